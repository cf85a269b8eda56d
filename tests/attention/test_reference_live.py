"""Decode attention bounded by the live length: the prefix path equals the full masked formula (the spec), reads
only a prefix, and keeps the cache update in place."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from helpers.hlo import is_copy_of, is_whole_buffer_copy
from helpers.models import model_for
from helpers.tolerances import tolerance
from jaxkv.attention import reference

# The two paths do the same arithmetic on the same slots, summed over a different number of zero terms
# (helpers.tolerances).
ATOL, RTOL = (tolerance("live prefix")[k] for k in ("atol", "rtol"))
B, N, K, S, H = 2, 4, 2, 40, 16  # GQA 2:1; S is not a multiple of the prefix lengths' steps
MIN_PREFIX = 8  # prefixes (8, 12, 16, 24, 40): edges at 1, block - 1, block, block + 1, capacity


def _cache(cache_dtype, rng):
    """k, v [B, K, S, H] (and scales [B, K, S] for a quantized cache) of random numbers in `cache_dtype`."""
    k, v = (rng.normal(size=(B, K, S, H)).astype(np.float32) for _ in range(2))
    if cache_dtype in ("int8", "float8_e4m3fn"):
        top = 127.0 if cache_dtype == "int8" else 448.0
        k_scale, v_scale = (np.abs(x).max(-1) / top for x in (k, v))
        k, v = ((x / s[..., None]).round() if cache_dtype == "int8" else x / s[..., None]
                for x, s in ((k, k_scale), (v, v_scale)))
        return jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype), jnp.asarray(k_scale), jnp.asarray(v_scale)
    return jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype), None, None


def _poison_dead(k, v, k_scale, v_scale, start, q_offset, window, ring):
    """NaN in every dead key slot (and key scale); dead values zeroed as the cache write does for the full path."""
    live = np.asarray(reference.live_mask(start, q_offset, 1, S, window, ring)[:, 0])[:, None, :, None]  # [B,1,S,1]
    k = jnp.where(live, k, jnp.asarray(np.nan, k.dtype)) if k.dtype != jnp.int8 else k
    v = jnp.where(live, v, jnp.zeros((), v.dtype))
    if k_scale is not None:
        k_scale = jnp.where(live[..., 0], k_scale, jnp.nan)
    return k, v, k_scale, v_scale


@functools.lru_cache(maxsize=None)
def _attend(min_prefix, window, ring):
    # q_offset and start are traced: one compile per variant, the prefix chosen at run time as in the decode loop.
    return jax.jit(functools.partial(reference.attention, scale=0.3, sliding_window=window, ring=ring,
                                     min_prefix=min_prefix))


VARIANTS = {  # name -> (cache dtype, sliding window, ring, start)
    "f32": ("float32", None, False, (0, 0)),
    "f32-left-padded": ("float32", None, False, (0, 5)),
    "bf16": ("bfloat16", None, False, (0, 3)),
    "f16": ("float16", None, False, (0, 3)),
    "int8": ("int8", None, False, (0, 3)),
    "fp8": ("float8_e4m3fn", None, False, (0, 3)),
    "sliding-window": ("float32", 10, False, (0, 3)),
    "ring": ("float32", 30, True, (0, 3)),
    "ring-int8": ("int8", S, True, (0, 2)),
}
# Live lengths (q_offset + 1) at every prefix edge, the capacity, and (rings) wrapped once and in steady state.
EDGES = [1, 7, 8, 9, 11, 12, 13, 16, 17, 24, 25, 39, 40]
RING_EDGES = EDGES + [41, 2 * S - 1, 2 * S, 3 * S + 5]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefix_path_equals_the_full_masked_formula(name):
    cache_dtype, window, ring, start = VARIANTS[name]
    rng = np.random.default_rng(sorted(VARIANTS).index(name))
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k0, v0, ks0, vs0 = _cache(cache_dtype, rng)
    start = jnp.asarray(start, jnp.int32)
    bounded, full = _attend(MIN_PREFIX, window, ring), _attend(None, window, ring)
    for live_len in RING_EDGES if ring else EDGES:
        q_offset = jnp.int32(live_len - 1)
        k, v, ks, vs = _poison_dead(k0, v0, ks0, vs0, start, q_offset, window, ring)
        got = np.asarray(bounded(q, k, v, start, q_offset, k_scale=ks, v_scale=vs))
        want = np.asarray(full(q, k, v, start, q_offset, k_scale=ks, v_scale=vs))
        rows = np.asarray(start) <= live_len - 1  # a row with no live key is uniform over different slot counts
        assert np.isfinite(got).all(), live_len
        np.testing.assert_allclose(got[rows], want[rows], atol=ATOL, rtol=RTOL, err_msg=f"live length {live_len}")


@pytest.mark.parametrize("live_len", [15, 38])  # prefix 16 (slot 15 dead), and the whole cache (slot 38, 39 dead)
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
def test_prefix_path_masks_dead_values_itself(cache_dtype, live_len):
    """Dead value slots (and value scales) may hold NaN: every branch of the prefix path masks them (so the cache
    write skips its zeroing pass), so it equals the spec on a cache whose dead values are zero."""
    assert reference.masks_dead_values(S, 1, MIN_PREFIX) and not reference.masks_dead_values(S, 2, MIN_PREFIX)
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k, v, ks, vs = _cache(cache_dtype, rng)
    start, q_offset = jnp.asarray([0, 4], jnp.int32), jnp.int32(live_len - 1)  # row 1's padding dead too
    live = np.asarray(reference.live_mask(start, q_offset, 1, S)[:, 0])[:, None, :, None]
    nan_v = v if v.dtype == jnp.int8 else jnp.where(live, v, jnp.asarray(np.nan, v.dtype))
    nan_vs = None if vs is None else jnp.where(live[..., 0], vs, jnp.nan)
    got = _attend(MIN_PREFIX, None, False)(q, k, nan_v, start, q_offset, k_scale=ks, v_scale=nan_vs)
    zero_v = jnp.where(live, v, jnp.zeros((), v.dtype))
    want = _attend(None, None, False)(q, k, zero_v, start, q_offset, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_prefix_lengths():
    assert reference.prefix_lengths(40, 8) == (8, 12, 16, 24, 40)
    assert reference.prefix_lengths(4160, 256) == (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4160)
    assert reference.prefix_lengths(144, 256) == (144,)  # a short cache: the full formula, no switch
    assert reference.prefix_lengths(4160, None) == (4160,)
    for capacity in (257, 320, 321, 1000, 4160, 10_000):
        lengths = reference.prefix_lengths(capacity, 256)
        assert lengths[-1] == capacity and list(lengths) == sorted(set(lengths))
        # Reading a prefix never costs more than 1.5x the slots needed (past the smallest prefix), or 1.25x of S.
        assert all(b <= 1.5 * a or b == capacity for a, b in zip(lengths, lengths[1:]))
        assert all(5 * n < 4 * capacity for n in lengths[:-1])


def test_decode_reads_only_a_prefix_of_the_cache():
    """The work follows the live length: the traced decode is a switch whose branches read the cache sliced to
    each prefix length."""
    q = jnp.zeros((1, 1, N, H))
    k = v = jnp.zeros((1, K, 4160, H))
    jaxpr = jax.make_jaxpr(functools.partial(reference.attention, scale=1.0))(q, k, v, jnp.zeros(1, jnp.int32),
                                                                             jnp.int32(3))
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1
    branches = conds[0].params["branches"]
    lengths = reference.prefix_lengths(4160)
    assert len(branches) == len(lengths)
    for n, branch in zip(lengths[:-1], branches):  # the last reads all S slots: no slice
        sliced = {tuple(e.outvars[0].aval.shape) for e in branch.jaxpr.eqns if e.primitive.name == "slice"}
        assert (1, K, n, H) in sliced, (n, sliced)


# A cache long enough for the default prefixes (256, 400): the decode loop runs the switch. Each batch size and each
# cache dtype is there (a batch of 1 with a float32 cache, a decode loop of its own, left out: its batch is the int8
# case's, its dtype the batch of 3's).
@pytest.mark.parametrize("batch, cache_dtype", [(3, "float32"), (1, "int8"), (3, "float16")])
def test_compiled_prefix_decode_never_copies_the_cache(batch, cache_dtype):
    """tests/test_cache.py's in-place check, with the cache passed through the prefix switch."""
    model = model_for("gqa")
    cfg = model.config
    capacity = 400
    assert len(reference.prefix_lengths(capacity)) > 1
    logits, cache = jaxkv.prefill(model.params, jnp.ones((batch, 4), jnp.int32), jnp.zeros(batch, jnp.int32),
                                  config=cfg, capacity=capacity, attention="xla", cache_dtype=cache_dtype)
    short = {"float32": "f32", "int8": "s8", "float16": "f16"}[cache_dtype]
    args = (model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.Sampler.make(), jnp.full((8,), -1))
    text = jaxkv.decode.lower(*args, config=cfg, steps=5, attention="xla").compile().as_text()
    assert f"= {short}[{batch},2,{capacity},16]" in text and " conditional(" in text
    scale_shape = f"[{batch},2,{capacity}]" if cache_dtype == "int8" else None
    copies = [ln.strip()[:120] for ln in text.splitlines()
              if is_whole_buffer_copy(ln, batch * 2 * capacity * 16) or (scale_shape and is_copy_of(ln, scale_shape))]
    assert not copies, copies[:3]


def test_cached_decode_through_the_prefix_switch_equals_recompute():
    """The whole model with a cache long enough for the switch: cached step logits equal the recompute."""
    model = model_for("gqa")
    cfg = model.config
    prompts = [[7, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    tokens, start = jnp.asarray([[0] * 9 + prompts[0], prompts[1]], jnp.int32), jnp.asarray([9, 0], jnp.int32)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=cfg, capacity=400, attention="xla")
    got, seqs = [], [list(p) for p in prompts]
    for _ in range(12):
        got.append(np.asarray(logits))
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        for b in range(2):
            seqs[b].append(int(nxt[b]))
        logits, cache = jaxkv.decode_step(model.params, nxt, cache, config=cfg)
    for b, prompt in enumerate(prompts):
        full = jaxkv.logits(model, [seqs[b][:-1]])[0]
        np.testing.assert_allclose(np.stack(got)[:, b], full[len(prompt) - 1:], atol=1e-5, rtol=0,
                                   err_msg=f"row {b}")
