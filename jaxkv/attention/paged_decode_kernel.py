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
at a time. Grid (B, K, splits); each program loops (`fori_loop`, dynamic trip count) over its share of the row's
live blocks only (flash-decoding, as the contiguous kernel: `split_share` divides the live blocks at run time and
`combine_splits` merges the partial softmax states; without it batch 1 ran 8 programs on an H200's 132 SMs and read
a 32k-token row at 155 GB/s, session 19). The pools
are passed flattened to [P * K * page_size, H] (a free reshape), a ref that is only a pointer. Per block the body
gathers each slot's page-table entry (a vector load), computes the slot's pool row
(page * K + h) * page_size + slot % page_size, and loads K, V ([C, H]) and the scales ([1, C]) with gather loads
(Triton pointer tensors). Every load is masked to the live slots (`pltriton.load(..., mask)`), so a dead slot reads
neither its page-table entry (it may be -1) nor its row. The head dim and the padded query rows must be powers of
two; a head dim that is not is refused (padding it would copy the whole pool every step).

Attention sinks (`sinks`, gpt-oss: float32[N], traced) join each row's softmax denominator once, where each body
normalizes: the TPU body takes each row's sink as one more input, [K, R, 1] with an [R, 1] block per (b, h) like
the row bounds' (`decode_kernel.row_sinks`), and starts its online softmax from the sink's state (max = sink,
sum = 1); the GPU body is unchanged and the sinks join `combine_splits` as one more partial state. Either way a
row with no live slot returns 0, and without sinks the kernels are the very ones they were.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jaxkv.attention.pallas_namespace import pl, pltpu, pltriton, require_triton

from jaxkv.attention.decode_kernel import (GPU_MIN_DIM, MASKED, TPU_ROW_MULTIPLE, tpu_step_block, block_range,
                                           cdiv, combine_splits, decode_masks, default_splits, live_bounds, load_rows,
                                           load_scale, matmul_dtype, next_pow2, normalize, online_softmax_step,
                                           pad_axis, reset_softmax_state, row_bounds, row_sinks, scale_rows,
                                           split_row_refs, split_scale_refs, split_share)
from jaxkv.attention.reference import Unsupported, check_chunk, check_sinks, check_softcap

# Slots per step a page group aims for when `pages_per_block` is not given. TPU: 128 slots (a lane-dense row of
# scores), at most 8 pages (each page is its own BlockSpec'd input and DMA). GPU: 64 slots, as the contiguous
# decode kernel's blocks.
TARGET_SLOTS = types.MappingProxyType({"tpu": 128, "gpu": 64})
TPU_MAX_PAGES_PER_BLOCK = 8


