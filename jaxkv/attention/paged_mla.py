"""Multi-head latent attention over a paged, keys-only latent cache: the plain-XLA path (no Pallas kernel yet).

An MLA model's `PagedKVCache` holds one pool per layer of latent rows, [P, 1, page_size, R + E] (letters as in
`jaxkv.shapes`; R = kv_lora_rank, E = qk_rope_head_dim): per slot the normalized latent c then the rotated shared
key, no value pools. As for the contiguous latent cache (`jaxkv.attention.mla`), absorbed decode is multi-query
attention with one KV head of width R + E whose values are the first R columns of the same row; here the rows are
read through the page table. Slots, lengths and masking are `jaxkv.attention.paged_reference`'s: sequence b holds
slots [0, lengths[b]), no left padding, and the query in slot q sees slot s when s <= q, s < lengths[b] and
(with a window) q - s < sliding_window. Dead slots may hold anything, NaN included: their scores are replaced by a
finite negative and their rows selected away before the weighted sum. A prompt chunk (`fresh`) reads its own
latent rows as computed and the pages only before the chunk, as `jaxkv.attention.paged_reference` describes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.paged_reference import before_chunk, fresh_mask, gather_pages, live_mask
from jaxkv.attention.mla_reference import gathered_attention
from jaxkv.attention.reference import MASKED, MIN_PREFIX, dot_precision, softmax, prefix_lengths


def _check(q, latent_pages, page_table, latent_dim, latent_scale):
    B, T, N, C = q.shape
    if latent_pages.ndim != 4 or latent_pages.shape[1] != 1 or latent_pages.shape[3] != C:
        raise ValueError(f"latent pages {latent_pages.shape} are not [P, 1, page_size, {C}] for queries {q.shape}")
    if not 0 < latent_dim < C:
        raise ValueError(f"latent_dim {latent_dim} must be in (0, {C}) for rows of width {C}")
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table {page_table.shape} is not [{B}, M]")
    if latent_scale is not None and latent_scale.shape != latent_pages.shape[:3]:
        raise ValueError(f"latent_scale {latent_scale.shape} is not {latent_pages.shape[:3]}")


def paged_mla_attention(q, latent_pages, page_table, lengths, q_slots, *, latent_dim: int, scale: float,
                        sliding_window: int | None = None, latent_scale=None, fresh=None, keep=None):
    """Absorbed latent attention of T queries per sequence over the sequence's pages of latent rows.

    Args:
      q: [B, T, N, R + E] queries in latent space (each head's absorbed no-position part, then its rotated
        position part); query t of sequence b sits in slot q_slots[b, t].
      latent_pages: [P, 1, page_size, R + E] the layer's pool (`PagedKVCache.keys[layer]` of an MLA config).
      page_table: int32[B, M], the pages of each sequence in slot order (-1: none).
      lengths: int32[B], slots written per sequence (the queries' own rows included).
      q_slots: int32[B, T].
      latent_dim: R (the values are the rows' first R columns).
      scale: multiplies the scores.
      sliding_window: if set, a query sees only the `sliding_window` most recent slots, itself included.
      latent_scale: float32[P, 1, page_size] dequantization scales of an int8/fp8 pool, else None.
      fresh: None, or (rows [B, T, R + E], valid bool[B, T]): the queries are a prompt chunk and these its own
        latent rows as computed (row t in slot q_slots[b, t], stored where valid): the pages are read only for
        the slots before each row's chunk, q_slots[b, 0].
      keep: None, or bool[B, T, S] (S = M x page_size, + T with `fresh`: the chunk's own rows last): the slots
        each query may read at most (DeepSeek-V3.2's top-k selection, `jaxkv.attention.indexer.keep_mask`).

    Returns:
      [B, T, N, R] float32: each head's output in latent space, before the value up-projection. A query with no
      live slot gets zeros.
    """
    _check(q, latent_pages, page_table, latent_dim, latent_scale)
    rows = gather_pages(latent_pages, page_table)[:, 0].astype(jnp.float32)  # [B, S, R + E], S = M x page_size
    if latent_scale is not None:
        rows = rows * gather_pages(latent_scale, page_table)[:, 0, :, None]
    live = live_mask(lengths, q_slots, rows.shape[1], sliding_window)  # [B, T, S]
    if fresh is not None:  # the chunk's own rows after the pages' slots before it
        own, valid = fresh
        live = before_chunk(live, jnp.arange(rows.shape[1], dtype=jnp.int32)[None, None, :], q_slots)
        rows = jnp.concatenate([rows, own.astype(jnp.float32)], axis=1)  # [B, S + T, R + E]
        live = jnp.concatenate([live, fresh_mask(q_slots, valid, sliding_window)], axis=2)
    if keep is not None:
        if keep.shape != live.shape:
            raise ValueError(f"keep {keep.shape} is not {live.shape} (the pages' slots, then a chunk's own)")
        live &= keep
    precision = dot_precision(jnp.float32)  # float32 products, as the contiguous reference (not TF32 on a GPU)
    scores = jnp.einsum("btnc,bsc->bnts", q.astype(jnp.float32), rows, precision=precision) * scale  # [B, N, T, S]
    weights = softmax(jnp.where(live[:, None], scores, MASKED))
    # A dead slot's weight is exactly 0, but 0 x NaN is NaN: dead rows are selected away, so garbage cannot leak.
    values = jnp.where(jnp.any(live, axis=1)[..., None], rows[..., :latent_dim], 0.0)  # [B, S, R]
    return jnp.einsum("bnts,bsr->btnr", weights, values, precision=precision)


def live_paged_mla_attention(q, latent_pages, page_table, lengths, q_slots, *, latent_dim: int, scale: float,
                             sliding_window: int | None = None, latent_scale=None,
                             min_prefix: int | None = MIN_PREFIX, fresh=None):
    """`paged_mla_attention` reading only the first m table entries of every sequence, m the shortest of a few
    static lengths (`reference.prefix_lengths`, so at most 1.5x what the longest sequence needs) that holds every
    sequence's written slots (with `fresh`, the slots before each chunk): one `lax.switch` branch per length. A
    decode step then costs what the batch's longest live sequence needs, not the table's full length (no query
    may read a page past every length)."""
    _check(q, latent_pages, page_table, latent_dim, latent_scale)
    ps = latent_pages.shape[2]
    M = page_table.shape[1]
    pages = sorted({min(M, -(-n // ps)) for n in prefix_lengths(M * ps, min_prefix)})
    kwargs = dict(latent_dim=latent_dim, scale=scale, sliding_window=sliding_window)

    def branch(m):
        def attend(q, latent_pages, latent_scale, page_table, lengths, q_slots, fresh):
            return paged_mla_attention(q, latent_pages, page_table[:, :m], lengths, q_slots,
                                       latent_scale=latent_scale, fresh=fresh, **kwargs)
        return attend

    args = (q, latent_pages, latent_scale, page_table, lengths, q_slots, fresh)
    if len(pages) == 1:
        return branch(M)(*args)
    read = lengths if fresh is None else q_slots[:, 0]  # a chunk reads its pages only before its own slots
    needed = (jnp.max(read) + ps - 1) // ps  # table entries the longest sequence uses
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(pages, jnp.int32), needed.astype(jnp.int32)), len(pages) - 1)
    return jax.lax.switch(index, [branch(m) for m in pages], *args)


def gather_slots(pages, page_table, slots):
    """A pool [P, 1, page_size, ...] read at each query's own slots (int32[B, T, K], sequence slots, any page
    table entry; -1 entries read page 0, for the caller to mask) -> [B, T, K, ...]: only those rows are read."""
    ps = pages.shape[2]
    B, T, K = slots.shape
    entry = jnp.clip(slots // ps, 0, page_table.shape[1] - 1).reshape(B, T * K)
    page = jnp.maximum(jnp.take_along_axis(page_table, entry, axis=1), 0).reshape(B, T, K)
    return pages[page, 0, slots % ps]


def sparse_paged_mla_attention(q, latent_pages, page_table, slots, valid, *, latent_dim: int, scale: float,
                               latent_scale=None):
    """`jaxkv.attention.mla_reference.sparse_attention` over a paged pool: each query reads only its K slots
    (int32[B, T, K], sequence slots; valid bool[B, T, K] which it may see), gathered through the page table.
    -> [B, T, N, R] float32."""
    _check(q, latent_pages, page_table, latent_dim, latent_scale)
    if slots.shape[:2] != q.shape[:2] or valid.shape != slots.shape:
        raise ValueError(f"slots {slots.shape} / valid {valid.shape} are not [{q.shape[0]}, {q.shape[1]}, K]")
    rows = gather_slots(latent_pages, page_table, slots).astype(jnp.float32)  # [B, T, K, R + E]
    if latent_scale is not None:
        rows = rows * gather_slots(latent_scale, page_table, slots)[..., None]
    return gathered_attention(q, rows, valid, latent_dim=latent_dim, scale=scale)
