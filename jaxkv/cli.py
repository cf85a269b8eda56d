"""The `jaxkv` command: argument parsing and printing only.

  jaxkv generate --prompt TEXT [--model PATH|tiny] [--max-new-tokens N] [--temperature T] [--top-k K]
                 [--top-p P] [--min-p M] [--seed S] [--dtype D] [--max-len N] [--json]
  jaxkv bench [options]     (see jaxkv bench --help; the same as python scripts/bench.py)

Bad arguments and bad checkpoints print one line on stderr and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxkv", description="KV-cached decoding for decoder-only transformers in JAX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
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
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")
    return parser


class _TextStream:
    """Prints decoded text as tokens arrive. Decodes the whole list each time and prints the new suffix, so
    multi-byte characters split across tokens are printed once complete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, row, token):
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
            return
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text


def _generate(args) -> dict:
    import jaxkv

    model = jaxkv.load(args.model, dtype=args.dtype)
    if args.prompt is not None:
        if model.tokenizer is None:
            raise ValueError(f"model {args.model} has no tokenizer.json: pass --prompt-ids instead of --prompt")
        prompt = args.prompt
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    stream = None
    if not args.json and model.tokenizer is not None:
        stream = _TextStream(model.tokenizer)
        if args.prompt is not None:
            sys.stdout.write(args.prompt)
    elif not args.json:
        stream = lambda row, token: print(token, end=" ", flush=True)  # noqa: E731
    out = jaxkv.generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                         max_len=args.max_len, stream=stream)
    if isinstance(stream, _TextStream):  # bytes held back as an incomplete character at the very end
        sys.stdout.write(out.text[0][len(stream.printed):])
    s = out.stats
    return {
        "text": out.text[0] if out.text is not None else None,
        "tokens": out.tokens[0],
        "finish_reason": out.finish_reasons[0],
        "prompt_tokens": s["prompt_tokens"],
        "new_tokens": s["new_tokens"],
        "prefill_ms": round(1e3 * s["prefill_s"], 2),
        "decode_tokens_per_s": round(s["decode_tokens_per_s"], 2),
        "kv_cache_bytes": s["kv_cache_bytes"],
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own options (scripts/bench.py, same code)
        from jaxkv import bench

        return bench.main(argv[1:])
    try:
        args = _parser().parse_args(argv)
        result = _generate(args)
    except _UsageError as e:
        print(f"jaxkv: error: {e} (see jaxkv generate --help)", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(f"[prompt tokens {result['prompt_tokens']}, new tokens {result['new_tokens']}, "
              f"prefill {result['prefill_ms']:.1f} ms, decode {result['decode_tokens_per_s']:.1f} tokens/s, "
              f"KV cache {result['kv_cache_bytes']:,} bytes]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
