"""Gemma 2 / Gemma 3 checkpoints: tiny random transformers models (Gemma2ForCausalLM, Gemma3ForCausalLM and
Gemma3ForConditionalGeneration with a tiny vision tower), saved with `save_pretrained` and loaded with `jaxkv.load`,
give transformers' logits (float32, atol 1e-4) and its greedy tokens, single prompt and a left-padded ragged batch,
with every prompt longer than the sliding window (so the sliding layers' rings wrap).

transformers initializes Gemma's zero-centred norm weights to 0; here every norm weight is random (about 1 +- 0.5:
the model scales by about 2), so treating a weight w as the scale (rather than 1 + w) fails. Each mapped feature is
also checked to matter: turning it off on jaxkv's side must move the logits well past the tolerance, as must
turning on the soft caps transformers 5.24 ignores for Gemma 3 (`test_each_feature_matters`).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf  # noqa: E402
from jaxkv.config import LinearScaling  # noqa: E402
from helpers.hf import (BOS, EOS, MIN_MARGIN, NEW_TOKENS, PAD, assert_clear_margins,  # noqa: E402
                        check_speculative_greedy, greedy_cases, hf_greedy, hf_logits, per_row, saved_and_loaded)
from helpers.tolerances import atol  # noqa: E402

# Whole-sequence logits against transformers: twice the other families' tolerance (why: helpers.tolerances).
GEMMA_LOGITS_ATOL = atol("transformers logits, gemma")

VOCAB, WINDOW = 128, 8
# The seeds below are chosen so that no greedy step of the reference output comes near a tie (MIN_MARGIN).
NORM_MEAN, NORM_STD, EMBED_SCALE = 1.0, 0.5, 0.5
# Every prompt is longer than the window of 8, so each sliding layer's ring wraps during the prompt already.
SINGLE = [[17, 3, 99, 41, 8, 110, 23, 64, 5, 77, 120, 31]]
# At most 16 tokens: the single prompt and the ragged batch pad to one prefill length (one compiled prefill).
RAGGED = [[44, 9, 101, 2, 61, 70, 13, 87, 20, 6], [7, 88, 19, 100, 33, 52, 101, 4, 66, 29, 115, 11, 93, 40, 72, 3],
          [12, 5, 70, 103, 38, 26, 9, 81, 57, 90, 14, 122, 36]]

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, initializer_range=0.25, rms_norm_eps=1e-6, sliding_window=WINDOW,
            # != head_dim, so a 1/sqrt(head_dim) scale fails
            query_pre_attn_scalar=24, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)

# name -> (config class, kwargs, seed). Each covers mapping features the others do not. Seeds: ones whose
# reference generations are varied and free of near-ties (`assert_clear_margins`; smallest top-2 gap over all steps:
# 0.003, 0.003, 0.013).
CASES = {
    # alternating layers (transformers' default), both soft caps set to act on these logits, tied head
    "gemma2": ("Gemma2Config", dict(TEXT, attn_logit_softcapping=20.0, final_logit_softcapping=10.0), 3),
    # q/k norms, local and global rope bases with linear scaling on the global layers (as Gemma 3 4B+), a mixed
    # layer pattern, a final soft cap, an untied head. attn_logit_softcapping is set, yet transformers 5.24's
    # Gemma 3 never applies it (nor does jaxkv's mapping): parity here pins that down.
    "gemma3-text": ("Gemma3TextConfig", dict(TEXT, layer_types=MIXED, final_logit_softcapping=10.0,
                                             attn_logit_softcapping=5.0, tie_word_embeddings=False,
                                             rope_parameters=dict(
                                                 full_attention=dict(rope_type="linear", factor=8.0,
                                                                     rope_theta=100000.0),
                                                 sliding_attention=dict(rope_type="default", rope_theta=1000.0))), 3),
    # the multimodal model: a SigLIP tower and projector next to the language model, which jaxkv skips; tied head.
    # Its text config has a final soft cap, which Gemma3ForConditionalGeneration (unlike Gemma3ForCausalLM) never
    # applies in transformers 5.24, so jaxkv's mapping leaves it out.
    "gemma3-multimodal": ("Gemma3Config", dict(
        text_config=dict(TEXT, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                            "sliding_attention"], final_logit_softcapping=10.0),
        vision_config=VISION, mm_tokens_per_image=4, eos_token_id=EOS, pad_token_id=PAD,
        initializer_range=0.25), 1),  # the outer config's initializes every weight
}


def build_hf(config_class: str, kwargs: dict, seed: int):
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    if config_class == "Gemma3Config":
        hf = transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager")
    else:
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf = hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred: the model scales by 1 + w, here about 2 +- 0.5
                p.copy_(torch.randn(p.shape) * NORM_STD + NORM_MEAN)
            elif name.endswith("embed_tokens.weight"):
                # Gemma multiplies embeddings by sqrt(D) = 8: at the weights' scale the token's own embedding would
                # swamp every layer's contribution and a tied head would just repeat the last token.
                p.mul_(EMBED_SCALE)
    # generate() fills unset options from the model's generation config: clear eos there too (test_hf_parity).
    hf.generation_config.eos_token_id = None
    return hf


loaded = saved_and_loaded(build_hf, CASES)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    return (request.param, *loaded(request.param, tmp_path_factory))


def test_config_mapping(pair):
    name, hf, model, _ = pair
    cfg = model.config
    assert (cfg.ffn_kind, cfg.norm_kind, cfg.post_norms, cfg.embed_scale) == ("geglu", "gemma_rmsnorm", True, 8.0)
    assert cfg.query_pre_attn_scalar == 24 and cfg.sliding_window == WINDOW and cfg.eos_ids == (EOS,)
    assert cfg.qk_norm == (name != "gemma2")
    if name == "gemma2":
        assert cfg.layer_types == ("sliding_attention", "full_attention") * 2  # transformers' default
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.rope_local_theta) == (20.0, 10.0, None)
        assert cfg.tie_embeddings and "lm_head" not in model.params
    elif name == "gemma3-text":
        assert cfg.layer_types == tuple(MIXED) and not cfg.tie_embeddings and "lm_head" in model.params
        assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e5, LinearScaling(8.0), 1e3)
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (None, 10.0)
    else:
        assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e6, None, 1e4)  # Gemma 3's defaults
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (None, None) and cfg.tie_embeddings


def test_params_have_the_decoder_layout(pair):
    """Same tree, shapes and dtypes as the Flax decoder's own init (nothing dropped or added: the vision tower of
    the multimodal checkpoint is not loaded), and the norm weights are the checkpoint's, zero-centred."""
    name, hf, model, _ = pair
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(jaxkv.Decoder(model.config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]
    got = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(expected)
    assert sum(a.size for a in jax.tree_util.tree_leaves(model.params)) == model.config.param_count()
    text = hf.model.language_model if name == "gemma3-multimodal" else hf.model
    layer = text.layers[1]
    for hf_norm, jx_norm in [(layer.input_layernorm, "attn_norm"), (layer.post_attention_layernorm, "post_attn_norm"),
                             (layer.pre_feedforward_layernorm, "mlp_norm"),
                             (layer.post_feedforward_layernorm, "post_mlp_norm")]:
        np.testing.assert_array_equal(model.params["layer_1"][jx_norm]["scale"], hf_norm.weight.detach().numpy())
    if name != "gemma2":
        np.testing.assert_array_equal(model.params["layer_1"]["attn"]["q_norm"]["scale"],
                                      layer.self_attn.q_norm.weight.detach().numpy())


def test_logits_match(pair):
    name, hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 30))  # 30 > window: the sliding layers slide
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=GEMMA_LOGITS_ATOL, rtol=0,
                               err_msg=name)


