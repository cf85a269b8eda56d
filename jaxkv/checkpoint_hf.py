"""Loads a local Hugging Face checkpoint directory (config.json + safetensors weights) into a `jaxkv.Model`.

Only safetensors is read, through `safetensors.safe_open(framework="numpy")`: never pickle, so a checkpoint cannot
run code. The loader works in two phases so that a bad checkpoint fails with a clear `ValueError` or
`FileNotFoundError` (naming the file, tensor or config field) before anything large is allocated:

  1. Plan (small reads only): parse config.json into a `jaxkv.Config` (with caps on every size), derive the exact
     list of tensors and shapes that config implies, and read the safetensors headers (names, shapes, dtypes;
     `safe_open` reads only the header and checks that the file covers every tensor's byte range, so a truncated
     file is caught here). Every expected tensor must be present with the expected shape, and every tensor
     present must be expected or a known redundant one.
  2. Load: read one tensor at a time, convert it to jaxkv's layout, cast it, and put it on the device.

Per-architecture name mapping (HF name, after the base-model prefix `model.` / `transformer.`; letters as in
`jaxkv.shapes`; `{i}` is the layer; paths are into `Model.params`). The table gives each matrix in its [out, in]
form; the loader then transposes those the config stores [in, out] (`jaxkv.layers.in_out_names`,
`OUT_IN_ORDER`: wq [D, N, H], wo [N, H, D], w_gate [D, F], ...; embeddings and lm_head stay [V, D]):

  Llama / Mistral / Qwen2 (torch nn.Linear weights are [out, in])
    embed_tokens.weight                  [V, D]    -> embedding                      as is
    layers.{i}.input_layernorm.weight    [D]       -> layer_{i}/attn_norm/scale      as is
    layers.{i}.post_attention_layernorm.weight [D] -> layer_{i}/mlp_norm/scale       as is
    layers.{i}.self_attn.q_proj.weight   [N*H, D]  -> layer_{i}/attn/wq [N, H, D]    reshape
    layers.{i}.self_attn.k_proj.weight   [K*H, D]  -> layer_{i}/attn/wk [K, H, D]    reshape
    layers.{i}.self_attn.v_proj.weight   [K*H, D]  -> layer_{i}/attn/wv [K, H, D]    reshape
    layers.{i}.self_attn.{q,k,v}_proj.bias [N*H | K*H] -> layer_{i}/attn/w{q,k,v}_bias [N | K, H]  reshape
                                                     (Qwen2 always; Llama with attention_bias)
    layers.{i}.self_attn.o_proj.weight   [D, N*H]  -> layer_{i}/attn/wo [D, N, H]    reshape
    layers.{i}.self_attn.o_proj.bias     [D]       -> layer_{i}/attn/wo_bias         (Llama with attention_bias)
    layers.{i}.mlp.gate_proj.weight      [F, D]    -> layer_{i}/mlp/w_gate           as is
    layers.{i}.mlp.up_proj.weight        [F, D]    -> layer_{i}/mlp/w_up             as is
    layers.{i}.mlp.down_proj.weight      [D, F]    -> layer_{i}/mlp/w_down           as is
    layers.{i}.mlp.{gate,up,down}_proj.bias        -> layer_{i}/mlp/w_{gate,up,down}_bias  (Llama with mlp_bias)
    norm.weight                          [D]       -> final_norm/scale               as is
    lm_head.weight (no prefix)           [V, D]    -> lm_head                        as is (untied only)

  Qwen3: Llama's table (attention_bias: q, k, v and o biases, as Llama's), plus each head's query and key norm
    layers.{i}.self_attn.q_norm.weight   [H]       -> layer_{i}/attn/q_norm/scale    as is
    layers.{i}.self_attn.k_norm.weight   [H]       -> layer_{i}/attn/k_norm/scale    as is

  Gemma 2 / Gemma 3: Llama's table for embeddings, attention (attention_bias as Llama's), MLP (GeGLU), final norm
  and head, but four zero-centred norms per layer (stored as is: the model scales by 1 + w), and Gemma 3's q/k
  norms as Qwen3's
    layers.{i}.input_layernorm.weight            [D] -> layer_{i}/attn_norm/scale
    layers.{i}.post_attention_layernorm.weight   [D] -> layer_{i}/post_attn_norm/scale   (the attention output's)
    layers.{i}.pre_feedforward_layernorm.weight  [D] -> layer_{i}/mlp_norm/scale
    layers.{i}.post_feedforward_layernorm.weight [D] -> layer_{i}/post_mlp_norm/scale    (the MLP output's)
  Gemma3ForConditionalGeneration: the same names under `language_model.model.` (Google's releases, and what
  transformers 5.24's save_pretrained writes; untied head `language_model.lm_head.weight`) or
  `model.language_model.` (transformers 5's module names; head `lm_head.weight`). Its vision tower and multimodal
  projector (`vision_tower.*`, `multi_modal_projector.*`, with or without `model.`) are skipped by name: jaxkv
  runs the language model only, on token ids.

  Gemma 4 (`_gemma4_specs`): Gemma 3's norms and MLP names (norm weights scale by w, not 1 + w: `rmsnorm_f32`);
  H and K per layer (`Config.layer_head_dim` / `layer_kv_heads`: the full layers' own), F per layer (double-wide
  on the K/V-sharing layers), P the per-layer input width
    embed_tokens_per_layer.weight        [V, L*P]  -> per_layer_inputs/embedding         as is
    per_layer_model_projection.weight    [L*P, D]  -> per_layer_inputs/projection        as is
    per_layer_projection_norm.weight     [P]       -> per_layer_inputs/norm/scale        as is
    layers.{i}.layer_scalar              [1]       -> layer_{i}/layer_scalar             as is
    layers.{i}.per_layer_input_gate.weight [P, D]  -> layer_{i}/ple_gate                 as is
    layers.{i}.per_layer_projection.weight [D, P]  -> layer_{i}/ple_proj                 as is
    layers.{i}.post_per_layer_input_norm.weight [D] -> layer_{i}/post_ple_norm/scale     as is
    layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm: as Gemma 3's, except that a K/V-sharing layer has no
      k_proj / v_proj / k_norm (transformers ignores them if present, and so does the loader) and a full layer
      with attention_k_eq_v no v_proj
  Gemma4ForConditionalGeneration: the same names under `model.language_model.` (transformers 5.24's save_pretrained
  and module names; head `lm_head.weight`) or `language_model.model.` (head `language_model.lm_head.weight`);
  `vision_tower.*`, `audio_tower.*`, `embed_vision.*`, `embed_audio.*` (with or without `model.`) are skipped.

  GPT-2 (Conv1D weights are [in, out]: every matrix is transposed to the [out, in] form, then back)
    wte.weight                           [V, D]    -> embedding                      as is
    wpe.weight                   [n_positions, D]  -> pos_embedding                  as is
    h.{i}.ln_1.{weight,bias}             [D]       -> layer_{i}/attn_norm/{scale,bias}
    h.{i}.ln_2.{weight,bias}             [D]       -> layer_{i}/mlp_norm/{scale,bias}
    h.{i}.attn.c_attn.weight             [D, 3*D]  -> layer_{i}/attn/w{q,k,v} [N, H, D]  split q|k|v, transpose, reshape
    h.{i}.attn.c_attn.bias               [3*D]     -> layer_{i}/attn/w{q,k,v}_bias [N, H] split q|k|v, reshape
    h.{i}.attn.c_proj.weight             [D, D]    -> layer_{i}/attn/wo [D, N, H]    transpose, reshape
    h.{i}.attn.c_proj.bias               [D]       -> layer_{i}/attn/wo_bias
    h.{i}.mlp.c_fc.{weight,bias}         [D, F], [F] -> layer_{i}/mlp/w_fc [F, D], w_fc_bias  transpose
    h.{i}.mlp.c_proj.{weight,bias}       [F, D], [D] -> layer_{i}/mlp/w_down [D, F], w_down_bias  transpose
    ln_f.{weight,bias}                   [D]       -> final_norm/{scale,bias}
    lm_head.weight (no prefix)           [V, D]    -> lm_head                        as is (untied only)

  DeepSeek-V2 / V3 (multi-head latent attention, `jaxkv.mla_attention`; qk = qk_nope + E; norms, embeddings,
  lm_head and dense MLPs as for Llama; mixture-of-experts layers: `_deepseek_ffn_specs`)
    layers.{i}.self_attn.q_proj.weight   [N*qk, D]        -> layer_{i}/attn/wq [N, qk, D]       reshape, rope rows*
    layers.{i}.self_attn.q_a_proj.weight [q_lora_rank, D] -> layer_{i}/attn/wq_a                as is (q_lora_rank)
    layers.{i}.self_attn.q_a_layernorm.weight              -> layer_{i}/attn/q_norm/scale        as is (q_lora_rank)
    layers.{i}.self_attn.q_b_proj.weight [N*qk, q_lora_rank] -> layer_{i}/attn/wq_b [N, qk, q_lora_rank]  rope rows*
    layers.{i}.self_attn.kv_a_proj_with_mqa.weight [R+E, D] -> layer_{i}/attn/wkv_a             rope rows*
    layers.{i}.self_attn.kv_a_layernorm.weight [R]         -> layer_{i}/attn/kv_norm/scale       as is
    layers.{i}.self_attn.kv_b_proj.weight [N*(qk_nope+v), R] -> layer_{i}/attn/wk_b [N, qk_nope, R], wv_b [N, v, R]
    layers.{i}.self_attn.o_proj.weight   [D, N*v]         -> layer_{i}/attn/wo [D, N, v]        reshape
    with attention_bias: q_a_proj.bias, kv_a_proj_with_mqa.bias (rope rows*), o_proj.bias -> wq_a_bias, wkv_a_bias,
    wo_bias.  * DeepSeek rotates interleaved pairs (V2 always, V3 unless rope_interleave is false): each head's E
    rotary output rows are reordered evens-then-odds on load, which turns that rotation into jaxkv's rotate-half.
  their mixture-of-experts layers (i >= first_k_dense_replace; `jaxkv.moe`; X experts of width I, J = n_shared * I)
    layers.{i}.mlp.gate.weight           [X, D]    -> layer_{i}/mlp/router            as is, kept float32
    layers.{i}.mlp.gate.e_score_correction_bias [X] -> layer_{i}/mlp/router_bias     as is, kept float32 (V3)
    layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight [J, D], [J, D], [D, J] -> layer_{i}/mlp/ws_{gate,up,down}
    layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight [I, D], down_proj.weight [D, I]  (DeepSeek's releases and
        transformers 5.24's save_pretrained) -> layer_{i}/mlp/we_{gate,up} [X, I, D], we_down [X, D, I]  stacked
    or layers.{i}.mlp.experts.gate_up_proj [X, 2*I, D], down_proj [X, D, I] (transformers 5's in-memory form)
        -> the same                                                               gate rows, then up rows

Redundant tensors that are dropped: `lm_head.weight` of a tied model (only after checking that it equals the
embedding), rotary `inv_freq` buffers of the Llama family (jaxkv computes RoPE on the fly), and GPT-2's
`attn.bias` / `attn.masked_bias` causal-mask buffers; skipped by design: Gemma 3's vision tower and projector
(above). Any other unused tensor is an error: it most likely means the architecture is mis-mapped.

Also from config.json: `eos_token_id` (int or list) becomes Config.eos_ids. Weights keep the checkpoint's dtype
unless `load_hf(..., dtype=...)` casts them; Config.dtype always records the params' dtype.

Gemma and Qwen3 configs are read as transformers 5.24 reads them (`_gemma_fields`, `_llama_family_fields`):
  - per-layer attention: `layer_types` ("sliding_attention" / "full_attention"), else transformers' default:
    Gemma 2 alternates (sliding first), Gemma 3 has every `sliding_window_pattern`-th (6) layer full, Qwen2 and
    Qwen3 slide the layers >= max_window_layers when use_sliding_window is set. All-alike layers map to
    Config.layer_types None; `sliding_window` maps unchanged (see the Mistral note in `_llama_family_fields`).
  - Gemma 3's rope per layer type (`rope_parameters.full_attention` / `.sliding_attention`, or 4.x's rope_theta,
    rope_local_base_freq and rope_scaling, the last for the full layers only): the full layers' base and scaling
    become rope_theta / rope_scaling (rope types default, linear, llama3, yarn), the sliding layers' base
    rope_local_theta (their rope type must be default).
  - Gemma's omitted fields take Gemma2Config / Gemma3TextConfig's defaults (Google's Gemma 3 configs rely on them);
    Gemma3ForConditionalGeneration reads `text_config`, with tie_word_embeddings and eos_token_id (when set) from
    the outer config.
  - transformers 5.24 ignores two Gemma 3 fields, and so does the mapping (parity is with transformers):
    attn_logit_softcapping (Gemma3Attention never passes it on; Gemma 2's is Config.attn_logit_softcap) and, for
    Gemma3ForConditionalGeneration only, final_logit_softcapping (Gemma3ForCausalLM applies it).
  - refused: use_bidirectional_attention, a hidden_activation other than gelu_pytorch_tanh (or gelu_new, the same
    tanh approximation), rope types other than the above, a null sliding_window with sliding layers.  - Gemma 4 (`_gemma4_fields`): per_layer_config (or global_head_dim / num_global_key_value_heads) for the full
    layers' geometry, rope_parameters per layer type (full: default or proportional; sliding: default), the last
    layer forced to full attention as transformers does; refused: enable_moe_block (its MoE block does not map
    onto `jaxkv.moe`), any use_bidirectional_attention, vocab_size_per_layer_input != vocab_size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy, so safe_open(framework="numpy") can read BF16)
import numpy as np
import safetensors
from safetensors import safe_open

from jaxkv import checkpoint_fp8
from jaxkv import moe as moe_lib
from jaxkv.config import (DTYPES, Config, LinearScaling, Mla, MoeConfig, ProportionalRope, RopeScaling,
                          YarnScaling)
from jaxkv.layers import ALL_OUT_IN_ORDER, in_out_names
from jaxkv.model import Model

LLAMA, MISTRAL, QWEN2, GPT2 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"
DEEPSEEK_V2, DEEPSEEK_V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
DEEPSEEK = (DEEPSEEK_V2, DEEPSEEK_V3)
QWEN3 = "Qwen3ForCausalLM"
# model_type gemma2, gemma3_text, and gemma3 (the multimodal model: its language model only)
GEMMA2, GEMMA3_TEXT, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"
GEMMA = (GEMMA2, GEMMA3_TEXT, GEMMA3)
# model_type gemma4_text, and gemma4 (the multimodal model: its language model only)
GEMMA4_TEXT, GEMMA4 = "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, GPT2, DEEPSEEK_V2, DEEPSEEK_V3, GEMMA2, GEMMA3_TEXT, GEMMA3,
                 GEMMA4_TEXT, GEMMA4)
BASE_PREFIX = {LLAMA: "model.", MISTRAL: "model.", QWEN2: "model.", QWEN3: "model.", GPT2: "transformer.",
               DEEPSEEK_V2: "model.", DEEPSEEK_V3: "model.", GEMMA2: "model.", GEMMA3_TEXT: "model.",
               GEMMA4_TEXT: "model."}
# Gemma3ForConditionalGeneration holds its language model under one of two prefixes, each with its own lm_head name
# (when untied): Google's releases and transformers 5.24's save_pretrained (which converts back to that layout)
# write the first; transformers 5's in-memory module names (a state_dict saved as is) are the second.
GEMMA3_PREFIXES = {"language_model.model.": "language_model.lm_head.weight", "model.language_model.": "lm_head.weight"}
# ... and its vision tower and multimodal projector, which jaxkv (text only) skips by name, explicitly: any other
# tensor outside the language model is refused as for every architecture.
GEMMA3_SKIPPED = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\..+")
# Gemma4ForConditionalGeneration: the same two naming schemes, transformers 5.24's save_pretrained writing the
# module names (model.language_model.*, head lm_head.weight); its vision and audio towers and their embedders
# (projections into the language model) are skipped by name.
GEMMA4_PREFIXES = {"model.language_model.": "lm_head.weight", "language_model.model.": "language_model.lm_head.weight"}
GEMMA4_SKIPPED = re.compile(r"(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio)\..+")
MULTIMODAL = {GEMMA3: (GEMMA3_PREFIXES, GEMMA3_SKIPPED), GEMMA4: (GEMMA4_PREFIXES, GEMMA4_SKIPPED)}

# Sanity caps on config values, checked before anything is built from them. Each is well beyond any released
# model of these families (largest: vocab 256k, hidden 16k, 126 layers), yet small enough that a corrupt or
# hostile config.json (vocab 10**12, 10**6 layers) is refused with a message naming the field rather than
# attempting an allocation. The tensors themselves must then match the config exactly, so memory use is bounded
# by the checkpoint's own size.
MAX_VOCAB = 1 << 22
MAX_D_MODEL = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FFN = 1 << 20
MAX_EXPERTS = 1 << 14  # routed experts per layer (DeepSeek-V3: 256)
MAX_LEARNED_POSITIONS = 1 << 20  # GPT-2's n_positions sizes a table; RoPE's max_position_embeddings sizes nothing
MAX_PARAMS = 10 ** 12

# Checkpoint dtypes (safetensors names) that can hold weights, and their jaxkv names.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Buffers that older exports saved next to the weights (names without the base-model prefix); they carry no
# learned state.
_ROTARY_BUFFER = re.compile(r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
REDUNDANT = {LLAMA: _ROTARY_BUFFER, MISTRAL: _ROTARY_BUFFER, QWEN2: _ROTARY_BUFFER, QWEN3: _ROTARY_BUFFER,
             GPT2: re.compile(r"h\.\d+\.attn\.(bias|masked_bias)"), DEEPSEEK_V2: _ROTARY_BUFFER,
             DEEPSEEK_V3: _ROTARY_BUFFER, GEMMA2: _ROTARY_BUFFER, GEMMA3_TEXT: _ROTARY_BUFFER,
             GEMMA3: _ROTARY_BUFFER, GEMMA4_TEXT: _ROTARY_BUFFER, GEMMA4: _ROTARY_BUFFER}


# --- config ---------------------------------------------------------------------------------------------------


def read_config(directory: str | os.PathLike) -> dict:
    """The parsed config.json of a checkpoint directory. FileNotFoundError / ValueError naming the file."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; a Hugging Face checkpoint directory needs a {CONFIG_FILE}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def architecture(hf: dict, *, source: str) -> str:
    """`architectures[0]` of the config, which must be one this module can map."""
    archs = hf.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"{source}: field 'architectures' must be a non-empty list of names, got {archs!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    if archs[0] not in ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture {archs[0]!r} (field 'architectures'); "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return archs[0]


