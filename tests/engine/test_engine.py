"""The continuous-batching engine (issue 14): each request's tokens equal `generate` of it alone whatever shares the
batch and whenever it arrives; log-probabilities equal a recomputation; nothing recompiles after warm-up; slots and
pages all come back after finishing, cancelling and failing."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import sharding
from jaxkv.engine import Engine
from helpers.models import model_for
from helpers.tolerances import atol
from helpers.compiles import count_compiles
from helpers.engine import alone, assert_all_free, drain, recomputed_logprobs

LOGPROB_TOL = atol("logprobs")  # the same logits' log-softmax through a different (cached) program

RNG = np.random.default_rng(0)


# Engine configurations several tests share (so they share its compiled programs): the greedy test's, at 3 slots
# (2 prefill rows) or 8 (4 prefill rows: the occupied-width test's first six requests are admitted together), and
# the event tests' (2 slots, 2 decode steps per dispatch).
GREEDY = {3: dict(slots=3, max_len=96, page_size=8, prefill_chunk=16, prefill_rows=2),
          8: dict(slots=8, max_len=96, page_size=8, prefill_chunk=16, prefill_rows=4)}
EVENTS = dict(slots=2, max_len=64, page_size=8, steps_per_dispatch=2, decode_widths=[2])


def random_requests(n, rng, longest=40, most_new=24):
    return [(rng.integers(1, 97, int(rng.integers(1, longest))).tolist(), int(rng.integers(1, most_new)))
            for _ in range(n)]


@pytest.mark.parametrize("slots", [3, 8])  # one slot (width 1): test_decode_computes_only_the_occupied_width
def test_greedy_tokens_and_logprobs_equal_each_request_alone(slots):
    model = model_for("gqa")
    rng = np.random.default_rng(slots)
    engine = Engine(model, **GREEDY[slots])
    arrivals = [(p, n, {}) for p, n in random_requests(10, rng)]
    rng.shuffle(arrivals)
    ids = drain(engine, arrivals, rng)
    assert_all_free(engine)
    results = engine.results()
    assert [r.id for r in results] == sorted(ids)
    for r in results:
        prompt, new, _ = ids[r.id]
        assert r.tokens == alone(model, prompt, new).tokens[0]
        assert r.finish_reason == "length" and r.prompt_tokens == len(prompt)
        _, want = recomputed_logprobs(model, prompt, r.tokens)
        np.testing.assert_allclose(r.logprobs, want, atol=LOGPROB_TOL)


def test_mixed_sampling_settings_draw_what_each_request_draws_alone():
    model = model_for("gqa")
    rng = np.random.default_rng(7)
    settings = [dict(temperature=0.9, seed=1), dict(), dict(temperature=1.3, top_k=10, seed=2),
                dict(temperature=0.7, top_p=0.8, seed=3), dict(temperature=1.0, min_p=0.05, seed=2**40 + 5),
                dict(temperature=1.0, top_k=5, top_p=0.9, seed=4)]
    arrivals = [(p, n, s) for (p, n), s in zip(random_requests(len(settings), rng, most_new=16), settings)]
    engine = Engine(model, **GREEDY[3])
    ids = drain(engine, arrivals, rng)
    for r in engine.results():
        prompt, new, kwargs = ids[r.id]
        assert r.tokens == alone(model, prompt, new, **kwargs).tokens[0], kwargs


def test_top_logprobs_are_the_recomputed_top_k():
    model = model_for("gqa")
    prompt = RNG.integers(1, 97, 11).tolist()
    engine = Engine(model, **EVENTS)
    r = engine.generate([prompt], max_new_tokens=6, logprobs=5, stop_tokens=[], temperature=1.0, seed=9)[0]
    logp, want = recomputed_logprobs(model, prompt, r.tokens)
    np.testing.assert_allclose(r.logprobs, want, atol=LOGPROB_TOL)
    assert len(r.top_logprobs) == len(r.tokens) == 6
    for i, top in enumerate(r.top_logprobs):
        row = logp[len(prompt) - 1 + i]
        assert [t for t, _ in top] == np.argsort(-row, kind="stable")[:5].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:5], atol=LOGPROB_TOL)
    greedy = engine.generate([prompt], max_new_tokens=4, logprobs=1, stop_tokens=[])[0]
    assert [top[0][0] for top in greedy.top_logprobs] == greedy.tokens
    assert engine.generate([prompt], max_new_tokens=2, stop_tokens=[])[0].top_logprobs is None


def test_events_stream_every_token_once_and_stop_tokens_end_requests():
    model = model_for("gqa")
    prompts = [RNG.integers(1, 97, n).tolist() for n in (3, 17, 9)]
    # Stop at the third token each would emit greedily.
    stops = [alone(model, p, 6).tokens[0][2] for p in prompts]
    engine = Engine(model, **EVENTS)
    ids = [engine.submit(p, max_new_tokens=6, stop_tokens=[s]) for p, s in zip(prompts, stops)]
    streamed = {i: [] for i in ids}
    finished = []
    for event in engine.run():
        assert event.id in ids and len(event.tokens) == len(event.logprobs)
        streamed[event.id] += event.tokens
        if event.finished:
            finished.append((event.id, event.finish_reason))
    results = engine.results()
    assert sorted(finished) == [(i, "stop") for i in ids]
    for r, p, s in zip(results, prompts, stops):
        want = alone(model, p, 6, stop_tokens=[s]).tokens[0]
        assert r.tokens == streamed[r.id] == want and r.tokens[-1] == s and r.finish_reason == "stop"


def test_no_recompiles_after_warm_up_over_200_requests():
    model = model_for("gqa")
    rng = np.random.default_rng(3)
    engine = Engine(model, **GREEDY[3])  # the greedy test's programs, warmed by it or here
    engine.warm_up()  # every decode width (1, 2, 3)
    warm = [dict(max_new_tokens=3, temperature=0.8, top_k=5, seed=1, logprobs=2), dict(max_new_tokens=2)]
    for kwargs in warm:
        engine.generate([rng.integers(1, 97, 40).tolist()], stop_tokens=[], **kwargs)
    engine.cancel(engine.submit([1, 2, 3], max_new_tokens=4))  # a cancel, warm too
    settings = [dict(), dict(temperature=1.0, seed=5), dict(temperature=0.5, top_p=0.9, seed=6),
                dict(temperature=1.2, top_k=3, min_p=0.1, logprobs=3), dict(stop_tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9])]
    requests = [dict(prompt=rng.integers(1, 97, int(rng.integers(1, 68))).tolist(),
                     max_new_tokens=int(rng.integers(1, 28)), **settings[i % len(settings)]) for i in range(200)]
    with count_compiles() as c:
        results = engine.generate(requests)
    assert c["n"] == 0
    assert len(results) == 200 and all(r.finish_reason in ("stop", "length") for r in results)
    assert_all_free(engine)


def test_decode_computes_only_the_occupied_width():
    """A dispatch computes the first W slots, W the smallest compiled width holding every decoding slot: one
    request costs a batch of 1, not of `slots`. A request left in a high slot once the others finish moves down
    (its page-table row and per-slot state, PRNG key and sampling settings included), so the width drops; requests
    that join meanwhile, and the moved one, still get exactly their own tokens."""
    model = model_for("gqa")
    engine = Engine(model, **GREEDY[8])  # the greedy test's programs at 8 slots
    assert engine.decode_widths == [1, 2, 4, 8]
    assert Engine(model, slots=6, max_len=64, decode_widths=[6, 2, 2]).decode_widths == [2, 6]
    for bad in ([2, 4], [0, 6], [7], 6):
        with pytest.raises(ValueError, match="decode"):
            Engine(model, slots=6, max_len=64, decode_widths=bad)
    engine.generate([[3, 4, 5]], max_new_tokens=20, stop_tokens=[])
    s = engine.stats
    assert s["decode_steps"] >= 19 and s["decode_rows_computed"] == s["decode_steps"]  # width 1 throughout
    engine.reset_stats()
    prompts = [RNG.integers(1, 97, n).tolist() for n in (5, 7, 4, 6, 9, 3, 8, 5)]
    sampled = dict(temperature=1.0, top_k=20, seed=11)  # the long one in slot 5: sampled, so its key must move
    first = [engine.submit(p, max_new_tokens=n, stop_tokens=[], **(sampled if n == 40 else {}))
             for p, n in zip(prompts[:6], (2, 2, 2, 2, 2, 40))]
    late = []
    for event in engine.run():  # once the short ones are done, two more join in the low slots
        if not late and event.id == first[0] and event.finished:
            late = [engine.submit(p, max_new_tokens=12, stop_tokens=[]) for p in prompts[6:]]
    results = {r.id: r for r in engine.results()}
    for rid, p, n in zip(first + late, prompts, (2, 2, 2, 2, 2, 40, 12, 12)):
        assert results[rid].tokens == alone(model, p, n, **(sampled if n == 40 else {})).tokens[0]
    s = engine.stats
    assert s["slot_moves"] >= 1  # the long request left slot 5
    assert s["decode_rows_computed"] < s["decode_steps"] * 8 // 2  # mostly width 1 or 4, not 8
    assert_all_free(engine)


def test_leaving_run_early_loses_no_event_and_callbacks_see_cancels():
    """Issue 27, item 5: a consumer that leaves `run` after each event (the README says leaving is safe) still gets
    every token and every finish once, from later `run` calls; a request's callback gets its "cancelled" event."""
    model = model_for("gqa")
    prompts = [RNG.integers(1, 97, n).tolist() for n in (3, 17, 9)]
    engine = Engine(model, **EVENTS)
    ids = [engine.submit(p, max_new_tokens=6, stop_tokens=[]) for p in prompts]
    streamed, finished = {i: [] for i in ids}, []
    while (event := next(engine.run(), None)) is not None:  # a fresh run each time, left after one event
        streamed[event.id] += event.tokens
        if event.finished:
            finished.append(event.id)
    assert sorted(finished) == ids
    for r, p in zip(engine.results(), prompts):
        assert r.tokens == streamed[r.id] == alone(model, p, 6).tokens[0]
    got = []
    running = engine.submit(prompts[1], max_new_tokens=6, stop_tokens=[], callback=got.append)
    queued = [engine.submit(p, max_new_tokens=6, stop_tokens=[], callback=got.append) for p in prompts[::2]]
    engine.step()
    for rid in [running] + queued:
        engine.cancel(rid)
    cancelled = [(rid, "cancelled") for rid in [running] + queued]
    assert [(e.id, e.finish_reason) for e in got if e.finished] == cancelled
    assert [(e.id, e.finish_reason) for e in engine.step() if e.finished] == cancelled
    assert_all_free(engine)


