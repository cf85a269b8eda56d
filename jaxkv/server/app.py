"""The HTTP routes of `jaxkv serve` (Starlette): OpenAI's completions and chat completions over the engine.

    GET  /health                 200 {"status": "ok"}; 503 while stopping or after an engine failure
    GET  /metrics                Prometheus text (JSON with ?format=json or Accept: application/json)
    GET  /v1/models              the served model
    POST /v1/completions         prompt (text, token ids, or a list of either), n, stream, logprobs, echo, ...
    POST /v1/chat/completions    when the checkpoint has a chat template (else 400)

A request's sequences (its prompts times n) go to the engine thread together (`worker.EngineWorker`); its
tokens come back as engine events, are turned into text (`text.TextStream`: whole characters, cut at stop
strings) and sent as they come (stream) or when all are done. A client that disconnects cancels its sequences at
once: their slots and pages are free by the next engine step. Errors are OpenAI's JSON shape with the status
that says whose fault it was (`protocol.ApiError`); a bug answers 500 with its message, never a hung connection.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hmac
import json
import secrets
import sys
import time
import traceback
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxkv.engine import Event, Result
from jaxkv.server import protocol
from jaxkv.server.protocol import ApiError
from jaxkv.server.text import TextStream, added_tokens, prompt_text

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) before it is read
BIG_BODY_BYTES = 1 << 20  # a body larger than this is parsed off the event loop


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


@dataclasses.dataclass
class _Choice:
    """One sequence of a request, as it is being answered."""

    index: int
    prompt: list[int]
    text: TextStream
    stop_ids: set
    handle: object = None
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    tops: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    text_offset: int = 0  # streamed logprobs: where the next chunk's first token starts in the whole answer


# --- requests in -------------------------------------------------------------------------------------------------


def _authorize(request: Request, state: ServerState):
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise ApiError("Incorrect API key provided: pass it as 'Authorization: Bearer KEY'", status=401,
                       code="invalid_api_key")


async def _body(request: Request, parse):
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


def _check_model(name: str, state: ServerState):
    if name != state.model_name and name not in state.aliases:
        raise ApiError(f"The model '{name}' does not exist: this server serves '{state.model_name}'", status=404,
                       param="model", code="model_not_found")


def _context_exceeded(state: ServerState, what: str, length: str) -> ApiError:
    return ApiError(f"This model's maximum context length is {state.max_len} tokens. However, you requested "
                    f"{length} in the {what}. Please reduce the length of the {what}.", param=what,
                    code="context_length_exceeded")


def _check_text(text: str, state: ServerState, what: str):
    """A text about to be tokenized: refused (400) if it is longer than any text of max_len tokens can be, before
    the work of tokenizing it, or if it is not Unicode (a lone surrogate, which JSON's escapes can write)."""
    limit = state.max_prompt_chars
    if limit is not None and len(text) > limit:
        raise _context_exceeded(state, what, f"{len(text)} characters (more than {state.max_len} tokens of this "
                                             f"tokenizer can hold: at most {limit})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"the {what} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) at "
                       f"character {e.start}", param=what) from None


async def _encode(state: ServerState, texts: list[str], *, special_tokens: bool) -> list[list[int]]:
    """The token ids of each text, encoded on a thread (`encode_batch` lets go of the GIL): the event loop, and
    so every other client, goes on while a long prompt is tokenized."""
    tokenizer = state.tokenizer

    def encode():
        if hasattr(tokenizer, "encode_batch"):
            return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=special_tokens)]
        return [tokenizer.encode(t, add_special_tokens=special_tokens).ids for t in texts]

    return await asyncio.to_thread(encode)


async def _prompt_ids(prompts: list, state: ServerState, param: str = "prompt") -> list[list[int]]:
    """Each prompt's token ids: text is encoded as `jaxkv.generate` encodes it (with the tokenizer's special
    tokens), off the event loop, once its length says it may fit; a prompt of ids longer than max_len is refused
    before its ids are looked at."""
    vocab = state.model.config.vocab_size
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and state.tokenizer is None:
        raise ApiError("this model has no tokenizer: pass the prompt as token ids", param=param)
    for p in prompts:
        if isinstance(p, str):
            _check_text(p, state, param)
        elif len(p) > state.max_len:
            raise _context_exceeded(state, param, f"{len(p)} tokens")
    encoded = iter(await _encode(state, texts, special_tokens=True) if texts else [])
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


