"""DeepSeek-V3.2 (`deepseek_v32`: `jaxkv.layers.indexer`, `jaxkv.attention.indexer`) against transformers 5.25's
DeepseekV32ForCausalLM: tiny random models whose lightning indexer keeps 8 slots per query (index_topk 8, 8 indexer
heads of 16, the first 8 columns rotated), so every prompt here outgrows it and the sparse selection decides the
logits; layer 0 dense and layer 1 a DeepSeek-V3 mixture of experts (two layers: one of each kind is what the mapping
and the decoding paths need, and every program compiles a third faster than with three). Float32 logits within 1e-4
(and far off when the model attends to every slot instead), greedy tokens (single, ragged), n = 2, the engine
(prompt chunks past the top-k), beams, speculation (a draft, and an MTP module with its own indexer), the prefix
cache, int8 and fp8 caches (read as their dequantized numbers), the planner's bytes, a mesh
(tests/test_sharding_mla.py), broken checkpoints.

transformers embeds the pad id as zeros (`padding_idx`): a zero hidden state scores every slot 0 and the top-k is
then an arbitrary pick among ties, different in torch and in XLA. The models here get a random pad embedding, and
`assert_clear_selection` checks that every query's k-th and (k+1)-th index scores are apart by more than float noise
on the sequences compared, so equal tokens mean equal selections, not luck.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxkv  # noqa: E402
from helpers.hf import (ATOL, DEEPSEEK_MOE_LIKE, RAGGED, SINGLE, TIE_GAP,  # noqa: E402
                        VOCAB, check_moe_path, check_moe_routing, check_mtp_speculation, hf_greedy_cases,
                        hf_logits, saved_and_loaded)
from helpers.hf import build_hf as hf_model  # noqa: E402
from jaxkv.cache.planner import kv_bytes_per_token, kv_cache_bytes  # noqa: E402
from jaxkv.io.hf import config_from_hf  # noqa: E402

TOPK = 8
FIELDS = dict(DEEPSEEK_MOE_LIKE, num_hidden_layers=2, q_lora_rank=24, index_topk=TOPK, index_n_heads=8,
              index_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              routed_scaling_factor=1.5)
MOE_LAYERS = (1,)


def build_hf(seed: int = 0, **changes):
    hf = hf_model("DeepseekV32Config", dict(FIELDS, **changes), seed)
    with torch.no_grad():
        # Not zero (module docstring), and the norms and correction biases transformers initializes to 1 / 0
        # randomized, so a tensor loaded into the wrong place or left out shows.
        hf.model.embed_tokens.weight[0].copy_(torch.randn(hf.config.hidden_size) * 0.25)
        for i, layer in enumerate(hf.model.layers):
            norm = layer.self_attn.indexer.k_norm
            norm.weight.copy_(1 + torch.randn(norm.weight.shape) * 0.3)
            norm.bias.copy_(torch.randn(norm.bias.shape) * 0.5)
            if i in MOE_LAYERS:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape) * 0.1)
    return hf


loaded = saved_and_loaded(build_hf, {"deepseek_v32": ()})


def hf_index_scores(hf, tokens) -> list[np.ndarray]:
    """Per layer, transformers' index scores [B, T, T] of a forward over `tokens` (dead slots -inf), recomputed
    from what its indexers are called with (the formula of `DeepseekV32Indexer.forward`)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    calls = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, k, o: calls.append((m, a)), with_kwargs=True)
             for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(torch.tensor(np.asarray(tokens)))
            out = []
            for ix, (x, q_resid, (cos, sin), *_rest) in calls:
                B, T, _ = x.shape
                E = ix.qk_rope_head_dim
                q = ix.wq_b(q_resid).view(B, T, ix.n_heads, ix.head_dim)
                k = ix.k_norm(ix.wk(x)).unsqueeze(2)
                q_rot, k_rot = apply_rotary_pos_emb(q[..., :E], k[..., :E], cos, sin, unsqueeze_dim=2)
                q, k = torch.cat([q_rot, q[..., E:]], -1), torch.cat([k_rot, k[..., E:]], -1)[:, :, 0]
                per_head = torch.relu(torch.einsum("bthd,bsd->bhts", q.float(), k.float()) * ix.softmax_scale)
                w = ix.weights_proj(x).float() * ix.n_heads ** -0.5
                scores = torch.einsum("bth,bhts->bts", w, per_head)
                out.append(scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).numpy())
            return out
    finally:
        for h in hooks:
            h.remove()


