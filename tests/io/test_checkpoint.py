"""jaxkv.save / jaxkv.load: bit-exact round trips, and refusal of mismatched or damaged checkpoints."""

import json
import shutil

import jax
import numpy as np
import pytest

import jaxkv
from helpers.models import CONFIGS, model_for, placed_like
from helpers.text import byte_tokenizer


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for (_, x), (_, y) in zip(la, lb))


def test_format_1_checkpoints_load_in_the_in_out_layout(tmp_path):
    """Format 1 stored weight matrices [out, in]; they load transposed to the decoder's [in, out], bit-exactly, and
    decode the same tokens (the bundled tiny model is such a checkpoint)."""
    import orbax.checkpoint as ocp

    from jaxkv.model import to_out_in

    model = model_for("gqa")
    directory = tmp_path / "v1"
    directory.mkdir()
    config = json.loads(json.dumps(jaxkv.checkpoint.config_to_dict(model.config)))
    (directory / "jaxkv_config.json").write_text(json.dumps({**config, "format_version": 1}))
    old = to_out_in(model.params, model.config)
    assert old["layer_0"]["attn"]["wq"].shape == (4, 16, 64) and old["layer_0"]["mlp"]["w_down"].shape == (64, 96)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", old)
    checkpointer.wait_until_finished()
    loaded = jaxkv.load(directory)
    assert leaves_equal(loaded.params, model.params)
    prompts = [[5, 9, 2, 77]]
    assert jaxkv.generate(loaded, prompts, max_new_tokens=6).tokens == jaxkv.generate(
        placed_like(model, loaded), prompts, max_new_tokens=6).tokens
    with pytest.raises(ValueError, match="unsupported format_version 3"):
        (directory / "jaxkv_config.json").write_text(json.dumps({**config, "format_version": 3}))
        jaxkv.load(directory)


