"""DeepSeek-V2 / V3 / V3.2 (`model_type` deepseek_v2, deepseek_v3, deepseek_v32): multi-head latent attention
(`jaxkv.layers.mla`; qk = qk_nope + E), RMSNorm, SwiGLU; the first `first_k_dense_replace` layers keep a dense
MLP, the rest are mixtures of experts (`jaxkv.layers.moe`; X experts of width I, J = n_shared * I). Norms,
embeddings, lm_head and dense MLPs as Llama's.

  layers.{i}.self_attn.q_proj.weight   [N*qk, D]        -> layer_{i}/attn/wq [N, qk, D]       reshape, rope rows*
  layers.{i}.self_attn.q_a_proj.weight [q_lora_rank, D] -> layer_{i}/attn/wq_a                as is (q_lora_rank)
  layers.{i}.self_attn.q_a_layernorm.weight              -> layer_{i}/attn/q_norm/scale        as is (q_lora_rank)
  layers.{i}.self_attn.q_b_proj.weight [N*qk, q_lora_rank] -> layer_{i}/attn/wq_b [N, qk, q_lora_rank]  rope rows*
  layers.{i}.self_attn.kv_a_proj_with_mqa.weight [R+E, D] -> layer_{i}/attn/wkv_a             rope rows*
  layers.{i}.self_attn.kv_a_layernorm.weight [R]         -> layer_{i}/attn/kv_norm/scale       as is
  layers.{i}.self_attn.kv_b_proj.weight [N*(qk_nope+v), R] -> layer_{i}/attn/wk_b [N, qk_nope, R], wv_b [N, v, R]
  layers.{i}.self_attn.o_proj.weight   [D, N*v]         -> layer_{i}/attn/wo [D, N, v]        reshape
  with attention_bias: q_a_proj.bias, kv_a_proj_with_mqa.bias (rope rows*), o_proj.bias -> wq_a_bias, wkv_a_bias,
  wo_bias.
  DeepSeek-V3.2's lightning indexer (`indexer_tensors`, `jaxkv.layers.indexer`), all as stored:
  layers.{i}.self_attn.indexer.wq_b.weight [Hi*Di, q_lora_rank], wk.weight [Di, D], k_norm.{weight,bias} [Di],
  weights_proj.weight [Hi, D] -> layer_{i}/attn/indexer/index_wq, index_wk, index_norm_{scale,bias}, index_weights.
  * DeepSeek rotates interleaved pairs (V2 always, V3 unless rope_interleave is false): each head's E
  rotary output rows are reordered evens-then-odds on load, which turns that rotation into jaxkv's rotate-half.
their mixture-of-experts layers (i >= first_k_dense_replace; `tensors.router`, `shared_experts`, `experts`)
  layers.{i}.mlp.gate.weight           [X, D]    -> layer_{i}/mlp/router            as is, kept float32
  layers.{i}.mlp.gate.e_score_correction_bias [X] -> layer_{i}/mlp/router_bias     as is, kept float32 (V3)
  layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight [J, D], [J, D], [D, J] -> layer_{i}/mlp/ws_{gate,up,down}
  layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight [I, D], down_proj.weight [D, I]  (DeepSeek's releases and
      transformers 5.24's save_pretrained) -> layer_{i}/mlp/we_{gate,up} [X, I, D], we_down [X, D, I]  stacked
  or layers.{i}.mlp.experts.gate_up_proj [X, 2*I, D], down_proj [X, D, I] (transformers 5's in-memory form)
      -> the same                                                               gate rows, then up rows
DeepSeek-V3's multi-token-prediction (MTP) modules (num_nextn_predict_layers = n, stored as decoder layers
j = L, ..., L + n - 1; the release holds layer 61 of 61) load into `Model.mtp` (`jaxkv.decoding.mtp.Mtp`), one
params dict per module, with the decoder's params unchanged; a checkpoint holding none of them (transformers'
save_pretrained drops them but keeps the field) loads with `Model.mtp` None.
  layers.{j}.enorm.weight, hnorm.weight [D]  -> enorm/scale, hnorm/scale      the next token's embedding's and
                                                                              the previous hidden state's norms
  layers.{j}.eh_proj.weight [D, 2*D]         -> eh_proj                       as is, over concat(enorm, hnorm)
  layers.{j}.shared_head.norm.weight [D]     -> final_norm/scale              as is
  layers.{j}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*  -> layer_0/...   as decoder layer j above
      (the experts from first_k_dense_replace on, as the decoder's layers)
  layers.{j}.embed_tokens.weight, shared_head.head.weight [V, D] (optional) -> embedding, lm_head: kept only
      where they differ from the decoder's (the release repeats them); absent, the decoder's are used.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.config import Config, Mla, MoeConfig, SparseIndexer
from jaxkv.families import fields as fl
from jaxkv.families import tensors
from jaxkv.families.registry import Family, MtpPlan, register
from jaxkv.families.tensors import TensorSpec, as_is, reshape, rows

# transformers' DeepseekV2Config / DeepseekV3Config defaults for fields a config.json may omit.
_DEEPSEEK_DEFAULTS = {"deepseek_v2": dict(q_lora_rank=1536, first_k_dense_replace=0, max_position_embeddings=2048),
                      "deepseek_v3": dict(q_lora_rank=1536, first_k_dense_replace=3, max_position_embeddings=4096),
                      "deepseek_v32": dict(q_lora_rank=1536, first_k_dense_replace=3, max_position_embeddings=163840)}


def deepseek_fields(f: fl.Fields, arch: str) -> dict:
    """DeepSeek-V2/V3: multi-head latent attention, RMSNorm, SwiGLU; the first `first_k_dense_replace` layers
    have a dense FFN of intermediate_size, the rest mixture-of-experts ones."""
    defaults = _DEEPSEEK_DEFAULTS[arch]
    fl.silu(f)
    n_layers = f.int("num_hidden_layers", cap=fl.MAX_LAYERS, required=True)
    n_heads = f.int("num_attention_heads", cap=fl.MAX_HEADS, required=True)
    # transformers repeats the n_heads expanded keys num_attention_heads / num_key_value_heads times, which only
    # works when the two are equal (its default).
    if f.int("num_key_value_heads", n_heads, cap=fl.MAX_HEADS) != n_heads:
        f.fail("num_key_value_heads", f"must equal num_attention_heads ({n_heads}) for multi-head latent attention")
    q_lora_rank = f.int("q_lora_rank", cap=fl.MAX_D_MODEL) if "q_lora_rank" in f.hf else defaults["q_lora_rank"]
    try:
        mla = Mla(kv_lora_rank=f.int("kv_lora_rank", cap=fl.MAX_D_MODEL, required=True),
                  qk_nope_head_dim=f.int("qk_nope_head_dim", cap=fl.MAX_HEAD_DIM, required=True),
                  qk_rope_head_dim=f.int("qk_rope_head_dim", cap=fl.MAX_HEAD_DIM, required=True),
                  v_head_dim=f.int("v_head_dim", cap=fl.MAX_HEAD_DIM, required=True), q_lora_rank=q_lora_rank,
                  indexer=sparse_indexer(f) if arch == "deepseek_v32" else None)
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None
    dense = f.hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        f.fail("first_k_dense_replace", f"must be a non-negative integer, got {dense!r}")
    mlp_types = f.hf.get("mlp_layer_types")  # DeepSeek-V3.2's config spells the dense / MoE split out too
    if mlp_types is not None and list(mlp_types) != ["dense"] * min(dense, n_layers) + ["sparse"] * max(
            n_layers - dense, 0):
        f.fail("mlp_layer_types", f"= {mlp_types!r} is not supported: only the first_k_dense_replace ({dense}) "
                                  f"dense layers, then mixtures of experts")
    moe = deepseek_moe(f, arch, dense) if dense < n_layers else None
    kwargs = dict(
        vocab_size=f.int("vocab_size", cap=fl.MAX_VOCAB, required=True),
        d_model=f.int("hidden_size", cap=fl.MAX_D_MODEL, required=True),
        n_layers=n_layers,
        n_heads=n_heads,
        ffn_dim=f.int("intermediate_size", cap=fl.MAX_FFN, required=True),
        ffn_kind="swiglu",
        norm_kind="rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        positions="rope",
        max_positions=f.int("max_position_embeddings", defaults["max_position_embeddings"]),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        mla=mla,
        moe=moe,
    )
    # attention_bias covers q_a_proj and kv_a_proj_with_mqa (jaxkv's qkv_bias) and o_proj.
    kwargs["qkv_bias"] = kwargs["out_bias"] = f.bool("attention_bias", False)
    kwargs["rope_theta"], kwargs["rope_scaling"] = fl.rope(f, kwargs["max_positions"],
                                                         types=("default", "llama3", "yarn"))
    return kwargs


# transformers' DeepseekV2Config / DeepseekV3Config defaults for the mixture-of-experts fields.
_DEEPSEEK_MOE_DEFAULTS = {
    "deepseek_v2": dict(n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407, routed_scaling_factor=1.0),
    "deepseek_v3": dict(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=2.5,
                      num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True),
    "deepseek_v32": dict(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                         routed_scaling_factor=2.5, num_experts_per_tok=8, n_group=8, topk_group=4,
                         norm_topk_prob=True),
    # GLM-4.5 / 4.6 (`jaxkv.families.glm4_moe`): DeepSeek-V3's router and experts, transformers' Glm4MoeConfig defaults
    "glm4_moe": dict(n_routed_experts=128, n_shared_experts=1, moe_intermediate_size=1408, routed_scaling_factor=1.0,
                     num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True)}


def sparse_indexer(f: fl.Fields) -> SparseIndexer:
    """DeepSeek-V3.2's lightning indexer (transformers' DeepseekV32Config defaults); every layer has one (its
    layer_types are all "indexed_attention")."""
    types = f.hf.get("layer_types")
    if types is not None and any(t != "indexed_attention" for t in types):
        f.fail("layer_types", f"= {types!r} is not supported: every DeepSeek-V3.2 layer is 'indexed_attention'")
    try:
        return SparseIndexer(n_heads=f.int("index_n_heads", 64, cap=fl.MAX_HEADS),
                             head_dim=f.int("index_head_dim", 128, cap=fl.MAX_HEAD_DIM),
                             topk=f.int("index_topk", 2048, cap=1 << 24))
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None


def deepseek_moe(f: fl.Fields, arch: str, dense: int) -> MoeConfig:
    """The mixture of experts of layers >= first_k_dense_replace, as transformers 5.24 runs it: V3 always scores
    with a sigmoid and picks by "noaux_tc" (it reads neither `scoring_func` nor `topk_method`); V2 always with a
    softmax, by `topk_method`, and never normalizes the weights (it does not read `norm_topk_prob`)."""
    d = _DEEPSEEK_MOE_DEFAULTS[arch]
    freq = f.hf.get("moe_layer_freq", 1)
    if freq != 1:
        f.fail("moe_layer_freq", f"= {freq!r} is not supported: transformers puts a mixture of experts in every "
                                 f"layer from first_k_dense_replace on, DeepSeek's own code in every moe_layer_freq-th")
    fields = dict(
        n_routed_experts=f.int("n_routed_experts", d["n_routed_experts"], cap=fl.MAX_EXPERTS),
        experts_per_token=f.int("num_experts_per_tok", d.get("num_experts_per_tok"), cap=fl.MAX_EXPERTS,
                                required="num_experts_per_tok" not in d),
        moe_ffn_dim=f.int("moe_intermediate_size", d["moe_intermediate_size"], cap=fl.MAX_FFN),
        n_shared_experts=f.int("n_shared_experts", d["n_shared_experts"], cap=fl.MAX_EXPERTS),
        first_dense_layers=dense,
        routed_scaling_factor=f.float("routed_scaling_factor", d["routed_scaling_factor"]))
    if arch in ("deepseek_v3", "deepseek_v32", "glm4_moe"):
        fields |= dict(scoring="sigmoid", topk_method="noaux_tc", n_group=f.int("n_group", d["n_group"]),
                       topk_group=f.int("topk_group", d["topk_group"]),
                       norm_topk_prob=f.bool("norm_topk_prob", d["norm_topk_prob"]))
    else:
        method = f.str("topk_method", "greedy")
        if method == "group_limited_greedy":
            fields |= dict(n_group=f.int("n_group", required=True), topk_group=f.int("topk_group", required=True))
        elif method != "greedy":  # "greedy" ignores n_group / topk_group, as transformers does
            f.fail("topk_method", f"= {method!r} is not supported: transformers' DeepSeek-V2 router knows 'greedy' "
                                  f"and 'group_limited_greedy'")
        fields |= dict(scoring="softmax", topk_method=method)
    try:
        return MoeConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{f.source}: {e}") from None


def rope_interleaved(hf: dict, arch: str) -> bool:
    """Whether a DeepSeek checkpoint's rotary columns come in interleaved pairs (x0, x1), (x2, x3), ...: always
    for V2 (its complex-number rotary) and V3.2 (transformers 5.25 reads no flag), V3 unless `rope_interleave` is
    false. DeepSeek-V3.2's indexer rotates halves: its weights are never reordered."""
    return arch in ("deepseek_v2", "deepseek_v32") or hf.get("rope_interleave", True) is not False


