"""Qwen3-Next (`model_type` qwen3_next): a hybrid of Gated DeltaNet ("linear_attention") layers and gated
full-attention layers (`layer_types`; the releases put three linear layers before each full one), with a sparse
mixture of experts plus one gated shared expert, as transformers 5.25 builds it (modeling_qwen3_next.py):

  - every norm multiplies by (1 + w), in float32 (Qwen3NextRMSNorm: jaxkv's "gemma_rmsnorm"), the q/k norms too;
    the linear layers' gated norm multiplies by w (`jaxkv.layers.gated_delta`).
  - full attention: q_proj yields per head the query and an output gate ([N, 2H]: H query rows, then H gate
    rows), the output times sigmoid(gate) before o_proj (`Config.attn_output_gate`); q/k norms; rotary positions
    on the first partial_rotary_factor * head_dim dims of each head (`Config.rotary_dim`).
  - the experts: softmax router, top num_experts_per_tok, renormalized under norm_topk_prob; the shared expert
    (width shared_expert_intermediate_size) times sigmoid(shared_expert_gate x), added (`MoeConfig`).
    Layer i has experts iff i not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0.

Tensors (names without the `model.` prefix; letters as in `jaxkv.shapes`, r = Hv / Hk):

  layers.{i}.input_layernorm / post_attention_layernorm.weight [D] -> layer_{i}/attn_norm, mlp_norm/scale
  full layers:
  layers.{i}.self_attn.q_proj.weight [N*2H, D]  -> layer_{i}/attn/wq, wq_gate [N, H, D]  (per head: q, gate)
  layers.{i}.self_attn.{k,v,o}_proj, q_norm, k_norm  -> as Qwen3's
  linear layers (layer_{i}/linear_attn/...):
  linear_attn.in_proj_qkvz.weight [2*Hk*Dk + 2*Hv*Dv, D]: grouped per key head as [q Dk | k Dk | v r*Dv | z r*Dv]
                                                -> w_qkv [U, D] (all q, all k, all v) and w_z [Hv*Dv, D]
  linear_attn.in_proj_ba.weight [2*Hv, D]: per key head [b r | a r]  -> w_b, w_a [Hv, D]
  linear_attn.conv1d.weight [U, 1, Y]           -> conv [U, Y]
  linear_attn.dt_bias, A_log [Hv]               -> as is
  linear_attn.norm.weight [Dv]                  -> gate_norm
  linear_attn.out_proj.weight [D, Hv*Dv]        -> w_out
  sparse layers: mlp.gate.weight [X, D] -> router; experts as Qwen3-MoE's (per expert, or fused 3D);
  mlp.shared_expert.{gate,up,down}_proj -> ws_gate, ws_up, ws_down; mlp.shared_expert_gate.weight [1, D] ->
  shared_gate; dense layers: mlp.{gate,up,down}_proj as Llama's.

The checkpoint's multi-token-prediction layer (`mtp.*`, which transformers drops; vLLM's qwen3_next_mtp.py reads
it) loads into `Model.mtp` (`jaxkv.decoding.mtp`), the proposer of `Speculation("mtp")`:
  mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight [D] -> enorm, hnorm
  mtp.fc.weight [D, 2D] (its input: the normed embedding, then the normed hidden state) -> eh_proj
  mtp.layers.0.* (a gated full-attention decoder layer, its FFN as the decoder's layer 0) -> layer_0
  mtp.norm.weight [D] -> final_norm; the embedding and lm_head are the decoder's.
"""


from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxkv.config import Config, LinearAttention
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.llama import base_fields
from jaxkv.families.qwen3_moe import moe_fields
from jaxkv.families.registry import Family, MtpPlan, register
from jaxkv.families.tensors import TensorSpec, as_is

HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")
MTP = re.compile(r"mtp\..*")