@pytest.mark.parametrize("name", ["gqa-wide-heads", "learned"])
def test_round_trip_is_bit_exact(name, tmp_path):
    model = jaxkv.Model(CONFIGS[name], model_for(name).params, byte_tokenizer())
    jaxkv.save(model, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.config == model.config
    assert leaves_equal(loaded.params, model.params)
    assert loaded.tokenizer.to_str() == model.tokenizer.to_str()


def test_bfloat16_round_trip_and_cast(tmp_path):
    model = jaxkv.checkpoint.cast(model_for("gqa"), "bfloat16")
    jaxkv.save(model, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.config.dtype == "bfloat16" and leaves_equal(loaded.params, model.params)
    as_f32 = jaxkv.load(tmp_path / "m", dtype="float32")
    assert as_f32.config.dtype == "float32"
    assert all(leaf.dtype == np.float32 for leaf in jax.tree_util.tree_leaves(as_f32.params))


def test_save_refuses_to_overwrite(tmp_path):
    jaxkv.save(model_for("mqa"), tmp_path / "m")
    with pytest.raises(ValueError, match="not empty"):
        jaxkv.save(model_for("mqa"), tmp_path / "m")


def test_restore_refuses_a_config_that_does_not_match_the_arrays(tmp_path):
    jaxkv.save(model_for("gqa"), tmp_path / "m")
    path = tmp_path / "m" / "jaxkv_config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "n_kv_heads": 4}))
    with pytest.raises(ValueError, match=r"parameter \['layer_0'\]\['attn'\]\['wk'\] is stored as float32\[64, 2, 16\]"):
        jaxkv.load(tmp_path / "m")
    path.write_text(json.dumps({**data, "dtype": "bfloat16"}))  # stored float32: refuse, never cast silently
    with pytest.raises(ValueError, match="stored as float32.*needs bfloat16"):
        jaxkv.load(tmp_path / "m")
    path.write_text(json.dumps({**data, "qkv_bias": True}))
    with pytest.raises(ValueError, match="missing parameter"):
        jaxkv.load(tmp_path / "m")
    path.write_text(json.dumps({**data, "n_wheels": 4}))
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['n_wheels'\]"):
        jaxkv.load(tmp_path / "m")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        jaxkv.load(tmp_path / "m")


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        jaxkv.load(tmp_path / "nowhere")
    jaxkv.save(model_for("mqa"), tmp_path / "m")
    shutil.rmtree(tmp_path / "m" / "params")
    with pytest.raises(FileNotFoundError, match="missing parameter checkpoint"):
        jaxkv.load(tmp_path / "m")
    with pytest.raises(ValueError, match="dtype must be one of"):
        jaxkv.load(tmp_path / "m", dtype="float64")


def test_text_prompts_and_generation_text(tmp_path):
    model = jaxkv.Model(CONFIGS["learned"].replace(vocab_size=256), None, byte_tokenizer())
    model.params = jaxkv.Model.random(model.config, seed=2).params
    out = jaxkv.generate(model, ["héllo", "a"], max_new_tokens=5, stop_tokens=[])
    ids = [list("héllo".encode()), list(b"a")]
    by_ids = jaxkv.generate(model, ids, max_new_tokens=5, stop_tokens=[])
    assert out.tokens == by_ids.tokens
    assert out.text == [bytes(t).decode("utf-8", errors="replace") for t in out.tokens]
    single = jaxkv.generate(model, "héllo", max_new_tokens=5, stop_tokens=[])
    assert single.tokens == out.tokens[:1]
    with pytest.raises(ValueError, match="need a model with a tokenizer"):
        jaxkv.generate(model_for("gqa"), ["hello"], max_new_tokens=2)


def test_cast_follows_the_dtype_layout(tmp_path):
    """Wide matrices are [out, in] in float32 but [in, out] in 16-bit dtypes (`layers.stored_out_in`): casting and
    loading with `dtype=` re-lay them out, value for value, and the cast model decodes."""
    from jaxkv.model import to_out_in

    config = jaxkv.Config(vocab_size=64, d_model=2048, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=256,
                          ffn_dim=1024)
    model = jaxkv.Model.random(config, seed=0)
    assert "wq" not in jaxkv.layers.in_out_names(config)
    assert "wq" in jaxkv.layers.in_out_names(config.replace(dtype="bfloat16"))
    half = jaxkv.checkpoint.cast(model, "bfloat16")
    assert half.params["layer_0"]["attn"]["wq"].shape == (2048, 8, 256)
    rounded = jax.tree_util.tree_map(lambda a: np.asarray(a).astype(jax.numpy.bfloat16), to_out_in(model.params, config))
    assert leaves_equal(to_out_in(half.params, half.config), rounded)
    back = jaxkv.checkpoint.cast(half, "float32")
    assert back.params["layer_0"]["attn"]["wq"].shape == (8, 256, 2048)
    jaxkv.save(model, tmp_path / "wide")
    loaded = jaxkv.load(tmp_path / "wide", dtype="bfloat16")
    assert leaves_equal(loaded.params, half.params)
    assert jaxkv.generate(loaded, [[1, 2, 3]], max_new_tokens=3).tokens == jaxkv.generate(
        placed_like(half, loaded), [[1, 2, 3]], max_new_tokens=3).tokens


def test_16_bit_weight_products_accumulate_in_float32():
    """Every product with a bfloat16 weight asks for a float32 result (rounded to bfloat16 afterwards, as PyTorch's
    bfloat16 matmul does): XLA:CPU's bfloat16 kernel is taken only then, 3x faster at batch 8 than a product with a
    bfloat16 result (docs/design/benchmarks.md, "bfloat16")."""
    half = jaxkv.checkpoint.cast(model_for("gqa"), "bfloat16")
    tokens = jax.numpy.zeros((2, 1), jax.numpy.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: jaxkv.Decoder(half.config).apply({"params": p}, t, t))(half.params, tokens)

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for sub in jax.core.subjaxprs(eqn.params) if hasattr(jax.core, "subjaxprs") else ():
                yield from dots(sub)

    H = half.config.head_dim  # the attention's [H, H] identity product (it materializes q) is not a weight's
    found = [e for e in dots(jaxpr.jaxpr) if any(v.aval.dtype == jax.numpy.bfloat16 for v in e.invars)
             and e.invars[1].aval.shape != (H, H)]
    assert len(found) >= 7 * half.config.n_layers
    assert all(e.params["preferred_element_type"] == jax.numpy.float32 for e in found)


def test_hugging_face_load_in_bfloat16_lays_out_for_bfloat16(tmp_path):
    """A wide Llama saved by transformers in float32 loads with dtype="bfloat16" in the bfloat16 layout (every
    projection [in, out]), equal to loading in float32 and casting."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=2048, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    hf.save_pretrained(tmp_path / "wide")
    half = jaxkv.load(tmp_path / "wide", dtype="bfloat16")
    assert half.params["layer_0"]["attn"]["wq"].shape == (2048, 8, 256)
    assert leaves_equal(half.params, jaxkv.checkpoint.cast(jaxkv.load(tmp_path / "wide"), "bfloat16").params)


def test_mla_moe_model_saves_loads_and_casts(tmp_path):
    """An MLA + mixture-of-experts model round-trips through jaxkv.save/load bit-exactly (its nested Mla and
    MoeConfig included), and a cast to bfloat16 keeps the router in float32 (as transformers does) and lays the
    experts out for the new dtype."""
    from jaxkv.config import Mla, MoeConfig
    from jaxkv.model import weight_layout

    config = jaxkv.Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_dim=48,
                          mla=Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                          moe=MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=16, n_shared_experts=1,
                                        first_dense_layers=1, scoring="sigmoid", topk_method="noaux_tc"))
    model = jaxkv.Model.random(config, seed=0)
    jaxkv.save(model, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.config == config and leaves_equal(loaded.params, model.params)
    prompts = [[3, 4, 5]]
    assert jaxkv.generate(loaded, prompts, max_new_tokens=4).tokens == jaxkv.generate(
        placed_like(model, loaded), prompts, max_new_tokens=4).tokens
    half = jaxkv.checkpoint.cast(model, "bfloat16")
    mlp = half.params["layer_1"]["mlp"]
    assert mlp["router"].dtype == jax.numpy.float32 and mlp["we_gate"].dtype == jax.numpy.bfloat16
    assert weight_layout(half.config)[0] >= {"we_gate", "we_up", "we_down"}
    back = jaxkv.checkpoint.cast(half, "float32")
    assert jax.tree_util.tree_map(lambda a: a.shape, back.params) == jax.tree_util.tree_map(lambda a: a.shape,
                                                                                             model.params)


def test_moe_dense_layers_pick_the_mlp_per_layer_and_round_trip(tmp_path):
    """MoeConfig.dense_layers (Qwen3-MoE's mlp_only_layers / decoder_sparse_step): a dense MLP on those layers,
    experts on the others, beside first_dense_layers; the config and params round-trip through save/load (JSON
    lists back to a tuple)."""
    from jaxkv.config import MoeConfig

    moe = MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=16, first_dense_layers=1, dense_layers=(2,))
    config = jaxkv.Config(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, moe=moe)
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    model = jaxkv.Model.random(config, seed=0)
    assert ["router" in model.params[f"layer_{i}"]["mlp"] for i in range(4)] == [False, True, False, True]
    jaxkv.save(model, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.config == config and leaves_equal(loaded.params, model.params)
    for bad in [(2, 1), (1, 1), (-1,), [2]]:
        with pytest.raises(ValueError, match="moe.dense_layers"):
            MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=16, dense_layers=bad)
