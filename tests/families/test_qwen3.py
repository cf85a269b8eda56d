"""Qwen3 checkpoints: tiny random transformers Qwen3ForCausalLM models, saved with `save_pretrained` and loaded with
`jaxkv.load`, give transformers' logits (float32, atol 1e-4) and its greedy tokens, single prompt and a left-padded
ragged batch. Qwen3 is Llama plus an RMS norm over each query and key head (q_norm / k_norm, random here so that
skipping or misplacing them fails), an explicit head_dim, an optional bias on q/k/v/o, and sliding attention on
the layers >= max_window_layers when use_sliding_window is set (a mix of sliding and full layers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf  # noqa: E402
from jaxkv.config import YarnScaling  # noqa: E402
from helpers.hf import (ATOL, BOS, EOS, MIN_MARGIN, NEW_TOKENS, PAD, assert_clear_margins,  # noqa: E402
                        check_speculative_greedy, greedy_cases, hf_greedy, hf_logits, per_row, saved_and_loaded)

VOCAB, WINDOW = 128, 8
# The seeds below are chosen so that no greedy step of the reference output comes near a tie (MIN_MARGIN).
# Every prompt is longer than the window of 8, so each sliding layer's ring wraps during the prompt already.
SINGLE = [[17, 3, 99, 41, 8, 110, 23, 64, 5, 77, 120, 31]]
RAGGED = [[44, 9, 101, 2, 61, 70, 13, 87, 20, 6], [7, 88, 19, 100, 33, 52, 101, 4, 66, 29, 115, 11, 93, 40, 72, 3, 58],
          [12, 5, 70, 103, 38, 26, 9, 81, 57, 90, 14, 122, 36]]

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.25,
            rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)

# name -> (kwargs, seed). Seeds: ones whose reference generations are varied and far from near-ties
# (`assert_clear_margins`; the smallest top-2 gap over all steps is 0.02 for both).
CASES = {
    # head_dim 32 != hidden / heads, attention_bias on q, k, v and o, YaRN, untied head, full attention
    "qwen3-bias-yarn": (dict(BASE, attention_bias=True, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                  original_max_position_embeddings=64)), 3),
    # layers 2 and 3 slide (max_window_layers=2), 0 and 1 see everything; tied head
    "qwen3-sliding": (dict(BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                           tie_word_embeddings=True), 1),
}


def build_hf(kwargs: dict, seed: int):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**kwargs),
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):  # transformers starts them at 1: random, so a misplaced norm shows
                p.copy_(torch.randn(p.shape) * 0.5 + 1.0)
            elif name.endswith(".bias"):  # and at 0
                p.copy_(torch.randn(p.shape) * 0.25)
    hf.generation_config.eos_token_id = None  # see helpers.hf's build_hf
    return hf


loaded = saved_and_loaded(build_hf, CASES)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    return (request.param, *loaded(request.param, tmp_path_factory))


def test_config_mapping(pair):
    name, _, model, _ = pair
    cfg = model.config
    assert cfg.qk_norm and cfg.norm_kind == "rmsnorm" and cfg.ffn_kind == "swiglu" and cfg.head_dim == 32
    assert not cfg.post_norms and cfg.embed_scale is None and cfg.eos_ids == (EOS,)
    if name == "qwen3-bias-yarn":
        assert cfg.qkv_bias and cfg.out_bias and not cfg.tie_embeddings
        assert cfg.rope_scaling == YarnScaling(factor=4.0, original_max_positions=64)
        assert cfg.sliding_window is None and cfg.layer_types is None
    else:
        assert not cfg.qkv_bias and not cfg.out_bias and cfg.tie_embeddings and cfg.sliding_window == WINDOW
        assert cfg.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2


def test_params_have_the_decoder_layout(pair):
    name, hf, model, _ = pair
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(jaxkv.Decoder(model.config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]
    got = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(expected)
    assert sum(a.size for a in jax.tree_util.tree_leaves(model.params)) == model.config.param_count()
    attn = hf.model.layers[2].self_attn
    np.testing.assert_array_equal(model.params["layer_2"]["attn"]["k_norm"]["scale"], attn.k_norm.weight.detach())


def test_logits_match(pair):
    name, hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 30))  # 30 > window: the sliding layers slide
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0, err_msg=name)


def test_greedy_generation_is_token_identical(pair):
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    name, hf, model, _ = pair
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        expected = hf_greedy(hf, prompts)
        assert_clear_margins(hf, prompts, expected, name, MIN_MARGIN)
        got = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
        assert got == per_row(expected, batch), name


def test_paged_samples_are_token_identical_to_transformers(tmp_path_factory):
    """The paged cache (n > 1) over mixed sliding and full layers: 2 greedy samples of each ragged prompt equal
    transformers' greedy output; page size 5 divides none of the prompt lengths."""
    hf, model, _ = loaded("qwen3-sliding", tmp_path_factory)
    expected = hf_greedy(hf, RAGGED)
    got = jaxkv.generate(model, RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[], n=2, page_size=5).tokens
    assert got == [row for row in expected for _ in range(2)]


# name -> config changes that undo one mapped feature on jaxkv's side only (same params).
FEATURES = {
    "qwen3-bias-yarn": dict(yarn=dict(rope_scaling=None)),
    "qwen3-sliding": dict(no_window=dict(layer_types=None, sliding_window=None),
                          every_layer_sliding=dict(layer_types=None)),
}


@pytest.mark.parametrize("name,feature", [(n, f) for n in FEATURES for f in FEATURES[n]])
def test_each_feature_matters(tmp_path_factory, name, feature):
    """The parity above would catch each feature mapped wrong: without it jaxkv's logits move well past ATOL."""
    hf, model, _ = loaded(name, tmp_path_factory)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 30))
    ref = hf_logits(hf, tokens)
    changed = jaxkv.Model(model.config.replace(**FEATURES[name][feature]), model.params)
    assert np.abs(np.asarray(jaxkv.logits(changed, tokens)) - ref).max() > 1e-2


def test_sliding_layers_from_layer_types_or_max_window_layers():
    """transformers 5.24 slides the layers >= max_window_layers (use_sliding_window only) unless layer_types says
    otherwise; without use_sliding_window nothing slides, whatever sliding_window says."""
    common = dict(architectures=["Qwen3ForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    off = config_from_hf(dict(common, use_sliding_window=False, sliding_window=8), source="config.json")
    assert (off.sliding_window, off.layer_types, off.head_dim) == (None, None, 128)  # Qwen3Config's head_dim
    every = config_from_hf(dict(common, use_sliding_window=True, sliding_window=8, max_window_layers=0),
                           source="config.json")
    assert (every.sliding_window, every.layer_types) == (8, None)
    beyond = config_from_hf(dict(common, use_sliding_window=True, sliding_window=8), source="config.json")
    assert (beyond.sliding_window, beyond.layer_types) == (None, None)  # default max_window_layers 28 > 4 layers
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    listed = config_from_hf(dict(common, use_sliding_window=True, sliding_window=8, layer_types=types),
                            source="config.json")
    assert (listed.sliding_window, listed.layer_types) == (8, tuple(types))


def test_speculative_greedy_equals_transformers(tmp_path_factory):
    """q/k norms and Qwen3's sliding layers (max_window_layers) under speculation."""
    hf, model, _ = loaded("qwen3-sliding", tmp_path_factory)
    check_speculative_greedy(model, hf_greedy(hf, RAGGED), "qwen3-sliding", RAGGED)
