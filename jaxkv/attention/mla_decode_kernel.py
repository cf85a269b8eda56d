"""MLA flash-decoding: one query token per sequence against the latent cache, as a Pallas kernel.

The spec is `jaxkv.attention.mla.attention` with T == 1 (same arguments, plus tuning knobs). Shape letters:
B batch, N query heads, S cache slots, R latent width (kv_lora_rank), E rotary key width (qk_rope_head_dim),
C = R + E the cached row, M the query heads padded to a legal row count, P splits.

What a program reads
--------------------
MLA decode is multi-query attention with one "KV head" of width C whose values are the first R columns of the same
row (`mla` module docstring). So one program holds all N heads of a sequence (on GPU up to 64, below): the
query block [M, C] is the M dimension of both matmuls, and each [block_k, C] latent block is read from HBM once
per program and used twice, whole for the scores (q . row) and its first R columns for the values. Per head
nothing of cache length is read or formed. Which blocks are read is `decode_kernel`'s logic with one KV head:
row b's query may see cache indices [lo, hi] (`live_bounds`: left padding `start`, the sliding window, the
ring's wrap), only blocks holding one are visited (every block of a ring cache), and selects mask the dead slots
of a visited block (`decode_masks`), so NaN in dead slots or their scales cannot leak. Optional flash-decoding
splits share a row's live blocks out over parallel programs and `combine_splits` merges them.

Pallas TPU (Mosaic), `_mla_kernel_tpu`: grid (B, P, blocks per split), the last axis sequential ("arbitrary")
with the softmax state in VMEM scratch. lo, hi are scalar-prefetched and the latent BlockSpec's index map
(`_latent_block`, decode_kernel's clamped step) names only live blocks: a step past the split's share names the
block already in VMEM (no DMA) and `pl.when` skips the compute. The block is (block_k, C), C being the array's
full last dim (legal for any C, e.g. DeepSeek's 576); the step is decode_kernel's `online_softmax_step` with
k = the row and v = its first R columns (a lane-prefix slice of the VMEM block, 128-aligned for R = 512).

Pallas GPU (Triton), `_mla_kernel_gpu`: grid (B, head tiles, P); a program holds all heads up to 64
(`GPU_MAX_HEADS`: its [heads, R] float32 accumulator lives in registers; more heads are tiled over programs, each
tile reading the latent once). Each program gets its sequence's [S, C] latent as a ref (a pointer) and loops
(`fori_loop`, dynamic trip count) over its live blocks only. Triton tensors have power-of-two sizes and C = 576
is not one, so each block is loaded as its two column ranges, c = row[:, :R] and k_rope = row[:, R:] (together
exactly the row, each byte once), and the score is the sum of two dots, q[:, :R] . c + q[:, R:] . k_rope.
R and E must be powers of two >= 16 (DeepSeek-V2/V3: 512 and 64); other widths raise NotImplementedError
(padding them would copy the cache every step). As in decode_kernel a block that would run past S is loaded
shifted back to end at S, its re-read slots masked.

Quantized caches: an int8 / float8_e4m3fn latent cache comes with float32 scales [B, S], one per slot. Each step
loads the block's [1, block_k] scales with the block and applies them to the score and probability columns
((q . row) * s and sum_c (p_c * s_c) row_c[:R]): the dequantization happens inside the block math, never as a
dequantized copy. 1-byte values are cast exactly to q's dtype for the matmuls; accumulation is float32.

Returns float32 (like the reference): the caller applies W_UV, usually in float32 or after a cast it chooses.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jaxkv.attention.pallas_namespace import pl, pltpu, pltriton, require_triton

from jaxkv.attention.decode_kernel import (NN_DIMS, NT_DIMS, GPU_MIN_DIM, MASKED, TPU_ROW_MULTIPLE, dot_precision,
                                           tpu_step_block, block_range, cdiv, combine_splits, decode_masks,
                                           default_splits, gpu_block, live_bounds, load_scale, matmul_dtype,
                                           next_pow2, online_softmax_step, pad_axis, reset_softmax_state,
                                           split_share, tpu_block)
from jaxkv.attention.pallas import PLATFORMS, default_platform

# Slots per latent block. TPU: 512 (a multiple of 128 lanes for the [M, block_k] score tile; a [512, 576] bf16
# block is 576 KiB, double-buffered about 1.2 MiB of VMEM, and few grid steps amortise the ~0.35 us per-step
# cost). GPU: 64 (FlashMLA's key block; [64, 512] bf16 is 64 KiB of shared memory for the dot operands).
DEFAULT_BLOCK_K = types.MappingProxyType({"tpu": 512, "gpu": 64})
# GPU: query heads per program at most. The [heads, R] float32 accumulator lives in registers: 64 heads x 512 over
# 8 warps is 128 floats a thread (FlashMLA's tile is 64 heads too). More heads (128 without tensor parallelism) are
# tiled over programs, each re-reading the latent (mostly from L2). TPU keeps every head in one program: VMEM
# holds [128, 512] easily and a taller M feeds the MXU better.
GPU_MAX_HEADS = 64


# --- TPU (Mosaic) --------------------------------------------------------------------------------------------


def _latent_block(b, split, j, lo_ref, hi_ref, *, block_k: int, splits: int, num_blocks: int, ring: bool):
    """(latent block index, whether step (b, split, j) folds it in): the TPU index map and body both call this.

    decode_kernel's clamped step with one KV head: steps past the split's share repeat its last block (no DMA)."""
    return tpu_step_block(b, split, j, lo_ref, hi_ref, block_k=block_k, splits=splits, num_blocks=num_blocks,
                           ring=ring)


def _mla_kernel_tpu(lo_ref, hi_ref, q_ref, row_ref, *refs, scale: float, latent_dim: int, block_k: int,
                    splits: int, num_blocks: int, quantized: bool, ring_slots: int | None):
    """Grid (B, P, blocks per split). q_ref [M, C]; row_ref [block_k, C]; for a quantized cache scale_ref
    [1, block_k]; outputs this split's (acc [M, R], m [M, 1], l [M, 1]) at its last step; scratch m, l, acc."""
    scale_ref, (acc_out, m_out, l_out, m_scr, l_scr, acc_scr) = (refs[0], refs[1:]) if quantized else (None, refs)
    b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block, live_step = _latent_block(b, split, j, lo_ref, hi_ref, block_k=block_k, splits=splits,
                                     num_blocks=num_blocks, ring=ring_slots is not None)

    pl.when(j == 0)(functools.partial(reset_softmax_state, m_scr, l_scr, acc_scr))

    @pl.when(live_step)
    def _step():
        live, v_live = decode_masks(block * block_k, block * block_k, lo_ref[b], hi_ref[b], q_ref.shape[0],
                                    block_k, latent_dim, wrap=ring_slots)  # [M, block_k], [block_k, R]
        row = row_ref[...]  # [block_k, C]: the one read of this block, keys and values alike
        latent_scale = load_scale(scale_ref)  # [1, block_k] or None: one scale dequantizes both uses of the row
        m, l, acc = online_softmax_step(m_scr[...], l_scr[...], acc_scr[...], q_ref[...], row,
                                        row[:, :latent_dim], live, v_live, scale=scale, k_scale=latent_scale,
                                        v_scale=latent_scale)
        m_scr[...], l_scr[...], acc_scr[...] = m, l, acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _emit():
        acc_out[...], m_out[...], l_out[...] = acc_scr[...], m_scr[...], l_scr[...]