def _budget(s: protocol.Sampling, prompt: list[int], state: ServerState, what: str) -> int:
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


def _calls(s: protocol.Sampling, prompts: list[list[int]], budgets: list[int], state: ServerState):
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
    base = secrets.randbits(62) if s.seed is None else s.seed
    calls = []
    for prompt, budget in zip(prompts, budgets):
        for i in range(s.n):  # sample i of a seeded request draws with seed + i: reproducible, and distinct
            calls.append(dict(prompt=prompt, max_new_tokens=budget, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, min_p=s.min_p, seed=base + i, stop_tokens=stop_ids,
                              logprobs=s.logprobs or 0))
    return calls, set(stop_ids)


# --- driving the engine ------------------------------------------------------------------------------------------


async def _until_disconnect(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _updates(request: Request, state: ServerState, choices: list[_Choice], queue: asyncio.Queue):
    """Yields (choice, new text, index of its first new token) as its sequence progresses, until every choice has
    finished. Ends early, cancelling them all, if the client disconnects."""
    worker = state.worker
    watcher = asyncio.ensure_future(_until_disconnect(request))
    open_ = len(choices)
    try:
        while open_:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # the client went away: free its slots and pages now (finally, below)
                get.cancel()
                return
            index, item = get.result()
            c = choices[index]
            if isinstance(item, Event):
                if c.text.stopped:
                    continue  # tokens made in the same dispatch after a stop string: dropped
                first = len(c.tokens)
                feed = item.tokens
                if item.finish_reason == "stop" and feed and feed[-1] in c.stop_ids:
                    feed = feed[:-1]  # a stop token ends the text and is not part of it
                delta = c.text.add(feed)
                c.tokens += item.tokens
                c.logprobs += item.logprobs
                c.tops += item.top_logprobs or []
                if c.text.stopped:  # a stop string: keep only the tokens that made the text, end the sequence
                    del c.tokens[c.text.tokens_used:], c.logprobs[c.text.tokens_used:], c.tops[c.text.tokens_used:]
                    c.finish_reason = "stop"
                    worker.cancel([c.handle], reason="stop")
                elif item.finished:
                    delta += c.text.finish()
                    c.finish_reason = item.finish_reason
                yield c, delta, first
            else:  # the sequence's Result (or the engine's failure): it is over
                open_ -= 1
                if isinstance(item, Result) and item.finish_reason == "error" or isinstance(item, Exception):
                    c.error = item.error if isinstance(item, Result) else str(item)
                    c.finish_reason = "error"
                    yield c, "", len(c.tokens)
                elif c.finish_reason is None:  # cancelled (the server is stopping)
                    c.finish_reason = item.finish_reason if isinstance(item, Result) else "cancelled"
                    yield c, c.text.finish(), len(c.tokens)
    finally:  # normal end, our watcher saw the client leave, or the response task was cancelled (the same)
        watcher.cancel()
        if any(c.finish_reason is None for c in choices):
            state.http["disconnects"] += 1
        worker.cancel([c.handle for c in choices if c.handle is not None])


async def _start(request: Request, state: ServerState, s: protocol.Sampling, prompts, budgets, stop_text):
    calls, stop_ids = _calls(s, prompts, budgets, state)
    queue = asyncio.Queue()
    handles = await state.worker.submit(calls, queue)
    choices = []
    for i, (call, handle) in enumerate(zip(calls, handles)):
        choices.append(_Choice(index=i, prompt=call["prompt"], text=TextStream(state.tokenizer, stop_text),
                               stop_ids=stop_ids, handle=handle))
    return choices, queue


# --- answers out -------------------------------------------------------------------------------------------------


def _usage(prompts, choices) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(ch.tokens) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _completion_logprobs(decoded, first, tokens, logprobs, tops, offset, prompt_part=None) -> dict:
    """OpenAI's completions logprobs block for `tokens`, tokens first.. of `decoded` (a `text.Detokenizer`):
    tokens, token_logprobs, top_logprobs ({text: logprob}, the chosen token always among them), text_offset
    (from `offset`, appended to `prompt_part` when given).

    Each token's text is what it adds to the returned text, so text_offset is the character offset of that text in
    the returned text (the echoed prompt's included) and the texts join to it. A token inside a multi-byte
    character is "" at the offset where the character will start, and the token completing it carries the whole
    character (vLLM's convention); a special token the text skips, a BOS the tokenizer added to a text prompt, are
    "". The stop token that ended the text is listed with its own text at the text's end (it is no part of it)."""
    out = prompt_part if prompt_part is not None else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                       "text_offset": []}
    for j, token in enumerate(tokens):
        piece, _ = decoded.entry(first + j, token)
        top = {}
        if tops:
            for (_, lp), (text, _) in zip(tops[j], decoded.alternatives(first + j, [i for i, _ in tops[j]])):
                top.setdefault(text, lp)
        top.setdefault(piece, logprobs[j])
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprobs[j])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def _chat_logprobs(decoded, first, tokens, logprobs, tops) -> dict:
    """OpenAI's chat logprobs for `tokens`, tokens first.. of `decoded` (a `text.Detokenizer`): each token's text
    as in completions (`_completion_logprobs`), and its `bytes`: the token's own bytes (its vocabulary entry's: a
    byte-level BPE token's bytes, a <0xC3> byte-fallback token's byte), so a character split over tokens is
    rebuilt by joining them; the content's tokens' bytes join to the content's UTF-8."""
    content = []
    for j, token in enumerate(tokens):
        piece, own = decoded.entry(first + j, token)
        top = [] if not tops else [{"token": text, "logprob": lp, "bytes": list(raw)} for (_, lp), (text, raw)
                                   in zip(tops[j], decoded.alternatives(first + j, [i for i, _ in tops[j]]))]
        content.append({"token": piece, "logprob": logprobs[j], "bytes": list(own), "top_logprobs": top})
    return {"content": content, "refusal": None}


