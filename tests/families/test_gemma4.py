"""Gemma 4 checkpoints: tiny random transformers models (Gemma4ForCausalLM, and Gemma4ForConditionalGeneration with
a tiny vision tower), saved with `save_pretrained` and loaded with `jaxkv.load`, give transformers' logits (float32,
atol 1e-4) and its greedy tokens, single prompt and a left-padded ragged batch, every prompt longer than the sliding
window (so the sliding layers' rings wrap).

The text model has everything Gemma 4 adds to Gemma 3 at once: full-attention layers with their own head dim (32
against 16) and one KV head (against 2), values from the key projection there (attention_k_eq_v), a weightless value
norm, unscaled scores, "proportional" rope on the full layers, the last 2 of 6 layers reusing the K/V of layers 2
(sliding) and 3 (full) with double-wide MLPs, per-layer input embeddings, a per-layer scalar and a final soft cap.
transformers initializes Gemma 4's norm weights and layer scalars to 1; here they are random (about 1 +- 0.5), so a
(1 + w) / w mix-up or a dropped scalar fails, and `test_each_feature_matters` turns each mapped feature off on jaxkv's
side and requires the logits to move.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")

import jaxkv  # noqa: E402
from jaxkv import sharding  # noqa: E402
from jaxkv.cache import planner as memory  # noqa: E402
from jaxkv.checkpoint import config_from_dict, config_to_dict  # noqa: E402
from jaxkv.checkpoint_hf import config_from_hf  # noqa: E402
from jaxkv.config import ProportionalRope  # noqa: E402
from jaxkv.cache.paged import PagedKVCache  # noqa: E402
from helpers.hf import (ATOL, BOS, EOS, MIN_MARGIN, NEW_TOKENS, PAD, assert_clear_margins,  # noqa: E402
                        check_speculative_greedy, greedy_cases, hf_greedy, hf_logits, per_row, saved_and_loaded)
from helpers.tolerances import atol  # noqa: E402

# Whole-sequence logits against transformers: twice the other families' tolerance (why: helpers.tolerances).
GEMMA_LOGITS_ATOL = atol("transformers logits, gemma")

VOCAB, WINDOW = 128, 8
NORM_MEAN, NORM_STD, EMBED_SCALE = 1.0, 0.5, 0.5
SINGLE = [[17, 3, 99, 41, 8, 110, 23, 64, 5, 77, 120, 31]]
RAGGED = [[44, 9, 101, 2, 61, 70, 13, 87, 20, 6], [7, 88, 19, 100, 33, 52, 101, 4, 66, 29, 115, 11, 93, 40, 72, 3, 58],
          [12, 5, 70, 103, 38, 26, 9, 81, 57, 90, 14, 122, 36]]
TYPES = ["sliding_attention", "full_attention"] * 3

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, initializer_range=0.1, rms_norm_eps=1e-6, sliding_window=WINDOW,
            layer_types=TYPES, num_kv_shared_layers=2, use_double_wide_mlp=True, vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8, final_logit_softcapping=10.0, pad_token_id=PAD, eos_token_id=EOS,
            bos_token_id=BOS,
            # a base != the default 1e6 and a fraction of 0.5, so the rotated part of the full layers' heads matters
            rope_parameters=dict(full_attention=dict(rope_type="proportional", partial_rotary_factor=0.5,
                                                     rope_theta=10_000.0),
                                 sliding_attention=dict(rope_type="default", rope_theta=1000.0)))
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)
CASES = {
    # seed 2: varied reference generations, smallest top-2 gap over all greedy steps 0.003 (`assert_clear_margins`)
    "gemma4-text": ("Gemma4TextConfig", TEXT, 2),
    # the multimodal model: no k_eq_v, no double-wide MLP, an untied head; the vision tower is skipped by name
    "gemma4-multimodal": ("Gemma4Config", dict(
        text_config=dict(TEXT, attention_k_eq_v=False, use_double_wide_mlp=False, num_hidden_layers=4,
                         layer_types=TYPES[:4], num_kv_shared_layers=1, tie_word_embeddings=False),
        vision_config=VISION, audio_config=None, tie_word_embeddings=False), 0),
}


def build_hf(config_class: str, kwargs: dict, seed: int):
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    if config_class == "Gemma4Config":
        hf = transformers.Gemma4ForConditionalGeneration._from_config(config, attn_implementation="eager")
    else:
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf = hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "vision" in name:
                continue
            if name.endswith("norm.weight"):  # Gemma 4 scales by w: about 1 +- 0.5 (1 + w would be about 2)
                p.copy_(torch.randn(p.shape) * NORM_STD + NORM_MEAN)
            elif name.endswith("embed_tokens.weight"):  # times sqrt(D) = 8: keep the layers' share visible
                p.mul_(EMBED_SCALE)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):  # a saved buffer; 1 in transformers' init
                b.copy_(torch.rand(b.shape) + 0.5)
    hf.generation_config.eos_token_id = None
    return hf


loaded = saved_and_loaded(build_hf, CASES)
_RAGGED_GREEDY = []


def ragged_greedy(hf, new_tokens=NEW_TOKENS):
    """transformers' greedy tokens for RAGGED (the text model's), computed once per module; fewer new tokens are the
    first ones of the same greedy run."""
    if not _RAGGED_GREEDY:
        _RAGGED_GREEDY.append(hf_greedy(hf, RAGGED))
    return [row[:new_tokens] for row in _RAGGED_GREEDY[0]]


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    return (request.param, *loaded(request.param, tmp_path_factory))


def test_config_mapping(tmp_path_factory):
    _, model, _ = loaded("gemma4-text", tmp_path_factory)
    cfg = model.config
    assert (cfg.ffn_kind, cfg.norm_kind, cfg.post_norms, cfg.qk_norm, cfg.value_norm) == (
        "geglu", "rmsnorm_f32", True, True, True)
    assert (cfg.embed_scale, cfg.query_pre_attn_scalar, cfg.attention_scale) == (8.0, 1.0, 1.0)
    assert (cfg.layer_types, cfg.sliding_window) == (tuple(TYPES), WINDOW)
    assert (cfg.global_head_dim, cfg.global_kv_heads, cfg.global_values_from_keys) == (32, 1, True)
    assert (cfg.kv_shared_layers, cfg.kv_shared_ffn_dim, cfg.per_layer_input_dim) == (2, 192, 8)
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e4, ProportionalRope(0.5), 1e3)
    assert cfg.final_logit_softcap == 10.0 and cfg.tie_embeddings and cfg.layer_scalar and cfg.eos_ids == (EOS,)
    # the config survives jaxkv's own config file
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg))), source="test") == cfg


def test_params_have_the_decoder_layout(pair):
    """Same tree, shapes and dtypes as the Flax decoder's own init, nothing dropped or added (no k/v projections
    on the sharing layers, no v_proj where values are keys), and the parameter count is the config's."""
    name, hf, model, _ = pair
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(jaxkv.Decoder(model.config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]
    got = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(expected)
    assert sum(a.size for a in jax.tree_util.tree_leaves(model.params)) == model.config.param_count()
    last = model.config.n_layers - 1
    assert "wk" not in model.params[f"layer_{last}"]["attn"] and "wk" in model.params["layer_1"]["attn"]


def test_logits_match(pair):
    name, hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 30))  # 30 > window: the sliding layers slide
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=GEMMA_LOGITS_ATOL, rtol=0,
                               err_msg=name)