class _Fields:
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


def config_from_hf(hf_config: dict, *, source: str) -> Config:
    """The `jaxkv.Config` of a Hugging Face config.json (already parsed). `source` names it in error messages.

    Raises ValueError for an unsupported architecture or option, a missing or mistyped field, or a value beyond
    the sanity caps (MAX_*), naming the field. The returned config has dtype "float32"; `load_hf` sets the
    weights' dtype.
    """
    if not isinstance(hf_config, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(hf_config).__name__}")
    arch = architecture(hf_config, source=source)
    fields = _Fields(hf_config, source)
    eos_fields = fields
    if arch == GPT2:
        kwargs = _gpt2_fields(fields)
    elif arch in DEEPSEEK:
        kwargs = _deepseek_fields(fields, arch)
    elif arch == GEMMA3:
        text = _text_config(fields)
        kwargs = _gemma_fields(text, arch)
        # the head's tying is the outer config's; transformers' generation config takes eos from the outer config,
        # then from text_config
        kwargs["tie_embeddings"] = fields.bool("tie_word_embeddings", True)
        eos_fields = fields if fields.hf.get("eos_token_id") is not None else text
    elif arch in GEMMA:
        kwargs = _gemma_fields(fields, arch)
    elif arch == GEMMA4:
        text = _text_config(fields)
        kwargs = _gemma4_fields(text)
        kwargs["tie_embeddings"] = fields.bool("tie_word_embeddings", True)
        eos_fields = fields if fields.hf.get("eos_token_id") is not None else text
    elif arch == GEMMA4_TEXT:
        kwargs = _gemma4_fields(fields)
    else:
        kwargs = _llama_family_fields(fields, arch)
    kwargs["eos_ids"] = _eos_ids(eos_fields, kwargs["vocab_size"])
    config = Config(**kwargs)
    if config.param_count() > MAX_PARAMS:
        raise ValueError(f"{source}: the config implies {config.param_count():,} parameters, beyond the supported "
                         f"maximum {MAX_PARAMS:,}; the config is likely corrupt")
    return config


def _eos_ids(fields: _Fields, vocab_size: int) -> tuple[int, ...]:
    value = fields.hf.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            fields.fail("eos_token_id", f"must be token ids in [0, {vocab_size}) (vocab_size), got {value!r}")
    return tuple(ids)


def _head_dim(fields: _Fields, d_model: int, n_heads: int, field: str = "head_dim") -> int:
    # Llama/Mistral/Qwen2 all read `head_dim` when present and fall back to hidden_size // num_attention_heads.
    head_dim = fields.int(field, cap=MAX_HEAD_DIM)
    if head_dim is None:
        if d_model % n_heads:
            fields.fail(field, f"is missing and hidden size {d_model} is not divisible by {n_heads} heads")
        head_dim = d_model // n_heads
    return head_dim


# transformers' own default max_position_embeddings, for a file that omits the field.
_DEFAULT_MAX_POSITIONS = {LLAMA: 2048, MISTRAL: 131072, QWEN2: 32768, QWEN3: 32768}

# The rope types (`rope_type`) each family may use: those `jaxkv.layers.rope_inv_freq` reproduces. Llama, Mistral
# and Qwen2 keep the set they were parity-tested with; DeepSeek adds yarn (`_deepseek_fields`).
_ROPE_TYPES = ("default", "llama3")
_NEWER_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # Qwen3, Gemma 2, Gemma 3's full-attention layers


