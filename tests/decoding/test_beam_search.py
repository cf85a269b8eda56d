"""Beam search: the same hypotheses and scores as transformers' beam search, beams as forks of page-table rows
(no whole K/V copy in the compiled loop), every page back at the end, bad input refused before compute.

transformers runs tiny random Llama and GPT-2 models (CPU, float32, eager attention) with
`generate(num_beams=K, do_sample=False, ...)`; jaxkv loads the same weights with `load_hf`. The stop tokens are
picked from the models' own greedy continuations, so hypotheses end at a stop token at different steps.
"""

import dataclasses
import importlib
import itertools
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache import planner as memory
from jaxkv.checkpoint_hf import load_hf
from jaxkv.decoding.programs import prefill_paged as _prefill_paged

from helpers.hf import BEAM_NEW, BOS, EOS, PAD, RAGGED, SINGLE, VOCAB, hf_beam_search, hf_greedy_uncached
from helpers.models import model_for
from helpers.tolerances import atol

bs = importlib.import_module("jaxkv.beam_search")  # the module (jaxkv.beam_search is the function)

NEW = BEAM_NEW  # new tokens per hypothesis (helpers.hf's hf_beam_search asks transformers for as many)
SCORE_ATOL = atol("transformers beam scores")  # why: helpers.tolerances
# Both in one batch and one more prompt: 5 prompts padded to 8 rows (3 empty filler prompts), so that each setting
# compiles one search, not one per batch size.
BATCH = SINGLE + RAGGED + [[60, 17, 99, 23]]
HF = {
    "llama": ("LlamaConfig", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  initializer_range=0.25, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS,
                                  bos_token_id=BOS)),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                initializer_range=0.25, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)),
}


