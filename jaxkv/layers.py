"""Norms, rotary position embeddings and feed-forward blocks. Shapes use the letters of `jaxkv.shapes`."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import Config, RopeScaling


def fan_in_init(fan_in: int):
    """Normal(0, 1/sqrt(fan_in)): keeps activations O(1), so random models give varied tokens rather than one
    token repeated forever (which makes token-equality checks meaningless)."""
    return nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last axis, computed in float32 (bfloat16 loses too much in the mean of
    squares) and cast back to the input dtype."""

    config: Config

    @nn.compact
    def __call__(self, x):  # [..., D] -> [..., D]
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        scale = self.param("scale", nn.initializers.ones, (cfg.d_model,), dtype)
        xf = x.astype(jnp.float32)
        if cfg.norm_kind == "rmsnorm":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.norm_eps)
            return scale * y.astype(dtype)  # HF order: cast back, then scale
        bias = self.param("bias", nn.initializers.zeros, (cfg.d_model,), dtype)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + cfg.norm_eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """float32[H/2] inverse frequencies, computed on the host exactly as Hugging Face does (float32 throughout),
    so rotary angles match transformers bit for bit."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    # Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, a smooth ramp in between.
    low_wavelen = scaling.original_max_positions / scaling.low_freq_factor
    high_wavelen = scaling.original_max_positions / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_positions / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions, config: Config):
    """cos, sin: float32[B, T, H] for int32[B, T] positions. Computed from the positions on the fly: no table
    sized by the config's max_positions is ever allocated."""
    inv_freq = jnp.asarray(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates x [B, T, heads, H] by the angles (cos, sin [B, T, H]); halves convention (rotate_half), as in HF."""
    dtype = x.dtype
    cos, sin = cos[:, :, None, :].astype(dtype), sin[:, :, None, :].astype(dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# Weight matrices are stored [in, out] or [out, in], whichever made XLA:CPU's (jax 0.10) decode steps faster,
# measured on whole models (BUILD_NOTES.md, "Weight layout"): [out, in] (the layout of transformers and of jaxkv
# format 1) for matrices of 2**21 elements or more (a "medium" FFN's 1,024 x 2,816, and everything in larger
# models), [in, out] for smaller ones ("small": a batch-1 step 5% faster, batch 2-4 8-24%).
OUT_IN_ELEMENTS = 1 << 21


def stored_out_in(d_in: int, d_out: int, dtype="float32") -> bool:
    """Whether the weight of a d_in -> d_out projection in `dtype` is stored [out, in] (else [in, out])."""
    if jnp.dtype(dtype).itemsize < 4:
        return False
    return d_in * d_out >= OUT_IN_ELEMENTS


# Parameter leaf name -> the axes of its [out, in] form (PyTorch's Linear layout, and every jaxkv weight before
# format 2) in the order of its [in, out] layout: w_in_out = w_out_in.transpose(order). Which weights a config
# stores [in, out] is `in_out_names`; names not listed are the same in both.
OUT_IN_ORDER = {"wq": (2, 0, 1), "wk": (2, 0, 1), "wv": (2, 0, 1), "wo": (1, 2, 0), "w_gate": (1, 0), "w_up": (1, 0),
                "w_fc": (1, 0), "w_down": (1, 0)}


def in_out_names(config: Config) -> frozenset[str]:
    """The parameter names `config` stores [in, out] (the others in OUT_IN_ORDER: [out, in])."""
    D, F, NH = config.d_model, config.ffn_dim, config.n_heads * config.head_dim
    names, dtype = set(), config.dtype
    if not stored_out_in(D, NH, dtype):
        names |= {"wq", "wk", "wv", "wo"}
    if not stored_out_in(D, F, dtype):
        names |= {"w_gate", "w_up", "w_fc"}
    if not stored_out_in(F, D, dtype):
        names.add("w_down")
    return frozenset(names)


def linear(x, w, out_in: bool = False):
    """x [B, T, in] times w -> [B, T, out]; w is [in, out], or [out, in] with `out_in` (`stored_out_in`).

    Accumulates in float32 and rounds the result to x's dtype, as PyTorch's bfloat16 matmul does."""
    y = jnp.einsum("bti,oi->bto" if out_in else "bti,io->bto", x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


class Mlp(nn.Module):
    """SwiGLU (down(silu(x W_gate) * x W_up)) or GELU MLP (proj(gelu_tanh(x W_fc)))."""

    config: Config

    @nn.compact
    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        cfg = self.config
        D, F = cfg.d_model, cfg.ffn_dim
        dtype = jnp.dtype(cfg.dtype)

        def dense(name, x, d_in, d_out):
            out_in = stored_out_in(d_in, d_out, dtype)
            w = self.param(name, fan_in_init(d_in), (d_out, d_in) if out_in else (d_in, d_out), dtype)
            y = linear(x, w, out_in)
            if cfg.mlp_bias:
                y = y + self.param(name + "_bias", nn.initializers.zeros, (d_out,), dtype)
            return y

        if cfg.ffn_kind == "swiglu":
            h = nn.silu(dense("w_gate", x, D, F)) * dense("w_up", x, D, F)  # [B, T, F]
        else:
            h = nn.gelu(dense("w_fc", x, D, F), approximate=True)  # [B, T, F]
        return dense("w_down", h, F, D)
