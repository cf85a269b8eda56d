"""Mixtral (`model_type` mixtral): Mistral's attention (no biases, sliding_window on every layer when set) with a
mixture of experts in place of every layer's MLP, as transformers 5.24 builds it (configuration_mixtral.py,
modeling_mixtral.py):

  - the router (MixtralTopKRouter): softmax over the float32 router logits, the num_experts_per_tok (2) best,
    divided by their sum: jaxkv's "greedy" softmax router with norm_topk_prob (`jaxkv.layers.moe.route`); no
    shared experts, no scaling; router_jitter_noise acts in training only.
  - each expert is a SwiGLU of intermediate_size (there is no dense MLP).
  - defaults: rope_theta 1e6 (MixtralConfig.default_theta), rms_norm_eps 1e-5, max_position_embeddings 131072,
    head_dim hidden_size / num_attention_heads, num_local_experts 8, num_experts_per_tok 2, no sliding window.

Tensors: Llama's table for embeddings, norms and attention; each layer's experts
  layers.{i}.block_sparse_moe.gate.weight           [X, D] -> layer_{i}/mlp/router     as is, kept float32
  layers.{i}.block_sparse_moe.experts.{j}.w1.weight [I, D] -> layer_{i}/mlp/we_gate [X, I, D]  stacked
  layers.{i}.block_sparse_moe.experts.{j}.w3.weight [I, D] -> layer_{i}/mlp/we_up   [X, I, D]  stacked
  layers.{i}.block_sparse_moe.experts.{j}.w2.weight [D, I] -> layer_{i}/mlp/we_down [X, D, I]  stacked
  (the releases and transformers 5.24's save_pretrained), or transformers 5's in-memory form: layers.{i}.mlp.gate,
  layers.{i}.mlp.experts.gate_up_proj [X, 2*I, D] (w1 rows, then w3 rows) and experts.down_proj [X, D, I].
"""

from __future__ import annotations

from jaxkv.config import Config, MoeConfig
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.llama import base_fields
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec


def mixtral_fields(f: fl.Fields) -> dict:
    kwargs = base_fields(f, max_positions=4096 * 32, rope_types=fl.NEWER_ROPE_TYPES, rope_theta=1_000_000.0)
    kwargs["norm_eps"] = f.float("rms_norm_eps", 1e-5)
    kwargs["sliding_window"] = f.int("sliding_window", None)  # every layer; null or absent: none
    # config.json spells it num_local_experts (MixtralConfig's field); num_experts is its attribute_map alias
    field = "num_local_experts" if f.hf.get("num_local_experts") is not None else "num_experts"
    try:
        kwargs["moe"] = MoeConfig(n_routed_experts=f.int(field, 8, cap=fl.MAX_EXPERTS),
                                  experts_per_token=f.int("num_experts_per_tok", 2, cap=fl.MAX_EXPERTS),
                                  moe_ffn_dim=kwargs["ffn_dim"], scoring="softmax", topk_method="greedy",
                                  norm_topk_prob=True)
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None
    return kwargs


def mixtral_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    fused = tensors.fused_experts_stored(names)
    specs = tensors.embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        block, path = f"layers.{i}.{'mlp' if fused else 'block_sparse_moe'}.", (f"layer_{i}", "mlp")
        specs += (tensors.norms(cfg, i, tensors.PRE_NORMS) + tensors.attention(cfg, i)
                  + tensors.router(block, path, cfg.moe, cfg.d_model)
                  + tensors.experts(block, path, cfg.moe, cfg.d_model, fused=fused, names=("w1", "w3", "w2")))
    return specs


MIXTRAL = register(Family("mixtral", ("MixtralForCausalLM",), mixtral_fields, mixtral_tensors))
