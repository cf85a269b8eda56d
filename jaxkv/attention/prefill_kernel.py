"""Causal flash attention over the padded prompt batch (T > 1 queries), as a Pallas kernel.

Design
------
One program per (sequence b, query head n, block of `block_q` queries); it streams key blocks of `block_k` slots
through an online softmax (running max, running sum and a float32 accumulator, shared with the decode kernel in
`decode_kernel.online_softmax_step`), so the [T, S] score matrix never exists: at any time one [block_q, block_k]
tile does. Query head n reads KV head n // G.

Masking is the reference's rule per (query slot q, key slot s): start[b] <= s <= q and, with a window,
q - s < window; queries sit in slots q_offset .. q_offset + T - 1 (left padding puts a row's prompt at the end).
A query block needs only the keys in [lo, hi] with

    lo = max(start[b], first query slot - window + 1),    hi = min(last real query slot, S - 1),

so key blocks wholly above the diagonal, wholly before `start` (left padding) or wholly outside the window are
never read: causal prefill moves about half the K/V bytes and does half the FLOPs of the dense product, a
heavily padded row less still, and with a window the work per query block is bounded by the window, not by T.

Block skipping, per backend (same scheme as the decode kernel; see its docstring for the reasoning):

* TPU (Mosaic): grid (B, N, query blocks, key steps) with the key axis "arbitrary" and the softmax state in VMEM
  scratch. start and q_offset are scalar-prefetched; the K/V index_map starts at the query block's first live key
  block and clamps at its last, so steps past it re-name the resident block (no DMA) and `pl.when` skips them.
  With a window, the key axis has only as many steps as a window can span.
* GPU (Triton): grid (B, N, query blocks); each program loops (`lax.fori_loop`, dynamic trip count) over its live
  key blocks, loading `k_ref[pl.ds(offset, block_k), :]` from the [S, H] row, the last block shifted back to end
  at S and its re-read slots masked.

Memory traffic: each query block reads its Q tile once and each live K/V tile once per query head (the G heads of
a group re-read the same tiles, which on GPU mostly hit L2); writes the output tile once. Prefill is compute
bound for T in the hundreds, so the skipped tiles are what matter.

Quantized caches (int8 / float8 with float32 scales [B, K, S]) are dequantized per key block exactly as in the
decode kernel (the scale block rides along with its K/V block and multiplies the tile's score and probability
columns; see `decode_kernel`). Ring caches are not supported here (`pallas.attention` raises NotImplementedError
for them with T > 1): the library's prefill attends over the fresh prompt K/V, never over a ring.

Soft-capping (`softcap`, Gemma 2) happens in the shared `online_softmax_step`, on each float32 score tile before
its mask: a static float in the kernel's configuration, like `scale`.

Attention sinks (`sinks`, gpt-oss: float32[N], traced) are one more input, [N, 1, 1] with a [1, 1] block per
program (its head's sink; legal on Mosaic as the array's own last two dims, a power of two on Triton). Each
program's online softmax starts from the sink's state (running max = sink, running sum = 1, `sink_state`) instead
of (MASKED, 0), so the sink joins every query row's denominator exactly once and a row with no live key returns 0;
without sinks the kernel is the very one it was.

Query rows past T (padding of the query axis to a whole block) compute finite garbage that is sliced off; a query
row with no live key (a left-padding slot) returns 0, where the reference returns a uniform average over the
slots any query sees: only rows with at least one live key are specified (with sinks, the reference's are 0 too).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jaxkv.attention.pallas_namespace import pl, pltpu, pltriton, require_triton

from jaxkv.attention.decode_kernel import (GPU_MIN_DIM, MASKED, block_range, cdiv, check_scales, gpu_block,
                                           load_scale, matmul_dtype, next_pow2, normalize, online_softmax_step,
                                           pad_axis, reset_softmax_state, scale_rows, sink_state, split_scale_refs,
                                           tpu_block)
from jaxkv.attention.reference import check_sinks, check_softcap

# --- shared between the two bodies ---------------------------------------------------------------------------


def query_block_bounds(start, q_offset, i, *, block_q: int, num_queries: int, num_slots: int,
                       window: int | None):
    """(lo, hi, first query slot) of query block i: its real queries may see only key slots [lo, hi]."""
    q_first = q_offset + i * block_q
    q_last = q_offset + jnp.minimum((i + 1) * block_q, num_queries) - 1  # padded query rows do not widen it
    lo = start if window is None else jnp.maximum(start, q_first - (window - 1))
    return lo, jnp.minimum(q_last, num_slots - 1), q_first


def prefill_masks(q_first, offset, floor, start, lo, hi, window: int | None, rows: int, cols: int, head_dim: int):
    """Masks of a tile of query rows (slots q_first + r) against key columns (slots offset + c).

    live bool[rows, cols]: the reference's rule, restricted to slots >= floor (GPU: slots a shifted block re-reads
    were folded in by the previous block) and <= hi (slots past S in a partial TPU block are garbage).
    v_live bool[cols, head_dim]: slots in [max(lo, floor), hi], the union of the rows' ranges; every live pair's
    slot is in it.
    """
    q_slot = q_first + lax.broadcasted_iota(jnp.int32, (rows, cols), 0)  # [R, C]
    k_slot = offset + lax.broadcasted_iota(jnp.int32, (rows, cols), 1)  # [R, C]
    live = (k_slot >= jnp.maximum(start, floor)) & (k_slot <= q_slot) & (k_slot <= hi)
    if window is not None:
        live &= q_slot - k_slot < window
    v_slot = offset + lax.broadcasted_iota(jnp.int32, (cols, head_dim), 0)  # [C, H]
    return live, (v_slot >= jnp.maximum(lo, floor)) & (v_slot <= hi)


def max_key_steps(num_blocks: int, block_q: int, block_k: int, window: int | None) -> int:
    """Static bound on the key blocks one query block can need: all of them, or what a window can span."""
    if window is None:
        return num_blocks
    return min(num_blocks, cdiv(block_q + window - 1, block_k) + 1)


def split_sink_ref(refs, sinks: bool):
    """(the sink ref or None, the remaining refs): the sinks input follows K/V and their scales only when given."""
    return (refs[0], refs[1:]) if sinks else (None, refs)


# --- TPU (Mosaic) --------------------------------------------------------------------------------------------


def _tpu_step_block(b, i, j, start_ref, qoff_ref, *, block_k: int, num_blocks: int, **bounds):
    """(key block index, whether it is live) for grid step (b, ., i, j): the query block's j-th live key block,
    clamped to its last one past the end (same index as the previous step: no DMA)."""
    lo, hi, _ = query_block_bounds(start_ref[b], qoff_ref[0], i, **bounds)
    first, count = block_range(lo, hi, block_k)
    return jnp.clip(first + jnp.maximum(jnp.minimum(j, count - 1), 0), 0, num_blocks - 1), j < count


def _prefill_kernel_tpu(start_ref, qoff_ref, q_ref, k_ref, v_ref, *refs, scale: float, block_k: int,
                        num_blocks: int, window: int | None, quantized: bool, softcap: float | None = None,
                        sinks: bool = False, **bounds):
    """Grid (B, N, query blocks, key steps). q_ref, o_ref [block_q, H]; k_ref, v_ref [block_k, H]; for a quantized
    cache ks_ref, vs_ref [1, block_k], then with `sinks` the head's sink_ref [1, 1], before o_ref; scratch m, l,
    acc."""
    ks_ref, vs_ref, refs = split_scale_refs(refs, quantized)
    sink_ref, (o_ref, m_scr, l_scr, acc_scr) = split_sink_ref(refs, sinks)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block, live_step = _tpu_step_block(b, i, j, start_ref, qoff_ref, block_k=block_k, num_blocks=num_blocks,
                                       window=window, **bounds)

    # With sinks the softmax starts from the sink's own state (max = sink, sum = 1): counted once per query row.
    pl.when(j == 0)(functools.partial(reset_softmax_state, m_scr, l_scr, acc_scr, sink_ref))

    @pl.when(live_step)
    def _step():
        rows, head_dim = q_ref.shape
        start = start_ref[b]
        lo, hi, q_first = query_block_bounds(start, qoff_ref[0], i, window=window, **bounds)
        live, v_live = prefill_masks(q_first, block * block_k, block * block_k, start, lo, hi, window, rows,
                                     block_k, head_dim)
        m, l, acc = online_softmax_step(m_scr[...], l_scr[...], acc_scr[...], q_ref[...], k_ref[...], v_ref[...],
                                        live, v_live, scale=scale, k_scale=load_scale(ks_ref),
                                        v_scale=load_scale(vs_ref), softcap=softcap)
        m_scr[...], l_scr[...], acc_scr[...] = m, l, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _emit():
        o_ref[...] = normalize(acc_scr[...], l_scr[...]).astype(o_ref.dtype)


def _prefill_tpu(q, k, v, k_scale, v_scale, start, q_offset, *, scale: float, block_q: int, block_k: int,
                 num_queries: int, window: int | None, out_dtype, interpret, softcap: float | None = None,
                 sinks=None):
    """q [B, N, Tp, H] (Tp a multiple of block_q); k, v [B, K, S, H]; k_scale, v_scale f32[B, K, 1, S] or None;
    start int32[B]; q_offset int32[1]; sinks f32[N, 1, 1] or None -> [B, N, Tp, H] in out_dtype."""
    B, N, Tp, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    block_k = tpu_block(S, block_k)
    num_blocks = cdiv(S, block_k)
    bounds = dict(block_q=block_q, num_queries=num_queries, num_slots=S)
    step_block = functools.partial(_tpu_step_block, block_k=block_k, num_blocks=num_blocks, window=window,
                                   **bounds)

    def q_map(b, n, i, j, start_ref, qoff_ref):
        return b, n, i, 0

    def kv_map(b, n, i, j, start_ref, qoff_ref):
        return b, lax.div(n, G), step_block(b, i, j, start_ref, qoff_ref)[0], 0

    def scale_map(b, n, i, j, start_ref, qoff_ref):  # the K/V block's slots
        return b, lax.div(n, G), 0, step_block(b, i, j, start_ref, qoff_ref)[0]

    def sink_map(b, n, i, j, start_ref, qoff_ref):  # the head's sink: the same block for all of a (b, n)
        return n, 0, 0

    kv_spec = pl.BlockSpec((None, None, block_k, H), kv_map)
    q_spec = pl.BlockSpec((None, None, block_q, H), q_map)
    quantized = k_scale is not None
    scale_specs = [pl.BlockSpec((None, None, 1, block_k), scale_map)] * 2 if quantized else []
    # [1, 1]: the array's own last two dims, a legal Mosaic block; broadcast over the rows in the body
    sink_specs = [pl.BlockSpec((None, 1, 1), sink_map)] if sinks is not None else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # start, q_offset: the index maps need them before each step's DMA
        grid=(B, N, Tp // block_q, max_key_steps(num_blocks, block_q, block_k, window)),
        in_specs=[q_spec, kv_spec, kv_spec, *scale_specs, *sink_specs],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                        pltpu.VMEM((block_q, H), jnp.float32)],
    )
    kernel = functools.partial(_prefill_kernel_tpu, scale=scale, block_k=block_k, num_blocks=num_blocks,
                               window=window, quantized=quantized, softcap=softcap, sinks=sinks is not None,
                               **bounds)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxkv_prefill_attention",
    )(start, q_offset, q, k, v, *([k_scale, v_scale] if quantized else []), *([] if sinks is None else [sinks]))


# --- GPU (Triton) --------------------------------------------------------------------------------------------


def _prefill_kernel_gpu(start_ref, qoff_ref, q_ref, k_ref, v_ref, *refs, scale: float, block_k: int,
                        window: int | None, quantized: bool, softcap: float | None = None, sinks: bool = False,
                        **bounds):
    """Grid (B, N, query blocks). start_ref, qoff_ref [1]; q_ref, o_ref [block_q, H]; k_ref, v_ref [Sp, H] (a
    pointer: only the loop's slices are read); for a quantized cache ks_ref, vs_ref [1, Sp], then with `sinks` the
    head's sink_ref [1, 1], before o_ref."""
    ks_ref, vs_ref, refs = split_scale_refs(refs, quantized)
    sink_ref, (o_ref,) = split_sink_ref(refs, sinks)
    start = start_ref[0]
    ref_slots = k_ref.shape[0]  # Sp >= num_slots: the shifted block may re-read zero padding, never past it
    lo, hi, q_first = query_block_bounds(start, qoff_ref[0], pl.program_id(2), window=window, **bounds)
    first, count = block_range(lo, hi, block_k)
    q = q_ref[...]  # [block_q, H]
    rows, head_dim = q.shape

    def body(i, carry):
        floor = (first + i) * block_k
        offset = jnp.minimum(floor, ref_slots - block_k)  # the last block shifted back to end at Sp
        k = k_ref[pl.ds(offset, block_k), :]  # [block_k, H]
        v = v_ref[pl.ds(offset, block_k), :]  # [block_k, H]
        k_scale = load_scale(ks_ref, slice(None), pl.ds(offset, block_k))  # [1, block_k] or None
        v_scale = load_scale(vs_ref, slice(None), pl.ds(offset, block_k))
        live, v_live = prefill_masks(q_first, offset, floor, start, lo, hi, window, rows, block_k, head_dim)
        return online_softmax_step(*carry, q, k, v, live, v_live, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                   softcap=softcap)

    if sink_ref is None:
        init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    else:  # the sink's own state (max = sink, sum = 1): counted once per query row
        init = sink_state(sink_ref[...], (rows, 1))
    init = (*init, jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(0, count, body, init)  # only the live key blocks are loaded
    o_ref[...] = normalize(acc, l).astype(o_ref.dtype)


def _prefill_gpu(q, k, v, k_scale, v_scale, start, q_offset, *, scale: float, block_q: int, block_k: int,
                 num_queries: int, num_slots: int, window: int | None, out_dtype, interpret,
                 softcap: float | None = None, sinks=None):
    """q [B, N, Tp, H]; k, v [B, K, Sp, H] (Sp >= 16; H, block_q powers of two >= 16), of which the first
    `num_slots` slots are real; k_scale, v_scale f32[B, K, 1, Sp] or None; start int32[B]; q_offset int32[1];
    sinks f32[N, 1, 1] or None -> [B, N, Tp, H] in out_dtype."""
    require_triton()
    B, N, Tp, H = q.shape
    K, Sp = k.shape[1], k.shape[2]
    G = N // K
    block_k = gpu_block(Sp, block_k)

    def scalar_map(b, n, i):
        return (b,)

    def qoff_map(b, n, i):
        return (0,)

    def q_map(b, n, i):
        return b, n, i, 0

    def kv_map(b, n, i):
        return b, lax.div(n, G), 0, 0

    def sink_map(b, n, i):
        return n, 0, 0

    quantized = k_scale is not None
    kernel = functools.partial(_prefill_kernel_gpu, scale=scale, block_k=block_k, window=window, block_q=block_q,
                               num_queries=num_queries, num_slots=num_slots, quantized=quantized, softcap=softcap,
                               sinks=sinks is not None)
    q_spec = pl.BlockSpec((None, None, block_q, H), q_map)
    kv_spec = pl.BlockSpec((None, None, Sp, H), kv_map)  # whole row: a base pointer, loaded per block
    scale_specs = [pl.BlockSpec((None, None, 1, Sp), kv_map)] * 2 if quantized else []
    sink_specs = [pl.BlockSpec((None, 1, 1), sink_map)] if sinks is not None else []  # one number per program
    return pl.pallas_call(
        kernel,
        grid=(B, N, Tp // block_q),
        in_specs=[pl.BlockSpec((1,), scalar_map), pl.BlockSpec((1,), qoff_map), q_spec, kv_spec, kv_spec,
                  *scale_specs, *sink_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, out_dtype),
        # Explicit Triton params: without them JAX 0.10 lowers GPU pallas_calls with Mosaic GPU.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxkv_prefill_attention",
    )(start, q_offset, q, k, v, *([k_scale, v_scale] if quantized else []), *([] if sinks is None else [sinks]))


# --- public --------------------------------------------------------------------------------------------------

DEFAULT_BLOCKS = types.MappingProxyType({"tpu": (128, 256), "gpu": (64, 64)})  # (block_q, block_k), read-only


def prefill_attention(q, k, v, start, q_offset, *, scale: float, sliding_window: int | None = None, k_scale=None,
                      v_scale=None, platform: str = "tpu", block_q: int | None = None, block_k: int | None = None,
                      interpret=False, softcap: float | None = None, sinks=None):
    """Causal attention of T queries over S key slots; same contract as `reference.attention` (no ring caches).

    Args:
      q: [B, T, N, H] queries for slots [q_offset, q_offset + T); k, v: [B, K, S, H] (any float dtype, or int8 /
        float8_e4m3fn with scales); start: int32[B]; q_offset: int32[].
      k_scale, v_scale: float32[B, K, S] dequantization scales of a quantized cache, else None.
      platform: "tpu" (Mosaic body) or "gpu" (Triton body).
      block_q, block_k: tile sizes (TPU: block_q a multiple of 16, block_k of 128; GPU: powers of two >= 16).
      interpret: run the kernel in the Pallas interpreter (any truthy value pallas_call accepts).
      softcap: Gemma 2's attention-logit soft-capping (`reference.soft_cap`), a static float; None: off.
      sinks: float32[N] attention sinks (gpt-oss; `reference`), a traced array, or None: each head's online
        softmax starts from its sink (module docstring).

    Returns:
      [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    S = k.shape[2]
    if platform not in DEFAULT_BLOCKS:
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    check_scales(k, k_scale, v_scale)
    sinks = check_sinks(sinks, N)
    k_scale, v_scale = scale_rows(k_scale), scale_rows(v_scale)  # f32[B, K, 1, S] or None
    default_q, default_k = DEFAULT_BLOCKS[platform]
    block_q, block_k = block_q or default_q, block_k or default_k
    start = jnp.asarray(start, jnp.int32)  # [B]
    q_offset = jnp.reshape(jnp.asarray(q_offset, jnp.int32), (1,))  # [1]: scalar operands are 1-D refs
    common = dict(scale=scale, num_queries=T, window=sliding_window, out_dtype=q.dtype, interpret=interpret,
                  softcap=check_softcap(softcap), sinks=None if sinks is None else sinks.reshape(N, 1, 1))
    # [B, N, T, H]: each (sequence, head) a contiguous [T, H] tile source, in the matmul dtype
    q = q.transpose(0, 2, 1, 3).astype(matmul_dtype(q.dtype, k.dtype))
    if platform == "tpu":
        if T > block_q and block_q % 16:
            raise ValueError(f"TPU block_q must be a multiple of 16 (bf16 sublane packing), got {block_q}")
        block_q = T if T <= block_q else block_q  # a block equal to the array dim is always legal
        q = pad_axis(q, 2, cdiv(T, block_q) * block_q)  # [B, N, Tp, H]
        out = _prefill_tpu(q, k, v, k_scale, v_scale, start, q_offset, block_q=block_q, block_k=block_k, **common)
    else:
        gpu_block(GPU_MIN_DIM, block_q)  # validates: a power of two >= 16
        block_q = max(GPU_MIN_DIM, min(block_q, next_pow2(T)))
        Hp = max(GPU_MIN_DIM, next_pow2(H))  # Triton tensors are powers of two; pads copy q, k, v (rare)
        Sp = max(S, GPU_MIN_DIM)  # the shifted last key block must fit
        q = pad_axis(pad_axis(q, 3, Hp), 2, cdiv(T, block_q) * block_q)  # [B, N, Tp, Hp]
        k = pad_axis(pad_axis(k, 3, Hp), 2, Sp)  # [B, K, Sp, Hp]
        v = pad_axis(pad_axis(v, 3, Hp), 2, Sp)  # [B, K, Sp, Hp]
        if k_scale is not None:
            k_scale, v_scale = pad_axis(k_scale, 3, Sp), pad_axis(v_scale, 3, Sp)  # [B, K, 1, Sp]
        out = _prefill_gpu(q, k, v, k_scale, v_scale, start, q_offset, block_q=block_q, block_k=block_k,
                           num_slots=S, **common)
    return out[:, :, :T, :H].transpose(0, 2, 1, 3)  # [B, T, N, H]
