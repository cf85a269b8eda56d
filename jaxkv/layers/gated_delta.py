"""Gated DeltaNet, the "linear_attention" layers of hybrid models (Qwen3-Next, Qwen3.5), as a decoder layer's
token mixer: projections, the causal conv, the gated delta rule (`jaxkv.layers.delta_rule`), the gated norm, out.

Such a layer caches no keys or values. Per sequence it carries a fixed-size state in the cache
(`conv_states` / `recurrent_states` of a `KVCache` or a `PagedKVCache`, one row per sequence): the last Y - 1 inputs of its conv and the delta-rule state
[Hv, Dk, Dv], float32. A prompt (T > 1) runs the chunked form from the cached state; a decode step (T = 1) the
token-by-token one; both leave the state after the last token in the cache. The decode step is the Pallas kernel
`jaxkv.attention.delta_rule_kernel.recurrent_step` when the layer's attention implementation resolves to "pallas"
(`jaxkv.attention.api.resolve`, as the attention layers resolve theirs: "auto" is the kernel on GPU and TPU),
else `delta_rule.recurrent`; the prompt's chunked form has no kernel. Padding tokens (position < 0) are
zeroed at the input, as transformers zeroes them, and take an identity step (g = beta = 0): they never touch a
row's state, left padding (a contiguous cache's prompts) or right (a paged cache's: the conv keeps the window that
ends at the row's last real token). Letters as in `jaxkv.shapes`.

Parameters (every matrix [out, in], whatever the model's size: they are not in `layers.OUT_IN_ORDER`):
w_qkv [U, D] (query, key, value channels side by side, heads in order: Qwen3.5's in_proj_qkv), w_z [Hv*Dv, D]
(the output gate), w_b and w_a [Hv, D] (beta's and the decay's inputs), conv [U, Y], A_log and dt_bias [Hv],
gate_norm [Dv] (the gated RMSNorm's weight: plain, not zero-centred even where the model's norms are, so not
named "scale" as those are), w_out [D, Hv*Dv].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv.attention import api, delta_rule_kernel
from jaxkv.config import Config
from jaxkv.layers import delta_rule
from jaxkv.layers.linear import fan_in_init, linear
from jaxkv.layers.norms import Norm


class GatedDeltaNet(nn.Module):
    config: Config
    layer: int

    @nn.compact
    def __call__(self, x, cache, real, attention: str = "xla", step_states: bool = False):
        """x [B, T, D] (normed); cache: a `KVCache` holding this layer's state, or None (the no-cache reference:
        a fresh state, nothing stored); real bool[B, T] (false: a padding token); attention: the implementation
        name ("auto", "xla", "pallas"), deciding the decode step's form -> ([B, T, D], cache).

        step_states: (a speculative verify) the tokens run token by token (the recurrent form, as decode steps
        would) and the state after each one is sown as "intermediates" / "step_states": (conv [B, T, U, Y - 1],
        float32 [B, T, Hv, Dk, Dv]), from which the verify keeps the one after its last accepted token
        (`LayerStates.keep_step_states`)."""
        cfg, la = self.config, self.config.linear_attention
        D, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
        Hk, Hv, Dk, Dv, U, Y = (la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_dim,
                                la.conv_kernel)
        B, T = x.shape[:2]

        def weight(name, d_out, d_in):
            return self.param(name, fan_in_init(d_in), (d_out, d_in), dtype)

        x = jnp.where(real[..., None], x, jnp.zeros((), x.dtype))
        qkv = linear(x, weight("w_qkv", U, D), True)  # [B, T, U]
        z = linear(x, weight("w_z", Hv * Dv, D), True).reshape(B, T, Hv, Dv)
        b = linear(x, weight("w_b", Hv, D), True)  # [B, T, Hv]
        a = linear(x, weight("w_a", Hv, D), True)
        conv_w = self.param("conv", fan_in_init(Y), (U, Y), dtype)
        # transformers draws A from U(0.01, 16) and stores its log; dt_bias starts at ones
        A_log = self.param("A_log", lambda key, shape: jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16))
                           .astype(dtype), (Hv,))
        dt_bias = self.param("dt_bias", nn.initializers.ones, (Hv,), dtype)

        if cache is None:
            conv_state = jnp.zeros((B, U, Y - 1), dtype)
            state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
        else:
            conv_state, state = cache.state(self.layer)
        # The conv window after each row's last real token: a left-padded row's is its last (T), a right-padded
        # row's (paged prompts, a finished row's padding step) sits before its padding; no real token: kept.
        end = jnp.where(jnp.any(real, axis=1), T - jnp.argmax(real[:, ::-1], axis=1), 0).astype(jnp.int32)
        mixed, conv_state = delta_rule.causal_conv(qkv, conv_w, conv_state, end)
        q = mixed[..., :Hk * Dk].reshape(B, T, Hk, Dk)
        k = mixed[..., Hk * Dk:2 * Hk * Dk].reshape(B, T, Hk, Dk)
        v = mixed[..., 2 * Hk * Dk:].reshape(B, T, Hv, Dv)
        beta = nn.sigmoid(b)
        # float32, as transformers computes it (in float16 exp(A_log) could overflow to inf)
        g = -jnp.exp(A_log.astype(jnp.float32)) * nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        beta = jnp.where(real[..., None], beta, jnp.zeros((), beta.dtype))  # padding: the identity step
        g = jnp.where(real[..., None], g, 0.0)
        if step_states:
            out, states = delta_rule.recurrent(q, k, v, g, beta, state, every_state=True)
            old_conv = cache.state(self.layer)[0]
            self.sow("intermediates", "step_states", (delta_rule.conv_windows(qkv, old_conv), states))
            state = states[:, -1]  # (padding after a row's last real token is an identity step)
        elif T == 1 and cache is not None:
            # One state row per sequence in either cache, so the contiguous kind's resolution
            step = (delta_rule_kernel.recurrent_step if api.resolve(attention, "contiguous") == "pallas"
                    else delta_rule.recurrent)
            out, state = step(q, k, v, g, beta, state)
        else:
            out, state = delta_rule.chunked(q, k, v, g, beta, state, chunk=la.chunk)
        # transformers' RMSNormGated: x / rms(x) in float32, cast back (the weightless Norm), times the plain
        # weight, times silu(z) in float32, cast back
        out = Norm(cfg, dim=Dv, with_scale=False, name="gate_rms")(out) * self.param(
            "gate_norm", nn.initializers.ones, (Dv,), dtype)
        out = (out.astype(jnp.float32) * nn.silu(z.astype(jnp.float32))).astype(dtype)
        y = linear(out.reshape(B, T, Hv * Dv), weight("w_out", D, Hv * Dv), True)
        if cache is not None:
            cache = cache.with_state(self.layer, conv_state, state)
        return y, cache

