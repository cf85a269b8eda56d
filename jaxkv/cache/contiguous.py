"""The contiguous KV cache: a registered pytree of preallocated, fixed-shape key and value arrays.

Only keys and values are cached (a multi-head latent attention model caches one latent row per token as its
"key" and no values: `zeroed_buffers`). Queries, attention weights and hidden states of past tokens are never stored:
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

Cache dtypes (`CACHE_DTYPES`). float32, bfloat16 and float16 store K and V as they are (cast on write). int8 and
float8_e4m3fn are quantized on write, symmetrically, with one float32 scale per token per KV head (the absolute
maximum over the head dimension maps to the format's largest value), kept beside the cache in `key_scales` /
`value_scales` ([B, K, S] per layer; `jaxkv.cache.storage`); attention dequantizes as it reads.
`jaxkv.kv_cache_bytes` counts exactly these leaves.

Ring buffers: a sliding-window layer only ever attends to the last `window` slots, so its cache needs only
S = window slots. Absolute slot s (what `start`, `length` and positions count) is stored at index s mod S and
overwrites slot s - S; memory is O(window), not O(sequence). Attention maps indices back to absolute slots
(`attention.reference.live_mask`). Such a ring takes one token per write: a second would overwrite a slot the
first token's query still sees. A speculative verify writes k + 1 tokens at once (the last token and k
proposals), so with `ring_lookahead` = k a ring layer holds window + k slots: the block's writes then overwrite
only slots more than `window` behind its first query, and every later query's window ends past them too; the
rejected tokens' slots, once the length is rewound, hold K/V no query's window reaches (each index maps to the
absolute slot S behind it). Memory O(window + k).

Per-layer geometry. Each layer has its own buffer, so each has its own length and layout (`rings`): a model that
mixes sliding-window and full-attention layers (Gemma 2/3, `Config.layer_types`) gets, with `ring=True`, a ring of
min(window, S) slots on each sliding layer and S plain slots on each full layer. `capacity` is then the full
layers' S (what bounds the sequence), and `ring` is true only when every layer is a ring (nothing bounds it).
Gemma 4's layers also differ in KV heads and head dim (`Config.layer_kv_heads`, `layer_head_dim`), and its last
`kv_shared_layers` layers store nothing: each reads its source layer's buffer (`Config.kv_source`), so its own
entry is an empty [B, K, 0, H] placeholder of zero bytes, which keeps the per-layer tuples indexed by layer.

State (hybrid models: Qwen3-Next, Qwen3.5, `Config.linear_attention`). A "linear_attention" layer caches no K/V
(an empty placeholder, as above) but a fixed-size state per sequence: `conv_states[l]` [B, U, Y - 1] (the last
inputs of its causal conv, model dtype) and `recurrent_states[l]` float32 [B, Hv, Dk, Dv] (the delta-rule state);
the other layers' entries are empty ([B, 0, 0] and [B, 0, 0, 0]), and a model without linear layers has none at
all. The state is the sequence's summary up to `length`: unlike a K/V slot it cannot be rewound, so whatever
would rewind `length` (a speculative verify's rejected tokens) must restore it (`jaxkv.layers.gated_delta`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention.reference import live_mask
from jaxkv.cache.geometry import layer_slots
from jaxkv.cache.storage import LayerStates, quantize, zeroed_buffers, zeroed_states
from jaxkv.config import Config


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["keys", "values", "start", "length", "key_scales", "value_scales", "conv_states",
                                "recurrent_states"],
                   meta_fields=["rings", "ring_lookahead"])
@dataclasses.dataclass(frozen=True)
class KVCache(LayerStates):
    keys: tuple[jax.Array, ...]  # L x [B, K, S, H]; MLA: L x [B, 1, S, R + E], the latent rows
    values: tuple[jax.Array, ...]  # L x [B, K, S, H]; MLA: empty (the values are keys[l][..., :R])
    start: jax.Array  # int32[B]
    length: jax.Array  # int32[]
    key_scales: tuple[jax.Array, ...] = ()  # L x float32[B, K, S] for int8/fp8 caches, else empty
    value_scales: tuple[jax.Array, ...] = ()
    conv_states: tuple[jax.Array, ...] = ()  # hybrid models: L x [B, U, Y - 1] (empty on non-linear layers)
    recurrent_states: tuple[jax.Array, ...] = ()  # hybrid models: L x float32[B, Hv, Dk, Dv] (likewise)
    # static, per layer: that layer's S slots are a ring of the most recent S (module docstring). A bool is
    # taken for every layer.
    rings: tuple[bool, ...] | bool = False
    # static: k, the slots a ring layer holds beyond its window, so that it takes up to k + 1 tokens per write
    # (a speculative verify's block; module docstring). 0: one token per write.
    ring_lookahead: int = 0

    def __post_init__(self):
        if isinstance(self.rings, bool):
            object.__setattr__(self, "rings", (self.rings,) * len(self.keys))
        elif len(self.rings) != len(self.keys):
            raise ValueError(f"rings has {len(self.rings)} entries for {len(self.keys)} layers")

    @classmethod
    def allocate(cls, config: Config, batch: int, max_len: int, *, dtype=None, start=None,
                 ring: bool = False, lookahead: int = 0) -> "KVCache":
        """A zeroed cache for `batch` sequences of `max_len` slots each; with `ring`, each sliding-window layer
        holds a ring of min(window + lookahead, max_len) slots instead (`layer_slots`; a model without per-layer
        kinds and a window: every layer, `max_len` being that bound), taking up to lookahead + 1 tokens per write
        (`ring_lookahead`: a speculative verify's block). Each layer has its own KV heads and head dim (`Config.layer_kv_heads`,
        `layer_head_dim`); a layer that shares another's K/V gets an empty [B, K, 0, H] placeholder (no bytes).
        `dtype` is one of CACHE_DTYPES (default config.dtype); `start` defaults to zeros."""
        slots = layer_slots(config, max_len, ring, lookahead)
        keys, values, key_scales, value_scales = zeroed_buffers(
            config, [(batch, config.layer_kv_heads(layer), S, config.layer_head_dim(layer))
                     for layer, (S, _) in enumerate(slots)], dtype)
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        conv_states, recurrent_states = zeroed_states(config, batch)
        return cls(keys=keys, values=values, start=start, length=jnp.zeros((), jnp.int32),
                   key_scales=key_scales, value_scales=value_scales, conv_states=conv_states,
                   recurrent_states=recurrent_states, rings=tuple(r for _, r in slots),
                   ring_lookahead=lookahead if ring else 0)

    @property
    def ring(self) -> bool:
        """Every layer is a ring: no slot count bounds the sequence (only the model's max positions)."""
        return all(self.rings)

    def layer_ring(self, layer: int) -> bool:
        return self.rings[layer]

    def layer_capacity(self, layer: int) -> int:
        """S of `layer`: its slots (a ring's window, or the full length)."""
        return self.keys[layer].shape[2]

    @property
    def dtype(self) -> str:
        """The cache dtype's name (one of CACHE_DTYPES)."""
        return self.keys[0].dtype.name

    @property
    def quantized(self) -> bool:
        return bool(self.key_scales)

    def scales(self, layer: int):
        """(key scales, value scales) of `layer`, each None where that kind is not quantized (an unquantized cache,
        a keys-only MLA cache's values; DeepSeek-V3.2's float8 indexer keys beside unquantized rows)."""
        return (self.key_scales[layer] if self.key_scales else None,
                self.value_scales[layer] if self.value_scales else None)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        """S, the slots per sequence: the full (non-ring) layers' when there are any (they bound the sequence),
        else the rings'."""
        plain = [k.shape[2] for k, ring in zip(self.keys, self.rings) if not ring]  # (a sharing layer's 0 too)
        return max(plain) if plain else max(k.shape[2] for k in self.keys)

    def nbytes(self) -> int:
        """Bytes of keys, values, (quantized caches) their scales and (hybrid models) the linear layers' states:
        what `jaxkv.kv_cache_bytes` predicts."""
        return sum(a.size * a.dtype.itemsize
                   for a in (*self.keys, *self.values, *self.key_scales, *self.value_scales, *self.conv_states,
                             *self.recurrent_states))

    def write(self, layer: int, k: jax.Array, v: jax.Array | None, *, zero_dead_values: bool = False) -> "KVCache":
        """Returns the cache with k, v ([B, K, T, H]) written to slots [length, length + T) of `layer`
        (quantized first, for an int8/fp8 cache; at index length mod S in a ring). A keys-only (MLA) cache takes
        v = None.

        `length` is not advanced here (every layer writes to the same slots); call `advance` once per forward pass.

        `zero_dead_values` also zeroes the value slots no query can see (padding before `start`, anything at or
        past `length`), so whatever they held (NaN included) cannot reach an attention output as 0 * NaN. The XLA
        attention path needs this; doing it here, on the buffer about to be updated in place, costs one pass over
        the values and no copy, whereas masking the values inside the attention made XLA:CPU copy the whole
        buffer (seen in the compiled HLO). A kernel that masks per block does not need it.

        `dynamic_update_slice` clamps an out-of-range start index, which would silently overwrite the last slots.
        Callers check capacity on the host before any compute; as a second line of defence, a write that does not
        fit writes the existing contents back (a no-op) instead, and `advance` still moves `length` past
        `capacity`, so the overflow stays visible: `overflowed` is then true, the decoder returns NaN logits (see
        `jaxkv.model.Decoder`) and `check()` fails under `checkify`. A ring layer takes one token per write (every
        such write fits), up to ring_lookahead + 1 in a ring allocated with a lookahead (wrapping past its last
        index); a longer chunk is a ValueError at trace time (its attention could not be right once the ring is
        full), except through `write_prompt` into an empty cache.
        """
        return self._write(layer, k, v, zero_dead_values=zero_dead_values, prompt=False)

    def _write(self, layer: int, k, v, *, zero_dead_values: bool, prompt: bool) -> "KVCache":
        T, S, ring = k.shape[2], self.layer_capacity(layer), self.rings[layer]
        if T > S:  # known at trace time: refuse before compute
            raise ValueError(f"cannot write {T} tokens into a cache of {S} slots")
        if ring and T > 1 + self.ring_lookahead and not prompt:
            # The chunk's later tokens would overwrite slots its earlier queries still see once the ring is full
            # (a window of W in W + k slots has room for k + 1 new tokens), so its attention would be wrong;
            # refused rather than computed. Prefill (`write_prompt`) attends over the fresh K/V instead.
            per_step = f"at most {1 + self.ring_lookahead} tokens" if self.ring_lookahead else "one token"
            raise ValueError(f"a ring cache layer ({S} slots) takes {per_step} per step after prefill, got a chunk "
                             f"of {T}: decode token by token, or allocate the cache without ring=True (or with a "
                             "lookahead)")
        at = self.length % S if ring else self.length
        fits = at + T <= S

        def update(buf, new):
            if ring and T > 1 and not prompt:  # a verify's block may wrap past the ring's last index
                index = (self.length + jnp.arange(T, dtype=jnp.int32)) % S
                return buf.at[:, :, index].set(new.astype(buf.dtype))
            old = lax.dynamic_slice_in_dim(buf, at, T, axis=2)
            new = jnp.where(fits, new.astype(buf.dtype), old)
            return lax.dynamic_update_slice_in_dim(buf, new, at, axis=2)

        if (v is None) != (not self.values):
            raise ValueError("a keys-only (MLA) cache is written with v=None, any other cache with values")
        # Keys and values are quantized each where their buffers are (DeepSeek-V3.2's indexer keys, the values of a
        # latent cache, may be float8 beside rows that are not: `zeroed_buffers`).
        k_scale, v_scale = self.scales(layer)
        if k_scale is not None:
            k, new_k_scale = quantize(k, self.dtype)
        if v is None:
            with jax.named_scope("cache_update"):
                cache = self.with_layer(layer, update(self.keys[layer], k), None)
                return cache.with_layer_scales(layer, update(k_scale, new_k_scale), None) if self.quantized else cache
        values = self.values[layer]
        if v_scale is not None:
            v, new_v_scale = quantize(v, values.dtype.name)
        if zero_dead_values:
            # What the next query (slot `length`) can see, before this write; the written slots are replaced below.
            kept = live_mask(self.start, self.length, 1, S, ring=ring)[:, 0]  # [B, S]
            values = jnp.where(kept[:, None, :, None], values, jnp.zeros((), values.dtype))
            if v_scale is not None:  # a float8 value can itself be NaN: zero both the value and its scale
                v_scale = jnp.where(kept[:, None, :], v_scale, 0.0)
        with jax.named_scope("cache_update"):
            cache = self.with_layer(layer, update(self.keys[layer], k), update(values, v))
            if k_scale is not None or v_scale is not None:
                cache = cache.with_layer_scales(layer, None if k_scale is None else update(k_scale, new_k_scale),
                                                None if v_scale is None else update(v_scale, new_v_scale))
            return cache

    def write_prompt(self, layer: int, k: jax.Array, v: jax.Array | None) -> "KVCache":
        """Writes a whole prompt ([B, K, T, H], slots [0, T)) into an empty cache (v None: keys only, MLA). Unlike
        `write`, a ring cache may be shorter than the prompt: then only the last S slots are kept, each at its
        index slot mod S."""
        T, S = k.shape[2], self.layer_capacity(layer)
        if self.rings[layer] and T > S:
            # Slots T-S .. T-1 go to indices (T-S) mod S .. : a rotation of the last S slots by T mod S.
            k, v = (None if x is None else jnp.roll(x[:, :, T - S:], T % S, axis=2) for x in (k, v))
        return self._write(layer, k, v, zero_dead_values=False, prompt=True)

    def with_layer(self, layer: int, k: jax.Array, v: jax.Array | None) -> "KVCache":
        """The cache with layer `layer`'s buffers replaced by k, v ([B, K, S, H]; v None in a keys-only cache)."""
        keys = self.keys[:layer] + (k,) + self.keys[layer + 1:]
        values = self.values if v is None else self.values[:layer] + (v,) + self.values[layer + 1:]
        return dataclasses.replace(self, keys=keys, values=values)

    def with_layer_scales(self, layer: int, k_scale: jax.Array, v_scale: jax.Array | None) -> "KVCache":
        """The cache with layer `layer`'s quantization scales replaced (None: those scales left as they are, as in
        a keys-only cache or one whose keys or values alone are quantized)."""
        key_scales = (self.key_scales if k_scale is None
                      else self.key_scales[:layer] + (k_scale,) + self.key_scales[layer + 1:])
        value_scales = (self.value_scales if v_scale is None
                        else self.value_scales[:layer] + (v_scale,) + self.value_scales[layer + 1:])
        return dataclasses.replace(self, key_scales=key_scales, value_scales=value_scales)

    @property
    def overflowed(self) -> jax.Array:
        """bool[]: some write did not fit (a plain cache's `length` has passed its capacity). A ring never
        overflows by writing; its limit is the model's max positions, which the decoder checks per row."""
        if self.ring:
            return jnp.zeros((), bool)
        return self.length > self.capacity

    def check(self) -> None:
        """A `jax.experimental.checkify` check that no write overflowed: inside a function transformed by
        `checkify.checkify`, an overflowing cache turns into an error the caller must `throw()` or inspect.

            checked = checkify.checkify(lambda c: c.check())
            err, _ = checked(cache); err.throw()
        """
        from jax.experimental import checkify

        checkify.check(~self.overflowed, "KV cache overflow: length {length} exceeds capacity " + str(self.capacity),
                       length=self.length)

    def advance(self, num_tokens: int) -> "KVCache":
        return dataclasses.replace(self, length=self.length + num_tokens)

    def positions(self, num_tokens: int) -> jax.Array:
        """int32[B, T]: position ids of the next `num_tokens` tokens of each sequence."""
        q_slot = self.length + jnp.arange(num_tokens, dtype=jnp.int32)
        return q_slot[None, :] - self.start[:, None]
