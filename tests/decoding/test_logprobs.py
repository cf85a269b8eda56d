"""Log-probabilities: `generate(..., logprobs=k)` on every path, and `jaxkv.score`, each against log_softmax of the
no-cache forward pass (`jaxkv.logits`) over prompt + tokens, recomputed here in numpy."""

import importlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxkv
from helpers.models import model_for
from helpers.tolerances import atol

# float32 everywhere: the cached and the recomputed passes differ only in summation order (helpers.tolerances).
ATOL = atol("logprobs")
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 6, 2, 11, 30], [60]]  # ragged
NEW = 6


def reference(model, prompts, outputs):
    """Per row, float64[len(outputs[i]), V]: log_softmax of the no-cache logits that predicted each token of
    outputs[i] after prompts[i]. Rows are right-padded to one shape (causal: padding after a token cannot change
    its logits), so every call for a model shares one compiled forward pass."""
    rows = [p + t for p, t in zip(prompts, outputs)]
    assert len(rows) <= 8 and max(map(len, rows)) <= 64
    tokens = np.zeros((8, 64), np.int32)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    logits = np.asarray(jaxkv.logits(model, tokens), np.float64)
    out = []
    for b, (p, t) in enumerate(zip(prompts, outputs)):
        x = logits[b, len(p) - 1: len(p) - 1 + len(t)]
        top = x.max(-1, keepdims=True)
        out.append(x - top - np.log(np.exp(x - top).sum(-1, keepdims=True)))
    return out


def check_generation(model, prompts, out, k):
    """Every row's logprobs and top-k equal the recomputation; the top ids are numpy's top-k (ties: lower id)."""
    assert len(out.logprobs) == len(out.tokens)
    for tokens, logprobs, top, ref in zip(out.tokens, out.logprobs, out.top_logprobs or [None] * len(out.tokens),
                                          reference(model, prompts, out.tokens)):
        assert len(logprobs) == len(tokens) > 0
        np.testing.assert_allclose(logprobs, ref[np.arange(len(tokens)), tokens], atol=ATOL)
        if k == 0:
            assert top is None
            continue
        assert len(top) == len(tokens) and all(len(step) == k for step in top)
        ids = np.array([[i for i, _ in step] for step in top])
        values = np.array([[v for _, v in step] for step in top])
        want_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(values, np.take_along_axis(ref, want_ids, -1), atol=ATOL)


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_logprobs_equal_recompute(k):
    model = model_for("gqa")
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], logprobs=k)
    check_generation(model, PROMPTS, out, k)
    if k:  # greedy picks the most likely token
        assert all(step[0][0] == t for tokens, top in zip(out.tokens, out.top_logprobs)
                   for t, step in zip(tokens, top))
    else:
        assert out.top_logprobs is None


def test_sampled_logprobs_are_the_unfiltered_distribution():
    """Sampling with a temperature and filters does not change what is reported: the model's own distribution."""
    model = model_for("learned")
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], temperature=[1.5, 0.7, 0.0],
                         top_k=[5, None, None], top_p=[None, 0.9, None], seed=3, logprobs=2)
    check_generation(model, PROMPTS, out, 2)


def test_processed_rows_report_the_models_logprobs():
    """logit_bias, penalties and min_tokens change which token is drawn, never what is reported (issue 50: the
    one definition, vLLM's raw logprobs): generate (contiguous and paged) and the engine. A bias of 100 on a
    token the model finds unlikely forces it: a processed distribution would report about 0 for it."""
    model = model_for("gqa")
    plain = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], logprobs=2)
    forced = int(np.argmin(reference(model, PROMPTS, plain.tokens)[0][0]))  # the least likely first token
    kw = dict(max_new_tokens=NEW, logprobs=2, logit_bias={forced: 100.0}, repetition_penalty=1.3,
              presence_penalty=0.5, min_tokens=4)
    out = jaxkv.generate(model, PROMPTS, stop_tokens=[forced], **kw)
    assert out.tokens[0][:4] != [forced] * 4 and out.tokens[0][4] == forced  # min_tokens held it, then the bias
    check_generation(model, PROMPTS, out, 2)
    samples = jaxkv.generate(model, PROMPTS[:2], n=2, stop_tokens=[], seed=2, temperature=1.0, **kw)
    check_generation(model, [p for p in PROMPTS[:2] for _ in range(2)], samples, 2)
    engine = jaxkv.Engine(model, slots=2, max_len=64)
    results = engine.generate([dict(prompt=p, stop_tokens=[forced], **kw) for p in PROMPTS])
    assert [r.tokens for r in results] == out.tokens
    for r, ref in zip(results, reference(model, PROMPTS, out.tokens)):
        np.testing.assert_allclose(r.logprobs, ref[np.arange(len(r.tokens)), r.tokens], atol=ATOL)


