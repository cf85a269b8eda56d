"""The KV-cache pytree: what it holds, its masks, and in-place updates of donated buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from helpers.hlo import is_copy_of, is_whole_buffer_copy
from helpers.models import CONFIGS, model_for


def test_leaves_are_keys_values_and_declared_bookkeeping_only():
    cfg = CONFIGS["gqa-wide-heads"]  # N*H != D, so a cached query or hidden state would have a telltale shape
    cache = jaxkv.KVCache.allocate(cfg, batch=3, max_len=40)
    leaves = jax.tree_util.tree_leaves(cache)
    kv_shape = (3, cfg.n_kv_heads, 40, cfg.head_dim)
    assert len(leaves) == 2 * cfg.n_layers + 2
    assert [leaf.shape for leaf in cache.keys] == [kv_shape] * cfg.n_layers
    assert [leaf.shape for leaf in cache.values] == [kv_shape] * cfg.n_layers
    assert cache.start.shape == (3,) and cache.start.dtype == jnp.int32
    assert cache.length.shape == () and cache.length.dtype == jnp.int32
    # The bytes are exactly 2 x layers x KV heads x head dim x bytes per element per token (plus nothing else).
    assert cache.nbytes() == cfg.kv_bytes_per_token() * 3 * 40


def test_kv_bytes_per_token_formula():
    # The mission's worked example: 40 layers x 5120 width in fp16 = 819,200 bytes; 8 KV heads of 128: 163,840.
    mha = jaxkv.Config(vocab_size=10, d_model=5120, n_layers=40, n_heads=40, ffn_dim=16, dtype="float16")
    gqa = mha.replace(n_kv_heads=8, head_dim=128)
    assert mha.kv_bytes_per_token() == 819_200
    assert gqa.kv_bytes_per_token() == 163_840


def test_positions_follow_left_padding():
    cache = jaxkv.KVCache.allocate(CONFIGS["mqa"], batch=2, max_len=6, start=jnp.array([0, 2])).advance(3)
    np.testing.assert_array_equal(cache.positions(2), [[3, 4], [1, 2]])


def _aliased_params(compiled_text: str) -> str:
    line = next((ln for ln in compiled_text.splitlines() if "input_output_alias" in ln), "")
    return line


# The in-place tests use test_compiled_decode_never_copies_the_cache[3-float32]'s shapes (batch 3, 4 prompt tokens,
# capacity 48, 5 steps): one set of compiled programs serves them all.
def test_decode_step_updates_the_donated_cache_in_place():
    model = model_for("gqa")
    cfg = model.config
    _, cache = jaxkv.prefill(model.params, jnp.ones((3, 4), jnp.int32), jnp.zeros(3, jnp.int32), config=cfg,
                             capacity=48, attention="xla")
    tokens = jnp.ones((3,), jnp.int32)
    compiled = jaxkv.decode_step.lower(model.params, tokens, cache, config=cfg).compile()
    alias = _aliased_params(compiled.as_text())
    # Every key and value buffer (2 per layer) must be aliased input -> output.
    assert alias.count("may-alias") + alias.count("must-alias") >= 2 * cfg.n_layers, alias
    donated = list(cache.keys) + list(cache.values)
    _, new_cache = jaxkv.decode_step(model.params, tokens, cache, config=cfg)
    assert all(buf.is_deleted() for buf in donated)
    assert int(new_cache.length) == 5


def test_decode_loop_updates_the_donated_cache_in_place():
    model = model_for("gqa")
    cfg = model.config
    logits, cache = jaxkv.prefill(model.params, jnp.ones((3, 4), jnp.int32), jnp.zeros(3, jnp.int32), config=cfg,
                                  capacity=48, attention="xla")
    args = (model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.Sampler.make(), jnp.full((8,), -1))
    compiled = jaxkv.decode.lower(*args, config=cfg, steps=5, attention="xla").compile()
    alias = _aliased_params(compiled.as_text())
    assert alias.count("may-alias") + alias.count("must-alias") >= 2 * cfg.n_layers, alias
    donated = list(cache.keys) + list(cache.values)
    *_, new_cache = jaxkv.decode(*args, config=cfg, steps=5, attention="xla")
    assert all(buf.is_deleted() for buf in donated)
    assert int(new_cache.length) == 4 + 4


# bfloat16 is not in the list: XLA:CPU has no bfloat16 arithmetic and performs the first layer's cache update in
# float32 (convert, update, convert back), so that layer's K/V buffers are copied every step (docs/design/cache.md).
@pytest.mark.parametrize("batch, cache_dtype", [(1, "float32"), (3, "float32"), (1, "int8"), (3, "int8"),
                                                (1, "float16")])
def test_compiled_decode_never_copies_the_cache(batch, cache_dtype):
    """The cache must be updated in place inside the loop too: no `copy` (or transposing copy fusion) of a whole
    K/V buffer (or, for int8, a whole scale buffer) anywhere in the compiled decode step or scan loop. Batch 1
    matters: a size-1 batch dimension once made XLA:CPU copy every cache buffer every step; a `lax.cond` around the
    model did too. For 16-bit caches, a bare float32 upcast of the updated buffer in the attention did too."""
    model = model_for("gqa")
    cfg = model.config
    logits, cache = jaxkv.prefill(model.params, jnp.ones((batch, 4), jnp.int32), jnp.zeros(batch, jnp.int32),
                                  config=cfg, capacity=48, attention="xla", cache_dtype=cache_dtype)
    short = {"float32": "f32", "int8": "s8", "float16": "f16"}[cache_dtype]
    kv_shape = f"{short}[{batch},2,48,16]"
    args = (model.params, cache, logits, jax.random.PRNGKey(0), jaxkv.Sampler.make(), jnp.full((8,), -1))
    loop = jaxkv.decode.lower(*args, config=cfg, steps=5, attention="xla").compile().as_text()
    step = jaxkv.decode_step.lower(model.params, jnp.ones((batch,), jnp.int32), cache, config=cfg).compile().as_text()
    scale_shape = f"[{batch},2,48]" if cache_dtype == "int8" else None  # an int8 cache's per-layer scales
    for text in (loop, step):
        assert f"= {kv_shape}" in text  # the check below looks for the right shape
        copies = [ln.strip()[:120] for ln in text.splitlines()
                  if is_whole_buffer_copy(ln, batch * 2 * 48 * 16) or (scale_shape and is_copy_of(ln, scale_shape))]
        assert not copies, copies[:3]
