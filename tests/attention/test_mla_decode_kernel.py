"""The Pallas MLA decode kernel (jaxkv.attention.mla_decode_kernel) against the XLA reference (jaxkv.attention.mla),
its block skipping, its lowering, and the dispatch by name.

On CPU the kernel runs in the Pallas interpreter, both bodies (Mosaic "tpu" and Triton "gpu"). With
JAXKV_PALLAS_COMPILED=1 (as scripts/device_check.py sets on a GPU or TPU machine) it runs compiled, the device's
body only. start and q_offset are traced, so each configuration compiles once and is checked at many live lengths.
Quantized caches are quantized once (`jaxkv.cache.quantize`, one scale per slot) and both sides read the very same
stored numbers and scales.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import mla, mla_decode_kernel, reference
from jaxkv.cache import quantize

from helpers import kernels
# the interpreter on CPU; compiled with JAXKV_PALLAS_COMPILED=1
from helpers.kernels import INTERPRET, PLATFORMS, lowered_text
from helpers.tolerances import by_dtype

# Kernel vs reference, keyed by the query's dtype (their reasons: helpers.tolerances, "kernel").
TOLERANCES = by_dtype("kernel")

BLOCK_K = {"tpu": 128, "gpu": 32}  # small, so S = 300 spans several blocks and ends in a partial one
S = 300  # not a multiple of either block
SCALE = 0.1

@functools.lru_cache(maxsize=None)
def _kernel(platform, latent_dim, window, ring, splits):
    def kernel(q, latent, start, q_offset, latent_scale=None):
        return mla_decode_kernel.mla_decode(q, latent, start, q_offset, latent_dim=latent_dim, scale=SCALE,
                                            latent_scale=latent_scale, sliding_window=window, ring=ring,
                                            block_k=BLOCK_K[platform], splits=splits, platform=platform,
                                            interpret=INTERPRET)

    return kernel


@functools.lru_cache(maxsize=None)
def _reference(latent_dim, window, ring):
    def ref(q, latent, start, q_offset, latent_scale=None):
        return mla.attention(q, latent, start, q_offset, latent_dim=latent_dim, scale=SCALE,
                             latent_scale=latent_scale, sliding_window=window, ring=ring)

    return ref


def _inputs(B, N, R, E, dtype, cache_dtype=None, num_slots=S, seed=0):
    """q [B, 1, N, R + E] in dtype; latent [B, S, R + E] in cache_dtype (default dtype); scales f32[B, S] or None."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, 1, N, R + E)).astype(np.float32)
    latent = rng.normal(size=(B, num_slots, R + E)).astype(np.float32)
    cache_dtype = jnp.dtype(cache_dtype or dtype).name
    if cache_dtype in ("int8", "float8_e4m3fn"):
        stored, scales = quantize(latent[:, None], cache_dtype)  # as a cache with one KV head
        return jnp.asarray(q, dtype), stored[:, 0], scales[:, 0]
    return jnp.asarray(q, dtype), jnp.asarray(latent, cache_dtype), None


def _check(platform, R, window, q, latent, start, q_offset, *, latent_scale=None, ring=False, splits=None,
           expected_from=None):
    """Kernel vs reference on rows with a live slot (the others must be exactly 0); every output finite.
    `expected_from`: (latent, latent_scale) to compute the reference from instead (the clean cache of a poisoned
    one)."""
    start, q_offset = jnp.asarray(start, jnp.int32), jnp.int32(q_offset)
    scales = () if latent_scale is None else (latent_scale,)
    out = np.asarray(kernels.run(_kernel(platform, R, window, ring, splits), q, latent, start, q_offset, *scales))
    ref_latent, ref_scale = expected_from or (latent, latent_scale)
    ref_scales = () if ref_scale is None else (ref_scale,)
    want = np.asarray(kernels.run(_reference(R, window, ring), q, ref_latent, start, q_offset, *ref_scales))
    assert out.shape == want.shape == (q.shape[0], 1, q.shape[2], R) and out.dtype == np.float32
    has_live = np.asarray(reference.live_mask(start, q_offset, 1, latent.shape[1], window, ring).any(-1))[:, 0]
    assert np.isfinite(out).all(), "non-finite output (a row with no live slot must give 0, not NaN)"
    np.testing.assert_array_equal(out[~has_live], 0.0)  # the reference leaves such rows unspecified
    assert has_live.any()
    np.testing.assert_allclose(out[has_live], want[has_live], **TOLERANCES[jnp.dtype(q.dtype).name],
                               err_msg=f"start={np.asarray(start)} q_offset={int(q_offset)}")
    return has_live


# --- parity with the reference -------------------------------------------------------------------------------

