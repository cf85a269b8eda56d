"""RoPE scalings a `jaxkv.Config` may hold (`rope_scaling`): Llama 3's frequency bands, linear interpolation,
Gemma 4's proportional (partial) rotation, YaRN. Frozen, hashable, validated on construction."""

from __future__ import annotations

import dataclasses
import math


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(f"invalid config: {message}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE (HF `rope_scaling` with `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __post_init__(self):
        _check(self.factor >= 1.0, f"rope_scaling.factor must be >= 1, got {self.factor}")
        _check(self.low_freq_factor > 0, f"rope_scaling.low_freq_factor must be > 0, got {self.low_freq_factor}")
        _check(
            self.high_freq_factor > self.low_freq_factor,
            f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
            f"({self.low_freq_factor})",
        )
        _check(
            self.original_max_positions >= 1,
            f"rope_scaling.original_max_positions must be >= 1, got {self.original_max_positions}",
        )


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Linear position interpolation (HF `rope_type: linear`, Gemma 3's global layers): every inverse frequency
    divided by `factor`."""

    factor: float

    def __post_init__(self):
        _check(isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 0,
               f"rope_scaling.factor must be a finite number > 0, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class ProportionalRope:
    """transformers' "proportional" rope type (Gemma 4's full-attention layers): only the first
    int(rotary_fraction * H // 2) frequency pairs rotate, with the ordinary inverse frequencies over the whole head
    (theta ** (-2i / H)); the remaining ones get frequency 0 (left unrotated). Every frequency is divided by
    `factor`. H is the layer's own head dim (`Config.layer_head_dim`)."""

    rotary_fraction: float
    factor: float = 1.0

    def __post_init__(self):
        _check(isinstance(self.rotary_fraction, (int, float)) and not isinstance(self.rotary_fraction, bool)
               and 0 < self.rotary_fraction <= 1,
               f"rope_scaling.rotary_fraction must be in (0, 1], got {self.rotary_fraction!r}")
        _check(isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 0,
               f"rope_scaling.factor must be a finite number > 0, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency scaling of RoPE (HF `rope_parameters` with `rope_type: yarn`, as DeepSeek-V2/V3 use it).

    Frequencies between the `beta_fast` and `beta_slow` rotation counts (over `original_max_positions`) ramp from
    kept to divided by `factor`; cos and sin are multiplied by the attention factor (`attention_factor`, else
    derived from `mscale` / `mscale_all_dim`: `layers.yarn_attention_factor`). An MLA model also multiplies its
    softmax scale by mscale(factor, mscale_all_dim) squared (`Config.attention_scale`)."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _check(self.factor >= 1.0, f"rope_scaling.factor must be >= 1, got {self.factor}")
        _check(self.original_max_positions >= 1,
               f"rope_scaling.original_max_positions must be >= 1, got {self.original_max_positions}")
        _check(self.beta_fast > 0 and self.beta_slow > 0,
               f"rope_scaling.beta_fast and beta_slow must be > 0, got {self.beta_fast}, {self.beta_slow}")
        _check(self.attention_factor is None or self.attention_factor > 0,
               f"rope_scaling.attention_factor must be > 0, got {self.attention_factor}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1), as transformers computes it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
