"""Llama, Mistral and Qwen2 (`model_type` llama, mistral, qwen2): pre-norm RMSNorm decoders with RoPE, grouped-query
attention and a SwiGLU MLP; `tensors.llama_decoder` names their tensors. `base_fields` is the config mapping they
share (Qwen3 and the MoE families build on it).

  embed_tokens.weight                  [V, D]    -> embedding                      as is
  layers.{i}.input_layernorm.weight    [D]       -> layer_{i}/attn_norm/scale      as is
  layers.{i}.post_attention_layernorm.weight [D] -> layer_{i}/mlp_norm/scale       as is
  layers.{i}.self_attn.q_proj.weight   [N*H, D]  -> layer_{i}/attn/wq [N, H, D]    reshape
  layers.{i}.self_attn.k_proj.weight   [K*H, D]  -> layer_{i}/attn/wk [K, H, D]    reshape
  layers.{i}.self_attn.v_proj.weight   [K*H, D]  -> layer_{i}/attn/wv [K, H, D]    reshape
  layers.{i}.self_attn.{q,k,v}_proj.bias [N*H | K*H] -> layer_{i}/attn/w{q,k,v}_bias [N | K, H]  reshape
                                                   (Qwen2 always; Llama with attention_bias)
  layers.{i}.self_attn.o_proj.weight   [D, N*H]  -> layer_{i}/attn/wo [D, N, H]    reshape
  layers.{i}.self_attn.o_proj.bias     [D]       -> layer_{i}/attn/wo_bias         (Llama with attention_bias)
  layers.{i}.mlp.gate_proj.weight      [F, D]    -> layer_{i}/mlp/w_gate           as is
  layers.{i}.mlp.up_proj.weight        [F, D]    -> layer_{i}/mlp/w_up             as is
  layers.{i}.mlp.down_proj.weight      [D, F]    -> layer_{i}/mlp/w_down           as is
  layers.{i}.mlp.{gate,up,down}_proj.bias        -> layer_{i}/mlp/w_{gate,up,down}_bias  (Llama with mlp_bias)
  norm.weight                          [D]       -> final_norm/scale               as is
  lm_head.weight (no prefix)           [V, D]    -> lm_head                        as is (untied only)
"""

from __future__ import annotations

from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.registry import Family, register


def base_fields(f: fl.Fields, *, max_positions: int, head_dim: int | None = None,
                rope_types: tuple[str, ...] = fl.ROPE_TYPES, rope_theta: float | None = None,
                partial_rotary: bool = False) -> dict:
    """The Llama-style config: sizes, SwiGLU, RMSNorm, RoPE. `max_positions`: transformers' default for a file
    that omits max_position_embeddings; `head_dim`: the default of a missing `head_dim` (None: D / N);
    `rope_theta`: the default rotary base (None: 10000); `partial_rotary`: the family reads
    partial_rotary_factor (`fields.partial_rotary_dim`) rather than refusing it."""
    d_model = f.int("hidden_size", cap=fl.MAX_D_MODEL, required=True)
    n_heads = f.int("num_attention_heads", cap=fl.MAX_HEADS, required=True)
    fl.silu(f)
    kwargs = dict(
        vocab_size=f.int("vocab_size", cap=fl.MAX_VOCAB, required=True),
        d_model=d_model,
        n_layers=f.int("num_hidden_layers", cap=fl.MAX_LAYERS, required=True),
        n_heads=n_heads,
        n_kv_heads=f.int("num_key_value_heads", n_heads, cap=fl.MAX_HEADS),
        head_dim=(fl.head_dim(f, d_model, n_heads) if head_dim is None
                  else f.int("head_dim", head_dim, cap=fl.MAX_HEAD_DIM)),
        ffn_dim=f.int("intermediate_size", cap=fl.MAX_FFN, required=True),
        ffn_kind="swiglu",
        norm_kind="rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        positions="rope",
        # RoPE is computed on the fly from position ids, so this only bounds generation; it sizes no allocation.
        max_positions=f.int("max_position_embeddings", max_positions),
        tie_embeddings=f.bool("tie_word_embeddings", False),
    )
    kwargs["rope_theta"], kwargs["rope_scaling"] = fl.rope(f, kwargs["max_positions"], types=rope_types,
                                                           default_theta=rope_theta, partial=partial_rotary)
    return kwargs


def mistral_window(f: fl.Fields) -> int | None:
    """Mistral's `sliding_window` on every layer. transformers' mask keeps key j for query i when j > i -
    sliding_window (masking_utils.sliding_window_overlay, transformers 5.24): the `sliding_window` most recent
    tokens, the query itself included. That is exactly jaxkv's Config.sliding_window, so the value maps
    unchanged, not off by one (the parity tests check it with a window of 8 and 40+ tokens). Its sliding cache
    keeps sliding_window - 1 old tokens plus the new one: the same set. Both index by cache slot, padding
    included, so left-padded batches agree too. null disables the window; an absent field means transformers'
    MistralConfig default, 4096."""
    return f.int("sliding_window", None) if "sliding_window" in f.hf else 4096


def qwen_layer_types(f: fl.Fields, n_layers: int) -> tuple[list[str], int | None]:
    """Qwen2 / Qwen3's (layer types, sliding window) as transformers 5.24 builds them: the window applies only with
    use_sliding_window, and then to the layers whose `layer_types` entry is "sliding_attention" (by default the
    layers i >= max_window_layers)."""
    window = f.int("sliding_window", None) if f.bool("use_sliding_window", False) else None
    types = f.hf.get("layer_types")
    if types is None:
        first_sliding = f.hf.get("max_window_layers", 28)  # may be 0: every layer slides
        if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
            f.fail("max_window_layers", f"must be a non-negative integer, got {first_sliding!r}")
        types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                 for i in range(n_layers)]
    fl.check_layer_types(f, types, n_layers)
    if window is None and "sliding_attention" in types:
        f.fail("layer_types", "has sliding_attention layers but use_sliding_window is false or sliding_window "
                              "is unset")
    return types, window


def _llama(f: fl.Fields) -> dict:
    kwargs = base_fields(f, max_positions=2048)
    # Llama's attention_bias covers q, k, v and o; mlp_bias covers gate, up and down.
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    kwargs["mlp_bias"] = f.bool("mlp_bias", False)
    return kwargs


def _mistral(f: fl.Fields) -> dict:
    return base_fields(f, max_positions=131072) | {"sliding_window": mistral_window(f)}


def _qwen2(f: fl.Fields) -> dict:
    kwargs = base_fields(f, max_positions=32768)
    kwargs["qkv_bias"] = True  # Qwen2 always has q/k/v biases and never an o_proj bias
    # Its sliding layers (use_sliding_window: the layers >= max_window_layers) may mix with full ones, as Qwen3's.
    kwargs["layer_types"], kwargs["sliding_window"] = fl.jaxkv_layer_types(*qwen_layer_types(f, kwargs["n_layers"]))
    return kwargs


def decoder_tensors(config, hf, names):
    return tensors.llama_decoder(config)


LLAMA = register(Family("llama", ("LlamaForCausalLM",), _llama, decoder_tensors))
MISTRAL = register(Family("mistral", ("MistralForCausalLM",), _mistral, decoder_tensors))
QWEN2 = register(Family("qwen2", ("Qwen2ForCausalLM",), _qwen2, decoder_tensors))
