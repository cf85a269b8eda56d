"""Chunked attention (Llama 4's `attention_chunk_size`; `chunk=` of the contiguous and paged kinds) in the XLA
references against a naive loop of the rule: a query at position p sees the keys at positions [p - p mod C, p],
positions counting from each row's first real token. Also: a ring of C slots serves decode exactly, the chunk
composes with a sliding window and with sinks, and a bad chunk is a ValueError."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_reference as paged
from jaxkv.attention import reference

# kernels.call: each (function, keywords, shapes) compiled once; the loops below over query slots reuse it (eager
# calls re-traced every `lax.switch` of the live-prefix paths at every slot).
from helpers import kernels

B, N, K, H, S = 2, 4, 2, 8, 32
SCALE = H ** -0.5


def naive(q, k, v, start, q_offset, chunk, window=None, sinks=None):
    """[B, T, N, H]: the rule of the module docstring, one query and head at a time, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T = q.shape[1]
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            qs = q_offset + t
            qp = qs - start[b]
            for n in range(N):
                kh = n // (N // K)
                live = [s for s in range(k.shape[2]) if start[b] <= s <= qs and s - start[b] >= qp - qp % chunk
                        and (window is None or qs - s < window)]
                logits = [q[b, t, n] @ k[b, kh, s] * SCALE for s in live]
                if sinks is not None:
                    logits.append(float(sinks[n]))
                if not logits:  # a padding query: nothing to compare (`close` skips it)
                    out[b, t, n] = np.nan
                    continue
                logits = np.array(logits)
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, t, n] = sum(w[i] * v[b, kh, s] for i, s in enumerate(live))
    return out


def close(got, want):
    """got == want at 1e-5 where want is defined (a padding query's is NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    real = ~np.isnan(want)
    assert real.any()
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, S, N, H)).astype(np.float32)
    k = rng.normal(size=(B, K, S, H)).astype(np.float32)
    v = rng.normal(size=(B, K, S, H)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("chunk, window", [(8, None), (5, None), (8, 6)])
def test_contiguous_prefill_and_decode_follow_the_rule(qkv, chunk, window):
    """A left-padded batch (row 1 starts at slot 3: its chunks start at slots 3, 3 + C, ...): the prompt's 20
    queries at once, then each later slot's decode query (the live-prefix switch at its smallest prefix)."""
    q, k, v = qkv
    start = np.array([0, 3])
    got = kernels.call(reference.attention, jnp.asarray(q[:, :20]), k, v, jnp.asarray(start, jnp.int32),
                       jnp.int32(0), scale=SCALE, chunk=chunk, sliding_window=window)
    close(got, naive(q[:, :20], k, v, start, 0, chunk, window))
    unchunked = kernels.call(reference.attention, jnp.asarray(q[:, :20]), k, v, jnp.asarray(start, jnp.int32),
                             jnp.int32(0), scale=SCALE, sliding_window=window)
    assert np.abs(np.asarray(got) - np.asarray(unchunked)).max() > 1e-2  # the chunk moved it
    for t in range(20, S):
        got = kernels.call(reference.attention, jnp.asarray(q[:, t:t + 1]), k, v, jnp.asarray(start, jnp.int32),
                           jnp.int32(t), scale=SCALE, chunk=chunk, sliding_window=window, min_prefix=8)
        close(got, naive(q[:, t:t + 1], k, v, start, t, chunk, window))


def test_a_ring_of_the_chunk_serves_decode(qkv):
    """Decode over a ring of C slots (absolute slot s at index s mod C) equals decode over the whole cache."""
    q, k, v = qkv
    C, start = 8, np.array([0, 3])
    for t in range(C, S):
        ring_k, ring_v = np.zeros((B, K, C, H), np.float32), np.zeros((B, K, C, H), np.float32)
        for s in range(t - C + 1, t + 1):
            ring_k[:, :, s % C], ring_v[:, :, s % C] = k[:, :, s], v[:, :, s]
        got = kernels.call(reference.attention, jnp.asarray(q[:, t:t + 1]), ring_k, ring_v,
                           jnp.asarray(start, jnp.int32), jnp.int32(t), scale=SCALE, chunk=C, ring=True)
        close(got, naive(q[:, t:t + 1], k, v, start, t, C))


