"""Norms over the last axis (RMSNorm and its Gemma variants, LayerNorm), computed in float32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv.config import Config


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last axis, computed in float32 (bfloat16 loses too much in the mean of
    squares) and cast back to the input dtype. config.norm_kind picks the kind; a norm of its own width (`dim`:
    MLA's latent norms, the q/k norms over a head) is never a LayerNorm. Without `with_scale` (Gemma 4's value
    norm) it has no weight: x / rms(x) in float32, cast back."""

    config: Config
    dim: int | None = None  # the normalized width; default D
    eps: float | None = None  # default config.norm_eps
    with_scale: bool = True

    @nn.compact
    def __call__(self, x):  # [..., D] -> [..., D]
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        eps = cfg.norm_eps if self.eps is None else self.eps
        gemma = cfg.norm_kind == "gemma_rmsnorm"
        xf = x.astype(jnp.float32)
        if not self.with_scale:
            return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dtype)
        # Gemma's weight is zero-centred (it multiplies by 1 + w): initialized to 0, as transformers does.
        init = nn.initializers.zeros if gemma else nn.initializers.ones
        scale = self.param("scale", init, (self.dim or cfg.d_model,), dtype)
        if cfg.norm_kind != "layernorm" or self.dim is not None:
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            if gemma:  # transformers' Gemma order: (1 + w) in float32, then cast back
                return (y * (1.0 + scale.astype(jnp.float32))).astype(dtype)
            if cfg.norm_kind == "rmsnorm_f32":  # Gemma 4: times w in float32, then cast back
                return (y * scale.astype(jnp.float32)).astype(dtype)
            return scale * y.astype(dtype)  # HF (Llama) order: cast back, then scale
        bias = self.param("bias", nn.initializers.zeros, (cfg.d_model,), dtype)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)
