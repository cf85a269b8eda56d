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

Quantized and mixed-dtype caches
--------------------------------
An int8 or float8_e4m3fn cache comes with float32 scales [B, K, S], one per slot and KV head. Each kernel step
loads the scale block of its K/V block (TPU: a BlockSpec with the same block index along S as K/V; GPU: a `pl.ds`
load of the same slots) and dequantizes inside the block's matmuls, never as a copy of the cache. Because a slot's
scale is constant over the head dim, it is applied to that slot's column of the [R, block_k] tiles instead of to
the [block_k, H] block: q.(k * ks) = (q.k) * ks and sum_c p_c (v_c * vs_c) = sum_c (p_c * vs_c) v_c, which is
the same dequantization in R * block_k multiplies instead of block_k * H, on lane-dense tiles (no relayout of a
[block_k] vector into a column on Mosaic). The raw block is cast to the matmul dtype (`matmul_dtype`): q's dtype
when the conversion is exact (int8 and float8 values are exact in bfloat16, float16 and float32), else the
promotion of the two (float32 q over a bfloat16 cache: float32). Accumulation is float32 throughout.

Ring caches
-----------
A ring cache (a sliding-window model's S = window slots) keeps absolute slot s at index s mod S, so a row's live
slots are not one interval of indices: with qi = q_offset mod S and max_age the largest age (q_offset - slot) a
row may see, the live indices are [qi - max_age, qi] taken mod S, i.e. [lo, hi] with lo possibly below 0 wrapping
to [lo + S, S - 1] (`live_bounds(..., ring=True)`, `decode_masks(..., wrap=S)`). The ring kernels visit every block
of the S slots: in steady state max_age = window - 1 = S - 1 and nearly every slot is live, so skipping would save
at most a block; the per-slot mask does the rest. Non-ring caches keep the live-block skipping above.

Both bodies mask with `jnp.where` (scores to a large finite negative, probabilities of dead slots to exactly 0,
values of dead slots to 0 so that 0 * NaN cannot occur), so garbage or NaN in a dead slot inside a read block
cannot leak (nor can a garbage scale: a dead slot's probability is zeroed after its value scale is applied), and
a row with no live slot ends with l = 0 and returns 0 instead of NaN.

Soft-capping
------------
With `softcap` (Gemma 2), each block's scaled float32 score tile becomes softcap * tanh(s / softcap) inside
`online_softmax_step`, after the key scales and `scale` and before the live mask, as `reference.soft_cap` does; a
static Python float baked into the kernel like `scale` (None traces exactly the uncapped kernel). Capping is
elementwise on the [R, block_k] score tile: no memory traffic, R * block_k tanh per block.

Attention sinks
---------------
With `sinks` (gpt-oss: one learned logit per query head in the softmax denominator, `reference`), the kernel is
unchanged: the sink enters `combine_splits`, which already merges the splits' (acc, m, l) in plain jnp, as one more
partial state (max = the row's sink, sum = 1, accumulator 0), so it is counted once whatever the split count, and a
row with no live key gets 0. The kernels that normalize in the kernel (`prefill_kernel`, the TPU body of
`paged_decode_kernel`) start their online softmax from that state instead (`reset_softmax_state`, `sink_state`).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jaxkv.attention.pallas_namespace import pl, pltpu, pltriton, require_triton

from jaxkv.attention.reference import (MASKED, check_chunk, check_sinks, check_softcap, dot_precision, grouped_sinks,
                                      soft_cap)

# Triton's dot (tl.dot) needs every matmul dimension >= 16, and every loaded tensor a power-of-two size.
GPU_MIN_DIM = 16
# Mosaic tiles the last two dims of a block by (8, 128): query rows are padded to a multiple of 8 sublanes, and
# key blocks are multiples of 128 so that the [rows, block_k] score tile is lane-dense.
TPU_ROW_MULTIPLE = 8
TPU_LANES = 128

NT_DIMS = (((1,), (1,)), ((), ()))  # contract the last dims: [R, H] x [C, H] -> [R, C]
NN_DIMS = (((1,), (0,)), ((), ()))  # plain matmul: [R, C] x [C, H] -> [R, H]


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


def matmul_dtype(q_dtype, kv_dtype):
    """The dtype both matmuls take their inputs in: q's when the cache's numbers convert to it exactly (1-byte
    caches: int8 and float8 values are exact in bfloat16, float16 and float32), else the promotion of the two
    (float32 q over a bfloat16 cache: float32; bfloat16 with float16: float32)."""
    if jnp.dtype(kv_dtype).itemsize == 1:
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, kv_dtype)


def check_scales(k, k_scale, v_scale):
    """Both scales or neither; each float32-castable [B, K, S] like the cache's first three axes."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (a quantized cache) or neither")
    if k_scale is not None:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x.shape != k.shape[:3]:
                raise ValueError(f"{name} must have shape {k.shape[:3]} (B, K, S), got {x.shape}")


def scale_rows(x):
    """[B, K, S] scales -> float32 [B, K, 1, S] (a free reshape): each slot's scale on the lane axis, so a kernel's
    [1, block_k] scale block broadcasts over the [R, block_k] score tile without a relayout."""
    return None if x is None else x.astype(jnp.float32)[:, :, None, :]


def split_scale_refs(refs, quantized: bool):
    """(k_scale ref, v_scale ref, the remaining refs): the scale inputs follow K and V only for a quantized cache."""
    return (*refs[:2], refs[2:]) if quantized else (None, None, refs)


def load_scale(ref, *index):
    """The f32[1, C] scale block at `index` of a scale ref, or None for an unquantized cache."""
    return None if ref is None else ref[index or (...,)]


def reset_softmax_state(m_scr, l_scr, acc_scr, sink_ref=None):
    """Starts an online softmax: running max at MASKED, running sum and accumulator at 0 (TPU scratch refs).

    With `sink_ref` (attention sinks: a ref whose block broadcasts to m_scr's [R, 1], each row's sink logit) the
    state starts as if the sink were one key already folded in that weighs no value: max = sink, sum = exp(sink -
    sink) = 1, accumulator 0. The blocks then fold in as usual, so the sink joins the denominator exactly once
    (`sink_state`)."""
    if sink_ref is None:
        m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    else:
        m_scr[...], l_scr[...] = sink_state(sink_ref[...], m_scr.shape)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)


def sink_state(sink, shape):
    """(m, l) f32[shape] of an online softmax that has seen only the sink: m = sink (broadcast), l = 1. A row that
    then sees no live key ends with acc = 0 and l = 1: output 0, as `reference.softmax` gives it."""
    return jnp.broadcast_to(sink.astype(jnp.float32), shape), jnp.ones(shape, jnp.float32)


def online_softmax_step(m_prev, l_prev, acc_prev, q, k, v, live, v_live, *, scale: float, k_scale=None,
                        v_scale=None, softcap: float | None = None):
    """Folds one key block into the online softmax state.

    Args:
      m_prev, l_prev: f32[R, 1] running max and running sum of exp(score - max).
      acc_prev: f32[R, H] running sum of exp(score - max) * value.
      q: [R, H] query rows, already in `matmul_dtype(q, cache)`; k, v: [C, H] one key block in the cache dtype.
      live: bool[R, C], which (row, key) pairs may attend.
      v_live: bool[C, H], value slots that any row may see (the others are zeroed: 0 * NaN is NaN).
      k_scale, v_scale: f32[1, C] the block's dequantization scales (quantized caches), else None.
      softcap: a static float: scores become softcap * tanh(s / softcap) before masking (`reference.soft_cap`);
        None: uncapped.

    Returns:
      (m, l, acc) after the block.
    """
    dtype = q.dtype
    precision = dot_precision(dtype)
    k, v = k.astype(dtype), v.astype(dtype)  # exact for int8/fp8 into q's dtype (`matmul_dtype`)
    s = lax.dot_general(q, k, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)  # [R, C]
    if k_scale is not None:
        s = s * k_scale  # q.(k * ks) = (q.k) * ks: the keys dequantized, per column
    # Capped before the mask, so a dead slot gets MASKED itself (and a NaN key's NaN score is selected away).
    s = jnp.where(live, soft_cap(s * scale, softcap), MASKED)
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    alpha = jnp.exp(m_prev - m)  # [R, 1]; 0 when the first live score arrives after a masked-only history
    # Explicitly 0 for dead pairs: a row with nothing live so far keeps l = 0 (exp(MASKED - MASKED) would be 1).
    p = jnp.where(live, jnp.exp(s - m), 0.0)  # [R, C]
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)  # [R, 1]
    if v_scale is not None:
        # sum_c p_c (v_c * vs_c) = sum_c (p_c * vs_c) v_c; the where keeps a dead slot's garbage scale out (0 * NaN).
        p = jnp.where(live, p * v_scale, 0.0)
    v = jnp.where(v_live, v, jnp.zeros((), dtype))
    # p is rounded to the matmul dtype (bf16 MXU / tensor-core inputs); the accumulation stays float32.
    pv = lax.dot_general(p.astype(dtype), v, NN_DIMS, precision=precision, preferred_element_type=jnp.float32)
    return m, l, alpha * acc_prev + pv  # acc: [R, H]


def normalize(acc, l):
    """acc / l, with 0 (not NaN) for rows that saw no live key (l == 0)."""
    return acc / jnp.where(l > 0, l, 1.0)


def decode_masks(offset, floor, lo, hi, rows: int, cols: int, head_dim: int, wrap: int | None = None,
                 row_bounds=None, value_bounds=None):
    """Masks of a decode block whose column c holds cache index offset + c.

    An index counts if lo <= index <= hi (the live range) and index >= floor (on GPU a shifted block re-reads
    indices below `floor` that the previous block already folded in). For a ring of `wrap` slots, lo may be below
    0 and the range wraps: indices in [lo + wrap, wrap - 1] count too. Returns (live bool[rows, cols],
    v_live bool[cols, head_dim]); full-shape 2-D iotas because Mosaic has no 1-D iota and lays 2-D ones out best.

    One query per sequence: every row shares the scalar range [lo, hi]. Several (`row_bounds`: int32[rows, 1]
    lo and hi per row, one query position per row): `live` takes each row's own range and `v_live` the scalar
    [lo, hi], which must then be the union of the rows' ranges, or `value_bounds`, scalar (lo, hi) pairs whose
    ranges together are that union (values no row may see are zeroed, so that 0 x NaN cannot occur).
    """

    def counts(index, lo, hi):
        inside = (index >= lo) & (index <= hi)
        if wrap is not None:
            inside |= (index >= lo + wrap) & (index < wrap)  # the wrapped part; empty when lo >= 0
        return inside & (index >= floor)

    slot = offset + lax.broadcasted_iota(jnp.int32, (rows, cols), 1)  # [R, C]
    v_slot = offset + lax.broadcasted_iota(jnp.int32, (cols, head_dim), 0)  # [C, H]
    live = counts(slot, lo, hi) if row_bounds is None else counts(slot, *row_bounds)  # row bounds [R, 1] broadcast
    if value_bounds is None:
        return live, counts(v_slot, lo, hi)
    v_live = functools.reduce(jnp.logical_or, [counts(v_slot, *b) for b in value_bounds])
    return live, v_live


def combine_splits(acc, m, l, sinks=None):
    """Merges per-split partial results: acc f32[..., P, R, H], m, l f32[..., P, R, 1] -> f32[..., R, H].

    Each split's state is rescaled to the global max (log-sum-exp combine). Empty splits have l = 0 and acc = 0,
    so they add nothing; a row with no live key anywhere gets 0.

    `sinks` (attention sinks: f32[..., R, 1], broadcasting against m without its split axis; `row_sinks`) joins as
    one more partial state, the sink's own: max = sink, sum = 1, accumulator 0. Here, after the splits, it is
    counted exactly once however many splits there are (and a row with no live key still gets 0: acc / 1).
    """
    m_all = jnp.max(m, axis=-3, keepdims=True)  # [..., 1, R, 1]
    if sinks is None:
        w = jnp.exp(m - m_all)  # [..., P, R, 1]
        return normalize(jnp.sum(w * acc, axis=-3), jnp.sum(w * l, axis=-3))  # [..., R, H]
    sinks = jnp.expand_dims(sinks.astype(jnp.float32), -3)  # [..., 1, R, 1]
    m_all = jnp.maximum(m_all, sinks)
    w = jnp.exp(m - m_all)  # [..., P, R, 1]
    l_all = jnp.sum(w * l, axis=-3) + jnp.squeeze(jnp.exp(sinks - m_all), -3)  # [..., R, 1]
    return normalize(jnp.sum(w * acc, axis=-3), l_all)  # [..., R, H]


def live_bounds(start, q_offset, num_slots: int, sliding_window: int | None, ring: bool = False,
                chunk: int | None = None):
    """int32[B] lo, hi: the cache indices the query in slot q_offset of each row may see are [lo, hi] (none if
    lo > hi).

    A chunk (Llama 4's chunked attention, `reference`) is one more lower bound, like the window: the query at
    position p = q_offset - start sees back to its chunk's first position, p - p mod chunk (age p mod chunk).

    For a ring, hi = q_offset mod S (the query's own index) and lo = hi - max_age, where max_age is the oldest age
    q_offset - slot the row may see (start, window and S bound it); lo < 0 means the range wraps to
    [lo + S, S - 1] (`decode_masks(..., wrap=S)`). A row with nothing live has lo > hi >= 0, so neither part
    holds an index.
    """
    q_offset = jnp.asarray(q_offset, jnp.int32)
    lo = jnp.asarray(start, jnp.int32)
    if ring:
        max_age = jnp.minimum(q_offset - lo, num_slots - 1)  # [B]; negative when start is past the query
        if sliding_window is not None:
            max_age = jnp.minimum(max_age, sliding_window - 1)
        if chunk is not None:
            max_age = jnp.minimum(max_age, jnp.remainder(q_offset - lo, chunk))
        hi = jnp.remainder(q_offset, num_slots)
        return hi - max_age, jnp.broadcast_to(hi, max_age.shape)
    if sliding_window is not None:
        lo = jnp.maximum(lo, q_offset - (sliding_window - 1))
    if chunk is not None:
        lo = jnp.maximum(lo, q_offset - jnp.remainder(q_offset - jnp.asarray(start, jnp.int32), chunk))
    hi = jnp.broadcast_to(jnp.minimum(q_offset, num_slots - 1), lo.shape)
    return lo, hi


def query_block_bounds(start, q_offset, num_queries: int, num_slots: int, sliding_window: int | None,
                       ring: bool = False, chunk: int | None = None):
    """Live bounds of T consecutive queries (slots q_offset .. q_offset + T - 1) of each row: (lo, hi int32[B, T],
    each query's own range as `live_bounds` gives it; lo_all, hi_all int32[B], the union of a row's ranges).

    The union is one range: a query's bounds move by at most one slot from the one before it (the window and the
    ring bound move with the query, `start` does not), so consecutive ranges touch or overlap, and a query with
    nothing live (start past it) precedes every one with something. Its lower end is the first query's lower end
    and its upper end the last query's. In a ring the union counts absolute slots: it spans T - 1 + (the first
    query's oldest age) slots below the last query's index, wrapping (all S indices once it spans S or more)."""
    q_offset = jnp.asarray(q_offset, jnp.int32)
    start = jnp.asarray(start, jnp.int32)
    shape = (start.shape[0], num_queries)
    slots = jnp.broadcast_to(q_offset + jnp.arange(num_queries, dtype=jnp.int32)[None, :], shape)  # [B, T]
    # (a chunk boundary moves a query's lower bound forward by up to `chunk`: the union below stays a superset)
    lo, hi = live_bounds(jnp.broadcast_to(start[:, None], shape), slots, num_slots, sliding_window, ring, chunk)
    if ring:  # the union's oldest slot is the first query's: hi_all - lo_all = T - 1 + its oldest age
        hi_all = hi[:, -1]
        return lo, hi, hi_all - (num_queries - 1) - (hi[:, 0] - lo[:, 0]), hi_all
    return lo, hi, lo[:, 0], hi[:, -1]


def row_bounds(lo, hi, groups: int, rows: int):
    """Per-query bounds [B, T] -> per kernel row int32[B, rows, 1]: row r = t * groups + g is query t of query
    head g of the KV group; rows past T * groups (padding) get an empty range (lo 1 > hi 0, wrapped or not)."""
    B, T = lo.shape

    def expand(x, fill):
        x = jnp.repeat(x, groups, axis=1)  # [B, T * G]
        return jnp.pad(x, ((0, 0), (0, rows - T * groups)), constant_values=fill)[:, :, None]

    return expand(lo, 1), expand(hi, 0)


def row_sinks(sinks, kv_heads: int, queries: int, rows: int):
    """float32[N] attention sinks (or None) -> f32[K, rows, 1], each kernel row's sink: row r = t * G + g is query t
    of query head n = kv_head * G + g, so every query position of a head gets that head's sink; rows past T * G
    (padding, sliced off) get 0. The [rows, 1] layout is the kernels' m and l column."""
    if sinks is None:
        return None
    per_head = grouped_sinks(sinks, kv_heads)  # [K, G]
    return pad_axis(jnp.tile(per_head, (1, queries)), 1, rows)[:, :, None]  # [K, T * G] -> [K, rows, 1]


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


def tpu_step_block(b, split, j, lo_ref, hi_ref, *, block_k: int, splits: int, num_blocks: int,
                    ring: bool = False):
    """(block index, whether it holds live slots) for grid step (b, split, j); used by index_map and body alike.

    Past the end of this split's share the index repeats the share's last block (the previous step's block: no
    DMA); an empty share repeats the last live block, which the previous split ended on. A ring visits all blocks.
    """
    if ring:
        first, count = jnp.int32(0), jnp.int32(num_blocks)
    else:
        first, count = block_range(lo_ref[b], hi_ref[b], block_k)
    begin, end = split_share(count, splits, split)
    i = jnp.maximum(jnp.minimum(begin + j, end - 1), 0)  # end - 1 = count - 1 for an empty share
    block = jnp.clip(first + i, 0, num_blocks - 1)
    return block, begin + j < end


def split_row_refs(refs, per_row: bool):
    """(the row bounds (lo ref, hi ref) or None, the remaining refs): the per-row bound inputs follow q only when
    the rows hold several query positions."""
    return ((refs[0], refs[1]), refs[2:]) if per_row else (None, refs)


def load_rows(bounds):
    """The [R, 1] per-row (lo, hi) blocks of `split_row_refs`, or None."""
    return None if bounds is None else (bounds[0][...], bounds[1][...])


def _decode_kernel_tpu(lo_ref, hi_ref, q_ref, *refs, scale: float, block_k: int, splits: int, num_blocks: int,
                       quantized: bool, ring_slots: int | None, softcap: float | None = None, per_row: bool = False):
    """Grid (B, K, splits, blocks per split). q_ref [R, H]; with `per_row`, row lo and hi refs [R, 1] (lo_ref, hi_ref
    then hold the union of the rows' ranges); k_ref, v_ref [block_k, H]; then, for a quantized cache, ks_ref, vs_ref
    [1, block_k]; outputs are this split's (acc [R, H], m [R, 1], l [R, 1]), written at its last step; scratch m, l,
    acc."""
    rows_refs, (k_ref, v_ref, *refs) = split_row_refs(refs, per_row)
    ks_ref, vs_ref, (acc_out, m_out, l_out, m_scr, l_scr, acc_scr) = split_scale_refs(refs, quantized)
    b, split, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block, live_step = tpu_step_block(b, split, j, lo_ref, hi_ref, block_k=block_k, splits=splits,
                                       num_blocks=num_blocks, ring=ring_slots is not None)

    pl.when(j == 0)(functools.partial(reset_softmax_state, m_scr, l_scr, acc_scr))

    @pl.when(live_step)
    def _step():
        rows, head_dim = q_ref.shape
        live, v_live = decode_masks(block * block_k, block * block_k, lo_ref[b], hi_ref[b], rows, block_k,
                                    head_dim, wrap=ring_slots, row_bounds=load_rows(rows_refs))
        m, l, acc = online_softmax_step(m_scr[...], l_scr[...], acc_scr[...], q_ref[...], k_ref[...], v_ref[...],
                                        live, v_live, scale=scale, k_scale=load_scale(ks_ref),
                                        v_scale=load_scale(vs_ref), softcap=softcap)
        m_scr[...], l_scr[...], acc_scr[...] = m, l, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _emit():
        acc_out[...], m_out[...], l_out[...] = acc_scr[...], m_scr[...], l_scr[...]


def _decode_tpu(q, k, v, k_scale, v_scale, lo, hi, *, scale: float, block_k: int, splits: int, ring: bool,
                interpret, softcap: float | None = None, rows=None):
    """q [B, K, R, H] (R = G, or T * G, padded to a multiple of 8); k, v [B, K, S, H]; k_scale, v_scale
    f32[B, K, 1, S] or None; lo, hi int32[B]; rows: None (one query per sequence) or the per-row (lo, hi)
    int32[B, R, 1] (`row_bounds`; lo, hi their union) -> per-split (acc f32[B, K, P, R, H], m, l
    f32[B, K, P, R, 1])."""
    B, K, R, H = q.shape
    S = k.shape[2]
    block_k = tpu_block(S, block_k)
    num_blocks = cdiv(S, block_k)
    splits = max(1, min(splits, num_blocks))
    step_block = functools.partial(tpu_step_block, block_k=block_k, splits=splits, num_blocks=num_blocks,
                                   ring=ring)

    def kv_map(b, h, split, j, lo_ref, hi_ref):
        return b, h, step_block(b, split, j, lo_ref, hi_ref)[0], 0

    def scale_map(b, h, split, j, lo_ref, hi_ref):  # the K/V block's slots
        return b, h, 0, step_block(b, split, j, lo_ref, hi_ref)[0]

    def row_map(b, h, split, j, lo_ref, hi_ref):
        return b, h, 0, 0

    def bounds_map(b, h, split, j, lo_ref, hi_ref):  # the same block for every step of a row: fetched once per b
        return b, 0, 0

    def out_map(b, h, split, j, lo_ref, hi_ref):
        return b, h, split, 0, 0

    kv_spec = pl.BlockSpec((None, None, block_k, H), kv_map)
    quantized = k_scale is not None
    scale_specs = [pl.BlockSpec((None, None, 1, block_k), scale_map)] * 2 if quantized else []
    row_specs = [pl.BlockSpec((None, R, 1), bounds_map)] * 2 if rows is not None else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # lo, hi: read by the index maps before each step's DMA is issued
        grid=(B, K, splits, cdiv(num_blocks, splits)),
        in_specs=[pl.BlockSpec((None, None, R, H), row_map), *row_specs, kv_spec, kv_spec, *scale_specs],
        out_specs=[pl.BlockSpec((None, None, None, R, H), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map)],
        scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                        pltpu.VMEM((R, H), jnp.float32)],
    )
    kernel = functools.partial(_decode_kernel_tpu, scale=scale, block_k=block_k, splits=splits,
                               num_blocks=num_blocks, quantized=quantized, ring_slots=S if ring else None,
                               softcap=softcap, per_row=rows is not None)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxkv_decode_attention",
    )(lo, hi, q, *(rows or ()), k, v, *([k_scale, v_scale] if quantized else []))


