"""Flash-decoding: one query token per sequence against the fixed-shape KV cache, as a Pallas kernel.

Also home of the math shared with `prefill_kernel` (masks, one online-softmax step, the split combine).

Memory-traffic argument
-----------------------
A decode step does about 2 FLOPs per byte of K/V it reads, so it is bound by HBM bandwidth and the only thing
that matters is how many bytes move. The kernel therefore:

* handles all G = N // K query heads of one KV group in one program: the G query rows are the M dimension of both
  matmuls, so each K/V block is read from HBM once per group, not once per query head (GQA and MQA get their whole
  saving, and MHA is the G = 1 case);
* reads only the blocks that hold live slots. Row b's query (in slot q_offset) may see slots [lo, hi] with
  lo = max(start[b], q_offset - window + 1) and hi = min(q_offset, S - 1). The cache's S slots are cut into
  blocks of `block_k` and only blocks lo // block_k .. hi // block_k are read: with S = 4096 and 100 live tokens
  that is at most ceil(100 / block_k) + 1 blocks, not S / block_k. Masking happens inside those blocks only;
* keeps the softmax online (running max m, running sum l, float32 accumulator acc), so nothing of size S is
  materialised, whatever the cache dtype;
* optionally splits a row's live blocks evenly over `splits` parallel programs (flash-decoding). The share of each
  split is computed at run time from the live length, so short rows do not leave most splits idle while one does
  all the work. Each split returns (acc, m, l) and `combine_splits` merges them with a log-sum-exp rescale in plain
  jnp (B * K * splits * G * H floats, negligible next to the K/V bytes). Splits matter on GPUs, where B * K alone
  may give fewer programs than there are SMs.

Block skipping, per backend
---------------------------
One kernel body cannot serve both Pallas backends, so there are two small bodies sharing the math below.

Pallas TPU (Mosaic), `_decode_kernel_tpu`: Mosaic pipelines BlockSpec'd inputs, DMA-ing the block that the
index_map names into VMEM ahead of the body, and the grid's last axis ("arbitrary") walks key blocks in order with
the softmax state in VMEM scratch. The live bounds lo, hi are scalar-prefetched into SMEM
(`pltpu.PrefetchScalarGridSpec`), so the K/V index_map can clamp the block index into the row's live range: a grid
step past the last live block names the same block as the step before it, the pipeline issues no DMA for a block
it already holds, and `pl.when` skips the compute. A skipped step costs the fixed per-step overhead, no HBM
traffic. (An entirely empty row, one with lo > hi, still fetches one block: the index map must name some block.)

Pallas GPU (Triton), `_decode_kernel_gpu`: Triton has neither scalar prefetch nor a sequential grid axis with
scratch (programs run concurrently and keep state in registers). Each program gets its (b, h) row of K and V as a
[S, H] ref, which on Triton is only a pointer: nothing is read until the body loads. The body runs a
`lax.fori_loop` with a dynamic trip count over its live blocks (lowered to `scf.for`, which Triton pipelines) and
loads each block with `k_ref[pl.ds(offset, block_k), :]`, so dead blocks are never read. Triton tensors must have
power-of-two sizes, so a block that would run past S is loaded shifted back to end exactly at S
(offset = min(j * block_k, S - block_k)) and the slots it re-reads from the previous block are masked out: no
out-of-bounds access and no padded copy of the cache.

Both bodies mask with `jnp.where` (scores to a large finite negative, probabilities of dead slots to exactly 0,
values of dead slots to 0 so that 0 * NaN cannot occur), so garbage or NaN in a dead slot inside a read block
cannot leak, and a row with no live slot ends with l = 0 and returns 0 instead of NaN.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxkv.attention.reference import MASKED

# Triton's dot (tl.dot) needs every matmul dimension >= 16, and every loaded tensor a power-of-two size.
GPU_MIN_DIM = 16
# Mosaic tiles the last two dims of a block by (8, 128): query rows are padded to a multiple of 8 sublanes, and
# key blocks are multiples of 128 so that the [rows, block_k] score tile is lane-dense.
TPU_ROW_MULTIPLE = 8
TPU_LANES = 128

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: [R, H] x [C, H] -> [R, C]
_NN = (((1,), (0,)), ((), ()))  # plain matmul: [R, C] x [C, H] -> [R, H]


# --- shared math (plain jnp/lax: lowers on Mosaic, Triton and the interpreter alike) ---------------------------


def cdiv(a, b):
    """Ceiling division for Python ints or non-negative int32 scalars (lax.div truncates; operands are >= 0)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + (b - 1), jnp.int32(b))


