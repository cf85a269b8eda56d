"""gpt-oss (`jaxkv.families.gpt_oss`) against transformers: tiny random GptOssForCausalLM models with every feature
moving the logits: attention sinks drawn N(0, 2) (a zero or missing sink would show), sliding layers of window 8
alternating with full ones over prompts of 12-24 tokens and 32 new ones (ring caches wrap), q/k/v/o biases, YaRN
as released (factor 32 over 4,096 positions: the ramp and the attention factor act at every position), the
router's logit bias and the experts' biases drawn at random (transformers zeroes them), and a swiglu_limit of 2 so
the clamps bind. Checked: the config mapping and transformers' defaults, float32 logits within 1e-4, greedy tokens
(a single prompt and a ragged batch), n = 2, beams, the engine, speculation, every token's experts (no near
ties), the MXFP4 release format dequantized as transformers' own `convert_moe_packed_tensors` does, and broken
checkpoints named.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from helpers.hf import (ATOL, BOS, EOS, PAD, RAGGED, SINGLE, VOCAB, check_moe_path,  # noqa: E402
                        check_moe_routing, hf_greedy, hf_greedy_cases, hf_logits, saved_and_loaded)
from helpers.hf import build_hf as hf_model  # noqa: E402
from jaxkv.io.hf import config_from_hf  # noqa: E402

LAYERS = 4
FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=8, swiglu_limit=2.0, max_position_embeddings=256, initializer_range=0.25,
              rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)


def build_hf(seed: int = 0, **changes):
    hf = hf_model("GptOssConfig", dict(FIELDS, **changes), seed)
    with torch.no_grad():  # transformers zeroes the expert biases and draws small sinks: make them matter
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2)
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias, layer.mlp.router.bias):
                bias.copy_(torch.randn(bias.shape) * 0.5)
    return hf


loaded = saved_and_loaded(build_hf, {"gpt_oss": ()})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, jaxkv's, transformers' greedy tokens for SINGLE and RAGGED by prompt count)."""
    hf, model, _ = loaded("gpt_oss", tmp_path_factory)
    return hf, model, hf_greedy_cases(hf)


def test_config_maps_sinks_windows_and_experts(pair):
    _, model, _ = pair
    c, moe = model.config, model.config.moe
    assert c.attention_sinks and c.qkv_bias and c.out_bias and c.norm_kind == "rmsnorm_f32"
    assert c.layer_types == ("sliding_attention", "full_attention") * 2 and c.sliding_window == 8
    assert (c.rope_theta, c.rope_scaling.factor, c.rope_scaling.original_max_positions, c.rope_scaling.truncate) == (
        150000.0, 32.0, 4096, False)
    assert (moe.scoring, moe.n_routed_experts, moe.experts_per_token, moe.moe_ffn_dim, moe.swiglu_limit,
            moe.swiglu_alpha, moe.router_logit_bias, moe.expert_bias, moe.n_shared_experts) == (
        "topk_softmax", 8, 2, 48, 2.0, 1.702, True, True, 0)
    attn = model.params["layer_0"]["attn"]
    assert attn["sinks"].shape == (4,) and np.abs(np.asarray(attn["sinks"])).max() > 1
    assert model.params["layer_0"]["mlp"]["router_logit_bias"].dtype == np.float32


def test_omitted_fields_take_transformers_defaults():
    """A config.json with only the sizes reads as GptOssConfig fills it: alternating layers (sliding first) of
    window 128, YaRN (theta 150000, factor 32 over 4096, no truncation), 128 experts, 4 per token, limit 7."""
    given = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=48, vocab_size=VOCAB)
    theirs = transformers.GptOssConfig(**given)
    ours = config_from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **given},
                          source="config.json")
    assert list(ours.layer_types) == theirs.layer_types and ours.sliding_window == theirs.sliding_window == 128
    rope = theirs.rope_parameters
    assert (ours.rope_theta, ours.rope_scaling.factor, ours.rope_scaling.original_max_positions,
            ours.rope_scaling.truncate) == (rope["rope_theta"], rope["factor"],
                                            rope["original_max_position_embeddings"], rope["truncate"])
    m = ours.moe
    assert (m.n_routed_experts, m.experts_per_token, m.swiglu_limit, m.swiglu_alpha) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.swiglu_limit, theirs.swiglu_alpha)
    assert ours.norm_eps == theirs.rms_norm_eps and ours.qkv_bias == ours.out_bias == theirs.attention_bias


def test_logits_match(pair):
    hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_sinks_and_clamps_move_the_logits(pair):
    """The features this family adds are not inert on these weights: zeroing the sinks or lifting the clamp
    moves the logits by far more than the parity bound (so the parity test could fail on either)."""
    _, model, _ = pair
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 24))  # test_logits_match's shape: its compiled forward
    base = np.asarray(jaxkv.logits(model, tokens))
    params = {k: dict(v) if isinstance(v, dict) else v for k, v in model.params.items()}
    for i in range(LAYERS):
        params[f"layer_{i}"] = {**params[f"layer_{i}"], "attn": {**params[f"layer_{i}"]["attn"]}}
        params[f"layer_{i}"]["attn"]["sinks"] = np.zeros(4, np.float32)
    no_sinks = np.asarray(jaxkv.logits(jaxkv.Model(model.config, params), tokens))
    unclamped = model.config.replace(moe=model.config.moe.__class__(**{**model.config.moe.__dict__,
                                                                        "swiglu_limit": 1e6}))
    no_clamp = np.asarray(jaxkv.logits(jaxkv.Model(unclamped, model.params), tokens))
    assert np.abs(no_sinks - base).max() > 100 * ATOL and np.abs(no_clamp - base).max() > 100 * ATOL


