"""The absorbed MLA reference (jaxkv.attention.mla) against attention over the expanded per-head keys and values."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import mla, reference

B, N, R, E, P, V, S = 2, 4, 16, 8, 12, 10, 24  # P: no-position query/key width per head, V: value width per head


def expanded_vs_absorbed(T, q_offset, start, window=None, ring=False, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(B, S, R)).astype(np.float32)
    k_rope = rng.normal(size=(B, S, E)).astype(np.float32)
    w_uk = rng.normal(size=(N, P, R)).astype(np.float32) / np.sqrt(R)
    w_uv = rng.normal(size=(N, V, R)).astype(np.float32) / np.sqrt(R)
    q_nope = rng.normal(size=(B, T, N, P)).astype(np.float32)
    q_rope = rng.normal(size=(B, T, N, E)).astype(np.float32)
    scale = (P + E) ** -0.5
    start, q_offset = jnp.asarray(start, jnp.int32), jnp.asarray(q_offset, jnp.int32)
    # Expanded: per-head keys [W_UK c ; k_rope] and values W_UV c, ordinary multi-head attention.
    k = np.concatenate([np.einsum("npr,bsr->bnsp", w_uk, c), np.broadcast_to(k_rope[:, None], (B, N, S, E))], -1)
    v = np.einsum("nvr,bsr->bnsv", w_uv, c)
    q = np.concatenate([q_nope, q_rope], -1)
    kv_width = P + E  # the reference needs equal q/k/v widths: pad v with zeros
    v_padded = np.concatenate([v, np.zeros((B, N, S, kv_width - V), np.float32)], -1)
    want = reference.full_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v_padded), start, q_offset,
                                    scale=scale, sliding_window=window, ring=ring)[..., :V]
    # Absorbed: queries in latent space over the cached rows [c ; k_rope]; W_UV applied after.
    q_lat = np.concatenate([np.einsum("btnp,npr->btnr", q_nope, w_uk), q_rope], -1)
    rows = np.concatenate([c, k_rope], -1)
    out = mla.attention(jnp.asarray(q_lat), jnp.asarray(rows), start, q_offset, latent_dim=R, scale=scale,
                        sliding_window=window, ring=ring)
    got = jnp.einsum("btnr,nvr->btnv", out, w_uv)
    return np.asarray(got), np.asarray(want)


@pytest.mark.parametrize("T,q_offset,start,window", [(1, 10, [0, 3], None), (1, 23, [5, 0], 6), (5, 7, [0, 2], None),
                                                     (6, 0, [0, 0], 3)])
def test_absorbed_equals_expanded(T, q_offset, start, window):
    got, want = expanded_vs_absorbed(T, q_offset, start, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ring_equals_expanded():
    got, want = expanded_vs_absorbed(1, 40, [0, 9], window=S, ring=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dead_slots_cannot_leak():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, N, R + E)), jnp.float32)
    rows = rng.normal(size=(1, S, R + E)).astype(np.float32)
    clean = mla.attention(q, jnp.asarray(rows), jnp.zeros(1, jnp.int32), jnp.int32(9), latent_dim=R, scale=0.3)
    rows[:, 10:] = np.nan  # slots after the query
    poisoned = mla.attention(q, jnp.asarray(rows), jnp.zeros(1, jnp.int32), jnp.int32(9), latent_dim=R, scale=0.3)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(poisoned))
    assert np.isfinite(np.asarray(poisoned)).all()


def test_quantized_rows_are_dequantized():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 1, N, R + E)), jnp.float32)
    rows = rng.normal(size=(2, S, R + E)).astype(np.float32)
    scales = np.abs(rows).max(-1) / 127
    stored = np.round(rows / scales[..., None]).astype(np.int8)
    args = (jnp.zeros(2, jnp.int32), jnp.int32(S - 1))
    got = mla.attention(q, jnp.asarray(stored), *args, latent_dim=R, scale=0.3, latent_scale=jnp.asarray(scales))
    want = mla.attention(q, jnp.asarray(stored * scales[..., None]), *args, latent_dim=R, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_bad_shapes():
    with pytest.raises(ValueError, match="does not fit"):
        mla.attention(jnp.zeros((1, 1, N, R + E)), jnp.zeros((1, S, R)), jnp.zeros(1, jnp.int32), jnp.int32(0),
                      latent_dim=R, scale=1.0)
