"""The server's structured-output fields without a server (`jaxkv.server.structured`): each field to its
constraint, the conflicts and bad values refused with the field named, and tool calls read back from text."""

import json

import pytest

import jaxkv
from jaxkv.server import structured

pytest.importorskip("llguidance")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_fields_become_constraints():
    assert structured.constraint({"response_format": {"type": "text"}}, chat=True) == (None, None)
    c, _ = structured.constraint({"response_format": {"type": "json_object"}}, chat=False)
    assert c == jaxkv.JsonSchema({"type": "object"})
    c, _ = structured.constraint({"structured_outputs": {"regex": "[a-z]+"}}, chat=False)
    assert c == jaxkv.Regex("[a-z]+")
    c, _ = structured.constraint({"structured_outputs": {"choice": ["a", "b"]}}, chat=False)
    assert c == jaxkv.Choice(["a", "b"])
    c, plan = structured.constraint({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_weather"}}}, chat=True)
    assert c == jaxkv.JsonSchema(TOOLS[0]["function"]["parameters"]) and plan.mode == "named"
    c, plan = structured.constraint({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                                    chat=True)
    assert c.schema["maxItems"] == 1 and plan.mode == "required"
    assert structured.constraint({"tools": TOOLS}, chat=True)[1].mode == "auto"
    assert structured.constraint({"tools": TOOLS, "tool_choice": "none"}, chat=True) == (None, None)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integr"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_fields_name_the_field(body, param):
    with pytest.raises(structured.FieldError) as refused:
        structured.constraint(body, chat=True)
    assert refused.value.param == param
    with pytest.raises(structured.FieldError, match="<tool_call>.*Llama 3.1"):
        structured.check_auto(structured.ToolCalls("auto"), "{{ messages }}")


def test_tool_calls_read_back():
    content, calls = structured.tool_calls(structured.ToolCalls("named", "get_weather"), '{"city": "Oslo"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    content, calls = structured.tool_calls(structured.ToolCalls("required"),
                                           '[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = structured.tool_calls(structured.ToolCalls("auto"), text)
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert structured.tool_calls(structured.ToolCalls("auto"), "no calls") == ("no calls", [])
    assert structured.tool_calls(structured.ToolCalls("named", "f"), '{"cut": ') == ('{"cut": ', [])


def test_llama3_json_tool_calls_read_back():
    """tool_choice "auto" under a Llama 3.1-style template (its JSON instruction, `LLAMA3_JSON_MARK`): a reply that
    is one {"name", "parameters"} object, or several joined by ";" after <|python_tag|>, is calls; prose, a cut
    object, an object followed by prose, or a malformed call is the content with no calls."""
    template = "{{- 'Respond in the format " + structured.LLAMA3_JSON_MARK + ".' }}{{ messages }}"
    plan = structured.ToolCalls("auto")
    structured.check_auto(plan, template)
    assert plan.format == "llama3_json"
    content, calls = structured.tool_calls(plan, ' {"name": "get_weather", "parameters": {"city": "Oslo"}}\n')
    assert content is None and [c["function"] for c in calls] == [{"name": "get_weather",
                                                                   "arguments": '{"city": "Oslo"}'}]
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [json.loads(c["function"]["arguments"]) for c in structured.tool_calls(plan, two)[1]] == [{}, {"x": 1}]
    for text in ("It is sunny in Oslo.", '{"name": "a", "parameters": {}} and then', '{"name": "a", "param',
                 '{"name": 3, "parameters": {}}', '{"name": "a", "parameters": "city"}'):
        assert structured.tool_calls(plan, text) == (text, []), text
    hermes = structured.ToolCalls("auto")
    structured.check_auto(hermes, "{% if tools %}<tool_call>{% endif %}")
    assert hermes.format == "hermes"


# --- issue 50: a function without parameters, json_object with a schema, strict closing -----------------------


@pytest.fixture(scope="module")
def accepts():
    """accepts(constraint, text): whether `constraint` lets the bundled byte-level tokenizer (token i is byte i)
    write exactly `text`."""
    from jaxkv.constraints import matcher

    model = jaxkv.load("tiny")
    lltok = matcher.lltokenizer(model.tokenizer, model.config.vocab_size, model.config.eos_ids)

    def check(constraint, text):
        m = matcher.compiled(constraint, lltok)
        return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting() and not m.is_error()

    return check


def _named(tool, name="f"):
    return {"tools": [{"type": "function", "function": {"name": name, **tool}}],
            "tool_choice": {"type": "function", "function": {"name": name}}}


@pytest.mark.parametrize("tool", [{}, {"parameters": None}, {"parameters": {}}, {"parameters": {"type": "object"}},
                                  {"parameters": {"type": "object", "properties": {}, "required": [],
                                                  "title": "Now", "description": "no arguments"}},
                                  {"parameters": {"type": "object", "properties": {}}, "strict": True}])
def test_a_function_without_parameters_is_called_with_the_empty_object(tool, accepts):
    """OpenAI: omitting parameters defines a function with an empty parameter list, and a call's arguments are a
    JSON object. A forced call admits exactly "{}" (no keys, nothing to space: what OpenAI returns); in a
    "required" array, {} with the format's whitespace. Before: an open object (any keys) or, for {}, any value."""
    c, plan = structured.constraint(_named(tool), chat=True)
    assert plan.mode == "named" and c.schema == structured.NO_ARGUMENTS
    assert accepts(c, "{}")
    for text in ("{ }", '{"a": 1}', '{"now": "x"}', "[1]", "1", '"{}"'):
        assert not accepts(c, text), text
    body = {**_named(tool), "tool_choice": "required"}
    c, plan = structured.constraint(body, chat=True)
    assert plan.mode == "required"
    assert accepts(c, '[{"name": "f", "arguments": {}}]') and accepts(c, '[{"name": "f", "arguments": { }}]')
    for text in ('[{"name": "f", "arguments": {"a": 1}}]', '[{"name": "f", "arguments": [1]}]'):
        assert not accepts(c, text), text
    assert structured.tool_calls(plan, '[{"name": "f", "arguments": {}}]')[1][0]["function"]["arguments"] == "{}"


def test_arguments_are_always_an_object(accepts):
    """A parameters schema without a type is an object schema (a number would pass `properties` alone); one of
    another type is a 400 naming it; one that names keys is kept as given (open unless it says otherwise)."""
    c, _ = structured.constraint(_named({"parameters": {"properties": {"a": {"type": "integer"}}}}), chat=True)
    assert c.schema["type"] == "object" and not accepts(c, "1") and accepts(c, '{"a": 1}')
    assert accepts(c, '{"a": 1, "b": 2}')  # not strict: the schema's own (open) meaning
    for params in ({"type": "array"}, {"type": "string"}, [1]):
        with pytest.raises(structured.FieldError) as refused:
            structured.constraint(_named({"parameters": params}), chat=True)
        assert refused.value.param == "tools[0].function.parameters"
    with pytest.raises(structured.FieldError) as refused:
        structured.constraint(_named({"parameters": {}, "strict": "yes"}), chat=True)
    assert refused.value.param == "tools[0].function.strict"


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def test_json_object_with_a_schema_is_held_to_it(accepts):
    """response_format {"type": "json_object", "schema": ...} (instructor < 1.4's JSON_SCHEMA mode, Fireworks'
    JSON mode) is that schema with its objects closed, as Fireworks holds it; before, any object passed."""
    given = json.loads(json.dumps(SCHEMA))
    c, _ = structured.constraint({"response_format": {"type": "json_object", "schema": given}}, chat=False)
    assert given == SCHEMA  # the client's schema is not changed
    assert c == jaxkv.JsonSchema({**SCHEMA, "additionalProperties": False})
    assert accepts(c, '{"answer": 42}')
    for text in ("{}", '{"answer": "x"}', '{"answer": 1, "extra": 2}', "[]"):
        assert not accepts(c, text), text


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_object", "schema": {"type": "integr"}}, "response_format.schema"),
    ({"type": "json_object", "schema": "{}"}, "response_format.schema"),
    ({"type": "json_object", "json_schema": SCHEMA}, "response_format.json_schema"),
    ({"type": "text", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}, "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strcit": True}}, "response_format.json_schema.strcit"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "true"}},
     "response_format.json_schema.strict"),
])
def test_response_format_keys_jaxkv_would_not_honour_are_400s(response_format, param):
    with pytest.raises(structured.FieldError) as refused:
        structured.constraint({"response_format": response_format}, chat=True)
    assert refused.value.param == param


