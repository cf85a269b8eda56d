"""Gemma 4 (`model_type` gemma4_text, and gemma4: the multimodal model, its language model only), as transformers
5.24 builds it (configuration_gemma4.py, modeling_gemma4.py).

Tensors: Gemma 3's norms and MLP names (norm weights scale by w, not 1 + w: `rmsnorm_f32`); H and K per layer
(`Config.layer_head_dim` / `layer_kv_heads`: the full layers' own), F per layer (double-wide on the K/V-sharing
layers), P the per-layer input width
  embed_tokens_per_layer.weight        [V, L*P]  -> per_layer_inputs/embedding         as is
  per_layer_model_projection.weight    [L*P, D]  -> per_layer_inputs/projection        as is
  per_layer_projection_norm.weight     [P]       -> per_layer_inputs/norm/scale        as is
  layers.{i}.layer_scalar              [1]       -> layer_{i}/layer_scalar             as is
  layers.{i}.per_layer_input_gate.weight [P, D]  -> layer_{i}/ple_gate                 as is
  layers.{i}.per_layer_projection.weight [D, P]  -> layer_{i}/ple_proj                 as is
  layers.{i}.post_per_layer_input_norm.weight [D] -> layer_{i}/post_ple_norm/scale     as is
  layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm: as Gemma 3's, except that a K/V-sharing layer has no
    k_proj / v_proj / k_norm (transformers ignores them if present, and so does the loader) and a full layer
    with attention_k_eq_v no v_proj
Gemma4ForConditionalGeneration: the same names under `model.language_model.` (transformers 5.24's save_pretrained
and module names; head `lm_head.weight`) or `language_model.model.` (head `language_model.lm_head.weight`);
`vision_tower.*`, `audio_tower.*`, `embed_vision.*`, `embed_audio.*` (with or without `model.`) are skipped.

Config: per_layer_config (or global_head_dim / num_global_key_value_heads) for the full layers' geometry,
rope_parameters per layer type (full: default or proportional; sliding: default), the last layer forced to full
attention as transformers does; refused: enable_moe_block (its MoE block does not map onto `jaxkv.layers.moe`), any
use_bidirectional_attention, vocab_size_per_layer_input != vocab_size.
"""

from __future__ import annotations

import re

from jaxkv.config import Config, ProportionalRope
from jaxkv.families import fields as fl
from jaxkv.families.gemma import geglu
from jaxkv.families.registry import Family, register
from jaxkv.families.tensors import SANDWICH_NORMS, TensorSpec, as_is, reshape

# Gemma4ForConditionalGeneration: the two naming schemes of Gemma 3's, transformers 5.24's save_pretrained writing
# the module names (model.language_model.*, head lm_head.weight); its vision and audio towers and their embedders
# (projections into the language model) are skipped by name.
GEMMA4_PREFIXES = {"model.language_model.": "lm_head.weight", "language_model.model.": "language_model.lm_head.weight"}
GEMMA4_SKIPPED = re.compile(r"(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio)\..+")