def _mla_tpu(q, latent, latent_scale, lo, hi, *, scale: float, latent_dim: int, block_k: int, splits: int,
             ring: bool, interpret):
    """q [B, M, C] (M a multiple of 8); latent [B, S, C]; latent_scale f32[B, 1, S] or None; lo, hi int32[B]
    -> per-split (acc f32[B, P, M, R], m, l f32[B, P, M, 1])."""
    B, M, C = q.shape
    S, R = latent.shape[1], latent_dim
    block_k = tpu_block(S, block_k)
    num_blocks = cdiv(S, block_k)
    splits = max(1, min(splits, num_blocks))
    step_block = functools.partial(_latent_block, block_k=block_k, splits=splits, num_blocks=num_blocks, ring=ring)

    def row_map(b, split, j, lo_ref, hi_ref):
        return b, step_block(b, split, j, lo_ref, hi_ref)[0], 0

    def scale_map(b, split, j, lo_ref, hi_ref):  # the latent block's slots
        return b, 0, step_block(b, split, j, lo_ref, hi_ref)[0]

    def q_map(b, split, j, lo_ref, hi_ref):
        return b, 0, 0

    def out_map(b, split, j, lo_ref, hi_ref):
        return b, split, 0, 0

    quantized = latent_scale is not None
    scale_specs = [pl.BlockSpec((None, 1, block_k), scale_map)] if quantized else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # lo, hi: read by the index maps before each step's DMA is issued
        grid=(B, splits, cdiv(num_blocks, splits)),
        in_specs=[pl.BlockSpec((None, M, C), q_map), pl.BlockSpec((None, block_k, C), row_map), *scale_specs],
        out_specs=[pl.BlockSpec((None, None, M, R), out_map), pl.BlockSpec((None, None, M, 1), out_map),
                   pl.BlockSpec((None, None, M, 1), out_map)],
        scratch_shapes=[pltpu.VMEM((M, 1), jnp.float32), pltpu.VMEM((M, 1), jnp.float32),
                        pltpu.VMEM((M, R), jnp.float32)],
    )
    kernel = functools.partial(_mla_kernel_tpu, scale=scale, latent_dim=R, block_k=block_k, splits=splits,
                               num_blocks=num_blocks, quantized=quantized, ring_slots=S if ring else None)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, splits, M, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, M, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, M, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxkv_mla_decode",
    )(lo, hi, q, latent, *([latent_scale] if quantized else []))


