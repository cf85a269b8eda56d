"""Parity with transformers for the Llama-style families (Llama, Mistral, Qwen2: jaxkv.families.llama) and GPT-2:
tiny random HF models, saved as safetensors and loaded with `load_hf`, must give the same logits (float32, atol
1e-4) and token-identical greedy generations, single prompt and ragged batch.

Each HF model is built once per module (CPU, float32, seeded). transformers runs with eager attention and with
eos disabled (so it never stops or suppresses a token early); jaxkv runs with stop_tokens=[] (helpers.hf).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf, load_hf  # noqa: E402

# The harness (helpers.hf): the prompts, build_hf, hf_logits, hf_greedy, and the parity test bodies the other
# families' files run on their own models too.
from helpers.hf import (ATOL, BOS, EOS, LLAMA_LIKE, MIN_MARGIN, NEW_TOKENS, PAD, RAGGED, SINGLE, VOCAB,  # noqa: E402
                        assert_clear_margins, build_hf, check_greedy_generation_is_token_identical, check_logits_match,
                        check_speculative_greedy, hf_greedy, hf_logits, saved_and_loaded)
from helpers.models import left_pad  # noqa: E402

# name -> (config class, config kwargs). Each covers one mapping feature the others do not.
CASES = {
    "llama-tied": ("LlamaConfig", dict(LLAMA_LIKE, tie_word_embeddings=True)),
    # untied head, q/k/v/o and MLP biases, head_dim != hidden / heads, Llama-3 rope scaling in 5.x's form
    "llama-untied-llama3": ("LlamaConfig", dict(
        LLAMA_LIKE, tie_word_embeddings=False, attention_bias=True, mlp_bias=True, head_dim=24,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    "mistral-window8": ("MistralConfig", dict(LLAMA_LIKE, sliding_window=8)),
    # attention matrices of 2048 x 2048 >= OUT_IN_ELEMENTS: stored [out, in]; the 2048 x 512 FFN [in, out]
    "llama-wide-mixed-layout": ("LlamaConfig", dict(LLAMA_LIKE, hidden_size=2048, intermediate_size=512,
                                                    num_hidden_layers=1, num_attention_heads=8,
                                                    initializer_range=0.03)),
    # Qwen2's q/k/v biases, and use_sliding_window with max_window_layers=2 of 4: the first two layers attend over
    # everything, the last two over a window of 8 (per-layer types; test_qwen2_sliding_layers_after_max_window_layers)
    "qwen2-bias": ("Qwen2Config", dict(LLAMA_LIKE, num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                       max_window_layers=2)),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                initializer_range=0.25, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)),
}


# Each case built, saved and loaded once per module (the Mistral ring tests reuse the parity tests' model).
loaded = saved_and_loaded(build_hf, CASES)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, HF model, jaxkv model loaded from its save_pretrained directory, that directory)."""
    return (request.param, *loaded(request.param, tmp_path_factory))


def test_logits_match(pair):
    check_logits_match(pair)


# Greedy tokens for each family and feature that decoding reads differently. Left out as covered: llama-tied (its
# layers are llama-untied-llama3's; the tied head is read as in gpt2's greedy run, and its mapping is in its logits)
# and llama-wide-mixed-layout (its [out, in] weights go through linear()'s einsum in every call at batch 4, prefill
# and decode alike: its logits test; only a batch-1 decode step takes the w @ x branch, which this test never ran).
@pytest.mark.parametrize("pair", ["gpt2", "llama-untied-llama3", "mistral-window8", "qwen2-bias"], indirect=True)
def test_greedy_generation_is_token_identical(pair):
    check_greedy_generation_is_token_identical(pair)


# The paged cache for each family here: Llama (untied head, biases, head_dim 24, llama3 rope), Mistral (the window)
# and GPT-2 (learned positions). Left out as covered: llama-tied (the same Llama layers as llama-untied-llama3; the
# tied head is gpt2's), qwen2-bias (its paged run is test_qwen2_sliding_layers_after_max_window_layers) and
# llama-wide-mixed-layout (its [out, in] weights are read by the same projections in every cache: its logits test).
@pytest.mark.parametrize("pair", ["gpt2", "llama-untied-llama3", "mistral-window8"], indirect=True)
def test_paged_samples_are_token_identical_to_transformers(pair):
    """The paged cache (issue 13) for every family: 2 greedy samples of each ragged prompt, prefilled once and
    forked, equal transformers' greedy output; page size 5 divides none of the prompt lengths."""
    name, hf, model, _ = pair
    expected = hf_greedy(hf, RAGGED)
    got = jaxkv.generate(model, RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[], n=2, page_size=5).tokens
    assert got == [row for row in expected for _ in range(2)], name


def test_params_have_the_decoder_layout(pair):
    """Same tree, shapes and dtypes as the Flax decoder's own init, and the config records the params' dtype."""
    _, _, model, _ = pair
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(jaxkv.Decoder(model.config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]
    got = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(expected)
    assert model.config.dtype == "float32" and model.config.eos_ids == (EOS,)
    from jaxkv.model import in_out_names

    wide = model.config.d_model * model.config.n_heads * model.config.head_dim >= jaxkv.layers.OUT_IN_ELEMENTS
    assert ("wq" in in_out_names(model.config)) == (not wide)


def test_sliding_window_matters():
    """The window must change the logits at these lengths, or the Mistral cases would pass with it ignored."""
    hf = build_hf(*CASES["mistral-window8"])
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 40))
    ref = hf_logits(hf, tokens)
    hf.config.sliding_window = None  # read at forward time: the same weights, full causal attention
    assert np.abs(hf_logits(hf, tokens) - ref)[:, 8:].max() > 1e-2


