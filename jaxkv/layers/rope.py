"""Rotary position embeddings: inverse frequencies as Hugging Face computes them (plain, linear, Llama 3.1, YaRN,
proportional), the angles of a batch of positions, and the rotation (halves convention)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxkv.config import Config, LinearScaling, ProportionalRope, RopeScaling, YarnScaling, yarn_mscale


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: RopeScaling | LinearScaling | YarnScaling | ProportionalRope | None) -> np.ndarray:
    """float32[H/2] inverse frequencies, computed on the host exactly as Hugging Face does (float32 throughout),
    so rotary angles match transformers bit for bit."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    if isinstance(scaling, LinearScaling):  # transformers: inv_freq /= factor, in float32
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if isinstance(scaling, ProportionalRope):
        # transformers' _compute_proportional_rope_parameters: int(fraction * H // 2) rotated pairs, the rest at
        # frequency 0 (cos 1, sin 0: unrotated), then everything / factor
        rotated = int(scaling.rotary_fraction * head_dim // 2)
        inv_freq = np.where(np.arange(head_dim // 2) < rotated, inv_freq, np.float32(0)).astype(np.float32)
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
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


def _yarn_inv_freq(dim: int, theta: float, y: YarnScaling) -> np.ndarray:
    """transformers' `_compute_yarn_parameters` (5.24), float32 where it is: each frequency is a blend of itself
    (extrapolation) and itself / factor (interpolation), ramping between the dimensions that make `beta_fast` and
    `beta_slow` rotations over the original context."""
    def correction_dim(rotations):
        return dim * math.log(y.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(y.factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def yarn_attention_factor(y: YarnScaling) -> float:
    """What YaRN multiplies cos and sin by: `attention_factor` if given, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set, else mscale(factor) (transformers' rule)."""
    if y.attention_factor is not None:
        return y.attention_factor
    if y.mscale and y.mscale_all_dim:
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return yarn_mscale(y.factor)


def rope_angles(positions, config: Config, layer: int = 0):
    """cos, sin: float32[B, T, H] for int32[B, T] positions (H: the rotated width, an MLA model's
    qk_rope_head_dim; `Config.layer_head_dim` per layer), with `layer`'s rope base and scaling
    (`Config.layer_rope`: Gemma 3's sliding layers have their own). Computed from the positions on the fly: no table sized by the config's max_positions is ever
    allocated. YaRN's attention factor is folded into both."""
    dim = config.layer_head_dim(layer) if config.mla is None else config.mla.qk_rope_head_dim
    if config.rotary_dim is not None:  # partial rotation (Qwen3-Next): the first rotary_dim of each head
        dim = config.rotary_dim
    theta, scaling = config.layer_rope(layer)
    inv_freq = jnp.asarray(rope_inv_freq(dim, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if isinstance(scaling, YarnScaling):
        factor = jnp.float32(yarn_attention_factor(scaling))
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply_rope(x, cos, sin):
    """Rotates x [B, T, heads, H] by the angles (cos, sin [B, T, H]); halves convention (rotate_half), as in HF.
    Angles narrower than the head (`Config.rotary_dim`) rotate its first dims only; the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    dtype = x.dtype
    cos, sin = cos[:, :, None, :].astype(dtype), sin[:, :, None, :].astype(dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
