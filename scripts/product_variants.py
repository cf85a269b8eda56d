"""How fast XLA:CPU runs the weight products of a decode step, written different ways (issue 16's levers).

Each variant runs `--matrices` distinct weight matrices in a chain (each product's output feeds the next, as the
layers of a decoder do) inside one jitted `lax.scan`, and prints microseconds per product, median of `--reps`. Every
output column is consumed (a sum over the whole product feeds the next input), so XLA cannot shrink a product to
the columns a slice would keep.

  f32 [in,out] / f32 [out,in]     float32 weights in either layout
  f32 [out,in] w @ x              the [out, in] weight times one row written as a matrix-vector product, as
                                  `jaxkv.layers.linear` does where XLA:CPU (jax >= 0.11) repacks the einsum's weight
                                  (more rows: the product above)
  bf16 -> f32 / bf16 -> bf16      bfloat16 weights and activations, the product asked for a float32 or a bfloat16
                                  result (the second is what `x @ w` gives on bfloat16 operands)
  bf16 [out,in] -> f32            the same in the other layout
  bf16 upcast                     bfloat16 weights converted to float32 before a float32 product
  3 products                      three products of [in, out/3] weights, against "f32 [in,out]": one product of
                                  their concatenation (q/k/v or gate/up fused into one weight)
  independent                     the same float32 products, all fed by the same input (no chain)

    python scripts/product_variants.py --shape 1024x2816 --rows 1,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1024x2816", help="IN x OUT of each weight matrix")
    parser.add_argument("--rows", default="1,8", help="comma-separated rows (batch sizes)")
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20, help="scan steps per timed call")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        d_in, d_out = (int(x) for x in args.shape.lower().split("x"))
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--shape must be INxOUT and --rows integers, got {args.shape!r} / {args.rows!r}")
    if d_out < d_in or min(rows) < 1 or args.matrices < 1 or args.reps < 1:
        parser.error("need OUT >= IN and positive rows, matrices and reps")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((d_in, d_out)).astype(np.float32) / np.sqrt(d_in) for _ in range(args.matrices)]
    f32, bf16 = jnp.float32, jnp.bfloat16
    stores = {
        "f32 [in,out]": [jnp.asarray(w) for w in weights],
        "f32 [out,in]": [jnp.asarray(w.T.copy()) for w in weights],
        "bf16 [in,out]": [jnp.asarray(w, bf16) for w in weights],
        "bf16 [out,in]": [jnp.asarray(w.T.copy(), bf16) for w in weights],
        "thirds": [[jnp.asarray(part) for part in np.array_split(w, 3, axis=1)] for w in weights],
    }
    variants = {  # name: (store, product of x [rows, in] float32 -> [rows, out] float32)
        "f32 [in,out]": ("f32 [in,out]", lambda x, w: x @ w),
        "f32 [out,in]": ("f32 [out,in]", lambda x, w: x @ w.T),
        "f32 [out,in] w @ x": ("f32 [out,in]",
                               lambda x, w: (w @ x[0])[None] if x.shape[0] == 1 else x @ w.T),
        "bf16 -> f32": ("bf16 [in,out]", lambda x, w: jnp.dot(x.astype(bf16), w, preferred_element_type=f32)),
        "bf16 -> bf16": ("bf16 [in,out]", lambda x, w: jnp.dot(x.astype(bf16), w).astype(f32)),
        "bf16 [out,in] -> f32": ("bf16 [out,in]",
                                 lambda x, w: jnp.dot(x.astype(bf16), w.T, preferred_element_type=f32)),
        "bf16 upcast": ("bf16 [in,out]", lambda x, w: x @ w.astype(f32)),
        "3 products": ("thirds", lambda x, w: jnp.concatenate([x @ part for part in w], axis=-1)),
    }

    @partial(jax.jit, static_argnames=("name", "chain"))
    def run(ws, x, name, chain=True):
        product = variants[name][1]

        def step(h, _):
            total, start = jnp.zeros_like(h), h  # independent: every product reads the step's input `start`
            for w in ws:
                y = product(h if chain else start, w)
                # Every column feeds the next input: a product cannot be cut down to the columns a slice keeps.
                nxt = jnp.tanh(y[:, :d_in] + 1e-6 * jnp.sum(y, axis=-1, keepdims=True))
                h, total = (nxt, total) if chain else (h, total + nxt)
            return (h if chain else h + 1e-6 * total), None

        return lax.scan(step, x, None, length=args.steps)[0]

    print(f"XLA:CPU products, {args.matrices} matrices of {d_in} x {d_out}, jax {jax.__version__}, "
          f"median of {args.reps}: microseconds per product")
    print(f"{'variant':24}" + "".join(f"{f'{r} row' + ('s' if r > 1 else ''):>10}" for r in rows))
    cases = [(name, True) for name in variants] + [("f32 [in,out]", False)]
    for name, chain in cases:
        cells = []
        for r in rows:
            x = jnp.full((r, d_in), 0.01, f32)
            ws = stores[variants[name][0]]
            run(ws, x, name, chain).block_until_ready()  # compile and warm up
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                run(ws, x, name, chain).block_until_ready()
                times.append((time.perf_counter() - t0) / (args.steps * args.matrices) * 1e6)
            cells.append(statistics.median(times))
        label = name if chain else "f32 [in,out] independent"
        print(f"{label:24}" + "".join(f"{c:10.0f}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
