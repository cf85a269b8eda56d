"""DeepSeek-V2/V3 (multi-head latent attention, dense FFN layers) against transformers, and the latent cache.

Tiny random HF models are built here, saved as safetensors and loaded with `jaxkv.load`: logits (float32, atol
1e-4) and 32 greedy tokens must equal transformers', single prompt and a left-padded ragged batch of 3. The
absorbed decode over the latent cache must equal the expanded no-cache recompute, the compiled decode step must
form nothing per head of cache length, and bad checkpoints must fail naming the tensor. Every layer is dense
(first_k_dense_replace = num_hidden_layers): mixture-of-experts layers are another module's.
"""

import json
import math
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxkv  # noqa: E402
from jaxkv.config import Config, Mla, YarnScaling  # noqa: E402

from helpers.hf import (MLA_LIKE, RAGGED, SINGLE, VOCAB, build_hf,  # noqa: E402
                        check_greedy_generation_is_token_identical, check_logits_match, check_speculative_greedy,
                        hf_greedy, hf_logits)
from helpers.models import left_pad  # noqa: E402
from helpers.tolerances import atol, by_dtype  # noqa: E402

# Tolerances, keyed by what is compared (their reasons: helpers.tolerances).
ATOL_HF = atol("transformers logits")
ATOL_ABSORBED = atol("mla absorbed")
ATOL_QUANTIZED = {dtype: tol["atol"] for dtype, tol in by_dtype("quantized latent cache").items()}
ATOL_16_BIT = {dtype: tol["atol"] for dtype, tol in by_dtype("16-bit weights").items()}

# MLA_LIKE (helpers.hf): every layer dense (first_k_dense_replace = num_hidden_layers); its dimensions, by name here
HEADS, RANK, ROPE, NOPE, V_DIM = (MLA_LIKE[f] for f in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                                                         "qk_nope_head_dim", "v_head_dim"))
Q_RANK = 24
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9, mscale_all_dim=0.8,
            original_max_position_embeddings=64)  # factor = 256 / 64, as transformers expects

# name -> (config class, config kwargs, seed). Each covers one mapping feature the others do not. Seeds are picked
# so that every greedy row has at least 8 distinct tokens (the parity test refuses repetitive output).
CASES = {
    "v3-q-lora": ("DeepseekV3Config", dict(MLA_LIKE, q_lora_rank=Q_RANK), 5),
    # a direct q_proj, and the rotary columns in halves rather than DeepSeek's interleaved pairs
    "v3-no-q-lora-halves": ("DeepseekV3Config", dict(MLA_LIKE, q_lora_rank=None, rope_interleave=False), 3),
    # mscale and mscale_all_dim change the rotary magnitude and the softmax scale
    "v3-yarn": ("DeepseekV3Config", dict(MLA_LIKE, q_lora_rank=Q_RANK, rope_parameters=YARN), 4),
    # V2's complex-number rotary; attention_bias (q_a_proj, kv_a_proj_with_mqa, o_proj), set to random values
    "v2-bias": ("DeepseekV2Config", dict(MLA_LIKE, q_lora_rank=Q_RANK, attention_bias=True), 5),
}