# --- GPU (Triton) --------------------------------------------------------------------------------------------


def _decode_kernel_gpu(lo_ref, hi_ref, q_ref, *refs, scale: float, block_k: int, splits: int, quantized: bool,
                       ring_slots: int | None, softcap: float | None = None, per_row: bool = False):
    """Grid (B, K, splits). lo_ref, hi_ref [1]; q_ref [R, H]; with `per_row`, row lo and hi refs [R, 1] (lo_ref,
    hi_ref then hold their union); k_ref, v_ref [Sp, H] (a pointer: only the loop's slices are read); then, for a
    quantized cache, ks_ref, vs_ref [1, Sp]; outputs this split's (acc [R, H], m [R, 1], l [R, 1])."""
    rows_refs, (k_ref, v_ref, *refs) = split_row_refs(refs, per_row)
    ks_ref, vs_ref, (acc_out, m_out, l_out) = split_scale_refs(refs, quantized)
    bounds = load_rows(rows_refs)  # loaded once, before the loop
    lo, hi = lo_ref[0], hi_ref[0]
    num_slots = k_ref.shape[0]
    q = q_ref[...]  # [R, H]
    rows, head_dim = q.shape
    if ring_slots is not None:  # a ring's live indices wrap: every block
        first, count = jnp.int32(0), jnp.int32(cdiv(num_slots, block_k))
    else:
        first, count = block_range(lo, hi, block_k)
    begin, end = split_share(count, splits, pl.program_id(2))

    def body(i, carry):
        floor = (first + i) * block_k  # first slot of live block first + i
        offset = jnp.minimum(floor, num_slots - block_k)  # shifted back to end at S, never past it
        k = k_ref[pl.ds(offset, block_k), :]  # [block_k, H]
        v = v_ref[pl.ds(offset, block_k), :]  # [block_k, H]
        k_scale = load_scale(ks_ref, slice(None), pl.ds(offset, block_k))  # [1, block_k] or None
        v_scale = load_scale(vs_ref, slice(None), pl.ds(offset, block_k))
        live, v_live = decode_masks(offset, floor, lo, hi, rows, block_k, head_dim, wrap=ring_slots,
                                    row_bounds=bounds)
        return online_softmax_step(*carry, q, k, v, live, v_live, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                   softcap=softcap)

    init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(begin, end, body, init)  # dynamic trip count: only live blocks are loaded
    acc_out[...], m_out[...], l_out[...] = acc, m, l


