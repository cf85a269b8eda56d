"""Speculative decoding (`jaxkv.Speculation`, `jaxkv.decoding.speculation`): greedy output token for token equal
to plain decoding, the acceptance rule's output distribution equal to the sampler's (chi-square), the cache left
as plain decoding leaves it, and bad combinations refused before compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import jaxkv
from jaxkv import Speculation
from jaxkv.config import Config
from jaxkv.decoding import loop, speculation
from jaxkv.sampling import Sampler
from tests.helpers.models import CONFIGS, MTP_CONFIG, model_for, with_mtp
from tests.helpers.tolerances import tolerance

# One worker runs the whole file, in order: tests on the same model and shapes then share compiled programs (the
# plain and the speculative loops of "gqa" and "mla", the draft loop), which cuts the file's compiles by a third
# (the suite's time on 2 cores). The test that swaps the proposer clears JAX's caches: it runs after them.
pytestmark = pytest.mark.xdist_group("speculation")

# Two layers, one of each kind (a third layer only lengthened each compile).
MIXED = Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
               sliding_window=6, layer_types=("sliding_attention", "full_attention"), max_positions=256)
MLA = MTP_CONFIG
_extra = {}


def model(name):
    if name in CONFIGS:
        return model_for(name)
    if name not in _extra:
        _extra[name] = jaxkv.Model.random({"mixed": MIXED, "mla": MLA}[name], seed=2)
    return _extra[name]


def prompts(V, seed=0):
    """A prompt that repeats a passage (the n-gram proposer finds matches) and a random one."""
    rng = np.random.default_rng(seed)
    passage = rng.integers(0, V, 9).tolist()
    return [passage * 3 + passage[:4], rng.integers(0, V, 13).tolist()]


# No "mqa": the same contiguous cache and verify as "gqa" with one KV head; mqa drafts under speculation in
# test_draft_model_greedy_equals_plain_decoding[mqa] (its cache kept in step through rejections and plain steps).
# No "gqa-wide-heads" either: the same contiguous cache and verify as "gqa"; a verify is the model's multi-token
# forward (prefill's), whose head_dim != d_model / n_heads, q/k/v bias and rope scaling the family and equivalence
# tests check against recompute (its 3 compiled programs here cost ~9 s of the suite's time on 2 cores).
@pytest.mark.parametrize("name", ["gqa", "learned", "sliding", "mixed", "mla"])
def test_greedy_equals_plain_decoding(name):
    m = model(name)
    ps = prompts(m.config.vocab_size)
    plain = jaxkv.generate(m, ps, max_new_tokens=24, stop_tokens=[])
    # The ragged pair verifying every pass on every model (each cache kind: contiguous, ring, mixed, latent), and
    # on "gqa" the repeating prompt alone with the adaptive rule and k = 3 (the adaptive rule is the loop's, not
    # the cache's: one more compiled loop per model would only repeat it; the adaptive draft and MTP loops run in
    # test_draft_model_greedy_equals_plain_decoding[gqa] and test_mtp_greedy_equals_plain_decoding_...).
    runs = [(Speculation("ngram", 4, adaptive=False), ps)]
    if name == "gqa":
        runs.append((Speculation("ngram", 3), ps[:1]))
    for spec, rows in runs:
        got = jaxkv.generate(m, rows, max_new_tokens=24, stop_tokens=[], speculative=spec)
        assert got.tokens == plain.tokens[: len(rows)], (name, spec)
        assert got.stats["target_forwards"] <= 23 and got.stats["spec_verifies"] > 0
        np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(plain.logprobs[: len(rows)]),
                                   **tolerance("logprobs", "float32"))


# int8 only: its verify writes k + 1 tokens with per-token scales (the quantized path); a bfloat16 cache is the
# float32 path at another dtype (test_greedy_equals_plain_decoding covers that path's verify writes).
@pytest.mark.parametrize("cache_dtype", ["int8"])
def test_greedy_equal_with_cache_dtypes(cache_dtype):
    m = model("gqa")
    ps = prompts(m.config.vocab_size, seed=1)
    plain = jaxkv.generate(m, ps, max_new_tokens=20, stop_tokens=[], cache_dtype=cache_dtype)
    got = jaxkv.generate(m, ps, max_new_tokens=20, stop_tokens=[], cache_dtype=cache_dtype,
                         speculative=Speculation("ngram", adaptive=False))
    assert got.tokens == plain.tokens


@pytest.mark.parametrize("draft_name", ["mqa", "gqa"])
def test_draft_model_greedy_equals_plain_decoding(draft_name):
    """Another model with the same vocabulary drafts (mqa), or the target drafts for itself (every proposal
    kept): the tokens are plain decoding's either way; the draft's cache follows through plain steps too."""
    m, draft = model("gqa"), model(draft_name)
    ps = prompts(m.config.vocab_size, seed=8)
    plain = jaxkv.generate(m, ps, max_new_tokens=22, stop_tokens=[])
    # the adaptive rule once (on "gqa"): it decides per batch whether to speculate, whatever the draft's cache
    for adaptive in (False, True) if draft_name == "gqa" else (False,):
        got = jaxkv.generate(m, ps, max_new_tokens=22, stop_tokens=[],
                             speculative=Speculation("draft", 3, draft=draft, adaptive=adaptive))
        assert got.tokens == plain.tokens, (draft_name, adaptive)
    if draft_name == "gqa":
        assert got.stats["spec_acceptance_rate"] > 0.9 and got.stats["target_forwards"] <= 8


def test_sampled_draft_equal_to_the_target_keeps_every_proposal():
    """q == p: min(1, p/q) = 1, so every proposal is kept (a rule that compared q with unfiltered logits, or a
    draft drawing with other settings, would reject some)."""
    m = model("gqa")
    # The ragged pair and the draft plan of test_draft_model_greedy_equals_plain_decoding[gqa] (its compiled loop;
    # the sampler's settings are traced): 20 tokens after the first, 5 verifies of 3 + 1 per row.
    got = jaxkv.generate(m, prompts(m.config.vocab_size, seed=9), max_new_tokens=21, stop_tokens=[],
                         temperature=0.8, top_k=30, seed=2, speculative=Speculation("draft", 3, draft=m,
                                                                                      adaptive=False))
    assert got.stats["spec_accepted"] == got.stats["spec_proposed"] == 2 * 15 and got.stats["target_forwards"] == 5
    assert all(len(row) == 21 for row in got.tokens)


def test_sampled_output_is_reproducible_and_streams_what_it_returns():
    m = model("gqa")
    ps = prompts(m.config.vocab_size, seed=6)
    seen = {0: [], 1: []}
    # k = 4 on the ragged pair: test_greedy_equals_plain_decoding[gqa]'s compiled loop (the sampler's settings are
    # traced) serves the call without a stream
    spec = Speculation("ngram", 4, adaptive=False)
    a = jaxkv.generate(m, ps, max_new_tokens=16, temperature=0.9, top_k=20, seed=7, stop_tokens=[],
                       speculative=spec, stream=lambda b, t: seen[b].append(t))
    b = jaxkv.generate(m, ps, max_new_tokens=16, temperature=0.9, top_k=20, seed=7, stop_tokens=[],
                       speculative=spec)
    assert a.tokens == b.tokens and [seen[0], seen[1]] == a.tokens
    assert all(len(t) == 16 for t in a.tokens)


def test_stops_where_plain_decoding_stops_and_never_exceeds_the_budget():
    # The ragged pair with k = 4 (not adaptive): test_greedy_equals_plain_decoding[gqa]'s compiled plain and
    # speculative loops (a capacity of 256 slots for any budget here; max_new_tokens and the stop ids are traced).
    # Row 0 stops at a token of its own continuation; row 1 stops where that token comes, if it does.
    m = model("gqa")
    ps = prompts(m.config.vocab_size, seed=3)
    free = jaxkv.generate(m, ps, max_new_tokens=30, stop_tokens=[]).tokens[0]
    stop = free[len(free) // 2]
    plain = jaxkv.generate(m, ps, max_new_tokens=30, stop_tokens=[stop])
    for budget in (30, 7, 2, 1):
        spec = jaxkv.generate(m, ps, max_new_tokens=budget, stop_tokens=[stop],
                              speculative=Speculation("ngram", adaptive=False))
        want = jaxkv.generate(m, ps, max_new_tokens=budget, stop_tokens=[stop])
        assert spec.tokens == want.tokens and spec.finish_reasons == want.finish_reasons
        assert all(len(t) <= budget for t in spec.tokens)
    assert plain.finish_reasons[0] == "stop" and plain.tokens[0][-1] == stop


def _plain_and_speculative(m, prefill, history, length, *, max_steps: int, k: int = 4):
    """Two greedy rows, 20 new tokens each, decoded plainly and with the n-gram proposer verifying every pass:
    prefill(lookahead) -> (logits, cache) gives each run's cache (lookahead 0 for the plain run, k for the
    speculative one) -> (plain `LoopOut`, speculative `LoopOut`), their tokens checked equal."""
    sampler, stop = Sampler.make(temperature=[0.0, 0.0]), jnp.full((8,), -1, jnp.int32)
    outs = []
    for spec in (None, speculation.Speculation("ngram", k, adaptive=False).check(m)):
        logits, cache = prefill(0 if spec is None else k)
        args = (m.params, cache, logits, jax.random.PRNGKey(0), sampler, stop, jnp.zeros((2,), bool), jnp.int32(20))
        if spec is None:
            out = loop.decode_loop(*args, config=m.config, max_steps=max_steps, rows=None, attention="xla",
                                   stream=None, mesh=None)
        else:
            out = loop.speculative_loop(*args, history, length, config=m.config, max_steps=max_steps,
                                        attention="xla", stream=None, logprobs=0, plan=spec)
        outs.append(out)
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    return outs


def test_cache_after_rejections_equals_plain_decoding():
    m = model("gqa")
    ps = prompts(m.config.vocab_size, seed=5)
    cfg = m.config
    tokens, start = jaxkv.left_pad(ps)
    cap = 64
    history = np.zeros((2, cap + 8), np.int32)
    for b, p in enumerate(ps):
        history[b, : len(p)] = p
    length = np.array([len(p) for p in ps], np.int32)
    plain, spec = _plain_and_speculative(
        m, lambda lookahead: jaxkv.prefill(m.params, tokens, start, config=cfg, capacity=cap), history, length,
        max_steps=cap + 1)
    assert int(spec.verifies) > 0 and int(np.sum(spec.accepted)) < int(np.sum(spec.proposed))
    n = int(plain.cache.length)
    assert int(spec.cache.length) == n
    for a, b in zip(plain.cache.keys + plain.cache.values, spec.cache.keys + spec.cache.values):
        np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n],
                                   **tolerance("speculative cache", "float32"))
    # the first layer's K/V: the same products, written for the same kept tokens
    np.testing.assert_allclose(np.asarray(plain.cache.keys[0])[:, :, :n], np.asarray(spec.cache.keys[0])[:, :, :n],
                               atol=1e-6, rtol=0)


def test_ring_after_rejections_holds_plain_decodings_window():
    """A sliding-window model under speculation keeps a ring of window + k slots (a verify writes k + 1 tokens at
    once); after many rejected proposals its length, and every K/V in the window of the next query (index slot mod
    S), equal plain decoding's ring of `window` slots. With a ring of `window` slots instead the verify's writes
    would overwrite slots its first queries still see (test_greedy_equals_plain_decoding[sliding] fails then)."""
    from jaxkv.decoding import programs

    m = model("sliding")
    cfg, k, window = m.config, 4, m.config.sliding_window
    ps = prompts(cfg.vocab_size, seed=5)
    tokens, start = jaxkv.left_pad(ps)
    history, length = speculation.prompt_history(ps, 2, 64)

    def prefill(lookahead):
        logits, cache = programs.prefill(m.params, tokens, start, config=cfg, capacity=window + lookahead,
                                         attention="xla", cache_dtype="float32", ring=True, mesh=None,
                                         lookahead=lookahead)
        assert cache.ring and cache.capacity == window + lookahead
        return logits, cache

    plain, spec = _plain_and_speculative(m, prefill, history, length, max_steps=64, k=k)
    assert int(spec.verifies) > 0 and int(np.sum(spec.accepted)) < int(np.sum(spec.proposed))
    n = int(plain.cache.length)
    assert int(spec.cache.length) == n
    live = np.arange(n - window + 1, n)  # what the next query (slot n) sees besides itself
    for layer, (a, b) in enumerate(zip(plain.cache.keys + plain.cache.values, spec.cache.keys + spec.cache.values)):
        a, b = np.asarray(a)[:, :, live % window], np.asarray(b)[:, :, live % (window + k)]
        np.testing.assert_allclose(a, b, **(dict(atol=1e-6, rtol=0) if layer in (0, cfg.n_layers)
                                            else tolerance("speculative cache", "float32")))


def test_paged_cache_after_rejections_equals_plain_decoding():
    """Rows of two lengths on pages of 4 slots, a verify of 5 positions every pass (most rejected): each row's
    length, its count of pages, the pool's refcounts and every kept slot's K/V (read through the row's page
    table) equal plain decoding's. Which free page a row takes may differ (a verify reserves for k + 1 slots
    at once, then gives back what the rejected ones took)."""
    from jaxkv.attention.paged_reference import gather_pages
    from jaxkv.decoding import programs

    m = model("gqa")
    cfg = m.config
    ps = prompts(cfg.vocab_size, seed=5)
    tokens, positions = np.zeros((2, 32), np.int32), np.full((2, 32), -1, np.int32)
    for b, p in enumerate(ps):
        tokens[b, : len(p)], positions[b, : len(p)] = p, np.arange(len(p))
    history, length = speculation.prompt_history(ps, 2, 80)
    plain, spec = _plain_and_speculative(
        m, lambda lookahead: programs.prefill_paged(m.params, tokens, positions, jnp.arange(2, dtype=jnp.int32),
                                                    config=cfg, attention="xla", num_pages=32, page_size=4,
                                                    max_pages=16, cache_dtype="float32"),
        history, length, max_steps=65)
    assert int(spec.verifies) > 5 and int(np.sum(spec.accepted)) < int(np.sum(spec.proposed)) / 2
    a, b = plain.cache, spec.cache
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(np.sum(np.asarray(a.page_table) >= 0, axis=1),
                                  np.sum(np.asarray(b.page_table) >= 0, axis=1))
    np.testing.assert_array_equal(np.sort(np.asarray(a.refcounts)), np.sort(np.asarray(b.refcounts)))
    for layer, (ka, kb) in enumerate(zip(a.keys + a.values, b.keys + b.values)):
        ga, gb = gather_pages(ka, a.page_table), gather_pages(kb, b.page_table)
        for row, n in enumerate(np.asarray(a.lengths)):
            np.testing.assert_allclose(np.asarray(ga[row, :, :n]), np.asarray(gb[row, :, :n]),
                                       **(dict(atol=1e-6, rtol=0) if layer == 0
                                          else tolerance("speculative cache", "float32")))


def test_paged_greedy_equals_plain_decoding_with_samples_pages_and_a_prefix_cache():
    """n = 2 samples per prompt, pages of 4 slots (prompts and outputs cross page boundaries), and a prefix cache
    (a miss, then a hit): the tokens are plain decoding's; the pool ends with the free pages and cached prefixes
    a run without speculation leaves."""
    # near_end("gqa") and 16 new tokens: a pool of 32 pages, 16 per row, for plain decoding and with the lookahead,
    # so test_sampled_rows_up_to_the_last_position_... and test_paged_greedy_equals_plain_decoding_up_to_the_last_
    # position share the compiled paged loops (the prompts and outputs stay far from the 64th position)
    m = near_end("gqa")
    ps = prompts(m.config.vocab_size, seed=3)
    spec = Speculation("ngram", 4, adaptive=False)
    plain = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4)
    got = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4, speculative=spec)
    assert got.tokens == plain.tokens and got.stats["spec_verifies"] > 0
    assert got.stats["pages_in_use_peak"] == plain.stats["pages_in_use_peak"]
    # the draft model over forked rows: its own contiguous cache of each row's prompt
    drafted = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4,
                             speculative=Speculation("draft", 3, draft=m, adaptive=False))
    assert drafted.tokens == plain.tokens and drafted.stats["spec_acceptance_rate"] > 0.9
    pools = []
    for speculative in (None, spec):
        pc = jaxkv.PrefixCache(m, num_pages=64, page_size=4)
        for _ in range(2):
            out = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], prefix_cache=pc, speculative=speculative)
            assert out.tokens == plain.tokens[::2]
        assert out.stats["prefix_hit_tokens"] > 0
        pools.append((pc.free_pages(), pc.cached_pages))
    assert pools[0] == pools[1]


def test_mtp_greedy_equals_plain_decoding_and_a_right_module_keeps_every_proposal():
    ps = prompts(MLA.vocab_size, seed=4)
    m = with_mtp(bigram=False)
    plain = jaxkv.generate(m, ps, max_new_tokens=24, stop_tokens=[])
    for adaptive in (False, True):
        got = jaxkv.generate(m, ps, max_new_tokens=24, stop_tokens=[], speculative=Speculation("mtp", 3,
                                                                                                adaptive=adaptive))
        assert got.tokens == plain.tokens and got.stats["spec_verifies"] > 0, adaptive
    m = with_mtp(bigram=True)
    plain = jaxkv.generate(m, ps, max_new_tokens=24, stop_tokens=[])
    assert len(set(plain.tokens[1])) > 2  # g cycles through several tokens: a pair off by one would be refused
    got = jaxkv.generate(m, ps, max_new_tokens=24, stop_tokens=[], speculative=Speculation("mtp", 3, adaptive=False))
    assert got.tokens == plain.tokens
    assert got.stats["spec_accepted"] == got.stats["spec_proposed"] > 0 and got.stats["target_forwards"] <= 7
    # sampled: reproducible by seed, every row its full length (the adaptive loop compiled above: the sampler's
    # settings are traced)
    a, b = (jaxkv.generate(m, ps, max_new_tokens=12, temperature=0.9, seed=5, stop_tokens=[],
                           speculative=Speculation("mtp", 3)) for _ in range(2))
    assert a.tokens == b.tokens and all(len(t) == 12 for t in a.tokens)


def test_mtp_on_the_paged_cache_with_samples_pages_and_a_prefix_cache():
    """The module over a paged pool of its own (forked as the target's rows, one slot behind them): n = 2 with
    pages of 4 slots (prompts of 13 and 6 tokens: the module's fork point is a partly filled page for one prompt
    and a page boundary for the other) and a prefix cache (a miss, then a hit) give plain decoding's tokens, and
    the right module keeps every proposal there too (it must be fed each row's own pairs at its own slots);
    the prefix cache's pool ends as without speculation."""
    rng = np.random.default_rng(7)
    ps = [rng.integers(0, MLA.vocab_size, 13).tolist(), rng.integers(0, MLA.vocab_size, 6).tolist()]
    m = with_mtp(bigram=False)
    plain = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4)
    got = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4,
                         speculative=Speculation("mtp", 3, adaptive=False))
    assert got.tokens == plain.tokens and got.stats["spec_verifies"] > 0
    assert got.stats["pages_in_use_peak"] == plain.stats["pages_in_use_peak"]
    pools = []
    for speculative in (None, Speculation("mtp", 3, adaptive=False)):
        pc = jaxkv.PrefixCache(m, num_pages=64, page_size=4)
        for _ in range(2):
            out = jaxkv.generate(m, ps, max_new_tokens=16, stop_tokens=[], prefix_cache=pc, speculative=speculative)
            assert out.tokens == plain.tokens[::2]
        assert out.stats["prefix_hit_tokens"] > 0
        pools.append((pc.free_pages(), pc.cached_pages))
    assert pools[0] == pools[1]
    right = with_mtp(bigram=True)
    plain = jaxkv.generate(right, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4)
    got = jaxkv.generate(right, ps, max_new_tokens=16, stop_tokens=[], n=2, page_size=4,
                         speculative=Speculation("mtp", 3, adaptive=False))
    assert got.tokens == plain.tokens
    assert got.stats["spec_accepted"] == got.stats["spec_proposed"] > 0


