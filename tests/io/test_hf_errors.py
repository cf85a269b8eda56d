"""Bad Hugging Face checkpoints fail in `load_hf` with a clear ValueError / FileNotFoundError naming the file,
tensor or config field, before any tensor data is read.

The checkpoints are written by hand with json and `safetensors.numpy` (no torch needed).
"""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

from jaxkv import checkpoint_hf  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf, load_hf  # noqa: E402

V, D, L, N, K, H, F = 32, 16, 2, 2, 1, 8, 24

LLAMA_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=D,
                    num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K, intermediate_size=F,
                    max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0))

GPT2_CONFIG = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=V, n_embd=D, n_layer=L, n_head=N,
                   n_positions=64, activation_function="gelu_new", eos_token_id=2)


def llama_tensors(seed: int = 0) -> dict:
    """HF names and shapes of a tiny untied Llama, written out independently of the loader's table."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.normal(0, 0.1, shape).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": w(D), "lm_head.weight": w(V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": w(D), p + "post_attention_layernorm.weight": w(D),
                  p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
                  p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
                  p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
                  p + "mlp.down_proj.weight": w(D, F)})
    return t


def gpt2_tensors(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.normal(0, 0.1, shape).astype(np.float32)

    t = {"wte.weight": w(V, D), "wpe.weight": w(64, D), "ln_f.weight": w(D), "ln_f.bias": w(D)}
    for i in range(L):
        p = f"h.{i}."
        t.update({p + "ln_1.weight": w(D), p + "ln_1.bias": w(D), p + "ln_2.weight": w(D), p + "ln_2.bias": w(D),
                  p + "attn.c_attn.weight": w(D, 3 * D), p + "attn.c_attn.bias": w(3 * D),
                  p + "attn.c_proj.weight": w(D, D), p + "attn.c_proj.bias": w(D),
                  p + "mlp.c_fc.weight": w(D, 4 * D), p + "mlp.c_fc.bias": w(4 * D),
                  p + "mlp.c_proj.weight": w(4 * D, D), p + "mlp.c_proj.bias": w(D)})
    return t


def write(directory, config=None, tensors=None, *, file="model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG if config is None else config))
    save_file(llama_tensors() if tensors is None else tensors, str(directory / file), metadata={"format": "pt"})
    return directory


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Fails the test if the loader reads any tensor's data: validation must come first."""
    def forbidden(t):
        raise AssertionError(f"read tensor {t.name} before validating the checkpoint")
    monkeypatch.setattr(checkpoint_hf, "_read", forbidden)


def test_valid_checkpoints_load(tmp_path):
    """The baselines every error case below breaks in one way."""
    model = load_hf(write(tmp_path / "llama"))
    assert model.config.n_layers == L and model.config.eos_ids == (2,) and model.tokenizer is None
    gpt2 = load_hf(write(tmp_path / "gpt2", GPT2_CONFIG, gpt2_tensors()))
    assert gpt2.config.positions == "learned" and gpt2.config.tie_embeddings


# --- files ------------------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    write(tmp_path).joinpath("config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)


def test_config_not_json(tmp_path):
    write(tmp_path).joinpath("config.json").write_text("{'architectures': [LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_hf(tmp_path)


def test_config_not_an_object(tmp_path):
    write(tmp_path).joinpath("config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object"):
        load_hf(tmp_path)


def test_missing_weights(tmp_path):
    write(tmp_path).joinpath("model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(tmp_path)


def test_pickle_checkpoint_is_refused(tmp_path):
    write(tmp_path).joinpath("model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*convert it to safetensors"):
        load_hf(tmp_path)


def sharded(tmp_path):
    """The tiny Llama split over two shards with an index, as save_pretrained(max_shard_size=...) writes it."""
    tensors = llama_tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path, weight_map


def test_sharded_loads(tmp_path):
    directory, _ = sharded(tmp_path)
    sharded_model = load_hf(directory)
    single = load_hf(write(tmp_path / "single"))
    for i in range(L):
        np.testing.assert_array_equal(sharded_model.params[f"layer_{i}"]["attn"]["wq"],
                                      single.params[f"layer_{i}"]["attn"]["wq"])


def test_missing_shard(tmp_path):
    directory, _ = sharded(tmp_path)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf(directory)


def test_index_lists_tensor_missing_from_its_shard(tmp_path):
    directory, weight_map = sharded(tmp_path)
    weight_map["model.layers.9.extra.weight"] = "model-00001-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.extra\.weight"):
        load_hf(directory)


def test_index_path_outside_directory(tmp_path):
    directory, weight_map = sharded(tmp_path)
    weight_map["model.norm.weight"] = "../elsewhere.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*not a file name"):
        load_hf(directory)


