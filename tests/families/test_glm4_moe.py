"""GLM-4.5 / 4.6 (`jaxkv.families.glm4_moe`) against transformers: tiny random Glm4MoeForCausalLM models with
partial rotary (half of each head, as the releases), q/k/v biases, q/k norms on and off, layer 0 dense and layers
1-2 DeepSeek-V3-style mixtures of experts (sigmoid scores plus a randomized correction bias, 4 groups of 2 experts
with 2 kept, normalized, scaled, a shared expert), saved with save_pretrained (per-expert tensors) and as
transformers 5's fused state_dict: the config mapping and transformers' defaults, float32 logits within 1e-4, greedy
tokens (a single prompt and a ragged batch), n = 2 samples, beam search, the engine, speculation, the experts
every token is routed to (no near ties), and the multi-token-prediction layer (its torch composition, and
Speculation("mtp")).
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from helpers.hf import (ATOL, BOS, EOS, PAD, RAGGED, VOCAB, check_moe_path, check_moe_routing,  # noqa: E402
                        check_mtp_speculation, hf_greedy_cases, hf_logits, saved_and_loaded)
from helpers.hf import build_hf as hf_model  # noqa: E402
from jaxkv.io.hf import config_from_hf  # noqa: E402

MOE_LAYERS = (1, 2)
FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
              n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.8, n_shared_experts=1,
              first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, max_position_embeddings=256,
              initializer_range=0.25, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)


def build_hf(seed: int = 0, **changes):
    hf = hf_model("Glm4MoeConfig", dict(FIELDS, **changes), seed)
    with torch.no_grad():  # transformers zeroes the correction bias, which would hide one left out
        for i in MOE_LAYERS:
            bias = hf.model.layers[i].mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape) * 0.1)
    return hf


loaded = saved_and_loaded(build_hf, {"glm4_moe": ()})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, jaxkv's, transformers' greedy tokens for SINGLE and RAGGED by prompt count)."""
    hf, model, _ = loaded("glm4_moe", tmp_path_factory)
    return hf, model, hf_greedy_cases(hf)


def test_config_maps_attention_and_experts(pair):
    hf, model, _ = pair
    c, moe = model.config, model.config.moe
    assert c.rotary_dim == 8 and c.head_dim == 16 and c.qk_norm and c.qkv_bias and not c.out_bias
    assert (moe.scoring, moe.topk_method, moe.n_group, moe.topk_group, moe.norm_topk_prob) == (
        "sigmoid", "noaux_tc", 4, 2, True)
    assert (moe.n_routed_experts, moe.experts_per_token, moe.moe_ffn_dim, moe.n_shared_experts,
            moe.first_dense_layers, moe.routed_scaling_factor) == (8, 3, 32, 1, 1, 1.8)
    assert "w_gate" in model.params["layer_0"]["mlp"] and "router_bias" in model.params["layer_1"]["mlp"]


def test_omitted_fields_take_transformers_defaults():
    """A config.json without partial_rotary_factor, rms_norm_eps or the MoE fields reads as Glm4MoeConfig fills
    them: half of each head rotated, eps 1e-5, 128 experts of 1408, 8 per token, one group, layer 0 dense."""
    given = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=VOCAB)
    theirs = transformers.Glm4MoeConfig(**given)
    ours = config_from_hf({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **given},
                          source="config.json")
    assert ours.rotary_dim == int(16 * theirs.rope_parameters["partial_rotary_factor"]) == 8
    assert ours.norm_eps == theirs.rms_norm_eps == 1e-5 and not ours.qk_norm and not ours.qkv_bias
    m = ours.moe
    assert (m.n_routed_experts, m.moe_ffn_dim, m.experts_per_token, m.n_group, m.topk_group, m.first_dense_layers,
            m.routed_scaling_factor, m.n_shared_experts) == (
        theirs.n_routed_experts, theirs.moe_intermediate_size, theirs.num_experts_per_tok, theirs.n_group,
        theirs.topk_group, theirs.first_k_dense_replace, theirs.routed_scaling_factor, theirs.n_shared_experts)


@pytest.mark.parametrize("changes", [{}, dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0)],
                         ids=["glm4.5", "plain-attention"])
