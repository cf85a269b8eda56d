"""The engine with speculation (`Engine(..., speculative=jaxkv.Speculation("ngram"))`, and a draft model, issue 29):
greedy requests emit the tokens plain decoding emits, sampled ones draw what they draw alone in the engine whatever
shares the batch, stops and budgets hold, pages all come back, and acceptance lengths never recompile."""

import numpy as np
import pytest

import jaxkv
from jaxkv import Speculation
from jaxkv.engine import Engine
from helpers.compiles import count_compiles
from helpers.models import model_for, with_mtp
from helpers.engine import alone, assert_all_free, drain, recomputed_logprobs
from helpers.tolerances import atol


def repeating(rng, V=97):
    """A prompt that quotes a passage several times (the n-gram proposer finds matches) or a random one."""
    if rng.random() < 0.6:
        passage = rng.integers(1, V, int(rng.integers(3, 9))).tolist()
        return (passage * 6)[: int(rng.integers(8, 40))]
    return rng.integers(1, V, int(rng.integers(1, 30))).tolist()


def test_greedy_requests_with_random_arrivals_equal_plain_decoding_and_give_every_page_back():
    model = model_for("gqa")
    rng = np.random.default_rng(11)
    engine = Engine(model, slots=3, max_len=96, page_size=4, prefill_chunk=16, prefill_rows=2,
                    speculative=Speculation("ngram", 3, adaptive=False))
    arrivals = [(repeating(rng), int(rng.integers(1, 28)), {}) for _ in range(8)]
    # a stop token inside what the proposer predicts: the request ends exactly where plain decoding ends
    stop_prompt = arrivals[0][0]
    plain = alone(model, stop_prompt, 24).tokens[0]
    arrivals.append((stop_prompt, 24, dict(stop_tokens=[plain[5]])))
    ids = drain(engine, arrivals, rng)
    assert_all_free(engine)
    stats = engine.stats
    assert stats["spec_verifies"] > 0 and 0 < stats["spec_accepted"] < stats["spec_proposed"]
    assert stats["tokens_per_target_forward"] > 1.0
    for r in engine.results():
        prompt, new, kwargs = ids[r.id]
        want = alone(model, prompt, new, **kwargs).tokens[0]
        assert r.tokens == want, (prompt, new, kwargs)
        assert r.finish_reason == ("stop" if kwargs else "length") and len(r.tokens) <= new
        _, logp = recomputed_logprobs(model, prompt, r.tokens)
        np.testing.assert_allclose(r.logprobs, logp, atol=atol("logprobs"))


def test_sampled_and_plain_requests_draw_what_each_draws_alone_in_the_engine():
    """Sampled speculative requests beside greedy ones and ones the proposer cannot predict: each request's
    tokens equal its run alone in a speculative engine (its speculation is its own, never the batch's)."""
    model = model_for("gqa")
    rng = np.random.default_rng(5)
    settings = [dict(temperature=0.8, seed=1), dict(), dict(temperature=1.0, top_k=8, seed=2),
                dict(temperature=0.7, top_p=0.9, seed=3), dict(temperature=1.2, min_p=0.05, seed=4), dict()]
    arrivals = [(repeating(rng), int(rng.integers(4, 20)), s) for s in settings]
    ids = drain(together := adaptive_ngram_engine(), arrivals, rng)
    results = together.results()
    assert together.stats["spec_verifies"] > 0
    single = adaptive_ngram_engine()
    for r in results:
        prompt, new, kwargs = ids[r.id]
        kwargs = dict(kwargs, stop_tokens=[])
        assert r.tokens == single.generate([prompt], max_new_tokens=new, **kwargs)[0].tokens, kwargs
        assert len(r.tokens) == new
    assert_all_free(together)


def adaptive_ngram_engine():
    """The adaptive n-gram engine of the two tests below (one configuration: they share its compiled programs)."""
    return Engine(model_for("gqa"), slots=3, max_len=96, page_size=4, prefill_chunk=16,
                  speculative=Speculation("ngram", 4))