def test_truncated_safetensors(tmp_path):
    path = write(tmp_path) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_hf(tmp_path)


@pytest.mark.parametrize("garbage", [b"", b"abc", np.random.default_rng(0).bytes(4096),
                                     (10 ** 12).to_bytes(8, "little") + b"{}"], ids=["empty", "short", "random",
                                                                                     "huge-header"])
def test_garbage_safetensors(tmp_path, garbage):
    (write(tmp_path) / "model.safetensors").write_bytes(garbage)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_hf(tmp_path)


def test_corrupt_tensor_data(tmp_path):
    """safetensors has no checksum: a NaN written into the data region is caught when the tensor is read."""
    tensors = llama_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*NaN"):
        load_hf(write(tmp_path, tensors=tensors))


# --- tensors ----------------------------------------------------------------------------------------------------


def test_missing_tensor(tmp_path, no_tensor_reads):
    tensors = llama_tensors()
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.v_proj\.weight' is missing"):
        load_hf(write(tmp_path, tensors=tensors))


def test_missing_lm_head_of_untied_model(tmp_path, no_tensor_reads):
    tensors = llama_tensors()
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is missing"):
        load_hf(write(tmp_path, tensors=tensors))


def test_unexpected_tensor(tmp_path, no_tensor_reads):
    tensors = llama_tensors()
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(H, np.float32)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight'.*not used"):
        load_hf(write(tmp_path, tensors=tensors))


def test_extra_layer_is_unexpected(tmp_path, no_tensor_reads):
    """A layer beyond num_hidden_layers: the config and the weights disagree."""
    tensors = llama_tensors()
    tensors["model.layers.2.input_layernorm.weight"] = np.ones(D, np.float32)
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.input_layernorm\.weight'.*not used"):
        load_hf(write(tmp_path, tensors=tensors))


def test_shape_mismatch(tmp_path, no_tensor_reads):
    tensors = llama_tensors()
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((D, F + 1), np.float32)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight'.*shape \[16, 25\].*"
                                         r"\[D, F\] = \[16, 24\]"):
        load_hf(write(tmp_path, tensors=tensors))


def test_config_disagrees_with_tensors(tmp_path, no_tensor_reads):
    """A config whose sizes are wrong for its weights (here: vocab) fails on the first tensor it sizes."""
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight'.*\[V, D\] = \[64, 16\]"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, vocab_size=64)))


def test_non_float_tensor(tmp_path, no_tensor_reads):
    tensors = llama_tensors()
    tensors["model.norm.weight"] = np.ones(D, np.int32)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*dtype I32"):
        load_hf(write(tmp_path, tensors=tensors))


def test_redundant_buffers_are_tolerated(tmp_path):
    """Old exports saved rotary inv_freq (Llama) and the causal-mask buffers (GPT-2) next to the weights."""
    tensors = llama_tensors()
    for i in range(L):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(H // 2, np.float32)
    load_hf(write(tmp_path / "llama", tensors=tensors))
    tensors = gpt2_tensors()
    for i in range(L):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.uint8))
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    load_hf(write(tmp_path / "gpt2", GPT2_CONFIG, tensors))


