"""`jaxkv generate`: a prompt continued by sampling (`jaxkv.generate`, streamed as it comes) or by beam search
(`jaxkv.beam_search`, printed at the end), then one line of figures (the wait before the first token, the decode
speed, the KV-cache bytes), or one JSON object with --json.

Every flag is checked here without JAX (`jaxkv.checks`: the API's own checks) before the checkpoint is read or
anything is printed; JAX, Flax and the kernels are imported only once the flags are known good.
"""

from __future__ import annotations

import pathlib
import sys
import time

from jaxkv import checks
from jaxkv.checks import add_weight_flags, check_weight_flags, weights_of
from jaxkv.io import generation as generation_config
from jaxkv.cache import planner as memory

EARLY_STOPPING = {"true": True, "false": False, "never": "never"}  # --early-stopping -> jaxkv.beam_search's value


def add_parser(commands):
    """The `generate` subcommand and its flags, on the top-level parser's subparsers."""
    gen = commands.add_parser("generate", help="generate text from a prompt")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a model with a tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--model", default="tiny", help="checkpoint directory (Hugging Face or jaxkv) or 'tiny'")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None,
                     help="0 is greedy (default: the checkpoint's generation_config.json, else 0)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--generation-config", choices=generation_config.MODES, default="auto",
                     help="auto: sampling flags not given default to the checkpoint's generation_config.json "
                          "(transformers' meaning: do_sample false is greedy); ignore: greedy unless flags say "
                          "otherwise")
    pen = gen.add_argument_group("penalties", "change the logits before temperature and the filters, as "
                                 "jaxkv.generate's arguments of the same names")
    pen.add_argument("--repetition-penalty", type=float, default=None, metavar="P",
                     help="transformers': a token of the prompt or the output has its logit divided by P where "
                          "positive, multiplied by P otherwise (P > 0; 1.0 is off)")
    pen.add_argument("--presence-penalty", type=float, default=None, metavar="R",
                     help="OpenAI's: R subtracted from the logit of every token already generated ([-2, 2])")
    pen.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                     help="OpenAI's: F times its count subtracted from the logit of every token generated ([-2, 2])")
    pen.add_argument("--logit-bias", default=None, metavar="ID:BIAS,...",
                     help="biases added to those tokens' logits, e.g. 50256:-100,13:2.5 (at most 300)")
    pen.add_argument("--min-tokens", type=int, default=None, metavar="N",
                     help="no stop token (eos included) before N new tokens")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    add_weight_flags(gen)
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
    spec = gen.add_argument_group("speculative decoding", "a proposer guesses tokens, one forward pass verifies "
                                  "them; the output is what plain decoding gives (jaxkv.Speculation)")
    spec.add_argument("--speculative-method", choices=["ngram", "draft", "mtp"], default=None,
                      help="ngram: prompt lookup (the sequence's own earlier text proposes); draft: --draft-model; "
                           "mtp: the checkpoint's multi-token-prediction layers (DeepSeek-V3)")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                      help="proposals per verify pass (default 4)")
    spec.add_argument("--draft-model", default=None, metavar="PATH",
                      help="the draft model for --speculative-method draft (a checkpoint directory or 'tiny')")
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


def _logit_bias(text: str | None) -> dict | None:
    """--logit-bias ID:BIAS,... -> {id: bias} (checked as the API checks it, the vocabulary later), or ValueError."""
    if text is None:
        return None
    bias = {}
    for item in text.split(","):
        token, sep, value = item.partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID:BIAS pairs separated by commas, got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias takes ID:BIAS pairs separated by commas, got {item!r}")
    checks.logit_bias(bias, None)
    return bias


def _penalties(args) -> dict:
    """The penalty flags as `jaxkv.generate` arguments (checked without JAX; ValueError)."""
    out = dict(repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
               frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias(args.logit_bias),
               min_tokens=args.min_tokens)
    if out["repetition_penalty"] is not None:
        checks.repetition_penalty(out["repetition_penalty"])
    for name in ("presence_penalty", "frequency_penalty"):
        if out[name] is not None:
            checks.openai_penalty(name, out[name])
    if out["min_tokens"] is not None:
        checks.check_int("min_tokens", out["min_tokens"], 0, args.max_new_tokens)
    return out


