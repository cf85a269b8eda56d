"""The hybrid-model benchmark: a Qwen3-Next-shaped model (3 linear-attention layers : 1 full) against its
all-attention twin of the same size.

    jaxkv bench hybrid [--contexts 1024,4096,16384] [--batches 1,8] [--steps 32] [--reps 5]
                       [--prefix 2048,64] [--snapshot-interval 128] [--verify 4] [--quick] [--out F]
    python scripts/bench_hybrid.py ...            (the same)

Two models with random weights (seed 0), float32, at the "small" preset's scale (8 layers, d_model 512, 8 query
heads of 64, 4 KV heads, vocabulary 32,000, max positions 32,768), both with Qwen3-Next's gated attention (an
output gate per head, rotation of the first quarter of each head, q/k norms, (1 + w) norms):

  hybrid  layers 0-2 and 4-6 Gated DeltaNet (4 key heads and 8 value heads of 64, a conv of width 4), layers 3 and
          7 full attention: K/V for 2 layers, plus a fixed state per sequence (conv windows and [8, 64, 64]
          delta-rule states) on the other 6;
  twin    every layer full attention, the FFN width chosen so that the parameter count is the hybrid's to within
          0.1% (the linear layers hold more parameters than attention ones).

Dense FFNs in both (Qwen3-Next's experts are another axis: `jaxkv bench mla` and the MoE tests cover those).
For each batch and context C: the cache bytes (planned, and as allocated: every array of the cache, states
included) and the decode step time with C tokens cached (the compiled decode loop, XLA attention, --steps
steps per call, median of --reps calls, the two models alternating). What the issue asks to see: the linear
layers' cost stays flat with length (their state is the same at every C), so the hybrid's bytes and step time
grow 4x slower than the twin's.

Prefix cache (--prefix HEAD,TAIL): time to first token (one `generate` call of max_new_tokens=1, wall clock,
median of --reps, each on a new tail, after a warm-up call) of a prompt of HEAD shared tokens and TAIL of its own,
for the hybrid model with a `PrefixCache` keeping state snapshots every --snapshot-interval tokens (the head
prefilled once before: the prompt resumes at the head's last snapshot boundary and prefills the rest) and without
snapshots (no prefix cache: a hybrid prefix cannot be resumed from its pages alone, so the whole prompt is
prefilled); the twin with a plain prefix cache (pages only) beside them. Also the snapshot's bytes.

Speculation (--verify K): what keeping the state after each verified token costs. One verify pass of K + 1 tokens
through the hybrid's cache at each batch and the first context, as the speculative loop runs it (the linear layers
token by token, the state after each token kept, then the one after the kept tokens chosen), against the same pass
without (the chunked form, the final state only: what a pass that could not rewind the state would cost).
"""

from __future__ import annotations

import argparse
import functools
import sys

QUICK = {"contexts": "64,128", "batches": "1", "steps": 4, "reps": 1, "prefix": "256,16", "verify": 2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench hybrid", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,4096,16384", help="comma-separated cached tokens")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed call (default 32)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per model, batch and context (default 5)")
    p.add_argument("--prefix", default="2048,64", help="HEAD,TAIL: the prefix-cache part's shared head and own "
                   "tail, in tokens (0,0: skip it)")
    p.add_argument("--snapshot-interval", type=int, default=128, help="the prefix cache's snapshot interval")
    p.add_argument("--verify", type=int, default=4, help="K, the proposals of the verify-cost part (0: skip it)")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    p.add_argument("--layers", type=int, default=None, help="layers of each model, a multiple of 4 (default 8; "
                   "fewer only for a smoke test of the benchmark itself, e.g. in the test suite)")
    p.add_argument("--quick", action="store_true",
                   help="a small run, as if given " + ", ".join(f"--{k} {v}" for k, v in QUICK.items()))
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--quick", action="store_true")
    if first.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    for name in ("contexts", "batches", "prefix"):
        try:
            setattr(args, name, [int(c) for c in getattr(args, name).split(",")])
        except ValueError:
            p.error(f"--{name} must be comma-separated integers, got {getattr(args, name)!r}")
        if min(getattr(args, name)) < (0 if name == "prefix" else 1):
            p.error(f"--{name} must be positive")
    if len(args.prefix) != 2:
        p.error(f"--prefix must be HEAD,TAIL, got {args.prefix}")
    if args.snapshot_interval < 1 or args.snapshot_interval % 16:
        p.error(f"--snapshot-interval must be a positive multiple of 16 (the page size), got {args.snapshot_interval}")
    if args.layers is not None and (args.layers < 4 or args.layers % 4):
        p.error(f"--layers must be a positive multiple of 4 (3 linear-attention layers : 1 full), got {args.layers}")
    for name in ("steps", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    return args


def twins(layers: int | None = None):
    """(hybrid, twin) configs with the same parameter count (to 0.1%); `layers`: fewer than the preset's 8
    (--layers, a smoke test's size)."""
    from jaxkv.config import PRESETS, LinearAttention

    base = PRESETS["small"].replace(n_layers=layers or PRESETS["small"].n_layers, max_positions=32768,
                                    norm_kind="gemma_rmsnorm", qk_norm=True,
                                    attn_output_gate=True, rotary_dim=16)
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(base.n_layers))
    hybrid = base.replace(layer_types=types, linear_attention=LinearAttention(
        key_heads=4, value_heads=8, key_head_dim=64, value_head_dim=64, conv_kernel=4))
    ffn = min(range(base.ffn_dim, base.ffn_dim + 1024),
              key=lambda f: abs(base.replace(ffn_dim=f).param_count() - hybrid.param_count()))
    return hybrid, base.replace(ffn_dim=ffn)


