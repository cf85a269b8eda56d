"""Qwen3.5 (`jaxkv.families.qwen3_5`) against transformers: tiny random models of the four classes, with every layer
kind (three Gated DeltaNet layers, then a gated full-attention layer), saved with save_pretrained and loaded with
`jaxkv.load`: Qwen3_5ForCausalLM (dense MLP), Qwen3_5MoeForCausalLM (experts and the gated shared expert on every
layer), and Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (the language model under
`model.language_model.`, a tiny vision tower whose tensors are skipped). The config mapping (transformers' defaults
for omitted fields, the fields its MoE model ignores, the refusals), logits against transformers' float64 and float32
runs, greedy tokens for a single prompt and a left-padded ragged batch, cached decoding against recomputing the
prefix, and the experts' fused 3D form.

Logits are compared at the hybrid bound (tests/helpers/tolerances.py), not the usual 1e-4, for the reason
tests/families/test_qwen3_next.py's docstring gives: the linear layers' gated RMSNorm scales nearly-zero value heads
to unit RMS, so no float32 implementation matches another (or the exact answer) to 1e-4 on these random models; any
mapping error moves logits 100-fold more. Greedy tokens must be identical where every choice has a clear margin.
"""

import copy

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from helpers.hf import (BOS, EOS, MIN_MARGIN, NEW_TOKENS, PAD, RAGGED, SINGLE, VOCAB, assert_clear_margins,  # noqa: E402
                        greedy_cases, hf_greedy, hf_logits, per_row, saved_and_loaded)
from helpers.tolerances import tolerance  # noqa: E402
from jaxkv.io.hf import config_from_hf  # noqa: E402

HYBRID = tolerance("transformers logits, hybrid", "float32")

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, initializer_range=0.25,
            rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
DENSE = dict(TEXT, intermediate_size=96)
# decoder_sparse_step, mlp_only_layers, norm_topk_prob and intermediate_size are no Qwen3_5MoeTextConfig fields, but
# save_pretrained writes them to config.json and the model ignores them (every layer sparse, weights renormalized):
# the mapping must ignore them too (honoured, layer 1 would be dense and the weights unnormalized).
MOE = dict(TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
           decoder_sparse_step=2, mlp_only_layers=[1], norm_topk_prob=False, intermediate_size=96)
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)

# name -> (config class, model class, config kwargs); the text models list layer_types, the multimodal ones leave
# them to the default (every full_attention_interval = 4th layer full: the same four kinds)
KINDS = {
    "dense": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(DENSE, layer_types=LAYER_TYPES)),
    "moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(MOE, layer_types=LAYER_TYPES)),
    "vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(text_config=DENSE, vision_config=VISION)),
    "vl-moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(text_config=MOE, vision_config=VISION)),
    # rotary scalings on the partial rotation (computed by transformers over the rotated dims only)
    "yarn": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(DENSE, layer_types=LAYER_TYPES, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    "linear": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(DENSE, layer_types=LAYER_TYPES, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=3.0))),
}
TEXT_KINDS = ("dense", "moe")
MULTIMODAL_KINDS = ("vl", "vl-moe")


