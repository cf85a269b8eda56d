"""`jaxkv.Engine(mesh=)` with a "data" axis above 1 (issue 33, item 3): an engine per data shard, requests placed
on the least loaded (with prefix caches, on the one holding the longest cached prefix). Outputs equal the
single-device engine's on the 8 host devices for meshes (2, 1) and (4, 2), with mixed settings,
random arrivals and cancels; every shard's slots and pages are free afterwards."""

import collections
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxkv
from jaxkv.engine import DataParallelEngine, data_shards

from helpers.engine import assert_all_free, drain
from helpers.models import model_for

SETTINGS = [dict(), dict(temperature=0.9, seed=1), dict(temperature=1.2, top_k=10, seed=2), dict(logprobs=2),
            dict(temperature=0.7, top_p=0.8, seed=3), dict(repetition_penalty=1.3)]
_reference = {}
# One engine configuration for every test here (they share its compiled programs: one set per mesh): 2 decode steps
# per dispatch, so a few tokens reach mid-decode, and prompts of up to 30 tokens prefill in several chunks. The
# single engine gets 3 slots: a third request decodes beside two as it does beside one of them on a shard of 2.
KW = dict(max_len=64, page_size=8, prefill_chunk=8, steps_per_dispatch=2)
# Every engine here decodes at its full width only: with the default widths each shard compiled the decode program
# once per width (1 and 2; 1, 2 and 3 on the single engine), ~5 s each, for what the data-parallel engine does not
# touch (a shard picks its width as any engine does: test_engine.py's test_decode_computes_only_the_occupied_width).
ONE = dict(slots=3, decode_widths=[3], **KW)  # the single-device engine
DP = dict(slots=2, decode_widths=[2], **KW)  # the data-parallel engine (each shard's slots)


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:data * model]).reshape(data, model), ("data", "model"))


def requests(seed: int, count: int = 10):
    rng = np.random.default_rng(seed)
    return [([int(t) for t in rng.integers(1, 97, size=int(rng.integers(2, 30)))], int(rng.integers(2, 10)),
             SETTINGS[i % len(SETTINGS)]) for i in range(count)]


def single_device(model, prompt, new, kwargs):
    key = (tuple(prompt), new, tuple(sorted(kwargs.items())))
    if key not in _reference:
        engine = jaxkv.Engine(model, **ONE)  # the cancel tests' single engine: its programs
        (_reference[key],) = engine.generate([{"prompt": prompt, "max_new_tokens": new, **kwargs}], stop_tokens=[])
    return _reference[key]


# (2, 1): data shards alone (the mesh every other test here runs on, so its programs are theirs); (4, 2): more than
# two shards, each split over a model axis. (4, 1) and (2, 2) are these two's axes apart: each mesh compiles every
# engine program once more.
@pytest.mark.parametrize("shape", [(2, 1), (4, 2)])
def test_outputs_equal_the_single_device_engine(shape):
    model = model_for("gqa")  # 2 KV heads: split over a model axis of 2
    engine = jaxkv.Engine(model, mesh=mesh_of(*shape), **DP)
    assert isinstance(engine, DataParallelEngine) and len(engine.shards) == shape[0]
    assert engine.slots == 2 * shape[0]
    rng = np.random.default_rng(sum(shape))
    arrivals = [(p, n, dict(k, stop_tokens=[])) for p, n, k in requests(sum(shape))]
    ids = drain(engine, arrivals, rng)
    results = engine.results()
    assert [r.id for r in results] == sorted(ids)
    for r in results:
        prompt, new, kwargs = ids[r.id]
        want = single_device(model, prompt, new, {k: v for k, v in kwargs.items() if k != "stop_tokens"})
        assert r.tokens == want.tokens, (r.id, kwargs)
        np.testing.assert_allclose(r.logprobs, want.logprobs, atol=1e-4)
    assert all(s.stats.get("requests_admitted", 0) > 0 for s in engine.shards)  # the load spread over all
    for shard in engine.shards:
        assert_all_free(shard)
    assert engine.pending == 0 and engine.free_slots == engine.slots and engine.held_pages() == 0


def test_cancels_free_their_shards():
    model = model_for("gqa")
    engine = jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)
    ids = [engine.submit(p, max_new_tokens=20, stop_tokens=[]) for p, _, _ in requests(5, 6)]
    engine.step()
    assert engine.cancel(ids[0]) and engine.cancel(ids[3]) and not engine.cancel(12345)
    results = {r.id: r for r in engine.results()}
    assert results[ids[0]].finish_reason == results[ids[3]].finish_reason == "cancelled"
    assert all(results[i].finish_reason == "length" for i in ids if i not in (ids[0], ids[3]))
    for shard in engine.shards:
        assert_all_free(shard)