def _llama_family_fields(f: _Fields, arch: str) -> dict:
    d_model = f.int("hidden_size", cap=MAX_D_MODEL, required=True)
    n_heads = f.int("num_attention_heads", cap=MAX_HEADS, required=True)
    act = f.str("hidden_act", "silu")
    if act not in ("silu", "swish"):
        f.fail("hidden_act", f"= {act!r} is not supported; jaxkv's SwiGLU MLP uses silu")
    kwargs = dict(
        vocab_size=f.int("vocab_size", cap=MAX_VOCAB, required=True),
        d_model=d_model,
        n_layers=f.int("num_hidden_layers", cap=MAX_LAYERS, required=True),
        n_heads=n_heads,
        n_kv_heads=f.int("num_key_value_heads", n_heads, cap=MAX_HEADS),
        # Qwen3Config's head_dim defaults to 128 whatever the hidden size; the others fall back to D / N
        head_dim=f.int("head_dim", 128, cap=MAX_HEAD_DIM) if arch == QWEN3 else _head_dim(f, d_model, n_heads),
        ffn_dim=f.int("intermediate_size", cap=MAX_FFN, required=True),
        ffn_kind="swiglu",
        norm_kind="rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        positions="rope",
        # RoPE is computed on the fly from position ids, so this only bounds generation; it sizes no allocation.
        max_positions=f.int("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch]),
        tie_embeddings=f.bool("tie_word_embeddings", False),
    )
    kwargs["rope_theta"], kwargs["rope_scaling"] = _rope(
        f, kwargs["max_positions"], types=_NEWER_ROPE_TYPES if arch == QWEN3 else _ROPE_TYPES)
    if arch == LLAMA:
        # Llama's attention_bias covers q, k, v and o; mlp_bias covers gate, up and down.
        kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
        kwargs["mlp_bias"] = f.bool("mlp_bias", False)
    elif arch == QWEN2:
        kwargs["qkv_bias"] = True  # Qwen2 always has q/k/v biases and never an o_proj bias
        # Its sliding layers (use_sliding_window: the layers >= max_window_layers) may mix with full ones, as Qwen3's.
        kwargs["layer_types"], kwargs["sliding_window"] = _jaxkv_layer_types(*_qwen_layer_types(f, kwargs["n_layers"]))
    elif arch == QWEN3:
        # Qwen3: Llama plus an RMS norm over each query and key head (q_norm / k_norm, before the rotation);
        # attention_bias covers q, k, v and o. Its sliding layers (use_sliding_window) may mix with full ones.
        kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
        kwargs["qk_norm"] = True
        kwargs["layer_types"], kwargs["sliding_window"] = _jaxkv_layer_types(*_qwen_layer_types(f, kwargs["n_layers"]))
    else:
        # transformers' mask keeps key j for query i when j > i - sliding_window (masking_utils.
        # sliding_window_overlay, transformers 5.24): the `sliding_window` most recent tokens, the query itself
        # included. That is exactly jaxkv's Config.sliding_window, so the value maps unchanged, not off by one
        # (the parity tests check it with a window of 8 and 40+ tokens). Its sliding cache keeps
        # sliding_window - 1 old tokens plus the new one: the same set. Both index by cache slot, padding
        # included, so left-padded batches agree too.
        # null disables the window; an absent field means transformers' MistralConfig default, 4096.
        kwargs["sliding_window"] = f.int("sliding_window", None) if "sliding_window" in f.hf else 4096
    return kwargs


def _qwen_layer_types(f: _Fields, n_layers: int) -> tuple[list[str], int | None]:
    """Qwen2 / Qwen3's (layer types, sliding window) as transformers 5.24 builds them: the window applies only with
    use_sliding_window, and then to the layers whose `layer_types` entry is "sliding_attention" (by default the
    layers i >= max_window_layers)."""
    window = f.int("sliding_window", None) if f.bool("use_sliding_window", False) else None
    types = f.hf.get("layer_types")
    if types is None:
        first_sliding = f.hf.get("max_window_layers", 28)  # may be 0: every layer slides
        if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
            f.fail("max_window_layers", f"must be a non-negative integer, got {first_sliding!r}")
        types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                 for i in range(n_layers)]
    _check_layer_types(f, types, n_layers)
    if window is None and "sliding_attention" in types:
        f.fail("layer_types", "has sliding_attention layers but use_sliding_window is false or sliding_window "
                              "is unset")
    return types, window


def _check_layer_types(f: _Fields, types, n_layers: int):
    if not isinstance(types, list) or len(types) != n_layers or \
            not set(types) <= {"full_attention", "sliding_attention"}:
        f.fail("layer_types", f"must list 'full_attention' or 'sliding_attention' for each of the {n_layers} "
                              f"layers, got {types!r}")


def _jaxkv_layer_types(types: list[str], window: int | None) -> tuple[tuple[str, ...] | None, int | None]:
    """(Config.layer_types, Config.sliding_window) of Hugging Face's per-layer types: no layer_types when every
    layer is alike (one window on all of them, or none)."""
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {False}:
        return None, None
    if sliding == {True}:
        return None, window
    return tuple(types), window