# Gemma 2 and Gemma 3: the multimodal checkpoint's language model decodes as gemma3-text's does (the same layers and
# caches); what its mapping adds (the vision tower skipped, the tied head, no final soft cap) is in its logits.
@pytest.mark.parametrize("pair", ["gemma2", "gemma3-text"], indirect=True)
def test_greedy_generation_is_token_identical(pair):
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    name, hf, model, _ = pair
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        expected = hf_greedy(hf, prompts)
        assert_clear_margins(hf, prompts, expected, name, MIN_MARGIN)
        gen = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[])
        assert gen.tokens == per_row(expected, batch), name


@pytest.mark.parametrize("name", ["gemma2", "gemma3-text"])  # the multimodal case's cache is gemma3-text's
def test_paged_samples_are_token_identical_to_transformers(tmp_path_factory, name):
    """The paged cache (n > 1): 2 greedy samples of each ragged prompt equal transformers' greedy output; page size
    5 divides none of the prompt lengths."""
    hf, model, _ = loaded(name, tmp_path_factory)
    expected = hf_greedy(hf, RAGGED)
    got = jaxkv.generate(model, RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[], n=2, page_size=5).tokens
    assert got == [row for row in expected for _ in range(2)], name


# name -> config changes on jaxkv's side only (same params) that undo one mapped feature, or apply a soft cap that
# transformers 5.24 leaves out for these Gemma 3 models (so parity above shows it is really left out).
FEATURES = {
    "gemma2": dict(norm=dict(norm_kind="rmsnorm"), embed_scale=dict(embed_scale=None),
                   attn_softcap=dict(attn_logit_softcap=None), final_softcap=dict(final_logit_softcap=None),
                   scale=dict(query_pre_attn_scalar=None), window=dict(layer_types=None, sliding_window=None),
                   every_layer_sliding=dict(layer_types=None)),
    "gemma3-text": dict(local_rope=dict(rope_local_theta=None), linear_rope=dict(rope_scaling=None),
                        final_softcap=dict(final_logit_softcap=None), qk_norm_kind=dict(norm_kind="rmsnorm"),
                        layer_types=dict(layer_types=("sliding_attention", "full_attention") * 2),
                        attn_softcap_ignored=dict(attn_logit_softcap=5.0)),
    "gemma3-multimodal": dict(final_softcap_ignored=dict(final_logit_softcap=10.0)),
}