_GEMMA4_DEFAULTS = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                        sliding_window=512, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
                        global_head_dim=512)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def gemma4_fields(f: fl.Fields) -> dict:
    """Gemma 4's language model, as transformers 5.24 builds it (configuration_gemma4.py, modeling_gemma4.py):
    Gemma 3's layout (GeGLU, sandwich norms, q/k norms, embeddings times sqrt(D), sliding and full layers) with
    RMS norms that scale by w (not 1 + w; `rmsnorm_f32`), unscaled scores, a weightless norm on the values, the
    full layers' own head dim / KV heads (`per_layer_config`, or global_head_dim and num_global_key_value_heads)
    and "proportional" rope, values from the key projection there (attention_k_eq_v), the last
    num_kv_shared_layers layers reusing K/V (with double-wide MLPs under use_double_wide_mlp), per-layer input
    embeddings (hidden_size_per_layer_input), a per-layer scalar and the final soft cap. Refused: the MoE block,
    bidirectional attention, rope types other than default / proportional, a per-layer input vocabulary other
    than vocab_size."""
    # Long on purpose: one field after another in configuration_gemma4.py's order, read top to bottom beside it.
    d = _GEMMA4_DEFAULTS
    geglu(f)
    if f.hf.get("use_bidirectional_attention") is not None:
        f.fail("use_bidirectional_attention", f"= {f.hf['use_bidirectional_attention']!r} is not supported (jaxkv "
                                              f"decodes with causal attention)")
    if f.bool("enable_moe_block", False):
        f.fail("enable_moe_block", "= true is not supported: Gemma 4's MoE block (a dense MLP beside softmax-routed "
                                   "GeGLU experts with per-expert scales) does not map onto jaxkv's mixture of "
                                   "experts (DeepSeek's SwiGLU experts)")
    d_model = f.int("hidden_size", d["hidden_size"], cap=fl.MAX_D_MODEL)
    n_layers = f.int("num_hidden_layers", d["num_hidden_layers"], cap=fl.MAX_LAYERS)
    n_heads = f.int("num_attention_heads", d["num_attention_heads"], cap=fl.MAX_HEADS)
    n_kv_heads = f.int("num_key_value_heads", d["num_key_value_heads"], cap=fl.MAX_HEADS)
    head_dim = f.int("head_dim", d["head_dim"], cap=fl.MAX_HEAD_DIM)
    vocab = f.int("vocab_size", d["vocab_size"], cap=fl.MAX_VOCAB)
    ffn_dim = f.int("intermediate_size", d["intermediate_size"], cap=fl.MAX_FFN)

    types = f.hf.get("layer_types")
    if types is None:  # transformers' default: every 6th layer full
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    fl.check_layer_types(f, types, n_layers)
    types = list(types[:-1]) + ["full_attention"]  # transformers forces the last layer to full attention
    window = f.int("sliding_window", None) if "sliding_window" in f.hf else d["sliding_window"]
    if window is None and "sliding_attention" in types:
        f.fail("sliding_window", "is null but layer_types has sliding_attention layers")
    layer_types, sliding_window = fl.jaxkv_layer_types(types, window)

    global_head_dim, global_kv_heads = _gemma4_global_geometry(f, types, head_dim, n_kv_heads)

    shared = f.hf.get("num_kv_shared_layers", 0) or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n_layers:
        f.fail("num_kv_shared_layers", f"must be an integer in [0, num_hidden_layers = {n_layers}), got {shared!r}")
    first = n_layers - shared
    if shared and not {t for t in types[first:]} <= {t for t in types[:first]}:
        f.fail("num_kv_shared_layers", f"= {shared}: a shared layer's type has no earlier layer of that type to "
                                       f"take keys and values from (layer_types {types!r})")

    ple = f.hf.get("hidden_size_per_layer_input", d["hidden_size_per_layer_input"])
    if ple in (None, 0):
        ple = None
    else:
        ple = f.int("hidden_size_per_layer_input", cap=fl.MAX_HEAD_DIM)
        ple_vocab = f.int("vocab_size_per_layer_input", d["vocab_size_per_layer_input"], cap=fl.MAX_VOCAB)
        if ple_vocab != vocab:
            f.fail("vocab_size_per_layer_input", f"= {ple_vocab} differs from vocab_size ({vocab}); jaxkv's per-layer "
                                                 f"input table has one row per token id")

    theta, scaling, local = _gemma4_rope(f, types)
    kwargs = dict(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, ffn_dim=ffn_dim, ffn_kind="geglu", norm_kind="rmsnorm_f32",
        norm_eps=f.float("rms_norm_eps", 1e-6), positions="rope",
        max_positions=f.int("max_position_embeddings", d["max_position_embeddings"]),
        tie_embeddings=f.bool("tie_word_embeddings", True),
        embed_scale=d_model ** 0.5,  # transformers: hidden_size ** 0.5, rounded to the weights' dtype (the model)
        post_norms=True, qk_norm=True, value_norm=True,
        query_pre_attn_scalar=1.0,  # Gemma4TextAttention.scaling = 1.0: the q/k norms set the scores' scale
        layer_types=layer_types, sliding_window=sliding_window,
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local if layer_types is not None else None,
        global_head_dim=global_head_dim, global_kv_heads=global_kv_heads,
        global_values_from_keys=f.bool("attention_k_eq_v", False),
        kv_shared_layers=shared,
        kv_shared_ffn_dim=2 * ffn_dim if shared and f.bool("use_double_wide_mlp", False) else None,
        per_layer_input_dim=ple, layer_scalar=True,
        final_logit_softcap=f.positive("final_logit_softcapping", None),
    )
    if layer_types is None and sliding_window is not None:  # every layer slides: they take the sliding rope
        kwargs["rope_theta"], kwargs["rope_scaling"] = local, None
    if layer_types is None and sliding_window is None and global_head_dim is not None:
        kwargs["head_dim"], kwargs["global_head_dim"] = global_head_dim, None  # every layer is full
        kwargs["n_kv_heads"], kwargs["global_kv_heads"] = global_kv_heads or n_kv_heads, None
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    return kwargs