def test_no_recompiles_after_warm_up_as_acceptance_varies():
    rng = np.random.default_rng(3)
    engine = adaptive_ngram_engine()  # the sampled test's configuration: warm_up still compiles every width
    engine.warm_up()
    engine.generate([repeating(rng)], max_new_tokens=3, temperature=0.8, top_k=5, seed=1, logprobs=2,
                    stop_tokens=[])
    requests = [dict(prompt=repeating(rng), max_new_tokens=int(rng.integers(1, 40)),
                     **[dict(), dict(temperature=1.0, seed=5), dict(logprobs=3)][i % 3]) for i in range(24)]
    with count_compiles() as c:
        results = engine.generate(requests, stop_tokens=[])
    assert c["n"] == 0
    assert all(len(r.tokens) == q["max_new_tokens"] for r, q in zip(results, requests))
    assert engine.stats["spec_verifies"] > 0
    assert_all_free(engine)


def test_draft_model_in_the_engine_equals_plain_decoding_also_after_prefix_hits():
    """A draft model (another one with the target's vocabulary, and the target drafting for itself) in the engine,
    its K/V in a pool of its own under the target's page tables: greedy requests with random arrivals equal plain
    decoding, every page comes back. The target drafting for itself keeps every proposal, which it can only do if
    the draft's cache holds each request's whole sequence at the right slots, including a prompt whose prefix the
    target found in the prefix cache (the draft prefills it from slot 0)."""
    model = model_for("gqa")
    rng = np.random.default_rng(11)
    shared = rng.integers(1, 97, 20).tolist()  # 2.5 pages of 8: two whole pages cached after the first request
    prompts = [shared + rng.integers(1, 97, int(rng.integers(1, 12))).tolist() for _ in range(3)]
    prompts += [rng.integers(1, 97, int(rng.integers(2, 30))).tolist() for _ in range(3)]
    for draft in (model_for("mqa"), model):  # (another model: most proposals rejected, rewound)
        greedy_with_prefix_hits(model, Speculation("draft", 3, draft=draft, adaptive=False), prompts, rng,
                                keeps_all=draft is model, first_block=0)


def prefix_engine(model, speculative):
    """The draft and MTP tests' engine: 3 slots, a fresh prefix cache of 48 pages of 8 (one configuration per
    proposer, so the greedy, sampled and page-sharing tests of each share its compiled programs). Decode widths 1
    and 3, not also 2: each width compiles the whole speculative decode (~17 s here); a dispatch narrower than the
    slots (the proposer's cache or pools sliced with the target's) runs at width 1, and every width of the
    speculative engine's decode runs in the n-gram tests (test_no_recompiles_after_warm_up_as_acceptance_varies
    warms up 1, 2 and 3)."""
    return Engine(model, slots=3, max_len=96, prefill_chunk=16, prefill_rows=2, decode_widths=[1, 3],
                  prefix_cache=jaxkv.PrefixCache(model, num_pages=48, page_size=8), speculative=speculative)


def greedy_with_prefix_hits(model, speculative, prompts, rng, *, keeps_all: bool, first_block: int = 1):
    """Greedy requests with random arrivals through an engine (3 slots, a prefix cache of pages of 8) speculating
    with `speculative`: each equals plain decoding, prefixes were hit, every page comes back; every proposal
    kept (`keeps_all`) or most rejected. Budgets of 1 + 4j or 2 + 4j tokens (j >= first_block): the last verify
    is never cut short by the budget (which would count its proposals past the budget as not accepted)."""
    engine = prefix_engine(model, speculative)
    pc = engine.prefix_cache
    arrivals = [(p, int(4 * rng.integers(first_block, 6) + rng.integers(1, 3)), {}) for p in prompts]
    ids = drain(engine, arrivals, rng)
    assert engine.pending == 0 and pc.lent_to is None and pc.free_pages() == 48 - pc.cached_pages
    stats = engine.stats
    assert stats["prefix_hit_tokens"] >= 16 and stats["spec_verifies"] > 0
    for r in engine.results():
        prompt, new, kwargs = ids[r.id]
        assert r.tokens == alone(model, prompt, new).tokens[0], prompt
    if keeps_all:
        assert stats["spec_acceptance_rate"] == 1.0, stats
    else:
        assert stats["spec_acceptance_rate"] < 0.5