def _error_event(message: str) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                            "code": None}}) + "\n\n"


def _sse(payload: dict) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


async def _event_stream(request, state, choices, queue, head: dict, opening: list[dict], chunk, usage_prompts):
    """Server-sent events: `opening` choice dicts, then one chunk per update (`chunk(choice, text, first)`), a
    usage chunk when `usage_prompts` (the prompts' ids) are given, then [DONE]. A failed choice is an error
    event; the others go on."""
    started, first_token = time.perf_counter(), True
    for choice in opening:
        yield _sse({**head, "choices": [choice]})
    async for c, text, first in _updates(request, state, choices, queue):
        if c.error:
            yield _error_event(f"choice {c.index}: generation failed: {c.error}")
            continue
        if first_token and c.tokens:
            state.http["ttft_s"] += time.perf_counter() - started
            state.http["ttft_count"] += 1
            first_token = False
        yield _sse({**head, "choices": [chunk(c, text, first)]})
    if usage_prompts is not None:
        yield _sse({**head, "choices": [], "usage": _usage(usage_prompts, choices)})
    yield "data: [DONE]\n\n"


async def _collect(request, state, choices, queue) -> bool:
    """Runs every choice to its end -> False if the client went away first."""
    async for _ in _updates(request, state, choices, queue):
        pass
    return all(c.finish_reason is not None for c in choices)


def _server_error(choices):
    errors = [c.error for c in choices if c.error]
    if errors:
        raise ApiError(f"generation failed: {errors[0]}", status=500, type="server_error")


# --- routes ------------------------------------------------------------------------------------------------------


async def _accept(request: Request, endpoint: str, parse):
    """Counts, authorizes, reads and checks a request body -> (state, the parsed request)."""
    state: ServerState = request.app.state.jaxkv
    state.http[endpoint] += 1
    _authorize(request, state)
    req = await _body(request, parse)
    _check_model(req.model, state)
    return state, req


