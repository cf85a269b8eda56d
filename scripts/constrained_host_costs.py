"""The host-side pieces of a constrained engine step, measured apart (docs/design/constrained.md, session 19):

    python scripts/constrained_host_costs.py

1. An ordered `io_callback` inside a compiled `while_loop` (a [16, 768] matmul per iteration, the callback
   returning a [16, 9] int32 mask as the engine's does): microseconds per iteration with no callback, with one,
   and with one under `lax.cond` (as the engine calls it). Best of 3 runs of 300 iterations.
2. llguidance on the bundled model's tokenizer and the `jaxkv bench constrained` schema: `Rows.advance` for 8
   constrained rows of 16 (each row takes the middle allowed token; median of 60 steps), and filling 8 rows'
   masks through `fill_next_token_bitmask_par` (jaxkv's `LLExecutor`) against a plain loop of
   `fill_next_token_bitmask` (mean of 200).
"""

from __future__ import annotations

import time

import numpy as np


def callback_cost(n: int = 300, B: int = 16, W: int = 9, D: int = 768) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import io_callback

    shape = jax.ShapeDtypeStruct((B, W), jnp.int32)

    def host(tokens):
        return np.full((B, W), -1, np.int32)

    def per_iteration(mode):
        @jax.jit
        def f(x, w):
            def body(c):
                i, x, m = c
                x = jnp.tanh(x @ w)
                call = lambda m: m + io_callback(host, shape, x[:, 0].astype(jnp.int32), ordered=True)  # noqa: E731
                if mode == "callback":
                    m = call(m)
                elif mode == "callback under lax.cond":
                    m = lax.cond(x[0, 0] > -10, call, lambda m: m, m)
                return i + 1, x, m
            return lax.while_loop(lambda c: c[0] < n, body, (0, x, jnp.zeros((B, W), jnp.int32)))

        x = jnp.full((B, D), 0.01, jnp.float32)
        w = jnp.asarray(np.random.default_rng(0).normal(size=(D, D)) * 0.03, jnp.float32)
        f(x, w)[1].block_until_ready()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            f(x, w)[1].block_until_ready()
            best = min(best, (time.perf_counter() - t0) / n)
        return best * 1e6

    return {mode: per_iteration(mode) for mode in ("none", "callback", "callback under lax.cond")}


def llguidance_cost(B: int = 16, steps: int = 60, reps: int = 200) -> dict:
    from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

    import jaxkv
    from jaxkv.bench.constrained import SCHEMA
    from jaxkv.constraints import matcher

    model = jaxkv.load("tiny")
    V, eos = model.config.vocab_size, model.config.eos_ids
    lltok = matcher.lltokenizer(model.tokenizer, V, eos)
    schema = jaxkv.JsonSchema(SCHEMA)
    matchers = [matcher.compiled(schema, lltok) if b % 2 == 0 else None for b in range(B)]
    rows = matcher.Rows(matchers, rows=B, vocab_size=V, stop_ids=np.array(eos), eos_ids=eos)
    rows.first()
    times = []
    for _ in range(steps):
        tokens = np.zeros(B, np.int32)
        for b in range(B):
            if matchers[b] is not None and not rows.over[b]:
                bits = rows.mask[b].view(np.uint32)
                allowed = [t for t in range(V) if (bits[t // 32] >> (t % 32)) & 1]
                tokens[b] = allowed[len(allowed) // 2]
        t0 = time.perf_counter()
        rows.advance(tokens, np.ones(B, bool))
        times.append(time.perf_counter() - t0)
    eight = [matcher.compiled(schema, lltok) for _ in range(8)]
    mask = np.zeros((8, rows.mask.shape[1]), np.int32)
    t0 = time.perf_counter()
    for _ in range(reps):
        fill_next_token_bitmask_par(matcher.executor(), [(m, i) for i, m in enumerate(eight)], mask)
    pooled = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        for i, m in enumerate(eight):
            fill_next_token_bitmask(m, mask, i)
    plain = (time.perf_counter() - t0) / reps
    return {"advance_8_of_16_rows_us_median": float(np.median(times) * 1e6), "fill_8_pooled_us": pooled * 1e6,
            "fill_8_plain_loop_us": plain * 1e6}


def main() -> int:
    for name, us in callback_cost().items():
        print(f"while_loop iteration, {name}: {us:.1f} us")
    for name, us in llguidance_cost().items():
        print(f"{name}: {us:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
