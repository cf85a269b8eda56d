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


def test_decode_prefix_path_equals_the_full_formula():
    """Decode (T == 1) reads a live prefix in the reduce form; it equals the plain formula (min_prefix=None), with
    NaN in dead rows, a window, a ring and int8 rows with scales."""
    rng = np.random.default_rng(3)
    S_long = 700  # several prefix lengths (256, 384, 512, all)
    q = jnp.asarray(rng.normal(size=(2, 1, N, R + E)), jnp.float32)
    rows = rng.normal(size=(2, S_long, R + E)).astype(np.float32)
    for q_offset, start, window, ring in [(300, [0, 40], None, False), (650, [3, 0], 100, False),
                                          (2000, [0, 0], S_long, True), (10, [0, 2], None, False)]:
        poisoned = rows.copy()
        if not ring:
            poisoned[:, q_offset + 1:] = np.nan
        args = (jnp.asarray(start, jnp.int32), jnp.int32(q_offset))
        kw = dict(latent_dim=R, scale=0.2, sliding_window=window, ring=ring)
        got = mla.attention(q, jnp.asarray(poisoned), *args, **kw)
        want = mla.attention(q, jnp.asarray(rows), *args, min_prefix=None, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    scales = np.abs(rows).max(-1) / 127
    stored = jnp.asarray(np.round(rows / scales[..., None]).astype(np.int8))
    args = (jnp.zeros(2, jnp.int32), jnp.int32(500))
    got = mla.attention(q, stored, *args, latent_dim=R, scale=0.2, latent_scale=jnp.asarray(scales))
    want = mla.attention(q, stored, *args, latent_dim=R, scale=0.2, latent_scale=jnp.asarray(scales), min_prefix=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# (A batch of 1 with a float32 cache, a decode loop of its own, left out: its batch is the int8 case's, its dtype the
# batch of 3's.)
@pytest.mark.parametrize("batch, cache_dtype", [(3, "float32"), (1, "int8")])
def test_compiled_mla_decode_updates_the_latent_cache_in_place(batch, cache_dtype):
    """No copy (or transposing copy fusion) of a latent buffer [B, 1, S, R + E], or of its value columns [B, 1, S, R],
    in the compiled decode loop: the einsum form of the attention made XLA:CPU copy float32 buffers several times per
    layer and step, and slicing the values out of the buffer copied the slice each step."""
    import jax

    import jaxkv
    from jaxkv.config import Mla
    from helpers.hlo import is_whole_buffer_copy

    config = jaxkv.Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_dim=48,
                          mla=Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))
    model = jaxkv.Model.random(config, seed=0)
    logits, cache = jaxkv.prefill(model.params, jnp.ones((batch, 4), jnp.int32), jnp.zeros(batch, jnp.int32),
                                  config=config, capacity=2048, attention="xla", cache_dtype=cache_dtype)
    args = (model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.Sampler.make(), jnp.full((8,), -1))
    text = jaxkv.decode.lower(*args, config=config, steps=5, attention="xla").compile().as_text()
    short = {"float32": "f32", "int8": "s8"}[cache_dtype]
    # 2,048 slots: the live-prefix branches (`prefix_lengths`) in which the copies appeared; 48 showed none.
    assert f"= {short}[{batch},1,2048,24]" in text  # the check below looks for the right shape
    copies = [ln.strip()[:120] for ln in text.splitlines() if is_whole_buffer_copy(ln, batch * 2048 * 16)]
    assert not copies, copies[:3]
