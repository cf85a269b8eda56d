"""The paged KV cache: a pool of fixed-size pages shared by reference, a page table per sequence, refcounts.

Why pages. A contiguous cache gives every sequence a private stretch of S slots and one shared write position, so
nothing can be shared: 16 samples of one prompt store the prompt's K/V 16 times. Here each layer's keys and
values live in a pool of P pages of `page_size` token slots ([P, K, page_size, H], letters as in `jaxkv.shapes`),
and a sequence is a row of a page table naming its pages in slot order. Sequences that share a prefix name the
same pages; a page's reference count is the number of table entries naming it, and a page with count 0 is free.

  keys, values    L x [P, K, page_size, H]     the pools (int8/fp8 pools: L x float32[P, K, page_size] scales)
  page_table      int32[B, M]                   page of slot s of sequence b: page_table[b, s // page_size]; -1: none
  lengths         int32[B]                      slots written per sequence: its next token goes to slot lengths[b]
  refcounts       int32[P]                      table entries naming each page
  overflowed      bool[B]                       a write found no free page (sticky): that row's output is poisoned

No left padding: every sequence starts at slot and position 0 and writes at its own position. Everything is a
device array of fixed shape in one registered pytree, so the cache goes through `jit`, `lax.scan` /
`lax.while_loop` and donation like `KVCache`, and every operation here is a pure, jittable function:

  reserve(num_new)   pages for each row's next num_new[b] slots, taken from the free pages (lowest index first)
  write(layer, ...)  K/V of new tokens into their slots, through the page table (a scatter; dropped if no page,
                     and for every token of an overflowed row)
  advance(num_new)   lengths += num_new
  rewind(lengths)    lengths set back (a speculative verify's rejected tokens), the pages wholly past them given back
  fork(parents)      a new batch whose row i continues sequence parents[i]: the table rows are gathered and the
                     counts adjusted; the partly filled last page of a sequence is copied (copy-on-write) for every
                     row but the first that continues it, so no write ever lands in a page another row reads
  release(rows)      drops the rows' pages (count - 1) and empties them (rows: a bool mask of B, or row indices)

Running out of pages. The host refuses a call whose need it knows before any compute (`jaxkv.cache.planner`).
Inside a compiled loop, a row that needs a page when none is free gets none (`reserve`), and a fork's child that finds
no free page for its copy of a shared partly filled page stays on that page: either way `overflowed[b]` turns true, the
decoder gives that row NaN logits, and from then on none of its writes lands anywhere (each is a scatter to an
out-of-range page) until the row is released. Other rows' pages are never touched.

Keys only (multi-head latent attention, `Config.mla`). An MLA model caches one latent row [c ; k_rope] of R + E
per token and layer and no values (its values are the row's first R columns, `jaxkv.attention.mla`): the pools are
`keys` L x [P, 1, page_size, R + E] (scales L x float32[P, 1, page_size]) and `values` / `value_scales` are empty,
as in the contiguous `KVCache`. `write` then takes v=None. The page bookkeeping (reserve, fork and its
copy-on-write, release) only ever touches the page table, the counts and whatever pools there are, so it is the
same for both.

States (hybrid models, `Config.linear_attention`). A linear-attention layer stores no K/V in the pool (its pools
are [P, 0, page_size, 0] placeholders of no bytes) but a fixed-size state per row, as in `KVCache`:
`conv_states[l]` [B, U, Y - 1] and `recurrent_states[l]` float32 [B, Hv, Dk, Dv] (empty on the other layers).
States are rows, not pages: `fork` gathers them with the table rows (each child gets its own copy: a state is a
few hundred KB per layer and every child's differs after its first token), `release` zeroes them. A state is the
row's summary up to `lengths[b]` and cannot be rewound, so `rewind` would leave it ahead of the length: the
speculative loop does not run a hybrid model yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.storage import LayerStates, quantize, state_rows, zeroed_buffers, zeroed_states
from jaxkv.config import Config

NO_PAGE = -1


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["keys", "values", "page_table", "lengths", "refcounts", "overflowed", "key_scales",
                                "value_scales", "conv_states", "recurrent_states"],
                   meta_fields=["page_size"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache(LayerStates):
    keys: tuple[jax.Array, ...]  # L x [P, K, page_size, H]
    values: tuple[jax.Array, ...]  # L x [P, K, page_size, H]; MLA: empty (keys only, module docstring)
    page_table: jax.Array  # int32[B, M]
    lengths: jax.Array  # int32[B]
    refcounts: jax.Array  # int32[P]
    overflowed: jax.Array  # bool[B]
    key_scales: tuple[jax.Array, ...] = ()  # L x float32[P, K, page_size] for int8/fp8 pools, else empty
    value_scales: tuple[jax.Array, ...] = ()  # empty for int8/fp8 keys-only (MLA) pools too
    conv_states: tuple[jax.Array, ...] = ()  # hybrid models: L x [B, U, Y - 1] (empty on non-linear layers)
    recurrent_states: tuple[jax.Array, ...] = ()  # hybrid models: L x float32[B, Hv, Dk, Dv] (likewise)
    page_size: int = 16  # static

    @classmethod
    def allocate(cls, config: Config, batch: int, *, num_pages: int, page_size: int, max_len: int,
                 dtype=None) -> "PagedKVCache":
        """An empty cache: `num_pages` free pages of `page_size` slots per layer, `batch` empty sequences of at most
        `max_len` slots each (M = ceil(max_len / page_size) table entries); `dtype` one of CACHE_DTYPES (default
        config.dtype). An MLA config gets key pools only (`jaxkv.cache.storage.zeroed_buffers`).

        Per-layer geometry (Gemma 4): each layer's pools have its own KV heads and head dim
        (`Config.layer_kv_heads`, `layer_head_dim`); a layer that shares another's K/V (`Config.kv_source`) gets
        an empty [0, K, page_size, H] placeholder (no bytes) and reads its source layer's pools. One page table
        serves every layer: a page index names the same token slots in every pool."""
        keys, values, key_scales, value_scales = zeroed_buffers(config, [
            (num_pages if config.caches_kv(layer) else 0, config.layer_kv_heads(layer), page_size,
             config.layer_head_dim(layer)) for layer in range(config.n_layers)], dtype)
        M = -(-max_len // page_size)
        conv_states, recurrent_states = zeroed_states(config, batch)
        return cls(keys=keys, values=values, page_table=jnp.full((batch, M), NO_PAGE, jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32), refcounts=jnp.zeros((num_pages,), jnp.int32),
                   overflowed=jnp.zeros((batch,), bool), key_scales=key_scales, value_scales=value_scales,
                   conv_states=conv_states, recurrent_states=recurrent_states, page_size=page_size)

    # --- shapes -------------------------------------------------------------------------------------------------

    @property
    def dtype(self) -> str:
        return self.keys[0].dtype.name

    @property
    def quantized(self) -> bool:
        return bool(self.key_scales)

    @property
    def keys_only(self) -> bool:
        """A multi-head latent attention pool: latent rows as keys, no value pools."""
        return not self.values

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_pages(self) -> int:
        return self.refcounts.shape[0]  # (not keys[0]'s: a sharing or linear layer's pool is an empty placeholder)

    @property
    def capacity(self) -> int:
        """Slots one sequence can hold: table entries x page size."""
        return self.page_table.shape[1] * self.page_size

    def scales(self, layer: int):
        """(key scales, value scales) of `layer`, each None where that kind is not quantized (an unquantized pool,
        a keys-only pool's values; DeepSeek-V3.2's float8 indexer keys beside unquantized rows)."""
        return (self.key_scales[layer] if self.key_scales else None,
                self.value_scales[layer] if self.value_scales else None)

    def nbytes(self) -> int:
        """Bytes of the pools (keys, values and scales) and (hybrid models) the rows' states: what
        `jaxkv.cache.planner.pool_bytes` predicts (given the rows)."""
        return self.state_nbytes() + sum(a.size * a.dtype.itemsize
                                         for a in (*self.keys, *self.values, *self.key_scales, *self.value_scales))

    def pages_in_use(self) -> jax.Array:
        """int32[]: pages some sequence holds."""
        return jnp.sum(self.refcounts > 0, dtype=jnp.int32)

    def positions(self, num_tokens: int) -> jax.Array:
        """int32[B, T]: position ids of the next `num_tokens` tokens of each sequence (its slots)."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    # --- page bookkeeping ---------------------------------------------------------------------------------------

    def count_pages(self, table, sign: int, refcounts):
        """refcounts + sign for every page named in `table` (any shape; -1 entries ignored)."""
        flat = table.reshape(-1)
        return refcounts.at[jnp.where(flat >= 0, flat, self.num_pages)].add(sign, mode="drop")

    def reserve(self, num_new) -> "PagedKVCache":
        """Gives each row pages for slots [lengths[b], lengths[b] + num_new[b]) where its table has none, taking
        free pages lowest index first, in row-major order of the entries that need one. A row that finds too few
        free pages gets none for the missing entries (its writes there are dropped) and is marked overflowed."""
        num_new = jnp.broadcast_to(jnp.asarray(num_new, jnp.int32), self.lengths.shape)
        B, M = self.page_table.shape
        P, ps = self.num_pages, self.page_size
        entry = jnp.arange(M, dtype=jnp.int32)[None, :]  # [1, M]
        end = self.lengths + num_new  # [B]
        needed = (entry * ps < end[:, None]) & (self.page_table == NO_PAGE)  # [B, M]
        too_long = end > M * ps  # slots past the table: no entry can hold them
        flat = needed.reshape(-1)
        rank = jnp.cumsum(flat, dtype=jnp.int32) - 1  # the k-th entry needing a page gets the k-th free page
        free = jnp.nonzero(self.refcounts == 0, size=B * M, fill_value=P)[0].astype(jnp.int32)
        got = jnp.where(flat, free[jnp.clip(rank, 0, B * M - 1)], P)  # P: none available
        table = jnp.where(flat & (got < P), got, self.page_table.reshape(-1)).reshape(B, M)
        short = jnp.any((flat & (got >= P)).reshape(B, M), axis=1)
        refcounts = self.refcounts.at[got].add(1, mode="drop")
        return dataclasses.replace(self, page_table=table, refcounts=refcounts,
                                   overflowed=self.overflowed | short | too_long)

    def advance(self, num_new) -> "PagedKVCache":
        num_new = jnp.broadcast_to(jnp.asarray(num_new, jnp.int32), self.lengths.shape)
        return dataclasses.replace(self, lengths=self.lengths + num_new)

    def rewind(self, lengths) -> "PagedKVCache":
        """Sets each row's length back to lengths[b] (<= its length: the slots past it were written by a
        speculative verify for tokens it rejected) and gives back the pages wholly past it, so the row holds
        what it would had the rejected tokens never been written. The K/V left in the slots of its last page past
        lengths[b] are never read (every query is masked to a row's length) and are overwritten by its next
        writes. A page past a row's length is that row's own (sharing only ever covers written slots: forks,
        prefix hits), so its count drops to 0."""
        lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), self.lengths.shape)
        entry = jnp.arange(self.page_table.shape[1], dtype=jnp.int32)[None, :]
        past = entry * self.page_size >= lengths[:, None]  # [B, M]: entries holding no slot below the length
        dropped = jnp.where(past, self.page_table, NO_PAGE)
        return dataclasses.replace(self, lengths=lengths, page_table=jnp.where(past, NO_PAGE, self.page_table),
                                   refcounts=self.count_pages(dropped, -1, self.refcounts))

    def _slots(self, num_tokens: int, valid):
        """(page int32[B, T], offset int32[B, T]) of each row's next `num_tokens` slots; page P (out of range, so a
        scatter drops it) where the token is not valid, the row has no page there, or the row is overflowed: a
        starved row writes nowhere (a copy-on-write fork that found no free page leaves it on a page a sibling
        writes and reads; its own output is NaN anyway)."""
        slot = self.positions(num_tokens)  # [B, T]
        entry = slot // self.page_size
        M = self.page_table.shape[1]
        page = jnp.take_along_axis(self.page_table, jnp.clip(entry, 0, M - 1), axis=1)
        ok = valid & ~self.overflowed[:, None] & (entry < M) & (page >= 0)
        return jnp.where(ok, page, self.num_pages), slot % self.page_size

    def write(self, layer: int, k: jax.Array, v: jax.Array | None, valid=None) -> "PagedKVCache":
        """k, v [B, K, T, H] into slots [lengths[b], lengths[b] + T) of each row (quantized first for an int8/fp8
        pool); `valid` bool[B, T] marks the tokens to store (prefill's right padding is not stored). A keys-only
        (MLA) pool takes v=None and k the latent rows [B, 1, T, R + E]. `reserve` first; `advance` once per
        forward pass."""
        if (v is None) != self.keys_only:
            raise ValueError("a keys-only (MLA) paged cache takes v=None, any other cache takes values"
                             if self.keys_only else "this paged cache stores values: v must not be None")
        T = k.shape[2]
        valid = jnp.ones(k.shape[:1] + (T,), bool) if valid is None else valid
        page, offset = self._slots(T, valid)  # [B, T]

        def put(pool, new):  # pool [P, K, ps, ...], new [B, K, T, ...]
            new = jnp.moveaxis(new, 2, 1)  # [B, T, K, ...]
            return pool.at[page, :, offset].set(new.astype(pool.dtype), mode="drop")

        # Keys and values each quantized where their pools are (`scales`; DeepSeek-V3.2's float8 indexer keys).
        k_scale, v_scale = self.scales(layer)
        if k_scale is not None:
            k, new_k_scale = quantize(k, self.dtype)
        if v is not None and v_scale is not None:
            v, new_v_scale = quantize(v, self.values[layer].dtype.name)
        with jax.named_scope("paged_cache_update"):
            cache = self._with_layer(layer, put(self.keys[layer], k), None if v is None else put(self.values[layer], v))
            cache = cache._with_layer_scales(layer, None if k_scale is None else put(k_scale, new_k_scale),
                                             None if v is None or v_scale is None else put(v_scale, new_v_scale))
        return cache

    def fork(self, parents) -> "PagedKVCache":
        """A cache of len(parents) rows whose row i continues sequence parents[i] (int32[B'], any B'; a row may
        appear many times, or not at all: then its pages are released; a negative parent makes an empty row).

        Full pages are shared by reference (count + 1 per new holder). A partly filled last page is shared by
        every child at the same fill, so the first child continuing it (lowest row) keeps it and each other child
        gets a copy: from then on every row writes only to pages no other row reads."""
        parents = jnp.asarray(parents, jnp.int32)
        some = parents >= 0  # a negative parent: an empty row (no pages, length 0)
        src = jnp.maximum(parents, 0)
        table = jnp.where(some[:, None], self.page_table[src], NO_PAGE)  # [B', M]
        lengths = jnp.where(some, self.lengths[src], 0)
        overflowed = some & self.overflowed[src]
        refcounts = self.count_pages(self.page_table, -1, self.count_pages(table, +1, self.refcounts))
        cache = dataclasses.replace(self, page_table=table, lengths=lengths, overflowed=overflowed,
                                    refcounts=refcounts, conv_states=state_rows(self.conv_states, src, some),
                                    recurrent_states=state_rows(self.recurrent_states, src, some))
        return cache._copy_shared_last_pages()

    def _copy_shared_last_pages(self) -> "PagedKVCache":
        B, M = self.page_table.shape
        P, ps = self.num_pages, self.page_size
        rows = jnp.arange(B, dtype=jnp.int32)
        partial = (self.lengths % ps) != 0
        entry = jnp.clip(self.lengths // ps, 0, M - 1)
        # An overflowed row writes nowhere (`_slots`): it neither keeps nor copies its partly filled page.
        last = jnp.where(partial & ~self.overflowed, self.page_table[rows, entry], NO_PAGE)  # [B]
        # The first healthy row holding each partly filled page keeps it.
        first = jnp.full((P,), B, jnp.int32).at[jnp.where(last >= 0, last, P)].min(rows, mode="drop")
        copies = (last >= 0) & (first[jnp.maximum(last, 0)] != rows)  # [B]
        rank = jnp.cumsum(copies, dtype=jnp.int32) - 1
        free = jnp.nonzero(self.refcounts == 0, size=B, fill_value=P)[0].astype(jnp.int32)
        fresh = jnp.where(copies, free[jnp.clip(rank, 0, B - 1)], P)  # [B]; P: none (or no copy)
        got = fresh < P
        src = jnp.where(got, last, P)

        def copy(pool):  # pool[fresh[b]] = pool[last[b]] for the copying rows; a sharing layer's placeholder: none
            if pool.shape[0] == 0:
                return pool
            return pool.at[fresh].set(pool[jnp.clip(src, 0, P - 1)], mode="drop")

        keys, values = tuple(map(copy, self.keys)), tuple(map(copy, self.values))
        key_scales, value_scales = tuple(map(copy, self.key_scales)), tuple(map(copy, self.value_scales))
        table = self.page_table.at[rows, entry].set(jnp.where(got, fresh, self.page_table[rows, entry]))
        refcounts = self.refcounts.at[fresh].add(1, mode="drop").at[src].add(-1, mode="drop")
        # A copy that found no free page leaves the row on the shared page: overflowed, so it writes nowhere.
        overflowed = self.overflowed | (copies & ~got)
        return dataclasses.replace(self, keys=keys, values=values, key_scales=key_scales, value_scales=value_scales,
                                   page_table=table, refcounts=refcounts, overflowed=overflowed)

    def release(self, rows) -> "PagedKVCache":
        """Drops the pages of the rows `rows` names (count - 1 each; a page at 0 is free) and empties those rows (no
        pages, length 0). `rows` is either a bool mask of length B (true: release) or row indices: an int, or a
        1-D sequence / array of ints (`[0, 1]`: rows 0 and 1; `[]`: none). Refused with a ValueError before any
        compute: a mask of another length, indices of another shape, an index outside [0, B) or one given twice,
        any other dtype. Under `jit` traced indices cannot be checked by value: one outside [0, B) is ignored."""
        rows = self._row_mask(rows)
        dropped = jnp.where(rows[:, None], self.page_table, NO_PAGE)
        return dataclasses.replace(self, refcounts=self.count_pages(dropped, -1, self.refcounts),
                                   page_table=jnp.where(rows[:, None], NO_PAGE, self.page_table),
                                   lengths=jnp.where(rows, 0, self.lengths),
                                   overflowed=jnp.where(rows, False, self.overflowed),
                                   conv_states=state_rows(self.conv_states, None, ~rows),
                                   recurrent_states=state_rows(self.recurrent_states, None, ~rows))

    # --- rows as batches of their own (the engine's slots and staging rows) -----------------------------------

    def take_rows(self, rows) -> "PagedKVCache":
        """The rows `rows` (int32[n], -1: an empty row) as a batch of their own over the same pools: their table
        rows, lengths, overflow flags and states. Use it, then `put_rows` it back."""
        rows = jnp.asarray(rows, jnp.int32)
        used = rows >= 0
        row = jnp.maximum(rows, 0)

        def take(x, empty):
            return jnp.where(used.reshape((-1,) + (1,) * (x.ndim - 1)), x[row], jnp.asarray(empty, x.dtype))

        return dataclasses.replace(self, page_table=take(self.page_table, NO_PAGE), lengths=take(self.lengths, 0),
                                   overflowed=take(self.overflowed, False),
                                   conv_states=state_rows(self.conv_states, row, used),
                                   recurrent_states=state_rows(self.recurrent_states, row, used))

    def put_rows(self, rows, sub: "PagedKVCache") -> "PagedKVCache":
        """`sub` (from `take_rows(rows)`, then used) back: its pools and counts, and its rows into rows `rows`
        (-1 entries dropped)."""
        rows = jnp.asarray(rows, jnp.int32)
        back = jnp.where(rows >= 0, rows, self.batch)  # out of range for empty rows: dropped

        def put(x, new):
            return x.at[back].set(new, mode="drop")

        return dataclasses.replace(sub, page_table=put(self.page_table, sub.page_table),
                                   lengths=put(self.lengths, sub.lengths),
                                   overflowed=put(self.overflowed, sub.overflowed),
                                   conv_states=tuple(map(put, self.conv_states, sub.conv_states)),
                                   recurrent_states=tuple(map(put, self.recurrent_states, sub.recurrent_states)))

    def move_rows(self, dst, src) -> "PagedKVCache":
        """Row dst[i] takes over the sequence of row src[i] (int32[n] each; dst[i] outside [0, B): nothing
        moves): its table row, length, overflow flag and states move, no page is copied or recounted, and row
        src[i] empties (as `release` leaves a row). Destinations and sources must be disjoint sets."""
        dst, src = jnp.asarray(dst, jnp.int32), jnp.asarray(src, jnp.int32)
        B = self.batch
        moving = (dst >= 0) & (dst < B)
        dst = jnp.where(moving, dst, B)
        src = jnp.clip(src, 0, B - 1)
        emptied = jnp.where(moving, src, B)

        def move(x, empty):
            return x.at[dst].set(x[src], mode="drop").at[emptied].set(jnp.asarray(empty, x.dtype), mode="drop")

        return dataclasses.replace(self, page_table=move(self.page_table, NO_PAGE), lengths=move(self.lengths, 0),
                                   overflowed=move(self.overflowed, False),
                                   conv_states=tuple(move(x, 0) for x in self.conv_states),
                                   recurrent_states=tuple(move(x, 0) for x in self.recurrent_states))

    def with_row_states(self, rows, conv, recurrent) -> "PagedKVCache":
        """The cache with the states of rows `rows` (int32[n]) replaced: per layer conv[l] / recurrent[l] [n, ...]
        (a `PrefixCache` snapshot a row resumes from)."""
        rows = jnp.asarray(rows, jnp.int32)
        return dataclasses.replace(
            self, conv_states=tuple(x.at[rows].set(new.astype(x.dtype)) for x, new in zip(self.conv_states, conv)),
            recurrent_states=tuple(x.at[rows].set(new.astype(x.dtype))
                                   for x, new in zip(self.recurrent_states, recurrent)))

    def _row_mask(self, rows) -> jax.Array:
        """bool[B] from a bool mask or row indices (`release`), checked before any compute."""
        B = self.batch
        traced = isinstance(rows, jax.core.Tracer)
        if not traced:
            rows = np.asarray(rows)
            if rows.size == 0 and rows.ndim == 1:  # [] (numpy makes it float64): no rows
                rows = rows.astype(np.int32)
        if rows.dtype == bool:
            if rows.shape != (B,):
                raise ValueError(f"release: a bool mask of {B} rows (one per row of the cache), got shape "
                                 f"{tuple(rows.shape)}; or pass row indices")
            return jnp.asarray(rows)
        if not jnp.issubdtype(rows.dtype, jnp.integer):
            raise ValueError(f"release takes row indices or a bool mask of {B} rows, got dtype {rows.dtype}")
        if rows.ndim > 1:
            raise ValueError(f"release: row indices must be an int or 1-D, got shape {tuple(rows.shape)}")
        rows = rows.reshape(-1)
        if not traced:
            bad = rows[(rows < 0) | (rows >= B)]
            if bad.size:
                raise ValueError(f"release: row index {int(bad[0])} out of range for a cache of {B} rows")
            if np.unique(rows).size != rows.size:
                raise ValueError(f"release: row indices {rows.tolist()} name a row more than once")
        rows = jnp.asarray(rows, jnp.int32)
        return jnp.zeros((B,), bool).at[jnp.where((rows >= 0) & (rows < B), rows, B)].set(True, mode="drop")

    # --- layer buffers ------------------------------------------------------------------------------------------

    @staticmethod
    def _replaced(buffers: tuple, layer: int, new) -> tuple:
        """`buffers` with layer `layer` replaced by `new`; None (a keys-only pool's values) leaves them as they are."""
        return buffers if new is None else buffers[:layer] + (new,) + buffers[layer + 1:]

    def _with_layer(self, layer: int, k, v) -> "PagedKVCache":
        return dataclasses.replace(self, keys=self._replaced(self.keys, layer, k),
                                   values=self._replaced(self.values, layer, v))

    def _with_layer_scales(self, layer: int, k_scale, v_scale) -> "PagedKVCache":
        return dataclasses.replace(self, key_scales=self._replaced(self.key_scales, layer, k_scale),
                                   value_scales=self._replaced(self.value_scales, layer, v_scale))


def fork(cache: PagedKVCache, parents) -> PagedKVCache:
    """`cache.fork(parents)`: a cache whose row i continues sequence parents[i] (shared full pages, copy-on-write
    of a shared partial last page; a negative parent gives an empty row). Pure and jittable."""
    return cache.fork(parents)


def release(cache: PagedKVCache, rows) -> PagedKVCache:
    """`cache.release(rows)`: the rows `rows` names drop their pages and become empty. `rows`: a bool mask of
    length B, or row indices (an int or a 1-D sequence / array of ints; `[0, 1]` is rows 0 and 1). A mask of
    another length, indices out of range or repeated, or another shape or dtype: ValueError, before any compute."""
    return cache.release(rows)
