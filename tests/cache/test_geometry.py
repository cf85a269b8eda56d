"""Per-layer caches: models that mix sliding-window (local) and full-attention (global) layers (Gemma 2/3,
`Config.layer_types`). Each local layer's cache is a ring of its window, each global layer's full length; decoding
through that mix equals recomputing the whole sequence, and the bytes equal the planner's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache import planner as memory
from jaxkv.cache import KVCache
from jaxkv.config import Config, LinearScaling, ProportionalRope
from helpers.models import placed_like, recompute

WINDOW = 6
LOCAL, GLOBAL = "sliding_attention", "full_attention"
# Five local layers per global one would need 6 layers; 2:1 keeps the model tiny and still mixes both kinds, with
# the global layer in the middle (so neither kind is only first or last).
TYPES = (LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL)


def mixed_config(**changes) -> Config:
    """A tiny Gemma-3-shaped model: local and global layers, their own rope bases, q/k norms, sandwich norms."""
    base = dict(vocab_size=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                sliding_window=WINDOW, layer_types=TYPES, rope_theta=10000.0, rope_local_theta=100.0,
                rope_scaling=LinearScaling(2.0), embed_scale=32 ** 0.5, qk_norm=True, post_norms=True,
                norm_kind="gemma_rmsnorm", ffn_kind="geglu", query_pre_attn_scalar=16.0, max_positions=256)
    return Config(**{**base, **changes})


def random_model(config: Config, seed: int = 0) -> jaxkv.Model:
    """Random weights with non-zero norm weights (a Gemma norm's zero weight would hide a (1 + w) vs w mistake)."""
    model = jaxkv.Model.random(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype) if path[-1].key == "scale" else x,
        model.params)
    return jaxkv.Model(config, params)


PROMPTS = [[5, 9, 12, 3, 7, 1, 22, 40, 8, 13, 2, 60, 31], [4, 17, 9], [33, 2, 8, 19, 50, 11, 6, 7]]


def test_cache_leaves_are_rings_on_local_layers_and_full_on_global_ones():
    config = mixed_config()
    cache = KVCache.allocate(config, 3, 64, ring=True, dtype="int8")
    for layer, kind in enumerate(TYPES):
        S = WINDOW if kind == LOCAL else 64
        assert cache.keys[layer].shape == (3, 2, S, 8) and cache.values[layer].shape == (3, 2, S, 8)
        assert cache.key_scales[layer].shape == (3, 2, S)
        assert cache.layer_ring(layer) == (kind == LOCAL)
    assert cache.capacity == 64 and not cache.ring
    # Bytes: 2 global layers x 64 slots + 4 local layers x 6, each slot K and V int8 + two float32 scales.
    per_slot = 2 * 2 * (8 + 4)
    assert cache.nbytes() == 3 * (2 * 64 + 4 * WINDOW) * per_slot
    assert cache.nbytes() == memory.kv_cache_bytes(config, tokens=64, batch=3, cache_dtype="int8")
    # Without rings every layer keeps every slot: what the full-length planner figure counts.
    plain = KVCache.allocate(config, 3, 64, ring=False, dtype="int8")
    assert {k.shape[2] for k in plain.keys} == {64}
    assert plain.nbytes() == memory.full_length_cache_bytes(config, tokens=64, batch=3, cache_dtype="int8")


# The planner and recompute tests decode NEW tokens from PROMPTS: one compiled prefill and decode loop for both (a
# loop's step count is part of its program; 40 steps of this model run in milliseconds).
NEW = 40


def test_generate_allocates_what_the_planner_says():
    model = random_model(mixed_config())
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[])
    plan = memory.plan_cache(model.config, [len(p) for p in PROMPTS], NEW)
    assert plan.ring and plan.capacity == 256
    assert out.stats["kv_cache_bytes"] == plan.allocated_bytes
    per_slot = 2 * 2 * 8 * 4
    assert plan.allocated_bytes == plan.padded_batch * (2 * 256 + 4 * WINDOW) * per_slot


def test_cached_decoding_equals_recompute_past_many_ring_wraps():
    """40 steps from prompts longer than the window (13 tokens; the rings of 6 wrap ~9 times), a ragged batch: each
    greedy token is the argmax of the no-cache forward pass over everything before it (one pass over the
    sequences, right-padded)."""
    model = random_model(mixed_config())
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[])
    fulls = recompute(model, [prompt + list(tokens) for prompt, tokens in zip(PROMPTS, out.tokens)])
    for prompt, tokens, logits in zip(PROMPTS, out.tokens, fulls):
        assert list(tokens) == [int(np.argmax(logits[len(prompt) - 1 + j])) for j in range(NEW)]


