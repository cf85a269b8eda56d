"""Weight-only quantization (`jaxkv.layers.quantized`, `jaxkv.load(..., weights=)`): a quantized model computes
what the float model of its dequantized weights computes, stays within a per-mode bound of float32, saves and
reloads bit-exactly, shards like the float model, and the planner counts the bytes `load` makes."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxkv
from jaxkv.cache import planner
from jaxkv.cli import main as cli_main
from jaxkv.layers import quantized
from jaxkv.model import quantize_weights

from helpers.engine import assert_all_free, drain
from helpers.models import CONFIGS, MLA_DENSE
from helpers.tolerances import atol, tolerance

SAME = tolerance("quantized vs dequantized float")
TEXT = ("The KV cache stores the keys and values of every earlier token, so each decoding step computes only the "
        "new token's projections.")

# The head dim of these models is 16 (wo's groups lie within a head): int4 in groups of 16.
LLAMA = jaxkv.Config(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
MOE = LLAMA.replace(moe=jaxkv.MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=32, n_shared_experts=1))
MODES = [jaxkv.WeightQuant("int8"), jaxkv.WeightQuant("fp8"), jaxkv.WeightQuant("int4", group_size=16)]

_tiny = {}


def tiny(weights=None) -> jaxkv.Model:
    if weights not in _tiny:
        _tiny[weights] = jaxkv.load("tiny", weights=weights)
    return _tiny[weights]


def dequantized_model(model: jaxkv.Model) -> jaxkv.Model:
    """The float model whose weights are `model`'s dequantized ones (float32 qvalue x scale, in the model dtype)."""
    dtype = jnp.dtype(model.config.dtype)
    params = jax.tree.map(lambda w: quantized.dequantized(w, dtype), model.params, is_leaf=quantized.is_quantized)
    return jaxkv.Model(model.config, params, model.tokenizer)


def tokens():
    return [tiny().tokenizer.encode(TEXT).ids]


# Measured on the bundled model over TEXT (31 tokens, logits of std 5.9, max 20): int8 0.083 (0.13 with the
# embeddings quantized), fp8 0.31 (0.58), int4 in groups of 64 1.49 (1.94). The bounds leave ~2x; a scale on the
# wrong axis or a weight read unquantized-as-int moves logits by far more (tens).
TINY_BOUND = {"int8": 0.3, "fp8": 1.2, "int4": 4.0}


