"""DeepSeek-V3.2's sparse attention references: the lightning indexer (`jaxkv.attention.indexer`: scores, top_slots,
keep_mask) and the top-k latent attention over the picked slots (`mla_reference.sparse_attention`, the paged
`paged_mla.sparse_paged_mla_attention`, and `paged_mla.paged_mla_attention`'s `keep` mask).

Each is checked against a float64 numpy loop of its definition: the indexer's scores sum_h w_h relu(scale q_h . k_s);
the picks are each query's min(topk, S) best live slots (dead slots scored above every live one, so that ignoring
`live` would fail); attention is a softmax over exactly the picked live slots, zeros for a query with none. NaN sits
in every slot (row or int8 scale) no query may read, in the contiguous cache and in the pages. Last, the compiled
decode's FLOP count does not grow with the cache (it reads K rows, not S), while the dense formula's does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import indexer, mla_reference, paged_mla, paged_reference, reference
from jaxkv.cache import quantize

from helpers.tolerances import atol

# float32 results against float64 loops over a few dozen O(1) terms: ~1e-6 apart; 1e-5 leaves margin and is far
# below what a wrong pick moves (a dropped or extra slot changes an output by O(0.1)).
BY_HAND = dict(atol=1e-5, rtol=1e-5)
ATOL_PAGED = atol("paged vs contiguous")  # the same rows gathered through a page table
ATOL_SAME = atol("attention reference")  # the same reference, by another route

B, N, R, E, TOPK = 2, 4, 16, 8, 8
C = R + E
SCALE = C ** -0.5


def _np_scores(q, w, k, scale):
    q, w, k = (np.asarray(x, np.float64) for x in (q, w, k))
    out = np.zeros((q.shape[0], q.shape[1], k.shape[1]))
    for b, t, s in np.ndindex(out.shape):
        out[b, t, s] = sum(w[b, t, h] * max(0.0, scale * q[b, t, h] @ k[b, s]) for h in range(q.shape[2]))
    return out


def _np_picks(index_scores, live, topk):
    """[B][T] -> the set of slots each query reads: its min(topk, S) best live slots (all of them if fewer)."""
    sc, live = np.asarray(index_scores), np.asarray(live)
    K = min(topk, sc.shape[-1])
    return [[set(sorted(np.flatnonzero(live[b, t]), key=lambda s: -sc[b, t, s])[:K]) for t in range(sc.shape[1])]
            for b in range(sc.shape[0])]


def _np_attend(q, rows, reads, latent_dim, scale):
    """float64 softmax of q [B, T, N, C] over rows [B, S, C] at the slots reads[b][t] (a set); zeros if empty."""
    q, rows = np.asarray(q, np.float64), np.asarray(rows, np.float64)
    out = np.zeros(q.shape[:3] + (latent_dim,))
    for b, t, n in np.ndindex(q.shape[:3]):
        s = np.array(sorted(reads[b][t]), int)
        if len(s):
            logits = rows[b, s] @ q[b, t, n] * scale
            p = np.exp(logits - logits.max())
            out[b, t, n] = (p / p.sum()) @ rows[b, s, :latent_dim]
    return out


def _scores_dead_first(rng, live):
    """Distinct random index scores, every dead slot's above every live one (a pick that ignored `live` shows)."""
    live = np.asarray(live)
    sc = rng.permutation(live.size).reshape(live.shape).astype(np.float32) / live.size
    return jnp.asarray(np.where(live, sc, sc + 10.0))


def test_scores_equal_the_weighted_relu_sum():
    rng = np.random.default_rng(0)
    T, S, Hi, Di = 3, 12, 4, 16
    q = rng.normal(size=(B, T, Hi, Di)).astype(np.float32)
    w = rng.normal(size=(B, T, Hi)).astype(np.float32)  # both signs
    k = rng.normal(size=(B, S, Di)).astype(np.float32)
    got = np.asarray(indexer.scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), scale=Di ** -0.5))
    assert got.shape == (B, T, S) and got.dtype == np.float32
    np.testing.assert_allclose(got, _np_scores(q, w, k, Di ** -0.5), **BY_HAND)
    assert (got < 0).any() and (got > 0).any()


