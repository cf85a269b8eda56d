"""GLM-4.5 / GLM-4.6 (`model_type` glm4_moe, Glm4MoeForCausalLM), as transformers 5.25 builds it
(configuration_glm4_moe.py, modeling_glm4_moe.py): Llama-style grouped-query attention with q/k/v biases
(`attention_bias`; o_proj never has one), optional q/k norms over each head (`use_qk_norm`), rotary embeddings on
the first half of each head (`partial_rotary_factor`, 0.5 where the file gives none: rotate-half over those dims,
`Config.rotary_dim`), RMSNorm (w x, eps 1e-5 by default); the first `first_k_dense_replace` layers keep a dense
SwiGLU MLP of intermediate_size, the rest DeepSeek-V3's mixture of experts (sigmoid scores plus the
e_score_correction_bias choose, n_group / topk_group group limits, the chosen scores normalized under
norm_topk_prob and scaled by routed_scaling_factor; n_shared_experts always-on experts of moe_intermediate_size
each): `jaxkv.families.deepseek`'s router and experts, GLM's own defaults.

Tensors (under `model.`, head `lm_head.weight`): Llama's embedding, norms and attention (`tensors.attention`:
q_proj/k_proj/v_proj (+ biases), o_proj, q_norm/k_norm), dense MLPs as Llama's, and DeepSeek's MoE tensors
(mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.shared_experts.*, mlp.experts.{j}.* or the fused 3D form).

The releases' multi-token-prediction layer (decoder layer L = num_hidden_layers, num_nextn_predict_layers of them,
which transformers drops) loads into `Model.mtp` as DeepSeek-V3's does (`deepseek.nextn_plan`: enorm, hnorm,
eh_proj, shared_head.norm, optional embed_tokens / shared_head.head, and a decoder layer of GLM's own tensors,
with experts from first_k_dense_replace on); vLLM's glm4_moe_mtp zeroes the token embedding at position 0 as
DeepSeek's does (`Config.mtp_zero_first_embedding`). `Speculation("mtp")` then drafts with it.
"""

from __future__ import annotations

from jaxkv.config import Config
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.deepseek import deepseek_moe, ffn_tensors, nextn_plan
from jaxkv.families.llama import base_fields
from jaxkv.families.qwen3_next import with_defaults
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec

# transformers 5.25's Glm4MoeConfig defaults for the fields the shared readers require or default differently
GLM_DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                    num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5)


def glm4_moe_fields(f: fl.Fields) -> dict:
    f = with_defaults(f, GLM_DEFAULTS, partial_rotary_factor=0.5)
    kwargs = base_fields(f, max_positions=131072, rope_types=fl.NEWER_ROPE_TYPES, partial_rotary=True)
    kwargs["rotary_dim"] = fl.partial_rotary_dim(f, kwargs["head_dim"])
    kwargs["qkv_bias"] = f.bool("attention_bias", False)  # q, k and v only: o_proj has no bias
    kwargs["qk_norm"] = f.bool("use_qk_norm", False)
    dense = f.hf.get("first_k_dense_replace", 1)
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        f.fail("first_k_dense_replace", f"must be a non-negative integer, got {dense!r}")
    kwargs["moe"] = deepseek_moe(f, "glm4_moe", dense) if dense < kwargs["n_layers"] else None
    return kwargs


def glm4_layer(cfg: Config, i: int, fused: bool) -> list[TensorSpec]:
    """Decoder layer i's tensors: Llama's norms and attention, the dense MLP or DeepSeek's experts."""
    return tensors.norms(cfg, i, tensors.PRE_NORMS) + tensors.attention(cfg, i) + ffn_tensors(cfg, i, fused)


def glm4_moe_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    fused = cfg.moe is not None and tensors.fused_experts_stored(names)
    specs = tensors.embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        specs += glm4_layer(cfg, i, fused)
    return specs


def glm4_mtp_plan(config: Config, hf: dict, names, source: str):
    """GLM's multi-token-prediction layers (module docstring); config.json spells their count
    num_nextn_predict_layers (the releases) or num_mtp_layers (transformers 5.25's field, default 1)."""
    hf = hf if "num_nextn_predict_layers" in hf or "num_mtp_layers" in hf else {**hf, "num_mtp_layers": 1}
    return nextn_plan(config, hf, names, source, "glm4_moe", 1, glm4_layer)


GLM4_MOE = register(Family("glm4_moe", ("Glm4MoeForCausalLM",), glm4_moe_fields, glm4_moe_tensors,
                           mtp=glm4_mtp_plan))