def build(kind):
    config_class, model_class, kwargs = KINDS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**copy.deepcopy(kwargs))
    hf = getattr(transformers, model_class)._from_config(config, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # never stop early (helpers.hf.build_hf)
    return hf


loaded = saved_and_loaded(build, {kind: (kind,) for kind in KINDS})


def stored_names(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "np") as f:
        return set(f.keys())


def exact_and_float32(hf, tokens):
    """transformers' logits in float64 (the exact answer, up to 1e-12) and in float32, for `tokens` [B, T]."""
    exact = copy.deepcopy(hf).double()
    exact.set_experts_implementation("eager")  # the grouped experts kernel takes no float64
    with torch.no_grad():
        return exact(torch.tensor(tokens)).logits.numpy(), hf_logits(hf, tokens)


@pytest.mark.parametrize("kind", TEXT_KINDS + MULTIMODAL_KINDS)
def test_config_maps_every_layer_kind(kind, tmp_path_factory):
    _, model, directory = loaded(kind, tmp_path_factory)
    c = model.config
    assert c.layer_types == tuple(LAYER_TYPES) and c.linear_layers == (0, 1, 2)
    la = c.linear_attention
    assert (la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (2, 4, 8, 12, 4)
    assert c.rotary_dim == 4 and c.attn_output_gate and c.qk_norm and c.norm_kind == "gemma_rmsnorm"
    assert not c.tie_embeddings and "lm_head" in model.params and c.eos_ids == (EOS,)
    assert set(model.params["layer_0"]["linear_attn"]) == {"w_qkv", "w_z", "w_b", "w_a", "conv", "A_log", "dt_bias",
                                                            "gate_norm", "w_out"}
    assert "wq_gate" in model.params["layer_3"]["attn"]
    names = stored_names(directory)
    if kind.endswith("moe"):
        moe = c.moe
        assert (moe.n_routed_experts, moe.experts_per_token, moe.moe_ffn_dim, moe.shared_ffn_dim) == (8, 2, 32, 48)
        assert moe.shared_expert_gate and moe.norm_topk_prob and moe.scoring == "softmax"
        assert [moe.is_moe_layer(i) for i in range(4)] == [True] * 4  # mlp_only_layers / decoder_sparse_step ignored
        assert "shared_gate" in model.params["layer_1"]["mlp"]
        # what save_pretrained writes: one tensor per expert
        assert any(".mlp.experts.7.down_proj.weight" in n for n in names)
        assert not any(n.endswith("experts.gate_up_proj") for n in names)
    else:
        assert c.moe is None and c.ffn_dim == 96 and set(model.params["layer_1"]["mlp"]) == {"w_gate", "w_up",
                                                                                             "w_down"}
    prefix = "model.language_model." if kind in MULTIMODAL_KINDS else "model."
    assert f"{prefix}layers.0.linear_attn.in_proj_qkv.weight" in names and "lm_head.weight" in names
    vision = {n for n in names if n.startswith("model.visual.")}
    assert bool(vision) == (kind in MULTIMODAL_KINDS)  # the multimodal checkpoints hold a vision tower, skipped
    assert c.param_count() == sum(np.size(x) for x in jax.tree_util.tree_leaves(model.params))


# 150 tokens (the chunked form's three chunks) on the MoE model only: the same delta-rule code as the dense one's.
LOGITS_CASES = [("dense", (2, 40)), ("moe", (2, 40)), ("moe", (1, 150))] + [
    (k, (2, 40)) for k in MULTIMODAL_KINDS + ("yarn", "linear")]


@pytest.mark.parametrize("kind, shape", LOGITS_CASES, ids=[f"{k}-{s[1]}" for k, s in LOGITS_CASES])
def test_logits_match(kind, shape, tmp_path_factory):
    """The whole-sequence logits of random tokens (150: three chunks of the delta rule's parallel form, the last
    partial) against transformers' float64 run (the exact answer) and its float32 one, within the hybrid bound.
    The multimodal classes run token ids alone: transformers feeds the same position to all three mrope grids."""
    hf, model, _ = loaded(kind, tmp_path_factory)
    tokens = np.random.default_rng(shape[1]).integers(0, VOCAB, shape)
    exact, theirs = exact_and_float32(hf, tokens)
    ours = jaxkv.logits(model, tokens)
    np.testing.assert_allclose(ours, exact, **HYBRID, err_msg=f"{kind}: against exact")
    np.testing.assert_allclose(ours, theirs, **HYBRID, err_msg=f"{kind}: against transformers' float32")


GREEDY_CASES = [(k, i) for k in TEXT_KINDS for i in (0, 1)] + [(k, 1) for k in MULTIMODAL_KINDS]


@pytest.mark.parametrize("kind, case", GREEDY_CASES,
                         ids=[f"{k}-{('single', 'ragged')[i]}" for k, i in GREEDY_CASES])
def test_greedy_generation_is_token_identical(kind, case, tmp_path_factory):
    """The single prompt (4 copies) or the left-padded ragged batch: transformers' greedy tokens, each choice
    decided by a clear margin (the multimodal classes: the ragged batch, whose rows' positions transformers'
    generate derives from the attention mask)."""
    hf, model, _ = loaded(kind, tmp_path_factory)
    prompts, batch = greedy_cases(SINGLE, RAGGED)[case]
    expected = hf_greedy(hf, prompts)
    assert_clear_margins(hf, prompts, expected, kind, MIN_MARGIN)
    got = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
    for b, row in enumerate(per_row(expected, batch)):
        assert got[b] == row, f"{kind}, {len(prompts)} prompt(s), row {b}"


def _logprobs(logits, prompt, row):
    """The log-probabilities of `row`'s tokens, from the logits [T, V] of prompt + row (float64)."""
    x = np.asarray(logits, np.float64)[len(prompt) - 1:-1]
    x = x - x.max(-1, keepdims=True)
    x = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return x[np.arange(len(row)), row]


# The MoE model only: the dense one's linear layers and state carry are the same code (and its greedy tokens are
# transformers' above); the dense hybrid's cached decoding against a recomputed prefix is
# tests/families/test_qwen3_next_sharing.py's (forks, paged, the engine).
@pytest.mark.parametrize("kind", ["moe"])
def test_cached_decoding_equals_recompute(kind, tmp_path_factory):
    """40 decode steps (the recurrent form, states carried in the cache) after a ragged prefill (the chunked form):
    each step's token is the argmax of the no-cache forward pass over the whole prefix, and its log-probability
    equals that pass's and transformers' float64 one within the hybrid bound. Not the usual 1e-4: the gated norm
    amplifies float32 rounding here too; measured (MoE) cached 9e-5 and recomputed 2e-4 from the exact answer,
    1.3e-4 apart, where transformers' own float32 pass is 8e-5 from it. A state lost or misplaced moves O(0.1)."""
    hf, model, _ = loaded(kind, tmp_path_factory)
    exact = copy.deepcopy(hf).double()
    exact.set_experts_implementation("eager")
    prompts = RAGGED  # the greedy test's ragged batch (padded to 4): its compiled prefill
    out = jaxkv.generate(model, prompts, max_new_tokens=40, stop_tokens=[], logprobs=1)
    for p, row, lps in zip(prompts, out.tokens, out.logprobs):
        # right-padded to 150 (causal: the padding after them changes none of their logits): one compiled pass,
        # test_logits_match[moe-150]'s
        full = np.asarray(jaxkv.logits(model, [p + row + [0] * (150 - len(p + row))])[0])[:len(p + row)]
        assert list(full[len(p) - 1:-1].argmax(-1)) == row, kind
        with torch.no_grad():
            want = _logprobs(exact(torch.tensor([p + row])).logits[0].numpy(), p, row)
        np.testing.assert_allclose(lps, _logprobs(full, p, row), **HYBRID, err_msg=f"{kind}: against recompute")
        np.testing.assert_allclose(lps, want, **HYBRID, err_msg=f"{kind}: against transformers' float64")


def test_fused_experts_load_and_a_partial_mtp_layer_is_refused(tmp_path_factory, tmp_path):
    """transformers' in-memory form (a state_dict saved as is: each layer's experts as the 3D gate_up_proj
    [X, 2*I, D] and down_proj [X, D, I]) loads to the same weights as save_pretrained's per-expert tensors; a
    multi-token-prediction layer stored in part (`mtp.*`: it loads into Model.mtp, whole) names what is missing."""
    hf, model, directory = loaded("moe", tmp_path_factory)
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 2 * 32, 64)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    fused = jaxkv.load(tmp_path)
    assert fused.config == model.config and fused.mtp is None
    jax.tree_util.tree_map(np.testing.assert_array_equal, fused.params, model.params)
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    state["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor 'mtp.layers.0.*' is missing from the checkpoint"):
        jaxkv.load(tmp_path)


def _text_config(config_class, fields):
    """transformers' reading of a config.json holding `fields`, and jaxkv's."""
    hf = getattr(transformers, config_class)(**copy.deepcopy(fields))
    architecture = {"Qwen3_5TextConfig": "Qwen3_5ForCausalLM", "Qwen3_5MoeTextConfig": "Qwen3_5MoeForCausalLM"}
    return hf, config_from_hf(dict(fields, architectures=[architecture[config_class]]), source="config.json")


@pytest.mark.parametrize("config_class", ["Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"])
@pytest.mark.parametrize("fields", [
    {},
    {"num_hidden_layers": 6, "full_attention_interval": 3},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True}},
    {"partial_rotary_factor": 0.5, "head_dim": 64},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}},
], ids=["empty", "interval", "mrope", "top-level-partial", "partial"])
def test_omitted_fields_take_transformers_defaults(config_class, fields):
    """A config.json that leaves fields out (the releases leave few, but the defaults differ from the shared
    readers': partial_rotary_factor 0.25, num_key_value_heads, layer_types) is read as transformers reads it."""
    hf, c = _text_config(config_class, fields)
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
        hf.head_dim)
    assert c.layer_types == tuple(hf.layer_types)
    assert c.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert c.rope_theta == hf.rope_parameters["rope_theta"] and c.rope_scaling is None
    assert (c.max_positions, c.norm_eps, c.tie_embeddings) == (hf.max_position_embeddings, hf.rms_norm_eps,
                                                               hf.tie_word_embeddings)
    la = c.linear_attention
    assert (la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    if config_class == "Qwen3_5MoeTextConfig":
        moe = c.moe
        assert (moe.n_routed_experts, moe.experts_per_token, moe.moe_ffn_dim, moe.shared_ffn_dim) == (
            hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.shared_expert_intermediate_size)
        assert moe.dense_layers == () and moe.first_dense_layers == 0
    else:
        assert c.moe is None and c.ffn_dim == hf.intermediate_size


@pytest.mark.parametrize("architecture, fields, field", [
    ("Qwen3_5ForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type"),
    ("Qwen3_5ForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters"),
    ("Qwen3_5ForCausalLM", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
     "layer_types"),
    ("Qwen3_5ForCausalLM", {"num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2}, "layer_types"),
    ("Qwen3_5MoeForCausalLM", {"num_experts": 0}, "num_experts"),
    ("Qwen3_5MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 8}, "experts_per_token"),
    ("Qwen3_5ForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
], ids=["dynamic-rope", "per-layer-rope", "sliding", "no-full-layer", "no-experts", "top-k", "activation"])
def test_refusals_name_the_field(architecture, fields, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(dict(fields, architectures=[architecture]), source="config.json")


def test_multimodal_reads_text_config_and_outer_fields():
    """Qwen3_5ForConditionalGeneration: the sizes from text_config (omitted ones at their defaults), the head's
    tying from the outer config, eos from the outer config when set, else from text_config."""
    text = dict(DENSE, eos_token_id=7)
    c = config_from_hf({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                        "tie_word_embeddings": True}, source="config.json")
    assert c.tie_embeddings and c.eos_ids == (7,) and c.d_model == 64 and c.rotary_dim == 4
    c = config_from_hf({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": MOE,
                        "tie_word_embeddings": False, "eos_token_id": 9}, source="config.json")
    assert not c.tie_embeddings and c.eos_ids == (9,) and [c.moe.is_moe_layer(i) for i in range(4)] == [True] * 4
    with pytest.raises(ValueError, match="text_config"):
        config_from_hf({"architectures": ["Qwen3_5ForConditionalGeneration"]}, source="config.json")


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_mtp_layer_loads_and_matches_its_torch_composition(kind, tmp_path):
    """The releases' `mtp.*` layer (which transformers drops) loads into Model.mtp and matches the torch module
    vLLM's qwen3_5_mtp.py composes from transformers' Qwen3.5 layers (helpers.hybrid.check_mtp_module); for the
    multimodal class too, whose language model sits under `model.language_model.` while `mtp.*` is top level."""
    from helpers.hybrid import check_mtp_module

    module = "qwen3_5_moe" if kind == "moe" else "qwen3_5"
    modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=["_"])
    prefix = "Qwen3_5Moe" if kind == "moe" else "Qwen3_5"
    hf = build(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    check_mtp_module(hf, tmp_path, getattr(modeling, f"{prefix}DecoderLayer"), getattr(modeling, f"{prefix}RMSNorm"))


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_logits_within_1e4_at_transformers_default_init(kind, tmp_path):
    """With transformers' own initializer range (0.02) the float32 logits match to the usual 1e-4: the hybrid bound
    is needed only for the 0.25 models above (tests/families/test_qwen3_next.py's docstring says why)."""
    from helpers.hf import ATOL

    config_class, model_class, kwargs = KINDS[kind]
    kwargs = copy.deepcopy(kwargs)
    for fields in (kwargs, kwargs.get("text_config", {})):
        if "initializer_range" in fields:
            fields["initializer_range"] = 0.02
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)._from_config(getattr(transformers, config_class)(**kwargs),
                                                         attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    # test_logits_match's 2 x 40 shape (this config differs from its kind's only in its weights): its compiled pass
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 40))
    np.testing.assert_allclose(jaxkv.logits(jaxkv.load(tmp_path), tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)
