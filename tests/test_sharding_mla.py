"""Multi-head latent attention (and the DeepSeek mixture of experts) in sharded generation: `generate(..., mesh=)`
over ("data", "model") meshes of the 8 CPU devices conftest sets up, compared with single-device generation.

The layout under test (`jaxkv.sharding`'s docstring): the latent cache [B, 1, S, R + E] is split over "data" and
replicated over "model"; per-head weights (wq_b, wk_b, wv_b, wo) split their head axis over "model", each expert
its hidden width.
"""

import dataclasses
import importlib.util
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxkv
from jaxkv import sharding
from jaxkv.config import Mla, MoeConfig, SparseIndexer

from helpers import hlo
from helpers.env import SCRIPTS
from helpers.tolerances import atol

# float32 throughout: sharded and single-device log-probabilities differ in the last bits only
# (helpers.tolerances).
LOGPROB_ATOL = atol("sharded vs one device")

MLA = jaxkv.Config(vocab_size=128, d_model=48, n_layers=2, n_heads=8, ffn_dim=80, max_positions=256,
                   mla=Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24))
# Layer 0 dense, layer 1 DeepSeek-V3 routing (sigmoid, correction bias, groups) with a shared expert; expert and
# shared widths (32) divide every model axis here.
MLA_MOE = MLA.replace(moe=MoeConfig(n_routed_experts=8, experts_per_token=2, moe_ffn_dim=32, n_shared_experts=1,
                                    first_dense_layers=1, scoring="sigmoid", topk_method="noaux_tc", n_group=2,
                                    topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=True))
# DeepSeek-V3.2: an indexer keeping 4 slots per query (the prompts and their 8 new tokens outgrow it), its keys
# cached as the latent cache's values and split like the rows.
MLA_INDEXED = MLA_MOE.replace(mla=dataclasses.replace(MLA.mla, indexer=SparseIndexer(n_heads=4, head_dim=16, topk=4)))
CONFIGS = {"mla": MLA, "mla-moe": MLA_MOE, "mla-indexed": MLA_INDEXED}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]  # ragged; the padded batch of 4 does not divide a data axis of 8
NEW = 8
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=3)

_models, _references = {}, {}


def model_for(name: str) -> jaxkv.Model:
    if name not in _models:
        _models[name] = jaxkv.Model.random(CONFIGS[name], seed=1)
    return _models[name]


def reference(name: str, **kwargs) -> jaxkv.Generation:
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _references:
        _references[key] = jaxkv.generate(model_for(name), PROMPTS, max_new_tokens=NEW, stop_tokens=[], **kwargs)
    return _references[key]


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


def latent_bytes(config: jaxkv.Config, batch: int, slots: int, cache_dtype: str = "float32") -> int:
    """The whole latent cache: per layer, batch x slots rows of R + E numbers (+ one float32 scale per row when
    quantized)."""
    row = config.mla.row_dim * np.dtype(cache_dtype).itemsize + (4 if cache_dtype == "int8" else 0)
    if config.mla.indexer is not None:  # DeepSeek-V3.2's indexer key beside each row
        row += config.mla.indexer.head_dim * np.dtype(cache_dtype).itemsize + (4 if cache_dtype == "int8" else 0)
    return config.n_layers * batch * slots * row


# The dense MLA model split over both axes; the indexed model (DeepSeek-V3.2: the MoE model plus an indexer) with
# its experts split over a 4-way model axis beside data (a data-only mesh, (8, 1), is plain data parallelism:
# tests/test_sharding.py). The MoE model without the indexer: its experts on the same (2, 4) mesh are the indexed
# model's (the greedy case of its own compiled ~8 s for no other path), its layers over a model-only mesh (1, 8)
# test_sampled_tokens_equal_single_device[mla-moe-shape1]'s: the dense layer 0 there is this dense model's layer on
# the same 8-way model axis (the (1, 8) greedy case of the dense model compiled ~8 s for no other path).
@pytest.mark.parametrize("name, shape", [("mla", (2, 4)), ("mla-indexed", (2, 4))],
                         ids=["mla-shape0", "mla-indexed-shape2"])
