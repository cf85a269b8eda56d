"""A hybrid model (the tiny Qwen3-Next of helpers.hybrid) on the paged cache: its linear layers' states are rows
beside the pages (`PagedKVCache.conv_states` / `recurrent_states`), gathered by a fork and zeroed by a release.
The paged path against the contiguous one (right-padded prompts: the conv window must end at each row's last real
token), n > 1 forks each continuing its own copy of the prompt's state, beam search against transformers' (whose
beams reorder their cache's states), and the planner's bytes against what is allocated.

The model here is helpers.hybrid's dense one cut to three layers (two Gated DeltaNet layers, then the full one):
two linear layers still tell one layer's state rows from another's, and every program compiles about a quarter
faster (its transformers parity on four layers is tests/families/test_qwen3_next.py's). The tests share shapes
so that their programs compile once: every plain `generate` records logprobs, the engines take one geometry.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from helpers.hf import ATOL, BEAM_NEW, RAGGED, SINGLE, check_beam_search  # noqa: E402
from helpers.hf import build_hf, hf_greedy, saved_and_loaded  # noqa: E402
from helpers.hybrid import FIELDS  # noqa: E402
from jaxkv.cache.paged import PagedKVCache  # noqa: E402

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention"]
loaded = saved_and_loaded(lambda: build_hf("Qwen3NextConfig", dict(FIELDS, num_experts=0, num_hidden_layers=3,
                                                                   layer_types=LAYER_TYPES)), {"dense": ()})
# The engines' one geometry (random arrivals, cancel, the prefix cache's engine, speculation): 3 slots of 64, pages
# of 4, prompt chunks of 8, 2 rows, decode dispatches of widths 2 and 3 (the default adds width 1, another ~5 s
# compile; tests/engine covers the widths).
ENGINE = dict(slots=3, max_len=64, page_size=4, prefill_chunk=8, prefill_rows=2, decode_widths=[2, 3])
# The pool an ENGINE allocates (every slot at max_len): a prefix cache of this many pages gives the engine in it the
# same pool, so its programs are the ones compiled already.
ENGINE_PAGES = 3 * 64 // 4
# The ragged batch the paged, speculative and plain runs share (lengths 15, 18, 13: right-padded to 32, crossing
# page boundaries; the repeats give the n-gram proposer matches).
PROMPTS = [RAGGED[0] * 3, RAGGED[2] * 2, RAGGED[1]]
NEW = 24
# The forked runs' one shape (n > 1 on pages of 4: sampled forks, greedy forks, the planner's bytes): two prompts
# (5 and 13 tokens), 3 samples each (6 rows, padded to 8), 16 new tokens.
FORKED = [RAGGED[0], RAGGED[1]]
FORK_N, FORK_NEW = 3, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return loaded("dense", tmp_path_factory)[1]


def alone(model, prompt, new):
    """`generate` of one prompt alone (helpers.engine.alone), with logprobs as every plain run here."""
    from helpers.engine import alone

    return alone(model, prompt, new, logprobs=1)


class Plain(NamedTuple):
    tokens: list
    logprobs: list


@pytest.fixture(scope="module")
def plain(model):
    """The contiguous path's tokens and log-probabilities for PROMPTS, each prompt alone (the one batch-1 program
    every plain run here compiles; a batch of them would compile its own)."""
    rows = [alone(model, p, NEW) for p in PROMPTS]
    return Plain([r.tokens[0] for r in rows], [r.logprobs[0] for r in rows])


def test_paged_equals_contiguous(model, plain):
    """A ragged batch over pages of 4 (prompts of 15, 18 and 13 tokens right-padded to 32, so the conv window of the
    short rows must end before their padding, and each row's state crosses page boundaries): the contiguous
    path's tokens and log-probabilities (each prompt's alone)."""
    contiguous = plain
    paged = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], logprobs=1, page_size=4)
    assert paged.tokens == contiguous.tokens
    np.testing.assert_allclose(np.array(paged.logprobs), np.array(contiguous.logprobs), atol=ATOL, rtol=0)


def test_forks_continue_their_own_state(model):
    """n = 3 sampled continuations of two prompts (forked from each prompt's one prefill): every sample's
    log-probabilities equal the no-cache forward pass over its prompt + its own tokens, so each fork carried its
    own copy of the prompt's state and its own updates after the samples diverged."""
    from helpers.engine import recomputed_logprobs

    prompts = FORKED
    out = jaxkv.generate(model, prompts, n=FORK_N, max_new_tokens=FORK_NEW, stop_tokens=[], temperature=1.0, seed=3,
                         logprobs=1, page_size=4)
    rows = out.tokens
    assert len({tuple(r) for r in rows[:3]}) > 1 and len({tuple(r) for r in rows[3:]}) > 1  # they diverged
    for i, (row, lps) in enumerate(zip(rows, out.logprobs)):
        _, want = recomputed_logprobs(model, prompts[i // 3], row)  # one padded forward program for every row
        np.testing.assert_allclose(lps, want, atol=ATOL, rtol=0, err_msg=f"row {i}")


def test_greedy_forks_equal_one_sample(model):
    """Greedy n = 3 of two prompts: every sample is its prompt's single greedy continuation (the sampled forks'
    shapes: their programs)."""
    three = jaxkv.generate(model, FORKED, n=FORK_N, max_new_tokens=FORK_NEW, stop_tokens=[], logprobs=1,
                           page_size=4).tokens
    assert three == [alone(model, p, FORK_NEW).tokens[0] for p in FORKED for _ in range(FORK_N)]


def test_beam_search_matches_transformers(tmp_path_factory):
    """Three beams and three hypotheses per prompt, stop ids reached at different steps, a ragged batch:
    transformers' tokens and scores (its beams reorder its cache's linear states; jaxkv's fork gathers them). The
    stop ids are tokens transformers' greedy run of the prompts reaches (no jaxkv program compiled for them)."""
    hf, model, _ = loaded("dense", tmp_path_factory)
    prompts = SINGLE + RAGGED[:2]
    greedy = hf_greedy(hf, prompts, 7)
    stops = sorted({greedy[0][3], greedy[1][6]})
    check_beam_search(hf, model, prompts, stops)


def test_fork_gathers_and_release_zeroes_states(model):
    """The cache operations on the state rows themselves: a fork's row i holds row parents[i]'s states (a negative
    parent: zeros), a release zeroes exactly the released rows, and the bytes are the planner's."""
    c = model.config
    cache = PagedKVCache.allocate(c, 3, num_pages=8, page_size=4, max_len=16)
    rng = np.random.default_rng(0)
    for layer in c.linear_layers:
        conv, rec = cache.state(layer)
        cache = cache.with_state(layer, jnp.asarray(rng.normal(size=conv.shape)),
                                 jnp.asarray(rng.normal(size=rec.shape)))
    forked = cache.fork([2, 0, 2, -1])
    for layer in c.linear_layers:
        for before, after in zip(cache.state(layer), forked.state(layer)):
            before, after = np.asarray(before), np.asarray(after)
            np.testing.assert_array_equal(after[:3], before[[2, 0, 2]])
            assert not after[3].any()
    released = forked.release([0, 3])
    for layer in c.linear_layers:
        for before, after in zip(forked.state(layer), released.state(layer)):
            before, after = np.asarray(before), np.asarray(after)
            assert not after[0].any() and not after[3].any()
            np.testing.assert_array_equal(after[1:3], before[1:3])
    assert [k.shape[0] for k in cache.keys] == [0, 0, 8]  # the linear layers' pools are empty placeholders
    assert cache.nbytes() == jaxkv.memory.pool_bytes(c, num_pages=8, page_size=4, rows=3)
    assert forked.nbytes() == jaxkv.memory.pool_bytes(c, num_pages=8, page_size=4, rows=4)
    assert cache.state_nbytes() == 3 * c.state_bytes_per_sequence() > 0


def test_planner_counts_the_state_rows(model):
    """generate(n=...)'s allocation is the planner's: the pool plus one state row per padded row (8 for 6 samples);
    the peak in use counts one state per sample; without sharing, one state per sample too (the forked tests'
    shapes: their programs)."""
    c = model.config
    prompts = FORKED
    out = jaxkv.generate(model, prompts, n=FORK_N, max_new_tokens=FORK_NEW, stop_tokens=[], page_size=4, logprobs=1)
    plan = jaxkv.memory.plan_pages(c, [len(p) for p in prompts], FORK_NEW, n=FORK_N, page_size=4)
    state = c.state_bytes_per_sequence()
    s = out.stats
    assert s["kv_cache_bytes"] == plan.allocated_bytes == jaxkv.memory.pool_bytes(
        c, num_pages=plan.num_pages, page_size=4, rows=plan.padded_rows)
    assert plan.allocated_bytes - plan.num_pages * jaxkv.memory.page_bytes(c, 4) == 8 * state
    assert s["kv_bytes_in_use_peak"] == s["pages_in_use_peak"] * jaxkv.memory.page_bytes(c, 4) + 6 * state
    assert s["kv_cache_bytes_unshared"] == sum(FORK_N * jaxkv.kv_cache_bytes(c, tokens=len(p) + FORK_NEW, batch=1)
                                               for p in prompts)


def test_engine_with_random_arrivals_equals_generate_alone(model):
    """Continuous batching: 8 requests arriving at random points into 3 slots, prompts of up to 30 tokens in chunks
    of 8 (each chunk continues the staging row's state; right-padded chunks), rows moving from staging into slots:
    each request's tokens are generate's of it alone, its log-probabilities the no-cache recomputation's, and
    afterwards every slot, page and state row is free (zeroed). Then a row moving down to a lower slot with its
    recurrent state (the random arrivals need no move): three of the requests again, submitted together, the
    longest last, so it is left alone in slot 2 and decodes on at width 2."""
    from helpers.engine import assert_all_free, drain, recomputed_logprobs

    rng = np.random.default_rng(5)
    arrivals = [(rng.integers(3, 160, int(rng.integers(1, 30))).tolist(), int(rng.integers(1, 20)),
                 {"stop_tokens": []}) for _ in range(8)]
    engine = jaxkv.Engine(model, **ENGINE)
    ids = drain(engine, arrivals, rng)
    assert_all_free(engine)
    for r in engine.results():
        prompt, new, _ = ids[r.id]
        assert r.tokens == alone(model, prompt, new).tokens[0]
        _, want = recomputed_logprobs(model, prompt, r.tokens)
        np.testing.assert_allclose(r.logprobs, want, atol=ATOL)

    moves = engine.stats.get("slot_moves", 0)
    tail = [arrivals[7], arrivals[4], arrivals[1]]  # 1 and 4 new tokens, then 17
    for prompt, new, kwargs in tail:
        engine.submit(prompt, max_new_tokens=new, **kwargs)
    results = engine.results()
    assert engine.stats["slot_moves"] > moves
    for (prompt, new, _), r in zip(tail, results):
        assert r.tokens == alone(model, prompt, new).tokens[0]
    assert_all_free(engine)


def test_engine_cancel_frees_the_state_row(model):
    """A request cancelled mid-decode gives its slot's state row back zeroed; the next request in that slot
    decodes as it would alone (the random-arrivals test's engine geometry: its programs, compiled once; the other
    slots stay empty, so the next request takes the cancelled one's slot 0)."""
    from helpers.engine import assert_all_free

    engine = jaxkv.Engine(model, **ENGINE)
    first = engine.submit(RAGGED[1], max_new_tokens=30, stop_tokens=[])
    engine.step()
    engine.step()
    assert engine.cancel(first)
    engine.step()
    again = engine.generate([RAGGED[2]], max_new_tokens=12, stop_tokens=[])[0]
    assert again.tokens == alone(model, RAGGED[2], 12).tokens[0]
    assert_all_free(engine)


def shared_prompts(seed):
    """Three prompts sharing a 21-token head (5 pages of 4, the last partly), then their own tails."""
    rng = np.random.default_rng(seed)
    head = rng.integers(3, 160, 21).tolist()
    return [head + rng.integers(3, 160, n).tolist() for n in (7, 5, 11)]


def test_prefix_hits_resume_from_state_snapshots(model):
    """A prefix cache with snapshots every 8 tokens (2 pages of 4): a first call caches its prompt's pages and
    the states at 8, 16, 24; later prompts sharing 21 tokens resume at 16 (the last snapshot boundary inside the
    shared part: a hit between page boundaries falls back to it), the same prompt again at 24 (a hit at a boundary,
    its last token left to prefill), and every call's tokens and logprobs equal generate without a cache (each
    prompt alone: the one batch-1 program every plain run here compiles)."""
    p1, p2, p3 = shared_prompts(0)
    pc = jaxkv.PrefixCache(model, num_pages=96, page_size=4, snapshot_interval=8)
    first = jaxkv.generate(model, [p1], max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
    assert first.stats["prefix_hit_tokens"] == 0 and pc.cached_snapshots == 3  # at 8, 16, 24 of 28 tokens
    calls = [[p2, p1], [p3]]
    hits = [16 + 24, 16]
    for prompts, want_hit in zip(calls, hits):
        out = jaxkv.generate(model, prompts, max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
        plain = [alone(model, p, 10) for p in prompts]
        assert out.stats["prefix_hit_tokens"] == want_hit
        assert out.tokens == [r.tokens[0] for r in plain]
        np.testing.assert_allclose(np.array(out.logprobs), np.array([r.logprobs[0] for r in plain]), atol=ATOL,
                                   rtol=0)


def test_a_prefix_without_a_snapshot_is_not_a_hit(model):
    """Pages alone cannot resume a hybrid model: with the only snapshots evicted (max_snapshots=1, a second
    prompt's boundary took the slot) the first prompt's cached pages give no hit, and the call is still exact.
    (Snapshots every 8 tokens and 10 new tokens in every call: the shapes
    test_prefix_hits_resume_from_state_snapshots compiled.)"""
    p1, p2, _ = shared_prompts(1)
    other = list(reversed(p1))
    pc = jaxkv.PrefixCache(model, num_pages=96, page_size=4, snapshot_interval=8, max_snapshots=1)
    jaxkv.generate(model, [p1], max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
    # evicts p1's snapshot
    jaxkv.generate(model, [other], max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
    assert pc.cached_snapshots == 1 and pc.cached_pages >= 12
    out = jaxkv.generate(model, [p1], max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
    assert out.stats["prefix_hit_tokens"] == 0
    assert out.tokens == alone(model, p1, 10).tokens


def test_engine_prefix_cache_with_snapshots(model):
    """The engine in a snapshotting prefix cache (chunks of 8 = the interval): requests sharing a head hit the
    snapshot boundary and resume from its state; every request equals generate alone; afterwards the pool is
    back with the prefix cache (only its cached pages held) and the snapshots stay for later requests. (The
    other engines' geometry and pool size: their programs.)"""
    prompts = shared_prompts(2)
    pc = jaxkv.PrefixCache(model, num_pages=ENGINE_PAGES, page_size=4, snapshot_interval=8)
    engine = jaxkv.Engine(model, **ENGINE, prefix_cache=pc)
    first = engine.generate(prompts[:1], max_new_tokens=6, stop_tokens=[])
    assert engine.stats["prefix_hit_tokens"] == 0 and pc.cached_snapshots >= 2
    rest = engine.generate(prompts[1:], max_new_tokens=6, stop_tokens=[])
    assert engine.stats["prefix_hit_tokens"] == 16 + 16
    for prompt, r in zip(prompts, first + rest):
        assert r.tokens == alone(model, prompt, 6).tokens[0]
    assert engine.pending == 0 and pc.lent_to is None and pc.free_pages() == pc.num_pages - pc.cached_pages
    assert pc.cached_snapshots >= 4


def test_snapshot_settings_are_checked(model):
    with pytest.raises(ValueError, match="multiple of page_size"):
        jaxkv.PrefixCache(model, page_size=4, snapshot_interval=6)
    with pytest.raises(ValueError, match="max_snapshots must be"):
        jaxkv.PrefixCache(model, page_size=4, max_snapshots=0)
    pc = jaxkv.PrefixCache(model, num_pages=32, page_size=4, snapshot_interval=8, max_snapshots=3)
    assert pc.snapshot_bytes == model.config.state_bytes_per_sequence()
    assert pc.nbytes() == jaxkv.memory.pool_bytes(model.config, num_pages=32, page_size=4) + 3 * pc.snapshot_bytes


def test_a_call_that_fails_half_way_leaves_the_snapshots_as_they_were(model):
    """A stream callback that raises mid-decode (after the prefill took its snapshots): the prefix cache's index,
    snapshots and pool are as before the call, and the next call hits exactly what was cached before."""
    p1, p2, _ = shared_prompts(3)
    pc = jaxkv.PrefixCache(model, num_pages=96, page_size=4, snapshot_interval=8)
    jaxkv.generate(model, [p1], max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
    before = (pc.pages(), list(pc._snapshot_index.items()), pc.free_pages())

    def fails(i, token):
        raise KeyError("from the stream")

    longer = p2  # 26 tokens: 16 hit; its own boundary at 24 would be a new snapshot (the shapes of p1's call)
    with pytest.raises(KeyError, match="from the stream"):
        jaxkv.generate(model, [longer], max_new_tokens=10, stop_tokens=[], prefix_cache=pc, stream=fails)
    assert (pc.pages(), list(pc._snapshot_index.items()), pc.free_pages()) == before
    out = jaxkv.generate(model, [longer], max_new_tokens=10, stop_tokens=[], logprobs=1, prefix_cache=pc)
    assert out.stats["prefix_hit_tokens"] == 16
    assert out.tokens == alone(model, longer, 10).tokens


@pytest.mark.parametrize("where", ["contiguous", "paged", "engine"])
def test_greedy_speculation_equals_plain(model, plain, where):
    """n-gram speculation (k = 4, always verifying) over a hybrid model: nearly every proposal is rejected on this
    random model, so each verify writes 5 tokens and keeps 1, and a state that kept the rejected ones would change
    every later token: greedy tokens and logprobs equal plain decoding's (contiguous and paged loops, the engine:
    the other engines' geometry, one decode width, so one speculative decode program compiles)."""
    prompts = PROMPTS
    spec = jaxkv.Speculation("ngram", num_tokens=4, adaptive=False)
    if where == "engine":
        engine = jaxkv.Engine(model, **dict(ENGINE, decode_widths=[3]), speculative=spec)
        results = engine.generate(prompts, max_new_tokens=NEW, stop_tokens=[])
        assert engine.stats["spec_verifies"] > 0
        tokens, logprobs = [r.tokens for r in results], [r.logprobs for r in results]
    else:
        out = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[], logprobs=1, speculative=spec,
                             page_size=4 if where == "paged" else None)
        assert out.stats["spec_verifies"] > 0
        tokens, logprobs = out.tokens, out.logprobs
    assert tokens == plain.tokens
    np.testing.assert_allclose(np.array(logprobs), np.array(plain.logprobs), atol=ATOL, rtol=0)


def test_a_verify_keeps_the_state_after_its_kept_tokens(model):
    """The verify mechanism itself, at every acceptance: 5 tokens through the cache with step_states, the states
    after the first `kept` kept and the length rewound to them; the next token's logits equal those after feeding
    only the kept tokens one by one (kept 1, 3 and 5)."""
    import functools

    import jax

    from jaxkv.cache.contiguous import KVCache
    from jaxkv.decoding import programs

    c = model.config
    forward = jax.jit(functools.partial(programs.forward, config=c, attention="xla"),
                      static_argnames=("prefill", "step_states"))
    prompt = jnp.asarray([RAGGED[1]], jnp.int32)
    block = jnp.asarray([[5, 77, 140, 9, 31]], jnp.int32)
    nxt = jnp.asarray([[101]], jnp.int32)
    _, cache = forward(model.params, prompt, KVCache.allocate(c, 1, 64), prefill=True)
    _, verified_all, after_each = forward(model.params, block, cache, step_states=True)
    for kept in (1, 3, 5):
        verified = verified_all.keep_step_states(after_each, kept).advance(kept - 5)
        sequential = cache
        for t in range(kept):
            _, sequential = forward(model.params, block[:, t:t + 1], sequential)
        want, _ = forward(model.params, nxt, sequential)
        got, _ = forward(model.params, nxt, verified)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=0, err_msg=f"kept {kept}")
