"""What each weight quantization costs in accuracy and gives in memory (and speed on this machine), on the bundled
model over held-out text.

    python scripts/weight_accuracy.py [--windows N] [--greedy-prompts P] [--new-tokens 256] [--repeats 3]
                                      [--json FILE]

For float32 weights and each quantization (`jaxkv.load("tiny", weights=...)`: int8, fp8, int4 in groups of 64 and
of 32, int8 with the embeddings and head quantized too): the perplexity of the held-out text (the full forward
pass over each window, teacher-forced), its change against float32, greedy agreement (P held-out 32-token prompts
generate --new-tokens tokens; the share of positions equal to float32's and the mean index of the first
difference), the weight bytes the planner counts (`jaxkv.memory.weight_bytes`: int4 at half a byte) and the bytes
XLA holds (`Generation.stats["weight_bytes"]`), and batch-1 decode tokens/s (median of --repeats calls, after a
warm-up call). Prints a markdown table (docs/design/quantization.md). Takes about 2 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys

import jax
import numpy as np

import jaxkv
from jaxkv.cache import planner

SCRIPTS = pathlib.Path(__file__).resolve().parent
MODES = {"float32": None, "int8": jaxkv.WeightQuant("int8"), "fp8": jaxkv.WeightQuant("fp8"),
         "int4 (g64)": jaxkv.WeightQuant("int4", group_size=64), "int4 (g32)": jaxkv.WeightQuant("int4", group_size=32),
         "int8 + embeddings": jaxkv.WeightQuant("int8", embeddings=True)}


def cache_accuracy():
    """scripts/cache_accuracy.py, loaded by path: the held-out windows and greedy prompts are the same."""
    spec = importlib.util.spec_from_file_location("cache_accuracy", SCRIPTS / "cache_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def perplexity(model, windows: np.ndarray) -> float:
    """exp(mean NLL) of each window's tokens after its first, from one no-cache forward pass per window batch."""
    nll = []
    for chunk in np.array_split(windows, max(1, len(windows) // 16)):
        logp = jax.nn.log_softmax(jaxkv.logits(model, chunk[:, :-1]), axis=-1)
        nll.append(-np.take_along_axis(np.asarray(logp), chunk[:, 1:, None], axis=-1)[..., 0])
    return float(np.exp(np.concatenate(nll).mean()))


def agreement(got, ref, new_tokens: int) -> dict:
    equal = [np.asarray(a) == np.asarray(b) for a, b in zip(got, ref)]
    first = [int(np.argmin(e)) if not e.all() else new_tokens for e in equal]
    return {"agreement": float(np.mean(np.concatenate(equal))), "first_difference": float(np.mean(first))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=None, help="held-out windows to score (default: all)")
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed batch-1 decode calls per mode")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    base = jaxkv.load("tiny")
    windows = cache_accuracy().heldout_windows(base, args.windows)
    prompts = [w[:32].tolist() for w in windows[: args.greedy_prompts]]
    rows, ref = {}, None
    for name, quant in MODES.items():
        print(f"[weight_accuracy] {name} ...", file=sys.stderr, flush=True)
        model = jaxkv.load("tiny", weights=quant)
        greedy = jaxkv.generate(model, prompts, max_new_tokens=args.new_tokens, stop_tokens=[], temperature=0)
        ref = greedy.tokens if ref is None else ref
        jaxkv.generate(model, [prompts[0]], max_new_tokens=args.new_tokens, stop_tokens=[], temperature=0)  # warm
        speeds = [jaxkv.generate(model, [prompts[0]], max_new_tokens=args.new_tokens, stop_tokens=[],
                                 temperature=0).stats["decode_tokens_per_s"] for _ in range(args.repeats)]
        rows[name] = {"perplexity": perplexity(model, windows), **agreement(greedy.tokens, ref, args.new_tokens),
                      "planner_bytes": planner.weight_bytes(model.config, weights=quant),
                      "held_bytes": greedy.stats["weight_bytes"],
                      "decode_tokens_per_s": statistics.median(speeds)}
    f32 = rows["float32"]
    print(f"bundled model ({base.config.param_count():,} parameters), {windows.shape[0]} held-out windows x "
          f"{windows.shape[1] - 1} tokens; greedy: {len(prompts)} held-out 32-token prompts x {args.new_tokens} new "
          f"tokens; decode: batch 1, {args.new_tokens} tokens, median of {args.repeats}; {jax.devices()[0].platform}\n")
    print("| weights | perplexity | vs float32 | greedy agreement | mean first difference | weight bytes (planner) "
          "| vs float32 | bytes held (XLA) | decode tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / f32['perplexity'] - 1):+.3f}% | "
              f"{100 * r['agreement']:.1f}% | {r['first_difference']:.0f} | {r['planner_bytes']:,} | "
              f"{r['planner_bytes'] / f32['planner_bytes']:.3f} | {r['held_bytes']:,} | "
              f"{r['decode_tokens_per_s']:.0f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "windows": list(windows.shape),
                                                       "new_tokens": args.new_tokens}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