# Issue 50: a request that fits without speculation fits with it. The k lookahead slots are room to speculate, not
# part of the request: where a verify's k + 1 writes would pass the cache's slots or the model's positions (the
# target's, a draft's), the loop takes plain steps (`speculation.room`), as the engine does per slot.
NEAR = 64  # max positions of the models below: their prompts end a few tokens before the last position


def near_end(name):
    """`model(name)` with max positions NEAR (the same weights; "learned" keeps its 256-entry table)."""
    if name == "learned":
        return model(name)
    key = f"{name}@{NEAR}"
    if key not in _extra:
        base = model(name)
        _extra[key] = jaxkv.Model(base.config.replace(max_positions=NEAR), base.params)
    return _extra[key]


def mtp_near_end():
    """`with_mtp(bigram=True)` (every proposal right) with max positions NEAR, its module too."""
    from jaxkv.decoding.mtp import Mtp

    if "mtp@near" not in _extra:
        right = with_mtp(bigram=True)
        m = jaxkv.Model(right.config.replace(max_positions=NEAR), right.params)
        m.mtp = Mtp(right.mtp.config.replace(max_positions=NEAR), right.mtp.params)
        _extra["mtp@near"] = m
    return _extra["mtp@near"]


def repeating(V, n, seed=0):
    """n tokens repeating a 9-token passage (the n-gram proposer finds matches everywhere)."""
    passage = np.random.default_rng(seed).integers(0, V, 9).tolist()
    return (passage * (n // 9 + 1))[:n]


# No "gqa": "mixed" is the same contiguous cache and RoPE at the last position (its full-attention layers too);
# near_end("gqa") runs up to the last position on pages in test_paged_greedy_equals_plain_decoding_up_to_the_last_
# position and test_sampled_rows_up_to_the_last_position_are_reproducible_and_whole.
@pytest.mark.parametrize("name", ["learned", "sliding", "mixed"])
def test_greedy_equals_plain_decoding_up_to_the_last_position(name):
    """A prompt that ends max_new_tokens before the model's last position (the repro's request: refused before,
    with a message naming max_new_tokens + k), beside a short one (only the long row hits the end), on RoPE and
    learned positions (a table of 256), a sliding-window ring (window + k slots, wrapping) and mixed layer
    kinds: the tokens and log-probabilities are plain decoding's, and verifies ran."""
    m = near_end(name)
    P, V, new = m.config.max_positions, m.config.vocab_size, 7
    ps = [repeating(V, P - new, seed=1), np.random.default_rng(2).integers(0, V, 13).tolist()]
    plain = jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[])
    got = jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[],
                         speculative=Speculation("ngram", 4, adaptive=False))
    assert got.tokens == plain.tokens and all(len(t) == new for t in got.tokens)
    assert got.stats["spec_verifies"] > 0
    np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(plain.logprobs),
                               **tolerance("logprobs", "float32"))