def test_stop_token_keeps_its_logprob():
    model = model_for("gqa")
    free = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], logprobs=3)
    stop = free.tokens[0][2]
    end = free.tokens[0].index(stop) + 1  # its first occurrence
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[stop], logprobs=3)
    assert out.tokens[0] == free.tokens[0][:end] and out.finish_reasons[0] == "stop"
    check_generation(model, PROMPTS, out, 3)


def test_paged_samples_logprobs_equal_recompute():
    model = model_for("mqa")
    out = jaxkv.generate(model, PROMPTS[:2], max_new_tokens=NEW, stop_tokens=[], n=3, temperature=1.0, seed=1,
                         logprobs=2)
    check_generation(model, [p for p in PROMPTS[:2] for _ in range(3)], out, 2)


def test_prefix_cache_logprobs_equal_recompute():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=32, page_size=4)
    shared = list(range(1, 13))
    prompts = [shared + [40, 41], shared + [50]]
    # The same shapes twice: the first call fills the cache (the plain paged prefill), the second hits it.
    first = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[], prefix_cache=pc, logprobs=2)
    out = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[], prefix_cache=pc, logprobs=2)
    assert out.stats["prefix_hit_tokens"] > 0  # the suffix path ran
    check_generation(model, prompts, first, 2)
    check_generation(model, prompts, out, 2)


def test_custom_sampler_and_stream_logprobs_equal_recompute():
    model = model_for("gqa")
    seen = []

    def second_best(logits, key):
        return jax.numpy.argsort(-logits, axis=-1)[:, 1].astype(jax.numpy.int32)

    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], sampler=second_best, logprobs=2,
                         stream=lambda b, t: seen.append((b, t)))
    check_generation(model, PROMPTS, out, 2)
    assert all(step[1][0] == t for tokens, top in zip(out.tokens, out.top_logprobs) for t, step in zip(tokens, top))
    assert sorted(seen) == sorted((b, t) for b, tokens in enumerate(out.tokens) for t in tokens)


def test_mesh_and_pmap_logprobs_equal_recompute():
    model = model_for("gqa")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    check_generation(model, PROMPTS, jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh,
                                                    logprobs=2), 2)
    check_generation(model, PROMPTS, jaxkv.generate_pmap(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[],
                                                         logprobs=2), 2)


@pytest.mark.parametrize("k", [-1, 21, 1.0, True, "2"])
def test_bad_logprobs_are_refused_before_compute(k, monkeypatch):
    def no_compute(*a, **kw):
        raise AssertionError("compute started for bad input")

    for module, name in (("jaxkv.decoding.programs", "prefill"), ("jaxkv.decoding.loop", "decode_loop"),
                         ("jaxkv.decoding.programs", "prefill_paged")):
        monkeypatch.setattr(importlib.import_module(module), name, no_compute)
    with pytest.raises(ValueError, match="logprobs must be"):
        jaxkv.generate(model_for("gqa"), PROMPTS, max_new_tokens=2, logprobs=k)
    with pytest.raises(ValueError, match="logprobs must be"):
        jaxkv.generate(model_for("gqa"), PROMPTS, max_new_tokens=2, logprobs=k, n=2)
    with pytest.raises(ValueError, match="logprobs must be"):
        jaxkv.generate_pmap(model_for("gqa"), PROMPTS, max_new_tokens=2, logprobs=k)


# --- score ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gqa", "sliding", "learned"])
def test_score_equals_recompute(name):
    """Ragged pairs; a continuation longer than the sliding window; one longer than the prompt bucket."""
    model = model_for(name)
    prompts = [[5, 9, 2], [7] * 20, [60]]
    conts = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [96]]
    scores = jaxkv.score(model, prompts, conts)
    assert len(scores) == len(prompts)
    for c, s, ref in zip(conts, scores, reference(model, prompts, conts)):
        want = ref[np.arange(len(c)), c]
        assert isinstance(s, list) and len(s) == len(c)
        np.testing.assert_allclose(s, want, atol=ATOL)
        assert s.total == pytest.approx(want.sum(), abs=ATOL * len(c))
        assert s.greedy == bool((ref.argmax(-1) == c).all())