def paged_live_bounds(lengths, q_slots, num_slots: int, sliding_window: int | None, chunk: int | None = None):
    """int32[B] lo, hi: the slots [lo, hi] the query in slot q_slots[b] may see (none if lo > hi, e.g. a length-0
    row): written (< lengths), not in the future (<= q_slot), inside the window and the chunk (slots are
    positions here)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    lo, hi = live_bounds(jnp.zeros_like(lengths), q_slots, num_slots, sliding_window, chunk=chunk)
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


def _paged_kernel_tpu(lo_ref, hi_ref, table_ref, *refs, scale: float, page_size: int, pages_per_block: int,
                      num_groups: int, quantized: bool, softcap: float | None = None, per_row: bool = False,
                      value_queries: int = 0, sinks: bool = False):
    """Grid (B, K, groups). With `value_queries` = T, two more scalar-prefetched refs int32[B * T]: each query's lo
    and hi (`query_value_bounds`). Then q_ref [R, H]; with `per_row`, row lo and hi refs [R, 1] (lo_ref, hi_ref then
    span the rows' ranges); with `sinks`, each row's sink ref [R, 1]; then pages_per_block K page refs
    [page_size, H], as many V page refs, and for a quantized pool as many K and V scale refs [1, page_size]; the
    output [R, H] is written at the last step; scratch m, l, acc."""
    del table_ref  # read by the index maps only
    (qlo_ref, qhi_ref), (q_ref, *refs) = (refs[:2], refs[2:]) if value_queries else ((None, None), refs)
    rows_refs, refs = split_row_refs(refs, per_row)
    sink_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
    n = pages_per_block
    kv_refs, rest = refs[:2 * n], refs[2 * n:]
    scale_refs, (out_ref, m_scr, l_scr, acc_scr) = (rest[:2 * n], rest[2 * n:]) if quantized else ((), rest)
    b, j = pl.program_id(0), pl.program_id(2)
    lo, hi = lo_ref[b], hi_ref[b]
    page = functools.partial(_tpu_page, b, j, lo_ref=lo_ref, hi_ref=hi_ref, page_size=page_size,
                             pages_per_block=n, num_groups=num_groups)
    T = value_queries
    value_bounds = [(qlo_ref[b * T + t], qhi_ref[b * T + t]) for t in range(T)] or None

    # With sinks the softmax starts from the sink's own state (max = sink, sum = 1): counted once per row, and the
    # output is normalized here, at the last step.
    pl.when(j == 0)(functools.partial(reset_softmax_state, m_scr, l_scr, acc_scr, sink_ref))

    @pl.when(page(0)[2])
    def _step():
        rows, head_dim = q_ref.shape
        q = q_ref[...]
        bounds = load_rows(rows_refs)
        state = m_scr[...], l_scr[...], acc_scr[...]
        for i in range(n):  # static: one online-softmax step per page of the group
            offset = page(i)[1] * page_size  # the slots input i's positions stand for; masked if a clamped copy
            live, v_live = decode_masks(offset, offset, lo, hi, rows, page_size, head_dim, row_bounds=bounds,
                                        value_bounds=value_bounds)
            ks, vs = (load_scale(scale_refs[i]), load_scale(scale_refs[n + i])) if quantized else (None, None)
            state = online_softmax_step(*state, q, kv_refs[i][...], kv_refs[n + i][...], live, v_live,
                                        scale=scale, k_scale=ks, v_scale=vs, softcap=softcap)
        m_scr[...], l_scr[...], acc_scr[...] = state

    @pl.when(j == pl.num_programs(2) - 1)
    def _emit():
        out_ref[...] = normalize(acc_scr[...], l_scr[...])


def _paged_tpu(q, k_pages, v_pages, k_scale, v_scale, page_table, lo, hi, *, scale: float, pages_per_block: int,
               interpret, softcap: float | None = None, rows=None, values=None, sinks=None):
    """q [B, K, R, H] (R a multiple of 8); pools [P, K, page_size, H]; scales f32[P, K, 1, page_size] or None;
    page_table int32[B, M]; lo, hi int32[B]; rows: None (one query per sequence) or the per-row (lo, hi)
    int32[B, R, 1] (`row_bounds`); values: None (the value slots are [lo, hi]) or each query's (lo, hi)
    int32[B, T]; sinks: None or each row's sink f32[K, R, 1] (`row_sinks`) -> f32[B, K, R, H]."""
    B, K, R, H = q.shape
    page_size = k_pages.shape[2]
    M = page_table.shape[1]
    n = pages_per_block
    num_groups = cdiv(M, n)
    page = functools.partial(_tpu_page, page_size=page_size, pages_per_block=n, num_groups=num_groups)

    def page_map(i, b, h, j, lo_ref, hi_ref, table_ref, *_):
        p = page(b, j, i, lo_ref, hi_ref)[0]
        return jnp.maximum(table_ref[b * M + p], 0), h, 0, 0  # -1 only for an empty row, which computes nothing

    def row_map(b, h, j, *_):
        return b, h, 0, 0

    def bounds_map(b, h, j, *_):  # the same block for every step of a row: fetched once per b
        return b, 0, 0

    def sink_map(b, h, j, *_):  # the KV head's rows' sinks: the same block for every step of a (b, h)
        return h, 0, 0

    page_specs = [pl.BlockSpec((None, None, page_size, H), functools.partial(page_map, i)) for i in range(n)]
    scale_specs = [pl.BlockSpec((None, None, 1, page_size), functools.partial(page_map, i)) for i in range(n)]
    row_specs = [pl.BlockSpec((None, R, 1), bounds_map)] * 2 if rows is not None else []
    sink_specs = [pl.BlockSpec((None, R, 1), sink_map)] if sinks is not None else []  # as the row bounds' blocks
    quantized = k_scale is not None
    # lo, hi, the flattened page table (read by the index maps before each step's DMA), and each query's value
    # bounds (read by the body as scalars)
    prefetch = [lo, hi, page_table.reshape(-1), *(() if values is None else (x.reshape(-1) for x in values))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(B, K, num_groups),
        in_specs=[pl.BlockSpec((None, None, R, H), row_map), *row_specs, *sink_specs, *page_specs, *page_specs,
                  *(scale_specs * 2 if quantized else [])],
        out_specs=pl.BlockSpec((None, None, R, H), row_map),
        scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                        pltpu.VMEM((R, H), jnp.float32)],
    )
    kernel = functools.partial(_paged_kernel_tpu, scale=scale, page_size=page_size, pages_per_block=n,
                               num_groups=num_groups, quantized=quantized, softcap=softcap, per_row=rows is not None,
                               value_queries=0 if values is None else values[0].shape[1], sinks=sinks is not None)
    scales = [k_scale] * n + [v_scale] * n if quantized else []
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, K, R, H), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxkv_paged_decode_attention",
    )(*prefetch, q, *(rows or ()), *([] if sinks is None else [sinks]), *[k_pages] * n, *[v_pages] * n, *scales)