def test_callbacks_and_events_carry_the_engines_ids():
    model = model_for("gqa")
    engine = jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)
    seen = []
    ids = [engine.submit(p, max_new_tokens=3, stop_tokens=[], callback=lambda e: seen.append(e.id))
           for p, _, _ in requests(6, 4)]
    events = [e for e in engine.run()]
    assert {e.id for e in events} == set(ids) == set(seen)
    assert sorted(r.id for r in engine.results()) == ids


def test_a_prompt_goes_to_the_shard_holding_its_prefix():
    model = model_for("gqa")
    mesh = mesh_of(2, 1)
    caches = [jaxkv.PrefixCache(model, num_pages=32, page_size=8, mesh=m) for m in data_shards(mesh)]
    engine = jaxkv.Engine(model, mesh=mesh, prefix_cache=caches, **DP)  # the raising shard test's
    header = list(range(1, 33))  # 4 pages
    (first,) = engine.generate([header + [40, 41]], max_new_tokens=3, stop_tokens=[])
    holder = next(d for d, c in enumerate(caches) if c.cached_pages)
    # three more requests at once: the load alone would spread them; the prefix sends them all to the holder
    results = engine.generate([header + [50 + i] for i in range(3)], max_new_tokens=3, stop_tokens=[])
    assert all(r.cached_tokens == 32 for r in results)
    assert engine.shards[holder].stats["requests_admitted"] == 4
    assert engine.shards[1 - holder].stats.get("requests_admitted", 0) == 0
    with pytest.raises(ValueError, match="one per shard"):
        jaxkv.Engine(model, mesh=mesh, prefix_cache=caches[0], **DP)


def test_generate_with_one_bad_request_submits_none():
    """As Engine.generate: the third request is refused after two were placed on shards; neither runs, no shard
    keeps anything, and the next call's results and ids are those of an engine that never saw the bad call."""
    model = model_for("gqa")
    engine = jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)
    (p0, n0, _), (p1, n1, _) = requests(9, 2)
    calls = [{"prompt": p0, "max_new_tokens": n0}, {"prompt": p1, "max_new_tokens": n1},
             {"prompt": p1, "max_new_tokens": 1000}]  # past max_len: refused by its shard's submit
    with pytest.raises(ValueError):
        engine.generate(calls, stop_tokens=[])
    assert engine.pending == 0 and engine.waiting == 0
    assert all(shard.pending == 0 and shard.waiting == 0 for shard in engine.shards)
    got = engine.generate(calls[:2], stop_tokens=[])
    assert [r.id for r in got] == [0, 1]
    assert [r.tokens for r in got] == [single_device(model, p, n, {}).tokens for p, n in ((p0, n0), (p1, n1))]
    for shard in engine.shards:
        assert_all_free(shard)


# --- Issue 50: one engine's events and results in every event path ---------------------------------------------

LONG = [int(t) % 96 + 1 for t in range(7, 47)]  # 40 tokens: five prefill chunks of 8


def assert_shards_free(engine):
    for shard in engine.shards:
        if shard._state is not None:
            assert_all_free(shard)
        else:  # no request has reached it yet: no pool to check
            assert shard.pending == shard.queued_events == 0
    assert engine.free_slots == engine.slots and engine.held_pages() == 0


def view(event):
    return event.id, tuple(event.tokens), event.finished, event.finish_reason


def cancel_scenario(engine, when, others):
    """Requests A and B decoding (one per shard on the data-parallel engine; none when others is "none"), then T,
    cancelled before its admission ("queued"), while its long prompt is prefilled in chunks ("prefill"), or
    mid-decode ("decode"). others "cancelled": A and B are cancelled first, so T is the last request in flight;
    "running": they run on to the end. Then the engine serves a later request. -> what it reported: each id's
    events from step/run and from its callback, the results, the later request's."""
    reported, called = collections.defaultdict(list), collections.defaultdict(list)

    def submit(prompt):
        return engine.submit(prompt, max_new_tokens=12, stop_tokens=[], callback=lambda e: called[e.id].append(view(e)))

    def record(events):
        for event in events:
            reported[event.id].append(view(event))

    (pa, _, _), (pb, _, _), (pt, _, _) = requests(11, 3)
    ab = [] if others == "none" else [submit(pa), submit(pb)]
    record(engine.step())
    prefilled = engine.stats.get("prefill_tokens", 0)
    t = submit(LONG if when == "prefill" else pt)
    if when == "queued":
        assert engine.waiting == 1
    else:
        record(engine.step())
        assert engine.waiting == 0
    if when == "prefill":  # part of T's prompt is in the cache, not all of it
        assert prefilled < engine.stats["prefill_tokens"] < prefilled + len(LONG)
        assert t not in reported
    if when == "decode":
        record(engine.step())
        assert reported[t] and not reported[t][-1][2]
    if others == "cancelled":
        assert all(engine.cancel(rid) for rid in ab)
    assert engine.cancel(t) and not engine.cancel(t)
    assert engine.queued_events == (len(ab) if others == "cancelled" else 0) + 1
    record(engine.run())
    assert engine.pending == 0 and engine.queued_events == 0 and list(engine.run()) == [] and engine.step() == []
    results = [(r.id, tuple(r.tokens), r.finish_reason) for r in engine.results()]
    assert engine.results() == []
    (later,) = engine.generate([pa], max_new_tokens=5, stop_tokens=[])
    return dict(reported), dict(called), results, (later.id, tuple(later.tokens), later.finish_reason)


