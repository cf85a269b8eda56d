"""Paged attention in plain jax.numpy: the specification the paged Pallas kernel is tested against.

A paged cache (`jaxkv.paged_cache.PagedKVCache`) keeps each layer's keys and values in a pool of pages,
`[P, K, page_size, H]` (letters as in `jaxkv.shapes`; P pages). Sequence b's token slot s lives in page
`page_table[b, s // page_size]` at offset `s % page_size`; sequences that share a prefix share its pages. Sequence
b holds `lengths[b]` slots, [0, lengths[b]); there is no left padding, every sequence starts at slot (and position)
0. A query in slot q of sequence b may attend to key slot s when

    s <= q and s < lengths[b]                (written, and not in the future)
    and q - s < sliding_window               (if there is a window)
    and s // chunk == q // chunk             (if attention is chunked: `reference`'s chunk, slots being positions)

Page-table entries a sequence does not use are -1 and never read for a live slot. Pages past a sequence's length
(free pages, another sequence's pages, a partly written last page) may hold anything, NaN included: dead keys are
masked with a finite negative and dead values are selected away (never multiplied by a zero weight, 0 x NaN = NaN).
Quantized pools (int8, float8_e4m3fn) pass `k_scale`, `v_scale` [P, K, page_size] and are dequantized as read.
Computes in float32 whatever the pool dtype. `softcap` (Gemma 2's attention-logit soft-capping) caps the scaled
scores before masking, as in `reference` (`reference.soft_cap`); `sinks` (gpt-oss's attention sinks, float32[N])
join each softmax's denominator, as in `reference`.

A prompt chunk (`fresh`): the queries are a chunk of new tokens continuing their sequences (the engine's chunked
prefill, a prompt's suffix after a prefix-cache hit). They then attend over the pages only for the slots before
the chunk, as stored (quantized in an int8/fp8 pool), and over the chunk's own keys and values as computed, causally:
as a whole prompt's prefill attends over its fresh K/V, so a prompt prefilled in one chunk reads nothing quantized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.reference import (MASKED, MIN_PREFIX, softmax, check_chunk, check_sinks, check_softcap,
                                      dequantize, dot_precision, grouped_sinks, prefix_lengths, same_chunk, soft_cap)


def gather_pages(pages, page_table):
    """A pool [P, K, page_size, ...] read through a page table int32[B, M] -> [B, K, M * page_size, ...]: each
    sequence's slots in order. Entries of -1 read page 0 (whatever it holds is masked by the caller)."""
    B, M = page_table.shape
    g = pages[jnp.maximum(page_table, 0)]  # [B, M, K, page_size, ...]
    g = jnp.moveaxis(g, 2, 1)  # [B, K, M, page_size, ...]
    return g.reshape(B, g.shape[1], M * g.shape[3], *g.shape[4:])


def live_mask(lengths, q_slots, num_slots: int, sliding_window: int | None = None, chunk: int | None = None):
    """bool[B, T, S]: which of a sequence's S slots the query in slot q_slots[b, t] may attend to."""
    s = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    q = q_slots[:, :, None]  # [B, T, 1]
    live = (s <= q) & (s < lengths[:, None, None])
    if sliding_window is not None:
        live &= s > q - sliding_window
    if chunk is not None:
        live &= same_chunk(s, q, chunk)
    return live


def fresh_mask(q_slots, valid, sliding_window: int | None = None, chunk: int | None = None):
    """bool[B, T, T]: which of the chunk's own fresh keys (key t in slot q_slots[b, t], stored where valid[b, t])
    the query in slot q_slots[b, t'] may attend to."""
    qs, ks = q_slots[:, :, None], q_slots[:, None, :]
    live = valid[:, None, :] & (ks <= qs)
    if sliding_window is not None:
        live &= ks > qs - sliding_window
    if chunk is not None:
        live &= same_chunk(ks, qs, chunk)
    return live


def before_chunk(live, slot, q_slots):
    """A pages' live mask [B, T, S] (slot [.., S] the sequence slot of each) cut to the slots before the chunk."""
    return live & (slot < q_slots[:, :1, None])


def paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, scale: float,
                    sliding_window: int | None = None, k_scale=None, v_scale=None, softcap: float | None = None,
                    fresh=None, sinks=None, chunk: int | None = None):
    """Softmax attention of T queries per sequence over the sequence's pages.

    Args:
      q: [B, T, N, H] queries; query t of sequence b sits in slot q_slots[b, t].
      k_pages, v_pages: [P, K, page_size, H] pools, K dividing N; query head n reads KV head n // (N // K).
      page_table: int32[B, M], the pages of each sequence in slot order (-1: none).
      lengths: int32[B], slots written per sequence (the queries' own K/V included).
      q_slots: int32[B, T].
      scale: multiplies q.k.
      sliding_window: if set, a query sees only the `sliding_window` most recent slots, itself included.
      k_scale, v_scale: float32[P, K, page_size] scales of an int8/fp8 pool, else None.
      softcap: if set, each scaled score s becomes softcap * tanh(s / softcap) before masking (Gemma 2); None: off.
      fresh: None, or (k, v [B, K, T, H], valid bool[B, T]): the queries are a prompt chunk and these its own keys
        and values as computed (key t in slot q_slots[b, t], stored where valid): the pages are read only for the
        slots before each row's chunk, q_slots[b, 0] (module docstring).
      sinks: float32[N], one logit per query head in each softmax's denominator (`reference`), or None.
      chunk: if set, a query sees only the earlier slots of its own chunk of `chunk` slots (Llama 4), or None.

    Returns:
      [B, T, N, H] in q's dtype. A query with no live slot gets a uniform average of zeros: finite.
    """
    B, T, N, H = q.shape
    softcap = check_softcap(softcap)
    K = k_pages.shape[1]
    sinks = grouped_sinks(check_sinks(sinks, N), K)  # [K, G]
    chunk = check_chunk(chunk)
    k = dequantize(gather_pages(k_pages, page_table), None if k_scale is None else gather_pages(k_scale, page_table))
    v = dequantize(gather_pages(v_pages, page_table), None if v_scale is None else gather_pages(v_scale, page_table))
    live = live_mask(lengths, q_slots, k.shape[2], sliding_window, chunk)  # [B, T, S]
    if fresh is not None:  # the chunk's own keys and values after the pages' slots before it
        fresh_k, fresh_v, valid = fresh
        live = before_chunk(live, jnp.arange(k.shape[2], dtype=jnp.int32)[None, None, :], q_slots)
        k = jnp.concatenate([k, fresh_k.astype(jnp.float32)], axis=2)
        v = jnp.concatenate([v, fresh_v.astype(jnp.float32)], axis=2)
        live = jnp.concatenate([live, fresh_mask(q_slots, valid, sliding_window, chunk)], axis=2)  # [B, T, S + T]
    written = jnp.any(live, axis=1)  # [B, S]: some query reads the slot
    v = jnp.where(written[:, None, :, None], v, 0.0)  # dead values selected away, NaN included
    # (dead keys need no select: their scores are replaced by MASKED, NaN or not)
    precision = dot_precision(q.dtype)
    qg = q.astype(jnp.float32).reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    scores = soft_cap(jnp.einsum("btkgh,bksh->bkgts", qg, k, precision=precision) * scale, softcap)  # [B,K,G,T,S]
    weights = softmax(jnp.where(live[:, None, None], scores, MASKED), None if sinks is None else sinks[:, :, None])
    out = jnp.einsum("bkgts,bksh->btkgh", weights, v, precision=precision)  # [B, T, K, G, H]
    return out.reshape(B, T, N, H).astype(q.dtype)