@pytest.mark.parametrize("mode", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("embeddings", [False, True])
def test_bundled_model_logits_within_the_modes_bound_of_float32(mode, embeddings):
    quant = jaxkv.WeightQuant(mode, embeddings=embeddings)
    model = tiny(quant)
    assert model.weights == quant
    ref = jaxkv.logits(tiny(), tokens())
    got = jaxkv.logits(model, tokens())
    err = np.abs(got - ref).max()
    assert 0 < err < TINY_BOUND[mode], err  # 0 would mean nothing was quantized
    np.testing.assert_allclose(got, jaxkv.logits(dequantized_model(model), tokens()), **SAME)


@pytest.mark.parametrize("quant", MODES, ids=lambda q: q.mode)
@pytest.mark.parametrize("name", ["llama", "learned", "gqa-wide-heads", "mla", "moe"])
def test_quantized_model_equals_the_float_model_of_its_dequantized_weights(name, quant):
    """Every layer that reads a weight (q/k/v/o, the FFNs, MLA's projections and up-projections, the experts,
    a tied head) reads the quantized one as its dequantized value; and the logits stay near float32."""
    config = {"llama": LLAMA, "learned": CONFIGS["learned"], "gqa-wide-heads": CONFIGS["gqa-wide-heads"],
              "mla": MLA_DENSE, "moe": MOE}[name]
    if name == "gqa-wide-heads" and quant.mode == "int4":
        quant = dataclasses.replace(quant, group_size=8)  # head dim 24
    if name == "mla" and quant.mode == "int4":
        quant = dataclasses.replace(quant, group_size=4)  # v head dim 12
    model = jaxkv.Model.random(config, seed=1)
    q = quantize_weights(model, dataclasses.replace(quant, embeddings=True))
    ids = [list(range(1, 30))]
    got = jaxkv.logits(q, ids)
    np.testing.assert_allclose(got, jaxkv.logits(dequantized_model(q), ids), **SAME)
    ref = jaxkv.logits(model, ids)
    # random models' logits are O(1-4): int8 measured <= 0.09 from float32, fp8 <= 0.4, int4 (groups of 16) <= 1.
    # Not for the mixture of experts: a token whose router scores nearly tie may pick another expert once the
    # weights before the router are quantized, an O(1) change that is no error.
    if name != "moe":
        assert 0 < np.abs(got - ref).max() < {"int8": 0.3, "fp8": 1.2, "int4": 3.0}[quant.mode]
    # cached decoding of the quantized model: what recomputing it gives (right-padded to the 29 tokens above: causal,
    # so the padding changes none of the logits read, and `got`'s compiled forward pass serves). Every family in
    # int4 (groups: the most intricate scales) and every mode on llama, not all 15 pairs: a quantized weight is
    # dequantized before its product (`quantized.einsum`, MLA's wk_b / wv_b) in the cached path as in the forward
    # pass just compared, mode by mode, so a pair adds only a prefill and a decode loop to compile (~2 s each).
    if quant.mode != "int4" and name != "llama":
        return
    gen = jaxkv.generate(q, [[1, 2, 3, 4]], max_new_tokens=6, temperature=0, stop_tokens=[])
    full = jaxkv.logits(q, [[1, 2, 3, 4] + gen.tokens[0] + [0] * (len(ids[0]) - 10)])
    assert gen.tokens[0] == [int(t) for t in np.argmax(full[0, 3:9], axis=-1)]


def test_every_projection_is_quantized_and_nothing_else():
    model = quantize_weights(jaxkv.Model.random(MOE, seed=0), "int8")
    flat = {jax.tree_util.keystr(p): w for p, w in
            jax.tree_util.tree_flatten_with_path(model.params, is_leaf=quantized.is_quantized)[0]}
    names = {key.rsplit("'", 2)[-2]: quantized.is_quantized(w) for key, w in flat.items()}
    assert {n for n, q in names.items() if q} == {"wq", "wk", "wv", "wo", "we_gate", "we_up", "we_down", "ws_gate",
                                                   "ws_up", "ws_down"}
    assert not names["router"] and not names["embedding"] and not names["lm_head"] and not names["scale"]
    # per output channel: wq [D, N, H] ([in, out] here) has one scale per (n, h), none along D
    wq = flat["['layer_0']['attn']['wq']"]
    assert wq.qvalue.dtype == jnp.int8 and wq.scale.shape == (1, 4, 16) and wq.scale.dtype == jnp.float32


def test_int4_groups_lie_along_the_contracted_axis():
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 32))  # [in, out]
    q = quantized.quantize_params({"w_up": w}, jaxkv.WeightQuant("int4", group_size=16), frozenset({"w_up"}),
                                  {"w_up": (1, 0)})["w_up"]
    assert q.qvalue.dtype == jnp.int4 and q.scale.shape == (4, 32)
    # each group of 16 inputs of an output channel has its own scale: its largest magnitude maps to 7.5
    np.testing.assert_allclose(q.scale, np.abs(np.asarray(w)).reshape(4, 16, 32).max(axis=1) / 7.5, rtol=1e-6)
    assert np.abs(np.asarray(quantized.dequantized(q, jnp.float32)) - np.asarray(w)).max() <= \
        np.asarray(q.scale).max() / 2 + 1e-6  # round to nearest: at most half a step


# (shape, the reshape, how the weight is quantized): the layouts the layers merge. [heads, H, D] -> [heads H, D]
# per output channel, or in groups along D; [D, N, H] -> [D, N H] per channel (one scale along N H), or in groups
# of a head's H; [D, N, H] per (n, h) -> [D, N H] (wq stored [in, out]); and a -1 in the shape.
MERGES = [((3, 4, 8), (12, 8), dict(channelwise_axes=(0, 1))),
          ((3, 4, 8), (12, 8), dict(channelwise_axes=(0, 1), tiled_axes={2: 4})),
          ((8, 3, 4), (8, 12), dict(channelwise_axes=(0,))),
          ((8, 3, 4), (8, 12), dict(channelwise_axes=(0,), tiled_axes={1: 1, 2: 2})),
          ((8, 3, 4), (8, 12), dict(channelwise_axes=(1, 2))),
          ((8, 3, 4), (8, 12), dict(channelwise_axes=(1, 2), tiled_axes={0: 4})),
          ((3, 4, 8), (-1, 8), dict(channelwise_axes=(0, 1)))]


@pytest.mark.parametrize("shape, new, how", MERGES)
def test_merged_scales_follow_the_reshape(shape, new, how):
    import qwix

    w = jax.random.normal(jax.random.PRNGKey(1), shape)
    q = qwix.quantize(w, jnp.int8, scale_dtype=jnp.float32, **how)
    m = quantized.merged(q, new)
    np.testing.assert_array_equal(quantized.dequantized(m, jnp.float32),
                                  quantized.dequantized(q, jnp.float32).reshape(new))


