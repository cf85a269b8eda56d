"""The prefix cache's host tier (issue 33, item 2): blocks evicted from the device pool go to host memory, and a
later prompt gets them copied back instead of recomputed; the tokens are exactly those of a run without the
cache, both tiers' counts stay consistent under random request sequences, nothing leaks, and a failed call leaves
both tiers as they were."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.cache.prefix import _block_keys

from helpers.models import model_for

RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(1, 97, n).tolist() for n in (40, 33, 47, 26, 41)]  # 3-5 pages of 8 each
_alone = {}


def alone(model, prompt):
    key = tuple(prompt)
    if key not in _alone:
        _alone[key] = jaxkv.generate(model, [prompt], max_new_tokens=6, stop_tokens=[]).tokens[0]
    return _alone[key]


def call(model, prompt, pc):
    return jaxkv.generate(model, [prompt], max_new_tokens=6, stop_tokens=[], prefix_cache=pc)


def check_tiers(pc):
    """Each block in one tier at most; the host tier within its size, each of its batches counting the blocks it
    holds; every device block's page held by the index (refcount >= 1)."""
    device, host = set(pc._index), set(pc._host_index)
    assert not device & host
    assert pc.host_cached_pages == len(host) <= pc.host_pages
    live = {}
    for batch, _ in pc._host_index.values():
        live[batch] = live.get(batch, 0) + 1
    assert live == {b: e[1] for b, e in pc._host_batches.items()}
    if pc.lent_to is None:
        counts = np.asarray(pc._pools.refcounts)
        assert all(counts[p] >= 1 for p in pc._index.values())


def test_a_prefix_evicted_to_the_host_comes_back_instead_of_being_recomputed():
    model = model_for("gqa")
    # 8 pages: room for one call (a prompt of up to 6 pages with its new tokens), so each call evicts the last
    pc = jaxkv.PrefixCache(model, num_pages=8, page_size=8, host_pages=64)
    for p in PROMPTS[:3]:
        assert call(model, p, pc).tokens[0] == alone(model, p)
    assert pc.host_stats["spilled_pages"] > 0 and pc.host_cached_pages > 0
    check_tiers(pc)
    on_host = [k for k in _block_keys(PROMPTS[0][:-1], 8)]
    assert on_host[0] in pc._host_index  # the first prompt's blocks were spilled
    again = call(model, PROMPTS[0], pc)
    assert again.tokens[0] == alone(model, PROMPTS[0])
    assert again.stats["prefix_hit_tokens"] == 32 and pc.host_stats["restored_pages"] == 4  # 4 whole pages of 39
    assert on_host[0] in pc._index and on_host[0] not in pc._host_index
    check_tiers(pc)


def test_without_a_host_tier_the_same_calls_recompute():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=8, page_size=8)
    for p in PROMPTS[:3]:
        call(model, p, pc)
    again = call(model, PROMPTS[0], pc)
    assert again.stats["prefix_hit_tokens"] == 0 and again.tokens[0] == alone(model, PROMPTS[0])
    assert pc.host_cached_pages == 0 and not pc.host_stats


def test_the_host_tier_drops_its_oldest_blocks_beyond_its_size():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=8, page_size=8, host_pages=5)
    for p in PROMPTS:
        call(model, p, pc)
        check_tiers(pc)
    assert pc.host_cached_pages == 5 and pc.host_stats["host_dropped_pages"] > 0
    assert pc.host_nbytes() >= 5 * pc.page_bytes  # (batches stay whole until their last block goes)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), min_size=1, max_size=8),
       st.integers(1, 12))
def test_random_request_sequences_keep_both_tiers_consistent(requests, host_pages):
    """Prompts share random prefixes (prompt i cut at a random length); every call's tokens equal a run without
    the cache; tiers stay consistent; pages are never leaked (free + cached == all when idle)."""
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=9, page_size=8, host_pages=host_pages)
    for i, cut in requests:
        prompt = PROMPTS[i][:max(2, len(PROMPTS[i]) - cut)]
        assert call(model, prompt, pc).tokens[0] == alone(model, prompt)
        check_tiers(pc)
        assert pc.free_pages() + pc.cached_pages == pc.num_pages


