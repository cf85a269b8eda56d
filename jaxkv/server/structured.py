"""Structured output in `jaxkv serve`: OpenAI's `response_format`, vLLM's `structured_outputs` and `tools` with
`tool_choice`, as the `jaxkv.constraints` a request's sequences are decoded under, and the tool calls read back
from what they produced.

- `response_format`: {"type": "text"} (nothing), {"type": "json_object"} (any JSON object; with a "schema", as
  instructor < 1.4's JSON_SCHEMA mode and Fireworks-style clients send it, that schema, closed as under strict:
  Fireworks' JSON mode, where the form comes from, holds it so), {"type": "json_schema", "json_schema": {"name",
  "description", "schema", "strict"}} (the schema, always enforced: a keyword llguidance cannot enforce is a 400,
  never ignored; under `strict: true` an object schema without `additionalProperties` is closed, `closed`: the
  output carries only the keys it names, as OpenAI's strict mode guarantees). Any other key is a 400.
- `structured_outputs` (vLLM's extension): exactly one of "json" (a schema), "regex", "choice" (a list of
  strings), "grammar" (Lark or GBNF), "json_object": true; "disable_any_whitespace" is accepted (JSON here is
  always bounded: at most one space where JSON allows whitespace) and "whitespace_pattern" refused.
- `tools` + `tool_choice` (chat only): "none" or unset with no tools (plain text); a named function
  ({"type": "function", "function": {"name"}}): the output is that function's arguments, held to its
  `parameters` schema (`_arguments_schema`: always a JSON object; no parameters, `{}` or an object schema naming
  no keys is OpenAI's empty parameter list, the object `{}`; `strict: true` closes its objects as above);
  "required": the output is a JSON array of one or more {"name", "arguments"} calls, each held to its function's
  schema (one with `parallel_tool_calls: false`); both come back as OpenAI `tool_calls` with finish_reason
  "tool_calls".
  "auto" (the default with tools) where the chat template names a call format jaxkv reads back: Hermes-style
  `<tool_call>{"name", "arguments"}</tool_call>` blocks (Qwen's templates: the text is decoded freely and the
  blocks are parsed out), or Llama 3.1-3.3's JSON (the template asks for `{"name": function name, "parameters":
  dictionary of argument name and its value}`: a reply that is such an object, or several joined by ";", after an
  optional `<|python_tag|>`, is read as calls, as vLLM's llama3_json parser reads it; any other reply is the
  content); with a template of another format, a 400 (jaxkv cannot read its calls back).

Every bad field is a `FieldError` naming the field, raised while the body is checked (`protocol` answers it as
its 400 in OpenAI's shape): nothing reaches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# The instruction Llama 3.1-3.3's chat templates give for a tool call (their JSON format's mark).
LLAMA3_JSON_MARK = '{"name": function name, "parameters": dictionary of argument name and its value}'
LLAMA3_PYTHON_TAG = "<|python_tag|>"


class FieldError(ValueError):
    """A bad structured-output field: `protocol.ApiError`'s message, param and code (this module sits below
    `protocol`, which imports it)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclasses.dataclass
class ToolCalls:
    """How a chat request's output becomes tool calls: `mode` "named" (the output is `name`'s arguments),
    "required" (a JSON array of calls) or "auto" (free text, read in the template's `format`: "hermes" or
    "llama3_json", set by `check_auto`)."""

    mode: str
    name: str | None = None
    format: str = "hermes"


def _constraints():
    try:
        import jaxkv.constraints as constraints

        constraints.spec.llguidance()
    except ImportError as exc:
        raise FieldError(f"structured output needs llguidance on the server: {exc}", code="unsupported_parameter",
                       param="response_format") from None
    return constraints


def _made(make, param: str):
    try:
        return make()
    except ValueError as exc:
        raise FieldError(str(exc), param=param) from None


# The keys each response_format type takes (OpenAI's, and json_object's "schema" as the clients above send it).
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _unknown(value: dict, allowed: set, where: str):
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise FieldError(f"'{where}' does not take {unknown[0]!r} (it takes {', '.join(sorted(allowed))})",
                         param=f"{where}.{unknown[0]}", code="unknown_parameter")