def test_two_engines_on_one_prefix_cache_take_turns():
    """Issue 27, item 8: while one engine runs in a prefix cache's pool, another on the same cache is refused
    clearly (it would run on a stale copy of the pool), changes nothing, and runs once the first has finished."""
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=40, page_size=8)
    first, second = (Engine(model, slots=2, max_len=96, prefix_cache=pc, prefill_chunk=16, decode_widths=[2])
                     for _ in range(2))
    prompt = RNG.integers(1, 97, 45).tolist()
    first.submit(prompt, max_new_tokens=20, stop_tokens=[])
    first.step()  # prefilled, 8 of its 20 tokens decoded
    assert pc.lent_to is first
    second.submit(prompt, max_new_tokens=20, stop_tokens=[])
    with pytest.raises(RuntimeError, match="in use by another jaxkv.Engine"):
        second.step()
    assert second.pending == 1 and second.waiting == 1 and pc.lent_to is first
    want = alone(model, prompt, 20).tokens[0]
    assert first.results()[0].tokens == want and pc.lent_to is None
    result = second.results()[0]
    assert result.tokens == want and result.cached_tokens == 40  # the 5 whole pages the first engine cached
    assert pc.lent_to is None and pc.free_pages() == 40 - pc.cached_pages


def test_no_recompiles_when_a_prefix_cache_pool_comes_back():
    """With a prefix cache the pool goes back to the cache when the engine is idle and returns for the next run:
    the state is then made of program outputs, not fresh arrays; it must hit the same compiled programs (it did
    not: jit keys on committed vs uncommitted arrays, and with a loaded checkpoint's committed weights every
    program compiled a second time)."""
    model = model_for("mqa")
    model = jaxkv.Model(model.config, jax.device_put(model.params, jax.local_devices()[0]))  # as jaxkv.load gives
    # one decode width (2): the pool's return is the point, not the widths (each compiles the decode program once
    # more; test_no_recompiles_after_warm_up_over_200_requests warms several)
    engine = Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=16, decode_widths=[2],
                    prefix_cache=jaxkv.PrefixCache(model, num_pages=24, page_size=8))
    engine.warm_up()  # every program compiled once, then the pool goes back to the cache
    with count_compiles() as c:
        engine.generate([list(range(1, 30)), [7, 8, 9]], max_new_tokens=5, stop_tokens=[])
    assert c["n"] == 0


