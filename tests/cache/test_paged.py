"""The paged cache: paged == contiguous, forks share pages without ever writing into another row's, refcounts never
leak, running out of pages never corrupts another sequence (issue 13)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from helpers.models import CONFIGS, MLA_DENSE, model_for, recompute
from helpers.tolerances import atol
from jaxkv.attention import paged_reference
from jaxkv.cache.paged import PagedKVCache

PROMPTS = [[5, 17, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7, 1, 8, 2, 8, 1, 8]]
ATOL = atol("paged vs contiguous")  # why: helpers.tolerances


def right_pad(prompts):
    """(tokens int32[B, T], positions int32[B, T]): prompts from slot 0, padding after them at position -1."""
    T = max(map(len, prompts))
    tokens, positions = np.zeros((len(prompts), T), np.int32), np.full((len(prompts), T), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)], positions[b, :len(p)] = p, np.arange(len(p))
    return jnp.asarray(tokens), jnp.asarray(positions)


@functools.partial(jax.jit, static_argnames=("config", "prefill"))
def _apply(params, tokens, positions, cache, *, config, prefill=False):
    logits, cache = jaxkv.Decoder(config).apply({"params": params}, tokens, positions, cache, prefill=prefill,
                                                last_only=prefill, attention="xla")
    return logits[:, -1], cache


def paged_prefill(model, prompts, *, page_size, num_pages=None, max_len=64, cache_dtype=None):
    cache = PagedKVCache.allocate(model.config, len(prompts), num_pages=num_pages or 4 * max_len, page_size=page_size,
                                  max_len=max_len, dtype=cache_dtype)
    return _apply(model.params, *right_pad(prompts), cache, config=model.config, prefill=True)


def paged_step(model, tokens, cache):
    return _apply(model.params, tokens[:, None], cache.positions(1), cache, config=model.config)


def greedy_run(step, logits, cache, steps):
    """(tokens [B, steps], logits [B, steps, V]) of a greedy loop."""
    tokens, seen = [], []
    for _ in range(steps):
        seen.append(np.asarray(logits))
        t = jnp.argmax(logits, -1).astype(jnp.int32)
        tokens.append(np.asarray(t))
        logits, cache = step(t, cache)
    return np.stack(tokens, 1), np.stack(seen, 1), cache


def contiguous_run(model, prompts, steps, cache_dtype=None):
    tokens, start = jaxkv.left_pad(prompts)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=model.config, capacity=64,
                                  cache_dtype=cache_dtype, attention="xla")
    step = lambda t, c: jaxkv.decode_step(model.params, t, c, config=model.config, attention="xla")  # noqa: E731
    return greedy_run(step, logits, cache, steps)


# --- paged == contiguous -----------------------------------------------------------------------------------------


# Every config with pages of 5 (dividing none of the prompt lengths); pages of one slot and of 16 (longer than the
# shortest prompt) on the windowed config: the page-table arithmetic at both extremes is the same for every config,
# and the windowed one also masks within and across those pages (the default config's pages of 1 and 16 repeated
# these; pages of 4 on the default config: the fork, starvation and pool tests below).
@pytest.mark.parametrize("name, page_size", [*[(name, 5) for name in sorted(CONFIGS)], ("sliding", 1),
                                             ("sliding", 16)])
def test_paged_equals_contiguous(name, page_size):
    model = model_for(name)
    want_tokens, want_logits, _ = contiguous_run(model, PROMPTS, 12)
    logits, cache = paged_prefill(model, PROMPTS, page_size=page_size)
    got_tokens, got_logits, cache = greedy_run(functools.partial(paged_step, model), logits, cache, 12)
    np.testing.assert_allclose(got_logits, want_logits, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    # Only the slots written are stored: no padding, each row from position 0.
    lengths = [len(p) + 12 for p in PROMPTS]
    assert np.asarray(cache.lengths).tolist() == lengths
    assert int(cache.pages_in_use()) == sum(-(-n // page_size) for n in lengths)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_paged_equals_quantized_contiguous(cache_dtype):
    model = model_for("gqa")
    want_tokens, want_logits, _ = contiguous_run(model, PROMPTS, 10, cache_dtype)
    logits, cache = paged_prefill(model, PROMPTS, page_size=4, cache_dtype=cache_dtype)
    assert cache.dtype == cache_dtype and cache.quantized
    got_tokens, got_logits, _ = greedy_run(functools.partial(paged_step, model), logits, cache, 10)
    np.testing.assert_allclose(got_logits, want_logits, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got_tokens, want_tokens)


def test_nan_in_free_pages_changes_nothing():
    model = model_for("gqa")
    # pages of 5: test_paged_equals_contiguous[gqa-5]'s compiled prefill and step (the pages' size is not the point)
    logits, cache = paged_prefill(model, PROMPTS, page_size=5)
    clean_tokens, clean_logits, _ = greedy_run(functools.partial(paged_step, model), logits, cache, 8)
    logits, cache = paged_prefill(model, PROMPTS, page_size=5)
    free = np.asarray(cache.refcounts) == 0
    poison = lambda pool: jnp.where(jnp.asarray(free)[:, None, None, None], jnp.nan, pool)  # noqa: E731
    cache = cache.__class__(**{**cache.__dict__, "keys": tuple(map(poison, cache.keys)),
                               "values": tuple(map(poison, cache.values))})
    tokens, got_logits, _ = greedy_run(functools.partial(paged_step, model), logits, cache, 8)
    np.testing.assert_array_equal(got_logits, clean_logits)
    np.testing.assert_array_equal(tokens, clean_tokens)


# --- forks -------------------------------------------------------------------------------------------------------


# Pages of 4: the 18-token prompt ends mid-page (4 full pages shared, the partial one copied). Pages of 7 (2 full, a
# partial one) took the same path through fork at ~5 s of compiles of their own.
@pytest.mark.parametrize("page_size", [4])
def test_greedy_forks_equal_the_prompt_alone_and_share_its_pages(page_size):
    model = model_for("gqa")
    prompt = PROMPTS[1]
    alone, _, _ = contiguous_run(model, [prompt], 9)
    logits, cache = paged_prefill(model, [prompt], page_size=page_size)
    shared_pages = len(prompt) // page_size  # full pages, shared by reference
    forked = cache.fork(jnp.zeros((4,), jnp.int32))
    refs = np.asarray(forked.refcounts)
    table = np.asarray(forked.page_table)
    assert (refs[table[0, :shared_pages]] == 4).all()  # every child holds the full pages
    last = table[:, shared_pages]  # the partly filled page: one child keeps it, three got copies
    assert len(set(last.tolist())) == 4 and (refs[last] == 1).all()
    tokens, _, forked = greedy_run(functools.partial(paged_step, model), jnp.repeat(logits, 4, 0), forked, 9)
    assert (tokens == alone).all()
    assert int(forked.pages_in_use()) == shared_pages + 4 * (-(-(len(prompt) + 9) // page_size) - shared_pages)


def test_a_childs_writes_never_change_what_others_read():
    """Fork mid-page into a child sampled differently (forced tokens) and a greedy child: the greedy child and the
    parent's continuation equal un-forked runs, whatever the other child wrote."""
    model = model_for("mha")
    prompt = PROMPTS[2]  # 8 tokens: with page size 5 the fork happens mid-page
    alone, alone_logits, _ = contiguous_run(model, [prompt], 6)
    # pages of 5 and 3 rows: test_paged_equals_contiguous[mha-5]'s compiled step
    logits, cache = paged_prefill(model, [prompt], page_size=5)
    cache = cache.fork(jnp.asarray([0, 0, 0], jnp.int32))
    logits = jnp.repeat(logits, 3, 0)
    seen = []
    for step in range(6):
        seen.append(np.asarray(logits))
        greedy = jnp.argmax(logits, -1).astype(jnp.int32)
        tokens = greedy.at[2].set((7 * step + 11) % model.config.vocab_size)  # row 2 writes other tokens
        logits, cache = paged_step(model, tokens, cache)
    seen = np.stack(seen, 1)
    np.testing.assert_allclose(seen[0], alone_logits[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(seen[1], alone_logits[0], atol=ATOL, rtol=0)
    assert np.abs(seen[2, 2:] - alone_logits[0, 2:]).max() > 1e-3  # the forced child really diverged


def test_sampled_forks_differ():
    model = model_for("gqa")
    # the greedy fork test's prompt, pages and 4 children: its compiled prefill and step
    logits, cache = paged_prefill(model, [PROMPTS[1]], page_size=4)
    cache = cache.fork(jnp.zeros((4,), jnp.int32))
    logits = jnp.repeat(logits, 4, 0)
    key = jax.random.PRNGKey(0)
    rows = []
    for _ in range(8):
        key, sub = jax.random.split(key)
        t = jax.random.categorical(sub, logits * 0.3).astype(jnp.int32)  # hot: rows draw differently
        rows.append(np.asarray(t))
        logits, cache = paged_step(model, t, cache)
    rows = np.stack(rows, 1)
    assert len({tuple(r) for r in rows.tolist()}) == 4


# --- prompt chunks (issue 27, item 16) -----------------------------------------------------------------------


def _chunk(model, tokens, cache, **kwargs):
    return _apply_chunk(model.params, *right_pad(tokens), cache, config=model.config, **kwargs)


@functools.partial(jax.jit, static_argnames=("config", "chunk"))
def _apply_chunk(params, tokens, positions, cache, *, config, chunk=True):
    positions = jnp.where(positions >= 0, positions + cache.lengths[:, None], -1)
    logits, cache = jaxkv.Decoder(config).apply({"params": params}, tokens, positions, cache, chunk=chunk,
                                                last_only=True, attention="xla")
    return logits[:, -1], cache


def _dequantized(cache):
    """The same cache with float32 pools holding what the quantized pools store."""
    import dataclasses
    keys, values = ([a.astype(jnp.float32) * s[..., None] for a, s in zip(pools, scales)]
                    for pools, scales in ((cache.keys, cache.key_scales), (cache.values, cache.value_scales)))
    return dataclasses.replace(cache, keys=tuple(keys), values=tuple(values), key_scales=(), value_scales=())


@pytest.mark.parametrize("name, num_pages", [("gqa", 64), ("sliding", 10)])  # per-sequence gather; whole pool
def test_a_prompt_chunk_attends_its_own_fresh_kv_and_earlier_slots_as_stored(name, num_pages):
    """A prompt in one chunk from empty rows gives prefill's logits whatever the cache dtype (float8 here); a
    second chunk reads the first as stored: it equals the same chunk over a float32 pool holding the dequantized
    first chunk. Before, a chunk read its own K/V as stored (quantized), unlike prefill."""
    model = model_for(name)
    prompts = [PROMPTS[1], PROMPTS[2]]  # 18 and 8 tokens (windowed config: past its window of 8)
    allocate = functools.partial(PagedKVCache.allocate, model.config, 2, num_pages=num_pages, page_size=4, max_len=64)
    assert paged_reference.prefers_pool(num_pages, 2, 16) == (num_pages == 10)
    want, _ = _apply(model.params, *right_pad(prompts), allocate(dtype="float8_e4m3fn"), config=model.config,
                     prefill=True)
    got, _ = _chunk(model, prompts, allocate(dtype="float8_e4m3fn"))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # Two chunks: the first 9 and 5 tokens, then the rest (9 and 3): both chunks 9 wide, one compiled program.
    _, cache = _chunk(model, [PROMPTS[1][:9], PROMPTS[2][:5]], allocate(dtype="float8_e4m3fn"))
    rest = [PROMPTS[1][9:], PROMPTS[2][5:]]
    got, _ = _chunk(model, rest, cache)
    spec, _ = _chunk(model, rest, _dequantized(cache))
    np.testing.assert_allclose(got, spec, atol=ATOL, rtol=0)
    assert np.abs(got - want).max() > 1e-4  # the first chunk really is read quantized


# --- running out of pages ----------------------------------------------------------------------------------------


def test_a_row_without_pages_is_poisoned_and_others_are_untouched():
    model = model_for("gqa")
    want, want_logits, _ = contiguous_run(model, PROMPTS[:2], 4)
    # Exactly the pages the prompts need, plus one: row 0 (3 tokens, page 4) has room for one more token in its
    # page; the 18-token row needs a new page at once (its 5th), gets the spare one, then none.
    logits, cache = paged_prefill(model, PROMPTS[:2], page_size=4, num_pages=1 + 5 + 1)
    tokens, seen, cache = greedy_run(functools.partial(paged_step, model), logits, cache, 4)
    overflowed = np.asarray(cache.overflowed)
    assert overflowed.tolist() == [True, False] or overflowed.tolist() == [False, True]
    ok = int(np.flatnonzero(~overflowed)[0])
    np.testing.assert_allclose(seen[ok], want_logits[ok], atol=ATOL, rtol=0)
    bad = 1 - ok
    assert np.isnan(seen[bad, -1]).all()  # the starved row's logits are NaN, never plausible
    refs, table = np.asarray(cache.refcounts), np.asarray(cache.page_table)
    assert refs.sum() == (table >= 0).sum() and refs.max() == 1


def _starved_fork(config, dtype=None, filled=6):
    """A 6-token row (page 4: one full page, a partial one) forked 3 ways with one page free: child 1 gets the
    copy of the partial page, child 2 is starved (overflowed, left on the page child 0 keeps and writes)."""
    cache = PagedKVCache.allocate(config, 1, num_pages=3, page_size=4, max_len=16, dtype=dtype).reserve(filled)
    cache = cache.advance(filled).fork(jnp.array([0, 0, 0], jnp.int32))
    assert np.asarray(cache.overflowed).tolist() == [False, False, True]
    return cache


def test_a_starved_fork_writes_nowhere_and_its_sibling_stays_exact():
    """Issue 27 (1): the starved child's K/V used to land in the shared page its sibling reads (logits off by 1.2)."""
    model = model_for("gqa")
    prompt = PROMPTS[2][:6]
    logits, cache = paged_prefill(model, [prompt], page_size=4, num_pages=3, max_len=16)
    cache = cache.fork(jnp.array([0, 0, 0], jnp.int32))
    assert np.asarray(cache.overflowed).tolist() == [False, False, True]
    forked = cache
    want = recompute(model, [prompt + [10, 11], prompt + [20, 21]])
    pools = []
    for starved_tokens in ((30, 31), (40, 41)):  # what the starved row feeds must change nothing stored
        cache, seen = forked, []
        for t in range(2):
            logits, cache = paged_step(model, jnp.array([10 + t, 20 + t, starved_tokens[t]], jnp.int32), cache)
            seen.append(np.asarray(logits))
        for r in range(2):  # the healthy rows equal the no-cache reference, step by step
            for t in range(2):
                np.testing.assert_allclose(seen[t][r], want[r][6 + t], atol=ATOL, rtol=0)
        assert np.isnan(seen[0][2]).all() and np.isnan(seen[1][2]).all()
        pools.append([np.asarray(a) for a in (*cache.keys, *cache.values)])
    for a, b in zip(*pools):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["float32", "int8", "keys-only"])
def test_a_starved_row_writes_nowhere_in_any_pool(kind):
    """Every write path goes through `PagedKVCache.write`: plain, quantized (scales too) and MLA latent pools."""
    DENSE = MLA_DENSE
    RANK, ROPE = DENSE.mla.kv_lora_rank, DENSE.mla.qk_rope_head_dim
    config = DENSE if kind == "keys-only" else TINY
    cache = _starved_fork(config, None if kind == "keys-only" else kind)
    K, H = (1, RANK + ROPE) if kind == "keys-only" else (1, TINY.head_dim)
    k = jnp.ones((3, K, 1, H)) * jnp.array([1.0, 2.0, 3.0])[:, None, None, None]  # row r writes r + 1
    after = cache.reserve(1)
    after = after.write(0, k, None if kind == "keys-only" else -k)
    table, starved_page = np.asarray(after.page_table), np.asarray(after.page_table)[2, 1]
    for pool in (*after.keys[:1], *after.values[:1]):
        stored = np.abs(np.asarray(pool, np.float32))
        if kind == "int8":  # dequantized
            stored = stored * np.asarray(after.key_scales[0])[..., None]
        assert not np.isclose(stored, 3.0, atol=0.05).any()  # the starved row's value is nowhere
        np.testing.assert_allclose(stored[table[0, 1], :, 2], 1.0, atol=0.05)  # the page's keeper wrote its own
        assert starved_page == table[0, 1]
    untouched = [np.asarray(a) for a in (*after.keys, *after.values, *after.key_scales, *after.value_scales)]
    again = cache.reserve(1).write(0, k.at[2].set(7.0), None if kind == "keys-only" else -k.at[2].set(7.0))
    for a, b in zip(untouched, (*again.keys, *again.values, *again.key_scales, *again.value_scales)):
        np.testing.assert_array_equal(a, np.asarray(b))
    # Forked again with the starved row first and no page free: the healthy child keeps the shared page (a
    # starved row neither keeps nor copies one), so it is not starved in turn.
    refork = cache.fork(jnp.array([2, 0, 1], jnp.int32))
    assert np.asarray(refork.overflowed).tolist() == [True, False, False]
    assert np.asarray(refork.page_table)[1, 1] == np.asarray(cache.page_table)[0, 1]


# --- refcounts ---------------------------------------------------------------------------------------------------

TINY = jaxkv.Config(vocab_size=11, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8, max_positions=64)
B, PAGES, PAGE, MAX_LEN = 4, 24, 3, 18


@functools.partial(jax.jit, static_argnames="n")
def _write(cache, n):
    cache = cache.reserve(n)
    k = jnp.ones((B, 1, n, TINY.head_dim))
    return cache.write(0, k, k).advance(n)


@jax.jit
def _verify(cache, kept):
    """A speculative verify: 3 slots written per row, then the row rewound to keep `kept[b]` of them."""
    start = cache.lengths
    return _write(cache, 3).rewind(start + kept)


_fork = jax.jit(PagedKVCache.fork)
_release = jax.jit(PagedKVCache.release)


def _check_counts(cache):
    table, refs = np.asarray(cache.page_table), np.asarray(cache.refcounts)
    held = np.bincount(table[table >= 0], minlength=PAGES)
    np.testing.assert_array_equal(refs, held)  # count of a page = table entries naming it
    lengths = np.asarray(cache.lengths)
    healthy = ~np.asarray(cache.overflowed)
    for b in range(B):  # a row's partly filled last page is its own: no other row that writes reads it
        if lengths[b] % PAGE and healthy[b]:  # (a starved row may stay on it: it writes nowhere)
            assert (table[healthy] == table[b, lengths[b] // PAGE]).sum() == 1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "fork", "release", "verify"]), st.integers(0, 2**16)),
                max_size=24))
def test_refcounts_stay_exact_and_nothing_leaks(ops):
    cache = PagedKVCache.allocate(TINY, B, num_pages=PAGES, page_size=PAGE, max_len=MAX_LEN)
    for op, seed in ops:
        rng = np.random.default_rng(seed)
        if op == "write":
            cache = _write(cache, int(rng.integers(1, 3)))
        elif op == "verify":
            before = np.asarray(cache.lengths)
            kept = rng.integers(0, 4, B)
            cache = _verify(cache, jnp.asarray(kept, jnp.int32))
            # a row that found its pages keeps exactly what it kept, and holds pages for those slots only
            ok = ~np.asarray(cache.overflowed)
            np.testing.assert_array_equal(np.asarray(cache.lengths)[ok], (before + kept)[ok])
            held = np.sum(np.asarray(cache.page_table) >= 0, axis=1)
            assert (held[ok] == -(-(before + kept)[ok] // PAGE)).all()
        elif op == "fork":
            cache = _fork(cache, jnp.asarray(rng.integers(0, B, B), jnp.int32))
        else:
            cache = _release(cache, jnp.asarray(rng.random(B) < 0.5))
        _check_counts(cache)
    cache = _release(cache, jnp.ones((B,), bool))
    assert int(cache.pages_in_use()) == 0 and not np.asarray(cache.refcounts).any()


def test_release_takes_row_indices_or_a_bool_mask():
    """Issue 27 (6): `release(cache, [0, 1])` released row 1 only and `[1]` every row (indices read as a mask)."""
    cache = PagedKVCache.allocate(TINY, 3, num_pages=8, page_size=PAGE, max_len=9).reserve(4).advance(4)  # 2 pages each
    T, F = True, False
    for rows, want in [([0, 1], [T, T, F]), ([1], [F, T, F]), ((2,), [F, F, T]), (np.array([2, 0]), [T, F, T]),
                       (jnp.array([1], jnp.int32), [F, T, F]), (1, [F, T, F]), ([], [F, F, F]),
                       ([T, F, T], [T, F, T]), (np.array([F, T, F]), [F, T, F]), (jnp.array([T, T, T]), [T, T, T])]:
        for release in (jaxkv.release, _release):  # eager and traced
            if release is _release and isinstance(rows, (list, tuple, int)) and not np.asarray(rows).size:
                continue
            got = release(cache, jnp.asarray(rows) if release is _release else rows)
            assert np.asarray(got.lengths).tolist() == [0 if w else 4 for w in want], (rows, release)
            assert int(got.pages_in_use()) == 2 * want.count(F)
    for rows, match in [([3], "out of range"), ([-1], "out of range"), ([0, 0], "more than once"),
                        ([[0, 1]], "1-D"), ([T, F], "bool mask of 3"), (np.array([0.5]), "indices or a bool mask"),
                        (jnp.zeros((2,), bool), "bool mask of 3")]:
        with pytest.raises(ValueError, match=match):
            jaxkv.release(cache, rows)
    with pytest.raises(ValueError, match="bool mask of 3"):
        _release(cache, jnp.zeros((4,), bool))


# --- generate(n=N) -----------------------------------------------------------------------------------------------


def test_generate_n_greedy_samples_equal_each_prompt_alone():
    model = model_for("gqa")
    prompts = PROMPTS[:2]
    alone = jaxkv.generate(model, prompts, max_new_tokens=10, stop_tokens=[]).tokens
    out = jaxkv.generate(model, prompts, max_new_tokens=10, stop_tokens=[], n=3)
    assert out.tokens == [alone[0]] * 3 + [alone[1]] * 3  # prompt-major: tokens[i * n + j]
    plan = jaxkv.memory.plan_pages(model.config, [len(p) for p in prompts], 10, n=3)
    s = out.stats
    # The pool generate allocates is the planner's, and what is in use at the peak is what the plan needs.
    assert s["kv_cache_bytes"] == plan.allocated_bytes == jaxkv.memory.pool_bytes(
        model.config, num_pages=plan.num_pages, page_size=16)
    assert s["pages_in_use_peak"] == plan.pages_needed and s["kv_bytes_in_use_peak"] == plan.requested_bytes
    assert s["kv_cache_bytes_unshared"] == sum(jaxkv.kv_cache_bytes(model.config, tokens=len(p) + 10, batch=3)
                                               for p in prompts)
    assert s["prefilled_tokens"] == sum(map(len, prompts))  # once per prompt, not per sample


def test_generate_n_sampled_rows_differ_and_settings_are_per_prompt():
    model = model_for("gqa")
    out = jaxkv.generate(model, PROMPTS[:2], max_new_tokens=8, stop_tokens=[], n=3, temperature=[0.0, 2.0], seed=4)
    # prompt 0 alone greedy, in the batch of test_generate_n_greedy_samples_equal_each_prompt_alone (its programs)
    greedy = jaxkv.generate(model, PROMPTS[:2], max_new_tokens=8, stop_tokens=[]).tokens[0]
    assert out.tokens[:3] == [greedy] * 3  # prompt 0 is greedy in all its samples
    assert len({tuple(t) for t in out.tokens[3:]}) == 3  # prompt 1's samples each draw their own tokens


def test_generate_n_stops_rows_independently_and_finished_rows_take_no_pages():
    model = model_for("gqa")
    # prompt 1 greedy, in the batch of test_generate_n_greedy_samples_equal_each_prompt_alone (its programs)
    free = jaxkv.generate(model, PROMPTS[:2], max_new_tokens=12, stop_tokens=[]).tokens[1]
    stop = free[2]
    out = jaxkv.generate(model, [PROMPTS[1]], max_new_tokens=12, stop_tokens=[stop], n=2, page_size=4)
    assert out.tokens == [free[:free.index(stop) + 1]] * 2 and out.finish_reasons == ["stop", "stop"]
    full = len(PROMPTS[1]) // 4
    assert out.stats["pages_in_use_peak"] == full + 2 * (-(-(len(PROMPTS[1]) + len(out.tokens[0]) - 1) // 4) - full)


def test_paged_generate_with_page_size_and_n_1_equals_contiguous():
    model = model_for("learned")
    want = contiguous_run(model, PROMPTS, 9)[0].tolist()  # greedy on the contiguous cache, as compiled above
    # max_len bounds each sequence's page table: 27 slots -> 6 entries of 5. (The default max_len's page tables:
    # every other paged generate here, e.g. test_generate_n_stops_rows_independently_and_finished_rows_take_no_pages;
    # a second call at the default compiled its own prefill and decode loop, ~7 s.)
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=9, stop_tokens=[], page_size=5, max_len=27)
    assert out.tokens == want and out.stats["cache_capacity"] == 30


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n must be >= 1"),
    (dict(n=2, max_len=3), r"prompt_len \+ max_new_tokens = 4 exceeds max_len=3"),
    (dict(n=2, max_len=10**6), "exceeds the model's max positions"),
    (dict(page_size=0), "page_size must be >= 1"),
])
def test_generate_n_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(model_for("gqa"), [[1, 2]], max_new_tokens=2, **kwargs)


def test_decode_runs_on_a_paged_cache_and_refuses_what_the_pool_cannot_hold():
    model = model_for("gqa")
    want, _, _ = contiguous_run(model, PROMPTS, 6)  # greedy on the contiguous cache, as the tests above compile it
    logits, cache = paged_prefill(model, PROMPTS, page_size=4, num_pages=16)  # prompts hold 1 + 5 + 2 pages; 13 more slots each need 3 + 3 + 4
    with pytest.raises(ValueError, match="needs 10 more pages; the pool has 8 free"):
        jaxkv.decode(model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.sampling.greedy, [],
                     config=model.config, steps=14)
    out = jaxkv.decode(model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.sampling.greedy, [],
                       config=model.config, steps=6)
    assert np.asarray(out.tokens).tolist() == want.tolist()


def test_paged_generate_through_the_pallas_kernel_equals_xla():
    """The decoder's paged decode path with attention="pallas" (the paged kernel, interpreted on CPU)."""
    model = model_for("gqa")
    kwargs = dict(max_new_tokens=6, stop_tokens=[], n=2, page_size=4)
    xla = jaxkv.generate(model, PROMPTS[:2], attention="xla", **kwargs)
    assert jaxkv.generate(model, PROMPTS[:2], attention="pallas", **kwargs).tokens == xla.tokens


# --- the two XLA formulations ------------------------------------------------------------------------------------


@pytest.mark.parametrize("T, window", [(1, None), (1, 6), (3, None)])
def test_pool_attention_equals_per_sequence_gather(T, window):
    """The whole-pool formulation (shared pages read once) equals the gather spec, NaN in unread slots included."""
    from jaxkv.attention import paged_reference as pr

    rng = np.random.default_rng(0)
    P, K, ps, H, B, N, M = 20, 2, 4, 8, 3, 4, 5
    k, v = (jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32) for _ in range(2))
    table = np.full((B, M), -1, np.int32)
    perm = rng.permutation(P)
    table[0, :1], table[1, :3], table[2, :5] = perm[:1], perm[1:4], perm[4:9]
    table[2, 0] = table[1, 0]  # rows 1 and 2 share their first page
    lengths = jnp.asarray([1, 9, 20], jnp.int32)
    held = np.isin(np.arange(P), table)[:, None, None, None]
    nan_k, nan_v = (jnp.where(held, x, jnp.nan) for x in (k, v))  # free pages hold NaN
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    q_slots = jnp.maximum(lengths[:, None] - T + jnp.arange(T)[None], 0)
    args = (jnp.asarray(table), lengths, q_slots)
    # jitted: one compile each instead of dozens of op-by-op ones
    want = jax.jit(functools.partial(pr.paged_attention, scale=0.3, sliding_window=window))(q, k, v, *args)
    got = jax.jit(functools.partial(pr.pool_attention, scale=0.3, sliding_window=window))(q, nan_k, nan_v, *args)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gqa", "sliding", "learned"])
def test_paged_through_the_pool_formulation_equals_contiguous(name):
    """A pool no bigger than the batch's page tables takes the whole-pool path in the decoder."""
    from jaxkv.attention import paged_reference as pr

    model = model_for(name)
    want_tokens, want_logits, _ = contiguous_run(model, PROMPTS, 8)
    # Table rows of 16 entries: 3 rows x 16 >= POOL_COST x 16 pages.
    logits, cache = paged_prefill(model, PROMPTS, page_size=4, num_pages=16, max_len=64)
    assert pr.prefers_pool(cache.num_pages, *cache.page_table.shape)
    got_tokens, got_logits, _ = greedy_run(functools.partial(paged_step, model), logits, cache, 8)
    np.testing.assert_allclose(got_logits, want_logits, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got_tokens, want_tokens)


@pytest.mark.parametrize("longest", [1, 16, 17, 40, 64])
def test_live_paged_attention_equals_the_full_table_gather(longest):
    """Reading only the first entries of every table (a branch per length) gives what reading all of them gives:
    entries past the longest sequence hold nothing live (here their pages hold NaN)."""
    from jaxkv.attention import paged_reference as pr

    rng = np.random.default_rng(longest)
    B, N, K, H, ps, M, P = 3, 4, 2, 8, 4, 16, 64
    k, v = (jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32) for _ in range(2))
    lengths = np.array([longest, max(longest // 2, 1), 1], np.int32)
    table = np.full((B, M), -1, np.int32)
    perm = rng.permutation(P)
    for b, n in enumerate(lengths):
        table[b, :-(-n // ps)] = perm[b * M:b * M + -(-n // ps)]
    held = np.isin(np.arange(P), table)[:, None, None, None]
    nan_k, nan_v = (jnp.where(held, x, jnp.nan) for x in (k, v))
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    args = (jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(lengths - 1)[:, None])
    want = jax.jit(functools.partial(pr.paged_attention, scale=0.3))(q, k, v, *args)  # one compile, not dozens
    got = jax.jit(functools.partial(pr.live_paged_attention, scale=0.3, min_prefix=16))(q, nan_k, nan_v, *args)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window, quantized", [(None, False), (5, False), (None, True)])
def test_ragged_paged_attention_equals_the_per_sequence_gather(window, quantized):
    """One list of every sequence's used pages, segment softmax per sequence == each sequence's own gather: ragged
    lengths (one sequence empty, one a single slot, one across a page boundary), pages out of order, shared pages,
    free pages holding NaN, branch sizes below and at the whole table."""
    from jaxkv.attention import paged_reference as pr

    rng = np.random.default_rng(7)
    N, K, H, ps, M, P = 4, 2, 8, 4, 8, 48
    lengths = np.array([0, 1, 5, 32, 13, 4], np.int32)
    B = len(lengths)
    table = np.full((B, M), -1, np.int32)
    perm = rng.permutation(P)
    for b, n in enumerate(lengths):
        table[b, :-(-n // ps)] = perm[b * M:b * M + -(-n // ps)]
    table[4, 0] = table[3, 0]  # a shared first page
    held = np.isin(np.arange(P), table)[:, None, None, None]
    k, v = (jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32) for _ in range(2))
    scales = {}
    if quantized:
        k, v = (jnp.round(x * 20).astype(jnp.int8) for x in (k, v))
        scales = dict(k_scale=jnp.asarray(rng.uniform(0.01, 0.1, (P, K, ps)), jnp.float32),
                      v_scale=jnp.asarray(rng.uniform(0.01, 0.1, (P, K, ps)), jnp.float32))
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    args = (jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(np.maximum(lengths - 1, 0))[:, None])
    want = jax.jit(functools.partial(pr.paged_attention, scale=0.3, sliding_window=window))(  # one compile
        q, k, v, *args, **scales)
    nan_k, nan_v = ((jnp.where(held, x, jnp.nan) if not quantized else x) for x in (k, v))
    for min_prefix in (4, None):  # several branch sizes; one branch (the whole table)
        ragged = functools.partial(pr.ragged_paged_attention, scale=0.3, sliding_window=window,
                                   min_prefix=min_prefix, **scales)
        got = jax.jit(ragged)(q, nan_k, nan_v, *args)
        np.testing.assert_allclose(got[1:], want[1:], atol=2e-6, rtol=0)
        np.testing.assert_array_equal(got[0], 0.0)  # no live slot: zeros