async def completions(request: Request) -> Response:
    state, req = await _accept(request, "completions", protocol.completion_request)
    s = req.sampling
    if s.stop and state.tokenizer is None:
        raise ApiError("stop strings need a model with a tokenizer: pass stop token ids", param="stop")
    if state.tokenizer is None and (req.echo or s.logprobs is not None):
        raise ApiError("echo and logprobs need a model with a tokenizer (they are text)",
                       param="echo" if req.echo else "logprobs")
    # echo only scores each prompt once, whatever n; a request that could never be held is refused before any work
    per_prompt = s.n if s.max_tokens != 0 else 1
    state.worker.check_count(len(req.prompts) * per_prompt, "n" if per_prompt > 1 else "prompt")
    prompts = await _prompt_ids(req.prompts, state)
    budgets = [_budget(s, p, state, "prompt") for p in prompts]
    token_ids = s.return_token_ids or state.tokenizer is None
    echoed = [p if isinstance(p, str) else state.tokenizer.decode(ids, skip_special_tokens=False)
              for p, ids in zip(req.prompts, prompts)] if req.echo else None
    prompt_part = None
    if req.echo and s.logprobs is not None:  # the prompt's own log-probabilities, as evaluation harnesses ask
        with state.worker.hold(len(prompts)):  # held against the server's capacity (429) as engine sequences are
            # one prompt at a time: each runs a program compiled at start (`worker.warm_up_scoring`: one per length
            # bucket, batch 1), and the engine steps between them, so running streams go on
            prompt_part = [(await _prompt_logprobs(state, [p], s.logprobs, [given]))[0]
                           for p, given in zip(prompts, req.prompts)]
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

    def choice_json(c: _Choice, text: str, first: int, whole: bool) -> dict:
        p = c.index // s.n
        logprobs = None
        if s.logprobs is not None:
            head = None
            if whole and prompt_part is not None:
                head = json.loads(json.dumps(prompt_part[p]))  # a copy: n choices share the prompt's part
            # Offsets count from the start of the answer's text (after the echoed prompt), in a stream too: each
            # chunk goes on where the last one ended, as the whole answer's offsets do.
            offset = (len(echoed[p]) if echoed else 0) + (0 if whole else c.text_offset)
            logprobs = _completion_logprobs(c.text.decoded, first, c.tokens[first:], c.logprobs[first:],
                                            c.tops[first:], offset, head)
            if not whole:
                c.text_offset += sum(len(piece) for piece in logprobs["tokens"])
        out = {"index": c.index, "text": text, "logprobs": logprobs,
               "finish_reason": c.finish_reason if c.finish_reason != "error" else None}
        if token_ids:
            out["token_ids"] = c.tokens[first:]
        return out

    if s.max_tokens == 0:  # echo only: score the prompt, generate nothing
        choices = [_Choice(index=i, prompt=prompts[i // s.n], text=TextStream(state.tokenizer), stop_ids=set(),
                           finish_reason="length") for i in range(len(prompts) * s.n)]
        out = [choice_json(c, echoed[c.index // s.n], 0, True) for c in choices]
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                             "choices": out, "usage": _usage(prompts, choices)})
    choices, queue = await _start(request, state, s, prompts, budgets, s.stop)

    if not s.stream:
        if not await _collect(request, state, choices, queue):
            return Response(status_code=499)  # nobody is listening
        _server_error(choices)
        out = [choice_json(c, (echoed[c.index // s.n] if echoed else "") + c.text.text, 0, True) for c in choices]
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                             "choices": out, "usage": _usage(prompts, choices)})

    head = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name}
    opening = [{"index": c.index, "text": echoed[c.index // s.n], "logprobs": prompt_part[c.index // s.n]
                if prompt_part else None, "finish_reason": None} for c in choices] if echoed else []
    events = _event_stream(request, state, choices, queue, head, opening,
                           lambda c, text, first: choice_json(c, text, first, False),
                           prompts if s.include_usage else None)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _prompt_logprobs(state: ServerState, prompts, k: int, texts) -> list[dict]:
    """Each prompt's completions-style logprobs block (its first token has none), computed on the engine thread.
    `texts`: the prompts as given; a text prompt's tokens are read as its echo shows it, the text as given: a
    token the tokenizer added (a BOS) is "" at offset 0 (`text.added_tokens`); an id prompt's echo is its ids
    decoded with their special tokens, and so are its tokens."""
    from jaxkv.score import score

    scored = [p for p in prompts if len(p) > 1]
    results = iter(await state.worker.call(lambda: score(state.model, [p[:1] for p in scored],
                                                         [p[1:] for p in scored], top_logprobs=max(k, 1)))
                   if scored else [])

    def listing(p, given, r):  # off the event loop: a long prompt's listing is many decodes
        decoded = prompt_text(state.tokenizer, p, added_tokens(state.tokenizer, given, p) if isinstance(given, str)
                              else None)
        first = decoded.pieces[0]
        part = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        if r is not None:
            tops = [t[:k] for t in r.top_logprobs] if k else []
            part = _completion_logprobs(decoded, 1, p[1:], list(r), tops, len(first), part)
        return part

    return [await asyncio.to_thread(listing, p, given, next(results) if len(p) > 1 else None)
            for p, given in zip(prompts, texts)]


async def chat_completions(request: Request) -> Response:
    state, req = await _accept(request, "chat_completions", protocol.chat_request)
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
    _check_text(rendered, state, "messages")
    prompt = (await _encode(state, [rendered], special_tokens=False))[0]  # the template wrote any BOS
    if not prompt:
        raise ApiError("the messages render to an empty prompt", param="messages")
    s = req.sampling
    budget = _budget(s, prompt, state, "messages")
    choices, queue = await _start(request, state, s, [prompt], [budget], s.stop)
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    def logprobs_json(c, first):
        if s.logprobs is None:
            return None
        return _chat_logprobs(c.text.decoded, first, c.tokens[first:], c.logprobs[first:], c.tops[first:])

    def finish(c):
        return c.finish_reason if c.finish_reason != "error" else None

    if not s.stream:
        if not await _collect(request, state, choices, queue):
            return Response(status_code=499)
        _server_error(choices)
        out = [{"index": c.index, "message": {"role": "assistant", "content": c.text.text, "refusal": None},
                "logprobs": logprobs_json(c, 0), "finish_reason": finish(c)}
               | ({"token_ids": c.tokens} if s.return_token_ids else {}) for c in choices]
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
                             "choices": out, "usage": _usage([prompt], choices)})

    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    opening = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None} for c in choices]
    events = _event_stream(request, state, choices, queue, head, opening,
                           lambda c, text, first: {"index": c.index, "delta": {"content": text} if text else {},
                                                   "logprobs": logprobs_json(c, first), "finish_reason": finish(c)}
                           | ({"token_ids": c.tokens[first:]} if s.return_token_ids else {}),
                           [prompt] if s.include_usage else None)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "jaxkv",
            "max_model_len": state.max_len}


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.jaxkv
    _authorize(request, state)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(request: Request) -> Response:
    """OpenAI's "retrieve model" (`client.models.retrieve(name)`): the served model by its name or an alias, else
    404 model_not_found."""
    state: ServerState = request.app.state.jaxkv
    _authorize(request, state)
    _check_model(request.path_params["model"], state)
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.jaxkv
    if state.worker.failed:
        return JSONResponse({"status": "failed", "error": state.worker.failed}, status_code=503)
    return JSONResponse({"status": "ok"})


