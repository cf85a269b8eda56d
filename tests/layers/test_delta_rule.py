"""jaxkv.layers.delta_rule against transformers' own torch functions for Qwen3-Next's Gated DeltaNet (float32),
and its two forms (recurrent, chunked) against each other: splitting, padding, dtypes.

Inputs follow the model's ranges: q/k/v and the conv inputs ~ N(0, 1), g = -A * softplus(a) with A log-uniform in
[0.01, 2] (decays from ~0.99 to ~0.1 per token, so the state remembers across chunks), beta = sigmoid(N(0, 1)); the
first token's q and k are shrunk to norms near the l2norm's epsilon.
Tolerance: both sides sum the same float32 terms in another order; the state runs over T tokens, ~1e-6 apart.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.layers.delta_rule import causal_conv, chunked, recurrent

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    causal_conv1d_fn, causal_conv1d_update, torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

TOL = dict(atol=1e-5, rtol=0)  # float32 summation order only (see the module docstring)
B, HK, DK, DV, C, W = 2, 2, 8, 16, 24, 4

rec = jax.jit(recurrent)
chk = jax.jit(chunked, static_argnames="chunk")
conv = jax.jit(causal_conv)


def rule_inputs(seed, T, hv=4, with_state=True):
    """q, k [B, T, HK, DK], v [B, T, hv, DV], g, beta [B, T, hv], state [B, hv, DK, DV] (float32 numpy)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, HK, DK))
    k = rng.standard_normal((B, T, HK, DK))
    q[:, 0] *= 1e-3  # |q|^2 ~ 1e-5, near the l2norm's eps (1e-6): a wrong eps shows
    k[:, 0] *= 1e-3
    v = rng.standard_normal((B, T, hv, DV))
    A = np.exp(rng.uniform(np.log(0.01), np.log(2.0), hv))
    g = -A * np.logaddexp(0.0, rng.standard_normal((B, T, hv)))  # -A * softplus(a)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, hv))))
    state = rng.standard_normal((B, hv, DK, DV)) * 0.5 if with_state else np.zeros((B, hv, DK, DV))
    return [a.astype(np.float32) for a in (q, k, v, g, beta, state)]


def torch_rule(fn, args, with_state=True, **kw):
    q, k, v, g, beta, state = (torch.from_numpy(a) for a in args)
    out, S = fn(q, k, v, g=g, beta=beta, initial_state=state if with_state else None, output_final_state=True,
                use_qk_l2norm_in_kernel=True, **kw)
    return out.numpy(), S.numpy()


def pad_tokens(seed, n, hv=4):
    """n padding tokens: arbitrary (nonzero) q/k/v, g = beta = 0."""
    q, k, v, _, _, _ = rule_inputs(seed, n, hv)
    zeros = np.zeros((B, n, hv), np.float32)
    return q * 3, k * 3, v * 3, zeros, zeros


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("hv", [2, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_transformers(T, hv, with_state):
    args = rule_inputs(0, T, hv, with_state)
    want_out, want_S = torch_rule(torch_recurrent_gated_delta_rule, args, with_state)
    out, S = rec(*args)
    assert out.dtype == jnp.float32 and S.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    np.testing.assert_allclose(np.asarray(S), want_S, **TOL)


@pytest.mark.parametrize("chunk, T, hv", [(64, 11, 4), (64, 70, 2), (4, 11, 2), (4, 11, 4)])
def test_chunked_matches_transformers(chunk, T, hv):
    args = rule_inputs(1, T, hv)
    want_out, want_S = torch_rule(torch_chunk_gated_delta_rule, args, chunk_size=chunk)
    out, S = chk(*args, chunk=chunk)
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    np.testing.assert_allclose(np.asarray(S), want_S, **TOL)


@pytest.mark.parametrize("T", [1, 5, 64, 130])
def test_chunked_matches_recurrent(T):
    """The prefill form and the decode form of the same rule."""
    args = rule_inputs(2, T)
    out_r, S_r = rec(*args)
    out_c, S_c = chk(*args)
    np.testing.assert_allclose(np.asarray(out_c), np.asarray(out_r), **TOL)
    np.testing.assert_allclose(np.asarray(S_c), np.asarray(S_r), **TOL)


@pytest.mark.parametrize("T1", [3, 8])  # inside a chunk, on a chunk boundary
def test_chunked_split_carries_state(T1):
    """Prefill in two calls (the state passed between them) == in one."""
    q, k, v, g, beta, state = rule_inputs(3, 11)
    out, S = chk(q, k, v, g, beta, state, chunk=4)
    out1, S1 = chk(q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], beta[:, :T1], state, chunk=4)
    out2, S2 = chk(q[:, T1:], k[:, T1:], v[:, T1:], g[:, T1:], beta[:, T1:], S1, chunk=4)
    np.testing.assert_allclose(np.concatenate([out1, out2], axis=1), np.asarray(out), **TOL)
    np.testing.assert_allclose(np.asarray(S2), np.asarray(S), **TOL)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_padding_tokens_are_identity(form):
    """g = beta = 0 leaves the state exactly as it was, whatever the token's q/k/v."""
    state = rule_inputs(4, 1)[-1]
    fn = rec if form == "recurrent" else (lambda *a: chk(*a, chunk=4))
    _, S = fn(*pad_tokens(5, 6), state)  # 6 tokens: a full chunk of 4 and a partial one
    np.testing.assert_array_equal(np.asarray(S), state)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_left_padding(form):
    """Row 0 left-padded by 3 tokens, row 1 by none (a batched prefill): each row's final state and real-token
    outputs are those of its real tokens alone."""
    fn = rec if form == "recurrent" else (lambda *a: chk(*a, chunk=4))
    P, T = 3, 9
    real = rule_inputs(6, T)
    pads = pad_tokens(7, P)
    padded = []
    for r, p in zip(real[:5], pads):
        row0 = np.concatenate([p[:1], r[:1, :T - P]], axis=1)  # row 0: 3 padding tokens, then its first T - P
        padded.append(np.concatenate([row0, r[1:]], axis=0))
    out, S = fn(*padded, real[5])
    want0_out, want0_S = fn(*[a[:1, :T - P] for a in real[:5]], real[5][:1])
    want_out, want_S = fn(*real)
    np.testing.assert_allclose(np.asarray(out[0, P:]), np.asarray(want0_out[0]), **TOL)
    np.testing.assert_allclose(np.asarray(S[0]), np.asarray(want0_S[0]), **TOL)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(want_out[1]), **TOL)
    np.testing.assert_allclose(np.asarray(S[1]), np.asarray(want_S[1]), **TOL)


