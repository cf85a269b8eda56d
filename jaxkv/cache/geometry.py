"""The cache's geometry: per layer, how many slots it has, whether they are a ring, and its K and H.

A sliding-window layer only ever attends to the last `window` slots, so with `ring` its cache is a ring of
min(window, slots) (`layer_slots`); every other layer keeps every slot. Gemma 2/3 mix the two kinds; Gemma 4 also
varies K and H per layer, and its last `kv_shared_layers` layers store nothing (0 slots: each reads its source
layer's buffer). `CacheGeometry` is just what a cache's size depends on, for when there is no full model config
(`jaxkv memory --layers ...`).

Pure arithmetic, no JAX: the contiguous cache allocates from `layer_slots` and the planner counts bytes from it
and `CacheGeometry`, so the two always agree.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.config import DTYPES, Config


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """What the KV cache's size depends on: L layers, K KV heads, H head dim, the model dtype (the default cache
    dtype) and the sliding window (None: the cache holds every token)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    sliding_window: int | None = None
    keys_only: bool = False  # an MLA cache: one latent row per token, no value buffers
    # DeepSeek-V3.2's indexer key width (`SparseIndexer.head_dim`), stored as a keys-only cache's values: one
    # more buffer of this width per layer; None: no indexer.
    index_dim: int | None = None
    index_dtype: str | None = None  # their dtype where it is not the cache's (`SparseIndexer.key_dtype`)
    # Per-layer spans: sliding windows or Llama 4's attention chunks (`Config.layer_span`; None entries:
    # full-attention layers), for models that mix layer kinds (Gemma 2/3, Llama 4,
    # `Config.layer_types`); None: every layer has `sliding_window`.
    layer_windows: tuple[int | None, ...] | None = None
    # Per-layer (KV heads, head dim), None entries for layers that cache nothing (they share another layer's K/V:
    # Gemma 4, `Config.kv_source`); None: every layer has (n_kv_heads, head_dim).
    layer_shapes: tuple[tuple[int, int] | None, ...] | None = None
    # Bytes per sequence of a hybrid model's linear-attention states (`Config.state_bytes_per_sequence`): fixed,
    # whatever the length; those layers' `layer_shapes` entries are None (no K/V).
    state_bytes: int = 0

    @property
    def kinds(self) -> int:
        """Buffers per layer and KV head: 2 (keys and values), or 1 for a keys-only (MLA) cache."""
        return 1 if self.keys_only else 2

    def __post_init__(self):
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            positive_int(name, getattr(self, name))
        if self.sliding_window is not None:
            positive_int("sliding_window", self.sliding_window)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.n_layers:
                raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.n_layers} layers")
            for w in self.layer_windows:
                if w is not None:
                    positive_int("a layer window", w)
        if self.layer_shapes is not None:
            if len(self.layer_shapes) != self.n_layers:
                raise ValueError(f"layer_shapes has {len(self.layer_shapes)} entries for {self.n_layers} layers")
            for shape in self.layer_shapes:
                if shape is not None:
                    positive_int("a layer's KV heads", shape[0]), positive_int("a layer's head dim", shape[1])

    @property
    def shapes(self) -> tuple[tuple[int, int] | None, ...]:
        """Each layer's (KV heads, head dim), None for a layer that caches nothing."""
        if self.layer_shapes is not None:
            return self.layer_shapes
        return ((self.n_kv_heads, self.head_dim),) * self.n_layers

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: the layer keeps every token)."""
        return self.layer_windows if self.layer_windows is not None else (self.sliding_window,) * self.n_layers

    @classmethod
    def of(cls, config: Config | CacheGeometry) -> CacheGeometry:
        if isinstance(config, CacheGeometry):
            return config
        if not isinstance(config, Config):
            raise TypeError(f"expected a jaxkv.Config or CacheGeometry, got {type(config).__name__}")
        shapes = None if config.uniform_kv else tuple(
            (config.layer_kv_heads(layer), config.layer_head_dim(layer)) if config.caches_kv(layer) else None
            for layer in range(config.n_layers))
        return cls(config.n_layers, config.n_kv_heads, config.head_dim, config.dtype, config.sliding_window,
                   keys_only=config.mla is not None,
                   index_dim=None if config.mla is None or config.mla.indexer is None else config.mla.indexer.head_dim,
                   index_dtype=None if config.mla is None or config.mla.indexer is None
                   else config.mla.indexer.key_dtype,
                   layer_windows=None if config.layer_types is None else config.layer_spans, layer_shapes=shapes,
                   state_bytes=config.state_bytes_per_sequence())


def positive_int(name: str, value) -> int:
    """`value` as an int, or ValueError naming it unless it is a positive integer (the planner's checks too)."""
    # bool is an int subclass; True layers or tokens is a caller's mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def layer_slots(config: Config, max_len: int, ring: bool, lookahead: int = 0) -> tuple[tuple[int, bool], ...]:
    """(slots, is a ring) of each layer of a cache of `max_len` slots: with `ring`, a layer with a sliding window
    gets a ring of min(window + lookahead, max_len) slots (`lookahead`: the k more tokens a speculative verify
    writes at once, `KVCache.ring_lookahead`); every other layer max_len plain slots. A config whose every layer
    slides (or none: no `ring`) has one geometry: every layer max_len slots, all rings or none. A layer that
    shares another's K/V (`Config.kv_source`) stores nothing: 0 slots, with its source's ring flag. The planner
    and `KVCache.allocate` both use this."""
    if not ring or config.every_layer_sliding:
        slots = [(max_len, bool(ring)) for _ in range(config.n_layers)]
    else:
        slots = [(min(w + lookahead, max_len), True) if w is not None else (max_len, False)
                 for w in config.layer_spans]  # a window, or a chunk (Llama 4): the slots the layer can read
    return tuple((0, False) if config.layer_is_linear(layer)  # a state, no K/V (`KVCache.conv_states`)
                 else slots[layer] if config.stores_kv(layer) else (0, slots[config.kv_source(layer)][1])
                 for layer in range(config.n_layers))


def cache_slots(config: Config | CacheGeometry, tokens: int) -> int:
    """S, the slots a sequence of `tokens` tokens occupies, summed over the layers and divided by their number:
    all of them, or at most the sliding window (per layer, for a model mixing layer kinds; the mean is then
    rounded up, so prefer `layer_cache_slots` there)."""
    slots = layer_cache_slots(config, tokens)
    return -(-sum(slots) // len(slots))


def layer_cache_slots(config: Config | CacheGeometry, tokens: int) -> tuple[int, ...]:
    """Each layer's slots for a sequence of `tokens` tokens: tokens, or at most that layer's window (a ring)."""
    geometry = CacheGeometry.of(config)
    positive_int("tokens", tokens)
    return tuple(tokens if w is None else min(tokens, w) for w in geometry.windows)