@pytest.mark.parametrize("path", ["greedy", "n=2", "engine", "beams", "routing", "speculative"])
def test_decoding_paths_equal_transformers(pair, path):
    """Each decoding path against transformers' tokens (beams: and scores), and every token's experts."""
    hf, model, greedy = pair
    check_moe_path(path, hf, model, greedy, "gpt-oss",
                   routing=lambda: check_moe_routing(hf, model, range(LAYERS), lambda layer: layer.mlp.router),
                   decode_widths=[2])  # one engine decode dispatch compiled (tests/engine: the widths)


def test_paged_and_int8_caches_equal_the_contiguous_cache(pair):
    """The paged cache (a prefix cache miss, then a hit) and an int8 cache against the plain greedy tokens
    (transformers', which the contiguous cache gives in the greedy path test): the sinks enter every attention path
    (the sliding layers' rings, the paged reads, the fresh chunk after a hit). The paged forks (n = 2) with sinks:
    test_decoding_paths_equal_transformers[n=2]."""
    hf, model, _ = pair
    # 15 tokens: past the window of 8; the miss's 15 tokens and the hit's 3 pad to one prefill length (one compile)
    prompt = SINGLE[0] + RAGGED[0][:3]
    plain = hf_greedy(hf, [prompt], 16)
    prefix = jaxkv.PrefixCache(model, num_pages=64, page_size=4)
    for hits in (0, 12):  # the second call hits the first's pages (3 whole pages of the 15-token prompt)
        out = jaxkv.generate(model, [prompt], max_new_tokens=16, stop_tokens=[], prefix_cache=prefix)
        assert out.tokens == plain and out.stats["prefix_hit_tokens"] == hits
    prompt = SINGLE[0] + RAGGED[1]  # 25 tokens (the int8 run compiles its own programs at any length)
    plain = hf_greedy(hf, [prompt], 16)
    quantized = jaxkv.generate(model, [prompt], max_new_tokens=16, stop_tokens=[], cache_dtype="int8")
    assert sum(a == b for a, b in zip(quantized.tokens[0], plain[0])) >= 8


# --- the release format: MXFP4 experts ---------------------------------------------------------------------------


def mxfp4_encode(w: np.ndarray):
    """A [X, D, O] float32 expert matrix (transformers' layout) -> MXFP4 (blocks uint8 [X, O, D / 32, 16], scales
    uint8 [X, O, D / 32]): each block of 32 along D scaled by a power of two so its largest value is <= 6, each
    value rounded to the nearest E2M1 value (the inverse of `convert_moe_packed_tensors`, as a test fixture)."""
    from jaxkv.io.mxfp4 import FP4_VALUES
    rows = np.ascontiguousarray(w.transpose(0, 2, 1))  # [X, O, D]
    X, O, D = rows.shape
    blocks = rows.reshape(X, O, D // 32, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)  # [X, O, G]
    scaled = blocks / np.ldexp(1.0, exponent)[..., None]
    nibble = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)  # [X, O, G, 32]
    packed = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return packed.astype(np.uint8), (exponent + 127).astype(np.uint8)


def save_mxfp4(hf, directory, *, corrupt=None):
    """`hf` saved as the releases are: config.json with quantization_config mxfp4, each layer's two expert
    matrices as _blocks / _scales. Returns the state dict transformers' dequantization gives back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    dequantized = dict(state)
    for i in range(LAYERS):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = mxfp4_encode(state.pop(name).numpy())
            state[name + "_blocks"], state[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            dequantized[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                           dtype=torch.float32)
    if corrupt is not None:
        corrupt(state)
    config = hf.config.to_dict()
    config["architectures"] = [type(hf).__name__]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.embed_tokens",
                                                                                          "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return dequantized


def test_mxfp4_experts_dequantize_as_transformers_does(tmp_path):
    """The released MXFP4 experts load to the weights transformers' own dequantization gives: logits within 1e-4
    of transformers' model holding those weights, and not those of the unquantized model (the rounding shows)."""
    hf = build_hf(seed=3, hidden_size=64, intermediate_size=64)  # D and I multiples of 32: whole blocks
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    dequantized = save_mxfp4(hf, tmp_path)
    model = jaxkv.load(tmp_path)
    tokens = np.random.default_rng(5).integers(0, VOCAB, (2, 16))
    before = hf_logits(hf, tokens)
    hf.load_state_dict(dequantized)
    ours = np.asarray(jaxkv.logits(model, tokens))
    np.testing.assert_allclose(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)
    assert np.abs(ours - before).max() > 100 * ATOL
    hf.load_state_dict(original)


@pytest.mark.parametrize("broken, named", [
    (lambda s: s.pop("model.layers.1.self_attn.sinks"), "model.layers.1.self_attn.sinks"),
    (lambda s: s.__setitem__("model.layers.2.mlp.router.weight", torch.zeros(7, 64)), "model.layers.2.mlp.router.weight"),
    (lambda s: s.__setitem__("model.layers.0.mlp.experts.down_proj_blocks",
                             s["model.layers.0.mlp.experts.down_proj_blocks"][..., :8].contiguous()),
     "model.layers.0.mlp.experts.down_proj_blocks"),
    (lambda s: s.pop("model.layers.3.mlp.experts.gate_up_proj_scales"), "model.layers.3.mlp.experts.gate_up_proj"),
], ids=["missing-sink", "router-shape", "mxfp4-block-size", "mxfp4-missing-scales"])
def test_broken_checkpoints_name_the_tensor(tmp_path, broken, named):
    hf = build_hf(seed=1, hidden_size=64, intermediate_size=64)
    save_mxfp4(hf, tmp_path, corrupt=broken)
    with pytest.raises(ValueError, match=named):
        jaxkv.load(tmp_path)