def test_tied_head_equal_to_embedding_is_tolerated(tmp_path):
    tensors = llama_tensors()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    model = load_hf(write(tmp_path, dict(LLAMA_CONFIG, tie_word_embeddings=True), tensors))
    assert "lm_head" not in model.params


def test_tied_head_different_from_embedding(tmp_path):
    """tie_word_embeddings with a different stored head: loading would silently drop real weights."""
    with pytest.raises(ValueError, match=r"'lm_head\.weight'.*differs from the embedding"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, tie_word_embeddings=True)))


def test_gpt2_prefixed_names_load(tmp_path):
    """save_pretrained writes GPT-2 names under `transformer.`; the original upload has no prefix."""
    tensors = {"transformer." + k: v for k, v in gpt2_tensors().items()}
    plain = load_hf(write(tmp_path / "plain", GPT2_CONFIG, gpt2_tensors()))
    prefixed = load_hf(write(tmp_path / "prefixed", GPT2_CONFIG, tensors))
    np.testing.assert_array_equal(plain.params["layer_1"]["attn"]["wv"], prefixed.params["layer_1"]["attn"]["wv"])


# --- config fields ----------------------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture 'FalconForCausalLM'"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, architectures=["FalconForCausalLM"])))


def test_missing_architectures_field(tmp_path):
    config = dict(LLAMA_CONFIG)
    del config["architectures"]
    with pytest.raises(ValueError, match="'architectures'"):
        load_hf(write(tmp_path, config))


def test_missing_required_field(tmp_path):
    config = dict(LLAMA_CONFIG)
    del config["hidden_size"]
    with pytest.raises(ValueError, match=r"config\.json: field 'hidden_size' is missing"):
        load_hf(write(tmp_path, config))


@pytest.mark.parametrize("field,value", [("vocab_size", 10 ** 12), ("num_hidden_layers", 10 ** 6),
                                         ("hidden_size", 10 ** 7), ("intermediate_size", 10 ** 9),
                                         ("num_attention_heads", 10 ** 5), ("head_dim", 10 ** 6)])
def test_absurd_config_values(tmp_path, no_tensor_reads, field, value):
    with pytest.raises(ValueError, match=rf"field '{field}' = {value} is beyond the supported maximum"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, **{field: value})))


def test_absurd_total_parameter_count():
    """Each field under its cap, the product absurd: 1024 layers of 65536 x 1M feed-forward blocks."""
    config = dict(LLAMA_CONFIG, hidden_size=1 << 16, num_attention_heads=512, num_key_value_heads=512,
                  num_hidden_layers=1024, intermediate_size=1 << 20)
    with pytest.raises(ValueError, match="parameters, beyond the supported maximum"):
        config_from_hf(config, source="config.json")


def test_absurd_gpt2_positions(tmp_path, no_tensor_reads):
    with pytest.raises(ValueError, match=r"field 'n_positions' = 1000000000 is beyond"):
        load_hf(write(tmp_path, dict(GPT2_CONFIG, n_positions=10 ** 9), gpt2_tensors()))


@pytest.mark.parametrize("field,value", [("vocab_size", -3), ("num_hidden_layers", 2.5), ("hidden_size", "16"),
                                         ("num_key_value_heads", True), ("rms_norm_eps", "tiny"),
                                         ("tie_word_embeddings", "yes")])
def test_mistyped_config_values(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"field '{field}'"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, **{field: value})))


def test_huge_rope_max_positions_allocates_nothing(tmp_path):
    """RoPE models compute angles on the fly: max_position_embeddings only bounds generation."""
    model = load_hf(write(tmp_path, dict(LLAMA_CONFIG, max_position_embeddings=2 ** 40)))
    assert model.config.max_positions == 2 ** 40
    assert sum(a.size for a in jax.tree_util.tree_leaves(model.params)) == model.config.param_count()


def test_eos_out_of_vocabulary(tmp_path):
    with pytest.raises(ValueError, match=r"field 'eos_token_id'"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, eos_token_id=[2, V + 5])))


