"""Attention sinks (gpt-oss's `sinks`: one learned logit per query head in every softmax denominator) in every GQA
attention implementation: the XLA references by hand, then the Pallas kernels and the shard_map wrappers against
the references.

The spec (`reference` module docstring): weights = exp(s - m) / (sum over live keys exp(s - m) + exp(sink - m)),
m = max(the row's max live score, sink); the sink weighs no value, so a row with no live key gives 0. Checked by a
float64 numpy loop over every (row, query, head) against the contiguous reference (prefill, decode through the
live-prefix switch, windows, rings, int8 caches, soft-capping) and every paged form (pages shared between rows, a
prompt chunk's `fresh` K/V). The kernels (interpreted on CPU, both bodies; compiled with JAXKV_PALLAS_COMPILED=1 as
scripts/device_check.py runs this file) are compared with the reference on every row, those without a live key
included: with sinks both give 0 there. Sinks ~ N(0, 2) with one head's at 50 (that head attends to nearly
nothing): each comparison asserts that the sinks change the result far beyond its tolerance, so a path that
ignored them, or counted one twice (once per split), would fail.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxkv import sharding
from jaxkv.attention import api, decode_kernel, paged_reference, pallas, prefill_kernel, reference
from jaxkv.attention import paged_decode_kernel as pk
from jaxkv.cache import quantize

# From helpers.kernels: run (compiled once per argument shapes), inputs (q, k, v and scales), ring_offsets,
# page_layout / page_pool / poison (page tables whose rows share pages, NaN in every slot no row may read);
# TOLERANCES keyed by q's dtype, with their reasons in helpers.tolerances (a sink adds one float32 term to each
# row's denominator: it does not widen them).
from helpers import kernels
from helpers.kernels import BLOCKS, INTERPRET, PLATFORMS, TOLERANCES, lowered_text

# The references against the float64 loop: float32 sums of at most ~40 O(1) terms in another order, ~1e-6; 1e-5
# leaves margin and is three orders below what a sink moves here (asserted in `_sinks_matter`).
BY_HAND = dict(atol=1e-5, rtol=1e-5)
HUGE = 50.0  # a sink far above every score: its head's weights are ~exp(-45) and its output ~0


def _sinks(N, seed=0):
    """float32[N] ~ N(0, 2), head 1's at HUGE."""
    sinks = np.random.default_rng(seed).normal(size=N).astype(np.float32) * 2
    sinks[1] = HUGE
    return jnp.asarray(sinks)


def _sinks_matter(with_sinks, without, rows, atol):
    """The sinks change the result (on `rows`, a bool mask over the leading axes) by far more than `atol`: an
    implementation that ignored them could not pass a comparison at that tolerance."""
    diff = np.abs(np.asarray(with_sinks, np.float64) - np.asarray(without, np.float64))[rows].max()
    assert diff > 10 * atol, diff


NO_SINKS = -np.inf  # the by-hand loops' sink that takes no weight: the plain softmax


def _softmax_with_sink(scores, sink):
    """float64 weights of `scores` (the live ones only) with `sink` in the denominator."""
    if len(scores) == 0:  # no live key: nothing to weigh (and no max to subtract, were the sink NO_SINKS)
        return np.zeros(0)
    logits = np.append(np.asarray(scores, np.float64), sink)
    w = np.exp(logits - logits.max())
    return (w / w.sum())[:-1]


# --- the contiguous reference, by hand -----------------------------------------------------------------------