# (start, q_offset, T, S): left padding; queries with fewer live slots than TOPK, one with none; S <= TOPK.
LIVE_CASES = [([0, 5], 9, 3, 32), ([0, 10], 9, 3, 32), ([0, 20], 31, 1, 32), ([2, 4], 5, 2, 6)]


@pytest.mark.parametrize("start, q_offset, T, S", LIVE_CASES)
def test_top_slots_are_each_querys_best_live_slots(start, q_offset, T, S):
    live = reference.live_mask(jnp.asarray(start, jnp.int32), jnp.int32(q_offset), T, S)
    sc = _scores_dead_first(np.random.default_rng(S + T), live)
    slots, valid = indexer.top_slots(sc, live, TOPK)
    K = min(TOPK, S)
    assert slots.shape == valid.shape == (B, T, K) and slots.dtype == jnp.int32
    slots, valid, want = np.asarray(slots), np.asarray(valid), _np_picks(sc, live, TOPK)
    for b, t in np.ndindex(B, T):
        n_live = int(np.asarray(live)[b, t].sum())
        assert set(slots[b, t][valid[b, t]]) == want[b][t], (b, t)
        assert valid[b, t].tolist() == [i < min(n_live, K) for i in range(K)], (b, t)  # false exactly past them
        if n_live <= K:
            assert want[b][t] == set(np.flatnonzero(np.asarray(live)[b, t]))


@pytest.mark.parametrize("start, q_offset, T, S", LIVE_CASES)
def test_keep_mask_is_the_top_slots_scattered(start, q_offset, T, S):
    live = reference.live_mask(jnp.asarray(start, jnp.int32), jnp.int32(q_offset), T, S)
    sc = _scores_dead_first(np.random.default_rng(S), live)
    want = np.zeros((B, T, S), bool)
    for b, t in np.ndindex(B, T):
        want[b, t, sorted(_np_picks(sc, live, TOPK)[b][t])] = True
    np.testing.assert_array_equal(np.asarray(indexer.keep_mask(sc, live, TOPK)), want)
    if S <= TOPK:  # live as it is, whatever the scores
        np.testing.assert_array_equal(np.asarray(indexer.keep_mask(jnp.full(sc.shape, jnp.nan), live, TOPK)), live)


def _int8(latent):
    """latent [B, S, C] -> (int8 rows [B, S, C], float32 scales [B, S]) via the cache's quantize."""
    stored, scale = quantize(jnp.asarray(latent)[:, None], "int8")
    return np.asarray(stored[:, 0]), np.asarray(scale[:, 0])


def _poison_unread(x, slots, valid):
    """x [B, S, ...] float with NaN in every slot no query validly reads."""
    read = np.zeros(x.shape[:2], bool)
    for b in range(x.shape[0]):
        read[b, np.asarray(slots)[b][np.asarray(valid)[b]]] = True
    return np.where(read.reshape(read.shape + (1,) * (x.ndim - 2)), x, np.nan).astype(x.dtype)


@pytest.mark.parametrize("start, q_offset, T", [([0, 7], 31, 1), ([0, 10], 9, 3)])  # 2nd: 0, 1, 2 live slots
def test_sparse_attention_is_a_softmax_over_the_picked_slots(start, q_offset, T):
    S = 32
    rng = np.random.default_rng(T)
    q = rng.normal(size=(B, T, N, C)).astype(np.float32)
    latent = rng.normal(size=(B, S, C)).astype(np.float32)
    live = reference.live_mask(jnp.asarray(start, jnp.int32), jnp.int32(q_offset), T, S)
    sc = _scores_dead_first(rng, live)
    slots, valid = indexer.top_slots(sc, live, TOPK)
    reads = _np_picks(sc, live, TOPK)
    kw = dict(latent_dim=R, scale=SCALE)
    got = mla_reference.sparse_attention(jnp.asarray(q), jnp.asarray(_poison_unread(latent, slots, valid)), slots,
                                         valid, **kw)
    assert got.shape == (B, T, N, R) and np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), _np_attend(q, latent, reads, R, SCALE), **BY_HAND)
    # the picks matter: the dense formula over every live slot is far from it
    dense = mla_reference.full_attention(jnp.asarray(q), jnp.asarray(latent), jnp.asarray(start, jnp.int32),
                                         jnp.int32(q_offset), **kw)
    assert np.abs(np.asarray(dense) - np.asarray(got)).max() > 100 * BY_HAND["atol"]
    empty = [(b, t) for b, t in np.ndindex(B, T) if not reads[b][t]]
    assert empty == ([] if T == 1 else [(1, 0)])  # the T = 3 case holds a query with no live slot: zeros
    for b, t in empty:
        np.testing.assert_array_equal(np.asarray(got)[b, t], 0.0)
    # int8 rows with per-slot scales (NaN scales where unread) against the same math on the dequantized rows
    stored, scales = _int8(latent)
    got8 = mla_reference.sparse_attention(jnp.asarray(q), jnp.asarray(stored), slots, valid,
                                          latent_scale=jnp.asarray(_poison_unread(scales, slots, valid)), **kw)
    want8 = _np_attend(q, stored.astype(np.float64) * scales[..., None], reads, R, SCALE)
    np.testing.assert_allclose(np.asarray(got8), want8, **BY_HAND)