def test_greedy_generation_equals_single_device(name, shape):
    """Greedy tokens identical to one device's for a ragged batch, log-probabilities within LOGPROB_ATOL, and the
    per-device cache = the whole latent cache / data (replicated over "model", never split by it)."""
    ref = reference(name)
    got = jaxkv.generate(model_for(name), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(*shape))
    assert got.tokens == ref.tokens
    for want_row, got_row in zip(ref.logprobs, got.logprobs):
        np.testing.assert_allclose(got_row, want_row, atol=LOGPROB_ATOL, rtol=0)
    data, _ = shape
    total = latent_bytes(CONFIGS[name], got.stats["padded_batch"], got.stats["cache_capacity"])
    assert got.stats["padded_batch"] == max(4, data)
    assert got.stats["kv_cache_bytes"] == total
    assert got.stats["kv_cache_bytes_per_device"] == total // data


@pytest.mark.parametrize("name, shape", [("mla", (2, 4)), ("mla-moe", (1, 8))])
def test_sampled_tokens_equal_single_device(name, shape):
    """A seed fixes the samples on a mesh as on one device (the key is replicated; threefry is partitionable)."""
    got = jaxkv.generate(model_for(name), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(*shape),
                         **SAMPLED)
    assert got.tokens == reference(name, **SAMPLED).tokens
    assert got.tokens != reference(name).tokens  # really sampled


def test_stop_tokens_on_a_mesh():
    """A stop token ends its row on a mesh as on one device (same tokens, same finish reasons)."""
    stop = reference("mla").tokens[1][3]
    kwargs = dict(max_new_tokens=NEW, stop_tokens=[stop])
    want = jaxkv.generate(model_for("mla"), PROMPTS, **kwargs)
    got = jaxkv.generate(model_for("mla"), PROMPTS, mesh=mesh_of(2, 4), **kwargs)
    assert (got.tokens, got.finish_reasons) == (want.tokens, want.finish_reasons)
    assert got.finish_reasons[1] == "stop"


def test_ring_latent_cache_on_a_mesh():
    """A sliding window of 8: the latent cache is a ring of 8 rows, shorter than the 20-token prompt, split over
    "data" like the plain one; tokens equal one device's."""
    # A new params tree: generate remembers the last sharded (params, mesh) by identity, config not included, so
    # the same tree under another config would run with the remembered config.
    model = jaxkv.Model(MLA.replace(sliding_window=8), jax.tree.map(lambda w: w, model_for("mla").params))
    prompts = [list(range(1, 21)), [5, 6, 7]]
    want = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[])
    got = jaxkv.generate(model, prompts, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(2, 4))
    assert got.tokens == want.tokens
    assert got.stats["cache_ring"] and got.stats["cache_capacity"] == 8
    assert got.stats["kv_cache_bytes_per_device"] == got.stats["kv_cache_bytes"] // 2