def test_slots_and_pages_come_back_after_cancels_and_failed_callbacks():
    model = model_for("gqa")
    prompts = [RNG.integers(1, 97, n).tolist() for n in (30, 12, 25, 8, 19)]
    engine = Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=8, prefill_rows=2, decode_widths=[2])

    def explode(event):
        raise RuntimeError("user code failed")

    ids = [engine.submit(p, max_new_tokens=n, stop_tokens=[]) for p, n in zip(prompts[:3], (20, 40, 20))]
    failing = engine.submit(prompts[3], max_new_tokens=20, stop_tokens=[], callback=explode)
    waiting = engine.submit(prompts[4], max_new_tokens=20, stop_tokens=[])
    engine.step()  # ids[0], ids[1] prefilling (two staging rows), the rest waiting
    assert engine.cancel(waiting) and not engine.cancel(waiting)
    assert (waiting, "cancelled") in [(e.id, e.finish_reason) for e in engine.step() if e.finished]
    engine.step()
    assert engine.cancel(ids[1])  # mid-decode (3 dispatches of 8 steps so far)
    results = {r.id: r for r in engine.results()}
    assert_all_free(engine)
    assert results[waiting].finish_reason == "cancelled" and results[waiting].tokens == []
    assert results[ids[1]].finish_reason == "cancelled"
    assert results[failing].finish_reason == "error" and "user code failed" in results[failing].error
    for rid, p in ((ids[0], prompts[0]), (ids[2], prompts[2])):  # the others are untouched
        assert results[rid].tokens == alone(model, p, 20).tokens[0]
    # The engine keeps working afterwards.
    assert engine.generate([prompts[1]], max_new_tokens=5, stop_tokens=[])[0].tokens == alone(model, prompts[1], 5).tokens[0]


