"""`jaxkv.Engine(mesh=)` with a "data" axis above 1 (issue 33, item 3): an engine per data shard, requests placed
on the least loaded (with prefix caches, on the one holding the longest cached prefix). Outputs equal the
single-device engine's on the 8 host devices for meshes (2, 1), (4, 1), (2, 2), (4, 2), with mixed settings,
random arrivals and cancels; every shard's slots and pages are free afterwards."""

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


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:data * model]).reshape(data, model), ("data", "model"))


def requests(seed: int, count: int = 10):
    rng = np.random.default_rng(seed)
    return [([int(t) for t in rng.integers(1, 97, size=int(rng.integers(2, 30)))], int(rng.integers(2, 10)),
             SETTINGS[i % len(SETTINGS)]) for i in range(count)]


def single_device(model, prompt, new, kwargs):
    key = (tuple(prompt), new, tuple(sorted(kwargs.items())))
    if key not in _reference:
        engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=16)
        (_reference[key],) = engine.generate([{"prompt": prompt, "max_new_tokens": new, **kwargs}], stop_tokens=[])
    return _reference[key]


@pytest.mark.parametrize("shape", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_outputs_equal_the_single_device_engine(shape):
    model = model_for("gqa")  # 2 KV heads: split over a model axis of 2
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=16, mesh=mesh_of(*shape))
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
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, mesh=mesh_of(2, 1))
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
    engine = jaxkv.Engine(model, slots=1, max_len=64, page_size=8, mesh=mesh_of(2, 1))
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
    engine = jaxkv.Engine(model, slots=2, max_len=64, mesh=mesh, prefix_cache=caches)
    header = list(range(1, 33))  # 4 pages
    (first,) = engine.generate([header + [40, 41]], max_new_tokens=3, stop_tokens=[])
    holder = next(d for d, c in enumerate(caches) if c.cached_pages)
    # three more requests at once: the load alone would spread them; the prefix sends them all to the holder
    results = engine.generate([header + [50 + i] for i in range(3)], max_new_tokens=3, stop_tokens=[])
    assert all(r.cached_tokens == 32 for r in results)
    assert engine.shards[holder].stats["requests_admitted"] == 4
    assert engine.shards[1 - holder].stats.get("requests_admitted", 0) == 0
    with pytest.raises(ValueError, match="one per shard"):
        jaxkv.Engine(model, slots=2, max_len=64, mesh=mesh, prefix_cache=caches[0])


def test_generate_with_one_bad_request_submits_none():
    """As Engine.generate: the third request is refused after two were placed on shards; neither runs, no shard
    keeps anything, and the next call's results and ids are those of an engine that never saw the bad call."""
    model = model_for("gqa")
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, mesh=mesh_of(2, 1))
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