def test_sampled_draft_requests_draw_what_each_draws_alone_in_the_engine():
    """Sampled requests with a draft model: each draws what it draws alone in the engine (its proposals from its
    own key and settings), beside greedy ones."""
    stats = sampled_draw_alone(model_for("gqa"), Speculation("draft", 3, draft=model_for("mqa"), adaptive=False),
                               np.random.default_rng(7), 97)
    assert stats["spec_verifies"] > 0


def sampled_draw_alone(model, speculative, rng, vocab: int) -> dict:
    """Sampled requests (two settings) beside greedy ones, with random arrivals, in an engine speculating with
    `speculative` (`prefix_engine`'s, as the greedy tests': their compiled programs; random prompts, so hardly a
    prefix hit): each draws what it draws alone in such an engine, its full budget, and every page comes back
    -> the shared engine's stats."""
    settings = [dict(temperature=0.8, seed=1), dict(), dict(temperature=1.0, top_k=8, seed=2), dict()]
    arrivals = [(rng.integers(1, vocab, int(rng.integers(2, 20))).tolist(), int(rng.integers(4, 16)), s)
                for s in settings]

    ids = drain(together := prefix_engine(model, speculative), arrivals, rng)
    single = prefix_engine(model, speculative)
    for r in together.results():
        prompt, new, kwargs = ids[r.id]
        kwargs = dict(kwargs, stop_tokens=[])
        assert r.tokens == single.generate([prompt], max_new_tokens=new, **kwargs)[0].tokens, kwargs
        assert len(r.tokens) == new
    pc = together.prefix_cache  # every page back: the pool went back to the cache, holding only cached prefixes
    assert together.pending == 0 and pc.lent_to is None and pc.free_pages() == 48 - pc.cached_pages
    return together.stats


def test_mtp_in_the_engine_equals_plain_decoding_and_a_right_module_keeps_every_proposal():
    """The checkpoint's MTP module in the engine (its one-layer K/V under the target's page tables, one position
    behind; each slot's pending pairs fed at its next pass): greedy requests with random arrivals and a prefix
    cache equal plain decoding, every page comes back; with the module built to be right (it predicts the true
    token after next exactly when fed each slot's own pairs at its own positions) every proposal is kept."""
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 80, 20).tolist()  # 2.5 pages of 8: two whole pages cached after the first request
    prompts = [shared + rng.integers(1, 80, int(rng.integers(1, 12))).tolist() for _ in range(2)]
    prompts += [rng.integers(1, 80, int(rng.integers(2, 30))).tolist() for _ in range(3)]
    for bigram in (False, True):  # (random weights: most proposals rejected, rewound)
        greedy_with_prefix_hits(with_mtp(bigram), Speculation("mtp", 3, adaptive=False), prompts, rng,
                                keeps_all=bigram)
    # A noisy module's proposals depend on every pair it attends over, at its positions (the right module's
    # ignore them): one request alone in the engine keeps what `generate` keeps (the module over a contiguous
    # cache, checked against its definition in tests/families/test_deepseek_mtp.py), verify for verify.
    # (The shared MTP engine, a fresh prefix cache: nothing to hit.)
    model, prompt = with_mtp(True, noisy=True), prompts[0]
    engine = prefix_engine(model, Speculation("mtp", 3, adaptive=False))
    engine.generate([prompt], max_new_tokens=21, stop_tokens=[])
    plain = jaxkv.generate(model, [prompt], max_new_tokens=21, stop_tokens=[],
                           speculative=Speculation("mtp", 3, adaptive=False))
    counts = ("spec_verifies", "spec_proposed", "spec_accepted")
    assert [engine.stats[c] for c in counts] == [plain.stats[c] for c in counts] and plain.stats["spec_accepted"] > 0


