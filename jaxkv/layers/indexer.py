"""DeepSeek-V3.2's lightning indexer as a layer: its queries, head weights and the key it caches per token.

The selection rule is `jaxkv.attention.indexer`'s; this module computes its inputs, as transformers'
`DeepseekV32Indexer` does (letters as in `jaxkv.shapes`; Hi = indexer heads, Di = indexer head dim, q_rank =
q_lora_rank, E = qk_rope_head_dim):

  q = index_wq q_latent            [B, T, Hi, Di]   from the normalized query latent the attention's wq_b reads
  k = LayerNorm(index_wk x)        [B, T, Di]       (eps 1e-6, with a bias): the one key per token that is cached
  w = index_weights x * Hi ** -0.5 [B, T, Hi]       float32

and rotates the first E columns of q and k by the layer's rotary angles (rotate-half pairs, not DeepSeek's
interleaved ones: transformers' indexer rotates halves, so its weights load as they are stored).

Parameters, all stored [out, in] as transformers stores them (small next to the attention's):
  index_wq [Hi * Di, q_rank], index_wk [Di, D], index_norm_scale [Di], index_norm_bias [Di], index_weights [Hi, D].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv.config import Config
from jaxkv.layers.linear import fan_in_init, linear
from jaxkv.layers.rope import apply_rope

NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6), whatever the config's norm eps


class Indexer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x, q_latent, rope):
        """x [B, T, D], q_latent [B, T, q_rank], rope (cos, sin) [B, T, E] -> (q [B, T, Hi, Di], weights float32
        [B, T, Hi], k [B, T, Di]); q and k in the model dtype."""
        cfg, m = self.config, self.config.mla
        ix, D, dtype = m.indexer, cfg.d_model, jnp.dtype(cfg.dtype)
        Hi, Di = ix.n_heads, ix.head_dim
        wq = self.param("index_wq", fan_in_init(m.q_lora_rank), (Hi * Di, m.q_lora_rank), dtype)
        wk = self.param("index_wk", fan_in_init(D), (Di, D), dtype)
        scale = self.param("index_norm_scale", nn.initializers.ones, (Di,), dtype)
        bias = self.param("index_norm_bias", nn.initializers.zeros, (Di,), dtype)
        ww = self.param("index_weights", fan_in_init(D), (Hi, D), dtype)

        q = linear(q_latent, wq, True).reshape(*x.shape[:2], Hi, Di)
        k = linear(x, wk, True).astype(jnp.float32)  # [B, T, Di]
        mean = jnp.mean(k, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(k - mean), axis=-1, keepdims=True)
        k = ((k - mean) * jax.lax.rsqrt(var + NORM_EPS) * scale.astype(jnp.float32)
             + bias.astype(jnp.float32)).astype(dtype)
        q = apply_rope(q, *rope)  # the angles are E wide: the first E columns rotate, the rest pass
        k = apply_rope(k[:, :, None], *rope)[:, :, 0]
        weights = linear(x, ww, True).astype(jnp.float32) * Hi ** -0.5
        return q, weights, k