@pytest.mark.parametrize("shape, new, how", [
    ((4, 8, 2), (32, 2), dict(channelwise_axes=(1,))),  # a scale per inner index, shared along the outer: no tile
    ((8, 3, 4), (8, 12), dict(channelwise_axes=(2,)))])
def test_merged_refuses_a_scale_that_cannot_follow(shape, new, how):
    import qwix

    q = qwix.quantize(jnp.ones(shape), jnp.int8, scale_dtype=jnp.float32, **how)
    with pytest.raises(ValueError, match="cannot follow"):
        quantized.merged(q, new)


def test_saved_and_reloaded_bit_exact(tmp_path):
    model = tiny(jaxkv.WeightQuant("int4"))
    jaxkv.save(model, tmp_path / "q")
    assert json.loads((tmp_path / "q" / "weights.json").read_text()) == {"mode": "int4", "group_size": 64,
                                                                         "embeddings": False}
    loaded = jaxkv.load(tmp_path / "q")
    assert loaded.weights == model.weights
    a, b = jax.tree.leaves(model.params), jax.tree.leaves(loaded.params)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).astype(np.float32), np.asarray(y).astype(np.float32))
    assert jax.tree.structure(model.params) == jax.tree.structure(loaded.params)
    np.testing.assert_array_equal(jaxkv.logits(loaded, tokens()), jaxkv.logits(model, tokens()))
    # loading it as what it is, is loading it; as anything else, an error (no second rounding)
    assert jaxkv.load(tmp_path / "q", weights=jaxkv.WeightQuant("int4")).weights == model.weights
    with pytest.raises(ValueError, match="stored quantized"):
        jaxkv.load(tmp_path / "q", weights="int8")
    with pytest.raises(ValueError, match="quantized"):
        jaxkv.load(tmp_path / "q", dtype="bfloat16")


def test_a_damaged_weights_file_is_a_clear_error(tmp_path):
    jaxkv.save(tiny(jaxkv.WeightQuant("int8")), tmp_path / "q")
    (tmp_path / "q" / "weights.json").write_text('{"mode": "int3"}')
    with pytest.raises(ValueError, match="weights.json.*int3"):
        jaxkv.load(tmp_path / "q")
    (tmp_path / "q" / "weights.json").unlink()  # quantized arrays without the file: refused, not misread
    with pytest.raises(ValueError, match="parameter"):
        jaxkv.load(tmp_path / "q")


@pytest.mark.parametrize("weights, match", [
    ("int3", "weights must be one of"), (8, "weights must be"),
    (jaxkv.WeightQuant("int4", group_size=48), "not a multiple of group_size 48.*divides 64")])
