"""Requests in: a request authorized, its body read and checked (`protocol`), its prompts turned into token ids
and each sequence's token budget and engine arguments decided, every refusal an `ApiError` naming the field.
Shared by the completions and chat endpoints."""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets

from starlette.requests import Request

from jaxkv.server import protocol
from jaxkv.server.protocol import ApiError
from jaxkv.server.state import ServerState

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) before it is read
BIG_BODY_BYTES = 1 << 20  # a body larger than this is parsed off the event loop


def authorize(request: Request, state: ServerState):
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise ApiError("Incorrect API key provided: pass it as 'Authorization: Bearer KEY'", status=401,
                       code="invalid_api_key")


async def read_body(request: Request, parse):
    """The request body read, decoded and checked (`parse`: a `protocol` function) -> its parsed request. A large
    body is decoded and checked on a thread, so a 64 MB one holds up no other client."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    big = len(raw) > BIG_BODY_BYTES
    try:
        body = await asyncio.to_thread(json.loads, raw) if big else json.loads(raw)
    except RecursionError:
        raise ApiError("the request body is not valid JSON here: it is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past int()'s 4,300 digits
        reason = "it holds an integer of more than 4300 digits" if "4300" in str(e) else str(e)
        raise ApiError(f"the request body is not valid JSON: {reason}") from None
    return await asyncio.to_thread(parse, body) if big else parse(body)


def check_model(name: str, state: ServerState):
    if name != state.model_name and name not in state.aliases:
        raise ApiError(f"The model '{name}' does not exist: this server serves '{state.model_name}'", status=404,
                       param="model", code="model_not_found")


def _context_exceeded(state: ServerState, what: str, length: str) -> ApiError:
    return ApiError(f"This model's maximum context length is {state.max_len} tokens. However, you requested "
                    f"{length} in the {what}. Please reduce the length of the {what}.", param=what,
                    code="context_length_exceeded")


def check_text(text: str, state: ServerState, what: str):
    """A text about to be tokenized: refused (400) if it is longer than any text of max_len tokens can be, before
    the work of tokenizing it, or if it is not Unicode (a lone surrogate, which JSON's escapes can write)."""
    limit = state.max_prompt_chars
    if limit is not None and len(text) > limit:
        raise _context_exceeded(state, what, f"{len(text)} characters (more than {state.max_len} tokens of this "
                                             f"tokenizer can hold: at most {limit})")
    check_unicode(text, what)


def check_unicode(text: str, what: str):
    """A text about to be tokenized: refused (400) if it is not Unicode (a lone surrogate, which JSON's escapes can
    write), which the tokenizer would fail on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"the {what} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) at "
                       f"character {e.start}", param=what) from None


async def encode(state: ServerState, texts: list[str], *, special_tokens: bool) -> list[list[int]]:
    """The token ids of each text, encoded on a thread (`encode_batch` lets go of the GIL): the event loop, and
    so every other client, goes on while a long prompt is tokenized."""
    tokenizer = state.tokenizer

    def encode_all():
        if hasattr(tokenizer, "encode_batch"):
            return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=special_tokens)]
        return [tokenizer.encode(t, add_special_tokens=special_tokens).ids for t in texts]

    return await asyncio.to_thread(encode_all)


async def render_chat(state: ServerState, req: protocol.ChatRequest) -> str:
    """The messages of a chat request rendered by the checkpoint's chat template (400 without one); a template
    that fails on them is the request's 400."""
    if state.chat_template is None:
        raise ApiError("this model has no chat template (its tokenizer config names none): use /v1/completions, "
                       "or serve a checkpoint whose tokenizer_config.json or chat_template.jinja has one",
                       code="no_chat_template")
    from jaxkv.chat_template import ChatTemplateError

    try:  # on a thread, as the tokenizing below: long messages hold up no other client
        rendered = await asyncio.to_thread(state.chat_template.render, req.messages,
                                           add_generation_prompt=req.add_generation_prompt, **req.template_kwargs)
    except ChatTemplateError as e:
        raise ApiError(str(e), param="messages") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
        # the template's own code failed on what this request gave it (a chat_template_kwargs value of a type it
        # does not expect, say): the request's to change
        raise ApiError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param="messages") from None
    return rendered


