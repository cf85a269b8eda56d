"""Llama 4 text (`jaxkv.families.llama4`) against transformers: tiny random Llama4ForCausalLM models with every
feature moving the logits: chunked attention with chunks of 8 over prompts of 5-24 tokens and 32 new ones (chunk
boundaries crossed, the chunked layers' ring caches wrapped), NoPE layers every second layer with attention
temperature tuning at floor_scale 4 (the query scale steps every 4 positions), the q/k L2 norm, complex-pair
rotary positions with llama3 scaling, and mixtures of experts every second layer (sigmoid of the chosen logits
scaling the experts' inputs, a shared expert) beside dense layers of their own width; and the text part of a
Llama4ForConditionalGeneration checkpoint. Checked: float32 logits within 1e-4, greedy tokens, n = 2, beams, the
engine, speculation, the prefix cache, every token's experts.

transformers scales a NoPE layer's queries by the cache slot (padding included), not the position: a left-padded
prompt in a batch gets other temperatures than alone. jaxkv uses positions (as vLLM does), so the ragged batch is
compared with transformers' tokens for each prompt alone.
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxkv  # noqa: E402
from helpers.hf import (ATOL, BOS, EOS, PAD, RAGGED, SINGLE, VOCAB, check_beam_search,  # noqa: E402
                        check_moe_path, check_moe_routing, hf_greedy, hf_logits, saved_and_loaded)
from helpers.hf import build_hf as hf_model  # noqa: E402
from jaxkv.io.hf import config_from_hf  # noqa: E402

LAYERS = 4
MOE_LAYERS = (1, 3)
FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=8, num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=2,
              attention_chunk_size=8, floor_scale=4, attn_scale=0.1, use_qk_norm=True,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
              max_position_embeddings=256, initializer_range=0.25, rms_norm_eps=1e-6, pad_token_id=PAD,
              eos_token_id=EOS, bos_token_id=BOS)


def build_hf(seed: int = 0, **changes):
    return hf_model("Llama4TextConfig", dict(FIELDS, **changes), seed)


loaded = saved_and_loaded(build_hf, {"llama4_text": ()})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, jaxkv's, transformers' greedy tokens: for SINGLE, and for each RAGGED prompt alone
    (module docstring))."""
    hf, model, _ = loaded("llama4_text", tmp_path_factory)
    return hf, model, {1: hf_greedy(hf, SINGLE), len(RAGGED): [hf_greedy(hf, [p])[0] for p in RAGGED]}


def test_config_maps_chunks_nope_layers_and_experts(pair):
    _, model, _ = pair
    c, moe = model.config, model.config.moe
    assert c.layer_types == ("chunked_attention", "full_attention") * 2 and c.attention_chunk_size == 8
    assert c.nope_layers == (1, 3) and c.qk_l2_norm and c.attn_temperature == (4, 0.1)
    assert c.layer_spans == (8, None, 8, None) and c.ffn_dim == 96
    assert (moe.scoring, moe.scale_expert_input, moe.n_routed_experts, moe.experts_per_token, moe.moe_ffn_dim,
            moe.shared_ffn_dim, moe.dense_layers) == ("topk_sigmoid", True, 8, 2, 32, 32, (0, 2))


def test_omitted_fields_take_transformers_defaults():
    """A config.json with only the sizes reads as Llama4TextConfig fills it: every 4th layer NoPE and full, the
    others chunked by 8192, temperature tuning (8192, 0.1), the q/k norm, experts in every layer (16, 1 each)."""
    given = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=32, vocab_size=VOCAB)
    theirs = transformers.Llama4TextConfig(**given)
    ours = config_from_hf({"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", **given},
                          source="config.json")
    assert list(ours.layer_types) == theirs.layer_types and ours.attention_chunk_size == theirs.attention_chunk_size
    assert [int(i not in ours.nope_layers) for i in range(8)] == theirs.no_rope_layers
    assert ours.attn_temperature == (theirs.floor_scale, theirs.attn_scale) and ours.qk_l2_norm == theirs.use_qk_norm
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.ffn_dim == theirs.intermediate_size_mlp
    m = ours.moe
    assert (m.n_routed_experts, m.experts_per_token, m.dense_layers) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, tuple(i for i in range(8) if i not in theirs.moe_layers))


