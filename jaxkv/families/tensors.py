"""Checkpoint tensor plans: `TensorSpec` (one HF tensor, its shape and how it becomes jaxkv parameters), the
converters (as is, reshape, Conv1D transpose, fused q|k|v split, row reorder), and the spec lists families share:
the Llama-style decoder (embedding, norms, attention, SwiGLU MLP, optional biases and q/k norms) and a mixture of
experts' router and experts (per-expert tensors, or transformers 5's fused 3D ones).

Names are HF's without the base-model prefix (`model.`, `transformer.`, ...), except `lm_head.weight`, which sits
outside the base model. Paths are into `Model.params`; matrices are given in their [out, in] form (the loader
transposes those the config stores [in, out]); letters as in `jaxkv.shapes`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from jaxkv.config import Config, MoeConfig

Convert = Callable[[np.ndarray], dict[tuple, np.ndarray]]

# Buffers that older exports saved next to the weights (names without the base-model prefix); they carry no
# learned state.
ROTARY_BUFFER = re.compile(r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")

# HF norm name -> jaxkv norm: pre-norm decoders, and Gemma's sandwich norms (post_norms: post_attention_layernorm
# is the attention output's norm there, and the MLP's input norm is pre_feedforward_layernorm).
PRE_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
SANDWICH_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
                  "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF name (without the base-model prefix), the shape the config implies (and
    that shape in letters, for error messages), and how it becomes jaxkv parameters."""

    name: str
    shape: tuple[int, ...]
    letters: str
    convert: Convert


def as_is(path):
    return lambda w: {path: w}


def conv1d(path, *shape):
    """GPT-2 Conv1D weight [in, out] -> transposed to the [out, in] form, then reshaped to `shape`."""
    return lambda w: {path: np.ascontiguousarray(w.T).reshape(shape or w.T.shape)}


def reshape(path, *shape):
    return lambda w: {path: w.reshape(shape)}


def split_qkv(paths, *shape):
    """GPT-2 c_attn packs q, k and v along its last (output) axis: [..., 3*D] -> three [*shape]; a weight
    ([in, out]) is transposed to the [out, in] form first."""
    def convert(w):
        parts = np.split(w, 3, axis=-1)
        return {p: np.ascontiguousarray(part.T).reshape(shape) for p, part in zip(paths, parts)}
    return convert


def rows(path, order, *shape):
    """A weight or bias whose output rows (axis 0) are reordered by `order`, then reshaped to `shape`."""
    return lambda w: {path: np.ascontiguousarray(w[order]).reshape(shape or w.shape)}


def deinterleave(rows: int, rope: int, heads: int = 1) -> np.ndarray:
    """Row order that turns each head's last `rope` of `rows` output rows from interleaved pairs (x0, x1), (x2,
    x3), ... into halves (x0, x2, ... ; x1, x3, ...): DeepSeek's and Llama 4's pairwise rotation of pair i by
    frequency i is then `layers.apply_rope`'s rotate-half, bit for bit. Queries and keys are permuted alike, so every
    score is unchanged."""
    head = np.arange(rows)
    head[rows - rope:] = rows - rope + np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    return (np.arange(heads)[:, None] * rows + head[None]).reshape(-1)


def lm_head(config: Config) -> list[TensorSpec]:
    """The untied head (nothing for a tied model)."""
    if config.tie_embeddings:
        return []
    return [TensorSpec("lm_head.weight", (config.vocab_size, config.d_model), "[V, D]", as_is(("lm_head",)))]


def embedding_and_final_norm(cfg: Config) -> list[TensorSpec]:
    V, D = cfg.vocab_size, cfg.d_model
    return [TensorSpec("embed_tokens.weight", (V, D), "[V, D]", as_is(("embedding",))),
            TensorSpec("norm.weight", (D,), "[D]", as_is(("final_norm", "scale")))]