def test_sampled_rows_up_to_the_last_position_are_reproducible_and_whole():
    """Sampled, n = 2 samples on pages of 4 slots, rows of two lengths (the long one ends at the last position):
    every row its full length of real tokens (a verify past the positions would give NaN logits: -1, a short
    row), the same tokens for the same seed."""
    m = near_end("gqa")
    V, new = m.config.vocab_size, 9
    ps = [repeating(V, NEAR - new, seed=3), repeating(V, 20, seed=4)]
    a, b = (jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[], temperature=0.9, seed=3, n=2, page_size=4,
                           speculative=Speculation("ngram", 4, adaptive=False)) for _ in range(2))
    assert a.tokens == b.tokens and all(len(t) == new and min(t) >= 0 for t in a.tokens)
    assert a.stats["spec_verifies"] > 0


def test_paged_greedy_equals_plain_decoding_up_to_the_last_position():
    """n = 2 on pages of 4 slots, rows of two lengths, the long one ending at the model's last position, max_len
    given as exactly the longest prompt + max_new_tokens: plain decoding's tokens and peak pages (the pool
    counts the lookahead only as far as the table and positions allow; a pool too small raises RuntimeError)."""
    m = near_end("gqa")
    V, new = m.config.vocab_size, 7
    ps = [repeating(V, NEAR - new, seed=5), repeating(V, 22, seed=6)]
    plain = jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[], n=2, page_size=4, max_len=NEAR)
    got = jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[], n=2, page_size=4, max_len=NEAR,
                         speculative=Speculation("ngram", 4, adaptive=False))
    assert got.tokens == plain.tokens and got.stats["spec_verifies"] > 0
    assert got.stats["pages_in_use_peak"] == plain.stats["pages_in_use_peak"]