def _rope(f: _Fields, max_positions: int, *,
          types: tuple[str, ...] = _ROPE_TYPES) -> tuple[float, RopeScaling | LinearScaling | YarnScaling | None]:
    """(rope_theta, scaling or None), from either transformers 5.x's `rope_parameters` (which holds rope_theta and
    rope_type together) or the 4.x top-level `rope_theta` + `rope_scaling` (type under "type" or "rope_type").
    `types`: the rope types accepted."""
    params = f.hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = f.hf.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        f.fail(field, f"must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        f.fail(field, "holds per-layer-type RoPE settings, which jaxkv does not support")
    return _rope_entry(f, field, params, max_positions, types, f.hf.get("rope_theta"))


def _rope_entry(f: _Fields, field: str, params: dict, max_positions: int, types: tuple[str, ...],
                default_theta=None) -> tuple[float, RopeScaling | LinearScaling | YarnScaling | None]:
    """One rope settings object (`field` names it in errors): (theta, scaling or None)."""
    theta = params.get("rope_theta", default_theta)
    theta = 10000.0 if theta is None else f.number(f"{field}.rope_theta", theta)
    if theta <= 0:
        f.fail(f"{field}.rope_theta", f"must be > 0, got {theta}")
    partial = params.get("partial_rotary_factor", f.hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        f.fail("partial_rotary_factor", f"= {partial!r} is not supported (jaxkv rotates the whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in types:
        f.fail(f"{field}.rope_type", f"= {rope_type!r} is not supported; supported: "
                                     f"{', '.join(repr(t) for t in types)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, _yarn(f, field, params, max_positions)

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


# transformers 5.24's Gemma2Config / Gemma3TextConfig defaults, for fields a config.json omits: Google's Gemma 3
# releases spell out only a few fields of their text_config (hidden_size, intermediate_size, num_hidden_layers,
# sliding_window, rope_scaling) and rely on these for the rest. The tensors then check the sizes.
_GEMMA_DEFAULTS = {
    GEMMA2: dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                 query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                 attn_logit_softcapping=50.0),
    GEMMA3_TEXT: dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                      query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                      attn_logit_softcapping=None),
}
_GEMMA_DEFAULTS[GEMMA3] = _GEMMA_DEFAULTS[GEMMA3_TEXT]
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def _text_config(f: _Fields) -> _Fields:
    """The language model's config nested in a multimodal one (Gemma 3: `text_config`)."""
    text = f.hf.get("text_config")
    if not isinstance(text, dict):
        f.fail("text_config", f"must be an object holding the language model's config, got {text!r}")
    return _Fields(text, f.source, prefix=f.prefix + "text_config.")


def _gemma_fields(f: _Fields, arch: str) -> dict:
    """Gemma 2 / Gemma 3 (its language model): GeGLU, zero-centred RMS norms (x * (1 + w)) before and after both
    the attention and the MLP, embeddings times sqrt(D), scores scaled by query_pre_attn_scalar ** -0.5, sliding and
    full attention layers (`layer_types`). Gemma 2: tanh soft caps on the scores and the logits. Gemma 3: q/k norms,
    a rotary base per layer type."""
    d = _GEMMA_DEFAULTS[arch]
    act = f.str("hidden_activation", "gelu_pytorch_tanh")
    # gelu_new is the same tanh approximation (GPT-2's name for it); jaxkv's GeGLU computes that one
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        f.fail("hidden_activation", f"= {act!r} is not supported; jaxkv's GeGLU MLP uses gelu_pytorch_tanh")
    if f.bool("use_bidirectional_attention", False):
        f.fail("use_bidirectional_attention", "= true is not supported (jaxkv decodes with causal attention)")
    d_model = f.int("hidden_size", d["hidden_size"], cap=MAX_D_MODEL)
    n_layers = f.int("num_hidden_layers", d["num_hidden_layers"], cap=MAX_LAYERS)
    gemma3 = arch != GEMMA2
    kwargs = dict(
        vocab_size=f.int("vocab_size", d["vocab_size"], cap=MAX_VOCAB),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=f.int("num_attention_heads", d["num_attention_heads"], cap=MAX_HEADS),
        n_kv_heads=f.int("num_key_value_heads", d["num_key_value_heads"], cap=MAX_HEADS),
        head_dim=f.int("head_dim", d["head_dim"], cap=MAX_HEAD_DIM),
        ffn_dim=f.int("intermediate_size", d["intermediate_size"], cap=MAX_FFN),
        ffn_kind="geglu",
        norm_kind="gemma_rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        positions="rope",
        max_positions=f.int("max_position_embeddings", d["max_position_embeddings"]),
        tie_embeddings=f.bool("tie_word_embeddings", True),
        embed_scale=d_model ** 0.5,  # transformers: hidden_size ** 0.5, rounded to the weights' dtype (the model)
        post_norms=True,
        qk_norm=gemma3,
        query_pre_attn_scalar=_positive(f, "query_pre_attn_scalar", d["query_pre_attn_scalar"]),
    )
    # attention_bias covers q, k, v and o
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)

    types = f.hf.get("layer_types")
    if types is None:
        # transformers' defaults: Gemma 2 alternates sliding (even layers) and full; Gemma 3 has every
        # sliding_window_pattern-th layer full (the pattern is a constructor argument, not a stored field)
        pattern = 2 if arch == GEMMA2 else f.int("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    _check_layer_types(f, types, n_layers)
    window = f.int("sliding_window", None) if "sliding_window" in f.hf else d["sliding_window"]
    if window is None and "sliding_attention" in types:
        f.fail("sliding_window", "is null but layer_types has sliding_attention layers")
    kwargs["layer_types"], kwargs["sliding_window"] = _jaxkv_layer_types(types, window)

    if gemma3:
        kwargs["rope_theta"], kwargs["rope_scaling"], kwargs["rope_local_theta"] = _gemma3_rope(
            f, kwargs["max_positions"])
    else:
        kwargs["rope_theta"], kwargs["rope_scaling"] = _rope(f, kwargs["max_positions"], types=_NEWER_ROPE_TYPES)
    # transformers 5.24 applies attn_logit_softcapping in Gemma 2 only: Gemma3Attention never passes it to the
    # attention function, so a Gemma 3 config's value changes nothing there, nor here. Likewise
    # final_logit_softcapping: Gemma3ForCausalLM applies it, Gemma3ForConditionalGeneration does not.
    if arch == GEMMA2:
        kwargs["attn_logit_softcap"] = _positive(f, "attn_logit_softcapping", d["attn_logit_softcapping"])
    if arch != GEMMA3:
        kwargs["final_logit_softcap"] = _positive(f, "final_logit_softcapping", d["final_logit_softcapping"])
    return kwargs


def _positive(f: _Fields, field: str, default: float | None) -> float | None:
    """A number > 0, or None where the field is null; `default` where it is absent."""
    value = f.hf[field] if field in f.hf else default
    if value is None:
        return None
    value = f.number(field, value)
    if value <= 0:
        f.fail(field, f"must be > 0 (or null), got {value}")
    return value


def _gemma3_rope(f: _Fields, max_positions: int) -> tuple[float, LinearScaling | RopeScaling | YarnScaling | None,
                                                           float]:
    """(full layers' rope_theta, their scaling, sliding layers' rope_theta), as Gemma3TextConfig 5.24 reads them:
    `rope_parameters` per layer type, or the 4.x fields rope_theta (full layers; default 1e6), rope_local_base_freq
    (sliding layers; default 1e4) and rope_scaling (full layers only). The sliding layers take no scaling."""
    params = f.hf.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or not set(params) <= set(_GEMMA3_THETA):
        f.fail("rope_parameters", f"must be an object with 'full_attention' and 'sliding_attention' settings (Gemma "
                                  f"3 has a rotary base per layer type), got {params!r}")
    legacy_scaling = f.hf.get("rope_scaling")
    if legacy_scaling is not None and not isinstance(legacy_scaling, dict):
        f.fail("rope_scaling", f"must be an object, got {legacy_scaling!r}")
    entries = {}
    for kind, legacy in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
        entry = params.get(kind) or {"rope_type": "default"}
        if not isinstance(entry, dict):
            f.fail(f"rope_parameters.{kind}", f"must be an object, got {entry!r}")
        entry = dict(entry)
        if kind == "full_attention" and legacy_scaling:  # transformers: rope_scaling updates the full layers' only
            entry.update(legacy_scaling)
        if entry.get("rope_theta") is None:
            entry["rope_theta"] = f.hf[legacy] if f.hf.get(legacy) is not None else _GEMMA3_THETA[kind]
        entries[kind] = entry
    theta, scaling = _rope_entry(f, "rope_parameters.full_attention", entries["full_attention"], max_positions,
                                 _NEWER_ROPE_TYPES)
    local, _ = _rope_entry(f, "rope_parameters.sliding_attention", entries["sliding_attention"], max_positions,
                           ("default",))  # jaxkv's sliding layers take no scaling (`Config.layer_rope`)
    return theta, scaling, local


# transformers 5.24's Gemma4TextConfig defaults, for fields a config.json omits.
_GEMMA4_DEFAULTS = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                        sliding_window=512, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
                        global_head_dim=512)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def _gemma4_fields(f: _Fields) -> dict:
    """Gemma 4's language model, as transformers 5.24 builds it (configuration_gemma4.py, modeling_gemma4.py):
    Gemma 3's layout (GeGLU, sandwich norms, q/k norms, embeddings times sqrt(D), sliding and full layers) with
    RMS norms that scale by w (not 1 + w; `rmsnorm_f32`), unscaled scores, a weightless norm on the values, the
    full layers' own head dim / KV heads (`per_layer_config`, or global_head_dim and num_global_key_value_heads)
    and "proportional" rope, values from the key projection there (attention_k_eq_v), the last
    num_kv_shared_layers layers reusing K/V (with double-wide MLPs under use_double_wide_mlp), per-layer input
    embeddings (hidden_size_per_layer_input), a per-layer scalar and the final soft cap. Refused: the MoE block,
    bidirectional attention, rope types other than default / proportional, a per-layer input vocabulary other
    than vocab_size."""
    d = _GEMMA4_DEFAULTS
    act = f.str("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        f.fail("hidden_activation", f"= {act!r} is not supported; jaxkv's GeGLU MLP uses gelu_pytorch_tanh")
    if f.hf.get("use_bidirectional_attention") is not None:
        f.fail("use_bidirectional_attention", f"= {f.hf['use_bidirectional_attention']!r} is not supported (jaxkv "
                                              f"decodes with causal attention)")
    if f.bool("enable_moe_block", False):
        f.fail("enable_moe_block", "= true is not supported: Gemma 4's MoE block (a dense MLP beside softmax-routed "
                                   "GeGLU experts with per-expert scales) does not map onto jaxkv's mixture of "
                                   "experts (DeepSeek's SwiGLU experts)")
    d_model = f.int("hidden_size", d["hidden_size"], cap=MAX_D_MODEL)
    n_layers = f.int("num_hidden_layers", d["num_hidden_layers"], cap=MAX_LAYERS)
    n_heads = f.int("num_attention_heads", d["num_attention_heads"], cap=MAX_HEADS)
    n_kv_heads = f.int("num_key_value_heads", d["num_key_value_heads"], cap=MAX_HEADS)
    head_dim = f.int("head_dim", d["head_dim"], cap=MAX_HEAD_DIM)
    vocab = f.int("vocab_size", d["vocab_size"], cap=MAX_VOCAB)
    ffn_dim = f.int("intermediate_size", d["intermediate_size"], cap=MAX_FFN)

    types = f.hf.get("layer_types")
    if types is None:  # transformers' default: every 6th layer full
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    _check_layer_types(f, types, n_layers)
    types = list(types[:-1]) + ["full_attention"]  # transformers forces the last layer to full attention
    window = f.int("sliding_window", None) if "sliding_window" in f.hf else d["sliding_window"]
    if window is None and "sliding_attention" in types:
        f.fail("sliding_window", "is null but layer_types has sliding_attention layers")
    layer_types, sliding_window = _jaxkv_layer_types(types, window)

    global_head_dim, global_kv_heads = _gemma4_global_geometry(f, types, head_dim, n_kv_heads)

    shared = f.hf.get("num_kv_shared_layers", 0) or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n_layers:
        f.fail("num_kv_shared_layers", f"must be an integer in [0, num_hidden_layers = {n_layers}), got {shared!r}")
    first = n_layers - shared
    if shared and not {t for t in types[first:]} <= {t for t in types[:first]}:
        f.fail("num_kv_shared_layers", f"= {shared}: a shared layer's type has no earlier layer of that type to "
                                       f"take keys and values from (layer_types {types!r})")

    ple = f.hf.get("hidden_size_per_layer_input", d["hidden_size_per_layer_input"])
    if ple in (None, 0):
        ple = None
    else:
        ple = f.int("hidden_size_per_layer_input", cap=MAX_HEAD_DIM)
        ple_vocab = f.int("vocab_size_per_layer_input", d["vocab_size_per_layer_input"], cap=MAX_VOCAB)
        if ple_vocab != vocab:
            f.fail("vocab_size_per_layer_input", f"= {ple_vocab} differs from vocab_size ({vocab}); jaxkv's per-layer "
                                                 f"input table has one row per token id")

    theta, scaling, local = _gemma4_rope(f, types)
    kwargs = dict(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, ffn_dim=ffn_dim, ffn_kind="geglu", norm_kind="rmsnorm_f32",
        norm_eps=f.float("rms_norm_eps", 1e-6), positions="rope",
        max_positions=f.int("max_position_embeddings", d["max_position_embeddings"]),
        tie_embeddings=f.bool("tie_word_embeddings", True),
        embed_scale=d_model ** 0.5,  # transformers: hidden_size ** 0.5, rounded to the weights' dtype (the model)
        post_norms=True, qk_norm=True, value_norm=True,
        query_pre_attn_scalar=1.0,  # Gemma4TextAttention.scaling = 1.0: the q/k norms set the scores' scale
        layer_types=layer_types, sliding_window=sliding_window,
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local if layer_types is not None else None,
        global_head_dim=global_head_dim, global_kv_heads=global_kv_heads,
        global_values_from_keys=f.bool("attention_k_eq_v", False),
        kv_shared_layers=shared,
        kv_shared_ffn_dim=2 * ffn_dim if shared and f.bool("use_double_wide_mlp", False) else None,
        per_layer_input_dim=ple, layer_scalar=True,
        final_logit_softcap=_positive(f, "final_logit_softcapping", None),
    )
    if layer_types is None and sliding_window is not None:  # every layer slides: they take the sliding rope
        kwargs["rope_theta"], kwargs["rope_scaling"] = local, None
    if layer_types is None and sliding_window is None and global_head_dim is not None:
        kwargs["head_dim"], kwargs["global_head_dim"] = global_head_dim, None  # every layer is full
        kwargs["n_kv_heads"], kwargs["global_kv_heads"] = global_kv_heads or n_kv_heads, None
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    return kwargs


def _gemma4_global_geometry(f: _Fields, types: list[str], head_dim: int,
                            n_kv_heads: int) -> tuple[int | None, int | None]:
    """(global_head_dim, global_kv_heads) of the full-attention layers: from `per_layer_config` (what
    transformers 5.24 writes: layer index -> overrides of head_dim / num_key_value_heads) or else from
    global_head_dim (default 512) and, with attention_k_eq_v, num_global_key_value_heads. Overrides must be the
    same on every full layer and absent on sliding ones (jaxkv has one geometry per layer kind)."""
    per_layer = f.hf.get("per_layer_config")
    if per_layer is None:
        hd = f.int("global_head_dim", _GEMMA4_DEFAULTS["global_head_dim"], cap=MAX_HEAD_DIM)
        kv = f.int("num_global_key_value_heads", None, cap=MAX_HEADS) if f.bool("attention_k_eq_v", False) else None
        return (hd if hd != head_dim else None), (kv if kv not in (None, n_kv_heads) else None)
    if not isinstance(per_layer, dict):
        f.fail("per_layer_config", f"must be an object of layer index -> overrides, got {per_layer!r}")
    geometry = {}
    for i, kind in enumerate(types):
        entry = per_layer.get(str(i), per_layer.get(i, {})) or {}
        if not isinstance(entry, dict) or not set(entry) <= {"head_dim", "num_key_value_heads"}:
            f.fail(f"per_layer_config.{i}", f"may override head_dim and num_key_value_heads only, got {entry!r}")
        shape = (entry.get("head_dim", head_dim), entry.get("num_key_value_heads", n_kv_heads))
        for field, value, cap in (("head_dim", shape[0], MAX_HEAD_DIM), ("num_key_value_heads", shape[1], MAX_HEADS)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
                f.fail(f"per_layer_config.{i}.{field}", f"must be an integer in [1, {cap}], got {value!r}")
        geometry.setdefault(kind, set()).add(shape)
    if geometry.get("sliding_attention", {(head_dim, n_kv_heads)}) != {(head_dim, n_kv_heads)}:
        f.fail("per_layer_config", "overrides a sliding layer's geometry; jaxkv supports overrides on the "
                                   "full-attention layers only")
    full = geometry.get("full_attention", {(head_dim, n_kv_heads)})
    if len(full) != 1:
        f.fail("per_layer_config", f"gives the full-attention layers different geometries {sorted(full)}; jaxkv "
                                   f"supports one")
    (hd, kv), = full
    return (hd if hd != head_dim else None), (kv if kv != n_kv_heads else None)


def _gemma4_rope(f: _Fields, types: list[str]) -> tuple[float, ProportionalRope | None, float]:
    """(full layers' rope_theta, their scaling, sliding layers' rope_theta) from `rope_parameters` per layer type
    (transformers' defaults where absent): full layers "default" or "proportional" (partial_rotary_factor, factor),
    sliding layers "default"."""
    params = f.hf.get("rope_parameters")
    if params is None:
        params = _GEMMA4_ROPE
    if not isinstance(params, dict) or not set(params) <= set(_GEMMA4_ROPE):
        f.fail("rope_parameters", f"must be an object with 'full_attention' and 'sliding_attention' settings, got "
                                  f"{params!r}")
    out = {}
    for kind in _GEMMA4_ROPE:
        entry = params.get(kind)
        if entry is None:
            if kind in types:
                f.fail(f"rope_parameters.{kind}", "is missing")
            entry = _GEMMA4_ROPE[kind]
        if not isinstance(entry, dict):
            f.fail(f"rope_parameters.{kind}", f"must be an object, got {entry!r}")
        field = f"rope_parameters.{kind}"
        theta = f.number(f"{field}.rope_theta", entry.get("rope_theta", _GEMMA4_ROPE[kind]["rope_theta"]))
        if theta <= 0:
            f.fail(f"{field}.rope_theta", f"must be > 0, got {theta}")
        rope_type = entry.get("rope_type", "default")
        allowed = ("default", "proportional") if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            f.fail(f"{field}.rope_type", f"= {rope_type!r} is not supported; supported: "
                                         f"{', '.join(repr(t) for t in allowed)}")
        scaling = None
        if rope_type == "proportional":
            fraction = f.number(f"{field}.partial_rotary_factor", entry.get("partial_rotary_factor", 1.0) or 1.0)
            factor = f.number(f"{field}.factor", entry.get("factor", 1.0) or 1.0)
            try:
                scaling = ProportionalRope(rotary_fraction=fraction, factor=factor)
            except ValueError as e:
                raise ValueError(f"{f.source}: field {f.prefix + field!r}: {e}") from None
        out[kind] = theta, scaling
    return out["full_attention"][0], out["full_attention"][1], out["sliding_attention"][0]


def _yarn(f: _Fields, field: str, params: dict, max_positions: int) -> YarnScaling:
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


# transformers' DeepseekV2Config / DeepseekV3Config defaults for fields a config.json may omit.
_DEEPSEEK_DEFAULTS = {DEEPSEEK_V2: dict(q_lora_rank=1536, first_k_dense_replace=0, max_position_embeddings=2048),
                      DEEPSEEK_V3: dict(q_lora_rank=1536, first_k_dense_replace=3, max_position_embeddings=4096)}


def _deepseek_fields(f: _Fields, arch: str) -> dict:
    """DeepSeek-V2/V3: multi-head latent attention, RMSNorm, SwiGLU; the first `first_k_dense_replace` layers
    have a dense FFN of intermediate_size, the rest mixture-of-experts ones."""
    defaults = _DEEPSEEK_DEFAULTS[arch]
    act = f.str("hidden_act", "silu")
    if act not in ("silu", "swish"):
        f.fail("hidden_act", f"= {act!r} is not supported; jaxkv's SwiGLU MLP uses silu")
    n_layers = f.int("num_hidden_layers", cap=MAX_LAYERS, required=True)
    n_heads = f.int("num_attention_heads", cap=MAX_HEADS, required=True)
    # transformers repeats the n_heads expanded keys num_attention_heads / num_key_value_heads times, which only
    # works when the two are equal (its default).
    if f.int("num_key_value_heads", n_heads, cap=MAX_HEADS) != n_heads:
        f.fail("num_key_value_heads", f"must equal num_attention_heads ({n_heads}) for multi-head latent attention")
    q_lora_rank = f.int("q_lora_rank", cap=MAX_D_MODEL) if "q_lora_rank" in f.hf else defaults["q_lora_rank"]
    try:
        mla = Mla(kv_lora_rank=f.int("kv_lora_rank", cap=MAX_D_MODEL, required=True),
                  qk_nope_head_dim=f.int("qk_nope_head_dim", cap=MAX_HEAD_DIM, required=True),
                  qk_rope_head_dim=f.int("qk_rope_head_dim", cap=MAX_HEAD_DIM, required=True),
                  v_head_dim=f.int("v_head_dim", cap=MAX_HEAD_DIM, required=True), q_lora_rank=q_lora_rank)
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None
    dense = f.hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        f.fail("first_k_dense_replace", f"must be a non-negative integer, got {dense!r}")
    moe = _deepseek_moe(f, arch, dense) if dense < n_layers else None
    kwargs = dict(
        vocab_size=f.int("vocab_size", cap=MAX_VOCAB, required=True),
        d_model=f.int("hidden_size", cap=MAX_D_MODEL, required=True),
        n_layers=n_layers,
        n_heads=n_heads,
        ffn_dim=f.int("intermediate_size", cap=MAX_FFN, required=True),
        ffn_kind="swiglu",
        norm_kind="rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        positions="rope",
        max_positions=f.int("max_position_embeddings", defaults["max_position_embeddings"]),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        mla=mla,
        moe=moe,
    )
    # attention_bias covers q_a_proj and kv_a_proj_with_mqa (jaxkv's qkv_bias) and o_proj.
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    kwargs["rope_theta"], kwargs["rope_scaling"] = _rope(f, kwargs["max_positions"],
                                                         types=("default", "llama3", "yarn"))
    return kwargs


# transformers' DeepseekV2Config / DeepseekV3Config defaults for the mixture-of-experts fields.
_DEEPSEEK_MOE_DEFAULTS = {
    DEEPSEEK_V2: dict(n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407, routed_scaling_factor=1.0),
    DEEPSEEK_V3: dict(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=2.5,
                      num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True)}


def _deepseek_moe(f: _Fields, arch: str, dense: int) -> MoeConfig:
    """The mixture of experts of layers >= first_k_dense_replace, as transformers 5.24 runs it: V3 always scores
    with a sigmoid and picks by "noaux_tc" (it reads neither `scoring_func` nor `topk_method`); V2 always with a
    softmax, by `topk_method`, and never normalizes the weights (it does not read `norm_topk_prob`)."""
    d = _DEEPSEEK_MOE_DEFAULTS[arch]
    freq = f.hf.get("moe_layer_freq", 1)
    if freq != 1:
        f.fail("moe_layer_freq", f"= {freq!r} is not supported: transformers puts a mixture of experts in every "
                                 f"layer from first_k_dense_replace on, DeepSeek's own code in every moe_layer_freq-th")
    fields = dict(
        n_routed_experts=f.int("n_routed_experts", d["n_routed_experts"], cap=MAX_EXPERTS),
        experts_per_token=f.int("num_experts_per_tok", d.get("num_experts_per_tok"), cap=MAX_EXPERTS,
                                required="num_experts_per_tok" not in d),
        moe_ffn_dim=f.int("moe_intermediate_size", d["moe_intermediate_size"], cap=MAX_FFN),
        n_shared_experts=f.int("n_shared_experts", d["n_shared_experts"], cap=MAX_EXPERTS),
        first_dense_layers=dense,
        routed_scaling_factor=f.float("routed_scaling_factor", d["routed_scaling_factor"]))
    if arch == DEEPSEEK_V3:
        fields |= dict(scoring="sigmoid", topk_method="noaux_tc", n_group=f.int("n_group", d["n_group"]),
                       topk_group=f.int("topk_group", d["topk_group"]),
                       norm_topk_prob=f.bool("norm_topk_prob", d["norm_topk_prob"]))
    else:
        method = f.str("topk_method", "greedy")
        if method == "group_limited_greedy":
            fields |= dict(n_group=f.int("n_group", required=True), topk_group=f.int("topk_group", required=True))
        elif method != "greedy":  # "greedy" ignores n_group / topk_group, as transformers does
            f.fail("topk_method", f"= {method!r} is not supported: transformers' DeepSeek-V2 router knows 'greedy' "
                                  f"and 'group_limited_greedy'")
        fields |= dict(scoring="softmax", topk_method=method)
    try:
        return MoeConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None


def rope_interleaved(hf: dict, arch: str) -> bool:
    """Whether a DeepSeek checkpoint's rotary columns come in interleaved pairs (x0, x1), (x2, x3), ...: always
    for V2 (its complex-number rotary), V3 unless `rope_interleave` is false."""
    return arch == DEEPSEEK_V2 or hf.get("rope_interleave", True) is not False


def _gpt2_fields(f: _Fields) -> dict:
    act = f.str("activation_function", "gelu_new")
    # gelu_new and gelu_pytorch_tanh are the same tanh approximation, which is jaxkv's GELU.
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        f.fail("activation_function", f"= {act!r} is not supported; jaxkv's GELU MLP is gelu_new (tanh "
                                      "approximation)")
    refused = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
               "add_cross_attention": False, "scale_attn_weights": True}
    for field, supported in refused.items():
        if f.bool(field, supported) != supported:
            f.fail(field, f"= {not supported} is not supported by jaxkv (only {str(supported).lower()})")
    d_model = f.int("n_embd", cap=MAX_D_MODEL, required=True)
    n_heads = f.int("n_head", cap=MAX_HEADS, required=True)
    if d_model % n_heads:
        f.fail("n_head", f"= {n_heads} does not divide n_embd = {d_model}")
    if d_model // n_heads > MAX_HEAD_DIM:
        f.fail("n_embd", f"/ n_head = {d_model // n_heads} is beyond the supported maximum head dim "
                         f"{MAX_HEAD_DIM}")
    return dict(
        vocab_size=f.int("vocab_size", cap=MAX_VOCAB, required=True),
        d_model=d_model,
        n_layers=f.int("n_layer", cap=MAX_LAYERS, required=True),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        ffn_dim=f.int("n_inner", 4 * d_model, cap=MAX_FFN),
        ffn_kind="gelu",
        norm_kind="layernorm",
        norm_eps=f.float("layer_norm_epsilon", 1e-5),
        positions="learned",
        max_positions=f.int("n_positions", 1024, cap=MAX_LEARNED_POSITIONS),
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_embeddings=f.bool("tie_word_embeddings", True),
    )


# --- the tensor plan ------------------------------------------------------------------------------------------

Convert = Callable[[np.ndarray], dict[tuple[str, ...], np.ndarray]]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF name (without the base-model prefix), the shape the config implies (and
    that shape in letters, for error messages), and how it becomes jaxkv parameters."""

    name: str
    shape: tuple[int, ...]
    letters: str
    convert: Convert


def _as_is(path):
    return lambda w: {path: w}


def _conv1d(path, *shape):
    """GPT-2 Conv1D weight [in, out] -> transposed to the [out, in] form, then reshaped to `shape`."""
    return lambda w: {path: np.ascontiguousarray(w.T).reshape(shape or w.T.shape)}


def _reshape(path, *shape):
    return lambda w: {path: w.reshape(shape)}


def _split_qkv(paths, *shape):
    """GPT-2 c_attn packs q, k and v along its last (output) axis: [..., 3*D] -> three [*shape]; a weight
    ([in, out]) is transposed to the [out, in] form first."""
    def convert(w):
        parts = np.split(w, 3, axis=-1)
        return {p: np.ascontiguousarray(part.T).reshape(shape) for p, part in zip(paths, parts)}
    return convert


def tensor_specs(arch: str, config: Config, *, interleaved: bool = False,
                 fused_experts: bool = False) -> list[TensorSpec]:
    """Every tensor a checkpoint of `arch` with `config` must hold (base-model prefix stripped, except for
    `lm_head.weight`, which sits outside the base model). `interleaved`: a DeepSeek checkpoint's rotary columns
    are in pairs (`rope_interleaved`). `fused_experts`: its experts are stored as transformers 5 holds them in
    memory, 3D per layer (`fused_experts_stored`), not one tensor per expert."""
    if arch == GPT2:
        specs = _gpt2_specs(config)
    elif arch in DEEPSEEK:
        specs = _deepseek_specs(config, interleaved, fused_experts)
    elif arch in (GEMMA4_TEXT, GEMMA4):
        specs = _gemma4_specs(config)
    else:
        specs = _llama_family_specs(config)
    if not config.tie_embeddings:
        V, D = config.vocab_size, config.d_model
        specs.append(TensorSpec("lm_head.weight", (V, D), "[V, D]", _as_is(("lm_head",))))
    return specs


def _llama_family_specs(cfg: Config) -> list[TensorSpec]:
    V, D, N, K, H, F = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    specs = [TensorSpec("embed_tokens.weight", (V, D), "[V, D]", _as_is(("embedding",))),
             TensorSpec("norm.weight", (D,), "[D]", _as_is(("final_norm", "scale")))]
    # HF norm name -> jaxkv norm. Gemma's sandwich norms (post_norms): post_attention_layernorm is the attention
    # output's norm there, and the MLP's input norm is pre_feedforward_layernorm.
    norms = ({"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
              "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}
             if cfg.post_norms else {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"})
    for i in range(cfg.n_layers):
        hf, jx = f"layers.{i}.", f"layer_{i}"
        specs += [TensorSpec(f"{hf}{name}.weight", (D,), "[D]", _as_is((jx, norm, "scale")))
                  for name, norm in norms.items()]
        if cfg.qk_norm:  # Qwen3, Gemma 3: over each head's H
            specs += [TensorSpec(hf + "self_attn.q_norm.weight", (H,), "[H]", _as_is((jx, "attn", "q_norm", "scale"))),
                      TensorSpec(hf + "self_attn.k_norm.weight", (H,), "[H]", _as_is((jx, "attn", "k_norm", "scale")))]
        specs += [
            TensorSpec(hf + "self_attn.q_proj.weight", (N * H, D), "[N*H, D]", _reshape((jx, "attn", "wq"), N, H, D)),
            TensorSpec(hf + "self_attn.k_proj.weight", (K * H, D), "[K*H, D]", _reshape((jx, "attn", "wk"), K, H, D)),
            TensorSpec(hf + "self_attn.v_proj.weight", (K * H, D), "[K*H, D]", _reshape((jx, "attn", "wv"), K, H, D)),
            TensorSpec(hf + "self_attn.o_proj.weight", (D, N * H), "[D, N*H]", _reshape((jx, "attn", "wo"), D, N, H)),
            TensorSpec(hf + "mlp.gate_proj.weight", (F, D), "[F, D]", _as_is((jx, "mlp", "w_gate"))),
            TensorSpec(hf + "mlp.up_proj.weight", (F, D), "[F, D]", _as_is((jx, "mlp", "w_up"))),
            TensorSpec(hf + "mlp.down_proj.weight", (D, F), "[D, F]", _as_is((jx, "mlp", "w_down"))),
        ]
        if cfg.qkv_bias:
            specs += [
                TensorSpec(hf + "self_attn.q_proj.bias", (N * H,), "[N*H]", _reshape((jx, "attn", "wq_bias"), N, H)),
                TensorSpec(hf + "self_attn.k_proj.bias", (K * H,), "[K*H]", _reshape((jx, "attn", "wk_bias"), K, H)),
                TensorSpec(hf + "self_attn.v_proj.bias", (K * H,), "[K*H]", _reshape((jx, "attn", "wv_bias"), K, H)),
            ]
        if cfg.out_bias:
            specs.append(TensorSpec(hf + "self_attn.o_proj.bias", (D,), "[D]", _as_is((jx, "attn", "wo_bias"))))
        if cfg.mlp_bias:
            specs += [TensorSpec(hf + f"mlp.{proj}_proj.bias", (n,), letter, _as_is((jx, "mlp", f"w_{proj}_bias")))
                      for proj, n, letter in (("gate", F, "[F]"), ("up", F, "[F]"), ("down", D, "[D]"))]
    return specs


def _gemma4_specs(cfg: Config) -> list[TensorSpec]:
    """Gemma 4's language model: per layer its own head dim and KV heads (`Config.layer_head_dim`,
    `layer_kv_heads`), no k/v projections or norms on the K/V-sharing layers, no v_proj where the values are the
    keys, the per-layer input gate / projection / norm, the layer scalar; the per-layer input table, projection and
    norm beside the embedding."""
    V, D, N = cfg.vocab_size, cfg.d_model, cfg.n_heads
    specs = [TensorSpec("embed_tokens.weight", (V, D), "[V, D]", _as_is(("embedding",))),
             TensorSpec("norm.weight", (D,), "[D]", _as_is(("final_norm", "scale")))]
    if cfg.per_layer_input_dim is not None:
        LP, P = cfg.n_layers * cfg.per_layer_input_dim, cfg.per_layer_input_dim
        specs += [TensorSpec("embed_tokens_per_layer.weight", (V, LP), "[V, L*P]",
                             _as_is(("per_layer_inputs", "embedding"))),
                  TensorSpec("per_layer_model_projection.weight", (LP, D), "[L*P, D]",
                             _as_is(("per_layer_inputs", "projection"))),
                  TensorSpec("per_layer_projection_norm.weight", (P,), "[P]",
                             _as_is(("per_layer_inputs", "norm", "scale")))]
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
             "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}
    for i in range(cfg.n_layers):
        hf, jx = f"layers.{i}.", f"layer_{i}"
        H, K, F = cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.layer_ffn_dim(i)
        attn = hf + "self_attn."
        specs += [TensorSpec(f"{hf}{name}.weight", (D,), "[D]", _as_is((jx, norm, "scale")))
                  for name, norm in norms.items()]
        specs += [
            TensorSpec(hf + "layer_scalar", (1,), "[1]", _as_is((jx, "layer_scalar"))),
            TensorSpec(attn + "q_proj.weight", (N * H, D), "[N*H, D]", _reshape((jx, "attn", "wq"), N, H, D)),
            TensorSpec(attn + "q_norm.weight", (H,), "[H]", _as_is((jx, "attn", "q_norm", "scale"))),
            TensorSpec(attn + "o_proj.weight", (D, N * H), "[D, N*H]", _reshape((jx, "attn", "wo"), D, N, H)),
            TensorSpec(hf + "mlp.gate_proj.weight", (F, D), "[F, D]", _as_is((jx, "mlp", "w_gate"))),
            TensorSpec(hf + "mlp.up_proj.weight", (F, D), "[F, D]", _as_is((jx, "mlp", "w_up"))),
            TensorSpec(hf + "mlp.down_proj.weight", (D, F), "[D, F]", _as_is((jx, "mlp", "w_down"))),
        ]
        projections = ["q"]
        if cfg.stores_kv(i):
            projections.append("k")
            specs += [TensorSpec(attn + "k_proj.weight", (K * H, D), "[K*H, D]", _reshape((jx, "attn", "wk"), K, H, D)),
                      TensorSpec(attn + "k_norm.weight", (H,), "[H]", _as_is((jx, "attn", "k_norm", "scale")))]
            if not cfg.layer_values_from_keys(i):
                projections.append("v")
                specs.append(TensorSpec(attn + "v_proj.weight", (K * H, D), "[K*H, D]",
                                        _reshape((jx, "attn", "wv"), K, H, D)))
        if cfg.qkv_bias:
            specs += [TensorSpec(attn + f"{p}_proj.bias", ((N if p == "q" else K) * H,),
                                 "[N*H]" if p == "q" else "[K*H]",
                                 _reshape((jx, "attn", f"w{p}_bias"), N if p == "q" else K, H)) for p in projections]
        if cfg.out_bias:
            specs.append(TensorSpec(attn + "o_proj.bias", (D,), "[D]", _as_is((jx, "attn", "wo_bias"))))
        if cfg.per_layer_input_dim is not None:
            P = cfg.per_layer_input_dim
            specs += [TensorSpec(hf + "per_layer_input_gate.weight", (P, D), "[P, D]", _as_is((jx, "ple_gate"))),
                      TensorSpec(hf + "per_layer_projection.weight", (D, P), "[D, P]", _as_is((jx, "ple_proj"))),
                      TensorSpec(hf + "post_per_layer_input_norm.weight", (D,), "[D]",
                                 _as_is((jx, "post_ple_norm", "scale")))]
    return specs


def ignored_tensors(arch: str, config: Config) -> frozenset[str]:
    """Names (as in `tensor_specs`) a checkpoint may hold that the model does not use and `match` drops: a Gemma 4
    K/V-sharing layer's k/v projections and norms, which transformers likewise ignores on load
    (`_keys_to_ignore_on_load_unexpected`). Nothing for the other architectures."""
    if arch not in (GEMMA4_TEXT, GEMMA4):
        return frozenset()
    return frozenset(f"layers.{i}.self_attn.{name}.{kind}" for i in range(config.n_layers)
                     if not config.stores_kv(i) for name in ("k_proj", "v_proj", "k_norm", "v_norm")
                     for kind in ("weight", "bias"))


def _mtp_tensors(hf: dict, arch: str, config: Config, stored: dict, source: str) -> frozenset[str]:
    """DeepSeek's multi-token-prediction modules (config.json's num_nextn_predict_layers, stored as layers
    n_layers, n_layers + 1, ...: DeepSeek-V3's release holds layer 61 of 61) are not part of the decoder and are
    dropped, as transformers drops them (`_keys_to_ignore_on_load_unexpected`). Names as in `tensor_specs`."""
    if arch not in DEEPSEEK:
        return frozenset()
    n = hf.get("num_nextn_predict_layers", 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 16:
        raise ValueError(f"{source}: field 'num_nextn_predict_layers' must be an integer in [0, 16], got {n!r}")
    layers = tuple(f"layers.{i}." for i in range(config.n_layers, config.n_layers + n))
    names = _strip_prefix(stored, BASE_PREFIX[arch])
    return frozenset(name for name in names if layers and name.startswith(layers))


def _deinterleave(rows: int, rope: int, heads: int = 1) -> np.ndarray:
    """Row order that turns each head's last `rope` of `rows` output rows from interleaved pairs (x0, x1), (x2,
    x3), ... into halves (x0, x2, ... ; x1, x3, ...): DeepSeek's pairwise rotation of pair i by frequency i is
    then `layers.apply_rope`'s rotate-half, bit for bit. Queries and keys are permuted alike, so every score is
    unchanged."""
    head = np.arange(rows)
    head[rows - rope:] = rows - rope + np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    return (np.arange(heads)[:, None] * rows + head[None]).reshape(-1)


def _rows(path, order, *shape):
    """A weight or bias whose output rows (axis 0) are reordered by `order`, then reshaped to `shape`."""
    return lambda w: {path: np.ascontiguousarray(w[order]).reshape(shape or w.shape)}


def _split_kv_b(paths, N, nope, dv, R):
    """kv_b_proj [N*(nope+dv), R]: per head, nope key rows then dv value rows -> wk_b [N, nope, R], wv_b [N, dv, R]."""
    def convert(w):
        w = w.reshape(N, nope + dv, R)
        return {paths[0]: np.ascontiguousarray(w[:, :nope]), paths[1]: np.ascontiguousarray(w[:, nope:])}
    return convert


def _deepseek_specs(cfg: Config, interleaved: bool, fused_experts: bool) -> list[TensorSpec]:
    m = cfg.mla
    V, D, N, F = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.ffn_dim
    R, E, nope, dv, qk = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.qk_head_dim
    q_order = _deinterleave(qk, E if interleaved else 0, N)
    kv_order = _deinterleave(R + E, E if interleaved else 0)
    specs = [TensorSpec("embed_tokens.weight", (V, D), "[V, D]", _as_is(("embedding",))),
             TensorSpec("norm.weight", (D,), "[D]", _as_is(("final_norm", "scale")))]
    for i in range(cfg.n_layers):
        hf, jx = f"layers.{i}.", f"layer_{i}"
        attn = hf + "self_attn."
        specs += [
            TensorSpec(hf + "input_layernorm.weight", (D,), "[D]", _as_is((jx, "attn_norm", "scale"))),
            TensorSpec(hf + "post_attention_layernorm.weight", (D,), "[D]", _as_is((jx, "mlp_norm", "scale"))),
            TensorSpec(attn + "kv_a_proj_with_mqa.weight", (R + E, D), "[R+E, D]",
                       _rows((jx, "attn", "wkv_a"), kv_order)),
            TensorSpec(attn + "kv_a_layernorm.weight", (R,), "[R]", _as_is((jx, "attn", "kv_norm", "scale"))),
            TensorSpec(attn + "kv_b_proj.weight", (N * (nope + dv), R), "[N*(qk_nope+v), R]",
                       _split_kv_b([(jx, "attn", "wk_b"), (jx, "attn", "wv_b")], N, nope, dv, R)),
            TensorSpec(attn + "o_proj.weight", (D, N * dv), "[D, N*v]", _reshape((jx, "attn", "wo"), D, N, dv)),
        ]
        specs += _deepseek_ffn_specs(cfg, i, fused_experts)
        if m.q_lora_rank is None:
            specs.append(TensorSpec(attn + "q_proj.weight", (N * qk, D), "[N*qk, D]",
                                    _rows((jx, "attn", "wq"), q_order, N, qk, D)))
        else:
            Q = m.q_lora_rank
            specs += [
                TensorSpec(attn + "q_a_proj.weight", (Q, D), "[q_lora_rank, D]", _as_is((jx, "attn", "wq_a"))),
                TensorSpec(attn + "q_a_layernorm.weight", (Q,), "[q_lora_rank]",
                           _as_is((jx, "attn", "q_norm", "scale"))),
                TensorSpec(attn + "q_b_proj.weight", (N * qk, Q), "[N*qk, q_lora_rank]",
                           _rows((jx, "attn", "wq_b"), q_order, N, qk, Q)),
            ]
            if cfg.qkv_bias:
                specs.append(TensorSpec(attn + "q_a_proj.bias", (Q,), "[q_lora_rank]",
                                        _as_is((jx, "attn", "wq_a_bias"))))
        if cfg.qkv_bias:
            specs.append(TensorSpec(attn + "kv_a_proj_with_mqa.bias", (R + E,), "[R+E]",
                                    _rows((jx, "attn", "wkv_a_bias"), kv_order)))
        if cfg.out_bias:
            specs.append(TensorSpec(attn + "o_proj.bias", (D,), "[D]", _as_is((jx, "attn", "wo_bias"))))
    return specs


def _deepseek_ffn_specs(cfg: Config, i: int, fused_experts: bool) -> list[TensorSpec]:
    """Layer i's FFN: the dense MLP, or the router, the shared experts and the X routed experts (one [I, D] /
    [D, I] tensor per expert and projection, loaded under the expert's index and stacked by `_stack_experts`; or
    transformers' fused gate_up_proj [X, 2*I, D] and down_proj [X, D, I])."""
    hf, mlp, D, F, m = f"layers.{i}.mlp.", (f"layer_{i}", "mlp"), cfg.d_model, cfg.ffn_dim, cfg.moe
    if m is None or not m.is_moe_layer(i):
        return [TensorSpec(hf + "gate_proj.weight", (F, D), "[F, D]", _as_is((*mlp, "w_gate"))),
                TensorSpec(hf + "up_proj.weight", (F, D), "[F, D]", _as_is((*mlp, "w_up"))),
                TensorSpec(hf + "down_proj.weight", (D, F), "[D, F]", _as_is((*mlp, "w_down")))]
    X, I, J = m.n_routed_experts, m.moe_ffn_dim, m.shared_ffn_dim
    specs = [TensorSpec(hf + "gate.weight", (X, D), "[X, D]", _as_is((*mlp, "router")))]
    if m.topk_method == "noaux_tc":
        specs.append(TensorSpec(hf + "gate.e_score_correction_bias", (X,), "[X]", _as_is((*mlp, "router_bias"))))
    specs += [TensorSpec(hf + "shared_experts.gate_proj.weight", (J, D), "[J, D]", _as_is((*mlp, "ws_gate"))),
              TensorSpec(hf + "shared_experts.up_proj.weight", (J, D), "[J, D]", _as_is((*mlp, "ws_up"))),
              TensorSpec(hf + "shared_experts.down_proj.weight", (D, J), "[D, J]", _as_is((*mlp, "ws_down")))]
    if fused_experts:
        def split_gate_up(w):  # [X, 2*I, D]: gate rows, then up rows (transformers' chunk(2))
            return {(*mlp, "we_gate"): np.ascontiguousarray(w[:, :I]), (*mlp, "we_up"): np.ascontiguousarray(w[:, I:])}

        return specs + [TensorSpec(hf + "experts.gate_up_proj", (X, 2 * I, D), "[X, 2*I, D]", split_gate_up),
                        TensorSpec(hf + "experts.down_proj", (X, D, I), "[X, D, I]", _as_is((*mlp, "we_down")))]
    for j in range(X):
        e = f"{hf}experts.{j}."
        specs += [TensorSpec(e + "gate_proj.weight", (I, D), "[I, D]", _as_is((*mlp, "we_gate", j))),
                  TensorSpec(e + "up_proj.weight", (I, D), "[I, D]", _as_is((*mlp, "we_up", j))),
                  TensorSpec(e + "down_proj.weight", (D, I), "[D, I]", _as_is((*mlp, "we_down", j)))]
    return specs