def test_a_small_pool_makes_requests_wait_not_fail():
    model = model_for("gqa")
    rng = np.random.default_rng(11)
    # 6 pages of 8: a 40-token prompt with 8 new tokens needs 6, so requests run one or two at a time.
    engine = Engine(model, slots=4, max_len=64, page_size=8, num_pages=6, prefill_chunk=16, decode_widths=[4])
    reqs = random_requests(6, rng)
    results = engine.generate([dict(prompt=p, max_new_tokens=n) for p, n in reqs], stop_tokens=[])
    for r, (p, n) in zip(results, reqs):
        assert r.tokens == alone(model, p, n).tokens[0]
    assert_all_free(engine)


def test_requests_sharing_a_prefix_share_pages_through_the_prefix_cache():
    model = model_for("gqa")
    header = RNG.integers(1, 97, 40).tolist()  # 5 pages of 8
    prompts = [header + RNG.integers(1, 97, n).tolist() for n in (3, 9, 5, 1)]
    pc = jaxkv.PrefixCache(model, num_pages=40, page_size=8)
    engine = Engine(model, slots=2, max_len=96, prefix_cache=pc, prefill_chunk=16, decode_widths=[2])
    first = engine.generate([prompts[0]], max_new_tokens=6, stop_tokens=[])[0]
    assert first.cached_tokens == 0 and pc.cached_pages == 5 and pc.lent_to is None
    results = engine.generate(prompts[1:], max_new_tokens=6, stop_tokens=[])
    assert [r.cached_tokens for r in results] == [40, 40, 40]
    for r, p in zip([first] + results, prompts):
        assert r.tokens == alone(model, p, 6).tokens[0]
    # The pool went back to the prefix cache: generate can use it, and hits what the engine cached.
    out = jaxkv.generate(model, [prompts[2]], max_new_tokens=6, stop_tokens=[], prefix_cache=pc)
    assert out.stats["prefix_hit_tokens"] == 40 and out.tokens[0] == results[1].tokens
    # A pool too small for everything cached: the engine evicts least recently used prefixes and stays exact.
    small = jaxkv.PrefixCache(model, num_pages=9, page_size=8)
    engine = Engine(model, slots=2, max_len=96, prefix_cache=small, decode_widths=[2])
    others = [RNG.integers(1, 97, 45).tolist() for _ in range(3)]
    for r, p in zip(engine.generate(others + prompts[:2], max_new_tokens=4, stop_tokens=[]), others + prompts[:2]):
        assert r.tokens == alone(model, p, 4).tokens[0]