def test_max_len_equal_to_prompt_plus_max_new_tokens_is_enough():
    """max_len = the longest prompt + max_new_tokens exactly (no slot for the lookahead), on a model with
    positions to spare: accepted, the cache max_len slots as asked, plain decoding's tokens (the slots, not the
    positions, stop the verifies)."""
    m = model("gqa")
    # max_len 256: the default capacity of the ragged pair of test_greedy_equals_plain_decoding[gqa], whose
    # compiled plain and speculative loops (2 rows, 256 slots, k = 4) serve this test too
    V, new = m.config.vocab_size, 8
    ps = [repeating(V, 248, seed=7), repeating(V, 17, seed=8)]
    kwargs = dict(max_new_tokens=new, stop_tokens=[], max_len=248 + new)
    plain = jaxkv.generate(m, ps, **kwargs)
    got = jaxkv.generate(m, ps, **kwargs, speculative=Speculation("ngram", 4, adaptive=False))
    assert got.tokens == plain.tokens and got.stats["spec_verifies"] > 0
    assert got.stats["kv_cache_bytes"] == plain.stats["kv_cache_bytes"]


@pytest.mark.parametrize("proposer", ["short draft", "mtp", "mtp paged"])
def test_verifies_stop_exactly_where_the_lookahead_no_longer_fits(proposer):
    """Proposals that are always right with k = 3: a 53-token prompt and 11 new tokens fill 64 positions exactly.
    Verifies from lengths 53 and 57 emit 4 tokens each; from 61 the k + 1 writes would reach position 64, so the
    last two tokens are plain steps: 2 verifies, 4 target forwards (with positions to spare, a third verify from
    61 would emit the last two: the budget, not the positions, would end it). "short draft": a target of 4096
    positions, drafting for itself through a copy with 64 (the draft's own positions stop it); "mtp": the
    bigram MTP module on a target (and module) of 64 positions; "mtp paged": the same, 2 samples on pages of 4
    slots (the module's pool and the target's counted as far as the positions reach)."""
    k, prompt, new = 3, 53, 11
    if proposer.startswith("mtp"):
        m, spec = mtp_near_end(), Speculation("mtp", k, adaptive=False)
    else:
        m, spec = model("gqa"), Speculation("draft", k, draft=near_end("gqa"), adaptive=False)
    ps = [repeating(m.config.vocab_size, prompt, seed=9)]
    paged = dict(n=2, page_size=4) if proposer == "mtp paged" else {}
    plain = jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[], **paged)
    got = jaxkv.generate(m, ps, max_new_tokens=new, stop_tokens=[], speculative=spec, **paged)
    assert got.tokens == plain.tokens and got.stats["spec_acceptance_rate"] == 1.0
    assert (got.stats["spec_verifies"], got.stats["target_forwards"]) == (2, 4)