def block_range(lo, hi, block: int):
    """(first block, number of blocks) covering slots [lo, hi]; zero blocks when lo > hi. int32 scalars >= 0."""
    first = lax.div(lo, jnp.int32(block))
    last = lax.div(hi, jnp.int32(block))
    return first, jnp.where(lo <= hi, last - first + 1, 0)


def split_share(count, splits: int, split):
    """[begin, end): the blocks (counted from the first live one) that program `split` of `splits` handles."""
    per = cdiv(count, splits)
    begin = split * per
    return begin, jnp.minimum(begin + per, count)


def _precision(dtype):
    # float32 inputs: full-precision matmuls (no TF32 on GPU, 6-pass bf16 on TPU), to match the XLA reference.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def reset_softmax_state(m_scr, l_scr, acc_scr):
    """Starts an online softmax: running max at MASKED, running sum and accumulator at 0 (TPU scratch refs)."""
    m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)


def online_softmax_step(m_prev, l_prev, acc_prev, q, k, v, live, v_live, *, scale: float):
    """Folds one key block into the online softmax state.

    Args:
      m_prev, l_prev: f32[R, 1] running max and running sum of exp(score - max).
      acc_prev: f32[R, H] running sum of exp(score - max) * value.
      q: [R, H] query rows; k, v: [C, H] one key block.
      live: bool[R, C], which (row, key) pairs may attend.
      v_live: bool[C, H], value slots that any row may see (the others are zeroed: 0 * NaN is NaN).

    Returns:
      (m, l, acc) after the block.
    """
    precision = _precision(q.dtype)
    s = lax.dot_general(q, k, _NT, precision=precision, preferred_element_type=jnp.float32) * scale  # [R, C]
    s = jnp.where(live, s, MASKED)
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    alpha = jnp.exp(m_prev - m)  # [R, 1]; 0 when the first live score arrives after a masked-only history
    # Explicitly 0 for dead pairs: a row with nothing live so far keeps l = 0 (exp(MASKED - MASKED) would be 1).
    p = jnp.where(live, jnp.exp(s - m), 0.0)  # [R, C]
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)  # [R, 1]
    v = jnp.where(v_live, v, jnp.zeros((), v.dtype))
    # p is rounded to the value dtype (bf16 MXU / tensor-core inputs); the accumulation stays float32.
    pv = lax.dot_general(p.astype(v.dtype), v, _NN, precision=precision, preferred_element_type=jnp.float32)
    return m, l, alpha * acc_prev + pv  # acc: [R, H]


def normalize(acc, l):
    """acc / l, with 0 (not NaN) for rows that saw no live key (l == 0)."""
    return acc / jnp.where(l > 0, l, 1.0)


def decode_masks(offset, floor, lo, hi, rows: int, cols: int, head_dim: int):
    """Masks of a decode block whose column c holds slot offset + c; all rows share the query slot.

    A slot counts if lo <= slot <= hi (the row's live range) and slot >= floor (on GPU a shifted block re-reads
    slots below `floor` that the previous block already folded in). Returns (live bool[rows, cols],
    v_live bool[cols, head_dim]); full-shape 2-D iotas because Mosaic has no 1-D iota and lays 2-D ones out best.
    """
    lo = jnp.maximum(lo, floor)
    slot = offset + lax.broadcasted_iota(jnp.int32, (rows, cols), 1)  # [R, C]
    v_slot = offset + lax.broadcasted_iota(jnp.int32, (cols, head_dim), 0)  # [C, H]
    return (slot >= lo) & (slot <= hi), (v_slot >= lo) & (v_slot <= hi)