def test_bad_requests_are_refused_at_submit_and_queue_nothing():
    model = model_for("gqa")
    engine = Engine(model, slots=2, max_len=32, page_size=8, num_pages=3)
    good = [1, 2, 3]
    bad = [
        dict(prompt=list(range(1, 30)), max_new_tokens=4),  # 33 > max_len
        dict(prompt=list(range(1, 20)), max_new_tokens=10),  # 28 slots: 4 pages > the pool's 3
        dict(prompt=good, max_new_tokens=0),
        dict(prompt=[], max_new_tokens=2),
        dict(prompt=[1, 200], max_new_tokens=2),  # outside the vocabulary
        dict(prompt=good, max_new_tokens=2, temperature=-1.0),
        dict(prompt=good, max_new_tokens=2, top_k=5),  # a filter with greedy decoding
        dict(prompt=good, max_new_tokens=2, temperature=1.0, top_p=1.5),
        dict(prompt=good, max_new_tokens=2, logprobs=21),
        dict(prompt=good, max_new_tokens=2, stop_tokens=[97]),
        dict(prompt=good, max_new_tokens=2, stop_tokens=list(range(40))),
        dict(prompt=good, max_new_tokens=2, callback=3),
        dict(prompt="text", max_new_tokens=2),  # no tokenizer
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            engine.submit(kwargs.pop("prompt"), **kwargs)
    assert engine.pending == 0
    with pytest.raises(ValueError):  # one bad request in a batch submits none
        engine.generate([good, dict(prompt=good, max_new_tokens=0)], max_new_tokens=2)
    assert engine.pending == 0
    for kwargs in (dict(slots=0, max_len=32), dict(slots=2, max_len=10_000), dict(slots=2, max_len=32, mesh=object()),
                   dict(slots=2, max_len=32, cache_dtype="int4")):
        with pytest.raises(ValueError):
            Engine(model, **kwargs)
    with pytest.raises(ValueError):
        Engine("not a model", slots=1, max_len=8)


# int8 pools read by the Pallas kernel in one engine (each case compiles every engine program once more)
@pytest.mark.parametrize("kwargs", [dict(cache_dtype="bfloat16"), dict(cache_dtype="int8", attention="pallas")])
def test_quantized_caches_and_the_pallas_decode_kernel(kwargs):
    """The engine's cache dtypes and decode kernel are `generate`'s paged ones (Pallas in interpret mode on CPU).
    Each prompt is prefilled in one chunk, which attends over its own fresh K/V as generate's prefill does
    (tests/test_cache_dtypes.py: quantized engine == generate); a prompt in several chunks reads the earlier ones
    as stored, so it may differ from generate within the cache's rounding."""
    model = model_for("gqa")
    rng = np.random.default_rng(5)  # fixed prompts, whatever ran before
    prompts = [rng.integers(1, 97, n).tolist() for n in (5, 30, 12)]
    engine = Engine(model, slots=2, max_len=64, page_size=8, decode_widths=[2], **kwargs)
    got = engine.generate(prompts, max_new_tokens=8, stop_tokens=[])
    want = jaxkv.generate(model, prompts, max_new_tokens=8, stop_tokens=[], page_size=8, **kwargs)
    assert [r.tokens for r in got] == want.tokens
    assert_all_free(engine)


def test_readme_engine_example_runs():
    """The README's engine example runs as shown; its greedy request equals generate of it alone."""
    import contextlib
    import io
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "jaxkv.Engine(" in b]
    assert blocks, "README has no engine example"
    scope = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(blocks[0], scope)  # noqa: S102 (our own README)
    model, results = scope["model"], scope["results"]
    assert [r.finish_reason for r in results] == ["length", "length"] and len(results[1].tokens) == 4
    want = jaxkv.generate(model, ["Hello"], max_new_tokens=16)
    assert results[0].tokens == want.tokens[0] and results[0].text == want.text[0]


