"""Norms, rotary position embeddings and feed-forward blocks. Shapes use the letters of `jaxkv.shapes`."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import Config, LinearScaling, ProportionalRope, RopeScaling, YarnScaling, yarn_mscale


def fan_in_init(fan_in: int):
    """Normal(0, 1/sqrt(fan_in)): keeps activations O(1), so random models give varied tokens rather than one
    token repeated forever (which makes token-equality checks meaningless)."""
    return nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


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
    qk_rope_head_dim; `Config.layer_head_dim` per layer), with `layer`'s rope base and scaling (`Config.layer_rope`: Gemma 3's sliding layers have
    their own). Computed from the positions on the fly: no table sized by the config's max_positions is ever
    allocated. YaRN's attention factor is folded into both."""
    dim = config.layer_head_dim(layer) if config.mla is None else config.mla.qk_rope_head_dim
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
    """Rotates x [B, T, heads, H] by the angles (cos, sin [B, T, H]); halves convention (rotate_half), as in HF."""
    dtype = x.dtype
    cos, sin = cos[:, :, None, :].astype(dtype), sin[:, :, None, :].astype(dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# Weight matrices are stored [in, out] or [out, in], whichever made XLA:CPU's (jax 0.10) decode steps faster,
# measured on whole models (docs/design/families.md, "Weight layout"): [out, in] (the layout of transformers and
# of jaxkv format 1) for matrices of 2**21 elements or more (a "medium" FFN's 1,024 x 2,816, and everything in larger
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
# MLA's own projections (`jaxkv.mla_attention`; it shares wq [N, qk, D] and wo [D, N, v] above): wq_a [q_rank, D],
# wq_b [N, qk, q_rank], wkv_a [R + E, D]. Kept apart because only MLA configs have them (`jaxkv.sharding` reads
# ALL_OUT_IN_ORDER for its axes). The per-head up-projections wk_b [N, nope, R] and wv_b [N, v, R] are read by
# einsums, never by `linear`, and have one layout.
MLA_OUT_IN_ORDER = {"wq_a": (1, 0), "wq_b": (2, 0, 1), "wkv_a": (1, 0)}
ALL_OUT_IN_ORDER = {**OUT_IN_ORDER, **MLA_OUT_IN_ORDER}


def mla_out_in(config: Config) -> dict[str, bool]:
    """Each MLA projection's `stored_out_in`, decided by its own size."""
    m, D, N, dtype = config.mla, config.d_model, config.n_heads, config.dtype
    sizes = {"wq": (D, N * m.qk_head_dim), "wkv_a": (D, m.row_dim), "wo": (N * m.v_head_dim, D)}
    if m.q_lora_rank is not None:
        sizes |= {"wq_a": (D, m.q_lora_rank), "wq_b": (m.q_lora_rank, N * m.qk_head_dim)}
    return {name: stored_out_in(*size, dtype) for name, size in sizes.items()}


def in_out_names(config: Config) -> frozenset[str]:
    """The parameter names `config` stores [in, out] (the others in ALL_OUT_IN_ORDER: [out, in])."""
    D, F, NH = config.d_model, config.ffn_dim, config.n_heads * config.head_dim
    names, dtype = set(), config.dtype
    if config.mla is not None:
        names |= {name for name, out_in in mla_out_in(config).items() if not out_in}
    elif not stored_out_in(D, NH, dtype):
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
