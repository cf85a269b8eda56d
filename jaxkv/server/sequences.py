"""Driving the engine for one request: its sequences (`Choice`, one per prompt times n) submitted to the engine
thread together, their engine events turned into text as they come (`text.TextStream`: whole characters, cut at
stop strings), a client that disconnects cancelling them all at once, and the usage block of the answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from starlette.requests import Request

from jaxkv.engine import Event, Result
from jaxkv.server import intake, protocol
from jaxkv.server.protocol import ApiError
from jaxkv.server.state import ServerState
from jaxkv.server.text import TextStream


@dataclasses.dataclass
class Choice:
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


async def _until_disconnect(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


def take_event(c: Choice, event: Event) -> str:
    """An engine Event's tokens added to choice c (its text, tokens, logprobs, finish_reason) -> the new text. A
    stop string (`c.text.stopped` after it) keeps only the tokens that made the text and finishes the choice."""
    feed = event.tokens
    if event.finish_reason == "stop" and feed and feed[-1] in c.stop_ids:
        feed = feed[:-1]  # a stop token ends the text and is not part of it
    delta = c.text.add(feed)
    c.tokens += event.tokens
    c.logprobs += event.logprobs
    c.tops += event.top_logprobs or []
    if c.text.stopped:
        del c.tokens[c.text.tokens_used:], c.logprobs[c.text.tokens_used:], c.tops[c.text.tokens_used:]
        c.finish_reason = "stop"
    elif event.finished:
        delta += c.text.finish()
        c.finish_reason = event.finish_reason
    return delta


async def updates(request: Request, state: ServerState, choices: list[Choice], queue: asyncio.Queue):
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
                delta = take_event(c, item)
                if c.text.stopped:  # a stop string: end the sequence
                    worker.cancel([c.handle], reason="stop")
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


async def unless_gone(request: Request, awaitable):
    """`awaitable`'s result (a wait for room on the engine thread), unless the client leaves first: then it is
    cancelled (giving up its place in the queue, or what it was given) and the answer is ApiError 499."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ApiError("the client closed the connection while its request waited for room", status=499)
    return task.result()


@contextlib.asynccontextmanager
async def admitted(request: Request, held):
    """`held` (a `worker.hold(...)`) entered `unless_gone`, and left after the block."""
    await unless_gone(request, held.__aenter__())
    try:
        yield
    finally:
        await held.__aexit__(None, None, None)


async def start(request: Request, state: ServerState, s: protocol.Sampling, prompts, budgets, stop_text):
    """Every sequence of a request (its prompts times n) submitted to the engine thread -> (its choices, the queue
    their events arrive on). A stream is refused (429) when the server is full; a whole answer waits in the
    worker's queue for room (429 when that is full too)."""
    calls, stop_ids = intake.engine_calls(s, prompts, budgets, state)
    queue = asyncio.Queue()
    handles = await unless_gone(request, state.worker.submit(calls, queue, wait=not s.stream))
    choices = []
    for i, (call, handle) in enumerate(zip(calls, handles)):
        choices.append(Choice(index=i, prompt=call["prompt"], text=TextStream(state.tokenizer, stop_text, s.min_tokens),
                              stop_ids=stop_ids, handle=handle))
    return choices, queue


async def collect(request, state, choices, queue) -> bool:
    """Runs every choice to its end -> False if the client went away first. ApiError 503 if the server's shutdown
    cancelled every choice before it made a token: nothing was made, and a 503 is retried where an empty
    "cancelled" answer would be taken for the model's (the same answer as a request still waiting for room)."""
    async for _ in updates(request, state, choices, queue):
        pass
    if state.worker.stopping and all(c.finish_reason == "cancelled" and not c.tokens for c in choices):
        raise ApiError("the server is shutting down", status=503, type="server_error")
    return all(c.finish_reason is not None for c in choices)


def server_error(choices):
    errors = [c.error for c in choices if c.error]
    if errors:
        raise ApiError(f"generation failed: {errors[0]}", status=500, type="server_error")


def usage(prompts, choices) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(ch.tokens) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