def _response_format(value):
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError("'response_format' must be an object with a 'type': text, json_object or json_schema",
                       param="response_format")
    kind = value["type"]
    if kind not in _FORMAT_KEYS:
        raise FieldError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                         param="response_format.type")
    _unknown(value, _FORMAT_KEYS[kind], "response_format")  # a key jaxkv would not honour is refused, not ignored
    if kind == "text":
        return None
    c = _constraints()
    if kind == "json_object":
        schema = value.get("schema")
        if schema is None:
            return _made(lambda: c.JsonSchema({"type": "object"}), "response_format")
        if not isinstance(schema, dict):
            raise FieldError("'response_format.schema' must be a JSON schema object", param="response_format.schema")
        # closed as Fireworks, whose JSON mode this form comes from, holds it: named keys only (`closed`)
        return _made(lambda: c.JsonSchema(closed(schema)), "response_format.schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise FieldError("'response_format.json_schema' must be an object with a 'schema' object",
                       param="response_format.json_schema")
    _unknown(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError("'response_format.json_schema.strict' must be a boolean",
                         param="response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})
    return _made(lambda: c.JsonSchema(closed(schema) if strict else schema), "response_format.json_schema")


# Sub-schema places a strict schema's objects are closed in (allOf apart: `closed`).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "contains")


def closed(schema, *, close: bool = True):
    """`schema` as OpenAI's strict mode holds it: every object schema without an explicit `additionalProperties`
    takes none (`additionalProperties: false`), so the output carries only the keys the schema names (OpenAI
    refuses such schemas; closing them keeps clients that send them working). A copy; the caller's is unchanged.

    Not closed, since closing would refuse keys the schema does name: an object with `allOf`, `anyOf`, `oneOf`
    or `$ref` beside it (its keys are named there; the branches and the target are closed themselves) or with
    `unevaluatedProperties`, and `allOf`'s branches (each is checked against the whole object, so a closed
    branch would refuse the keys its siblings name). An explicit `additionalProperties` (true, or a schema) is
    kept: the client said the object is open."""
    if not isinstance(schema, dict):  # a boolean schema
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, close=False) for sub in out["allOf"]]
    kinds = out.get("type")
    is_object = kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or (
        kinds is None and "properties" in out)
    names_elsewhere = {"allOf", "anyOf", "oneOf", "$ref", "unevaluatedProperties"} & set(out)
    if close and is_object and "additionalProperties" not in out and not names_elsewhere:
        out["additionalProperties"] = False
    return out


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("'structured_outputs' must be an object with one of " + ", ".join(_KINDS),
                       param="structured_outputs")
    unknown = sorted(set(value) - set(_KINDS) - {"disable_any_whitespace"})
    if unknown:
        raise FieldError(f"'structured_outputs' does not take {unknown[0]!r} in jaxkv serve (it takes one of "
                       f"{', '.join(_KINDS)})", param=f"structured_outputs.{unknown[0]}", code="unsupported_parameter")
    given = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise FieldError(f"'structured_outputs' needs exactly one of {', '.join(_KINDS)}, got "
                       f"{', '.join(given) or 'none'}", param="structured_outputs")
    kind, spec = given[0], value[given[0]]
    c = _constraints()
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return _made(lambda: c.JsonSchema({"type": "object"}), param)
    if kind == "json":
        return _made(lambda: c.JsonSchema(spec), param)
    if kind == "regex":
        return _made(lambda: c.Regex(spec), param)
    if kind == "choice":
        return _made(lambda: c.Choice(spec), param)
    return _made(lambda: c.Grammar(spec), param)


# A function without parameters: OpenAI's empty parameter list, whose arguments are the object {}.
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# Keywords that say nothing about which keys an object has.
_ANNOTATIONS = {"type", "title", "description", "$schema", "$id", "$comment", "$defs", "definitions", "default",
                "examples"}


def _arguments_schema(params, where: str, *, strict: bool = False) -> dict:
    """A function's `parameters` -> the schema its call's arguments are held to. The arguments are always a JSON
    object (OpenAI's), so a schema of another type is a 400 and one without a type gets "object"; omitted
    `parameters`, `{}` and an object schema naming no keys (no properties, no required, nothing that admits keys)
    are OpenAI's empty parameter list: `NO_ARGUMENTS`, which admits only `{}` (an open object would let a model
    write any keys, and `{}` any JSON value). `strict`: the function's own `strict: true` (`closed`)."""
    if params is None:
        return NO_ARGUMENTS
    if not isinstance(params, dict):
        raise FieldError(f"{where} must be a JSON schema object", param=where)
    if params.get("type", "object") != "object":
        raise FieldError(f"{where} must describe a JSON object (a call's arguments are one), got type "
                         f"{params['type']!r}", param=where)
    if not params.get("properties") and not params.get("required") and set(params) <= _ANNOTATIONS | {
            "properties", "required"}:
        return NO_ARGUMENTS
    schema = {**params, "type": "object"}
    return closed(schema) if strict else schema


