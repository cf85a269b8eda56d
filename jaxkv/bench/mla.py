"""The multi-head latent attention benchmark: an MLA model against its grouped-query twin of the same size.

    jaxkv bench mla [--contexts 1024,4096] [--batch 1] [--steps 32] [--reps 5] [--quick] [--out F]
    python scripts/bench_mla.py ...            (the same)

Two models with random weights (seed 0), float32, built from the "small" preset (8 layers, d_model 512, 8 query
heads, vocabulary 32,000; max positions raised to 16,384, which costs nothing with rotary positions):

  gqa   the preset: 4 KV heads of 64 dims, so 2 x 4 x 64 = 512 cached values per token and layer;
  mla   the same model with multi-head latent attention: latent R = 96, shared rotary key E = 32 (one cached row of
        128 values per token and layer), per-head no-position query/key width 64 and value width 64, no query
        LoRA, and the FFN width chosen so that the parameter count is the twin's to within 0.1%.

For each context C in --contexts: the bytes per token (planner) and the bytes a cache of C + steps slots
allocates (summed over the cache's arrays), and the decode step time with C tokens already cached (the compiled
decode loop on a cache of that length, `jaxkv.generate.decode`, XLA attention; --steps steps per call, median of
--reps calls, the two models alternating). Targets (issue 17): the MLA cache at least 4x smaller per token, and
MLA decode not slower than the twin at 4,096 tokens of context.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time

TARGETS = {"bytes_ratio": 4.0, "speed_ratio_at_longest": 1.0}
QUICK = {"contexts": "64,128", "steps": 4, "reps": 1}


def context_parser(argv, *, prog: str, description: str, contexts: str, quick: dict, steps: int = 32,
                   add_options=None):
    """(parser, args) for a benchmark over cached contexts (`jaxkv bench mla`, `layers`, `sparse`): --contexts
    (comma-separated, default `contexts`), --batch, --steps (default `steps`), --reps, --out and --quick (as if
    given `quick`; explicit options win), each checked; `add_options(parser)` adds a benchmark's own options
    first; `parser.error` is the caller's for further checks."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--contexts", default=contexts, help=f"comma-separated cached tokens (default {contexts})")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=steps, help=f"decode steps per timed call (default {steps})")
    p.add_argument("--reps", type=int, default=5, help="timed calls per variant and context (default 5)")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    p.add_argument("--layers", type=int, default=None, help="layers of each model (default: the benchmark's own; "
                   "fewer only for a smoke test of the benchmark itself, e.g. in the test suite)")
    if add_options is not None:
        add_options(p)
    as_if = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items())
    p.add_argument("--quick", action="store_true", help=f"a small run, as if given {as_if} (explicit options win)")
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--quick", action="store_true")
    if first.parse_known_args(argv)[0].quick:
        p.set_defaults(**quick)
    args = p.parse_args(argv)
    try:
        args.contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    for name, value in (("--batch", args.batch), ("--steps", args.steps), ("--reps", args.reps),
                        ("--contexts", min(args.contexts)), ("--layers", 1 if args.layers is None else args.layers)):
        if value < 1:
            p.error(f"{name} must be positive, got {value}")
    return p, args


def parse_args(argv=None):
    return context_parser(argv, prog="jaxkv bench mla", description=__doc__.split("\n\n")[0],
                          contexts="1024,4096", quick=QUICK)[1]