@pytest.mark.parametrize("prompt, new, kwargs", [
    (60, 8, {}),  # the prompt and max_new_tokens past the positions
    (70, 1, {}),  # the prompt alone
    (18, 10, dict(max_len=27)),  # max_len too small
    (18, 10, dict(max_len=27, n=2)),  # the paged cache's
    (60, 8, dict(page_size=4)),
    (18, 10, dict(max_len=NEAR + 1)),  # max_len past the positions
])
def test_errors_name_the_callers_values(prompt, new, kwargs):
    """A request refused with speculation is refused without it, with the same message: the caller's
    max_new_tokens and max_len, never theirs plus the lookahead."""
    m = near_end("gqa")
    ps = [repeating(m.config.vocab_size, prompt)]
    with pytest.raises(ValueError) as plain:
        jaxkv.generate(m, ps, max_new_tokens=new, **kwargs)
    for spec in (Speculation("ngram", 8), Speculation("draft", 4, draft=m)):
        with pytest.raises(ValueError) as got:
            jaxkv.generate(m, ps, max_new_tokens=new, speculative=spec, **kwargs)
        assert str(got.value) == str(plain.value)


def test_a_draft_that_cannot_follow_the_sequence_is_refused_with_the_callers_values():
    """The draft is fed every token, so it must hold the prompt and max_new_tokens (the engine likewise refuses a
    max_len past the draft's positions); the lookahead it need not hold."""
    m, short = model("gqa"), near_end("gqa")
    ps = [repeating(m.config.vocab_size, 60)]
    with pytest.raises(ValueError, match=r"^the draft model has 64 positions; the longest prompt has 60 tokens, "
                                         r"which with max_new_tokens=5 need 65$"):
        jaxkv.generate(m, ps, max_new_tokens=5, speculative=Speculation("draft", 4, draft=short))


