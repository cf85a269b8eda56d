"""Sharded generation: `generate(..., mesh=)` over ("data", "model") meshes of the 8 CPU devices conftest sets up,
and `generate_pmap`. Every sharded result is compared with single-device generation of the same model."""

import importlib.util
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxkv
from jaxkv import sharding

from helpers import hlo
from helpers.env import SCRIPTS
from helpers.tolerances import atol


# float32 throughout: sharded and single-device logits differ in the last bits only (helpers.tolerances).
LOGITS_ATOL = atol("sharded vs one device")

# N=8 query heads over K=2 KV heads: on a model axis of 4 or 8 the KV heads are replicated (to 4 or 8).
GQA = jaxkv.Config(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=128)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]  # 3 prompts: the padded batch of 4 does not divide a data axis of 8
NEW = 8

_models, _references = {}, {}


def model_for(config: jaxkv.Config) -> jaxkv.Model:
    if config not in _models:
        _models[config] = jaxkv.Model.random(config, seed=1)
    return _models[config]


def reference(config: jaxkv.Config, prompts=PROMPTS, **kwargs) -> jaxkv.Generation:
    """Single-device generation (no mesh), remembered per config and arguments."""
    key = (config, str(prompts), tuple(sorted(kwargs.items())))
    if key not in _references:
        _references[key] = jaxkv.generate(model_for(config), prompts, max_new_tokens=NEW, stop_tokens=[],
                                          **kwargs)
    return _references[key]