_BUILT = {}  # name -> pair: each case built once per module, whichever test (or indirect parametrization) asks


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, HF model, jaxkv model loaded from its save_pretrained directory, that directory)."""
    if request.param in _BUILT:
        return _BUILT[request.param]
    config_class, kwargs, seed = CASES[request.param]
    hf = build_hf(config_class, kwargs, seed=seed)
    with torch.no_grad():  # transformers initializes biases to zero, which would hide a mis-mapped one
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory, safe_serialization=True)
    _BUILT[request.param] = request.param, hf, jaxkv.load(directory), directory
    return _BUILT[request.param]


# transformers parity of logits (atol 1e-4) and of 32 greedy tokens (single prompt, ragged batch of 3): the same
# test bodies as for the other families (helpers.hf), run on this module's DeepSeek `pair`s.
def test_logits_match(pair):
    check_logits_match(pair)


# Greedy tokens for V2 and V3 (the speculative test's model). The two other V3 variants differ from v3-q-lora only in
# what test_logits_match and test_cached_logits_match check against transformers at 1e-4 on their own models (the
# direct q_proj and halves rotary, YaRN's mscales), the latter through prefill and the cached absorbed decode steps.
@pytest.mark.parametrize("pair", ["v2-bias", "v3-q-lora"], indirect=True)
def test_greedy_generation_is_token_identical(pair):
    check_greedy_generation_is_token_identical(pair)


def test_config_maps_the_mla_fields(pair):
    name, hf, model, _ = pair
    cfg, hf_cfg = model.config, hf.config
    assert cfg.mla == Mla(kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                          q_lora_rank=hf_cfg.q_lora_rank)
    assert (cfg.n_kv_heads, cfg.head_dim) == (1, RANK + ROPE)  # the cache's geometry: one row per token
    assert cfg.qkv_bias == cfg.out_bias == (name == "v2-bias")
    assert isinstance(cfg.rope_scaling, YarnScaling) == (name == "v3-yarn")
    assert cfg.param_count() == sum(p.numel() for p in hf.parameters())


def test_cached_logits_match(pair):
    """Prefill (expanded form) then decode steps (absorbed form, over the latent cache) against transformers'
    logits of the whole sequence."""
    name, hf, model, _ = pair
    prompt = SINGLE[0]
    sequence = prompt + hf_greedy(hf, [prompt], new_tokens=8)[0]
    expected = hf_logits(hf, [sequence])[0]
    # 4 copies padded to 16 in a cache of 256: the batch, length and capacity generate gives the single prompt in
    # test_greedy_generation_is_token_identical (its compiled prefill, for the cases that test runs)
    tokens, start = left_pad([prompt] * 4, 16)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=model.config, capacity=256)
    for b in range(4):
        np.testing.assert_allclose(logits[b], expected[len(prompt) - 1], atol=ATOL_HF, rtol=0, err_msg=name)
    for i, token in enumerate(sequence[len(prompt):]):
        logits, cache = jaxkv.decode_step(model.params, jnp.full((4,), token, jnp.int32), cache, config=model.config)
        for b in range(4):
            np.testing.assert_allclose(logits[b], expected[len(prompt) + i], atol=ATOL_HF, rtol=0,
                                       err_msg=f"{name}, step {i}, row {b}")


# --- the latent cache, without transformers ---------------------------------------------------------------------

CONFIG = Config(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=HEADS, ffn_dim=80, max_positions=256,
                mla=Mla(kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                        q_lora_rank=Q_RANK),
                rope_scaling=YarnScaling(factor=4.0, original_max_positions=64, mscale=0.9, mscale_all_dim=0.8))


@pytest.fixture(scope="module")
def model():
    return jaxkv.Model.random(CONFIG, seed=3)


@pytest.mark.parametrize("window", [None, 8], ids=["plain", "ring-window8"])
def test_absorbed_decode_equals_the_expanded_recompute(model, window):
    """33 cached steps over a left-padded ragged batch (prefill expands, each step reads only the latent rows)
    against the no-cache recompute of each row alone, which expands per-head keys and values. With a sliding
    window of 8 the cache is a ring of 8 latent rows, shorter than one prompt, wrapped 5 times."""
    # the ragged batch at capacity 64: the plain case's prefill and decode step are the ones the float32 runs below
    # compile (the quantized, Pallas and 16-bit tests)
    prompts, steps = RAGGED, 33
    config = CONFIG.replace(sliding_window=window)
    model = jaxkv.Model(config, model.params)
    tokens, start = left_pad(prompts)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=config, capacity=window or 64,
                                  ring=window is not None)
    cached, fed = [np.asarray(logits)], []
    for _ in range(steps):
        fed.append(np.argmax(cached[-1], axis=-1).astype(np.int32))
        logits, cache = jaxkv.decode_step(model.params, jnp.asarray(fed[-1]), cache, config=config)
        cached.append(np.asarray(logits))
    cached, fed = np.stack(cached, axis=1), np.stack(fed, axis=1)  # [B, steps + 1, V], [B, steps]
    # Each row's recompute alone, in one call: right-padded to one length (causal: the padding after a row's tokens
    # changes none of their logits).
    rows = [prompt + fed[b].tolist() for b, prompt in enumerate(prompts)]
    padded = [row + [0] * (max(map(len, rows)) - len(row)) for row in rows]
    recompute = jaxkv.logits(model, padded)
    for b, prompt in enumerate(prompts):
        full = recompute[b, :len(rows[b])]  # [len + steps, V]
        np.testing.assert_allclose(cached[b], full[len(prompt) - 1:], atol=ATOL_ABSORBED, rtol=0, err_msg=f"row {b}")
    assert len(set(fed[1].tolist())) >= 8  # varied tokens: the positions really differ
    if window is not None:  # the window matters: without it the same tokens give other logits
        unwindowed = jaxkv.logits(jaxkv.Model(CONFIG, model.params), padded)[1]  # row 1, the longest: no padding
        assert np.abs(unwindowed - recompute[1]).max() > 0.1


def test_sampling_and_stop_tokens(model):
    """generate's settings act on an MLA model as on any other: a stop token ends its row, a seed fixes samples."""
    greedy = jaxkv.generate(model, RAGGED, max_new_tokens=12, stop_tokens=[]).tokens
    stop = greedy[1][3]
    stopped = jaxkv.generate(model, RAGGED, max_new_tokens=12, stop_tokens=[stop])
    assert stopped.tokens[1] == greedy[1][: greedy[1].index(stop) + 1]
    assert stopped.finish_reasons[1] == "stop"
    sampled = [jaxkv.generate(model, RAGGED, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=seed,
                              stop_tokens=[]).tokens for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert sampled[0] != greedy


def test_cache_leaves_are_latent_rows_and_no_values(model):
    tokens, start = left_pad(RAGGED)
    for cache_dtype, scales in (("float32", False), ("int8", True)):
        _, cache = jaxkv.prefill(model.params, tokens, start, config=CONFIG, capacity=40, cache_dtype=cache_dtype)
        assert [k.shape for k in cache.keys] == [(3, 1, 40, RANK + ROPE)] * CONFIG.n_layers
        assert cache.values == () and cache.value_scales == ()
        assert [s.shape for s in cache.key_scales] == ([(3, 1, 40)] * CONFIG.n_layers if scales else [])
        assert cache.nbytes() == 3 * 40 * CONFIG.n_layers * (
            (RANK + ROPE) * (1 if scales else 4) + (4 if scales else 0))
    assert CONFIG.kv_bytes_per_token() == CONFIG.n_layers * (RANK + ROPE) * 4


@pytest.mark.parametrize("cache_dtype", sorted(ATOL_QUANTIZED))
def test_quantized_latent_caches_stay_close(model, cache_dtype):
    tokens, start = left_pad(RAGGED)
    runs = {}
    for dtype in ("float32", cache_dtype):
        logits, cache = jaxkv.prefill(model.params, tokens, start, config=CONFIG, capacity=64, cache_dtype=dtype)
        out = []
        for token in (11, 42, 7, 99, 130, 3, 58, 21):
            logits, cache = jaxkv.decode_step(model.params, jnp.full((3,), token, jnp.int32), cache, config=CONFIG)
            out.append(np.asarray(logits))
        runs[dtype] = np.stack(out)
    assert cache.dtype == cache_dtype and cache.quantized
    diff = np.abs(runs[cache_dtype] - runs["float32"]).max()
    assert 0 < diff < ATOL_QUANTIZED[cache_dtype], diff  # 0 would mean the cache was not quantized at all
    got = jaxkv.generate(model, RAGGED, max_new_tokens=8, stop_tokens=[], cache_dtype=cache_dtype).tokens
    assert [len(row) for row in got] == [8, 8, 8]


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_pallas_latent_decode_equals_xla(model, cache_dtype):
    """The decode step through the Pallas MLA kernel (interpreted on CPU) against the XLA reference."""
    tokens, start = left_pad(RAGGED)
    runs = {}
    for attention in ("xla", "pallas"):
        logits, cache = jaxkv.prefill(model.params, tokens, start, config=CONFIG, capacity=64, cache_dtype=cache_dtype)
        out = []
        for token in (11, 42, 7):
            logits, cache = jaxkv.decode_step(model.params, jnp.full((3,), token, jnp.int32), cache, config=CONFIG,
                                              attention=attention)
            out.append(np.asarray(logits))
        runs[attention] = np.stack(out)
    np.testing.assert_allclose(runs["pallas"], runs["xla"], atol=ATOL_ABSORBED, rtol=0)


@pytest.mark.parametrize("dtype", sorted(ATOL_16_BIT))
def test_16_bit_weights_decode_close_to_float32(model, dtype):
    """Prefill and cached decode with 16-bit weights (the cache in the same dtype) against float32; the absorbed
    step's per-head products then run in 16 bits (XLA:CPU has no unfused batched bf16 x bf16 -> f32 dot)."""
    tokens, start = left_pad(RAGGED)
    runs = {}
    for m in (model, jaxkv.checkpoint.cast(model, dtype)):
        logits, cache = jaxkv.prefill(m.params, tokens, start, config=m.config, capacity=64)
        out = [np.asarray(logits)]
        for token in (11, 42, 7, 99):
            logits, cache = jaxkv.decode_step(m.params, jnp.full((3,), token, jnp.int32), cache, config=m.config)
            out.append(np.asarray(logits))
        runs[m.config.dtype] = np.stack(out)
    assert cache.dtype == dtype
    diff = np.abs(runs[dtype] - runs["float32"]).max()
    assert 0 < diff < ATOL_16_BIT[dtype], diff


def _materialized(hlo: str) -> str:
    """The compiled HLO without the bodies of fusions: what a fusion computes element by element inside one loop
    (the decode's broadcast product of the query with each row, summed at once) is never stored as an array."""
    fused = set(re.findall(r"fusion\(.*?calls=(%[\w.-]+)", hlo))
    kept, keep = [], True
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation's header
            keep = line.split()[0] not in fused
        if keep:
            kept.append(line)
    return "\n".join(kept)


def _per_head_cache_arrays(hlo: str, batch: int, slots: int) -> list[str]:
    """Shapes in compiled HLO that have a dimension of `slots` (the cache length) and more elements than the
    latent rows themselves (batch x slots x (R + E)): per-head keys or values of cache length, however laid out.
    The scores [B, N, 1, S] are smaller."""
    limit = batch * slots * (RANK + ROPE)
    found = set()
    for dims in re.findall(r"\b(?:f32|bf16|f16|s8|f8e4m3fn)\[([\d,]+)\]", _materialized(hlo)):
        shape = tuple(int(d) for d in dims.split(","))
        if slots in shape and math.prod(shape) > limit:
            found.add(shape)
    return sorted(found)


def test_compiled_decode_step_holds_nothing_per_head_of_cache_length(model):
    batch, slots = 3, 40  # 40: no weight dimension of CONFIG has this size
    tokens, start = left_pad(RAGGED)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=CONFIG, capacity=slots, attention="xla")
    step = jaxkv.decode_step.lower(model.params, jnp.ones((batch,), jnp.int32), cache, config=CONFIG,
                                   attention="xla").compile().as_text()
    assert f"f32[{batch},1,{slots},{RANK + ROPE}]" in step  # the latent cache is there
    assert _per_head_cache_arrays(step, batch, slots) == []
    # The check does find per-head keys and values: the expanded recompute over `slots` tokens has them.
    full = jaxkv.model._full_forward.lower(model.params, jnp.ones((batch, slots), jnp.int32), config=CONFIG,
                                           attention="xla").compile().as_text()
    assert any(HEADS in shape and NOPE in shape for shape in _per_head_cache_arrays(full, batch, slots))