def run(args) -> dict:
    import jax

    import jaxkv
    from jaxkv.bench.mla import alternating_medians, step_seconds
    from jaxkv.cache import planner as memory
    from jaxkv.cache.contiguous import KVCache

    hybrid, twin = twins(args.layers)
    models = {"hybrid": jaxkv.Model.random(hybrid, seed=0), "twin": jaxkv.Model.random(twin, seed=0)}
    result = {"jax": jax.__version__, "steps": args.steps, "reps": args.reps,
              "configs": {name: {"params": m.config.param_count(),
                                 "kv_bytes_per_token": memory.kv_bytes_per_token(m.config),
                                 "state_bytes_per_sequence": memory.state_bytes_per_sequence(m.config),
                                 "config": repr(m.config)} for name, m in models.items()},
              "rows": []}
    for batch in args.batches:
        for context in args.contexts:
            capacity = context + args.steps
            row = {"batch": batch, "context": context, "capacity": capacity}
            seconds = alternating_medians({name: functools.partial(step_seconds, model, batch, context, capacity,
                                                                   args.steps) for name, model in models.items()},
                                          args.reps)
            for name, model in models.items():
                ms = seconds[name] * 1e3
                row[name] = {"step_ms": ms, "tokens_per_s": batch * 1e3 / ms,
                             "cache_bytes_allocated": KVCache.allocate(model.config, batch, capacity).nbytes(),
                             "cache_bytes_planned": memory.kv_cache_bytes(model.config, tokens=capacity,
                                                                          batch=batch)}
            row["bytes_ratio"] = row["twin"]["cache_bytes_allocated"] / row["hybrid"]["cache_bytes_allocated"]
            row["speed_ratio"] = row["hybrid"]["tokens_per_s"] / row["twin"]["tokens_per_s"]
            result["rows"].append(row)
    if args.verify:
        result["verify"] = [verify_cost(models["hybrid"], batch, args.contexts[0], args.verify, args.reps)
                            for batch in args.batches]
    head, tail = args.prefix
    if head and tail:
        result["prefix"] = prefix_ttft(models, head, tail, args.snapshot_interval, args.reps)
    return result


