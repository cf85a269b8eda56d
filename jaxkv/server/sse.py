"""Server-sent events, as OpenAI streams them: `data: {json}` chunks, an error event for a failed choice (the
others go on), an optional usage chunk, then `data: [DONE]`; and the time to the first token, for /metrics."""

from __future__ import annotations

import json
import time

from starlette.responses import StreamingResponse

from jaxkv.server import sequences


def _error_event(message: str) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                            "code": None}}) + "\n\n"


def _sse(payload: dict) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


async def event_stream(request, state, choices, queue, head: dict, opening: list[dict], chunk, usage_prompts):
    """Server-sent events: `opening` choice dicts, then one chunk per update (`chunk(choice, text, first)`), a
    usage chunk when `usage_prompts` (the prompts' ids) are given, then [DONE]. A failed choice is an error
    event; the others go on."""
    started, first_token = time.perf_counter(), True
    for choice in opening:
        yield _sse({**head, "choices": [choice]})
    async for c, text, first in sequences.updates(request, state, choices, queue):
        if c.error:
            yield _error_event(f"choice {c.index}: generation failed: {c.error}")
            continue
        if first_token and c.tokens:
            state.http["ttft_s"] += time.perf_counter() - started
            state.http["ttft_count"] += 1
            first_token = False
        yield _sse({**head, "choices": [chunk(c, text, first)]})
    if usage_prompts is not None:
        yield _sse({**head, "choices": [], "usage": sequences.usage(usage_prompts, choices)})
    yield "data: [DONE]\n\n"


def response(events) -> StreamingResponse:
    """The HTTP response streaming `events` (an `event_stream`)."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
