"""Qwen3 (`model_type` qwen3): Llama's table (attention_bias: q, k, v and o biases, as Llama's) plus an RMS norm over
each query and key head, before the rotation:

  layers.{i}.self_attn.q_norm.weight   [H]       -> layer_{i}/attn/q_norm/scale    as is
  layers.{i}.self_attn.k_norm.weight   [H]       -> layer_{i}/attn/k_norm/scale    as is

Its sliding layers (use_sliding_window; by default the layers >= max_window_layers) may mix with full ones.
"""

from __future__ import annotations

from jaxkv.families import fields as fl
from jaxkv.families.llama import base_fields, decoder_tensors, qwen_layer_types
from jaxkv.families.registry import Family, register


def qwen3_fields(f: fl.Fields) -> dict:
    # Qwen3Config's head_dim defaults to 128 whatever the hidden size
    kwargs = base_fields(f, max_positions=32768, head_dim=128, rope_types=fl.NEWER_ROPE_TYPES)
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    kwargs["qk_norm"] = True
    kwargs["layer_types"], kwargs["sliding_window"] = fl.jaxkv_layer_types(*qwen_layer_types(f, kwargs["n_layers"]))
    return kwargs


QWEN3 = register(Family("qwen3", ("Qwen3ForCausalLM",), qwen3_fields, decoder_tensors))
