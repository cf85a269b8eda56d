"""Qwen3-MoE (`jaxkv.families.qwen3_moe`) against transformers: a tiny random Qwen3MoeForCausalLM (q/k norms, a
softmax top-2 router with norm_topk_prob, a dense layer between MoE layers through mlp_only_layers), saved with
save_pretrained (one tensor per expert) and as transformers 5's fused state_dict, loaded with `jaxkv.load`: logits
(float32, atol 1e-4), greedy tokens (a single prompt and a left-padded ragged batch) through `jaxkv.generate`,
parallel samples (n=2), the engine and beam search, and the experts every token is routed to.

Ties: every token's expert choice is checked to be decided by a margin well above rounding (tests/test_moe.py's
`assert_no_near_ties`), so equal routing is meaningful.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf  # noqa: E402
from helpers.hf import build_hf as hf_model  # noqa: E402
from helpers.hf import (ATOL, BOS, EOS, PAD, RAGGED, VOCAB,  # noqa: E402
                        check_moe_beam_search, check_moe_engine, check_moe_greedy_generation,
                        check_moe_parallel_greedy_samples, check_speculative_greedy, check_moe_routing,
                        hf_greedy_cases, hf_logits)

# 3 layers: experts on layers 0 and 2, layer 1 dense (mlp_only_layers); head_dim left out: hidden / heads = 16.
FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
              initializer_range=0.25, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
MOE_LAYERS = (0, 2)


def build_hf(seed: int = 0, **changes):
    return hf_model("Qwen3MoeConfig", dict(FIELDS, **changes), seed)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = build_hf()
    directory = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(directory, safe_serialization=True)
    return hf, jaxkv.load(directory)


@pytest.fixture(scope="module")
def greedy(pair):
    """transformers' greedy tokens for SINGLE and RAGGED."""
    hf, _ = pair
    return hf_greedy_cases(hf)


def test_config_maps_the_layers_and_router(pair):
    _, model = pair
    c = model.config
    assert c.qk_norm and c.head_dim == 16 and c.sliding_window is None
    assert (c.moe.n_routed_experts, c.moe.experts_per_token, c.moe.moe_ffn_dim, c.moe.n_shared_experts) == (8, 2, 32, 0)
    assert (c.moe.scoring, c.moe.topk_method, c.moe.norm_topk_prob) == ("softmax", "greedy", True)
    assert [c.moe.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert "w_gate" in model.params["layer_1"]["mlp"] and "router" in model.params["layer_2"]["mlp"]


@pytest.mark.parametrize("changes, moe_layers", [
    (dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[]), [1, 3, 5]),
    (dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]), [1, 5]),
    (dict(num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=None), [0, 1, 2, 3]),
    (dict(num_hidden_layers=2, decoder_sparse_step=3, mlp_only_layers=[]), []),  # no MoE layer: a dense model
    (dict(num_hidden_layers=2, num_experts=0), []),
])
def test_sparse_step_and_mlp_only_layers(changes, moe_layers):
    """transformers' rule: layer i has experts iff i not in mlp_only_layers, num_experts > 0 and (i + 1) %
    decoder_sparse_step == 0; as config.json writes it (num_local_experts) and as the releases do (num_experts)."""
    hf = transformers.Qwen3MoeConfig(**dict(FIELDS, **changes)).to_dict()
    hf["architectures"] = ["Qwen3MoeForCausalLM"]
    for spelling in (hf, {k: v for k, v in hf.items() if k != "num_local_experts"} | {
            "num_experts": hf["num_local_experts"]}):
        config = config_from_hf(json.loads(json.dumps(spelling)), source="config.json")
        got = [] if config.moe is None else [i for i in range(config.n_layers) if config.moe.is_moe_layer(i)]
        assert got == moe_layers


def test_sliding_window_only_with_use_sliding_window():
    hf = dict(FIELDS, architectures=["Qwen3MoeForCausalLM"], sliding_window=8)
    assert config_from_hf(hf, source="c").sliding_window is None
    assert config_from_hf(dict(hf, use_sliding_window=True), source="c").sliding_window == 8


def test_logits_match(pair):
    hf, model = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_fused_experts_load_too(tmp_path):
    """transformers 5's in-memory names (experts.gate_up_proj / down_proj, a state_dict saved as is), with
    norm_topk_prob off."""
    hf = build_hf(seed=1, norm_topk_prob=False)
    hf.config.architectures = [type(hf).__name__]
    hf.config.to_json_file(tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    safetensors_torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = jaxkv.load(tmp_path)
    assert not model.config.moe.norm_topk_prob
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_greedy_generation_is_token_identical(pair, greedy):
    check_moe_greedy_generation(pair[1], greedy)


def test_parallel_greedy_samples_equal_transformers(pair, greedy):
    check_moe_parallel_greedy_samples(pair[1], greedy)


def test_engine_equals_transformers(pair, greedy):
    check_moe_engine(pair[1], greedy, decode_widths=[2])  # one decode dispatch compiled (tests/engine: the widths)


def test_beam_search_equals_transformers(pair, greedy):
    check_moe_beam_search(pair[0], pair[1], greedy)


def test_every_token_is_routed_to_the_same_experts(pair):
    check_moe_routing(pair[0], pair[1], MOE_LAYERS)


def test_speculative_greedy_equals_transformers(pair, greedy):
    check_speculative_greedy(pair[1], greedy[len(RAGGED)], "qwen3-moe")