def _tools(body):
    """The checked tools -> {name: the schema its arguments are held to}."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        raise FieldError("'tools' must be a list of {type: function, function: {name, parameters}} objects",
                       param="tools")
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}",
                           param=f"tools[{i}]")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise FieldError(f"tools[{i}].function.strict must be a boolean", param=f"tools[{i}].function.strict")
        out[fn["name"]] = _arguments_schema(fn.get("parameters"), f"tools[{i}].function.parameters",
                                            strict=bool(strict))
    return out


def tool_plan(body):
    """A chat body's tools -> (the constraint, `ToolCalls`) or (None, None) when no tool call is asked for ("auto"
    is checked against the chat template later: `check_auto`)."""
    choice = body.get("tool_choice")
    if not body.get("tools"):
        if choice not in (None, "none"):
            raise FieldError("'tool_choice' needs 'tools'", param="tool_choice")
        return None, None
    tools = _tools(body)
    if choice == "none":
        return None, None
    c = _constraints()
    if choice is None or choice == "auto":
        return None, ToolCalls("auto")
    if choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": name}, "arguments": params}} for name, params in tools.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if body.get("parallel_tool_calls") is False:  # OpenAI's switch: one call at most
            schema["maxItems"] = 1
        return _made(lambda: c.JsonSchema(schema), "tools"), ToolCalls("required")
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldError("'tool_choice' must be none, auto, required or {type: function, function: {name}}",
                       param="tool_choice")
    if fn["name"] not in tools:
        raise FieldError(f"tool_choice names {fn['name']!r}, which is not in 'tools'", param="tool_choice")
    schema = tools[fn["name"]]
    # no arguments: exactly "{}", the string OpenAI returns for such a call (there is nothing to space)
    whitespace = "compact" if schema == NO_ARGUMENTS else "single"
    return _made(lambda: c.JsonSchema(schema, whitespace=whitespace), "tools"), ToolCalls("named", fn["name"])


def auto_format(template_source: str | None) -> str | None:
    """The tool-call format a chat template asks its model for, of those jaxkv reads back ("hermes",
    "llama3_json"), or None."""
    if template_source is None:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if LLAMA3_JSON_MARK in template_source:
        return "llama3_json"
    return None


def check_auto(plan: ToolCalls | None, template_source: str | None):
    """tool_choice "auto" needs a chat template whose calls jaxkv reads back (`auto_format`): records the format on
    the plan, else a 400."""
    if plan is None or plan.mode != "auto":
        return
    plan.format = auto_format(template_source)
    if plan.format is None:
        raise FieldError("tool_choice 'auto' needs a chat template whose tool calls jaxkv can read back (Hermes-style "
                         "<tool_call> JSON, as Qwen's, or Llama 3.1's JSON); this model's template writes another "
                         "format: use tool_choice 'required' or a named function", param="tool_choice",
                         code="unsupported_parameter")


def constraint(body, *, chat: bool):
    """A body's structured-output fields -> (a `jaxkv.constraints` constraint or None, `ToolCalls` or None);
    FieldError for a bad or conflicting one."""
    fmt, outputs = _response_format(body.get("response_format")), _structured_outputs(body.get("structured_outputs"))
    tool_constraint, calls = tool_plan(body) if chat else (None, None)
    asked = [name for name, c in (("response_format", fmt), ("structured_outputs", outputs),
                                  ("tools", tool_constraint)) if c is not None]
    if len(asked) > 1:
        raise FieldError(f"send one of {' and '.join(asked)}: each sets the output's format", param=asked[1])
    return fmt or outputs or tool_constraint, calls


def _call(name: str, arguments) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def tool_calls(plan: ToolCalls, text: str) -> tuple[str | None, list[dict]]:
    """What a finished choice's text says -> (the message content, its tool calls; [] for none). A constrained
    output that is not complete (cut by max_tokens) gives no calls: the text stays the content."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(c["name"], c["arguments"]) for c in calls]
    if plan.format == "llama3_json":
        return _llama3_json_calls(text)
    calls = []
    for block in HERMES_CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append(_call(call["name"], call.get("arguments", {})))
    content = HERMES_CALL.sub("", text).strip() if calls else text
    return content or None, calls


def _llama3_json_calls(text: str) -> tuple[str | None, list[dict]]:
    """Llama 3.1's tool-call reply: `{"name": ..., "parameters": {...}}` objects joined by ";" (an optional
    <|python_tag|> first, whitespace around) -> (None, the calls); any other text is the content, with no calls."""
    body = text.strip()
    if body.startswith(LLAMA3_PYTHON_TAG):
        body = body[len(LLAMA3_PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            call, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("parameters", call.get("arguments")), dict)):
            return text, []
        calls.append(_call(call["name"], call.get("parameters", call.get("arguments"))))
        rest = body[at:].lstrip()
        if not rest:
            return None, calls
        if not rest.startswith(";"):
            return text, []
        at = len(body) - len(rest[1:].lstrip())