_FUSED_EXPERTS = re.compile(r"(model\.)?layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")


def fused_experts_stored(stored) -> bool:
    """Whether a checkpoint's experts are 3D per layer (transformers 5's in-memory form, e.g. a state_dict saved
    as is) rather than one tensor per expert (DeepSeek's releases, and transformers 5.24's save_pretrained)."""
    return any(_FUSED_EXPERTS.fullmatch(name) for name in stored)


def _gpt2_specs(cfg: Config) -> list[TensorSpec]:
    V, D, N, H, F = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim
    specs = [TensorSpec("wte.weight", (V, D), "[V, D]", _as_is(("embedding",))),
             TensorSpec("wpe.weight", (cfg.max_positions, D), "[n_positions, D]", _as_is(("pos_embedding",))),
             TensorSpec("ln_f.weight", (D,), "[D]", _as_is(("final_norm", "scale"))),
             TensorSpec("ln_f.bias", (D,), "[D]", _as_is(("final_norm", "bias")))]
    for i in range(cfg.n_layers):
        hf, jx = f"h.{i}.", f"layer_{i}"
        specs += [
            TensorSpec(hf + "ln_1.weight", (D,), "[D]", _as_is((jx, "attn_norm", "scale"))),
            TensorSpec(hf + "ln_1.bias", (D,), "[D]", _as_is((jx, "attn_norm", "bias"))),
            TensorSpec(hf + "ln_2.weight", (D,), "[D]", _as_is((jx, "mlp_norm", "scale"))),
            TensorSpec(hf + "ln_2.bias", (D,), "[D]", _as_is((jx, "mlp_norm", "bias"))),
            TensorSpec(hf + "attn.c_attn.weight", (D, 3 * D), "[D, 3*D]",
                       _split_qkv([(jx, "attn", w) for w in ("wq", "wk", "wv")], N, H, D)),
            TensorSpec(hf + "attn.c_attn.bias", (3 * D,), "[3*D]",
                       _split_qkv([(jx, "attn", w) for w in ("wq_bias", "wk_bias", "wv_bias")], N, H)),
            TensorSpec(hf + "attn.c_proj.weight", (D, D), "[N*H, D]", _conv1d((jx, "attn", "wo"), D, N, H)),
            TensorSpec(hf + "attn.c_proj.bias", (D,), "[D]", _as_is((jx, "attn", "wo_bias"))),
            TensorSpec(hf + "mlp.c_fc.weight", (D, F), "[D, F]", _conv1d((jx, "mlp", "w_fc"))),
            TensorSpec(hf + "mlp.c_fc.bias", (F,), "[F]", _as_is((jx, "mlp", "w_fc_bias"))),
            TensorSpec(hf + "mlp.c_proj.weight", (F, D), "[F, D]", _conv1d((jx, "mlp", "w_down"))),
            TensorSpec(hf + "mlp.c_proj.bias", (D,), "[D]", _as_is((jx, "mlp", "w_down_bias"))),
        ]
    return specs


