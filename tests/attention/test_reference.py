"""The attention reference against hand-computed cases, and its masking guarantees."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxkv.attention import reference

from helpers.tolerances import atol

ATOL = atol("attention reference")  # float32 arithmetic on a handful of numbers (helpers.tolerances)
START0 = jnp.array([0], jnp.int32)


def test_live_mask_hand_computed():
    # Row 0 starts at slot 0, row 1 at slot 2 (two padding slots); one query in slot 3 of a 6-slot cache.
    start = jnp.array([0, 2])
    np.testing.assert_array_equal(reference.live_mask(start, 3, 1, 6)[:, 0],
                                  [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    # Two queries (slots 3, 4) with a window of 2: each sees itself and the slot before.
    np.testing.assert_array_equal(reference.live_mask(start, 3, 2, 6, sliding_window=2)[0],
                                  [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]])


def test_single_query_two_keys_hand_computed():
    # q = [1, 0], keys [1, 0] and [0, 1], scale 1: scores 1 and 0, weights e/(e+1) and 1/(e+1).
    q = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = jnp.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 1, 2, 2)
    v = jnp.array([[10.0, 0.0], [0.0, 20.0]]).reshape(1, 1, 2, 2)
    w0 = math.e / (math.e + 1)
    out = reference.attention(q, k, v, START0, jnp.int32(1), scale=1.0)  # query in slot 1 sees slots 0, 1
    np.testing.assert_allclose(np.asarray(out).ravel(), [10 * w0, 20 * (1 - w0)], atol=ATOL)


def test_masked_slot_is_ignored():
    # Only slot 0 live: the output is exactly v[0], whatever key slot 1 holds (NaN included) and whatever finite
    # value it holds (dead values must be finite: the cache write zeroes them for this path).
    q = jnp.ones((1, 1, 1, 2))
    k = jnp.array([[1.0, 1.0], [jnp.nan, jnp.nan]]).reshape(1, 1, 2, 2)
    v = jnp.array([[3.0, 4.0], [1e30, -1e30]]).reshape(1, 1, 2, 2)
    out = reference.attention(q, k, v, START0, jnp.int32(0), scale=1.0)  # query in slot 0: slot 1 is the future
    np.testing.assert_array_equal(np.asarray(out).ravel(), [3.0, 4.0])


def test_fully_masked_row_is_finite():
    q = jnp.ones((1, 1, 1, 2))
    k = jnp.full((1, 1, 3, 2), 1e4)
    v = jnp.ones((1, 1, 3, 2))
    out = reference.attention(q, k, v, jnp.array([3]), jnp.int32(2), scale=1.0)  # start beyond the query
    assert np.isfinite(np.asarray(out)).all()


def test_large_logits_are_stable():
    q = jnp.full((1, 1, 1, 2), 1e3)
    k = jnp.array([[1e3, 1e3], [-1e3, -1e3]]).reshape(1, 1, 2, 2)
    v = jnp.array([[1.0, 2.0], [5.0, 6.0]]).reshape(1, 1, 2, 2)
    out = reference.attention(q, k, v, START0, jnp.int32(1), scale=1.0)
    np.testing.assert_allclose(np.asarray(out).ravel(), [1.0, 2.0], atol=ATOL)


def test_gqa_heads_read_their_own_kv_group():
    # 4 query heads, 2 KV heads: heads 0, 1 read KV head 0 (values 1), heads 2, 3 read KV head 1 (values 2).
    q = jnp.ones((1, 1, 4, 2))
    k = jnp.ones((1, 2, 3, 2))
    v = jnp.stack([jnp.ones((3, 2)), 2 * jnp.ones((3, 2))])[None]
    out = np.asarray(reference.attention(q, k, v, START0, jnp.int32(2), scale=1.0))
    np.testing.assert_allclose(out[0, 0, :, 0], [1, 1, 2, 2], atol=ATOL)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_decode_over_a_16_bit_cache_rounds_only_to_the_cache_precision(cache_dtype):
    """One-query attention over a 16-bit cache multiplies in the cache dtype (accumulating in float32): the result
    stays within that dtype's rounding of the exact float32 math on the same stored numbers."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 40, 32)), cache_dtype) for _ in range(2))
    start = jnp.array([0, 9], jnp.int32)
    got = reference.attention(q, k, v, start, jnp.int32(39), scale=0.2)
    exact = reference.attention(q, k.astype(jnp.float32), v.astype(jnp.float32), start, jnp.int32(39), scale=0.2)
    eps = float(jnp.finfo(cache_dtype).eps)
    np.testing.assert_allclose(got, exact, atol=8 * eps, rtol=0)
    assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 0  # the product really is in the 16-bit dtype