def test_eos_list(tmp_path):
    assert load_hf(write(tmp_path, dict(LLAMA_CONFIG, eos_token_id=[2, 7]))).config.eos_ids == (2, 7)


@pytest.mark.parametrize("rope", [dict(rope_type="yarn", rope_theta=1e4, factor=4.0),
                                  dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
                                  dict(rope_type="linear", rope_theta=1e4, factor=2.0)])
def test_unknown_rope_type(tmp_path, rope):
    with pytest.raises(ValueError, match=rf"rope_parameters\.rope_type' = '{rope['rope_type']}' is not supported"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, rope_parameters=rope)))


def test_unknown_rope_type_in_transformers_4_form(tmp_path):
    config = dict(LLAMA_CONFIG, rope_theta=1e4, rope_scaling=dict(type="linear", factor=2.0))
    del config["rope_parameters"]
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type' = 'linear' is not supported"):
        load_hf(write(tmp_path, config))


def test_llama3_rope_missing_factor(tmp_path):
    rope = dict(rope_type="llama3", rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match=r"rope_parameters\.factor' is missing"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, rope_parameters=rope)))


def test_partial_rotary_factor_refused(tmp_path):
    rope = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, rope_parameters=rope)))


def test_non_silu_activation_refused(tmp_path):
    with pytest.raises(ValueError, match=r"field 'hidden_act' = 'gelu'"):
        load_hf(write(tmp_path, dict(LLAMA_CONFIG, hidden_act="gelu")))


@pytest.mark.parametrize("field,value", [("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                                         ("scale_attn_weights", False), ("add_cross_attention", True),
                                         ("activation_function", "relu")])
def test_gpt2_unsupported_options(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"field '{field}' = .* not supported"):
        load_hf(write(tmp_path, dict(GPT2_CONFIG, **{field: value}), gpt2_tensors()))


def qwen2_config(**changes):
    return dict(LLAMA_CONFIG, architectures=["Qwen2ForCausalLM"], model_type="qwen2", **changes)


def test_qwen2_mixed_sliding_layers_map_to_layer_types():
    """transformers slides only the layers >= max_window_layers (with use_sliding_window): per-layer types."""
    config = config_from_hf(qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                            source="config.json")
    assert (config.layer_types, config.sliding_window) == (("full_attention", "sliding_attention"), 8)


def test_qwen2_window_only_when_enabled():
    off = config_from_hf(qwen2_config(use_sliding_window=False, sliding_window=8), source="config.json")
    beyond = config_from_hf(qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=28),
                            source="config.json")
    every = config_from_hf(qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=0),
                           source="config.json")
    assert (off.sliding_window, beyond.sliding_window, every.sliding_window) == (None, None, 8)
    assert off.qkv_bias and not off.out_bias


def test_bad_dtype_argument(tmp_path):
    with pytest.raises(ValueError, match="dtype must be None or one of"):
        load_hf(write(tmp_path), dtype="float64")


def test_cast_overflow(tmp_path):
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*overflows float16"):
        load_hf(write(tmp_path, tensors=tensors), dtype="float16")


# --- Qwen3, Gemma 2 / 3 ---------------------------------------------------------------------------------------------

QWEN3_CONFIG = dict(LLAMA_CONFIG, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=H)
GEMMA3_TEXT = dict(model_type="gemma3_text", vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=N,
                   num_key_value_heads=K, head_dim=H, intermediate_size=F, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"])
GEMMA3_CONFIG = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=GEMMA3_TEXT,
                     eos_token_id=[1, 2], vision_config=dict(model_type="siglip_vision_model"))
GEMMA2_CONFIG = dict(GEMMA3_TEXT, architectures=["Gemma2ForCausalLM"], model_type="gemma2")


def qwen3_tensors(seed: int = 0) -> dict:
    """A tiny untied Qwen3: Llama's tensors plus each layer's q_norm / k_norm [H]."""
    rng = np.random.default_rng(seed)
    t = llama_tensors(seed)
    for i in range(L):
        t[f"model.layers.{i}.self_attn.q_norm.weight"] = rng.normal(1, 0.1, H).astype(np.float32)
        t[f"model.layers.{i}.self_attn.k_norm.weight"] = rng.normal(1, 0.1, H).astype(np.float32)
    return t


