"""A checkpoint's chat template: messages -> the prompt text, rendered as Hugging Face's `apply_chat_template` does.

Where it comes from (the first found): `chat_template.jinja` in the checkpoint directory (what transformers 5
saves), `chat_template.json` ({"chat_template": ...}), or the "chat_template" entry of `tokenizer_config.json`
(a string, or a list of {"name", "template"} from which "default" is taken). The special tokens the template
may name (bos_token, eos_token, ...) come from `tokenizer_config.json` too.

How it renders, and why each piece: the same Jinja setup as transformers, since a template is written against
it: a sandboxed, immutable environment (templates come from model repositories and are untrusted code) with
trim_blocks and lstrip_blocks, the loopcontrols extension, `{% generation %}` blocks rendered as their body,
a `tojson` filter that does not escape HTML or non-ASCII, and the globals raise_exception, strftime_now, dict and
namespace. Messages given reasoning under one of its names get the others too, as transformers does. The
rendered text already holds any BOS the template writes: encode it without adding special tokens.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed to render it."""


class ChatTemplate:
    """A compiled chat template and the special tokens it may name.

        template = ChatTemplate.from_directory(path)     # None when the checkpoint has no template
        text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def from_directory(cls, directory: str | os.PathLike | None) -> "ChatTemplate | None":
        """The template of a checkpoint directory, or None when it has none (ValueError if a file is unreadable)."""
        if directory is None:
            return None
        directory = pathlib.Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        source = None
        if (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        elif (directory / "chat_template.json").is_file():
            source = _read_json(directory / "chat_template.json").get("chat_template")
        if source is None:
            source = config.get("chat_template")
        if isinstance(source, list):  # named templates: transformers uses "default" unless asked for another
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source.strip():
            return None
        special = {}
        for name, value in config.items():
            if name.endswith("_token") and isinstance(value, dict):
                value = value.get("content")
            if name.endswith("_token") and isinstance(value, str):
                special[name] = value
        return cls(source, special)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages` (a list of {"role", "content", ...} dicts). kwargs are template
        variables beside the special tokens (they override them, as in transformers)."""
        import jinja2

        chat = []
        for message in messages:
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        try:
            return self._template.render(**{"tools": None, "documents": None, **self.special_tokens, **kwargs,
                                            "messages": chat, "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a template bug
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    return data if isinstance(data, dict) else {}


_ENVIRONMENT = None


def _environment():
    """The Jinja environment chat templates are written against (module docstring), built once."""
    # Long on purpose: the filters, tests and globals templates use, registered in one place.
    global _ENVIRONMENT
    if _ENVIRONMENT is not None:
        return _ENVIRONMENT
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names (no reaching Python internals from a template)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    _ENVIRONMENT = env
    return env
