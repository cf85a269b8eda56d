"""The engine's thread: the one place `jaxkv.Engine` is touched while the server runs.

The HTTP side is asyncio (one event loop thread); the engine is synchronous and each `step` blocks for a prefill
chunk and a decode dispatch. So the engine lives on its own thread, and the two sides talk through:

  an inbox (a lock-guarded list the loop thread appends commands to, and the worker drains between steps):
    submit   a request's engine calls (all of them, or none if one is refused: its ValueError goes back),
    cancel   its handles (a client went away, a stop string was found, the server is stopping),
    call     a function to run on the device between steps (prompt scoring for echo + logprobs);
  each request's asyncio queue, which the worker fills through `loop.call_soon_threadsafe`: every engine `Event`
    of its sequences, then each sequence's `Result` once it has finished (taken from the engine, so nothing
    accumulates there).

A sequence is counted from `submit` until its Result is handed over, and a prompt being scored (echo + logprobs)
while `hold` holds it. The count may not pass `capacity` (the engine's slots, its staging rows and `max_waiting`).
A request that would pass it waits, when it asks to (`wait`: the server's non-streaming requests), in a first-in
first-out queue of at most `max_queued` sequences, and is admitted as others finish; a request that may not wait,
or finds that queue full, is refused (429). So a burst of clients queues a bounded amount of work (the queued
requests' prompts: at most max_queued x max_len token ids) instead of growing memory without limit, and a harness
that sends more requests at once than the engine holds gets answers, not errors. While requests are queued, no
later request goes before them.

Prompt scoring runs `jaxkv.score` one prompt at a time, so that its programs are one per continuation-length
bucket, all compiled at start (`warm_up_scoring`): no request compiles on the engine thread, which would stall
every stream.

Between steps the worker publishes a snapshot of counters and gauges (`metrics`), read by /metrics without touching
the engine from another thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
import traceback

from jaxkv.server.protocol import ApiError


class Handle:
    """One engine sequence as the loop thread sees it: items arrive on `queue` as (index, Event | Result | error)."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self.queue, self.index = queue, index
        self.id: int | None = None  # the engine's request id, set by the worker when it submits
        self.done = False
        self.ended_by: str | None = None  # why the server cancelled it ("stop": a stop string), for /metrics


class _Waiter:
    """A request queued for room: `count` sequences, admitted (under the worker's lock) by settling `future`."""

    def __init__(self, count: int, scoring: bool, loop: asyncio.AbstractEventLoop):
        self.count, self.scoring, self.loop = count, scoring, loop
        self.future = loop.create_future()
        self.admitted = False


