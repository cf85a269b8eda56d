"""Penalties, logit bias and min_tokens (`jaxkv.decoding.processing`): the formulas on hand-computed logits, greedy
decoding against a numpy reimplementation over `jaxkv.logits` (every `generate` path and the engine), repetition
penalty against transformers' `generate`, no recompile when the values change, and the refusals."""

import numpy as np
import pytest

import jaxkv
from jaxkv.decoding import processing
from helpers.compiles import count_compiles
from helpers.models import model_for

# Prompt 1 holds tokens its repetition penalty then keeps out of the output (leaving the prompt out of the
# penalty changes its tokens: checked).
PROMPTS = [[3, 1, 4, 1, 5], [45, 92, 9, 2, 6], [8, 8, 1, 30, 2, 7], [5, 40, 41]]
NEW = 8
REFERENCE_LEN = 16  # the reference's forward length: the longest prompt + NEW
# One row per part, each on where greedy decoding of the tiny model repeats itself (so the penalty changes it),
# the last neutral (it must give plain greedy's tokens).
SETTINGS = dict(repetition_penalty=[1.0, 1.8, 1.0, None], presence_penalty=[0.6, 0.5, None, None],
                frequency_penalty=[0.9, None, -0.3, None], logit_bias=[None, {7: 3.0, 85: -100.0}, {11: 2.5}, None],
                min_tokens=[0, 0, 5, None])


def numpy_greedy(model, prompt, *, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 logit_bias=None, min_tokens=0, stop=(), new=NEW):
    """The spec: each step's logits from the full forward pass over prompt + output (`jaxkv.logits`), then
    bias, transformers' repetition penalty over prompt and output, OpenAI's penalties over the output, the stop
    ids masked before min_tokens, argmax; a stop id ends the row."""
    out = []
    for _ in range(new):
        # padded to one length (one compile): a causal model's logits at a position ignore what follows it
        seq = prompt + out
        x = jaxkv.logits(model, [seq + [0] * (REFERENCE_LEN - len(seq))])[0, len(seq) - 1].astype(np.float64)
        for t, b in (logit_bias or {}).items():
            x[t] += b
        p = repetition_penalty or 1.0
        for t in set(prompt) | set(out):
            x[t] = x[t] / p if x[t] > 0 else x[t] * p
        counts = np.bincount(out, minlength=x.size)
        x -= counts * (frequency_penalty or 0.0) + (counts > 0) * (presence_penalty or 0.0)
        if len(out) < (min_tokens or 0):
            x[list(stop)] = -np.inf
        out.append(int(np.argmax(x)))
        if out[-1] in stop:
            break
    return out


def row_settings(b):
    return {name: values[b] for name, values in SETTINGS.items()}


@pytest.fixture(scope="module")
def expected():
    """(the stop ids, the numpy tokens per prompt): the stop id is plain greedy's second token of prompt 2, so
    that its min_tokens holds a stop back."""
    model = model_for("gqa")
    stop = (jaxkv.generate(model, [PROMPTS[2]], max_new_tokens=2, stop_tokens=[]).tokens[0][1],)
    return stop, [numpy_greedy(model, p, stop=stop, **row_settings(b)) for b, p in enumerate(PROMPTS)]


def test_apply_on_hand_computed_logits():
    # Row 0: repetition 2 over prompt {0} and output {1: once, 2: twice}, frequency 0.5, presence 1.
    # Row 1: bias {3: +10}, min_tokens 1 holding the stop id 2 back. Row 2: neutral.
    logits = np.array([[2.0, -1.0, 4.0, 1.0], [2.0, -1.0, 4.0, 1.0], [2.0, -1.0, 4.0, 1.0]], np.float32)
    pen = processing.settings(repetition_penalty=[2.0, None, None], presence_penalty=[1.0, None, None],
                              frequency_penalty=[0.5, None, None], logit_bias=[None, {3: 10.0}, None],
                              min_tokens=[None, 1, None], rows=3, padded=3, vocab_size=4)
    state = processing.start(pen, np.array([[0, -1], [-1, -1], [-1, -1]], np.int32), vocab_size=4)
    emitted = np.array([True, False, False])
    for t in (1, 2, 2):
        state = state.advance(np.array([t, 0, 0], np.int32), emitted)
    got = np.asarray(state.apply(logits, np.array([2, -1], np.int32)))
    # row 0: 2/2 = 1 (prompt); -1*2 - 0.5 - 1 = -3.5; 4/2 - 2*0.5 - 1 = 0; 1 untouched
    np.testing.assert_allclose(got[0], [1.0, -3.5, 0.0, 1.0])
    np.testing.assert_allclose(got[1], [2.0, -1.0, -np.inf, 11.0])
    np.testing.assert_allclose(got[2], logits[2])
    np.testing.assert_array_equal(state.generated, [3, 0, 0])


