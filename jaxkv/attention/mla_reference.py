"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent cache: the plain-XLA spec.

Per token and layer an MLA model caches one row of R + E values: the normalized latent c (R = kv_lora_rank)
followed by the rotated key k_rope (E = qk_rope_head_dim) that every head shares. Head n's key and value would be

    k_n = [W_UK[n] c ; k_rope]      v_n = W_UV[n] c

but decode never forms them. Absorbing W_UK into the query (q_lat[n] = W_UK[n]^T q_nope[n]) turns the score into a
dot with the cached row itself, and the value up-projection commutes with the weighted sum:

    score[n, s] = q_lat[n] . c_s + q_rope[n] . k_rope_s = q[n] . row_s        with q[n] = [q_lat[n] ; q_rope[n]]
    out[n]      = W_UV[n] sum_s p[n, s] v_s = W_UV[n] (sum_s p[n, s] c_s)

So MLA decode is multi-query attention with one KV head of width R + E whose values are the first R columns of
the same row: every head reads each cached row once, and nothing per head is ever of cache length. This module
computes the latent-space output sum_s p[n, s] c_s; the caller applies W_UV and the output projection.

The masking rule (which slots a query may see), the ring layout and the int8/fp8 per-slot scales are those of
`jaxkv.attention.reference` (its module docstring), with the one KV head's axis dropped.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.attention.reference import (MASKED, MIN_PREFIX, decode_prefix, dot_precision, softmax, live_mask,
                                      prefix_lengths)


def attention(q, latent, start, q_offset, *, latent_dim: int, scale: float, latent_scale=None,
              sliding_window: int | None = None, ring: bool = False, min_prefix: int | None = MIN_PREFIX):
    """Absorbed multi-head latent attention of T queries over S cached latent rows.

    Args:
      q: [B, T, N, R + E] queries in latent space: each head's absorbed no-position part (R) then its rotated
        position part (E), for slots [q_offset, q_offset + T).
      latent: [B, S, R + E] the cache: per slot the normalized latent (R) then the rotated shared key (E).
      start: int32[B], each sequence's first live slot. q_offset: int32[], the slot of the first query.
      latent_dim: R (the values are latent[..., :R]).
      scale: multiplies the scores (DeepSeek: qk_head_dim ** -0.5, times the YaRN mscale squared).
      latent_scale: float32[B, S] dequantization scales of an int8/fp8 cache (one per slot), else None.
      sliding_window, ring, min_prefix: as in `jaxkv.attention.reference.attention`. Decode (T == 1) reads the
        shortest cache prefix holding every live slot, as there, in the same broadcast-and-reduce form (which
        reads the just-updated cache buffer in place: the einsum form below made XLA:CPU copy a float32 latent
        buffer several times per layer and step); min_prefix=None, T > 1 or a bfloat16/float16 cache is the plain
        formula (`full_attention`).

    Returns:
      [B, T, N, R] float32: each head's attention output in latent space, before the value up-projection.
    """
    B, T, N, C = q.shape
    S = latent.shape[1]
    if latent.shape != (B, S, C) or not 0 < latent_dim < C:
        raise ValueError(f"latent {latent.shape} does not fit queries {q.shape} with latent_dim {latent_dim}")
    # A 16-bit cache keeps the plain formula: the reduce form multiplies in the cache's dtype (as the GQA reference
    # does for 16-bit K/V), which would round the float32 latent-space query to 16 bits first.
    sixteen_bit = latent_scale is None and latent.dtype != jnp.float32
    if T == 1 and min_prefix is not None and not sixteen_bit:
        # Multi-query attention with one KV head of width R + E whose values are its first R columns.
        rows = latent[:, None]  # [B, 1, S, R + E]
        row_scale = None if latent_scale is None else latent_scale[:, None]  # [B, 1, S]
        # The values are the whole rows and the output's last E columns are dropped: slicing the values out
        # of the buffer (rows[..., :R]) made XLA:CPU copy that slice of every layer's cache each step (~1 ms of
        # a 16 ms step at 4k slots, scripts/profile_decode.py --config mla-twin); E / (R + E) more multiply-adds
        # in the weighted sum cost less than that copy.
        out = decode_prefix(q.reshape(B, 1, N, C), rows, rows, start, q_offset, scale,
                             sliding_window, row_scale, row_scale, ring, prefix_lengths(S, min_prefix))
        return out.reshape(B, 1, N, C)[..., :latent_dim].astype(jnp.float32)
    return full_attention(q, latent, start, q_offset, latent_dim=latent_dim, scale=scale, latent_scale=latent_scale,
                          sliding_window=sliding_window, ring=ring)


