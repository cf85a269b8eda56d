"""Gemma 2 and Gemma 3 (`model_type` gemma2, gemma3_text, and gemma3: the multimodal model, its language model
only): GeGLU, zero-centred RMS norms (x * (1 + w), stored as is) before and after both the attention and the MLP,
embeddings times sqrt(D), scores scaled by query_pre_attn_scalar ** -0.5, sliding and full layers. Gemma 2: tanh
soft caps on the scores and the logits. Gemma 3: q/k norms (as Qwen3's), a rotary base per layer type.

Tensors: Llama's table for embeddings, attention (attention_bias as Llama's), MLP, final norm and head, with four
norms per layer
  layers.{i}.input_layernorm.weight            [D] -> layer_{i}/attn_norm/scale
  layers.{i}.post_attention_layernorm.weight   [D] -> layer_{i}/post_attn_norm/scale   (the attention output's)
  layers.{i}.pre_feedforward_layernorm.weight  [D] -> layer_{i}/mlp_norm/scale
  layers.{i}.post_feedforward_layernorm.weight [D] -> layer_{i}/post_mlp_norm/scale    (the MLP output's)
Gemma3ForConditionalGeneration: the same names under `language_model.model.` (Google's releases, and what
transformers 5.24's save_pretrained writes; untied head `language_model.lm_head.weight`) or
`model.language_model.` (transformers 5's module names; head `lm_head.weight`). Its vision tower and multimodal
projector (`vision_tower.*`, `multi_modal_projector.*`, with or without `model.`) are skipped by name: jaxkv runs
the language model only, on token ids.

The config is read as transformers 5.24 reads it:
  - per-layer attention: `layer_types`, else transformers' default: Gemma 2 alternates (sliding first), Gemma 3
    has every `sliding_window_pattern`-th (6) layer full.
  - Gemma 3's rope per layer type (`rope_parameters.full_attention` / `.sliding_attention`, or 4.x's rope_theta,
    rope_local_base_freq and rope_scaling, the last for the full layers only): the full layers' base and scaling
    become rope_theta / rope_scaling (rope types default, linear, llama3, yarn), the sliding layers' base
    rope_local_theta (their rope type must be default).
  - omitted fields take Gemma2Config / Gemma3TextConfig's defaults (Google's Gemma 3 configs rely on them);
    Gemma3ForConditionalGeneration reads `text_config`, with tie_word_embeddings and eos_token_id (when set) from
    the outer config.
  - transformers 5.24 ignores two Gemma 3 fields, and so does the mapping (parity is with transformers):
    attn_logit_softcapping (Gemma3Attention never passes it on; Gemma 2's is Config.attn_logit_softcap) and, for
    Gemma3ForConditionalGeneration only, final_logit_softcapping (Gemma3ForCausalLM applies it).
  - refused: use_bidirectional_attention, a hidden_activation other than gelu_pytorch_tanh (or gelu_new, the same
    tanh approximation), rope types other than the above, a null sliding_window with sliding layers.
"""

from __future__ import annotations

import re

from jaxkv.families import fields as fl
from jaxkv.families.llama import decoder_tensors
from jaxkv.families.registry import Family, register

# transformers 5.24's Gemma2Config / Gemma3TextConfig defaults, for fields a config.json omits: Google's Gemma 3
# releases spell out only a few fields of their text_config (hidden_size, intermediate_size, num_hidden_layers,
# sliding_window, rope_scaling) and rely on these for the rest. The tensors then check the sizes.
GEMMA2_DEFAULTS = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                       query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0)
GEMMA3_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                       query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                       attn_logit_softcapping=None)
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta

# Gemma3ForConditionalGeneration holds its language model under one of two prefixes, each with its own lm_head name
# (when untied): Google's releases and transformers 5.24's save_pretrained (which converts back to that layout)
# write the first; transformers 5's in-memory module names (a state_dict saved as is) are the second.
GEMMA3_PREFIXES = {"language_model.model.": "language_model.lm_head.weight", "model.language_model.": "lm_head.weight"}
# ... and its vision tower and multimodal projector, which jaxkv (text only) skips by name, explicitly: any other
# tensor outside the language model is refused as for every architecture.
GEMMA3_SKIPPED = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\..+")


def geglu(f: fl.Fields):
    act = f.str("hidden_activation", "gelu_pytorch_tanh")
    # gelu_new is the same tanh approximation (GPT-2's name for it); jaxkv's GeGLU computes that one
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        f.fail("hidden_activation", f"= {act!r} is not supported; jaxkv's GeGLU MLP uses gelu_pytorch_tanh")


