"""Paged flash-decoding: one query token per sequence against a paged K/V pool, as a Pallas kernel.

The spec is `paged_reference.paged_attention` with T == 1. Pools are [P, K, page_size, H]; sequence b's slot s
lives in page `page_table[b, s // page_size]` at offset `s % page_size`. The math (online softmax in float32,
masks, in-kernel dequantization, `softcap`'s capping of each score tile before its mask) is `decode_kernel`'s;
this file only decides which pages each program reads.

What a program reads
--------------------
One program per (sequence b, KV head h) handles all G = N // K query heads of that KV head (the G rows are the M
dimension of both matmuls), so each K/V page is read once per group. Row b's query in slot q may see slots
[lo, hi] with lo = max(0, q - window + 1) and hi = min(q, lengths[b] - 1) (`paged_live_bounds`). Both bodies walk
only the blocks of slots holding a slot of [lo, hi]: pages past the length and pages wholly before the sliding
window are never read. Inside a visited block, slots outside [lo, hi] are masked with selects (`decode_masks`), so
NaN in a free page, in another sequence's page or in the unwritten tail of the last page cannot leak.

Pallas TPU (Mosaic), `_paged_kernel_tpu`: a block is a group of `pages_per_block` consecutive page-table entries.
Grid (B, K, groups), the last axis sequential ("arbitrary") with the softmax state in VMEM scratch. lo, hi and the
flattened page table are scalar-prefetched into SMEM (`pltpu.PrefetchScalarGridSpec`) and read by the index maps:
one pool BlockSpec per page of the group, block (page_size, H) (the pool's full last two dims: legal for any page
size), whose index map names the physical page `page_table[b, p]` of the group's page position p. Positions are
clamped (`_tpu_page`): the group into the row's live groups (a step past the last one names the pages of the step
before it: no DMA, and `pl.when` skips the compute), and a position within the group into the live pages
[lo // page_size, hi // page_size] (an input whose position falls outside names a live page instead of a -1 or a
dead entry, and the body masks all of that position's slots, which lie outside [lo, hi]). So no page-table entry
outside the live pages is read and no dead page is copied. The body folds the group's pages into the softmax one
page at a time. Several pages per step amortise the fixed per-step cost (~0.35 us) over more bytes: a 16-slot
bfloat16 page of H = 128 is 4 KiB.

Pallas GPU (Triton), `_paged_kernel_gpu`: a block is C slots, a power of two >= 16 (Triton tensor sizes; tl.dot
needs every matmul dim >= 16), independent of the page size, so pages of 1, 4 or 5 slots are read 16 or more slots
at a time. Grid (B, K); each program loops (`fori_loop`, dynamic trip count) over its live blocks only. The pools
are passed flattened to [P * K * page_size, H] (a free reshape), a ref that is only a pointer. Per block the body
gathers each slot's page-table entry (a vector load), computes the slot's pool row
(page * K + h) * page_size + slot % page_size, and loads K, V ([C, H]) and the scales ([1, C]) with gather loads
(Triton pointer tensors). Every load is masked to the live slots (`pltriton.load(..., mask)`), so a dead slot reads
neither its page-table entry (it may be -1) nor its row. The head dim and the padded query rows must be powers of
two; a head dim that is not is refused (padding it would copy the whole pool every step).
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

from jaxkv.attention.decode_kernel import (GPU_MIN_DIM, MASKED, TPU_ROW_MULTIPLE, tpu_step_block, block_range,
                                           cdiv, decode_masks, live_bounds, load_scale, matmul_dtype, next_pow2,
                                           normalize, online_softmax_step, pad_axis, reset_softmax_state,
                                           scale_rows, split_scale_refs)
from jaxkv.attention.reference import Unsupported, check_softcap

# Slots per step a page group aims for when `pages_per_block` is not given. TPU: 128 slots (a lane-dense row of
# scores), at most 8 pages (each page is its own BlockSpec'd input and DMA). GPU: 64 slots, as the contiguous
# decode kernel's blocks.
TARGET_SLOTS = types.MappingProxyType({"tpu": 128, "gpu": 64})
TPU_MAX_PAGES_PER_BLOCK = 8


def paged_live_bounds(lengths, q_slots, num_slots: int, sliding_window: int | None):
    """int32[B] lo, hi: the slots [lo, hi] the query in slot q_slots[b] may see (none if lo > hi, e.g. a length-0
    row): written (< lengths), not in the future (<= q_slot), inside the window."""
    lengths = jnp.asarray(lengths, jnp.int32)
    lo, hi = live_bounds(jnp.zeros_like(lengths), q_slots, num_slots, sliding_window)
    return lo, jnp.minimum(hi, lengths - 1)


def tpu_pages_per_block(page_size: int, pages_per_seq: int, pages_per_block: int | None) -> int:
    """Pages per TPU grid step: `pages_per_block` if given, else enough for 128 slots but at most 8; never more
    than the table holds."""
    default = min(max(1, TARGET_SLOTS["tpu"] // page_size), TPU_MAX_PAGES_PER_BLOCK)
    return min(pages_per_block or default, pages_per_seq)


def check_pool(k_pages, v_pages, page_table, k_scale, v_scale):
    """Pools of one shape; both scales [P, K, page_size] or neither; a 2-D page table."""
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (a quantized pool) or neither")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is not None and x.shape != k_pages.shape[:3]:
            raise ValueError(f"{name} must have shape {k_pages.shape[:3]} (P, K, page_size), got {x.shape}")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be int32[B, M], got shape {page_table.shape}")


# --- TPU (Mosaic) --------------------------------------------------------------------------------------------


def _tpu_page(b, j, i, lo_ref, hi_ref, *, page_size: int, pages_per_block: int, num_groups: int):
    """(page position in the row's table, position of input i in the group, whether step j is live) for grid step
    (b, j): the group is clamped into the row's live groups, the page position into its live pages."""
    group, live_step = tpu_step_block(b, 0, j, lo_ref, hi_ref, block_k=page_size * pages_per_block, splits=1,
                                       num_blocks=num_groups)
    position = group * pages_per_block + i  # where input i's slots sit in the sequence, in pages
    first = lax.div(lo_ref[b], jnp.int32(page_size))
    last = jnp.maximum(lax.div(hi_ref[b], jnp.int32(page_size)), first)  # an empty row (hi < lo) reads one page
    return jnp.clip(position, first, last), position, live_step


def _paged_kernel_tpu(lo_ref, hi_ref, table_ref, q_ref, *refs, scale: float, page_size: int, pages_per_block: int,
                      num_groups: int, quantized: bool, softcap: float | None = None):
    """Grid (B, K, groups). q_ref [R, H]; then pages_per_block K page refs [page_size, H], as many V page refs, and
    for a quantized pool as many K and V scale refs [1, page_size]; the output [R, H] is written at the last step;
    scratch m, l, acc."""
    del table_ref  # read by the index maps only
    n = pages_per_block
    kv_refs, rest = refs[:2 * n], refs[2 * n:]
    scale_refs, (out_ref, m_scr, l_scr, acc_scr) = (rest[:2 * n], rest[2 * n:]) if quantized else ((), rest)
    b, j = pl.program_id(0), pl.program_id(2)
    lo, hi = lo_ref[b], hi_ref[b]
    page = functools.partial(_tpu_page, b, j, lo_ref=lo_ref, hi_ref=hi_ref, page_size=page_size,
                             pages_per_block=n, num_groups=num_groups)

    pl.when(j == 0)(functools.partial(reset_softmax_state, m_scr, l_scr, acc_scr))

    @pl.when(page(0)[2])
    def _step():
        rows, head_dim = q_ref.shape
        q = q_ref[...]
        state = m_scr[...], l_scr[...], acc_scr[...]
        for i in range(n):  # static: one online-softmax step per page of the group
            offset = page(i)[1] * page_size  # the slots input i's positions stand for; masked if a clamped copy
            live, v_live = decode_masks(offset, offset, lo, hi, rows, page_size, head_dim)
            ks, vs = (load_scale(scale_refs[i]), load_scale(scale_refs[n + i])) if quantized else (None, None)
            state = online_softmax_step(*state, q, kv_refs[i][...], kv_refs[n + i][...], live, v_live,
                                        scale=scale, k_scale=ks, v_scale=vs, softcap=softcap)
        m_scr[...], l_scr[...], acc_scr[...] = state

    @pl.when(j == pl.num_programs(2) - 1)
    def _emit():
        out_ref[...] = normalize(acc_scr[...], l_scr[...])


def _paged_tpu(q, k_pages, v_pages, k_scale, v_scale, page_table, lo, hi, *, scale: float, pages_per_block: int,
               interpret, softcap: float | None = None):
    """q [B, K, R, H] (R a multiple of 8); pools [P, K, page_size, H]; scales f32[P, K, 1, page_size] or None;
    page_table int32[B, M]; lo, hi int32[B] -> f32[B, K, R, H]."""
    B, K, R, H = q.shape
    page_size = k_pages.shape[2]
    M = page_table.shape[1]
    n = pages_per_block
    num_groups = cdiv(M, n)
    page = functools.partial(_tpu_page, page_size=page_size, pages_per_block=n, num_groups=num_groups)

    def page_map(i, b, h, j, lo_ref, hi_ref, table_ref):
        p = page(b, j, i, lo_ref, hi_ref)[0]
        return jnp.maximum(table_ref[b * M + p], 0), h, 0, 0  # -1 only for an empty row, which computes nothing

    def row_map(b, h, j, lo_ref, hi_ref, table_ref):
        return b, h, 0, 0

    page_specs = [pl.BlockSpec((None, None, page_size, H), functools.partial(page_map, i)) for i in range(n)]
    scale_specs = [pl.BlockSpec((None, None, 1, page_size), functools.partial(page_map, i)) for i in range(n)]
    quantized = k_scale is not None
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,  # lo, hi, the flattened page table: read by the index maps before each step's DMA
        grid=(B, K, num_groups),
        in_specs=[pl.BlockSpec((None, None, R, H), row_map), *page_specs, *page_specs,
                  *(scale_specs * 2 if quantized else [])],
        out_specs=pl.BlockSpec((None, None, R, H), row_map),
        scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                        pltpu.VMEM((R, H), jnp.float32)],
    )
    kernel = functools.partial(_paged_kernel_tpu, scale=scale, page_size=page_size, pages_per_block=n,
                               num_groups=num_groups, quantized=quantized, softcap=softcap)
    scales = [k_scale] * n + [v_scale] * n if quantized else []
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, K, R, H), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxkv_paged_decode_attention",
    )(lo, hi, page_table.reshape(-1), q, *[k_pages] * n, *[v_pages] * n, *scales)