def test_logits_match(pair):
    hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_the_features_move_the_logits(pair):
    """Unchunking the chunked layers, dropping the temperature or scaling the experts' outputs instead of their
    inputs each moves the logits far beyond the parity bound (so the parity test could fail on any of them)."""
    _, model, _ = pair
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 24))  # test_logits_match's shape: its compiled forward
    base = np.asarray(jaxkv.logits(model, tokens))
    c = model.config
    for changed in (c.replace(layer_types=None, attention_chunk_size=None), c.replace(attn_temperature=None),
                    c.replace(moe=c.moe.__class__(**{**c.moe.__dict__, "scale_expert_input": False}))):
        # Op by op: the same code as the jitted forward (within float32 rounding of it, far below 100 x ATOL), but
        # each changed config would compile a forward of its own (~2 s each), where these ops compile once for all.
        with jax.disable_jit():
            other = np.asarray(jaxkv.logits(jaxkv.Model(changed, model.params), tokens))
        assert np.abs(other - base).max() > 100 * ATOL


@pytest.mark.parametrize("path", ["greedy", "n=2", "engine", "beams", "routing", "speculative"])
def test_decoding_paths_equal_transformers(pair, path):
    """Each decoding path against transformers' tokens (beams: and scores; one prompt at a time, as transformers'
    padded batch would take other temperatures: module docstring), and every token's experts (Llama4Router returns
    (scores, logits): the ids are its logits' top A)."""
    hf, model, greedy = pair
    A = model.config.moe.experts_per_token
    check_moe_path(path, hf, model, greedy, "llama4",
                   routing=lambda: check_moe_routing(hf, model, MOE_LAYERS, lambda layer: layer.feed_forward.router,
                                                     lambda out: (out[1], out[1].topk(A, dim=-1).indices)),
                   # one pool for the four prompts (the plan's for the longest): one compiled search
                   beams=lambda: [check_beam_search(hf, model, [p], [greedy[1][0][3], greedy[len(RAGGED)][0][6]],
                                                    num_pages=8) for p in SINGLE + RAGGED],
                   decode_widths=[2])  # one engine decode dispatch compiled (tests/engine: the widths)


def test_chunked_rings_paged_and_prefix_cache_equal_plain(pair):
    """The chunked layers' caches are rings of the chunk (8 slots, whatever the length); the paged cache with a
    prefix-cache miss, then a hit (the suffix attends over cached pages and its own chunk) give the plain greedy
    tokens (transformers', for this prompt alone: what the contiguous cache gives in the greedy path test).
    The paged cache's forks (n = 2) over chunked layers: test_decoding_paths_equal_transformers[n=2]."""
    hf, model, _ = pair
    # 15 tokens and 16 new ones: three chunk boundaries (8, 16, 24); the hit (3 pages of 4) leaves positions 12-14
    # in the chunk from 8, and the miss's 15 tokens and the hit's 3 pad to one prefill length: one compiled prefill
    prompt = SINGLE[0] + RAGGED[0][:3]
    plain = hf_greedy(hf, [prompt], 16)
    cache = jaxkv.KVCache.allocate(model.config, 1, 64, ring=True)
    assert [cache.layer_capacity(i) for i in range(LAYERS)] == [8, 64, 8, 64]
    prefix = jaxkv.PrefixCache(model, num_pages=64, page_size=4)
    for hits in (0, 12):
        out = jaxkv.generate(model, [prompt], max_new_tokens=16, stop_tokens=[], prefix_cache=prefix)
        assert out.tokens == plain and out.stats["prefix_hit_tokens"] == hits
    # A quantized ring of the chunk: close to plain, not equal. (int8 only: float8's codec differs from int8's in
    # what tests/cache's quantized-cache tests check, not in the ring's geometry.)
    quantized = jaxkv.generate(model, [prompt], max_new_tokens=16, stop_tokens=[], cache_dtype="int8")
    assert sum(a == b for a, b in zip(quantized.tokens[0], plain[0])) >= 8


def test_the_text_part_of_a_multimodal_checkpoint_loads(pair, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (language_model.model.*, language_model.lm_head, the vision
    tower skipped): the same model and logits."""
    hf, model, _ = pair
    state = {f"language_model.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    state["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    config = transformers.Llama4Config(text_config=hf.config.to_dict(), vision_config={"hidden_size": 16,
                                                                                      "num_hidden_layers": 1})
    config.architectures = ["Llama4ForConditionalGeneration"]
    config.to_json_file(tmp_path / "config.json")
    safetensors_torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    multimodal = jaxkv.load(tmp_path)
    assert multimodal.config == model.config
    tokens = np.random.default_rng(6).integers(0, VOCAB, (2, 24))  # test_logits_match's shape: its compiled forward
    np.testing.assert_array_equal(jaxkv.logits(multimodal, tokens), jaxkv.logits(model, tokens))