def test_strict_closes_every_object_that_does_not_say(accepts):
    """json_schema with strict: true: an object schema without additionalProperties takes only the keys it names
    (OpenAI's strict guarantee; OpenAI refuses such schemas, which breaks clients such as instructor's
    TOOLS_STRICT whose nested objects lack it); without strict the schema keeps its JSON Schema meaning."""
    def fmt(schema, strict):
        return structured.constraint({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema, "strict": strict}}}, chat=False)[0]

    nested = {"type": "object", "properties": {"inner": {"$ref": "#/$defs/Inner"}}, "required": ["inner"],
              "$defs": {"Inner": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    for schema in (SCHEMA, nested):
        extra = '{"answer": 1, "x": 2}' if schema is SCHEMA else '{"inner": {"a": 1, "x": 2}}'
        named = '{"answer": 1}' if schema is SCHEMA else '{"inner": {"a": 1}}'
        assert accepts(fmt(schema, True), named) and not accepts(fmt(schema, True), extra)
        assert accepts(fmt(schema, False), extra) and accepts(fmt(schema, None), extra)
    assert accepts(fmt({**SCHEMA, "additionalProperties": True}, True), '{"answer": 1, "x": 2}')  # said open: kept


def test_closed_leaves_what_names_keys_elsewhere_open():
    """`closed` closes objects in properties, $defs, items and anyOf branches; not allOf's branches (each is
    checked against the whole object) nor an object whose keys are named by allOf/anyOf/$ref beside it; an
    explicit additionalProperties is kept; the caller's schema is not changed."""
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"list": {"type": "array", "items": obj},
                                               "either": {"anyOf": [obj, {"type": "null"}]},
                                               "free": {"type": "object", "additionalProperties": True},
                                               "typed": {"type": "object", "additionalProperties": {"type": "string"}},
                                               "ref": {"$ref": "#/$defs/O"}},
              "$defs": {"O": obj}, "allOf": [obj]}
    before = json.dumps(schema)
    out = structured.closed(schema)
    assert json.dumps(schema) == before
    props = out["properties"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in props[
        "either"]["anyOf"][1]
    assert props["free"]["additionalProperties"] is True and props["typed"]["additionalProperties"] == {
        "type": "string"}
    assert props["ref"] == {"$ref": "#/$defs/O"} and out["$defs"]["O"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0] and "additionalProperties" not in out  # allOf beside it
    assert structured.closed({"type": "object"}) == {"type": "object", "additionalProperties": False}
    assert structured.closed({"type": ["object", "null"], "properties": {}})["additionalProperties"] is False