def conv_inputs(seed, T):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    weight = (rng.standard_normal((C, W)) * 0.5).astype(np.float32)
    return x, weight


def test_causal_conv_fresh_matches_transformers():
    x, weight = conv_inputs(8, 9)
    want = causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(weight), None, activation="silu")
    y, state = conv(x, weight, np.zeros((B, C, W - 1), np.float32))
    np.testing.assert_allclose(np.asarray(y), want.transpose(1, 2).numpy(), **TOL)
    np.testing.assert_array_equal(np.asarray(state), np.swapaxes(x[:, -(W - 1):], 1, 2))


@pytest.mark.parametrize("torch_state_len", [W - 1, W])
def test_causal_conv_update_matches_transformers(torch_state_len):
    """Token by token from a nonzero state. transformers' cache keeps W inputs (the oldest unused), ours W - 1:
    both give the same outputs, and ours is the last W - 1 of theirs."""
    x, weight = conv_inputs(9, 5)
    rng = np.random.default_rng(10)
    torch_state = torch.from_numpy(rng.standard_normal((B, C, torch_state_len)).astype(np.float32))
    state = torch_state.numpy()[..., -(W - 1):].copy()
    for t in range(x.shape[1]):
        want = causal_conv1d_update(torch.from_numpy(x[:, t:t + 1]).transpose(1, 2), torch_state,
                                    torch.from_numpy(weight), None, activation="silu")  # updates torch_state
        y, state = conv(x[:, t:t + 1], weight, state)
        np.testing.assert_allclose(np.asarray(y), want.transpose(1, 2).numpy(), **TOL)
        np.testing.assert_array_equal(np.asarray(state), torch_state.numpy()[..., -(W - 1):])


@pytest.mark.parametrize("T", [2, 7])  # T < W - 1: the new state mixes old state and new inputs
def test_causal_conv_prefill_then_decode(T):
    x, weight = conv_inputs(11, T + 1)
    zeros = np.zeros((B, C, W - 1), np.float32)
    y_all, s_all = conv(x, weight, zeros)
    y1, s1 = conv(x[:, :T], weight, zeros)
    y2, s2 = conv(x[:, T:], weight, s1)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), np.asarray(y_all), **TOL)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s_all))


@pytest.mark.parametrize("ends", [(2, 9), (0, 5)])  # shorter and longer than W - 1; a row with no real input
def test_causal_conv_window_ends_at_each_rows_end(ends):
    """Right padding (a paged cache's prompts): with `end`, each row's new state is the window of its own first
    end[b] inputs, as if the padding after them were never given; outputs before end[b] are unchanged; end 0
    keeps the state."""
    T = 9
    x, weight = conv_inputs(13, T)
    state = np.random.default_rng(14).normal(size=(B, C, W - 1)).astype(np.float32)
    y, s = causal_conv(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(state), jnp.asarray(ends, jnp.int32))
    for b, e in enumerate(ends):
        y_b, s_b = causal_conv(jnp.asarray(x[b:b + 1, :e]), jnp.asarray(weight), jnp.asarray(state[b:b + 1]))
        np.testing.assert_array_equal(np.asarray(s)[b], np.asarray(s_b)[0])
        np.testing.assert_allclose(np.asarray(y)[b, :e], np.asarray(y_b)[0], **TOL)


def test_bfloat16_inputs():
    """bfloat16 in, bfloat16 out, float32 state; computed in float32 from the bfloat16 values."""
    args = rule_inputs(12, 11)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in args[:5]] + [jnp.asarray(args[5])]
    up = [a.astype(jnp.float32) for a in bf]
    for fn in (rec, lambda *a: chk(*a, chunk=4)):
        out, S = fn(*bf)
        assert out.dtype == jnp.bfloat16 and S.dtype == jnp.float32
        assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(S)).all()
        want_out, want_S = fn(*up)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out.astype(jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(S), np.asarray(want_S))
    x, weight = conv_inputs(13, 6)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16)
    y, state = conv(xb, wb, jnp.zeros((B, C, W - 1), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and state.dtype == jnp.bfloat16
    want, _ = conv(xb.astype(jnp.float32), wb.astype(jnp.float32), np.zeros((B, C, W - 1), np.float32))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want.astype(jnp.bfloat16)))
