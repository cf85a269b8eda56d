"""How cached K/V are stored: the zeroed per-layer buffers of a cache dtype, and int8/fp8 quantization on write.

int8 and float8_e4m3fn are quantized symmetrically, with one float32 scale per token per KV head: the absolute
maximum over the head dimension maps to the format's largest value. The scales live beside the cache
(`key_scales` / `value_scales`); attention dequantizes as it reads (`jaxkv.attention.reference.dequantize`).
Both the contiguous and the paged cache allocate and write through here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.cache.dtypes import QUANTIZED, check_cache_dtype
from jaxkv.config import Config

# The largest magnitude each quantized format holds: a token's absolute maximum maps here. int8 uses the symmetric
# range [-127, 127] (so the scale is the same for both signs).
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def zeroed_buffers(config: Config, shape, dtype=None):
    """(keys, values, key_scales, value_scales): L zeroed K and V buffers in the cache dtype (`dtype`, default
    config.dtype), and for int8/fp8 L float32 scale buffers of shape[:3] each (else empty). `shape` is one shape
    for every layer, or a list of L shapes (per-layer geometry). Every buffer is distinct: all may be donated,
    and one buffer cannot be donated twice.

    An MLA config (`config.mla`) caches keys only: its values are the first R columns of the key row, so values
    and value_scales are empty and no second buffer is ever allocated. DeepSeek-V3.2 (`Mla.indexer`) stores its
    indexer's keys in the value buffers instead, one head of `indexer.head_dim` per slot ([..., 1, S, Di]): every
    fork, page copy, move and prefix snapshot then carries them as it carries values. They take the cache dtype,
    or `indexer.key_dtype` (DeepSeek's release: float8 keys beside bfloat16 rows), with scales where quantized:
    key_scales exist where the keys are quantized and value_scales where the values are, independently."""
    name = check_cache_dtype(dtype or config.dtype)
    shapes = [tuple(shape)] * config.n_layers if isinstance(shape, tuple) else [tuple(s) for s in shape]
    buffers = lambda dt, cut=None: tuple(jnp.zeros(s[:cut], dt) for s in shapes)  # noqa: E731
    scales = name in QUANTIZED
    indexer = None if config.mla is None else config.mla.indexer
    if indexer is None:
        values = () if config.mla is not None else buffers(name)
        value_scales = buffers(jnp.float32, 3) if scales and values else ()
    else:  # the indexer's keys, in their own dtype where `SparseIndexer.key_dtype` names one
        key_dtype = check_cache_dtype(indexer.key_dtype or name)
        values = tuple(jnp.zeros((*s[:3], indexer.head_dim), key_dtype) for s in shapes)
        value_scales = buffers(jnp.float32, 3) if key_dtype in QUANTIZED else ()
    return buffers(name), values, buffers(jnp.float32, 3) if scales else (), value_scales


def zeroed_states(config: Config, batch: int):
    """(conv states, recurrent states): per layer the zeroed state of a linear-attention layer (conv [B, U, Y - 1]
    in the model dtype, delta rule float32 [B, Hv, Dk, Dv]) or an empty placeholder on the other layers; two empty
    tuples for a model without linear layers. Independent of the cache dtype: states are never quantized."""
    la = config.linear_attention
    if la is None:
        return (), ()
    conv = tuple(jnp.zeros((batch, la.conv_dim, la.conv_kernel - 1) if config.layer_is_linear(layer)
                           else (batch, 0, 0), config.dtype) for layer in range(config.n_layers))
    recurrent = tuple(jnp.zeros((batch, la.value_heads, la.key_head_dim, la.value_head_dim)
                                if config.layer_is_linear(layer) else (batch, 0, 0, 0), jnp.float32)
                      for layer in range(config.n_layers))
    return conv, recurrent


def state_rows(states: tuple, src, keep) -> tuple:
    """Per layer, the state rows src[i] (None: the rows as they are), zeroed where keep[i] is false: what a fork,
    a release, a batch of some rows and a prefix cache's snapshots take."""
    def pick(x):
        x = x if src is None else x[src]
        return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))
    return tuple(map(pick, states))


class LayerStates:
    """What a cache holding hybrid models' states (`conv_states`, `recurrent_states`: per layer a [B, ...] row per
    sequence, empty on non-linear layers) reads and writes them with; mixed into `KVCache` and `PagedKVCache`,
    whose rows they follow (a paged cache's fork gathers them, its release zeroes them)."""

    def state(self, layer: int):
        """(conv state [B, U, Y - 1], delta-rule state float32 [B, Hv, Dk, Dv]) of linear layer `layer`."""
        return self.conv_states[layer], self.recurrent_states[layer]

    def with_state(self, layer: int, conv, recurrent):
        """The cache with linear layer `layer`'s states replaced (cast to the buffers' dtypes)."""
        conv = conv.astype(self.conv_states[layer].dtype)
        recurrent = recurrent.astype(self.recurrent_states[layer].dtype)
        return dataclasses.replace(
            self, conv_states=self.conv_states[:layer] + (conv,) + self.conv_states[layer + 1:],
            recurrent_states=self.recurrent_states[:layer] + (recurrent,) + self.recurrent_states[layer + 1:])

    def keep_step_states(self, steps: dict, kept):
        """The cache with each row's states set to those after its first kept[b] tokens of a speculative verify
        (`steps`: {linear layer: (conv [B, T, U, Y - 1], float32 [B, T, Hv, Dk, Dv])}, the states after each of
        its T tokens, `Decoder`'s step_states; kept int32[B] or a scalar). A row keeping 0 keeps its state as it
        is. A state cannot be rewound as a K/V slot can, so this is what rewinding the length needs beside it."""
        kept = jnp.broadcast_to(jnp.asarray(kept, jnp.int32), self.conv_states[0].shape[:1])
        index = jnp.maximum(kept - 1, 0)
        cache = self
        for layer, (conv, recurrent) in steps.items():
            def pick(steps_of, now):
                at = jnp.take_along_axis(steps_of, index.reshape((-1, 1) + (1,) * (steps_of.ndim - 2)), axis=1)[:, 0]
                return jnp.where((kept > 0).reshape((-1,) + (1,) * (now.ndim - 1)), at.astype(now.dtype), now)

            now_conv, now_recurrent = cache.state(layer)
            cache = cache.with_state(layer, pick(conv, now_conv), pick(recurrent, now_recurrent))
        return cache

    def state_nbytes(self) -> int:
        """Bytes of the states (0 for a model without linear layers)."""
        return sum(a.size * a.dtype.itemsize for a in (*self.conv_states, *self.recurrent_states))


def quantize(x, cache_dtype: str):
    """x [B, K, T, H] -> (values in cache_dtype, float32 scales [B, K, T]); symmetric, one scale per token and head.

    A token whose head is all zeros gets scale 0 (and zeros), never a division by zero."""
    x = x.astype(jnp.float32)
    qmax = QMAX[cache_dtype]
    amax = jnp.max(jnp.abs(x), axis=-1)  # [B, K, T]
    scale = amax / qmax
    scaled = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    if cache_dtype == "int8":
        stored = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
    else:
        stored = jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn)  # round-to-nearest in the cast
    return stored, scale
