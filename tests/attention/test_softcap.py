"""Attention-logit soft-capping (Gemma 2's `softcap`) in every GQA attention implementation, and the per-layer
window combinations a Gemma 3 model asks of the Pallas kernels (global layers: no window over the whole cache; local
layers: a window over a ring of that many slots).

The spec is transformers' Gemma2: s = (q . k) * scale, then softcap * tanh(s / softcap) in float32, then the mask,
then the softmax. Checked by hand (numpy) against the XLA reference, then every Pallas kernel (interpreted on CPU,
both bodies, as tests/test_pallas_attention.py and tests/test_paged_kernel.py run them) and every paged XLA form
against the reference. A cap of 2.0 changes the outputs far beyond the tolerances (asserted where it is used); 50.0
is Gemma 2's value. Start slots, q_offset, lengths and page tables are traced: each configuration compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import pallas, paged_reference, reference

# From helpers.kernels: run, compiled once per argument shapes (XLA:CPU optimisation level 0); TOLERANCES keyed by
# q's dtype, with their reasons in helpers.tolerances (capping is elementwise with a derivative <= 1: it does not
# widen them); inputs: q, k, v (and scales of a quantized cache) from one seed; ring_offsets: fresh, just-wrapped and
# steady-state ring (start, q_offset)s; page_layout: page tables whose rows share pages, with every slot no row may
# read marked; page_pool: float or quantized pools of head dim 32; poison: NaN in those slots; edge_lengths: 0, 1,
# page - 1, page, page + 1, the whole table.
from helpers import kernels
from helpers.kernels import BLOCKS, INTERPRET, PLATFORMS, TOLERANCES, lowered_text

SCALE = 0.125  # with head dim 64 and unit normals the scores are O(1): a cap of 2.0 bends the larger ones a lot


def _assert_close(out, want, live, dtype):
    """Rows with a live key match; rows without one are 0 in the kernels (the reference's are unspecified)."""
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all(), "non-finite output"
    np.testing.assert_array_equal(out[~live], 0.0)
    assert live.any()
    np.testing.assert_allclose(out[live], want[live], **TOLERANCES[jnp.dtype(dtype).name])


def _assert_cap_matters(capped, uncapped, live, dtype):
    """The capped and uncapped results differ by far more than the tolerance: a kernel that ignored `softcap`
    would fail the comparison."""
    diff = np.abs(np.asarray(capped, np.float32) - np.asarray(uncapped, np.float32))[live].max()
    assert diff > 10 * TOLERANCES[jnp.dtype(dtype).name]["atol"], diff


# --- the reference, by hand ----------------------------------------------------------------------------------


def _by_hand(q, k, v, live, scale, softcap, cap_masked=False):
    """float64 numpy: q [B, T, N, H], k, v [B, K, S, H], live bool[B, T, S] -> [B, T, N, H]. Dead slots get
    probability exactly 0 (their keys may be NaN: selected away, never computed with). `cap_masked`: the wrong
    order, masking with reference.MASKED first and capping that too (dead slots then score -softcap)."""
    B, T, N, H = q.shape
    K = k.shape[1]
    kk = np.repeat(np.asarray(k, np.float64), N // K, axis=1)  # [B, N, S, H]: query head n reads KV head n // G
    vv = np.repeat(np.asarray(v, np.float64), N // K, axis=1)
    s = np.einsum("btnh,bnsh->bnts", np.asarray(q, np.float64), np.nan_to_num(kk)) * scale
    if cap_masked:
        s = np.where(live[:, None], s, reference.MASKED)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if not cap_masked:
        s = np.where(live[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsh->btnh", p, vv)


def test_reference_by_hand():
    """A tiny case (scores up to ~8, cap 2): the decode path, the prefix switch over a longer cache, and a T = 2
    chunk (the einsum path) all equal softmax(cap * tanh(s / cap)) @ v with dead slots (NaN keys) masked. Capping
    after the mask, or not at all, is off by far more than the tolerance."""
    rng = np.random.default_rng(0)
    B, N, K, H, cap = 2, 4, 2, 8, 2.0
    for S in (6, 400):  # 400 slots: `attention` decodes through its live-prefix switch (prefixes 256 and 400)
        q = rng.normal(size=(B, 2, N, H)).astype(np.float32) * 2
        k, v = (rng.normal(size=(B, K, S, H)).astype(np.float32) for _ in range(2))
        start = np.array([0, 2], np.int32)
        k[1, :, :2] = np.nan  # row 1's left padding: dead keys may hold anything
        k[:, :, 5:] = np.nan  # the future
        for T, q_offset in ((1, 4), (2, 3)):
            qt = q[:, :T]
            live = np.asarray(reference.live_mask(jnp.asarray(start), q_offset, T, S))
            want = _by_hand(qt, k, v, live, 1.0, cap)
            args = (jnp.asarray(qt), jnp.asarray(k), jnp.asarray(v), jnp.asarray(start), jnp.int32(q_offset))
            for fn in (reference.attention, reference.full_attention):
                out = np.asarray(fn(*args, scale=1.0, softcap=cap))
                np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5, err_msg=f"{fn.__name__} S={S} T={T}")
            assert np.abs(want - _by_hand(qt, k, v, live, 1.0, None)).max() > 0.1  # the cap changes this case
            # Capping the masked score too (tanh(MASKED) * cap = -cap: dead slots get real weight) would not pass.
            assert np.abs(want - _by_hand(qt, k, v, live, 1.0, cap, cap_masked=True)).max() > 1e-3


def test_softcap_none_is_the_uncapped_program():
    """softcap=None traces exactly the program without the argument (no tanh anywhere, the same jaxpr), for the
    reference, every paged form and every Pallas kernel; a cap puts a tanh in each. Bad caps are refused."""
    q1, k, v, _ = kernels.inputs(1, 1, "gqa", 32, "float32", num_slots=40)
    q4 = jnp.concatenate([q1] * 4, axis=1)
    start, q_offset = jnp.zeros((1,), jnp.int32), jnp.int32(20)
    table, _, P = kernels.page_layout([9, 3], 4, 0)
    kp, vp, _ = kernels.page_pool(P, 2, 4, "float32", np.random.default_rng(0))
    qp, lengths = jnp.concatenate([q1] * 2)[..., :32], jnp.asarray([9, 3], jnp.int32)
    paged = (qp, kp, vp, table, lengths, (lengths - 1)[:, None])
    fns = [functools.partial(reference.attention, q1, k, v, start, q_offset),
           functools.partial(reference.full_attention, q4, k, v, start, q_offset),
           functools.partial(pallas.attention, q1, k, v, start, q_offset, interpret=True),
           functools.partial(pallas.attention, q4, k, v, start, q_offset, interpret=True),
           functools.partial(pallas.paged_attention, *paged, interpret=True),
           functools.partial(pallas.paged_attention, *paged, interpret=True, platform="gpu"),
           *(functools.partial(f, *paged) for f in (paged_reference.paged_attention, paged_reference.pool_attention,
                                                     paged_reference.live_paged_attention,
                                                     paged_reference.ragged_paged_attention))]
    for fn in fns:
        plain = str(jax.make_jaxpr(functools.partial(fn, scale=SCALE, sliding_window=16))())
        assert str(jax.make_jaxpr(functools.partial(fn, scale=SCALE, sliding_window=16, softcap=None))()) == plain
        assert "tanh" not in plain
        assert "tanh" in str(jax.make_jaxpr(functools.partial(fn, scale=SCALE, sliding_window=16, softcap=50.0))())
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(ValueError, match="softcap"):
            fns[0](scale=SCALE, softcap=bad)
        with pytest.raises(ValueError, match="softcap"):
            fns[2](scale=SCALE, softcap=bad)


# --- Pallas decode (T == 1) ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _kernel(platform, window, ring, softcap, **knobs):
    def kernel(q, k, v, start, q_offset, *scales):
        ks, vs = scales or (None, None)
        return pallas.attention(q, k, v, start, q_offset, scale=SCALE, sliding_window=window, k_scale=ks, v_scale=vs,
                                ring=ring, softcap=softcap, platform=platform, interpret=INTERPRET,
                                **{**BLOCKS[platform], **knobs})

    return kernel


@functools.lru_cache(maxsize=None)
def _reference(window, ring, softcap):
    def ref(q, k, v, start, q_offset, *scales):
        ks, vs = scales or (None, None)
        return reference.attention(q, k, v, start, q_offset, scale=SCALE, sliding_window=window, k_scale=ks,
                                   v_scale=vs, ring=ring, softcap=softcap)

    return ref


def _check(platform, window, ring, softcap, q, k, v, scales, start, q_offset, *, clean=None, **knobs):
    """Kernel == reference (the reference on `clean` (k, v) when k, v are poisoned); returns (reference, live)."""
    start, q_offset = jnp.asarray(start, jnp.int32), jnp.int32(q_offset)
    out = kernels.run(_kernel(platform, window, ring, softcap, **knobs), q, k, v, start, q_offset, *scales)
    want = kernels.run(_reference(window, ring, softcap), q, *(clean or (k, v)), start, q_offset, *scales)
    live = np.asarray(reference.live_mask(start, q_offset, q.shape[1], k.shape[2], window, ring).any(-1))  # [B, T]
    _assert_close(out, want, live, q.dtype)
    if softcap == 2.0:
        uncapped = kernels.run(_reference(window, ring, None), q, *(clean or (k, v)), start, q_offset, *scales)
        _assert_cap_matters(want, uncapped, live, q.dtype)
    return want, live


S, S_RING = 300, 200  # as tests/test_pallas_attention.py: not multiples of the blocks

# (cache dtype, q dtype, window, ring, softcap, splits). Rings are S_RING = window slots. Every cache dtype meets the
# cap of 2.0 (the one that moves the outputs), with and without a ring, splits 1-3. The cap is elementwise on the
# scores, before the mask: it does not interact with the cache's format or layout, whose uncapped kernels are
# tests/attention/test_pallas.py's (decode and ring cases). Dropped as duplicates: bfloat16 under a window of 50
# with cap 50 (bfloat16 meets the cap in the ring case; cap 50 is in the prefill and paged cases) and an int8 ring
# with cap 50 (int8 meets the cap below, the int8 ring is test_pallas.py's).
DECODE_CASES = [
    ("float32", "float32", None, False, 2.0, None),
    ("int8", "float32", 50, False, 2.0, 3),
    ("float32", "float32", S_RING, True, 2.0, None),
    ("bfloat16", "bfloat16", S_RING, True, 2.0, 3),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("cache_dtype,dtype,window,ring,softcap,splits", DECODE_CASES)
def test_decode_matches_reference(platform, cache_dtype, dtype, window, ring, softcap, splits):
    num_slots = S_RING if ring else S
    q, k, v, scales = kernels.inputs(3, 1, "gqa", 64, dtype, num_slots=num_slots, cache_dtype=cache_dtype, seed=1)
    check = functools.partial(_check, platform, window, ring, softcap, q, k, v, scales, decode_splits=splits)
    if ring:
        for start, q_offset in kernels.ring_offsets(num_slots):  # fresh, wrapped once, wrapped three times; ragged
            check(start, q_offset)
        return
    bk = BLOCKS[platform]["decode_block_k"]
    for q_offset in (bk + 7, S - 1):  # ragged left padding: 1 live slot, a block's worth, everything
        check(q_offset + 1 - np.array([1, bk, q_offset + 1]), q_offset)
    _, live = check([0, bk + 1, 5], bk)  # row 1: no live slot at all
    assert not live[1].any()
    if cache_dtype == "float32":  # NaN keys and values in every dead slot (left padding, the future) cannot leak
        start, q_offset = np.array([37, 0, 150]), 200
        dead = (np.arange(S)[None, :] < start[:, None]) | (np.arange(S)[None, :] > q_offset)
        poison = jnp.asarray(dead)[:, None, :, None]
        _check(platform, window, ring, softcap, q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v),
               scales, start, q_offset, clean=(k, v), decode_splits=splits)


# --- Pallas prefill (T > 1) ----------------------------------------------------------------------------------

# (heads, cache dtype, q dtype, T, slots, window, softcap, q_offsets): prompts longer than the window, over their
# own fresh K/V (T = S, q_offset 0, as generate's prefill) and a chunk over an int8 cache after cached slots.
# (The windowless float32 prompt is test_pallas.py's uncapped prefill case; capping is the same with or without a
# window: dropped here.)
PREFILL_CASES = [
    ("gqa", "float32", "float32", 37, 37, 16, 2.0, (0,)),
    ("mqa", "bfloat16", "bfloat16", 40, 40, 7, 50.0, (0,)),
    ("gqa", "int8", "float32", 33, 100, 17, 2.0, (0, 60)),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("heads,cache_dtype,dtype,T,num_slots,window,softcap,q_offsets", PREFILL_CASES)
def test_prefill_matches_reference(platform, heads, cache_dtype, dtype, T, num_slots, window, softcap, q_offsets):
    q, k, v, scales = kernels.inputs(3, T, heads, 64, dtype, num_slots=num_slots, cache_dtype=cache_dtype, seed=2)
    for q_offset in q_offsets:
        # Ragged left padding: none, a little, only the last query real; then a row with no real token at all.
        for start in ([0, 3, q_offset + T - 1], [q_offset + T, 0, q_offset + 20]):
            _check(platform, window, False, softcap, q, k, v, scales, np.array(start), q_offset)


# --- paged -----------------------------------------------------------------------------------------------------

# (page size, (N, K), q dtype, pool dtype, window, softcap): the batch mixes the edge lengths (0, 1, page - 1, page,
# page + 1, the whole table); rows share pages; every slot no row may read holds NaN (values, and scales of the int8
# pool).
# (Dropped: pages of 8 of a bfloat16 MQA pool with a window of 11 and cap 50, 7 programs for a cap that barely
# moves the outputs: the bfloat16 and MQA pools are tests/attention/test_paged_decode_kernel.py's and test_sinks.py's
# paged kernel cases, cap 50 is the prefill case's, and the capped paged path is the same for any cap.)
PAGED_CASES = [
    (4, (8, 2), "float32", "float32", None, 2.0),
    (5, (8, 2), "float32", "int8", 3, 2.0),
]


def _scales_positional(form):
    """form(q, k, v, table, lengths, q_slots, k_scale=..., v_scale=...) taking the scales positionally (`_run`
    passes arrays only), built once per form so that `_run` compiles it once."""
    def run(q, k, v, table, lengths, q_slots, *scales):
        return form(q, k, v, table, lengths, q_slots, **dict(zip(("k_scale", "v_scale"), scales)))

    return run


@pytest.mark.parametrize("page_size,heads,dtype,pool_dtype,window,softcap", PAGED_CASES)
def test_paged_matches_reference(page_size, heads, dtype, pool_dtype, window, softcap):
    """pallas.paged_attention (both bodies) and the pool, live-prefix and ragged XLA forms on the poisoned pool ==
    paged_reference.paged_attention on the clean one, for every row with a live slot (a length-0 row is
    unspecified: the Pallas kernel returns 0, the pool form an average of other rows' values)."""
    (N, K), kw = heads, dict(scale=0.3, sliding_window=window, softcap=softcap)
    q = jnp.asarray(np.random.default_rng(7).normal(size=(6, 1, N, 32)), dtype)
    forms = {f"pallas-{p}": functools.partial(pallas.paged_attention, platform=p, interpret=INTERPRET, **kw)
             for p in PLATFORMS}
    forms |= dict(pool=functools.partial(paged_reference.pool_attention, **kw),
                  live=functools.partial(paged_reference.live_paged_attention, min_prefix=8, **kw),  # several branches
                  ragged=functools.partial(paged_reference.ragged_paged_attention, min_prefix=8, **kw))
    forms = {name: _scales_positional(form) for name, form in forms.items()}
    expected = _scales_positional(functools.partial(paged_reference.paged_attention, **kw))
    uncapped = _scales_positional(functools.partial(paged_reference.paged_attention, **{**kw, "softcap": None}))
    for seed, lengths in enumerate(kernels.edge_lengths(page_size)[:1]):  # one layout: each compiles for its pool size
        table, live, P = kernels.page_layout(lengths, page_size, seed)
        k, v, scales = kernels.page_pool(P, K, page_size, pool_dtype, np.random.default_rng(seed + 1))
        lengths = jnp.asarray(lengths, jnp.int32)
        args = (table, lengths, (lengths - 1)[:, None])
        want = kernels.run(expected, q, k, v, *args, *scales)
        bad = [kernels.poison(x, live) for x in (k, v, *scales)]
        has_live = np.asarray(lengths)[:, None] > 0  # [B, T = 1]
        for name, form in forms.items():
            out = np.asarray(kernels.run(form, q, *bad[:2], *args, *bad[2:]), np.float32)
            assert np.isfinite(out).all(), name
            np.testing.assert_allclose(out[has_live], np.asarray(want, np.float32)[has_live],
                                       **TOLERANCES[jnp.dtype(dtype).name], err_msg=f"{name} lengths={lengths}")
        if softcap == 2.0:
            _assert_cap_matters(want, kernels.run(uncapped, q, k, v, *args, *scales), has_live, dtype)


# --- per-layer windows: a global layer and a local (ring) layer over the same sequence --------------------------


@pytest.mark.parametrize("platform", PLATFORMS)
def test_global_and_local_layers(platform):
    """The same q and per-slot K/V, decoded at a slot past several wraps of a w-slot ring, as Gemma 3's layers
    see them: the whole cache with no window (global), and a window of w over a ring of w slots (local); also the
    window over the whole cache and the ring with no window (its own bound is the window). Pallas == XLA for each;
    the three local forms agree with each other and differ from the global one."""
    w, capacity, softcap = 24, 5 * 24, 2.0
    q, k_all, v_all, _ = kernels.inputs(3, 1, "gqa", 64, "float32", num_slots=capacity, seed=3)
    for q_offset in (3 * w + 5, 5 * w - 1):
        start = np.array([0, q_offset - w - 3, q_offset - 5])  # all, a window's worth and more, 6 slots
        future = jnp.asarray(np.arange(capacity) > q_offset)[None, None, :, None]
        k_full, v_full = (jnp.where(future, jnp.nan, x) for x in (k_all, v_all))  # never written yet
        # The ring: index i holds the latest slot s <= q_offset with s mod w == i (`reference` module docstring).
        held = q_offset - (q_offset - np.arange(w)) % w
        k_ring, v_ring = k_all[:, :, held], v_all[:, :, held]
        local = []
        for (window, ring), (k, v) in {(None, False): (k_full, v_full), (w, True): (k_ring, v_ring),
                                       (w, False): (k_full, v_full), (None, True): (k_ring, v_ring)}.items():
            clean = (k_all, v_all) if not ring else None  # the spec's dead values must be finite
            want, live = _check(platform, window, ring, softcap, q, k, v, (), start, q_offset, clean=clean)
            assert live.all()
            if window is None and not ring:
                global_out = want
            else:
                local.append(np.asarray(want))
        for other in local[1:]:
            np.testing.assert_allclose(other, local[0], atol=1e-6, rtol=1e-6)
        assert np.abs(local[0] - np.asarray(global_out)).max() > 1e-2  # the window bites


# --- lowering for real hardware, capped --------------------------------------------------------------------------


@pytest.mark.parametrize("platform,lowering_platform,custom_call",
                         [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_capped_kernels_lower_for_device(platform, lowering_platform, custom_call):
    """tanh has a Mosaic and a Triton lowering rule: the capped decode (int8 ring), prefill and paged kernels lower
    (not compiled: no device here) as tests/test_pallas_attention.py's lowering tests do."""
    B, N, K, H, S = 2, 8, 2, 128, 256
    bf16, i8, f32, i32 = jnp.bfloat16, jnp.int8, jnp.float32, jnp.int32
    spec = jax.ShapeDtypeStruct
    common = dict(scale=SCALE, softcap=50.0, platform=platform, interpret=False)
    decode = functools.partial(pallas.attention, sliding_window=S, ring=True, **common)
    prefill = functools.partial(pallas.attention, sliding_window=S, **common)
    targets = [
        (lambda q, k, v, s, o, ks, vs: decode(q, k, v, s, o, k_scale=ks, v_scale=vs),
         [spec((B, 1, N, H), bf16), spec((B, K, S, H), i8), spec((B, K, S, H), i8), spec((B,), i32), spec((), i32),
          spec((B, K, S), f32), spec((B, K, S), f32)]),
        (prefill, [spec((B, 64, N, H), bf16), spec((B, K, 1000, H), bf16), spec((B, K, 1000, H), bf16),
                   spec((B,), i32), spec((), i32)]),
        (functools.partial(pallas.paged_attention, sliding_window=48, **common),
         [spec((B, 1, N, H), f32), spec((64, K, 16, H), f32), spec((64, K, 16, H), f32), spec((B, 8), i32),
          spec((B,), i32), spec((B, 1), i32)]),
    ]
    for fn, args in targets:
        text = lowered_text(jax.jit(fn), args, lowering_platform)
        assert f"stablehlo.custom_call @{custom_call}" in text