def hybrid_fields(f: fl.Fields, max_positions: int) -> dict:
    """What Qwen3-Next and Qwen3.5 share: the Llama-style sizes with zero-centred norms, the gated attention
    with partial rotation, and the linear layers' geometry and placement."""
    kwargs = base_fields(f, max_positions=max_positions, head_dim=256, rope_types=fl.NEWER_ROPE_TYPES,
                         partial_rotary=True)
    kwargs["rotary_dim"] = fl.partial_rotary_dim(f, kwargs["head_dim"])
    kwargs["norm_kind"] = "gemma_rmsnorm"  # (1 + w) in float32, every norm but the linear layers' gated one
    kwargs["qk_norm"] = True
    kwargs["attn_output_gate"] = True
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    n = kwargs["n_layers"]
    types = f.hf.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer full, the rest linear
        interval = f.int("full_attention_interval", 4, cap=fl.MAX_LAYERS)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= set(HYBRID_LAYER_TYPES):
        f.fail("layer_types", f"must list 'full_attention' or 'linear_attention' for each of the {n} layers, "
                              f"got {types!r}")
    if "full_attention" not in types:
        f.fail("layer_types", "has no full_attention layer (a model of linear layers only is not supported)")
    kwargs["layer_types"] = tuple(types)
    if "linear_attention" in types:
        try:
            kwargs["linear_attention"] = LinearAttention(
                key_heads=f.int("linear_num_key_heads", 16, cap=fl.MAX_HEADS),
                value_heads=f.int("linear_num_value_heads", 32, cap=fl.MAX_HEADS),
                key_head_dim=f.int("linear_key_head_dim", 128, cap=fl.MAX_HEAD_DIM),
                value_head_dim=f.int("linear_value_head_dim", 128, cap=fl.MAX_HEAD_DIM),
                conv_kernel=f.int("linear_conv_kernel_dim", 4, cap=64))
        except ValueError as e:
            raise ValueError(f"{f.source}: {e}") from None
    else:
        kwargs["layer_types"] = None
    return kwargs


# transformers 5.25's Qwen3NextConfig defaults for the fields the shared readers (`llama.base_fields`) require or
# default differently (its num_key_value_heads is 2, not num_attention_heads)
NEXT_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                     num_attention_heads=16, num_key_value_heads=2)
PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3Next / Qwen3.5 configs' `kwargs.setdefault("partial_rotary_factor", 0.25)`


def with_defaults(f: fl.Fields, defaults: dict, partial_rotary_factor: float = PARTIAL_ROTARY_FACTOR,
                  **fixed) -> fl.Fields:
    """`f` with transformers' defaults for the omitted `defaults` fields, `fixed` fields set, and the family's
    default `partial_rotary_factor` where neither rope_parameters (or rope_scaling) nor the top level gives one
    (the shared reader's own default is 1: the whole head)."""
    hf = {**{k: v for k, v in defaults.items() if k not in f.hf}, **f.hf, **fixed}
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(params, dict) and "partial_rotary_factor" not in params and "partial_rotary_factor" not in hf:
        hf["partial_rotary_factor"] = partial_rotary_factor
    return fl.Fields(hf, f.source, f.prefix)


def qwen3_next_fields(f: fl.Fields) -> dict:
    kwargs = hybrid_fields(with_defaults(f, NEXT_DEFAULTS), max_positions=32768)
    moe = moe_fields(f, kwargs["n_layers"])
    if moe is not None:
        shared = f.int("shared_expert_intermediate_size", 512, cap=fl.MAX_FFN)
        moe = dataclasses.replace(moe, shared_expert_ffn_dim=shared, shared_expert_gate=True)
    kwargs["moe"] = moe
    return kwargs