def test_every_generate_path_and_the_engine_match_numpy(expected):
    model = model_for("gqa")
    stop, want = expected
    plain = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=list(stop)).tokens
    assert all(plain[b] != want[b] for b in range(3)), (plain, want)  # each setting changes its row
    assert plain[3] == want[3]
    paths = {
        "contiguous": jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=list(stop), **SETTINGS).tokens,
    }
    n2 = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=list(stop), n=2, **SETTINGS).tokens
    paths["n=2"] = n2[::2]
    assert n2[1::2] == n2[::2]  # greedy: each sample counts its own output, as the one before
    prefix = jaxkv.PrefixCache(model, num_pages=64, page_size=4)
    for _ in range(2):  # the second call hits the cached prompt pages (those tokens are still the prompt's)
        paths["prefix cache"] = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=list(stop),
                                               prefix_cache=prefix, **SETTINGS).tokens
    engine = jaxkv.Engine(model, slots=2, max_len=32, page_size=4, prefill_chunk=4,
                          prefix_cache=jaxkv.PrefixCache(model, num_pages=64, page_size=4))
    for _ in range(2):
        paths["engine"] = [r.tokens for r in engine.generate(
            [dict(prompt=p, **row_settings(b)) for b, p in enumerate(PROMPTS)], max_new_tokens=NEW,
            stop_tokens=list(stop))]
    for path, tokens in paths.items():
        assert tokens == want, (path, tokens, want)


def test_new_values_never_recompile(expected):
    model = model_for("gqa")
    stop, _ = expected
    args = dict(max_new_tokens=NEW, stop_tokens=list(stop))
    jaxkv.generate(model, PROMPTS, **args)
    with count_compiles() as c:
        jaxkv.generate(model, PROMPTS, **args, **SETTINGS)
        jaxkv.generate(model, PROMPTS, **args, repetition_penalty=1.2, logit_bias={3: -1.0}, min_tokens=1)
    assert c["n"] == 0


def test_refusals():
    model = model_for("gqa")
    V = model.config.vocab_size
    for bad, words in [(dict(logit_bias={V: 1.0}), "outside the vocabulary"),
                       (dict(logit_bias={t: 1.0 for t in range(processing.MAX_LOGIT_BIAS + 1)}), "at most 300"),
                       (dict(repetition_penalty=0.0), "> 0"), (dict(presence_penalty=2.5), "[-2, 2]"),
                       (dict(min_tokens=NEW + 1), "exceeds max_new_tokens"),
                       (dict(frequency_penalty=[0.1]), "one per prompt")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, **bad)
    with pytest.raises(ValueError, match="speculative decoding does not take repetition_penalty"):
        jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, repetition_penalty=1.3,
                       speculative=jaxkv.Speculation("ngram", num_tokens=2))


def test_repetition_penalty_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import transformers

    from helpers.hf import LLAMA_LIKE, PAD, SINGLE, build_hf

    hf = build_hf("LlamaConfig", LLAMA_LIKE)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = jaxkv.load(tmp_path)
    prompts = [SINGLE[0], SINGLE[0][::-1]]  # equal lengths: no padding token for transformers to penalize
    new = 12

    def hf_tokens(penalty):
        config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                               repetition_penalty=penalty, eos_token_id=None, pad_token_id=PAD)
        with torch.no_grad():
            return hf.generate(input_ids=torch.tensor(prompts), generation_config=config)[:, len(prompts[0]):].tolist()

    want = hf_tokens(1.5)
    assert want != hf_tokens(1.0)  # the penalty changes the output: the comparison can fail
    got = jaxkv.generate(model, prompts, max_new_tokens=new, stop_tokens=[], repetition_penalty=1.5).tokens
    assert got == want
    assert jaxkv.generate(model, prompts, max_new_tokens=new, stop_tokens=[], repetition_penalty=1.5,
                          page_size=4).tokens == want