def full_attention(q, latent, start, q_offset, *, latent_dim: int, scale: float, latent_scale=None,
                   sliding_window: int | None = None, ring: bool = False):
    """`attention` over every one of the S slots, dead ones masked: the plain formula, whatever T."""
    B, T, N, C = q.shape
    S = latent.shape[1]
    rows = latent.astype(jnp.float32)
    if latent_scale is not None:
        rows = rows * latent_scale[..., None].astype(jnp.float32)
    live = live_mask(start, q_offset, T, S, sliding_window, ring)  # [B, T, S]
    precision = dot_precision(q.dtype)
    scores = jnp.einsum("btnc,bsc->bnts", q.astype(jnp.float32), rows, precision=precision) * scale
    weights = softmax(jnp.where(live[:, None], scores, MASKED))  # [B, N, T, S]
    # A dead slot's weight is exactly 0, but 0 x NaN is NaN: dead rows are zeroed, so garbage there cannot leak.
    values = jnp.where(live[:, :, :, None].any(axis=1), rows[..., :latent_dim], 0.0)  # [B, S, R]
    return jnp.einsum("bnts,bsr->btnr", weights, values, precision=precision)


def sparse_attention(q, latent, slots, valid, *, latent_dim: int, scale: float, latent_scale=None):
    """Absorbed latent attention of each query over only its own K slots (DeepSeek-V3.2's top-k, chosen by
    `jaxkv.attention.indexer.top_slots`): the K rows are gathered, so a query reads K rows, not S.

    Args:
      q: [B, T, N, R + E] queries in latent space, as `attention`'s.
      latent: [B, S, R + E] the cache. slots: int32[B, T, K] the slots each query reads; valid: bool[B, T, K]
        which of them it may see (picks past its live slots are masked).
      latent_scale: float32[B, S] dequantization scales of an int8/fp8 cache, else None.

    Returns:
      [B, T, N, R] float32, as `attention`'s; a query with no valid slot gets zeros.
    """
    B, T, N, C = q.shape
    if latent.ndim != 3 or latent.shape[0] != B or latent.shape[2] != C or not 0 < latent_dim < C:
        raise ValueError(f"latent {latent.shape} does not fit queries {q.shape} with latent_dim {latent_dim}")
    if slots.shape[:2] != (B, T) or valid.shape != slots.shape:
        raise ValueError(f"slots {slots.shape} / valid {valid.shape} are not [{B}, {T}, K]")
    K = slots.shape[2]
    flat = slots.reshape(B, T * K)
    rows = jnp.take_along_axis(latent, flat[..., None], axis=1).reshape(B, T, K, C).astype(jnp.float32)
    if latent_scale is not None:
        rows = rows * jnp.take_along_axis(latent_scale, flat, axis=1).reshape(B, T, K, 1).astype(jnp.float32)
    return gathered_attention(q, rows, valid, latent_dim=latent_dim, scale=scale)


def gathered_attention(q, rows, valid, *, latent_dim: int, scale: float):
    """`sparse_attention` over rows already gathered per query: rows float32[B, T, K, R + E] (dequantized),
    valid bool[B, T, K] -> [B, T, N, R] float32. The paged cache gathers its rows through the page table."""
    # An invalid pick may be a slot never written (garbage or NaN): its row is zeroed, its score masked.
    rows = jnp.where(valid[..., None], rows, 0.0)
    precision = dot_precision(q.dtype)
    scores = jnp.einsum("btnc,btkc->btnk", q.astype(jnp.float32), rows, precision=precision) * scale
    # A query with no valid slot spreads its weight over zeroed rows: its output is zeros.
    weights = softmax(jnp.where(valid[:, :, None, :], scores, MASKED))  # [B, T, N, K]
    return jnp.einsum("btnk,btkr->btnr", weights, rows[..., :latent_dim], precision=precision)