# (heads N, R, E, query dtype, cache dtype, batch, slots, window, splits): every head count, both R/E shapes, each
# cache dtype, batch 1 and 3, S a multiple of both blocks (256) and not (300), windows, splits 1 and 3 (None: the
# platform default, several on GPU). The full product would be minutes of interpreter compiles.
CASES = [
    (4, 64, 16, "float32", "float32", 3, S, None, 1),
    (16, 128, 32, "bfloat16", "bfloat16", 1, 256, 50, 3),
    (1, 64, 16, "float32", "int8", 3, S, None, 3),
    (4, 64, 16, "float32", "float8_e4m3fn", 3, 256, 129, None),
    (16, 64, 16, "float32", "bfloat16", 3, S, 50, 3),  # a bfloat16 cache under float32 queries: f32 matmuls
    (4, 128, 32, "bfloat16", "int8", 3, S, None, None),  # int8 exact in bfloat16: the bf16 matmul path
    (1, 128, 32, "float32", "float16", 1, 256, None, 1),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("N,R,E,dtype,cache_dtype,B,num_slots,window,splits", CASES)
def test_matches_reference(platform, N, R, E, dtype, cache_dtype, B, num_slots, window, splits):
    q, latent, latent_scale = _inputs(B, N, R, E, dtype, cache_dtype, num_slots)
    check = functools.partial(_check, platform, R, window, q, latent, latent_scale=latent_scale, splits=splits)
    bk = BLOCK_K[platform]
    # Live lengths 1, block-1, block, block+1 and the whole cache, from slot 0 (block-aligned).
    for length in (1, bk - 1, bk, bk + 1, num_slots):
        check(np.zeros(B, np.int32), length - 1)
    # Ragged left padding ending at a block-unaligned slot: one live slot, a block, everything.
    for q_offset in (num_slots - 1, bk + 7):
        check(q_offset + 1 - np.array([1, bk, q_offset + 1][:B]), q_offset)
    if B > 1:  # a row with no live slot (start past the query) comes out 0
        assert not check([0, bk + 1, 5], bk)[1]


@pytest.mark.skipif("gpu" not in PLATFORMS, reason="the Triton body's knob")
def test_gpu_head_tiles_match_reference():
    """40 heads (padded to 64) in tiles of 16 over the Triton body's grid: each tile's rows land in its own place."""
    q, latent, _ = _inputs(2, 40, 64, 16, "float32")
    start, q_offset = jnp.asarray([0, 120], jnp.int32), jnp.int32(S - 1)
    out = mla_decode_kernel.mla_decode(q, latent, start, q_offset, latent_dim=64, scale=SCALE, sliding_window=200,
                                       block_k=32, splits=3, heads_per_program=16, platform="gpu",
                                       interpret=INTERPRET)
    want = mla.attention(q, latent, start, q_offset, latent_dim=64, scale=SCALE, sliding_window=200)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOLERANCES["float32"])


@pytest.mark.parametrize("platform", PLATFORMS)
def test_large_logits_are_stable(platform):
    q, latent, _ = _inputs(3, 4, 64, 16, "float32")
    # Scores in the thousands: exp overflows unless the running max is subtracted (the first case's compile).
    _check(platform, 64, None, q * 40.0, latent * 40.0, [0, 10, 250], S - 1, splits=1)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_ignores_poisoned_dead_slots(platform):
    """NaN in every slot outside [start, q_offset] (left padding, the unwritten tail, whole blocks of both) must
    not change the output: dead blocks are never read and dead slots of read blocks are masked."""
    start, q_offset = np.array([37, 0, 150]), 200
    q, latent, _ = _inputs(3, 4, 64, 16, "float32")
    dead = (np.arange(S)[None, :] < start[:, None]) | (np.arange(S)[None, :] > q_offset)  # [B, S]
    bad = jnp.where(jnp.asarray(dead)[..., None], jnp.nan, latent)
    _check(platform, 64, None, q, bad, start, q_offset, splits=1, expected_from=(latent, None))
    _check(platform, 64, 50, q, bad, start, q_offset, splits=3, expected_from=(latent, None))


# --- ring caches ---------------------------------------------------------------------------------------------

S_RING = 200  # a ring of S = window slots: not a multiple of either block


