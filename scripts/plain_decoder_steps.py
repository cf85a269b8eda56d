"""jaxkv's compiled decode loop against the plain JAX decoder's (`../shared/bench/jax_llama.py`), step for step.

    python scripts/plain_decoder_steps.py [--batch 1] [--live 128] [--capacity 384] [--steps 256] [--reps 7]
                                          [--plain-dir ../shared/bench] [--stub-logprobs] [--profile]

Both decode "small" (random weights of the same shapes; the plain decoder's own [in, out] layout, jaxkv's own) for
`--steps` steps from `--live` cached tokens, greedy, in one process, the two calls alternating `--reps` times
after a warm-up; prints each one's median ms per step and plain/jaxkv (>1: jaxkv faster). Unlike
`jaxkv_vs_hf.py --with-jaxref` this times only the decode loops (no prefill, no host work), so it says whether a
gap is in the step. `--stub-logprobs` replaces the log-probability of the sampled token by zeros (what skipping it
would save). `--profile` instead prints the per-op tally of each loop (`profile_decode.py`'s method) for the slowest
ops of each.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys
import tempfile
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--live", type=int, default=128)
    p.add_argument("--capacity", type=int, default=384)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--plain-dir", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "bench"))
    p.add_argument("--stub-logprobs", action="store_true")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if not 0 <= args.live < args.capacity - args.steps + 1:
        p.error("--live + --steps - 1 must fit in --capacity")
    if not (pathlib.Path(args.plain_dir) / "jax_llama.py").exists():
        p.error(f"no jax_llama.py in --plain-dir {args.plain_dir}")
    sys.path.insert(0, args.plain_dir)
    import jax
    import jax.numpy as jnp
    import jax_llama as plain

    import jaxkv
    from jaxkv.bench.decode import decode_inputs
    from jaxkv.config import PRESETS
    from jaxkv.decoding import step
    from jaxkv.generate import decode

    if args.stub_logprobs:
        step.token_logprobs = lambda logits, tokens, k=0: (
            jnp.zeros(tokens.shape), jnp.zeros(tokens.shape + (k,), jnp.int32), jnp.zeros(tokens.shape + (k,)))
    config = PRESETS["small"]
    model = jaxkv.Model.random(config, seed=0)
    D, F, V, L = config.d_model, config.ffn_dim, config.vocab_size, config.n_layers
    N, K, H = config.n_heads, config.n_kv_heads, config.head_dim
    cfg = plain.Cfg(vocab=V, dim=D, layers=L, heads=N, kv_heads=K, head_dim=H, eps=config.norm_eps,
                    theta=config.rope_theta, eos=-1)
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[0]))

    layers = [{"ln1": jnp.ones(D), "ln2": jnp.ones(D), "wq": w(D, N * H), "wk": w(D, K * H), "wv": w(D, K * H),
               "wo": w(N * H, D), "wg": w(D, F), "wu": w(D, F), "wd": w(F, D)} for _ in range(L)]
    params = {"embed": w(V, D), "norm": jnp.ones(D), "lm_head": w(D, V), "layers": layers}
    B = args.batch

    def plain_inputs():
        return params, plain.init_cache(cfg, B, args.capacity), jnp.zeros((B,), jnp.int32), args.live

    def ours_inputs():
        return (model.params, *decode_inputs(config, B, args.live, args.capacity))

    def run_plain(inputs):
        return plain.decode(*inputs, cfg=cfg, steps=args.steps - 1)

    def run_ours(inputs):
        return decode(*inputs, config=config, steps=args.steps, attention="xla")

    if args.profile:
        for name, run, inputs in (("plain", run_plain, plain_inputs), ("jaxkv", run_ours, ours_inputs)):
            print(name)
            for line in _profile(run, inputs, args.steps):
                print("  " + line)
        return 0
    times = collections.defaultdict(list)
    for rep in range(args.reps + 1):
        for name, run, inputs, steps in (("plain", run_plain, plain_inputs, args.steps - 1),
                                         ("jaxkv", run_ours, ours_inputs, args.steps)):
            x = inputs()
            jax.block_until_ready(x)
            t0 = time.perf_counter()
            jax.block_until_ready(run(x))
            if rep:  # the first round compiles
                times[name].append((time.perf_counter() - t0) / steps)
    a, b = (float(np.median(times[n])) for n in ("plain", "jaxkv"))
    print(f"small float32 batch {B}, {args.live}/{args.capacity} live slots, {args.steps} steps, medians of "
          f"{args.reps}{', log-probabilities stubbed' if args.stub_logprobs else ''}: plain {a * 1e3:.3f} ms/step, "
          f"jaxkv {b * 1e3:.3f} ms/step, plain/jaxkv {a / b:.3f}")
    return 0


def _profile(run, inputs, steps, top=12):
    """The slowest ops of one profiled call, ms per step (ops run a multiple of `steps` times)."""
    import jax

    jax.block_until_ready(run(inputs()))
    with tempfile.TemporaryDirectory() as trace_dir:
        x = inputs()
        jax.block_until_ready(x)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(run(x))
        with gzip.open(next(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))) as f:
            events = json.loads(f.read())["traceEvents"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith(("$", "ThunkExecutor", "end: ")):
            total[name] += e["dur"] * 1e-3
            count[name] += 1
    per_step = {k: v / steps for k, v in total.items() if count[k] >= steps - 1}
    return [f"{v:8.3f}  {k}" for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]]


if __name__ == "__main__":
    sys.exit(main())