@pytest.mark.parametrize("length", [1, 7, 24, 64, 80, 128])
def test_pairwise_sum_equals_the_sum(length):
    """The decode scores' add tree (halving while even, then a plain sum) sums every element exactly once."""
    x = np.random.default_rng(length).standard_normal((3, 5, length)).astype(np.float32)
    np.testing.assert_allclose(reference._sum_minor(jnp.asarray(x)), x.astype(np.float64).sum(-1), rtol=1e-5,
                               atol=1e-5)


def test_decode_equals_the_multi_query_path():
    """One query through the decode form (add tree, materialized query) equals the same query through the
    general einsum path (a second query slot that is masked out of nothing it reads)."""
    rng = np.random.default_rng(0)
    B, K, N, S, H = 2, 2, 4, 40, 24
    q = jnp.asarray(rng.standard_normal((B, 2, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32) for _ in range(2))
    start, q_offset = jnp.array([0, 5]), jnp.int32(30)
    one = reference.attention(q[:, :1], k, v, start, q_offset, scale=0.2)
    two = reference.attention(q, k, v, start, q_offset, scale=0.2)  # T = 2: einsum path; query 0 is the same
    np.testing.assert_allclose(one[:, 0], two[:, 0], atol=ATOL, rtol=1e-5)


def _dot_precisions(fn, *args):
    """The precision of every dot_general in fn's jaxpr, nested jaxprs (cond, jit) included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_references_attend_at_the_kernels_precision(dtype):
    """Float32 queries: every matmul of the XLA references at HIGHEST precision, as the Pallas kernels run theirs
    (`reference.dot_precision`); 16-bit queries: the backend's default. On CPU both give the same numbers, but on an
    H200 (session 19) the float32 references at the default precision ran in TF32 and were off by ~1e-3 against
    float64 and against the kernels (18 of the compiled kernel tests failed that way, on the reference's side)."""
    from jaxkv.attention import mla_reference, paged_reference

    want = (lax.Precision.HIGHEST,) if dtype == "float32" else (None,)
    B, T, N, K, S, H = 2, 3, 4, 2, 16, 8
    q = jnp.zeros((B, T, N, H), dtype)
    k = jnp.zeros((B, K, S, H), dtype)
    start = jnp.zeros((B,), jnp.int32)
    pages = jnp.zeros((8, K, 4, H), dtype)
    table = jnp.arange(8, dtype=jnp.int32).reshape(B, 4)
    lengths, q_slots = jnp.full((B,), 12, jnp.int32), jnp.tile(jnp.arange(9, 12, dtype=jnp.int32), (B, 1))
    latent = jnp.zeros((B, S, 12), dtype)
    calls = {
        "full_attention": lambda: _dot_precisions(
            lambda q, k: reference.full_attention(q, k, k, start, jnp.int32(5), scale=1.0), q, k),
        "attention": lambda: _dot_precisions(
            lambda q, k: reference.attention(q, k, k, start, jnp.int32(5), scale=1.0), q, k),
        "paged_attention": lambda: _dot_precisions(
            lambda q, p: paged_reference.paged_attention(q, p, p, table, lengths, q_slots, scale=1.0), q, pages),
        "pool_attention": lambda: _dot_precisions(
            lambda q, p: paged_reference.pool_attention(q, p, p, table, lengths, q_slots, scale=1.0), q, pages),
        "mla full_attention": lambda: _dot_precisions(
            lambda q, x: mla_reference.full_attention(q[..., :12], x, start, jnp.int32(5), latent_dim=8, scale=1.0),
            jnp.zeros((B, T, N, 12), dtype), latent),
    }
    for name, call in calls.items():
        found = call()
        assert found, f"{name}: no matmul seen"
        assert {p if p is None else p[0] for p in found} == set(want), f"{name}: {found}"
