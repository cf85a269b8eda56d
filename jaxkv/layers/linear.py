"""Projections: the initializer, `linear`, and the weight-layout rule (which weights are stored [out, in] and which
[in, out], `stored_out_in`; the axis orders between the two forms per parameter name)."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv.config import Config
from jaxkv.layers import quantized


def fan_in_init(fan_in: int):
    """Normal(0, 1/sqrt(fan_in)): keeps activations O(1), so random models give varied tokens rather than one
    token repeated forever (which makes token-equality checks meaningless)."""
    return nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


# Weight matrices are stored [in, out] or [out, in], whichever made XLA:CPU's (jax 0.10) decode steps faster,
# measured on whole models (docs/design/families.md, "Weight layout"): [out, in] (the layout of transformers and
# of jaxkv format 1) for matrices of 2**21 elements or more (a "medium" FFN's 1,024 x 2,816, and everything in larger
# models), [in, out] for smaller ones ("small": a batch-1 step 5% faster, batch 2-4 8-24%).
OUT_IN_ELEMENTS = 1 << 21


def stored_out_in(d_in: int, d_out: int, dtype="float32") -> bool:
    """Whether the weight of a d_in -> d_out projection in `dtype` is stored [out, in] (else [in, out])."""
    if jnp.dtype(dtype).itemsize < 4:
        return False
    return d_in * d_out >= OUT_IN_ELEMENTS


# Parameter leaf name -> the axes of its [out, in] form (PyTorch's Linear layout, and every jaxkv weight before
# format 2) in the order of its [in, out] layout: w_in_out = w_out_in.transpose(order). Which weights a config
# stores [in, out] is `in_out_names`; names not listed are the same in both.
OUT_IN_ORDER = {"wq": (2, 0, 1), "wq_gate": (2, 0, 1), "wk": (2, 0, 1), "wv": (2, 0, 1), "wo": (1, 2, 0), "w_gate": (1, 0), "w_up": (1, 0),
                "w_fc": (1, 0), "w_down": (1, 0)}
# MLA's own projections (`jaxkv.layers.mla`; it shares wq [N, qk, D] and wo [D, N, v] above): wq_a [q_rank, D],
# wq_b [N, qk, q_rank], wkv_a [R + E, D]. Kept apart because only MLA configs have them (`jaxkv.sharding` reads
# ALL_OUT_IN_ORDER for its axes). The per-head up-projections wk_b [N, nope, R] and wv_b [N, v, R] are read by
# einsums, never by `linear`, and have one layout.
MLA_OUT_IN_ORDER = {"wq_a": (1, 0), "wq_b": (2, 0, 1), "wkv_a": (1, 0)}
ALL_OUT_IN_ORDER = {**OUT_IN_ORDER, **MLA_OUT_IN_ORDER}


def mla_out_in(config: Config) -> dict[str, bool]:
    """Each MLA projection's `stored_out_in`, decided by its own size."""
    m, D, N, dtype = config.mla, config.d_model, config.n_heads, config.dtype
    sizes = {"wq": (D, N * m.qk_head_dim), "wkv_a": (D, m.row_dim), "wo": (N * m.v_head_dim, D)}
    if m.q_lora_rank is not None:
        sizes |= {"wq_a": (D, m.q_lora_rank), "wq_b": (m.q_lora_rank, N * m.qk_head_dim)}
    return {name: stored_out_in(*size, dtype) for name, size in sizes.items()}


def in_out_names(config: Config) -> frozenset[str]:
    """The parameter names `config` stores [in, out] (the others in ALL_OUT_IN_ORDER: [out, in])."""
    D, F, NH = config.d_model, config.ffn_dim, config.n_heads * config.head_dim
    names, dtype = set(), config.dtype
    if config.mla is not None:
        names |= {name for name, out_in in mla_out_in(config).items() if not out_in}
    elif not stored_out_in(D, NH, dtype):
        names |= {"wq", "wq_gate", "wk", "wv", "wo"}
    if not stored_out_in(D, F, dtype):
        names |= {"w_gate", "w_up", "w_fc"}
    if not stored_out_in(F, D, dtype):
        names.add("w_down")
    return frozenset(names)


@functools.cache
def einsum_repacks_out_in() -> bool:
    """Whether the default backend repacks an [out, in] weight on every one-row einsum: XLA:CPU from jax 0.11
    (its YNNPACK dot; `ynn::transpose_x32` took 28% of a "medium" decode step on jax 0.12.1, 0% on 0.10.2).
    GPU and TPU are not measured, so they keep the einsum."""
    return jax.default_backend() == "cpu" and jax.__version_info__[:2] >= (0, 11)


def linear(x, w, out_in: bool = False):
    """x [B, T, in] times w -> [B, T, out]; w is [in, out], or [out, in] with `out_in` (`stored_out_in`).

    Accumulates in float32 and rounds the result to x's dtype, as PyTorch's bfloat16 matmul does. A quantized w
    (`jaxkv.layers.quantized`) is dequantized to x's dtype first.

    One token of one sequence (B = T = 1, a batch-1 decode step) times a float [out, in] weight of at least
    OUT_IN_ELEMENTS is written as the matrix-vector product w @ x where the einsum would repack the weight
    (`einsum_repacks_out_in`): the same sums, the weight read once ("medium" decoding 22.9 -> 29.3 tok/s on jax
    0.12.1; `scripts/product_variants.py`, "f32 [out,in] w @ x"). On jax 0.10.2 the einsum was as fast or faster,
    and smaller weights gain nothing, so they keep it (docs/design/overview.md, "Versions")."""
    if (out_in and x.shape[0] * x.shape[1] == 1 and not isinstance(w, quantized.QArray)
            and w.size >= OUT_IN_ELEMENTS and einsum_repacks_out_in()):
        y = jnp.dot(w, x.reshape(-1), preferred_element_type=jnp.float32)
        return y.reshape(x.shape[:2] + w.shape[:1]).astype(x.dtype)
    y = quantized.einsum("bti,oi->bto" if out_in else "bti,io->bto", x, w)
    return y.astype(x.dtype)