async def prompt_ids(prompts: list, state: ServerState, param: str = "prompt") -> list[list[int]]:
    """Each prompt's token ids: text is encoded as `jaxkv.generate` encodes it (with the tokenizer's special
    tokens), off the event loop, once its length says it may fit; a prompt of ids longer than max_len is refused
    before its ids are looked at."""
    vocab = state.model.config.vocab_size
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and state.tokenizer is None:
        raise ApiError("this model has no tokenizer: pass the prompt as token ids", param=param)
    for p in prompts:
        if isinstance(p, str):
            check_text(p, state, param)
        elif len(p) > state.max_len:
            raise _context_exceeded(state, param, f"{len(p)} tokens")
    encoded = iter(await encode(state, texts, special_tokens=True) if texts else [])
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids = next(encoded)
            if not ids:
                raise ApiError("the prompt encodes to no tokens", param=param)
        else:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ApiError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)
            ids = list(p)
        out.append(ids)
    return out


def budget(s: protocol.Sampling, prompt: list[int], state: ServerState, what: str) -> int:
    """The new tokens a sequence may make: max_tokens (or, unset, all that fit), checked against the context. With
    max_tokens 0 (echo only: the prompt scored, nothing generated) the prompt alone must fit."""
    room = state.max_len - len(prompt)
    if s.max_tokens == 0:
        if room < 0:
            raise _context_exceeded(state, what, f"{len(prompt)} tokens")
        return 0
    want = room if s.max_tokens is None else s.max_tokens
    if room < 1 or want > room:
        raise ApiError(f"This model's maximum context length is {state.max_len} tokens. However, you requested "
                       f"{len(prompt) + max(want, 1)} tokens ({len(prompt)} in the {what}, {max(want, 1)} in the "
                       f"completion). Please reduce the length of the {what} or completion.",
                       param="max_tokens" if room >= 1 else what, code="context_length_exceeded")
    return want


def engine_calls(s: protocol.Sampling, prompts: list[list[int]], budgets: list[int], state: ServerState):
    """The engine.submit arguments of every sequence (prompt-major, n per prompt) and each one's stop ids."""
    eos = [] if s.ignore_eos else list(state.model.config.eos_ids)
    stop_ids = list(dict.fromkeys(eos + list(s.stop_token_ids)))
    vocab = state.model.config.vocab_size
    for t in stop_ids:
        if not 0 <= t < vocab:
            raise ApiError(f"stop token id {t} is outside the vocabulary [0, {vocab})", param="stop")
    if len(stop_ids) > protocol.MAX_STOP_IDS:
        raise ApiError(f"at most {protocol.MAX_STOP_IDS} stop token ids per request, the model's {len(eos)} "
                       f"end-of-sequence ids included (ignore_eos leaves those out), got {len(stop_ids)}",
                       param="stop_token_ids")
    for t in s.logit_bias or {}:
        if t >= vocab:
            raise ApiError(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab})", param="logit_bias")
    if s.min_tokens > min(budgets, default=s.min_tokens):
        raise ApiError(f"'min_tokens' ({s.min_tokens}) exceeds the completion's token budget ({min(budgets)})",
                       param="min_tokens")
    base = secrets.randbits(62) if s.seed is None else s.seed
    calls = []
    for prompt, budget in zip(prompts, budgets):
        for i in range(s.n):  # sample i of a seeded request draws with seed + i: reproducible, and distinct
            calls.append(dict(prompt=prompt, max_new_tokens=budget, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, min_p=s.min_p, seed=base + i, stop_tokens=stop_ids,
                              logprobs=s.logprobs or 0, repetition_penalty=s.repetition_penalty,
                              presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                              logit_bias=s.logit_bias, min_tokens=s.min_tokens, constraint=s.constraint))
    return calls, set(stop_ids)


def with_defaults(body, defaults: dict):
    """A request body with the checkpoint's sampling (`--generation-config auto`) where it names none: each field
    the client sends overrides it (do_sample false, or temperature 0, makes it greedy and drops the checkpoint's
    filters, as `protocol` reads them)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for name, value in defaults.items():
        if out.get(name) is None and value is not None:
            out[name] = value
    return out


async def accept(request: Request, endpoint: str, parse):
    """Counts, authorizes, reads and checks a request body -> (state, the parsed request)."""
    state: ServerState = request.app.state.jaxkv
    state.http[endpoint] += 1
    authorize(request, state)
    defaults = state.sampling_defaults
    req = await read_body(request, parse if not defaults else lambda body: parse(with_defaults(body, defaults)))
    check_model(req.model, state)
    return state, req