def gated_attention(cfg: Config, i: int) -> list[TensorSpec]:
    """A full layer's attention: Qwen3's table, with q_proj holding each head's query and output gate."""
    specs = [s for s in tensors.attention(cfg, i) if not s.name.endswith(("q_proj.weight", "q_proj.bias"))]
    N, H, D = cfg.n_heads, cfg.head_dim, cfg.d_model
    hf, jx = f"layers.{i}.self_attn.", (f"layer_{i}", "attn")

    def split(suffix, *tail):
        def convert(w):  # [N*2H, ...]: per head H query rows, then H gate rows
            w = w.reshape(N, 2 * H, *tail)
            return {(*jx, "wq" + suffix): np.ascontiguousarray(w[:, :H]),
                    (*jx, "wq_gate" + suffix): np.ascontiguousarray(w[:, H:])}
        return convert

    specs.append(TensorSpec(hf + "q_proj.weight", (N * 2 * H, D), "[N*2H, D]", split("", D)))
    if cfg.qkv_bias:
        specs.append(TensorSpec(hf + "q_proj.bias", (N * 2 * H,), "[N*2H]", split("_bias")))
    return specs


def linear_attention_fused(cfg: Config, i: int) -> list[TensorSpec]:
    """A Qwen3-Next linear layer: the fused, per-key-head grouped in_proj_qkvz and in_proj_ba."""
    la, D = cfg.linear_attention, cfg.d_model
    Hk, Hv, Dk, Dv = la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim
    r = Hv // Hk
    hf, jx = f"layers.{i}.linear_attn.", (f"layer_{i}", "linear_attn")

    def qkvz(w):  # [Hk * (2 Dk + 2 r Dv), D], grouped per key head
        g = w.reshape(Hk, 2 * Dk + 2 * r * Dv, D)
        q, k, v, z = np.split(g, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=1)
        flat = lambda x: x.reshape(-1, D)  # noqa: E731  (heads in order; a key head's r value heads together)
        return {(*jx, "w_qkv"): np.ascontiguousarray(np.concatenate([flat(q), flat(k), flat(v)])),
                (*jx, "w_z"): np.ascontiguousarray(flat(z))}

    def ba(w):  # [Hk * 2r, D], per key head [b r | a r]
        g = w.reshape(Hk, 2 * r, D)
        return {(*jx, "w_b"): np.ascontiguousarray(g[:, :r].reshape(Hv, D)),
                (*jx, "w_a"): np.ascontiguousarray(g[:, r:].reshape(Hv, D))}

    return [TensorSpec(hf + "in_proj_qkvz.weight", (2 * Hk * Dk + 2 * Hv * Dv, D), "[2*Hk*Dk + 2*Hv*Dv, D]", qkvz),
            TensorSpec(hf + "in_proj_ba.weight", (2 * Hv, D), "[2*Hv, D]", ba)] + linear_attention_common(cfg, i)


def linear_attention_common(cfg: Config, i: int) -> list[TensorSpec]:
    """The linear layer's tensors both families name alike: conv, decay parameters, gated norm, out."""
    la, D = cfg.linear_attention, cfg.d_model
    Hv, Dv, U, Y = la.value_heads, la.value_head_dim, la.conv_dim, la.conv_kernel
    hf, jx = f"layers.{i}.linear_attn.", (f"layer_{i}", "linear_attn")
    return [TensorSpec(hf + "conv1d.weight", (U, 1, Y), "[U, 1, Y]", lambda w: {(*jx, "conv"): w.reshape(U, Y)}),
            TensorSpec(hf + "dt_bias", (Hv,), "[Hv]", as_is((*jx, "dt_bias"))),
            TensorSpec(hf + "A_log", (Hv,), "[Hv]", as_is((*jx, "A_log"))),
            TensorSpec(hf + "norm.weight", (Dv,), "[Dv]", as_is((*jx, "gate_norm"))),
            TensorSpec(hf + "out_proj.weight", (D, Hv * Dv), "[D, Hv*Dv]", as_is((*jx, "w_out")))]