def pool_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, scale: float,
                   sliding_window: int | None = None, k_scale=None, v_scale=None, softcap: float | None = None,
                   fresh=None, sinks=None, chunk: int | None = None):
    """`paged_attention` computed over the whole pool at once, each query masked to its own sequence's slots.

    Same arguments (`fresh` included) and result. Instead of gathering each sequence's pages (B x M pages read and
    copied), every query is scored against every page of the pool and a page counts for a sequence only where its page table
    names it. A page shared by many sequences (the prompt of N samples, a beam's prefix) is then read once per
    step, not once per sequence, at the price of B x more (cheap) multiply-adds and of reading free pages too: the
    better choice when the pool is not much larger than what the batch holds (`prefers_pool`).
    """
    B, T, N, H = q.shape
    softcap = check_softcap(softcap)
    P, K, ps = k_pages.shape[:3]
    M = page_table.shape[1]
    sinks = grouped_sinks(check_sinks(sinks, N), K)
    row_sinks = None if sinks is None else sinks[:, :, None]  # [K, G, 1]: against [B, K, G, T]
    chunk = check_chunk(chunk)
    # entry[b, p]: the table entry of page p in sequence b, -1 if b does not hold p. (A sequence never holds a
    # page twice; -1 table entries scatter out of range and are dropped.)
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, M))
    entries = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32)[None, :], (B, M))
    entry = jnp.full((B, P), -1, jnp.int32).at[rows, jnp.where(page_table >= 0, page_table, P)].set(
        entries, mode="drop")
    slot = entry[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)  # [B, P, ps]: the sequence slot held there
    slot = jnp.where(entry[:, :, None] >= 0, slot, jnp.iinfo(jnp.int32).max).reshape(B, 1, P * ps)
    qs = q_slots[:, :, None]  # [B, T, 1]
    live = (slot <= qs) & (slot < lengths[:, None, None])  # [B, T, P * ps]
    if sliding_window is not None:
        live &= slot > qs - sliding_window
    if chunk is not None:
        live &= same_chunk(slot, qs, chunk)
    if fresh is not None:
        live = before_chunk(live, slot, q_slots)
    k = dequantize(k_pages, k_scale)  # [P, K, ps, H]
    v = dequantize(v_pages, v_scale)
    read = jnp.any(live, axis=(0, 1)).reshape(P, 1, ps, 1)  # slots some query reads; the rest selected away
    k, v = (jnp.where(read, x, 0.0) for x in (k, v))
    precision = dot_precision(q.dtype)
    qg = q.astype(jnp.float32).reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,pksh->bkgtps", qg, k, precision=precision)
    scores = soft_cap(scores.reshape(B, K, N // K, T, P * ps) * scale, softcap)
    scores = jnp.where(live[:, None, None], scores, MASKED)
    if fresh is None:
        weights = softmax(scores, row_sinks).reshape(B, K, N // K, T, P, ps)
        out = jnp.einsum("bkgtps,pksh->btkgh", weights, v, precision=precision)  # [B, T, K, G, H]
        return out.reshape(B, T, N, H).astype(q.dtype)
    # A prompt chunk: one softmax over the pool's slots before the chunk and the chunk's own fresh K/V.
    fresh_k, fresh_v, valid = (x.astype(jnp.float32) if x.dtype != bool else x for x in fresh)
    own = jnp.einsum("btkgh,bksh->bkgts", qg, fresh_k, precision=precision)
    own = soft_cap(own * scale, softcap)  # [B, K, G, T, T]
    own = jnp.where(fresh_mask(q_slots, valid, sliding_window, chunk)[:, None, None], own, MASKED)
    weights = softmax(jnp.concatenate([scores, own], axis=-1), row_sinks)
    pool_w, own_w = weights[..., :P * ps].reshape(B, K, N // K, T, P, ps), weights[..., P * ps:]
    out = (jnp.einsum("bkgtps,pksh->btkgh", pool_w, v, precision=precision)
           + jnp.einsum("bkgts,bksh->btkgh", own_w, fresh_v, precision=precision))
    return out.reshape(B, T, N, H).astype(q.dtype)


def live_paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, scale: float,
                         sliding_window: int | None = None, k_scale=None, v_scale=None,
                         min_prefix: int | None = MIN_PREFIX, softcap: float | None = None, fresh=None,
                         sinks=None, chunk: int | None = None):
    """`paged_attention` reading only the first m table entries of every sequence, m the shortest of a few
    static lengths (`reference.prefix_lengths` in slots, so at most 1.5x what the longest sequence needs) that
    holds every sequence's written slots (with `fresh`, the slots before each chunk): one `lax.switch` branch per
    length. A decode step then costs what the batch's longest live sequence needs, not the table's full length (a
    page past every length holds nothing any query may read)."""
    ps = k_pages.shape[2]
    M = page_table.shape[1]
    pages = sorted({min(M, -(-n // ps)) for n in prefix_lengths(M * ps, min_prefix)})
    kwargs = dict(scale=scale, sliding_window=sliding_window, softcap=check_softcap(softcap), chunk=check_chunk(chunk))
    sinks = check_sinks(sinks, q.shape[2])

    def branch(m):
        def attend(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, q_slots, fresh, sinks):
            return paged_attention(q, k_pages, v_pages, page_table[:, :m], lengths, q_slots, k_scale=k_scale,
                                   v_scale=v_scale, fresh=fresh, sinks=sinks, **kwargs)
        return attend

    if len(pages) == 1:
        return paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, k_scale=k_scale, v_scale=v_scale,
                               fresh=fresh, sinks=sinks, **kwargs)
    read = lengths if fresh is None else q_slots[:, 0]  # a chunk reads its pages only before its own slots
    needed = (jnp.max(read) + ps - 1) // ps  # table entries the longest sequence uses
    index = jnp.searchsorted(jnp.asarray(pages, jnp.int32), needed.astype(jnp.int32))
    index = jnp.minimum(index, len(pages) - 1)
    return jax.lax.switch(index, [branch(m) for m in pages], q, k_pages, v_pages, k_scale, v_scale, page_table,
                          lengths, q_slots, fresh, sinks)


def ragged_paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, scale: float,
                           sliding_window: int | None = None, k_scale=None, v_scale=None,
                           min_prefix: int | None = MIN_PREFIX, softcap: float | None = None,
                           sinks=None, chunk: int | None = None):
    """`paged_attention` for one query per sequence (T == 1) reading only the pages each sequence uses.

    The batch's used table entries, ceil(lengths[b] / page_size) of row b, are laid end to end in one list of C
    entries, C the shortest of a few static sizes (`reference.prefix_lengths` of the whole table, in pages: at
    most 1.5x the total in use) that holds them all: one `lax.switch` branch per size. Those pages are gathered
    once ([C, K, page_size, H]), each scored against its own sequence's query, and each sequence's softmax is
    taken over its entries with segment reductions (max, then sums of weights and of weighted values). A batch of
    ragged sequences then reads what its sequences hold, not B x its longest one (the engine's slots hold prompts
    of 16 to 1,024 tokens side by side). Same arguments and result as `paged_attention`, T == 1; a sequence with
    no live slot gets zeros.
    """
    B, T, N, H = q.shape
    if T != 1:
        raise ValueError(f"ragged_paged_attention takes one query per sequence, got {T}")
    softcap = check_softcap(softcap)
    P, K, ps, _ = k_pages.shape
    M = page_table.shape[1]
    sinks = grouped_sinks(check_sinks(sinks, N), K)  # [K, G]
    chunk = check_chunk(chunk)
    used = jnp.minimum((lengths + ps - 1) // ps, M).astype(jnp.int32)  # [B] table entries in use
    ends = jnp.cumsum(used)  # [B]: row b's entries are [ends[b] - used[b], ends[b]) of the list
    sizes = sorted({min(B * M, -(-n // ps)) for n in prefix_lengths(B * M * ps, min_prefix)})

    def branch(C):
        def attend(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, q_slots):
            i = jnp.arange(C, dtype=jnp.int32)
            owner = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # [C]: the row of entry i
            valid = owner < B  # past the batch's last used entry: nothing
            owner = jnp.minimum(owner, B - 1)
            entry = i - (ends[owner] - used[owner])  # [C]: its index in the row's table
            page = jnp.maximum(jnp.where(valid, page_table[owner, jnp.clip(entry, 0, M - 1)], 0), 0)
            k = dequantize(k_pages[page], None if k_scale is None else k_scale[page])  # [C, K, ps, H]
            v = dequantize(v_pages[page], None if v_scale is None else v_scale[page])
            slot = entry[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]  # [C, ps]
            qs = q_slots[owner, 0][:, None]
            live = valid[:, None] & (slot <= qs) & (slot < lengths[owner][:, None])  # [C, ps]
            if sliding_window is not None:
                live &= slot > qs - sliding_window
            if chunk is not None:
                live &= same_chunk(slot, qs, chunk)
            v = jnp.where(live[:, None, :, None], v, 0.0)  # dead values selected away, NaN included
            qg = q[owner, 0].astype(jnp.float32).reshape(C, K, N // K, H)  # [C, K, G, H]
            scores = soft_cap(jnp.einsum("ckgh,cksh->ckgs", qg, k, precision=dot_precision(q.dtype)) * scale, softcap)
            scores = jnp.where(live[:, None, None, :], scores, MASKED)  # [C, K, G, ps]
            segment = dict(segment_ids=owner, num_segments=B, indices_are_sorted=True)
            top = jax.ops.segment_max(jnp.max(scores, axis=-1), **segment)  # [B, K, G]; -inf: no entries
            top = jnp.where(jnp.isfinite(top), top, 0.0)
            if sinks is not None:  # the sink joins each row's max and denominator (`reference.softmax`)
                top = jnp.maximum(top, sinks)
            weights = jnp.exp(scores - top[owner][..., None])  # dead: exp(MASKED - max) == 0
            total = jax.ops.segment_sum(jnp.sum(weights, axis=-1), **segment)  # [B, K, G]
            if sinks is not None:
                total = total + jnp.exp(sinks - top)
            out = jnp.einsum("ckgs,cksh->ckgh", weights, v, precision=dot_precision(q.dtype))
            out = jax.ops.segment_sum(out, **segment)  # [B, K, G, H]
            out = out / jnp.where(total > 0, total, 1.0)[..., None]
            return out.reshape(B, 1, N, H).astype(q.dtype)

        return attend

    index = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), ends[-1]), len(sizes) - 1)
    return jax.lax.switch(index, [branch(C) for C in sizes], q, k_pages, v_pages, k_scale, v_scale, page_table,
                          lengths, q_slots)


# Scoring every page of the pool for every sequence costs about 3x a gather of the same number of slots on CPU
# (measured: the engine's decode step, 16 sequences over a 1,024-page pool, 0.47 s through the pool against
# 0.14 s gathering each sequence's 64 pages): the pool pays off only when it is several times smaller.
POOL_COST = 3


def prefers_pool(num_pages: int, batch: int, max_pages: int) -> bool:
    """Whether `pool_attention` is the cheaper formulation: the pool's pages (weighted by POOL_COST) against the
    batch's table entries (both static shapes). Pays off when many sequences share most of their pages."""
    return POOL_COST * num_pages <= batch * max_pages


def xla_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, scale: float,
                  sliding_window: int | None = None, k_scale=None, v_scale=None, softcap: float | None = None,
                  fresh=None, sinks=None, chunk: int | None = None):
    """The paged kind's XLA implementation (`jaxkv.attention.api`): `paged_attention`'s arguments and result, in
    whichever formulation reads less, chosen from static shapes: the whole pool once (`pool_attention`: shared pages
    read once per step), else for one query per sequence only the pages in use, end to end (`ragged_paged_attention`),
    else each table's live prefix (`live_paged_attention`; a prompt chunk with `fresh` too)."""
    kwargs = dict(scale=scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, softcap=softcap,
                  sinks=sinks, chunk=chunk)
    if prefers_pool(k_pages.shape[0], *page_table.shape):
        return pool_attention(q, k_pages, v_pages, page_table, lengths, q_slots, fresh=fresh, **kwargs)
    if q.shape[1] == 1 and fresh is None:
        return ragged_paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, **kwargs)
    return live_paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, fresh=fresh, **kwargs)
