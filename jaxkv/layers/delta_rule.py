"""Qwen3-Next's Gated DeltaNet token mixer, the math only (plain jittable functions, no Flax), as transformers
(5.25, modeling_qwen3_next) computes it: the causal depthwise conv over the mixed q/k/v channels, then the gated
delta rule, a linear attention whose recurrent state S [B, Hv, Dk, Dv] is, per token, decayed by exp(g), corrected
towards v along k by the step beta (the delta rule), and read by q.

Two forms of the same rule: `recurrent` (token by token, a scan over T: decoding) and `chunked` (the UT-transform
form: the tokens of a chunk in a few matmuls, a scan over chunks: prefill). They agree to float32 rounding.

Shape letters: B batch, T tokens, Hk query/key heads, Hv value heads (a multiple of Hk: each q/k head serves
Hv // Hk consecutive value heads), Dk / Dv the key / value head dims, C the conv channels (2 Hk Dk + Hv Dv),
W the conv kernel width, L the chunk length.

Everything runs in float32 and every contraction with Precision.HIGHEST: the state is a running sum over the whole
sequence, so rounding compounds over T, and on GPU the default float32 matmul is TF32 (a 10-bit mantissa: ~1e-3
relative per product), far outside the 1e-5 the two forms and transformers agree to.

g = 0 and beta = 0 is the identity step (S * exp(0) = S, delta * 0 = 0), exactly: callers mark padding tokens with
it, whatever their q/k/v, and `chunked` pads T up to a multiple of L the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

_HI = jax.lax.Precision.HIGHEST
_L2_EPS = 1e-6  # transformers' (and the FLA kernels') l2norm epsilon


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI)


def causal_conv(x, weight, state, end=None):
    """x [B, T, C] (the mixed q/k/v channels), weight [C, W] (depthwise kernel, transformers' conv1d.weight[:, 0, :]),
    state [B, C, W - 1] (the previous W - 1 inputs, oldest first; zeros for a fresh sequence), end int32[B] or None
    -> (silu(causal depthwise conv of concat(state, x) over time) [B, T, C] in x.dtype, the new state [B, C, W - 1] =
    the last W - 1 inputs of concat(state, x[:, :end[b]]) (in state.dtype)).

    `end`: the index after each row's last real input (None: T, every input). Right-padded rows (a paged cache's
    prompts, a finished row's padding step) keep the window of their real inputs, not of the padding after them;
    a row with end 0 keeps its state.

    The W products are summed in float32 and silu applied before the one cast back (transformers works in the
    weight's dtype: the same numbers for float32, closer to exact for bfloat16)."""
    T, W = x.shape[1], weight.shape[1]
    xs = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    w = weight.astype(jnp.float32)
    # A loop over the W taps (a handful), not over tokens: tap j meets input t + j of xs for output t, as
    # torch's conv1d (a cross-correlation) pairs them.
    y = sum(xs[:, j:j + T, :] * w[:, j] for j in range(W))
    if end is None:  # sliced by start index: xs[:, -(W - 1):] would keep everything when W = 1
        window = xs[:, xs.shape[1] - (W - 1):, :]
    else:  # input t is xs[t + W - 1]: the W - 1 inputs before input end[b] are xs[end[b] : end[b] + W - 1]
        index = jnp.asarray(end, jnp.int32)[:, None] + jnp.arange(W - 1, dtype=jnp.int32)[None, :]
        window = jnp.take_along_axis(xs, index[:, :, None], axis=1)
    new_state = jnp.swapaxes(window, 1, 2).astype(state.dtype)
    return jax.nn.silu(y).astype(x.dtype), new_state


def _prepare(q, k, v, g, beta):
    """float32; q and k l2-normalized, q scaled by Dk ** -0.5, q/k heads repeated up to Hv."""
    f32 = jnp.float32
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + _L2_EPS)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + _L2_EPS)
    q = q * q.shape[-1] ** -0.5
    rep = v.shape[2] // k.shape[2]
    if rep > 1:  # repeat_interleave: q/k head i serves value heads i * rep ... i * rep + rep - 1
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    return q, k, v, g, beta