def test_logits_of_every_decode_step_equal_recompute():
    """Logit-level: prefill + 40 jitted decode steps through the research-loop pieces; each step's logits against
    the no-cache forward pass over the final sequence (1e-4, float32)."""
    import functools

    model = random_model(mixed_config())
    prompt = PROMPTS[0]
    logits, cache = jaxkv.prefill(model.params, jnp.asarray([prompt], jnp.int32), jnp.zeros(1, jnp.int32),
                                  config=model.config, capacity=64, ring=True, attention="xla")
    assert [k.shape[2] for k in cache.keys] == [WINDOW if t == LOCAL else 64 for t in TYPES]
    step = jax.jit(functools.partial(jaxkv.Decoder(model.config).apply, attention="xla"))
    rows, seq = [np.asarray(logits)[0]], list(prompt)  # prefill gives [B, V], a step [B, 1, V]
    for _ in range(40):
        seq.append(int(np.argmax(rows[-1])))
        logits, cache = step({"params": model.params}, jnp.asarray([[seq[-1]]], jnp.int32), cache.positions(1), cache)
        rows.append(np.asarray(logits)[0, -1])
    want = jaxkv.logits(model, [seq])[0, len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(rows), want, rtol=1e-4, atol=1e-4)


def test_a_chunk_into_a_ring_layer_is_refused_and_a_plain_cache_takes_it():
    """A chunk of several tokens on a cache with rings cannot be attended right once a ring is full (its later
    tokens overwrite slots its earlier ones see): a ValueError before compute. The same chunk on the mixed model's
    plain cache (ring=False: every layer full length, windows masked) equals recompute."""
    model = random_model(mixed_config())
    prompt, chunk = PROMPTS[0][:4], [9, 14, 21, 3, 30]
    start = jnp.zeros(1, jnp.int32)
    _, ring_cache = jaxkv.prefill(model.params, jnp.asarray([prompt], jnp.int32), start, config=model.config,
                                  capacity=64, ring=True, attention="xla")
    with pytest.raises(ValueError, match="takes one token per step after prefill"):
        model.apply(jnp.asarray([chunk], jnp.int32), ring_cache.positions(len(chunk)), ring_cache, attention="xla")
    _, cache = jaxkv.prefill(model.params, jnp.asarray([prompt], jnp.int32), start, config=model.config,
                             capacity=64, attention="xla")
    logits, cache = model.apply(jnp.asarray([chunk], jnp.int32), cache.positions(len(chunk)), cache, attention="xla")
    want = jaxkv.logits(model, [prompt + chunk])[0, len(prompt):]
    np.testing.assert_allclose(np.asarray(logits[0]), want, rtol=1e-4, atol=1e-4)


def test_a_ring_with_a_lookahead_takes_a_verify_block():
    """Rings allocated with lookahead k (a speculative verify's block: window + k slots, `KVCache.ring_lookahead`)
    take a chunk of up to k + 1 tokens after prefill, also over a ring that has wrapped and across its last index,
    attended as recompute; a chunk of k + 2 is refused before compute."""
    from jaxkv.decoding import programs

    model, k = random_model(mixed_config()), 4
    prompt, chunk = PROMPTS[0], [9, 14, 21, 3, 30]  # 13 prompt slots: the rings of 6 + 4 slots have wrapped
    _, cache = programs.prefill(model.params, jnp.asarray([prompt], jnp.int32), jnp.zeros(1, jnp.int32),
                                config=model.config, capacity=64, attention="xla", cache_dtype=None, ring=True,
                                mesh=None, lookahead=k)
    assert [cache.layer_capacity(i) for i in range(6)] == [WINDOW + k if t == "sliding_attention" else 64
                                                           for t in TYPES]
    for blocks in (1, 2):  # slots 13..17 (ring indices 3..7), then 18..22 (indices 8, 9, 0, 1, 2: across the end)
        logits, cache = model.apply(jnp.asarray([chunk], jnp.int32), cache.positions(len(chunk)), cache,
                                    attention="xla")
        seq = prompt + chunk * blocks
        want = jaxkv.logits(model, [seq])[0, len(seq) - len(chunk):]
        np.testing.assert_allclose(np.asarray(logits[0]), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="takes at most 5 tokens per step after prefill"):
        model.apply(jnp.asarray([chunk + [1]], jnp.int32), cache.positions(k + 2), cache, attention="xla")


def test_paged_cache_and_parallel_samples_decode_the_mixed_model():
    """The paged cache keeps every token on every layer and masks each layer's window: the same tokens."""
    model = random_model(mixed_config())
    contiguous = jaxkv.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=[])
    paged = jaxkv.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=[], page_size=4)
    assert paged.tokens == contiguous.tokens


def test_the_mix_matters():
    """The same weights with every layer global decode differently: the per-layer windows and rope bases are not
    silently ignored (one forward pass over a sequence longer than the window)."""
    model = random_model(mixed_config())
    seq = [PROMPTS[0] + PROMPTS[2]]
    mixed = jaxkv.logits(model, seq)
    other = jaxkv.Model(model.config.replace(layer_types=(GLOBAL,) * 6), model.params)
    assert np.abs(jaxkv.logits(other, seq) - mixed)[0, WINDOW:].max() > 1e-2  # past the window: different
    np.testing.assert_allclose(jaxkv.logits(other, seq)[0, :1], mixed[0, :1], rtol=1e-5, atol=1e-5)


