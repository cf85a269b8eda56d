"""`jaxkv.Engine(..., mesh=)` with a "data" axis above 1: one engine per data shard, requests placed on one.

Each row d of the ("data", "model") mesh is a shard: an `Engine` over the (1, model) mesh of that row's devices,
with its own slots, page pool (and prefix cache) and its own copy of the weights (split over "model" as a one-row
mesh splits them). A paged pool cannot be split over "data" (sequences anywhere may share any page:
`sharding.check_paged_mesh`), so data parallelism is engines side by side, as tpu-inference's DP attention and
sglang's --dp-size run them.

Placement, at `submit`: with prefix caches, the shard whose cache holds the longest cached prefix of the prompt
(device and host tiers, `PrefixCache.cached_prefix_pages`), the least loaded among equals; without, the least
loaded shard (fewest requests in flight; among equals, the next in turn). A request stays on its shard to the end.
Its tokens are what that shard's engine gives, which is what one engine gives (each request is independent of the
batch it shares: `jaxkv.engine`'s docstring), so outputs equal a single-device engine's.

Stepping: `step` runs every shard with work in its own thread at once (each dispatch waits on its own devices;
JAX releases the GIL while it waits), so the shards compute in parallel. Ids: `submit` returns an id of this
engine's (its events and results carry it); each shard keeps its own.

Events and results are this engine's own, kept as one engine keeps them: a queue of events not yet reported (a
shard's cancellation is taken into it when it happens, so `run` reports it even when no request is left to
step), the finished results, the ids in submission order. A callback runs in the thread stepping its request's
shard, so these are guarded by one lock, and what a callback submits or cancels never touches a shard another
thread is stepping: a submit goes to its own shard or one not stepping this round, a cancel of a request on a
shard stepping elsewhere waits for the end of the round (as one engine's cancel from a callback, its event comes
with the next step).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from collections import deque
from collections.abc import Iterator

import numpy as np
from jax.sharding import Mesh

from jaxkv import sharding
from jaxkv.engine.outputs import Event, Result
from jaxkv.engine.requests import generate_calls


def data_shards(mesh: Mesh) -> list[Mesh]:
    """The (1, model) meshes of each row of a ("data", "model") mesh: where `jaxkv.Engine(mesh=mesh)` runs its
    shards, and what a shard's `jaxkv.PrefixCache(..., mesh=)` is built for."""
    mesh = sharding.check_mesh(mesh)
    devices = np.asarray(mesh.devices)
    return [Mesh(devices[d:d + 1], (sharding.DATA, sharding.MODEL)) for d in range(devices.shape[0])]