def test_room_for_a_verify():
    """`speculation.room`: a verify's k + 1 writes within the slots (not a ring's) and the positions; the
    contiguous cache's longest row (least start) decides, a paged cache's running rows."""
    from jaxkv.cache.contiguous import KVCache
    from jaxkv.cache.paged import PagedKVCache

    cfg, k = CONFIGS["gqa"], 4
    running = jnp.array([True, False])

    def contiguous(length, capacity, start, ring=False):
        cache = KVCache.allocate(CONFIGS["sliding"] if ring else cfg, 2, capacity,
                                 start=jnp.array(start, jnp.int32), ring=ring, lookahead=k if ring else 0)
        assert cache.ring == ring
        return dataclasses.replace(cache, length=jnp.int32(length))

    room = lambda cache, positions: bool(speculation.room(cache, running, k, positions))  # noqa: E731
    assert room(contiguous(27, 32, [0, 5]), 100) and not room(contiguous(28, 32, [0, 5]), 100)  # slots
    assert room(contiguous(20, 32, [8, 9]), 17) and not room(contiguous(20, 32, [8, 7]), 17)  # positions: any row
    assert room(contiguous(100, 12, [0, 0], ring=True), 105) and not room(contiguous(101, 12, [0, 0], ring=True),
                                                                          105)
    paged = PagedKVCache.allocate(cfg, 2, num_pages=8, page_size=4, max_len=16)
    at = lambda lengths: dataclasses.replace(paged, lengths=jnp.array(lengths, jnp.int32))  # noqa: E731
    assert room(at([11, 14]), 100) and not room(at([12, 0]), 100)  # the table; a finished row does not count
    assert room(at([9, 30]), 14) and not room(at([10, 0]), 14)