def test_bad_quantization_refused_before_anything_changes(weights, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.load("tiny", weights=weights)
    with pytest.raises(ValueError, match="group_size"):
        jaxkv.WeightQuant("int4", group_size=0)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(tiny(jaxkv.WeightQuant("int8")), "int8")


@pytest.mark.parametrize("quant", [None, "int8", "fp8", jaxkv.WeightQuant("int4"),
                                   jaxkv.WeightQuant("int4", embeddings=True)], ids=str)
def test_planner_counts_the_bytes_load_makes(quant):
    model = tiny(jaxkv.WeightQuant.of(quant))
    counted = planner.weight_bytes(model.config, weights=quant)
    # what the device holds, on every jax: int4 one per byte on jax 0.10's XLA:CPU, packed from 0.11 (int4_bits)
    assert counted == quantized.held_bytes(model.params)
    assert counted == quantized.packed_bytes(model.params, quantized.int4_bits())
    float_bytes = planner.weight_bytes(model.config)
    if quant in ("int8", "fp8"):  # a quarter of float32's, plus a float32 scale per output channel
        assert float_bytes / 4 < counted < float_bytes / 4 * 1.1 + 257 * 256 * 4 * 0.75
    # bfloat16's count: the float weights in 2 bytes, the quantized ones as before
    assert planner.weight_bytes(model.config, "bfloat16", weights=quant) <= counted


def test_int4_bits_is_what_the_device_allocates():
    held = jax.device_put(jnp.zeros((3, 1000), jnp.int4)).addressable_data(0).on_device_size_in_bytes()
    assert held == 3 * 1000 * quantized.int4_bits() // 8
    # XLA:CPU packs int4 from jax 0.11 (one per byte on 0.10.2): int4 weights then hold well under int8's
    packs = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
    assert quantized.int4_bits() == (4 if packs or jax.default_backend() != "cpu" else 8)
    if quantized.int4_bits() == 4:
        int8, int4 = (quantized.held_bytes(tiny(jaxkv.WeightQuant.of(q)).params) for q in ("int8", "int4"))
        assert int4 < 0.65 * int8  # half the values' bytes; the float32 group scales and float norms stay
    with pytest.raises(ValueError, match="int4_bits"):
        quantized.packed_bytes({}, int4_bits=2)


def test_generation_stats_report_the_bytes_held():
    model = tiny(jaxkv.WeightQuant("int8"))
    gen = jaxkv.generate(model, ["The KV cache"], max_new_tokens=4, temperature=0)
    assert gen.stats["weights"] == "int8"
    assert gen.stats["weight_bytes"] == quantized.held_bytes(model.params)
    float_gen = jaxkv.generate(tiny(), ["The KV cache"], max_new_tokens=4, temperature=0)
    assert float_gen.stats["weights"] is None
    assert float_gen.stats["weight_bytes"] == 12_332_032  # 3,083,008 float32 parameters
    assert gen.stats["weight_bytes"] < float_gen.stats["weight_bytes"] / 3
    # the roofline reads the quantized weights: a step moves fewer bytes
    assert gen.stats["bytes_per_step"] < float_gen.stats["bytes_per_step"] / 3


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


# int4 (group scales along the contracted axis, split with it) on both meshes; int8's per-channel scales on the
# (2, 4) one only: (1, 8) repeats wk / wv the same way for either mode (int4-shape1), and each case compiles its
# sharded prefill and decode loop (~6 s).
@pytest.mark.parametrize("quant, shape", [
    pytest.param(jaxkv.WeightQuant("int8"), (2, 4), id="int8-shape0"),
    pytest.param(jaxkv.WeightQuant("int4", group_size=8), (2, 4), id="int4-shape0"),
    pytest.param(jaxkv.WeightQuant("int4", group_size=8), (1, 8), id="int4-shape1")])
def test_sharded_quantized_model_equals_single_device(shape, quant):
    """8 query heads over 2 KV heads of 8: on a model axis of 4 or 8 the quantized wk / wv are repeated like
    float ones (their per-head scales with them), and the per-channel scales split with their weights."""
    config = jaxkv.Config(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=128)
    model = quantize_weights(jaxkv.Model.random(config, seed=1), quant)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    ref = jaxkv.generate(model, prompts, max_new_tokens=8, stop_tokens=[])
    got = jaxkv.generate(model, prompts, max_new_tokens=8, stop_tokens=[], mesh=mesh_of(*shape))
    assert got.tokens == ref.tokens
    np.testing.assert_allclose(np.array(got.logprobs), np.array(ref.logprobs), **tolerance("sharded vs one device"))


def test_engine_serves_a_quantized_model_as_generate_does():
    # test_quantized_model_equals_the_float_model_of_its_dequantized_weights[llama-int4]'s quantization (the
    # embeddings too): its compiled generate serves the references below
    model = quantize_weights(jaxkv.Model.random(LLAMA, seed=2),
                             jaxkv.WeightQuant("int4", group_size=16, embeddings=True))
    rng = np.random.default_rng(0)
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=8)
    arrivals = [([int(t) for t in rng.integers(1, 97, size=n)], 6, {}) for n in (3, 11, 5)]
    ids = drain(engine, arrivals, rng)
    assert_all_free(engine)
    for r in engine.results():
        prompt, new, _ = ids[r.id]
        assert r.tokens == jaxkv.generate(model, [prompt], max_new_tokens=new, stop_tokens=[]).tokens[0]


def test_moe_dispatches_agree_on_quantized_experts():
    from jaxkv.layers import moe as moe_lib

    model = quantize_weights(jaxkv.Model.random(MOE, seed=3), "int8")
    params = model.params["layer_0"]["mlp"]
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 64))
    # jitted: one compile per dispatch instead of dozens of op-by-op ones over the quantized experts
    outs = {d: jax.jit(moe_lib.Moe(MOE.moe, 64, "float32", dispatch=d).apply)({"params": params}, x)
            for d in moe_lib.DISPATCHES if d != "auto"}
    for d, y in outs.items():
        np.testing.assert_allclose(y, outs["dense"], atol=1e-5, err_msg=d)  # float32 sums in another order


def test_cli_generate_with_quantized_weights(capsys):
    assert cli_main(["generate", "--prompt", "The KV cache", "--max-new-tokens", "4", "--temperature", "0",
                     "--weights", "int4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    held = quantized.held_bytes(tiny(jaxkv.WeightQuant("int4")).params)
    assert out["weights"] == "int4" and out["weight_bytes"] == held
    for flags, match in [(["--weight-group-size", "32"], "need --weights"),
                         (["--weights", "int8", "--weight-group-size", "32"], "int4's"),
                         (["--weights", "int4", "--weight-group-size", "48"], "group_size 48")]:
        assert cli_main(["generate", "--prompt", "x", *flags]) == 2
        assert match in capsys.readouterr().err