def combine_splits(acc, m, l):
    """Merges per-split partial results: acc f32[..., P, R, H], m, l f32[..., P, R, 1] -> f32[..., R, H].

    Each split's state is rescaled to the global max (log-sum-exp combine). Empty splits have l = 0 and acc = 0,
    so they add nothing; a row with no live key anywhere gets 0.
    """
    m_all = jnp.max(m, axis=-3, keepdims=True)  # [..., 1, R, 1]
    w = jnp.exp(m - m_all)  # [..., P, R, 1]
    return normalize(jnp.sum(w * acc, axis=-3), jnp.sum(w * l, axis=-3))  # [..., R, H]


def live_bounds(start, q_offset, num_slots: int, sliding_window: int | None):
    """int32[B] lo, hi: the slots the query in slot q_offset of each row may see are [lo, hi] (none if lo > hi)."""
    q_offset = jnp.asarray(q_offset, jnp.int32)
    lo = jnp.asarray(start, jnp.int32)
    if sliding_window is not None:
        lo = jnp.maximum(lo, q_offset - (sliding_window - 1))
    hi = jnp.broadcast_to(jnp.minimum(q_offset, num_slots - 1), lo.shape)
    return lo, hi


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def pad_axis(x, axis: int, size: int):
    """x zero-padded at the end of `axis` to `size` (no copy when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def gpu_block(num_slots: int, block: int) -> int:
    """A Triton key-block size for `num_slots` slots: a power of two >= 16 and <= num_slots (the shifted last
    block must fit), assuming num_slots >= 16 (callers pad smaller arrays)."""
    if block < GPU_MIN_DIM or block & (block - 1):
        raise ValueError(f"GPU block sizes must be powers of two >= {GPU_MIN_DIM}, got {block}")
    return min(block, prev_pow2(num_slots))


def tpu_block(num_slots: int, block: int) -> int:
    """A Mosaic key-block size: `block` (a multiple of 128; the last block may be partial, which Pallas TPU pads),
    or the whole axis when it is shorter (a block equal to the array dim is always legal)."""
    if block % TPU_LANES:
        raise ValueError(f"TPU key block sizes must be multiples of {TPU_LANES}, got {block}")
    return num_slots if num_slots <= block else block


# --- TPU (Mosaic) --------------------------------------------------------------------------------------------


def _tpu_step_block(b, split, j, lo_ref, hi_ref, *, block_k: int, splits: int, num_blocks: int):
    """(block index, whether it holds live slots) for grid step (b, split, j); used by index_map and body alike.

    Past the end of this split's share the index repeats the share's last block (the previous step's block: no
    DMA); an empty share repeats the last live block, which the previous split ended on.
    """
    first, count = block_range(lo_ref[b], hi_ref[b], block_k)
    begin, end = split_share(count, splits, split)
    i = jnp.maximum(jnp.minimum(begin + j, end - 1), 0)  # end - 1 = count - 1 for an empty share
    block = jnp.clip(first + i, 0, num_blocks - 1)
    return block, begin + j < end


def _decode_kernel_tpu(lo_ref, hi_ref, q_ref, k_ref, v_ref, acc_out, m_out, l_out, m_scr, l_scr, acc_scr, *,
                       scale: float, block_k: int, splits: int, num_blocks: int):
    """Grid (B, K, splits, blocks per split). q_ref [R, H]; k_ref, v_ref [block_k, H]; outputs are this split's
    (acc [R, H], m [R, 1], l [R, 1]), written at its last step."""
    b, split, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block, live_step = _tpu_step_block(b, split, j, lo_ref, hi_ref, block_k=block_k, splits=splits,
                                       num_blocks=num_blocks)

    pl.when(j == 0)(functools.partial(reset_softmax_state, m_scr, l_scr, acc_scr))

    @pl.when(live_step)
    def _step():
        rows, head_dim = q_ref.shape
        live, v_live = decode_masks(block * block_k, block * block_k, lo_ref[b], hi_ref[b], rows, block_k,
                                    head_dim)
        m, l, acc = online_softmax_step(m_scr[...], l_scr[...], acc_scr[...], q_ref[...], k_ref[...], v_ref[...],
                                        live, v_live, scale=scale)
        m_scr[...], l_scr[...], acc_scr[...] = m, l, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _emit():
        acc_out[...], m_out[...], l_out[...] = acc_scr[...], m_scr[...], l_scr[...]


def _decode_tpu(q, k, v, lo, hi, *, scale: float, block_k: int, splits: int, interpret):
    """q [B, K, R, H] (R = G padded to a multiple of 8); k, v [B, K, S, H]; lo, hi int32[B]
    -> per-split (acc f32[B, K, P, R, H], m, l f32[B, K, P, R, 1])."""
    B, K, R, H = q.shape
    S = k.shape[2]
    block_k = tpu_block(S, block_k)
    num_blocks = cdiv(S, block_k)
    splits = max(1, min(splits, num_blocks))
    step_block = functools.partial(_tpu_step_block, block_k=block_k, splits=splits, num_blocks=num_blocks)

    def kv_map(b, h, split, j, lo_ref, hi_ref):
        return b, h, step_block(b, split, j, lo_ref, hi_ref)[0], 0

    def row_map(b, h, split, j, lo_ref, hi_ref):
        return b, h, 0, 0

    def out_map(b, h, split, j, lo_ref, hi_ref):
        return b, h, split, 0, 0

    kv_spec = pl.BlockSpec((None, None, block_k, H), kv_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # lo, hi: read by the index maps before each step's DMA is issued
        grid=(B, K, splits, cdiv(num_blocks, splits)),
        in_specs=[pl.BlockSpec((None, None, R, H), row_map), kv_spec, kv_spec],
        out_specs=[pl.BlockSpec((None, None, None, R, H), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map)],
        scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                        pltpu.VMEM((R, H), jnp.float32)],
    )
    kernel = functools.partial(_decode_kernel_tpu, scale=scale, block_k=block_k, splits=splits,
                               num_blocks=num_blocks)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxkv_decode_attention",
    )(lo, hi, q, k, v)


# --- GPU (Triton) --------------------------------------------------------------------------------------------


def _decode_kernel_gpu(lo_ref, hi_ref, q_ref, k_ref, v_ref, acc_out, m_out, l_out, *, scale: float, block_k: int,
                       splits: int):
    """Grid (B, K, splits). lo_ref, hi_ref [1]; q_ref [R, H]; k_ref, v_ref [S, H] (a pointer: only the loop's
    slices are read); outputs this split's (acc [R, H], m [R, 1], l [R, 1])."""
    lo, hi = lo_ref[0], hi_ref[0]
    num_slots = k_ref.shape[0]
    q = q_ref[...]  # [R, H]
    rows, head_dim = q.shape
    first, count = block_range(lo, hi, block_k)
    begin, end = split_share(count, splits, pl.program_id(2))

    def body(i, carry):
        floor = (first + i) * block_k  # first slot of live block first + i
        offset = jnp.minimum(floor, num_slots - block_k)  # shifted back to end at S, never past it
        k = k_ref[pl.ds(offset, block_k), :]  # [block_k, H]
        v = v_ref[pl.ds(offset, block_k), :]  # [block_k, H]
        live, v_live = decode_masks(offset, floor, lo, hi, rows, block_k, head_dim)
        return online_softmax_step(*carry, q, k, v, live, v_live, scale=scale)

    init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(begin, end, body, init)  # dynamic trip count: only live blocks are loaded
    acc_out[...], m_out[...], l_out[...] = acc, m, l