def twins(layers: int | None = None):
    """(gqa, mla) configs with the same parameter count (to 0.1%); `layers`: fewer than the preset's (--layers, a
    smoke test's size)."""
    from jaxkv.config import Mla
    from jaxkv.config import PRESETS

    # rotary positions: room for long contexts, no table
    gqa = PRESETS["small"].replace(max_positions=16384, n_layers=layers or PRESETS["small"].n_layers)
    mla = Mla(kv_lora_rank=96, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    base = dataclasses.replace(gqa, n_kv_heads=None, head_dim=None, mla=mla)
    # The FFN width that brings the MLA model's parameter count closest to the twin's.
    ffn = min(range(gqa.ffn_dim - 256, gqa.ffn_dim + 256),
              key=lambda f: abs(base.replace(ffn_dim=f).param_count() - gqa.param_count()))
    return gqa, base.replace(ffn_dim=ffn)


def allocated_bytes(config, batch: int, slots: int) -> int:
    """Bytes of every array of a cache of `slots` slots, as allocated (not as planned)."""
    from jaxkv.cache.contiguous import KVCache

    cache = KVCache.allocate(config, batch, slots)
    return sum(x.nbytes for x in (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales))


def step_seconds(model, batch: int, live: int, capacity: int, steps: int, ring: bool = False) -> float:
    """Seconds per decode step of one call of the compiled decode loop with `live` tokens cached (`ring`: the
    cache's sliding-window layers are rings, `jaxkv.cache.layer_slots`)."""
    import jax

    from jaxkv.bench.decode import decode_inputs
    from jaxkv.generate import decode

    inputs = decode_inputs(model.config, batch, live, capacity, ring=ring)
    t0 = time.perf_counter()
    jax.block_until_ready(decode(model.params, *inputs, config=model.config, steps=steps, attention="xla"))
    return (time.perf_counter() - t0) / steps


def alternating_medians(variants: dict, reps: int) -> dict:
    """{name: a call returning seconds} -> {name: the median of `reps` calls}, after one warm-up (compiling) call
    each; the variants alternate, so drift in the machine's speed hits them alike (`jaxkv bench mla`, `layers`,
    `hybrid`)."""
    for call in variants.values():
        call()
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, call in variants.items():
            times[name].append(call())
    return {name: statistics.median(t) for name, t in times.items()}


def bench_main(argv, parse_args, run, report) -> int:
    """A context benchmark's `main`: parse, run, print the report, and with --out write the figures as JSON."""
    args = parse_args(argv)
    result = run(args)
    report(result)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


def run(args) -> dict:
    import jax

    import jaxkv
    from jaxkv.cache import planner as memory

    gqa, mla = twins(args.layers)
    models = {"gqa": jaxkv.Model.random(gqa, seed=0), "mla": jaxkv.Model.random(mla, seed=0)}
    result = {"jax": jax.__version__, "batch": args.batch, "steps": args.steps, "reps": args.reps,
              "configs": {name: {"params": m.config.param_count(),
                                 "bytes_per_token": memory.kv_bytes_per_token(m.config),
                                 "config": repr(m.config)} for name, m in models.items()},
              "contexts": []}
    for context in args.contexts:
        capacity = context + args.steps
        row = {"context": context, "capacity": capacity}
        seconds = alternating_medians({name: functools.partial(step_seconds, model, args.batch, context, capacity,
                                                               args.steps) for name, model in models.items()},
                                      args.reps)
        for name, model in models.items():
            ms = seconds[name] * 1e3
            row[name] = {"step_ms": ms, "tokens_per_s": args.batch * 1e3 / ms,
                         "cache_bytes_allocated": allocated_bytes(model.config, args.batch, capacity),
                         "cache_bytes_planned": memory.kv_cache_bytes(model.config, tokens=capacity,
                                                                      batch=args.batch)}
        row["bytes_ratio"] = row["gqa"]["cache_bytes_allocated"] / row["mla"]["cache_bytes_allocated"]
        row["speed_ratio"] = row["mla"]["tokens_per_s"] / row["gqa"]["tokens_per_s"]
        result["contexts"].append(row)
    last = result["contexts"][-1]
    result["targets"] = TARGETS
    result["met"] = {"bytes_ratio": all(r["bytes_ratio"] >= TARGETS["bytes_ratio"] for r in result["contexts"]),
                     "speed_ratio_at_longest": last["speed_ratio"] >= TARGETS["speed_ratio_at_longest"]}
    return result


def report(result: dict):
    for name, c in result["configs"].items():
        print(f"{name}: {c['params']:,} parameters, {c['bytes_per_token']:,} cache bytes per token")
    print(f"batch {result['batch']}, float32, XLA attention, {result['steps']} steps per call, median of "
          f"{result['reps']}")
    print(f"{'context':>8} {'gqa ms':>8} {'mla ms':>8} {'mla/gqa speed':>13} {'gqa cache B':>12} {'mla cache B':>12} "
          f"{'bytes ratio':>11}")
    for r in result["contexts"]:
        print(f"{r['context']:>8,} {r['gqa']['step_ms']:8.2f} {r['mla']['step_ms']:8.2f} {r['speed_ratio']:12.2f}x "
              f"{r['gqa']['cache_bytes_allocated']:12,} {r['mla']['cache_bytes_allocated']:12,} "
              f"{r['bytes_ratio']:10.2f}x")
    last = result["contexts"][-1]
    print(f"targets: cache >= {TARGETS['bytes_ratio']}x smaller per token: "
          f"{'met' if result['met']['bytes_ratio'] else 'NOT met'}; MLA decode >= the twin's at "
          f"{last['context']:,} tokens: {last['speed_ratio']:.2f}x, "
          f"{'met' if result['met']['speed_ratio_at_longest'] else 'NOT met'}")


def main(argv=None) -> int:
    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
