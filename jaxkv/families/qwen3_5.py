"""Qwen3.5 (`model_type` qwen3_5_text, qwen3_5_moe_text, and qwen3_5 / qwen3_5_moe: the multimodal models, their
language model only): Qwen3-Next's hybrid decoder (`jaxkv.families.qwen3_next`: Gated DeltaNet "linear_attention"
layers and gated full-attention layers) with separate linear-layer projections, multimodal rotary positions, a dense
MLP (Qwen3_5ForCausalLM) or experts on every layer (Qwen3_5MoeForCausalLM), as transformers 5.25 builds them
(modeling_qwen3_5.py, modeling_qwen3_5_moe.py):

  - as Qwen3-Next: every norm is (1 + w) in float32 (Qwen3_5RMSNorm, Gemma's; jaxkv's "gemma_rmsnorm"), the q/k
    norms too; the linear layers' gated norm multiplies by w; the full layers' attention is Qwen3NextAttention
    (per head a query and an output gate in q_proj, q/k norms, partial rotation); the delta rule (l2-normed q/k,
    key heads repeated for Hv / Hk consecutive value heads) is transformers' same functions.
  - rotary positions are "mrope": cos/sin per frequency taken from one of three position grids (temporal, height,
    width; `mrope_section`, interleaved). For token ids alone both classes feed the same position to all three
    grids (Qwen3_5TextModel expands the 1D positions; Qwen3_5ForConditionalGeneration's generate and forward do too
    without images), so every frequency sees that position: plain rotary positions on the first
    partial_rotary_factor * head_dim dims (`Config.rotary_dim`), whatever `mrope_section` / `mrope_interleaved`
    say. rope_type default, linear, llama3 or yarn (transformers computes their frequencies over the rotated dims,
    as jaxkv does); others (dynamic, longrope, ...) and per-layer-type settings are refused.
  - MoE: every layer is sparse (Qwen3_5MoeDecoderLayer always builds the sparse block: decoder_sparse_step and
    mlp_only_layers are not fields of Qwen3_5MoeTextConfig and nothing reads them, so the mapping ignores them,
    and intermediate_size too); softmax router, top num_experts_per_tok, always renormalized
    (Qwen3_5MoeTopKRouter: norm_topk_prob is not read either); one shared expert of shared_expert_intermediate_size
    times sigmoid(shared_expert_gate x).
  - omitted fields take Qwen3_5TextConfig / Qwen3_5MoeTextConfig's defaults: sizes (vocab 248320, hidden 4096 /
    2048, intermediate 12288, 32 / 40 layers, 16 heads, 4 / 2 key-value heads, head_dim 256), linear layers (16 key
    heads, 32 value heads, dims 128, conv 4), experts (256, 8 per token, widths 512), partial_rotary_factor 0.25
    (the config's default when neither rope_parameters nor the top level sets it), layer_types every
    full_attention_interval-th (4) layer full.
  - Qwen3_5(Moe)ForConditionalGeneration: config.json's `text_config`; tie_word_embeddings and eos_token_id (when
    set) are the outer config's (the loader's rule for every multimodal family). Caveat: an outer config that
    omits tie_word_embeddings is untied for transformers (Qwen3_5Config's default) but tied for the loader (the
    Gemmas' default); save_pretrained always writes the field, and such a checkpoint with its own lm_head fails
    to load (the head differs from the embedding) rather than loading wrong.

Tensors (names without the base model's prefix; letters as in `jaxkv.shapes`):

  layers.{i}.input_layernorm / post_attention_layernorm.weight [D] -> layer_{i}/attn_norm, mlp_norm/scale
  full layers: layers.{i}.self_attn.* as Qwen3-Next's (q_proj [N*2H, D] -> wq, wq_gate; k/v/o_proj, q/k norms)
  linear layers (layer_{i}/linear_attn/...):
  linear_attn.in_proj_qkv.weight [2*Hk*Dk + Hv*Dv, D]: all q heads, all k heads, all v heads  -> w_qkv  as is
                                                 (the conv's channel order, which is jaxkv's w_qkv order)
  linear_attn.in_proj_z.weight [Hv*Dv, D]        -> w_z    as is
  linear_attn.in_proj_b.weight, in_proj_a.weight [Hv, D]  -> w_b, w_a  as is
  linear_attn.conv1d, dt_bias, A_log, norm, out_proj  -> as Qwen3-Next's
  dense MLP (qwen3_5_text, qwen3_5): mlp.{gate,up,down}_proj as Llama's
  experts (qwen3_5_moe_text, qwen3_5_moe): mlp.gate.weight [X, D] -> router; mlp.experts.{j}.{gate,up,down}_proj
  (what transformers 5.25's save_pretrained writes, for both classes) or the fused mlp.experts.gate_up_proj
  [X, 2*I, D] / down_proj [X, D, I] (its in-memory form: a state_dict saved as is); mlp.shared_expert.* and
  mlp.shared_expert_gate.weight [1, D] as Qwen3-Next's.

Base-model prefix: `model.` (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; head `lm_head.weight`) or
`model.language_model.` (the ForConditionalGeneration classes; head `lm_head.weight`), as transformers 5.25's
save_pretrained writes them. The vision tower (`model.visual.*`) is skipped by name: jaxkv runs the language model
only, on token ids. The releases' multi-token-prediction layer (`mtp.*`, which transformers drops) loads into
`Model.mtp` as Qwen3-Next's does (`qwen3_next.mtp_plan`; vLLM's qwen3_5_mtp.py composes it alike). Not read: a
text-only class's checkpoint whose language model sits under `model.language_model.` (transformers' PrefixChange
loads one; the loader's prefixes cannot tell `model.` from it).
"""