# The single prompt runs as 3 copies (no row padded): the batch of the ragged case, so that both share the compiled
# decode step (and generate's program with the parity tests' batches of 4).
@pytest.mark.parametrize("prompts", [SINGLE * 3, RAGGED], ids=["single", "ragged"])
def test_mistral_ring_cache_matches_transformers_past_the_window(prompts, tmp_path_factory):
    """Mistral's cache is a ring of `window` (8) slots: positions wrap and old entries are overwritten. 64 greedy
    tokens equal transformers' (the sequence outgrows the window 8 times over), and every cached decode step's
    logits equal transformers' full forward pass over the sequence so far."""
    hf, model, _ = loaded("mistral-window8", tmp_path_factory)
    new = 64
    gen = jaxkv.generate(model, prompts, max_new_tokens=new, stop_tokens=[])
    assert gen.stats["cache_ring"] and gen.stats["cache_capacity"] == 8  # memory O(window), not O(sequence)
    expected = hf_greedy(hf, prompts, new)
    assert gen.tokens == expected

    # Step logits: prefill into an 8-slot ring, then feed the greedy tokens one by one.
    ids, start = left_pad(prompts, 16)  # both cases padded to 16 (generate's bucket): one compiled prefill
    T = ids.shape[1]
    logits, cache = jaxkv.prefill(model.params, ids, start, config=model.config,
                                  capacity=8, attention="xla", ring=True)
    for step in range(0, new, 9):  # every 9th step: positions at every offset of the ring
        while int(cache.length) < T + step:
            logits, cache = jaxkv.decode_step(model.params, jnp.asarray([row[int(cache.length) - T]
                                                                         for row in expected], jnp.int32),
                                              cache, config=model.config, attention="xla")
        for b, p in enumerate(prompts):
            full = hf_logits(hf, [p + expected[b][:step]])[0, -1]
            np.testing.assert_allclose(np.asarray(logits[b]), full, atol=ATOL, rtol=0, err_msg=f"step {step}, {b}")


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = build_hf(*CASES["llama-untied-llama3"])
    hf.save_pretrained(tmp_path / "one", safe_serialization=True)
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one, sharded = load_hf(tmp_path / "one"), load_hf(tmp_path / "sharded")
    assert one.config == sharded.config
    jax.tree_util.tree_map(np.testing.assert_array_equal, one.params, sharded.params)


def test_qwen2_sliding_window_on_every_layer(tmp_path):
    """use_sliding_window with max_window_layers=0 slides every layer: one jaxkv window, same logits."""
    hf = build_hf("Qwen2Config", dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf(tmp_path)
    assert model.config.sliding_window == 8
    tokens = np.random.default_rng(2).integers(0, VOCAB, (1, 30))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_qwen2_sliding_layers_after_max_window_layers(tmp_path_factory):
    """use_sliding_window with max_window_layers=2 of 4 (the qwen2-bias case): the first two layers attend over
    everything, the last two over a window of 8 (per-layer types); 24 greedy tokens (ragged, contiguous and paged)
    == transformers', each decided by a clear margin. Its logits: test_logits_match[qwen2-bias]."""
    hf, model, _ = loaded("qwen2-bias", tmp_path_factory)
    assert model.config.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    expected = hf_greedy(hf, RAGGED, 24)
    assert_clear_margins(hf, RAGGED, expected, "qwen2-mixed", MIN_MARGIN)
    assert jaxkv.generate(model, RAGGED, max_new_tokens=24, stop_tokens=[]).tokens == expected
    paged = jaxkv.generate(model, RAGGED, max_new_tokens=24, stop_tokens=[], n=2, page_size=5).tokens
    assert paged == [row for row in expected for _ in range(2)]


def test_dtype_cast_and_half_precision_checkpoints(tmp_path):
    hf = build_hf(*CASES["llama-tied"])
    hf.save_pretrained(tmp_path / "f32", safe_serialization=True)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    f32 = load_hf(tmp_path / "f32")
    for directory, dtype, expected in [("f32", "bfloat16", "bfloat16"), ("f32", "float16", "float16"),
                                       ("bf16", None, "bfloat16"), ("bf16", "float32", "float32")]:
        model = load_hf(tmp_path / directory, dtype=dtype)
        assert model.config.dtype == expected
        assert {a.dtype for a in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(expected)}
        if directory == "bf16":  # the bf16 checkpoint holds exactly the f32 weights rounded to bfloat16
            ref = jax.tree_util.tree_map(lambda a: np.asarray(a.astype(jnp.bfloat16).astype(expected)), f32.params)
            jax.tree_util.tree_map(np.testing.assert_array_equal, ref, model.params)


def test_transformers_4_rope_fields_give_the_same_config():
    """transformers 4.x writes rope_theta and rope_scaling at the top level; 5.x nests them in rope_parameters."""
    common = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    v5 = config_from_hf(dict(common, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5)), source="v5")
    v4 = config_from_hf(dict(common, rope_theta=5e5, rope_scaling=dict(scaling, rope_type="llama3")), source="v4")
    v4_type = config_from_hf(dict(common, rope_theta=5e5, rope_scaling=dict(scaling, type="llama3")), source="v4")
    assert v5 == v4 == v4_type
    assert v5.rope_scaling == jaxkv.RopeScaling(8.0, 1.0, 4.0, 32) and v5.rope_theta == 5e5


# A sliding window (under speculation its ring holds window + k slots) and learned positions.
@pytest.mark.parametrize("pair", ["mistral-window8", "gpt2"], indirect=True)
def test_speculative_greedy_equals_transformers(pair):
    name, hf, model, _ = pair
    check_speculative_greedy(model, hf_greedy(hf, RAGGED), name)
