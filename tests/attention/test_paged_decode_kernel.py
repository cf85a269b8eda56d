"""The Pallas paged decode kernel against `paged_reference`, its page skipping, and its lowering.

Both bodies (Mosaic "tpu", Triton "gpu") run in the Pallas interpreter on CPU. Every batch mixes the edge lengths
(0, 1, page - 1, page, page + 1, the whole table), rows share pages (a prefix of row 0's pages, including pages
where one row's slot is live and another's is past its length), and every slot no row may read holds NaN (values,
and scales for quantized pools). Page tables and lengths are traced, so each configuration compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import decode_kernel, pallas, paged_reference
from jaxkv.attention import paged_decode_kernel as pk

# kernels.run: compiled once per argument shapes, at XLA:CPU optimisation level 0. TOLERANCES, keyed by q's dtype, with
# their reasons in helpers.tolerances (the paged kernel shares the contiguous kernel's math; quantized pools give both
# sides the same stored numbers and scales).
from helpers import kernels
# the interpreter on CPU; compiled with JAXKV_PALLAS_COMPILED=1
from helpers.kernels import INTERPRET, PLATFORMS, TOLERANCES, lowered_text

HEADS = {"mha": (2, 2), "gqa": (8, 2), "mqa": (4, 1)}  # (N, K)
H = kernels.PAGED_HEAD_DIM
M = kernels.PAGES_PER_SEQUENCE  # pages per sequence: the groups of 2 or 4 pages below do not divide it
SCALE = 0.3


@functools.lru_cache(maxsize=None)
def _kernel(platform, window, pages_per_block):
    def kernel(q, k, v, table, lengths, k_scale=None, v_scale=None):
        return pk.paged_decode_attention(q, k, v, table, lengths, scale=SCALE, sliding_window=window,
                                         k_scale=k_scale, v_scale=v_scale, platform=platform,
                                         pages_per_block=pages_per_block, interpret=INTERPRET)

    return kernel


@functools.lru_cache(maxsize=None)
def _reference(window):
    def ref(q, k, v, table, lengths, k_scale=None, v_scale=None):
        out = paged_reference.paged_attention(q[:, None], k, v, table, lengths, (lengths - 1)[:, None], scale=SCALE,
                                              sliding_window=window, k_scale=k_scale, v_scale=v_scale)
        return out[:, 0]

    return ref


def _check(platform, window, pages_per_block, q, kv_heads, lengths, page_size, pool_dtype, seed=0):
    """Kernel on the poisoned pool == reference on the clean one, for rows with length >= 1; length-0 rows are 0."""
    table, live, P = kernels.page_layout(lengths, page_size, seed)
    k, v, scales = kernels.page_pool(P, kv_heads, page_size, pool_dtype, np.random.default_rng(seed + 1))
    lengths = jnp.asarray(lengths, jnp.int32)
    bad = [kernels.poison(x, live) for x in (k, v, *scales)]
    out = np.asarray(kernels.run(_kernel(platform, window, pages_per_block), q, *bad[:2], table, lengths, *bad[2:]),
                     np.float32)
    want = np.asarray(kernels.run(_reference(window), q, k, v, table, lengths, *scales), np.float32)
    assert np.isfinite(out).all()
    empty = np.asarray(lengths) == 0
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_allclose(out[~empty], want[~empty], **TOLERANCES[jnp.dtype(q.dtype).name],
                               err_msg=f"lengths={np.asarray(lengths)}")


# (page size, heads, q dtype, pool dtype, window, pages per block {platform: n} or None for the default): page sizes
# 1, 4, 8, 16 and 5 (not a power of two); every head layout; float32, bfloat16, int8 and float8 pools; a window shorter than a long row (its
# pages and, on both platforms, whole groups before the window are skipped) and group sizes that do not divide M.
CASES = [
    (1, "mha", "float32", "float32", None, None),
    (4, "gqa", "bfloat16", "bfloat16", None, None),
    (16, "mqa", "float32", "int8", None, None),
    (8, "gqa", "float32", "float8_e4m3fn", 11, {"tpu": 1, "gpu": 2}),
    (5, "gqa", "float32", "float32", 3, {"tpu": 2, "gpu": 3}),  # GPU: 15 slots, rounded up to 16
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("page_size,heads,dtype,pool_dtype,window,pages_per_block", CASES)
def test_kernel_matches_reference(platform, page_size, heads, dtype, pool_dtype, window, pages_per_block):
    N, K = HEADS[heads]
    q = jnp.asarray(np.random.default_rng(7).normal(size=(6, N, H)), dtype)
    ppb = (pages_per_block or {}).get(platform)
    for seed, lengths in enumerate(kernels.edge_lengths(page_size)):
        _check(platform, window, ppb, q, K, lengths, page_size, pool_dtype, seed)


@functools.lru_cache(maxsize=None)
def _split_kernel(window, splits):
    def kernel(q, k, v, table, lengths, q_slots):
        return pk.paged_decode_attention(q, k, v, table, lengths, q_slots=q_slots, scale=SCALE, sliding_window=window,
                                         platform="gpu", pages_per_block=1, interpret=INTERPRET, splits=splits)

    return kernel


@pytest.mark.skipif("gpu" not in PLATFORMS, reason="the sequence split is the GPU body's (compiled runs on a TPU "
                    "have only the TPU body)")
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("T", [1, 3])
def test_gpu_sequence_splits_match_reference(window, T):
    """The GPU body split over each row's live blocks (flash-decoding): pages of 16, one page per block, so a full
    row of the 5-page table is 5 blocks, shared as 3 + 2 (splits 2), 2 + 2 + 1 (3), 2 + 2 + 1 + an empty split (4),
    and 5 capped to the 5 blocks (8); rows of every edge length (a 0-length row's splits are all empty), NaN in
    every slot no query may read, one query per row or a block of T."""
    page_size, N, K = 16, 8, 2
    lengths = kernels.edge_lengths(page_size)[0]
    table, live_slots, P = kernels.page_layout(lengths, page_size, 11)
    k, v, _ = kernels.page_pool(P, K, page_size, "float32", np.random.default_rng(12))
    lengths = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(np.random.default_rng(13).normal(size=(len(lengths), T, N, H)), jnp.float32)
    q_slots = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
    bad = [kernels.poison(x, live_slots) for x in (k, v)]
    want = np.asarray(kernels.run(_block_reference(window), q, k, v, table, lengths, q_slots), np.float32)
    live = np.asarray(paged_reference.live_mask(lengths, q_slots, M * page_size, window).any(-1))  # [B, T]
    for splits in (2, 3, 4, 8):
        out = np.asarray(kernels.run(_split_kernel(window, splits), q, *bad, table, lengths, q_slots), np.float32)
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out[~live], 0.0)
        np.testing.assert_allclose(out[live], want[live], **TOLERANCES["float32"], err_msg=f"splits={splits}")


# --- several queries per sequence (a speculative verify: T = k + 1) -----------------------------------------------


@functools.lru_cache(maxsize=None)
def _block_kernel(platform, window, pages_per_block):
    def kernel(q, k, v, table, lengths, q_slots, k_scale=None, v_scale=None):
        return pallas.paged_attention(q, k, v, table, lengths, q_slots, scale=SCALE, sliding_window=window,
                                      k_scale=k_scale, v_scale=v_scale, platform=platform,
                                      pages_per_block=pages_per_block, interpret=INTERPRET)

    return kernel


@functools.lru_cache(maxsize=None)
def _block_reference(window):
    def ref(q, k, v, table, lengths, q_slots, k_scale=None, v_scale=None):
        return paged_reference.paged_attention(q, k, v, table, lengths, q_slots, scale=SCALE, sliding_window=window,
                                               k_scale=k_scale, v_scale=v_scale)

    return ref


def _read_by_some_query(table, lengths, q_slots, window, P, page_size):
    """bool[P, page_size]: the pool slots some query of some row may read (the reference's live mask)."""
    live = np.asarray(paged_reference.live_mask(lengths, q_slots, M * page_size, window).any(1))  # [B, S]
    read = np.zeros((P, page_size), bool)
    for b, s in zip(*np.nonzero(live)):
        read[int(table[b, s // page_size]), s % page_size] = True
    return read


# (T, page size, heads, q dtype, pool dtype, window, pages per block {platform: n} or None): T * G rows of 10 and 20
# (GQA 4:1), 5 and 8 (MQA); pages of 4 and 5 slots (a block's queries cross page boundaries); float32, bfloat16 and
# int8 pools; windows shorter than the block's span (queries far apart then leave unread slots between them).
BLOCK_CASES = [
    (5, 4, "gqa", "float32", "float32", None, None),
    (2, 5, "gqa", "float32", "int8", 3, {"tpu": 2, "gpu": 3}),
    (5, 4, "mqa", "bfloat16", "bfloat16", 6, {"tpu": 1, "gpu": 2}),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("T,page_size,heads,dtype,pool_dtype,window,pages_per_block", BLOCK_CASES)
def test_query_block_matches_reference(platform, T, page_size, heads, dtype, pool_dtype, window, pages_per_block):
    """T queries per sequence through `pallas.paged_attention` against the reference: the last T slots of each
    row (the verify's: its K/V written first; short rows' early queries sit before slot 0 and see nothing), and
    arbitrary slots (before, inside and past a row's length, out of order). Every pool slot no query of any row may
    read holds NaN: free pages, shared pages past a row's length, and the slots between far-apart queries'
    windows."""
    N, K = HEADS[heads]
    lengths = kernels.edge_lengths(page_size)[0]
    table, _, P = kernels.page_layout(lengths, page_size, 3)
    k, v, scales = kernels.page_pool(P, K, page_size, pool_dtype, np.random.default_rng(4))
    lengths = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(np.random.default_rng(5).normal(size=(len(lengths), T, N, H)), dtype)
    rng = np.random.default_rng(6)
    ppb = (pages_per_block or {}).get(platform)
    for q_slots in (lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :],
                    jnp.asarray(rng.integers(-1, M * page_size, size=(len(lengths), T)), jnp.int32)):
        read = _read_by_some_query(np.asarray(table), lengths, q_slots, window, P, page_size)
        bad = [kernels.poison(x, read) for x in (k, v, *scales)]
        out = np.asarray(kernels.run(_block_kernel(platform, window, ppb), q, *bad[:2], table, lengths, q_slots,
                                     *bad[2:]), np.float32)
        want = np.asarray(kernels.run(_block_reference(window), q, k, v, table, lengths, q_slots, *scales),
                          np.float32)
        live = np.asarray(paged_reference.live_mask(lengths, q_slots, M * page_size, window).any(-1))  # [B, T]
        assert np.isfinite(out).all() and live.any() and not live.all()
        np.testing.assert_array_equal(out[~live], 0.0)
        np.testing.assert_allclose(out[live], want[live], **TOLERANCES[jnp.dtype(dtype).name],
                                   err_msg=f"q_slots={np.asarray(q_slots)}")


def test_reference_ignores_poison():
    """The spec itself: NaN in every slot no row may read changes nothing (so the kernel tests may compare the
    kernel on a poisoned pool with the reference on a clean one)."""
    page_size, lengths = 4, jnp.asarray([20, 5, 0], jnp.int32)
    table, live, P = kernels.page_layout(list(np.asarray(lengths)), page_size, 0)
    k, v, scales = kernels.page_pool(P, 2, page_size, "float8_e4m3fn", np.random.default_rng(1))
    q = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, H)), jnp.float32)
    ref = _reference(3)
    clean = ref(q, k, v, table, lengths, *scales)
    k_bad, v_bad, *bad_scales = (kernels.poison(x, live) for x in (k, v, *scales))
    poisoned = ref(q, k_bad, v_bad, table, lengths, *bad_scales)
    np.testing.assert_array_equal(clean, poisoned)


def test_dispatch_takes_the_query_slot():
    """`pallas.paged_attention` has the reference's signature (q_slots included: a query need not sit at its row's
    last slot) and refuses more queries per sequence than the decode kernel takes."""
    page_size, lengths = 4, jnp.asarray([17, 9, 3], jnp.int32)
    # The last slot; an earlier one; one past the row's length (it sees slots 0..2 only, not the page's slot 3).
    q_slots = jnp.asarray([[16], [4], [5]], jnp.int32)
    table, _, P = kernels.page_layout(list(np.asarray(lengths)), page_size, 0)
    k, v, _ = kernels.page_pool(P, 2, page_size, "float32", np.random.default_rng(1))
    q = jnp.asarray(np.random.default_rng(2).normal(size=(3, 1, 8, H)), jnp.float32)
    args = (q, k, v, table, lengths, q_slots)
    out = pallas.paged_attention(*args, scale=SCALE, sliding_window=6)
    want = paged_reference.paged_attention(*args, scale=SCALE, sliding_window=6)
    np.testing.assert_allclose(out, want, **TOLERANCES["float32"])
    T = pallas.MAX_DECODE_QUERIES + 1
    with pytest.raises(ValueError, match="at most 16 queries"):
        pallas.paged_attention(jnp.concatenate([q] * T, 1), k, v, table, lengths, jnp.concatenate([q_slots] * T, 1),
                               scale=SCALE)


def _tpu_fetches(lengths, window, *, page_size, pages_per_block, table):
    """Simulates the Mosaic pipeline over the TPU grid of one KV head: the (row, table position, physical page)
    each page input DMAs (a copy only when its index map names another page than at the previous step) and the
    table positions the body folds in unmasked (live steps, positions not clamped)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    lo, hi = pk.paged_live_bounds(lengths, lengths - 1, M_BIG * page_size, window)
    num_groups = -(-M_BIG // pages_per_block)
    fetched, computed, previous = [], [], {}
    for b in range(len(lengths)):
        for j in range(num_groups):
            for i in range(pages_per_block):
                p, position, live = pk._tpu_page(b, j, i, lo, hi, page_size=page_size,
                                                 pages_per_block=pages_per_block, num_groups=num_groups)
                page = int(table[b, int(p)])
                if previous.get(i) != page:
                    fetched.append((b, int(p), page))
                    previous[i] = page
                if live and int(p) == int(position):
                    computed.append((b, int(p)))
    return fetched, computed


M_BIG = 64


@pytest.mark.parametrize("pages_per_block", [1, 3])
def test_reads_only_live_pages(pages_per_block):
    """A 64-page table (1,024 slots) with rows of 100 slots, all 1,024, 0, and 1,024 under a window of 40: the TPU
    index maps name only the rows' live pages (never a -1 entry, nor a page wholly before the window), each live
    page is folded in exactly once, and the GPU loop visits exactly the live groups."""
    page_size, window = 16, None
    table = np.arange(4 * M_BIG).reshape(4, M_BIG)
    table[0, 7:] = -1  # 100 slots: pages 0..6
    table[2, :] = -1
    lengths = [100, 1024, 0, 1024]
    for window, rows, live_pages in ((None, (0, 1, 2), {0: range(7), 1: range(64)}),
                                     (40, (3,), {3: range(61, 64)})):  # slots 984..1023: pages 61..63
        fetched, computed = _tpu_fetches([lengths[r] for r in rows], window, page_size=page_size,
                                         pages_per_block=pages_per_block, table=table[list(rows)])
        expected = sorted((rows.index(r), p) for r, pages in live_pages.items() for p in pages)
        assert sorted(computed) == expected
        empty = [f for f in fetched if lengths[rows[f[0]]] == 0]
        assert len(empty) <= pages_per_block  # an empty row names one page per input, reading nothing else
        fetched = [f for f in fetched if lengths[rows[f[0]]] > 0]
        assert all(page >= 0 and p in live_pages[rows[b]] for b, p, page in fetched)
        assert len({(b, p) for b, p, _ in fetched}) == len(expected)  # every live page, nothing else
    # GPU: the loop runs over the groups holding [lo, hi], the same `block_range` for every row.
    lo, hi = pk.paged_live_bounds(jnp.asarray([100, 1024, 0]), jnp.asarray([99, 1023, -1]), 1024, 40)
    groups = [decode_kernel.block_range(lo[b], hi[b], 4 * page_size) for b in range(3)]
    assert [(int(f), int(c)) for f, c in groups] == [(0, 2), (15, 1), (0, 0)]  # slots 60..99; 984..1023; none


@pytest.mark.parametrize("pool,page_size,T", [("float32", 16, 1), ("int8", 5, 1), ("bfloat16", 1, 1),
                                             ("int8", 5, 5), ("bfloat16", 16, 5), ("float8_e4m3fn", 8, 1)])
@pytest.mark.parametrize("platform,lowering_platform,custom_call",
                         [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_for_device(platform, lowering_platform, custom_call, pool, page_size, T):
    """Compiled (interpret=False) kernels lower to Mosaic / Triton IR from this host: the whole Pallas lowering
    (block-shape rules, gather loads, scalar-prefetched index maps), not the device compiler. 1-slot bfloat16 pages
    on TPU take the float32-matmul path (`paged_decode_attention`). T = 5: a verify's query block (per-row bounds
    and, under the window, each query's value bounds). float8 pools: the masked loads' fill value is cast in
    Triton's lowering, which has no integer -> float8 cast (the compiled GPU run of session 19 failed there)."""
    B, N, K, Hd, P, Mt = 2, 8, 2, 128, 64, 8
    dtype = jnp.bfloat16 if pool == "bfloat16" else jnp.float32
    shapes = [((B, N, Hd) if T == 1 else (B, T, N, Hd), dtype), ((P, K, page_size, Hd), pool),
              ((P, K, page_size, Hd), pool), ((B, Mt), jnp.int32), ((B,), jnp.int32)]
    if pool in ("int8", "float8_e4m3fn"):
        shapes += [((P, K, page_size), jnp.float32)] * 2
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    f = jax.jit(functools.partial(_lowering_target, platform=platform))
    text = lowered_text(f, args, lowering_platform)
    assert f"stablehlo.custom_call @{custom_call}" in text


def _lowering_target(q, k, v, table, lengths, k_scale=None, v_scale=None, *, platform):
    return pk.paged_decode_attention(q, k, v, table, lengths, scale=SCALE, sliding_window=48, k_scale=k_scale,
                                     v_scale=v_scale, platform=platform, interpret=False)