class EngineWorker:
    def __init__(self, engine, *, max_waiting: int, max_queued: int = 0):
        self.engine = engine
        self.capacity = engine.slots + 2 * engine.prefill_rows + max_waiting  # sequences held at once
        self.max_queued = max_queued  # sequences that may wait for room beyond those (`submit(wait=True)`)
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._queued = 0  # sequences in _queue
        self._lock = threading.Lock()
        self._inbox: list[tuple] = []
        self._wake = threading.Event()
        self._handles: dict[int, tuple[Handle, asyncio.AbstractEventLoop]] = {}
        self._held = 0  # sequences submitted (or in the inbox) whose Result has not been handed over
        self._scoring = 0  # prompts being scored (`hold`)
        self._stopping = False
        self.failed: str | None = None  # set if the engine raised: the server then answers 503
        self.counters = collections.Counter()  # requests, tokens, finish reasons (worker thread only)
        self.metrics: dict = {}
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)

    def start(self):
        self._publish()
        self._thread.start()

    def stop(self):
        """Refuses new work (503) and cancels every sequence, running or queued: each gets its Result, finish_reason
        "cancelled", by the next step (so each response ends as it should); requests waiting for room get 503.
        Returns at once."""
        with self._lock:
            self._stopping = True
            self._refuse_queued(ApiError("the server is shutting down", status=503, type="server_error"))
        self._wake.set()

    def close(self, timeout: float = 30.0):
        """`stop`, then waits for the engine thread to end."""
        self.stop()
        self._thread.join(timeout)

    # --- called from the event loop thread ------------------------------------------------------------------------

    async def submit(self, calls: list[dict], queue: asyncio.Queue, *, wait: bool = False) -> list[Handle]:
        """Submits `calls` (engine.submit keyword arguments, "prompt" included) together -> one Handle each.
        With `wait`, waits in the queue for room when the server holds too many sequences (`admit`). ApiError 429
        when it may not wait or the queue is full, 400 if the engine refuses one (none is kept), 503 if the server
        is stopping or broken."""
        loop = asyncio.get_running_loop()
        handles = [Handle(queue, i) for i in range(len(calls))]
        future = loop.create_future()
        self.check_count(len(calls))
        await self.admit(len(calls), wait=wait)
        with self._lock:
            if self.failed:  # the engine thread is gone: nothing would answer the inbox
                raise ApiError(f"the engine failed: {self.failed}", status=503, type="server_error")
            self._inbox.append(("submit", calls, handles, loop, future))
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:  # the client left while the worker was submitting: nothing keeps running
            self.cancel(handles)
            raise
        return handles

    @property
    def stopping(self) -> bool:
        """True once `stop` was called (the server is shutting down)."""
        return self._stopping

    @property
    def held(self) -> int:
        """Sequences held now (engine sequences and prompts being scored), of `capacity`."""
        return self._held + self._scoring

    @property
    def queued(self) -> int:
        """Sequences of requests waiting for room, of `max_queued`."""
        return self._queued

    def check_count(self, count: int, param: str = "n"):
        """ApiError 400 if `count` sequences could never be held at once, however idle the server."""
        if count > self.capacity:
            raise ApiError(f"the request asks for {count} sequences (prompts x n); this server holds at most "
                           f"{self.capacity} at once", param=param)

    async def admit(self, count: int, *, scoring: bool = False, wait: bool = False):
        """Counts `count` sequences as held (`scoring`: prompts to score, released by `release`; else engine
        sequences, released as their Results are handed over): at once if they fit and no request is queued, else,
        with `wait`, once the requests queued before this one are in and these fit. ApiError 429 (the queue is
        full, or it may not wait), 503 (stopping or broken). A waiter cancelled (its client left) gives up its
        place, or the room it was just given."""
        with self._lock:
            self._check_open()
            if not self._queue and self._fits(count):
                self._take(count, scoring)
                return
            if not wait or self._queued + count > self.max_queued:
                raise ApiError(f"the server is at capacity ({self._held + self._scoring} sequences in flight or "
                               f"queued of {self.capacity}, {self._queued} more waiting of {self.max_queued}): "
                               f"retry later", status=429, code="rate_limit_exceeded")
            waiter = _Waiter(count, scoring, asyncio.get_running_loop())
            self._queue.append(waiter)
            self._queued += count
        try:
            await waiter.future
        except BaseException:
            with self._lock:
                if waiter.admitted:
                    self._release_locked(count, scoring)
                elif waiter in self._queue:
                    self._queue.remove(waiter)
                    self._queued -= count
                    self._admit_queued()  # a smaller request behind it may fit now
            raise

    def release(self, count: int, *, scoring: bool = False):
        """Gives back room `admit` counted (thread-safe); queued requests that now fit are admitted."""
        with self._lock:
            self._release_locked(count, scoring)

    def _check_open(self):  # under the lock
        if self._stopping or self.failed:
            raise ApiError("the server is shutting down" if self._stopping else f"the engine failed: {self.failed}",
                           status=503, type="server_error")

    def _fits(self, count: int) -> bool:  # under the lock
        return self._held + self._scoring + count <= self.capacity

    def _take(self, count: int, scoring: bool):  # under the lock
        if scoring:
            self._scoring += count
        else:
            self._held += count

    def _release_locked(self, count: int, scoring: bool):
        if scoring:
            self._scoring -= count
        else:
            self._held -= count
        self._admit_queued()

    def _admit_queued(self):  # under the lock: the queue's head, in order, while each fits
        while self._queue and self._fits(self._queue[0].count) and not (self._stopping or self.failed):
            waiter = self._queue.popleft()
            self._queued -= waiter.count
            self._take(waiter.count, waiter.scoring)
            waiter.admitted = True
            waiter.loop.call_soon_threadsafe(_settle, waiter.future, None, None)

    def _refuse_queued(self, error: Exception):  # under the lock
        while self._queue:
            waiter = self._queue.popleft()
            self._queued -= waiter.count
            waiter.loop.call_soon_threadsafe(_settle, waiter.future, None, error)

    @contextlib.asynccontextmanager
    async def hold(self, count: int, *, wait: bool = False):
        """Counts `count` prompts being scored as held while the block runs: ApiError 400, 429 or 503 as `submit`
        refuses them; with `wait`, queued for room as `submit` is."""
        self.check_count(count, "prompt")
        await self.admit(count, scoring=True, wait=wait)
        try:
            yield
        finally:
            self.release(count, scoring=True)

    def cancel(self, handles: list[Handle], *, reason: str | None = None):
        """Ends these sequences now (thread-safe; each still gets its Result, "cancelled" unless it had finished).
        `reason`: what /metrics counts it as finishing by ("stop" for a stop string), else "cancelled"."""
        live = [h for h in handles if not h.done]
        for handle in live:
            handle.ended_by = reason or handle.ended_by
        if live:
            with self._lock:
                self._inbox.append(("cancel", live))
            self._wake.set()

    async def call(self, fn):
        """Runs fn() on the engine thread between steps -> its result (its exception re-raised here)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._stopping:
                raise ApiError("the server is shutting down", status=503, type="server_error")
            self._inbox.append(("call", fn, loop, future))
        self._wake.set()
        return await future

    # --- the engine thread ----------------------------------------------------------------------------------------

    def _run(self):
        engine = self.engine
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            for command in inbox:
                getattr(self, "_" + command[0])(*command[1:])
            if stopping:
                for handle, _ in list(self._handles.values()):
                    engine.cancel(handle.id)
            if engine.pending or self._handles:
                try:
                    events = engine.step()
                except Exception as exc:  # a bug or a device failure: every request gets the error, none hangs
                    traceback.print_exc()
                    self._fail(f"{type(exc).__name__}: {exc}")
                    return
                for event in events:
                    self._deliver(event)
                self._publish()
                continue
            self._publish()
            if stopping:
                return
            self._wake.wait(0.5)
            self._wake.clear()

    def _submit(self, calls, handles, loop, future):
        engine, ids = self.engine, []
        try:
            for call in calls:
                call = dict(call)
                ids.append(engine.submit(call.pop("prompt"), **call))
        except Exception as exc:  # refused: none of them runs
            for rid in ids:
                engine.cancel(rid)
                engine.take(rid)
            self.release(len(calls))
            error = api_error(exc) if isinstance(exc, ValueError) else exc
            loop.call_soon_threadsafe(_settle, future, None, error)
            return
        for handle, rid in zip(handles, ids):
            handle.id = rid
            self._handles[rid] = (handle, loop)
        self.counters["sequences"] += len(calls)
        loop.call_soon_threadsafe(_settle, future, None, None)

    def _cancel(self, handles):
        for handle in handles:
            if handle.id is not None and handle.id in self._handles:
                self.engine.cancel(handle.id)

    def _call(self, fn, loop, future):
        try:
            result, error = fn(), None
        except Exception as exc:
            result, error = None, exc
        loop.call_soon_threadsafe(_settle, future, result, error)

    def _deliver(self, event):
        entry = self._handles.get(event.id)
        if entry is None:
            return
        handle, loop = entry
        loop.call_soon_threadsafe(handle.queue.put_nowait, (handle.index, event))
        self.counters["generated_tokens"] += len(event.tokens)
        if event.finished:
            result = self.engine.take(event.id)
            del self._handles[event.id]
            handle.done = True
            self.release(1)
            reason = result.finish_reason if result else "cancelled"
            if reason == "cancelled" and handle.ended_by:
                reason = handle.ended_by  # the server ended it, for a reason of its own (a stop string)
            self.counters["finished_" + reason] += 1
            loop.call_soon_threadsafe(handle.queue.put_nowait, (handle.index, result))

    def _fail(self, message: str):
        self.failed = message
        for handle, loop in self._handles.values():
            handle.done = True
            loop.call_soon_threadsafe(handle.queue.put_nowait, (handle.index, RuntimeError(message)))
        self._handles.clear()
        with self._lock:
            self._held = 0
            self._refuse_queued(ApiError(f"the engine failed: {message}", status=503, type="server_error"))
            for command in self._inbox:
                if command[0] in ("submit", "call"):
                    command[-2].call_soon_threadsafe(_settle, command[-1], None, RuntimeError(message))
            self._inbox = []
        self._publish()

    def _publish(self):
        engine = self.engine
        stats = engine.stats
        running = len(self._handles) - engine.waiting
        self.metrics = {
            "time": time.time(),
            "sequences_running": running, "sequences_waiting": engine.waiting,
            "sequences_held": self._held + self._scoring, "sequences_queued": self._queued,
            "slots_total": engine.slots, "slots_free": engine.free_slots,
            "pages_total": engine.num_pages, "pages_free": engine.free_pages,
            "pages_held": engine.held_pages(),
            "pages_cached": engine.cached_pages,
            "generated_tokens": stats.get("generated_tokens", 0),
            "prefill_tokens": stats.get("prefill_tokens", 0),
            "prefix_hit_tokens": stats.get("prefix_hit_tokens", 0),
            "decode_steps": stats.get("decode_steps", 0), "slot_occupancy": stats["slot_occupancy"],
            # speculative decoding (`jaxkv serve --speculative-method`): all 0 without it
            **{name: stats.get(name, 0) for name in ("spec_proposed", "spec_accepted", "spec_verifies",
                                                     "target_forwards", "spec_acceptance_rate",
                                                     "tokens_per_target_forward")},
            "sequences_submitted": self.counters["sequences"],
            "finished": {k[len("finished_"):]: v for k, v in self.counters.items() if k.startswith("finished_")},
        }


def _settle(future: asyncio.Future, result, error):
    if future.done():  # the waiting request was cancelled (its client left)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# The request field of each `Engine.submit` argument its refusals name (`checks.ArgumentError.argument`).
_API_FIELDS = {"prompt": "prompt", "max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k",
               "top_p": "top_p", "min_p": "min_p", "seed": "seed", "stop_tokens": "stop_token_ids",
               "logprobs": "logprobs", "constraint": "response_format"}


def api_error(exc: ValueError) -> ApiError:
    """An engine refusal as the client's 400, naming the request field it is about (None if it names none)."""
    return ApiError(str(exc), param=_API_FIELDS.get(getattr(exc, "argument", None)))


def scoring_buckets(max_len: int) -> list[int]:
    """The continuation lengths `jaxkv.score` pads a served prompt's scoring to (the prompt minus its first token:
    at most max_len - 1 tokens): powers of two from its smallest bucket."""
    from jaxkv.cache.planner import MIN_PROMPT_BUCKET

    buckets, top = [MIN_PROMPT_BUCKET], max(max_len - 1, 1)
    while buckets[-1] < top:
        buckets.append(buckets[-1] * 2)
    return buckets


def warm_up_scoring(model, max_len: int):
    """Compiles every program prompt scoring may run for prompts of up to max_len tokens (`jaxkv.score` of one
    prompt, with top logprobs, at each continuation bucket), by scoring a dummy prompt at each."""
    from jaxkv.score import score

    for bucket in scoring_buckets(max_len):
        score(model, [[0]], [[0] * min(bucket, max(max_len - 1, 1))], top_logprobs=1)