def _by_hand(q, k, v, start, q_offset, *, scale, sinks, window=None, ring=False, scales=(), softcap=None):
    """float64 loop: q [B, T, N, H], k, v [B, K, S, H] (times their scales [B, K, S] if quantized) -> [B, T, N, H].
    Index i of a ring holds absolute slot q - ((q - i) mod S) for the query in slot q (`reference`)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if scales:
        k, v = (x * np.asarray(s, np.float64)[..., None] for x, s in zip((k, v), scales))
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            q_slot = int(q_offset) + t
            index = np.arange(S)
            slot = q_slot - (q_slot - index) % S if ring else index
            live = (slot >= int(start[b])) & (slot <= q_slot)
            if window is not None:
                live &= q_slot - slot < window
            for n in range(N):
                kv = n // (N // K)
                s = k[b, kv, live] @ q[b, t, n] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                out[b, t, n] = _softmax_with_sink(s, float(sinks[n])) @ v[b, kv, live]
    return out


# (T, window, ring, cache, softcap, min_prefix, [(start, q_offset), ...]) over S = 32 slots, B = 3: each row set
# has a row with no live key (start past every query). T = 1 through the live-prefix switch (min_prefix 8: prefixes
# of 8, 12, 16, 24 and 32 slots, picked by q_offset) and through the whole cache; T = 5 the einsum path.
S_BY_HAND = 32
REFERENCE_CASES = [
    (5, None, False, "float32", None, 8, [([0, 3, 15], 10), ([0, 20, 40], 27)]),
    (1, None, False, "float32", None, 8, [([0, 2, 9], 5), ([0, 3, 11], 10), ([4, 0, 30], 20), ([0, 9, 32], 31)]),
    (5, 4, False, "float32", None, 8, [([0, 3, 15], 10)]),
    (1, 6, False, "float32", None, 8, [([0, 3, 11], 10), ([0, 20, 40], 31)]),
    # a ring of S = window slots: fresh, just wrapped, far past S (steady state)
    (1, S_BY_HAND, True, "float32", None, 8, [([0, 2, 20], 12), ([0, 5, 40], 32), ([90, 100, 200], 105)]),
    (1, 10, True, "float32", None, None, [([0, 80, 200], 101)]),
    (5, None, False, "int8", None, 8, [([0, 3, 15], 10)]),
    (5, 6, False, "float32", 2.0, 8, [([0, 3, 15], 10)]),
    (1, None, False, "int8", 2.0, 8, [([0, 3, 11], 10), ([0, 9, 32], 31)]),
]
# Folded into the cases above, each a program of its own for a path another case runs: T = 1 with min_prefix None
# (one branch over the whole cache: the switch's last branch, read by the second case at q_offset 31) and an int8
# cache at T = 1 without the cap (the last case's offsets; the cap is elementwise, before the mask and the sinks).


@pytest.mark.parametrize("T,window,ring,cache,softcap,min_prefix,offsets", REFERENCE_CASES)
def test_reference_by_hand(T, window, ring, cache, softcap, min_prefix, offsets):
    """`reference.attention` (and `full_attention`, the spec it switches away from at T == 1) with sinks equals the
    float64 loop on every row; a row with no live key is exactly 0; the huge sink's head is ~0; and the result
    without sinks differs by far more than the tolerance."""
    B, N, K, H, scale = 3, 4, 2, 16, 0.25
    rng = np.random.default_rng(T + (window or 0))
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k, v = (rng.normal(size=(B, K, S_BY_HAND, H)).astype(np.float32) for _ in range(2))
    if cache == "int8":
        (k, k_scale), (v, v_scale) = quantize(k, "int8"), quantize(v, "int8")
        scales = (k_scale, v_scale)
    else:
        k, v, scales = jnp.asarray(k), jnp.asarray(v), ()
    sinks = _sinks(N)
    static = dict(scale=scale, sliding_window=window, ring=ring, softcap=softcap)
    attend = functools.partial(reference.attention, min_prefix=min_prefix)
    # jitted: each compiles once, start and q_offset traced (eager dispatch of the prefix switch is slower)
    fns = [jax.jit(functools.partial(fn, **static)) for fn in (attend, reference.full_attention)]
    cache_scales = dict(zip(("k_scale", "v_scale"), scales))
    for start, q_offset in offsets:
        start, q_offset = jnp.asarray(start, jnp.int32), jnp.int32(q_offset)
        want = _by_hand(q, k, v, start, q_offset, scale=scale, sinks=sinks, window=window, ring=ring, scales=scales,
                        softcap=softcap)
        live = np.asarray(reference.live_mask(start, q_offset, T, S_BY_HAND, window, ring).any(-1))  # [B, T]
        assert live.any() and not live.all()
        for fn in fns:
            out = np.asarray(fn(q, k, v, start, q_offset, sinks=sinks, **cache_scales))
            np.testing.assert_allclose(out, want, **BY_HAND, err_msg=f"start={start} q_offset={q_offset}")
            np.testing.assert_array_equal(out[~live], 0.0)  # no live key: the sink takes all the weight
            assert np.abs(out[:, :, 1]).max() < 1e-12  # the huge sink's head
        without = _by_hand(q, k, v, start, q_offset, scale=scale, sinks=np.full(N, NO_SINKS), window=window,
                           ring=ring, scales=scales, softcap=softcap)
        _sinks_matter(want, without, live, BY_HAND["atol"])


def test_reference_by_hand_large_scores():
    """Scores far above the sink (up to ~60) and far below it: the shared max keeps both finite and exact."""
    B, T, N, K, H = 1, 3, 4, 1, 8
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)) * 8, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, 12, H)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray([-30.0, 0.0, 30.0, 80.0], jnp.float32)
    start, q_offset = jnp.zeros((B,), jnp.int32), jnp.int32(9)
    out = np.asarray(reference.attention(q, k, v, start, q_offset, scale=1.0, sinks=sinks))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _by_hand(q, k, v, start, q_offset, scale=1.0, sinks=sinks), **BY_HAND)


# --- the paged references, by hand ---------------------------------------------------------------------------


def _paged_by_hand(q, k_pages, v_pages, table, lengths, q_slots, *, scale, sinks, window=None, scales=(),
                   softcap=None, fresh=None):
    """float64 loop over each sequence's slots through its page table (and, with `fresh`, the pages only before the
    chunk, then the chunk's own keys causally): q [B, T, N, H] -> [B, T, N, H]."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    if scales:
        k_pages, v_pages = (x * np.asarray(s, np.float64)[..., None] for x, s in zip((k_pages, v_pages), scales))
    table, lengths, q_slots = np.asarray(table), np.asarray(lengths), np.asarray(q_slots)
    B, T, N, H = q.shape
    K, ps = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            qs = int(q_slots[b, t])
            for n in range(N):
                kv = n // (N // K)
                keys, values = [], []
                for s in range(table.shape[1] * ps):
                    live = s <= qs and s < lengths[b] and (window is None or s > qs - window)
                    if fresh is not None:
                        live = live and s < q_slots[b, 0]
                    if live:
                        page = int(table[b, s // ps])
                        assert page >= 0
                        keys.append(k_pages[page, kv, s % ps])
                        values.append(v_pages[page, kv, s % ps])
                if fresh is not None:
                    fresh_k, fresh_v, valid = (np.asarray(x) for x in fresh)
                    for u in range(T):
                        ks = int(q_slots[b, u])
                        if valid[b, u] and ks <= qs and (window is None or ks > qs - window):
                            keys.append(fresh_k[b, kv, u].astype(np.float64))
                            values.append(fresh_v[b, kv, u].astype(np.float64))
                keys, values = np.reshape(keys, (-1, H)), np.reshape(values, (-1, H))
                scores = keys @ q[b, t, n] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                out[b, t, n] = _softmax_with_sink(scores, float(sinks[n])) @ values
    return out


PAGED_FORMS = {
    "paged": paged_reference.paged_attention,
    "pool": paged_reference.pool_attention,
    "live": functools.partial(paged_reference.live_paged_attention, min_prefix=4),  # prefixes of 1, 2, 3, 5 pages
    # T == 1 only; lists of 4, 6, 8, 12, 16 and 30 pages (a smaller min_prefix compiles more branches for nothing)
    "ragged": functools.partial(paged_reference.ragged_paged_attention, min_prefix=16),
    "xla": paged_reference.xla_attention,
}


# (T, queries, pool, window, softcap, fresh): queries "last" = each row's last T slots (decode, a verify), "any" =
# arbitrary slots (before, inside and past a row's length), "chunk" = a prompt chunk at each row's end.
PAGED_CASES = [
    (1, "last", "float32", None, None, False),
    (1, "last", "int8", 6, 2.0, False),
    (3, "any", "float32", 5, None, False),
    (3, "chunk", "float32", None, None, True),
    (3, "chunk", "int8", 4, 2.0, True),
]


@pytest.mark.parametrize("T,queries,pool,window,softcap,fresh", PAGED_CASES)
def test_paged_references_by_hand(T, queries, pool, window, softcap, fresh):
    """Every paged form with sinks equals the float64 loop on every query (length-0 rows and queries that see
    nothing included: 0); the result without sinks differs by far more than the tolerance."""
    N, K, ps = 4, 2, 4
    lengths = [20, 1, 3, 4, 5, 0]
    table, _, P = kernels.page_layout(lengths, ps, 0)
    k, v, scales = kernels.page_pool(P, K, ps, pool, np.random.default_rng(1))
    B, H = len(lengths), k.shape[-1]
    lengths = jnp.asarray(lengths, jnp.int32)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    if queries == "any":
        q_slots = jnp.asarray(rng.integers(-1, 20, size=(B, T)), jnp.int32)
    else:  # the last T slots of each row (a chunk written into the pages too, read from `fresh` instead)
        q_slots = jnp.maximum(lengths[:, None] - T, 0) + jnp.arange(T, dtype=jnp.int32)[None, :]
    chunk = None
    if fresh:
        fresh_k, fresh_v = (jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32) for _ in range(2))
        valid = q_slots < jnp.maximum(lengths, 1)[:, None]  # a short row's chunk is partly padding
        chunk = (fresh_k, fresh_v, valid.at[-1].set(False))  # the last row's chunk: all padding
    sinks = _sinks(N)
    arrays = dict(sinks=sinks, **dict(zip(("k_scale", "v_scale"), scales)), **({} if chunk is None else
                                                                                dict(fresh=chunk)))
    by_hand = functools.partial(_paged_by_hand, q, k, v, table, lengths, q_slots, scale=0.3, window=window,
                                scales=scales, softcap=softcap, fresh=chunk)
    want = by_hand(sinks=sinks)
    seen = np.abs(want).max(-1).max(-1) > 0  # [B, T]: queries with some live key (the loop gives exact 0 else)
    assert seen.any() and not seen.all()
    _sinks_matter(want, by_hand(sinks=np.full(N, NO_SINKS)), seen, BY_HAND["atol"])
    for name, form in PAGED_FORMS.items():
        if name == "ragged" and (T != 1 or fresh):
            continue
        form = jax.jit(functools.partial(form, scale=0.3, sliding_window=window, softcap=softcap))  # compiled once
        out = np.asarray(form(q, k, v, table, lengths, q_slots, **arrays))
        np.testing.assert_allclose(out, want, **BY_HAND, err_msg=name)
        np.testing.assert_array_equal(out[~seen], 0.0)
        assert np.abs(out[:, :, 1]).max() < 1e-12, name  # the huge sink's head


def test_wrong_sinks_shape_is_a_value_error():
    """One float per query head, shape (N,): anything else is refused before any compute, by every reference, every
    Pallas entry point and kernel, and the shard_map wrappers."""
    N = 8
    q, k, v, _ = kernels.inputs(1, 1, "gqa", 32, "float32", num_slots=16)
    start, q_offset = jnp.zeros((1,), jnp.int32), jnp.int32(3)
    table, _, P = kernels.page_layout([9, 3], 4, 0)
    kp, vp, _ = kernels.page_pool(P, 2, 4, "float32", np.random.default_rng(0))
    qp, lengths = jnp.concatenate([q] * 2), jnp.asarray([9, 3], jnp.int32)
    paged = (qp, kp, vp, table, lengths, (lengths - 1)[:, None])
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), sharding.AXES)
    fns = [functools.partial(reference.attention, q, k, v, start, q_offset),
           functools.partial(reference.full_attention, q, k, v, start, q_offset),
           functools.partial(pallas.attention, q, k, v, start, q_offset, interpret=True),
           functools.partial(pallas.attention, jnp.concatenate([q] * 20, 1), k, v, start, q_offset, interpret=True),
           functools.partial(decode_kernel.decode_attention, q, k, v, start, q_offset, interpret=True),
           functools.partial(prefill_kernel.prefill_attention, q, k, v, start, q_offset, interpret=True),
           functools.partial(pallas.paged_attention, *paged, interpret=True),
           functools.partial(pk.paged_decode_attention, *paged[:5], interpret=True),
           functools.partial(sharding.shard_attention(reference.attention, mesh), q, k, v, start, q_offset),
           functools.partial(sharding.shard_paged_attention(paged_reference.paged_attention, mesh), *paged),
           *(functools.partial(f, *paged) for f in PAGED_FORMS.values())]
    for bad in (jnp.zeros((N + 1,)), jnp.zeros((1, N)), jnp.zeros((2, N // 2)), jnp.zeros(()), [0.0] * N):
        for fn in fns:
            with pytest.raises(ValueError, match="sinks must be one logit per query head"):
                fn(scale=0.125, sinks=bad)


def test_no_sinks_is_the_program_without_them():
    """sinks=None traces exactly the program without the argument, and the decode kernels' pallas_call is the same
    kernel with sinks (they join the split combine outside it)."""
    q1, k, v, _ = kernels.inputs(1, 1, "gqa", 32, "float32", num_slots=40)
    q20 = jnp.concatenate([q1] * 20, axis=1)
    start, q_offset = jnp.zeros((1,), jnp.int32), jnp.int32(20)
    table, _, P = kernels.page_layout([9, 3], 4, 0)
    kp, vp, _ = kernels.page_pool(P, 2, 4, "float32", np.random.default_rng(0))
    paged = (jnp.concatenate([q1] * 2), kp, vp, table, jnp.asarray([9, 3], jnp.int32))
    sinks = _sinks(8)
    for platform in ("tpu", "gpu"):
        fns = [functools.partial(pallas.attention, q1, k, v, start, q_offset, platform=platform, interpret=True),
               functools.partial(pallas.attention, q20, k, v, start, q_offset, platform=platform, interpret=True),
               functools.partial(pallas.paged_attention, *paged, paged[-1][:, None] - 1, platform=platform,
                                 interpret=True)]
        for fn in fns:
            plain = str(jax.make_jaxpr(functools.partial(fn, scale=0.125))())
            assert str(jax.make_jaxpr(functools.partial(fn, scale=0.125, sinks=None))()) == plain
            assert str(jax.make_jaxpr(functools.partial(fn, scale=0.125, sinks=sinks))()) != plain
        decode = functools.partial(decode_kernel.decode_attention, q1, k, v, start, q_offset, scale=0.125,
                                   platform=platform, interpret=True, splits=2)
        assert _pallas_calls(decode) == _pallas_calls(functools.partial(decode, sinks=sinks))
    gpu_paged = functools.partial(pk.paged_decode_attention, *paged, scale=0.125, platform="gpu", interpret=True)
    assert _pallas_calls(gpu_paged) == _pallas_calls(functools.partial(gpu_paged, sinks=sinks))


def _pallas_calls(fn):
    """The pallas_call equations of fn()'s jaxpr, printed (kernel, grid and block specs)."""
    eqns = jax.make_jaxpr(fn)().eqns
    calls = [str(e) for e in eqns if e.primitive.name == "pallas_call"]
    assert calls
    return calls


# --- Pallas kernels against the reference --------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _kernel(platform, window, ring, **knobs):
    def kernel(q, k, v, start, q_offset, sinks, *scales):
        ks, vs = scales or (None, None)
        return pallas.attention(q, k, v, start, q_offset, scale=0.125, sliding_window=window, k_scale=ks,
                                v_scale=vs, ring=ring, platform=platform, interpret=INTERPRET, sinks=sinks,
                                **{**BLOCKS[platform], **knobs})

    return kernel


@functools.lru_cache(maxsize=None)
def _reference(window, ring, with_sinks=True):
    def ref(q, k, v, start, q_offset, sinks, *scales):
        ks, vs = scales or (None, None)
        return reference.attention(q, k, v, start, q_offset, scale=0.125, sliding_window=window, k_scale=ks,
                                   v_scale=vs, ring=ring, sinks=sinks if with_sinks else None)

    return ref


def _check_kernel(platform, window, ring, q, k, v, scales, offsets, **knobs):
    """Kernel == reference with sinks on every row, at the kernel tolerance of q's dtype, for each (start, q_offset);
    the sinks matter on the rows with a live key."""
    sinks = _sinks(q.shape[2])
    tol = TOLERANCES[jnp.dtype(q.dtype).name]
    for start, q_offset in offsets:
        args = (q, k, v, jnp.asarray(start, jnp.int32), jnp.int32(q_offset), sinks, *scales)
        out = np.asarray(kernels.run(_kernel(platform, window, ring, **knobs), *args), np.float32)
        want = np.asarray(kernels.run(_reference(window, ring), *args), np.float32)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, want, **tol, err_msg=f"start={start} q_offset={q_offset}")
        live = np.asarray(reference.live_mask(args[3], args[4], q.shape[1], k.shape[2], window, ring).any(-1))
        np.testing.assert_array_equal(out[~live], 0.0)
        _sinks_matter(want, kernels.run(_reference(window, ring, False), *args), live, tol["atol"])


S_DECODE = 160  # two TPU blocks of 128 (the last partial), three GPU blocks of 64 (the last shifted back)

# (T, heads, dtype, cache, window, ring, {platform: decode_splits} or None for the default): one query (decode)
# and a block of 3 (a verify: each head's sink on each of its query positions' rows); splits over 2 or 3 programs
# on each platform (the sink must join their combine once); int8 with a window; a ring of S = window slots.
DECODE_CASES = [
    (1, "gqa", "float32", "float32", None, False, {"tpu": 2, "gpu": 3}),
    (3, "gqa", "float32", "int8", 50, False, None),
    (1, "mha", "bfloat16", "bfloat16", S_DECODE, True, {"tpu": 2, "gpu": 2}),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("T,heads,dtype,cache,window,ring,splits", DECODE_CASES)
def test_decode_kernel_matches_reference(platform, T, heads, dtype, cache, window, ring, splits):
    q, k, v, scales = kernels.inputs(3, T, heads, 64, dtype, num_slots=S_DECODE, cache_dtype=cache)
    if ring:
        offsets = kernels.ring_offsets(S_DECODE)[2:5]  # just wrapped and steady state; each has a row at its start
    else:  # ragged rows, one of them with no live key for any query (start past them)
        offsets = [([0, 70, 150], 140), ([5, 159, 0], 156)]
    _check_kernel(platform, window, ring, q, k, v, scales, offsets,
                  decode_splits=(splits or {}).get(platform))


# (heads, dtype, cache, window): T = 20 queries (past the decode kernel's 16) over 40 slots.
PREFILL_CASES = [("gqa", "float32", "float32", None), ("gqa", "float32", "int8", 7), ("mqa", "bfloat16", "bfloat16", 9)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("heads,dtype,cache,window", PREFILL_CASES)
def test_prefill_kernel_matches_reference(platform, heads, dtype, cache, window):
    T = pallas.MAX_DECODE_QUERIES + 4
    q, k, v, scales = kernels.inputs(3, T, heads, 64, dtype, num_slots=40, cache_dtype=cache)
    # left padding of 0, 3 and T - 1 slots; a chunk after cached slots whose last row starts past every query
    _check_kernel(platform, window, False, q, k, v, scales, [([0, 3, T - 1], 0), ([0, 12, 40], 15)])


@functools.lru_cache(maxsize=None)
def _paged_kernel(platform, window, pages_per_block):
    def kernel(q, k, v, table, lengths, q_slots, sinks, *scales):
        ks, vs = scales or (None, None)
        return pallas.paged_attention(q, k, v, table, lengths, q_slots, scale=0.3, sliding_window=window,
                                      k_scale=ks, v_scale=vs, platform=platform, pages_per_block=pages_per_block,
                                      interpret=INTERPRET, sinks=sinks)

    return kernel


@functools.lru_cache(maxsize=None)
def _paged_reference(window, with_sinks=True):
    def ref(q, k, v, table, lengths, q_slots, sinks, *scales):
        ks, vs = scales or (None, None)
        return paged_reference.paged_attention(q, k, v, table, lengths, q_slots, scale=0.3, sliding_window=window,
                                               k_scale=ks, v_scale=vs, sinks=sinks if with_sinks else None)

    return ref


# (T, heads, q dtype, pool, page size, window, pages per block {platform: n}): decode and a verify's block of 3,
# float32 / int8 / bfloat16 pools, pages of 4 and 5 slots, groups of 1-3 pages (GPU: rounded up to 16 slots).
PAGED_KERNEL_CASES = [
    (1, "gqa", "float32", "float32", 4, None, {"tpu": 2, "gpu": 2}),
    (3, "gqa", "float32", "int8", 5, 6, {"tpu": 1, "gpu": 3}),
    (1, "mqa", "bfloat16", "bfloat16", 4, None, {"tpu": 3, "gpu": 1}),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("T,heads,dtype,pool,page_size,window,pages_per_block", PAGED_KERNEL_CASES)
def test_paged_kernel_matches_reference(platform, T, heads, dtype, pool, page_size, window, pages_per_block):
    """The paged kernel on a pool with NaN in every slot no query may read == the reference on the clean pool, on
    every query (length-0 rows and queries before slot 0 give 0); the GPU body over several splits too."""
    N, K = kernels.HEADS[heads]
    lengths = kernels.edge_lengths(page_size)[0]
    table, _, P = kernels.page_layout(lengths, page_size, 3)
    k, v, scales = kernels.page_pool(P, K, page_size, pool, np.random.default_rng(4))
    lengths = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(np.random.default_rng(5).normal(size=(len(lengths), T, N, k.shape[-1])), dtype)
    q_slots = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
    live = paged_reference.live_mask(lengths, q_slots, kernels.PAGES_PER_SEQUENCE * page_size, window)  # [B, T, S]
    read = np.zeros((P, page_size), bool)  # pool slots some query may read; NaN in the rest
    for b, s in zip(*np.nonzero(np.asarray(live.any(1)))):
        read[int(table[b, s // page_size]), s % page_size] = True
    bad = [kernels.poison(x, read) for x in (k, v, *scales)]
    sinks = _sinks(N)
    tol = TOLERANCES[jnp.dtype(dtype).name]
    out = np.asarray(kernels.run(_paged_kernel(platform, window, pages_per_block[platform]), q, *bad[:2], table,
                                 lengths, q_slots, sinks, *bad[2:]), np.float32)
    want = np.asarray(kernels.run(_paged_reference(window), q, k, v, table, lengths, q_slots, sinks, *scales),
                      np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **tol)
    seen = np.asarray(live.any(-1))
    assert seen.any() and not seen.all()
    np.testing.assert_array_equal(out[~seen], 0.0)
    _sinks_matter(want, kernels.run(_paged_reference(window, False), q, k, v, table, lengths, q_slots, sinks,
                                    *scales), seen, tol["atol"])


# --- the dispatch and the shard_map wrappers -----------------------------------------------------------------


def _contiguous_args(B, T, N, K, S, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, S, 32)), jnp.float32) for _ in range(2))
    # ragged left padding; the last row starts at the last slot: only the last query sees a key (the rest: 0)
    start = jnp.asarray(np.append(rng.integers(0, 8, size=B - 1), S - 1), jnp.int32)
    return q, k, v, start, jnp.int32(S - T)


def _paged_args(N, K, page_size=4):
    lengths = kernels.edge_lengths(page_size)[0]
    table, _, P = kernels.page_layout(lengths, page_size, 7)
    k, v, _ = kernels.page_pool(P, K, page_size, "float32", np.random.default_rng(8))
    lengths = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(np.random.default_rng(9).normal(size=(len(lengths), 1, N, k.shape[-1])), jnp.float32)
    return q, k, v, table, lengths, (lengths - 1)[:, None]


def test_dispatch_pallas_equals_xla():
    """`api.get(kind, "pallas")` takes sinks and equals `api.get(kind, "xla")` with them: contiguous decode and
    prefill, paged decode (default platform and blocks)."""
    sinks = _sinks(8)
    tol = TOLERANCES["float32"]
    for T in (1, pallas.MAX_DECODE_QUERIES + 2):
        args = _contiguous_args(2, T, 8, 2, 48, T)
        got, want = (api.get("contiguous", impl)(*args, scale=0.2, sliding_window=30, sinks=sinks)
                     for impl in ("pallas", "xla"))
        np.testing.assert_allclose(got, want, **tol, err_msg=f"T={T}")
        _sinks_matter(want, api.get("contiguous", "xla")(*args, scale=0.2, sliding_window=30), slice(None),
                      tol["atol"])
    args = _paged_args(8, 2)
    got, want = (api.get("paged", impl)(*args, scale=0.3, sinks=sinks) for impl in ("pallas", "xla"))
    np.testing.assert_allclose(got, want, **tol)


def _mesh(data, model):
    return Mesh(np.array(jax.devices()[:data * model]).reshape(data, model), sharding.AXES)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py's host devices on CPU)")
def test_sharded_wrappers_pass_each_shard_its_heads_sinks():
    """On a (2, 4) mesh (data x model; a (1, 4) one for the paged pools, as a paged cache requires), the shard_map
    wrappers split the sinks over "model" with q's heads: the XLA reference wrapped equals it unwrapped (to float32
    rounding), and the Pallas kernels through `api.get(kind, "pallas", mesh=)` equal the unsharded reference."""
    N, K = 8, 4  # 2 query heads per shard, one KV head each
    sinks = _sinks(N)
    tol = TOLERANCES["float32"]
    mesh = _mesh(2, 4)
    for T in (1, pallas.MAX_DECODE_QUERIES + 2):
        args = _contiguous_args(4, T, N, K, 48, T)
        kw = dict(scale=0.2, sliding_window=30, sinks=sinks)
        want = np.asarray(reference.attention(*args, **kw))
        wrapped = jax.jit(functools.partial(sharding.shard_attention(reference.attention, mesh), **kw))
        np.testing.assert_allclose(wrapped(*args), want, atol=1e-6, rtol=1e-6)  # the same math per head
        got = jax.jit(functools.partial(api.get("contiguous", "pallas", mesh=mesh), **kw))(*args)
        np.testing.assert_allclose(got, want, **tol, err_msg=f"T={T}")
        _sinks_matter(want, reference.attention(*args, scale=0.2, sliding_window=30), slice(None), tol["atol"])
    mesh = _mesh(1, 4)
    args = _paged_args(N, K)
    want = np.asarray(paged_reference.paged_attention(*args, scale=0.3, sinks=sinks))
    wrapped = jax.jit(functools.partial(sharding.shard_paged_attention(paged_reference.paged_attention, mesh),
                                        scale=0.3, sinks=sinks))
    np.testing.assert_allclose(wrapped(*args), want, atol=1e-6, rtol=1e-6)
    got = jax.jit(functools.partial(api.get("paged", "pallas", mesh=mesh), scale=0.3, sinks=sinks))(*args)
    np.testing.assert_allclose(got, want, **tol)


# --- lowering for real hardware without the hardware ---------------------------------------------------------


@pytest.mark.parametrize("kind,T", [("contiguous", 64), ("paged", 1), ("paged", 5)])
@pytest.mark.parametrize("platform,lowering_platform,custom_call",
                         [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_for_device_with_sinks(platform, lowering_platform, custom_call, kind, T):
    """The kernels that take the sinks as an input (prefill; the paged TPU body, and its GPU body for symmetry)
    lower to Mosaic / Triton IR from any host with them (block-shape rules of the new [1, 1] and [R, 1] blocks),
    with an int8 cache's scales."""
    B, N, K, H = 2, 8, 2, 128
    if kind == "contiguous":
        S = 1000
        shapes = [((B, T, N, H), jnp.bfloat16), ((B, K, S, H), jnp.int8), ((B, K, S, H), jnp.int8),
                  ((B,), jnp.int32), ((), jnp.int32), ((N,), jnp.float32), ((B, K, S), jnp.float32),
                  ((B, K, S), jnp.float32)]

        def target(q, k, v, start, q_offset, sinks, k_scale, v_scale):
            return pallas.attention(q, k, v, start, q_offset, scale=0.125, sliding_window=256, k_scale=k_scale,
                                    v_scale=v_scale, platform=platform, interpret=False, sinks=sinks)
    else:
        P, ps, M = 64, 5, 8
        shapes = [((B, T, N, H), jnp.bfloat16), ((P, K, ps, H), jnp.int8), ((P, K, ps, H), jnp.int8),
                  ((B, M), jnp.int32), ((B,), jnp.int32), ((N,), jnp.float32), ((P, K, ps), jnp.float32),
                  ((P, K, ps), jnp.float32)]

        def target(q, k, v, table, lengths, sinks, k_scale, v_scale):
            return pk.paged_decode_attention(q, k, v, table, lengths, scale=0.3, sliding_window=48, k_scale=k_scale,
                                             v_scale=v_scale, platform=platform, interpret=False, sinks=sinks)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    text = lowered_text(jax.jit(target), args, lowering_platform)
    assert f"stablehlo.custom_call @{custom_call}" in text