_GAUGES = {  # metrics name -> (worker snapshot key, help)
    "jaxkv_sequences_running": ("sequences_running", "Sequences prefilling or decoding in the engine."),
    "jaxkv_sequences_waiting": ("sequences_waiting", "Sequences queued for a cache row (the queue)."),
    "jaxkv_sequences_held": ("sequences_held", "Sequences submitted and not yet answered, and prompts being scored "
                                               "(the 429 limit counts these)."),
    "jaxkv_slots_total": ("slots_total", "Decode slots of the engine."),
    "jaxkv_slots_free": ("slots_free", "Decode slots no sequence holds."),
    "jaxkv_pages_total": ("pages_total", "KV-cache pages in the pool."),
    "jaxkv_pages_free": ("pages_free", "Pages nothing holds."),
    "jaxkv_pages_held": ("pages_held", "Pages some running sequence holds (0 when idle)."),
    "jaxkv_pages_cached": ("pages_cached", "Pages the prefix cache keeps for later prompts (reclaimable)."),
    "jaxkv_slot_occupancy": ("slot_occupancy", "Decoding slots per decode step run, over all slots."),
}
_COUNTERS = {
    "jaxkv_sequences_total": ("sequences_submitted", "Sequences submitted to the engine (prompts x n)."),
    "jaxkv_generation_tokens_total": ("generated_tokens", "Tokens the engine generated."),
    "jaxkv_prompt_tokens_total": ("prefill_tokens", "Prompt tokens prefilled (not counting prefix-cache hits)."),
    "jaxkv_prefix_cache_hit_tokens_total": ("prefix_hit_tokens", "Prompt tokens taken from the prefix cache."),
    "jaxkv_decode_steps_total": ("decode_steps", "Decode steps that ran."),
}


