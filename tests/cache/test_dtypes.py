"""Quantized and 16-bit KV caches, and the sliding-window ring cache: what is stored, what attention reads, what
it costs in accuracy, and that the memory planner predicts the allocated bytes exactly."""

import dataclasses
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import reference
from jaxkv.cache import CACHE_DTYPES, quantize
from jaxkv.cache.planner import plan_cache
from helpers.models import CONFIGS, model_for, left_pad

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def test_quantize_round_trip_error_is_bounded():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 50, 64)) * jnp.exp(jax.random.normal(
        jax.random.PRNGKey(1), (2, 3, 50, 1)))  # per-token magnitudes spread over orders of magnitude
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    for dtype in ["int8", "float8_e4m3fn"]:
        q, scale = quantize(x, dtype)
        assert q.dtype == jnp.dtype(dtype) and scale.shape == (2, 3, 50) and scale.dtype == jnp.float32
        err = jnp.abs(q.astype(jnp.float32) * scale[..., None] - x)
        if dtype == "int8":  # rounding to the nearest step of amax / 127: at most half a step
            assert float(jnp.max(err / amax)) <= 0.5 / 127 + 1e-6
        else:  # 3 mantissa bits: at most 2^-4 of the value in the normal range; below it (|x| < 2^-6 steps of
            # amax / 448) the subnormal spacing 2^-9 of amax / 448 applies
            assert bool(jnp.all(err <= 2.0 ** -4 * jnp.abs(x) + 2.0 ** -10 * amax / 448 + 1e-7))
    zeros = quantize(jnp.zeros((1, 1, 2, 4)), "int8")
    assert not jnp.any(zeros[0]) and not jnp.any(zeros[1])  # all-zero token: scale 0, no 0/0


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("T", [1, 5])
def test_reference_reads_a_quantized_cache_as_its_dequantized_values(dtype, T):
    """Attention over (values, scales) equals attention over the dequantized float cache: the scales are applied
    to what is read, nothing else changes."""
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    B, K, N, S, H = 2, 2, 4, 24, 16
    q = jax.random.normal(keys[0], (B, T, N, H))
    k, ks = quantize(jax.random.normal(keys[1], (B, K, S, H)), dtype)
    v, vs = quantize(jax.random.normal(keys[2], (B, K, S, H)), dtype)
    start, q_offset = jnp.array([0, 3]), jnp.int32(S - T)
    got = reference.attention(q, k, v, start, q_offset, scale=0.25, k_scale=ks, v_scale=vs)
    want = reference.attention(q, reference.dequantize(k, ks), reference.dequantize(v, vs), start, q_offset,
                               scale=0.25)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def _allocated_cache(model, prompts, max_new_tokens, cache_dtype):
    """The cache generate allocates for these arguments (same planning, same prefill)."""
    plan = plan_cache(model.config, [len(p) for p in prompts], max_new_tokens)
    batch, T, capacity, ring = plan.padded_batch, plan.prompt_len, plan.capacity, plan.ring
    tokens = np.zeros((batch, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, T - len(p):] = p[-T:]
    start = np.array([max(T - len(p), 0) for p in prompts] + [T - 1] * (batch - len(prompts)), np.int32)
    # Shapes and dtypes only: traced, not compiled or run (the bytes are all this needs).
    _, cache = jax.eval_shape(
        lambda params, tokens, start: jaxkv.prefill(params, tokens, start, config=model.config, capacity=capacity,
                                                    attention="xla", cache_dtype=cache_dtype, ring=ring),
        model.params, jnp.asarray(tokens), jnp.asarray(start))
    return cache, batch, capacity


def _engine_prompts():
    """27, 20 and 8 tokens: prompts whose greedy tokens differed between the engine and generate over a quantized
    cache before issue 27 (16) was fixed (test_engine_with_a_quantized_cache_equals_generate)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 97, int(n)).tolist() for n in rng.integers(3, 40, 24)]
    return [prompts[i] for i in (0, 4, 18)]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("name", ["gqa", "sliding"])
def test_the_planner_is_the_truth(name, cache_dtype):
    """The bytes of the cache generate allocates (keys, values and scales: every leaf but the two bookkeeping
    integers start and length) equal jaxkv.kv_cache_bytes, for each cache dtype and for the sliding-window ring."""
    model = model_for(name)
    # The shapes of generate calls elsewhere in this file, so the runs below compile nothing of their own: the
    # plain model's int8 run is test_engine_with_a_quantized_cache_equals_generate[int8]'s reference, the ring's
    # float32 run test_ring_cache_decode_equals_recompute_far_past_the_window[5]'s.
    prompts, new = (_engine_prompts(), 8) if name == "gqa" else ([[3, 1, 4, 1, 5], [9, 2, 6]], 40)
    cache, batch, capacity = _allocated_cache(model, prompts, new, cache_dtype)
    leaves = [*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales]
    assert len(jax.tree_util.tree_leaves(cache)) == len(leaves) + 2  # + start, length
    allocated = sum(a.size * a.dtype.itemsize for a in leaves)
    # generate rounds a plain cache's capacity up to a multiple of 64: plan for what it allocates. A ring caps the
    # slots at the window whatever the length, so any long sequence plans the same bytes.
    tokens = capacity if name == "gqa" else 10_000
    assert allocated == jaxkv.kv_cache_bytes(model.config, tokens=tokens, batch=batch, cache_dtype=cache_dtype)
    # One quantized run of the plain cache and one unquantized run of the ring (each compiled for seconds when
    # both models ran both dtypes; the other two runs checked what these do).
    if (name, cache_dtype) in (("gqa", "int8"), ("sliding", "float32")):
        gen = jaxkv.generate(model, prompts, max_new_tokens=new, cache_dtype=cache_dtype, stop_tokens=[])
        assert gen.stats["kv_cache_bytes"] == allocated
    assert all(a.dtype == jnp.dtype(cache_dtype) for a in (*cache.keys, *cache.values))
    if name == "sliding":
        assert cache.ring and capacity == model.config.sliding_window


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_decode_through_a_low_precision_cache_tracks_the_float_one(cache_dtype):
    """Step logits over a low-precision cache stay close to the float32 cache's (the error is the cache
    rounding only: bf16 keeps 8 mantissa bits, int8 a step of amax/127 per token, fp8 3 mantissa bits)."""
    model = model_for("gqa")
    prompts = [[5, 17, 3, 88, 41, 9, 60], [2, 7]]
    ref = _step_logits(model, prompts, "float32")
    got = _step_logits(model, prompts, cache_dtype)
    scale = np.abs(ref).max()
    tolerance = {"bfloat16": 0.02, "int8": 0.02, "float8_e4m3fn": 0.1}[cache_dtype]
    assert np.abs(got - ref).max() <= tolerance * scale, np.abs(got - ref).max() / scale
    assert np.abs(got - ref).max() > 0  # the cache really is in the low-precision dtype


def _step_logits(model, prompts, cache_dtype, steps=12):
    tokens, start = left_pad(prompts)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=model.config,
                                  capacity=32, attention="xla", cache_dtype=cache_dtype)
    out = []
    for i in range(steps):
        out.append(np.asarray(logits))
        feed = jnp.full((len(prompts),), (7 * i + 3) % model.config.vocab_size, jnp.int32)  # same feed for all
        logits, cache = jaxkv.decode_step(model.params, feed, cache, config=model.config, attention="xla")
    return np.stack(out, 1)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_nan_in_dead_slots_of_a_quantized_cache_cannot_poison_real_rows(cache_dtype):
    model = model_for("gqa")
    prompts = [[5, 17, 3, 88, 41, 9, 60], [2, 7]]
    T = 7
    tokens = np.zeros((2, T), np.int32)
    start = np.array([0, 5], np.int32)
    tokens[0], tokens[1, 5:] = prompts[0], prompts[1]

    def run(poison):
        logits, cache = jaxkv.prefill(model.params, jnp.asarray(tokens), jnp.asarray(start), config=model.config,
                                      capacity=32, attention="xla", cache_dtype=cache_dtype)
        if poison:
            slot = jnp.arange(cache.capacity)
            dead = (slot[None, :] < cache.start[:, None]) | (slot[None, :] >= cache.length)
            nan_v = lambda a: jnp.where(dead[:, None, :, None], jnp.asarray(jnp.nan, a.dtype) if a.dtype != jnp.int8
                                        else jnp.int8(127), a)  # noqa: E731  (int8 has no NaN: its largest value)
            nan_s = lambda a: jnp.where(dead[:, None, :], jnp.nan, a)  # noqa: E731
            cache = dataclasses.replace(cache, keys=tuple(map(nan_v, cache.keys)),
                                        values=tuple(map(nan_v, cache.values)),
                                        key_scales=tuple(map(nan_s, cache.key_scales)),
                                        value_scales=tuple(map(nan_s, cache.value_scales)))
        out = []
        for i in range(6):
            out.append(np.asarray(logits))
            logits, cache = jaxkv.decode_step(model.params, jnp.argmax(logits, -1).astype(jnp.int32), cache,
                                              config=model.config, attention="xla")
        return np.stack(out)

    clean, poisoned = run(False), run(True)
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(poisoned, clean)


def test_bad_cache_dtype_is_refused_before_compute():
    model = model_for("gqa")
    for bad in ["int4", "float64", "", object()]:
        with pytest.raises(ValueError, match="cache_dtype must be one of"):
            jaxkv.generate(model, [[1, 2]], max_new_tokens=2, cache_dtype=bad)


# --- the ring cache ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [5, 20])  # shorter and longer than the ring (window 8 slots)
def test_ring_cache_decode_equals_recompute_far_past_the_window(prompt_len):
    """A sliding-window model's ring cache of `window` slots: 40 steps (5 wraps) of cached logits equal the
    no-cache recompute with the window mask, for a ragged batch (one prompt longer than the ring)."""
    model = model_for("sliding")
    window = model.config.sliding_window
    prompts = [list(range(3, 3 + prompt_len)), [11, 12, 13]]
    gen = jaxkv.generate(model, prompts, max_new_tokens=40, stop_tokens=[])
    assert gen.stats["cache_ring"] and gen.stats["cache_capacity"] == window
    # The no-cache recompute, both rows in one call right-padded to 64 tokens (one compiled shape for both cases):
    # causal, so the padding after a row's tokens changes none of their logits.
    rows = [p + gen.tokens[b] for b, p in enumerate(prompts)]
    recompute = jaxkv.logits(model, [row + [0] * (64 - len(row)) for row in rows])
    for b, p in enumerate(prompts):
        full_logits = recompute[b, :len(rows[b])]
        np.testing.assert_array_equal(gen.tokens[b], np.argmax(full_logits[len(p) - 1:-1], -1))
    # And the step logits themselves.
    tokens, start = left_pad(prompts, 32)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=model.config,
                                  capacity=window, attention="xla", ring=True)
    # Causal: position t of the full recompute sees exactly the tokens a cached step at t has seen.
    full = [recompute[b, len(p) - 1:len(rows[b])] for b, p in enumerate(prompts)]
    for i in range(40):
        for b in range(len(prompts)):
            np.testing.assert_allclose(np.asarray(logits[b]), full[b][i], atol=1e-5, rtol=0, err_msg=f"step {i}")
        logits, cache = jaxkv.decode_step(model.params, jnp.asarray([g[i] for g in gen.tokens], jnp.int32),
                                          cache, config=model.config, attention="xla")


# --- accuracy on the bundled model (issue 6's gates) ------------------------------------------------------------


def test_perplexity_gates_on_held_out_text():
    """Perplexity of held-out text scored through the cache (scripts/cache_accuracy.py, 3 of its 70 windows, to keep
    the suite fast): bfloat16 and int8 within 1% of the float32 cache, float8_e4m3fn within 3%."""
    spec = importlib.util.spec_from_file_location("cache_accuracy", SCRIPTS / "cache_accuracy.py")
    cache_accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache_accuracy)
    model = jaxkv.load("tiny")
    windows = cache_accuracy.heldout_windows(model, count=3)
    ppl = cache_accuracy.perplexities(model, windows, dtypes=("float32", "bfloat16", "int8", "float8_e4m3fn"))
    assert 2.0 < ppl["float32"] < 4.0  # the model's held-out perplexity: a broken cache would be far off
    for dtype, gate in [("bfloat16", 0.01), ("int8", 0.01), ("float8_e4m3fn", 0.03)]:
        assert abs(ppl[dtype] / ppl["float32"] - 1) <= gate, (dtype, ppl)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_engine_with_a_quantized_cache_equals_generate(cache_dtype):
    """Issue 27 (16): the engine's prompt chunk attended over its own K/V as stored (quantized), generate's prefill
    over the fresh K/V, so greedy tokens differed (these prompts did, for one dtype or both). A prompt prefilled
    in one chunk with no cached prefix now reads nothing quantized; so does generate's first prefix-cache call."""
    from jaxkv.engine import Engine
    model = model_for("gqa")
    prompts = _engine_prompts()  # 27, 20 and 8 tokens: one chunk each
    engine = Engine(model, slots=2, max_len=64, page_size=8, decode_widths=[2], cache_dtype=cache_dtype)
    got = [r.tokens for r in engine.generate(prompts, max_new_tokens=8, stop_tokens=[])]
    want = jaxkv.generate(model, prompts, max_new_tokens=8, stop_tokens=[], cache_dtype=cache_dtype).tokens
    assert got == want
    pc = jaxkv.PrefixCache(model, num_pages=24, page_size=8, cache_dtype=cache_dtype)
    first = jaxkv.generate(model, prompts, max_new_tokens=8, stop_tokens=[], cache_dtype=cache_dtype, prefix_cache=pc)
    assert first.stats["prefix_hit_tokens"] == 0 and first.tokens == want