def test_save_and_load_round_trip(model, tmp_path):
    jaxkv.save(model, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.config == CONFIG
    # the shape of the absorbed test's recompute (3 x 46): the original model's forward is compiled already
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 46))
    np.testing.assert_array_equal(jaxkv.logits(loaded, tokens), jaxkv.logits(model, tokens))


def test_mla_params_round_trip_through_the_out_in_form(model):
    # A float32 matrix of 2**21 elements is stored [out, in], a smaller one [in, out]: both layouts, one model.
    wide = CONFIG.replace(d_model=2048, n_heads=8, ffn_dim=64, mla=Mla(
        kv_lora_rank=RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, q_lora_rank=None))
    shapes = jaxkv.model.param_shapes(wide)["layer_0"]["attn"]
    assert shapes["wq"].shape == (8, 128 + ROPE, 2048)  # 8 x 136 x 2048 >= 2**21: [out, in]
    assert shapes["wkv_a"].shape == (2048, RANK + ROPE)  # small: [in, out]
    params = jax.tree_util.tree_map(np.asarray, model.params)
    back = jaxkv.model.from_out_in(jaxkv.model.to_out_in(params, CONFIG), CONFIG)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, params, back))
    out_in = jaxkv.model.to_out_in(params, CONFIG)["layer_0"]["attn"]
    assert out_in["wq_b"].shape == (HEADS, NOPE + ROPE, Q_RANK) and out_in["wkv_a"].shape == (RANK + ROPE, 48)