def _decode_gpu(q, k, v, k_scale, v_scale, lo, hi, *, scale: float, block_k: int, splits: int,
                ring_slots: int | None, interpret, softcap: float | None = None, rows=None):
    """q [B, K, R, H] (R, H powers of two >= 16); k, v [B, K, S, H] with S >= 16; k_scale, v_scale f32[B, K, 1, S]
    or None; lo, hi int32[B]; ring_slots: the ring's real S (<= S, the rest padding) or None; rows: None or the
    per-row (lo, hi) int32[B, R, 1] (`row_bounds`) -> per-split (acc f32[B, K, P, R, H], m, l
    f32[B, K, P, R, 1])."""
    require_triton()
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

    def bounds_map(b, h, split):
        return b, 0, 0

    quantized = k_scale is not None
    kernel = functools.partial(_decode_kernel_gpu, scale=scale, block_k=block_k, splits=splits,
                               quantized=quantized, ring_slots=ring_slots, softcap=softcap, per_row=rows is not None)
    scale_specs = [pl.BlockSpec((None, None, 1, S), row_map)] * 2 if quantized else []  # pointers, like K and V
    row_specs = [pl.BlockSpec((None, R, 1), bounds_map)] * 2 if rows is not None else []
    # Several query positions per row make R = T * G rows: the [R, H] float32 accumulator, the [R, block_k] scores
    # and q live in registers, and 4 warps would hold 128 f32 of the accumulator per thread alone at R = H = 128
    # (spilling); 8 warps halve that. Not measured (no GPU here); one query per sequence keeps its 4 warps.
    num_warps = 8 if rows is not None and R > 64 else 4
    return pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[pl.BlockSpec((1,), scalar_map), pl.BlockSpec((1,), scalar_map),
                  pl.BlockSpec((None, None, R, H), row_map), *row_specs,
                  pl.BlockSpec((None, None, S, H), row_map),  # whole row: a base pointer, loaded per block
                  pl.BlockSpec((None, None, S, H), row_map), *scale_specs],
        out_specs=[pl.BlockSpec((None, None, None, R, H), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map),
                   pl.BlockSpec((None, None, None, R, 1), out_map)],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32)],
        # Explicit Triton params: without them JAX 0.10 lowers GPU pallas_calls with Mosaic GPU.
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="jaxkv_decode_attention",
    )(lo, hi, q, *(rows or ()), k, v, *([k_scale, v_scale] if quantized else []))