def _check_generate(args):
    """Every `generate` flag checked without JAX (jaxkv.checks: the same checks as the API), before anything is
    printed or imported. Returns the prompt: the text, or the list of ids. Raises ValueError."""
    check_weight_flags(args)
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
    # with auto and no --temperature the checkpoint's decides; a filter on a greedy checkpoint is generate's error
    implied = 1.0 if args.generation_config == "auto" else 0.0
    checks.sampling(implied if args.temperature is None else args.temperature, args.top_k, args.top_p, args.min_p)
    penalties = [flag for flag, name in (("--repetition-penalty", "repetition_penalty"),
                                         ("--presence-penalty", "presence_penalty"),
                                         ("--frequency-penalty", "frequency_penalty"), ("--logit-bias", "logit_bias"),
                                         ("--min-tokens", "min_tokens")) if getattr(args, name) is not None]
    if penalties and args.num_beams > 1:
        raise ValueError(f"{penalties[0]} is for sampling and greedy decoding, not beam search (--num-beams)")
    _penalties(args)
    checks.seed_words(args.seed)
    checks.check_int("num_speculative_tokens", args.num_speculative_tokens, 1, 16)
    if args.speculative_method is not None and args.num_beams > 1:
        raise ValueError("--speculative-method is for sampling and greedy decoding, not beam search (--num-beams)")
    if (args.speculative_method == "draft") != (args.draft_model is not None):
        raise ValueError("--draft-model goes with --speculative-method draft, and it needs one")
    if args.draft_model not in (None, "tiny") and not pathlib.Path(args.draft_model).exists():
        raise FileNotFoundError(f"{args.draft_model}: no such directory (--draft-model: a checkpoint directory "
                                f"or 'tiny')")
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
    sampling = {"--temperature": args.temperature if (args.temperature or 0) > 0 else None, "--top-k": args.top_k,
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


def run(args, started: float) -> dict:
    """Checks the flags, loads the model, generates (streaming to stdout unless --json or --n > 1) -> the result
    (what --json prints). `started`: when the command started, for the first token's wait."""
    prompt = _check_generate(args)
    if args.no_compile_cache:
        import os

        from jaxkv import compile_cache

        os.environ[compile_cache.ENV] = "0"  # read when jaxkv.model is first imported, just below
    t0 = time.perf_counter()
    from jaxkv.checkpoint import load  # JAX, Flax and the Pallas kernels: seconds
    from jaxkv.generate import Speculation, generate

    t1 = time.perf_counter()
    model = load(args.model, dtype=args.dtype, weights=weights_of(args))
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
                   logprobs=args.logprobs, **_penalties(args),
                   sampling="checkpoint" if args.generation_config == "auto" else None,
                   speculative=None if args.speculative_method is None
                   else Speculation(args.speculative_method, args.num_speculative_tokens,
                                    draft=None if args.draft_model is None else load(args.draft_model,
                                                                                     dtype=args.dtype)))
    if stream is not None:
        stream.finish(out.text[0] if out.text is not None else None)
    elif args.n > 1 and not args.json:
        for j in range(args.n):
            body = out.text[j] if out.text is not None else _ids(out.tokens[j])
            print(f"--- sample {j + 1} of {args.n} ({out.finish_reasons[j]}) ---")
            print((args.prompt or "") + body)
    first_token = None if stream is None or stream.first_token_at is None else stream.first_token_at - started
    return _result(args, out, timing, first_token)


def _result(args, out, timing: dict, first_token: float | None) -> dict:
    """What --json prints for sampling: the first sample's text, tokens, log-probabilities and figures, and with
    --n > 1 every sample."""
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
        "weights": s["weights"],  # --weights (None: float)
        "weight_bytes": s["weight_bytes"],  # the parameter arrays as held
        # Where the wait for the first token goes: importing JAX, reading the checkpoint, compiling (prefill_ms
        # and decode_tokens_per_s exclude compile time).
        **timing,
        "compile_s": round(s["compile_s"], 3),
        "first_token_s": None if first_token is None else round(first_token, 3),
        **{name: round(s[name], 3) if isinstance(s[name], float) else s[name] for name in SPEC_STATS if name in s},
    }


# Generation.stats of a speculative call, passed through to --json and the figures line.
SPEC_STATS = ("spec_proposed", "spec_accepted", "spec_acceptance_rate", "spec_verifies", "target_forwards",
              "tokens_per_target_forward")


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
                sys.stdout.write(body)  # show() ends the line, as after streamed text
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
    spec = ""
    if "spec_proposed" in r:
        spec = (f"; speculative: {r['spec_accepted']} of {r['spec_proposed']} proposals accepted "
                f"({100 * r['spec_acceptance_rate']:.0f}%), {r['target_forwards']} target forwards "
                f"({r['spec_verifies']} verifies), {r['tokens_per_target_forward']:.2f} tokens per forward")
    weights = f"; {r['weights']} weights {r['weight_bytes']:,} bytes" if r.get("weights") else ""
    return (f"[prompt tokens {r['prompt_tokens']}, new tokens {r['new_tokens']}; {wait}; "
            f"decode {r['decode_tokens_per_s']:.1f} tokens/s; {kv}{weights}{spec}]")


def _beam_figures(r: dict) -> str:
    s, best = r["stats"], r["hypotheses"][0]
    wait = _wait(r, s["compile_s"], 1e3 * s["prefill_s"])
    return (f"[prompt tokens {s['prompt_tokens']}, new tokens {len(best['tokens'])} (the best of {s['num_beams']} "
            f"beams, score {best['score']:.4f}); {wait}, search {1e3 * s['search_s']:.1f} ms ({s['steps']} steps); "
            f"KV cache {s['kv_cache_bytes']:,} bytes ({s['kv_bytes_in_use_peak']:,} in use at the peak, shared by "
            f"{s['num_beams']} beams; {s['kv_cache_bytes_unshared']:,} without sharing)]")


def show(result: dict):
    """The figures line after the streamed (or printed) text, on a line of its own."""
    print()
    print(_figures(result))
