"""The data-parallel engine: throughput per ("data", "model") mesh on the same requests.

    jaxkv bench data-parallel [--config test-tiny] [--requests 64] [--slots 4] [--meshes 1x1,2x1,4x1,2x2,4x2]
                              [--reps 3] [--out F]
    python scripts/bench_data_parallel.py ...            (the same)

One process, random weights (`jaxkv.Model.random(PRESETS[config], seed=0)`, float32). Without devices of its own
(no accelerator), it asks XLA for 8 host devices (--xla_force_host_platform_device_count=8, before JAX starts),
as the tests do. Per mesh, `jaxkv.Engine(model, mesh=..., slots=S)` (1x1: no mesh), warmed up by one pass of the
requests; then --reps timed passes of `Engine.generate` over --requests requests (prompts of 8-64 random tokens,
8-32 new, greedy, stop_tokens=[]): new tokens / seconds, median. Each data shard has S slots, so a mesh with D
data shards decodes D x S sequences at once.

What the figures can show here: the 8 "devices" of XLA:CPU share this machine's cores, so D shards compete for
the same 2 cores; on real devices each shard has its own. Reported as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench data-parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="test-tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--meshes", default="1x1,2x1,4x1,2x2,4x2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def run(args) -> dict:
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxkv

    config = jaxkv.PRESETS[args.config]
    model = jaxkv.Model.random(config, seed=0)
    rng = np.random.default_rng(0)
    requests = [{"prompt": [int(t) for t in rng.integers(1, config.vocab_size, size=int(rng.integers(8, 65)))],
                 "max_new_tokens": int(rng.integers(8, 33))} for _ in range(args.requests)]
    rows = []
    reference = None
    for spec in args.meshes.split(","):
        data, model_axis = (int(x) for x in spec.split("x"))
        if data * model_axis > jax.device_count():
            print(f"[bench data-parallel] {spec}: needs {data * model_axis} devices, {jax.device_count()} here",
                  file=sys.stderr)
            continue
        mesh = None if data * model_axis == 1 else Mesh(
            np.array(jax.devices()[:data * model_axis]).reshape(data, model_axis), ("data", "model"))
        engine = jaxkv.Engine(model, slots=args.slots, max_len=128, mesh=mesh)
        first = engine.generate(requests, stop_tokens=[])  # warm-up: compiles
        tokens = [r.tokens for r in first]
        reference = tokens if reference is None else reference
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            engine.generate(requests, stop_tokens=[])
            seconds.append(time.perf_counter() - start)
        new = sum(len(t) for t in tokens)
        row = {"mesh": spec, "data_shards": data, "slots_total": data * args.slots, "new_tokens": new,
               "seconds": statistics.median(seconds), "tokens_per_s": new / statistics.median(seconds),
               "same_tokens_as_first_mesh": tokens == reference}
        rows.append(row)
        print(f"[bench data-parallel] {spec}: {row['tokens_per_s']:,.0f} new tokens/s", file=sys.stderr, flush=True)
    return {"config": args.config, "requests": args.requests, "slots_per_shard": args.slots, "reps": args.reps,
            "device": jax.devices()[0].platform, "devices": jax.device_count(), "cores": os.cpu_count(),
            "rows": rows}


def report(r: dict) -> str:
    lines = [f"{r['config']}, {r['requests']} requests, {r['slots_per_shard']} slots per shard, median of {r['reps']} "
             f"({r['devices']} {r['device']} devices on {r['cores']} cores):",
             "  mesh   shards  slots  new tokens/s  same tokens"]
    base = r["rows"][0]["tokens_per_s"] if r["rows"] else 1.0
    for row in r["rows"]:
        lines.append(f"  {row['mesh']:<6} {row['data_shards']:>6} {row['slots_total']:>6} {row['tokens_per_s']:>13,.0f}"
                     f"  {row['same_tokens_as_first_mesh']}   ({row['tokens_per_s'] / base:.2f}x the first)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("requests", "slots", "reps"):
        if getattr(args, name) < 1:
            print(f"jaxkv bench data-parallel: error: --{name} must be >= 1", file=sys.stderr)
            return 2
    r = run(args)
    print(report(r), flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(r, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