def _decode_gpu(q, k, v, lo, hi, *, scale: float, block_k: int, splits: int, interpret):
    """q [B, K, R, H] (R, H powers of two >= 16); k, v [B, K, S, H] with S >= 16; lo, hi int32[B]
    -> per-split (acc f32[B, K, P, R, H], m, l f32[B, K, P, R, 1])."""
    B, K, R, H = q.shape
    S = k.shape[2]
    block_k = gpu_block(S, block_k)
    splits = max(1, min(splits, cdiv(S, block_k)))

    def scalar_map(b, h, split):
        return (b,)

    def row_map(b, h, split):
        return b, h, 0, 0

    def out_map(b, h, split):
        return b, h, split, 0, 0

    kernel = functools.partial(_decode_kernel_gpu, scale=scale, block_k=block_k, splits=splits)
    return pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[pl.BlockSpec((1,), scalar_map), pl.BlockSpec((1,), scalar_map),
                  pl.BlockSpec((None, None, R, H), row_map),
                  pl.BlockSpec((None, None, S, H), row_map),  # whole row: a base pointer, loaded per block
                  pl.BlockSpec((None, None, S, H), row_map)],
        out_specs=[pl.BlockSpec((None, None, None, R, H), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map)],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32)],
        # Explicit Triton params: without them JAX 0.10 lowers GPU pallas_calls with Mosaic GPU.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxkv_decode_attention",
    )(lo, hi, q, k, v)


