"""Attention in plain jax.numpy: the specification every kernel is tested against.

Every implementation takes the same arguments: queries for T consecutive slots starting at `q_offset`, the
cache's keys and values, and each sequence's first live slot `start`. The query in slot q of sequence b may attend
to key slot s when

    start[b] <= s <= q                       (a real token of this sequence, not in the future)
    and q - s < sliding_window               (if there is a window)
    and (s - start[b]) // chunk == (q - start[b]) // chunk     (if attention is chunked)

Chunked attention (Llama 4's `attention_chunk_size`; `chunk`, default None: off): positions are cut into chunks of
`chunk` tokens and a query sees only the earlier tokens of its own chunk, so a layer reads at most `chunk` slots:
its cache is a ring of `chunk` slots (a ring that restarts at each chunk boundary, in effect). Positions count from
each sequence's first real token (slot - start[b]), as the model's position ids do.

Computes in float32 whatever the input dtype. Masking uses `jnp.where` with a large finite negative, never an
additive -inf: a row with no live key then gets a uniform (finite) distribution instead of NaN, and a NaN or
garbage key in a dead slot cannot leak into a live row. Dead *value* slots must hold finite numbers (a zero
weight times NaN is NaN): `KVCache.write(..., zero_dead_values=True)` keeps them zero for this path.

Attention-logit soft-capping (Gemma 2; `softcap`, default None: off): the scaled score s = (q . k) * scale (keys
dequantized first) becomes softcap * tanh(s / softcap), in float32, before masking and the softmax, exactly as
Hugging Face transformers' Gemma2 does (`soft_cap`). Masked slots still get MASKED itself, never tanh of it.

Two cache variants every implementation accepts:

  Quantized caches (int8, float8_e4m3fn) pass `k_scale`, `v_scale` [B, K, S]: slot s of KV head k holds
  `k[b, k, s] * k_scale[b, k, s]`. Dequantization is part of the attention's reads (here fused by XLA into the
  score and output reductions; in the kernels, per block), never a dequantized copy of the cache. Caches in
  bfloat16/float16 pass no scales and are simply upcast.

Attention sinks (gpt-oss; `sinks`, default None: off): one learned logit per query head that joins every query's
softmax denominator and weighs no value, as transformers' GptOss eager attention does (the sink appended to the
masked scores, the softmax taken, the sink's column dropped): weights = exp(s - m) / (sum exp(s - m) + exp(sink -
m)), m the larger of the row's max score and the sink. A head whose sink is large attends to nothing much; a row
with no live key then averages nothing (zeros) instead of the uniform average below. `sinks` is float32[N], an
array (a trained parameter, not static); `check_sinks` validates it.

  Ring caches (`ring=True`, a sliding-window model's cache of S = window slots): absolute slot s (as counted by
  `start`, `q_offset` and positions) lives at index s mod S, overwriting slot s - S. For the query in absolute slot
  q, index i therefore holds absolute slot q - ((q - i) mod S), and the rule above applies to that slot. This holds
  when the T queries do not overwrite slots they read: T == 1 (decode), or a chunk none of whose writes replaces a
  slot an earlier query of the chunk may still see: one whose overwritten slots all precede `start`
  (q_offset + T - 1 < S + start: the ring has not yet filled), or a window <= S - T + 1. A chunk over a full ring
  of S = window slots breaks it (its first query's oldest live slots sit at the indices its later queries write);
  the library never asks for one: prefill attends over the fresh prompt K/V (ring=False), and only decode reads a
  ring.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class Unsupported(NotImplementedError, ValueError):
    """A case an implementation cannot serve (a shape, dtype, platform, ring, chunk, ...), raised while tracing,
    before any compute. A NotImplementedError, so `jaxkv.attention.api` falls through to the next implementation for
    "auto"; a ValueError, as a call that names the implementation asked for something it does not take."""


MASKED = -1e30  # large finite negative: exp(MASKED - max) underflows to exactly 0 for any live max
# Decode reads a prefix of the cache of at least this many slots (`prefix_lengths`). 128 measured no faster at live
# 128 or 300 and adds branches, each compiled per layer (docs/design/attention.md, "Decode attention bounded by the
# live length").
MIN_PREFIX = 256


def live_mask(start, q_offset, num_queries: int, num_slots: int, sliding_window: int | None = None,
              ring: bool = False, num_indices: int | None = None, chunk: int | None = None):
    """bool[B, T, S]: which cache indices each query may attend to (the rule in the module docstring).

    `num_indices` (default all S) limits the mask to the first that many indices of the S-slot cache: a ring's
    index-to-slot map still wraps modulo S."""
    q_slot = q_offset + jnp.arange(num_queries, dtype=jnp.int32)[:, None]  # [T, 1]
    index = jnp.arange(num_slots if num_indices is None else num_indices, dtype=jnp.int32)[None, :]  # [1, S]
    k_slot = q_slot - (q_slot - index) % num_slots if ring else index  # [T or 1, S]: the absolute slot held
    live = (k_slot[None] >= start[:, None, None]) & (k_slot[None] <= q_slot[None])
    if sliding_window is not None:
        live &= k_slot[None] > q_slot[None] - sliding_window
    if chunk is not None:
        live &= same_chunk(k_slot[None] - start[:, None, None], q_slot[None] - start[:, None, None], chunk)
    return live


def same_chunk(k_position, q_position, chunk: int):
    """Whether a key at `k_position` lies in the chunk of the query at `q_position` (<= it: the causal rule is the
    caller's): k >= q - q mod chunk. For a padding query (a negative position) the result does not matter."""
    return k_position >= q_position - q_position % chunk


def check_chunk(chunk) -> int | None:
    """`chunk` as a Python int or None: static, as `sliding_window`; ValueError unless a positive integer."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be None or a positive integer (a static Python int), got {chunk!r}")
    return int(chunk)


def check_softcap(softcap) -> float | None:
    """`softcap` as a Python float, or None (no capping). It is static, part of a kernel's compile-time
    configuration like `scale`: ValueError unless it is a finite number > 0 known at trace time."""
    if softcap is None:
        return None
    try:
        value = math.nan if isinstance(softcap, (bool, str, bytes)) else float(softcap)
    except TypeError:  # a traced value (jax's ConcretizationTypeError is a TypeError), a list, ...
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be None or a finite number > 0 (a static Python float), got {softcap!r}")
    return value


def soft_cap(scores, softcap: float | None):
    """Gemma 2's attention-logit soft-capping of scaled scores: softcap * tanh(scores / softcap), in float32
    (transformers' Gemma2: divide, tanh, multiply). None returns `scores` untouched, so the uncapped path is the
    very same computation as before capping existed.

    Callers apply it before masking: the mask then replaces a dead slot's capped score (finite, or NaN from a NaN
    key) with MASKED, which stays far below every live score (capped scores lie in [-softcap, softcap])."""
    if softcap is None:
        return scores
    return jnp.tanh(scores.astype(jnp.float32) / softcap) * softcap


def check_sinks(sinks, num_heads: int):
    """`sinks` as float32[N] (N = `num_heads`, the query heads), or None: ValueError for any other shape (before
    any compute)."""
    if sinks is None:
        return None
    shape = getattr(sinks, "shape", None)
    if shape != (num_heads,):
        raise ValueError(f"sinks must be one logit per query head, shape ({num_heads},), got "
                         f"{shape if shape is not None else type(sinks).__name__}")
    return jnp.asarray(sinks).astype(jnp.float32)


def grouped_sinks(sinks, num_kv_heads: int):
    """float32[N] sinks -> [K, G]: query head n = k * G + g reads KV head k (the layout every path groups q by)."""
    return None if sinks is None else sinks.reshape(num_kv_heads, -1)


def dequantize(x, scale):
    """x [B, K, S, H] in the cache dtype -> float32, times its per-slot scale [B, K, S] if quantized."""
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale[..., None].astype(jnp.float32)


def attention(q, k, v, start, q_offset, *, scale: float, sliding_window: int | None = None, k_scale=None,
              v_scale=None, ring: bool = False, min_prefix: int | None = MIN_PREFIX, softcap: float | None = None,
              sinks=None, chunk: int | None = None):
    """Softmax attention of T queries over S cached keys and values.

    Args:
      q: [B, T, N, H] queries for slots [q_offset, q_offset + T).
      k, v: [B, K, S, H] keys and values, K dividing N; query head n reads KV head n // (N // K).
      start: int32[B], each sequence's first live slot.
      q_offset: int32[], the slot of the first query.
      scale: multiplies q.k (1 / sqrt(H) for standard attention).
      sliding_window: if set, a query sees only the `sliding_window` most recent slots, itself included.
      k_scale, v_scale: float32[B, K, S] dequantization scales of an int8/fp8 cache, else None.
      ring: the cache is a ring buffer of S slots (module docstring).
      min_prefix: decode (T == 1) reads only the shortest of `prefix_lengths(S, min_prefix)` that holds every
        live index, chosen by `q_offset` at run time: the work follows the live length, not the capacity. None
        reads all S slots (`full_attention`, the spec). The result equals the spec's (up to float32 summation
        order), except in a row with no live key at all (uniform weights over the slots read: finite either way).
        Over a prefix shorter than S, dead value slots are masked here and need not hold finite numbers.
      softcap: if set, each scaled score s becomes softcap * tanh(s / softcap) before masking (Gemma 2's
        attention-logit soft-capping, `soft_cap`); None leaves the scores as they are.
      sinks: float32[N], one logit per query head in the softmax denominator (gpt-oss; module docstring), or None.
      chunk: if set, a query sees only the earlier tokens of its own chunk of `chunk` positions (Llama 4's chunked
        attention; module docstring).

    Returns:
      [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    softcap, chunk = check_softcap(softcap), check_chunk(chunk)
    sinks = check_sinks(sinks, N)
    lengths = prefix_lengths(k.shape[2], min_prefix)
    if T > 1 or len(lengths) == 1:
        return full_attention(q, k, v, start, q_offset, scale=scale, sliding_window=sliding_window,
                              k_scale=k_scale, v_scale=v_scale, ring=ring, softcap=softcap, sinks=sinks, chunk=chunk)
    qg = q.reshape(B, k.shape[1], N // k.shape[1], H)  # [B, K, G, H]
    out = decode_prefix(qg, k, v, start, q_offset, scale, sliding_window, k_scale, v_scale, ring, lengths,
                         softcap, grouped_sinks(sinks, k.shape[1]), chunk)
    return out.reshape(B, 1, N, H).astype(q.dtype)


def dot_precision(dtype):
    """The matmul precision attention runs at for queries of `dtype`: HIGHEST for float32 (no TF32 on a GPU, no
    one-pass bfloat16 on a TPU: a float32 model attends in float32, as transformers' does), the backend's default
    for 16-bit queries. The Pallas kernels follow the same rule, so kernel and reference agree on every backend: on
    an H200 (session 19) the float32 references at the default precision were off by ~1e-3 against float64 and
    against the kernels, which run float32 dots at full precision."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def full_attention(q, k, v, start, q_offset, *, scale: float, sliding_window: int | None = None, k_scale=None,
                   v_scale=None, ring: bool = False, softcap: float | None = None, sinks=None,
                   chunk: int | None = None):
    """`attention` over every one of the S slots, dead ones masked: the plain formula, whatever T."""
    B, T, N, H = q.shape
    softcap = check_softcap(softcap)
    K, S = k.shape[1], k.shape[2]
    sinks = grouped_sinks(check_sinks(sinks, N), K)  # [K, G]
    live = live_mask(start, q_offset, T, S, sliding_window, ring, chunk=check_chunk(chunk))  # [B, T, S]
    qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    if T == 1:
        out = _decode(qg[:, 0], k, v, live[:, 0], scale, k_scale, v_scale, softcap=softcap, sinks=sinks)
        return out.reshape(B, 1, N, H).astype(q.dtype)
    k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    precision = dot_precision(q.dtype)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32, precision=precision) * scale
    scores = jnp.where(live[:, None, None, :, :], soft_cap(scores, softcap), MASKED)  # [B, K, G, T, S]
    weights = softmax(scores, None if sinks is None else sinks[:, :, None])
    out = jnp.einsum("bkgts,bksh->btkgh", weights, v, precision=precision)  # [B, T, K, G, H]
    return out.reshape(B, T, N, H).astype(q.dtype)


def prefix_lengths(num_slots: int, min_prefix: int | None = MIN_PREFIX) -> tuple[int, ...]:
    """The cache prefixes a decode step may read: min_prefix x 1, 1.5, 2, 3, 4, 6, ... while below 0.8 S, then S.

    Each length is at most 1.5x the one before, so a step reads at most 1.5x the slots it needs (past the first);
    a prefix within 1.25x of S would save too little to be worth a branch (each is compiled per layer)."""
    lengths = []
    while min_prefix is not None and 5 * min_prefix < 4 * num_slots:
        lengths += [n for n in (min_prefix, 3 * min_prefix // 2) if 5 * n < 4 * num_slots]
        min_prefix *= 2
    return (*lengths, num_slots)


def masks_dead_values(num_slots: int, num_queries: int, min_prefix: int | None = MIN_PREFIX) -> bool:
    """Whether `attention` over a cache of `num_slots` masks dead value slots itself (the prefix switch, decode
    over a cache with more than one prefix length), so the cache write need not zero them every step."""
    return num_queries == 1 and len(prefix_lengths(num_slots, min_prefix)) > 1


def decode_prefix(q, k, v, start, q_offset, scale, sliding_window, k_scale, v_scale, ring, lengths, softcap=None,
                  sinks=None, chunk=None):
    """`_decode` over the shortest prefix in `lengths` holding every live index: q [B, K, G, H] -> [B, K, G, H];
    `sinks` [K, G] or None.

    Slots past the query (index q_offset + 1 on) are dead, so only the first q_offset + 1 indices can be live; in a
    ring that has wrapped (q_offset >= S) every index can. One `lax.switch` branch per prefix length, each the
    ordinary decode on a static slice, so XLA:CPU compiles the same fused loops (the add tree, the value
    reduction) as for a short cache. Branch operands are the whole buffers: the in-place cache update outside is
    not copied (tests/attention/test_reference_live.py)."""
    S = k.shape[2]
    needed = jnp.minimum(q_offset + 1, S)  # indices [0, needed) hold every live slot
    branch = jnp.sum(jnp.asarray(lengths[:-1], jnp.int32) < needed)  # the first length >= needed

    def prefix(n):
        def run(q, k, v, k_scale, v_scale, start, q_offset):
            live = live_mask(start, q_offset, 1, S, sliding_window, ring, num_indices=n, chunk=chunk)[:, 0]  # [B, n]
            ks, vs = (None if x is None else x[:, :, :n] for x in (k_scale, v_scale))
            # Every branch masks dead values, the whole-cache one too: then the cache write does not have to zero
            # them (`masks_dead_values`), a pass over every value buffer each step (1.7-4 ms of a "small" step at
            # 4,160 slots) traded for a copy of the values in the last branch only, once the cache is >0.8 full.
            return _decode(q, k[:, :, :n], v[:, :, :n], live, scale, ks, vs, mask_values=True, softcap=softcap,
                           sinks=sinks)
        return run

    return jax.lax.switch(branch, [prefix(n) for n in lengths], q, k, v, k_scale, v_scale, start, q_offset)


def softmax(scores, sinks=None):
    """Softmax over the last axis; `sinks` (broadcasting against scores.shape[:-1]) adds one logit per row to the
    denominator only (attention sinks: module docstring), so a row's weights sum to less than one."""
    top = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is None:
        weights = jnp.exp(scores - top)
        return weights / jnp.sum(weights, axis=-1, keepdims=True)
    sinks = jnp.broadcast_to(sinks, scores.shape[:-1])[..., None]
    top = jnp.maximum(top, sinks)
    weights = jnp.exp(scores - top)
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sinks - top))