def assert_clear_selection(hf, tokens):
    """Every query with more than TOPK live slots has its TOPK-th and next index scores apart by > TIE_GAP in
    every layer (a random model's selection is then the same in float32 here and in torch)."""
    for layer, scores in enumerate(hf_index_scores(hf, tokens)):
        ranked = -np.sort(-scores, axis=-1)[:, TOPK:]  # queries TOPK.. have more than TOPK live slots
        gap = ranked[:, :, TOPK - 1] - ranked[:, :, TOPK]
        assert np.min(gap) > TIE_GAP, f"layer {layer}: near tie at the top-k boundary ({np.min(gap)})"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, jaxkv's, transformers' greedy tokens for SINGLE and RAGGED by prompt count)."""
    hf, model, _ = loaded("deepseek_v32", tmp_path_factory)
    greedy = hf_greedy_cases(hf)
    for prompts in (SINGLE, RAGGED):  # the sequences compared: prompt + transformers' tokens
        for p, row in zip(prompts, greedy[len(prompts)]):
            assert_clear_selection(hf, [p + row])
    return hf, model, greedy


def test_config_maps_the_indexer_and_defaults():
    """index_* fields map to `SparseIndexer`; a config.json without them reads as DeepseekV32Config fills them
    (64 heads of 128, top 2048, 3 dense layers, interleaved rotary for the attention)."""
    given = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, intermediate_size=96, vocab_size=VOCAB,
                 moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)
    theirs = transformers.DeepseekV32Config(**given)
    ours = config_from_hf({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **given},
                          source="config.json")
    ix = ours.mla.indexer
    assert (ix.n_heads, ix.head_dim, ix.topk) == (theirs.index_n_heads, theirs.index_head_dim, theirs.index_topk)
    assert ours.mla.q_lora_rank == theirs.q_lora_rank and ours.moe.first_dense_layers == theirs.first_k_dense_replace
    assert ours.max_positions == theirs.max_position_embeddings
    with pytest.raises(ValueError, match="mlp_layer_types"):
        config_from_hf({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **given,
                        "mlp_layer_types": ["sparse", "dense", "dense", "dense"]}, source="config.json")


def test_logits_match(pair):
    hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    assert_clear_selection(hf, tokens)
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_the_selection_moves_the_logits(pair):
    """The indexer is not inert here: the same weights attending to every slot (top-k past the context) give
    logits far from transformers' (so the parity test would catch a selection left out)."""
    hf, model, _ = pair
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 24))
    mla = model.config.mla
    dense = model.config.replace(mla=type(mla)(**{**mla.__dict__, "indexer": type(mla.indexer)(
        n_heads=mla.indexer.n_heads, head_dim=mla.indexer.head_dim, topk=10_000)}))
    ours = np.asarray(jaxkv.logits(jaxkv.Model(dense, model.params), tokens))
    assert np.abs(ours - hf_logits(hf, tokens)).max() > 100 * ATOL


@pytest.mark.parametrize("path", ["greedy", "n=2", "engine", "beams", "routing", "speculative"])
def test_decoding_paths_equal_transformers(pair, path):
    """Each decoding path against transformers' tokens (beams: and scores): contiguous sparse decode, paged
    forks' gathered reads, the engine's prompt chunks of 8 (masked after the first chunk), verify blocks."""
    hf, model, greedy = pair
    check_moe_path(path, hf, model, greedy, "deepseek-v3.2",
                   routing=lambda: check_moe_routing(hf, model, MOE_LAYERS),
                   decode_widths=[2])  # one engine decode dispatch compiled (tests/engine: the widths)


@pytest.mark.parametrize("where", ["contiguous", "paged", "engine"])
def test_mtp_speculation_equals_plain_decoding(pair, where):
    """A V3.2 MTP module (random, its block's attention with its own indexer and indexer-key cache) proposing for
    `Speculation("mtp")`: the greedy tokens of plain decoding, with verifies run (transformers' tokens of the ragged
    prompts, which plain decoding gives: test_decoding_paths_equal_transformers[greedy])."""
    from jaxkv.decoding.mtp import random_mtp
    _, model, greedy = pair
    speculating = jaxkv.Model(model.config, model.params)
    speculating.mtp = random_mtp(model.config, seed=1)
    assert speculating.mtp.config.mla.indexer == model.config.mla.indexer
    check_mtp_speculation(speculating, where, RAGGED, [row[:16] for row in greedy[len(RAGGED)]], decode_widths=[2])


