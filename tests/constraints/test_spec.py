"""The constraints' own checks: a bad schema, regex, choice or grammar is a ValueError naming the problem when
the constraint is made (no model involved); equal constraints are equal (one compiled grammar)."""

import pytest

import jaxkv
from jaxkv.constraints import spec

pytest.importorskip("llguidance")


@pytest.mark.parametrize("make, words", [
    (lambda: jaxkv.JsonSchema({"type": "integr"}), "integr"),
    (lambda: jaxkv.JsonSchema("{not json"), "not JSON"),
    (lambda: jaxkv.JsonSchema([1, 2]), "JSON object"),
    (lambda: jaxkv.JsonSchema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (lambda: jaxkv.JsonSchema({"type": "object"}, whitespace="lots"), "whitespace"),
    (lambda: jaxkv.Regex("(ab"), "unclosed group"),
    (lambda: jaxkv.Regex(3), "string"),
    (lambda: jaxkv.Choice([]), "non-empty"),
    (lambda: jaxkv.Choice("yes"), "list of strings"),
    (lambda: jaxkv.Grammar("start: foo"), "foo"),
    (lambda: jaxkv.Grammar(""), "non-empty"),
])
def test_bad_constraints_name_the_problem(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_equal_constraints_and_per_row():
    a = jaxkv.JsonSchema({"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}})
    b = jaxkv.JsonSchema('{"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b) and a.grammar == b.grammar
    assert a != jaxkv.JsonSchema(a.schema, whitespace="compact")
    assert jaxkv.Grammar('root ::= "a" | "b"').grammar  # GBNF is taken too
    assert spec.per_row(a, 2) == [a, a] and spec.per_row([None, None], 2) is None
    with pytest.raises(ValueError, match="2 prompts"):
        spec.per_row([a], 2)
    with pytest.raises(ValueError, match="constraint 1"):
        spec.per_row([a, "x"], 2)