def mtp_plan(config: Config, hf: dict, names, source: str, arch: str) -> MtpPlan | None:
    """DeepSeek's multi-token-prediction modules (`nextn_plan`, its decoder layers' tensors)."""
    interleaved = rope_interleaved(hf, arch)
    return nextn_plan(config, hf, names, source, arch, _DEEPSEEK_DEFAULTS[arch]["first_k_dense_replace"],
                      lambda block, i, fused: _layer(block, i, interleaved, fused))


def nextn_plan(config: Config, hf: dict, names, source: str, arch: str, dense_default: int,
               layer) -> MtpPlan | None:
    """DeepSeek's (and GLM-4.5's) multi-token-prediction modules (config.json's num_nextn_predict_layers = n,
    stored as layers n_layers, ..., n_layers + n - 1), or None when the checkpoint holds no tensor of them:
    transformers drops them (`_keys_to_ignore_on_load_unexpected`) and its save_pretrained writes n = 1 with none.
    `layer(block config, i, fused experts)` names decoder layer i's tensors; `dense_default` is the family's
    first_k_dense_replace default. Names as in `tensor_specs`; a module partly stored is a missing tensor, named by
    the loader."""
    field = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
    n = hf.get(field, 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 16:
        raise ValueError(f"{source}: field {field!r} must be an integer in [0, 16], got {n!r}")
    L = config.n_layers
    prefixes = tuple(f"layers.{j}." for j in range(L, L + n))
    if not any(name.startswith(prefixes) for name in names):
        return None
    dense = hf.get("first_k_dense_replace", dense_default)
    if len({j >= dense for j in range(L, L + n)}) > 1:
        raise ValueError(f"{source}: first_k_dense_replace = {dense} makes some multi-token-prediction layers "
                         f"dense and others mixtures of experts; one config serves them all here")
    # DeepSeek's rule for layer L's FFN: experts from first_k_dense_replace on, even where every decoder layer is
    # dense (the decoder's config then holds no MoeConfig: parse it from the same fields).
    moe = None
    if L >= dense:
        moe = config.moe or deepseek_moe(fl.Fields(hf, source), arch, dense)
        moe = dataclasses.replace(moe, first_dense_layers=0, dense_layers=())
    block = config.replace(n_layers=1, moe=moe, mtp_zero_first_embedding=True)
    fused = tensors.fused_experts_stored(names)
    V, D = config.vocab_size, config.d_model
    modules = []
    for prefix in prefixes:
        specs = [dataclasses.replace(spec, name=prefix + spec.name.removeprefix("layers.0."))
                 for spec in layer(block, 0, fused)]
        specs += [TensorSpec(prefix + "enorm.weight", (D,), "[D]", as_is(("enorm", "scale"))),
                  TensorSpec(prefix + "hnorm.weight", (D,), "[D]", as_is(("hnorm", "scale"))),
                  TensorSpec(prefix + "eh_proj.weight", (D, 2 * D), "[D, 2*D]", as_is(("eh_proj",))),
                  TensorSpec(prefix + "shared_head.norm.weight", (D,), "[D]", as_is(("final_norm", "scale")))]
        for name, path in (("embed_tokens.weight", "embedding"), ("shared_head.head.weight", "lm_head")):
            if prefix + name in names:  # optional: the release repeats the decoder's
                specs.append(TensorSpec(prefix + name, (V, D), "[V, D]", as_is((path,))))
        modules.append((prefix, specs))
    return MtpPlan(block, tuple(modules))


def _split_kv_b(paths, N, nope, dv, R):
    """kv_b_proj [N*(nope+dv), R]: per head, nope key rows then dv value rows -> wk_b [N, nope, R], wv_b [N, dv, R]."""
    def convert(w):
        w = w.reshape(N, nope + dv, R)
        return {paths[0]: np.ascontiguousarray(w[:, :nope]), paths[1]: np.ascontiguousarray(w[:, nope:])}
    return convert


def _tensors(cfg: Config, interleaved: bool, fused_experts: bool) -> list[TensorSpec]:
    V, D = cfg.vocab_size, cfg.d_model
    specs = [TensorSpec("embed_tokens.weight", (V, D), "[V, D]", as_is(("embedding",))),
             TensorSpec("norm.weight", (D,), "[D]", as_is(("final_norm", "scale")))]
    for i in range(cfg.n_layers):
        specs += _layer(cfg, i, interleaved, fused_experts)
    return specs


def _layer(cfg: Config, i: int, interleaved: bool, fused_experts: bool) -> list[TensorSpec]:
    """Decoder layer i: its norms, latent attention and FFN."""
    m = cfg.mla
    D, N = cfg.d_model, cfg.n_heads
    R, E, nope, dv, qk = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.qk_head_dim
    q_order = tensors.deinterleave(qk, E if interleaved else 0, N)
    kv_order = tensors.deinterleave(R + E, E if interleaved else 0)
    hf, jx = f"layers.{i}.", f"layer_{i}"
    attn = hf + "self_attn."
    specs = [
        TensorSpec(hf + "input_layernorm.weight", (D,), "[D]", as_is((jx, "attn_norm", "scale"))),
        TensorSpec(hf + "post_attention_layernorm.weight", (D,), "[D]", as_is((jx, "mlp_norm", "scale"))),
        TensorSpec(attn + "kv_a_proj_with_mqa.weight", (R + E, D), "[R+E, D]",
                   rows((jx, "attn", "wkv_a"), kv_order)),
        TensorSpec(attn + "kv_a_layernorm.weight", (R,), "[R]", as_is((jx, "attn", "kv_norm", "scale"))),
        TensorSpec(attn + "kv_b_proj.weight", (N * (nope + dv), R), "[N*(qk_nope+v), R]",
                   _split_kv_b([(jx, "attn", "wk_b"), (jx, "attn", "wv_b")], N, nope, dv, R)),
        TensorSpec(attn + "o_proj.weight", (D, N * dv), "[D, N*v]", reshape((jx, "attn", "wo"), D, N, dv)),
    ]
    specs += ffn_tensors(cfg, i, fused_experts)
    if m.indexer is not None:
        specs += indexer_tensors(cfg, i)
    if m.q_lora_rank is None:
        specs.append(TensorSpec(attn + "q_proj.weight", (N * qk, D), "[N*qk, D]",
                                rows((jx, "attn", "wq"), q_order, N, qk, D)))
    else:
        Q = m.q_lora_rank
        specs += [
            TensorSpec(attn + "q_a_proj.weight", (Q, D), "[q_lora_rank, D]", as_is((jx, "attn", "wq_a"))),
            TensorSpec(attn + "q_a_layernorm.weight", (Q,), "[q_lora_rank]",
                       as_is((jx, "attn", "q_norm", "scale"))),
            TensorSpec(attn + "q_b_proj.weight", (N * qk, Q), "[N*qk, q_lora_rank]",
                       rows((jx, "attn", "wq_b"), q_order, N, qk, Q)),
        ]
        if cfg.qkv_bias:
            specs.append(TensorSpec(attn + "q_a_proj.bias", (Q,), "[q_lora_rank]",
                                    as_is((jx, "attn", "wq_a_bias"))))
    if cfg.qkv_bias:
        specs.append(TensorSpec(attn + "kv_a_proj_with_mqa.bias", (R + E,), "[R+E]",
                                rows((jx, "attn", "wkv_a_bias"), kv_order)))
    if cfg.out_bias:
        specs.append(TensorSpec(attn + "o_proj.bias", (D,), "[D]", as_is((jx, "attn", "wo_bias"))))
    return specs


def indexer_tensors(cfg: Config, i: int) -> list[TensorSpec]:
    """Layer i's DeepSeek-V3.2 indexer (`jaxkv.layers.indexer`), every tensor as stored."""
    ix, D, Q = cfg.mla.indexer, cfg.d_model, cfg.mla.q_lora_rank
    Hi, Di = ix.n_heads, ix.head_dim
    hf, path = f"layers.{i}.self_attn.indexer.", (f"layer_{i}", "attn", "indexer")
    return [TensorSpec(hf + "wq_b.weight", (Hi * Di, Q), "[index_n_heads*index_head_dim, q_lora_rank]",
                       as_is((*path, "index_wq"))),
            TensorSpec(hf + "wk.weight", (Di, D), "[index_head_dim, D]", as_is((*path, "index_wk"))),
            TensorSpec(hf + "k_norm.weight", (Di,), "[index_head_dim]", as_is((*path, "index_norm_scale"))),
            TensorSpec(hf + "k_norm.bias", (Di,), "[index_head_dim]", as_is((*path, "index_norm_bias"))),
            TensorSpec(hf + "weights_proj.weight", (Hi, D), "[index_n_heads, D]", as_is((*path, "index_weights")))]


def ffn_tensors(cfg: Config, i: int, fused_experts: bool) -> list[TensorSpec]:
    """Layer i's FFN: the dense MLP, or the router, the shared experts and the X routed experts."""
    m = cfg.moe
    if m is None or not m.is_moe_layer(i):
        return tensors.mlp(cfg, i)
    hf, path, D = f"layers.{i}.mlp.", (f"layer_{i}", "mlp"), cfg.d_model
    return (tensors.router(hf, path, m, D) + tensors.shared_experts(hf, path, m, D)
            + tensors.experts(hf, path, m, D, fused=fused_experts))


def _family(arch: str) -> Family:
    def tensor_specs(config: Config, hf: dict, names) -> list[TensorSpec]:
        return _tensors(config, rope_interleaved(hf, arch), config.moe is not None
                        and tensors.fused_experts_stored(names))

    classes = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "deepseek_v32": "DeepseekV32ForCausalLM"}
    return Family(arch, (classes[arch],), lambda f: deepseek_fields(f, arch), tensor_specs,
                  mtp=lambda config, hf, names, source: mtp_plan(config, hf, names, source, arch))


DEEPSEEK_V2 = register(_family("deepseek_v2"))
DEEPSEEK_V3 = register(_family("deepseek_v3"))
DEEPSEEK_V32 = register(_family("deepseek_v32"))