# --- GPU (Triton) --------------------------------------------------------------------------------------------


def gpu_block_range(lo, hi, *, num_slots: int, block_k: int, splits: int, split, ring: bool):
    """(first block, begin, end): program `split` folds in blocks first + begin .. first + end - 1 (the GPU loop's
    bounds; every block of a ring)."""
    if ring:
        first, count = jnp.int32(0), jnp.int32(cdiv(num_slots, block_k))
    else:
        first, count = block_range(lo, hi, block_k)
    return (first, *split_share(count, splits, split))


def _fold_split_scores(m_prev, l_prev, acc_prev, q_lat, q_rope, c, k_rope, live, v_live, *, scale: float,
                       latent_scale=None):
    """decode_kernel.online_softmax_step for a row loaded as two column ranges: the score is
    q_lat . c + q_rope . k_rope (one dot over [c ; k_rope] would need a power-of-two C in Triton), the values c.

    q_lat [M, R], q_rope [M, E] in the matmul dtype; c [block_k, R], k_rope [block_k, E] in the cache dtype;
    live bool[M, block_k]; v_live bool[block_k, R]; latent_scale f32[1, block_k] or None -> (m, l, acc)."""
    dtype = q_lat.dtype
    precision = dot_precision(dtype)
    c, k_rope = c.astype(dtype), k_rope.astype(dtype)  # exact for int8/fp8 into q's dtype (`matmul_dtype`)
    s = (lax.dot_general(q_lat, c, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
         + lax.dot_general(q_rope, k_rope, NT_DIMS, precision=precision, preferred_element_type=jnp.float32))
    if latent_scale is not None:
        s = s * latent_scale  # q . (row * s) = (q . row) * s, per column
    s = jnp.where(live, s * scale, MASKED)  # [M, block_k]
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [M, 1]
    alpha = jnp.exp(m_prev - m)
    p = jnp.where(live, jnp.exp(s - m), 0.0)  # dead pairs exactly 0: a row with nothing live keeps l = 0
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    if latent_scale is not None:
        p = jnp.where(live, p * latent_scale, 0.0)  # a dead slot's garbage scale cannot reach acc (0 * NaN)
    c = jnp.where(v_live, c, jnp.zeros((), dtype))
    pv = lax.dot_general(p.astype(dtype), c, NN_DIMS, precision=precision, preferred_element_type=jnp.float32)
    return m, l, alpha * acc_prev + pv  # acc: [M, R]


def _mla_kernel_gpu(lo_ref, hi_ref, q_lat_ref, q_rope_ref, row_ref, *refs, scale: float, latent_dim: int,
                    block_k: int, splits: int, quantized: bool, ring_slots: int | None):
    """Grid (B, head tiles, P). lo_ref, hi_ref [1]; q_lat_ref [M, R], q_rope_ref [M, E] (this tile's heads);
    row_ref [Sp, C] (a pointer: only the loop's blocks are read); for a quantized cache scale_ref [1, Sp]; outputs
    (acc [M, R], m [M, 1], l [M, 1])."""
    scale_ref, (acc_out, m_out, l_out) = (refs[0], refs[1:]) if quantized else (None, refs)
    lo, hi = lo_ref[0], hi_ref[0]
    num_slots, width = row_ref.shape
    R, E = latent_dim, width - latent_dim
    q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]  # [M, R], [M, E]
    rows = q_lat.shape[0]
    first, begin, end = gpu_block_range(lo, hi, num_slots=num_slots, block_k=block_k, splits=splits,
                                        split=pl.program_id(2), ring=ring_slots is not None)

    def body(i, carry):
        floor = (first + i) * block_k  # first slot of live block first + i
        offset = jnp.minimum(floor, num_slots - block_k)  # shifted back to end at S, never past it
        c = row_ref[pl.ds(offset, block_k), pl.ds(0, R)]  # [block_k, R]: scores and values
        k_rope = row_ref[pl.ds(offset, block_k), pl.ds(R, E)]  # [block_k, E]: scores only
        latent_scale = load_scale(scale_ref, slice(None), pl.ds(offset, block_k))  # [1, block_k] or None
        live, v_live = decode_masks(offset, floor, lo, hi, rows, block_k, R, wrap=ring_slots)
        return _fold_split_scores(*carry, q_lat, q_rope, c, k_rope, live, v_live, scale=scale,
                                  latent_scale=latent_scale)

    init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, R), jnp.float32))
    m, l, acc = lax.fori_loop(begin, end, body, init)  # dynamic trip count: only live blocks are loaded
    acc_out[...], m_out[...], l_out[...] = acc, m, l