def mesh_of(data: int, model: int) -> Mesh:
    devices = np.array(jax.devices()[: data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"))


def test_conftest_provides_eight_devices():
    assert jax.device_count() == 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"


# Data only and both axes. Model only: test_paged_samples_on_a_mesh_equal_single_device (1 x 4),
# test_prefix_cache_on_a_mesh_equals_single_device and the issue-32 families (1 x 2); KV heads replicated as here
# (K = 2 -> 4 on (2, 4)), and to lcm(K, M) by test_kv_heads_that_do_not_divide_the_model_axis. A (1, 8) case repeated
# those paths with its own compiles.
@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_mesh_generation_equals_single_device(shape):
    mesh = mesh_of(*shape)
    model = model_for(GQA)
    ref = reference(GQA)
    # On (2, 4) with a stream: the program test_stream_on_a_mesh_reports_every_token runs (the stream is a static
    # argument), so that test and test_sampled_tokens_equal_single_device compile nothing of their own; the loop without
    # a stream on a mesh is every other test's.
    stream = {"stream": lambda b, token: None} if shape == (2, 4) else {}
    got = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh, **stream)
    assert got.tokens == ref.tokens

    # Batch padded to a multiple of the data axis; KV heads replicated to lcm(K, M) when M does not divide K.
    data, M = shape
    assert got.stats["padded_batch"] == max(4, data)
    kv_heads = math.lcm(GQA.n_kv_heads, M)
    total = jaxkv.kv_cache_bytes(GQA.replace(n_kv_heads=kv_heads), tokens=got.stats["cache_capacity"],
                                 batch=got.stats["padded_batch"])
    assert got.stats["kv_cache_bytes"] == total
    assert got.stats["kv_cache_bytes_per_device"] == total // (data * M)

    # Prefill logits of the real rows within LOGITS_ATOL of one device's (at the capacity generate used, so both
    # prefills are the programs generate and the reference already compiled).
    capacity = got.stats["cache_capacity"]
    params, config = sharding.shard_params(model.params, GQA, mesh)
    tokens = np.zeros((got.stats["padded_batch"], 16), np.int32)
    start = np.full((got.stats["padded_batch"],), 15, np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, 16 - len(p):], start[b] = p, 16 - len(p)
    batch_sharding = NamedSharding(sharding.check_mesh(mesh), sharding.BATCH_SPEC)
    logits, cache = jaxkv.prefill(params, sharding.global_array(tokens, batch_sharding),
                                  sharding.global_array(start, batch_sharding), config=config, capacity=capacity,
                                  attention="xla", mesh=sharding.check_mesh(mesh))
    want, _ = jaxkv.prefill(model.params, tokens[:4], start[:4], config=GQA, capacity=capacity, attention="xla")
    np.testing.assert_allclose(np.asarray(logits)[:3], np.asarray(want)[:3], atol=LOGITS_ATOL, rtol=0)
    assert cache.keys[0].sharding.is_equivalent_to(NamedSharding(sharding.check_mesh(mesh), sharding.KV_SPEC), 4)


def test_batch_that_does_not_divide_the_data_axis():
    """5 prompts -> a power-of-two batch of 8 -> 9 rows on a data axis of 3 (6 of the 8 devices)."""
    rest = [[7, 8, 9, 10], [11]]
    prompts = PROMPTS + rest
    got = jaxkv.generate(model_for(GQA), prompts, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(3, 2))
    assert got.stats["padded_batch"] == 9
    # Greedy rows are independent: the one-device tokens from two batches of 3 (padded to 4), the shapes the
    # other tests' reference already compiled, not a batch of 8 compiled for this test alone.
    assert got.tokens == reference(GQA).tokens + reference(GQA, rest + [[9]]).tokens[:2]


def test_replicated_kv_heads_compute_the_same_attention():
    """The replication math on one device: wk/wv repeated 4x (K=2 -> 8, so G = 4 -> 1) give the same logits."""
    model = model_for(GQA)
    wide = GQA.replace(n_kv_heads=8)
    params = sharding.replicate_kv_heads(model.params, GQA, 8)
    assert params["layer_0"]["attn"]["wk"].shape == (64, 8, 8)  # [D, K, H]
    tokens = np.array([[5, 6, 7, 8, 9]])
    np.testing.assert_allclose(jaxkv.logits(jaxkv.Model(wide, params), tokens), jaxkv.logits(model, tokens),
                               atol=LOGITS_ATOL, rtol=0)


def test_kv_heads_that_do_not_divide_the_model_axis():
    """N=12 heads, K=3 KV heads on a model axis of 2: K' = lcm(3, 2) = 6, each KV head repeated twice."""
    config = jaxkv.Config(vocab_size=128, d_model=96, n_layers=1, n_heads=12, n_kv_heads=3, ffn_dim=64)
    assert sharding.sharded_kv_heads(config, mesh_of(4, 2)) == 6
    got = jaxkv.generate(model_for(config), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(4, 2))
    assert got.tokens == reference(config).tokens


def test_int8_cache_on_a_mesh_equals_single_device_int8():
    got = jaxkv.generate(model_for(GQA), PROMPTS, max_new_tokens=NEW, stop_tokens=[], cache_dtype="int8",
                         mesh=mesh_of(2, 4))
    ref = reference(GQA, cache_dtype="int8")
    assert got.tokens == ref.tokens
    assert got.stats["kv_cache_bytes_per_device"] == got.stats["kv_cache_bytes"] // 8


def test_sliding_window_ring_cache_on_a_mesh():
    """A window of 8 with a 20-token prompt: the ring wraps in prefill and in every decode step."""
    config = GQA.replace(sliding_window=8)
    prompts = PROMPTS + [list(range(20))]
    got = jaxkv.generate(model_for(config), prompts, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(2, 4))
    assert got.stats["cache_ring"] and got.stats["cache_capacity"] == 8
    assert got.tokens == reference(config, prompts).tokens


def test_pallas_attention_runs_per_shard(monkeypatch):
    """Pallas (interpreted on CPU) through shard_map on a (2, 4) mesh: same tokens as one device. Slow (the
    interpreter), so one small case."""
    wrapped = []
    real = sharding.shard_attention
    monkeypatch.setattr(sharding, "shard_attention", lambda fn, mesh: wrapped.append(mesh) or real(fn, mesh))
    got = jaxkv.generate(model_for(GQA), PROMPTS, max_new_tokens=4, stop_tokens=[], attention="pallas",
                         mesh=mesh_of(2, 4))
    assert wrapped, "the Pallas attention was not wrapped in shard_map"
    assert got.tokens == [t[:4] for t in reference(GQA).tokens]


def test_pmap_generation_equals_single_device():
    got = jaxkv.generate_pmap(model_for(GQA), PROMPTS, max_new_tokens=NEW, stop_tokens=[])
    assert got.tokens == reference(GQA).tokens
    assert got.stats["padded_batch"] == 8  # 3 prompts -> 4 -> a multiple of the 8 local devices
    assert got.stats["kv_cache_bytes_per_device"] == got.stats["kv_cache_bytes"] // 8


def test_pmap_stop_tokens_and_finish_reasons_match():
    ref = reference(GQA)
    stop = ref.tokens[0][2]
    want = jaxkv.generate(model_for(GQA), PROMPTS, max_new_tokens=NEW, stop_tokens=[stop])
    got = jaxkv.generate_pmap(model_for(GQA), PROMPTS, max_new_tokens=NEW, stop_tokens=[stop])
    assert (got.tokens, got.finish_reasons) == (want.tokens, want.finish_reasons)
    assert "stop" in got.finish_reasons


def test_decode_loop_never_moves_the_cache():
    """The compiled decode loop on a (2, 4) mesh: the expected all-reduces (attention output and FFN down
    projection, one each per layer, of [B/2, 1, D]) and no collective whose result is as large as one device's
    cache shard of a single layer's keys (the smallest thing that would mean cache traffic)."""
    mesh = sharding.check_mesh(mesh_of(2, 4))
    params, config = sharding.shard_params(model_for(GQA).params, GQA, mesh)
    B, S = 4, 256
    batch = NamedSharding(mesh, sharding.BATCH_SPEC)
    logits, cache = jaxkv.prefill(params, sharding.global_array(np.ones((B, 16), np.int32), batch),
                                  sharding.global_array(np.zeros((B,), np.int32), batch), config=config, capacity=S,
                                  attention="xla", mesh=mesh)
    rep = NamedSharding(mesh, P())
    put = lambda x: jax.tree.map(lambda leaf: sharding.global_array(leaf, rep), x)  # noqa: E731
    args = (params, cache, logits, put(jax.random.PRNGKey(0)), put(jaxkv.Sampler.make()),
            put(np.full((8,), -1, np.int32)))
    text = jaxkv.decode.lower(*args, config=config, steps=5, attention="xla", mesh=mesh).compile().as_text()
    collectives = hlo.collectives(text)
    shard = (B // 2) * (config.n_kv_heads // 4) * S * config.head_dim  # one layer's keys on one device
    assert f"f32[{B // 2},{config.n_kv_heads // 4},{S},{config.head_dim}]" in text  # the cache is really split
    big = [c for c in collectives if c[1] >= shard]
    assert not big, big
    all_reduces = [c for c in collectives if c[0] == "all-reduce" and c[1] == (B // 2) * GQA.d_model]
    assert len(all_reduces) == 2 * GQA.n_layers, collectives
    # And each device's cache shard is still updated in place: every K/V buffer aliased input -> output.
    alias = next((ln for ln in text.splitlines() if "input_output_alias" in ln), "")
    assert alias.count("may-alias") + alias.count("must-alias") >= 2 * GQA.n_layers, alias


@pytest.mark.parametrize("mesh, message", [
    ("not a mesh", "must be a jax.sharding.Mesh"),
    (Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "heads")), "mesh axes must be"),
    (Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model")), None),  # ffn 128 ok, n_heads 4: below
])
def test_bad_meshes_are_refused(mesh, message):
    config = GQA.replace(n_heads=4, n_kv_heads=2, d_model=64)
    with pytest.raises(ValueError, match=message or r"n_heads \(4\) must be divisible by the mesh's 'model' axis"):
        jaxkv.generate(model_for(config), PROMPTS, max_new_tokens=2, mesh=mesh)


def test_ffn_must_divide_the_model_axis():
    config = GQA.replace(ffn_dim=102)
    with pytest.raises(ValueError, match=r"ffn_dim \(102\) must be divisible"):
        jaxkv.generate(model_for(config), PROMPTS, max_new_tokens=2, mesh=mesh_of(2, 4))


def test_stream_on_a_mesh_reports_every_token():
    streamed = {b: [] for b in range(len(PROMPTS))}
    got = jaxkv.generate(model_for(GQA), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(2, 4),
                         stream=lambda b, token: streamed[b].append(token))
    assert got.tokens == reference(GQA).tokens
    assert [streamed[b] for b in range(len(PROMPTS))] == got.tokens


def test_stream_is_refused_by_pmap():
    with pytest.raises(ValueError, match="stream is not supported by generate_pmap"):
        jaxkv.generate_pmap(model_for(GQA), PROMPTS, max_new_tokens=2, stream=print)


def _script():
    """scripts/generate_sharded.py, loaded by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("generate_sharded", SCRIPTS / "generate_sharded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_generates_on_a_mesh_and_prints_per_device_bytes(capsys):
    """The bundled model on a (2, 2) mesh: the same tokens as one device, and the per-device cache bytes line."""
    want = jaxkv.generate(jaxkv.load("tiny"), ["The KV cache"], max_new_tokens=4).tokens[0]
    assert _script().main(["--data", "2", "--model", "2", "--prompt", "The KV cache", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert str(want) in out
    assert "mesh data=2 x model=2" in out and "per device" in out


@pytest.mark.parametrize("argv, message", [
    (["--data", "2", "--model", "8"], "a 2 x 8 mesh needs 16 devices, 8 available"),
    (["--model", "3"], "--model 3 does not divide the 8 devices"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
])
def test_script_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert _script().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_sampled_tokens_equal_single_device():
    """Sampling (temperature, top-k, top-p) on a (2, 4) mesh draws the same tokens as one device: the PRNG key is
    replicated and JAX's partitionable threefry gives the same bits however the [B, V] draw is split."""
    kwargs = dict(max_new_tokens=NEW, stop_tokens=[], temperature=1.0, top_k=20, top_p=0.9, seed=3)
    want = jaxkv.generate(model_for(GQA), PROMPTS, **kwargs)
    # With a stream (ignored): the sampler is traced, so this runs the (2, 4) program with a stream that
    # test_mesh_generation_equals_single_device[shape1] and the stream test run, instead of compiling its own.
    got = jaxkv.generate(model_for(GQA), PROMPTS, mesh=mesh_of(2, 4), stream=lambda b, token: None, **kwargs)
    assert got.tokens == want.tokens


def test_layout_rules():
    """The specs the module docstring promises, derived from logical axes; a mesh axis is never used twice."""
    assert sharding.KV_SPEC == P("data", "model", None, None)
    assert sharding.KV_SCALE_SPEC == P("data", "model", None)
    shardings = sharding.param_shardings(model_for(GQA).params, sharding.check_mesh(mesh_of(2, 4)), GQA)
    attn, mlp = shardings["layer_0"]["attn"], shardings["layer_0"]["mlp"]
    assert attn["wq"].spec == P(None, "model", None) and attn["wk"].spec == P(None, "model", None)
    assert attn["wo"].spec == P("model", None, None)
    assert mlp["w_gate"].spec == P(None, "model") and mlp["w_down"].spec == P("model", None)  # [D, F], [F, D]
    # A config whose matrices reach OUT_IN_ELEMENTS stores them [out, in]: the same axes, transposed.
    big = GQA.replace(d_model=2048, ffn_dim=1024, n_heads=8, n_kv_heads=2, head_dim=256)
    params = jaxkv.model.param_shapes(big)
    shardings = sharding.param_shardings(params, sharding.check_mesh(mesh_of(2, 4)), big)
    attn, mlp = shardings["layer_0"]["attn"], shardings["layer_0"]["mlp"]
    assert params["layer_0"]["attn"]["wq"].shape == (8, 256, 2048) and attn["wq"].spec == P("model", None, None)
    assert attn["wo"].spec == P(None, "model", None)
    assert mlp["w_gate"].spec == P("model", None) and mlp["w_down"].spec == P(None, "model")
    assert shardings["embedding"].is_fully_replicated and shardings["lm_head"].is_fully_replicated
    # In bfloat16 every projection is [in, out], however wide (`layers.stored_out_in`), with the [in, out] specs.
    params = jaxkv.model.param_shapes(big.replace(dtype="bfloat16"))
    shardings = sharding.param_shardings(params, sharding.check_mesh(mesh_of(2, 4)), big.replace(dtype="bfloat16"))
    assert params["layer_0"]["attn"]["wq"].shape == (2048, 8, 256)
    assert shardings["layer_0"]["attn"]["wq"].spec == P(None, "model", None)
    assert shardings["layer_0"]["mlp"]["w_down"].spec == P("model", None)
    with pytest.raises(ValueError, match="a mesh axis used twice"):
        sharding.spec((sharding.HEADS, sharding.FFN))


def test_paged_samples_on_a_mesh_equal_single_device():
    """n = 3 sampled on a 1 x 4 mesh: the pools split over KV heads (2 repeated to 4), the weights Megatron-style;
    every sample equals the single-device run's (same seed), and the pages all come back."""
    kwargs = dict(n=3, temperature=0.9, seed=4, page_size=4)
    got = jaxkv.generate(model_for(GQA), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(1, 4), **kwargs)
    assert got.tokens == reference(GQA, **kwargs).tokens
    assert got.stats["n"] == 3 and got.stats["pages_in_use_peak"] > 0


def test_prefix_cache_on_a_mesh_equals_single_device():
    """A PrefixCache(mesh=) reused by two generate calls on a 1 x 2 mesh: the second hits the first's prompt
    pages; greedy tokens equal one device's. A cache for one device, or a data axis > 1, is refused."""
    model, mesh = model_for(GQA), mesh_of(1, 2)
    pc = jaxkv.PrefixCache(model, num_pages=32, page_size=4, mesh=mesh)
    header = list(range(10, 22))
    first = jaxkv.generate(model, [header + [3]], max_new_tokens=NEW, stop_tokens=[], prefix_cache=pc, mesh=mesh)
    second = jaxkv.generate(model, [header + [5, 6]], max_new_tokens=NEW, stop_tokens=[], prefix_cache=pc, mesh=mesh)
    assert second.stats["prefix_hit_tokens"] == 12
    # One device's contiguous cache (paged greedy equals it: tests/cache/test_paged.py and the paged tests above),
    # with a third prompt: a padded batch of 4 in the 16-token prompt bucket, the programs reference(GQA) compiled.
    want = reference(GQA, [header + [3], header + [5, 6], [9]]).tokens[:2]
    assert [first.tokens[0], second.tokens[0]] == want
    with pytest.raises(ValueError, match="laid out for one device"):
        jaxkv.generate(model, [header], max_new_tokens=2, prefix_cache=jaxkv.PrefixCache(model, num_pages=8,
                                                                                          page_size=4), mesh=mesh)
    with pytest.raises(ValueError, match="'data' axis must be 1"):
        jaxkv.generate(model, [header], max_new_tokens=2, n=2, mesh=mesh_of(2, 2))


# gpt-oss's and Llama 4's pieces (issue 32): sinks split over the model axis with the heads, alternating ring and
# full layers, the gpt-oss experts; chunked rings, NoPE layers with temperature, the L2 q/k norm, input-scaled
# experts beside a dense layer.
GPT_OSS_LIKE = jaxkv.Config(
    vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=32, qkv_bias=True,
    out_bias=True, attention_sinks=True, layer_types=("sliding_attention", "full_attention"), sliding_window=4,
    moe=jaxkv.MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=32, scoring="topk_softmax",
                        router_logit_bias=True, expert_bias=True, swiglu_limit=2.0))
LLAMA4_LIKE = jaxkv.Config(
    vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
    layer_types=("chunked_attention", "full_attention"), attention_chunk_size=4, nope_layers=(1,), qk_l2_norm=True,
    attn_temperature=(2.0, 0.1),
    moe=jaxkv.MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=32, shared_expert_ffn_dim=32,
                        scoring="topk_sigmoid", scale_expert_input=True, dense_layers=(0,)))


# A diagonal: each family once, each layout once (each case compiles its own prefill and decode loop, on the mesh
# and on one device). Left: gpt-oss's pieces paged on a mesh and Llama 4's contiguous on a mesh; the paged pools'
# split over a mesh is test_paged_samples_on_a_mesh_equal_single_device's and the prefix cache's, both families paged
# (n = 2 forks) on one device tests/families/test_gpt_oss.py's and test_llama4.py's
# test_decoding_paths_equal_transformers[n=2], and the contiguous mesh layout every other test here.
@pytest.mark.parametrize("config, shape, paged", [(GPT_OSS_LIKE, (2, 2), False), (LLAMA4_LIKE, (1, 2), True)],
                         ids=["2x2-gpt-oss", "1x2-paged-llama4"])
def test_issue_32_families_on_a_mesh_equal_single_device(config, shape, paged):
    """Prompts of 1-5 tokens and 8 new ones cross the window / chunk of 4 (the rings wrap); the same tokens as
    one device, contiguous and paged (n = 2 forks)."""
    kwargs = dict(n=2, page_size=4) if paged else {}
    got = jaxkv.generate(model_for(config), PROMPTS, max_new_tokens=NEW, stop_tokens=[], mesh=mesh_of(*shape),
                         **kwargs)
    assert got.tokens == reference(config, **kwargs).tokens
