"""Reading a Hugging Face config.json: typed, capped field reads (`Fields`) and the parsers families share (head
dim, eos ids, per-layer attention types, RoPE settings in transformers 5.x and 4.x spellings, YaRN).

Every error is a ValueError naming the source file and the field. The caps (MAX_*) are checked before anything is
built from a value: each is well beyond any released model of the supported families (largest: vocab 256k, hidden
16k, 126 layers), yet small enough that a corrupt or hostile config.json (vocab 10**12, 10**6 layers) is refused
with a message naming the field rather than attempting an allocation. The tensors must then match the config
exactly, so memory use is bounded by the checkpoint's own size.
"""

from __future__ import annotations

import math

from jaxkv.config import LinearScaling, RopeScaling, YarnScaling

MAX_VOCAB = 1 << 22
MAX_D_MODEL = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FFN = 1 << 20
MAX_EXPERTS = 1 << 14  # routed experts per layer (DeepSeek-V3: 256)
MAX_LEARNED_POSITIONS = 1 << 20  # GPT-2's n_positions sizes a table; RoPE's max_position_embeddings sizes nothing
MAX_PARAMS = 10 ** 12

# The rope types (`rope_type`) a family may use: those `jaxkv.layers.rope_inv_freq` reproduces. Llama, Mistral
# and Qwen2 keep the set they were parity-tested with; DeepSeek adds yarn.
ROPE_TYPES = ("default", "llama3")
NEWER_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # Qwen3, Gemma 2, Gemma 3's full-attention layers

LAYER_TYPES = ("full_attention", "sliding_attention")


