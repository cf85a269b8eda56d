"""Llama 4 text (`model_type` llama4_text, Llama4ForCausalLM) and the language model of Llama 4 checkpoints
(`llama4`, Llama4ForConditionalGeneration: config.json's `text_config`, the vision tower skipped), as transformers
5.25 builds them (configuration_llama4.py, modeling_llama4.py):

  - attention: grouped-query attention (biases under `attention_bias`); rotary positions by complex pairs
    (x0, x1), (x2, x3), ... (q/k rows reordered at load into jaxkv's rotate-half: `tensors.deinterleave`), except
    on the NoPE layers (`no_rope_layers` 0: by default every `no_rope_layer_interval`-th, 4th, layer), which take
    no rotation and, under attn_temperature_tuning, queries scaled by log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1 (`Config.attn_temperature`). With use_qk_norm the rotary layers' queries and keys get a
    weightless RMS norm after the rotation (`Config.qk_l2_norm`).
  - chunked attention: the rotary layers are "chunked_attention" layers (`attention_chunk_size`, 8192): a query
    sees only the earlier tokens of its chunk, and their cache is a ring of the chunk; the NoPE layers see
    everything (`layer_types` as transformers derives it when the file has none).
  - feed-forward: layers in `moe_layers` (default every `interleave_moe_layer_step`-th) a mixture of experts:
    the router's num_experts_per_tok best logits, their sigmoid scaling each chosen expert's *input*
    (`MoeConfig.scale_expert_input`), the experts' outputs summed, plus an always-on shared expert of
    intermediate_size; the other layers a dense SwiGLU of intermediate_size_mlp.
  - RMSNorm as Llama's (x / rms(x) cast back, then times w).

Tensors (Llama4ForCausalLM: under `model.`, head `lm_head.weight`; Llama4ForConditionalGeneration: under
`language_model.model.`, head `language_model.lm_head.weight`), per layer i:

  self_attn.{q,k}_proj.weight [N*H | K*H, D] -> attn/wq, wk     rows reordered per head (complex pairs -> halves)
  self_attn.v_proj, o_proj (+ biases)         -> as Llama's
  input_layernorm, post_attention_layernorm   -> attn_norm, mlp_norm
  feed_forward.router.weight        [X, D]      -> mlp/router (float32)
  feed_forward.experts.gate_up_proj [X, D, 2*I] -> mlp/we_gate, we_up: the first / second I columns
  feed_forward.experts.down_proj    [X, I, D]   -> mlp/we_down
  feed_forward.shared_expert.{gate,up,down}_proj.weight -> mlp/ws_{gate,up,down}
  feed_forward.{gate,up,down}_proj.weight (dense layers) -> mlp/w_{gate,up,down}
"""

from __future__ import annotations

import re

import numpy as np

from jaxkv.config import Config, MoeConfig
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.llama import base_fields
from jaxkv.families.qwen3_next import with_defaults
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec, as_is, rows

# transformers 5.25's Llama4TextConfig defaults for the fields the shared readers require or default differently
LLAMA4_DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, num_hidden_layers=48,
                       num_attention_heads=40, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096 * 32,
                       rms_norm_eps=1e-5)
DEFAULT_THETA = 500000.0
PREFIXES = {"language_model.model.": "language_model.lm_head.weight"}  # Llama4ForConditionalGeneration
VISION = re.compile(r"(vision_model|multi_modal_projector)\..+")


def llama4_fields(f: fl.Fields) -> dict:
    f = with_defaults(f, LLAMA4_DEFAULTS, partial_rotary_factor=1.0)
    kwargs = base_fields(f, max_positions=4096 * 32, rope_types=fl.NEWER_ROPE_TYPES, rope_theta=DEFAULT_THETA)
    kwargs["norm_eps"] = f.float("rms_norm_eps", 1e-5)
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    L = kwargs["n_layers"]
    interval = f.int("no_rope_layer_interval", 4)
    use_rope = f.hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
    if not isinstance(use_rope, list) or len(use_rope) != L or any(v not in (0, 1) or isinstance(v, bool)
                                                                   for v in use_rope):
        f.fail("no_rope_layers", f"must list 0 or 1 for each of the {L} layers, got {use_rope!r}")
    kwargs["nope_layers"] = tuple(i for i, v in enumerate(use_rope) if v == 0)
    chunk = f.int("attention_chunk_size", None) if "attention_chunk_size" in f.hf else 8192
    types = f.hf.get("layer_types")
    if types is None:  # Llama4TextConfig's default: the rotary layers chunked (when there is a chunk)
        types = ["chunked_attention" if v and chunk is not None else "full_attention" for v in use_rope]
    if (not isinstance(types, list) or len(types) != L
            or not set(types) <= {"full_attention", "chunked_attention"}):
        f.fail("layer_types", f"must list 'full_attention' or 'chunked_attention' for each of the {L} layers, "
                              f"got {types!r}")
    if "chunked_attention" in types:
        if chunk is None:
            f.fail("attention_chunk_size", "is null but layer_types has chunked_attention layers")
        kwargs["layer_types"], kwargs["attention_chunk_size"] = tuple(types), chunk
    kwargs["qk_l2_norm"] = f.bool("use_qk_norm", True)
    if f.bool("attn_temperature_tuning", True) and kwargs["nope_layers"]:
        kwargs["attn_temperature"] = (f.positive("floor_scale", 8192), f.positive("attn_scale", 0.1))
    X = f.int("num_local_experts", 16, cap=fl.MAX_EXPERTS)
    step = f.int("interleave_moe_layer_step", 1)
    moe_layers = f.hf.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, L, step))
    if not isinstance(moe_layers, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L
                                               for i in moe_layers):
        f.fail("moe_layers", f"must list layer indices in [0, {L}), got {moe_layers!r}")
    I = kwargs["ffn_dim"]  # intermediate_size: each expert's and the shared expert's width
    kwargs["ffn_dim"] = f.int("intermediate_size_mlp", 16384, cap=fl.MAX_FFN)  # the dense layers'
    if moe_layers:
        try:
            kwargs["moe"] = MoeConfig(
                n_routed_experts=X, experts_per_token=f.int("num_experts_per_tok", 1, cap=fl.MAX_EXPERTS),
                moe_ffn_dim=I, shared_expert_ffn_dim=I, scoring="topk_sigmoid", topk_method="greedy",
                scale_expert_input=True, dense_layers=tuple(i for i in range(L) if i not in set(moe_layers)))
        except ValueError as e:
            raise ValueError(f"{f.source}: {e}") from None
    return kwargs