def test_score_of_greedy_output_is_greedy_and_equals_generate():
    model = model_for("gqa")
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[])
    scores = jaxkv.score(model, PROMPTS, out.tokens)
    for s, logprobs, tokens in zip(scores, out.logprobs, out.tokens):
        assert s.greedy
        np.testing.assert_allclose(s, logprobs, atol=ATOL)
    changed = [out.tokens[0][:-1] + [(out.tokens[0][-1] + 1) % model.config.vocab_size]] + out.tokens[1:]
    assert [s.greedy for s in jaxkv.score(model, PROMPTS, changed)] == [False, True, True]


class _Encoding:
    def __init__(self, ids):
        self.ids = ids


class _BosTokenizer:
    """One id per character (its code mod 90, plus 1), after a BOS (0) unless special tokens are off."""

    def encode(self, text, add_special_tokens=True):
        return _Encoding([0] * add_special_tokens + [1 + ord(ch) % 90 for ch in text])


def test_score_encodes_text_continuations_without_special_tokens():
    plain = model_for("gqa")
    model = jaxkv.Model(plain.config, plain.params, tokenizer=_BosTokenizer())
    got = jaxkv.score(model, ["ab", "c"], ["de", "f"])
    want = jaxkv.score(plain, [[0, 8, 9], [0, 10]], [[11, 12], [13]])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_score_lengths_within_a_bucket_never_recompile():
    from helpers.compiles import count_compiles

    model = model_for("mqa")
    jaxkv.score(model, [[1, 2], [3]], [[3], [4]])
    with count_compiles() as c:
        for n in range(2, 9):
            jaxkv.score(model, [[1] * n, [2] * (n + 3)], [[3] * n, [4]])
    assert c["n"] == 0


def test_score_splits_a_batch_whose_logits_would_not_fit(monkeypatch):
    model = model_for("gqa")
    prompts, conts = [[1 + i, 2] for i in range(5)], [[3, 4 + i] for i in range(5)]
    whole = jaxkv.score(model, prompts, conts)
    # Two rows' worth of [Tc=16, V] float32 logits: batches of 2, 2 and 1.
    monkeypatch.setattr(importlib.import_module("jaxkv.score"), "LOGITS_BYTES", 2 * 16 * model.config.vocab_size * 4)
    split = jaxkv.score(model, prompts, conts)
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a, b, atol=ATOL)


@pytest.mark.parametrize("prompts, conts, match", [
    ([[1]], [[2], [3]], "1 prompts and 2 continuations"),
    ([], [], "prompts is empty"),
    ([[1]], [[]], "continuation 0 is empty"),
    ([[]], [[1]], "prompt 0 is empty"),
    ([[1]], [[97]], r"continuation 0: token id 97 is outside the vocabulary \[0, 97\)"),
    ([[-1]], [[1]], "prompt 0: token id -1"),
    ([[1]], [[1.5]], "continuation 0 must be a flat list of integer token ids"),
    ([[1] * 200], [[2] * 57], r"pair 0: the prompt \(200 tokens\) and continuation \(57\) exceed the model's max "
                              r"positions \(256\)"),
    (["hello"], [[1]], "text prompts need a model with a tokenizer"),
    ([[1]], ["world"], "text continuations need a model with a tokenizer"),
])
def test_score_bad_input_is_refused_before_compute(prompts, conts, match, monkeypatch):
    def no_compute(*a, **kw):
        raise AssertionError("compute started for bad input")

    monkeypatch.setattr(importlib.import_module("jaxkv.score"), "_score_batch", no_compute)
    with pytest.raises(ValueError, match=match):
        jaxkv.score(model_for("learned"), prompts, conts)  # max_positions 256


def test_score_bad_settings_are_refused(monkeypatch):
    monkeypatch.setattr(importlib.import_module("jaxkv.score"), "_score_batch", None)
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        jaxkv.score(model_for("gqa"), [[1]], [[2]], cache_dtype="int4")
    with pytest.raises(ValueError, match="unknown attention implementation"):
        jaxkv.score(model_for("gqa"), [[1]], [[2]], attention="flash")