RIGHT_K, WRONG_K = 4, 3  # the oracle's proposals: all right with k = 4, all wrong with k = 3 (k is static)


def _oracle(monkeypatch):
    """Replaces the n-gram proposer by one that proposes the true greedy continuation (k = RIGHT_K: every proposal
    correct) or tokens it is not (k = WRONG_K: every proposal wrong), read from a plain run's output. k is a
    static argument, so both loops trace the patched proposer after one clear of JAX's caches."""
    def propose(history, length, k, ngram_min, ngram_max):
        truth = jnp.asarray(_oracle.truth)  # [P]: the prompt and its plain greedy continuation
        index = jnp.clip(length[:, None] + jnp.arange(k)[None, :], 0, truth.shape[0] - 1)
        tokens = truth[index]
        if k == WRONG_K:
            tokens = (tokens + 1) % _oracle.vocab
        else:
            assert k == RIGHT_K
        return tokens.astype(jnp.int32), jnp.ones(length.shape, bool)

    monkeypatch.setattr(speculation, "ngram_propose", propose)
    jax.clear_caches()


def test_all_or_none_accepted(monkeypatch):
    """Every proposal right, then every one wrong: one plain reference for both (one row: the oracle reads one
    continuation). After every test
    that shares compiled programs: swapping the proposer clears JAX's caches."""
    m = model("gqa")
    prompt = prompts(m.config.vocab_size, seed=4)[0]
    plain = jaxkv.generate(m, [prompt], max_new_tokens=21, stop_tokens=[])
    _oracle.truth = np.array(prompt + plain.tokens[0] + [0] * 40, np.int32)
    _oracle.vocab = m.config.vocab_size
    _oracle(monkeypatch)
    try:
        got = {right: jaxkv.generate(m, [prompt], max_new_tokens=21, stop_tokens=[],
                                     speculative=Speculation("ngram", RIGHT_K if right else WRONG_K,
                                                             adaptive=False))
               for right in (True, False)}
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    for right, out in got.items():
        assert out.tokens == plain.tokens, right
        s = out.stats
        if right:  # 20 tokens after the first: 4 verifies of 5, 0 plain steps
            assert s["spec_acceptance_rate"] == 1.0 and s["target_forwards"] == 4
            assert s["tokens_per_target_forward"] == 5.0
        else:
            assert s["spec_accepted"] == 0 and s["target_forwards"] == 20 and s["spec_proposed"] > 0