def moe_tensors(cfg: Config, i: int, fused: bool) -> list[TensorSpec]:
    """Layer i's feed-forward block: dense, or the experts with the gated shared expert."""
    if cfg.moe is None or not cfg.moe.is_moe_layer(i):
        return tensors.mlp(cfg, i)
    moe, D, J = cfg.moe, cfg.d_model, cfg.moe.shared_ffn_dim
    mlp, path = f"layers.{i}.mlp.", (f"layer_{i}", "mlp")
    return (tensors.router(mlp, path, moe, D) + tensors.experts(mlp, path, moe, D, fused=fused)
            + [TensorSpec(mlp + "shared_expert.gate_proj.weight", (J, D), "[J, D]", as_is((*path, "ws_gate"))),
               TensorSpec(mlp + "shared_expert.up_proj.weight", (J, D), "[J, D]", as_is((*path, "ws_up"))),
               TensorSpec(mlp + "shared_expert.down_proj.weight", (D, J), "[D, J]", as_is((*path, "ws_down"))),
               TensorSpec(mlp + "shared_expert_gate.weight", (1, D), "[1, D]", as_is((*path, "shared_gate")))])


def hybrid_tensors(cfg: Config, names, linear_attention) -> list[TensorSpec]:
    """The hybrid decoder's tensors (Qwen3-Next and Qwen3.5): embedding and final norm, then per layer its norms,
    its linear layer (`linear_attention(cfg, i)`: the family's projections) or gated attention, and its
    feed-forward block (experts per expert or fused 3D, as `names` holds them)."""
    fused = tensors.fused_experts_stored(names)
    specs = tensors.embedding_and_final_norm(cfg)
    for i in range(cfg.n_layers):
        specs += tensors.norms(cfg, i, tensors.PRE_NORMS)
        specs += linear_attention(cfg, i) if cfg.layer_is_linear(i) else gated_attention(cfg, i)
        specs += moe_tensors(cfg, i, fused)
    return specs


def qwen3_next_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    return hybrid_tensors(cfg, names, linear_attention_fused)


def mtp_plan(config: Config, hf: dict, names, source: str) -> MtpPlan | None:
    """Qwen3-Next's (and Qwen3.5's) multi-token-prediction module (module docstring), or None when the checkpoint
    holds no `mtp.*` tensor (transformers' save_pretrained drops them). One module: its fc and norms are shared by every
    `mtp.layers.{i}` in vLLM's reading, which jaxkv's one-module-per-layer `Mtp` does not express, so a checkpoint
    with more than one layer is refused."""
    if not any(MTP.fullmatch(name) for name in names):
        return None
    layers = {name.split(".")[2] for name in names if name.startswith("mtp.layers.")}
    if layers != {"0"}:
        raise ValueError(f"{source}: the checkpoint's multi-token-prediction part has layers {sorted(layers)}; "
                         f"jaxkv loads one (mtp.layers.0)")
    moe = config.moe
    if moe is not None:  # vLLM builds the layer with index 0: the decoder's layer-0 rule decides its FFN
        moe = dataclasses.replace(moe, first_dense_layers=0, dense_layers=()) if moe.is_moe_layer(0) else None
    block = config.replace(n_layers=1, layer_types=("full_attention",), linear_attention=None, moe=moe)
    fused = tensors.fused_experts_stored([name[4:] for name in names if MTP.fullmatch(name)])  # (as its own are)
    D = config.d_model
    specs = [dataclasses.replace(spec, name="mtp." + spec.name)
             for spec in tensors.norms(block, 0, tensors.PRE_NORMS) + gated_attention(block, 0)
             + moe_tensors(block, 0, fused)]
    specs += [TensorSpec("mtp.pre_fc_norm_embedding.weight", (D,), "[D]", as_is(("enorm", "scale"))),
              TensorSpec("mtp.pre_fc_norm_hidden.weight", (D,), "[D]", as_is(("hnorm", "scale"))),
              TensorSpec("mtp.fc.weight", (D, 2 * D), "[D, 2*D]", as_is(("eh_proj",))),
              TensorSpec("mtp.norm.weight", (D,), "[D]", as_is(("final_norm", "scale")))]
    return MtpPlan(block, (("mtp.", specs),))


QWEN3_NEXT = register(Family("qwen3_next", ("Qwen3NextForCausalLM",), qwen3_next_fields, qwen3_next_tensors,
                             mtp=mtp_plan))
