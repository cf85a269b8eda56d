"""The model config: one frozen, hashable dataclass for a decoder-only transformer.

The config is a static argument of every jitted function, so it must be hashable and immutable; every field is a
plain Python value (tuples, not lists). It is validated on construction so a bad value fails with a clear message
before any array is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

FfnKind = Literal["swiglu", "gelu"]
NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned"]

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "xla", "pallas")


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
class Config:
    """A decoder-only transformer.

    Attributes:
      vocab_size: V, number of token ids.
      d_model: D, width of the residual stream.
      n_layers: L.
      n_heads: N, query heads.
      n_kv_heads: K, key/value heads. N == K is MHA, K == 1 is MQA, anything between that divides N is GQA.
      head_dim: H; defaults to d_model // n_heads but may differ (then the attention width N*H != D).
      ffn_dim: F, hidden width of the feed-forward block.
      ffn_kind: "swiglu" (Llama family: down(silu(gate x) * up x)) or "gelu" (GPT-2: proj(gelu_tanh(fc x))).
      norm_kind: "rmsnorm" or "layernorm"; norm_eps its epsilon.
      positions: "rope" (rotary, `rope_theta`, optional `rope_scaling`) or "learned" (an absolute position table
        of `max_positions` rows).
      qkv_bias: bias on the q, k and v projections (Qwen2, GPT-2). out_bias / mlp_bias: on the attention output
        projection / the FFN linears (GPT-2).
      tie_embeddings: the output head reuses the token embedding.
      max_positions: the largest position id + 1 the model supports.
      sliding_window: if set, a token attends only to the `sliding_window` most recent tokens, itself included.
      eos_ids: default stop tokens for `generate`.
      dtype: parameter and activation dtype; softmax, norms and logits are computed in float32 whatever it is.
      attention: default attention implementation: "auto" (Pallas on GPU/TPU, XLA on CPU), "xla" or "pallas".
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int | None = None
    ffn_kind: FfnKind = "swiglu"
    norm_kind: NormKind = "rmsnorm"
    norm_eps: float = 1e-5
    positions: PositionKind = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    max_positions: int = 4096
    sliding_window: int | None = None
    eos_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    attention: str = "auto"

    def __post_init__(self):
        # Fill the derived defaults first (frozen: go through object.__setattr__), then validate everything.
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and self.n_heads > 0 and self.d_model % max(self.n_heads, 1) == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.d_model)
        if isinstance(self.eos_ids, int):
            object.__setattr__(self, "eos_ids", (self.eos_ids,))
        else:
            object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        self._validate()

    def _validate(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_positions"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"{name} must be a positive integer, got {value!r}")
        _check(self.head_dim is not None,
               f"head_dim must be given when d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads})")
        _check(isinstance(self.head_dim, int) and self.head_dim >= 1,
               f"head_dim must be a positive integer, got {self.head_dim!r}")
        _check(self.n_kv_heads <= self.n_heads,
               f"n_kv_heads ({self.n_kv_heads}) must not exceed n_heads ({self.n_heads})")
        _check(self.n_heads % self.n_kv_heads == 0,
               f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        _check(self.ffn_kind in ("swiglu", "gelu"), f"ffn_kind must be 'swiglu' or 'gelu', got {self.ffn_kind!r}")
        _check(self.norm_kind in ("rmsnorm", "layernorm"),
               f"norm_kind must be 'rmsnorm' or 'layernorm', got {self.norm_kind!r}")
        _check(self.norm_eps > 0 and math.isfinite(self.norm_eps), f"norm_eps must be > 0, got {self.norm_eps}")
        _check(self.positions in ("rope", "learned"),
               f"positions must be 'rope' or 'learned', got {self.positions!r}")
        if self.positions == "rope":
            _check(self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")
            _check(self.rope_theta > 0 and math.isfinite(self.rope_theta),
                   f"rope_theta must be > 0, got {self.rope_theta}")
        else:
            _check(self.rope_scaling is None, "rope_scaling is set but positions is 'learned'")
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
               f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        _check(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window >= 1),
               f"sliding_window must be None or a positive integer, got {self.sliding_window!r}")
        for i in self.eos_ids:
            _check(0 <= i < self.vocab_size, f"eos id {i} is outside the vocabulary [0, {self.vocab_size})")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.attention in ATTENTION_IMPLS,
               f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")

    # Derived sizes --------------------------------------------------------------------------------------------

    @property
    def group_size(self) -> int:
        """G = N // K: query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes per element."""
        if bytes_per_element is None:
            bytes_per_element = 4 if self.dtype == "float32" else 2
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element

    def param_count(self) -> int:
        D, H, N, K, F, V = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads, self.ffn_dim, self.vocab_size
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.qkv_bias:
            attn += N * H + 2 * K * H
        if self.out_bias:
            attn += D
        ffn = (3 if self.ffn_kind == "swiglu" else 2) * D * F
        if self.mlp_bias:
            ffn += (2 * F if self.ffn_kind == "swiglu" else F) + D
        norm = D if self.norm_kind == "rmsnorm" else 2 * D
        total = self.n_layers * (attn + ffn + 2 * norm) + norm + V * D
        if not self.tie_embeddings:
            total += D * V
        if self.positions == "learned":
            total += self.max_positions * D
        return total

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(f"invalid config: {message}")


# Presets used by tests, scripts and benchmarks. "small" and "medium" are the benchmark configs of issue 4.
PRESETS: dict[str, Config] = {
    "test-tiny": Config(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        max_positions=4096),
    "small": Config(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408,
                    max_positions=4096),
    "medium": Config(vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                     max_positions=4096),
}
