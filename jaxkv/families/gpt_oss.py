"""gpt-oss (`model_type` gpt_oss, GptOssForCausalLM), as transformers 5.25 builds it (configuration_gpt_oss.py,
modeling_gpt_oss.py):

  - attention: grouped-query attention with biases on q, k, v and o (`attention_bias`, default true), head_dim 64,
    and one learned sink logit per query head in every softmax's denominator (`Config.attention_sinks`);
    `layer_types` alternating "sliding_attention" (window `sliding_window`, 128: a ring cache of the window) and
    "full_attention", sliding first (transformers' default when the file has none).
  - RMSNorm computed in float32 and multiplied there, then cast back ("rmsnorm_f32"), eps 1e-5.
  - rotary positions with YaRN as released (rope_theta 150000, factor 32 over 4,096 original positions,
    beta_fast 32, beta_slow 1, truncate false: transformers' default when the file gives no rope settings).
  - every layer a mixture of experts (`jaxkv.layers.moe`): the router's logits with a bias, the
    num_experts_per_tok best logits chosen and their softmax the weights ("topk_softmax"); each expert a clamped
    SwiGLU with biases ((clip(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit); swiglu_limit 7,
    swiglu_alpha 1.702); no shared experts, no dense layers.

Tensors (under `model.`, head `lm_head.weight`, untied by default): Llama's embedding, norms and attention with
biases (`tensors.attention`), and per layer

  layers.{i}.self_attn.sinks                [N]          -> layer_{i}/attn/sinks
  layers.{i}.mlp.router.weight / .bias      [X, D] / [X] -> layer_{i}/mlp/router / router_logit_bias (float32)
  layers.{i}.mlp.experts.gate_up_proj       [X, D, 2*I]  -> we_gate, we_up: the even / odd columns (gate, up
                                                            interleaved, as GptOssExperts._apply_gate reads them)
  layers.{i}.mlp.experts.gate_up_proj_bias  [X, 2*I]     -> we_gate_bias, we_up_bias (even / odd)
  layers.{i}.mlp.experts.down_proj          [X, I, D]    -> we_down
  layers.{i}.mlp.experts.down_proj_bias     [X, D]       -> we_down_bias

The releases store the two expert matrices in MXFP4 (`<name>_blocks` / `<name>_scales`), dequantized at load to
exactly these tensors (`jaxkv.io.mxfp4`).
"""

from __future__ import annotations

import numpy as np

from jaxkv.config import Config, MoeConfig
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.llama import base_fields
from jaxkv.families.qwen3_next import with_defaults
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec, as_is

# transformers 5.25's GptOssConfig defaults for the fields the shared readers require or default differently
GPT_OSS_DEFAULTS = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        rms_norm_eps=1e-5)
# GptOssConfig.__post_init__'s rope settings when the file gives none, and its default_theta
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0


def gpt_oss_fields(f: fl.Fields) -> dict:
    hf = dict(f.hf)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": hf.get("rope_theta", DEFAULT_THETA)}
    f = with_defaults(fl.Fields(hf, f.source, f.prefix), GPT_OSS_DEFAULTS, partial_rotary_factor=1.0)
    kwargs = base_fields(f, max_positions=131072, rope_types=fl.NEWER_ROPE_TYPES, rope_theta=DEFAULT_THETA)
    kwargs["norm_kind"] = "rmsnorm_f32"
    kwargs["norm_eps"] = f.float("rms_norm_eps", 1e-5)
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", True)
    kwargs["attention_sinks"] = True
    n_layers = kwargs["n_layers"]
    types = f.hf.get("layer_types")
    if types is None:  # GptOssConfig's default: sliding first, then alternating
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    fl.check_layer_types(f, types, n_layers)
    window = f.int("sliding_window", None) if "sliding_window" in f.hf else 128
    if window is None and "sliding_attention" in types:
        f.fail("sliding_window", "is null but layer_types has sliding_attention layers")
    kwargs["layer_types"], kwargs["sliding_window"] = fl.jaxkv_layer_types(types, window)
    field = "num_local_experts" if f.hf.get("num_local_experts") is not None else "num_experts"
    try:
        kwargs["moe"] = MoeConfig(
            n_routed_experts=f.int(field, 128, cap=fl.MAX_EXPERTS),
            experts_per_token=f.int("num_experts_per_tok", 4, cap=fl.MAX_EXPERTS),
            moe_ffn_dim=kwargs["ffn_dim"], scoring="topk_softmax", topk_method="greedy", router_logit_bias=True,
            expert_bias=True, swiglu_limit=f.positive("swiglu_limit", 7.0),
            swiglu_alpha=f.positive("swiglu_alpha", 1.702))
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None
    return kwargs


def _columns(paths):
    """[X, D, 2*I] (or a bias [X, 2*I]) -> its even or odd last-axis entries, each to its path: gate_up_proj
    interleaves the gate's and the up projection's output columns. Weights become the [out, in] form [X, I, D]."""
    def convert(w):
        out = {}
        for path, start in zip(paths, (0, 1)):
            part = w[..., start::2]
            out[path] = np.ascontiguousarray(part.transpose(0, 2, 1) if part.ndim == 3 else part)
        return out
    return convert


def gpt_oss_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    X, I, D, N = cfg.moe.n_routed_experts, cfg.moe.moe_ffn_dim, cfg.d_model, cfg.n_heads
    specs = tensors.embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        e, mlp = f"layers.{i}.mlp.", (f"layer_{i}", "mlp")
        specs += tensors.norms(cfg, i, tensors.PRE_NORMS) + tensors.attention(cfg, i) + [
            TensorSpec(f"layers.{i}.self_attn.sinks", (N,), "[N]", as_is((f"layer_{i}", "attn", "sinks"))),
            TensorSpec(e + "router.weight", (X, D), "[X, D]", as_is((*mlp, "router"))),
            TensorSpec(e + "router.bias", (X,), "[X]", as_is((*mlp, "router_logit_bias"))),
            TensorSpec(e + "experts.gate_up_proj", (X, D, 2 * I), "[X, D, 2*I]",
                       _columns(((*mlp, "we_gate"), (*mlp, "we_up")))),
            TensorSpec(e + "experts.gate_up_proj_bias", (X, 2 * I), "[X, 2*I]",
                       _columns(((*mlp, "we_gate_bias"), (*mlp, "we_up_bias")))),
            TensorSpec(e + "experts.down_proj", (X, I, D), "[X, I, D]",
                       lambda w, mlp=mlp: {(*mlp, "we_down"): np.ascontiguousarray(w.transpose(0, 2, 1))}),
            TensorSpec(e + "experts.down_proj_bias", (X, D), "[X, D]", as_is((*mlp, "we_down_bias")))]
    return specs


GPT_OSS = register(Family("gpt_oss", ("GptOssForCausalLM",), gpt_oss_fields, gpt_oss_tensors))