def _mla_gpu(q, latent, latent_scale, lo, hi, *, scale: float, latent_dim: int, block_k: int, splits: int,
             heads_per_program: int, ring_slots: int | None, interpret):
    """q [B, M, C] (M a power of two >= 16, a multiple of heads_per_program); latent [B, Sp, C] with Sp >= 16;
    latent_scale f32[B, 1, Sp] or None; lo, hi int32[B]; ring_slots: the ring's real S (<= Sp) or None
    -> per-split (acc f32[B, P, M, R], m, l f32[B, P, M, 1])."""
    require_triton()
    B, M, C = q.shape
    Mh = heads_per_program
    S, R = latent.shape[1], latent_dim
    block_k = gpu_block(S, block_k)
    splits = max(1, min(splits, cdiv(S, block_k)))

    def scalar_map(b, h, split):
        return (b,)

    def seq_map(b, h, split):
        return b, 0, 0

    def head_map(b, h, split):
        return b, h, 0

    def out_map(b, h, split):
        return b, split, h, 0

    quantized = latent_scale is not None
    kernel = functools.partial(_mla_kernel_gpu, scale=scale, latent_dim=R, block_k=block_k, splits=splits,
                               quantized=quantized, ring_slots=ring_slots)
    scale_specs = [pl.BlockSpec((None, 1, S), seq_map)] if quantized else []  # a pointer, like the latent
    # acc [Mh, R] lives in registers: 4 warps hold 16 heads x 512 (64 floats a thread); more heads get 8 warps.
    num_warps = 4 if Mh * R <= 16 * 512 else 8
    return pl.pallas_call(
        kernel,
        grid=(B, M // Mh, splits),
        in_specs=[pl.BlockSpec((1,), scalar_map), pl.BlockSpec((1,), scalar_map),
                  pl.BlockSpec((None, Mh, R), head_map), pl.BlockSpec((None, Mh, C - R), head_map),
                  pl.BlockSpec((None, S, C), seq_map), *scale_specs],  # the whole sequence: a base pointer
        out_specs=[pl.BlockSpec((None, None, Mh, R), out_map), pl.BlockSpec((None, None, Mh, 1), out_map),
                   pl.BlockSpec((None, None, Mh, 1), out_map)],
        out_shape=[jax.ShapeDtypeStruct((B, splits, M, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, M, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, M, 1), jnp.float32)],
        # Explicit Triton params: without them JAX 0.10 lowers GPU pallas_calls with Mosaic GPU.
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="jaxkv_mla_decode",
    )(lo, hi, q[..., :R], q[..., R:], latent, *([latent_scale] if quantized else []))


# --- public --------------------------------------------------------------------------------------------------


def _check_inputs(q, latent, start, latent_dim: int, latent_scale, sliding_window):
    B, T, N, C = q.shape
    S = latent.shape[1] if latent.ndim == 3 else -1
    if latent.shape != (B, S, C) or not 0 < latent_dim < C:
        raise ValueError(f"latent {latent.shape} does not fit queries {q.shape} with latent_dim {latent_dim}")
    if T != 1:
        raise NotImplementedError(f"the Pallas MLA kernel decodes one query per sequence (T == 1), got T={T}; "
                                  "use jaxkv.attention.mla.attention (implementation 'xla') for T > 1")
    if jnp.shape(start) != (B,):
        raise ValueError(f"start must have shape ({B},), got {jnp.shape(start)}")
    if jnp.dtype(latent.dtype).itemsize == 1 and latent_scale is None:
        raise ValueError(f"a {jnp.dtype(latent.dtype).name} latent cache needs latent_scale (float32[B, S])")
    if latent_scale is not None and latent_scale.shape != (B, S):
        raise ValueError(f"latent_scale must have shape {(B, S)} (B, S), got {latent_scale.shape}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def mla_decode(q, latent, start, q_offset, *, latent_dim: int, scale: float, latent_scale=None,
               sliding_window: int | None = None, ring: bool = False, block_k: int | None = None,
               splits: int | None = None, heads_per_program: int | None = None, interpret=None,
               platform: str | None = None):
    """Absorbed MLA of one query per sequence over the latent cache; `mla.attention`'s contract with T == 1.

    Args:
      q: [B, 1, N, R + E] latent-space queries (absorbed no-position part, then rotated part) for slot q_offset.
      latent: [B, S, R + E] the cache (float32, bfloat16, float16, or int8 / float8_e4m3fn with latent_scale).
      start: int32[B], each sequence's first live slot. q_offset: int32[], the query's absolute slot (a ring's
        may exceed S).
      latent_dim: R. scale: multiplies the scores.
      latent_scale: float32[B, S] dequantization scales of an int8/fp8 cache, else None.
      sliding_window, ring: as in `mla.attention`.
      block_k: slots per latent block (TPU: a multiple of 128; GPU: a power of two >= 16); default
        `DEFAULT_BLOCK_K`. splits: parallel programs per sequence; default `decode_kernel.default_splits`.
      heads_per_program: GPU only, a power of two >= 16: query heads per program (default all of them, padded to
        a power of two, up to `GPU_MAX_HEADS`); each head tile reads the latent blocks once. TPU: all heads.
      interpret: run in the Pallas interpreter; None means "only on CPU".
      platform: "tpu" (Mosaic) or "gpu" (Triton) body; None picks the default backend's.

    Returns:
      [B, 1, N, R] float32; a sequence with no live slot gets 0.

    Raises:
      NotImplementedError: T > 1, or (GPU) R or E not a power of two >= 16.
      ValueError: shapes that do not fit, an int8/fp8 cache without scales, an unknown platform.
    """
    _check_inputs(q, latent, start, latent_dim, latent_scale, sliding_window)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    platform = platform or default_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    B, _, N, C = q.shape
    S, R = latent.shape[1], latent_dim
    block_k = block_k or DEFAULT_BLOCK_K[platform]
    lo, hi = live_bounds(start, q_offset, S, sliding_window, ring)  # int32[B] each
    # f32[B, 1, S]: each slot's scale on the lane axis, broadcasting over the [M, block_k] score tile
    latent_scale = None if latent_scale is None else latent_scale.astype(jnp.float32)[:, None, :]
    q = q[:, 0].astype(matmul_dtype(q.dtype, latent.dtype))  # [B, N, C], cast once rather than per block
    if platform == "tpu":
        if heads_per_program is not None:
            raise ValueError("heads_per_program is a GPU knob; the TPU body holds every head in one program")
        M = cdiv(N, TPU_ROW_MULTIPLE) * TPU_ROW_MULTIPLE  # whole sublane tiles
        splits = splits or default_splits(platform, B, 1, cdiv(S, tpu_block(S, block_k)))
        acc, m, l = _mla_tpu(pad_axis(q, 1, M), latent, latent_scale, lo, hi, scale=scale, latent_dim=R,
                             block_k=block_k, splits=splits, ring=ring, interpret=interpret)
    else:
        E = C - R
        for name, width in (("latent_dim R", R), ("rotary width E", E)):
            if width < GPU_MIN_DIM or width & (width - 1):
                raise NotImplementedError(f"the GPU (Triton) MLA kernel needs R and E powers of two >= "
                                          f"{GPU_MIN_DIM} (DeepSeek: 512 and 64), got {name} = {width}")
        M = max(GPU_MIN_DIM, next_pow2(N))  # tl.dot needs M >= 16; padded rows are zeros, sliced off below
        Mh = min(M, heads_per_program or GPU_MAX_HEADS)
        if Mh < GPU_MIN_DIM or Mh & (Mh - 1):
            raise ValueError(f"heads_per_program must be a power of two >= {GPU_MIN_DIM}, got {Mh}")
        # A cache shorter than 16 slots is padded (copied) so the shifted block fits; only tiny caches are.
        Sp = max(S, GPU_MIN_DIM)
        latent = pad_axis(latent, 1, Sp)  # [B, Sp, C]
        if latent_scale is not None:
            latent_scale = pad_axis(latent_scale, 2, Sp)  # [B, 1, Sp]
        splits = splits or default_splits(platform, B * (M // Mh), 1, cdiv(Sp, gpu_block(Sp, block_k)))
        acc, m, l = _mla_gpu(pad_axis(q, 1, M), latent, latent_scale, lo, hi, scale=scale, latent_dim=R,
                             block_k=block_k, splits=splits, heads_per_program=Mh, ring_slots=S if ring else None,
                             interpret=interpret)
    return combine_splits(acc, m, l)[:, None, :N]  # [B, 1, N, R] float32