def verify_cost(model, batch: int, context: int, k: int, reps: int) -> dict:
    """Milliseconds of one verify pass of k + 1 tokens over `context` cached ones: with the states after each
    token kept (what the speculative loop runs) and without (module docstring)."""
    import dataclasses
    import time

    import jax
    import jax.numpy as jnp

    from jaxkv.bench.mla import alternating_medians
    from jaxkv.cache.contiguous import KVCache
    from jaxkv.decoding import programs

    config = model.config
    cache = KVCache.allocate(config, batch, context + k + 1)
    cache = dataclasses.replace(cache, length=jnp.int32(context))
    tokens = jnp.ones((batch, k + 1), jnp.int32)

    @jax.jit
    def plain(params, tokens, cache):
        return programs.forward(params, tokens, cache, config=config, attention="xla")

    @jax.jit
    def kept(params, tokens, cache):
        logits, cache, after_each = programs.forward(params, tokens, cache, config=config, attention="xla",
                                                     step_states=True)
        return logits, cache.keep_step_states(after_each, 1 + k // 2)

    def timed(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(model.params, tokens, cache))
        return time.perf_counter() - t0

    seconds = alternating_medians({"step_states": lambda: timed(kept), "final_state": lambda: timed(plain)},
                                  max(reps, 3))
    return {"batch": batch, "context": context, "k": k, "ms": {name: s * 1e3 for name, s in seconds.items()},
            "ratio": seconds["step_states"] / seconds["final_state"],
            "step_state_bytes": batch * (k + 1) * config.state_bytes_per_sequence()}


def prefix_ttft(models, head: int, tail: int, interval: int, reps: int) -> dict:
    """Time to first token of head + a new tail: the hybrid with state snapshots, without (no prefix cache), the
    twin with its pages (module docstring)."""
    import time

    import numpy as np

    import jaxkv
    from jaxkv.bench.mla import alternating_medians

    rng = np.random.default_rng(0)
    vocab = models["hybrid"].config.vocab_size
    shared = rng.integers(3, vocab, head).tolist()
    pages = -(-(head + tail) // 16) * 4 + 64
    caches = {"hybrid": jaxkv.PrefixCache(models["hybrid"], num_pages=pages, snapshot_interval=interval),
              "twin": jaxkv.PrefixCache(models["twin"], num_pages=pages)}
    for name, pc in caches.items():  # the head once, before any timed call
        jaxkv.generate(models[name], [shared + [5]], max_new_tokens=1, stop_tokens=[], prefix_cache=pc)
    hits = {}

    def call(name, prefix_cache):
        prompt = shared + rng.integers(3, vocab, tail).tolist()
        t0 = time.perf_counter()
        out = jaxkv.generate(models[name], [prompt], max_new_tokens=1, stop_tokens=[], prefix_cache=prefix_cache)
        seconds = time.perf_counter() - t0
        hits[(name, prefix_cache is not None)] = out.stats.get("prefix_hit_tokens", 0)
        return seconds

    seconds = alternating_medians({
        "hybrid_snapshots": lambda: call("hybrid", caches["hybrid"]),
        "hybrid_no_snapshots": lambda: call("hybrid", None),
        "twin_pages": lambda: call("twin", caches["twin"])}, reps)
    pc = caches["hybrid"]
    return {"head": head, "tail": tail, "snapshot_interval": pc.snapshot_interval,
            "snapshot_bytes": pc.snapshot_bytes, "max_snapshots": pc.max_snapshots,
            "snapshots_kept": pc.cached_snapshots,
            "ttft_ms": {name: s * 1e3 for name, s in seconds.items()},
            "hit_tokens": {"hybrid_snapshots": hits[("hybrid", True)], "hybrid_no_snapshots": hits[("hybrid", False)],
                           "twin_pages": hits[("twin", True)]},
            "speedup": seconds["hybrid_no_snapshots"] / seconds["hybrid_snapshots"]}


def report(result: dict):
    for name, c in result["configs"].items():
        print(f"{name}: {c['params']:,} parameters, {c['kv_bytes_per_token']:,} K/V bytes per token, "
              f"{c['state_bytes_per_sequence']:,} state bytes per sequence")
    print(f"float32, XLA attention, {result['steps']} steps per call, median of {result['reps']}")
    print(f"{'batch':>5} {'context':>8} {'hybrid ms':>9} {'twin ms':>8} {'hybrid/twin speed':>17} "
          f"{'hybrid cache B':>14} {'twin cache B':>13} {'bytes ratio':>11}")
    for r in result["rows"]:
        print(f"{r['batch']:>5} {r['context']:>8,} {r['hybrid']['step_ms']:9.2f} {r['twin']['step_ms']:8.2f} "
              f"{r['speed_ratio']:16.2f}x {r['hybrid']['cache_bytes_allocated']:14,} "
              f"{r['twin']['cache_bytes_allocated']:13,} {r['bytes_ratio']:10.2f}x")
    for v in result.get("verify", []):
        print(f"verify of {v['k']} + 1 tokens, batch {v['batch']}, {v['context']:,} cached: keeping the state after "
              f"each token {v['ms']['step_states']:.2f} ms, the final state only {v['ms']['final_state']:.2f} ms "
              f"({v['ratio']:.2f}x; {v['step_state_bytes']:,} bytes of per-token states)")
    p = result.get("prefix")
    if p:
        print(f"prefix cache, batch 1: {p['head']:,} shared + {p['tail']:,} own tokens; snapshots every "
              f"{p['snapshot_interval']} tokens, {p['snapshot_bytes']:,} bytes each, {p['snapshots_kept']} kept "
              f"(at most {p['max_snapshots']})")
        for name, ms in p["ttft_ms"].items():
            print(f"  {name:<20} time to first token {ms:9.2f} ms, {p['hit_tokens'][name]:,} tokens from the cache")
        print(f"  snapshots vs none: {p['speedup']:.2f}x faster to the first token")


def main(argv=None) -> int:
    from jaxkv.bench.mla import bench_main

    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