def gemma_fields(f: fl.Fields, d: dict, *, gemma3: bool, attn_softcap: bool, final_softcap: bool) -> dict:
    """The shared mapping; `d`: the defaults; `attn_softcap` / `final_softcap`: whether transformers applies
    attn_logit_softcapping (Gemma 2) / final_logit_softcapping (not Gemma3ForConditionalGeneration)."""
    geglu(f)
    if f.bool("use_bidirectional_attention", False):
        f.fail("use_bidirectional_attention", "= true is not supported (jaxkv decodes with causal attention)")
    d_model = f.int("hidden_size", d["hidden_size"], cap=fl.MAX_D_MODEL)
    n_layers = f.int("num_hidden_layers", d["num_hidden_layers"], cap=fl.MAX_LAYERS)
    kwargs = dict(
        vocab_size=f.int("vocab_size", d["vocab_size"], cap=fl.MAX_VOCAB),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=f.int("num_attention_heads", d["num_attention_heads"], cap=fl.MAX_HEADS),
        n_kv_heads=f.int("num_key_value_heads", d["num_key_value_heads"], cap=fl.MAX_HEADS),
        head_dim=f.int("head_dim", d["head_dim"], cap=fl.MAX_HEAD_DIM),
        ffn_dim=f.int("intermediate_size", d["intermediate_size"], cap=fl.MAX_FFN),
        ffn_kind="geglu",
        norm_kind="gemma_rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        positions="rope",
        max_positions=f.int("max_position_embeddings", d["max_position_embeddings"]),
        tie_embeddings=f.bool("tie_word_embeddings", True),
        embed_scale=d_model ** 0.5,  # transformers: hidden_size ** 0.5, rounded to the weights' dtype (the model)
        post_norms=True,
        qk_norm=gemma3,
        query_pre_attn_scalar=f.positive("query_pre_attn_scalar", d["query_pre_attn_scalar"]),
    )
    # attention_bias covers q, k, v and o
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)

    types = f.hf.get("layer_types")
    if types is None:
        # transformers' defaults: Gemma 2 alternates sliding (even layers) and full; Gemma 3 has every
        # sliding_window_pattern-th layer full (the pattern is a constructor argument, not a stored field)
        pattern = f.int("sliding_window_pattern", 6) if gemma3 else 2
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    fl.check_layer_types(f, types, n_layers)
    window = f.int("sliding_window", None) if "sliding_window" in f.hf else d["sliding_window"]
    if window is None and "sliding_attention" in types:
        f.fail("sliding_window", "is null but layer_types has sliding_attention layers")
    kwargs["layer_types"], kwargs["sliding_window"] = fl.jaxkv_layer_types(types, window)

    if gemma3:
        kwargs["rope_theta"], kwargs["rope_scaling"], kwargs["rope_local_theta"] = _gemma3_rope(
            f, kwargs["max_positions"])
    else:
        kwargs["rope_theta"], kwargs["rope_scaling"] = fl.rope(f, kwargs["max_positions"], types=fl.NEWER_ROPE_TYPES)
    # transformers 5.24 applies attn_logit_softcapping in Gemma 2 only: Gemma3Attention never passes it to the
    # attention function, so a Gemma 3 config's value changes nothing there, nor here. Likewise
    # final_logit_softcapping: Gemma3ForCausalLM applies it, Gemma3ForConditionalGeneration does not.
    if attn_softcap:
        kwargs["attn_logit_softcap"] = f.positive("attn_logit_softcapping", d["attn_logit_softcapping"])
    if final_softcap:
        kwargs["final_logit_softcap"] = f.positive("final_logit_softcapping", d["final_logit_softcapping"])
    return kwargs


def _gemma3_rope(f: fl.Fields, max_positions: int):
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
    theta, scaling = fl.rope_entry(f, "rope_parameters.full_attention", entries["full_attention"], max_positions,
                                   fl.NEWER_ROPE_TYPES)
    local, _ = fl.rope_entry(f, "rope_parameters.sliding_attention", entries["sliding_attention"], max_positions,
                             ("default",))  # jaxkv's sliding layers take no scaling (`Config.layer_rope`)
    return theta, scaling, local


def _gemma2(f):
    return gemma_fields(f, GEMMA2_DEFAULTS, gemma3=False, attn_softcap=True, final_softcap=True)


def _gemma3_text(f):
    return gemma_fields(f, GEMMA3_DEFAULTS, gemma3=True, attn_softcap=False, final_softcap=True)


def _gemma3(f):
    return gemma_fields(f, GEMMA3_DEFAULTS, gemma3=True, attn_softcap=False, final_softcap=False)


GEMMA2 = register(Family("gemma2", ("Gemma2ForCausalLM",), _gemma2, decoder_tensors))
GEMMA3_TEXT = register(Family("gemma3_text", ("Gemma3ForCausalLM",), _gemma3_text, decoder_tensors))
GEMMA3 = register(Family("gemma3", ("Gemma3ForConditionalGeneration",), _gemma3, decoder_tensors,
                         prefixes=GEMMA3_PREFIXES, skipped=GEMMA3_SKIPPED, text_config=True))
