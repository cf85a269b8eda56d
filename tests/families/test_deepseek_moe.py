"""DeepSeek-V2/V3 mixture-of-experts models against transformers: tiny random DeepseekV3ForCausalLM /
DeepseekV2ForCausalLM with a dense first layer and MoE layers after it, saved and loaded with `load_hf`: logits
(float32, atol 1e-4), 32 greedy tokens (single prompt and a left-padded ragged batch of 3), and the experts every
token of a prompt is routed to in every MoE layer (transformers' routers captured with forward hooks, ours sown by
`jaxkv.moe.Moe`). Both on-disk expert layouts load: one tensor per expert (DeepSeek's releases and transformers
5.24's save_pretrained) and transformers 5's fused 3D tensors (its state_dict as is).

Ties: as in tests/test_moe.py, every token's choice is checked to be decided by a margin well above rounding.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf, load_hf  # noqa: E402
from jaxkv.config import MoeConfig  # noqa: E402
from jaxkv.model import Decoder  # noqa: E402
from helpers.hf import (ATOL, DEEPSEEK_MOE_LAYERS as MOE_LAYERS, DEEPSEEK_MOE_LIKE as MLA,  # noqa: E402
                        NEW_TOKENS, RAGGED, SINGLE, VOCAB, assert_no_near_ties, build_deepseek_moe_hf as build_hf,
                        check_speculative_greedy, greedy_cases, hf_greedy, hf_logits, per_row)

# MLA (helpers.hf's DEEPSEEK_MOE_LIKE): 3 layers, layer 0 dense, layers 1-2 MoE (MOE_LAYERS); build_hf
# (helpers.hf's build_deepseek_moe_hf) randomizes V3's e_score_correction_bias, which transformers zeroes.
# name -> (config class, fields, fused experts on disk). Layer 0 dense, layers 1-2 MoE in each.
CASES = {
    # sigmoid + correction bias, 4 groups of 2 experts, 2 groups kept, normalized, scaled by 2.5
    "v3": ("DeepseekV3Config", dict(MLA, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                    topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                    n_shared_experts=1), False),
    "v3-fused-unnormed": ("DeepseekV3Config", dict(MLA, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2,
                                                   n_group=1, topk_group=1, norm_topk_prob=False,
                                                   routed_scaling_factor=1.5, n_shared_experts=2), True),
    "v2-group-limited": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
                                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                  routed_scaling_factor=2.0, n_shared_experts=2), False),
    "v2-greedy": ("DeepseekV2Config", dict(MLA, q_lora_rank=48, n_routed_experts=6, num_experts_per_tok=2,
                                           topk_method="greedy", routed_scaling_factor=1.0, n_shared_experts=1),
                  True),
}
def save(hf, directory, fused: bool):
    if fused:  # the in-memory (fused) parameter names, as a state_dict saved as is would have them
        directory.mkdir(parents=True, exist_ok=True)
        hf.config.architectures = [type(hf).__name__]  # what save_pretrained records
        hf.config.to_json_file(directory / "config.json")
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.layers.1.mlp.experts.gate_up_proj" in state
        safetensors_torch.save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        hf.save_pretrained(directory, safe_serialization=True)


_BUILT = {}  # name -> (HF model, its saved directory): each case built once per module


def built(name, tmp_path_factory):
    if name not in _BUILT:
        config_class, fields, fused = CASES[name]
        hf = build_hf(config_class, fields)
        directory = tmp_path_factory.mktemp(name)
        save(hf, directory, fused)
        _BUILT[name] = hf, directory, load_hf(directory)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf, _, model = built(request.param, tmp_path_factory)
    return request.param, hf, model


def test_config_maps_the_moe(pair):
    name, hf, model = pair
    moe, c = model.config.moe, hf.config
    assert (moe.n_routed_experts, moe.experts_per_token, moe.moe_ffn_dim, moe.n_shared_experts,
            moe.first_dense_layers, moe.routed_scaling_factor) == (
        c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.n_shared_experts,
        c.first_k_dense_replace, c.routed_scaling_factor)
    v3 = name.startswith("v3")
    assert (moe.scoring, moe.norm_topk_prob) == (("sigmoid", c.norm_topk_prob) if v3 else ("softmax", False))
    assert moe.topk_method == ("noaux_tc" if v3 else c.topk_method)
    assert "w_gate" in model.params["layer_0"]["mlp"] and "router" in model.params["layer_1"]["mlp"]


def test_logits_match(pair):
    name, hf, model = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0, err_msg=name)


# Greedy tokens for one V2 and one V3 router. The other two cases differ in what loading and routing decide, which
# test_logits_match and test_every_token_is_routed_to_the_same_experts check on their own models (every token's
# experts are chosen per token by the same code whether prefilled or decoded): group-limited greedy routing, and the
# fused expert tensors with unnormalized weights.
@pytest.mark.parametrize("pair", ["v2-greedy", "v3"], indirect=True)
def test_greedy_generation_is_token_identical(pair):
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    name, hf, model = pair
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        got = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
        for b, row in enumerate(per_row(hf_greedy(hf, prompts), batch)):
            assert len(set(row)) >= 8, f"{name}: HF output too repetitive to test anything: {row}"
            assert got[b] == row, f"{name}, {len(prompts)} prompt(s), row {b}"


def test_bfloat16_load_keeps_the_router_float32(tmp_path_factory):
    """load_hf(dtype="bfloat16"): experts and shared experts bfloat16, the router and its bias float32 (as
    transformers keeps them); the logits are no farther from the float32 model's than transformers' own bfloat16
    model is, and decoding runs."""
    _, tmp_path, full = built("v3", tmp_path_factory)
    half = load_hf(tmp_path, dtype="bfloat16")
    mlp = half.params["layer_1"]["mlp"]
    assert mlp["router"].dtype == mlp["router_bias"].dtype == np.float32
    assert mlp["we_gate"].dtype == mlp["ws_down"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(mlp["router"], full.params["layer_1"]["mlp"]["router"])
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    expected = jaxkv.logits(full, tokens)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                               attn_implementation="eager").eval()
    assert theirs.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        their_logits = theirs(torch.tensor(tokens)).logits.float().numpy()
    their_error = np.abs(their_logits - expected).mean()
    # mean, not max: one token routed differently in 16 bits moves its logits a lot, in either implementation
    assert np.abs(jaxkv.logits(half, tokens) - expected).mean() <= 1.5 * their_error
    assert len(jaxkv.generate(half, SINGLE, max_new_tokens=4, stop_tokens=[]).tokens[0]) == 4


def hf_routing(hf, tokens) -> dict[int, tuple]:
    """layer -> (router logits [M, X], expert ids [M, A]) of transformers' routers on `tokens` [B, T]."""
    captured, hooks = {}, []
    for i in MOE_LAYERS:
        def hook(module, args, out, i=i):
            captured[i] = (out[0].detach().numpy(), out[2].detach().numpy())
        hooks.append(hf.model.layers[i].mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf(torch.tensor(np.asarray(tokens)))
    finally:
        for h in hooks:
            h.remove()
    return captured


_FORWARDS = {}  # config -> the jitted forward pass sowing expert ids: one compile per config and shape


def jaxkv_routing(model, tokens) -> dict[int, np.ndarray]:
    """layer -> expert ids int32[B, T, A], sown by each Moe block during a no-cache forward pass."""
    tokens = np.asarray(tokens, np.int32)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    # jitted: one compile instead of hundreds of op-by-op ones
    if model.config not in _FORWARDS:
        _FORWARDS[model.config] = jax.jit(lambda params, t, p, config=model.config: Decoder(config).apply(
            {"params": params}, t, p, None, mutable=["intermediates"]))
    _, state = _FORWARDS[model.config](model.params, tokens, positions)
    return {i: np.asarray(state["intermediates"][f"layer_{i}"]["mlp"]["expert_ids"][0]) for i in MOE_LAYERS}


def test_every_token_is_routed_to_the_same_experts(pair):
    name, hf, model = pair
    tokens = np.array(SINGLE + [list(reversed(SINGLE[0]))])  # [2, 12]
    theirs, ours = hf_routing(hf, tokens), jaxkv_routing(model, tokens)
    A = model.config.moe.experts_per_token
    for i in MOE_LAYERS:
        logits, ids = theirs[i]
        bias = model.params[f"layer_{i}"]["mlp"].get("router_bias")
        assert_no_near_ties(logits, model.config.moe, None if bias is None else np.asarray(bias))
        # transformers' order within a token is unspecified (topk sorted=False): compare as sets
        np.testing.assert_array_equal(np.sort(ours[i].reshape(-1, A), -1), np.sort(ids, -1),
                                      err_msg=f"{name}, layer {i}")
    # different tokens do pick different experts here, or the comparison would prove little
    assert len({tuple(sorted(row)) for row in ours[1].reshape(-1, A)}) > 2


def test_a_wrong_correction_bias_changes_the_routing(tmp_path_factory):
    """The routing comparison can fail: dropping V3's correction bias routes some token differently."""
    hf, directory, _ = built("v3", tmp_path_factory)
    model = load_hf(directory)  # its own copy: the params are edited below
    tokens = np.array(SINGLE + [list(reversed(SINGLE[0]))])  # the routing test's [2, 12]: its compiled forward
    for i in MOE_LAYERS:
        model.params[f"layer_{i}"]["mlp"]["router_bias"] = model.params[f"layer_{i}"]["mlp"]["router_bias"] * 0
    theirs, ours = hf_routing(hf, tokens), jaxkv_routing(model, tokens)
    assert not np.array_equal(np.sort(ours[1].reshape(len(theirs[1][1]), -1), -1), np.sort(theirs[1][1], -1))


def _rewrite(directory, edit):
    """Applies `edit` to the tensors of directory/model.safetensors (a dict, edited in place)."""
    path = directory / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("case, edit, message", [
    ("v3", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
     r"'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight' is missing"),
    ("v3", lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
     r"'model\.layers\.1\.mlp\.gate\.e_score_correction_bias' is missing"),
    ("v3", lambda t: t.update({"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(64, 16)}),
     r"'model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight'.*\[D, I\] = \[64, 32\]"),
    ("v3-fused-unnormed", lambda t: t.update({"model.layers.2.mlp.experts.gate_up_proj": torch.zeros(64, 64)}),
     r"'model\.layers\.2\.mlp\.experts\.gate_up_proj'.*\[X, 2\*I, D\] = \[6, 64, 64\]"),
    ("v3-fused-unnormed", lambda t: t.pop("model.layers.1.mlp.experts.down_proj"),
     r"'model\.layers\.1\.mlp\.experts\.down_proj' is missing"),
    ("v2-group-limited", lambda t: t.pop("model.layers.1.mlp.shared_experts.down_proj.weight"),
     r"'model\.layers\.1\.mlp\.shared_experts\.down_proj\.weight' is missing"),
])
def test_bad_expert_tensors_are_named(case, edit, message, tmp_path):
    config_class, fields, fused = CASES[case]
    save(build_hf(config_class, fields), tmp_path, fused)
    _rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


@pytest.mark.parametrize("case, changes, message", [
    ("v3", dict(moe_layer_freq=2), "'moe_layer_freq'"),
    ("v3", dict(topk_group=5), r"topk_group \(5\) exceeds moe.n_group \(4\)"),
    ("v3", dict(n_group=3), r"multiple of moe.n_group \(3\)"),
    ("v3", dict(num_experts_per_tok=9), r"experts_per_token \(9\) exceeds"),
    ("v2-greedy", dict(topk_method="noaux_tc"), "'topk_method'"),
    ("v2-greedy", dict(num_experts_per_tok=None), "'num_experts_per_tok' is missing"),
    ("v2-group-limited", dict(n_group=None), "'n_group' is missing"),
])
def test_bad_moe_config_is_a_clear_error(case, changes, message):
    config_class, fields, _ = CASES[case]
    hf = json.loads(getattr(transformers, config_class)(**fields).to_json_string())
    hf["architectures"] = [config_class.replace("Config", "ForCausalLM")]
    hf.update(changes)
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf, source="config.json")


def test_v2_greedy_ignores_groups_and_norm_as_transformers_does():
    """transformers' V2 router reads neither n_group / topk_group under "greedy" nor norm_topk_prob at all."""
    config_class, fields, _ = CASES["v2-greedy"]
    hf = json.loads(getattr(transformers, config_class)(**fields).to_json_string())
    hf.update(architectures=["DeepseekV2ForCausalLM"], n_group=8, topk_group=3, norm_topk_prob=True)
    moe = config_from_hf(hf, source="config.json").moe
    assert (moe.topk_method, moe.n_group, moe.topk_group, moe.norm_topk_prob) == ("greedy", 1, 1, False)


def test_random_moe_model_cached_decoding_equals_recompute():
    """A random MoE model (grouped-query attention, no checkpoint): `init_params` draws the experts with their
    fan-in, the parameter count is the config's, and cached greedy decoding (ragged batch, contiguous cache) picks
    the recompute's argmax at every step. (The paged cache's MoE blocks: every MoE family's n=2 parity test, e.g.
    test_glm4_moe.py's, grouped noaux_tc routing as here.)"""
    moe = MoeConfig(n_routed_experts=8, experts_per_token=2, moe_ffn_dim=32, n_shared_experts=1,
                    first_dense_layers=1, scoring="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1,
                    routed_scaling_factor=2.0, norm_topk_prob=True)
    config = jaxkv.Config(vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=4, ffn_dim=96, moe=moe)
    model = jaxkv.Model.random(config, seed=0)
    experts = model.params["layer_1"]["mlp"]
    assert experts["we_gate"].shape == (8, 64, 32) and abs(float(np.std(experts["we_gate"])) - 64 ** -0.5) < 0.01
    assert sum(np.size(a) for a in jax.tree_util.tree_leaves(model.params)) == config.param_count()
    prompts = [p[:n] for p, n in zip(RAGGED, (5, 9, 3))]
    out = jaxkv.generate(model, prompts, max_new_tokens=12, stop_tokens=[]).tokens
    # The recompute of all rows in one call, right-padded to one length: causal, and every token routed alone
    # (dropless), so the padding after a row's tokens changes none of their logits.
    rows = [prompt + new for prompt, new in zip(prompts, out)]
    recompute = jaxkv.logits(model, [row + [0] * (max(map(len, rows)) - len(row)) for row in rows])
    for b, (prompt, new) in enumerate(zip(prompts, out)):
        logits = recompute[b, :len(rows[b])]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == new


@pytest.mark.parametrize("pair", ["v3"], indirect=True)
def test_speculative_greedy_equals_transformers(pair):
    """Group-limited expert routing of k + 1 tokens per row at once."""
    name, hf, model = pair
    check_speculative_greedy(model, hf_greedy(hf, RAGGED), name)