def test_greedy_generation_is_token_identical(tmp_path_factory):
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        expected = hf_greedy(hf, prompts)
        assert_clear_margins(hf, prompts, expected, "gemma4-text", MIN_MARGIN)
        gen = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[])
        assert gen.tokens == per_row(expected, batch)
        # the cache generate allocated: what the planner says, sharing layers included at zero bytes
        plan = memory.plan_cache(model.config, [len(p) for p in batch], NEW_TOKENS)
        assert gen.stats["kv_cache_bytes"] == plan.allocated_bytes


def test_cached_decoding_equals_recompute_past_ring_wraps(tmp_path_factory):
    """Prefill 12 tokens (the window of 8 wraps already), then 18 single-token steps (sharing layers reading their
    source layers' rings and plain buffers): every step's logits equal the full recompute's, ragged batch."""
    _, model, _ = loaded("gemma4-text", tmp_path_factory)
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, VOCAB, (2, 30)).astype(np.int32)  # test_logits_match's shape: one compiled recompute
    start = np.array([0, 4], np.int32)  # row 1 is left-padded by 4
    tokens[1, :4] = PAD
    cache = jaxkv.KVCache.allocate(model.config, 2, 64, ring=True, start=start)
    positions = jnp.asarray(np.arange(12)[None] - start[:, None], jnp.int32)
    positions = jnp.where(positions < 0, -1, positions)
    # one compiled prefill (run eagerly, its hundreds of ops would each compile on their own)
    prefill = jax.jit(lambda params, tok, pos, cache: jaxkv.Decoder(model.config).apply(
        {"params": params}, tok, pos, cache, prefill=True))
    out, cache = prefill(model.params, jnp.asarray(tokens[:, :12]), positions, cache)
    steps = [np.asarray(out)]
    step = jax.jit(lambda params, tok, cache: jaxkv.Decoder(model.config).apply(
        {"params": params}, tok, cache.positions(1), cache))  # one compile for the 18 steps
    for t in range(12, 30):
        out, cache = step(model.params, jnp.asarray(tokens[:, t:t + 1]), cache)
        steps.append(np.asarray(out))
    got = np.concatenate(steps, axis=1)
    # Each row's recompute alone, in one call: row 1 without its left padding, right-padded instead (causal: the
    # padding after its tokens changes none of their logits).
    rows = np.stack([tokens[0], np.concatenate([tokens[1, start[1]:], np.full(start[1], PAD, np.int32)])])
    ref = jaxkv.logits(model, rows)
    for b in range(2):
        np.testing.assert_allclose(got[b, start[b]:], ref[b, :30 - start[b]], atol=ATOL, rtol=0)


