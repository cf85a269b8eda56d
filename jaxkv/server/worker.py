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

A sequence is counted from `submit` until its Result is handed over; `submit` refuses (429) what would take the
count past the engine's slots, its staging rows and `max_waiting`, so a burst of clients queues a bounded number
of requests instead of growing memory without limit.

Between steps the worker publishes a snapshot of counters and gauges (`metrics`), read by /metrics without touching
the engine from another thread.
"""

from __future__ import annotations

import asyncio
import collections
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


class EngineWorker:
    def __init__(self, engine, *, max_waiting: int):
        self.engine = engine
        self.capacity = engine.slots + 2 * engine.prefill_rows + max_waiting  # sequences held at once
        self._lock = threading.Lock()
        self._inbox: list[tuple] = []
        self._wake = threading.Event()
        self._handles: dict[int, tuple[Handle, asyncio.AbstractEventLoop]] = {}
        self._held = 0  # sequences submitted (or in the inbox) whose Result has not been handed over
        self._stopping = False
        self.failed: str | None = None  # set if the engine raised: the server then answers 503
        self.counters = collections.Counter()  # requests, tokens, finish reasons (worker thread only)
        self.metrics: dict = {}
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)

    def start(self):
        self._publish()
        self._thread.start()

    def close(self, timeout: float = 30.0):
        """Cancels whatever is still running (each gets its Result, finish_reason "cancelled") and stops."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # --- called from the event loop thread ------------------------------------------------------------------------

    async def submit(self, calls: list[dict], queue: asyncio.Queue) -> list[Handle]:
        """Submits `calls` (engine.submit keyword arguments, "prompt" included) together -> one Handle each.
        ApiError 429 when the server holds too many sequences, 400 if the engine refuses one (none is kept),
        503 if the server is stopping or broken."""
        loop = asyncio.get_running_loop()
        handles = [Handle(queue, i) for i in range(len(calls))]
        future = loop.create_future()
        if len(calls) > self.capacity:  # it could never be held, however idle the server: the request is wrong
            raise ApiError(f"the request asks for {len(calls)} sequences (prompts x n); this server holds at most "
                           f"{self.capacity} at once", param="n")
        with self._lock:
            if self._stopping or self.failed:
                raise ApiError("the server is shutting down" if self._stopping else f"the engine failed: {self.failed}",
                               status=503, type="server_error")
            if self._held + len(calls) > self.capacity:
                raise ApiError(f"the server is at capacity ({self._held} sequences in flight or queued of "
                               f"{self.capacity}): retry later", status=429, code="rate_limit_exceeded")
            self._held += len(calls)
            self._inbox.append(("submit", calls, handles, loop, future))
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:  # the client left while the worker was submitting: nothing keeps running
            self.cancel(handles)
            raise
        return handles

    def cancel(self, handles: list[Handle]):
        """Ends these sequences now (thread-safe; each still gets its Result, "cancelled" unless it had finished)."""
        live = [h for h in handles if not h.done]
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
            with self._lock:
                self._held -= len(calls)
            error = ApiError(str(exc)) if isinstance(exc, ValueError) else exc
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
            with self._lock:
                self._held -= 1
            self.counters["finished_" + (result.finish_reason if result else "cancelled")] += 1
            loop.call_soon_threadsafe(handle.queue.put_nowait, (handle.index, result))

    def _fail(self, message: str):
        self.failed = message
        for handle, loop in self._handles.values():
            handle.done = True
            loop.call_soon_threadsafe(handle.queue.put_nowait, (handle.index, RuntimeError(message)))
        self._handles.clear()
        with self._lock:
            self._held = 0
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
            "sequences_held": self._held,
            "slots_total": engine.slots, "slots_free": engine.free_slots,
            "pages_total": engine.num_pages, "pages_free": engine.free_pages,
            "pages_held": engine.held_pages(),
            "pages_cached": engine.prefix_cache.cached_pages if engine.prefix_cache is not None else 0,
            "generated_tokens": stats.get("generated_tokens", 0),
            "prefill_tokens": stats.get("prefill_tokens", 0),
            "prefix_hit_tokens": stats.get("prefix_hit_tokens", 0),
            "decode_steps": stats.get("decode_steps", 0), "slot_occupancy": stats["slot_occupancy"],
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
