"""The dense feed-forward block (SwiGLU, GeGLU or GELU) and the FFN's activation."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxkv.config import Config
from jaxkv.layers.linear import fan_in_init, linear, stored_out_in


class Mlp(nn.Module):
    """SwiGLU (down(silu(x W_gate) * x W_up)), GeGLU (down(gelu_tanh(x W_gate) * x W_up)) or GELU MLP
    (proj(gelu_tanh(x W_fc))), of width `dim` (default config.ffn_dim; `Config.layer_ffn_dim`)."""

    config: Config
    dim: int | None = None

    @nn.compact
    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        cfg = self.config
        D, F = cfg.d_model, self.dim or cfg.ffn_dim
        dtype = jnp.dtype(cfg.dtype)

        def dense(name, x, d_in, d_out):
            # The layout follows the config's ffn_dim whatever this layer's width, as `in_out_names` says (one
            # layout per parameter name)
            out_in = stored_out_in(D, cfg.ffn_dim, dtype)
            w = self.param(name, fan_in_init(d_in), (d_out, d_in) if out_in else (d_in, d_out), dtype)
            y = linear(x, w, out_in)
            if cfg.mlp_bias:
                y = y + self.param(name + "_bias", nn.initializers.zeros, (d_out,), dtype)
            return y

        if cfg.ffn_kind == "swiglu":
            h = nn.silu(dense("w_gate", x, D, F)) * dense("w_up", x, D, F)  # [B, T, F]
        elif cfg.ffn_kind == "geglu":  # Gemma: gelu_pytorch_tanh on the gate
            h = nn.gelu(dense("w_gate", x, D, F), approximate=True) * dense("w_up", x, D, F)
        else:
            h = nn.gelu(dense("w_fc", x, D, F), approximate=True)  # [B, T, F]
        return dense("w_down", h, F, D)


def activation(config: Config, x):
    """The FFN's activation (silu for SwiGLU, tanh GELU otherwise), for Gemma 4's per-layer input gate."""
    return nn.silu(x) if config.ffn_kind == "swiglu" else nn.gelu(x, approximate=True)
