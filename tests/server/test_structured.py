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
