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
    logits = recompute(model(), rows)
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
    generate's greedy tokens (then the eos that beam search needs to end a hypothesis)."""
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
    assert [hyps[0].tokens for hyps in one] == [gen.tokens[i] + [256] for i in picked]


def test_engine_requests_decode_as_generate():
    """Engine.submit(constraint=): constrained and unconstrained requests in one engine, slots reused and
    compacted, give generate's greedy tokens (the unconstrained one too); a bad constraint is refused at submit."""
    prompts, constraints, gen = greedy_run()
    engine = jaxkv.Engine(model(), slots=4, max_len=256, steps_per_dispatch=4, decode_widths=[2, 4])
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
    spec = jaxkv.Speculation("draft", num_tokens=3, draft=model(), adaptive=False)
    engine = jaxkv.Engine(model(), slots=4, max_len=256, steps_per_dispatch=4, decode_widths=[4], speculative=spec)
    results = engine.generate([dict(prompt=p, constraint=c) for p, c in zip(prompts, constraints)],
                              max_new_tokens=120)
    assert [r.tokens for r in results] == gen.tokens
    assert [r.finish_reason for r in results] == gen.finish_reasons
    assert 0 < engine.stats["spec_accepted"] < engine.stats["spec_proposed"]