def _metrics_json(state: ServerState) -> dict:
    m = dict(state.worker.metrics)
    http = state.http
    m["requests"] = {k: http[k] for k in ("completions", "chat_completions")}
    m["responses"] = {k[len("status_"):]: v for k, v in http.items() if k.startswith("status_")}
    m["disconnects"] = http["disconnects"]
    m["time_to_first_token_seconds"] = {"sum": http["ttft_s"], "count": http["ttft_count"]}
    return m


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.jaxkv
    m = _metrics_json(state)
    if request.query_params.get("format") == "json" or "application/json" in request.headers.get("accept", ""):
        return JSONResponse(m)
    lines = []

    def metric(name, kind, help_, samples):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("jaxkv_requests_total", "counter", "HTTP requests received, by endpoint.",
           [(f'{{endpoint="{k}"}}', v) for k, v in m["requests"].items()])
    metric("jaxkv_responses_total", "counter", "HTTP responses sent, by status.",
           [(f'{{status="{k}"}}', v) for k, v in sorted(m["responses"].items())])
    metric("jaxkv_client_disconnects_total", "counter", "Requests cancelled before their end: the client left "
           "(or the server stopped before they could finish).",
           [("", m["disconnects"])])
    metric("jaxkv_sequences_finished_total", "counter", "Sequences finished, by finish reason (stop: a stop token "
           "or a stop string; cancelled: the client left, or the server stopped).",
           [(f'{{reason="{k}"}}', v) for k, v in sorted(m["finished"].items())])
    for name, (key, help_) in _COUNTERS.items():
        metric(name, "counter", help_, [("", m[key])])
    for name, (key, help_) in _GAUGES.items():
        metric(name, "gauge", help_, [("", m[key])])
    ttft = m["time_to_first_token_seconds"]
    metric("jaxkv_time_to_first_token_seconds", "summary", "Streamed requests: seconds to the first token.",
           [("_sum", ttft["sum"]), ("_count", ttft["count"])])
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


# --- the application ---------------------------------------------------------------------------------------------


def _error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ApiError):
        error = exc
    elif isinstance(exc, HTTPException):
        error = ApiError(exc.detail if isinstance(exc.detail, str) else "HTTP error", status=exc.status_code)
    else:  # a bug: say what it was, as JSON, rather than a bare 500 page
        error = ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")
    return JSONResponse(error.body(), status_code=error.status,
                        headers={"WWW-Authenticate": "Bearer"} if error.status == 401 else None)


class _CountStatus:
    """ASGI middleware counting responses by status (for /metrics), and answering a bug's exception itself: a JSON
    500 (counted), after which the app returns normally, so the server keeps the connection (uvicorn drops a
    keep-alive connection whose app raised, without telling the client). Mid-response there is nothing to answer:
    the exception goes on to the server, which ends the connection."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.state.http[f"status_{message['status']}"] += 1
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            if started:
                raise
            print(f"jaxkv serve: internal error answering {scope.get('method')} {scope.get('path')}:",
                  file=sys.stderr)
            traceback.print_exc()
            await _error_response(None, exc)(scope, receive, counting_send)


def create_app(state: ServerState, lifespan=None) -> Starlette:
    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", model, methods=["GET"]),  # a name may hold slashes (org/name)
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    handlers = {ApiError: _error_response, HTTPException: _error_response, Exception: _error_response}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.jaxkv = state
    app.add_middleware(_CountStatus, state=state)
    return app
