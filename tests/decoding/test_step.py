"""The one decode step (`jaxkv.decoding.step`): every decoding path picks its tokens through it.

Replacing its logit hook once (`step.process_logits`) must change what `generate` (contiguous and paged),
`decode`, the engine and beam search emit; the step's own rules (NaN rows, stop ids, per-row stop lists, the
log-probability of the picked token) are checked on hand-made logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.decoding import step
from jaxkv.sampling import greedy
from helpers.models import model_for, recompute
from helpers.tolerances import tolerance

FORCED = 7  # the token the patched hook forces; not a stop id below (stop_tokens=[] everywhere)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]
NEW = 4


def forcing(logits, processing=None, stop_ids=None):
    """A hook that leaves only FORCED possible (whatever the path's processing state): every path must then emit
    FORCED at every step, with the model's log-probability of it (issue 50: what the hook does to the
    distribution is not what is reported)."""
    return jnp.where(jnp.arange(logits.shape[-1]) == FORCED, logits, -jnp.inf)


def every_path(model):
    """{path: the tokens it emits for PROMPTS}, through the four decoding paths."""
    out = {}
    gen = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[])
    out["generate"], out["generate logprobs"] = gen.tokens, gen.logprobs
    out["generate n=2"] = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], n=2,
                                         temperature=1.0).tokens
    tokens, start = jaxkv.left_pad(PROMPTS)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=model.config, capacity=32)
    decoded = jaxkv.decode(model.params, cache, logits, jax.random.PRNGKey(0), greedy, [], config=model.config,
                           steps=NEW)
    out["decode"] = np.asarray(decoded.tokens).tolist()
    engine = jaxkv.Engine(model, slots=2, max_len=32, page_size=4, prefill_chunk=8)
    out["engine"] = [r.tokens for r in engine.generate([dict(prompt=p, max_new_tokens=NEW, stop_tokens=[])
                                                        for p in PROMPTS])]
    result = jaxkv.beam_search(model, PROMPTS, num_beams=2, max_new_tokens=NEW, stop_tokens=[])
    out["beam_search"] = [hyps[0].tokens for hyps in result]
    return out


@pytest.fixture
def fresh_compiles():
    """Each decode path looks the hook up when it is traced: drop compiled programs before and after, so the
    patched hook is traced in and then out again."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_patching_the_hook_once_changes_every_decoding_path(monkeypatch, fresh_compiles):
    model = model_for("gqa")
    # The no-cache logits of each prompt and the forced continuation (causal: position len(p) - 1 sees the prompt
    # alone).
    rows = [p + [FORCED] * (NEW - 1) for p in PROMPTS]
    logp = [jax.nn.log_softmax(logits, axis=-1) for logits in recompute(model, rows)]
    # Without the hook, greedy decoding of random weights does not emit FORCED everywhere: the check can fail. The
    # model's own argmax after each prompt is the first token of generate's, decode's and the engine's greedy
    # rows (one compiled forward instead of the five paths compiled a second time without the hook).
    first = [int(np.argmax(lp[len(p) - 1])) for p, lp in zip(PROMPTS, logp)]
    assert any(t != FORCED for t in first), first
    monkeypatch.setattr(step, "process_logits", forcing)
    jax.clear_caches()
    forced = every_path(model)
    for path in ("generate", "generate n=2", "decode", "engine", "beam_search"):
        assert all(row == [FORCED] * NEW for row in forced[path]), (path, forced[path])
    want = [[float(lp[len(p) - 1 + i, FORCED]) for i in range(NEW)] for p, lp in zip(PROMPTS, logp)]
    np.testing.assert_allclose(np.array(forced["generate logprobs"]), want, **tolerance("logprobs", "float32"))
    assert np.all(np.array(want) < -1e-3)  # not the forced distribution's 0


def test_nan_rows_get_minus_one_and_stop_and_stop_ids_match_per_row():
    logits = jnp.array([[0.0, 2.0, 1.0, 0.0], [jnp.nan, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]], jnp.float32)
    shared = step.select(logits, None, greedy, jnp.array([0, -1], jnp.int32))
    np.testing.assert_array_equal(shared.tokens, [1, -1, 0])
    np.testing.assert_array_equal(shared.nan, [False, True, False])
    np.testing.assert_array_equal(shared.stopped, [False, True, True])  # NaN row stops; token 0 is a stop id
    # log p(1) in row 0 = 2 - logsumexp(0, 2, 1, 0)
    np.testing.assert_allclose(shared.logprob[0], 2.0 - np.log(1 + np.e ** 2 + np.e + 1), rtol=1e-6)
    per_row = step.select(logits, None, greedy, jnp.array([[1, -1], [-1, -1], [2, -1]], jnp.int32))
    np.testing.assert_array_equal(per_row.stopped, [True, True, False])


def test_alternatives_only_when_wanted():
    logits = jnp.array([[0.0, 2.0, 1.0]], jnp.float32)
    wanted = step.select(logits, None, greedy, jnp.array([-1]), top=2, top_wanted=jnp.array(True))
    skipped = step.select(logits, None, greedy, jnp.array([-1]), top=2, top_wanted=jnp.array(False))
    np.testing.assert_array_equal(wanted.top_ids, [[1, 2]])
    np.testing.assert_array_equal(skipped.top_ids, [[0, 0]])
    np.testing.assert_allclose(wanted.logprob, skipped.logprob)


def test_a_sampler_of_the_wrong_shape_is_refused_at_trace_time():
    with pytest.raises(ValueError, match="the sampler must return integer token ids of shape"):
        step.select(jnp.zeros((2, 4)), None, lambda logits, key: jnp.zeros((3,), jnp.int32), jnp.array([-1]))
