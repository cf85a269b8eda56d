"""The compiled pieces a research loop drives (prefill, decode_step, decode, Model.apply, samplers): nothing
plausible-but-wrong comes out of them, and nothing recompiles without need (issue 12, items 2-5 and 9)."""

import re
import pathlib

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from helpers.compiles import count_compiles
from helpers.models import model_for

PROMPT = list(range(1, 17))  # 16 tokens


def _prefill(model, capacity, prompts=(PROMPT,), ring=False):
    tokens, start = jaxkv.left_pad(prompts)
    return jaxkv.prefill(model.params, tokens, start, config=model.config, capacity=capacity, ring=ring)


def _greedy_decode(model, logits, cache, steps, stop_ids=()):
    return jaxkv.decode(model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.sampling.greedy, list(stop_ids),
                        config=model.config, steps=steps)


# --- item 2: overflow ------------------------------------------------------------------------------------------


def test_decode_refuses_steps_that_do_not_fit_before_compute():
    """Capacity 20, prompt 16: 10 steps would feed 9 tokens back into 4 free slots."""
    model = model_for("gqa")
    logits, cache = _prefill(model, 20)
    with pytest.raises(ValueError, match="at most 5 steps fit"):
        _greedy_decode(model, logits, cache, 10)
    # Nothing was donated or consumed by the refusal: the exact fit (4 fed back, the 5th only sampled) runs and
    # agrees with generate.
    out = _greedy_decode(model, logits, cache, 5)
    assert int(out.cache.length) == 20 and not bool(out.cache.overflowed)
    want = jaxkv.generate(model, [PROMPT], max_new_tokens=5, stop_tokens=[]).tokens[0]
    assert np.asarray(out.tokens)[0].tolist() == want


def test_steps_past_any_capacity_are_refused_even_under_jit():
    model = model_for("gqa")
    logits, cache = _prefill(model, 20)

    @jax.jit
    def loop(cache, logits):
        return _greedy_decode(model, logits, cache, 30)

    with pytest.raises(ValueError, match="holds only 20"):
        loop(cache, logits)


def test_decode_step_on_a_full_cache_gives_nan_and_a_checkable_overflow():
    model = model_for("gqa")
    logits, cache = _prefill(model, 16)  # full after the prompt
    assert not bool(cache.overflowed)
    logits, cache = jaxkv.decode_step(model.params, jnp.argmax(logits, -1).astype(jnp.int32), cache,
                                      config=model.config)
    assert np.isnan(np.asarray(logits)).all()
    assert bool(cache.overflowed)
    err, _ = checkify.checkify(lambda c: c.check())(cache)
    with pytest.raises(checkify.JaxRuntimeError, match="KV cache overflow"):
        err.throw()


def test_check_passes_on_a_cache_with_room():
    model = model_for("gqa")
    _, cache = _prefill(model, 32)
    err, _ = checkify.checkify(lambda c: c.check())(cache)
    err.throw()  # no error


def test_decode_under_jit_with_traced_length_cannot_return_plausible_tokens():
    """Inside a user's jit the length is traced: an overflowing row emits -1 and stops, never a real id."""
    model = model_for("gqa")
    logits, cache = _prefill(model, 20)

    @jax.jit
    def loop(cache, logits):
        return _greedy_decode(model, logits, cache, 10)

    out = loop(cache, logits)
    tokens = np.asarray(out.tokens)[0].tolist()
    # 4 tokens fit after the first; the 6th sample comes from NaN logits: -1, and the row stops.
    assert tokens[5] == -1 and tokens[6:] == [-1] * 4
    assert all(0 <= t < model.config.vocab_size for t in tokens[:5])
    assert int(out.num_new[0]) == 6 and bool(out.done[0])


def test_apply_with_a_chunk_that_does_not_fit():
    model = model_for("gqa")
    cache = jaxkv.KVCache.allocate(model.config, 1, 8)
    tokens = jnp.ones((1, 9), jnp.int32)
    with pytest.raises(ValueError, match="cannot write 9 tokens"):
        model.apply(tokens, cache.positions(9), cache)
    logits, cache = model.apply(tokens[:, :6], cache.positions(6), cache)
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="cannot write 3 tokens at slot 6 of a cache of 8 slots"):
        model.apply(tokens[:, :3], cache.positions(3), cache)  # eager: the length is known
    # Under jit the length is traced: NaN logits and a visible overflow instead.
    logits, cache = jax.jit(lambda c, t: model.apply(t, c.positions(3), c))(cache, tokens[:, :3])
    assert np.isnan(np.asarray(logits)).all() and bool(cache.overflowed)


def test_prefill_below_the_prompt_length_is_a_clear_error():
    model = model_for("gqa")
    with pytest.raises(ValueError, match="more than the cache's capacity of 8"):
        _prefill(model, 8)
    with pytest.raises(ValueError, match="capacity must be <= 4096"):
        _prefill(model, 10**7)


# --- item 3: samplers ------------------------------------------------------------------------------------------