# --- public --------------------------------------------------------------------------------------------------

DEFAULT_BLOCK_K = types.MappingProxyType({"tpu": 512, "gpu": 64})  # read-only


def default_splits(platform: str, batch: int, kv_heads: int, num_blocks: int) -> int:
    """Static split count: on GPU enough programs to fill a big GPU (~512 in flight) when B * K is small; on TPU
    1 (the grid runs in order on one core; B and K already feed both megacore cores)."""
    if platform == "tpu":
        return 1
    return max(1, min(16, num_blocks, cdiv(512, batch * kv_heads)))


def decode_attention(q, k, v, start, q_offset, *, scale: float, sliding_window: int | None = None, k_scale=None,
                     v_scale=None, ring: bool = False, platform: str = "tpu", block_k: int | None = None,
                     splits: int | None = None, interpret=False, softcap: float | None = None, sinks=None,
                     chunk: int | None = None):
    """Attention of a few queries per sequence over the cache; same contract as `reference.attention`.

    Meant for one query (decode) or a small block of them (a speculative verify: k + 1 queries, causal within the
    block): the T query positions times the G query heads of a KV group are the kernel's T * G matmul rows, each
    masked by its own position (`query_block_bounds`), and each live K/V block is read once for all of them.

    Args:
      q: [B, T, N, H], queries for slots [q_offset, q_offset + T); k, v: [B, K, S, H] (any float dtype, or int8 /
        float8_e4m3fn with scales); start: int32[B]; q_offset: int32[] (the first query's absolute slot; for a
        ring it may exceed S).
      k_scale, v_scale: float32[B, K, S] dequantization scales of a quantized cache, else None.
      ring: the cache is a ring buffer of S slots (module docstring; with T > 1, the reference's formula per query).
      platform: "tpu" (Mosaic body) or "gpu" (Triton body).
      block_k: slots per key block (TPU: a multiple of 128; GPU: a power of two >= 16).
      splits: parallel programs per (sequence, KV head); default `default_splits`.
      interpret: run the kernel in the Pallas interpreter (any truthy value pallas_call accepts).
      softcap: Gemma 2's attention-logit soft-capping (`reference.soft_cap`), a static float; None: off.
      sinks: float32[N] attention sinks (gpt-oss; `reference`), a traced array, or None. Folded into the split
        combine (`combine_splits`), not the kernel: the same kernel runs with and without them.
      chunk: Llama 4's chunked attention (`reference`): one more lower bound per query (`live_bounds`), so the
        same kernel serves it.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    check_scales(k, k_scale, v_scale)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, N)
    chunk = check_chunk(chunk)
    G, dtype = N // K, q.dtype
    block_k = block_k or DEFAULT_BLOCK_K.get(platform, 0)
    if T == 1:  # one query: every row shares its bounds, the kernel takes no per-row inputs (as before T > 1)
        lo, hi = live_bounds(start, q_offset, S, sliding_window, ring, chunk)  # int32[B] each
    else:  # per-query bounds, and their union: the blocks to read
        lo_t, hi_t, lo, hi = query_block_bounds(start, q_offset, T, S, sliding_window, ring, chunk)
    k_scale, v_scale = scale_rows(k_scale), scale_rows(v_scale)  # f32[B, K, 1, S] or None
    # [B, K, T * G, H]: row t * G + g is query t of head n = kv_head * G + g (T == 1: a free reshape); cast once
    # here rather than per block in the kernel
    q = (q.reshape(B, K, G, H) if T == 1
         else q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H))
    q = q.astype(matmul_dtype(dtype, k.dtype))
    if platform == "tpu":
        R = -(-(T * G) // TPU_ROW_MULTIPLE) * TPU_ROW_MULTIPLE  # whole sublane tiles: 1..7 rows have no layout
        rows = None if T == 1 else row_bounds(lo_t, hi_t, G, R)
        splits = splits or default_splits(platform, B, K, cdiv(S, tpu_block(S, block_k)))
        acc, m, l = _decode_tpu(pad_axis(q, 2, R), k, v, k_scale, v_scale, lo, hi, scale=scale, block_k=block_k,
                                splits=splits, ring=ring, interpret=interpret, softcap=softcap, rows=rows)
        sinks = row_sinks(sinks, K, T, R)  # f32[K, R, 1] or None
    elif platform == "gpu":
        R = max(GPU_MIN_DIM, next_pow2(T * G))  # tl.dot needs M >= 16; the padded rows are zeros, sliced off below
        rows = None if T == 1 else row_bounds(lo_t, hi_t, G, R)
        Hp = max(GPU_MIN_DIM, next_pow2(H))
        # A head dim that is not a power of two forces a padded copy of the cache (Triton tensors are powers of
        # two); a cache shorter than 16 slots is padded so the shifted block fits. Both copies are the exception.
        q = pad_axis(pad_axis(q, 2, R), 3, Hp)  # [B, K, R, Hp]
        Sp = max(S, GPU_MIN_DIM)
        k = pad_axis(pad_axis(k, 3, Hp), 2, Sp)  # [B, K, Sp, Hp]
        v = pad_axis(pad_axis(v, 3, Hp), 2, Sp)  # [B, K, Sp, Hp]
        if k_scale is not None:
            k_scale, v_scale = pad_axis(k_scale, 3, Sp), pad_axis(v_scale, 3, Sp)  # [B, K, 1, Sp]
        splits = splits or default_splits(platform, B, K, cdiv(Sp, gpu_block(Sp, block_k)))
        acc, m, l = _decode_gpu(q, k, v, k_scale, v_scale, lo, hi, scale=scale, block_k=block_k, splits=splits,
                                ring_slots=S if ring else None, interpret=interpret, softcap=softcap, rows=rows)
        sinks = row_sinks(sinks, K, T, R)  # f32[K, R, 1] or None
    else:
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    out = combine_splits(acc, m, l, sinks)[:, :, :T * G, :H]  # [B, K, T * G, H] float32
    if T > 1:
        out = out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)  # [B, T, K, G, H]
    return out.reshape(B, T, N, H).astype(dtype)