# --- GPU (Triton) --------------------------------------------------------------------------------------------


def _paged_kernel_gpu(lo_ref, hi_ref, table_ref, q_ref, *refs, scale: float, page_size: int, block: int,
                      kv_heads: int, quantized: bool, splits: int, softcap: float | None = None,
                      per_row: bool = False, value_queries: int = 0):
    """Grid (B, K, splits). lo_ref, hi_ref [1]; table_ref [M] (the row's page table); q_ref [R, H]; with `per_row`,
    row lo and hi refs [R, 1] (lo_ref, hi_ref then span the rows' ranges); with `value_queries` = T, each query's lo
    and hi refs [Tp] (`query_value_bounds`, padded to a power of two); k_ref, v_ref [P * K * page_size, H]
    (pointers: only the gathered rows are read); then, for a quantized pool, ks_ref, vs_ref [P * K * page_size];
    outputs this split's (acc [R, H], m [R, 1], l [R, 1])."""
    rows_refs, refs = split_row_refs(refs, per_row)
    (qlo_ref, qhi_ref), (k_ref, v_ref, *refs) = (refs[:2], refs[2:]) if value_queries else ((None, None), refs)
    ks_ref, vs_ref, (acc_out, m_out, l_out) = split_scale_refs(refs, quantized)
    bounds = load_rows(rows_refs)  # loaded once, before the loop
    value_bounds = [(qlo_ref[t], qhi_ref[t]) for t in range(value_queries)] or None
    lo, hi = lo_ref[0], hi_ref[0]
    h = pl.program_id(1)
    q = q_ref[...]  # [R, H]
    rows, head_dim = q.shape
    first, count = block_range(lo, hi, block)
    begin, end = split_share(count, splits, pl.program_id(2))
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
        # `other` in the pool's dtype: Triton's lowering cannot cast an integer 0 to float8 (NotImplementedError
        # "cannot cast ... tp tensor<...xf8E4M3FN>", seen compiling on an H200, session 19).
        k = pltriton.load(k_ref.at[rows_kv], mask=read_kv, other=jnp.zeros((), k_ref.dtype))  # [C, H]
        v = pltriton.load(v_ref.at[rows_kv], mask=read_kv, other=jnp.zeros((), v_ref.dtype))
        k_scale, v_scale = ((pltriton.load(x.at[row[None, :]], mask=read[None, :], other=0) for x in (ks_ref, vs_ref))
                            if quantized else (None, None))  # [1, C] each
        live, v_live = decode_masks(offset, offset, lo, hi, rows, block, head_dim, row_bounds=bounds,
                                    value_bounds=value_bounds)
        return online_softmax_step(*carry, q, k, v, live, v_live, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                   softcap=softcap)

    init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(begin, end, body, init)  # dynamic trip count: only live blocks are loaded
    acc_out[...], m_out[...], l_out[...] = acc, m, l