def test_planner_for_a_gemma3_shaped_config_at_32k():
    """29 local layers (window 1,024) and 5 global ones, 4 KV heads of 256, bfloat16: per-layer rings against
    every layer keeping 32,768 tokens."""
    types = tuple(GLOBAL if (i + 1) % 6 == 0 else LOCAL for i in range(34))
    config = Config(vocab_size=1024, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256,
                    ffn_dim=10240, sliding_window=1024, layer_types=types, dtype="bfloat16", max_positions=131072)
    per_slot = 2 * 4 * 256 * 2
    assert memory.kv_cache_bytes(config, tokens=32768) == (5 * 32768 + 29 * 1024) * per_slot == 792_723_456
    assert memory.full_length_cache_bytes(config, tokens=32768) == 34 * 32768 * per_slot == 4_563_402_752


def test_memory_command_prints_both_figures(capsys, tmp_path):
    config = mixed_config()
    path = tmp_path / "jaxkv_config.json"
    from jaxkv.checkpoint import config_to_dict

    import json

    path.write_text(json.dumps(config_to_dict(config)))
    assert jaxkv.cli.main(["memory", "--config", str(path), "--tokens", "64", "--cache-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "4 local layers with a sliding window of 6, 2 global" in out
    assert "all layers full length" in out
    ring_bytes = memory.kv_cache_bytes(config, tokens=64)
    full_bytes = memory.full_length_cache_bytes(config, tokens=64)
    assert f"{ring_bytes:,}" in out and f"{full_bytes:,}" in out


def test_config_round_trips_through_save_and_load(tmp_path):
    model = random_model(mixed_config())
    jaxkv.save(model, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.config == model.config
    assert jaxkv.generate(loaded, PROMPTS[:1], max_new_tokens=6, stop_tokens=[]).tokens == \
        jaxkv.generate(placed_like(model, loaded), PROMPTS[:1], max_new_tokens=6, stop_tokens=[]).tokens


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=(LOCAL, GLOBAL)), "layer_types has 2 entries for 6 layers"),
    (dict(layer_types=("local",) * 6), "layer_types entries must be one of"),
    (dict(sliding_window=None), "sliding_attention layers but sliding_window is None"),
    (dict(attn_logit_softcap=-1.0), "attn_logit_softcap must be None or a finite number > 0"),
    (dict(rope_local_theta=0.0), "rope_local_theta must be None or > 0"),
    (dict(ffn_kind="reglu"), "ffn_kind must be"),
])
def test_bad_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        mixed_config(**changes)


@pytest.mark.parametrize("changes", [
    dict(),  # Gemma-3-shaped: q/k norms, per-layer rope bases
    dict(kv_shared_layers=2, global_head_dim=16, global_kv_heads=1, global_values_from_keys=True, value_norm=True,
         norm_kind="rmsnorm_f32", rope_scaling=ProportionalRope(0.5), per_layer_input_dim=4, layer_scalar=True),
    # Gemma-4-shaped: the last two layers read layers 3 (a ring) and 2 (full length), wider global heads
])  # capped scores (Gemma 2) in both kernels and both bodies: tests/test_softcap.py
def test_pallas_kernels_equal_xla_on_mixed_windows(changes):
    """The Pallas prefill and decode kernels (interpreted on CPU) on local rings and global full-length layers in
    one model, a prompt longer than the window and decode past several wraps: the same greedy tokens and logits."""
    model = random_model(mixed_config(**changes))
    prompts = [PROMPTS[0], PROMPTS[2]]
    kwargs = dict(max_new_tokens=10, stop_tokens=[])
    xla = jaxkv.generate(model, prompts, attention="xla", **kwargs)
    pallas = jaxkv.generate(model, prompts, attention="pallas", **kwargs)
    assert pallas.tokens == xla.tokens
    np.testing.assert_allclose(np.asarray(pallas.logprobs), np.asarray(xla.logprobs), rtol=1e-4, atol=1e-4)


def test_soft_capping_is_applied():
    """Capped scores and logits change the model (a cap of 2 on scores of a few units): the caps are not dropped
    on the way to the attention, and the logits are within (-cap, cap)."""
    model = random_model(mixed_config(attn_logit_softcap=2.0, final_logit_softcap=5.0))
    seq = [PROMPTS[0]]
    capped = jaxkv.logits(model, seq)
    assert np.abs(capped).max() < 5.0
    uncapped = jaxkv.logits(jaxkv.Model(model.config.replace(attn_logit_softcap=None), model.params), seq)
    assert np.abs(np.arctanh(uncapped.clip(-4.999, 4.999) / 5.0) * 5.0 - np.arctanh(capped / 5.0) * 5.0).max() > 1e-2