def test_cache_stores_nothing_for_shared_layers(tmp_path_factory):
    """A K/V-sharing layer has an empty buffer (zero bytes); each other layer has its own geometry; the bytes equal
    the planner's and a figure computed by hand."""
    _, model, _ = loaded("gemma4-text", tmp_path_factory)
    cfg = model.config
    for cache_dtype in ("float32", "int8"):
        cache = jaxkv.KVCache.allocate(cfg, 2, 64, ring=True, dtype=cache_dtype)
        shapes = [k.shape for k in cache.keys]
        assert shapes == [(2, 2, 8, 16), (2, 1, 64, 32)] * 2 + [(2, 2, 0, 16), (2, 1, 0, 32)]
        assert [v.shape for v in cache.values] == shapes
        assert all(a.size == 0 for a in (*cache.keys[4:], *cache.values[4:], *cache.key_scales[4:]))
        per_elem, scale = (4, 0) if cache_dtype == "float32" else (1, 4)
        by_hand = 2 * 2 * 2 * (8 * 2 * (16 * per_elem + scale) + 64 * 1 * (32 * per_elem + scale))
        assert cache.nbytes() == by_hand == memory.kv_cache_bytes(cfg, tokens=64, batch=2, cache_dtype=cache_dtype)
    assert memory.kv_bytes_per_token(cfg) == cfg.kv_bytes_per_token() == 2 * 2 * (2 * 16 + 32) * 4


