"""The four constraints a caller passes as `constraint=`: `JsonSchema`, `Regex`, `Choice`, `Grammar`.

Each is a small frozen value: it holds what the caller gave (hashable, so equal constraints share one compiled
grammar) and the grammar llguidance compiles from it, built and checked when the constraint is made. A bad
schema, regex or grammar is a ValueError naming the problem there, before any model, tokenizer or compute is
involved (`llguidance.LLMatcher.validate_grammar` needs no tokenizer).

JSON whitespace is bounded by default: a grammar library's "any whitespace" lets a weak model spend every token
on spaces and newlines (docs/design/constrained.md). `JsonSchema(..., whitespace=)`: "single" (default: at most
one optional space wherever JSON allows whitespace), "compact" (none: `{"a":1,"b":[1,2]}`) or "any" (JSON's own
rule: any run of spaces, tabs and newlines).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

WHITESPACE = {
    "compact": {"whitespace_flexible": False},
    "single": {"whitespace_flexible": False, "whitespace_pattern": "[ ]?"},
    "any": {"whitespace_flexible": True},
}


def llguidance():
    """The llguidance module, imported when a constraint is first made (`import jaxkv` never needs it)."""
    try:
        import llguidance as llg
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("constrained decoding needs llguidance: pip install 'jaxkv[constrained]' "
                          "(or pip install 'llguidance>=1.9,<2')") from exc
    return llg


class Constraint:
    """What every constraint has: `grammar`, the llguidance grammar text it compiles to (checked)."""

    grammar: str

    def _set_grammar(self, grammar: str, what: str):
        error = llguidance().LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"invalid {what}: {error.strip()}")
        object.__setattr__(self, "grammar", grammar)


@dataclasses.dataclass(frozen=True, init=False)
class JsonSchema(Constraint):
    """Output that is one JSON value valid under `schema` (a dict, or its JSON text; `{"type": "object"}` is any
    JSON object). Keywords llguidance cannot enforce (`uniqueItems`, `not`, `if/then/else`) are refused, never
    ignored. `whitespace`: "single" (default), "compact" or "any" (the module docstring)."""

    schema_json: str  # the schema's JSON text, keys in the caller's order (properties are written in that order)
    whitespace: str
    grammar: str = dataclasses.field(compare=False, repr=False)

    def __init__(self, schema, *, whitespace: str = "single"):
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"invalid JSON schema: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"invalid JSON schema: must be a JSON object (a dict), got {type(schema).__name__}")
        if whitespace not in WHITESPACE:
            raise ValueError(f"whitespace must be one of {sorted(WHITESPACE)}, got {whitespace!r}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from None
        object.__setattr__(self, "schema_json", text)
        object.__setattr__(self, "whitespace", whitespace)
        try:
            grammar = llguidance().LLMatcher.grammar_from_json_schema(text, defaults=WHITESPACE[whitespace])
        except ValueError as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from None
        self._set_grammar(grammar, "JSON schema")

    @property
    def schema(self) -> dict:
        return json.loads(self.schema_json)


@dataclasses.dataclass(frozen=True, init=False)
class Regex(Constraint):
    """Output that matches `pattern` in full (Rust `regex` syntax: no look-around, no back-references)."""

    pattern: str
    grammar: str = dataclasses.field(compare=False, repr=False)

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise ValueError(f"a regex must be a string, got {type(pattern).__name__}")
        object.__setattr__(self, "pattern", pattern)
        self._set_grammar(llguidance().LLMatcher.grammar_from_regex(pattern), f"regex {pattern!r}")


@dataclasses.dataclass(frozen=True, init=False)
class Choice(Constraint):
    """Output that is exactly one of `strings`."""

    strings: tuple[str, ...]
    grammar: str = dataclasses.field(compare=False, repr=False)

    def __init__(self, strings: Sequence[str]):
        if isinstance(strings, str) or not isinstance(strings, Sequence):
            raise ValueError(f"a choice must be a list of strings, got {type(strings).__name__}")
        strings = tuple(strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"a choice must be a non-empty list of non-empty strings, got {list(strings)!r}")
        object.__setattr__(self, "strings", strings)
        lark = "start: " + " | ".join(json.dumps(s) for s in strings)
        self._set_grammar(llguidance().LLMatcher.grammar_from_lark(lark), "choice")


@dataclasses.dataclass(frozen=True, init=False)
class Grammar(Constraint):
    """Output in the language of a context-free grammar: llguidance's Lark dialect (`start: ...`; see
    llguidance's docs/syntax.md), or GBNF (llama.cpp's, `root ::= ...`), converted to Lark."""

    text: str
    grammar: str = dataclasses.field(compare=False, repr=False)

    def __init__(self, text: str):
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar must be a non-empty string (Lark or GBNF)")
        object.__setattr__(self, "text", text)
        try:
            grammar = llguidance().grammar_from("grammar", text)
        except ValueError as exc:
            raise ValueError(f"invalid grammar: {exc}") from None
        self._set_grammar(grammar, "grammar")


CONSTRAINTS = (JsonSchema, Regex, Choice, Grammar)


def per_row(constraint, rows: int) -> list | None:
    """`constraint=` as one entry per row (None: unconstrained), or None when no row is constrained: one
    constraint for all rows, or a list of `rows` entries, each a constraint or None. ValueError otherwise."""
    if constraint is None:
        return None
    if isinstance(constraint, Constraint):
        return [constraint] * rows
    if isinstance(constraint, (list, tuple)):
        if len(constraint) != rows:
            raise ValueError(f"constraint is a list of {len(constraint)}; there are {rows} prompts (one entry "
                             f"each, None for an unconstrained prompt)")
        for i, c in enumerate(constraint):
            if c is not None and not isinstance(c, Constraint):
                raise ValueError(f"constraint {i} must be a jaxkv.JsonSchema, Regex, Choice, Grammar or None, "
                                 f"got {type(c).__name__}")
        return list(constraint) if any(c is not None for c in constraint) else None
    raise ValueError(f"constraint must be a jaxkv.JsonSchema, Regex, Choice or Grammar, or a list of them (None "
                     f"for unconstrained prompts), got {type(constraint).__name__}")