def _gemma4_global_geometry(f: fl.Fields, types: list[str], head_dim: int,
                            n_kv_heads: int) -> tuple[int | None, int | None]:
    """(global_head_dim, global_kv_heads) of the full-attention layers: from `per_layer_config` (what
    transformers 5.24 writes: layer index -> overrides of head_dim / num_key_value_heads) or else from
    global_head_dim (default 512) and, with attention_k_eq_v, num_global_key_value_heads. Overrides must be the
    same on every full layer and absent on sliding ones (jaxkv has one geometry per layer kind)."""
    per_layer = f.hf.get("per_layer_config")
    if per_layer is None:
        hd = f.int("global_head_dim", _GEMMA4_DEFAULTS["global_head_dim"], cap=fl.MAX_HEAD_DIM)
        kv = f.int("num_global_key_value_heads", None, cap=fl.MAX_HEADS) if f.bool("attention_k_eq_v", False) else None
        return (hd if hd != head_dim else None), (kv if kv not in (None, n_kv_heads) else None)
    if not isinstance(per_layer, dict):
        f.fail("per_layer_config", f"must be an object of layer index -> overrides, got {per_layer!r}")
    geometry = {}
    for i, kind in enumerate(types):
        entry = per_layer.get(str(i), per_layer.get(i, {})) or {}
        if not isinstance(entry, dict) or not set(entry) <= {"head_dim", "num_key_value_heads"}:
            f.fail(f"per_layer_config.{i}", f"may override head_dim and num_key_value_heads only, got {entry!r}")
        shape = (entry.get("head_dim", head_dim), entry.get("num_key_value_heads", n_kv_heads))
        for field, value, cap in (("head_dim", shape[0], fl.MAX_HEAD_DIM),
                                  ("num_key_value_heads", shape[1], fl.MAX_HEADS)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
                f.fail(f"per_layer_config.{i}.{field}", f"must be an integer in [1, {cap}], got {value!r}")
        geometry.setdefault(kind, set()).add(shape)
    if geometry.get("sliding_attention", {(head_dim, n_kv_heads)}) != {(head_dim, n_kv_heads)}:
        f.fail("per_layer_config", "overrides a sliding layer's geometry; jaxkv supports overrides on the "
                                   "full-attention layers only")
    full = geometry.get("full_attention", {(head_dim, n_kv_heads)})
    if len(full) != 1:
        f.fail("per_layer_config", f"gives the full-attention layers different geometries {sorted(full)}; jaxkv "
                                   f"supports one")
    (hd, kv), = full
    return (hd if hd != head_dim else None), (kv if kv != n_kv_heads else None)


def _gemma4_rope(f: fl.Fields, types: list[str]) -> tuple[float, ProportionalRope | None, float]:
    """(full layers' rope_theta, their scaling, sliding layers' rope_theta) from `rope_parameters` per layer type
    (transformers' defaults where absent): full layers "default" or "proportional" (partial_rotary_factor, factor),
    sliding layers "default"."""
    params = f.hf.get("rope_parameters")
    if params is None:
        params = _GEMMA4_ROPE
    if not isinstance(params, dict) or not set(params) <= set(_GEMMA4_ROPE):
        f.fail("rope_parameters", f"must be an object with 'full_attention' and 'sliding_attention' settings, got "
                                  f"{params!r}")
    out = {}
    for kind in _GEMMA4_ROPE:
        entry = params.get(kind)
        if entry is None:
            if kind in types:
                f.fail(f"rope_parameters.{kind}", "is missing")
            entry = _GEMMA4_ROPE[kind]
        if not isinstance(entry, dict):
            f.fail(f"rope_parameters.{kind}", f"must be an object, got {entry!r}")
        field = f"rope_parameters.{kind}"
        theta = f.number(f"{field}.rope_theta", entry.get("rope_theta", _GEMMA4_ROPE[kind]["rope_theta"]))
        if theta <= 0:
            f.fail(f"{field}.rope_theta", f"must be > 0, got {theta}")
        rope_type = entry.get("rope_type", "default")
        allowed = ("default", "proportional") if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            f.fail(f"{field}.rope_type", f"= {rope_type!r} is not supported; supported: "
                                         f"{', '.join(repr(t) for t in allowed)}")
        scaling = None
        if rope_type == "proportional":
            fraction = f.number(f"{field}.partial_rotary_factor", entry.get("partial_rotary_factor", 1.0) or 1.0)
            factor = f.number(f"{field}.factor", entry.get("factor", 1.0) or 1.0)
            try:
                scaling = ProportionalRope(rotary_fraction=fraction, factor=factor)
            except ValueError as e:
                raise ValueError(f"{f.source}: field {f.prefix + field!r}: {e}") from None
        out[kind] = theta, scaling
    return out["full_attention"][0], out["full_attention"][1], out["sliding_attention"][0]


def gemma4_tensors(cfg: Config, hf_config: dict, names) -> list[TensorSpec]:
    """Gemma 4's language model: per layer its own head dim and KV heads (`Config.layer_head_dim`,
    `layer_kv_heads`), no k/v projections or norms on the K/V-sharing layers, no v_proj where the values are the
    keys, the per-layer input gate / projection / norm, the layer scalar; the per-layer input table, projection and
    norm beside the embedding."""
    V, D, N = cfg.vocab_size, cfg.d_model, cfg.n_heads
    specs = [TensorSpec("embed_tokens.weight", (V, D), "[V, D]", as_is(("embedding",))),
             TensorSpec("norm.weight", (D,), "[D]", as_is(("final_norm", "scale")))]
    if cfg.per_layer_input_dim is not None:
        LP, P = cfg.n_layers * cfg.per_layer_input_dim, cfg.per_layer_input_dim
        specs += [TensorSpec("embed_tokens_per_layer.weight", (V, LP), "[V, L*P]",
                             as_is(("per_layer_inputs", "embedding"))),
                  TensorSpec("per_layer_model_projection.weight", (LP, D), "[L*P, D]",
                             as_is(("per_layer_inputs", "projection"))),
                  TensorSpec("per_layer_projection_norm.weight", (P,), "[P]",
                             as_is(("per_layer_inputs", "norm", "scale")))]
    norms = SANDWICH_NORMS
    for i in range(cfg.n_layers):
        hf, jx = f"layers.{i}.", f"layer_{i}"
        H, K, F = cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.layer_ffn_dim(i)
        attn = hf + "self_attn."
        specs += [TensorSpec(f"{hf}{name}.weight", (D,), "[D]", as_is((jx, norm, "scale")))
                  for name, norm in norms.items()]
        specs += [
            TensorSpec(hf + "layer_scalar", (1,), "[1]", as_is((jx, "layer_scalar"))),
            TensorSpec(attn + "q_proj.weight", (N * H, D), "[N*H, D]", reshape((jx, "attn", "wq"), N, H, D)),
            TensorSpec(attn + "q_norm.weight", (H,), "[H]", as_is((jx, "attn", "q_norm", "scale"))),
            TensorSpec(attn + "o_proj.weight", (D, N * H), "[D, N*H]", reshape((jx, "attn", "wo"), D, N, H)),
            TensorSpec(hf + "mlp.gate_proj.weight", (F, D), "[F, D]", as_is((jx, "mlp", "w_gate"))),
            TensorSpec(hf + "mlp.up_proj.weight", (F, D), "[F, D]", as_is((jx, "mlp", "w_up"))),
            TensorSpec(hf + "mlp.down_proj.weight", (D, F), "[D, F]", as_is((jx, "mlp", "w_down"))),
        ]
        projections = ["q"]
        if cfg.stores_kv(i):
            projections.append("k")
            specs += [TensorSpec(attn + "k_proj.weight", (K * H, D), "[K*H, D]", reshape((jx, "attn", "wk"), K, H, D)),
                      TensorSpec(attn + "k_norm.weight", (H,), "[H]", as_is((jx, "attn", "k_norm", "scale")))]
            if not cfg.layer_values_from_keys(i):
                projections.append("v")
                specs.append(TensorSpec(attn + "v_proj.weight", (K * H, D), "[K*H, D]",
                                        reshape((jx, "attn", "wv"), K, H, D)))
        if cfg.qkv_bias:
            specs += [TensorSpec(attn + f"{p}_proj.bias", ((N if p == "q" else K) * H,),
                                 "[N*H]" if p == "q" else "[K*H]",
                                 reshape((jx, "attn", f"w{p}_bias"), N if p == "q" else K, H)) for p in projections]
        if cfg.out_bias:
            specs.append(TensorSpec(attn + "o_proj.bias", (D,), "[D]", as_is((jx, "attn", "wo_bias"))))
        if cfg.per_layer_input_dim is not None:
            P = cfg.per_layer_input_dim
            specs += [TensorSpec(hf + "per_layer_input_gate.weight", (P, D), "[P, D]", as_is((jx, "ple_gate"))),
                      TensorSpec(hf + "per_layer_projection.weight", (D, P), "[D, P]", as_is((jx, "ple_proj"))),
                      TensorSpec(hf + "post_per_layer_input_norm.weight", (D,), "[D]",
                                 as_is((jx, "post_ple_norm", "scale")))]
    return specs


def kv_shared_tensors(config: Config, hf: dict, names, source: str) -> frozenset[str]:
    """Names a checkpoint may hold that the model does not use and the loader drops: a K/V-sharing layer's k/v
    projections and norms, which transformers likewise ignores on load (`_keys_to_ignore_on_load_unexpected`)."""
    return frozenset(f"layers.{i}.self_attn.{name}.{kind}" for i in range(config.n_layers)
                     if not config.stores_kv(i) for name in ("k_proj", "v_proj", "k_norm", "v_norm")
                     for kind in ("weight", "bias"))


GEMMA4_TEXT = register(Family("gemma4_text", ("Gemma4ForCausalLM",), gemma4_fields, gemma4_tensors,
                              ignored=kv_shared_tensors))
GEMMA4 = register(Family("gemma4", ("Gemma4ForConditionalGeneration",), gemma4_fields, gemma4_tensors,
                         prefixes=GEMMA4_PREFIXES, skipped=GEMMA4_SKIPPED, ignored=kv_shared_tensors,
                         text_config=True))