class Fields:
    """Typed, capped reads of config.json fields; every error names the source file and the field."""

    def __init__(self, hf: dict, source: str, prefix: str = ""):
        # prefix: where `hf` sits in the file, e.g. "text_config." for a nested config; error messages name
        # fields with it
        self.hf, self.source, self.prefix = hf, source, prefix

    def fail(self, field: str, message: str):
        raise ValueError(f"{self.source}: field {self.prefix + field!r} {message}")

    def int(self, field: str, default=None, *, cap: int | None = None, required: bool = False) -> int | None:
        value = self.hf.get(field)
        if value is None:
            if required:
                self.fail(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(field, f"must be a positive integer, got {value!r}")
        if cap is not None and value > cap:
            self.fail(field, f"= {value} is beyond the supported maximum {cap}; the config is likely corrupt")
        return value

    def float(self, field: str, default: float) -> float:
        value = self.hf.get(field)
        return default if value is None else self.number(field, value)

    def number(self, field: str, value) -> float:
        """`value` (read by the caller, e.g. from a nested object) as a finite float."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, got {value!r}")
        return float(value)

    def bool(self, field: str, default: bool) -> bool:
        value = self.hf.get(field, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, got {value!r}")
        return value

    def str(self, field: str, default: str) -> str:
        value = self.hf.get(field)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(field, f"must be a string, got {value!r}")
        return value

    def positive(self, field: str, default: float | None) -> float | None:
        """A number > 0, or None where the field is null; `default` where it is absent."""
        value = self.hf[field] if field in self.hf else default
        if value is None:
            return None
        value = self.number(field, value)
        if value <= 0:
            self.fail(field, f"must be > 0 (or null), got {value}")
        return value

    def text_config(self) -> Fields:
        """The language model's config nested in a multimodal one (Gemma 3 / 4: `text_config`)."""
        text = self.hf.get("text_config")
        if not isinstance(text, dict):
            self.fail("text_config", f"must be an object holding the language model's config, got {text!r}")
        return Fields(text, self.source, prefix=self.prefix + "text_config.")


def eos_ids(fields: Fields, vocab_size: int) -> tuple[int, ...]:
    """config.json's `eos_token_id` (an int or a list) as Config.eos_ids."""
    value = fields.hf.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            fields.fail("eos_token_id", f"must be token ids in [0, {vocab_size}) (vocab_size), got {value!r}")
    return tuple(ids)


def head_dim(fields: Fields, d_model: int, n_heads: int, field: str = "head_dim") -> int:
    """`head_dim` when present, else hidden_size // num_attention_heads (Llama, Mistral, Qwen2's rule)."""
    value = fields.int(field, cap=MAX_HEAD_DIM)
    if value is None:
        if d_model % n_heads:
            fields.fail(field, f"is missing and hidden size {d_model} is not divisible by {n_heads} heads")
        value = d_model // n_heads
    return value


def silu(fields: Fields, field: str = "hidden_act"):
    """Refuses an activation other than SiLU, the only one jaxkv's SwiGLU MLP (and experts) computes."""
    act = fields.str(field, "silu")
    if act not in ("silu", "swish"):
        fields.fail(field, f"= {act!r} is not supported; jaxkv's SwiGLU MLP uses silu")


def check_layer_types(f: Fields, types, n_layers: int):
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
        f.fail("layer_types", f"must list 'full_attention' or 'sliding_attention' for each of the {n_layers} "
                              f"layers, got {types!r}")


def jaxkv_layer_types(types: list[str], window: int | None) -> tuple[tuple[str, ...] | None, int | None]:
    """(Config.layer_types, Config.sliding_window) of Hugging Face's per-layer types: no layer_types when every
    layer is alike (one window on all of them, or none)."""
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {False}:
        return None, None
    if sliding == {True}:
        return None, window
    return tuple(types), window


def rope(f: Fields, max_positions: int, *, types: tuple[str, ...] = ROPE_TYPES,
         default_theta: float | None = None,
         partial: bool = False) -> tuple[float, RopeScaling | LinearScaling | YarnScaling | None]:
    """(rope_theta, scaling or None), from either transformers 5.x's `rope_parameters` (which holds rope_theta and
    rope_type together) or the 4.x top-level `rope_theta` + `rope_scaling` (type under "type" or "rope_type").
    `types`: the rope types accepted; `default_theta`: the family's base where the file gives none (10000);
    `partial`: the family reads partial_rotary_factor itself (`partial_rotary_dim`), else it must be 1."""
    params = f.hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = f.hf.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        f.fail(field, f"must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        f.fail(field, "holds per-layer-type RoPE settings, which jaxkv does not support")
    theta = f.hf.get("rope_theta")
    return rope_entry(f, field, params, max_positions, types, default_theta if theta is None else theta, partial)


def partial_rotary_dim(f: Fields, head_dim: int) -> int | None:
    """Config.rotary_dim from partial_rotary_factor (in rope_parameters, or top-level in 4.x files), as
    transformers computes it: int(head_dim * factor); None when the whole head rotates."""
    factor = rotary_factor(f, f.hf.get("rope_parameters") or f.hf.get("rope_scaling") or {})
    factor = f.number("partial_rotary_factor", 1.0 if factor is None else factor)
    if not 0 < factor <= 1:
        f.fail("partial_rotary_factor", f"must be in (0, 1], got {factor}")
    dim = int(head_dim * factor)
    if dim == head_dim:
        return None
    if dim < 2 or dim % 2:
        f.fail("partial_rotary_factor", f"= {factor} rotates {dim} of {head_dim} head dims: must be even and >= 2")
    return dim


def rotary_factor(f: Fields, params: dict):
    """partial_rotary_factor as given: in the rope settings `params`, else top level (4.x files), else 1."""
    return params.get("partial_rotary_factor", f.hf.get("partial_rotary_factor", 1.0))


def rope_entry(f: Fields, field: str, params: dict, max_positions: int, types: tuple[str, ...],
               default_theta=None,
               partial: bool = False) -> tuple[float, RopeScaling | LinearScaling | YarnScaling | None]:
    """One rope settings object (`field` names it in errors): (theta, scaling or None)."""
    theta = params.get("rope_theta", default_theta)
    theta = 10000.0 if theta is None else f.number(f"{field}.rope_theta", theta)
    if theta <= 0:
        f.fail(f"{field}.rope_theta", f"must be > 0, got {theta}")
    factor = rotary_factor(f, params)
    if factor != 1.0 and not partial:
        f.fail("partial_rotary_factor", f"= {factor!r} is not supported (jaxkv rotates the whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in types:
        f.fail(f"{field}.rope_type", f"= {rope_type!r} is not supported; supported: "
                                     f"{', '.join(repr(t) for t in types)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, yarn(f, field, params, max_positions)

    def number(key):
        if params.get(key) is None:
            f.fail(f"{field}.{key}", f"is missing (required by rope_type {rope_type!r})")
        return f.number(f"{field}.{key}", params[key])

    try:
        if rope_type == "linear":  # transformers: every inverse frequency divided by factor
            return theta, LinearScaling(factor=number("factor"))
        original = params.get("original_max_position_embeddings", max_positions)  # transformers' fallback
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            f.fail(f"{field}.original_max_position_embeddings", f"must be a positive integer, got {original!r}")
        return theta, RopeScaling(factor=number("factor"), low_freq_factor=number("low_freq_factor"),
                                  high_freq_factor=number("high_freq_factor"), original_max_positions=original)
    except ValueError as e:
        if str(e).startswith(f.source):  # already names the field
            raise
        raise ValueError(f"{f.source}: field {f.prefix + field!r}: {e}") from None


def yarn(f: Fields, field: str, params: dict, max_positions: int) -> YarnScaling:
    """YaRN settings as transformers 5.24 reads them (`_compute_yarn_parameters`, `yarn_apply_mscale`)."""
    original = params.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        f.fail(f"{field}.original_max_position_embeddings", f"must be a positive integer (required by rope_type "
                                                            f"'yarn'), got {original!r}")

    def number(key, default=None):
        value = params.get(key)
        return default if value is None else f.number(f"{field}.{key}", value)

    # A missing factor is the ratio of the context lengths; a missing (or 0) beta is transformers' default.
    factor = number("factor", max_positions / original)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        f.fail(f"{field}.truncate", f"must be true or false, got {truncate!r}")
    try:
        return YarnScaling(factor=factor, original_max_positions=original, beta_fast=number("beta_fast") or 32.0,
                           beta_slow=number("beta_slow") or 1.0, mscale=number("mscale"),
                           mscale_all_dim=number("mscale_all_dim"), attention_factor=number("attention_factor"),
                           truncate=truncate)
    except ValueError as e:
        raise ValueError(f"{f.source}: field {f.prefix + field!r}: {e}") from None