def test_mtp_never_writes_into_a_page_the_prefix_cache_shares(monkeypatch):
    """The module's pair at a prompt's last position waits for the first drawn token, so with MTP the engine
    indexes the whole pages of the prompt but its last token: every module slot of a shared page is final when
    the page is shared. A prompt of exactly two pages (its last position the last slot of page 2), then longer
    ones extending it: the module's K/V in every indexed page stay as they were when indexed, through the run;
    the pool comes back with the module's pools kept for the next lease."""
    from jaxkv.engine import programs

    model = with_mtp(True, noisy=True)
    rng = np.random.default_rng(9)
    first = rng.integers(1, 80, 16).tolist()
    engine = prefix_engine(model, Speculation("mtp", 3, adaptive=False))  # the MTP tests' programs
    indexed = {}  # page -> the module's K/V bytes when indexed
    real_refs = programs.refs

    def refs(state, pages, delta, **kwargs):
        for page in np.asarray(pages):
            if page >= 0 and delta > 0:
                indexed[int(page)] = [np.asarray(x[page]).copy() for x in state.draft.keys]
        return real_refs(state, pages, delta, **kwargs)

    monkeypatch.setattr(programs, "refs", refs)
    arrivals = [(first, 9, {})] + [(first + rng.integers(1, 80, int(rng.integers(1, 9))).tolist(), 9, {})
                                   for _ in range(3)]
    ids = drain(engine, arrivals, rng)
    assert engine.stats["prefix_hit_tokens"] >= 8 and len(indexed) >= 2
    for r in engine.results():
        prompt, new, _ = ids[r.id]
        assert r.tokens == alone(model, prompt, new).tokens[0]
    pools = engine._mtp_pools
    for page, before in indexed.items():
        for x, b in zip(pools.keys, before):
            np.testing.assert_array_equal(np.asarray(x[page]), b, err_msg=f"page {page}")


def test_sampled_mtp_requests_draw_what_each_draws_alone_in_the_engine():
    """Sampled requests with the MTP proposer: each draws what it draws alone in the engine (its proposals from
    its own key and settings, its own pending pairs), beside greedy ones."""
    stats = sampled_draw_alone(with_mtp(bigram=True), Speculation("mtp", 3, adaptive=False),
                               np.random.default_rng(8), 80)
    assert stats["spec_verifies"] > 0 and stats["spec_accepted"] > 0


def test_greedy_slots_speculate_together_only_while_it_pays_at_their_width():
    """The engine's cost rule (adaptive): 8 greedy slots whose proposals are never kept (n-gram matches on random
    weights, each slot finding its first at another pass; a draft model that disagrees) verify only on the
    shared probe clock (at the first pass and at 32, in ~40 passes: a rule per slot verified at each slot's first
    match, and a verify of 8 slots costs ~3.6 plain passes here), while the same slots with a draft that keeps
    everything verify nearly every pass once the first probes show it. The plan's costs are set, so the test
    does not depend on the platform's."""
    model = model_for("gqa")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 97, int(rng.integers(4, 20))).tolist() for _ in range(8)]
    want = [alone(model, p, 40).tokens[0] for p in prompts]
    for spec, most in ((Speculation("ngram", 3), 2), (Speculation("draft", 3, draft=model_for("mqa")), 2),
                       (Speculation("draft", 3, draft=model), None)):
        engine = Engine(model, slots=8, max_len=96, page_size=8, prefill_chunk=32, decode_widths=[8],
                        speculative=spec)
        engine.speculation = engine.speculation._replace(verify_cost=2.75, width_cost=0.1)
        results = engine.generate(prompts, max_new_tokens=40, stop_tokens=[])
        assert [r.tokens for r in results] == want
        stats = engine.stats
        if most is not None:  # nothing kept: the probes only
            assert 1 <= stats["spec_verifies"] <= most and stats["spec_acceptance_rate"] < 0.5, stats
        else:  # everything kept: a few plain passes while the estimates climb, then every pass verifies
            assert stats["spec_verifies"] >= stats["target_forwards"] - 4 and stats["tokens_per_target_forward"] > 3


@pytest.mark.parametrize("speculative, match", [
    ("ngram", "must be a jaxkv.Speculation"),
    (Speculation("draft", draft=jaxkv.Model.random(model_for("gqa").config.replace(max_positions=32))),
     "draft model's max positions"),
    (Speculation("mtp"), "multi-token-prediction"),
])
def test_bad_speculation_is_refused_at_construction(speculative, match):
    with pytest.raises(ValueError, match=match):
        Engine(model_for("gqa"), slots=2, max_len=64, speculative=speculative)