# config changes on jaxkv's side only (same params) that undo one mapped feature
# (norm_kind "rmsnorm", cast-then-scale, equals "rmsnorm_f32" in float32: it differs in 16 bits only.)
FEATURES = dict(norm_one_plus_w=dict(norm_kind="gemma_rmsnorm"),
                value_norm=dict(value_norm=False), scale=dict(query_pre_attn_scalar=None),
                proportional_rope=dict(rope_scaling=None), local_rope=dict(rope_local_theta=None),
                final_softcap=dict(final_logit_softcap=None), embed_scale=dict(embed_scale=None),
                layer_scalar=dict(layer_scalar=False), per_layer_inputs=dict(per_layer_input_dim=None))


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_feature_matters(tmp_path_factory, feature):
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 30))
    ref = hf_logits(hf, tokens)
    changed = model.config.replace(**FEATURES[feature])
    params = jax.tree_util.tree_map(lambda a: a, model.params)
    if feature == "layer_scalar":
        for layer in range(changed.n_layers):
            del params[f"layer_{layer}"]["layer_scalar"]
    if feature == "per_layer_inputs":
        del params["per_layer_inputs"]
        for layer in range(changed.n_layers):
            for name in ("ple_gate", "ple_proj", "post_ple_norm"):
                del params[f"layer_{layer}"][name]
    assert np.abs(np.asarray(jaxkv.logits(jaxkv.Model(changed, params), tokens)) - ref).max() > 1e-2


def test_kv_sharing_matters(tmp_path_factory):
    """Reading the other layer's K/V (a sharing layer pointed at the wrong source) moves the logits: the source
    mapping is what parity pins down."""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 30))  # test_logits_match's shape: its compiled forward
    params = jax.tree_util.tree_map(lambda a: a, model.params)
    # layers 2 and 0 are both sliding with the same geometry: swap layer 2's k projection with layer 0's
    params["layer_2"]["attn"]["wk"], params["layer_0"]["attn"]["wk"] = (params["layer_0"]["attn"]["wk"],
                                                                        params["layer_2"]["attn"]["wk"])
    assert np.abs(np.asarray(jaxkv.logits(jaxkv.Model(model.config, params), tokens))
                  - hf_logits(hf, tokens)).max() > 1e-2


def test_multimodal_checkpoint_holds_the_vision_tower(tmp_path_factory):
    _, model, directory = loaded("gemma4-multimodal", tmp_path_factory)
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        names = list(f.keys())
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert any(n.startswith("model.embed_vision.") for n in names)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert "lm_head" in model.params and model.config.kv_shared_layers == 1