# On the indexed model only: its rows and their scales are laid out, counted and read as the MoE model's (the same
# latent rows; the experts read no cache), with its indexer keys beside them. An int8 latent cache without an
# indexer on a mesh compiled its own mesh and one-device programs (~20% of this file) for nothing else.
@pytest.mark.parametrize("name, shape", [("mla-indexed", (2, 4))], ids=["mla-indexed-shape1"])
def test_int8_latent_cache(name, shape):
    """An int8 latent cache on a mesh: the cache leaves (rows and their scales) carry the latent layout, hold
    total / data bytes on each device, and generation equals single-device int8 generation."""
    config, mesh = CONFIGS[name], sharding.check_mesh(mesh_of(*shape))
    got = jaxkv.generate(model_for(name), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh, cache_dtype="int8")
    assert got.tokens == reference(name, cache_dtype="int8").tokens
    assert got.stats["kv_cache_bytes_per_device"] == got.stats["kv_cache_bytes"] // shape[0]

    # The cache itself, from generate's own compiled prefill (the same shapes and settings).
    params, sharded_config = sharding.shard_params(model_for(name).params, config, mesh)
    assert sharded_config == config  # one latent row: nothing repeated, whatever the model axis
    data, B, T, S = shape[0], got.stats["padded_batch"], got.stats["padded_prompt_len"], got.stats["cache_capacity"]
    tokens = np.zeros((B, T), np.int32)
    start = np.full((B,), T - 1, np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, T - len(p):], start[b] = p, T - len(p)
    batch = NamedSharding(mesh, sharding.BATCH_SPEC)
    _, cache = jaxkv.prefill(params, sharding.global_array(tokens, batch), sharding.global_array(start, batch),
                             config=config, capacity=S, cache_dtype="int8", attention="auto", mesh=mesh)
    assert sharding.LATENT_SPEC == P("data", None, None, None)
    for rows, scales in zip(cache.keys, cache.key_scales, strict=True):
        assert rows.shape == (B, 1, S, config.mla.row_dim) and rows.dtype == np.int8
        assert rows.sharding.is_equivalent_to(NamedSharding(mesh, sharding.LATENT_SPEC), 4)
        assert scales.sharding.is_equivalent_to(NamedSharding(mesh, sharding.LATENT_SCALE_SPEC), 3)
        # One device holds its batch rows' whole rows: B / data rows, all R + E columns.
        assert rows.addressable_shards[0].data.shape == (B // data, 1, S, config.mla.row_dim)
    assert cache.values  # DeepSeek-V3.2's indexer keys (the one model here has them): laid out as the rows
    for keys, scales in zip(cache.values, cache.value_scales, strict=True):
        assert keys.shape == (B, 1, S, config.mla.indexer.head_dim) and keys.dtype == np.int8
        assert keys.sharding.is_equivalent_to(NamedSharding(mesh, sharding.LATENT_SPEC), 4)
        assert scales.sharding.is_equivalent_to(NamedSharding(mesh, sharding.LATENT_SCALE_SPEC), 3)
    assert sharding.cache_bytes_per_device(cache) == latent_bytes(config, B, S, "int8") // data


def test_decode_loop_reads_the_latent_in_place():
    """The compiled MLA decode loop on a (2, 4) mesh: per layer the two all-reduces of [B/2, 1, D] (after wo, after
    the FFN down projection), no collective as large as one device's latent cache of one layer, the latent held
    whole per device ([B/2, 1, S, R + E]) and every latent buffer updated in place."""
    mesh = sharding.check_mesh(mesh_of(2, 4))
    params, config = sharding.shard_params(model_for("mla").params, MLA, mesh)
    # S = 64, the capacity greedy generation of PROMPTS allocates: this prefill is the one
    # test_greedy_generation_equals_single_device[mla-shape0] compiled (S = 256 compiled another for this test)
    B, S, C = 4, 64, MLA.mla.row_dim
    batch = NamedSharding(mesh, sharding.BATCH_SPEC)
    logits, cache = jaxkv.prefill(params, sharding.global_array(np.ones((B, 16), np.int32), batch),
                                  sharding.global_array(np.zeros((B,), np.int32), batch), config=config, capacity=S,
                                  attention="xla", mesh=mesh)
    rep = NamedSharding(mesh, P())
    put = lambda x: jax.tree.map(lambda leaf: sharding.global_array(leaf, rep), x)  # noqa: E731
    args = (params, cache, logits, put(jax.random.PRNGKey(0)), put(jaxkv.Sampler.make()),
            put(np.full((8,), -1, np.int32)))
    text = jaxkv.decode.lower(*args, config=config, steps=5, attention="xla", mesh=mesh).compile().as_text()
    assert f"f32[{B // 2},1,{S},{C}]" in text
    collectives = hlo.collectives(text)
    big = [c for c in collectives if c[1] >= (B // 2) * S * C]
    assert not big, big
    all_reduces = [c for c in collectives if c[0] == "all-reduce" and c[1] == (B // 2) * MLA.d_model]
    assert len(all_reduces) == 2 * MLA.n_layers, collectives
    alias = next((ln for ln in text.splitlines() if "input_output_alias" in ln), "")
    assert alias.count("may-alias") + alias.count("must-alias") >= MLA.n_layers, alias


def test_pallas_latent_kernel_runs_per_shard():
    """attention="pallas" on a mesh: the latent kernel (interpreted on CPU) runs inside shard_map on each device's
    heads and batch rows (a compiled kernel cannot be partitioned; the interpreted one could be, so the traced
    step is checked for the shard_map too), and gives one device's XLA tokens."""
    mesh = sharding.check_mesh(mesh_of(2, 4))
    params, config = sharding.shard_params(model_for("mla").params, MLA, mesh)
    batch = NamedSharding(mesh, sharding.BATCH_SPEC)
    rows = lambda x: sharding.global_array(x, batch)  # noqa: E731
    # generate's prefill for PROMPTS on this mesh ([4, 16] tokens, 64 slots): compiled by the greedy test already
    _, cache = jaxkv.prefill(params, rows(np.ones((4, 16), np.int32)), rows(np.zeros((4,), np.int32)),
                             config=config, capacity=64, attention="xla", mesh=mesh)
    for attention, per_shard in (("pallas", True), ("xla", False)):
        step = jax.make_jaxpr(lambda p, t, c: jaxkv.decode_step(p, t, c, config=config, attention=attention,
                                                                mesh=mesh))
        assert ("shard_map" in str(step(params, rows(np.ones((4,), np.int32)), cache))) == per_shard, attention

    got = jaxkv.generate(model_for("mla"), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(2, 4),
                         attention="pallas")
    assert got.tokens == reference("mla").tokens


def test_layout_of_the_mla_and_moe_weights():
    """Per-head weights split their heads, each expert its hidden width; everything shared is replicated."""
    mesh = sharding.check_mesh(mesh_of(2, 4))
    specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(model_for("mla-moe").params, mesh, MLA_MOE))
    attn, dense, moe = specs["layer_0"]["attn"], specs["layer_0"]["mlp"], specs["layer_1"]["mlp"]
    # wq_b is stored [q_rank, N, qk] here, wk_b / wv_b [N, width, R], wo [N, dv, D]: N over "model".
    assert attn["wq_b"] == P(None, "model", None)
    assert attn["wk_b"] == attn["wv_b"] == P("model", None, None)
    assert attn["wo"] == P("model", None, None)
    assert attn["wq_a"] == attn["wkv_a"] == attn["kv_norm"]["scale"] == attn["q_norm"]["scale"] == P()
    assert dense["w_gate"] == P(None, "model") and dense["w_down"] == P("model", None)
    # experts [X, D, I] (gate, up) and [X, I, D] (down): I over "model"; the router replicated
    assert moe["we_gate"] == moe["we_up"] == P(None, None, "model") and moe["we_down"] == P(None, "model", None)
    assert moe["ws_gate"] == P(None, "model") and moe["ws_down"] == P("model", None)
    assert moe["router"] == moe["router_bias"] == P()
    assert sharding.sharded_kv_heads(MLA, mesh) == 1


@pytest.mark.parametrize("config, message", [
    (MLA.replace(n_heads=6), r"n_heads \(6\) must be divisible by the mesh's 'model' axis \(4\)"),
    (MLA_MOE.replace(moe=dataclasses.replace(MLA_MOE.moe, moe_ffn_dim=30)),
     r"moe.moe_ffn_dim \(30\) must be divisible"),
])
def test_heads_and_expert_widths_must_divide_the_model_axis(config, message):
    """Refused before anything is compiled: no division of the heads or an expert's width is possible."""
    model = jaxkv.Model.random(config, seed=0)
    with pytest.raises(ValueError, match=message):
        jaxkv.generate(model, PROMPTS, max_new_tokens=2, mesh=mesh_of(2, 4))


def test_all_moe_model_ignores_ffn_dim():
    """With every layer MoE the dense ffn_dim is never read, so it need not divide the model axis."""
    moe = MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=16)
    config = MLA.replace(n_layers=1, ffn_dim=30, moe=moe)
    assert sharding.check_config(config, mesh_of(2, 4)) == config
    assert math.gcd(config.ffn_dim, 4) != 4


@pytest.mark.parametrize("argv, message", [
    (["--meshes", "4x4"], "a 4 x 4 mesh needs 16 devices, 8 available"),
    (["--meshes", "8x1", "--batch", "4"], "--batch 4 must divide over the data axis of the 8 x 1 mesh"),
    (["--meshes", "2-4"], "--meshes must look like 8x1,2x4"),
])
def test_bytes_script_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    """scripts/mla_mesh_bytes.py refuses what it cannot measure before building any model."""
    spec = importlib.util.spec_from_file_location("mla_mesh_bytes", SCRIPTS / "mla_mesh_bytes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