def test_paged_references_follow_the_rule(qkv):
    """Every paged formulation (gathered, pool, live prefix, ragged, and a prompt chunk over cached pages with
    its fresh K/V) with chunks of 8 and sinks, pages of 4."""
    q, k, v = qkv
    ps, C, T, offset = 4, 8, 5, 18
    sinks = np.random.default_rng(1).normal(size=(N,)).astype(np.float32) * 2
    pool_k, pool_v = np.zeros((20, K, ps, H), np.float32), np.zeros((20, K, ps, H), np.float32)
    table = np.arange(B * (S // ps), dtype=np.int32).reshape(B, S // ps)
    for b in range(B):
        for m in range(S // ps):
            pool_k[table[b, m]], pool_v[table[b, m]] = k[b, :, m * ps:(m + 1) * ps], v[b, :, m * ps:(m + 1) * ps]
    want = naive(q[:, offset:offset + T], k, v, np.zeros(B, int), offset, C, sinks=sinks)
    lengths = jnp.full((B,), offset + T, jnp.int32)
    slots = jnp.broadcast_to(offset + jnp.arange(T, dtype=jnp.int32), (B, T))
    args = (jnp.asarray(q[:, offset:offset + T]), pool_k, pool_v, table, lengths, slots)
    for fn in (paged.paged_attention, paged.pool_attention, paged.live_paged_attention, paged.xla_attention):
        np.testing.assert_allclose(kernels.call(fn, *args, scale=SCALE, chunk=C, arrays=dict(sinks=sinks)), want,
                                   atol=1e-5, rtol=0, err_msg=fn.__name__)
    fresh = (jnp.asarray(k[:, :, offset:offset + T]), jnp.asarray(v[:, :, offset:offset + T]), jnp.ones((B, T), bool))
    np.testing.assert_allclose(kernels.call(paged.xla_attention, *args, scale=SCALE, chunk=C,
                                            arrays=dict(sinks=sinks, fresh=fresh)), want, atol=1e-5, rtol=0)
    for t in range(T):
        got = kernels.call(paged.ragged_paged_attention, jnp.asarray(q[:, offset + t:offset + t + 1]), pool_k,
                           pool_v, table, jnp.full((B,), offset + t + 1, jnp.int32), slots[:, t:t + 1],
                           scale=SCALE, chunk=C, min_prefix=4, arrays=dict(sinks=sinks))
        np.testing.assert_allclose(got[:, 0], want[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "8"])
def test_a_bad_chunk_is_refused(qkv, bad):
    q, k, v = qkv
    with pytest.raises(ValueError, match="chunk"):
        reference.attention(jnp.asarray(q[:, :2]), k, v, jnp.zeros(B, jnp.int32), jnp.int32(0), scale=SCALE,
                            chunk=bad)


# --- the Pallas kernels (interpret mode on CPU; compiled where helpers.kernels finds a device) ----------------------

from jaxkv.attention import api, pallas  # noqa: E402
from helpers.kernels import INTERPRET, PLATFORMS  # noqa: E402


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("T, ring", [(1, False), (3, False), (1, True)], ids=["decode", "verify-3", "ring"])
def test_decode_kernel_takes_the_chunk(qkv, platform, T, ring):
    """The decode kernel with a chunk of 8 (one more lower bound per query) == the reference, for each query
    position across two chunk boundaries; a left-padded row; over the whole cache or a ring of 8 + T - 1."""
    q, k, v = qkv
    C, start = 8, np.array([0, 3])
    S_ring = C + T - 1
    for t in range(12, 24, 3):
        kk, vv = k, v
        if ring:
            kk, vv = np.zeros((B, K, S_ring, H), np.float32), np.zeros((B, K, S_ring, H), np.float32)
            for s in range(t + T - S_ring, t + T):
                kk[:, :, s % S_ring], vv[:, :, s % S_ring] = k[:, :, s], v[:, :, s]
        args = (jnp.asarray(q[:, t:t + T]), kk, vv, jnp.asarray(start, jnp.int32), jnp.int32(t))
        want = kernels.call(reference.attention, *args, scale=SCALE, chunk=C, ring=ring)
        got = kernels.call(pallas.attention, *args, scale=SCALE, chunk=C, ring=ring, platform=platform,
                           interpret=INTERPRET)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"query slot {t}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_paged_kernel_takes_the_chunk(qkv, platform):
    """The paged decode kernel with a chunk of 8 (pages of 4) == the paged reference, one query and a verify of 3."""
    q, k, v = qkv
    ps, C = 4, 8
    pool_k, pool_v = np.zeros((20, K, ps, H), np.float32), np.zeros((20, K, ps, H), np.float32)
    table = np.arange(B * (S // ps), dtype=np.int32).reshape(B, S // ps)
    for b in range(B):
        for m in range(S // ps):
            pool_k[table[b, m]], pool_v[table[b, m]] = k[b, :, m * ps:(m + 1) * ps], v[b, :, m * ps:(m + 1) * ps]
    for T, offset in ((1, 17), (3, 14), (1, 23)):
        slots = jnp.broadcast_to(offset + jnp.arange(T, dtype=jnp.int32), (B, T))
        args = (jnp.asarray(q[:, offset:offset + T]), pool_k, pool_v, table, jnp.full((B,), offset + T, jnp.int32),
                slots)
        want = kernels.call(paged.paged_attention, *args, scale=SCALE, chunk=C)
        got = kernels.call(pallas.paged_attention, *args, scale=SCALE, chunk=C, platform=platform,
                           interpret=INTERPRET)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"T={T}, offset {offset}")


def test_a_chunked_prompt_falls_through_to_xla(qkv):
    """The prefill kernel has no chunk mask: "pallas" refuses a 20-query chunked block by name, "auto" (Pallas
    first, as on a device) serves it with the reference."""
    q, k, v = qkv
    args = (jnp.asarray(q[:, :20]), k, v, jnp.zeros(B, jnp.int32), jnp.int32(0))
    with pytest.raises(NotImplementedError, match="chunk"):
        api.get("contiguous", "pallas")(*args, scale=SCALE, chunk=8)
    auto = api.Attend("contiguous", ("pallas", "xla"), explicit=False)
    np.testing.assert_allclose(auto(*args, scale=SCALE, chunk=8), reference.attention(*args, scale=SCALE, chunk=8),
                               atol=1e-6, rtol=0)