def _first_tokens(logits, proposals, sampler, q, n):
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    if q is not None:  # the proposer draws its proposals from q, a fresh draw per sample
        draws = jax.vmap(lambda kk: jax.random.categorical(kk, jnp.log(q[0]), axis=-1))(
            jax.random.split(jax.random.PRNGKey(1), n)).astype(jnp.int32)  # [n, k]
    else:
        draws = jnp.broadcast_to(proposals, (n,) + proposals.shape[1:])

    def one(key, d):
        out = speculation.verify(logits, d[None], key, sampler, q=q)
        return out.tokens[0]

    return np.asarray(jax.jit(jax.vmap(one))(keys, draws))


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_outcome_follows_the_filtered_distribution(with_q):
    """The first emitted token, over many seeded verifies, against the sampler's own distribution (after the
    temperature and top-k filters): a rule that skipped the residual resampling, or computed min(1, p/q) from
    the unfiltered logits, fails this."""
    V, k, n = 8, 3, 40000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, k + 1, V)) * 1.5, jnp.float32)
    sampler = Sampler.make(temperature=0.7, top_k=6)
    q = jnp.asarray(rng.dirichlet(np.ones(V), size=(1, k)), jnp.float32) if with_q else None
    proposals = jnp.asarray([[int(jnp.argmax(logits[0, 1])), 2, 5]], jnp.int32)
    first = _first_tokens(logits, proposals, sampler, q, n)[:, 0]
    p = np.asarray(sampler.distribution(logits[:, 0]))[0].astype(np.float64)
    observed = np.bincount(first, minlength=V)
    assert observed[p == 0].sum() == 0  # a filtered-out token never comes out
    live = p > 0
    chi2, pvalue = scipy_stats.chisquare(observed[live], p[live] / p[live].sum() * n)
    assert pvalue > 1e-3, (observed, p * n)


def test_the_chi_square_test_catches_a_rule_without_residual_resampling(monkeypatch):
    """The test above must be able to fail: with rejected positions drawn from p instead of the residual, the
    same check rejects."""
    V, k, n = 8, 3, 40000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, k + 1, V)) * 1.5, jnp.float32)
    sampler = Sampler.make(temperature=0.7, top_k=6)
    p = np.asarray(sampler.distribution(logits[:, 0]))[0].astype(np.float64)
    proposals = jnp.asarray([[int(np.argmax(p)), 2, 5]], jnp.int32)
    # The bug: a rejected position drawn from p itself, the rejected proposal not taken out (q's one-hot zeroed).
    monkeypatch.setattr(jax.nn, "one_hot", lambda x, num, dtype=jnp.float32: jnp.zeros(x.shape + (num,), dtype))
    first = _first_tokens(logits, proposals, sampler, None, n)[:, 0]
    monkeypatch.undo()
    observed = np.bincount(first, minlength=V)
    live = p > 0
    assert scipy_stats.chisquare(observed[live], p[live] / p[live].sum() * n).pvalue < 1e-6


def test_ngram_proposer():
    history = jnp.asarray([[5, 6, 7, 8, 5, 6, 0, 0], [1, 2, 3, 4, 9, 9, 9, 9], [3, 3, 3, 0, 0, 0, 0, 0]], jnp.int32)
    length = jnp.asarray([6, 4, 3], jnp.int32)
    proposals, found = speculation.ngram_propose(history, length, 3, 1, 3)
    # row 0: "5 6" occurred at 0, followed by 7 8 5; row 1: nothing repeats; row 2: "3 3" at 0, period 1
    assert found.tolist() == [True, False, True]
    assert proposals[0].tolist() == [7, 8, 5] and proposals[2].tolist() == [3, 3, 3]
    assert proposals[1].tolist() == [4, 4, 4]


@pytest.mark.parametrize("make, message", [
    (lambda m: Speculation("beam"), "must be one of"),
    (lambda m: Speculation("ngram", 0), "num_tokens must be an integer in"),
    (lambda m: Speculation("ngram", ngram_min=3, ngram_max=2), "exceeds ngram_max"),
    (lambda m: Speculation("draft"), "needs draft="),
    (lambda m: Speculation("ngram", draft=m), "only for method 'draft'"),
])
def test_bad_speculation_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make(model("gqa"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative=Speculation("mtp")), "multi-token-prediction"),
    (dict(speculative=Speculation("draft", draft=jaxkv.Model.random(CONFIGS["gqa"].replace(vocab_size=50)))),
     "vocabulary"),
    (dict(speculative=Speculation("ngram"), sampler=lambda logits, key: jnp.argmax(logits, -1)), "custom sampler"),
    (dict(speculative=Speculation("ngram", 8), n=2, max_len=27), "= 28 exceeds max_len=27"),
    (dict(speculative=Speculation("draft", draft="small")), "must be a jaxkv.Model"),
    (dict(speculative="ngram"), "must be a jaxkv.Speculation"),
    (dict(speculative=Speculation("ngram", 8), max_len=27), r"18 \+ 10 = 28 exceeds max_len=27"),
])
def test_bad_generate_combinations_fail_before_compute(kwargs, message):
    m = kwargs.pop("model", lambda: model("gqa"))()
    with pytest.raises(ValueError, match=message):
        jaxkv.generate(m, [[1, 2, 3] * 6], max_new_tokens=10, **kwargs)
