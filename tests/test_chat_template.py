"""Chat templates render as Hugging Face renders them: `ChatTemplate` against transformers' apply_chat_template on
the same checkpoint directory (the bundled tokenizer plus a tokenizer_config.json or chat_template.jinja)."""

import json
import shutil

import pytest

from jaxkv import checkpoint
from jaxkv.chat_template import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")

# written over lines and indented, as templates are: trim_blocks and lstrip_blocks decide the whitespace
SIMPLE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
<|user|>
{{ message['content'] | trim }}{{ eos_token }}
    {% else %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
# the features real templates use: bos, namespace(), loop controls, tojson of non-ASCII, {% generation %},
# raise_exception, a system message pulled out first, reasoning under another name
RICH = ("{{ bos_token }}{% set ns = namespace(system='') %}"
        "{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}"
        "{% if ns.system %}[SYS]{{ ns.system | tojson }}[/SYS]{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}"
        "{% endif %}"
        "{% if message['role'] == 'assistant' %}{% generation %}<A>{% if message.reasoning_content %}"
        "<think>{{ message.reasoning_content }}</think>{% endif %}{{ message['content'] }}{{ eos_token }}"
        "{% endgeneration %}{% else %}<U>{{ message['content'] }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<A>{% endif %}")
MESSAGES = [{"role": "system", "content": "Réponds en français, «brièvement»."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Bonjour", "thinking": "greet back"},
            {"role": "user", "content": "  How are you?  "}]


def checkpoint_dir(tmp_path, template, *, where="config", bos="<|endoftext|>"):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint.TINY_DIR, directory)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "bos_token": {"content": bos, "special": True, "__type": "AddedToken"}}
    if where == "config":
        config["chat_template"] = template
    elif where == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": template}]
    elif where == "jinja":
        (directory / "chat_template.jinja").write_text(template)
        config["chat_template"] = "IGNORED: chat_template.jinja comes first"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def hf_render(directory, messages, add_generation_prompt=True):
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return text, list(ids)


@pytest.mark.parametrize("template,where", [(SIMPLE, "config"), (RICH, "config"), (RICH, "named"), (RICH, "jinja")])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(tmp_path, template, where, add_generation_prompt):
    directory = checkpoint_dir(tmp_path, template, where=where)
    ours = ChatTemplate.from_directory(directory)
    text = ours.render(MESSAGES, add_generation_prompt=add_generation_prompt)
    expected_text, expected_ids = hf_render(directory, MESSAGES, add_generation_prompt)
    assert text == expected_text
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected_ids  # what the server feeds the engine


def test_no_template_and_refusals(tmp_path):
    assert ChatTemplate.from_directory(checkpoint.TINY_DIR) is None  # the bundled model has none
    assert ChatTemplate.from_directory(None) is None
    directory = checkpoint_dir(tmp_path, RICH)
    with pytest.raises(ChatTemplateError, match="bad role robot"):
        ChatTemplate.from_directory(directory).render([{"role": "robot", "content": "x"}])
    # the sandbox: a template cannot reach Python internals
    evil = checkpoint_dir(tmp_path / "evil", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_directory(evil).render(MESSAGES)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON"):
        ChatTemplate.from_directory(broken)
