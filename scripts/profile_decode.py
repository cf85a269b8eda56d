"""Where a decode step's time goes: per-op times of the compiled decode loop, from `jax.profiler`.

    python scripts/profile_decode.py [--config small|mla-twin|gqa-twin] [--batch 1] [--live 256] [--capacity 384] [--steps 64]
                                     [--dtype float32] [--cache-dtype D] [--top 15] [--json FILE]

Runs `jaxkv.generate.decode` (the compiled `lax.scan` decode loop, cache donated) for `--steps` steps on a random
preset model with a cache of `--capacity` slots holding `--live` tokens, once to compile and once under
`jax.profiler.trace`. The trace's per-op events (XLA:CPU records one per executed op) are summed per step and
matched to the compiled HLO, then printed: the step time, the ops' total and the remainder (dispatch between ops),
time by op kind (dots, fusions, ...), the dots' read rate over the weights, and the slowest ops with their HLO.
This is the measurement behind the "where the time goes" figures in docs/design/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import roofline
from jaxkv.bench.decode import decode_inputs
from jaxkv.cache.dtypes import check_cache_dtype
from jaxkv.checkpoint import cast
from jaxkv.config import PRESETS
from jaxkv.generate import _decode_args as decode_loop_args
from jaxkv.generate import decode

_HLO_DEF = re.compile(r"\s*(?:ROOT )?%(\S+) = (\S+) (\S+?)\((.*)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", choices=sorted(PRESETS) + ["mla-twin", "gqa-twin"],
                   help="a preset, or `jaxkv bench mla`'s pair: the MLA model and its GQA twin")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--live", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--capacity", type=int, default=384, help="cache slots (max_len)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cache-dtype", default=None)
    p.add_argument("--top", type=int, default=15, help="slowest ops to list")
    p.add_argument("--json", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    for name in ("batch", "steps", "capacity"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 <= args.live < args.capacity - args.steps:
        p.error(f"--live must be in [0, capacity - steps) = [0, {args.capacity - args.steps}) so every step has a "
                "free slot")
    if args.cache_dtype is not None:
        try:
            args.cache_dtype = check_cache_dtype(args.cache_dtype)
        except ValueError as e:
            p.error(str(e))
    return args


def profile(args) -> dict:
    if args.config in ("mla-twin", "gqa-twin"):
        from jaxkv.bench.mla import twins

        config = twins()[args.config == "mla-twin"]
    else:
        config = PRESETS[args.config]
    model = cast(jaxkv.Model.random(config, seed=0), args.dtype)
    config = model.config
    cache_dtype = args.cache_dtype or args.dtype
    B = args.batch

    def inputs():  # decode donates the cache: fresh inputs for every call, as the compiled loop takes them
        call, _ = decode_loop_args(model.params, *decode_inputs(config, B, args.live, args.capacity, cache_dtype),
                                   config=config, steps=args.steps + 1, attention="xla")
        return call

    # One compile: the HLO it prints is the executable that runs.
    compiled = decode.lower(model.params, *decode_inputs(config, B, args.live, args.capacity, cache_dtype),
                            config=config, steps=args.steps + 1, attention="xla").compile()
    hlo = compiled.as_text()
    jax.block_until_ready(compiled(*inputs()))  # warm up

    with tempfile.TemporaryDirectory() as trace_dir:
        call_inputs = inputs()
        jax.block_until_ready(call_inputs)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*call_inputs))
            wall = time.perf_counter() - t0
        traces = list(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
        if not traces:
            raise RuntimeError("jax.profiler wrote no perfetto trace")
        events = json.loads(gzip.open(traces[0]).read())["traceEvents"]

    definitions = {}
    for line in hlo.splitlines():
        m = _HLO_DEF.match(line)
        if m:
            definitions[m.group(1)] = f"{m.group(2)} {m.group(3)}({m.group(4)}"[:140]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        # Op events carry the HLO instruction's name; Python frames start with "$", runtime bookkeeping with
        # "ThunkExecutor" or "end: ".
        name = e.get("name", "")
        if e.get("ph") == "X" and name in definitions:
            total[name] += e["dur"] * 1e-6
            count[name] += 1
    # Ops run once per step (or once per layer per step); ops outside the loop (count not a multiple of steps) are
    # the loop's setup and are left out of the per-step figures.
    per_step = {k: v / args.steps for k, v in total.items() if count[k] % args.steps == 0}
    kinds = collections.Counter()
    for k, v in per_step.items():
        kinds[re.sub(r"[.0-9]+$", "", k)] += v
    step_s = wall / args.steps
    ops_s = sum(per_step.values())
    weight_bytes = roofline.weight_bytes_per_step(config, B, jnp.dtype(args.dtype).itemsize)
    dot_s = kinds.get("dot", 0.0)
    return {
        "config": args.config, "batch": B, "dtype": args.dtype, "cache_dtype": cache_dtype, "live": args.live,
        "capacity": args.capacity, "steps": args.steps,
        "step_ms": step_s * 1e3, "ops_ms": ops_s * 1e3, "between_ops_ms": (step_s - ops_s) * 1e3,
        "tokens_per_s": B / step_s, "weight_bytes": weight_bytes,
        "dot_ms": dot_s * 1e3, "dot_weight_GBps": weight_bytes / dot_s / 1e9 if dot_s else None,
        "ops_per_step": sum(count[k] // args.steps for k in per_step),
        "by_kind_ms": {k: v * 1e3 for k, v in kinds.most_common()},
        "slowest": [{"op": k, "ms": v * 1e3, "hlo": definitions.get(k, "")}
                    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]],
    }


def report(r: dict) -> str:
    lines = [
        f"{r['config']} {r['dtype']} batch {r['batch']}, cache {r['cache_dtype']} {r['live']}/{r['capacity']} "
        f"slots, {r['steps']} steps (profiled run; the profiler adds a little to the wall time)",
        f"  step {r['step_ms']:.2f} ms ({r['tokens_per_s']:.1f} tok/s): ops {r['ops_ms']:.2f} ms in "
        f"{r['ops_per_step']} ops, {r['between_ops_ms']:.2f} ms between ops",
        f"  dots {r['dot_ms']:.2f} ms: {r['weight_bytes'] / 1e6:.0f} MB of weights at "
        f"{r['dot_weight_GBps']:.1f} GB/s" if r["dot_weight_GBps"] else "  no dots",
        "  by kind (ms/step):",
    ]
    lines += [f"    {v:8.3f}  {k}" for k, v in list(r["by_kind_ms"].items())[:12]]
    lines.append("  slowest ops (ms/step):")
    lines += [f"    {s['ms']:8.3f}  {s['op']:28} {s['hlo']}" for s in r["slowest"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    r = profile(args)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
