"""generate: ragged batches, padding safety, capacity invariance, stop handling, errors, compile counts."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from helpers.models import CONFIGS, model_for, left_pad, recompute

PROMPTS = [[5, 17, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7, 1, 8, 2, 8, 1, 8]]


@pytest.mark.parametrize("name", ["gqa", "learned"])
def test_ragged_batch_equals_single_prompts(name):
    # Learned positions matter here: RoPE is shift-invariant, so a wrong position id after padding could hide.
    model = model_for(name)
    batch = jaxkv.generate(model, PROMPTS, max_new_tokens=24, stop_tokens=[])
    for prompt, tokens in zip(PROMPTS, batch.tokens):
        alone = jaxkv.generate(model, [prompt], max_new_tokens=24, stop_tokens=[])
        assert alone.tokens[0] == tokens
        assert len(tokens) == 24


def test_greedy_tokens_match_recompute_argmax():
    model = model_for("learned")
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=[])
    fulls = recompute(model, [prompt + tokens[:-1] for prompt, tokens in zip(PROMPTS, out.tokens)])
    for prompt, tokens, full in zip(PROMPTS, out.tokens, fulls):
        assert np.argmax(full[len(prompt) - 1:], -1).tolist() == tokens


def test_cache_capacity_does_not_change_results():
    model = model_for("gqa")
    prompt = [[4, 8, 15, 16, 23, 42]]
    outs = [jaxkv.generate(model, prompt, max_new_tokens=26, max_len=n, stop_tokens=[]).tokens for n in (32, 64, 4096)]
    assert outs[0] == outs[1] == outs[2]


def _prefill_ragged(model, prompts, capacity):
    tokens, start = left_pad(prompts)
    return jaxkv.prefill(model.params, tokens, start, config=model.config,
                         capacity=capacity, attention="xla")


def _decode(model, logits, cache, steps):
    out = []
    for _ in range(steps):
        out.append(np.asarray(logits))
        logits, cache = jaxkv.decode_step(model.params, jnp.argmax(logits, -1).astype(jnp.int32), cache,
                                          config=model.config)
    return np.stack(out, 1)


# 40 slots: the cache write zeroes dead values every step; 600: the live-prefix attention masks them itself.
@pytest.mark.parametrize("name, capacity", [("gqa", 40), ("learned", 40), ("gqa", 600)])
def test_nan_in_dead_cache_slots_cannot_poison_real_rows(name, capacity):
    """Every slot that is not live (left padding, and slots not yet written) is filled with NaN: real rows'
    logits must not change and must stay finite."""
    model = model_for(name)
    clean = _decode(model, *_prefill_ragged(model, PROMPTS, capacity), steps=8)
    logits, cache = _prefill_ragged(model, PROMPTS, capacity)
    slot = jnp.arange(cache.capacity)
    dead = (slot[None, :] < cache.start[:, None]) | (slot[None, :] >= cache.length)  # [B, S]
    poison = lambda a: jnp.where(dead[:, None, :, None], jnp.nan, a)  # noqa: E731
    cache = dataclasses.replace(cache, keys=tuple(map(poison, cache.keys)), values=tuple(map(poison, cache.values)))
    poisoned = _decode(model, logits, cache, steps=8)
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(poisoned, clean)


@pytest.mark.parametrize("name", ["gqa", "learned"])
def test_nan_pad_embedding_cannot_poison_real_rows(name):
    """Prompts are left-padded with id 0. Make the embedding of id 0 NaN (the real prompts never use 0):
    nothing a padding token's embedding holds may reach a real row. (Untied head: with a tied one the logit of
    id 0 is legitimately NaN.)"""
    model = jaxkv.Model.random(CONFIGS[name].replace(tie_embeddings=False), seed=3)
    clean = jaxkv.generate(model, PROMPTS, max_new_tokens=8, stop_tokens=[])
    assert 0 not in sum(clean.tokens, []), "precondition: a generated 0 would read the poisoned row legitimately"
    params = dict(model.params, embedding=model.params["embedding"].at[0].set(jnp.nan))
    poisoned = jaxkv.Model(model.config, params)
    logits, _ = _prefill_ragged(poisoned, PROMPTS, 32)
    assert np.isfinite(np.asarray(logits)).all()
    out = jaxkv.generate(poisoned, PROMPTS, max_new_tokens=8, stop_tokens=[])
    assert out.tokens == clean.tokens


def test_fully_masked_rows_are_finite():
    """A filler row with a single live token and padded query rows in prefill have (almost) nothing to attend
    to; the where-based mask must give finite results, never NaN."""
    model = model_for("mqa")
    T = 16
    tokens = jnp.zeros((2, T), jnp.int32).at[0, -1].set(5).at[1, 3:].set(7)
    start = jnp.array([T - 1, 3], jnp.int32)
    cache = jaxkv.KVCache.allocate(model.config, 2, 32, start=start)
    logits, cache = model.apply(tokens, cache.positions(T), cache)  # all T logits, padded query rows included
    assert np.isfinite(np.asarray(logits)).all()


# --- stop handling ----------------------------------------------------------------------------------------------


def test_stop_tokens_end_rows_at_different_steps():
    model = model_for("mha")
    free = jaxkv.generate(model, PROMPTS, max_new_tokens=20, stop_tokens=[]).tokens
    # Pick, for rows 0 and 1, a token first emitted at different steps; row 2 must avoid both, or stop on them too.
    stop_a = next(t for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i])
    stop_b = next(t for i, t in enumerate(free[1]) if i >= 5 and t not in free[1][:i] and t != stop_a)
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=20, stop_tokens=[stop_a, stop_b])
    for row, tokens, reason in zip(free, out.tokens, out.finish_reasons):
        hits = [i for i, t in enumerate(row) if t in (stop_a, stop_b)]
        if hits:
            assert tokens == row[: hits[0] + 1] and reason == "stop"
        else:
            assert tokens == row and reason == "length"
    assert len(out.tokens[0]) != len(out.tokens[1])
    assert out.finish_reasons[0] == out.finish_reasons[1] == "stop"


def test_default_stop_tokens_are_eos_ids_and_empty_list_disables():
    model = model_for("mha")
    free = jaxkv.generate(model, [PROMPTS[0]], max_new_tokens=12, stop_tokens=[]).tokens[0]
    eos = free[4]
    with_eos = jaxkv.Model(model.config.replace(eos_ids=(eos,)), model.params)
    stopped = jaxkv.generate(with_eos, [PROMPTS[0]], max_new_tokens=12)
    assert stopped.tokens[0] == free[: free.index(eos) + 1] and stopped.finish_reasons == ["stop"]
    unstopped = jaxkv.generate(with_eos, [PROMPTS[0]], max_new_tokens=12, stop_tokens=[])
    assert unstopped.tokens[0] == free and unstopped.finish_reasons == ["length"]


def _zero_heavy_sampler(logits, key):
    """Greedy, except that every even id becomes 0: outputs full of legitimate zeros."""
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    return jnp.where(tok % 2 == 0, 0, tok)


def test_token_zero_is_a_real_token_not_padding():
    model = model_for("gqa")
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=16, sampler=_zero_heavy_sampler, stop_tokens=[1])
    # Reference: the same rule applied to the no-cache recompute of prompt + output (causal, so position t of one
    # full forward is what step t saw); the output must end exactly at the first 1, or run to 16 tokens.
    fulls = recompute(model, [prompt + tokens for prompt, tokens in zip(PROMPTS, out.tokens)])
    for prompt, tokens, reason, full in zip(PROMPTS, out.tokens, out.finish_reasons, fulls):
        full = full[len(prompt) - 1: -1]
        assert tokens == np.asarray(_zero_heavy_sampler(full, None)).tolist()
        assert (1 not in tokens[:-1]) and (tokens[-1] == 1 or len(tokens) == 16)
        assert reason == ("stop" if tokens[-1] == 1 else "length")
    assert any(0 in t[:-1] for t in out.tokens), "the test needs a 0 in the middle of some output"


# --- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1] * 30], max_new_tokens=5, max_len=32), r"30 \+ 5 = 35 exceeds max_len=32"),
    (dict(prompts=[[1] * 250], max_new_tokens=10), r"260 positions.*max positions \(256\)"),
    (dict(prompts=[[1, 97]], max_new_tokens=2), r"token id 97 is outside the vocabulary \[0, 97\)"),
    (dict(prompts=[[1, -1]], max_new_tokens=2), r"token id -1"),
    (dict(prompts=[[1], []], max_new_tokens=2), r"prompt 1 is empty"),
    (dict(prompts=[], max_new_tokens=2), r"prompts is empty"),
    (dict(prompts=[[1]], max_new_tokens=0), r"max_new_tokens must be >= 1"),
    (dict(prompts=[[1]], max_new_tokens=2, temperature=-0.5), r"temperature must be >= 0"),
    (dict(prompts=[[1]], max_new_tokens=2, temperature=float("nan")), r"temperature must be finite"),
    (dict(prompts=[[1]], max_new_tokens=2, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(prompts=[[1]], max_new_tokens=2, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(prompts=[[1]], max_new_tokens=2, top_k=0), r"top_k must be >= 1"),
    (dict(prompts=[[1]], max_new_tokens=2, min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(prompts=[[1]], max_new_tokens=2, stop_tokens=[500]), r"stop token 500 is outside"),
    (dict(prompts=[[1]], max_new_tokens=2, attention="nope"), r"unknown attention implementation"),
    (dict(prompts=[[1]], max_new_tokens=2, temperature=1.0, top_k=2**40), r"top_k must be <= 2147483647"),
    (dict(prompts=[[1]], max_new_tokens=2, seed=2**64), r"seed must be <= 18446744073709551615"),
    (dict(prompts=[[1]], max_new_tokens=2, seed=1.5), r"seed must be an integer"),
    (dict(prompts=[[1]], max_new_tokens=2, temperature="0.5"), r"temperature must be a number, got '0.5'"),
    (dict(prompts=[[1]], max_new_tokens=2, top_p=0.9), r"top_p has no effect with temperature 0"),
    (dict(prompts=[[1]], max_new_tokens=2, top_k=5), r"top_k has no effect with temperature 0"),
    (dict(prompts=[[1]], max_new_tokens=2, temperature=[0.0, 0.0], min_p=[0.1, None]),
     r"temperature has 2 values, one per prompt is 1"),
    (dict(prompts=[[1], [2]], max_new_tokens=2, temperature=[0.0, 0.0], min_p=[0.1, None]),
     r"min_p has no effect with temperature 0"),
    (dict(prompts=[[1]], max_new_tokens=2, max_len=10**7), r"max_len=10000000 exceeds the model's max positions"),
    (dict(prompts=[[1]], max_new_tokens=2, max_len=257), r"exceeds the model's max positions \(256\)"),
])
def test_bad_input_is_refused_before_compute(kwargs, match, monkeypatch):
    model = model_for("learned")  # max_positions 256

    def no_compute(*a, **k):
        raise AssertionError("compute started for bad input")

    for module, name in (("jaxkv.decoding.programs", "prefill"), ("jaxkv.decoding.loop", "decode_loop")):
        monkeypatch.setattr(importlib.import_module(module), name, no_compute)
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(model, **kwargs)


def test_write_past_the_end_cannot_overwrite_the_last_slot():
    """dynamic_update_slice clamps out-of-range starts; the cache write must turn an overflowing write into a
    no-op instead of overwriting the last slots, and leave the overflow visible in `length`."""
    cfg = CONFIGS["mqa"]
    cache = jaxkv.KVCache.allocate(cfg, 1, 8)
    marker = jnp.full((1, 1, 2, cfg.head_dim), 7.0)
    cache = dataclasses.replace(cache, length=jnp.int32(6))

    @jax.jit
    def write(cache, k):
        return cache.write(0, k, k).advance(k.shape[2])

    fits = write(cache, marker)  # slots 6, 7: fits exactly
    np.testing.assert_array_equal(np.asarray(fits.keys[0][0, 0, 6:, 0]), [7.0, 7.0])
    overflow = write(dataclasses.replace(cache, length=jnp.int32(7)), marker * 2)  # slots 7, 8: does not fit
    np.testing.assert_array_equal(np.asarray(overflow.keys[0]), 0.0)  # nothing written, nothing clamped
    assert int(overflow.length) > overflow.capacity


def test_refusal_check_sees_compute(monkeypatch):
    """The monkeypatch above must catch compute, or the refusals prove nothing: a good call hits it."""

    def no_compute(*a, **k):
        raise AssertionError("compute started")

    monkeypatch.setattr(importlib.import_module("jaxkv.decoding.programs"), "prefill", no_compute)
    with pytest.raises(AssertionError, match="compute started"):
        jaxkv.generate(model_for("learned"), [[1]], max_new_tokens=2)


# --- seeds ------------------------------------------------------------------------------------------------------


def test_seeds_use_their_full_range():
    model = model_for("gqa")

    def sample(seed):
        return jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=12, temperature=3.0, seed=seed,
                              stop_tokens=[]).tokens[0]

    assert sample(5) == sample(5)
    assert sample(5) != sample(2**32 + 5)  # once truncated to 32 bits: identical
    assert len({tuple(sample(s)) for s in (2**63, 2**64 - 1, 7, 2**33)}) == 4
    assert sample(-1) == sample(2**64 - 1)  # seeds are taken modulo 2**64 (two's complement for negatives)
    # Small seeds keep jax.random.PRNGKey's key, so earlier results reproduce.
    from jaxkv.decoding.request import prng_key as _key

    np.testing.assert_array_equal(_key(12345), np.asarray(jax.random.PRNGKey(12345)))


# --- capacity, positions and the planner ------------------------------------------------------------------------


def test_default_capacity_never_exceeds_max_positions():
    model = jaxkv.Model.random(CONFIGS["gqa"].replace(max_positions=100), seed=0)
    out = jaxkv.generate(model, [[1] * 60], max_new_tokens=40, stop_tokens=[])
    assert out.stats["cache_capacity"] <= 100 and len(out.tokens[0]) == 40


@pytest.mark.parametrize("lengths, max_new_tokens, cache_dtype", [([12, 37], 8, None), ([5, 9, 3], 20, "int8"),
                                                                  ([1, 2, 3, 4, 5], 3, None)])
def test_planner_equals_the_allocation(lengths, max_new_tokens, cache_dtype):
    """The README's claim, with ragged prompts and odd batch sizes: kv_cache_bytes is what the call asks for,
    plan_cache what generate allocates, and Generation.stats reports both."""
    model = model_for("gqa")
    prompts = [list(range(1, n + 1)) for n in lengths]
    out = jaxkv.generate(model, prompts, max_new_tokens=max_new_tokens, cache_dtype=cache_dtype, stop_tokens=[])
    plan = jaxkv.plan_cache(model.config, lengths, max_new_tokens, cache_dtype=cache_dtype)
    s = out.stats
    assert s["kv_cache_bytes"] == plan.allocated_bytes
    assert s["kv_cache_bytes"] == jaxkv.kv_cache_bytes(model.config, tokens=plan.capacity, batch=plan.padded_batch,
                                                       cache_dtype=cache_dtype)
    requested = jaxkv.kv_cache_bytes(model.config, tokens=max(lengths) + max_new_tokens, batch=len(lengths),
                                     cache_dtype=cache_dtype)
    assert s["kv_cache_bytes_requested"] == plan.requested_bytes == requested
    # With max_len, the capacity is exactly what was asked for; only the batch is padded.
    exact = jaxkv.generate(model, prompts, max_new_tokens=max_new_tokens, cache_dtype=cache_dtype, stop_tokens=[],
                           max_len=max(lengths) + max_new_tokens)
    assert exact.stats["kv_cache_bytes"] == jaxkv.kv_cache_bytes(
        model.config, tokens=max(lengths) + max_new_tokens, batch=plan.padded_batch, cache_dtype=cache_dtype)
    assert exact.tokens == out.tokens