class DataParallelEngine:
    """The engine `jaxkv.Engine(model, mesh=mesh, ...)` returns for a mesh whose "data" axis is above 1 (module
    docstring). Its arguments are `Engine`'s, per shard (slots, num_pages, ...: each shard has that many), except:

      prefix_cache: None, or one `jaxkv.PrefixCache` per data shard, each built with `mesh=` its shard's mesh
        (`data_shards(mesh)[d]`).

    It has `Engine`'s methods and properties; counts (slots, free slots and pages, pending, waiting, stats) are
    the shards' sums; `shards` are the shards' engines.
    """

    def __init__(self, model, *, mesh, engine: type, prefix_cache=None, **kwargs):
        # engine: the class of each shard's engine, `jaxkv.Engine`, passed by `Engine.__new__` (this module sits
        # beside the scheduler, not under it: importing it here would make a cycle)
        from jaxkv.cache.prefix import PrefixCache

        self.mesh = sharding.check_mesh(mesh)
        meshes = data_shards(self.mesh)
        if prefix_cache is not None:
            caches = list(prefix_cache) if isinstance(prefix_cache, (list, tuple)) else None
            if caches is None or len(caches) != len(meshes) or not all(isinstance(c, PrefixCache) for c in caches):
                raise ValueError(f"on a mesh with {len(meshes)} data shards, prefix_cache is a list of "
                                 f"{len(meshes)} jaxkv.PrefixCache, one per shard, each built with mesh= its "
                                 f"shard's (jaxkv.engine.data_shards(mesh)[d])")
        else:
            caches = [None] * len(meshes)
        self.shards = [engine(model, mesh=m, prefix_cache=c, **kwargs) for m, c in zip(meshes, caches)]
        first = self.shards[0]
        self.model, self.config, self.max_len, self.page_size = first.model, first.config, first.max_len, \
            first.page_size
        self.slots = sum(e.slots for e in self.shards)
        self.num_pages = sum(e.num_pages for e in self.shards)
        self.prefill_rows = sum(e.prefill_rows for e in self.shards)  # staging rows are twice these, per shard
        self.prefix_cache = None if prefix_cache is None else caches
        # The bookkeeping below is one state, guarded by _lock: callbacks run in the shards' threads and may
        # submit or cancel from there (module docstring). Reentrant: a cancel calls its request's callback, which
        # may submit.
        self._lock = threading.RLock()
        self._round_over = threading.Condition(self._lock)
        self._stepping: frozenset[int] = frozenset()  # the shards a round is stepping now, each in its thread
        self._thread = threading.local()  # .shard: the shard this thread is stepping, if any
        self._deferred: list[int] = []  # cancels of requests whose shard was stepping in another thread
        self._where: dict[int, tuple[int, int]] = {}  # our id -> (shard, the shard's id)
        self._ours: list[dict[int, int]] = [{} for _ in self.shards]  # per shard: its id -> ours
        self._next_id = 0
        self._order: list[int] = []  # ids submitted and not yet handed over by results(), in order
        self._done: dict[int, Result] = {}  # finished results not yet handed over
        self._events: deque[Event] = deque()  # events not yet reported (Engine._events: cancellations, what a
        # `run` left early did not yield), our ids
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.shards),
                                                           thread_name_prefix="jaxkv-shard")

    # --- requests -----------------------------------------------------------------------------------------------

    def _mine(self, d: int) -> bool:
        """Whether this thread may touch shard d now: no round is stepping it, or this thread is (a callback
        of one of its requests)."""
        return d not in self._stepping or getattr(self._thread, "shard", None) == d

    def _place(self, prompt, shards: list[int]) -> int:
        """The shard among `shards` a prompt goes to: the longest cached prefix, then the fewest requests in
        flight, then the next in turn (so an idle engine's requests go round the shards, not all to the first)."""
        D = len(self.shards)
        cached = {d: 0 for d in shards}
        if self.prefix_cache is not None:
            ids = prompt
            if isinstance(prompt, str):  # the shard's engine tokenizes it; match as it will
                ids = self.model.tokenizer.encode(prompt).ids if self.model.tokenizer is not None else []
            cached = {d: self.prefix_cache[d].cached_prefix_pages(ids) for d in shards}
        return min(shards, key=lambda d: (-cached[d], self.shards[d].pending, (d - self._next_id) % D))

    def submit(self, prompt, *, callback=None, **kwargs) -> int:
        """`Engine.submit` on the shard `prompt` is placed on -> this engine's id for it. From a callback (a
        shard's thread), among its own shard and those the round is not stepping."""
        with self._lock:
            while not (shards := [d for d in range(len(self.shards)) if self._mine(d)]):
                self._round_over.wait()  # another thread, while every shard steps
            d = self._place(prompt, shards)
            rid = self._next_id
            wrapped = None if callback is None else (lambda event: callback(event._replace(id=rid)))
            shard_id = self.shards[d].submit(prompt, callback=wrapped, **kwargs)
            self._next_id += 1
            self._where[rid] = (d, shard_id)
            self._ours[d][shard_id] = rid
            self._order.append(rid)
            return rid

    def cancel(self, request_id: int) -> bool:
        """`Engine.cancel`: its callback gets the "cancelled" event now, and the next `step` or `run` reports it
        (queued here, not left in the shard: none may be left to step). A request whose shard another thread is
        stepping (a callback's cancel of a request on another shard) is cancelled at the end of the round."""
        with self._lock:
            where = self._where.get(request_id)
            if where is None or request_id in self._done:
                return False
            d, shard_id = where
            if not self._mine(d):
                if request_id not in self._deferred:
                    self._deferred.append(request_id)
                return True
            cancelled = self.shards[d].cancel(shard_id)
            self._events.extend(self._report(d, self.shards[d].take_events()))
            return cancelled

    # --- running ------------------------------------------------------------------------------------------------

    def _report(self, d: int, shard_events: list[Event]) -> list[Event]:
        """Shard d's events -> ours (our ids); the results of those that finished taken from the shard. Under
        the lock."""
        events = []
        for event in shard_events:
            event = event._replace(id=self._ours[d][event.id])
            events.append(event)
            if event.finished:
                result = self.shards[d].take(self._where[event.id][1])
                self._done[event.id] = dataclasses.replace(result, id=event.id)
        return events

    def step(self) -> list[Event]:
        """As `Engine.step`: the events queued (cancellations, what a `run` left early did not yield), then one
        round of every shard with work, the shards at once -> their events (this engine's ids)."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events + self._round()

    def _round(self) -> list[Event]:
        with self._lock:
            busy = [d for d, e in enumerate(self.shards) if e.pending or e.queued_events]
            self._stepping = frozenset(busy)
        rounds, error = [], None
        try:
            if len(busy) == 1:
                rounds = [(busy[0], self._step_shard(busy[0]))]
            else:
                futures = [(d, self._pool.submit(self._step_shard, d)) for d in busy]
                concurrent.futures.wait([f for _, f in futures])  # every shard done before the shards are free
                rounds = [(d, f.result()) for d, f in futures if f.exception() is None]
                error = next((f.exception() for _, f in futures if f.exception() is not None), None)
        finally:
            with self._lock:
                self._stepping = frozenset()
                events = [event for d, shard_events in rounds for event in self._report(d, shard_events)]
                if error is not None:  # a shard raised (its requests wait, `Engine._round`): the others' events
                    self._events.extend(events)  # stay queued for the next step, their results taken
                deferred, self._deferred = self._deferred, []
                for rid in deferred:  # their events go to the queue: the next step reports them
                    self.cancel(rid)
                self._round_over.notify_all()
        if error is not None:
            raise error
        return events

    def _step_shard(self, d: int) -> list[Event]:
        self._thread.shard = d  # this thread's callbacks are shard d's (`_mine`)
        try:
            return self.shards[d].step()
        finally:
            self._thread.shard = None

    def run(self) -> Iterator[Event]:
        """As `Engine.run`: until every request has finished and every event is reported; leaving early keeps
        the events not yet yielded queued for the next `run` or `step`."""
        while self.pending or self.queued_events:
            if not self._events:
                events = self._round()
                with self._lock:  # before what the round's callbacks queued (their cancels came after), as Engine.run
                    self._events.extendleft(reversed(events))
            while self._events:
                yield self._events.popleft()

    def results(self) -> list[Result]:
        for _ in self.run():
            pass
        with self._lock:
            order, self._order = self._order, []
            return [self._forget(rid) for rid in order]

    def take(self, request_id: int) -> Result | None:
        with self._lock:
            if request_id not in self._done:
                return None
            self._order.remove(request_id)
            return self._forget(request_id)

    def _forget(self, rid: int) -> Result:
        result = self._done.pop(rid)
        d, shard_id = self._where.pop(rid)
        self._ours[d].pop(shard_id, None)
        return result

    def generate(self, requests, **defaults) -> list[Result]:
        """As `Engine.generate`: every request checked by its shard as submitted; the results in order."""
        calls = generate_calls(requests, defaults)
        ids = []
        with self._lock:
            # one bad request submits none, as Engine.generate: every shard withdraws what it took, our maps too
            saved = (self._next_id, list(self._order), dict(self._where), [dict(ours) for ours in self._ours])
            try:
                with contextlib.ExitStack() as stack:
                    for shard in self.shards:
                        stack.enter_context(shard.submitting())
                    for call in calls:
                        ids.append(self.submit(call.pop("prompt"), **call))
            except BaseException:
                self._next_id, self._order, self._where, self._ours = saved
                raise
        for _ in self.run():
            pass
        with self._lock:
            self._order = [rid for rid in self._order if rid not in ids]
            return [self._forget(rid) for rid in ids]

    # --- inspection ---------------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return sum(e.free_slots for e in self.shards)

    @property
    def free_pages(self) -> int:
        return sum(e.free_pages for e in self.shards)

    def held_pages(self) -> int:
        return sum(e.held_pages() for e in self.shards)

    @property
    def cached_pages(self) -> int:
        return sum(e.cached_pages for e in self.shards)

    @property
    def queued_events(self) -> int:
        """Events not yet reported: the next `step` returns them first."""
        return len(self._events) + sum(e.queued_events for e in self.shards)

    @property
    def waiting(self) -> int:
        return sum(e.waiting for e in self.shards)

    @property
    def pending(self) -> int:
        return sum(e.pending for e in self.shards)

    @property
    def stats(self) -> dict:
        """The shards' counters summed (their ratios recomputed over the sums), and each shard's as "shards"."""
        per = [e.stats for e in self.shards]
        total: dict = {}
        for s in per:
            for k, v in s.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        rows = total.get("decode_steps", 0) and sum(s.get("decode_steps", 0) * e.slots for s, e in
                                                    zip(per, self.shards))
        total["slot_occupancy"] = total.get("decode_rows_used", 0) / rows if rows else 0.0
        computed = total.get("decode_rows_computed", 0)
        total["decode_padding"] = 1.0 - total.get("decode_rows_used", 0) / computed if computed else 0.0
        computed = total.get("prefill_tokens_computed", 0)
        total["prefill_padding"] = 1.0 - total.get("prefill_tokens", 0) / computed if computed else 0.0
        total["shards"] = per
        return total

    def warm_up(self):
        list(self._pool.map(lambda e: e.warm_up(), self.shards))

    def reset_stats(self):
        for e in self.shards:
            e.reset_stats()
