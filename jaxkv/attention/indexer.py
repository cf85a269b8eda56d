"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): which cached slots each query attends to.

Per token the indexer caches one key k_s of width Di (`SparseIndexer.head_dim`, stored as the MLA cache's values:
`jaxkv.cache.storage.zeroed_buffers`). A query brings Hi indexer heads q_h and a weight w_h per head, and scores
every live slot s as

    I[s] = sum_h w_h relu(scale q_h . k_s)          (scale = Di ** -0.5; w already holds Hi ** -0.5)

in float32. The query then attends (`jaxkv.attention.mla_reference.sparse_attention`) only to the `topk` live
slots of highest I, all of them when it has no more than `topk`: transformers' `DeepseekV32Indexer` masks dead
slots to -inf and takes top-min(topk, T), which selects the same live slots. Slots that tie exactly at the k-th
score may be picked differently than torch picks them (`jax.lax.top_k` keeps the lower index).

The Hadamard rotation and fp8 scoring of DeepSeek's own kernel are a precision choice (the rotation is orthogonal,
so the scores are the same): as transformers, the scores are computed from the keys as cached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.reference import dot_precision


def scores(q, weights, keys, *, scale: float):
    """I [B, T, S] float32 of T queries over S slots.

    Args:
      q: [B, T, Hi, Di] the indexer's (rotated) queries.
      weights: [B, T, Hi] each head's weight (times Hi ** -0.5).
      keys: [B, S, Di] the indexer keys of the slots (dequantized).
      scale: multiplies q . k before the relu (Di ** -0.5).
    """
    f32 = jnp.float32
    q, keys = q.astype(f32), keys.astype(f32)
    per_head = jnp.einsum("bthd,bsd->bths", q, keys, precision=dot_precision(f32)) * scale
    return jnp.einsum("bth,bths->bts", weights.astype(f32), jax.nn.relu(per_head), precision=dot_precision(f32))


def top_slots(index_scores, live, topk: int):
    """(slots int32[B, T, K], valid bool[B, T, K]) with K = min(topk, S): each query's K highest-scoring slots
    among its live ones (live bool[B, T, S]); `valid` is false on the picks past a query's live slots (a query with
    fewer than K live slots), which attention must mask."""
    K = min(topk, index_scores.shape[-1])
    _, slots = jax.lax.top_k(jnp.where(live, index_scores, -jnp.inf), K)
    return slots.astype(jnp.int32), jnp.take_along_axis(live, slots, axis=-1)


def keep_mask(index_scores, live, topk: int):
    """bool[B, T, S]: `live` restricted to each query's `top_slots` (the mask form, for attention that reads every
    slot anyway: prefill and prompt chunks). With S <= topk it is `live` itself (a caller need not score)."""
    S = live.shape[-1]
    if S <= topk:
        return live
    slots, valid = top_slots(index_scores, live, topk)
    picked = jnp.zeros(live.shape, bool)
    B, T, K = slots.shape
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(T)[None, :, None]
    return picked.at[b, t, slots].set(valid)