def _ring_offsets():
    """(start, q_offset): a fresh ring (the slots past the query never written), the first wrap, steady state far
    past S, with ragged starts (the whole ring live, a few slots live across index 0, only the query itself)."""
    wrapped = 3 * S_RING + 5
    return [([0, 40, 69], 69), ([0, 1, S_RING], S_RING), ([0, wrapped - 10, wrapped], wrapped),
            ([wrapped - 100, 2 * S_RING, wrapped - 3], wrapped)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("cache_dtype,window,splits", [("float32", S_RING, 1), ("int8", 150, 3)])
def test_ring_matches_reference(platform, cache_dtype, window, splits):
    q, latent, latent_scale = _inputs(3, 4, 64, 16, "float32", cache_dtype, num_slots=S_RING)
    for start, q_offset in _ring_offsets():
        _check(platform, 64, window, q, latent, start, q_offset, latent_scale=latent_scale, ring=True,
               splits=splits)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_ring_quantized_ignores_poisoned_dead_slots(platform):
    """NaN values and NaN scales of a float8 ring (float8_e4m3fn has a NaN) at every index the query may not see:
    a dead slot's scale reaches neither its score (masked after scaling) nor the values (zeroed after scaling)."""
    window = 150
    q, latent, latent_scale = _inputs(3, 4, 64, 16, "float32", "float8_e4m3fn", num_slots=S_RING)
    for start, q_offset in _ring_offsets()[::2]:
        dead = ~reference.live_mask(jnp.asarray(start), q_offset, 1, S_RING, window, ring=True)[:, 0]  # [B, S]
        assert dead.any()
        bad = jnp.where(dead[..., None], jnp.nan, latent).astype(latent.dtype)
        bad_scale = jnp.where(dead, jnp.nan, latent_scale)
        _check(platform, 64, window, q, bad, start, q_offset, latent_scale=bad_scale, ring=True, splits=3,
               expected_from=(latent, latent_scale))


# --- which blocks are read -----------------------------------------------------------------------------------


def _tpu_fetches(lo, hi, *, num_slots, block_k, splits, ring=False):
    """Simulates the Mosaic pipeline over the grid with the kernel's own index function: the latent blocks it DMAs
    (a copy only when the index map names another block than at the previous step) and the blocks it folds in."""
    num_blocks = -(-num_slots // block_k)
    lo_ref, hi_ref = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    fetched, computed, previous = [], [], None
    for b in range(len(lo)):
        for split in range(splits):
            for j in range(-(-num_blocks // splits)):
                block, live = mla_decode_kernel._latent_block(b, split, j, lo_ref, hi_ref, block_k=block_k,
                                                              splits=splits, num_blocks=num_blocks, ring=ring)
                if (b, int(block)) != previous:
                    fetched.append(previous := (b, int(block)))
                if live:
                    computed.append((b, int(block)))
    return fetched, computed


@pytest.mark.parametrize("splits", [1, 3])
def test_reads_only_live_blocks(splits):
    """S = 4096 with 100 live slots: two blocks are read, not 4096 / block_k; each live block exactly once (TPU
    index map, GPU loop bounds: the functions the kernel calls)."""
    block_k, num_slots = 128, 4096
    lo, hi = mla_decode_kernel.live_bounds(np.array([1000, 0, 3000]), 1099, num_slots, None)  # row 2: none live
    live_blocks = {0: {7, 8}, 1: set(range(9)), 2: set()}
    fetched, computed = _tpu_fetches(lo, hi, num_slots=num_slots, block_k=block_k, splits=splits)
    expected = sorted((b, blk) for b, blocks in live_blocks.items() for blk in blocks)
    assert sorted(computed) == expected
    # DMAs: the live blocks, plus one clamped block for the row with none (its index map must name some block).
    assert sorted(f for f in fetched if f[0] != 2) == expected and len([f for f in fetched if f[0] == 2]) == 1
    for b, blocks in live_blocks.items():
        loaded = []
        for split in range(splits):
            first, begin, end = mla_decode_kernel.gpu_block_range(lo[b], hi[b], num_slots=num_slots,
                                                                  block_k=block_k, splits=splits, split=split,
                                                                  ring=False)
            loaded += range(int(first + begin), int(first + end))
        assert sorted(loaded) == sorted(blocks)


def test_ring_visits_every_block_once():
    num_slots, block_k, splits = 1000, 128, 3
    lo, hi = mla_decode_kernel.live_bounds(np.array([0, 2990]), 3004, num_slots, None, ring=True)
    _, computed = _tpu_fetches(lo, hi, num_slots=num_slots, block_k=block_k, splits=splits, ring=True)
    assert sorted(computed) == [(b, blk) for b in range(2) for blk in range(8)]


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_cache_goes_to_the_kernel_as_stored(platform):
    """The int8 latent and its scales reach the pallas_call untouched: no dequantized, padded or re-laid-out copy of
    the cache is made outside the kernel (the only thing done to the scales is a free reshape to [B, 1, S])."""
    B, C = 2, 80
    args = [jax.ShapeDtypeStruct((B, 1, 4, C), jnp.bfloat16), jax.ShapeDtypeStruct((B, S, C), jnp.int8),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((B, S), jnp.float32)]

    def decode(q, latent, start, q_offset, latent_scale):
        return mla_decode_kernel.mla_decode(q, latent, start, q_offset, latent_dim=64, scale=SCALE,
                                            latent_scale=latent_scale, platform=platform, interpret=False)

    jaxpr = jax.make_jaxpr(decode)(*args).jaxpr
    latent = jaxpr.invars[1]
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [e.primitive.name for e in jaxpr.eqns if latent in e.invars] == ["pallas_call"]
    assert latent in call.invars
    # Nothing outside the kernel is as big as the cache.
    assert all(v.aval.size < B * S * C for e in jaxpr.eqns if e is not call for v in e.outvars)


# --- errors and dispatch -------------------------------------------------------------------------------------


def test_bad_input_raises():
    q, latent, latent_scale = _inputs(1, 4, 64, 16, "float32", "int8", num_slots=32)
    args = (jnp.zeros(1, jnp.int32), jnp.int32(5))
    decode = functools.partial(mla_decode_kernel.mla_decode, latent_dim=64, scale=SCALE, interpret=True)
    with pytest.raises(NotImplementedError, match="T == 1"):
        decode(jnp.concatenate([q, q], axis=1), latent, *args, latent_scale=latent_scale)
    with pytest.raises(ValueError, match="needs latent_scale"):
        decode(q, latent, *args)
    with pytest.raises(ValueError, match="latent_scale must have shape"):
        decode(q, latent, *args, latent_scale=latent_scale[:, :16])
    with pytest.raises(ValueError, match="does not fit"):
        decode(q, latent[..., :64], *args, latent_scale=latent_scale)
    with pytest.raises(NotImplementedError, match="powers of two"):  # E = 24 on the Triton body
        decode(jnp.zeros((1, 1, 4, 88)), jnp.zeros((1, 32, 88)), *args, platform="gpu")
    with pytest.raises(ValueError, match="platform"):
        decode(q, latent, *args, latent_scale=latent_scale, platform="cuda")
    with pytest.raises(ValueError, match="heads_per_program"):
        decode(q, latent, *args, latent_scale=latent_scale, platform="gpu", heads_per_program=8)
    with pytest.raises(ValueError, match="GPU knob"):
        decode(q, latent, *args, latent_scale=latent_scale, platform="tpu", heads_per_program=16)


def test_dispatch_by_name():
    assert mla.get("xla") is mla.attention
    assert mla.get("pallas") is mla_decode_kernel.mla_decode
    on_device = jax.default_backend() in ("gpu", "tpu")
    assert mla.get("auto") is (mla_decode_kernel.mla_decode if on_device else mla.attention)
    with pytest.raises(ValueError, match="unknown"):
        mla.get("triton")
    # The registered kernel takes the reference's arguments alone (default blocks, splits, platform, interpret).
    q, latent, latent_scale = _inputs(2, 4, 64, 16, "float32", "int8", num_slots=40)
    args = (q, latent, jnp.asarray([0, 7], jnp.int32), jnp.int32(30))
    got, want = (mla.get(name)(*args, latent_dim=64, scale=SCALE, latent_scale=latent_scale, sliding_window=20)
                 for name in ("pallas", "xla"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOLERANCES["float32"])


# --- lowering for real hardware without the hardware ---------------------------------------------------------


@pytest.mark.parametrize("cache", ["bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("platform,lowering_platform,custom_call",
                         [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_for_device(platform, lowering_platform, custom_call, cache):
    """Compiled (interpret=False) kernels lower to Mosaic / Triton IR from any host at DeepSeek-V3's shapes (R = 512,
    E = 64; 16 heads as on one of 8 tensor-parallel devices, or all 128, two head tiles on GPU): the whole Pallas
    lowering (block-shape rules, every primitive's Mosaic or Triton rule) but not the device compiler (Mosaic's
    layout passes live in libtpu, ptxas in the CUDA toolchain). Quantized caches come with their scales, as a ring;
    bfloat16 with a window and splits."""
    quantized = cache != "bfloat16"
    B, N, R, E = 2, 16 if quantized else 128, 512, 64
    num_slots = 256 if quantized else 1000
    shapes = [((B, 1, N, R + E), jnp.bfloat16), ((B, num_slots, R + E), cache), ((B,), jnp.int32), ((), jnp.int32)]
    if quantized:
        shapes.append(((B, num_slots), jnp.float32))
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]

    def target(q, latent, start, q_offset, latent_scale=None):
        return mla_decode_kernel.mla_decode(q, latent, start, q_offset, latent_dim=R, scale=SCALE,
                                            latent_scale=latent_scale, sliding_window=256, ring=quantized,
                                            splits=None if quantized else 2, platform=platform, interpret=False)

    text = lowered_text(jax.jit(target), args, lowering_platform)
    assert f"stablehlo.custom_call @{custom_call}" in text
