"""Gemma 4's per-layer inputs: one P-wide input per layer and token, from the token and its embedding."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxkv.config import Config
from jaxkv.layers import quantized
from jaxkv.layers.linear import fan_in_init, linear
from jaxkv.layers.norms import Norm


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer inputs [B, T, L, P] (`Config.per_layer_input_dim`; transformers' get_per_layer_inputs
    and project_per_layer_inputs): (norm(W x * D ** -0.5) + table[tokens] * sqrt(P)) * 2 ** -0.5, where x is the
    scaled token embeddings [B, T, D]; the scales are rounded to the dtype first, as transformers' are."""

    config: Config

    @nn.compact
    def __call__(self, tokens, x):
        cfg = self.config
        D, L, P, dtype = cfg.d_model, cfg.n_layers, cfg.per_layer_input_dim, jnp.dtype(cfg.dtype)
        B, T = tokens.shape
        table = self.param("embedding", fan_in_init(P), (cfg.vocab_size, L * P), dtype)
        from_tokens = quantized.rows(table, tokens, dtype) * jnp.asarray(P ** 0.5, dtype)
        w = self.param("projection", fan_in_init(D), (L * P, D), dtype)  # [out, in]
        projected = (linear(x, w, True) * jnp.asarray(D ** -0.5, dtype)).reshape(B, T, L, P)
        projected = Norm(cfg, dim=P, name="norm")(projected)
        return (projected + from_tokens.reshape(B, T, L, P)) * jnp.asarray(2 ** -0.5, dtype)


