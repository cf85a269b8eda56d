"""How fast the installed jax multiplies one token by a weight, written three ways (GB/s of weight read).

A batch-1 decode step is a chain of matrix-vector products, so it runs at the speed XLA gives this one shape. The
same sums can be written as the einsum `jaxkv.layers.linear` uses ("bti,io->bto" for an [in, out] weight,
"bti,oi->bto" for [out, in]) or as a matrix-vector product w @ x. XLA:CPU from jax 0.11 runs the [out, in] einsum
through YNNPACK, which repacks (transposes) the weight on every call; `linear` therefore uses w @ x for one token
and an [out, in] weight of at least OUT_IN_ELEMENTS (docs/design/overview.md, "Versions").

    python scripts/matvec_forms.py            # "medium"'s FFN shape, 1,024 x 2,816, and two smaller ones

Each figure: 16 weights of the shape chained through a tanh, 20 times in one jitted loop, the best of 5 calls.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, STEPS, CALLS = 16, 20, 5


def rate(apply, shape, d_in):
    """GB/s of weight bytes read by `apply(x [1, 1, d_in], w)` over LAYERS weights of `shape`, chained."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(LAYERS)]

    @jax.jit
    def run(x, ws):
        def step(_, x):
            for w in ws:
                y = apply(x, w)  # [1, 1, d_out]
                x = jnp.tanh(jnp.tile(y, (1, 1, -(-d_in // y.shape[-1])))[..., :d_in])
            return x
        return jax.lax.fori_loop(0, STEPS, step, x)

    x = jnp.ones((1, 1, d_in), jnp.float32)
    run(x, ws).block_until_ready()
    best = float("inf")
    for _ in range(CALLS):
        t = time.perf_counter()
        run(x, ws).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return STEPS * LAYERS * int(np.prod(shape)) * 4 / 1e9 / best


def main() -> None:
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; GB/s of weight read (best of {CALLS})")
    for d_in, d_out in ((2816, 1024), (1024, 1024), (512, 1408)):
        forms = {
            "einsum, [in, out]": (lambda x, w: jnp.einsum("bti,io->bto", x, w), (d_in, d_out)),
            "einsum, [out, in]": (lambda x, w: jnp.einsum("bti,oi->bto", x, w), (d_out, d_in)),
            "w @ x, [out, in]": (lambda x, w: jnp.dot(w, x.reshape(-1)).reshape(1, 1, -1), (d_out, d_in)),
        }
        row = ", ".join(f"{name} {rate(f, shape, d_in):5.1f}" for name, (f, shape) in forms.items())
        print(f"  {d_in:5d} -> {d_out:5d}: {row}", flush=True)


if __name__ == "__main__":
    main()
