"""The `jaxkv` command: argument parsing and printing only.

  jaxkv generate --prompt TEXT [--model PATH|tiny] [--max-new-tokens N] [--temperature T] [--top-k K]
                 [--top-p P] [--min-p M] [--seed S] [--dtype D] [--max-len N]
                 [--cache-dtype D] [--n N] [--logprobs K] [--json] [--no-compile-cache]
  jaxkv generate --prompt TEXT --num-beams K [--length-penalty F] [--early-stopping true|false|never]
                 [--num-return-sequences R] [--model PATH|tiny] [--max-new-tokens N] [--dtype D] [--max-len N]
                 [--cache-dtype D] [--json]
                 (beam search, jaxkv.beam_search: prints the best hypothesis at the end, or the R best; with
                 --json all R with their scores. Deterministic: no sampling flags, --n or --logprobs)
  jaxkv memory (--model PATH|tiny | --config config.json | --layers L --kv-heads K --head-dim H [--dtype D])
               [--window W] [--tokens N] [--batch B] [--cache-dtype D] [--hbm-gib G [--weights-gib W]]
               [--plot FILE.png] [--json]
  jaxkv bench [options]     (see jaxkv bench --help; the same as python scripts/bench.py)
  jaxkv bench sharing [options]   (parallel samples and prompt caching: jaxkv.bench.sharing)
  jaxkv bench engine [options]    (continuous batching against static batches: jaxkv.bench.engine)
  jaxkv bench beam [options]      (beam search: jaxkv.bench.beam)
  jaxkv bench mla [options]       (multi-head latent attention against its GQA twin: jaxkv.bench.mla)
  jaxkv bench layers [options]    (per-layer rings against full-length caches: jaxkv.bench.layers)
  jaxkv serve [options]     (an OpenAI-compatible HTTP server on the engine; see jaxkv serve --help;
                             needs pip install "jaxkv[serve]")
  jaxkv --version

Compiled programs are kept on disk between runs (`jaxkv.compile_cache`: ~/.cache/jaxkv/xla, JAXKV_COMPILE_CACHE
to move or disable it), so a second `jaxkv generate` starts warm; --no-compile-cache opts out for one run.

Every flag is parsed and checked (`jaxkv.checks`, which is JAX-free) before JAX is imported and before anything is
printed: `--help` and a bad flag answer in a fraction of a second, where importing JAX, Flax and Pallas takes
seconds. Bad arguments and bad checkpoints print one line on stderr and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from jaxkv import checks, memory
from jaxkv.config import DTYPES, Config

EXIT_USAGE = 2
# `jaxkv bench NAME ...` -> the module whose main() runs it (also scripts/bench_NAME.py)
BENCH_SCENARIOS = {"sharing": "jaxkv.bench.sharing", "engine": "jaxkv.bench.engine", "beam": "jaxkv.bench.beam",
                   "mla": "jaxkv.bench.mla", "layers": "jaxkv.bench.layers"}
EARLY_STOPPING = {"true": True, "false": False, "never": "never"}  # --early-stopping -> jaxkv.beam_search's value
VERSION = "0.1.0"  # what --version says when the package metadata is missing (running from a source tree)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("jaxkv")
    except metadata.PackageNotFoundError:
        return VERSION


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxkv", description="KV-cached decoding for decoder-only transformers in JAX.",
                     epilog="jaxkv COMMAND --help shows a command's options.")
    parser.add_argument("--version", action="version", version=f"jaxkv {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    gen = commands.add_parser("generate", help="generate text from a prompt")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a model with a tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--model", default="tiny", help="checkpoint directory (Hugging Face or jaxkv) or 'tiny'")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    gen.add_argument("--max-len", type=int, default=None, help="KV-cache capacity in tokens")
    gen.add_argument("--cache-dtype", choices=memory.CACHE_DTYPES, default=None,
                     help="KV-cache dtype (int8/fp8: quantized with a scale per token per KV head); default: the "
                          "model's dtype")
    gen.add_argument("--n", type=int, default=1,
                     help="samples of the prompt (default 1): it is prefilled once and the samples share its KV "
                          "pages; each is printed after the others finish")
    gen.add_argument("--logprobs", type=int, default=0, metavar="K",
                     help="with --json: each new token's log-probability (always) and its K most likely "
                          "alternatives per step (0 <= K <= 20)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")
    gen.add_argument("--no-compile-cache", action="store_true",
                     help="do not read or write the persistent compilation cache (jaxkv.compile_cache)")
    beam = gen.add_argument_group("beam search", "deterministic (no --temperature > 0, --top-k, --top-p, --min-p, "
                                  "--n or --logprobs); the options below need --num-beams > 1")
    beam.add_argument("--num-beams", type=int, default=1, metavar="K",
                      help="beam search with K beams (jaxkv.beam_search, transformers' scoring); printed at the "
                           "end, not streamed (default 1: no beam search)")
    # None: not given (each is refused without --num-beams > 1); the defaults are jaxkv.beam_search's.
    beam.add_argument("--length-penalty", type=float, default=None, metavar="F",
                      help="a hypothesis scores sum_logprobs / length**F; F > 0 favours longer ones (default 1.0)")
    beam.add_argument("--early-stopping", choices=list(EARLY_STOPPING), default=None,
                      help="true: stop once K hypotheses are finished; false: once no beam can beat them at the "
                           "current length; never: judged at the longest length a beam could reach (default false)")
    beam.add_argument("--num-return-sequences", type=int, default=None, metavar="R",
                      help="hypotheses returned, best first, 1 <= R <= K (default 1); printed one after the other, "
                           "with --json with their scores")

    mem = commands.add_parser("memory", help="KV-cache bytes of a model, and how many sequences fit in memory")
    source = mem.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH",
                        help="checkpoint directory (Hugging Face or jaxkv) or 'tiny'; only its config is read, never "
                             "the weights")
    source.add_argument("--config", metavar="FILE", help="a Hugging Face config.json (or a jaxkv_config.json) file")
    mem.add_argument("--layers", metavar="L", type=_positive_int, help="describe the model by hand: L layers ...")
    mem.add_argument("--kv-heads", metavar="K", type=_positive_int, help="... K key/value heads ...")
    mem.add_argument("--head-dim", metavar="H", type=_positive_int, help="... of H dims each")
    mem.add_argument("--dtype", choices=DTYPES, default=None,
                     help="model dtype (weights; the cache dtype the model uses by default); default: the config's, "
                          "float16 with --layers")
    mem.add_argument("--window", metavar="W", type=_positive_int, default=None,
                     help="sliding window W: the cache keeps at most W tokens (default: the config's, if any)")
    mem.add_argument("--tokens", metavar="N", type=_positive_int, default=2048,
                     help="tokens per sequence (default 2048)")
    mem.add_argument("--n", metavar="N", type=_positive_int, default=None,
                     help="samples per prompt: also print the bytes with prefix sharing (a paged cache: the "
                          "prompt's pages shared by its N samples) and without; --tokens is then the prompt")
    mem.add_argument("--new-tokens", metavar="T", type=_positive_int, default=None,
                     help="tokens each sample generates (with --n; default 0 new: the prompt alone)")
    mem.add_argument("--page-size", metavar="P", type=_positive_int, default=memory.DEFAULT_PAGE_SIZE,
                     help=f"slots per page of the paged cache (with --n; default {memory.DEFAULT_PAGE_SIZE})")
    mem.add_argument("--batch", metavar="B", type=_positive_int, default=1,
                     help="sequences cached together (default 1)")
    mem.add_argument("--cache-dtype", choices=memory.CACHE_DTYPES, default=None,
                     help="one cache dtype (default: a row for each)")
    mem.add_argument("--hbm-gib", metavar="G", type=_positive_float, default=None,
                     help="device memory in GiB: also print how many --tokens sequences fit beside the weights")
    mem.add_argument("--weights-gib", metavar="W", type=_non_negative_float, default=None,
                     help="weights' size in GiB (default: parameter count x dtype bytes; needed with --layers)")
    mem.add_argument("--plot", metavar="FILE.png", default=None, help="draw cache size versus tokens to FILE.png")
    mem.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    # Listed for --help only: main() hands `jaxkv bench ...` to jaxkv.bench.decode before this parser sees it.
    commands.add_parser("bench", add_help=False,
                        help="decode benchmarks against the memory roofline and transformers (see jaxkv bench --help)")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _float(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    # float("nan") and float("inf") parse; neither is a memory size.
    if not (value > 0 or (allow_zero and value == 0)) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _float(text, allow_zero=False)


def _non_negative_float(text: str) -> float:
    return _float(text, allow_zero=True)


class _Stream:
    """Prints the new tokens as they arrive: decoded text with a tokenizer, else the ids. The prompt (`prefix`) is
    printed with the first token, once generation has really started, so nothing reaches stdout before an error;
    the first token's time is kept for the figures line.

    Text is decoded from the whole list each time and the new suffix printed, so multi-byte characters split
    across tokens are printed once complete."""

    def __init__(self, tokenizer, prefix: str = ""):
        self.tokenizer, self.prefix = tokenizer, prefix
        self.ids, self.printed, self.first_token_at = [], "", None

    def __call__(self, row, token):
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            sys.stdout.write(self.prefix)
        self.ids.append(token)
        if self.tokenizer is None:
            sys.stdout.write(f"{token} ")
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
                return
            sys.stdout.write(text[len(self.printed):])
            self.printed = text
        sys.stdout.flush()

    def finish(self, text: str | None):
        """After generation: the prompt if no token was streamed, and any bytes held back as an incomplete
        character at the very end."""
        if self.first_token_at is None:
            sys.stdout.write(self.prefix)
        if self.tokenizer is not None and text is not None:
            sys.stdout.write(text[len(self.printed):])


def _check_generate(args):
    """Every `generate` flag checked without JAX (jaxkv.checks: the same checks as the API), before anything is
    printed or imported. Returns the prompt: the text, or the list of ids. Raises ValueError."""
    if args.prompt is not None:
        if not args.prompt:
            raise ValueError("--prompt is empty: give some text to continue")
        prompt = args.prompt
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        for token in prompt:
            checks.check_int("a prompt id", token, 0, checks.INT32_MAX)
    checks.check_int("max_new_tokens", args.max_new_tokens, 1)
    _check_beam_flags(args)
    checks.check_int("n", args.n, 1)
    checks.check_int("logprobs", args.logprobs, 0, 20)
    if args.max_len is not None:
        checks.check_int("max_len", args.max_len, 1)
    checks.sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    checks.seed_words(args.seed)
    if args.model != "tiny" and not pathlib.Path(args.model).exists():  # what jaxkv.load says, without JAX
        raise FileNotFoundError(f"{args.model}: no such directory (pass a checkpoint directory or 'tiny')")
    return prompt


def _check_beam_flags(args):
    """--num-beams and its options; beam search is deterministic and scores its hypotheses itself, so the
    sampling flags, --n and --logprobs are refused with it, and its options without it. Raises ValueError."""
    checks.check_int("num_beams", args.num_beams, 1)
    options = {"--length-penalty": args.length_penalty, "--early-stopping": args.early_stopping,
               "--num-return-sequences": args.num_return_sequences}
    if args.num_beams == 1:
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} is only used with --num-beams > 1 (beam search)")
        return
    # A bad temperature (negative, nan) is left to checks.sampling's message.
    sampling = {"--temperature": args.temperature if args.temperature > 0 else None, "--top-k": args.top_k,
                "--top-p": args.top_p, "--min-p": args.min_p}
    given = [flag for flag, value in sampling.items() if value is not None]
    if given:
        raise ValueError(f"{given[0]} samples; beam search (--num-beams {args.num_beams}) is deterministic: drop "
                         f"one of them")
    if args.n != 1:
        raise ValueError("--n is for sampling; beam search returns several hypotheses with --num-return-sequences")
    if args.logprobs != 0:
        raise ValueError("--logprobs is for sampling; beam search scores its hypotheses itself (see --json)")
    if args.length_penalty is not None:
        checks.check_float("length_penalty", args.length_penalty)
    if args.num_return_sequences is not None:
        checks.check_int("num_return_sequences", args.num_return_sequences, 1)
        if args.num_return_sequences > args.num_beams:
            raise ValueError(f"--num-return-sequences {args.num_return_sequences} exceeds --num-beams "
                             f"{args.num_beams}: beam search keeps that many hypotheses")


def _generate(args, started: float) -> dict:
    prompt = _check_generate(args)
    if args.no_compile_cache:
        import os

        from jaxkv import compile_cache

        os.environ[compile_cache.ENV] = "0"  # read when jaxkv.model is first imported, just below
    t0 = time.perf_counter()
    from jaxkv.checkpoint import load  # JAX, Flax and the Pallas kernels: seconds
    from jaxkv.generate import generate

    t1 = time.perf_counter()
    model = load(args.model, dtype=args.dtype)
    t2 = time.perf_counter()
    if args.prompt is not None and model.tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer.json: pass --prompt-ids instead of --prompt")
    timing = {"import_s": round(t1 - t0, 3), "load_s": round(t2 - t1, 3)}
    if args.num_beams > 1:
        return _beam_search(args, model, prompt, timing)
    # Several samples would interleave on a stream: they are printed whole, one after the other, at the end.
    stream = None if args.json or args.n > 1 else _Stream(model.tokenizer, args.prompt or "")
    out = generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                   max_len=args.max_len, cache_dtype=args.cache_dtype, stream=stream, n=args.n,
                   logprobs=args.logprobs)
    if stream is not None:
        stream.finish(out.text[0] if out.text is not None else None)
    elif args.n > 1 and not args.json:
        for j in range(args.n):
            body = out.text[j] if out.text is not None else _ids(out.tokens[j])
            print(f"--- sample {j + 1} of {args.n} ({out.finish_reasons[j]}) ---")
            print((args.prompt or "") + body)
    first_token = None if stream is None or stream.first_token_at is None else stream.first_token_at - started
    s = out.stats
    samples = {}
    if args.n > 1:
        samples = {"samples": [{"text": None if out.text is None else out.text[j], "tokens": out.tokens[j],
                                "finish_reason": out.finish_reasons[j], "logprobs": out.logprobs[j],
                                **_top(out, j)} for j in range(args.n)],
                   "pages_in_use_peak": s["pages_in_use_peak"], "kv_bytes_in_use_peak": s["kv_bytes_in_use_peak"],
                   "kv_cache_bytes_unshared": s["kv_cache_bytes_unshared"]}
    return {**samples,
        "text": out.text[0] if out.text is not None else None,
        "tokens": out.tokens[0],
        "logprobs": out.logprobs[0],
        **_top(out, 0),
        "finish_reason": out.finish_reasons[0],
        "prompt_tokens": s["prompt_tokens"],
        "new_tokens": s["new_tokens"],
        "prefill_ms": round(1e3 * s["prefill_s"], 2),
        "decode_tokens_per_s": round(s["decode_tokens_per_s"], 2),
        "kv_cache_bytes": s["kv_cache_bytes"],
        "cache_dtype": s["cache_dtype"],
        # Where the wait for the first token goes: importing JAX, reading the checkpoint, compiling (prefill_ms
        # and decode_tokens_per_s exclude compile time).
        **timing,
        "compile_s": round(s["compile_s"], 3),
        "first_token_s": None if first_token is None else round(first_token, 3),
    }


def _ids(tokens: list[int]) -> str:
    """New tokens of a model without a tokenizer, as printed: the ids."""
    return " ".join(map(str, tokens))


def _beam_search(args, model, prompt, timing: dict) -> dict:
    """--num-beams K > 1: jaxkv.beam_search, printed at the end (a search cannot stream: the best hypothesis is
    known only once it ends). Plain: the best hypothesis after the prompt, or with --num-return-sequences R > 1
    each of the R, best first, as --n prints its samples."""
    from jaxkv.beam_search import beam_search

    returned = args.num_return_sequences or 1
    out = beam_search(model, [prompt], num_beams=args.num_beams, max_new_tokens=args.max_new_tokens,
                      length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                      early_stopping=EARLY_STOPPING[args.early_stopping or "false"],
                      num_return_sequences=returned, max_len=args.max_len, cache_dtype=args.cache_dtype)
    hypotheses = [{"tokens": h.tokens, "text": h.text, "score": h.score, "logprob": h.logprob,
                   "finish_reason": h.finish_reason} for h in out[0]]
    if not args.json:
        for j, h in enumerate(hypotheses):
            body = (args.prompt or "") + (h["text"] if h["text"] is not None else _ids(h["tokens"]))
            if returned == 1:
                sys.stdout.write(body)  # main ends the line, as after streamed text
            else:
                print(f"--- hypothesis {j + 1} of {returned} (score {h['score']:.4f}, {h['finish_reason']}) ---")
                print(body)
    best = hypotheses[0]
    return {"prompt": prompt, "text": best["text"], "tokens": best["tokens"], "finish_reason": best["finish_reason"],
            "hypotheses": hypotheses, "stats": out.stats, **timing}


def _top(out, row: int) -> dict:
    """{"top_logprobs": per token, [[id, log-probability], ...] best first} when --logprobs K > 0, else {}."""
    if out.top_logprobs is None:
        return {}
    return {"top_logprobs": [[[t, lp] for t, lp in step] for step in out.top_logprobs[row]]}


def _wait(r: dict, compile_s: float, prefill_ms: float) -> str:
    return f"import {r['import_s']:.1f} s, load {r['load_s']:.1f} s, compile {compile_s:.1f} s, " \
        f"prefill {prefill_ms:.1f} ms"


def _figures(r: dict) -> str:
    if "hypotheses" in r:
        return _beam_figures(r)
    wait = (f"first token {r['first_token_s']:.1f} s after start: " if r["first_token_s"] is not None else "") + \
        _wait(r, r["compile_s"], r["prefill_ms"])
    kv = f"KV cache {r['kv_cache_bytes']:,} bytes"
    if "samples" in r:
        kv += (f" ({r['kv_bytes_in_use_peak']:,} in use at the peak, shared by {len(r['samples'])} samples; "
               f"{r['kv_cache_bytes_unshared']:,} without sharing)")
    return (f"[prompt tokens {r['prompt_tokens']}, new tokens {r['new_tokens']}; {wait}; "
            f"decode {r['decode_tokens_per_s']:.1f} tokens/s; {kv}]")


def _beam_figures(r: dict) -> str:
    s, best = r["stats"], r["hypotheses"][0]
    wait = _wait(r, s["compile_s"], 1e3 * s["prefill_s"])
    return (f"[prompt tokens {s['prompt_tokens']}, new tokens {len(best['tokens'])} (the best of {s['num_beams']} "
            f"beams, score {best['score']:.4f}); {wait}, search {1e3 * s['search_s']:.1f} ms ({s['steps']} steps); "
            f"KV cache {s['kv_cache_bytes']:,} bytes ({s['kv_bytes_in_use_peak']:,} in use at the peak, shared by "
            f"{s['num_beams']} beams; {s['kv_cache_bytes_unshared']:,} without sharing)]")


# --- jaxkv memory -----------------------------------------------------------------------------------------------


def _read_config_file(path: pathlib.Path) -> Config:
    """A jaxkv_config.json (it has a format_version) or a Hugging Face config.json, without touching weights."""
    from jaxkv.checkpoint import config_from_dict
    from jaxkv.checkpoint_hf import config_from_hf

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory (pass it with --model)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if isinstance(data, dict) and "format_version" in data:
        return config_from_dict(data, source=str(path))
    config = config_from_hf(data, source=str(path))
    # config_from_hf says float32 because load_hf takes the dtype from the weights; without reading them, the
    # dtype the checkpoint declares ("torch_dtype", or "dtype" in newer transformers) is the best estimate.
    declared = next((data[f] for f in ("torch_dtype", "dtype") if data.get(f) in DTYPES), None)
    return config if declared is None else config.replace(dtype=declared)


def _model_config(model: str) -> Config:
    from jaxkv.checkpoint import CONFIG_FILE, TINY_DIR
    from jaxkv.checkpoint_hf import CONFIG_FILE as HF_CONFIG_FILE

    directory = TINY_DIR if model == "tiny" else pathlib.Path(model)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such directory (pass a checkpoint directory or 'tiny')")
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (pass a config.json file with --config)")
    for name in (CONFIG_FILE, HF_CONFIG_FILE):
        if (directory / name).is_file():
            return _read_config_file(directory / name)
    raise FileNotFoundError(f"{directory}: has neither {CONFIG_FILE} (jaxkv) nor {HF_CONFIG_FILE} (Hugging Face)")


def _memory_model(args) -> Config | memory.CacheGeometry:
    """The model to plan for, from --model, --config, or the shape flags, with --dtype and --window applied."""
    shape_flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    given = [flag for flag, value in shape_flags.items() if value is not None]
    if args.model is not None or args.config is not None:
        if given:
            raise ValueError(f"{given[0]} describes a model by hand; it cannot be combined with --model or --config")
        config = _model_config(args.model) if args.model is not None else _read_config_file(pathlib.Path(args.config))
        changes = {"dtype": args.dtype, "sliding_window": args.window}
        return config.replace(**{k: v for k, v in changes.items() if v is not None})
    if not given:
        raise ValueError("no model: pass --model PATH|tiny, --config config.json, or --layers, --kv-heads and "
                         "--head-dim")
    missing = [flag for flag, value in shape_flags.items() if value is None]
    if missing:
        raise ValueError(f"a model described by hand needs --layers, --kv-heads and --head-dim; missing "
                         f"{', '.join(missing)}")
    return memory.CacheGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype or "float16", args.window)


def _memory(args) -> dict:
    model = _memory_model(args)
    geometry = memory.CacheGeometry.of(model)
    if args.weights_gib is not None and args.hbm_gib is None:
        raise ValueError("--weights-gib is only used with --hbm-gib")
    hbm = weights = None
    if args.hbm_gib is not None:
        if args.weights_gib is not None:
            weights = int(args.weights_gib * memory.GIB)
        elif isinstance(model, Config):
            weights = memory.weight_bytes(model)
        else:
            raise ValueError("--hbm-gib with --layers/--kv-heads/--head-dim also needs --weights-gib (there is no "
                             "config to count parameters from)")
        hbm = int(args.hbm_gib * memory.GIB)  # exact: a float times a power of two
    if args.new_tokens is not None and args.n is None:
        raise ValueError("--new-tokens is only used with --n")
    rows = []
    for cache_dtype in [args.cache_dtype] if args.cache_dtype else memory.CACHE_DTYPES:
        total = memory.kv_cache_bytes(geometry, tokens=args.tokens, batch=args.batch, cache_dtype=cache_dtype)
        rows.append({
            "cache_dtype": cache_dtype,
            "bytes_per_token": memory.kv_bytes_per_token(geometry, cache_dtype),
            "bytes_per_sequence": memory.kv_cache_bytes(geometry, tokens=args.tokens, cache_dtype=cache_dtype),
            "total_bytes": total,
            "total_gib": total / memory.GIB,
            "allocated_bytes": memory.allocated_bytes(geometry, tokens=args.tokens, batch=args.batch,
                                                      cache_dtype=cache_dtype),
            "sequences_fit": None if hbm is None else memory.sequences_that_fit(
                geometry, tokens=args.tokens, memory_bytes=hbm, weights_bytes=weights, cache_dtype=cache_dtype),
        })
        if isinstance(model, Config) and model.mla is not None:
            # What the latent cache saves: full per-head keys and values for the same tokens.
            per_token = memory.expanded_kv_bytes_per_token(model, cache_dtype)
            rows[-1]["per_head_kv_bytes_per_token"] = per_token
            rows[-1]["per_head_kv_total_bytes"] = per_token * args.batch * memory.cache_slots(geometry, args.tokens)
        if geometry.layer_windows is not None:
            # Per-layer rings (local layers) against a cache that keeps every token on every layer.
            rows[-1]["full_length_bytes"] = memory.full_length_cache_bytes(
                geometry, tokens=args.tokens, batch=args.batch, cache_dtype=cache_dtype)
        if args.n is not None:
            new = args.new_tokens or 1  # 1: the first new token is sampled from the prompt's logits, never stored
            rows[-1]["shared_bytes"] = memory.shared_cache_bytes(
                geometry, prompt_tokens=args.tokens, new_tokens=new, n=args.n, page_size=args.page_size,
                batch=args.batch, cache_dtype=cache_dtype)
            rows[-1]["unshared_bytes"] = memory.kv_cache_bytes(
                geometry, tokens=args.tokens + (args.new_tokens or 0), batch=args.batch * args.n,
                cache_dtype=cache_dtype)
    result = {
        "model": args.model or args.config,  # None: described by hand
        "n_layers": geometry.n_layers, "n_kv_heads": geometry.n_kv_heads, "head_dim": geometry.head_dim,
        "mla": None if not isinstance(model, Config) or model.mla is None else {
            "kv_lora_rank": model.mla.kv_lora_rank, "qk_rope_head_dim": model.mla.qk_rope_head_dim,
            "n_heads": model.n_heads, "qk_head_dim": model.mla.qk_head_dim, "v_head_dim": model.mla.v_head_dim},
        "dtype": geometry.dtype, "sliding_window": geometry.sliding_window,
        "local_layers": None if geometry.layer_windows is None else sum(w is not None for w in geometry.layer_windows),
        "param_count": model.param_count() if isinstance(model, Config) else None,
        "tokens": args.tokens, "batch": args.batch, "slots": memory.cache_slots(geometry, args.tokens),
        "padded_batch": memory._next_pow2(args.batch),
        "n": args.n, "new_tokens": args.new_tokens, "page_size": args.page_size if args.n is not None else None,
        "hbm_bytes": hbm, "weights_bytes": weights, "weights_fit": None if hbm is None else weights <= hbm,
        "rows": rows,
    }
    if args.plot is not None:
        _plot_memory(geometry, [row["cache_dtype"] for row in rows], result, args.plot)
        result["plot"] = args.plot
    return result


def _plot_memory(geometry: memory.CacheGeometry, cache_dtypes: list[str], result: dict, path: str):
    try:
        from matplotlib.figure import Figure  # not pyplot: no global backend or figure state is touched
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
    tokens, batch = result["tokens"], result["batch"]
    xs = sorted({round(tokens ** (i / 199)) for i in range(200)} | {tokens})  # 1..tokens, log-spaced
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    # Dtypes of equal size (bfloat16 and float16; int8 and fp8) draw the same curve: one line, both names.
    same_size: dict[int, list[str]] = {}
    for cache_dtype in cache_dtypes:
        same_size.setdefault(memory.kv_bytes_per_token(geometry, cache_dtype), []).append(cache_dtype)
    for names in same_size.values():
        gib = [memory.kv_cache_bytes(geometry, tokens=t, batch=batch, cache_dtype=names[0]) / memory.GIB for t in xs]
        ax.plot(xs, gib, label=", ".join(names))
    if result["hbm_bytes"] is not None and result["weights_fit"]:
        free = (result["hbm_bytes"] - result["weights_bytes"]) / memory.GIB
        if free > 0:
            ax.axhline(free, color="black", linestyle="--", linewidth=1, label="memory left after weights")
    # Log-log: the dtypes' fixed byte ratios become constant vertical gaps, and a sliding window a flat tail.
    ax.set_xscale("log")
    ax.set_yscale("log")
    window = f", window {geometry.sliding_window}" if geometry.sliding_window else ""
    ax.set(xlabel="tokens per sequence", ylabel=f"KV cache, batch {batch} (GiB)",
           title=f"{geometry.n_layers} layers x {geometry.n_kv_heads} KV heads x {geometry.head_dim} dims{window}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="cache dtype", loc="lower right")
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:  # a missing directory, an extension matplotlib has no writer for
        raise ValueError(f"--plot {path}: {e}") from None


def _gib(n: int) -> str:
    return f"{n / memory.GIB:,.2f} GiB"


def _print_memory(result: dict):
    window = f", sliding window {result['sliding_window']:,}" if result["sliding_window"] else ""
    local = result["local_layers"]
    if local is not None:
        window = (f" ({local} local layers with a sliding window of {result['sliding_window']:,}, "
                  f"{result['n_layers'] - local} global)") if local else " (every layer global)"
    params = f", {result['param_count']:,} parameters" if result["param_count"] is not None else ""
    name = f"{result['model']}: " if result["model"] is not None else ""
    mla = result["mla"]
    if mla is None:
        print(f"{name}{result['n_layers']} layers x {result['n_kv_heads']} KV heads x "
              f"{result['head_dim']} head dim{window}, {result['dtype']}{params}")
    else:
        print(f"{name}{result['n_layers']} layers, multi-head latent attention: one cached row per token and layer of "
              f"latent {mla['kv_lora_rank']} + rotary key {mla['qk_rope_head_dim']} = {result['head_dim']} values "
              f"(keys only){window}, {result['dtype']}{params}")
        print(f"per-head K/V: what {mla['n_heads']} heads' full keys ({mla['qk_head_dim']}) and values "
              f"({mla['v_head_dim']}) would take instead")
    if local:
        print(f"{result['tokens']:,} tokens x batch {result['batch']:,} (per sequence: {result['tokens']:,} cache "
              f"slots on each global layer, {min(result['tokens'], result['sliding_window']):,} in each local "
              f"layer's ring; 'all layers full length': every layer keeping every token)")
    else:
        print(f"{result['tokens']:,} tokens x batch {result['batch']:,} ({result['slots']:,} cache slots per "
              f"sequence)")
    hbm = result["hbm_bytes"]
    if hbm is not None:
        weights = result["weights_bytes"]
        if result["weights_fit"]:
            free = hbm - weights
            print(f"memory {_gib(hbm)} - weights {_gib(weights)} = {_gib(free)} for the cache "
                  f"({hbm:,} - {weights:,} = {free:,} bytes)")
        else:
            print(f"the weights alone ({weights:,} bytes, {_gib(weights)}) do not fit in the memory ({hbm:,} bytes, "
                  f"{_gib(hbm)}): no sequence fits")
    print(f"total: the cache for exactly these sequences; allocated: what jaxkv.generate allocates for them with "
          f"max_len={result['tokens']:,} (batch padded to {result['padded_batch']:,} rows; without max_len the "
          f"capacity is padded to a power of two too: jaxkv.plan_cache)")
    headers = ["cache dtype", "bytes/token", "bytes/sequence", "total bytes", "total GiB", "allocated bytes"]
    if result["n"] is not None:
        print(f"{result['n']} samples of {result['new_tokens'] or 0:,} new tokens per prompt of {result['tokens']:,}: "
              f"with sharing, the prompt's full pages ({result['page_size']} slots each) are held once and each "
              f"sample holds its own last prompt page and new tokens; without, each sample a private cache")
        headers += ["with sharing", "without sharing"]
    if mla is not None:
        headers += ["per-head K/V bytes/token", "per-head K/V total bytes"]
    if local is not None:
        headers.append("all layers full length")
    if hbm is not None:
        headers.append("sequences that fit")
    table = [headers]
    for row in result["rows"]:
        cells = [row["cache_dtype"], f"{row['bytes_per_token']:,}", f"{row['bytes_per_sequence']:,}",
                 f"{row['total_bytes']:,}", f"{row['total_gib']:,.4f}", f"{row['allocated_bytes']:,}"]
        if "shared_bytes" in row:
            cells += [f"{row['shared_bytes']:,}", f"{row['unshared_bytes']:,}"]
        if mla is not None:
            cells += [f"{row['per_head_kv_bytes_per_token']:,}", f"{row['per_head_kv_total_bytes']:,}"]
        if local is not None:
            cells.append(f"{row['full_length_bytes']:,}")
        if hbm is not None:
            cells.append(f"{row['sequences_fit']:,}")
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    print()
    for line in table:  # the dtype column left-aligned, numbers right-aligned
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    if "plot" in result:
        print(f"\nplot written to {result['plot']}")


def main(argv=None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the server has its own options (jaxkv/server/main.py)
        from jaxkv.server.main import main as serve

        return serve(argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_SCENARIOS:  # each has its own options
        import importlib

        return importlib.import_module(BENCH_SCENARIOS[argv[1]]).main(argv[2:])
    if argv[:1] == ["bench"]:  # the benchmark has its own options (scripts/bench.py, same code)
        from jaxkv.bench import decode

        return decode.main(argv[1:])
    try:
        args = _parser().parse_args(argv)
        result = _memory(args) if args.command == "memory" else _generate(args, started)
    except _UsageError as e:
        command = "memory" if argv[:1] == ["memory"] else "generate"
        print(f"jaxkv: error: {e} (see jaxkv {command} --help)", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result))
    elif args.command == "memory":
        _print_memory(result)
    else:
        print()
        print(_figures(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