def _lay_out(contiguous, lengths, ps, P, M, seed=0):
    """contiguous [B, S, ...] -> (pool [P, 1, ps, ...] with each sequence's first lengths[b] slots on pages in a
    shuffled order (the same for the same seed) and NaN (0 in an int8 pool) everywhere else, page table [B, M] with
    -1 past the used pages)."""
    fill = np.nan if contiguous.dtype.kind == "f" else 0
    pool = np.full((P, 1, ps) + contiguous.shape[2:], fill, contiguous.dtype)
    table = np.full((len(lengths), M), -1, np.int32)
    free = list(np.random.default_rng(seed).permutation(P))
    for b, n in enumerate(lengths):
        for e in range(-(-n // ps)):
            table[b, e] = free.pop()
            used = min(ps, n - e * ps)
            pool[table[b, e], 0, :used] = contiguous[b, e * ps:e * ps + used]
    return pool, table


@pytest.mark.parametrize("T, fresh", [(1, False), (3, False), (3, True)])
def test_paged_keep_mask_restricts_the_softmax(T, fresh):
    rng = np.random.default_rng(10 + T + fresh)
    lengths, ps, M, P = np.array([22, 13]), 4, 7, 16  # M x ps = 28 slots; entry 6 is -1 for both
    S = M * ps
    rows = rng.normal(size=(B, S, C)).astype(np.float32)
    q = rng.normal(size=(B, T, N, C)).astype(np.float32)
    q_slots = (lengths[:, None] - T + np.arange(T)).astype(np.int32)
    kw = dict(latent_dim=R, scale=SCALE)
    if fresh:  # the chunk's rows are fresh: the pages hold only the slots before it (NaN from the chunk on)
        own = rng.normal(size=(B, T, C)).astype(np.float32)
        chunk_valid = np.array([[True] * T, [True] * (T - 1) + [False]])
        pool, table = _lay_out(rows, lengths - T, ps, P, M)
        kw["fresh"] = (jnp.asarray(own), jnp.asarray(chunk_valid))
        live = np.zeros((B, T, S + T), bool)
        for b, t in np.ndindex(B, T):
            live[b, t, :q_slots[b, 0]] = True
            live[b, t, S:] = chunk_valid[b] & (np.arange(T) <= t)
        all_rows = np.concatenate([rows, own], axis=1)
    else:
        pool, table = _lay_out(rows, lengths, ps, P, M)
        live = np.asarray(paged_reference.live_mask(jnp.asarray(lengths), jnp.asarray(q_slots), S))
        all_rows = rows
    args = (jnp.asarray(q), jnp.asarray(pool), jnp.asarray(table), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(q_slots))
    dense = paged_mla.paged_mla_attention(*args, **kw)
    np.testing.assert_allclose(paged_mla.paged_mla_attention(*args, keep=jnp.ones(live.shape, bool), **kw), dense,
                               atol=ATOL_SAME, rtol=0)
    keep = np.asarray(indexer.keep_mask(_scores_dead_first(rng, live), jnp.asarray(live), 6))
    assert (live & ~keep).any()  # the mask drops live slots: the comparison below tests it
    got = paged_mla.paged_mla_attention(*args, keep=jnp.asarray(keep), **kw)
    reads = [[set(np.flatnonzero(live[b, t] & keep[b, t])) for t in range(T)] for b in range(B)]
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), _np_attend(q, all_rows, reads, R, SCALE), **BY_HAND)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("T", [1, 3])
def test_sparse_paged_equals_sparse_contiguous(T, cache_dtype):
    rng = np.random.default_rng(20 + T)
    lengths, ps, M, P = np.array([30, 6]), 4, 9, 20  # sequence 1 has fewer live slots than TOPK: invalid picks
    S = M * ps
    latent = rng.normal(size=(B, S, C)).astype(np.float32)
    q = jnp.asarray(rng.normal(size=(B, T, N, C)).astype(np.float32))
    q_slots = jnp.asarray(lengths[:, None] - T + np.arange(T), jnp.int32)
    live = paged_reference.live_mask(jnp.asarray(lengths, jnp.int32), q_slots, S)
    slots, valid = indexer.top_slots(_scores_dead_first(rng, live), live, TOPK)
    assert not np.asarray(valid).all()
    kw = dict(latent_dim=R, scale=SCALE)
    if cache_dtype == "int8":
        stored, scales = _int8(latent)
        pool, table = _lay_out(stored, lengths, ps, P, M)
        scale_pool, _ = _lay_out(scales, lengths, ps, P, M)  # the same pages: NaN scales wherever nothing was written
        got = paged_mla.sparse_paged_mla_attention(q, jnp.asarray(pool), jnp.asarray(table), slots, valid,
                                                   latent_scale=jnp.asarray(scale_pool), **kw)
        want = mla_reference.sparse_attention(q, jnp.asarray(stored), slots, valid, latent_scale=jnp.asarray(scales),
                                              **kw)
    else:
        pool, table = _lay_out(latent, lengths, ps, P, M)
        got = paged_mla.sparse_paged_mla_attention(q, jnp.asarray(pool), jnp.asarray(table), slots, valid, **kw)
        want = mla_reference.sparse_attention(q, jnp.asarray(latent), slots, valid, **kw)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL_PAGED, rtol=0)