# --- safetensors headers --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor's name as written in its file, the file, and what its header says (no data is read)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "F32", "BF16", ...


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """(safetensors files, the index's tensor -> file map or None, the index path or None).

    transformers' order: a single model.safetensors first, then a sharded one through its index."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single], None, None
    if index.is_file():
        weight_map = _read_index(index)
        shards = []
        for name in sorted(set(weight_map.values())):
            path = directory / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard named in {index} is missing")
            shards.append(path)
        return shards, weight_map, index
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    if pickles:
        raise ValueError(f"{directory}: has only {', '.join(pickles)} (a pickle-based PyTorch checkpoint), which "
                         f"jaxkv does not read because unpickling can run arbitrary code; convert it to "
                         f"safetensors (e.g. `model.save_pretrained(dir, safe_serialization=True)` in transformers)")
    raise FileNotFoundError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path}: expected an object with a non-empty 'weight_map' of tensor name -> file")
    for tensor, name in weight_map.items():
        # Shards sit next to the index; a path that leaves the directory is refused rather than followed.
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{path}: tensor {tensor!r} maps to {name!r}, which is not a file name in the "
                             f"checkpoint directory")
    return weight_map


def read_headers(files: list[Path], weight_map: dict[str, str] | None, index: Path | None) -> dict[str, StoredTensor]:
    """name -> StoredTensor for every tensor in `files`, from their headers alone.

    A truncated or corrupt file fails here: safe_open checks that the file covers every tensor's byte range.
    With an index, each tensor must sit in the shard the index names, and each tensor of a shard must be listed.
    """
    stored: dict[str, StoredTensor] = {}
    for path in files:
        for name, shape, dtype in _header(path):
            if name in stored:
                raise ValueError(f"tensor {name!r} appears in both {stored[name].file} and {path}")
            if weight_map is not None and weight_map.get(name) != path.name:
                where = f"puts it in {weight_map[name]!r}" if name in weight_map else "does not list it"
                raise ValueError(f"{path}: holds tensor {name!r}, but {index} {where}")
            stored[name] = StoredTensor(name, path, shape, dtype)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in stored:
                raise ValueError(f"{index}: lists tensor {name!r} in {file!r}, but that file does not hold it")
    return stored


def _header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    try:
        with safe_open(path, framework="numpy") as f:
            out = []
            for name in f.keys():
                piece = f.get_slice(name)
                out.append((name, tuple(int(n) for n in piece.get_shape()), piece.get_dtype()))
            return out
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None


# --- matching ---------------------------------------------------------------------------------------------------


def _strip_prefix(stored: dict[str, StoredTensor], prefix: str) -> dict[str, StoredTensor]:
    """Keys without the base-model prefix. A checkpoint saved from the base model alone (e.g. the original `gpt2`
    upload) has no prefix at all; `lm_head.weight` never has one."""
    if not any(name.startswith(prefix) for name in stored):
        return dict(stored)
    return {name.removeprefix(prefix): t for name, t in stored.items()}


def _checkpoint_names(stored: dict[str, StoredTensor],
                      arch: str) -> tuple[dict[str, StoredTensor], Callable[[str], str]]:
    """(the stored tensors keyed by the names `tensor_specs` uses, how the checkpoint would spell such a name).

    Gemma3ForConditionalGeneration / Gemma4ForConditionalGeneration (`MULTIMODAL`): the language model's tensors
    under either of its prefixes (one per checkpoint) and the head under its name there; the vision (and audio)
    towers and projectors (GEMMA3_SKIPPED, GEMMA4_SKIPPED) are left out here, the only tensors of any checkpoint
    skipped by design."""
    if arch not in MULTIMODAL:
        prefix = BASE_PREFIX[arch]
        return _strip_prefix(stored, prefix), lambda name: name if name == "lm_head.weight" else prefix + name
    prefixes, skipped = MULTIMODAL[arch]
    used = [p for p in prefixes if any(name.startswith(p) for name in stored)]
    if len(used) > 1:
        raise ValueError(f"the checkpoint holds language-model tensors under both {used[0]!r} and {used[1]!r}; "
                         f"expected one of the two naming schemes")
    prefix = used[0] if used else next(iter(prefixes))
    by_name: dict[str, StoredTensor] = {}
    for name, t in stored.items():
        if skipped.fullmatch(name):
            continue
        key = "lm_head.weight" if name in prefixes.values() else name.removeprefix(prefix)
        if key in by_name:
            raise ValueError(f"tensors {by_name[key].name!r} and {name!r} are both the language model's {key!r}")
        by_name[key] = t
    return by_name, lambda name: prefixes[prefix] if name == "lm_head.weight" else prefix + name


def match(specs: list[TensorSpec], stored: dict[str, StoredTensor], *, arch: str, tied: bool,
          ignored: frozenset[str] = frozenset(),
          fp8: bool = False) -> tuple[list[tuple[TensorSpec, StoredTensor]], StoredTensor | None]:
    """Pairs every expected tensor with its stored one, checking names, shapes and dtypes; refuses leftovers.

    Returns (pairs, the stored lm_head of a tied model, to be compared with the embedding, or None). The first
    pair is the embedding. `ignored`: names (as in `tensor_specs`) that may be present and are dropped
    (`ignored_tensors`). `fp8`: a block-quantized FP8 checkpoint, whose weights may also be F8_E4M3 (their scales
    already split off, `checkpoint_fp8.split_scales`).
    """
    dtypes = [*FLOAT_DTYPES, checkpoint_fp8.F8_DTYPE] if fp8 else list(FLOAT_DTYPES)
    by_name, stored_name = _checkpoint_names(stored, arch)
    pairs = []
    for spec in specs:
        t = by_name.pop(spec.name, None)
        if t is None:
            raise ValueError(f"tensor {stored_name(spec.name)!r} is missing from the checkpoint")
        if t.shape != spec.shape:
            raise ValueError(f"tensor {t.name!r} in {t.file} has shape {list(t.shape)}, but config.json implies "
                             f"{spec.letters} = {list(spec.shape)}")
        if t.dtype not in dtypes:
            hint = " (an FP8 checkpoint needs its quantization_config in config.json)" if "F8" in t.dtype else ""
            raise ValueError(f"tensor {t.name!r} in {t.file} has dtype {t.dtype}; expected one of "
                             f"{', '.join(dtypes)}{hint}")
        pairs.append((spec, t))
    tied_head = by_name.pop("lm_head.weight", None) if tied else None
    if tied_head is not None and tied_head.shape != pairs[0][1].shape:
        raise ValueError(f"tensor 'lm_head.weight' in {tied_head.file} has shape {list(tied_head.shape)}, but the "
                         f"model ties it to the embedding of shape {list(pairs[0][1].shape)}")
    for name, t in by_name.items():
        if not REDUNDANT[arch].fullmatch(name) and name not in ignored:
            raise ValueError(f"tensor {t.name!r} in {t.file} is not used by this architecture (is config.json's "
                             f"'architectures' right?)")
    return pairs, tied_head


# --- loading ----------------------------------------------------------------------------------------------------


def load_hf(directory: str | os.PathLike, *, dtype: str | None = None) -> Model:
    """Loads a Hugging Face checkpoint directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json) of a supported architecture (see ARCHITECTURES) into a `jaxkv.Model`.

    Args:
      directory: the checkpoint directory.
      dtype: "float32", "bfloat16" or "float16" to cast the weights to; None keeps the checkpoint's dtype (that
        of its embedding, for a checkpoint that mixes dtypes).

    Returns:
      Model(config, params, tokenizer=None), with config.dtype the params' dtype.

    Raises:
      FileNotFoundError: the directory, config.json, or a weight file or shard is missing.
      ValueError: anything else wrong with the checkpoint (see the module docstring), before large allocations.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be None or one of {DTYPES}, got {dtype!r}")
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    hf = read_config(root)
    source = str(root / CONFIG_FILE)
    arch = architecture(hf, source=source)
    config = config_from_hf(hf, source=source)
    block = checkpoint_fp8.block_size(hf, source=source)  # block-quantized FP8: dequantized at load
    stored, scales = checkpoint_fp8.split_scales(read_headers(*weight_files(root)), block)
    specs = tensor_specs(arch, config, interleaved=arch in DEEPSEEK and rope_interleaved(hf, arch),
                         fused_experts=config.moe is not None and fused_experts_stored(stored))
    pairs, tied_head = match(specs, stored, arch=arch, tied=config.tie_embeddings,
                             ignored=ignored_tensors(arch, config) | _mtp_tensors(hf, arch, config, stored, source),
                             fp8=block is not None)
    if tied_head is not None:
        _check_tied_head(tied_head, pairs[0][1])
    target = dtype or FLOAT_DTYPES.get(pairs[0][1].dtype, "bfloat16")
    config = config.replace(dtype=target)  # the weight layout follows the dtype (`layers.stored_out_in`)
    params = _load(pairs, target, config, scales, block)
    return Model(config=config, params=params, tokenizer=None)


