"""Sampling: hand-computed filter cases, laws (top-1 = greedy, temperature 0 = greedy), seeds and key splitting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import sampling
from helpers.models import model_for


def kept(filtered):
    return np.flatnonzero(np.isfinite(np.asarray(filtered)[0])).tolist()


def logits_of(probs):
    return jnp.log(jnp.asarray([probs], jnp.float32))


def test_greedy_breaks_ties_by_lowest_id():
    assert sampling.greedy(jnp.array([[1.0, 3.0, 3.0, 2.0]])).tolist() == [1]


def test_top_k_keeps_exactly_k_even_with_ties():
    x = jnp.array([[5.0, 1.0, 5.0, 5.0, 2.0]])
    assert kept(sampling.top_k_filter(x, 2)) == [0, 2]  # three tied at 5.0: the two lowest ids
    assert kept(sampling.top_k_filter(x, 4)) == [0, 2, 3, 4]
    assert kept(sampling.top_k_filter(x, 0)) == [0, 1, 2, 3, 4]  # 0 disables


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = logits_of([0.05, 0.5, 0.15, 0.3])  # sorted: id1 .5, id3 .3, id2 .15, id0 .05
    assert kept(sampling.top_p_filter(x, 0.4)) == [1]  # 0.5 alone reaches 0.4
    assert kept(sampling.top_p_filter(x, 0.7)) == [1, 3]  # 0.5 < 0.7, 0.5 + 0.3 = 0.8 >= 0.7
    assert kept(sampling.top_p_filter(x, 0.9)) == [1, 2, 3]  # 0.8 < 0.9, + 0.15 = 0.95
    assert kept(sampling.top_p_filter(x, 1.0)) == [0, 1, 2, 3]


def test_top_p_ties_are_deterministic():
    x = logits_of([0.2, 0.4, 0.2, 0.2])
    assert kept(sampling.top_p_filter(x, 0.5)) == [0, 1]  # 0.4 then the lowest id among the tied 0.2s


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(sampling.min_p_filter(x, 0.2)) == [0, 1, 2]  # threshold 0.1
    assert kept(sampling.min_p_filter(x, 0.7)) == [0]  # threshold 0.35
    assert kept(sampling.min_p_filter(x, 0.0)) == [0, 1, 2, 3]


def test_sampler_never_picks_outside_top_k():
    logits = jax.random.normal(jax.random.PRNGKey(0), (64, 50))
    best3 = np.argsort(-np.asarray(logits), axis=1)[:, :3]
    sampler = jaxkv.Sampler.make(temperature=5.0, top_k=3)  # a high temperature flattens the rest
    sample = jax.jit(lambda sampler, logits, key: sampler(logits, key))
    draws = np.stack([np.asarray(sample(sampler, logits, jax.random.PRNGKey(i))) for i in range(20)], 1)  # [64, 20]
    assert all(set(draws[b]) <= set(best3[b]) for b in range(64))
    assert len(set(draws.ravel())) > 3  # and it does sample (not greedy)


def test_sampler_top_p_and_min_p_respect_their_sets():
    logits = logits_of([0.05, 0.5, 0.15, 0.3])
    batch = jnp.repeat(logits, 256, axis=0)
    top_p = np.asarray(jaxkv.Sampler.make(temperature=1.0, top_p=0.7)(batch, jax.random.PRNGKey(1)))
    assert set(top_p) == {1, 3}
    min_p = np.asarray(jaxkv.Sampler.make(temperature=1.0, min_p=0.5)(batch, jax.random.PRNGKey(2)))
    assert set(min_p) == {1, 3}  # 0.3 >= 0.25, 0.15 < 0.25


def test_sampler_frequencies_follow_the_distribution():
    batch = jnp.repeat(logits_of([0.1, 0.6, 0.3]), 4000, axis=0)
    draws = np.asarray(jaxkv.Sampler.make(temperature=1.0)(batch, jax.random.PRNGKey(3)))
    freq = np.bincount(draws, minlength=3) / draws.size
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.3], atol=0.03)  # 4000 draws: 3 sigma is about 0.023


def test_temperature_zero_and_top_1_are_greedy():
    model = model_for("gqa")
    prompts = [[1, 2, 3], [9, 8]]
    greedy = jaxkv.generate(model, prompts, max_new_tokens=10, stop_tokens=[]).tokens
    assert jaxkv.generate(model, prompts, max_new_tokens=10, stop_tokens=[], sampler=sampling.greedy).tokens \
        == greedy
    assert jaxkv.generate(model, prompts, max_new_tokens=10, stop_tokens=[], temperature=1.5, top_k=1,
                          seed=4).tokens == greedy


def test_same_seed_same_tokens_different_seed_differs():
    model = model_for("gqa")
    run = lambda seed: jaxkv.generate(model, [[1, 2, 3]] * 2, max_new_tokens=16, temperature=1.5,  # noqa: E731
                                      stop_tokens=[], seed=seed).tokens
    a, b, c = run(0), run(0), run(1)
    assert a == b
    assert a != c
    assert a[0] != a[1]  # rows of one batch draw independently


def test_key_is_split_every_step():
    """A sampler that ignores the logits and draws uniform ids from its key: if a key were reused across steps,
    consecutive steps would repeat the same ids."""
    model = model_for("gqa")

    def uniform(logits, key):
        return jax.random.randint(key, logits.shape[:1], 0, logits.shape[-1])

    out = jaxkv.generate(model, [[1, 2]], max_new_tokens=24, sampler=jax.jit(uniform), stop_tokens=[]).tokens[0]
    assert len(set(out)) > 12


def test_sampler_and_sampling_parameters_are_exclusive():
    with pytest.raises(ValueError, match="either sampler or"):
        jaxkv.generate(model_for("gqa"), [[1]], max_new_tokens=2, sampler=sampling.greedy, temperature=1.0)