def norms(cfg: Config, i: int, names: dict[str, str]) -> list[TensorSpec]:
    """Layer i's [D] norms, HF name -> jaxkv norm (`PRE_NORMS`, `SANDWICH_NORMS`)."""
    return [TensorSpec(f"layers.{i}.{name}.weight", (cfg.d_model,), "[D]", as_is((f"layer_{i}", norm, "scale")))
            for name, norm in names.items()]


def attention(cfg: Config, i: int) -> list[TensorSpec]:
    """Layer i's grouped-query attention (`self_attn.{q,k,v,o}_proj`), its q/k norms over each head's H
    (cfg.qk_norm: Qwen3, Gemma 3) and biases (cfg.qkv_bias, cfg.out_bias)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    hf, jx = f"layers.{i}.self_attn.", (f"layer_{i}", "attn")
    specs = [TensorSpec(hf + "q_proj.weight", (N * H, D), "[N*H, D]", reshape((*jx, "wq"), N, H, D)),
             TensorSpec(hf + "k_proj.weight", (K * H, D), "[K*H, D]", reshape((*jx, "wk"), K, H, D)),
             TensorSpec(hf + "v_proj.weight", (K * H, D), "[K*H, D]", reshape((*jx, "wv"), K, H, D)),
             TensorSpec(hf + "o_proj.weight", (D, N * H), "[D, N*H]", reshape((*jx, "wo"), D, N, H))]
    if cfg.qk_norm:
        specs += [TensorSpec(hf + "q_norm.weight", (H,), "[H]", as_is((*jx, "q_norm", "scale"))),
                  TensorSpec(hf + "k_norm.weight", (H,), "[H]", as_is((*jx, "k_norm", "scale")))]
    if cfg.qkv_bias:
        specs += [TensorSpec(hf + "q_proj.bias", (N * H,), "[N*H]", reshape((*jx, "wq_bias"), N, H)),
                  TensorSpec(hf + "k_proj.bias", (K * H,), "[K*H]", reshape((*jx, "wk_bias"), K, H)),
                  TensorSpec(hf + "v_proj.bias", (K * H,), "[K*H]", reshape((*jx, "wv_bias"), K, H))]
    if cfg.out_bias:
        specs.append(TensorSpec(hf + "o_proj.bias", (D,), "[D]", as_is((*jx, "wo_bias"))))
    return specs


def mlp(cfg: Config, i: int, F: int | None = None) -> list[TensorSpec]:
    """Layer i's gated MLP (`mlp.{gate,up,down}_proj`, width F, default cfg.ffn_dim), with biases under
    cfg.mlp_bias."""
    D, F = cfg.d_model, cfg.ffn_dim if F is None else F
    hf, jx = f"layers.{i}.mlp.", (f"layer_{i}", "mlp")
    specs = [TensorSpec(hf + "gate_proj.weight", (F, D), "[F, D]", as_is((*jx, "w_gate"))),
             TensorSpec(hf + "up_proj.weight", (F, D), "[F, D]", as_is((*jx, "w_up"))),
             TensorSpec(hf + "down_proj.weight", (D, F), "[D, F]", as_is((*jx, "w_down")))]
    if cfg.mlp_bias:
        specs += [TensorSpec(hf + f"{proj}_proj.bias", (n,), letter, as_is((*jx, f"w_{proj}_bias")))
                  for proj, n, letter in (("gate", F, "[F]"), ("up", F, "[F]"), ("down", D, "[D]"))]
    return specs


def llama_decoder(cfg: Config) -> list[TensorSpec]:
    """The Llama-style decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2 / 3): embedding and final norm, then per
    layer its norms, attention and MLP."""
    specs = embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        specs += norms(cfg, i, SANDWICH_NORMS if cfg.post_norms else PRE_NORMS) + attention(cfg, i) + mlp(cfg, i)
    return specs


# --- mixtures of experts -----------------------------------------------------------------------------------------

# transformers 5 holds each layer's experts as two 3D tensors (`experts.gate_up_proj` [X, 2*I, D], `down_proj`
# [X, D, I]); a state_dict saved as is keeps them so, while save_pretrained (and the original releases) write one
# tensor per expert and projection.
FUSED_EXPERTS = re.compile(r"(model\.)?layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # per-expert names (DeepSeek, Qwen MoE); Mixtral: w1, w3, w2


def fused_experts_stored(names) -> bool:
    """Whether a checkpoint's experts are 3D per layer (transformers 5's in-memory form, e.g. a state_dict saved
    as is) rather than one tensor per expert (the releases, and transformers 5.24's save_pretrained)."""
    return any(FUSED_EXPERTS.fullmatch(name) for name in names)


def router(hf: str, mlp_path: tuple, moe: MoeConfig, d_model: int) -> list[TensorSpec]:
    """The router `{hf}gate.weight` [X, D] (kept float32 on load, as transformers keeps DeepSeek's), with
    DeepSeek-V3's correction bias under "noaux_tc"."""
    X = moe.n_routed_experts
    specs = [TensorSpec(hf + "gate.weight", (X, d_model), "[X, D]", as_is((*mlp_path, "router")))]
    if moe.topk_method == "noaux_tc":
        specs.append(TensorSpec(hf + "gate.e_score_correction_bias", (X,), "[X]", as_is((*mlp_path, "router_bias"))))
    return specs


def experts(hf: str, mlp_path: tuple, moe: MoeConfig, d_model: int, *, fused: bool,
            names: tuple[str, str, str] = EXPERT_NAMES) -> list[TensorSpec]:
    """The X routed experts under `hf` (e.g. "layers.3.mlp."): one [I, D] / [D, I] tensor per expert and
    projection (`{hf}experts.{j}.{gate,up,down name}.weight`, loaded under the expert's index and stacked by the
    loader) or, `fused`, transformers' `experts.gate_up_proj` [X, 2*I, D] (gate rows, then up rows) and
    `experts.down_proj` [X, D, I]."""
    X, I, D = moe.n_routed_experts, moe.moe_ffn_dim, d_model
    if fused:
        def split_gate_up(w):  # [X, 2*I, D]: gate rows, then up rows (transformers' chunk(2))
            return {(*mlp_path, "we_gate"): np.ascontiguousarray(w[:, :I]),
                    (*mlp_path, "we_up"): np.ascontiguousarray(w[:, I:])}

        return [TensorSpec(hf + "experts.gate_up_proj", (X, 2 * I, D), "[X, 2*I, D]", split_gate_up),
                TensorSpec(hf + "experts.down_proj", (X, D, I), "[X, D, I]", as_is((*mlp_path, "we_down")))]
    gate, up, down = names
    specs = []
    for j in range(X):
        e = f"{hf}experts.{j}."
        specs += [TensorSpec(f"{e}{gate}.weight", (I, D), "[I, D]", as_is((*mlp_path, "we_gate", j))),
                  TensorSpec(f"{e}{up}.weight", (I, D), "[I, D]", as_is((*mlp_path, "we_up", j))),
                  TensorSpec(f"{e}{down}.weight", (D, I), "[D, I]", as_is((*mlp_path, "we_down", j)))]
    return specs


def shared_experts(hf: str, mlp_path: tuple, moe: MoeConfig, d_model: int) -> list[TensorSpec]:
    """DeepSeek's shared experts `{hf}shared_experts.{gate,up,down}_proj` as one SwiGLU of width J."""
    J, D = moe.shared_ffn_dim, d_model
    if not J:
        return []
    return [TensorSpec(hf + "shared_experts.gate_proj.weight", (J, D), "[J, D]", as_is((*mlp_path, "ws_gate"))),
            TensorSpec(hf + "shared_experts.up_proj.weight", (J, D), "[J, D]", as_is((*mlp_path, "ws_up"))),
            TensorSpec(hf + "shared_experts.down_proj.weight", (D, J), "[D, J]", as_is((*mlp_path, "ws_down")))]