def test_logits_match(changes, tmp_path):
    hf = build_hf(seed=2, **changes)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(jaxkv.load(tmp_path), tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_fused_experts_load_too(tmp_path):
    """transformers 5's in-memory names (experts.gate_up_proj / down_proj: a state_dict saved as is)."""
    hf = build_hf(seed=1)
    hf.config.architectures = [type(hf).__name__]
    hf.config.to_json_file(tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    safetensors_torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(jaxkv.load(tmp_path), tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_a_broken_router_is_named(pair, tmp_path):
    """A router tensor of the wrong shape is a ValueError naming it."""
    hf, _, _ = pair
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    hf.config.architectures = [type(hf).__name__]
    hf.config.to_json_file(tmp_path / "config.json")
    state["model.layers.1.mlp.gate.weight"] = torch.zeros(7, 64)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.gate.weight"):
        jaxkv.load(tmp_path)


def add_mtp(hf, directory):
    """transformers drops GLM's multi-token-prediction layer (decoder layer L = num_hidden_layers), so the tests
    build it from transformers' own parts as vLLM's glm4_moe_mtp.py composes them (enorm, hnorm, eh_proj over
    [normed embedding; normed hidden], a Glm4MoeDecoderLayer of index L: experts, shared_head.norm), random, and
    add its tensors (`model.layers.L.*`) to the saved checkpoint -> the torch pieces {name: module}."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

    torch.manual_seed(4)
    cfg, L = hf.config, hf.config.num_hidden_layers
    D = cfg.hidden_size
    parts = {"enorm": Glm4MoeRMSNorm(D, eps=cfg.rms_norm_eps), "hnorm": Glm4MoeRMSNorm(D, eps=cfg.rms_norm_eps),
             "eh_proj": torch.nn.Linear(2 * D, D, bias=False), "layer": Glm4MoeDecoderLayer(cfg, L).eval(),
             "shared_head.norm": Glm4MoeRMSNorm(D, eps=cfg.rms_norm_eps)}
    stored = {}
    for name, module in parts.items():
        for key, value in module.state_dict().items():
            value = torch.randn_like(value) * (0.3 if value.ndim == 1 else 0.2)  # norms' weights away from 0 too
            with torch.no_grad():
                dict(module.named_parameters(), **dict(module.named_buffers()))[key].copy_(value)
            stored[f"model.layers.{L}.{'' if name == 'layer' else name + '.'}{key}"] = value.contiguous()
    path = directory / "model.safetensors"
    safetensors_torch.save_file({**safetensors_torch.load_file(path), **stored}, path, metadata={"format": "pt"})
    return parts


@pytest.fixture(scope="module")
def with_mtp(pair, tmp_path_factory):
    hf, _, _ = pair
    directory = tmp_path_factory.mktemp("glm_mtp")
    hf.save_pretrained(directory, safe_serialization=True)
    parts = add_mtp(hf, directory)
    return hf, parts, jaxkv.load(directory)


def test_mtp_layer_loads_and_matches_its_torch_composition(pair, with_mtp):
    """The checkpoint's MTP layer loads into Model.mtp (the decoder unchanged); its logits for the pairs (h_t,
    token_{t+1}) equal the torch composition's at 1e-4, the token embedding at position 0 zeroed as vLLM's
    glm4_moe_mtp does (without the zeroing the first position's logits differ)."""
    from jaxkv.decoding.mtp import mtp_forward

    _, model, _ = pair
    hf, parts, loaded_mtp = with_mtp
    assert loaded_mtp.mtp is not None and len(loaded_mtp.mtp.params) == 1
    assert loaded_mtp.mtp.config.mtp_zero_first_embedding and loaded_mtp.mtp.config.moe is not None
    batch = np.random.default_rng(0).integers(0, VOCAB, (2, 24))  # test_logits_match's shape: its compiled program
    np.testing.assert_array_equal(jaxkv.logits(loaded_mtp, batch), jaxkv.logits(model, batch))
    tokens = np.random.default_rng(9).integers(0, VOCAB, (1, 24))
    with torch.no_grad():
        ids = torch.tensor(tokens)
        h = hf.model(input_ids=ids).last_hidden_state  # after the final norm: what the head reads
        T = ids.shape[1] - 1
        embedded = hf.model.embed_tokens(ids[:, 1:]).clone()
        embedded[:, 0] = 0  # position 0
        x = parts["eh_proj"](torch.cat([parts["enorm"](embedded), parts["hnorm"](h[:, :-1])], dim=-1))
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = parts["layer"](x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        want = hf.lm_head(parts["shared_head.norm"](y[0] if isinstance(y, tuple) else y)).numpy()
    got, _, _ = mtp_forward(loaded_mtp.mtp.params[0], loaded_mtp.params, jnp.asarray(h[:, :-1].numpy()),
                            jnp.asarray(tokens[:, 1:]), jnp.arange(T)[None], None, config=loaded_mtp.mtp.config)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    unzeroed = loaded_mtp.mtp.config.replace(mtp_zero_first_embedding=False)
    other, _, _ = mtp_forward(loaded_mtp.mtp.params[0], loaded_mtp.params, jnp.asarray(h[:, :-1].numpy()),
                              jnp.asarray(tokens[:, 1:]), jnp.arange(T)[None], None, config=unzeroed)
    assert np.abs(np.asarray(other)[:, 0] - want[:, 0]).max() > 100 * ATOL


@pytest.mark.parametrize("where", ["contiguous", "paged", "engine"])
def test_mtp_speculation_equals_plain(pair, with_mtp, where):
    """Speculation("mtp") with GLM's MTP layer proposing: greedy tokens equal plain decoding's (transformers' greedy
    tokens of the ragged prompts, which plain decoding gives: test_decoding_paths_equal_transformers[greedy])."""
    check_mtp_speculation(with_mtp[2], where, RAGGED, [row[:16] for row in pair[2][len(RAGGED)]],
                          decode_widths=[2])  # one speculative decode dispatch compiled (tests/engine: the widths)


@pytest.mark.parametrize("path", ["greedy", "n=2", "engine", "beams", "routing", "speculative"])
def test_decoding_paths_equal_transformers(pair, path):
    """Each decoding path against transformers' tokens (beams: and scores), and every token's experts."""
    hf, model, greedy = pair
    check_moe_path(path, hf, model, greedy, "glm4-moe", routing=lambda: check_moe_routing(hf, model, MOE_LAYERS),
                   decode_widths=[2])  # one engine decode dispatch compiled (tests/engine: the widths)
