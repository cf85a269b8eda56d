"""Decode step time per batch size: `jaxkv.generate` on a random preset model, the same prompt in every row.

    python scripts/decode_steps.py [--config small] [--dtype float32] [--batches 1,4,8] [--prompt 128] [--new 64]
                                   [--reps 5]

Each batch size is warmed up once (compiles excluded), then run --reps times; the figure is the median of
stats["decode_s"] / stats["decode_steps"] (seconds per decode step, compile time excluded) and of the prefill.
This is the measurement behind docs/design/families.md's "Weight layout" table.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    import jaxkv
    from jaxkv.checkpoint import cast
    from jaxkv.config import PRESETS

    if args.config not in PRESETS:
        p.error(f"--config must be one of {sorted(PRESETS)}")
    model = cast(jaxkv.Model.random(PRESETS[args.config], seed=0), args.dtype)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, model.config.vocab_size, args.prompt)]
    for batch in (int(b) for b in args.batches.split(",")):
        run = lambda: jaxkv.generate(model, [prompt] * batch, max_new_tokens=args.new, stop_tokens=[])  # noqa: E731
        run()
        stats = [run().stats for _ in range(args.reps)]
        step = np.median([s["decode_s"] / s["decode_steps"] for s in stats]) * 1e3
        prefill = np.median([s["prefill_s"] for s in stats]) * 1e3
        print(f"{args.config} {args.dtype} batch {batch}: decode step {step:.2f} ms ({batch / step * 1e3:.1f} tok/s), "
              f"prefill {prefill:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
