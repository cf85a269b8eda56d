"""What the routes share (`ServerState`, on `app.state.jaxkv`): the model's tokenizer and template, the engine
thread, the served names, the HTTP counters that /metrics reports."""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

from jaxkv.server import protocol


@dataclasses.dataclass
class ServerState:
    """What the routes share: the model's tokenizer and template, the engine thread, the served names, counters."""

    model: object  # jaxkv.Model
    worker: object  # worker.EngineWorker
    model_name: str
    aliases: set  # other names a request's "model" may use for it (the --model argument as given)
    max_len: int
    chat_template: object | None = None  # jaxkv.chat_template.ChatTemplate
    api_key: str | None = None
    tokenizer_info: dict | None = None  # GET /tokenizer_info's answer (`tokenization.read_tokenizer_info`)
    sampling_defaults: dict | None = None  # request fields a body leaves unset take these (`intake.with_defaults`)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    http: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters a text prompt of max_len tokens can have (`protocol.text_char_limit`): a longer one
        is refused before it is tokenized. None: no bound (the body limit bounds the work)."""
        return None if self.tokenizer is None else protocol.text_char_limit(self.tokenizer, self.max_len)
