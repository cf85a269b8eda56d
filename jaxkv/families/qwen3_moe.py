"""Qwen3-MoE (`model_type` qwen3_moe): Qwen3's attention (q/k norms over each head, attention_bias on q, k, v and
o) with a mixture of experts in place of the MLP on the sparse layers, as transformers 5.24 builds it
(configuration_qwen3_moe.py, modeling_qwen3_moe.py):

  - layer i is a mixture of experts when it is not in `mlp_only_layers`, num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0; the others keep a dense SwiGLU MLP of intermediate_size
    (`MoeConfig.dense_layers`).
  - the router: softmax over the float32 router logits, the num_experts_per_tok best, divided by their sum under
    norm_topk_prob (Qwen3MoeTopKRouter); no shared experts, no scaling (`jaxkv.layers.moe.route`, "greedy").
  - head_dim: config.json's, else hidden_size / num_attention_heads (Qwen3MoeAttention's getattr; unlike
    Qwen3Config, which defaults it to 128).
  - sliding_window applies to every layer, and only with use_sliding_window (Qwen3MoeConfig.__post_init__; no
    layer_types or max_window_layers here).

Tensors: Qwen3's table (`jaxkv.families.qwen3`) on every layer; a sparse layer's MLP is
  layers.{i}.mlp.gate.weight           [X, D]    -> layer_{i}/mlp/router            as is, kept float32
  layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight [I, D], down_proj.weight [D, I]  (the releases and
      transformers 5.24's save_pretrained) -> layer_{i}/mlp/we_{gate,up} [X, I, D], we_down [X, D, I]  stacked
  or layers.{i}.mlp.experts.gate_up_proj [X, 2*I, D], down_proj [X, D, I] (transformers 5's in-memory form)
"""

from __future__ import annotations

from jaxkv.config import Config, MoeConfig
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.llama import base_fields
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec


def qwen3_moe_fields(f: fl.Fields) -> dict:
    kwargs = base_fields(f, max_positions=32768, rope_types=fl.NEWER_ROPE_TYPES)
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    kwargs["qk_norm"] = True
    kwargs["sliding_window"] = f.int("sliding_window", None) if f.bool("use_sliding_window", False) else None
    kwargs["moe"] = moe_fields(f, kwargs["n_layers"])
    return kwargs


def moe_fields(f: fl.Fields, n_layers: int) -> MoeConfig | None:
    """The experts, and which layers hold them (None: every layer is dense)."""
    # config.json spells it num_experts (the releases) or num_local_experts (transformers 5.24's attribute_map)
    field = "num_experts" if f.hf.get("num_experts") is not None else "num_local_experts"
    value = f.hf.get(field, 128)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= fl.MAX_EXPERTS:
        f.fail(field, f"must be an integer in [0, {fl.MAX_EXPERTS}], got {value!r}")
    step = f.int("decoder_sparse_step", 1, cap=fl.MAX_LAYERS)
    only = f.hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        f.fail("mlp_only_layers", f"must be a list of layer indices, got {only!r}")
    dense = tuple(i for i in range(n_layers) if value == 0 or i in only or (i + 1) % step)
    if len(dense) == n_layers:
        return None
    try:
        return MoeConfig(n_routed_experts=value,
                         experts_per_token=f.int("num_experts_per_tok", 8, cap=fl.MAX_EXPERTS),
                         moe_ffn_dim=f.int("moe_intermediate_size", 768, cap=fl.MAX_FFN),
                         dense_layers=dense, scoring="softmax", topk_method="greedy",
                         norm_topk_prob=f.bool("norm_topk_prob", False))
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None


def qwen3_moe_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    fused = tensors.fused_experts_stored(names)
    specs = tensors.embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        specs += tensors.norms(cfg, i, tensors.PRE_NORMS) + tensors.attention(cfg, i)
        if cfg.moe is None or not cfg.moe.is_moe_layer(i):
            specs += tensors.mlp(cfg, i)
            continue
        mlp, path = f"layers.{i}.mlp.", (f"layer_{i}", "mlp")
        specs += (tensors.router(mlp, path, cfg.moe, cfg.d_model)
                  + tensors.experts(mlp, path, cfg.moe, cfg.d_model, fused=fused))
    return specs


QWEN3_MOE = register(Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3_moe_fields, qwen3_moe_tensors))
