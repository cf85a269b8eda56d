"""`generate(constraint=...)`: every output satisfies its constraint (the `jsonschema` package, `re.fullmatch`,
the choice list, a hand parser of the grammar), and greedy constrained decoding picks at every step the argmax of
the model's logits (recomputed with `jaxkv.logits`) among the tokens llguidance's own matcher allows.

The model: random weights over the bundled tokenizer (257 ids, one per byte, eos 256), so nothing about the
text is likely and every structure comes from the constraint."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from helpers.models import recompute
from helpers.text import byte_level

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

CONFIG = jaxkv.Config(vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                      max_positions=1024, eos_ids=(256,))

SCHEMAS = [
    # nested objects, required and optional fields, additionalProperties false
    {"type": "object", "additionalProperties": False, "required": ["user", "tags"],
     "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id"],
                             "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                            "nick": {"type": "string", "maxLength": 6}}},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}},
    # numbers, enums, a patterned string, a nullable field
    {"type": "object", "additionalProperties": False, "required": ["code", "level", "score", "note"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "level": {"enum": ["low", "mid", "high", 3]},
                    "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
                    "note": {"type": ["string", "null"], "maxLength": 5}}},
    # an array of objects with bounds, booleans
    {"type": "array", "minItems": 2, "maxItems": 3,
     "items": {"type": "object", "additionalProperties": False, "required": ["ok"],
               "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}}}},
]

_model = None


def model():
    global _model
    if _model is None:
        random = jaxkv.Model.random(CONFIG, seed=3)
        _model = jaxkv.Model(CONFIG, random.params, byte_level())
    return _model


def text(tokens):
    return bytes(t for t in tokens if t < 256).decode("utf-8")


RECOMPUTE_SHAPE = (8, 160)  # rows, tokens: every row this file checks fits (the longest is 16 + 120 tokens)


def recompute_padded(rows):
    """`recompute` (the no-cache logits of each row) with the rows padded to one shape for the whole file: causal,
    so neither the padding after a row nor the padding rows change its logits, and one compiled forward serves
    every check (a shape per row length was a compile per check)."""
    B, T = RECOMPUTE_SHAPE
    assert len(rows) <= B and max(map(len, rows)) <= T, (len(rows), max(map(len, rows)))
    padded = [row + [0] * (T - len(row)) for row in rows] + [[0] * T] * (B - len(rows))
    return [logits[:len(row)] for logits, row in zip(recompute(model(), padded), rows)]


def test_json_schemas_validate():
    prompts = ["Answer in JSON: ", "{", "x"]
    for temperature in (0.0, 1.0):
        gen = jaxkv.generate(model(), prompts, max_new_tokens=160, temperature=temperature, seed=7,
                             constraint=[jaxkv.JsonSchema(s) for s in SCHEMAS])
        for schema, tokens, reason in zip(SCHEMAS, gen.tokens, gen.finish_reasons):
            assert reason == "stop", (schema, text(tokens))
            jsonschema.validate(json.loads(text(tokens)), schema)
        assert gen.stats["constraint_incomplete"] == []


# A Lark grammar and its GBNF twin: sums in parentheses, e.g. "(1+(2+3))".
LARK = 'start: expr\nexpr: DIGIT | "(" expr "+" expr ")"\nDIGIT: /[0-9]/\n'
GBNF = 'root ::= expr\nexpr ::= [0-9] | "(" expr "+" expr ")"\n'


def sums(s):
    """Whether s is in LARK's language (a hand parser: digit, or (expr+expr))."""
    def expr(i):
        if i < len(s) and s[i].isdigit():
            return i + 1
        if i < len(s) and s[i] == "(":
            j = expr(i + 1)
            if j is not None and j < len(s) and s[j] == "+":
                k = expr(j + 1)
                if k is not None and k < len(s) and s[k] == ")":
                    return k + 1
        return None
    return expr(0) == len(s)


OTHERS = [jaxkv.Regex(r"[0-9]{3}-[a-z]{2,4}(\.[a-z]{2})?"), jaxkv.Choice(["yes", "no", "maybe not"]),
          jaxkv.Grammar(LARK), jaxkv.Grammar(GBNF)]


def satisfies(constraint, s):
    if isinstance(constraint, jaxkv.Regex):
        return re.fullmatch(constraint.pattern, s) is not None
    if isinstance(constraint, jaxkv.Choice):
        return s in constraint.strings
    return sums(s)


