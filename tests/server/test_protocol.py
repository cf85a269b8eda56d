"""Request parsing (`jaxkv.server.protocol`) without a server: the generation settings harnesses forward under
transformers' names (issue 30, item 6d); messages as chat templates take them (issue 50)."""

import json

import pytest

from jaxkv.server.protocol import ApiError, chat_request, completion_request

OK = {"model": "m", "prompt": "x"}


def test_transformers_names_jaxkv_honours_are_accepted():
    r = completion_request({**OK, "max_new_tokens": 7, "do_sample": False, "temperature": 0.8, "num_beams": 1,
                            "repetition_penalty": 1.0})
    assert r.sampling.max_tokens == 7 and r.sampling.temperature == 0.0  # do_sample false: greedy
    assert completion_request({**OK, "max_tokens": 5, "max_new_tokens": 5}).sampling.max_tokens == 5
    assert completion_request({**OK, "do_sample": True, "temperature": 0.7}).sampling.temperature == 0.7
    chat = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 3})
    assert chat.sampling.max_tokens == 3


@pytest.mark.parametrize("extra, param", [
    (dict(num_beams=4), "num_beams"),
    (dict(repetition_penalty=10.5), "repetition_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={str(t): 1 for t in range(301)}), "logit_bias"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(max_tokens=5, max_new_tokens=6), "max_new_tokens"),
    (dict(do_sample="no"), "do_sample"),
])
def test_values_it_cannot_honour_are_400s_naming_them(extra, param):
    with pytest.raises(ApiError) as e:
        completion_request({**OK, **extra})
    assert e.value.param == param


def test_penalties_and_logit_bias_are_parsed():
    s = completion_request({**OK, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -1,
                            "logit_bias": {"50": -100, "7": 2.5}, "min_tokens": 3}).sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_tokens) == (1.3, 0.5, -1.0, 3)
    assert s.logit_bias == {50: -100.0, 7: 2.5}
    neutral = completion_request(OK).sampling
    assert (neutral.repetition_penalty, neutral.logit_bias, neutral.min_tokens) == (1.0, None, 0)


def test_the_checkpoints_sampling_fills_only_what_a_request_leaves_unset():
    """`jaxkv serve --generation-config auto`: a request's unset sampling fields take the checkpoint's
    generation_config.json values (`intake.with_defaults`); each field it sends overrides, and greedy (temperature 0
    or do_sample false) drops the checkpoint's filters."""
    from jaxkv.server.intake import with_defaults

    defaults = dict(temperature=0.7, top_k=None, top_p=0.9, min_p=None, repetition_penalty=1.1)

    def sampling(**body):
        return completion_request(with_defaults({"model": "m", "prompt": "x", **body}, defaults)).sampling

    s = sampling()
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.7, 0.9, None, 1.1)
    s = sampling(temperature=1.0, top_k=5)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 0.9, 5)
    for greedy in ({"temperature": 0}, {"do_sample": False}):
        s = sampling(**greedy)
        assert (s.temperature, s.top_p, s.repetition_penalty) == (0.0, None, 1.1), greedy


def test_checkpoint_sampling_outside_the_request_ranges_is_refused_at_start():
    """The checkpoint's defaults fill requests' unset fields, which are held to OpenAI's ranges: a
    generation_config.json temperature of 3 would make every request that leaves it unset a 400 (or, clamped, be
    silently changed), so `jaxkv serve --generation-config auto` refuses it at start, naming the way out; in-range
    defaults pass, and `ignore` takes none."""
    import types

    import pytest

    from jaxkv.io.generation import SamplingDefaults
    from jaxkv.server.main import _sampling_defaults

    def model(**fields):
        return types.SimpleNamespace(sampling_defaults=SamplingDefaults(do_sample=True, **fields))

    auto, ignore = types.SimpleNamespace(generation_config="auto"), types.SimpleNamespace(generation_config="ignore")
    assert _sampling_defaults(auto, model(temperature=0.7, top_p=0.9))["temperature"] == 0.7
    assert _sampling_defaults(ignore, model(temperature=3.0)) is None
    for fields, name in [(dict(temperature=3.0), "temperature"), (dict(repetition_penalty=12.0), "repetition_penalty")]:
        with pytest.raises(ValueError, match=f"'{name}'.*--generation-config ignore"):
            _sampling_defaults(auto, model(**fields))


def _call(arguments):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


def test_earlier_tool_call_arguments_reach_the_template_as_objects():
    """Issue 50: clients send an earlier call's `function.arguments` as a JSON string (OpenAI's wire format);
    chat templates `tojson` it, so the request's messages carry the object it encodes (what the model wrote);
    a string that is not a JSON object stays the string; the client's messages are not changed."""
    from jaxkv.chat_template import ChatTemplate
    from jaxkv.server.protocol import template_messages

    sent = [{"role": "user", "content": "Weather in Paris?"}, _call('{"city": "Paris", "days": [1, 2]}'),
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    before = json.dumps(sent)
    messages = chat_request({"model": "m", "messages": sent}).messages
    assert json.dumps(sent) == before
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": [1, 2]}
    assert messages[1]["tool_calls"][0]["id"] == "call_1" and messages[0] is sent[0] and messages[2] is sent[2]
    assert messages[2]["content"] == '{"temp": 21}'  # a tool's result is content, not arguments: as sent
    # Qwen2.5 / Hermes templates write `tool_call.arguments | tojson`
    template = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                            "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
                            "{% endfor %}{% endfor %}")
    assert template.render(messages) == '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
    for kept in ("not json", "", "[1, 2]", "42", '"{}"', "null", {"city": "Oslo"}, None):
        out = template_messages([_call(kept)])[0]["tool_calls"][0]["function"]["arguments"]
        assert out == kept, kept
    assert template_messages([_call("{}")])[0]["tool_calls"][0]["function"]["arguments"] == {}
    odd = [{"role": "assistant", "tool_calls": "x"}, {"role": "assistant", "tool_calls": [5, {"id": "c"}]}]
    assert template_messages(odd) == odd  # nothing to parse: left for the template to judge