def test_a_stored_mtp_layer_loads_with_its_indexer(pair, tmp_path_factory, tmp_path):
    """A V3.2 checkpoint's MTP layer as the release stores it (layer L with num_nextn_predict_layers 1: a decoder
    layer, indexer included, here layer L - 1's tensors under layer L's names (a mixture of experts, as DeepSeek's
    rule makes layer L), then enorm, hnorm, eh_proj, shared_head.norm): its indexer tensors land in `Model.mtp`'s
    block, and `Speculation("mtp")` proposing with it gives plain greedy's tokens."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file
    _, _, directory = loaded("deepseek_v32", tmp_path_factory)
    greedy = pair[2]
    L, D = FIELDS["num_hidden_layers"], FIELDS["hidden_size"]
    target = tmp_path / "mtp"
    shutil.copytree(directory, target)
    tensors = load_file(str(target / "model.safetensors"))
    rng = np.random.default_rng(7)
    last, mtp = f"model.layers.{L - 1}.", f"model.layers.{L}."
    tensors |= {mtp + k.removeprefix(last): v for k, v in tensors.items() if k.startswith(last)}
    tensors |= {mtp + "enorm.weight": (1 + 0.2 * rng.standard_normal(D)).astype(np.float32),
                mtp + "hnorm.weight": (1 + 0.2 * rng.standard_normal(D)).astype(np.float32),
                mtp + "eh_proj.weight": (rng.standard_normal((D, 2 * D)) / np.sqrt(2 * D)).astype(np.float32),
                mtp + "shared_head.norm.weight": tensors["model.norm.weight"]}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    model = jaxkv.load(target)
    assert model.mtp is not None and model.mtp.config.mla.indexer == model.config.mla.indexer
    indexer = model.mtp.params[0]["layer_0"]["attn"]["indexer"]
    for name, stored in (("index_wk", "wk.weight"), ("index_wq", "wq_b.weight"), ("index_norm_bias", "k_norm.bias"),
                         ("index_weights", "weights_proj.weight")):
        np.testing.assert_array_equal(np.asarray(indexer[name]), tensors[mtp + "self_attn.indexer." + stored])
    check_mtp_speculation(model, "contiguous", RAGGED, [row[:16] for row in greedy[len(RAGGED)]])


def test_prefix_cache_equals_the_plain_run(pair):
    """A prefix-cache hit (the indexer keys come back with the latent pages) equals the plain run: the ragged
    prompts' whole pages hit (4 + 12 + 8 tokens; the 13-token prompt's 12 are past the top-8), and every call gives
    transformers' greedy tokens, which plain decoding gives (test_decoding_paths_equal_transformers[greedy]; no
    plain run compiled here)."""
    _, model, greedy = pair
    plain = [row[:16] for row in greedy[len(RAGGED)]]
    prefix = jaxkv.PrefixCache(model, num_pages=64, page_size=4)
    for hits in (0, 4 + 12 + 8):
        out = jaxkv.generate(model, RAGGED, max_new_tokens=16, stop_tokens=[], prefix_cache=prefix)
        assert out.tokens == plain and out.stats["prefix_hit_tokens"] == hits


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantized_caches_read_what_they_hold(pair, dtype):
    """An int8 / fp8 cache (latent rows and indexer keys each with per-slot scales) decodes exactly as a float32
    cache holding its dequantized numbers: the selection and the attention read the scales right. (Token
    agreement with the float run is no test here: on these random weights the k-th and next index scores are
    1-3% apart, inside the quantization error, so the selection itself may change.)"""
    import dataclasses

    import jax.numpy as jnp

    from jaxkv.generate import decode_step, prefill
    _, model, _ = pair
    tokens, start = jnp.asarray([SINGLE[0] + RAGGED[1]], jnp.int32), jnp.zeros((1,), jnp.int32)
    _, cache = prefill(model.params, tokens, start, config=model.config, capacity=48, cache_dtype=dtype)

    def dequantized(buffers, scales):
        return tuple(b.astype(jnp.float32) * s[..., None] for b, s in zip(buffers, scales))

    plain = dataclasses.replace(cache, keys=dequantized(cache.keys, cache.key_scales),
                                values=dequantized(cache.values, cache.value_scales), key_scales=(), value_scales=(),
                                start=jnp.array(cache.start), length=jnp.array(cache.length))  # steps donate
    step = jnp.asarray([5], jnp.int32)
    ours, _ = decode_step(model.params, step, cache, config=model.config)
    want, _ = decode_step(model.params, step, plain, config=model.config)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), atol=ATOL, rtol=0)


def with_key_dtype(model, key_dtype):
    """The model with its indexer keys cached as `key_dtype` (`SparseIndexer.key_dtype`), the weights the same."""
    import dataclasses
    mla = model.config.mla
    config = model.config.replace(mla=dataclasses.replace(mla, indexer=dataclasses.replace(mla.indexer,
                                                                                             key_dtype=key_dtype)))
    return jaxkv.Model(config, model.params)


def test_float8_indexer_keys_beside_float32_rows(pair):
    """DeepSeek's release caches the indexer keys in float8 (a scale each) whatever the rows' dtype
    (`SparseIndexer.key_dtype`): the buffers and bytes are so (the planner agrees), a step reads exactly what a
    float32 cache holding the dequantized keys gives, and paged forks equal the contiguous run of the same model
    (a prefix-cache hit does not: its first query scores the stored float8 keys where a whole prefill scores
    them as computed, and these weights' selection margins are within that rounding)."""
    import dataclasses

    import jax.numpy as jnp

    from jaxkv.generate import decode_step, prefill
    _, model, _ = pair
    fp8 = with_key_dtype(model, "float8_e4m3fn")
    c, m = fp8.config, fp8.config.mla
    cache = jaxkv.KVCache.allocate(c, batch=2, max_len=40)
    assert cache.keys[0].dtype == jnp.float32 and cache.values[0].dtype == jnp.float8_e4m3fn
    assert cache.key_scales == () and len(cache.value_scales) == c.n_layers
    assert cache.nbytes() == kv_cache_bytes(c, tokens=40, batch=2) == 2 * 40 * c.n_layers * (
        m.row_dim * 4 + m.indexer.head_dim + 4)

    tokens, start = jnp.asarray([SINGLE[0] + RAGGED[1]], jnp.int32), jnp.zeros((1,), jnp.int32)
    _, cache = prefill(fp8.params, tokens, start, config=c, capacity=48)
    assert float(jnp.max(cache.value_scales[1])) > 0  # the prompt's keys were quantized into the cache
    keys = tuple(v.astype(jnp.float32) * s[..., None] for v, s in zip(cache.values, cache.value_scales))
    plain = dataclasses.replace(cache, keys=tuple(map(jnp.array, cache.keys)), values=keys, value_scales=(),
                                start=jnp.array(cache.start), length=jnp.array(cache.length))  # steps donate
    step = jnp.asarray([5], jnp.int32)
    ours, _ = decode_step(fp8.params, step, cache, config=c)
    want, _ = decode_step(model.params, step, plain, config=model.config)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), atol=ATOL, rtol=0)

    prompt = SINGLE[0] + RAGGED[1]
    contiguous = jaxkv.generate(fp8, [prompt], max_new_tokens=12, stop_tokens=[])
    assert jaxkv.generate(fp8, [prompt], max_new_tokens=12, stop_tokens=[], n=2, page_size=4).tokens == (
        contiguous.tokens * 2)


