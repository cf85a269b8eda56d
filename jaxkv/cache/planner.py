"""The KV-cache planner: how many bytes a cache takes, how many sequences fit beside the weights, and the layout
(batch, prompt bucket, capacity, pages) `generate` allocates: `plan_cache`, `plan_pages`.

The arithmetic mirrors the cache jaxkv allocates (letters as in `jaxkv.shapes`). Per layer:

  keys, values                 [B, K, S, H]  in the cache dtype
  key_scales, value_scales     [B, K, S]     float32, only for "int8" and "float8_e4m3fn" (one symmetric scale per
                                             token per KV head)

where S, the slots per sequence, is the token count, or min(tokens, W) for a model with a sliding window of W
tokens (its cache is a ring buffer of W slots: older entries are overwritten). Where layers differ (Gemma 2/3/4:
windows per layer; Gemma 4: K and H per layer, and layers that share another layer's K/V and cache nothing) the
sum runs over the layers, each with its own S, K and H. Hence

  bytes per token = 2 (K and V) x L x K x (H x bytes per element + 4 if quantized)
  cache bytes     = B x S x bytes per token

A multi-head latent attention model (`Config.mla`, DeepSeek-V2/V3) caches keys only: one row per token and layer of
the latent (R = kv_lora_rank) and the shared rotary key (E = qk_rope_head_dim), its values being the row's first R
columns (`jaxkv.attention.mla`). Its cache is one "KV head" of H = R + E with no value buffers, so

  bytes per token = L x (R + E) x bytes per element (+ 4 per layer if quantized)

`expanded_kv_bytes_per_token` gives what full per-head K and V would take instead (DeepSeek-V3, bfloat16:
61 x 576 x 2 = 70,272 bytes per token, against 61 x 128 x (192 + 128) x 2 = 4,997,120).

Only the cached keys and values (and their scales) are counted, not the cache's int32 bookkeeping (`start` [B],
`length` []): 4 x (B + 1) bytes, whatever the model.

The classic figures (a 13B-class model: 40 layers, 40 KV heads of 128 dims, float16):
  819,200 bytes per token; 1,677,721,600 bytes (1.5625 GiB) for one 2,048-token sequence;
  with grouped-query attention over 8 KV heads, 163,840 bytes per token;
  in int8 with scales, 40 x 40 x 2 x (128 + 4) = 422,400 bytes per token.

Every function takes a `jaxkv.Config` or a `CacheGeometry` (just the fields the cache size depends on, for when
there is no full model config, e.g. `jaxkv memory --layers ...`). No JAX here: the `jaxkv` command imports this
before JAX (this was `jaxkv.memory`, which still names it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.cache.dtypes import BYTES_PER_ELEMENT, CACHE_DTYPES, QUANTIZED, SCALE_BYTES
# cache_slots: not used here, but `jaxkv memory` and users reach it as planner's (the old jaxkv.memory's) name
from jaxkv.cache.geometry import CacheGeometry, cache_slots, layer_cache_slots, layer_slots, positive_int  # noqa: F401
from jaxkv.config import DTYPES, Config

GIB = 1 << 30


def _cache_dtype(geometry: CacheGeometry, cache_dtype) -> str:
    """The cache dtype's name. Dtype objects (jnp.int8, np.dtype("float16")) are accepted as well as names, so the
    value passed to `generate` can be passed here unchanged."""
    if cache_dtype is None:
        return geometry.dtype
    try:
        name = cache_dtype if isinstance(cache_dtype, str) else np.dtype(cache_dtype).name
    except TypeError:
        name = None
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES} or None (the model dtype), got {cache_dtype!r}")
    return name


def _layer_bytes_per_slot(geometry: CacheGeometry, cache_dtype) -> tuple[int, ...]:
    """Bytes of one slot of each layer: kinds x K x (H x bytes per element + scale bytes) (+ an MLA indexer's
    key); 0 for a layer that caches nothing."""
    dtype = _cache_dtype(geometry, cache_dtype)
    scale = SCALE_BYTES if dtype in QUANTIZED else 0
    # DeepSeek-V3.2: one indexer key per slot beside the latent row (the keys-only cache's values, with a scale)
    index_dtype = geometry.index_dtype or dtype  # their own dtype where `SparseIndexer.key_dtype` names one
    index = 0 if geometry.index_dim is None else geometry.index_dim * BYTES_PER_ELEMENT[index_dtype] + (
        SCALE_BYTES if index_dtype in QUANTIZED else 0)
    return tuple(0 if shape is None else
                 geometry.kinds * shape[0] * (shape[1] * BYTES_PER_ELEMENT[dtype] + scale) + index
                 for shape in geometry.shapes)


def kv_bytes_per_token(config: Config | CacheGeometry, cache_dtype=None) -> int:
    """Bytes one cached token takes over all layers: 2 x L x K x (H x bytes per element + scale bytes); a
    keys-only (MLA) cache has one buffer per layer instead of 2. Per layer where the layers differ (Gemma 4: K
    and H per layer, nothing for the layers that share another's K/V)."""
    return sum(_layer_bytes_per_slot(CacheGeometry.of(config), cache_dtype))


def expanded_kv_bytes_per_token(config: Config, cache_dtype=None) -> int:
    """For an MLA config: the bytes per token a cache of full per-head keys and values would take, L x N x
    (qk_nope + qk_rope + v head dims) x bytes per element (+ 2 scales per head if quantized): what the latent
    cache saves. For any other config, `kv_bytes_per_token`."""
    if not isinstance(config, Config):
        raise TypeError(f"expected a jaxkv.Config, got {type(config).__name__}")
    if config.mla is None:
        return kv_bytes_per_token(config, cache_dtype)
    dtype = _cache_dtype(CacheGeometry.of(config), cache_dtype)
    m = config.mla
    scales = 2 * SCALE_BYTES if dtype in QUANTIZED else 0
    return config.n_layers * config.n_heads * ((m.qk_head_dim + m.v_head_dim) * BYTES_PER_ELEMENT[dtype] + scales)


def kv_cache_bytes(config: Config | CacheGeometry, *, tokens: int | None = None, batch: int = 1, cache_dtype=None,
                   page_size: int | None = None, num_pages: int | None = None) -> int:
    """Exact bytes of the KV cache (keys, values and, for int8/fp8, their scales) for `batch` sequences of
    `tokens` tokens each, or of a paged pool.

    Args:
      config: a `jaxkv.Config` (or a `CacheGeometry`).
      tokens: tokens per sequence (prompt plus generated), i.e. the cache capacity asked for.
      batch: B, sequences cached together.
      cache_dtype: one of CACHE_DTYPES (a name or a dtype such as jnp.int8); None is the model's dtype.
      page_size: a paged cache's slots per page: each sequence then takes whole pages, ceil(tokens / page_size)
        of them (no sliding-window ring: a paged cache keeps every token).
      num_pages: with page_size and without tokens: the bytes of a pool of that many pages
        (`jaxkv.PagedKVCache.nbytes`). Prefix sharing: `shared_cache_bytes`.

    Returns:
      batch x slots x bytes per token, slots = min(tokens, sliding window); or pages x page bytes. A hybrid
      model's (`Config.linear_attention`) linear layers add their fixed state, batch x
      `state_bytes_per_sequence`, to a contiguous cache's bytes.

    Raises:
      ValueError: tokens or batch not a positive integer, or an unknown cache_dtype.
    """
    if num_pages is not None:
        if page_size is None or tokens is not None:
            raise ValueError("num_pages gives a pool's bytes: pass it with page_size and without tokens")
        return pool_bytes(config, num_pages=num_pages, page_size=page_size, cache_dtype=cache_dtype)
    if tokens is None:
        raise ValueError("pass tokens (per sequence), or num_pages and page_size (a paged pool)")
    positive_int("batch", batch)
    if page_size is not None:
        pages = -(-positive_int("tokens", tokens) // positive_int("page_size", page_size))
        return batch * pages * page_bytes(config, page_size, cache_dtype)
    geometry = CacheGeometry.of(config)
    kv = sum(slots * per_slot for slots, per_slot in zip(layer_cache_slots(geometry, tokens),
                                                         _layer_bytes_per_slot(geometry, cache_dtype)))
    return batch * (kv + geometry.state_bytes)


def state_bytes_per_sequence(config: Config | CacheGeometry) -> int:
    """Bytes of a hybrid model's linear-layer state per sequence (conv windows in the model dtype, float32
    delta-rule states; never quantized), whatever the length: 0 for a model without linear layers."""
    return CacheGeometry.of(config).state_bytes


def full_length_cache_bytes(config: Config | CacheGeometry, *, tokens: int, batch: int = 1,
                            cache_dtype=None) -> int:
    """What `kv_cache_bytes` would be if every layer kept all `tokens` (no sliding-window rings): the cost of a
    cache that ignores the per-layer kinds."""
    positive_int("batch", batch)
    return batch * positive_int("tokens", tokens) * kv_bytes_per_token(config, cache_dtype)


def allocated_bytes(config: Config | CacheGeometry, *, tokens: int, batch: int = 1, cache_dtype=None) -> int:
    """Bytes `jaxkv.generate(..., max_len=tokens)` allocates for `batch` prompts: `kv_cache_bytes` with the batch
    padded to a power of two (generate's filler rows, so batch sizes share compiled shapes). Without max_len the
    capacity is padded too: `plan_cache` gives that layout."""
    positive_int("batch", batch)
    return kv_cache_bytes(config, tokens=tokens, batch=next_pow2(batch), cache_dtype=cache_dtype)


def weight_bytes(config: Config, dtype: str | None = None, weights=None) -> int:
    """Bytes of the model's parameters: parameter count x bytes per element of `dtype` (None: config.dtype).

    weights: weight-only quantization ("int8", "fp8", "int4" or a `jaxkv.WeightQuant`; `jaxkv.layers.quantized`):
    the quantized weights at their width as the default backend's devices hold them (int4 at half a byte on GPU,
    TPU and jax >= 0.11's XLA:CPU, one byte on jax 0.10's XLA:CPU: `quantized.int4_bits`) plus their float32
    scales, the other parameters in `dtype`. Counted from the parameter shapes `jaxkv.load(..., weights=)` makes
    (this imports JAX)."""
    if not isinstance(config, Config):
        raise TypeError(f"weight bytes need a full jaxkv.Config (for its parameter count), got "
                        f"{type(config).__name__}")
    dtype = config.dtype if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if weights is not None:
        import jax

        from jaxkv.layers import quantized
        from jaxkv.model import param_shapes, weight_layout

        config = config.replace(dtype=dtype)
        quant = quantized.WeightQuant.of(weights)
        shapes = jax.eval_shape(lambda p: quantized.quantize_params(p, quant, *weight_layout(config)),
                                param_shapes(config))
        return quantized.packed_bytes(shapes, quantized.int4_bits())
    return config.param_count() * BYTES_PER_ELEMENT[dtype]


def sequences_that_fit(config: Config | CacheGeometry, *, tokens: int, memory_bytes: int, weights_bytes: int,
                       cache_dtype=None) -> int:
    """How many whole sequences of `tokens` tokens have room for their cache in `memory_bytes` once the weights
    (`weights_bytes`) are resident: floor((memory - weights) / cache bytes per sequence), 0 if the weights alone
    do not fit. Activations and allocator overheads are not counted, so this is an upper bound."""
    for name, value in (("memory_bytes", memory_bytes), ("weights_bytes", weights_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    per_sequence = kv_cache_bytes(config, tokens=tokens, cache_dtype=cache_dtype)
    return max(memory_bytes - weights_bytes, 0) // per_sequence


# --- what generate allocates -----------------------------------------------------------------------------------

MIN_PROMPT_BUCKET = 16  # prompts pad to a power of two >= this: lengths 1..500 compile 6 prefill shapes
# Default cache capacities are powers of two >= this, so that max_new_tokens 1..512 after one prompt bucket share
# 3 cache shapes (256, 512, 1024), i.e. 3 prefills and 3 decode loops. Decode time follows the live length, not
# the capacity, so the rounding costs memory only; pass max_len to allocate exactly.
MIN_CAPACITY = 256


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): the bucket sizes batches, prompts and pools round to."""
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """How `generate` lays out a batch, and the cache bytes it asks for and allocates.

    batch:           prompts given.
    padded_batch:    rows computed: the batch padded to a power of two (then to a multiple of the devices it is
                     split over), so batch sizes 5..8 share one compiled shape; filler rows hold one token.
    prompt_len:      T, the padded prompt length: prompts are left-padded to it, all writing at the same slot.
    capacity:        S, cache slots per row: max_len if given, else a power of two >= T + max_new_tokens
                     (+ lookahead; at least MIN_CAPACITY, at most the model's max positions); a sliding-window
                     model's ring holds at most `window` (+ lookahead) slots. A model mixing layer kinds: the
                     full layers' slots.
    ring:            the cache is a ring buffer of `capacity` slots; a model mixing layer kinds: its sliding
                     layers are rings of min(window + lookahead, capacity) slots
                     (`jaxkv.cache.geometry.layer_slots`).
    requested_bytes: `kv_cache_bytes` for `batch` sequences of the longest prompt plus max_new_tokens: what the
                     call needs.
    allocated_bytes: padded_batch x capacity slots: what the cache arrays hold (`Generation.stats`
                     "kv_cache_bytes").
    """

    batch: int
    padded_batch: int
    prompt_len: int
    capacity: int
    ring: bool
    cache_dtype: str
    requested_bytes: int
    allocated_bytes: int
    lookahead: int = 0  # k: a speculative verify's extra tokens per write; a ring holds window + k slots


def _check_request(planner: str, config, prompt_lengths, max_new_tokens):
    """(prompt lengths, max_new_tokens) checked for a planner: positive, and within the model's max positions."""
    if not isinstance(config, Config):
        raise TypeError(f"{planner} needs a jaxkv.Config, got {type(config).__name__}")
    lengths = [positive_int("prompt length", n) for n in prompt_lengths]
    if not lengths:
        raise ValueError("prompt_lengths is empty: pass at least one prompt")
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    limit = config.max_positions
    for i, n in enumerate(lengths):
        if n + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{n + max_new_tokens} positions, beyond the model's max positions ({limit})")
    return lengths, max_new_tokens


def _prompt_len(bucket: int, longest: int, room: int) -> int:
    """The padded prompt length: the bucket, shrunk to `room` (the slots the new tokens and a verify's lookahead
    leave; padding slots count against the capacity) but never below the longest prompt (the lookahead is then
    partly out of room: the loop speculates less near the end)."""
    return max(longest, min(bucket, room))


def plan_cache(config: Config, prompt_lengths, max_new_tokens: int, *, max_len: int | None = None,
               cache_dtype=None, batch_multiple: int = 1, lookahead: int = 0) -> CachePlan:
    """The cache `jaxkv.generate` allocates for prompts of `prompt_lengths` tokens and `max_new_tokens` new ones
    (see `CachePlan`): the same function generate calls, so its figures are the allocation exactly.

    `lookahead`: k, the positions a speculative verify writes past the last token (`jaxkv.Speculation`). They are
    room to speculate, not part of the request: the default capacity counts them as k more slots where the
    model's positions allow (never past them), the padded prompt shrinks (never below the longest prompt) to
    leave them under a given max_len, and a sliding-window model's rings hold window + k slots (a verify writes
    k + 1 tokens at once: `jaxkv.cache.contiguous`, "Ring buffers"). What is valid does not change: where the k
    slots do not fit, the speculative loop takes plain steps (`speculation.room`).

    Raises:
      ValueError: a prompt plus max_new_tokens beyond the model's max positions, max_len beyond them (slots that
        could never be used) or too small for the longest prompt plus max_new_tokens; each names the values
        passed.
    """
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"lookahead must be a non-negative integer, got {lookahead!r}")
    lengths, max_new_tokens = _check_request("plan_cache", config, prompt_lengths, max_new_tokens)
    batch_multiple = positive_int("batch_multiple", batch_multiple)
    cache_dtype = _cache_dtype(CacheGeometry.of(config), cache_dtype)
    longest, limit = max(lengths), config.max_positions
    if max_len is not None:
        max_len = positive_int("max_len", max_len)
        if max_len > limit:
            raise ValueError(f"max_len={max_len} exceeds the model's max positions ({limit}): slots past them "
                             f"could never be used")
    bucket = max(MIN_PROMPT_BUCKET, next_pow2(longest))
    default = min(max(MIN_CAPACITY, next_pow2(bucket + max_new_tokens + lookahead)), limit)
    spans = [w for w in config.layer_spans if w is not None]  # sliding windows, or Llama 4's chunks
    window = max(spans) if spans else None
    if window is not None and not config.every_layer_sliding:
        # Mixed layer kinds (Gemma 2/3): the full layers bound the sequence as a plain cache does; each sliding
        # layer holds a ring of min(window + lookahead, capacity) slots (`jaxkv.cache.geometry.layer_slots`).
        if max_len is not None and longest + max_new_tokens > max_len:
            raise ValueError(f"the longest prompt has {longest} tokens; prompt_len + max_new_tokens = "
                             f"{longest} + {max_new_tokens} = {longest + max_new_tokens} exceeds max_len={max_len}")
        ring, capacity = True, default if max_len is None else max_len
        prompt_len = _prompt_len(bucket, longest, capacity - max_new_tokens - lookahead)
    elif window is not None and (max_len is None or max_len >= window + lookahead):
        # A ring of at most `window` (+ lookahead) slots: memory O(window), not O(sequence). A ring that never
        # wraps (capacity < window) is just a plain cache. The padded prompt may be longer than the ring.
        ring, capacity, prompt_len = True, min(default, window + lookahead), bucket
    else:
        if max_len is not None and longest + max_new_tokens > max_len:
            raise ValueError(f"the longest prompt has {longest} tokens; prompt_len + max_new_tokens = "
                             f"{longest} + {max_new_tokens} = {longest + max_new_tokens} exceeds max_len={max_len}")
        ring, capacity = False, default if max_len is None else max_len
        # The padded prompt and the new tokens must fit: shrink the bucket (never below the longest prompt).
        prompt_len = _prompt_len(bucket, longest, capacity - max_new_tokens - lookahead)
    padded_batch = -(-next_pow2(len(lengths)) // batch_multiple) * batch_multiple

    per_slot = _layer_bytes_per_slot(CacheGeometry.of(config), cache_dtype)
    slot_bytes = sum(S * b for (S, _), b in zip(layer_slots(config, capacity, ring, lookahead), per_slot))
    return CachePlan(batch=len(lengths), padded_batch=padded_batch, prompt_len=prompt_len, capacity=capacity,
                     ring=ring, cache_dtype=cache_dtype,
                     requested_bytes=kv_cache_bytes(config, tokens=longest + max_new_tokens, batch=len(lengths),
                                                    cache_dtype=cache_dtype),
                     allocated_bytes=padded_batch * slot_bytes, lookahead=lookahead)


# --- paged pools ------------------------------------------------------------------------------------------------

DEFAULT_PAGE_SIZE = 16


def page_bytes(config: Config | CacheGeometry, page_size: int, cache_dtype=None) -> int:
    """Bytes of one page over all layers: page_size token slots of K and V (and scales) for every KV head."""
    return positive_int("page_size", page_size) * kv_bytes_per_token(config, cache_dtype)


def pool_bytes(config: Config | CacheGeometry, *, num_pages: int, page_size: int, cache_dtype=None,
               rows: int = 0) -> int:
    """Bytes of a paged pool of `num_pages` pages and (hybrid models) the linear layers' states of its `rows`
    rows (`jaxkv.PagedKVCache.nbytes`; states are per row, not per page)."""
    rows = 0 if rows == 0 else positive_int("rows", rows)
    return (positive_int("num_pages", num_pages) * page_bytes(config, page_size, cache_dtype)
            + rows * state_bytes_per_sequence(config))


def pages_for(prompt_len: int, max_new_tokens: int, n: int, page_size: int) -> int:
    """Pages n samples of one prompt hold at the end, sharing the prompt's full pages: the full pages once, and
    per sample its own partly filled prompt page (copied on fork) and the pages of its new tokens (the last new
    token is sampled but never stored)."""
    full = prompt_len // page_size
    per_sample = -(-(prompt_len + max_new_tokens - 1) // page_size) - full
    return full + n * per_sample


@dataclasses.dataclass(frozen=True)
class PagePlan:
    """How `generate(..., n=N)` lays out a paged batch, and the bytes it needs, allocates and saves.

    batch:           prompts given; rows = batch x n sequences decoded (prompt-major).
    prefill_batch:   prompts padded to a power of two (filler prompts are empty: they take no page).
    padded_rows:     rows padded to a power of two (filler rows are released before decoding).
    prompt_len:      T, the prompts' right-padded length (a power of two >= 16).
    max_pages:       M, page-table entries per sequence: a power of two of slots / page_size (at most the model's
                     max positions).
    pages_needed:    pages in use at the end (the peak: nothing is freed while decoding), `pages_for` summed.
    num_pages:       the pool allocated: pages_needed rounded up to a power of two, so calls share compiled shapes.
    requested_bytes: pages_needed pages; allocated_bytes: the pool; unshared_bytes: what `batch x n` private
                     sequences of prompt + max_new_tokens tokens would take (`kv_cache_bytes`, no sharing).
                     A hybrid model's states (`state_bytes_per_sequence`, per row, never shared) are counted in
                     all three: batch x n rows requested, padded_rows allocated.
    """

    batch: int
    n: int
    prefill_batch: int
    padded_rows: int
    prompt_len: int
    page_size: int
    max_pages: int
    pages_needed: int
    num_pages: int
    cache_dtype: str
    requested_bytes: int
    allocated_bytes: int
    unshared_bytes: int


def plan_pages(config: Config, prompt_lengths, max_new_tokens: int, *, n: int = 1,
               page_size: int = DEFAULT_PAGE_SIZE, cache_dtype=None, max_len: int | None = None,
               lookahead: int = 0) -> PagePlan:
    """The paged layout `jaxkv.generate(..., n=n)` allocates (see `PagePlan`); ValueError for what cannot fit.
    `max_len` bounds each sequence's slots (its page table holds ceil(max_len / page_size) pages). `lookahead`:
    k, the slots a speculative verify writes past a sequence's last token before it gives back what its rejected
    tokens took (`PagedKVCache.rewind`): room to speculate, not part of the request (what is valid does not
    change, and errors name the values passed). The default table counts them as k more slots, and the pages
    counted per sequence include them as far as its table and the model's positions allow (the speculative loop
    verifies only where the k slots fit: `speculation.room`)."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"lookahead must be a non-negative integer, got {lookahead!r}")
    lengths, max_new_tokens = _check_request("plan_pages", config, prompt_lengths, max_new_tokens)
    n, page_size = positive_int("n", n), positive_int("page_size", page_size)
    cache_dtype = _cache_dtype(CacheGeometry.of(config), cache_dtype)
    limit = config.max_positions
    prompt_len = max(MIN_PROMPT_BUCKET, next_pow2(max(lengths)))
    slots = min(next_pow2(max(lengths) + max_new_tokens + lookahead), -(-limit // page_size) * page_size)
    if max_len is not None:
        max_len = positive_int("max_len", max_len)
        if max_len > limit:
            raise ValueError(f"max_len={max_len} exceeds the model's max positions ({limit}): slots past them "
                             f"could never be used")
        if max(lengths) + max_new_tokens > max_len:
            raise ValueError(f"the longest prompt has {max(lengths)} tokens; prompt_len + max_new_tokens = "
                             f"{max(lengths) + max_new_tokens} exceeds max_len={max_len}")
        slots = max_len
    max_pages = -(-slots // page_size)
    # A verify from length L writes slots L..L + k, only where L + k + 1 fits the table and the positions, and
    # only with two tokens of budget left: at most min(x + max_new_tokens + k - 2, reach) slots, within the
    # x + new - 1 that `pages_for` counts (a plain run's new = max_new_tokens).
    reach = min(max_pages * page_size, limit)
    needed = sum(pages_for(x, min(max_new_tokens + lookahead, reach - x + 1), n, page_size) for x in lengths)
    num_pages = next_pow2(needed)
    per_page = page_bytes(config, page_size, cache_dtype)
    rows, padded_rows, state = len(lengths) * n, next_pow2(len(lengths) * n), state_bytes_per_sequence(config)
    unshared = (sum(n * (x + max_new_tokens) for x in lengths) * kv_bytes_per_token(config, cache_dtype)
                + rows * state)
    return PagePlan(batch=len(lengths), n=n, prefill_batch=next_pow2(len(lengths)),
                    padded_rows=padded_rows, prompt_len=prompt_len, page_size=page_size,
                    max_pages=max_pages, pages_needed=needed, num_pages=num_pages, cache_dtype=cache_dtype,
                    requested_bytes=needed * per_page + rows * state,
                    allocated_bytes=num_pages * per_page + padded_rows * state,
                    unshared_bytes=unshared)


def shared_cache_bytes(config: Config | CacheGeometry, *, prompt_tokens: int, new_tokens: int, n: int,
                       page_size: int = DEFAULT_PAGE_SIZE, batch: int = 1, cache_dtype=None) -> int:
    """Bytes `batch` prompts of `prompt_tokens` tokens with `n` samples of `new_tokens` each hold at the end in a
    paged cache with prefix sharing (`pages_for`; `jaxkv.generate(..., n=n)` reports the same figure as
    stats["kv_bytes_in_use_peak"]). Without sharing they would take
    `kv_cache_bytes(config, tokens=prompt_tokens + new_tokens, batch=batch * n)`."""
    pages = pages_for(positive_int("prompt_tokens", prompt_tokens), positive_int("new_tokens", new_tokens),
                      positive_int("n", n), positive_int("page_size", page_size))
    return positive_int("batch", batch) * pages * page_bytes(config, page_size, cache_dtype)
