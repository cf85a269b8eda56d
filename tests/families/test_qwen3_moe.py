"""Qwen3-MoE (`jaxkv.families.qwen3_moe`) against transformers: a tiny random Qwen3MoeForCausalLM (q/k norms, a
softmax top-2 router with norm_topk_prob, a dense layer between MoE layers through mlp_only_layers), saved with
save_pretrained (one tensor per expert) and as transformers 5's fused state_dict, loaded with `jaxkv.load`: logits
(float32, atol 1e-4), greedy tokens (a single prompt and a left-padded ragged batch) through `jaxkv.generate`,
parallel samples (n=2), the engine and beam search, and the experts every token is routed to.

Ties: every token's expert choice is checked to be decided by a margin well above rounding (tests/test_moe.py's
`assert_no_near_ties`), so equal routing is meaningful.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf  # noqa: E402
from jaxkv.model import Decoder  # noqa: E402
from helpers.hf import (ATOL, BEAM_NEW, BOS, EOS, NEW_TOKENS, PAD, RAGGED, SINGLE, VOCAB,  # noqa: E402
                        assert_no_near_ties, greedy_cases, hf_beam_search, hf_greedy, hf_logits, per_row)

# 3 layers: experts on layers 0 and 2, layer 1 dense (mlp_only_layers); head_dim left out: hidden / heads = 16.
FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
              initializer_range=0.25, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
MOE_LAYERS = (0, 2)


def build_hf(seed: int = 0, **changes):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**dict(FIELDS, **changes))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # never stop early (helpers.hf's build_hf)
    return hf


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
    return {len(prompts): hf_greedy(hf, prompts) for prompts, _ in greedy_cases(SINGLE, RAGGED)}


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
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    _, model = pair
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        got = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
        for b, row in enumerate(per_row(greedy[len(prompts)], batch)):
            assert len(set(row)) >= 8, f"HF output too repetitive to test anything: {row}"
            assert got[b] == row, f"{len(prompts)} prompt(s), row {b}"


def test_parallel_greedy_samples_equal_transformers(pair, greedy):
    """n=2 samples of each ragged prompt (prefilled once, forked; page size 5 divides no prompt length): each is
    transformers' greedy continuation."""
    _, model = pair
    expected = greedy[len(RAGGED)]
    got = jaxkv.generate(model, RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[], n=2, page_size=5).tokens
    assert got == [row for row in expected for _ in range(2)]


def test_engine_equals_transformers(pair, greedy):
    """The engine's requests (2 slots for 3 prompts, prefill chunks of 8), greedy: transformers' tokens."""
    _, model = pair
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=8)
    results = engine.generate(RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[])
    assert [r.tokens for r in results] == greedy[len(RAGGED)]


def test_beam_search_equals_transformers(pair, greedy):
    hf, model = pair
    prompts = SINGLE + RAGGED
    stops = sorted({greedy[1][0][3], greedy[len(RAGGED)][0][6]})  # reached at different steps
    want = hf_beam_search(hf, prompts, stops, num_beams=3, length_penalty=1.0, early_stopping=True,
                          num_return_sequences=3)
    got = jaxkv.beam_search(model, prompts, num_beams=3, max_new_tokens=BEAM_NEW, length_penalty=1.0,
                            early_stopping=True, num_return_sequences=3, stop_tokens=stops)
    assert got.tokens == [[tokens for tokens, _ in hyps] for hyps in want]
    for hyps, want_hyps in zip(got, want):
        for h, (_, score) in zip(hyps, want_hyps):
            assert abs(h.score - score) < 1e-4


def test_every_token_is_routed_to_the_same_experts(pair):
    hf, model = pair
    tokens = np.array(SINGLE + [list(reversed(SINGLE[0]))])  # [2, 12]
    captured, hooks = {}, []
    for i in MOE_LAYERS:
        def hook(module, args, out, i=i):  # Qwen3MoeTopKRouter -> (logits, weights, ids)
            captured[i] = (out[0].detach().numpy(), out[2].detach().numpy())
        hooks.append(hf.model.layers[i].mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf(torch.tensor(tokens))
    finally:
        for h in hooks:
            h.remove()
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    forward = jax.jit(lambda params, t, p: Decoder(model.config).apply({"params": params}, t, p, None,
                                                                       mutable=["intermediates"]))
    _, state = forward(model.params, tokens.astype(np.int32), positions)
    A = model.config.moe.experts_per_token
    for i in MOE_LAYERS:
        logits, ids = captured[i]
        assert_no_near_ties(logits, model.config.moe, None)
        ours = np.asarray(state["intermediates"][f"layer_{i}"]["mlp"]["expert_ids"][0]).reshape(-1, A)
        # transformers' order within a token is unspecified: compare as sets
        np.testing.assert_array_equal(np.sort(ours, -1), np.sort(ids, -1), err_msg=f"layer {i}")
        assert len({tuple(sorted(row)) for row in ours}) > 2  # different tokens pick different experts
