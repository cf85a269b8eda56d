"""GPT-2 (`model_type` gpt2): LayerNorm, learned positions, a GELU MLP, fused q|k|v. Its Conv1D weights are
[in, out]: every matrix is transposed to the [out, in] form, then back as the config stores it.

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

The `attn.bias` / `attn.masked_bias` causal-mask buffers are dropped as redundant.
"""

from __future__ import annotations

import re

from jaxkv.config import Config
from jaxkv.families import fields as fl
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import TensorSpec, as_is, conv1d, split_qkv


def gpt2_fields(f: fl.Fields) -> dict:
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
    d_model = f.int("n_embd", cap=fl.MAX_D_MODEL, required=True)
    n_heads = f.int("n_head", cap=fl.MAX_HEADS, required=True)
    if d_model % n_heads:
        f.fail("n_head", f"= {n_heads} does not divide n_embd = {d_model}")
    if d_model // n_heads > fl.MAX_HEAD_DIM:
        f.fail("n_embd", f"/ n_head = {d_model // n_heads} is beyond the supported maximum head dim "
                         f"{fl.MAX_HEAD_DIM}")
    return dict(
        vocab_size=f.int("vocab_size", cap=fl.MAX_VOCAB, required=True),
        d_model=d_model,
        n_layers=f.int("n_layer", cap=fl.MAX_LAYERS, required=True),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        ffn_dim=f.int("n_inner", 4 * d_model, cap=fl.MAX_FFN),
        ffn_kind="gelu",
        norm_kind="layernorm",
        norm_eps=f.float("layer_norm_epsilon", 1e-5),
        positions="learned",
        max_positions=f.int("n_positions", 1024, cap=fl.MAX_LEARNED_POSITIONS),
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_embeddings=f.bool("tie_word_embeddings", True),
    )


def gpt2_tensors(cfg: Config, hf: dict, names) -> list[TensorSpec]:
    V, D, N, H, F = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim
    specs = [TensorSpec("wte.weight", (V, D), "[V, D]", as_is(("embedding",))),
             TensorSpec("wpe.weight", (cfg.max_positions, D), "[n_positions, D]", as_is(("pos_embedding",))),
             TensorSpec("ln_f.weight", (D,), "[D]", as_is(("final_norm", "scale"))),
             TensorSpec("ln_f.bias", (D,), "[D]", as_is(("final_norm", "bias")))]
    for i in range(cfg.n_layers):
        p, jx = f"h.{i}.", f"layer_{i}"
        specs += [
            TensorSpec(p + "ln_1.weight", (D,), "[D]", as_is((jx, "attn_norm", "scale"))),
            TensorSpec(p + "ln_1.bias", (D,), "[D]", as_is((jx, "attn_norm", "bias"))),
            TensorSpec(p + "ln_2.weight", (D,), "[D]", as_is((jx, "mlp_norm", "scale"))),
            TensorSpec(p + "ln_2.bias", (D,), "[D]", as_is((jx, "mlp_norm", "bias"))),
            TensorSpec(p + "attn.c_attn.weight", (D, 3 * D), "[D, 3*D]",
                       split_qkv([(jx, "attn", w) for w in ("wq", "wk", "wv")], N, H, D)),
            TensorSpec(p + "attn.c_attn.bias", (3 * D,), "[3*D]",
                       split_qkv([(jx, "attn", w) for w in ("wq_bias", "wk_bias", "wv_bias")], N, H)),
            TensorSpec(p + "attn.c_proj.weight", (D, D), "[N*H, D]", conv1d((jx, "attn", "wo"), D, N, H)),
            TensorSpec(p + "attn.c_proj.bias", (D,), "[D]", as_is((jx, "attn", "wo_bias"))),
            TensorSpec(p + "mlp.c_fc.weight", (D, F), "[D, F]", conv1d((jx, "mlp", "w_fc"))),
            TensorSpec(p + "mlp.c_fc.bias", (F,), "[F]", as_is((jx, "mlp", "w_fc_bias"))),
            TensorSpec(p + "mlp.c_proj.weight", (F, D), "[F, D]", conv1d((jx, "mlp", "w_down"))),
            TensorSpec(p + "mlp.c_proj.bias", (D,), "[D]", as_is((jx, "mlp", "w_down_bias"))),
        ]
    return specs


GPT2 = register(Family("gpt2", ("GPT2LMHeadModel",), gpt2_fields, gpt2_tensors,
                       prefixes={"transformer.": "lm_head.weight"},
                       redundant=re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")))