def _decode(q, k, v, live, scale, k_scale, v_scale, mask_values=False, softcap=None, sinks=None):
    """One query per sequence: q [B, K, G, H], live bool[B, S] -> float32 [B, K, G, H]; `softcap` as `attention`'s,
    `sinks` [K, G] or None.

    `mask_values` zeroes dead value slots (NaN included) before they are weighted. Only for a slice shorter than
    the cache (`decode_prefix`): there the weighted values are summed by a tree over the slots (`_sum_slots`),
    one fusion that reads the slice in place with the select inside it (a reduce over the slice made XLA:CPU copy
    it first: 0.79 of an 8.7 ms "small" batch-1 step at 384 live slots). Over the whole just-updated buffer the
    select adds a copy (2 ms of a 23 ms "small" step at 4,160 slots) or, outside a switch, made XLA:CPU copy the
    buffer in the update (batch 3, tests/cache/test_contiguous.py); there the cache write's zeroing of dead values
    is relied on instead.

    Written as broadcast-multiply-and-reduce rather than einsum on purpose. The cache buffers were just updated in
    place; a dot over them with a size-1 batch dimension (batch 1, the common decode case) goes through a bitcast
    that made XLA:CPU duplicate the update and copy whole cache buffers every step (seen in the compiled HLO). The
    reduce form reads the updated buffers directly, with no copy at any batch size, and XLA fuses a quantized
    cache's dequantization into the reductions' reads.

    The scores' sum over the head dimension is a pairwise tree of adds (`_sum_minor`), not a reduce: XLA:CPU ran
    the reduce over the minor axis at about 0.5 GB/s; the tree is one elementwise fusion. The whole attention went
    from 6.9 to 1.8 ms of a "small" batch-1 step (`scripts/profile_decode.py`; docs/design/benchmarks.md, "Where the
    decode time goes").
    """
    # q is tiny; materialize it. Otherwise XLA fuses its producers (RoPE's cos, sin and concatenates) into the
    # scores' loop and recomputes them for every cache slot (measured: 10x slower scores). XLA:CPU never fuses a
    # dot into its consumers, and a dot with the identity is exact at HIGHEST precision (the default would round
    # to bf16 passes on TPU, TF32 on recent GPUs); an optimization barrier is expanded before fusion and does not
    # help.
    q = jnp.einsum("bkgh,hj->bkgj", q, np.eye(q.shape[-1], dtype=q.dtype), precision=jax.lax.Precision.HIGHEST)
    if k_scale is None and k.dtype != jnp.float32:
        # A 16-bit cache is read in its own dtype, products rounded to it and sums accumulated in float32 (as a
        # bf16 attention kernel does). Upcasting the whole just-updated buffer instead made XLA:CPU move the
        # convert into the in-place update, materializing a float32 copy of the cache and copying the buffer
        # every step (tests/cache/test_contiguous.py).
        scores = _sum_minor((k[:, :, None, :, :] * q.astype(k.dtype)[:, :, :, None, :]).astype(jnp.float32))
        weights = softmax(jnp.where(live[:, None, None, :], soft_cap(scores * scale, softcap), MASKED),
                          sinks)  # [B, K, G, S]
        if mask_values:
            v = jnp.where(live[:, None, :, None], v, jnp.zeros((), v.dtype))
            return _sum_slots((weights.astype(v.dtype)[..., None] * v[:, :, None, :, :]).astype(jnp.float32))
        return jnp.sum(weights.astype(v.dtype)[..., None] * v[:, :, None, :, :], axis=-2, dtype=jnp.float32)
    q = q.astype(jnp.float32)
    k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    if mask_values:
        v = jnp.where(live[:, None, :, None], v, 0.0)
    scores = soft_cap(_sum_minor(k[:, :, None, :, :] * q[:, :, :, None, :]) * scale, softcap)  # [B, K, G, S]
    weights = softmax(jnp.where(live[:, None, None, :], scores, MASKED), sinks)  # [B, K, G, S]
    if mask_values:
        return _sum_slots(weights[..., None] * v[:, :, None, :, :])  # [B, K, G, H]
    return jnp.sum(weights[..., None] * v[:, :, None, :, :], axis=-2)  # [B, K, G, H]


def _sum_slots(x):
    """x.sum(-2) over a slice of the cache as a pairwise tree of slice-and-add (as `_sum_minor`): one elementwise
    fusion that reads the slice where it lies. A reduce over a slice made XLA:CPU copy the slice first."""
    while x.shape[-2] > 1 and x.shape[-2] % 2 == 0:
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    return jnp.sum(x, axis=-2)


def _sum_minor(x):
    """x.sum(-1) as a pairwise tree of slice-and-add (halving while the length is even; a plain sum of what is
    left). Elementwise adds fuse into one loop that XLA:CPU vectorizes; its reduce over the minor axis does not."""
    while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return jnp.sum(x, axis=-1)