@flax.struct.dataclass
class ScaledGreedy:
    """A sampler built like jaxkv.Sampler: a pytree whose fields are leaves."""

    bias: jax.Array
    scale: float

    def __call__(self, logits, key):
        return jnp.argmax(logits * self.scale + self.bias, axis=-1).astype(jnp.int32)


def test_pytree_sampler_leaves_are_traced_not_static():
    model = model_for("mqa")
    bias = jnp.zeros((model.config.vocab_size,))
    first = jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=4, sampler=ScaledGreedy(bias, 1.0))
    equal = jnp.asarray(np.zeros(model.config.vocab_size, np.float32))  # another array, equal values
    with count_compiles() as c:
        again = jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=4, sampler=ScaledGreedy(equal, 1.0))
        for scale in (2.0, 3.0):
            jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=4, sampler=ScaledGreedy(bias, scale))
    assert again.tokens == first.tokens
    assert c["n"] == 0
    # A leaf's value is used, not frozen: a bias on one token makes it always win.
    forced = jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=4, stop_tokens=[],
                            sampler=ScaledGreedy(bias.at[7].set(1e6), 1.0))
    assert forced.tokens[0] == [7, 7, 7, 7]


def test_partial_holding_arrays_is_traced():
    model = model_for("mqa")

    def biased(bias, logits, key):
        return jnp.argmax(logits + bias, axis=-1).astype(jnp.int32)

    V = model.config.vocab_size
    # The biases are built before counting: eager ops compile once per worker process, so whether they count
    # would depend on which tests ran before in it (CI saw 7 compiles from that alone).
    samplers = {t: jax.tree_util.Partial(biased, jnp.zeros(V).at[t].set(1e6)) for t in (5, 9, 11)}

    def run(t):
        out = jaxkv.generate(model, [[1, 2]], max_new_tokens=3, stop_tokens=[], sampler=samplers[t])
        assert out.tokens[0] == [t] * 3

    run(5)  # compiles
    with count_compiles() as c:
        run(9)
        run(11)
    assert c["n"] == 0  # other values of the same leaf reuse the first call's programs


def test_custom_sampler_sees_the_callers_batch():
    model = model_for("mqa")
    seen = []

    def per_row(logits, key):
        seen.append(logits.shape)
        offsets = jnp.arange(3)  # one per prompt: fails to broadcast on a padded batch of 4
        return (jnp.argmax(logits, -1) * 0 + offsets).astype(jnp.int32)

    out = jaxkv.generate(model, [[1], [2, 3], [4, 5, 6]], max_new_tokens=2, stop_tokens=[], sampler=per_row)
    assert out.tokens == [[0, 0], [1, 1], [2, 2]]
    assert all(shape == (3, model.config.vocab_size) for shape in seen)


def test_per_row_sampling_settings():
    model = model_for("gqa")
    prompts = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    greedy = jaxkv.generate(model, prompts, max_new_tokens=16, stop_tokens=[]).tokens
    # Row 0 greedy, row 1 top-1 sampling (the greedy law), row 2 hot sampling (differs from greedy).
    mixed = jaxkv.generate(model, prompts, max_new_tokens=16, stop_tokens=[], temperature=[0.0, 1.0, 5.0],
                           top_k=[None, 1, None], seed=3)
    assert mixed.tokens[0] == greedy[0] and mixed.tokens[1] == greedy[1]
    assert mixed.tokens[2] != greedy[2]
    with count_compiles() as c:
        jaxkv.generate(model, prompts, max_new_tokens=16, stop_tokens=[], temperature=0.7)  # scalar: same loop
        jaxkv.generate(model, prompts, max_new_tokens=16, stop_tokens=[], temperature=[0.3, 0.0, 2.0],
                       top_p=[0.9, None, 0.5], min_p=[0.1, None, None])
    assert c["n"] == 0
    with pytest.raises(ValueError, match="temperature has 2 values, one per prompt is 3"):
        jaxkv.generate(model, prompts, max_new_tokens=2, temperature=[0.1, 0.2])


def test_sampler_ids_outside_the_vocabulary_are_an_error():
    model = model_for("mqa")
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {V} for prompt 0, outside the vocabulary"):
        jaxkv.generate(model, [[1, 2]], max_new_tokens=3, sampler=lambda logits, key: jnp.full((1,), V, jnp.int32))
    with pytest.raises(ValueError, match="token id -3"):
        jaxkv.generate(model, [[1, 2]], max_new_tokens=3, sampler=lambda logits, key: jnp.full((1,), -3, jnp.int32))
    with pytest.raises(ValueError, match="integer token ids of shape"):
        jaxkv.generate(model, [[1, 2]], max_new_tokens=3, sampler=lambda logits, key: logits)


# --- items 4 and 5: recompiles and early exit ------------------------------------------------------------------


