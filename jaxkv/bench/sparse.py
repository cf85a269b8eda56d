"""The sparse-attention benchmark: DeepSeek-V3.2's top-k latent attention against its dense MLA twin, and
gpt-oss's sinks with alternating sliding windows against all-full layers.

    jaxkv bench sparse [--contexts 4096,16384,65536] [--window-context 16384] [--batch 1] [--steps 16] [--reps 5]
                       [--quick] [--out F]
    python scripts/bench_sparse.py ...            (the same)

Random weights (seed 0), float32, the "small" preset's scale (8 layers, d_model 512, 8 query heads, vocabulary
32,000), the compiled decode loop (`jaxkv.generate.decode`, XLA attention), --steps steps per call, median of
--reps calls, the variants alternating; each cache holds C + steps slots with C tokens cached.

Part 1, DeepSeek-V3.2-shaped, for each context C in --contexts:
  sparse  multi-head latent attention (latent 96 + rotary key 32 per token, query LoRA 192, per-head widths 64)
          with the lightning indexer: 4 indexer heads of 32 (per cached token 1/8 of the attention's per-head work,
          as V3.2's 64 x 128 against 128 heads x 576 is 1/9), top-k 2,048 as released;
  dense   the same weights without the indexer (the dense MLA twin): every query attends to every cached row.
The step time, the bytes each cache allocates (the indexer keys are cached beside the latent rows) and, to
separate what grows with C, the latent attention alone (one layer's `sparse_attention` over its 2,048 picked
rows against the dense reference over all C rows, batch --batch, 8 heads): the sparse attention reads k rows at
every C; the indexer still scores every cached key, so the whole sparse step grows with C at its (smaller) rate.

Part 2, gpt-oss-shaped, at --window-context tokens: attention sinks on every layer, 4 KV heads of 64, layers
alternating sliding window (128 tokens, each a ring of 128 slots) and full, against the same model with
every layer full: cache bytes and step time.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

QUICK = {"contexts": "256,512", "window_context": 512, "steps": 4, "reps": 1, "topk": 128}
TOPK = 2048
WINDOW = 128


def parse_args(argv=None):
    from jaxkv.bench.mla import context_parser

    def own_options(p):
        p.add_argument("--window-context", type=int, default=16384, help="cached tokens of part 2 (default 16384)")
        p.add_argument("--topk", type=int, default=TOPK, help=f"the indexer's top-k (default {TOPK}, as released)")

    p, args = context_parser(argv, prog="jaxkv bench sparse", description=__doc__.split("\n\n")[0],
                             contexts="4096,16384,65536", quick=QUICK, steps=16, add_options=own_options)
    for name in ("topk", "window_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    longest = max(*args.contexts, args.window_context) + args.steps
    if longest > MAX_POSITIONS:
        p.error(f"--contexts / --window-context: at most {MAX_POSITIONS - args.steps} tokens with --steps {args.steps}")
    return args


MAX_POSITIONS = 1 << 17


def sparse_twins(topk: int = TOPK, layers: int | None = None):
    """(sparse, dense) DeepSeek-V3.2-shaped configs (module docstring): the same model with and without the
    indexer; `layers`: fewer than the preset's (--layers, a smoke test's size)."""
    from jaxkv.config import PRESETS, Mla, SparseIndexer

    small = PRESETS["small"].replace(n_layers=layers or PRESETS["small"].n_layers)
    mla = Mla(kv_lora_rank=96, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, q_lora_rank=192)
    dense = dataclasses.replace(small, n_kv_heads=None, head_dim=None, mla=mla, max_positions=MAX_POSITIONS)
    sparse = dense.replace(mla=dataclasses.replace(mla, indexer=SparseIndexer(n_heads=4, head_dim=32, topk=topk)))
    return sparse, dense


def window_twins(layers: int | None = None):
    """(windows, full) gpt-oss-shaped configs (module docstring); `layers`: as `sparse_twins`."""
    from jaxkv.config import PRESETS

    base = PRESETS["small"].replace(attention_sinks=True, max_positions=MAX_POSITIONS,
                                    n_layers=layers or PRESETS["small"].n_layers)
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(base.n_layers))
    return base.replace(sliding_window=WINDOW, layer_types=types), base


def attention_seconds(config, batch: int, context: int, topk: int, reps: int) -> dict:
    """Median seconds of one layer's latent attention for one query over `context` cached rows: over the top-k
    picked rows (`sparse_attention`) and over all of them (the dense reference)."""
    import jax
    import jax.numpy as jnp

    from jaxkv.attention import mla_reference

    m = config.mla
    C, N = m.row_dim, config.n_heads
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (batch, 1, N, C), jnp.float32)
    latent = jax.random.normal(key, (batch, context, C), jnp.float32)
    K = min(topk, context)
    slots = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32) * (context // K), (batch, 1, K))
    valid = jnp.ones((batch, 1, K), bool)
    start, offset = jnp.zeros((batch,), jnp.int32), jnp.int32(context - 1)
    kw = dict(latent_dim=m.kv_lora_rank, scale=config.attention_scale)
    sparse = jax.jit(lambda q, latent, slots, valid: mla_reference.sparse_attention(q, latent, slots, valid, **kw))
    dense = jax.jit(lambda q, latent: mla_reference.attention(q, latent, start, offset, **kw))

    def timed(fn, *args):
        def once():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return time.perf_counter() - t0
        return once

    from jaxkv.bench.mla import alternating_medians
    return alternating_medians({"sparse": timed(sparse, q, latent, slots, valid), "dense": timed(dense, q, latent)},
                               max(reps, 3))


def run(args) -> dict:
    import jax

    import jaxkv
    from jaxkv.bench.mla import alternating_medians, step_seconds
    from jaxkv.cache import planner as memory
    from jaxkv.cache.contiguous import KVCache

    def describe(models):
        return {name: {"params": m.config.param_count(), "kv_bytes_per_token": memory.kv_bytes_per_token(m.config),
                       "config": repr(m.config)} for name, m in models.items()}

    sparse, dense = sparse_twins(args.topk, args.layers)
    sparse_model = jaxkv.Model.random(sparse, seed=0)
    params = dict(sparse_model.params)
    dense_params = {name: ({**layer, "attn": {k: v for k, v in layer["attn"].items() if k != "indexer"}}
                           if name.startswith("layer_") else layer) for name, layer in params.items()}
    models = {"sparse": sparse_model, "dense": jaxkv.Model(dense, dense_params)}
    result = {"jax": jax.__version__, "batch": args.batch, "steps": args.steps, "reps": args.reps,
              "topk": args.topk, "sparse": {"configs": describe(models), "rows": []}}
    for context in args.contexts:
        capacity = context + args.steps
        row = {"context": context, "capacity": capacity}
        seconds = alternating_medians({name: functools.partial(step_seconds, model, args.batch, context, capacity,
                                                               args.steps) for name, model in models.items()},
                                      args.reps)
        for name, model in models.items():
            row[name] = {"step_ms": seconds[name] * 1e3,
                         "cache_bytes_allocated": KVCache.allocate(model.config, args.batch, capacity).nbytes(),
                         "cache_bytes_planned": memory.kv_cache_bytes(model.config, tokens=capacity,
                                                                      batch=args.batch)}
        row["speed_ratio"] = row["dense"]["step_ms"] / row["sparse"]["step_ms"]
        row["attention_ms"] = {k: s * 1e3 for k, s in attention_seconds(sparse, args.batch, context, args.topk,
                                                                         args.reps).items()}
        result["sparse"]["rows"].append(row)

    windows, full = window_twins(args.layers)
    wmodels = {"windows": jaxkv.Model.random(windows, seed=0), "full": jaxkv.Model.random(full, seed=0)}
    context, capacity = args.window_context, args.window_context + args.steps
    seconds = alternating_medians({name: functools.partial(step_seconds, model, args.batch, context, capacity,
                                                           args.steps, ring=True) for name, model in wmodels.items()},
                                  args.reps)
    part = {"context": context, "capacity": capacity, "configs": describe(wmodels)}
    for name, model in wmodels.items():
        part[name] = {"step_ms": seconds[name] * 1e3,
                      "cache_bytes_allocated": KVCache.allocate(model.config, args.batch, capacity, ring=True).nbytes(),
                      "cache_bytes_planned": memory.kv_cache_bytes(model.config, tokens=capacity, batch=args.batch)}
    part["bytes_ratio"] = part["full"]["cache_bytes_allocated"] / part["windows"]["cache_bytes_allocated"]
    part["speed_ratio"] = part["full"]["step_ms"] / part["windows"]["step_ms"]
    result["windows"] = part
    return result


def report(result: dict):
    s = result["sparse"]
    for name, c in s["configs"].items():
        print(f"{name}: {c['params']:,} parameters, {c['kv_bytes_per_token']:,} cache bytes per token")
    print(f"batch {result['batch']}, float32, XLA attention, top-k {result['topk']}, {result['steps']} steps per "
          f"call, median of {result['reps']}")
    print(f"{'context':>8} {'sparse ms':>9} {'dense ms':>9} {'dense/sparse':>12} {'sparse cache B':>14} "
          f"{'dense cache B':>13} {'attn sparse ms':>14} {'attn dense ms':>13}")
    for r in s["rows"]:
        print(f"{r['context']:>8,} {r['sparse']['step_ms']:9.2f} {r['dense']['step_ms']:9.2f} "
              f"{r['speed_ratio']:11.2f}x {r['sparse']['cache_bytes_allocated']:14,} "
              f"{r['dense']['cache_bytes_allocated']:13,} {r['attention_ms']['sparse']:14.3f} "
              f"{r['attention_ms']['dense']:13.3f}")
    w = result["windows"]
    print(f"gpt-oss-shaped, sinks, windows of {WINDOW} on every other layer vs every layer full, "
          f"{w['context']:,} tokens cached:")
    for name in ("windows", "full"):
        print(f"  {name:<8} step {w[name]['step_ms']:8.2f} ms, cache {w[name]['cache_bytes_allocated']:,} bytes")
    print(f"  full / windows: {w['bytes_ratio']:.2f}x the bytes, {w['speed_ratio']:.2f}x the step time")


def main(argv=None) -> int:
    from jaxkv.bench.mla import bench_main

    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