# --- bad checkpoints ----------------------------------------------------------------------------------------------


def _edit_checkpoint(source, target, edit_tensors=None, edit_config=None):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    if edit_tensors:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    hf = build_hf(*CASES["v3-q-lora"][:2])
    directory = tmp_path_factory.mktemp("v3-bad-base")
    hf.save_pretrained(directory, safe_serialization=True)
    return directory


def test_missing_tensor_is_named(v3_dir, tmp_path):
    bad = _edit_checkpoint(v3_dir, tmp_path / "bad",
                           edit_tensors=lambda t: t.pop("model.layers.1.self_attn.kv_a_layernorm.weight"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.kv_a_layernorm\.weight' is missing"):
        jaxkv.load(bad)


def test_kv_b_proj_of_the_wrong_rank_is_named(v3_dir, tmp_path):
    def shrink(t):
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        t[name] = np.ascontiguousarray(t[name][:, : RANK - 4])

    bad = _edit_checkpoint(v3_dir, tmp_path / "bad", edit_tensors=shrink)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*\[N\*\(qk_nope\+v\), R\] = \[120, 16\]"):
        jaxkv.load(bad)


def test_config_ranks_inconsistent_with_the_tensors_are_named(v3_dir, tmp_path):
    bad = _edit_checkpoint(v3_dir, tmp_path / "bad", edit_config=lambda c: c.update(kv_lora_rank=RANK + 4))
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa\.weight.*has shape \[24, 48\]"):
        jaxkv.load(bad)


def test_q_lora_tensors_without_q_lora_rank_are_refused(v3_dir, tmp_path):
    def direct_q(config):
        config["q_lora_rank"] = None

    def add_q_proj(t):
        t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((HEADS * (NOPE + ROPE), 48), np.float32)
        t["model.layers.1.self_attn.q_proj.weight"] = np.zeros((HEADS * (NOPE + ROPE), 48), np.float32)

    bad = _edit_checkpoint(v3_dir, tmp_path / "bad", edit_tensors=add_q_proj, edit_config=direct_q)
    with pytest.raises(ValueError, match=r"q_a_(proj|layernorm)\.weight.* is not used"):
        jaxkv.load(bad)


def test_dense_checkpoint_claiming_moe_layers_names_the_missing_router(v3_dir, tmp_path):
    """Layer 1 becomes a mixture of experts (tests/test_deepseek_moe.py): its router is the first tensor missing."""
    bad = _edit_checkpoint(v3_dir, tmp_path / "bad", edit_config=lambda c: c.update(first_k_dense_replace=1))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate\.weight' is missing"):
        jaxkv.load(bad)


def test_mla_config_validation():
    mla = Mla(kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM)
    with pytest.raises(ValueError, match="n_kv_heads must be 1 and head_dim 24"):
        Config(vocab_size=10, d_model=48, n_layers=1, n_heads=HEADS, n_kv_heads=HEADS, mla=mla)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        Mla(kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=7, v_head_dim=V_DIM)
    with pytest.raises(ValueError, match="q_lora_rank"):
        Mla(kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, q_lora_rank=0)


@pytest.mark.parametrize("pair", ["v3-q-lora"], indirect=True)
def test_speculative_greedy_equals_transformers(pair):
    """MLA's latent cache under a (k + 1)-wide verify."""
    name, hf, model, _ = pair
    check_speculative_greedy(model, hf_greedy(hf, RAGGED), name)