def gpu_block_slots(page_size: int, pages_per_seq: int, pages_per_block: int | None) -> int:
    """Slots per GPU loop iteration: a power of two >= 16 (Triton tensor sizes, tl.dot dims) covering
    `pages_per_block` pages if given, else 64 slots (as the contiguous kernel's blocks) or the whole table if that
    is shorter."""
    if pages_per_block:
        return max(GPU_MIN_DIM, next_pow2(pages_per_block * page_size))
    return max(GPU_MIN_DIM, min(TARGET_SLOTS["gpu"], next_pow2(pages_per_seq * page_size)))


def _paged_gpu(q, k_pages, v_pages, k_scale, v_scale, page_table, lo, hi, *, scale: float, block: int, splits: int,
               interpret, softcap: float | None = None, rows=None, values=None, sinks=None):
    """q [B, K, R, H] (R, H powers of two >= 16); pools [P, K, page_size, H]; scales f32[P, K, page_size] or None;
    page_table int32[B, M]; lo, hi int32[B]; block: slots per loop iteration; splits: programs per (row, KV head),
    each taking an even share of the row's live blocks; rows, values, sinks: as `_paged_tpu`'s -> f32[B, K, R, H].
    The sinks join the splits' combine (`combine_splits`), not the kernel."""
    require_triton()
    B, K, R, H = q.shape
    P, _, page_size, _ = k_pages.shape
    if H & (H - 1):
        raise Unsupported(f"the GPU paged kernel needs a power-of-two head dim (Triton tensor sizes), got {H}; "
                         "padding it would copy the whole pool every step")
    flat = (P * K * page_size, H)

    def scalar_map(b, h, s):
        return (b,)

    def row_map(b, h, s):
        return b, h, 0, 0

    def split_map(b, h, s):
        return b, h, s, 0, 0

    def whole(b, h, s):  # the whole pool: a base pointer, gathered from per block
        return 0, 0

    def whole_scales(b, h, s):
        return (0,)

    def bounds_map(b, h, s):
        return b, 0, 0

    quantized = k_scale is not None
    scale_specs = [pl.BlockSpec(flat[:1], whole_scales)] * 2 if quantized else []
    row_specs = [pl.BlockSpec((None, R, 1), bounds_map)] * 2 if rows is not None else []
    if values is not None:  # Triton tensors are powers of two: pad with empty ranges (lo 1 > hi 0), never read
        T = values[0].shape[1]
        Tp = next_pow2(T)
        values = [jnp.pad(x, ((0, 0), (0, Tp - T)), constant_values=fill) for x, fill in zip(values, (1, 0))]
    value_specs = [pl.BlockSpec((None, values[0].shape[1]), lambda b, h, s: (b, 0))] * 2 if values is not None else []
    kernel = functools.partial(_paged_kernel_gpu, scale=scale, page_size=page_size, block=block, kv_heads=K,
                               quantized=quantized, splits=splits, softcap=softcap, per_row=rows is not None,
                               value_queries=0 if values is None else T)
    scales = [k_scale.astype(jnp.float32).reshape(-1), v_scale.astype(jnp.float32).reshape(-1)] if quantized else []
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[pl.BlockSpec((1,), scalar_map), pl.BlockSpec((1,), scalar_map),
                  pl.BlockSpec((None, page_table.shape[1]), lambda b, h, s: (b, 0)),
                  pl.BlockSpec((None, None, R, H), row_map), *row_specs, *value_specs,
                  pl.BlockSpec(flat, whole), pl.BlockSpec(flat, whole), *scale_specs],
        out_specs=[pl.BlockSpec((None, None, None, R, H), split_map),
                   pl.BlockSpec((None, None, None, R, 1), split_map),
                   pl.BlockSpec((None, None, None, R, 1), split_map)],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R, 1), jnp.float32)],
        # Explicit Triton params: without them JAX 0.10 lowers GPU pallas_calls with Mosaic GPU. More rows (several
        # queries per sequence) hold more registers: 8 warps past 64 rows, as the contiguous decode kernel (not
        # measured).
        compiler_params=pltriton.CompilerParams(num_warps=8 if rows is not None and R > 64 else 4, num_stages=2),
        interpret=interpret,
        name="jaxkv_paged_decode_attention",
    )(lo, hi, page_table, q, *(rows or ()), *(values or ()), k_pages.reshape(flat), v_pages.reshape(flat),
      *scales)
    return combine_splits(acc, m, l, sinks)  # [B, K, R, H]