def _flops(f, *shapes):
    cost = jax.jit(f).lower(*(jax.ShapeDtypeStruct(*s) for s in shapes)).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_sparse_decode_work_does_not_grow_with_the_cache():
    """Decode (T = 1, K = 64) over 4,096 and 16,384 slots: the compiled sparse attention (contiguous and paged)
    does the same FLOPs, the K gathered rows' (its "bytes accessed" would grow: XLA counts a gather's whole operand),
    while the dense formula's grow about 4x (so the count does see the cache's length)."""
    K, ps = 64, 64
    q, picks = ((B, 1, N, C), jnp.float32), [((B, 1, K), jnp.int32), ((B, 1, K), bool)]
    kw = dict(latent_dim=R, scale=SCALE)
    sparse, paged, dense = [], [], []
    for S in (4096, 16384):
        sparse.append(_flops(lambda q, l, s, v: mla_reference.sparse_attention(q, l, s, v, **kw),
                             q, ((B, S, C), jnp.float32), *picks))
        paged.append(_flops(lambda q, p, t, s, v: paged_mla.sparse_paged_mla_attention(q, p, t, s, v, **kw),
                            q, ((B * S // ps, 1, ps, C), jnp.float32), ((B, S // ps), jnp.int32), *picks))
        dense.append(_flops(lambda q, l: mla_reference.full_attention(q, l, jnp.zeros(B, jnp.int32),
                                                                      jnp.int32(S - 1), **kw),
                            q, ((B, S, C), jnp.float32)))
    assert sparse[0] > 2 * B * N * K * C  # at least the K rows' scores: the count is of the attention
    assert abs(sparse[1] - sparse[0]) <= 0.01 * sparse[0], sparse
    assert abs(paged[1] - paged[0]) <= 0.01 * paged[0], paged
    assert 3.5 < dense[1] / dense[0] < 4.5, dense
    assert dense[0] > 10 * sparse[0], (dense, sparse)