@pytest.fixture(scope="module", params=sorted(HF))
def pair(request, tmp_path_factory):
    """(HF model, jaxkv model of the same weights, stop tokens its greedy continuations reach at different
    steps)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config_class, kwargs = HF[request.param]
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs),
                                                       attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # the stop tokens are passed per call
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory, safe_serialization=True)
    model = load_hf(directory)
    greedy = [hf_greedy_uncached(hf, prompt, NEW) for prompt in SINGLE + RAGGED]  # transformers': no jaxkv compile
    stops = sorted({greedy[0][3], greedy[1][6], greedy[2][9]})
    return hf, model, stops


# One beam is greedy search (test_one_beam_is_greedy_generate; greedy == transformers in test_hf_parity). Four
# beams with each early_stopping rule; two beams once, with "never" (each case compiles a search: the rule itself is
# checked at four beams, where it decides more; two beams check a narrower candidate set, 2 K, which the rule does
# not change).
@pytest.mark.parametrize("num_beams, early_stopping", [(4, True), (4, False), (4, "never"), (2, "never")])
def test_hypotheses_and_scores_equal_transformers(pair, num_beams, early_stopping):
    hf, model, stops = pair
    for length_penalty in [0.5, 1.0, 2.0]:
        want = hf_beam_search(hf, BATCH, stops, num_beams=num_beams, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_beams)
        got = jaxkv.beam_search(model, BATCH, num_beams=num_beams, max_new_tokens=NEW,
                                length_penalty=length_penalty, early_stopping=early_stopping,
                                num_return_sequences=num_beams, stop_tokens=stops)
        where = f"length_penalty={length_penalty}"
        assert got.tokens == [[tokens for tokens, _ in hyps] for hyps in want], where
        for hyps, want_hyps in zip(got, want):
            for h, (tokens, score) in zip(hyps, want_hyps):
                assert h.score == pytest.approx(h.logprob / len(h.tokens) ** length_penalty, rel=1e-6)
                assert h.finish_reason == ("stop" if tokens[-1] in stops else "length")
                if score is not None:
                    assert abs(h.score - score) < SCORE_ATOL, where
        assert got.stats["pages_in_use_end"] == 0
        assert got.stats["pages_in_use_peak"] <= got.stats["pages_needed"]


def test_the_settings_matter(pair):
    """The comparison above can tell the settings apart: on these models they give different hypotheses."""
    _, model, stops = pair
    outcome = {(lp, es): str(jaxkv.beam_search(model, BATCH, num_beams=4, max_new_tokens=NEW,
                                               length_penalty=lp, early_stopping=es, num_return_sequences=4,
                                               stop_tokens=stops).tokens)
               for lp, es in itertools.product([0.5, 2.0], [True, "never"])}  # the extremes of each
    assert any(len({outcome[lp, es] for es in (True, "never")}) > 1 for lp in (0.5, 2.0))
    assert any(len({outcome[lp, es] for lp in (0.5, 2.0)}) > 1 for es in (True, "never"))
    got = jaxkv.beam_search(model, BATCH, num_beams=4, max_new_tokens=NEW, num_return_sequences=4,
                            stop_tokens=stops)
    reasons = {h.finish_reason for hyps in got for h in hyps}
    lengths = {len(h.tokens) for hyps in got for h in hyps if h.finish_reason == "stop"}
    assert "stop" in reasons and len(lengths) >= 3  # stop tokens reached at different steps


@pytest.mark.parametrize("name", ["sliding", "learned"])  # a window; learned positions
def test_one_beam_is_greedy_generate(name):
    model = model_for(name)
    prompts = [[5, 9, 2, 77, 31, 8], [3] * 20, [60, 1]]
    greedy = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[], logprobs=1)  # the loop below's
    stops = [greedy.tokens[0][4], greedy.tokens[1][7]]
    greedy = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=stops, logprobs=1)
    # Each early_stopping rule compiles a search: all three on the window, the default (False) on learned positions
    # (the rules are the search's, not the model's).
    for early_stopping in (True, False, "never") if name == "sliding" else (False,):
        got = jaxkv.beam_search(model, prompts, num_beams=1, max_new_tokens=NEW, stop_tokens=stops,
                                early_stopping=early_stopping, length_penalty=2.0)
        assert [h[0].tokens for h in got] == greedy.tokens
        assert [h[0].finish_reason for h in got] == greedy.finish_reasons
        for hyps, logprobs in zip(got, greedy.logprobs):
            assert hyps[0].logprob == pytest.approx(sum(logprobs), abs=1e-4)


def test_pages_are_shared_bounded_and_all_returned(monkeypatch):
    """A long prompt's full pages are held once by all beams; a pool of exactly the planned pages suffices (a
    beam that found no page would poison its row and the call would raise); at the end every page is free."""
    model = model_for("gqa")
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 97, 100)]
    plan = memory.plan_pages(model.config, [100], NEW, n=4, page_size=4)
    roomy = jaxkv.beam_search(model, [prompt], num_beams=4, max_new_tokens=NEW, stop_tokens=[], page_size=4)
    tight = jaxkv.beam_search(model, [prompt], num_beams=4, max_new_tokens=NEW, stop_tokens=[], page_size=4,
                              num_pages=plan.pages_needed)
    assert tight.tokens == roomy.tokens
    # The pool size picks the paged attention's formulation (`paged_reference.prefers_pool`): the same sums in
    # another order, float32 rounding apart.
    np.testing.assert_allclose(tight.scores, roomy.scores, rtol=0, atol=1e-5)
    stats = tight.stats
    assert stats["pages_needed"] == plan.pages_needed == 25 + 4 * 3  # 25 prompt pages, 3 own pages per beam
    assert stats["pages_in_use_end"] == 0
    # K private caches would hold the prompt 4 times: 4 x 28 pages' worth of slots.
    assert 25 < stats["pages_in_use_peak"] <= plan.pages_needed < 4 * 25
    assert stats["kv_bytes_in_use_peak"] < stats["kv_cache_bytes_unshared"] / 2
    assert stats["kv_cache_bytes_unshared"] == 4 * (100 + NEW) * memory.kv_bytes_per_token(model.config)
    # The check behind "suffices" can fail: a planner that promised one page fewer than the beams took.
    short = dataclasses.replace(plan, pages_needed=stats["pages_in_use_peak"] - 1)
    monkeypatch.setattr(memory, "plan_pages", lambda *a, **kw: short)
    with pytest.raises(RuntimeError, match="ran out of pages"):
        jaxkv.beam_search(model, [prompt], num_beams=4, max_new_tokens=NEW, stop_tokens=[], page_size=4,
                          num_pages=short.pages_needed)


def test_tokenizer_text_and_result_views():
    model = jaxkv.load("tiny")
    got = jaxkv.beam_search(model, ["Once upon a time", "The cat"], num_beams=3, max_new_tokens=6,
                            num_return_sequences=2)
    assert len(got) == 2 and all(len(h) == 2 for h in got)
    for hyps in got:
        assert hyps[0].score >= hyps[1].score
        for h in hyps:
            assert h.text == model.tokenizer.decode(h.tokens, skip_special_tokens=True)
    assert got.text == [[h.text for h in hyps] for hyps in got]
    assert got.scores == [[h.score for h in hyps] for hyps in got]
    assert got.tokens == [[h.tokens for h in hyps] for hyps in got]


def test_settings_are_traced_not_compiled():
    """length_penalty, max_new_tokens (within a capacity bucket) and the stop ids do not recompile the loop."""
    model = model_for("gqa")
    prompts = [[5, 9, 2, 77], [3, 4]]
    jaxkv.beam_search(model, prompts, num_beams=2, max_new_tokens=8)
    before = bs._search._cache_size()
    for lp, new, stops in [(0.5, 9, [4]), (2.0, 10, [4, 5, 6]), (-1.0, 7, [])]:
        jaxkv.beam_search(model, prompts, num_beams=2, max_new_tokens=new, length_penalty=lp, stop_tokens=stops)
    assert bs._search._cache_size() == before


def test_int8_cache_and_pallas_kernel_run_the_same_search():
    """The quantized pool and the Pallas paged decode kernel (interpreted on CPU) behind the same search."""
    model = model_for("gqa")
    prompts = [[5, 9, 2, 77, 31, 8, 14, 60, 2], [3, 4, 5]]
    ref = jaxkv.beam_search(model, prompts, num_beams=3, max_new_tokens=6, stop_tokens=[], page_size=4)
    kernel = jaxkv.beam_search(model, prompts, num_beams=3, max_new_tokens=6, stop_tokens=[], page_size=4,
                               attention="pallas")
    assert kernel.tokens == ref.tokens
    np.testing.assert_allclose(kernel.scores, ref.scores, atol=1e-5)
    int8 = jaxkv.beam_search(model, prompts, num_beams=3, max_new_tokens=6, stop_tokens=[], page_size=4,
                             cache_dtype="int8")
    assert int8.stats["cache_dtype"] == "int8" and int8.stats["pages_in_use_end"] == 0
    # int8 K/V moves each score a little (per-token scales): the best hypotheses stay close.
    np.testing.assert_allclose([h[0].score for h in int8], [h[0].score for h in ref], atol=0.05)


# --- the compiled loop copies no K/V ----------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_compiled_search_never_copies_or_gathers_whole_pools(cache_dtype):
    """Choosing the next beams is a fork of page-table rows: outside the attention (which reads the pages it
    needs), no op in the compiled search copies, transposes or gathers a buffer as large as a K/V pool; the
    only K/V data moved is the partly filled last page of a beam extended twice (a gather of at most B*K
    pages)."""
    model = model_for("gqa")
    cfg = model.config
    B, K, P, page = 2, 4, 64, 4
    tokens = np.ones((B, 16), np.int32)
    positions = np.tile(np.arange(16, dtype=np.int32), (B, 1))
    parents = np.repeat(np.arange(B, dtype=np.int32), K)
    logits, cache = _prefill_paged(model.params, tokens, positions, parents, config=cfg, attention="xla",
                                   num_pages=P, page_size=page, max_pages=16, cache_dtype=cache_dtype)
    text = bs._search.lower(model.params, cache, logits, jnp.ones((B,), bool), jnp.full((8,), -1, jnp.int32),
                            jnp.int32(8), jnp.float32(1.0), config=cfg, attention="xla", early_stopping=False,
                            num_beams=K, candidates=9 * K).compile().as_text()
    short = {"float32": "f32", "int8": "s8"}[cache_dtype]
    pool = f"{short}[{P},{cfg.n_kv_heads},{page},{cfg.head_dim}]"
    assert pool in text  # the check below looks at the right buffers
    moved = []
    for line in text.splitlines():
        m = re.search(r"%(\S+) = \w+\[([\d,]+)\]\S* (\w+)\(", line)
        if not m:
            continue
        name, op, dims = m.group(1), m.group(3), [int(d) for d in m.group(2).split(",")]
        # Pages of K/V ([..., K, page, H]) or of scales ([..., K, page]), as many as the pool holds or more.
        for tail in ([cfg.n_kv_heads, page, cfg.head_dim], [cfg.n_kv_heads, page]):
            pages = dims[:-len(tail)]
            if dims[-len(tail):] == tail and pages and math.prod(pages) >= P:
                copy = op == "copy" or "copy" in name or "transpose" in name
                gather = (op == "gather" or "gather" in name) and "attn._paged" not in line
                if copy or gather:
                    moved.append(line.strip()[:160])
    assert not moved, moved[:3]


# --- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=0), "num_beams must be"),
    (dict(num_beams=2.0), "num_beams must be"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences=3 exceeds num_beams=2"),
    (dict(num_return_sequences=0), "num_return_sequences must be"),
    (dict(max_new_tokens=-1), "max_new_tokens must be"),
    (dict(max_new_tokens=0), "max_new_tokens must be"),
    (dict(early_stopping="sometimes"), "early_stopping must be"),
    (dict(early_stopping=None), "early_stopping must be"),
    (dict(length_penalty="long"), "length_penalty must be"),
    (dict(length_penalty=float("nan")), "length_penalty must be"),
    (dict(num_pages=5), "num_pages=5 cannot hold them"),
    (dict(max_len=16), "exceeds max_len=16"),
    (dict(max_new_tokens=5000), "max positions"),
    (dict(stop_tokens=[97]), "outside the vocabulary"),
    (dict(cache_dtype="int3"), "cache_dtype"),
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[[1, 2, 500]]), "outside the vocabulary"),
])
def test_bad_input_is_refused_before_compute(kwargs, match, monkeypatch):
    def no_compute(*a, **kw):
        raise AssertionError("compute started for bad input")

    monkeypatch.setattr(importlib.import_module("jaxkv.decoding.programs"), "prefill_paged", no_compute)
    monkeypatch.setattr(bs, "_search", no_compute)
    args = dict(prompts=[[5, 9, 2, 77, 31, 8, 14, 60, 2, 5]], num_beams=4, max_new_tokens=8) | kwargs
    with pytest.raises(ValueError, match=match):
        jaxkv.beam_search(model_for("gqa"), args.pop("prompts"), **args)


# --- constrained beams return only real hypotheses (issue 50) ---------------------------------------------------
#
# A random model over a byte-level tokenizer (257 ids: byte i, then the stop token 256), as the constraint tests
# use. Each constraint below admits a few completions, fewer than the beams: the search then holds every real
# prefix at every step (at most as many as the completions), so its hypotheses must be exactly the constraint's
# language, which `_language` enumerates with llguidance's own matcher. transformers' search would fill the beam
# slots left over with continuations of its -1e9 first-step copies, of ended beams (a stop token then more tokens)
# or of refused tokens, and return them scored with a -1e9 summed in; jaxkv returns fewer hypotheses instead.

STOP = 256
BYTES = jaxkv.Config(vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                     max_positions=256, eos_ids=(STOP,))
_byte_model = []  # [the model, its llguidance tokenizer], built once


def _bytes_model():
    if not _byte_model:
        from helpers.text import byte_level

        _byte_model[:] = [jaxkv.Model(BYTES, jaxkv.Model.random(BYTES, seed=3).params, byte_level())]
    return _byte_model[0]


def _matcher(constraint):
    llguidance = pytest.importorskip("llguidance")
    if len(_byte_model) == 1:
        _byte_model.append(llguidance.LLTokenizer(_bytes_model().tokenizer.to_str(), n_vocab=BYTES.vocab_size,
                                                  eos_token=[STOP]))
    return llguidance.LLMatcher(_byte_model[1], constraint.grammar, log_level=0)


def _allowed(matcher):
    """bool[V]: the tokens llguidance's matcher allows next (only the stop token once it can take nothing more,
    as the beams' rows do)."""
    if matcher.is_stopped():
        return np.arange(BYTES.vocab_size) == STOP
    import llguidance.numpy

    bits = np.zeros((1, (BYTES.vocab_size + 31) // 32), np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:BYTES.vocab_size] == 1


def _language(constraint, longest=16):
    """Every completion of `constraint` (token ids, the stop token last), by walking its matcher's masks."""
    found = []

    def walk(matcher, prefix):
        assert len(prefix) <= longest, "not a small finite language"
        for t in np.flatnonzero(_allowed(matcher)).tolist():
            if t == STOP:
                found.append(prefix + [STOP])
            else:
                child = matcher.deep_copy()
                assert child.consume_token(t)
                walk(child, prefix + [t])

    walk(_matcher(constraint), [])
    return found


def _logprob(prompt, tokens, constraint):
    """The summed log-probabilities of `tokens` after `prompt`: the model's, log_softmax of `jaxkv.logits` (no
    cache) over the whole vocabulary, not renormalized over the tokens the constraint allows (transformers' beam
    scores, and what generate reports). Asserts each token is allowed."""
    logits = jaxkv.logits(_bytes_model(), [(prompt + tokens + [0] * 32)[:32]])[0]  # one compiled shape
    matcher = None if constraint is None else _matcher(constraint)
    total = 0.0
    for i, token in enumerate(tokens):
        row = np.asarray(logits[len(prompt) + i - 1], np.float64)
        if matcher is not None:
            allowed = _allowed(matcher)
            assert allowed[token], (constraint, tokens, i)
            if token != STOP:
                assert matcher.consume_token(token)
        total += row[token] - np.logaddexp.reduce(row)
    return total


def _check_real(prompt, hyps, constraint, length_penalty):
    """Each hypothesis is one the constraint allows, ends at its first stop token (included), is no duplicate, and
    scores its own tokens' summed log-probabilities under the length penalty; best first."""
    assert len({tuple(h.tokens) for h in hyps}) == len(hyps), [h.tokens for h in hyps]
    for h in hyps:
        assert h.finish_reason == "stop" and h.tokens.index(STOP) == len(h.tokens) - 1, h.tokens
        assert math.isfinite(h.score) and h.logprob == pytest.approx(_logprob(prompt, h.tokens, constraint),
                                                                    abs=atol("logprobs"))
        assert h.score == pytest.approx(h.logprob / len(h.tokens) ** length_penalty, rel=1e-6)
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_constraint_with_fewer_completions_than_beams():
    """The issue's case: 6 beams, 6 asked for, a choice of 3 ("é" is two bytes): the 3, and the search ends with
    the longest ("no way" and its stop token, 7 steps), not at max_new_tokens with beams of fillers."""
    prompt = list(b"The KV cache")
    choice = jaxkv.Choice(["yes", "no way", "é"])
    got = jaxkv.beam_search(_bytes_model(), [prompt], num_beams=6, max_new_tokens=40, num_return_sequences=6,
                            constraint=choice)
    assert sorted(h.tokens for h in got[0]) == sorted(_language(choice))
    assert sorted(got.text[0]) == sorted(choice.strings)
    _check_real(prompt, got[0], choice, 1.0)
    assert got.stats["steps"] == 7 and got.stats["pages_in_use_end"] == 0


# One call, a prompt per constraint: completions 1, 2, 3 (a stop token chosen after "no", or forced after "no way"),
# a JSON enum's 3, and one unconstrained prompt.
MIXED = [jaxkv.Choice(["yes"]), jaxkv.Regex("a[bc]"), jaxkv.Choice(["no", "no way", "yes"]),
         jaxkv.JsonSchema({"enum": ["red", "green", "blue"]}), None]
MIXED_PROMPTS = [list(b"Say yes: "), list(b"code "), list(b"Is it? "), list(b"Colour: "), list(b"The cat")]


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_one_call_many_constraints(early_stopping):
    """Each constrained prompt gets exactly its constraint's completions, each scored as its own tokens (with
    early_stopping=True too, which would wait for W hypotheses); the unconstrained one gets what it gets alone."""
    model = _bytes_model()
    length_penalty = {True: 2.0, False: 1.0, "never": 0.5}[early_stopping]
    kwargs = dict(num_beams=4, max_new_tokens=12, length_penalty=length_penalty, early_stopping=early_stopping)
    got = jaxkv.beam_search(model, MIXED_PROMPTS, num_return_sequences=4, constraint=MIXED, **kwargs)
    for prompt, constraint, hyps in zip(MIXED_PROMPTS, MIXED, got):
        if constraint is not None:
            assert sorted(h.tokens for h in hyps) == sorted(_language(constraint)), constraint
            _check_real(prompt, hyps, constraint, length_penalty)
    assert len(got[-1]) == 4
    if early_stopping is False:  # (once: each batch size compiles a search)
        alone = jaxkv.beam_search(model, MIXED_PROMPTS[-1:], num_return_sequences=4, **kwargs)
        assert got.tokens[-1] == alone.tokens[0]
        np.testing.assert_allclose(got.scores[-1], alone.scores[0], rtol=0, atol=atol("paged vs contiguous"))
    assert got.stats["pages_in_use_end"] == 0


def test_fewer_returned_than_beams_are_the_best_completions():
    """num_return_sequences < num_beams: the best of the completions by their own scores; a small page size (the
    beams' partly filled pages copied on write) chooses the same."""
    model = _bytes_model()
    for page_size in (memory.DEFAULT_PAGE_SIZE, 2):
        got = jaxkv.beam_search(model, MIXED_PROMPTS, num_beams=4, max_new_tokens=12, num_return_sequences=2,
                                constraint=MIXED, page_size=page_size)
        for prompt, constraint, hyps in zip(MIXED_PROMPTS[:-1], MIXED, got):
            language = _language(constraint)
            best = sorted(language, key=lambda t: _logprob(prompt, t, constraint) / len(t), reverse=True)[:2]
            assert [h.tokens for h in hyps] == best, (constraint, page_size)
            _check_real(prompt, hyps, constraint, 1.0)
        assert len(got[-1]) == 2 and got.stats["pages_in_use_end"] == 0