def recurrent(q, k, v, g, beta, state, *, every_state: bool = False):
    """The token-by-token gated delta rule (transformers' torch_recurrent_gated_delta_rule with
    use_qk_l2norm_in_kernel=True). q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (log decay, <= 0) and beta [B, T, Hv];
    state float32 [B, Hv, Dk, Dv]. Hv a multiple of Hk: each q/k head serves Hv // Hk consecutive value heads
    (repeat_interleave). -> (out [B, T, Hv, Dv] in v.dtype, final state float32 [B, Hv, Dk, Dv]; with
    `every_state` the state after each token instead, float32 [B, T, Hv, Dk, Dv]: a speculative verify keeps the
    one after its last accepted token). Computed in float32."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, D] and [B, Hv]
        S = S * jnp.exp(g_t)[..., None, None]
        kv_mem = _einsum("bhkv,bhk->bhv", S, k_t)  # what S already predicts for k_t
        delta = (v_t - kv_mem) * b_t[..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        read = _einsum("bhkv,bhk->bhv", S, q_t)  # read after the write: token t sees itself
        return S, (read, S) if every_state else read

    time_major = [jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)]
    S, out = jax.lax.scan(step, state.astype(jnp.float32), time_major)
    if every_state:
        out, S = out[0], jnp.moveaxis(out[1], 0, 1)
    return jnp.moveaxis(out, 0, 1).astype(out_dtype), S


def conv_windows(x, state):
    """x [B, T, C] (the conv's inputs), state [B, C, W - 1] -> [B, T, C, W - 1]: the conv state after each token
    (`causal_conv`'s new state had the inputs stopped there), in state.dtype."""
    T, W1 = x.shape[1], state.shape[2]
    xs = jnp.concatenate([jnp.swapaxes(state, 1, 2), x.astype(state.dtype)], axis=1)  # [B, W - 1 + T, C]
    index = jnp.arange(T)[:, None] + 1 + jnp.arange(W1)[None, :]  # after token t: inputs t + 1 ... t + W - 1 of xs
    return jnp.swapaxes(xs[:, index], 2, 3)


def chunked(q, k, v, g, beta, state, *, chunk: int = 64):
    """The same result in the chunked (parallel) form (transformers' torch_chunk_gated_delta_rule): T padded to a
    multiple of `chunk`, the intra-chunk UT system solved (a unit lower triangular solve), a scan over chunks.
    Same arguments and returns as `recurrent`."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, T, H, Dk = k.shape
    Dv, L = v.shape[-1], chunk
    # Padding after the l2norm: zero q/k/v with g = beta = 0 are identity steps, so the final state is unchanged.
    pad = (-T) % L
    n = (T + pad) // L

    def to_chunks(a):  # [B, T, H, ...] -> [B, H, n, L, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, n, L, H, *a.shape[3:]), 3, 1)

    q, k, v, g, beta = (to_chunks(a) for a in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk's start through each token
    lower = jnp.tril(jnp.ones((L, L), bool))
    # exp(cum_i - cum_j) for j <= i only; the inner where keeps the (unused) upper triangle from overflowing to inf,
    # which would turn gradients through the outer where into NaN.
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    # The UT system I + strictly_lower(beta_i k_i.k_j decay_ij). transformers passes the whole lower triangle with
    # unitriangular=True, which never reads the diagonal (beta_i |k_i|^2, not 1); it is set to 1 here as well, so
    # the result does not depend on whether a backend's solver honours unit_diagonal.
    strict = jnp.tril(jnp.ones((L, L), bool), -1)
    ut = jnp.where(strict, _einsum("bhnid,bhnjd->bhnij", k_beta, k) * decay, 0.0) + jnp.eye(L, dtype=jnp.float32)
    # One solve for both right-hand sides: the corrected values u and the decayed keys w that read the old state.
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    sol = solve_triangular(ut, rhs, lower=True, unit_diagonal=True)
    u, w = sol[..., :Dv], sol[..., Dv:]
    attn = _einsum("bhnid,bhnjd->bhnij", q, k) * decay  # intra-chunk, diagonal included (read after write)
    q_dec = q * jnp.exp(cum)[..., None]  # decay from the chunk's start (the old state's age)
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # decay from each token to the chunk's end
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, n]

    def step(S, xs):
        u_c, w_c, q_c, k_c, a_c, d_c = xs
        v_new = u_c - _einsum("bhlk,bhkv->bhlv", w_c, S)  # only what the old state does not already predict
        out = _einsum("bhlk,bhkv->bhlv", q_c, S) + _einsum("bhij,bhjv->bhiv", a_c, v_new)
        S = S * d_c[..., None, None] + _einsum("bhlk,bhlv->bhkv", k_c, v_new)
        return S, out

    chunk_major = [jnp.moveaxis(a, 2, 0) for a in (u, w, q_dec, k_dec, attn, chunk_decay)]
    S, out = jax.lax.scan(step, state.astype(jnp.float32), chunk_major)  # out [n, B, H, L, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, n * L, Dv)[:, :, :T]
    return jnp.swapaxes(out, 1, 2).astype(out_dtype), S