def attention(cfg: Config, i: int) -> list[TensorSpec]:
    """Llama's attention tensors, q and k rows reordered per head from complex pairs to halves (NoPE layers too:
    they have no rotation, and a permutation of q and k alike leaves every score as it was)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    hf, jx = f"layers.{i}.self_attn.", (f"layer_{i}", "attn")
    reorder = {"q_proj": (N, "wq", "[N*H"), "k_proj": (K, "wk", "[K*H")}
    specs = []
    for spec in tensors.attention(cfg, i):
        proj, kind = spec.name[len(hf):].split(".")
        if proj not in reorder:
            specs.append(spec)
            continue
        heads, name, letters = reorder[proj]
        order = tensors.deinterleave(H, H, heads)
        if kind == "weight":
            convert = rows((*jx, name), order, heads, H, D)
            specs.append(TensorSpec(spec.name, (heads * H, D), f"{letters}, D]", convert))
        else:
            convert = rows((*jx, name + "_bias"), order, heads, H)
            specs.append(TensorSpec(spec.name, (heads * H,), f"{letters}]", convert))
    return specs


def feed_forward(cfg: Config, i: int) -> list[TensorSpec]:
    hf, jx, D = f"layers.{i}.feed_forward.", (f"layer_{i}", "mlp"), cfg.d_model
    m = cfg.moe
    if m is None or not m.is_moe_layer(i):
        F = cfg.ffn_dim
        return [TensorSpec(hf + "gate_proj.weight", (F, D), "[F, D]", as_is((*jx, "w_gate"))),
                TensorSpec(hf + "up_proj.weight", (F, D), "[F, D]", as_is((*jx, "w_up"))),
                TensorSpec(hf + "down_proj.weight", (D, F), "[D, F]", as_is((*jx, "w_down")))]
    X, I, J = m.n_routed_experts, m.moe_ffn_dim, m.shared_ffn_dim

    def gate_up(w):  # [X, D, 2*I]: gate columns, then up columns (chunk(2, dim=-1)) -> [X, I, D] each
        return {(*jx, "we_gate"): np.ascontiguousarray(w[..., :I].transpose(0, 2, 1)),
                (*jx, "we_up"): np.ascontiguousarray(w[..., I:].transpose(0, 2, 1))}

    return [TensorSpec(hf + "router.weight", (X, D), "[X, D]", as_is((*jx, "router"))),
            TensorSpec(hf + "experts.gate_up_proj", (X, D, 2 * I), "[X, D, 2*I]", gate_up),
            TensorSpec(hf + "experts.down_proj", (X, I, D), "[X, I, D]",
                       lambda w: {(*jx, "we_down"): np.ascontiguousarray(w.transpose(0, 2, 1))}),
            TensorSpec(hf + "shared_expert.gate_proj.weight", (J, D), "[J, D]", as_is((*jx, "ws_gate"))),
            TensorSpec(hf + "shared_expert.up_proj.weight", (J, D), "[J, D]", as_is((*jx, "ws_up"))),
            TensorSpec(hf + "shared_expert.down_proj.weight", (D, J), "[D, J]", as_is((*jx, "ws_down")))]


def llama4_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    specs = tensors.embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        specs += tensors.norms(cfg, i, tensors.PRE_NORMS) + attention(cfg, i) + feed_forward(cfg, i)
    return specs


LLAMA4_TEXT = register(Family("llama4_text", ("Llama4ForCausalLM",), llama4_fields, llama4_tensors))
LLAMA4 = register(Family("llama4", ("Llama4ForConditionalGeneration",), llama4_fields, llama4_tensors,
                         prefixes=PREFIXES, skipped=VISION, text_config=True))
