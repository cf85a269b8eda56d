"""The Pallas attention kernels against the XLA reference, their block skipping, and their lowering.

Cache variants: float caches of the query's dtype or another one (bfloat16 / float16 under float32 queries),
int8 and float8_e4m3fn caches with per-slot scales (quantized with `jaxkv.cache.quantize`, so the kernel and the
reference see the very same stored numbers), and ring caches (decode only).

On CPU the kernels run in the Pallas interpreter, both bodies (Mosaic "tpu" and Triton "gpu"). With
JAXKV_PALLAS_COMPILED=1 (set by scripts/device_check.py on a GPU or TPU machine) they run compiled, the device's
body only. Start slots and q_offset are traced arguments, so each kernel configuration compiles once and is then
checked at many live lengths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import decode_kernel, pallas, prefill_kernel, reference
from jaxkv.attention import paged_decode_kernel as pk

from helpers import kernels
from helpers.kernels import BLOCKS, INTERPRET, PLATFORMS, S, TOLERANCES, lowered_text


@functools.lru_cache(maxsize=None)
def _kernel(platform, window, ring=False, **knobs):
    knobs = {**BLOCKS[platform], **knobs}

    def kernel(q, k, v, start, q_offset, k_scale=None, v_scale=None):
        return pallas.attention(q, k, v, start, q_offset, scale=0.125, sliding_window=window, k_scale=k_scale,
                                v_scale=v_scale, ring=ring, platform=platform, interpret=INTERPRET, **knobs)

    return kernel


@functools.lru_cache(maxsize=None)
def _reference(window, ring=False, softcap=None):
    def ref(q, k, v, start, q_offset, k_scale=None, v_scale=None):
        return reference.attention(q, k, v, start, q_offset, scale=0.125, sliding_window=window, k_scale=k_scale,
                                   v_scale=v_scale, ring=ring, softcap=softcap)

    return ref


def _check(platform, window, q, k, v, start, q_offset, *, scales=(), ring=False, expected_from=None, softcap=None,
           **knobs):
    """Kernel vs reference on rows with at least one live key; every output finite. `scales`: (k_scale, v_scale)
    of a quantized cache. `expected_from`: (k, v, *scales) to compute the reference from instead (the clean cache
    of a poisoned one)."""
    start, q_offset = jnp.asarray(start, jnp.int32), jnp.int32(q_offset)
    if softcap is not None:
        knobs["softcap"] = softcap
    out = np.asarray(kernels.run(_kernel(platform, window, ring, **knobs), q, k, v, start, q_offset, *scales), np.float32)
    ref_cache = expected_from or (k, v, *scales)
    want = np.asarray(kernels.run(_reference(window, ring, softcap), q, *ref_cache[:2], start, q_offset,
                                  *ref_cache[2:]), np.float32)
    T, num_slots = q.shape[1], k.shape[2]
    has_live = np.asarray(reference.live_mask(start, q_offset, T, num_slots, window, ring).any(-1))  # [B, T]
    assert np.isfinite(out).all(), "non-finite output (a fully masked row must give 0, not NaN)"
    # Rows with no live key are unspecified by the reference; the kernels document 0 for them.
    np.testing.assert_array_equal(out[~has_live], 0.0)
    assert has_live.any()
    np.testing.assert_allclose(out[has_live], want[has_live], **TOLERANCES[jnp.dtype(q.dtype).name],
                               err_msg=f"start={np.asarray(start)} q_offset={int(q_offset)}")
    return out, has_live


# --- decode (T == 1) -----------------------------------------------------------------------------------------

# (heads, head dim, dtype, batch, window, splits): every value of every axis appears, and MHA and GQA each meet
# both head dims and both dtypes (the full product would cost minutes of interpreter compiles; MQA's H = 128 is in
# the prefill cases). splits=None is the platform default (GPU: several; TPU: 1).
DECODE_CASES = [
    ("mha", 64, "float32", 3, None, None),
    ("gqa", 128, "bfloat16", 1, None, None),
    ("mqa", 64, "bfloat16", 3, None, 2),
    ("gqa", 64, "float32", 3, 50, 2),
    ("mha", 128, "bfloat16", 3, 129, 3),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("heads,H,dtype,B,window,splits", DECODE_CASES)
def test_decode_matches_reference(platform, heads, H, dtype, B, window, splits):
    q, k, v, _ = kernels.inputs(B, 1, heads, H, dtype)
    check = functools.partial(_check, platform, window, q, k, v, decode_splits=splits)
    bk = BLOCKS[platform]["decode_block_k"]
    # Live lengths 1, block-1, block, block+1 and the whole cache, starting at slot 0 (block-aligned).
    for length in (1, bk - 1, bk, bk + 1, S):
        check(np.zeros(B, np.int32), length - 1)
    # The same lengths ending at a block-unaligned last slot, and ragged rows in one batch.
    for q_offset in (S - 1, bk + 7):
        for lengths in ((1, bk, q_offset + 1), (bk + 1, bk - 1, 2)):
            check(q_offset + 1 - np.array(lengths[:B]), q_offset)
    if B > 1:  # a row with no live slot at all (start past the query) must come out finite
        _, has_live = check([0, bk + 1, 5], bk)
        assert not has_live[1].any()


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_ignores_poisoned_dead_slots(platform):
    """NaN in every slot outside [start, q_offset] (left padding, the unwritten tail, whole blocks of both) must
    not change the output: dead blocks are never read and dead slots of read blocks are masked."""
    B, q_offset = 3, 200
    start = np.array([37, 0, 150])
    q, k, v, _ = kernels.inputs(B, 1, "gqa", 64, "float32")
    slot = np.arange(S)
    dead = (slot[None, :] < start[:, None]) | (slot[None, :] > q_offset)  # [B, S]
    poison = jnp.asarray(dead)[:, None, :, None]
    k_bad, v_bad = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    _check(platform, 50, q, k_bad, v_bad, start, q_offset, expected_from=(k, v), decode_splits=2)
    _check(platform, None, q, k_bad, v_bad, start, q_offset, expected_from=(k, v))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_large_logits_are_stable(platform):
    q, k, v, _ = kernels.inputs(3, 1, "gqa", 64, "float32")
    # Scores in the thousands: exp overflows unless the running max is subtracted. The window and splits of the
    # GQA float32 decode case, so that this reuses its compiled kernel (the window leaves 50 live slots a row).
    _check(platform, 50, q * 40.0, k * 40.0, v, [0, 10, 250], S - 1, decode_splits=2)


# (cache dtype, query dtype, window, splits): each quantized format under float32 queries (tolerance 1e-5: both
# sides read the same stored numbers and scales), int8 under bfloat16 queries (the bf16 matmul path: int8 values are
# exact in bfloat16), and float caches of a narrower dtype than the queries.
QUANTIZED_CASES = [
    ("int8", "float32", None, None),
    ("float8_e4m3fn", "float32", 50, 2),
    ("int8", "bfloat16", 129, 3),
    ("bfloat16", "float32", None, None),
    ("float16", "float32", 50, None),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("cache_dtype,dtype,window,splits", QUANTIZED_CASES)
def test_decode_cache_dtypes_match_reference(platform, cache_dtype, dtype, window, splits):
    q, k, v, scales = kernels.inputs(3, 1, "gqa", 64, dtype, cache_dtype=cache_dtype)
    # The kernels compute in float32 on the stored 16-bit numbers; the XLA reference rounds its products to the
    # cache dtype (a workaround for XLA:CPU, reference._decode). Compare with the exact math on the same numbers.
    exact = (k.astype(jnp.float32), v.astype(jnp.float32)) if not scales and k.dtype != jnp.float32 else None
    check = functools.partial(_check, platform, window, q, k, v, scales=scales, decode_splits=splits,
                              expected_from=exact)
    bk = BLOCKS[platform]["decode_block_k"]
    for q_offset in (bk, bk + 7, S - 1):
        check(q_offset + 1 - np.array([1, bk, q_offset + 1]), q_offset)  # ragged: 1 slot, a block, everything
    check([0, 0, 0], 0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_quantized_ignores_poisoned_dead_slots(platform):
    """NaN scales (int8 values cannot be NaN) in every dead slot: a dead slot's scale must not reach the output,
    through its score (masked after scaling) or its probability (zeroed after scaling)."""
    B, q_offset = 3, 200
    start = np.array([37, 0, 150])
    q, k, v, (k_scale, v_scale) = kernels.inputs(B, 1, "gqa", 64, "float32", cache_dtype="int8")
    slot = np.arange(S)
    dead = jnp.asarray((slot[None, :] < start[:, None]) | (slot[None, :] > q_offset))[:, None, :]  # [B, 1, S]
    bad_scales = jnp.where(dead, jnp.nan, k_scale), jnp.where(dead, jnp.nan, v_scale)
    _check(platform, 50, q, k, v, start, q_offset, scales=bad_scales, expected_from=(k, v, k_scale, v_scale),
           decode_splits=2)


# --- decode over a ring cache --------------------------------------------------------------------------------

S_RING = 200  # a ring of S = window slots: not a multiple of either platform's decode block


# (cache dtype, window, splits): window = S is what a sliding-window model allocates; window < S checks the
# window and the ring bound separately.
RING_CASES = [("float32", S_RING, None), ("int8", S_RING, 2), ("float32", 150, 3)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("cache_dtype,window,splits", RING_CASES)
def test_decode_ring_matches_reference(platform, cache_dtype, window, splits):
    q, k, v, scales = kernels.inputs(3, 1, "gqa", 64, "float32", num_slots=S_RING, cache_dtype=cache_dtype)
    for start, q_offset in kernels.ring_offsets(S_RING):
        _check(platform, window, q, k, v, start, q_offset, scales=scales, ring=True, decode_splits=splits)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_ring_ignores_poisoned_dead_slots(platform):
    """NaN values and NaN scales of a float8 ring (float8_e4m3fn has a NaN) at every index the query may not see:
    the never-written tail of a fresh ring, slots older than a row's start, slots older than the window."""
    window = 150
    q, k, v, (k_scale, v_scale) = kernels.inputs(3, 1, "gqa", 64, "float32", num_slots=S_RING,
                                          cache_dtype="float8_e4m3fn")
    for start, q_offset in kernels.ring_offsets(S_RING)[::3]:
        live = reference.live_mask(jnp.asarray(start), q_offset, 1, S_RING, window, ring=True)[:, 0]  # [B, S]
        dead = ~live[:, None, :]  # [B, 1, S]
        assert dead.any()
        k_bad, v_bad = (jnp.where(dead[..., None], jnp.nan, x).astype(x.dtype) for x in (k, v))
        bad_scales = jnp.where(dead, jnp.nan, k_scale), jnp.where(dead, jnp.nan, v_scale)
        _check(platform, window, q, k_bad, v_bad, start, q_offset, scales=bad_scales, ring=True,
               expected_from=(k, v, k_scale, v_scale), decode_splits=2)


