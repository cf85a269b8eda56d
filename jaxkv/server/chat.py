"""POST /v1/chat/completions: the messages rendered by the checkpoint's chat template (400 without one), then
generated as a completion is, streamed or whole, with OpenAI's chat logprobs (each token's own bytes)."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxkv.server import intake, protocol, sequences, sse, structured
from jaxkv.server.protocol import ApiError
from jaxkv.server.state import ServerState


async def chat_completions(request: Request) -> Response:
    state, req = await intake.accept(request, "chat_completions", protocol.chat_request)
    if state.chat_template is None:
        raise ApiError("this model has no chat template (its tokenizer config names none): use /v1/completions, "
                       "or serve a checkpoint whose tokenizer_config.json or chat_template.jinja has one",
                       code="no_chat_template")
    try:
        structured.check_auto(req.tool_calls, state.chat_template.source)
    except structured.FieldError as e:
        raise ApiError(str(e), param=e.param, code=e.code) from None
    rendered = await intake.render_chat(state, req)
    intake.check_text(rendered, state, "messages")
    prompt = (await intake.encode(state, [rendered], special_tokens=False))[0]  # the template wrote any BOS
    if not prompt:
        raise ApiError("the messages render to an empty prompt", param="messages")
    s = req.sampling
    budget = intake.budget(s, prompt, state, "messages")
    choices, queue = await sequences.start(request, state, s, [prompt], [budget], s.stop)
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    def logprobs_json(c, first):
        if s.logprobs is None:
            return None
        return _chat_logprobs(c.text.decoded, first, c.tokens[first:], c.logprobs[first:], c.tops[first:])

    def finish(c):
        return c.finish_reason if c.finish_reason != "error" else None

    if not s.stream:
        if not await sequences.collect(request, state, choices, queue):
            return Response(status_code=499)
        sequences.server_error(choices)
        out = [{"index": c.index, **_message(c, req.tool_calls, finish(c)), "logprobs": logprobs_json(c, 0)}
               | ({"token_ids": c.tokens} if s.return_token_ids else {}) for c in choices]
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
                             "choices": out, "usage": sequences.usage([prompt], choices)})

    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    opening = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None} for c in choices]

    def chunk(c, text, first):
        if req.tool_calls is not None:  # the calls are read from the whole text: sent with its last chunk
            return _tool_chunk(c, req.tool_calls, finish(c)) | ({"token_ids": c.tokens[first:]}
                                                               if s.return_token_ids else {})
        return ({"index": c.index, "delta": {"content": text} if text else {}, "logprobs": logprobs_json(c, first),
                 "finish_reason": finish(c)} | ({"token_ids": c.tokens[first:]} if s.return_token_ids else {}))

    return sse.response(sse.event_stream(request, state, choices, queue, head, opening, chunk,
                                         [prompt] if s.include_usage else None))


def _message(c, tool_calls, finish_reason) -> dict:
    """A finished choice's "message" and "finish_reason": with tools, the calls its text holds (`structured`),
    finish_reason "tool_calls" when there are any."""
    message = {"role": "assistant", "content": c.text.text, "refusal": None}
    if tool_calls is not None:
        content, calls = structured.tool_calls(tool_calls, c.text.text)
        if calls:
            message.update(content=content, tool_calls=calls)
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"message": message, "finish_reason": finish_reason}


def _tool_chunk(c, tool_calls, finish_reason) -> dict:
    """A streamed choice with tools: empty deltas while it runs; at its end, its tool calls (OpenAI's streamed
    shape: each with its "index") and finish_reason "tool_calls", or its whole text as content if it has none."""
    if not finish_reason:
        return {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None}
    done = _message(c, tool_calls, finish_reason)
    calls = done["message"].get("tool_calls")
    delta = ({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls
             else {"content": c.text.text})
    return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": done["finish_reason"]}


def _chat_logprobs(decoded, first, tokens, logprobs, tops) -> dict:
    """OpenAI's chat logprobs for `tokens`, tokens first.. of `decoded` (a `text.Detokenizer`): each token's text
    as in completions (`completions.py`), and its `bytes`: the token's own bytes (its vocabulary entry's: a
    byte-level BPE token's bytes, a <0xC3> byte-fallback token's byte), so a character split over tokens is
    rebuilt by joining them; the content's tokens' bytes join to the content's UTF-8."""
    content = []
    for j, token in enumerate(tokens):
        piece, own = decoded.entry(first + j, token)
        top = [] if not tops else [{"token": text, "logprob": lp, "bytes": list(raw)} for (_, lp), (text, raw)
                                   in zip(tops[j], decoded.alternatives(first + j, [i for i, _ in tops[j]]))]
        content.append({"token": piece, "logprob": logprobs[j], "bytes": list(own), "top_logprobs": top})
    return {"content": content, "refusal": None}