@pytest.mark.parametrize("name,feature", [(n, f) for n in FEATURES for f in FEATURES[n]])
def test_each_feature_matters(tmp_path_factory, name, feature):
    """The parity above would catch each feature mapped wrong: without it jaxkv's logits move well past ATOL."""
    hf, model, _ = loaded(name, tmp_path_factory)
    # test_logits_match's tokens (2 x 30): the unchanged model's forward is its compiled one
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 30))
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(jaxkv.logits(model, tokens), ref, atol=GEMMA_LOGITS_ATOL, rtol=0)
    changed = jaxkv.Model(model.config.replace(**FEATURES[name][feature]), model.params)
    # Op by op: the same code as the jitted forward (its float32 results within ~1e-5 of it, far below 1e-2), but
    # each changed config would compile a forward of its own (~1.4 s each), where these ops compile once for all.
    with jax.disable_jit():
        moved = np.asarray(jaxkv.logits(changed, tokens))
    assert np.abs(moved - ref).max() > 1e-2


def test_multimodal_checkpoint_holds_the_vision_tower(tmp_path_factory):
    """The saved multimodal checkpoint really has vision and projector tensors beside the language model's (the
    ones the loader skips by name), under transformers 5.24's save_pretrained names."""
    _, _, directory = loaded("gemma3-multimodal", tmp_path_factory)
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]


def test_multimodal_in_memory_names_load_identically(tmp_path_factory, tmp_path):
    """transformers 5's own module names (model.language_model.*, model.vision_tower.*, lm_head), as a state_dict
    saved as is holds them, load to the same params as save_pretrained's names."""
    hf, model, _ = loaded("gemma3-multimodal", tmp_path_factory)
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: not saved
    assert any(k.startswith("model.vision_tower.") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    other = jaxkv.load(tmp_path)
    assert other.config == model.config
    jax.tree_util.tree_map(np.testing.assert_array_equal, other.params, model.params)


# --- config.json as the releases write it -------------------------------------------------------------------------


def test_gemma3_release_config_uses_transformers_defaults():
    """Google's Gemma 3 4B config.json (transformers 4.50 layout) spells out few text fields: the rest are
    Gemma3TextConfig's defaults; rope_scaling applies to the global layers only; every 6th layer is global; eos
    comes from the outer config."""
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
          "image_token_index": 262144, "mm_tokens_per_image": 256,
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                          "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024},
          "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"}}
    cfg = config_from_hf(hf, source="config.json")
    assert (cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.max_positions) == (262208, 8, 4, 256,
                                                                                              131072)
    assert cfg.layer_types == tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                    for i in range(34))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e6, LinearScaling(8.0), 1e4)
    assert cfg.eos_ids == (1, 106) and cfg.tie_embeddings and cfg.sliding_window == 1024
    assert cfg.query_pre_attn_scalar == 256 and cfg.final_logit_softcap is None and cfg.qk_norm
    # transformers 4.x's rope fields: rope_theta and rope_local_base_freq
    legacy = dict(hf["text_config"], rope_theta=5e5, rope_local_base_freq=2e4, sliding_window_pattern=3)
    cfg = config_from_hf(dict(hf, text_config=legacy), source="config.json")
    assert (cfg.rope_theta, cfg.rope_local_theta) == (5e5, 2e4) and cfg.layer_types[:3] == (
        "sliding_attention", "sliding_attention", "full_attention")


def test_gemma2_release_config():
    """google/gemma-2-2b's config.json (transformers 4.42 layout): no layer_types (alternating, sliding first)."""
    hf = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
          "cache_implementation": "hybrid", "eos_token_id": [1, 107], "final_logit_softcapping": 30.0,
          "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
          "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
          "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
          "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
          "vocab_size": 256000}
    cfg = config_from_hf(hf, source="config.json")
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 13 and cfg.sliding_window == 4096
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert cfg.tie_embeddings and cfg.eos_ids == (1, 107) and cfg.rope_local_theta is None and not cfg.qk_norm
    assert cfg.embed_scale == 2304 ** 0.5 and cfg.head_dim == 256


def test_speculative_greedy_equals_transformers(tmp_path_factory):
    """Mixed sliding and full layers (rings of window + k beside plain layers), soft-capped logits."""
    hf, model, _ = loaded("gemma3-text", tmp_path_factory)
    check_speculative_greedy(model, hf_greedy(hf, RAGGED), "gemma3-text", RAGGED)