_greedy = {}
_engines = {}
NGRAM = jaxkv.Speculation("ngram", num_tokens=3, adaptive=False)


def shared_engine(speculative: bool = False):
    """The file's engine without speculation or with the model drafting for itself (k = 3), one of each for every
    test that runs one (an engine compiles its programs: one shape, slots 4, max_len 256, 4 steps per dispatch,
    serves all); stats reset, no request in flight. The plain engine has widths 2 and 4 (slots compacted into a
    narrower dispatch, the constrained rows' masks with them); the speculative one only 4 (each width compiles the
    whole speculative decode, ~16 s): its verifies check proposals against the masks whatever the proposer (the
    n-gram proposer in the engine: tests/engine/test_engine_speculation.py), and the draft's proposals are both
    kept and refused (test_speculative_engine_requests_decode_as_generate)."""
    if speculative not in _engines:
        _engines[speculative] = jaxkv.Engine(
            model(), slots=4, max_len=256, steps_per_dispatch=4, decode_widths=[4] if speculative else [2, 4],
            speculative=jaxkv.Speculation("draft", num_tokens=3, draft=model(), adaptive=False) if speculative
            else None)
    e = _engines[speculative]
    assert not e.pending
    e.reset_stats()
    return e


def greedy_run():
    """One greedy call over every constraint (and an unconstrained row), kept for the tests that read it."""
    if not _greedy:
        prompts = ["Answer in JSON: ", "{", "x", "code: ", "Is it? ", "1+2=", "(", "The KV cache"]
        constraints = [jaxkv.JsonSchema(s) for s in SCHEMAS] + OTHERS + [None]
        _greedy.update(prompts=prompts, constraints=constraints,
                       gen=jaxkv.generate(model(), prompts, max_new_tokens=120, constraint=constraints))
    return _greedy["prompts"], _greedy["constraints"], _greedy["gen"]


def test_regex_choice_grammar_match():
    prompts = ["code: ", "Is it? ", "1+2=", "("]
    for temperature in (0.0, 1.0):
        gen = jaxkv.generate(model(), prompts, max_new_tokens=60, temperature=temperature, seed=3,
                             constraint=OTHERS)
        for c, tokens, reason in zip(OTHERS, gen.tokens, gen.finish_reasons):
            s = text(tokens)
            assert satisfies(c, s) and reason == "stop", (c, s, reason)


def test_greedy_is_the_argmax_of_what_llguidance_allows():
    prompts, constraints, gen = greedy_run()
    tok = model().tokenizer
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=CONFIG.vocab_size, eos_token=[256])
    rows = [tok.encode(p).ids + out for p, out in zip(prompts, gen.tokens)]
    logits = recompute_padded(rows)
    changed = 0
    for b, (c, out) in enumerate(zip(constraints, gen.tokens)):
        if c is None:
            continue
        matcher = llguidance.LLMatcher(lltok, c.grammar, log_level=0)
        bits = np.zeros((1, 9), np.int32)
        start = len(rows[b]) - len(out)
        for i, token in enumerate(out):
            llguidance.numpy.fill_next_token_bitmask(matcher, bits)
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:CONFIG.vocab_size] == 1
            step = np.asarray(logits[b][start + i - 1], np.float32)
            best = np.max(np.where(allowed, step, -np.inf))
            assert allowed[token] and step[token] >= best - 1e-4, (b, i, token, int(np.argmax(step)))
            changed += not allowed[int(np.argmax(step))]
            assert matcher.consume_token(token)
        assert matcher.is_stopped() or out[-1] == 256, (b, text(out))
    assert changed > 0  # the constraint did change some steps


def test_unconstrained_row_decodes_as_alone():
    prompts, constraints, gen = greedy_run()
    alone = jaxkv.generate(model(), prompts[-1:], max_new_tokens=120)
    assert gen.tokens[-1] == alone.tokens[0]


