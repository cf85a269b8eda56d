"""Multi-head latent attention over the paged cache (issue 17): keys-only latent pages, the paged latent attention
reference, and every loop that runs on pages (parallel samples, beam search, the prefix cache, the engine).

The reference (`jaxkv.attention.paged_mla`) is tested against `jaxkv.attention.mla.attention` over the same rows laid
out contiguously, one sequence at a time (ragged lengths, partly filled and shared pages, NaN in every slot no query
may read, int8/fp8 rows). Tiny random MLA models then decode over pages exactly what they decode over the
contiguous latent cache, and beam search equals transformers' on a tiny DeepSeek-V3.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache import planner as memory
from jaxkv.attention import mla, paged_mla
from jaxkv.cache import quantize
from jaxkv.engine import Engine
from jaxkv.decoding.programs import forward as _forward
from jaxkv.cache.paged import PagedKVCache

from helpers.models import MLA_DENSE
from helpers.tolerances import atol

# Tolerances, keyed by what is compared (their reasons: helpers.tolerances).
ATOL_REFERENCE = atol("paged vs contiguous")
SCORE_ATOL = atol("transformers beam scores")

PROMPTS = [[44, 9, 130, 2, 61], [7, 88, 19, 140, 33, 52, 101, 4, 66, 29, 150, 11, 93], [12, 5, 70]]
NEW = 10
DENSE = MLA_DENSE  # the tiny dense MLA model (helpers.models), shared with the paged cache's write-path test
MLA = DENSE.mla
RANK, ROPE, NOPE, V_DIM = MLA.kv_lora_rank, MLA.qk_rope_head_dim, MLA.qk_nope_head_dim, MLA.v_head_dim
HEADS = DENSE.n_heads
# The greedy n = 2 comparison runs on the dense model only. Its DeepSeek-V3 MoE twin (a dense first layer, then
# routed and shared experts: `model[moe]`, ~25% of this file's compile time) is
# tests/families/test_deepseek_v32.py::test_decoding_paths_equal_transformers[n=2]: MLA with DeepSeek-V3 experts over
# latent pages (n = 2, page size 5), against transformers' tokens; the experts read no cache.
CONFIGS = {"dense": DENSE}


@pytest.fixture(scope="module")
def dense():
    return jaxkv.Model.random(DENSE, seed=5)  # seed: every greedy row has >= 6 distinct tokens


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, dense):
    return dense  # the one model object: every test's programs compiled once


def greedy(model, prompts=PROMPTS, **kwargs):
    return jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[], **kwargs)


# --- the keys-only pool -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "float8_e4m3fn"])
def test_pool_holds_latent_rows_only_and_its_bytes_are_the_planners(cache_dtype):
    P, ps = 12, 5
    cache = PagedKVCache.allocate(DENSE, 2, num_pages=P, page_size=ps, max_len=40, dtype=cache_dtype)
    assert cache.keys_only and cache.values == () and cache.value_scales == ()
    assert [k.shape for k in cache.keys] == [(P, 1, ps, RANK + ROPE)] * DENSE.n_layers
    assert [s.shape for s in cache.key_scales] == ([(P, 1, ps)] * 2 if cache_dtype in ("int8", "float8_e4m3fn")
                                                   else [])
    want = memory.pool_bytes(DENSE, num_pages=P, page_size=ps, cache_dtype=cache_dtype)
    assert cache.nbytes() == want == P * memory.page_bytes(DENSE, ps, cache_dtype)
    assert want == jaxkv.kv_cache_bytes(DENSE, num_pages=P, page_size=ps, cache_dtype=cache_dtype)
    # half of what a cache with values of the same geometry would take
    both = DENSE.replace(mla=None, n_kv_heads=1, head_dim=RANK + ROPE)
    assert 2 * cache.nbytes() == PagedKVCache.allocate(both, 2, num_pages=P, page_size=ps, max_len=40,
                                                       dtype=cache_dtype).nbytes()


def test_write_refuses_values_for_a_keys_only_pool_and_none_for_the_others():
    cache = PagedKVCache.allocate(DENSE, 1, num_pages=4, page_size=4, max_len=8).reserve(2)
    rows = jnp.ones((1, 1, 2, RANK + ROPE))
    with pytest.raises(ValueError, match="keys-only"):
        cache.write(0, rows, rows)
    gqa = PagedKVCache.allocate(DENSE.replace(mla=None), 1, num_pages=4, page_size=4, max_len=8).reserve(2)
    with pytest.raises(ValueError, match="must not be None"):
        gqa.write(0, jnp.ones((1, DENSE.n_heads, 2, 8)), None)


def test_fork_copies_a_shared_partial_latent_page_and_release_frees_every_page():
    cache = PagedKVCache.allocate(DENSE, 1, num_pages=8, page_size=4, max_len=16).reserve(6)
    rows = jnp.arange(6 * (RANK + ROPE), dtype=jnp.float32).reshape(1, 1, 6, RANK + ROPE)
    for layer in range(DENSE.n_layers):
        cache = cache.write(layer, rows, None)
    cache = cache.advance(6).fork(jnp.array([0, 0, 0]))
    table = np.asarray(cache.page_table)
    assert (table[:, 0] == table[0, 0]).all() and len(set(table[:, 1])) == 3  # full page shared, last one copied
    for b in range(3):  # every row reads its 6 rows back through its own table
        got = cache.keys[1][table[b, :2]].reshape(8, RANK + ROPE)[:6]
        np.testing.assert_array_equal(got, rows[0, 0])
    assert int(cache.pages_in_use()) == 4
    assert int(cache.release(jnp.ones((3,), bool)).pages_in_use()) == 0


# --- the reference ------------------------------------------------------------------------------------------------


def _paged_rows(rng, lengths, ps, P, C, shared: int = 0):
    """(pool [P, 1, ps, C] with NaN wherever no sequence wrote, page table [B, M], each sequence's rows [len, C]).
    Pages are taken in a shuffled order; the first `shared` full pages of sequence 0 are also sequence 1's."""
    M = max(-(-n // ps) for n in lengths)
    pool = np.full((P, 1, ps, C), np.nan, np.float32)
    table = np.full((len(lengths), M), -1, np.int32)
    free = list(rng.permutation(P))
    rows = []
    for b, n in enumerate(lengths):
        r = rng.standard_normal((n, C)).astype(np.float32)
        for e in range(-(-n // ps)):
            if b == 1 and e < shared:  # the same page (and so the same rows) as sequence 0's entry e
                table[b, e] = table[0, e]
                r[e * ps:(e + 1) * ps] = rows[0][e * ps:(e + 1) * ps]
                continue
            table[b, e] = free.pop()
            chunk = r[e * ps:(e + 1) * ps]
            pool[table[b, e], 0, :len(chunk)] = chunk
        rows.append(r)
    return pool, table, rows


def test_reference_by_hand():
    """One head, rows [c ; k_rope] of width 2 (R = E = 1) with k_rope = 0, slots 0..2 holding c = 1, 2, 3 on pages
    3 then 1 (page_size 2; slot 3 unwritten, NaN). The query [ln 2 ; 0] scores slot s at c_s ln 2, so its weights
    are proportional to 2, 4, 8: from slot 2, out = (2*1 + 4*2 + 8*3) / 14 = 17/7; from slot 1 (slot 2 in its
    future), (2*1 + 4*2) / 6 = 5/3."""
    pool = np.full((4, 1, 2, 2), np.nan, np.float32)
    pool[3, 0] = [[1, 0], [2, 0]]
    pool[1, 0, 0] = [3, 0]
    q = np.array([[[[math.log(2), 0.0]], [[math.log(2), 0.0]]]], np.float32)  # [B=1, T=2, N=1, 2]
    got = paged_mla.paged_mla_attention(q, pool, np.array([[3, 1]], np.int32), np.array([3], np.int32),
                                        np.array([[2, 1]], np.int32), latent_dim=1, scale=1.0)
    np.testing.assert_allclose(np.asarray(got).reshape(2), [17 / 7, 5 / 3], rtol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("window", [None, 4])
def test_reference_equals_contiguous_latent_attention(T, window):
    rng = np.random.default_rng(T)
    lengths, ps, C = [7, 8, 12, 3], 5, RANK + ROPE  # 0 and 1 share a full page
    pool, table, rows = _paged_rows(rng, lengths, ps, P=16, C=C, shared=1)
    q = rng.standard_normal((len(lengths), T, HEADS, C)).astype(np.float32)
    q_slots = np.array([[n - T + t for t in range(T)] for n in lengths], np.int32)
    kwargs = dict(latent_dim=RANK, scale=0.3, sliding_window=window)
    got = paged_mla.paged_mla_attention(q, pool, table, np.array(lengths, np.int32), q_slots, **kwargs)
    assert got.shape == (len(lengths), T, HEADS, RANK) and got.dtype == jnp.float32
    for b, n in enumerate(lengths):
        want = mla.attention(q[b:b + 1], rows[b][None], jnp.zeros((1,), jnp.int32), jnp.int32(n - T), **kwargs)
        np.testing.assert_allclose(got[b], want[0], atol=ATOL_REFERENCE, rtol=0)
    # the live-prefix switch (a branch per table prefix) reads fewer pages, never other results
    live = paged_mla.live_paged_mla_attention(q, pool, table, np.array(lengths, np.int32), q_slots, min_prefix=5,
                                              **kwargs)
    np.testing.assert_allclose(live, got, atol=ATOL_REFERENCE, rtol=0)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_reference_dequantizes_int8_and_fp8_pages_per_row(cache_dtype):
    rng = np.random.default_rng(0)
    lengths, ps, C = [9, 4], 5, RANK + ROPE
    pool, table, rows = _paged_rows(rng, lengths, ps, P=6, C=C)
    stored, scales = quantize(jnp.nan_to_num(jnp.asarray(pool)).transpose(1, 0, 2, 3), cache_dtype)  # per row
    stored, scales = stored.transpose(1, 0, 2, 3), scales.transpose(1, 0, 2)  # [P, 1, ps, C], [P, 1, ps]
    q = rng.standard_normal((2, 1, HEADS, C)).astype(np.float32)
    q_slots = np.array([[n - 1] for n in lengths], np.int32)
    got = paged_mla.paged_mla_attention(q, stored, table, np.array(lengths, np.int32), q_slots, latent_dim=RANK,
                                        scale=0.3, latent_scale=scales)
    for b, n in enumerate(lengths):
        entries = table[b, :-(-n // ps)]
        latent = np.asarray(stored[entries]).reshape(-1, C)[None, :n]
        scale = np.asarray(scales[entries]).reshape(-1)[None, :n]
        want = mla.attention(q[b:b + 1], latent, jnp.zeros((1,), jnp.int32), jnp.int32(n - 1), latent_dim=RANK,
                             scale=0.3, latent_scale=scale)
        np.testing.assert_allclose(got[b], want[0], atol=ATOL_REFERENCE, rtol=0)
    # and it is not the float32 result: the scales are really applied, the rounding really there
    plain = paged_mla.paged_mla_attention(q, np.nan_to_num(pool), table, np.array(lengths, np.int32), q_slots,
                                          latent_dim=RANK, scale=0.3)
    assert 0 < np.max(np.abs(got - plain)) < 0.2


def test_reference_refuses_pools_that_do_not_fit():
    q = jnp.zeros((1, 1, HEADS, RANK + ROPE))
    table, lengths, slots = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="not \\[P, 1, page_size"):
        paged_mla.paged_mla_attention(q, jnp.zeros((4, 2, 5, RANK + ROPE)), table, lengths, slots, latent_dim=RANK,
                                      scale=1.0)
    with pytest.raises(ValueError, match="latent_dim"):
        paged_mla.paged_mla_attention(q, jnp.zeros((4, 1, 5, RANK + ROPE)), table, lengths, slots,
                                      latent_dim=RANK + ROPE, scale=1.0)


# --- the model over pages -----------------------------------------------------------------------------------------


def test_parallel_samples_greedy_equal_the_contiguous_cache(model):
    want = greedy(model).tokens
    assert all(len(set(row)) >= 4 for row in want)  # not a degenerate model: the comparison can fail
    got = greedy(model, n=2, page_size=5)
    assert got.tokens == [row for row in want for _ in range(2)]


def test_sampled_samples_are_seeded_and_their_pages_come_back(dense):
    # n = 2, the greedy n = 2 test's batch: the sampler is traced, so these run its compiled programs (n = 3
    # compiled a prefill and a decode loop for this test alone)
    kwargs = dict(max_new_tokens=NEW, stop_tokens=[], n=2, page_size=5, temperature=1.0)
    first = jaxkv.generate(dense, PROMPTS, seed=7, **kwargs)
    assert first.tokens == jaxkv.generate(dense, PROMPTS, seed=7, **kwargs).tokens
    assert first.tokens != jaxkv.generate(dense, PROMPTS, seed=8, **kwargs).tokens
    assert len({tuple(row) for row in first.tokens[:2]}) > 1  # a prompt's samples differ
    # the prompt's full pages held once, each sample's own pages after them: what the planner counts
    assert first.stats["pages_in_use_peak"] == sum(memory.pages_for(len(p), NEW, 2, 5) for p in PROMPTS)


def test_int8_latent_pages_decode_as_the_int8_contiguous_cache(dense):
    want = greedy(dense, cache_dtype="int8").tokens
    assert greedy(dense, n=2, page_size=5, cache_dtype="int8").tokens == [row for row in want for _ in range(2)]


def test_one_beam_is_greedy(dense):
    got = jaxkv.beam_search(dense, PROMPTS, num_beams=1, max_new_tokens=NEW, stop_tokens=[], page_size=5)
    assert got.tokens == [[row] for row in greedy(dense).tokens]
    assert got.stats["pages_in_use_end"] == 0


def test_prefix_cache_reuses_latent_pages(dense):
    # Prompts within the 16-token bucket, so both calls prefill one compiled shape; the uncached reference batch
    # takes a third prompt, which makes it the padded batch of 4 the tests above compile.
    header = list(range(3, 15))
    prompts = [header + [41, 42], header + [90]]
    want = greedy(dense, prompts + PROMPTS[2:]).tokens[:2]
    pc = jaxkv.PrefixCache(dense, num_pages=48, page_size=4)
    first = greedy(dense, prompts[:1], prefix_cache=pc)
    second = greedy(dense, prompts[1:], prefix_cache=pc)
    assert [first.tokens[0], second.tokens[0]] == want
    assert first.stats["prefix_hit_tokens"] == 0 and second.stats["prefix_hit_tokens"] == 12
    assert pc.free_pages() == pc.num_pages - pc.cached_pages  # the calls gave every page back but the index's


def test_a_latent_prompt_chunk_reads_its_own_fresh_rows(dense):
    """Issue 27 (16): a prompt chunk from empty rows (the engine's prefill) gives prefill's logits over an int8
    latent pool (up to the absorbed / expanded forms' rounding); it read its own rows quantized (off by 0.02)."""
    cache = PagedKVCache.allocate(DENSE, 3, num_pages=32, page_size=4, max_len=32, dtype="int8")
    T = max(map(len, PROMPTS))
    tokens = jnp.asarray([p + [0] * (T - len(p)) for p in PROMPTS], jnp.int32)
    positions = jnp.asarray([list(range(len(p))) + [-1] * (T - len(p)) for p in PROMPTS], jnp.int32)
    apply = jax.jit(lambda params, cache, **mode: jaxkv.Decoder(DENSE).apply(
        {"params": params}, tokens, positions, cache, last_only=True, **mode)[0], static_argnames=("prefill", "chunk"))
    want = apply(dense.params, cache, prefill=True)
    np.testing.assert_allclose(apply(dense.params, cache, chunk=True), want, atol=ATOL_REFERENCE, rtol=0)


def test_engine_serves_an_mla_model(dense):
    engine = Engine(dense, slots=2, max_len=48, page_size=4, prefill_chunk=4, prefill_rows=2, decode_widths=[2])
    results = engine.generate([dict(prompt=p, max_new_tokens=NEW) for p in PROMPTS])  # chunked prefill too
    assert [r.tokens for r in results] == greedy(dense).tokens
    assert engine.free_pages == engine.num_pages


def test_pallas_over_latent_pages_is_refused_by_name(dense):
    for call in (lambda: greedy(dense, n=2, page_size=4, attention="pallas"),
                 lambda: jaxkv.beam_search(dense, PROMPTS, num_beams=2, max_new_tokens=4, attention="pallas"),
                 lambda: Engine(dense, slots=2, max_len=32, attention="pallas")):
        with pytest.raises(NotImplementedError, match="no Pallas kernel for MLA over a paged cache"):
            call()


def _per_head_cache_arrays(hlo: str, batch: int, slots: int, pages: int, page_size: int) -> list:
    """Shapes in compiled HLO larger than the batch's latent rows (batch x slots x (R + E)) that run over the cache
    length, as `slots` or as `pages` x `page_size`: per-head keys or values of cache length, however laid out."""
    limit = batch * slots * (RANK + ROPE)
    found = set()
    for dims in re.findall(r"\b(?:f32|bf16|f16|s8|f8e4m3fn)\[([\d,]+)\]", hlo):
        shape = tuple(int(d) for d in dims.split(","))
        if (slots in shape or (pages in shape and page_size in shape)) and math.prod(shape) > limit:
            found.add(shape)
    return sorted(found)


def test_compiled_paged_decode_step_holds_nothing_per_head_of_cache_length(dense):
    batch, pages, ps = 3, 9, 7  # 63 slots: no weight dimension of DENSE has 9, 7 or 63
    slots = pages * ps
    cache = PagedKVCache.allocate(DENSE, batch, num_pages=32, page_size=ps, max_len=slots)
    tokens = np.ones((batch, 13), np.int32)
    jitted = jax.jit(_forward, static_argnames=("config", "attention", "prefill"))  # eager: ~150 op compiles
    _, cache = jitted(dense.params, tokens, cache, config=DENSE, attention="xla", prefill=True)
    step = jitted.lower(
        dense.params, jnp.ones((batch, 1), jnp.int32), cache, config=DENSE, attention="xla").compile().as_text()
    assert f"f32[32,1,{ps},{RANK + ROPE}]" in step  # the latent pool is there
    assert _per_head_cache_arrays(step, batch, slots, pages, ps) == []
    # The check does find per-head keys and values: the expanded form over `slots` tokens has them.
    full = jaxkv.model._full_forward.lower(dense.params, jnp.ones((batch, slots), jnp.int32), config=DENSE,
                                           attention="xla").compile().as_text()
    assert (batch, slots, HEADS, NOPE) in _per_head_cache_arrays(full, batch, slots, pages, ps)


# --- beam search against transformers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(HF DeepSeek-V3, jaxkv model of the same weights, stop tokens its greedy continuations reach)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers.hf import MLA_LIKE, build_hf, hf_greedy_uncached

    hf = build_hf("DeepseekV3Config", dict(MLA_LIKE, q_lora_rank=24), seed=5)
    directory = tmp_path_factory.mktemp("deepseek")
    hf.save_pretrained(directory, safe_serialization=True)
    model = jaxkv.load(directory)
    out = [hf_greedy_uncached(hf, prompt, 12) for prompt in PROMPTS]  # transformers' own greedy: no jaxkv compile
    return hf, model, sorted({out[0][3], out[1][6], out[2][9]})


def test_beam_search_equals_transformers_on_deepseek_v3(deepseek):
    from helpers.hf import BEAM_NEW as HF_NEW, hf_beam_search

    hf, model, stops = deepseek
    # each setting once (the settings are traced: one compiled search per beam count); test_beam_search covers
    # their combinations on the other families
    for num_beams, length_penalty, early_stopping in [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never")]:
        want = hf_beam_search(hf, PROMPTS, stops, num_beams=num_beams, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_beams)
        got = jaxkv.beam_search(model, PROMPTS, num_beams=num_beams, max_new_tokens=HF_NEW, page_size=4,
                                length_penalty=length_penalty, early_stopping=early_stopping,
                                num_return_sequences=num_beams, stop_tokens=stops)
        where = f"num_beams={num_beams}, length_penalty={length_penalty}, early_stopping={early_stopping}"
        assert got.tokens == [[tokens for tokens, _ in hyps] for hyps in want], where
        for hyps, want_hyps in zip(got, want):
            for h, (_, score) in zip(hyps, want_hyps):
                assert abs(h.score - score) < SCORE_ATOL, where
        assert got.stats["pages_in_use_end"] == 0