def test_max_new_tokens_1_to_512_compile_a_handful_of_loops():
    model = model_for("mqa")
    prompt = [[3, 1, 4, 1, 5]]
    with count_compiles() as c:
        for n in (1, 2, 7, 40, 100, 241, 250, 300, 333, 512):
            out = jaxkv.generate(model, prompt, max_new_tokens=n, stop_tokens=[])
            assert len(out.tokens[0]) == n and out.stats["decode_steps"] == n - 1
    # Capacities 256, 512 and 1024: one prefill and one decode loop each. (Before: one loop per value.)
    assert c["n"] <= 6, c["n"]


def test_decode_step_counts_share_one_loop():
    model = model_for("mqa")
    logits, cache = _prefill(model, 64)
    _greedy_decode(model, logits, cache, 3)
    with count_compiles() as c:
        for steps in (5, 17, 40):
            logits, cache = _prefill(model, 64)
            out = _greedy_decode(model, logits, cache, steps)
            assert out.tokens.shape == (1, steps)
    assert c["n"] <= 3  # at most the eager slice of the result to [B, steps], never the loop


def test_generate_stops_when_every_row_has_stopped():
    model = model_for("gqa")
    prompts = [[5, 6, 7], [9, 8]]
    first = jaxkv.generate(model, prompts, max_new_tokens=1).tokens
    # 200: the capacity (256) of the other two calls, so all three share one compiled prefill and decode loop
    out = jaxkv.generate(model, prompts, max_new_tokens=200, stop_tokens=[first[0][0], first[1][0]])
    assert out.tokens == first and out.finish_reasons == ["stop", "stop"]
    assert out.stats["decode_steps"] == 0  # not 199
    # One row stops at once, the other runs on: the steps run are the longer row's.
    longer = jaxkv.generate(model, prompts, max_new_tokens=20, stop_tokens=[first[0][0]])
    assert longer.tokens[0] == first[0] and len(longer.tokens[1]) == 20
    assert longer.stats["decode_steps"] == 19


def test_decode_ends_early_and_pads_with_minus_one():
    model = model_for("gqa")
    logits, cache = _prefill(model, 64)
    first = int(jnp.argmax(logits[0]))
    out = _greedy_decode(model, logits, cache, 30, stop_ids=[first])
    assert np.asarray(out.tokens)[0].tolist() == [first] + [-1] * 29
    assert int(out.cache.length) == 16  # nothing was fed back


# --- item 9: research-loop ergonomics ---------------------------------------------------------------------------


def test_left_pad():
    tokens, start = jaxkv.left_pad([[1, 2, 3], [4]])
    assert tokens.tolist() == [[1, 2, 3], [0, 0, 4]] and start.tolist() == [0, 2]
    tokens, start = jaxkv.left_pad([[1, 2, 3], [4]], length=5)
    assert tokens.shape == (2, 5) and start.tolist() == [2, 4]
    with pytest.raises(ValueError):
        jaxkv.left_pad([[1, 2, 3]], length=2)
    with pytest.raises(ValueError):
        jaxkv.left_pad([[]])


def test_decode_continues_from_its_result():
    """decode twice (feeding the first call's last token with decode_step) == one decode of all the tokens."""
    model = model_for("gqa")
    logits, cache = _prefill(model, 64, prompts=[[1, 2, 3], [4, 5]])
    whole = _greedy_decode(model, logits, cache, 12)
    logits, cache = _prefill(model, 64, prompts=[[1, 2, 3], [4, 5]])
    part = _greedy_decode(model, logits, cache, 5)
    logits, cache = jaxkv.decode_step(model.params, part.tokens[:, -1], part.cache, config=model.config)
    rest = _greedy_decode(model, logits, cache, 7)
    np.testing.assert_array_equal(np.concatenate([part.tokens, rest.tokens], 1), whole.tokens)


def test_readme_research_loop_runs():
    """The README's hand-written loop (prefill, a Python-side sampler, decode_step, stop handling) runs as shown
    and produces what generate produces."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    loop = [b for b in blocks if "decode_step" in b and "prefill" in b]
    assert loop, "README has no research-loop example"
    scope = {}
    exec(loop[0], scope)  # noqa: S102 (our own README)
    model, prompts, outputs = scope["model"], scope["prompts"], scope["outputs"]
    want = jaxkv.generate(model, prompts, max_new_tokens=scope["max_new_tokens"]).tokens
    assert outputs == want


def test_decode_argument_errors_are_clear():
    model = model_for("gqa")
    logits, cache = _prefill(model, 32)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        _greedy_decode(model, logits, cache, 0)
    with pytest.raises(ValueError, match="stop_ids must be integer token ids"):
        _greedy_decode(model, logits, cache, 2, stop_ids=[0.5])
    with pytest.raises(ValueError, match="logits must be float32"):
        _greedy_decode(model, logits[:, :5], cache, 2)
    with pytest.raises(ValueError, match="tokens has 3 rows, the cache has 1"):
        jaxkv.decode_step(model.params, jnp.zeros((3,), jnp.int32), cache, config=model.config)
    out = _greedy_decode(model, logits, cache, 3, stop_ids=(5, 6))  # a tuple of ids is fine too
    assert out.tokens.shape == (1, 3)