# --- public --------------------------------------------------------------------------------------------------


def query_value_bounds(lo, hi):
    """Per-query bounds [B, T] -> the int32[B] range (lo, hi) spanning every query's nonempty range (0, -1: none).

    Without a sliding window every query's range starts at slot 0, so the span is their union. With one, queries
    whose slots are far apart (q_slots are arbitrary) leave gaps between their windows: the kernels then zero the
    values of each block outside every query's own range (`decode_masks`' `value_bounds`), as the reference does."""
    nonempty = lo <= hi
    some = jnp.any(nonempty, axis=1)
    lo_all = jnp.min(jnp.where(nonempty, lo, jnp.iinfo(jnp.int32).max), axis=1)
    hi_all = jnp.max(jnp.where(nonempty, hi, -1), axis=1)
    return jnp.where(some, lo_all, 0), hi_all


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float,
                           sliding_window: int | None = None, k_scale=None, v_scale=None, q_slots=None,
                           platform: str | None = None, pages_per_block: int | None = None, interpret=None,
                           softcap: float | None = None, splits: int | None = None, sinks=None,
                           chunk: int | None = None):
    """Attention of one query (or a small block of queries) per sequence over its pages;
    `paged_reference.paged_attention` without `fresh`.

    With several queries per sequence (a speculative verify), the T queries times the G query heads of a KV group
    are the kernel's T * G matmul rows, each masked by its own slot, and each live page is read once for all.

    Args:
      q: [B, N, H], one query per sequence, or [B, T, N, H].
      k_pages, v_pages: [P, K, page_size, H] pools, K dividing N (any float dtype, or int8 / float8_e4m3fn with
        scales).
      page_table: int32[B, M], each sequence's pages in slot order (-1: none; never read for a live slot).
      lengths: int32[B], slots written per sequence (the queries' own K/V included). A length-0 row returns 0.
      scale: multiplies q.k.
      sliding_window: if set, a query sees only the `sliding_window` most recent slots, itself included.
      k_scale, v_scale: float32[P, K, page_size] dequantization scales of a quantized pool, else None.
      q_slots: int32[B] (q [B, N, H]) or int32[B, T] (q [B, T, N, H]), each query's slot (any slots: a query sees
        the written slots up to its own, within the window); default the last T slots, lengths - T + t (decode:
        the queries' own K/V already written).
      platform: "tpu" (Mosaic body) or "gpu" (Triton body); None: "gpu" on GPUs, else "tpu".
      pages_per_block: pages per grid step (TPU, `tpu_pages_per_block`) or per loop iteration (GPU: rounded up to
        a power-of-two number of slots, `gpu_block_slots`).
      interpret: run in the Pallas interpreter; None means "only on CPU".
      softcap: Gemma 2's attention-logit soft-capping (`reference.soft_cap`), a static float; None: off.
      splits: GPU: programs per (sequence, KV head), each taking an even share of the row's live blocks (static);
        None: `decode_kernel.default_splits` (enough programs to fill a large GPU when B * K is small). TPU: 1.
      sinks: float32[N] attention sinks (gpt-oss; `paged_reference`), a traced array, or None (module docstring).
      chunk: Llama 4's chunked attention (`paged_reference`): one more lower bound per query
        (`paged_live_bounds`), the same kernel.

    Returns:
      q's shape ([B, N, H] or [B, T, N, H]) in q's dtype; a query with no live slot gets 0.
    """
    kwargs = dict(scale=scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, platform=platform,
                  pages_per_block=pages_per_block, interpret=interpret, softcap=softcap, splits=splits, sinks=sinks,
                  chunk=chunk)
    if q.ndim == 4 and q.shape[1] == 1:  # one query: exactly the [B, N, H] kernel
        q_slots = None if q_slots is None else jnp.asarray(q_slots, jnp.int32)[:, 0]
        return paged_decode_attention(q[:, 0], k_pages, v_pages, page_table, lengths, q_slots=q_slots, **kwargs)[:, None]
    B, N, H = q.shape[0], q.shape[-2], q.shape[-1]
    T = q.shape[1] if q.ndim == 4 else 1
    K, page_size = k_pages.shape[1], k_pages.shape[2]
    check_pool(k_pages, v_pages, page_table, k_scale, v_scale)
    softcap, chunk = check_softcap(softcap), check_chunk(chunk)
    sinks = check_sinks(sinks, N)
    platform = platform or ("gpu" if jax.default_backend() == "gpu" else "tpu")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M = page_table.shape[1]
    G, dtype = N // K, q.dtype
    lengths = jnp.asarray(lengths, jnp.int32)
    rows = values = None
    if T == 1:
        q_slots = lengths - 1 if q_slots is None else jnp.asarray(q_slots, jnp.int32)
        lo, hi = paged_live_bounds(lengths, q_slots, M * page_size, sliding_window, chunk)  # int32[B] each
    else:
        if q_slots is None:
            q_slots = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
        q_slots = jnp.asarray(q_slots, jnp.int32)
        if q_slots.shape != (B, T):
            raise ValueError(f"q_slots must be int32[B, T] = {(B, T)} for q {q.shape}, got shape {q_slots.shape}")
        lo_t, hi_t = paged_live_bounds(jnp.broadcast_to(lengths[:, None], (B, T)), q_slots, M * page_size,
                                       sliding_window, chunk)  # int32[B, T] each
        lo, hi = query_value_bounds(lo_t, hi_t)
        values = None if sliding_window is None and chunk is None else (lo_t, hi_t)
    page_table = jnp.asarray(page_table, jnp.int32)
    mm_dtype = matmul_dtype(dtype, k_pages.dtype)
    if platform == "tpu" and page_size == 1:
        # JAX 0.10's Mosaic lowering of a [R, H] x [1, H] score dot with 16-bit inputs emits an ill-typed
        # vector.broadcast (a verification error); float32 inputs lower, and a 1-slot page's matmul is no cost.
        mm_dtype = jnp.float32
    # [B, K, T * G, H]: row t * G + g is query t of head n = kv_head * G + g (T == 1: a free reshape); cast once
    # here rather than per page in the kernel
    q = (q.reshape(B, K, G, H) if T == 1
         else q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H))
    q = q.astype(mm_dtype)
    if platform == "tpu":
        R = cdiv(T * G, TPU_ROW_MULTIPLE) * TPU_ROW_MULTIPLE  # whole sublane tiles
        rows = None if T == 1 else row_bounds(lo_t, hi_t, G, R)
        out = _paged_tpu(pad_axis(q, 2, R), k_pages, v_pages, scale_rows(k_scale), scale_rows(v_scale), page_table,
                         lo, hi, scale=scale, pages_per_block=tpu_pages_per_block(page_size, M, pages_per_block),
                         interpret=interpret, softcap=softcap, rows=rows, values=values,
                         sinks=row_sinks(sinks, K, T, R))
    elif platform == "gpu":
        R = max(GPU_MIN_DIM, next_pow2(T * G))  # tl.dot needs M >= 16; the padded rows are zeros, sliced off below
        rows = None if T == 1 else row_bounds(lo_t, hi_t, G, R)
        block = gpu_block_slots(page_size, M, pages_per_block)
        num_blocks = cdiv(M * page_size, block)
        splits = max(1, min(splits or default_splits("gpu", B, K, num_blocks), num_blocks))
        out = _paged_gpu(pad_axis(q, 2, R), k_pages, v_pages, k_scale, v_scale, page_table, lo, hi, scale=scale,
                         block=block, splits=splits, interpret=interpret, softcap=softcap, rows=rows, values=values,
                         sinks=row_sinks(sinks, K, T, R))
    else:
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    if T == 1:
        return out[:, :, :G].reshape(B, N, H).astype(dtype)  # [B, N, H]
    out = out[:, :, :T * G].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)  # [B, T, K, G, H]
    return out.reshape(B, T, N, H).astype(dtype)