def test_the_planner_counts_the_indexer_keys(pair):
    """Bytes per token: L x ((R + E) + Di) x 4 in float32 (+ 2 scales of 4 bytes in int8), what the caches hold."""
    _, model, _ = pair
    c, m = model.config, model.config.mla
    assert kv_bytes_per_token(c) == c.n_layers * (m.row_dim + m.indexer.head_dim) * 4 == c.kv_bytes_per_token()
    assert kv_bytes_per_token(c, "int8") == c.n_layers * (m.row_dim + m.indexer.head_dim + 8)
    for dtype in (None, "int8"):
        cache = jaxkv.KVCache.allocate(c, batch=2, max_len=40, dtype=dtype)
        assert cache.nbytes() == kv_cache_bytes(c, tokens=40, batch=2, cache_dtype=dtype)
        assert cache.values[0].shape == (2, 1, 40, m.indexer.head_dim)


def test_pallas_by_name_is_refused_past_the_top_k(pair):
    """No sparse latent kernel: attention="pallas" is `Unsupported` once the cache holds more than top-k slots."""
    _, model, _ = pair
    with pytest.raises(NotImplementedError, match="sparse"):
        jaxkv.generate(model, [SINGLE[0]], max_new_tokens=4, stop_tokens=[], attention="pallas")


@pytest.mark.parametrize("tensor, broken, named", [
    ("model.layers.1.self_attn.indexer.wk.weight", None, "model.layers.1.self_attn.indexer.wk.weight"),
    ("model.layers.0.self_attn.indexer.weights_proj.weight", (7, 64),
     "model.layers.0.self_attn.indexer.weights_proj.weight"),
    ("model.layers.1.self_attn.indexer.k_norm.bias", None, "model.layers.1.self_attn.indexer.k_norm.bias"),
])
def test_broken_checkpoints_name_the_tensor(pair, tmp_path, tensor, broken, named):
    """A missing indexer tensor or one of the wrong shape is a ValueError naming it."""
    import json

    import safetensors.torch as st
    hf, _, _ = pair
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if broken is None:
        state.pop(tensor)
    else:
        state[tensor] = torch.zeros(broken)
    config = hf.config.to_dict()
    config["architectures"] = [type(hf).__name__]
    (tmp_path / "config.json").write_text(json.dumps(config))
    st.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        jaxkv.load(tmp_path)

