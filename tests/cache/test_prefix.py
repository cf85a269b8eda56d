"""Prompt caching (issue 13, item 5): a later call reuses the pages of a prefix computed before, prefills only the
rest, and returns exactly what a call without the cache returns; eviction keeps it correct under a small pool."""

import numpy as np
import pytest

import jaxkv
from helpers.models import model_for

RNG = np.random.default_rng(0)
HEADER = RNG.integers(1, 97, 40).tolist()  # a shared 40-token prefix: 5 pages of 8
SUFFIXES = [RNG.integers(1, 97, n).tolist() for n in (5, 9, 3, 12)]


def alone(model, prompt, **kwargs):
    return jaxkv.generate(model, [prompt], max_new_tokens=8, stop_tokens=[], **kwargs).tokens[0]


def test_second_call_reuses_the_prefix_and_prefills_only_the_suffix():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=64, page_size=8)
    first = jaxkv.generate(model, [HEADER + SUFFIXES[0]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    assert first.stats["prefix_hit_tokens"] == 0 and first.stats["prefilled_tokens"] == 45
    assert first.tokens[0] == alone(model, HEADER + SUFFIXES[0])
    assert pc.cached_pages == 5  # the prompt's whole pages
    second = jaxkv.generate(model, [HEADER + SUFFIXES[1]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    assert second.stats["prefix_hit_tokens"] == 40 and second.stats["prefilled_tokens"] == 9
    assert second.tokens[0] == alone(model, HEADER + SUFFIXES[1])
    # A batch, samples and a prompt that is entirely cached but its last token (33 tokens: the uncached call pads
    # it to 64 as the others, so no prefill is compiled for it alone).
    prompts = [HEADER + SUFFIXES[2], HEADER[:33]]
    third = jaxkv.generate(model, prompts, max_new_tokens=8, stop_tokens=[], prefix_cache=pc, n=2)
    assert third.tokens == [alone(model, prompts[0])] * 2 + [alone(model, prompts[1])] * 2
    assert third.stats["prefix_hit_tokens"] == 40 + 32 and third.stats["prefilled_tokens"] == 3 + 1


def test_sampled_calls_match_uncached_calls():
    """float32: the suffix attends over the cached prefix's pages, which hold exactly the K/V a fresh prefill
    computes, so sampled tokens match too. (An int8/fp8 pool stores the prefix quantized: a suffix prefilled after a
    hit reads it dequantized, where an uncached prefill attends over the fresh float K/V; docs/design/cache.md.)"""
    model = model_for("mha")
    # 16 pages: the pool the uncached calls allocate (13 and 14 pages needed), so both run one compiled decode loop;
    # the second call still finds the first's 11 prompt pages (and 5 free ones for its own 4).
    pc = jaxkv.PrefixCache(model, num_pages=16, page_size=4)
    for suffix in SUFFIXES[:2]:
        kwargs = dict(max_new_tokens=8, stop_tokens=[], temperature=1.0, seed=3, page_size=4)
        got = jaxkv.generate(model, [HEADER + suffix], prefix_cache=pc, **kwargs)
        assert got.tokens == jaxkv.generate(model, [HEADER + suffix], **kwargs).tokens
    assert got.stats["prefix_hit_tokens"] == 40


def test_eviction_under_a_small_pool_stays_correct():
    model = model_for("gqa")
    # Each call needs 7 pages of 8 (a 45-53-token prompt plus 7 fed-back tokens); 12 pages hold one cached
    # prompt besides a call, so every other call must evict.
    pc = jaxkv.PrefixCache(model, num_pages=12, page_size=8)
    others = [RNG.integers(1, 97, 40).tolist() + s for s in SUFFIXES[:2]]
    for prompt in [HEADER + SUFFIXES[0], others[0], HEADER + SUFFIXES[1], others[1], HEADER + SUFFIXES[3]]:
        out = jaxkv.generate(model, [prompt], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
        assert out.tokens[0] == alone(model, prompt)
        refs = np.asarray(pc._pools.refcounts)
        assert refs.sum() == pc.cached_pages and refs.max() <= 1  # only the index holds pages between calls


def test_a_call_the_pool_cannot_hold_is_refused_before_compute():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=4, page_size=8)
    with pytest.raises(ValueError, match="needs 7 free pages; the PrefixCache pool has 4 free of 4"):
        jaxkv.generate(model, [HEADER + SUFFIXES[0]], max_new_tokens=8, prefix_cache=pc)


def state(pc):
    return list(pc._index.items()), np.asarray(pc._pools.refcounts).tolist()


def test_a_call_that_fails_half_way_leaves_the_prefix_cache_as_it_was():
    """Issue 27, item 2: a sampler that fails after the prefill and a stream callback that raises mid-decode leave
    the index and pool as they were (no entry naming a page whose K/V never reached the pool); the callback's own
    exception surfaces, not XLA's runtime error; later calls hit only what was cached and stay exact."""
    import jax.numpy as jnp

    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=64, page_size=8)
    jaxkv.generate(model, [HEADER + SUFFIXES[0]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    before = state(pc)
    prompt = HEADER + SUFFIXES[1] + SUFFIXES[3]  # 40 tokens hit, 2 more whole pages that the call would cache

    def wrong_shape(logits, key):
        return jnp.argmax(logits, -1)[:, None].astype(jnp.int32)

    with pytest.raises(ValueError, match="the sampler must return integer token ids of shape"):
        jaxkv.generate(model, [prompt], max_new_tokens=8, stop_tokens=[], prefix_cache=pc, sampler=wrong_shape)
    assert state(pc) == before

    def fails(i, token):
        raise KeyError("from the stream")

    with pytest.raises(KeyError, match="from the stream"):
        jaxkv.generate(model, [prompt], max_new_tokens=8, stop_tokens=[], prefix_cache=pc, stream=fails)
    assert state(pc) == before
    out = jaxkv.generate(model, [prompt], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    assert out.stats["prefix_hit_tokens"] == 40 and out.tokens[0] == alone(model, prompt)
    with pytest.raises(KeyError, match="from the stream"):  # the plain cache's loop surfaces it too
        jaxkv.generate(model, [prompt], max_new_tokens=8, stop_tokens=[], stream=fails)


def test_a_refused_call_keeps_the_cached_prefixes_and_their_pages():
    """Issue 27, item 7: make_room that cannot make enough room drops nothing (it dropped every cached block from
    the index, kept their references, and so leaked their pages until every call was refused)."""
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=12, page_size=8)
    jaxkv.generate(model, [HEADER + SUFFIXES[0]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    before = state(pc)
    assert pc.cached_pages == 5 and pc.free_pages() == 7
    with pytest.raises(ValueError, match="needs 13 free pages; the PrefixCache pool has 12 free of 12"):
        jaxkv.generate(model, [HEADER[::-1] * 2], max_new_tokens=24, prefix_cache=pc)
    assert state(pc) == before
    out = jaxkv.generate(model, [HEADER + SUFFIXES[1]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    assert out.stats["prefix_hit_tokens"] == 40


def test_eviction_drops_a_prefixs_last_block_first():
    """Issue 27, item 15: blocks a call adopts enter the LRU order last block first, as a match touches them, so
    eviction takes a prefix's later blocks before the earlier ones they extend (block 0 went first: the rest
    could never match again and held their pages for nothing). The prompts' shapes are the eviction test's."""
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=12, page_size=8)
    jaxkv.generate(model, [HEADER + SUFFIXES[0]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    assert pc.cached_pages == 5 and pc.free_pages() == 7
    other = RNG.integers(1, 97, 52).tolist()  # 52 + 7 slots: 8 pages of the 7 free, so one cached block goes
    jaxkv.generate(model, [other], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    out = jaxkv.generate(model, [HEADER + SUFFIXES[1]], max_new_tokens=8, stop_tokens=[], prefix_cache=pc)
    assert out.stats["prefix_hit_tokens"] == 32  # HEADER's blocks 0-3; its block 4 was evicted
    assert out.tokens[0] == alone(model, HEADER + SUFFIXES[1])


def test_a_prefix_cache_belongs_to_one_model_dtype_and_page_size():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model, num_pages=16, page_size=8)
    with pytest.raises(ValueError, match="another model"):
        jaxkv.generate(model_for("mha"), [[1, 2, 3]], max_new_tokens=2, prefix_cache=pc)
    with pytest.raises(ValueError, match="holds float32 pages, the call asks for a int8 cache"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, prefix_cache=pc, cache_dtype="int8")
    with pytest.raises(ValueError, match="pages of 8 slots, the call asks for 4"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, prefix_cache=pc, page_size=4)
    with pytest.raises(ValueError, match="prefix_cache must be a jaxkv.PrefixCache"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, prefix_cache={})


def test_default_pool_and_public_fork_release():
    model = model_for("gqa")
    pc = jaxkv.PrefixCache(model)  # four sequences of max positions (4096) in pages of 16
    assert pc.num_pages == 4 * 4096 // 16 and pc.nbytes() == jaxkv.kv_cache_bytes(model.config, num_pages=1024,
                                                                                  page_size=16)
    cache = jaxkv.PagedKVCache.allocate(model.config, 1, num_pages=8, page_size=4, max_len=16)
    cache = cache.reserve(6).advance(6)
    two = jaxkv.fork(cache, [0, 0])
    assert np.asarray(two.refcounts).sum() == 4  # 1 shared full page x 2 + 2 partial pages
    assert int(jaxkv.release(two, np.array([True, True])).pages_in_use()) == 0