def test_paged_samples_and_prefix_cache():
    """n = 2 samples per prompt on the paged cache through a prefix cache: greedy gives the contiguous run's
    tokens; sampled (the second call, hitting the first's prompt pages), each sample satisfies its own matcher."""
    prompts, constraints, gen = greedy_run()
    cache = jaxkv.PrefixCache(model(), num_pages=256, page_size=8)
    paged = jaxkv.generate(model(), prompts[:4], n=2, max_new_tokens=120, constraint=constraints[:4],
                           prefix_cache=cache)
    assert paged.tokens == [t for t in gen.tokens[:4] for _ in range(2)]
    sampled = jaxkv.generate(model(), prompts[:4], n=2, max_new_tokens=120, constraint=constraints[:4],
                             prefix_cache=cache, temperature=1.0, seed=11)
    assert sampled.stats["prefix_hit_tokens"] > 0
    for i, tokens in enumerate(sampled.tokens):
        c = constraints[i // 2]
        if isinstance(c, jaxkv.JsonSchema):
            jsonschema.validate(json.loads(text(tokens)), c.schema)
        else:
            assert satisfies(c, text(tokens))
    assert any(sampled.tokens[i] != sampled.tokens[i + 1] for i in range(0, 8, 2))  # each sample its own draw


def test_length_stop_tokens_and_refused_tokens():
    gen = jaxkv.generate(model(), ["a", "b"], max_new_tokens=5,
                         constraint=[jaxkv.Regex("[a-z]{40}"), jaxkv.Choice(["no"])], stop_tokens=[])
    assert gen.finish_reasons == ["length", "stop"] and gen.stats["constraint_incomplete"] == [0]
    assert text(gen.tokens[1]) == "no"  # ended by its constraint, with no stop token to emit
    with pytest.raises(ValueError, match="prompt 0: token 0 is not allowed"):
        jaxkv.generate(model(), ["a"], max_new_tokens=3, sampler=lambda logits, key: jnp.zeros((1,), jnp.int32),
                       constraint=jaxkv.Choice(["no"]))
    no_tokenizer = jaxkv.Model(CONFIG, model().params)
    with pytest.raises(ValueError, match="tokenizer"):
        jaxkv.generate(no_tokenizer, [[1, 2]], max_new_tokens=3, constraint=jaxkv.Choice(["no"]))


def test_beam_search_hypotheses_satisfy():
    """Beams: every hypothesis that ends at eos satisfies its constraint; one beam is greedy search, so it gives
    generate's greedy tokens, the eos that ends a complete constraint included (issue 50: generate emits it)."""
    prompts, constraints, gen = greedy_run()
    picked = [0, 3, 4, 5]
    result = jaxkv.beam_search(model(), [prompts[i] for i in picked], num_beams=3, num_return_sequences=3,
                               max_new_tokens=120, constraint=[constraints[i] for i in picked])
    for i, hyps in zip(picked, result):
        for h in hyps:
            assert h.finish_reason == "stop" and h.tokens[-1] == 256
            s, c = text(h.tokens[:-1]), constraints[i]
            if isinstance(c, jaxkv.JsonSchema):
                jsonschema.validate(json.loads(s), c.schema)
            else:
                assert satisfies(c, s), (c, s)
    one = jaxkv.beam_search(model(), [prompts[i] for i in picked], num_beams=1, max_new_tokens=121,
                            constraint=[constraints[i] for i in picked])
    assert [hyps[0].tokens for hyps in one] == [gen.tokens[i] for i in picked]


def test_engine_requests_decode_as_generate():
    """Engine.submit(constraint=): constrained and unconstrained requests in one engine, slots reused and
    compacted, give generate's greedy tokens (the unconstrained one too); a bad constraint is refused at submit."""
    prompts, constraints, gen = greedy_run()
    engine = shared_engine()
    # two one-token requests in slots 0 and 1, two JSON ones in 2 and 3 that move down once those end
    order = [5, 6, 0, 1, 7, 2, 3, 4]
    results = engine.generate([dict(prompt=prompts[i], constraint=constraints[i]) for i in order],
                              max_new_tokens=120)
    assert engine.stats["slot_moves"] > 0
    assert [r.tokens for r in results] == [gen.tokens[i] for i in order]
    assert [r.finish_reason for r in results] == [gen.finish_reasons[i] for i in order]
    steps = engine._grammar.steps
    assert steps > 0
    plain = engine.generate([prompts[7]], max_new_tokens=120)  # no constrained request: no host step
    assert plain[0].tokens == gen.tokens[7] and engine._grammar.steps == steps
    with pytest.raises(ValueError, match="constraint") as refused:
        engine.submit("x", max_new_tokens=4, constraint="{}")
    assert refused.value.argument == "constraint"
    assert not engine.pending


def test_speculative_verifies_against_the_masks():
    """The model drafting for itself proposes its unconstrained greedy tokens: the verify checks them against
    each row's masks (those the constraint refuses are rejected), so the output is the plain constrained greedy
    one, with some proposals kept and some refused."""
    prompts, constraints, gen = greedy_run()
    spec = jaxkv.generate(model(), prompts, max_new_tokens=120, constraint=constraints,
                          speculative=jaxkv.Speculation("draft", num_tokens=3, draft=model(), adaptive=False))
    assert spec.tokens == gen.tokens and spec.finish_reasons == gen.finish_reasons
    assert 0 < spec.stats["spec_accepted"] < spec.stats["spec_proposed"]


def test_speculative_engine_requests_decode_as_generate():
    """Engine(speculative=) with constrained requests: the model drafting for itself, each verify's proposals
    checked against the slots' masks, gives generate's plain greedy tokens."""
    prompts, constraints, gen = greedy_run()
    engine = shared_engine(speculative=True)
    results = engine.generate([dict(prompt=p, constraint=c) for p, c in zip(prompts, constraints)],
                              max_new_tokens=120)
    assert [r.tokens for r in results] == gen.tokens
    assert [r.finish_reason for r in results] == gen.finish_reasons
    assert 0 < engine.stats["spec_accepted"] < engine.stats["spec_proposed"]


# Issue 50: the log-probabilities of a constrained row are the model's (before the mask), and a complete
# constraint ends its row with the stop token, as a row that chose one.
LP_PROMPTS = ["Is it? ", "code: ", "{"]
LP_CONSTRAINTS = [jaxkv.Choice(["yes", "maybe not"]), jaxkv.Regex("[a-c]{2,5}x"),
                  jaxkv.JsonSchema({"type": "object", "additionalProperties": False, "required": ["ok"],
                                    "properties": {"ok": {"type": "boolean"}}})]
LP_TOL = dict(atol=1e-4, rtol=0)  # (helpers.tolerances "logprobs": a cached program against the no-cache pass)


def assert_models_logprobs(prompts, outs, logprobs, tops, constraints):
    """Each token's log-probability and its top alternatives are log_softmax of the model's own logits
    (`jaxkv.logits`, no cache, no mask); each row ends with the stop token (256) after a whole answer; the mask
    forced some tokens the model did not prefer (so a masked distribution would report other numbers)."""
    tok = model().tokenizer
    rows = [tok.encode(p).ids + out for p, out in zip(prompts, outs)]
    forced = 0
    for row, out, lp, top, c, logits in zip(rows, outs, logprobs, tops, constraints, recompute_padded(rows)):
        start = len(row) - len(out)
        x = np.asarray(logits[start - 1: len(row) - 1], np.float64)  # (numpy: no compile per row length)
        logp = x - x.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        np.testing.assert_allclose(lp, logp[np.arange(len(out)), out], **LP_TOL)
        k = len(top[0])
        np.testing.assert_allclose([[v for _, v in step] for step in top], -np.sort(-logp, axis=-1)[:, :k], **LP_TOL)
        assert [step[0][0] for step in top] == [int(np.argmax(x)) for x in logp]  # the model's best, allowed or not
        forced += sum(int(np.argmax(x)) != t for x, t in zip(logp, out))
        assert out[-1] == 256, text(out)
        s = text(out)
        assert satisfies(c, s) if not isinstance(c, jaxkv.JsonSchema) else jsonschema.validate(json.loads(s),
                                                                                               c.schema) is None
    assert forced > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_logprobs_are_the_models(temperature):
    """generate (contiguous, paged n = 2, speculative n-gram) and the engine (plain and speculative), for
    Choice, Regex and JsonSchema rows: logprobs and top_logprobs are the model's (before this fix, 0.0 for every
    forced token: the masked distribution's)."""
    kw = dict(max_new_tokens=40, temperature=temperature, seed=5, logprobs=2, constraint=LP_CONSTRAINTS)
    gen = jaxkv.generate(model(), LP_PROMPTS, **kw)
    assert gen.finish_reasons == ["stop"] * 3 and gen.stats["constraint_incomplete"] == []
    assert_models_logprobs(LP_PROMPTS, gen.tokens, gen.logprobs, gen.top_logprobs, LP_CONSTRAINTS)
    paged = jaxkv.generate(model(), LP_PROMPTS, n=2, **kw)
    assert_models_logprobs([p for p in LP_PROMPTS for _ in range(2)], paged.tokens, paged.logprobs,
                           paged.top_logprobs, [c for c in LP_CONSTRAINTS for _ in range(2)])
    spec = jaxkv.generate(model(), LP_PROMPTS, speculative=NGRAM, **kw)
    assert spec.stats["spec_proposed"] > 0
    assert_models_logprobs(LP_PROMPTS, spec.tokens, spec.logprobs, spec.top_logprobs, LP_CONSTRAINTS)
    if temperature == 0:
        assert spec.tokens == gen.tokens
    for speculative in (False, True):
        results = shared_engine(speculative).generate([dict(prompt=p, constraint=c, seed=5 + i, logprobs=2)
                                   for i, (p, c) in enumerate(zip(LP_PROMPTS, LP_CONSTRAINTS))],
                                  max_new_tokens=40, temperature=temperature)
        assert [r.finish_reason for r in results] == ["stop"] * 3
        assert_models_logprobs(LP_PROMPTS, [r.tokens for r in results], [r.logprobs for r in results],
                               [r.top_logprobs for r in results], LP_CONSTRAINTS)
        if temperature == 0:
            assert [r.tokens for r in results] == gen.tokens


def test_complete_constraint_emits_its_stop_token():
    """"yes" is 3 tokens: with room, the stop token follows it (counted, with the model's log-probability), on
    every path; with exactly 3 tokens of budget there is no room for it and the row still ends "stop" (the
    constraint is complete: its answer is whole, and it is not listed as incomplete). With min_tokens past the
    answer the constraint wins (nothing else is allowed): the stop token is emitted before min_tokens. A call's
    own stop token (not the eos) is the one emitted, whether the masks are filled by one thread or the pool."""
    yes = jaxkv.Choice(["yes"])
    ngram = jaxkv.Speculation("ngram", num_tokens=2, adaptive=False)
    for speculative in (None, ngram):
        for new, want in ((4, [121, 101, 115, 256]), (3, [121, 101, 115])):
            gen = jaxkv.generate(model(), ["Is it? "], max_new_tokens=new, constraint=yes, speculative=speculative)
            assert (gen.tokens, gen.finish_reasons, gen.stats["constraint_incomplete"]) == ([want], ["stop"], [])
            assert len(gen.logprobs[0]) == len(want)
            # the file's engines (the speculative one proposing 3 tokens, not 2: more than the budget of 3)
            r = shared_engine(speculative is not None).generate(
                [dict(prompt="Is it? ", constraint=yes)], max_new_tokens=new)[0]
            assert (r.tokens, r.finish_reason) == (want, "stop")
    paged = jaxkv.generate(model(), ["Is it? "], n=2, max_new_tokens=3, constraint=yes)
    assert paged.finish_reasons == ["stop", "stop"] and paged.tokens == [[121, 101, 115]] * 2
    held = jaxkv.generate(model(), ["Is it? "], max_new_tokens=10, min_tokens=8, constraint=yes)
    assert (held.tokens, held.finish_reasons) == ([[121, 101, 115, 256]], ["stop"])
    r = shared_engine().generate([dict(prompt="Is it? ", constraint=yes, min_tokens=8)], max_new_tokens=10)[0]
    assert (r.tokens, r.finish_reason) == ([121, 101, 115, 256], "stop")


@pytest.mark.parametrize("threads", [1, 2])
def test_own_stop_token_after_a_complete_constraint(monkeypatch, threads):
    """stop_tokens=[ord("!")]: the row's stop id replaces the eos where the constraint may end, with one filling
    thread too (before issue 50 the one-thread fill left llguidance's eos there)."""
    from jaxkv.constraints import matcher

    monkeypatch.setattr(matcher, "threads", lambda: threads)
    for c, want in ((jaxkv.Choice(["yes"]), "yes!"), (jaxkv.Regex("[a-c]{1,9}"), None)):
        gen = jaxkv.generate(model(), ["Is it? "], max_new_tokens=12, constraint=c, stop_tokens=[33])
        out = gen.tokens[0]
        assert gen.finish_reasons == ["stop"] and out[-1] == 33 and 256 not in out, out
        assert text(out) == want if want else re.fullmatch("[a-c]{1,9}!", text(out))