def _read(t: StoredTensor) -> np.ndarray:
    try:
        if t.dtype == checkpoint_fp8.F8_DTYPE:
            return checkpoint_fp8.read_f8(t.file, t.name)
        with safe_open(t.file, framework="numpy") as f:
            return f.get_tensor(t.name)
    except (safetensors.SafetensorError, OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{t.file}: could not read tensor {t.name!r}: {e}") from None


def _check_tied_head(head: StoredTensor, embedding: StoredTensor):
    """A tied model's stored lm_head is redundant only if it really equals the embedding."""
    if not np.array_equal(_read(head), _read(embedding)):
        raise ValueError(f"tensor 'lm_head.weight' in {head.file} differs from the embedding {embedding.name!r}, "
                         f"but config.json sets tie_word_embeddings, so it would be silently dropped")


def _load(pairs: list[tuple[TensorSpec, StoredTensor]], target: str, config: Config, scales=None,
          block=None) -> dict:
    """Reads, converts and casts each tensor in turn (one host copy at a time) into the nested params dict; an
    FP8 weight is dequantized with its block scales first (`scales`: weight name -> scale tensor)."""
    params: dict = {}
    in_out = in_out_names(config)
    for spec, t in pairs:
        w = _read(t)
        if t.dtype == checkpoint_fp8.F8_DTYPE:
            w = checkpoint_fp8.dequantize(w, _read(scales[t.name]), block)
        # safetensors has no checksum; random bytes in the data region usually decode to some NaN or inf.
        if not np.isfinite(w).all():
            raise ValueError(f"tensor {t.name!r} in {t.file} holds NaN or infinite values (corrupt checkpoint?)")
        for path, value in spec.convert(w).items():
            if path[-1] in in_out:  # the mapping above is to the [out, in] form; this weight is stored [in, out]
                value = np.ascontiguousarray(value.transpose(ALL_OUT_IN_ORDER[path[-1]]))
            # transformers keeps the router in float32 whatever the model's dtype (`jaxkv.moe.Moe`)
            dtype = "float32" if path[-1] in ("router", "router_bias") else target
            with np.errstate(over="ignore"):  # reported just below, with the tensor's name
                value = value.astype(dtype)
            if not np.isfinite(value).all():
                raise ValueError(f"tensor {t.name!r} in {t.file} overflows {dtype}; load it with a wider dtype")
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            # one expert of a per-expert checkpoint stays on the host until `_stack_experts`
            node[path[-1]] = value if isinstance(path[-1], int) else jnp.asarray(value)
    if config.moe is not None:
        _stack_experts(params, config, target)
    return params


def _stack_experts(params: dict, config: Config, dtype: str):
    """Each MoE layer's experts as [X, ...] arrays (stacked from per-expert tensors, which `_load` put under the
    expert's index), then the experts and shared experts laid out as `jaxkv.moe.in_out_names` says for `dtype`."""
    m = config.moe
    for i in range(m.first_dense_layers, config.n_layers):
        node = params[f"layer_{i}"]["mlp"]
        for name in ("we_gate", "we_up", "we_down"):
            if isinstance(node[name], dict):
                node[name] = np.stack([node[name][j] for j in range(m.n_routed_experts)])
        laid_out = moe_lib.from_out_in({k: node[k] for k in moe_lib.OUT_IN_ORDER if k in node}, m, config.d_model,
                                       dtype)
        node.update({k: jnp.asarray(v) for k, v in laid_out.items()})