@pytest.mark.parametrize("when", ["queued", "prefill", "decode"])
def test_cancels_report_as_one_engine_does(when):
    """Issue 50: cancelling the last request in flight left its "cancelled" event in its shard (run() stopped when
    nothing was pending), and results() raised KeyError then and on every later call. Every cancel timing, the
    last request or not, alone or beside others: the same events (per request, from run() and from callbacks)
    and results as the single-device engine's, on one engine used for every case in turn."""
    model = model_for("gqa")
    single = jaxkv.Engine(model, **ONE)
    dp = jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)
    for others in ["none", "cancelled", "running"]:
        if when == "prefill" and others == "none":
            continue  # alone, a prompt is prefilled whole in one step (nothing decodes to hold it up)
        want = cancel_scenario(single, when, others)
        got = cancel_scenario(dp, when, others)
        assert got == want, others
        reported, called, results, later = got
        assert reported == called  # a callback gets each event run() reports, the "cancelled" one too
        for rid, events in reported.items():  # one finishing event each, the last
            assert [e[2] for e in events] == [False] * (len(events) - 1) + [True]
        t = max(reported)
        assert reported[t][-1][3] == "cancelled" and results[-1][2] == "cancelled"
        assert later[2] == "length" and len(later[1]) == 5
        assert_shards_free(dp)


def test_take_and_run_left_early_as_one_engine():
    """A cancelled request's result can be taken at once (the server's worker does when a submit is refused),
    and a run() left early keeps the rest of its events queued for the next run, as the single engine's."""
    model = model_for("gqa")
    outcomes = []
    for engine in [jaxkv.Engine(model, **ONE), jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)]:
        (pa, _, _), (pb, _, _) = requests(12, 2)
        a, b = (engine.submit(p, max_new_tokens=6, stop_tokens=[]) for p in (pa, pb))
        engine.step()
        assert engine.cancel(a)
        taken = engine.take(a)
        assert taken is not None and taken.finish_reason == "cancelled" and engine.take(a) is None
        run = engine.run()
        first = view(next(run))
        run.close()  # left early: the rest stays queued
        assert engine.queued_events + engine.pending > 0
        rest = [view(e) for e in engine.run()]
        outcomes.append((view_result(taken), first, rest, [view_result(r) for r in engine.results()]))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][1] == (a, (), True, "cancelled")


@pytest.mark.parametrize("loop", ["run", "step"])
def test_a_callback_cancels_a_request_stepped_before_it(loop):
    """Request 2's callback cancels request 0 (on the data-parallel engine, of the same shard), whose events of
    that dispatch came out first: its "cancelled" event comes after them, last, from run() as from step()
    (Engine.run used to yield it first, before the round's events), on both engines alike."""
    model = model_for("gqa")
    outcomes = []
    for engine in [jaxkv.Engine(model, **ONE), jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)]:
        prompts = [p for p, _, _ in requests(14, 3)]
        cancel_zero = lambda event: engine.cancel(0) if event.tokens else None  # noqa: E731
        ids = [engine.submit(p, max_new_tokens=6, stop_tokens=[], callback=cancel_zero if i == 2 else None)
               for i, p in enumerate(prompts)]
        reported = collections.defaultdict(list)
        events = engine.run() if loop == "run" else (e for _ in iter(lambda: engine.pending or engine.queued_events,
                                                                     0) for e in engine.step())
        for event in events:
            reported[event.id].append(view(event))
        assert reported[0][-1][2:] == (True, "cancelled") and not any(e[2] for e in reported[0][:-1])
        assert reported[0][0][1]  # it had tokens before the cancel
        outcomes.append((dict(reported), [view_result(r) for r in engine.results()]))
        assert ids == [0, 1, 2]
    assert outcomes[1] == outcomes[0]


def view_result(r):
    return r.id, tuple(r.tokens), r.finish_reason