def _rewrite(directory, tmp_path, drop=None, reshape=None, config=None):
    """A copy of a checkpoint directory with one tensor dropped or reshaped, or config.json changed."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = np.zeros((3,) + tensors[reshape].shape[1:], tensors[reshape].dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((directory / "config.json").read_text())
    hf_config.update(config or {})
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    return tmp_path


@pytest.mark.parametrize("tensor", ["model.layers.3.self_attn.k_proj.weight",
                                    "model.layers.0.per_layer_projection.weight", "model.layers.5.layer_scalar",
                                    "model.embed_tokens_per_layer.weight"])
def test_missing_tensor_is_named(tmp_path_factory, tmp_path, tensor):
    _, _, directory = loaded("gemma4-text", tmp_path_factory)
    with pytest.raises(ValueError, match=f"'{tensor}' is missing"):
        jaxkv.load(_rewrite(directory, tmp_path, drop=tensor))


@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.q_proj.weight", "model.layers.4.mlp.up_proj.weight"])
def test_wrong_shape_is_named(tmp_path_factory, tmp_path, tensor):
    _, _, directory = loaded("gemma4-text", tmp_path_factory)
    with pytest.raises(ValueError, match=f"'{tensor}'.*has shape"):
        jaxkv.load(_rewrite(directory, tmp_path, reshape=tensor))


def test_unexpected_v_proj_is_refused(tmp_path_factory, tmp_path):
    """A v_proj on a layer whose values are its keys means the config is wrong: refused, not dropped."""
    _, _, directory = loaded("gemma4-text", tmp_path_factory)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.v_proj.weight"):
        jaxkv.load(_rewrite(directory, tmp_path, config=dict(attention_k_eq_v=False)))


@pytest.mark.parametrize("change,field", [(dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                moe_intermediate_size=16), "enable_moe_block"),
                                          (dict(vocab_size_per_layer_input=64), "vocab_size_per_layer_input"),
                                          (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
                                          (dict(num_kv_shared_layers=6), "num_kv_shared_layers")])
def test_unsupported_config_is_refused(tmp_path_factory, change, field):
    _, _, directory = loaded("gemma4-text", tmp_path_factory)
    hf_config = dict(json.loads((directory / "config.json").read_text()), **change)
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf_config, source="config.json")


def test_release_style_config():
    """A config.json without per_layer_config (global_head_dim, num_global_key_value_heads) and without
    rope_parameters or layer_types: transformers' defaults (every 6th layer full, the last forced full,
    proportional rope of 0.25 at 1e6 on full layers, 1e4 on sliding ones)."""
    hf = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "vocab_size": 1000, "vocab_size_per_layer_input": 1000, "hidden_size_per_layer_input": 16,
          "num_kv_shared_layers": 2, "sliding_window": 32}
    cfg = config_from_hf(hf, source="config.json")
    assert cfg.layer_types == tuple(["sliding_attention"] * 5 + ["full_attention", "sliding_attention",
                                                                  "full_attention"])
    assert (cfg.global_head_dim, cfg.global_kv_heads, cfg.rope_scaling) == (128, 1, ProportionalRope(0.25))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.kv_source(7), cfg.kv_source(6)) == (1e6, 1e4, 5, 4)
    assert cfg.kv_shared_ffn_dim is None and cfg.tie_embeddings


def test_paged_pools_follow_each_layers_geometry(tmp_path_factory):
    """One pool per storing layer in its own geometry (sliding: 2 KV heads of 16; full: 1 of 32); the sharing
    layers hold an empty placeholder; the pool's bytes equal the planner's and a figure by hand."""
    _, model, _ = loaded("gemma4-text", tmp_path_factory)
    cache = PagedKVCache.allocate(model.config, 2, num_pages=10, page_size=4, max_len=40)
    assert [k.shape for k in cache.keys] == [(10, 2, 4, 16), (10, 1, 4, 32)] * 2 + [(0, 2, 4, 16), (0, 1, 4, 32)]
    assert [v.shape for v in cache.values] == [k.shape for k in cache.keys]
    assert cache.nbytes() == memory.pool_bytes(model.config, num_pages=10, page_size=4) == 10 * 4 * 2 * 2 * (
        2 * 16 + 1 * 32) * 4  # pages x slots x (K and V) x 2 layers of each kind x K x H x float32


def test_paged_samples_are_token_identical_to_transformers(tmp_path_factory):
    """n > 1 on the paged cache: the sharing layers read their source layers' pages (written earlier in the same
    step); 2 greedy samples of each ragged prompt equal transformers' greedy output; page size 5 divides none of
    the prompt lengths, and the prompts outgrow the window of 8."""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    expected = ragged_greedy(hf)
    got = jaxkv.generate(model, RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[], n=2, page_size=5)
    assert got.tokens == [row for row in expected for _ in range(2)]
    # The pallas paged kernel (interpreted here) reads the same pools, per-layer head dims included.
    pallas = jaxkv.generate(model, RAGGED[:1], max_new_tokens=2, stop_tokens=[], n=2, page_size=5,
                            attention="pallas")  # 1 decode step: the interpreter is slow
    assert pallas.tokens == [expected[0][:2]] * 2


def test_engine_and_prefix_cache_serve_gemma4(tmp_path_factory):
    """The engine's chunked prefill (chunks of 4 attend over the pages, not over fresh K/V) and a prefix cache hit
    (the sharing layers read the cached pages of their source layers) give transformers' greedy tokens."""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    shared = RAGGED[1][:12]
    prompts = [RAGGED[0], RAGGED[2], shared + [9, 31]]
    expected = hf_greedy(hf, prompts)
    pc = jaxkv.PrefixCache(model, num_pages=64, page_size=4)
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=4, prefill_chunk=4, decode_widths=[2],
                          prefix_cache=pc)
    first = engine.generate([dict(prompt=p, max_new_tokens=16, stop_tokens=[]) for p in prompts])
    assert [r.tokens for r in first] == [row[:16] for row in expected]
    again = engine.generate([dict(prompt=shared + [9, 31], max_new_tokens=16, stop_tokens=[])])
    assert again[0].tokens == expected[2][:16]
    assert engine.stats["prefix_hit_tokens"] >= 12
    assert engine.held_pages() == 0 and engine.free_pages == engine.num_pages - pc.cached_pages > 0