def test_on_a_mesh_the_pallas_paged_kernel_runs_per_shard(monkeypatch):
    """attention="pallas" on a 1 x 4 mesh: the paged kernel (interpreted on CPU) runs inside shard_map, each device
    over its own KV head of the pools (2 repeated to 4) with its query heads; tokens equal generate alone."""
    wrapped = []
    real = sharding.shard_paged_attention
    monkeypatch.setattr(sharding, "shard_paged_attention", lambda fn, mesh: wrapped.append(mesh) or real(fn, mesh))
    model = model_for("gqa")
    engine = Engine(model, slots=2, max_len=32, page_size=8, mesh=jax.make_mesh((1, 4), ("data", "model")),
                    attention="pallas", decode_widths=[2])
    prompts = [[5, 6, 7], list(range(1, 13))]
    got = engine.generate(prompts, max_new_tokens=5, stop_tokens=[])
    assert wrapped, "the Pallas paged kernel was not wrapped in shard_map"
    assert [r.tokens for r in got] == [alone(model, p, 5).tokens[0] for p in prompts]


def test_on_a_mesh_a_prefix_cache_built_for_it_is_shared():
    """A PrefixCache(mesh=) pool split over KV heads (2 repeated to 4 on a 4-way axis): the second request reuses
    the first's prompt pages, and each request's tokens equal generate of it alone on one device. A prefix cache
    laid out for one device is refused on a mesh (and the reverse), before any compute."""
    model = model_for("gqa")
    mesh = jax.make_mesh((1, 4), ("data", "model"))
    pc = jaxkv.PrefixCache(model, num_pages=48, page_size=8, mesh=mesh)
    assert pc._pools.keys[0].shape[1] == 4 and len(pc._pools.keys[0].sharding.device_set) == 4
    engine = Engine(model, slots=2, max_len=64, page_size=8, mesh=mesh, prefix_cache=pc, decode_widths=[2])
    header = list(range(3, 27))  # three whole pages
    for tail in ([40, 41], [50]):
        got = engine.generate([header + tail], max_new_tokens=6, stop_tokens=[])[0]
        assert got.tokens == alone(model, header + tail, 6).tokens[0]
    assert engine.stats["prefix_hit_tokens"] == 24
    assert engine.held_pages() == 0 and pc.cached_pages >= 3
    with pytest.raises(ValueError, match="laid out for a mesh of 4 devices; the call runs on one device"):
        Engine(model, slots=2, max_len=64, page_size=8, prefix_cache=pc)
    with pytest.raises(ValueError, match="laid out for one device; the call runs on another mesh"):
        Engine(model, slots=2, max_len=64, page_size=8, mesh=mesh,
               prefix_cache=jaxkv.PrefixCache(model, num_pages=48, page_size=8))


# a 4-way axis over 2 KV heads (repeated): test_on_a_mesh_a_prefix_cache_built_for_it_is_shared
@pytest.mark.parametrize("model_axis", [2])
def test_on_a_mesh_the_pools_split_over_kv_heads_and_tokens_are_unchanged(model_axis):
    """Weights over "model" (Megatron), page pools over KV heads (2 heads repeated to 4 for a 4-way axis), the
    rest replicated: each request draws what generate of it alone draws."""
    model = model_for("gqa")
    mesh = jax.make_mesh((1, model_axis), ("data", "model"))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 97, n).tolist() for n in (5, 30, 12)]
    engine = Engine(model, slots=2, max_len=64, page_size=8, mesh=mesh, decode_widths=[2])  # one decode program
    got = engine.generate(prompts, max_new_tokens=8, stop_tokens=[], temperature=0.8, seed=3)
    for r, p in zip(got, prompts):
        assert r.tokens == alone(model, p, 8, temperature=0.8, seed=3).tokens[0]
    pool = engine._state.cache.keys[0]
    kv_heads = max(model.config.n_kv_heads, model_axis)
    assert pool.shape[1] == kv_heads and pool.addressable_shards[0].data.shape[1] == kv_heads // model_axis
    assert_all_free(engine)
    # a data axis above 1 is the data-parallel engine (tests/engine/test_data_parallel.py): it takes one prefix
    # cache per shard, so a single one is refused; a cache built for no mesh is refused on a mesh
    for bad in (dict(mesh=jax.make_mesh((2, 2), ("data", "model")),
                     prefix_cache=jaxkv.PrefixCache(model, num_pages=8, page_size=8)),
                dict(mesh=mesh, prefix_cache=jaxkv.PrefixCache(model, num_pages=8, page_size=8))):
        with pytest.raises(ValueError):
            Engine(model, slots=2, max_len=64, page_size=8, **bad)
