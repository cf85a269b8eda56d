"""Engine test helpers: a request run alone through `generate`, log-probabilities recomputed without a cache,
random arrivals, and the check that an idle engine holds nothing."""

import jax
import numpy as np

import jaxkv


def alone(model, prompt, max_new_tokens, **kwargs):
    kwargs.setdefault("stop_tokens", [])
    return jaxkv.generate(model, [prompt], max_new_tokens=max_new_tokens, **kwargs)


def recomputed_logprobs(model, prompt, tokens, length=96):
    """log p(token i | prompt, tokens before i) from the full forward pass over prompt + tokens, no cache.
    Right-padded to `length` tokens: causal attention, so the padding after them changes none of their logits,
    and every request runs one compiled forward pass instead of one per length."""
    seq = prompt + tokens
    padded = seq + [0] * max(0, length - len(seq))
    logp = np.asarray(jax.nn.log_softmax(jaxkv.logits(model, padded)[0], axis=-1))[:len(seq)]
    return logp, np.array([logp[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)])


def drain(engine, arrivals, rng):
    """Submits `arrivals` (prompt, max_new_tokens, kwargs) at random points of the run -> {id: arrival}."""
    pending, ids = list(arrivals), {}
    while pending or engine.pending:
        for _ in range(int(rng.integers(0, 3)) if engine.pending else 1):
            if pending:
                prompt, new, kwargs = pending.pop(0)
                ids[engine.submit(prompt, max_new_tokens=new, **kwargs)] = (prompt, new, kwargs)
        engine.step()
    return ids


def assert_all_free(engine):
    assert engine.pending == 0 and engine.free_slots == engine.slots
    state = engine._state
    refcounts = np.asarray(state.cache.refcounts)
    cached = engine.prefix_cache.cached_pages if engine.prefix_cache is not None else 0
    assert refcounts.sum() == cached and engine.free_pages == engine.num_pages - cached
    assert (np.asarray(state.cache.page_table) == -1).all() and (np.asarray(state.cache.lengths) == 0).all()
    assert not np.asarray(state.decoding).any()
    # a hybrid model's state rows: every one zeroed again (none leaks into the next request of its row)
    assert not any(np.asarray(x).any() for x in (*state.cache.conv_states, *state.cache.recurrent_states))