from __future__ import annotations

import re

from jaxkv.config import Config, MoeConfig
from jaxkv.families import fields as fl
from jaxkv.families.qwen3_next import (hybrid_fields, hybrid_tensors, linear_attention_common, mtp_plan,
                                        with_defaults)
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec, as_is

# transformers 5.25's Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults for the fields the shared readers
# (`llama.base_fields`) require or default differently; the rest of their defaults equal the readers' own.
DENSE_DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                      num_attention_heads=16, num_key_value_heads=4)
MOE_DEFAULTS = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2)

# Qwen3_5(Moe)ForConditionalGeneration: the language model under `model.language_model.`, the head beside it
PREFIXES = {"model.language_model.": "lm_head.weight"}
# ... and the vision tower, which jaxkv (text only) skips by name; any other tensor is refused as always
VISION = re.compile(r"model\.visual\..+")


def qwen3_5_fields(f: fl.Fields) -> dict:
    """Qwen3_5TextConfig: every layer's MLP dense, of intermediate_size."""
    kwargs = hybrid_fields(with_defaults(f, DENSE_DEFAULTS), max_positions=32768)
    kwargs["moe"] = None
    return kwargs


def qwen3_5_moe_fields(f: fl.Fields) -> dict:
    """Qwen3_5MoeTextConfig: experts with the gated shared expert on every layer."""
    width = f.int("moe_intermediate_size", 512, cap=fl.MAX_FFN)
    # no dense layer: ffn_dim is unused, and config.json has no intermediate_size (transformers ignores one)
    kwargs = hybrid_fields(with_defaults(f, MOE_DEFAULTS, intermediate_size=width), max_positions=32768)
    try:
        kwargs["moe"] = MoeConfig(
            n_routed_experts=f.int("num_experts", 256, cap=fl.MAX_EXPERTS),
            experts_per_token=f.int("num_experts_per_tok", 8, cap=fl.MAX_EXPERTS),
            moe_ffn_dim=width, scoring="softmax", topk_method="greedy", norm_topk_prob=True,
            shared_expert_ffn_dim=f.int("shared_expert_intermediate_size", 512, cap=fl.MAX_FFN),
            shared_expert_gate=True)
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None
    return kwargs


def linear_attention_separate(cfg: Config, i: int) -> list[TensorSpec]:
    """A Qwen3.5 linear layer: in_proj_qkv (the conv's channels: all q, all k, all v heads), in_proj_z, in_proj_b
    and in_proj_a, each already in jaxkv's layout."""
    la, D = cfg.linear_attention, cfg.d_model
    Hv, Dv, U = la.value_heads, la.value_head_dim, la.conv_dim
    hf, jx = f"layers.{i}.linear_attn.", (f"layer_{i}", "linear_attn")
    return [TensorSpec(hf + "in_proj_qkv.weight", (U, D), "[2*Hk*Dk + Hv*Dv, D]", as_is((*jx, "w_qkv"))),
            TensorSpec(hf + "in_proj_z.weight", (Hv * Dv, D), "[Hv*Dv, D]", as_is((*jx, "w_z"))),
            TensorSpec(hf + "in_proj_b.weight", (Hv, D), "[Hv, D]", as_is((*jx, "w_b"))),
            TensorSpec(hf + "in_proj_a.weight", (Hv, D), "[Hv, D]", as_is((*jx, "w_a")))] + linear_attention_common(
        cfg, i)


def qwen3_5_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    return hybrid_tensors(cfg, names, linear_attention_separate)


# The text-only classes skip a vision tower too, as transformers' do (`_keys_to_ignore_on_load_unexpected`).
QWEN3_5_TEXT = register(Family("qwen3_5_text", ("Qwen3_5ForCausalLM",), qwen3_5_fields, qwen3_5_tensors,
                               skipped=VISION, mtp=mtp_plan))
QWEN3_5_MOE_TEXT = register(Family("qwen3_5_moe_text", ("Qwen3_5MoeForCausalLM",), qwen3_5_moe_fields,
                                   qwen3_5_tensors, skipped=VISION, mtp=mtp_plan))
QWEN3_5 = register(Family("qwen3_5", ("Qwen3_5ForConditionalGeneration",), qwen3_5_fields, qwen3_5_tensors,
                          prefixes=PREFIXES, skipped=VISION, mtp=mtp_plan, text_config=True))
QWEN3_5_MOE = register(Family("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration",), qwen3_5_moe_fields,
                              qwen3_5_tensors, prefixes=PREFIXES, skipped=VISION, mtp=mtp_plan,
                              text_config=True))