def gemma_tensors(prefix: str = "language_model.model.", qk_norm: bool = True, vision: bool = True) -> dict:
    """A tiny tied Gemma 3 multimodal checkpoint as transformers 5.24 saves it (the language model under
    `language_model.model.`, SigLIP under `vision_tower.`, the projector); Gemma 2 without q/k norms or vision."""
    t = {}
    for name, w in llama_tensors().items():
        if name != "lm_head.weight":
            t[prefix + name.removeprefix("model.")] = w
    for i in range(L):
        p = f"{prefix}layers.{i}."
        t[p + "pre_feedforward_layernorm.weight"] = np.zeros(D, np.float32)
        t[p + "post_feedforward_layernorm.weight"] = np.zeros(D, np.float32)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = np.zeros(H, np.float32)
            t[p + "self_attn.k_norm.weight"] = np.zeros(H, np.float32)
    if vision:
        t["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3, 2, 2), np.float32)
        t["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
        t["multi_modal_projector.mm_input_projection_weight"] = np.zeros((4, D), np.float32)
        t["multi_modal_projector.mm_soft_emb_norm.weight"] = np.zeros(4, np.float32)
    return t


def test_new_families_load(tmp_path):
    """The baselines of the cases below: Qwen3, Gemma 3 multimodal (vision tower skipped) and Gemma 2."""
    qwen3 = load_hf(write(tmp_path / "qwen3", QWEN3_CONFIG, qwen3_tensors()))
    assert qwen3.config.qk_norm and qwen3.params["layer_1"]["attn"]["k_norm"]["scale"].shape == (H,)
    gemma3 = load_hf(write(tmp_path / "gemma3", GEMMA3_CONFIG, gemma_tensors()))
    assert gemma3.config.tie_embeddings and gemma3.config.eos_ids == (1, 2) and gemma3.config.qk_norm
    assert gemma3.config.layer_types == ("sliding_attention", "full_attention")
    assert not any("vision" in str(path) for path, _ in jax.tree_util.tree_leaves_with_path(gemma3.params))
    gemma2 = load_hf(write(tmp_path / "gemma2", GEMMA2_CONFIG, gemma_tensors("model.", qk_norm=False, vision=False)))
    assert gemma2.config.post_norms and not gemma2.config.qk_norm and gemma2.config.attn_logit_softcap == 50.0
    # transformers 5's in-memory names: model.language_model.*, model.vision_tower.*, lm_head
    memory = gemma_tensors("model.language_model.", vision=False)
    memory["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
    load_hf(write(tmp_path / "memory", GEMMA3_CONFIG, memory))


def test_qwen3_missing_q_norm(tmp_path, no_tensor_reads):
    tensors = qwen3_tensors()
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_norm\.weight' is missing"):
        load_hf(write(tmp_path, QWEN3_CONFIG, tensors))


def test_gemma3_missing_q_norm(tmp_path, no_tensor_reads):
    """Named as the checkpoint spells it, under its multimodal prefix."""
    tensors = gemma_tensors()
    del tensors["language_model.model.layers.0.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match=r"'language_model\.model\.layers\.0\.self_attn\.q_norm\.weight' is missing"):
        load_hf(write(tmp_path, GEMMA3_CONFIG, tensors))


def test_qwen3_k_norm_wrong_shape(tmp_path, no_tensor_reads):
    tensors = qwen3_tensors()
    tensors["model.layers.0.self_attn.k_norm.weight"] = np.ones(D, np.float32)  # over the model width, not a head
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_norm\.weight'.*shape \[16\].*"
                                         r"\[H\] = \[8\]"):
        load_hf(write(tmp_path, QWEN3_CONFIG, tensors))


def test_gemma_norm_wrong_shape(tmp_path, no_tensor_reads):
    tensors = gemma_tensors()
    tensors["language_model.model.layers.1.pre_feedforward_layernorm.weight"] = np.zeros(D + 2, np.float32)
    with pytest.raises(ValueError, match=r"'language_model\.model\.layers\.1\.pre_feedforward_layernorm\.weight'"
                                         r".*shape \[18\].*\[D\] = \[16\]"):
        load_hf(write(tmp_path, GEMMA3_CONFIG, tensors))


def test_gemma3_untied_head_under_its_prefix(tmp_path, no_tensor_reads):
    with pytest.raises(ValueError, match=r"'language_model\.lm_head\.weight' is missing"):
        load_hf(write(tmp_path, dict(GEMMA3_CONFIG, tie_word_embeddings=False), gemma_tensors()))


@pytest.mark.parametrize("extra", ["audio_tower.conv.weight", "language_model.model.layers.0.self_attn.q_proj.bias",
                                   "model.multi_modal_projector_v2.weight", "vision_tower_extra.weight"])
def test_gemma3_only_vision_and_projector_are_skipped(tmp_path, no_tensor_reads, extra):
    tensors = gemma_tensors()
    tensors[extra] = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=rf"'{extra}'.*not used"):
        load_hf(write(tmp_path, GEMMA3_CONFIG, tensors))


def test_gemma3_mixed_naming_refused(tmp_path, no_tensor_reads):
    tensors = gemma_tensors()
    tensors["model.language_model.norm.weight"] = tensors.pop("language_model.model.norm.weight")
    with pytest.raises(ValueError, match="under both 'language_model.model.' and 'model.language_model.'"):
        load_hf(write(tmp_path, GEMMA3_CONFIG, tensors))


def test_gemma2_with_q_norm_is_unexpected(tmp_path, no_tensor_reads):
    """Gemma 2 has no q/k norms: a checkpoint holding them is not a Gemma 2 one."""
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_norm\.weight'.*not used"):
        load_hf(write(tmp_path, GEMMA2_CONFIG, gemma_tensors("model.", vision=False)))


def gemma3_text(**changes):
    return dict(GEMMA3_CONFIG, text_config=dict(GEMMA3_TEXT, **changes))


@pytest.mark.parametrize("config,field", [
    (gemma3_text(use_bidirectional_attention=True), "text_config.use_bidirectional_attention"),
    (gemma3_text(hidden_activation="gelu"), "text_config.hidden_activation"),
    (gemma3_text(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                      sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
     r"text_config.rope_parameters.sliding_attention.rope_type"),
    (gemma3_text(rope_parameters=dict(rope_type="default", rope_theta=1e6)), "text_config.rope_parameters"),
    (gemma3_text(rope_scaling=dict(rope_type="dynamic", factor=2.0)),
     "text_config.rope_parameters.full_attention.rope_type"),
    (gemma3_text(rope_scaling=dict(rope_type="linear")), "text_config.rope_parameters.full_attention.factor"),
    (gemma3_text(sliding_window=None), "text_config.sliding_window"),
    (gemma3_text(layer_types=["sliding_attention"]), "text_config.layer_types"),
    (gemma3_text(num_hidden_layers=10 ** 6), "text_config.num_hidden_layers"),
    (dict(GEMMA3_CONFIG, text_config=None), "text_config"),
    (dict(GEMMA2_CONFIG, attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(GEMMA2_CONFIG, query_pre_attn_scalar="big"), "query_pre_attn_scalar"),
    (dict(QWEN3_CONFIG, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
     "rope_parameters.rope_type"),
    (dict(QWEN3_CONFIG, use_sliding_window=False, sliding_window=4,
          layer_types=["full_attention", "sliding_attention"]), "layer_types"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_new_family_config_errors(config, field):
    """Options jaxkv cannot reproduce, and malformed fields, are refused naming the field (nested ones with their
    text_config. path)."""
    with pytest.raises(ValueError, match=rf"config\.json: field '{field}'"):
        config_from_hf(config, source="config.json")