def test_engine_restores_host_blocks_and_frees_everything():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=12, page_size=8, host_pages=32)
    engine = jaxkv.Engine(model, slots=2, max_len=64, prefix_cache=pc, prefill_chunk=16)
    for p in PROMPTS:
        (r,) = engine.generate([p], max_new_tokens=6, stop_tokens=[])
        assert r.tokens == alone(model, p)
    assert pc.host_cached_pages > 0
    results = engine.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=6, stop_tokens=[])
    assert [r.tokens for r in results] == [alone(model, PROMPTS[0]), alone(model, PROMPTS[1])]
    assert engine.stats["host_hit_tokens"] > 0
    assert engine.pending == 0 and engine.held_pages() == 0  # the pool went back to the cache
    assert pc.free_pages() + pc.cached_pages == pc.num_pages
    check_tiers(pc)


def test_a_failed_call_leaves_both_tiers_consistent():
    """A call that fails after host blocks came back (here its stream consumer raises during decode): the host tier
    is as before the call (the blocks it took are back), and the device tier as before or, since the failed
    program held the pool (donated), empty, as `PrefixCache.transaction` documents; never a block in both."""
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=8, page_size=8, host_pages=64)
    for p in PROMPTS[:3]:
        call(model, p, pc)
    device, host = list(pc._index.items()), list(pc._host_index.items())
    assert set(_block_keys(PROMPTS[0][:-1], 8)) <= set(pc._host_index)

    def fail(*_):
        raise RuntimeError("stream consumer failed")

    with pytest.raises(RuntimeError, match="stream consumer failed"):
        jaxkv.generate(model, [PROMPTS[0]], max_new_tokens=6, stop_tokens=[], prefix_cache=pc, stream=fail)
    assert list(pc._host_index.items()) == host
    assert list(pc._index.items()) in (device, [])
    check_tiers(pc)
    assert pc.free_pages() + pc.cached_pages == pc.num_pages
    again = call(model, PROMPTS[0], pc)  # and it still serves, from the host tier
    assert again.tokens[0] == alone(model, PROMPTS[0]) and again.stats["prefix_hit_tokens"] == 32
    check_tiers(pc)


def test_refusals():
    with pytest.raises(ValueError, match="host_pages"):
        jaxkv.PrefixCache(model_for("gqa"), num_pages=8, host_pages=-1)
    hybrid = jaxkv.Config(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                          max_positions=64, layer_types=("linear_attention", "full_attention"),
                          linear_attention=jaxkv.LinearAttention(key_heads=2, value_heads=4, key_head_dim=8,
                                                                 value_head_dim=12))
    with pytest.raises(ValueError, match="hybrid"):
        jaxkv.PrefixCache(jaxkv.Model.random(hybrid), num_pages=8, host_pages=4)


def test_a_mesh_pool_spills_and_restores_in_its_layout():
    from jax.sharding import Mesh

    model = model_for("gqa")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    pc = jaxkv.PrefixCache(model, num_pages=8, page_size=8, host_pages=64, mesh=mesh)
    engine = jaxkv.Engine(model, slots=1, max_len=64, prefix_cache=pc, prefill_chunk=16, mesh=mesh)
    for p in PROMPTS[:3] + PROMPTS[:1]:
        (r,) = engine.generate([p], max_new_tokens=6, stop_tokens=[])
        assert r.tokens == alone(model, p)
    assert engine.stats["host_hit_tokens"] > 0
    assert engine.pending == 0 and engine.held_pages() == 0  # the pool went back to the cache
    assert pc.free_pages() + pc.cached_pages == pc.num_pages