def test_decode_ring_visits_every_block():
    """A ring's live indices wrap, so its TPU grid (and GPU loop) covers every block exactly once, whatever the
    live bounds; the mask does the rest."""
    block_k, num_slots, splits = 128, 1000, 3
    num_blocks = -(-num_slots // block_k)
    lo, hi = decode_kernel.live_bounds(np.array([0, 2990, 3005]), 3004, num_slots, None, ring=True)
    assert list(np.asarray(hi)) == [4] * 3 and list(np.asarray(lo)) == [4 - 999, 4 - 14, 5]  # last row: none live
    _, computed = _tpu_decode_fetches(lo, hi, num_slots=num_slots, block_k=block_k, splits=splits, ring=True)
    assert sorted(computed) == [(b, blk) for b in range(3) for blk in range(num_blocks)]


def _tpu_decode_fetches(lo, hi, *, num_slots, block_k, splits, ring=False):
    """Simulates the Mosaic pipeline over the decode grid of one KV head: the K blocks it DMAs (it copies a block
    only when the index map names a different one than at the previous step) and the blocks the body computes."""
    num_blocks = -(-num_slots // block_k)
    lo_ref, hi_ref = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    fetched, computed, previous = [], [], None
    for b in range(len(lo)):
        for split in range(splits):
            for j in range(-(-num_blocks // splits)):
                block, live = decode_kernel.tpu_step_block(b, split, j, lo_ref, hi_ref, block_k=block_k,
                                                            splits=splits, num_blocks=num_blocks, ring=ring)
                if (b, int(block)) != previous:
                    fetched.append((b, int(block)))
                    previous = (b, int(block))
                if live:
                    computed.append((b, int(block)))
    return fetched, computed


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_reads_only_live_blocks(splits):
    """max_len 4096 with 100 live tokens: the work is two blocks, not 4096 / block_k (TPU index map and GPU loop
    bounds, the very functions the kernels call)."""
    block_k, num_slots = 128, 4096
    start = np.array([1000, 0, 3000])
    lo, hi = decode_kernel.live_bounds(start, 1099, num_slots, None)  # row 0: 100 live slots, in blocks 7 and 8
    live_blocks = {b: set(range(int(lo[b]) // block_k, int(hi[b]) // block_k + 1)) for b in range(3) if lo[b] <= hi[b]}
    assert live_blocks[0] == {7, 8} and len(live_blocks[1]) == 9 and 2 not in live_blocks

    fetched, computed = _tpu_decode_fetches(lo, hi, num_slots=num_slots, block_k=block_k, splits=splits)
    expected = sorted((b, blk) for b, blocks in live_blocks.items() for blk in blocks)
    assert sorted(computed) == expected  # each live block computed exactly once
    # DMAs: the live blocks, plus one clamped block for the row with none (its index map must name some block).
    assert sorted(f for f in fetched if f[0] != 2) == expected and len([f for f in fetched if f[0] == 2]) == 1

    # GPU: each split loops over [first + begin, first + end): the shares tile the live blocks exactly.
    for b in range(3):
        first, count = decode_kernel.block_range(lo[b], hi[b], block_k)
        loaded = []
        for split in range(splits):
            begin, end = decode_kernel.split_share(count, splits, split)
            loaded += range(int(first + begin), int(first + end))
        assert sorted(loaded) == sorted(live_blocks.get(b, ()))


# --- decode over a query block (a speculative verify: T = k + 1 queries, causal within the block) -------------

# (heads, head dim, q dtype, cache dtype, T, window, softcap, splits): GQA 4:1 with T * G = 20 rows (TPU: 24, GPU:
# 32 padded), MHA with T = 2, int8 and bfloat16 caches, a window, a cap, splits; each compiles once per platform.
QUERY_BLOCK_CASES = [
    ("gqa", 64, "float32", "float32", 5, None, None, None),
    ("gqa", 64, "float32", "int8", 5, 50, 2.0, 2),
    ("mha", 128, "bfloat16", "bfloat16", 2, 129, None, 3),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("heads,H,dtype,cache_dtype,T,window,softcap,splits", QUERY_BLOCK_CASES)
def test_query_block_matches_reference(platform, heads, H, dtype, cache_dtype, T, window, softcap, splits):
    """T queries per sequence through `pallas.attention` (the decode kernel, each row masked by its own slot)
    against the reference: blocks crossed by the queries, ragged starts (a row whose first queries see nothing,
    one whose only live slots are the block's own), the last slots of the cache, and NaN in every slot no query
    of the block may see."""
    q, k, v, scales = kernels.inputs(3, T, heads, H, dtype, cache_dtype=cache_dtype, seed=5)
    exact = (k.astype(jnp.float32), v.astype(jnp.float32)) if not scales and k.dtype != q.dtype else None
    check = functools.partial(_check, platform, window, q, k, v, scales=scales, expected_from=exact,
                              softcap=softcap, decode_splits=splits)
    bk = BLOCKS[platform]["decode_block_k"]
    for q_offset in (bk - 2, 2 * bk - 1, S - T):  # the block's queries straddle a key block boundary, or end at S
        check([0, q_offset + 1, q_offset - 40], q_offset)  # row 1: the first query sees nothing, the rest 1..T-1
        check([q_offset, q_offset + T - 1, q_offset + T], q_offset)  # own slots only; the last only; none at all
    if cache_dtype == "float32":
        start, q_offset = np.array([37, 0, 150]), 200
        slot = np.arange(S)[None, :]
        dead = jnp.asarray((slot < start[:, None]) | (slot > q_offset + T - 1))[:, None, :, None]
        check_nan = functools.partial(_check, platform, window, q, jnp.where(dead, jnp.nan, k),
                                      jnp.where(dead, jnp.nan, v), expected_from=(k, v), decode_splits=splits)
        check_nan(start, q_offset)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_query_block_over_a_ring_matches_reference(platform):
    """The reference's ring formula for T > 1 (each query's index-to-slot map): fresh, wrapped and steady-state
    rings with ragged starts, an int8 ring under a window of S - T + 1 (the largest the reference's ring formula
    is the attention for: no query overwrote a slot an earlier one sees)."""
    T = 5
    q, k, v, scales = kernels.inputs(3, T, "gqa", 64, "float32", num_slots=S_RING, cache_dtype="int8", seed=6)
    for start, q_offset in kernels.ring_offsets(S_RING):
        _check(platform, S_RING - T + 1, q, k, v, start, q_offset, scales=scales, ring=True, decode_splits=2)


def test_query_block_bounds_are_each_querys_and_their_union():
    """`query_block_bounds` (the bounds the kernels mask rows with, and the blocks they read) against the
    reference's mask, over random starts, offsets, windows and rings: each query's [lo, hi] is exactly its live
    indices (wrapping in a ring), and the union's is exactly the indices some query of the block sees (the value
    slots the kernels keep; the others are zeroed, so NaN there cannot leak)."""
    rng = np.random.default_rng(0)
    num_slots = 40

    def indices(lo, hi):  # the live set of a (possibly wrapped) range over the S indices
        index = np.arange(num_slots)
        return ((index >= lo) & (index <= hi)) | ((index >= lo + num_slots) & (index < num_slots))

    for ring in (False, True):
        for window in (None, 1, 7, num_slots):
            for T in (2, 5, 16):
                q_offset = int(rng.integers(0, 4 * num_slots if ring else num_slots - T + 1))
                start = rng.integers(0, q_offset + T + 2, size=6)
                lo, hi, lo_all, hi_all = (np.asarray(x) for x in decode_kernel.query_block_bounds(
                    start, q_offset, T, num_slots, window, ring))
                live = np.asarray(reference.live_mask(jnp.asarray(start, jnp.int32), q_offset, T, num_slots,
                                                      window, ring))  # [B, T, S]
                for b in range(len(start)):
                    for t in range(T):
                        np.testing.assert_array_equal(indices(lo[b, t], hi[b, t]), live[b, t])
                    np.testing.assert_array_equal(indices(lo_all[b], hi_all[b]), live[b].any(0),
                                                  err_msg=f"ring={ring} window={window} T={T} start={start[b]}")


def test_dispatch_sends_small_query_blocks_to_the_decode_kernel(monkeypatch):
    """Up to MAX_DECODE_QUERIES queries per sequence (a ring too) the decode kernel serves `pallas.attention`;
    more go to the prefill kernel (a ring: refused). Traced abstractly: nothing runs."""
    called = []

    def recording(name, real):
        def kernel(q, *args, **kwargs):
            called.append((name, q.shape[1]))
            return real(q, *args, **kwargs)
        return kernel

    for module, name in ((decode_kernel, "decode_attention"), (prefill_kernel, "prefill_attention")):
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    limit = pallas.MAX_DECODE_QUERIES
    for T, ring in ((1, False), (limit, False), (limit + 1, False), (limit, True)):
        q, k, v, _ = kernels.inputs(1, T, "gqa", 64, "float32", num_slots=64)
        jax.eval_shape(functools.partial(pallas.attention, scale=0.125, ring=ring, interpret=True), q, k, v,
                       jnp.zeros((1,), jnp.int32), jnp.int32(64 - T))
    assert called == [("decode_attention", 1), ("decode_attention", limit), ("prefill_attention", limit + 1),
                      ("decode_attention", limit)]


# --- prefill (T > 1) -----------------------------------------------------------------------------------------

# (heads, head dim, dtype, batch, T, slots, window, q_offsets)
PREFILL_CASES = [
    ("gqa", 64, "float32", 3, 40, 40, None, (0,)),  # what generate's prefill does: T = S, q_offset = 0
    ("mqa", 128, "bfloat16", 3, 40, 40, 7, (0,)),
    # q_offset > 0 (a chunk of prompt after cached slots), S not a multiple of the key block, T of the query block
    ("mha", 128, "float32", 1, 33, S, 17, (0, 100, S - 33)),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("heads,H,dtype,B,T,num_slots,window,q_offsets", PREFILL_CASES)
def test_prefill_matches_reference(platform, heads, H, dtype, B, T, num_slots, window, q_offsets):
    q, k, v, _ = kernels.inputs(B, T, heads, H, dtype, num_slots=num_slots)
    for q_offset in q_offsets:
        # Ragged left padding: no padding, a little, a lot, and a row whose only real token is the last query.
        for start in ([0, 3, T - 1], [q_offset + T - 1, 0, q_offset + 5]):
            _check(platform, window, q, k, v, np.array(start[:B]), q_offset)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_prefill_quantized_cache_matches_reference(platform):
    """A chunk of prompt (q_offset > 0) over an int8 cache with a window: the prefill kernel dequantizes per key
    block as the decode kernel does."""
    T = 33
    q, k, v, scales = kernels.inputs(1, T, "gqa", 64, "float32", cache_dtype="int8")
    for q_offset in (0, 100):
        _check(platform, 40, q, k, v, [q_offset + 3], q_offset, scales=scales)


def test_prefill_ring_is_not_implemented():
    q, k, v, _ = kernels.inputs(1, pallas.MAX_DECODE_QUERIES + 1, "gqa", 64, "float32", num_slots=32)
    with pytest.raises(NotImplementedError, match="ring"):
        pallas.attention(q, k, v, jnp.zeros((1,), jnp.int32), jnp.int32(20), scale=0.125, sliding_window=16,
                         ring=True, interpret=INTERPRET)


def test_prefill_skips_masked_key_blocks():
    """Causal T = S = 512 in 128-blocks: a query block reads only key blocks up to its diagonal and from the
    row's start on (the TPU index map; the GPU loop uses the same `query_block_bounds`)."""
    block, T = 128, 512
    bounds = dict(block_q=block, num_queries=T, num_slots=T, window=None)
    start, q_offset = jnp.asarray([0, 300], jnp.int32), jnp.asarray([0], jnp.int32)
    for b, first_live in ((0, 0), (1, 300 // block)):
        for i in range(T // block):
            live = [int(blk) for j in range(T // block)
                    for blk, ok in [prefill_kernel._tpu_step_block(b, i, j, start, q_offset, block_k=block,
                                                                   num_blocks=T // block, **bounds)] if ok]
            assert live == list(range(first_live, i + 1))  # [] for query blocks wholly in the padding
    # With a window of 64 a query block's keys span at most 128 + 63 slots: three blocks when q_offset is not
    # block-aligned, and the grid has only that many key steps instead of T / block.
    assert prefill_kernel.max_key_steps(8, block, block, 64) == 3


# --- end to end ----------------------------------------------------------------------------------------------

_SMALL = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, ffn_dim=96)
# Each test compiles four programs (~15 s here), so two configs: GQA 2:1 with a sliding window shorter than the
# longest prompt (the window bites in prefill and decode), and MQA without one (plain GQA is in between; the
# kernel-level tests cover it).
GENERATE_CONFIGS = {
    "gqa-sliding": jaxkv.Config(**_SMALL, n_kv_heads=2, sliding_window=8),
    "mqa": jaxkv.Config(**_SMALL, n_kv_heads=1),
}


# The sliding-window config decodes over a ring cache (window 8 < prompt + new tokens); with an int8 cache its
# decode steps also dequantize in the kernel. Prefill attends over the fresh prompt K/V in the model dtype either way.
# (The sliding config over a float cache is left out: its ring decode is the int8 case's with the scales left out,
# the float cache through generate is the MQA case's, and the float32 ring kernel is test_decode_ring_matches_reference.)
@pytest.mark.parametrize("name,cache_dtype", [("gqa-sliding", "int8"), ("mqa", None)])
def test_generate_pallas_equals_xla(name, cache_dtype):
    model = jaxkv.Model.random(GENERATE_CONFIGS[name], seed=3)
    prompts = [[5, 17, 3, 9, 41, 2, 8, 60, 11, 4, 23, 7], [1], [30, 31, 32, 33, 34]]  # ragged: left padding
    run = functools.partial(jaxkv.generate, model, prompts, max_new_tokens=12, stop_tokens=[],
                            cache_dtype=cache_dtype)
    assert run(attention="pallas").tokens == run(attention="xla").tokens


# One layer (compiles), GQA 2:1 and a window shorter than the prompts: a speculative cache is a plain one (no
# ring), so the verify's queries are masked to the window per row. Only this test uses it: its loops are traced here.
SPECULATION_CONFIG = jaxkv.Config(**{**_SMALL, "n_layers": 1}, n_kv_heads=2, sliding_window=8)


@pytest.mark.parametrize("page_size,cache_dtype", [(None, "int8"), (4, None)], ids=["contiguous-int8", "paged"])
def test_speculative_verify_runs_the_decode_kernels(page_size, cache_dtype, monkeypatch):
    """generate(speculative=ngram, attention="pallas") gives plain decoding's greedy tokens, and its verify pass
    (k + 1 = 5 queries per sequence) runs the decode kernel (contiguous) or the paged decode kernel (pages of 4: the
    verify's queries cross pages), seen by recording the kernels' query shapes as the loop is traced."""
    shapes = []

    def recording(real):
        def kernel(q, *args, **kwargs):
            shapes.append(q.shape)
            return real(q, *args, **kwargs)
        return kernel

    module, name = (decode_kernel, "decode_attention") if page_size is None else (pk, "paged_decode_attention")
    monkeypatch.setattr(module, name, recording(getattr(module, name)))
    model = jaxkv.Model.random(SPECULATION_CONFIG, seed=3)
    rng = np.random.default_rng(0)
    passage = rng.integers(0, SPECULATION_CONFIG.vocab_size, 9).tolist()
    prompts = [passage * 3 + passage[:4], rng.integers(0, SPECULATION_CONFIG.vocab_size, 13).tolist()]
    run = functools.partial(jaxkv.generate, model, prompts, max_new_tokens=12, stop_tokens=[],
                            cache_dtype=cache_dtype, **({} if page_size is None else dict(page_size=page_size)))
    plain = run(attention="xla")
    got = run(attention="pallas", speculative=jaxkv.Speculation("ngram", 4, adaptive=False))
    assert got.tokens == plain.tokens
    assert got.stats["spec_verifies"] > 0
    assert (len(prompts), 5, 4, 16) in [tuple(x) for x in shapes]  # [B, k + 1, N, H]: the verify's query block


# --- lowering for real hardware without the hardware ---------------------------------------------------------


@pytest.mark.parametrize("cache", ["bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("T", [1, 5, 64], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("platform,lowering_platform,custom_call",
                         [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_for_device(platform, lowering_platform, custom_call, T, cache):
    """Compiled (interpret=False) kernels lower to Mosaic / Triton IR from any host: this runs the whole Pallas
    lowering (block-shape rules, every primitive's Mosaic or Triton rule) but not the device compiler (Mosaic's
    layout passes live in libtpu, ptxas in the CUDA toolchain). The int8 and float8 caches come with their scales,
    and in decode and a verify's query block (T = 5: the decode kernel with per-row bounds) as a ring (S =
    window)."""
    B, N, K, H = 2, 8, 2, 128
    dtype = jnp.bfloat16
    quantized = cache != "bfloat16"
    decode = T <= pallas.MAX_DECODE_QUERIES
    num_slots = 256 if quantized and decode else 1000
    shapes = [((B, T, N, H), dtype), ((B, K, num_slots, H), cache), ((B, K, num_slots, H), cache),
              ((B,), jnp.int32), ((), jnp.int32)]
    if quantized:
        shapes += [((B, K, num_slots), jnp.float32)] * 2
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    f = jax.jit(functools.partial(_lowering_target, platform=platform, ring=quantized and decode))
    text = lowered_text(f, args, lowering_platform)
    assert f"stablehlo.custom_call @{custom_call}" in text


def _lowering_target(q, k, v, start, q_offset, k_scale=None, v_scale=None, *, platform, ring):
    return pallas.attention(q, k, v, start, q_offset, scale=0.125, sliding_window=256, k_scale=k_scale,
                            v_scale=v_scale, ring=ring, platform=platform, interpret=False)