# --- GPU (Triton) --------------------------------------------------------------------------------------------


def _paged_kernel_gpu(lo_ref, hi_ref, table_ref, q_ref, k_ref, v_ref, *refs, scale: float, page_size: int,
                      block: int, kv_heads: int, quantized: bool, softcap: float | None = None):
    """Grid (B, K). lo_ref, hi_ref [1]; table_ref [M] (the row's page table); q_ref [R, H]; k_ref, v_ref
    [P * K * page_size, H] (pointers: only the gathered rows are read); then, for a quantized pool, ks_ref, vs_ref
    [P * K * page_size]; output [R, H]."""
    ks_ref, vs_ref, (out_ref,) = split_scale_refs(refs, quantized)
    lo, hi = lo_ref[0], hi_ref[0]
    h = pl.program_id(1)
    q = q_ref[...]  # [R, H]
    rows, head_dim = q.shape
    first, count = block_range(lo, hi, block)
    within = lax.broadcasted_iota(jnp.int32, (block,), 0)  # [C]

    def body(g, carry):
        offset = (first + g) * block  # the block's first slot
        slot = offset + within  # [C]
        # Masked loads: a slot outside [lo, hi] (past the length or the table, before the window) reads nothing,
        # neither its page-table entry (it may be -1) nor its K/V/scale row.
        read = (slot >= lo) & (slot <= hi)  # [C]
        page = pltriton.load(table_ref.at[slot // page_size], mask=read, other=0)  # [C] each slot's page
        row = (page * kv_heads + h) * page_size + slot % page_size  # [C] rows of the flat pool
        rows_kv = (row[:, None], lax.broadcasted_iota(jnp.int32, (1, head_dim), 1))  # [C, 1], [1, H]: a [C, H] gather
        read_kv = jnp.broadcast_to(read[:, None], (block, head_dim))
        k = pltriton.load(k_ref.at[rows_kv], mask=read_kv, other=0)  # [C, H]
        v = pltriton.load(v_ref.at[rows_kv], mask=read_kv, other=0)
        k_scale, v_scale = ((pltriton.load(x.at[row[None, :]], mask=read[None, :], other=0) for x in (ks_ref, vs_ref))
                            if quantized else (None, None))  # [1, C] each
        live, v_live = decode_masks(offset, offset, lo, hi, rows, block, head_dim)
        return online_softmax_step(*carry, q, k, v, live, v_live, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                   softcap=softcap)

    init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(0, count, body, init)  # dynamic trip count: only live blocks are loaded
    out_ref[...] = normalize(acc, l)


def gpu_block_slots(page_size: int, pages_per_seq: int, pages_per_block: int | None) -> int:
    """Slots per GPU loop iteration: a power of two >= 16 (Triton tensor sizes, tl.dot dims) covering
    `pages_per_block` pages if given, else 64 slots (as the contiguous kernel's blocks) or the whole table if that
    is shorter."""
    if pages_per_block:
        return max(GPU_MIN_DIM, next_pow2(pages_per_block * page_size))
    return max(GPU_MIN_DIM, min(TARGET_SLOTS["gpu"], next_pow2(pages_per_seq * page_size)))


def _paged_gpu(q, k_pages, v_pages, k_scale, v_scale, page_table, lo, hi, *, scale: float, block: int, interpret,
               softcap: float | None = None):
    """q [B, K, R, H] (R, H powers of two >= 16); pools [P, K, page_size, H]; scales f32[P, K, page_size] or None;
    page_table int32[B, M]; lo, hi int32[B]; block: slots per loop iteration -> f32[B, K, R, H]."""
    B, K, R, H = q.shape
    P, _, page_size, _ = k_pages.shape
    if H & (H - 1):
        raise Unsupported(f"the GPU paged kernel needs a power-of-two head dim (Triton tensor sizes), got {H}; "
                         "padding it would copy the whole pool every step")
    flat = (P * K * page_size, H)

    def scalar_map(b, h):
        return (b,)

    def row_map(b, h):
        return b, h, 0, 0

    def whole(b, h):  # the whole pool: a base pointer, gathered from per block
        return 0, 0

    def whole_scales(b, h):
        return (0,)

    quantized = k_scale is not None
    scale_specs = [pl.BlockSpec(flat[:1], whole_scales)] * 2 if quantized else []
    kernel = functools.partial(_paged_kernel_gpu, scale=scale, page_size=page_size, block=block, kv_heads=K,
                               quantized=quantized, softcap=softcap)
    scales = [k_scale.astype(jnp.float32).reshape(-1), v_scale.astype(jnp.float32).reshape(-1)] if quantized else []
    return pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[pl.BlockSpec((1,), scalar_map), pl.BlockSpec((1,), scalar_map),
                  pl.BlockSpec((None, page_table.shape[1]), lambda b, h: (b, 0)),
                  pl.BlockSpec((None, None, R, H), row_map),
                  pl.BlockSpec(flat, whole), pl.BlockSpec(flat, whole), *scale_specs],
        out_specs=pl.BlockSpec((None, None, R, H), row_map),
        out_shape=jax.ShapeDtypeStruct((B, K, R, H), jnp.float32),
        # Explicit Triton params: without them JAX 0.10 lowers GPU pallas_calls with Mosaic GPU.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxkv_paged_decode_attention",
    )(lo, hi, page_table, q, k_pages.reshape(flat), v_pages.reshape(flat), *scales)


# --- public --------------------------------------------------------------------------------------------------


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float,
                           sliding_window: int | None = None, k_scale=None, v_scale=None, q_slots=None,
                           platform: str | None = None, pages_per_block: int | None = None, interpret=None,
                           softcap: float | None = None):
    """Attention of one query per sequence over its pages; `paged_reference.paged_attention` with T == 1.

    Args:
      q: [B, N, H], one query per sequence.
      k_pages, v_pages: [P, K, page_size, H] pools, K dividing N (any float dtype, or int8 / float8_e4m3fn with
        scales).
      page_table: int32[B, M], each sequence's pages in slot order (-1: none; never read for a live slot).
      lengths: int32[B], slots written per sequence (the query's own K/V included). A length-0 row returns 0.
      scale: multiplies q.k.
      sliding_window: if set, the query sees only the `sliding_window` most recent slots, itself included.
      k_scale, v_scale: float32[P, K, page_size] dequantization scales of a quantized pool, else None.
      q_slots: int32[B], the query's slot; default lengths - 1 (decode: its own K/V already written).
      platform: "tpu" (Mosaic body) or "gpu" (Triton body); None: "gpu" on GPUs, else "tpu".
      pages_per_block: pages per grid step (TPU, `tpu_pages_per_block`) or per loop iteration (GPU: rounded up to
        a power-of-two number of slots, `gpu_block_slots`).
      interpret: run in the Pallas interpreter; None means "only on CPU".
      softcap: Gemma 2's attention-logit soft-capping (`reference.soft_cap`), a static float; None: off.

    Returns:
      [B, N, H] in q's dtype.
    """
    B, N, H = q.shape
    K, page_size = k_pages.shape[1], k_pages.shape[2]
    check_pool(k_pages, v_pages, page_table, k_scale, v_scale)
    softcap = check_softcap(softcap)
    platform = platform or ("gpu" if jax.default_backend() == "gpu" else "tpu")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M = page_table.shape[1]
    G, dtype = N // K, q.dtype
    lengths = jnp.asarray(lengths, jnp.int32)
    q_slots = lengths - 1 if q_slots is None else jnp.asarray(q_slots, jnp.int32)
    lo, hi = paged_live_bounds(lengths, q_slots, M * page_size, sliding_window)  # int32[B] each
    page_table = jnp.asarray(page_table, jnp.int32)
    mm_dtype = matmul_dtype(dtype, k_pages.dtype)
    if platform == "tpu" and page_size == 1:
        # JAX 0.10's Mosaic lowering of a [R, H] x [1, H] score dot with 16-bit inputs emits an ill-typed
        # vector.broadcast (a verification error); float32 inputs lower, and a 1-slot page's matmul is no cost.
        mm_dtype = jnp.float32
    # [B, K, G, H]: query head n = kv_head * G + g; cast once here rather than per page in the kernel
    q = q.reshape(B, K, G, H).astype(mm_dtype)
    if platform == "tpu":
        R = cdiv(G, TPU_ROW_MULTIPLE) * TPU_ROW_MULTIPLE  # whole sublane tiles
        out = _paged_tpu(pad_axis(q, 2, R), k_pages, v_pages, scale_rows(k_scale), scale_rows(v_scale), page_table,
                         lo, hi, scale=scale, pages_per_block=tpu_pages_per_block(page_size, M, pages_per_block),
                         interpret=interpret, softcap=softcap)
    elif platform == "gpu":
        R = max(GPU_MIN_DIM, next_pow2(G))  # tl.dot needs M >= 16; the padded rows are zeros, sliced off below
        out = _paged_gpu(pad_axis(q, 2, R), k_pages, v_pages, k_scale, v_scale, page_table, lo, hi, scale=scale,
                         block=gpu_block_slots(page_size, M, pages_per_block), interpret=interpret, softcap=softcap)
    else:
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    return out[:, :, :G].reshape(B, N, H).astype(dtype)  # [B, N, H]