def test_callbacks_submit_and_cancel_from_the_shards_threads():
    """Callbacks run in the thread stepping their request's shard. Those that submit go to their own shard or one
    not stepping, never into a shard another thread is stepping (its host state is that thread's until the round
    ends); a cancel of a request on another shard lands at the end of the round. Every request submitted from a
    callback runs to its reference tokens, ids stay unique and in order, and the engine serves on afterwards."""
    model = model_for("gqa")
    engine = jaxkv.Engine(model, mesh=mesh_of(2, 1), **DP)
    owner, clashes, lock = {}, [], threading.Lock()

    def guarded(d, shard):  # each shard records which thread steps it; a submit or cancel from another is a clash
        step, submit, cancel = shard.step, shard.submit, shard.cancel

        def stepping():
            with lock:
                owner[d] = threading.get_ident()
            try:
                time.sleep(0.05)  # the rounds of both shards overlap, so a clash could not slip through by timing
                return step()
            finally:
                time.sleep(0.05)
                with lock:
                    owner[d] = None

        def check(fn):
            def call(*args, **kwargs):
                with lock:
                    if owner.get(d) not in (None, threading.get_ident()):
                        clashes.append((fn.__name__, d))
                return fn(*args, **kwargs)
            return call
        shard.step, shard.submit, shard.cancel = stepping, check(submit), check(cancel)

    for d, shard in enumerate(engine.shards):
        guarded(d, shard)

    prompts = [p for p, _, _ in requests(13, 8)]
    children, threads = {}, set()

    def spawn(parent, prompt, cancel=None):
        def callback(event):
            threads.add(threading.current_thread().name)
            if parent not in children and not event.finished:
                children[parent] = engine.submit(prompt, max_new_tokens=4, stop_tokens=[])
                if cancel is not None:
                    assert engine.cancel(cancel)
        return callback

    # shard 0 gets requests 0 and 2, shard 1 request 1: the least loaded shard is the other one when shard 0's
    # callbacks submit
    ids = [engine.submit(prompts[0], max_new_tokens=8, stop_tokens=[], callback=spawn(0, prompts[3])),
           engine.submit(prompts[1], max_new_tokens=8, stop_tokens=[], callback=spawn(1, prompts[4]))]
    ids.append(engine.submit(prompts[2], max_new_tokens=8, stop_tokens=[], callback=spawn(2, prompts[5], ids[1])))
    events = [view(e) for e in engine.run()]
    assert not clashes
    assert any(name.startswith("jaxkv-shard") for name in threads)  # the callbacks ran in the shards' threads
    results = engine.results()
    assert [r.id for r in results] == list(range(6)) and sorted(children.values()) == [3, 4, 5]
    by_id = {r.id: r for r in results}
    assert by_id[1].finish_reason == "cancelled" and [e for e in events if e[0] == 1][-1][3] == "cancelled"
    for rid, prompt in [(0, prompts[0]), (2, prompts[2])]:
        assert by_id[rid].tokens == single_device(model, prompt, 8, {}).tokens
    for parent, rid in children.items():
        assert by_id[rid].finish_reason == "length"
        assert by_id[rid].tokens == single_device(model, prompts[3 + parent], 4, {}).tokens
    (later,) = engine.generate([prompts[6]], max_new_tokens=3, stop_tokens=[])
    assert later.id == 6 and later.tokens == single_device(model, prompts[6], 3, {}).tokens
    assert not clashes
    assert_shards_free(engine)


def test_a_shard_that_raises_loses_no_other_shards_events():
    """A shard's step may raise and leave its requests waiting (its prefix cache's pool lent to another engine):
    the shards that stepped keep their events queued for the next step and their results, and once the pool is
    back every request finishes with its reference tokens."""
    model = model_for("gqa")
    mesh = mesh_of(2, 1)
    caches = [jaxkv.PrefixCache(model, num_pages=32, page_size=8, mesh=m) for m in data_shards(mesh)]
    engine = jaxkv.Engine(model, mesh=mesh, prefix_cache=caches, **DP)
    other = jaxkv.Engine(model, mesh=data_shards(mesh)[0], prefix_cache=caches[0], **DP)
    (p0, _, _), (p1, _, _), (p2, _, _) = requests(15, 3)
    other.submit(p2, max_new_tokens=8, stop_tokens=[])
    other.step()  # shard 0's pool is lent to `other` until its request finishes
    ids = [engine.submit(p, max_new_tokens=3, stop_tokens=[]) for p in (p0, p1)]  # one on each shard
    with pytest.raises(RuntimeError, match="in use by another"):
        engine.step()
    assert engine.queued_events > 0  # shard 1's request ran its round: its events wait here
    other.results()
    events = [view(e) for e in engine.run()]
    assert {e[0] for e in events if e[2]} == set(ids)
    results = engine.results()
    assert [r.id for r in results] == ids
    assert [r.tokens for r in results] == [single_device(model, p, 3, {}).tokens for p in (p0, p1)]
