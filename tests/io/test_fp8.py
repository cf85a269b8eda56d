"""Block-quantized FP8 checkpoints (`jaxkv.checkpoint_fp8`): tiny transformers models (Qwen3; DeepSeek-V3 with
MLA, a dense layer and MoE layers whose every expert is quantized) saved, then re-written as their FP8 releases
are (each linear weight float8_e4m3fn with float32 `_scale_inv` blocks, a quantization_config in config.json).
jaxkv dequantizes at load: its params equal the dequantized weights exactly, and its logits and greedy tokens equal
transformers' on those same dequantized weights (transformers reading them from an unquantized copy). The blocks
(16 x 32) do not divide every dimension, so partial blocks are exercised; the quantization is coarse enough (FP8)
that reading the values with the wrong scales moves the logits far past the tolerance."""

import json
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from jaxkv import checkpoint_fp8  # noqa: E402
from helpers.hf import (DEEPSEEK_MOE_LIKE as MOE_MLA, build_deepseek_moe_hf as moe_hf,  # noqa: E402
                        ATOL, LLAMA_LIKE, MIN_MARGIN, RAGGED, assert_clear_margins, build_hf, hf_greedy, hf_logits)

BLOCK = (16, 32)
QUANTIZED = ("proj.weight",)  # what the releases quantize: every linear layer's weight (not norms, embeddings, head)
# name -> (builder, config class, kwargs, seed)
CASES = {
    "qwen3": (build_hf, "Qwen3Config", dict(LLAMA_LIKE, head_dim=16), 1),
    # multi-head latent attention (q_lora_rank: q_a/q_b), a dense layer 0, then MoE layers: each routed and shared
    # expert's weights quantized (per-expert tensors, as the release has them)
    "deepseek-v3-moe": (moe_hf, "DeepseekV3Config", dict(MOE_MLA, q_lora_rank=48, n_routed_experts=8,
                                                          num_experts_per_tok=3, n_group=4, topk_group=2,
                                                          norm_topk_prob=True, routed_scaling_factor=2.5,
                                                          n_shared_experts=1), 0),
}


def quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scale_inv) of W [out, in], one scale per block (as DeepSeek's quantizer)."""
    out, inp = w.shape
    go, gi = -(-out // block[0]), -(-inp // block[1])
    padded = torch.zeros(go * block[0], gi * block[1])
    padded[:out, :inp] = w
    blocks = padded.reshape(go, block[0], gi, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
    q = (blocks / scale[:, None, :, None]).reshape(go * block[0], gi * block[1])[:out, :inp]
    return q.to(torch.float8_e4m3fn), scale.float()


def expand(scale: torch.Tensor, shape, block=BLOCK) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def fp8_release(root, source):
    """Re-writes `source` (a save_pretrained directory) as an FP8 release in root / "fp8", and the same model with
    the dequantized weights, unquantized, in root / "dequantized" -> names of the quantized weights."""
    tensors = safetensors_torch.load_file(str(source / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith(QUANTIZED) and w.ndim == 2:
            q, scale = quantize(w.float())
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = q.float() * expand(scale, w.shape)
        else:
            fp8[name] = dequantized[name] = w
    config = json.loads((source / "config.json").read_text())
    for name, tensors, quantization in (("dequantized", dequantized, None), ("fp8", fp8, {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)})):
        (root / name).mkdir()
        safetensors_torch.save_file(tensors, str(root / name / "model.safetensors"), metadata={"format": "pt"})
        c = dict(config, quantization_config=quantization) if quantization else config
        (root / name / "config.json").write_text(json.dumps(c))
    return sorted(n for n in fp8 if n.endswith("_scale_inv"))


_built: dict = {}


def release(name, tmp_path_factory):
    """(name, transformers' model of the dequantized weights, the directory holding "fp8" and "dequantized", the
    quantized weights' names), built once per process."""
    if name not in _built:
        builder, config_class, kwargs, seed = CASES[name]
        root = tmp_path_factory.mktemp(name)
        builder(config_class, kwargs, seed=seed).save_pretrained(root / "plain", safe_serialization=True)
        names = [n.removesuffix("_scale_inv") for n in fp8_release(root, root / "plain")]
        # transformers reads the dequantized directory itself (its own per-expert -> fused conversion included)
        hf = transformers.AutoModelForCausalLM.from_pretrained(root / "dequantized",
                                                               attn_implementation="eager").eval()
        hf.generation_config.eos_token_id = None
        _built[name] = name, hf, root, names
    return _built[name]


@pytest.fixture(params=sorted(CASES))
def released(request, tmp_path_factory):
    return release(request.param, tmp_path_factory)


def test_params_are_the_dequantized_weights_and_logits_match(released):
    name, hf, root, names = released
    assert len(names) >= 8 and (name != "deepseek-v3-moe" or any(".experts.7." in n for n in names))
    model = jaxkv.load(root / "fp8", dtype="float32")
    tokens = np.random.default_rng(1).integers(3, 120, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0, err_msg=name)
    # The same model saved unquantized from the dequantized weights loads to identical params.
    reference = jaxkv.load(root / "dequantized", dtype="float32")
    jax.tree_util.tree_map(np.testing.assert_array_equal, model.params, reference.params)


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(released):
    name, hf, root, _ = released
    model = jaxkv.load(root / "fp8", dtype="float32")
    expected = hf_greedy(hf, RAGGED, 16)
    assert_clear_margins(hf, RAGGED, expected, name, MIN_MARGIN)
    assert jaxkv.generate(model, RAGGED, max_new_tokens=16, stop_tokens=[]).tokens == expected


def test_default_dtype_is_the_embeddings(released):
    _, _, root, _ = released
    model = jaxkv.load(root / "fp8")  # the embedding is float32 here: the load dtype follows it
    assert model.config.dtype == "float32"


def _rewrite(root, tmp_path, drop=None, reshape=None, config=None):
    target = tmp_path / "bad"
    shutil.copytree(root / "fp8", target)
    if drop or reshape:
        tensors = safetensors_torch.load_file(str(target / "model.safetensors"))
        if drop:
            del tensors[drop]
        if reshape:
            tensors[reshape] = tensors[reshape][:-1]
        safetensors_torch.save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    if config:
        c = json.loads((target / "config.json").read_text())
        c["quantization_config"].update(config)
        (target / "config.json").write_text(json.dumps(c))
    return target


def test_bad_fp8_checkpoints_are_named_errors(released, tmp_path):
    name, _, root, names = released
    weight = names[0]
    cases = [
        (dict(drop=weight + "_scale_inv"), f"tensor '{weight}' .* is F8_E4M3 but its scales"),
        (dict(reshape=weight + "_scale_inv"), f"tensor '{weight}_scale_inv' .* has shape"),
        (dict(drop=weight), f"scales '{weight}', which the checkpoint does not hold"),
        (dict(config={"quant_method": "gptq"}), "quant_method' = 'gptq' is not supported"),
        (dict(config={"activation_scheme": "static"}), "activation_scheme' = 'static' is not supported"),
        (dict(config={"weight_block_size": None}), "weight_block_size' must be two positive integers"),
    ]
    for i, (change, words) in enumerate(cases):
        bad = _rewrite(root, tmp_path / str(i), **change)
        with pytest.raises(ValueError, match=words):
            jaxkv.load(bad)
    # Without its quantization_config the F8 weights are refused by dtype, with the reason.
    bad = tmp_path / "noconfig"
    shutil.copytree(root / "fp8", bad)
    c = json.loads((bad / "config.json").read_text())
    del c["quantization_config"]
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="F8_E4M3.*needs its quantization_config"):
        jaxkv.load(bad)


def test_dequantize_partial_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((20, 40)).astype(np.float32)
    q, scale = quantize(torch.from_numpy(w))
    got = checkpoint_fp8.dequantize(q.view(torch.uint8).numpy().view(checkpoint_fp8.ml_dtypes.float8_e4m3fn),
                                    scale.numpy(), BLOCK)
    np.testing.assert_array_equal(got, (q.float() * expand(scale, w.shape)).numpy())
    np.testing.assert_allclose(got, w, rtol=0.07, atol=1e-6)  # e4m3 keeps 3 mantissa bits: within 2**-4 relative


def test_deepseek_multi_token_prediction_layer_loads_apart(tmp_path_factory, tmp_path):
    """DeepSeek-V3's release also holds its multi-token-prediction module as layer n_layers (num_nextn_predict_layers
    1), FP8 too: it loads into Model.mtp, dequantized as the decoder's layers are, and leaves the decoder's params
    as they are; without the config field it is an unused tensor."""
    _, _, root, _ = release("deepseek-v3-moe", tmp_path_factory)
    target = tmp_path / "mtp"
    shutil.copytree(root / "fp8", target)
    tensors = safetensors_torch.load_file(str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    n, D = config["num_hidden_layers"], config["hidden_size"]
    last = f"model.layers.{n - 1}."  # a mixture-of-experts layer, as the module's own
    extra = {k.replace(last, f"model.layers.{n}."): v.clone() for k, v in tensors.items() if k.startswith(last)}
    extra[f"model.layers.{n}.eh_proj.weight"], extra[f"model.layers.{n}.eh_proj.weight_scale_inv"] = quantize(
        torch.randn(D, 2 * D))
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"model.layers.{n}.{name}.weight"] = torch.ones(D)
    safetensors_torch.save_file({**tensors, **extra}, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    with pytest.raises(ValueError, match=f"tensor 'model.layers.{n}.* is not used by this architecture"):
        jaxkv.load(target)
    (target / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))  # transformers' default
    model, reference = jaxkv.load(target), jaxkv.load(root / "fp8")
    jax.tree_util.tree_map(np.testing.assert_array_equal, model.params, reference.params)
    assert reference.mtp is None and len(model.mtp.params) == 1
    jax.tree_util.tree_map(np.testing.assert_array_equal, model.mtp.params[0]["layer_0"],
                           reference.params[f"layer_{n - 1}"])
    eh, scale = extra[f"model.layers.{n}.eh_proj.weight"], extra[f"model.layers.{n}.eh_proj.weight_scale_inv"]
    np.testing.assert_array_equal(model.mtp.params[0]["eh_proj"], (eh.float() * expand(scale, eh.shape)).numpy())