def test_beam_search_equals_transformers(tmp_path_factory):
    from helpers.hf import BEAM_NEW as NEW, hf_beam_search

    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    stops = [hf_greedy(hf, RAGGED[:1])[0][5]]
    want = hf_beam_search(hf, RAGGED[:2], stops, num_beams=3, length_penalty=1.0, early_stopping=False,
                          num_return_sequences=2)
    got = jaxkv.beam_search(model, RAGGED[:2], num_beams=3, max_new_tokens=NEW, num_return_sequences=2,
                            stop_tokens=stops, page_size=4)
    assert got.tokens == [[tokens for tokens, _ in hyps] for hyps in want]
    for hyps, want_hyps in zip(got, want):
        for h, (_, score) in zip(hyps, want_hyps):
            assert abs(h.score - score) < 1e-4  # float32 sums of log-probabilities, as test_beam_search
    assert got.stats["pages_in_use_end"] == 0


def test_mesh_generation_is_token_identical(tmp_path_factory):
    """On a (2, 4) mesh of the 8 host devices: the batch over "data", the sliding layers' 2 KV heads and the full
    layers' 1 each repeated to 4 and split over "model", the sharing layers reading their source's shard; greedy
    tokens of the ragged batch == transformers'. (The engine test below runs a (1, 4) mesh.)"""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    run = sharding.check_config(model.config, mesh)
    assert (run.n_kv_heads, run.global_kv_heads) == (4, 4)
    assert sharding.check_config(model.config, jax.make_mesh((1, 2), ("data", "model"))).global_kv_heads == 2
    expected = ragged_greedy(hf, 16)
    got = jaxkv.generate(model, RAGGED, max_new_tokens=16, stop_tokens=[], mesh=mesh)
    assert got.tokens == expected


def test_engine_on_a_mesh_is_token_identical(tmp_path_factory):
    """The paged pools on a 1 x 4 mesh: each storing layer's pool split over its KV heads (repeated to 4), the
    sharing layers' placeholders too; the engine's greedy tokens == transformers'."""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    expected = ragged_greedy(hf, 16)
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=4, prefill_chunk=8, decode_widths=[2],
                          mesh=jax.make_mesh((1, 4), ("data", "model")))
    got = engine.generate([dict(prompt=p, max_new_tokens=16, stop_tokens=[]) for p in RAGGED])
    assert [r.tokens for r in got] == expected
    assert engine.held_pages() == 0


def test_mesh_needs_the_sharing_layers_ffn_to_divide(tmp_path_factory):
    _, model, _ = loaded("gemma4-text", tmp_path_factory)
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    with pytest.raises(ValueError, match=r"kv_shared_ffn_dim \(196\) must be divisible by the mesh's 'model' axis"):
        sharding.check_config(model.config.replace(n_heads=8, kv_shared_ffn_dim=196), mesh)


def test_speculative_greedy_equals_transformers(tmp_path_factory):
    """Layers reading another layer's K/V (kv_shared_layers) in a verify's k + 1-wide pass."""
    hf, model, _ = loaded("gemma4-text", tmp_path_factory)
    check_speculative_greedy(model, ragged_greedy(hf), "gemma4-text", RAGGED)
