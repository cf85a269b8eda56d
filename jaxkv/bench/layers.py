"""The per-layer cache benchmark: a Gemma-3-shaped model whose local layers keep rings of their window, against
the same model with a full-length cache on every layer.

    jaxkv bench layers [--contexts 4096,16384] [--batch 1] [--steps 32] [--reps 5] [--quick] [--out F]
    python scripts/bench_layers.py ...          (the same)

One model with random weights (seed 0), float32, Gemma 3's layout scaled down to run on a CPU: 12 layers, five
local (sliding window 512, rope base 10,000) for every global one (rope base 1,000,000), d_model 512, 8 query
heads and 4 KV heads of 64, GeGLU of 1,408, q/k norms, sandwich norms, vocabulary 32,000. Two caches:

  rings   what `jaxkv.generate` allocates for it: each local layer a ring of 512 slots, each global layer full
          length (`KVCache.allocate(..., ring=True)`);
  full    every layer full length (`ring=False`): the local layers' windows are still masked, but every token is
          kept, as a cache with one geometry for the whole model would.

For each context C: the bytes each cache of C + steps slots allocates (summed over its arrays, and the planner's
figure beside it), and the decode step time with C tokens cached (the compiled decode loop,
`jaxkv.generate.decode`, XLA attention; --steps steps per call, median of --reps calls, the two alternating).
Targets (issue 18): the rings' cache at least 3.5x smaller at 16,384 tokens, and its decode not slower.
"""

from __future__ import annotations

import functools
import sys

TARGETS = {"bytes_ratio_at_longest": 3.5, "speed_ratio_at_longest": 1.0}
QUICK = {"contexts": "64,128", "steps": 4, "reps": 1}
WINDOW = 512


def parse_args(argv=None):
    from jaxkv.bench.mla import context_parser

    p, args = context_parser(argv, prog="jaxkv bench layers", description=__doc__.split("\n\n")[0],
                             contexts="4096,16384", quick=QUICK)
    if args.layers is not None and args.layers % 6:
        p.error(f"--layers must be a multiple of 6 (5 local layers : 1 global), got {args.layers}")
    if max(args.contexts) + args.steps > config().max_positions:
        p.error(f"--contexts: at most {config().max_positions - args.steps} tokens with --steps {args.steps}")
    return args


def config(layers: int = 12):
    """The Gemma-3-shaped model (module docstring); `layers`: fewer than 12 (--layers, a smoke test's size)."""
    from jaxkv.config import Config

    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    return Config(vocab_size=32000, d_model=512, n_layers=layers, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=1408,
                  ffn_kind="geglu", norm_kind="gemma_rmsnorm", norm_eps=1e-6, qk_norm=True, post_norms=True,
                  embed_scale=512 ** 0.5, query_pre_attn_scalar=64.0, sliding_window=WINDOW, layer_types=types,
                  rope_theta=1_000_000.0, rope_local_theta=10_000.0, tie_embeddings=True, max_positions=32768)


def cache_bytes(cfg, batch: int, slots: int, ring: bool) -> int:
    from jaxkv.cache.contiguous import KVCache

    return KVCache.allocate(cfg, batch, slots, ring=ring).nbytes()


def run(args) -> dict:
    import jax

    import jaxkv
    from jaxkv.cache import planner as memory
    from jaxkv.bench.mla import alternating_medians, step_seconds

    model = jaxkv.Model.random(config(args.layers or 12), seed=0)
    cfg = model.config
    caches = {"rings": True, "full": False}
    result = {"jax": jax.__version__, "batch": args.batch, "steps": args.steps, "reps": args.reps,
              "params": cfg.param_count(), "config": repr(cfg), "contexts": []}
    if cfg.n_layers != 12:  # --layers (the default run's JSON as it was)
        result["layers"] = cfg.n_layers
    for context in args.contexts:
        capacity = context + args.steps
        row = {"context": context, "capacity": capacity}
        seconds = alternating_medians({name: functools.partial(step_seconds, model, args.batch, context, capacity,
                                                               args.steps, ring) for name, ring in caches.items()},
                                      args.reps)
        planned = {"rings": memory.kv_cache_bytes(cfg, tokens=capacity, batch=args.batch),
                   "full": memory.full_length_cache_bytes(cfg, tokens=capacity, batch=args.batch)}
        for name, ring in caches.items():
            ms = seconds[name] * 1e3
            row[name] = {"step_ms": ms, "tokens_per_s": args.batch * 1e3 / ms,
                         "cache_bytes_allocated": cache_bytes(cfg, args.batch, capacity, ring),
                         "cache_bytes_planned": planned[name]}
        row["bytes_ratio"] = row["full"]["cache_bytes_allocated"] / row["rings"]["cache_bytes_allocated"]
        row["speed_ratio"] = row["rings"]["tokens_per_s"] / row["full"]["tokens_per_s"]
        result["contexts"].append(row)
    last = result["contexts"][-1]
    result["targets"] = TARGETS
    result["met"] = {"bytes_ratio_at_longest": last["bytes_ratio"] >= TARGETS["bytes_ratio_at_longest"],
                     "speed_ratio_at_longest": last["speed_ratio"] >= TARGETS["speed_ratio_at_longest"]}
    return result


def report(result: dict):
    layers = result.get("layers", 12)
    print(f"Gemma-3-shaped model: {result['params']:,} parameters, {layers} layers ({layers - layers // 6} local with "
          f"a window of {WINDOW}, {layers // 6} global)")
    print(f"batch {result['batch']}, float32, XLA attention, {result['steps']} steps per call, median of "
          f"{result['reps']}")
    print(f"{'context':>8} {'rings ms':>9} {'full ms':>8} {'rings/full speed':>16} {'rings cache B':>14} "
          f"{'full cache B':>14} {'bytes ratio':>11}")
    for r in result["contexts"]:
        print(f"{r['context']:>8,} {r['rings']['step_ms']:9.2f} {r['full']['step_ms']:8.2f} "
              f"{r['speed_ratio']:15.2f}x {r['rings']['cache_bytes_allocated']:14,} "
              f"{r['full']['cache_bytes_allocated']:14,} {r['bytes_ratio']:10.2f}x")
    last, met = result["contexts"][-1], result["met"]
    print(f"targets at {last['context']:,} tokens: cache >= {TARGETS['bytes_ratio_at_longest']}x smaller: "
          f"{last['bytes_ratio']:.2f}x, {'met' if met['bytes_ratio_at_longest'] else 'NOT met'}; decode not slower: "
          f"{last['speed_ratio']:.2f}x, {'met' if met['speed_ratio_at_longest'] else 'NOT met'}")


def main(argv=None) -> int:
    from jaxkv.bench.mla import bench_main

    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