# --- public --------------------------------------------------------------------------------------------------

DEFAULT_BLOCK_K = types.MappingProxyType({"tpu": 512, "gpu": 64})  # read-only


def default_splits(platform: str, batch: int, kv_heads: int, num_blocks: int) -> int:
    """Static split count: on GPU enough programs to fill a big GPU (~512 in flight) when B * K is small; on TPU
    1 (the grid runs in order on one core; B and K already feed both megacore cores)."""
    if platform == "tpu":
        return 1
    return max(1, min(16, num_blocks, cdiv(512, batch * kv_heads)))


def decode_attention(q, k, v, start, q_offset, *, scale: float, sliding_window: int | None = None,
                     platform: str = "tpu", block_k: int | None = None, splits: int | None = None,
                     interpret=False):
    """Attention of one query per sequence over the cache; same contract as `reference.attention` with T == 1.

    Args:
      q: [B, 1, N, H]; k, v: [B, K, S, H]; start: int32[B]; q_offset: int32[] (the query's slot).
      platform: "tpu" (Mosaic body) or "gpu" (Triton body).
      block_k: slots per key block (TPU: a multiple of 128; GPU: a power of two >= 16).
      splits: parallel programs per (sequence, KV head); default `default_splits`.
      interpret: run the kernel in the Pallas interpreter (any truthy value pallas_call accepts).

    Returns:
      [B, 1, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    if T != 1:
        raise ValueError(f"decode_attention takes one query per sequence, got T={T}")
    G, dtype = N // K, q.dtype
    block_k = block_k or DEFAULT_BLOCK_K.get(platform, 0)
    lo, hi = live_bounds(start, q_offset, S, sliding_window)  # int32[B] each
    q = q.reshape(B, K, G, H)  # [B, K, G, H]: query head n = kv_head * G + g
    if platform == "tpu":
        R = -(-G // TPU_ROW_MULTIPLE) * TPU_ROW_MULTIPLE  # whole sublane tiles: G = 1..7 has no legal layout
        splits = splits or default_splits(platform, B, K, cdiv(S, tpu_block(S, block_k)))
        acc, m, l = _decode_tpu(pad_axis(q, 2, R), k, v, lo, hi, scale=scale, block_k=block_k, splits=splits,
                                interpret=interpret)
    elif platform == "gpu":
        R = max(GPU_MIN_DIM, next_pow2(G))  # tl.dot needs M >= 16; the padded rows are zeros, sliced off below
        Hp = max(GPU_MIN_DIM, next_pow2(H))
        # A head dim that is not a power of two forces a padded copy of the cache (Triton tensors are powers of
        # two); a cache shorter than 16 slots is padded so the shifted block fits. Both copies are the exception.
        q = pad_axis(pad_axis(q, 2, R), 3, Hp)  # [B, K, R, Hp]
        Sp = max(S, GPU_MIN_DIM)
        k = pad_axis(pad_axis(k, 3, Hp), 2, Sp)  # [B, K, Sp, Hp]
        v = pad_axis(pad_axis(v, 3, Hp), 2, Sp)  # [B, K, Sp, Hp]
        splits = splits or default_splits(platform, B, K, cdiv(Sp, gpu_block(Sp, block_k)))
        acc, m, l = _decode_gpu(q, k, v, lo, hi, scale=scale, block_k=block_k, splits=splits, interpret=interpret)
    else:
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    out = combine_splits(acc, m, l)[:, :, :G, :H]  # [B, K, G, H] float32
    return out.reshape(B, 1, N, H).astype(dtype)
