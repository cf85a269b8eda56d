"""The KV cache: a registered pytree of preallocated, fixed-shape key and value arrays.

Only keys and values are cached. Queries, attention weights and hidden states of past tokens are never stored:
no later decode step reads them.

Layout. `keys[l]` and `values[l]` are [B, K, S, H] (axes `shapes.KV_AXES`), one array per layer. Per-layer arrays
(rather than one stacked [L, B, K, S, H] array) let each layer's write be its own in-place
`dynamic_update_slice` on its own donated buffer, and let the layer loop read a layer's cache without first
slicing it out of a bigger array (on XLA:CPU such a slice can be materialized, i.e. the cache read twice).

Ragged batches use left padding: the prompts of a batch are right-aligned to the same padded length, so every
sequence writes its next token to the same slot `length`, and one `dynamic_update_slice` per layer serves the whole
batch. Two pieces of bookkeeping describe what is live:

  start:  int32[B]  the first slot holding a real token of each sequence (the number of padding slots before it).
  length: int32[]   the number of slots written so far, i.e. the slot the next token goes to.

Sequence b's live slots are [start[b], length); the token in slot s has position id s - start[b].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.config import Config


@functools.partial(jax.tree_util.register_dataclass, data_fields=["keys", "values", "start", "length"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    keys: tuple[jax.Array, ...]  # L x [B, K, S, H]
    values: tuple[jax.Array, ...]  # L x [B, K, S, H]
    start: jax.Array  # int32[B]
    length: jax.Array  # int32[]

    @classmethod
    def allocate(cls, config: Config, batch: int, max_len: int, *, dtype=None, start=None) -> "KVCache":
        """A zeroed cache for `batch` sequences of up to `max_len` slots each; `start` defaults to all zeros."""
        dtype = jnp.dtype(dtype or config.dtype)
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        # keys and values must be distinct buffers: both are donated, and one buffer cannot be donated twice.
        return cls(keys=zeros, values=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
                   start=start, length=jnp.zeros((), jnp.int32))

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        """S, the number of slots per sequence."""
        return self.keys[0].shape[2]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.keys, *self.values))

    def write(self, layer: int, k: jax.Array, v: jax.Array, *, zero_dead_values: bool = False) -> "KVCache":
        """Returns the cache with k, v ([B, K, T, H]) written to slots [length, length + T) of `layer`.

        `length` is not advanced here (every layer writes to the same slots); call `advance` once per forward pass.

        `zero_dead_values` also zeroes the value slots no query can see (padding before `start`, anything at or
        past `length`), so whatever they held (NaN included) cannot reach an attention output as 0 * NaN. The XLA
        attention path needs this; doing it here, on the buffer about to be updated in place, costs one pass over
        the values and no copy, whereas masking the values inside the attention made XLA:CPU copy the whole
        buffer (seen in the compiled HLO). A kernel that masks per block does not need it.

        `dynamic_update_slice` clamps an out-of-range start index, which would silently overwrite the last slots.
        Callers check capacity on the host before any compute; as a second line of defence, a write that does not
        fit writes the existing contents back (a no-op) instead, and `advance` still moves `length` past
        `capacity`, so the overflow stays visible.
        """
        T = k.shape[2]
        fits = self.length + T <= self.capacity

        def update(buf, new):
            old = lax.dynamic_slice_in_dim(buf, self.length, T, axis=2)
            new = jnp.where(fits, new.astype(buf.dtype), old)
            return lax.dynamic_update_slice_in_dim(buf, new, self.length, axis=2)

        values = self.values[layer]
        if zero_dead_values:
            slot = jnp.arange(self.capacity, dtype=jnp.int32)
            kept = (slot[None, :] >= self.start[:, None]) & (slot[None, :] < self.length)  # [B, S]
            values = jnp.where(kept[:, None, :, None], values, jnp.zeros((), values.dtype))
        with jax.named_scope("cache_update"):
            return self.with_layer(layer, update(self.keys[layer], k), update(values, v))

    def with_layer(self, layer: int, k: jax.Array, v: jax.Array) -> "KVCache":
        """The cache with layer `layer`'s buffers replaced by k, v ([B, K, S, H])."""
        keys = self.keys[:layer] + (k,) + self.keys[layer + 1:]
        values = self.values[:layer] + (v,) + self.values[layer + 1:]
        return dataclasses.replace(self, keys=keys, values=values)

    def advance(self, num_tokens: int) -> "KVCache":
        return dataclasses.replace(self, length=self.length + num_tokens)

    def positions(self, num_tokens: int) -> jax.Array:
        """int32[B, T]: position ids of the next `num_tokens` tokens of each sequence."""
        q_slot = self.length + jnp.arange(num_tokens, dtype=jnp.int32)
        return q_slot[None, :] - self.start[:, None]
