"""Prompt caching: a page pool kept across `generate` calls, and an index of the prefixes its pages hold.

A prompt that many calls share (a system prompt, a few-shot header) is prefilled once: its K/V pages stay in the
pool after the call, indexed by their token ids, and a later call whose prompt starts with the same tokens reuses
those pages and prefills only the rest.

Matching is in whole pages. A prompt is cut into page-sized blocks of token ids; block k's key is a chain of the
keys before it and its own ids (`_block_keys`), so a key names the whole prefix up to that block, not just the
block (the same 16 tokens after different prefixes have different K/V). The index maps a key to the page holding
that block's K/V. A match stops at the first block not in the index, and always leaves at least one token to
prefill (the last prompt token's logits start the sampling).

Pages and references. The pool's refcounts count every holder: each sequence whose page table names the page, plus
one for the index while the page is cached. So a cached page is never handed out as free, a page a running
sequence holds is never freed by eviction, and when a call ends (its sequences released) the pages only the
index holds stay, ready for the next call. When a call needs more free pages than there are, the least recently
used cached blocks are dropped from the index (a prefix's later blocks before its earlier ones, since a match
and an adoption touch them last to first) until enough are free; if dropping them all is not enough, the call is refused
before any compute, naming the pages needed and available.

A prefix cache belongs to one model (config and parameters) and one cache dtype and page size: using it with
another is a ValueError, since the K/V it holds would be wrong for them.

State snapshots (hybrid models, `Config.linear_attention`). A linear-attention layer's state at a prompt position
summarizes every token before it, and cannot be recomputed from cached K/V: reusing a prefix's pages also needs
the state at the prefix's end. So the cache keeps snapshots of the rows' states (every linear layer's conv window
and delta-rule state: `Config.state_bytes_per_sequence` bytes each, `snapshot_bytes`) at page boundaries every
`snapshot_interval` tokens of the prompts it prefilled, keyed by the block key of the block ending there, in a store
of `max_snapshots` slots (least recently used dropped first; a block dropped from the index drops its snapshot).
A match then ends at the longest cached prefix whose last block has a snapshot (`match_with_state`), and the row
starts from that snapshot's state: hits land on snapshot boundaries only, the rest is prefilled. A snapshot is
taken where a prefill chunk ends, so prompts are prefilled in chunks that end on those boundaries (`generate`:
chunks of exactly the interval; the engine: its chunks cut back to the last boundary they reach).

The host tier (`host_pages`). A block evicted from the device pool is copied to host memory instead of dropped
(the page's K/V in every layer, with its scales: `planner.pool_bytes` per page): to the backend's "pinned_host"
memory where it has one (GPU, TPU, and XLA:CPU here), as host numpy arrays otherwise; jax-llm-examples, JetStream
and sglang's HiCache keep prefixes the same way. A later prompt whose device match stops where host blocks
continue it (`host_match`) gets them copied back into free device pages (`take_host` + `write_pages`, then
`indexed`) instead of prefilling them again: a hit of both tiers. Each tier is least recently used first: a block
copied back leaves the host tier (it is a device block again), and the host tier drops its oldest blocks beyond
`host_pages`. Evictions copy in batches (one device gather and one transfer per eviction), and a batch's host
memory is freed when its last block is dropped. Not for hybrid models yet (a spilled block would need its state
snapshot too).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import checks, sharding
from jaxkv.cache import planner
from jaxkv.cache.dtypes import check_cache_dtype
from jaxkv.cache.paged import PagedKVCache
from jaxkv.cache.storage import state_rows, zeroed_states
from jaxkv.config import Config

DEFAULT_SNAPSHOT_INTERVAL = 128  # tokens (rounded up to whole pages): a hybrid model's snapshot spacing


def _block_keys(tokens, page_size: int) -> list[bytes]:
    """The chained keys of a prompt's whole page-sized blocks: key k digests key k - 1 and block k's ids."""
    keys, previous = [], b""
    for k in range(len(tokens) // page_size):
        block = np.asarray(tokens[k * page_size:(k + 1) * page_size], np.int64).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        keys.append(previous)
    return keys


class PrefixCache:
    """A page pool shared by `jaxkv.generate` calls, reusing the pages of prefixes computed before.

        pc = jaxkv.PrefixCache(model, num_pages=512)
        out = jaxkv.generate(model, [system + question], max_new_tokens=64, prefix_cache=pc)
        out.stats["prefix_hit_tokens"], out.stats["prefilled_tokens"]

    Args:
      model: the `jaxkv.Model` whose K/V the pool holds.
      num_pages: pages in the pool (per layer): `jaxkv.planner.pool_bytes` gives its size in bytes. It must hold
        a whole call's sequences (prompts and new tokens) besides whatever is cached. Default: four sequences of
        the model's max positions.
      page_size: token slots per page; prefixes match in whole pages of this many tokens.
      cache_dtype: the pool's dtype (default: the model's), one of `jaxkv.cache.CACHE_DTYPES`.
      mesh: for a `jaxkv.Engine` or paged `jaxkv.generate` on a ("data", "model") mesh (data 1): the pool is
        allocated as theirs is, split over KV heads on "model" (repeated where the axis does not divide them,
        `jaxkv.sharding`). Such a cache serves calls on that mesh only.
      snapshot_interval: (hybrid models only) tokens between state snapshots, a multiple of page_size (default
        128 rounded up to whole pages): a hit resumes at the longest such boundary of a cached prefix.
      max_snapshots: (hybrid models only) snapshots kept, each `snapshot_bytes` (default: one per interval of the
        pool's pages, so every cached boundary can keep one, but at most as many as fit in the pool's own bytes: a
        real model's snapshot is tens of MB, hundreds of pages' worth).
      host_pages: pages the host tier holds (module docstring; 0: none, evicted blocks are dropped), each
        `page_bytes` bytes of host memory: `jaxkv serve --host-cache-gib G` sizes it in GiB.
    """

    def __init__(self, model, *, num_pages: int | None = None, page_size: int = planner.DEFAULT_PAGE_SIZE,
                 cache_dtype=None, mesh=None, snapshot_interval: int | None = None,
                 max_snapshots: int | None = None, host_pages: int = 0):
        # A jaxkv.Model by what it holds (a Config and params): the cache package sits below the model and never
        # imports it.
        if not isinstance(getattr(model, "config", None), Config) or not hasattr(model, "params"):
            raise ValueError(f"model must be a jaxkv.Model, got {type(model).__name__}")
        self.config, self._params = model.config, model.params
        self.hybrid = self.config.linear_attention is not None
        if self.hybrid and mesh is not None:
            raise ValueError("a PrefixCache on a mesh with a hybrid model (linear_attention layers, e.g. "
                             "Qwen3-Next) is not supported yet")
        if not self.hybrid and (snapshot_interval is not None or max_snapshots is not None):
            raise ValueError("snapshot_interval and max_snapshots are for hybrid models (linear_attention layers, "
                             "whose prefixes need their states): this model caches K/V only")
        self.page_size = checks.check_int("page_size", page_size, 1)
        if num_pages is None:
            num_pages = 4 * -(-model.config.max_positions // self.page_size)
        self.num_pages = checks.check_int("num_pages", num_pages, 1)
        self.snapshot_interval = self.max_snapshots = 0
        if self.hybrid:
            interval = DEFAULT_SNAPSHOT_INTERVAL if snapshot_interval is None else checks.check_int(
                "snapshot_interval", snapshot_interval, 1)
            if snapshot_interval is not None and interval % self.page_size:
                raise ValueError(f"snapshot_interval={interval} must be a multiple of page_size={self.page_size}: "
                                 f"snapshots are taken at page boundaries")
            self.snapshot_interval = -(-interval // self.page_size) * self.page_size
            if max_snapshots is None:  # one per interval of the pool's pages, in at most the pool's bytes
                pool = planner.pool_bytes(self.config, num_pages=self.num_pages, page_size=self.page_size,
                                          cache_dtype=cache_dtype)
                max_snapshots = max(1, min(self.num_pages * self.page_size // self.snapshot_interval,
                                           pool // self.config.state_bytes_per_sequence()))
            self.max_snapshots = checks.check_int("max_snapshots", max_snapshots, 1)
        self.cache_dtype = check_cache_dtype(model.config.dtype if cache_dtype is None else cache_dtype)
        self.mesh = None if mesh is None else sharding.check_paged_mesh(mesh)
        self._run_config = model.config if mesh is None else sharding.check_config(model.config, self.mesh)
        self._pools = self._empty_pools()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> page, LRU first
        # Hybrid models: the snapshot store (per layer [N, ...] state rows, `zeroed_states`) and its index,
        # block key -> slot, least recently used first.
        self._snapshots = self._empty_snapshots()
        self._snapshot_index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        # Inside a `transaction`: the snapshots taken so far, (keys, (conv, recurrent) rows), stored only when the
        # call succeeds (the store is donated as it is written, so a failed call could not be undone otherwise).
        self._pending: list | None = None
        self.lent_to = None  # the `jaxkv.Engine` running in this pool now, if any (it holds the pool meanwhile)
        self.host_pages = checks.check_int("host_pages", host_pages, 0)
        if self.host_pages and self.hybrid:
            raise ValueError("a host tier (host_pages) for a hybrid model (linear_attention layers) is not supported "
                             "yet: its blocks would need their state snapshots on the host too")
        # The host tier: block key -> (batch id, row of that batch), least recently used first; batch id -> [the
        # batch's arrays (the pool's tuples, [n, ...] per layer) in host memory, blocks of it still indexed].
        self._host_index: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()
        self._host_batches: dict[int, list] = {}
        self._host_batch_ids = 0
        self._host_memory = _host_memory()
        self.host_stats = collections.Counter()  # spilled_pages, restored_pages, host_dropped_pages

    def _empty_pools(self) -> "_Pools":
        empty = PagedKVCache.allocate(self._run_config, 1, num_pages=self.num_pages, page_size=self.page_size,
                                      max_len=self.page_size, dtype=self.cache_dtype)
        if self.mesh is not None:  # as the engine places its pool: split over KV heads, the rest replicated
            empty = jax.device_put(empty, sharding.paged_cache_shardings(empty, self.mesh))
        else:
            # Committed to the device, as the pool is once a program has returned it: jit keys on committedness,
            # so fresh arrays here would make every program compile twice (first use, then every later one).
            empty = jax.device_put(empty, jax.local_devices()[0])
        return _Pools.of(empty)

    def _empty_snapshots(self):
        if not self.hybrid:
            return (), ()
        return jax.device_put(zeroed_states(self._run_config, self.max_snapshots), jax.local_devices()[0])

    # --- what generate asks of it -------------------------------------------------------------------------------

    def check(self, model, cache_dtype: str, page_size: int, mesh=None):
        """ValueError unless `model`, `cache_dtype`, `page_size` and `mesh` are the ones this cache was built for."""
        devices = lambda m: None if m is None else m.devices.tolist()  # noqa: E731
        if devices(mesh) != devices(self.mesh):
            built = "one device" if self.mesh is None else f"a mesh of {self.mesh.devices.size} devices"
            runs = "one device" if mesh is None else "another mesh"
            raise ValueError(f"this PrefixCache's pool is laid out for {built}; the call runs on {runs}: build it "
                             f"with jaxkv.PrefixCache(..., mesh=) of the call's mesh")
        if self.lent_to is not None:
            raise ValueError("this PrefixCache's pool is in use by a jaxkv.Engine with requests in flight: finish "
                             "them (engine.results()) first")
        if model.config != self.config or model.params is not self._params:
            raise ValueError("this PrefixCache holds K/V of another model: build one PrefixCache per model")
        if cache_dtype != self.cache_dtype:
            raise ValueError(f"this PrefixCache holds {self.cache_dtype} pages, the call asks for a {cache_dtype} "
                             f"cache: build one PrefixCache per cache dtype")
        if page_size != self.page_size:
            raise ValueError(f"this PrefixCache has pages of {self.page_size} slots, the call asks for "
                             f"{page_size}: drop page_size, or build another PrefixCache")

    @contextlib.contextmanager
    def transaction(self):
        """A `generate` call's use of the cache: if the block raises (a refused call, a sampler or stream callback
        that fails half way, an interrupt), the index and the pool are put back as they were, so no entry names a
        page whose K/V never reached the pool. If the pool itself was lost (donated to a program that failed),
        the cache starts empty: every entry it keeps is always complete and valid."""
        index, pools = collections.OrderedDict(self._index), self._pools
        snapshot_index = collections.OrderedDict(self._snapshot_index)
        host = (collections.OrderedDict(self._host_index), {b: list(e) for b, e in self._host_batches.items()},
                collections.Counter(self.host_stats))
        self._pending = []
        try:
            yield
        except BaseException:
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(pools.arrays())):
                index, pools, snapshot_index = collections.OrderedDict(), self._empty_pools(), collections.OrderedDict()
            self._index, self._pools, self._snapshot_index = index, pools, snapshot_index
            self._host_index, self._host_batches, self.host_stats = host  # (host arrays are never changed in place)
            raise
        else:
            for keys, states in self._pending:
                self._store(keys, states)
        finally:
            self._pending = None

    def match(self, tokens) -> list[int]:
        """The cached pages of the longest whole-page prefix of `tokens` (leaving at least one token), marked
        recently used, last block first. A hybrid model's: only up to the last block with a state snapshot
        (`match_with_state`)."""
        return self.match_with_state(tokens)[0]

    def match_with_state(self, tokens) -> tuple[list[int], int]:
        """(`match`'s pages, the snapshot slot of the state after them, -1 for none). For a model without linear
        layers every cached prefix is usable (slot -1); for a hybrid model the match is cut back to the longest
        one whose last block has a snapshot (none: no pages), whose state the row then starts from
        (`snapshot_rows`)."""
        keys = _block_keys(tokens[:len(tokens) - 1], self.page_size)
        pages = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                break
            pages.append(page)
        slot = -1
        if self.hybrid:
            usable = [k for k in range(len(pages)) if keys[k] in self._snapshot_index]
            pages = pages[:usable[-1] + 1] if usable else []
            if pages:
                slot = self._snapshot_index[keys[len(pages) - 1]]
                self._snapshot_index.move_to_end(keys[len(pages) - 1])
        for key in reversed(keys[:len(pages)]):  # later blocks are evicted before the prefix they extend
            self._index.move_to_end(key)
        return pages, slot

    def make_room(self, needed: int, keep: set[int]):
        """Drops least recently used cached blocks (never pages in `keep`, which this call holds) until `needed`
        pages are free; ValueError if even dropping every other block is not enough, with the index and the pool
        left as they were (nothing dropped)."""
        refcounts = np.asarray(self._pools.refcounts).copy()
        victims, free = self._victims(needed, keep, refcounts)
        if free < needed:
            raise ValueError(f"the call needs {needed} free pages; the PrefixCache pool has {free} free of "
                             f"{self.num_pages} even after dropping every cached prefix it does not use: build it "
                             f"with more pages")
        dropped = self._drop(victims, self._pools)
        np.subtract.at(refcounts, dropped, 1)
        self._pools = dataclasses.replace(self._pools, refcounts=jax.device_put(refcounts))

    def evict(self, needed: int, keep: set[int], refcounts: np.ndarray, pool=None) -> tuple[list[int], int]:
        """Drops least recently used blocks from the index (never pages in `keep`) until `needed` pages would be
        free under `refcounts` (the pool's counts, read, not changed), or every droppable block is gone -> (the
        dropped pages, whose index reference the caller must remove from the pool's counts; the free pages after
        that). With a host tier, `pool` (the `PagedKVCache` the caller runs in this pool) is where the dropped
        blocks' K/V are copied from."""
        victims, free = self._victims(needed, keep, refcounts)
        return self._drop(victims, pool), free

    def _victims(self, needed: int, keep: set[int], refcounts: np.ndarray) -> tuple[list[bytes], int]:
        """The keys `evict` would drop, least recently used first, and the free pages after dropping them; the
        index is not changed."""
        counts = np.asarray(refcounts).copy()
        free = int((counts == 0).sum())
        victims = []
        for key, page in self._index.items():
            if free >= needed:
                break
            if page in keep:
                continue
            victims.append(key)
            counts[page] -= 1
            free += int(counts[page] == 0)
        return victims, free

    def _drop(self, keys: list[bytes], pool=None) -> list[int]:
        """Removes `keys` from the index (and their snapshots, which no match could reach any more) -> their
        pages. With a host tier their K/V are first copied from `pool` (a `PagedKVCache` or `_Pools` over this
        cache's pool) to host memory."""
        for key in keys:
            self._snapshot_index.pop(key, None)
        pages = [self._index.pop(key) for key in keys]
        if self.host_pages and keys:
            if pool is None:
                raise ValueError("a PrefixCache with a host tier evicts with the pool its K/V are copied from")
            self._spill(keys, pages, pool)
        return pages

    # --- the host tier ------------------------------------------------------------------------------------------

    def _spill(self, keys: list[bytes], pages: list[int], pool):
        """Copies the blocks `keys` (in `pages` of `pool`) to the host tier, dropping its oldest beyond
        host_pages."""
        keep = [(k, p) for k, p in zip(keys, pages) if k not in self._host_index][-self.host_pages:]
        if not keep:
            return
        data = _gather_pages(_page_arrays(pool), jnp.asarray([p for _, p in keep], jnp.int32))
        batch = self._host_batch_ids
        self._host_batch_ids += 1
        self._host_batches[batch] = [self._host_memory(data), len(keep)]
        for row, (key, _) in enumerate(keep):
            self._host_index[key] = (batch, row)
        self.host_stats["spilled_pages"] += len(keep)
        while len(self._host_index) > self.host_pages:
            self._host_forget(self._host_index.popitem(last=False)[1])
            self.host_stats["host_dropped_pages"] += 1

    def _host_forget(self, where: tuple[int, int]):
        entry = self._host_batches[where[0]]
        entry[1] -= 1
        if entry[1] == 0:
            del self._host_batches[where[0]]

    def cached_prefix_pages(self, tokens) -> int:
        """How many whole-page blocks of `tokens` (leaving one token) this cache holds in a row, device and host
        tiers together; a probe: nothing is marked used (a data-parallel engine's placement asks every shard)."""
        count = 0
        for key in _block_keys(tokens[:len(tokens) - 1], self.page_size):
            if key not in self._index and key not in self._host_index:
                break
            count += 1
        return count

    def host_match(self, tokens, device_pages: int) -> list[bytes]:
        """The keys of the host tier's blocks that continue a device match of `device_pages` blocks of `tokens`
        (consecutive, leaving at least one token to prefill, as `match`): what `take_host` copies back."""
        if not self._host_index:
            return []
        keys = _block_keys(tokens[:len(tokens) - 1], self.page_size)[device_pages:]
        found = []
        for key in keys:
            if key not in self._host_index:
                break
            found.append(key)
        return found

    def take_host(self, keys: list[bytes]):
        """The K/V of host blocks `keys`, as device arrays in the pool's layout ([n, ...] per layer), removed from
        the host tier (the caller writes them into free pages, `write_pages`, and indexes them, `indexed`)."""
        rows = [self._host_index.pop(key) for key in keys]
        parts, positions = [], []  # one gather per host batch; positions[j]: the key row j of the result is for
        for batch in dict.fromkeys(b for b, _ in rows):
            mine = [i for i, (b, _) in enumerate(rows) if b == batch]
            parts.append(_gather_pages(_to_device(self._host_batches[batch][0]),
                                       jnp.asarray([rows[i][1] for i in mine], jnp.int32)))
            positions += mine
        for where in rows:
            self._host_forget(where)
        self.host_stats["restored_pages"] += len(keys)
        data = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if len(parts) > 1 else parts[0]
        inverse = jnp.asarray(np.argsort(positions), jnp.int32)
        return jax.tree.map(lambda x: x[inverse], data)

    def indexed(self, keys: list[bytes], pages: list[int]):
        """Blocks `keys` now held in `pages` (copied back from the host tier): indexed, most recently used, last
        block first. The caller adds the index's reference to each page's count."""
        for key, page in reversed(list(zip(keys, pages))):
            self._index[key] = int(page)
            self._index.move_to_end(key)

    def fetch(self, tokens, hits: list[int]) -> list[int]:
        """(`generate`: the cache owns its pool) `hits` (the device match of `tokens`) extended by the host blocks
        that continue it, copied back into free pages of the pool and indexed -> the longer hit. Free pages must be
        there (`make_room` first); blocks for which none is free stay on the host."""
        keys = self.host_match(tokens, len(hits))
        if not keys:
            return hits
        free = np.flatnonzero(np.asarray(self._pools.refcounts) == 0)[:len(keys)]
        keys = keys[:len(free)]
        if not keys:
            return hits
        pages = [int(p) for p in free]
        arrays, refcounts = write_pages(_page_arrays(self._pools), self._pools.refcounts,
                                        jnp.asarray(pages, jnp.int32), self.take_host(keys))
        keys_, values, key_scales, value_scales = arrays
        self._pools = _Pools(keys_, values, key_scales, value_scales, refcounts)
        self.indexed(keys, pages)
        return hits + pages

    @property
    def host_cached_pages(self) -> int:
        """Blocks the host tier holds."""
        return len(self._host_index)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in every layer (K/V and scales): a host block's size."""
        return planner.pool_bytes(self.config, num_pages=1, page_size=self.page_size, cache_dtype=self.cache_dtype)

    def host_nbytes(self) -> int:
        """Host memory the tier's batches hold now (a batch stays whole until its last block is dropped)."""
        return sum(sum(np.asarray(x).nbytes if not isinstance(x, jax.Array) else x.nbytes
                       for x in jax.tree.leaves(entry[0])) for entry in self._host_batches.values())

    # --- state snapshots (hybrid models) ------------------------------------------------------------------------

    def snapshot_keys(self, tokens, start: int, end: int) -> list[tuple[int, bytes]]:
        """(position, block key) of each snapshot boundary of `tokens` in (start, end]: the multiples of
        `snapshot_interval` there (none for a model without linear layers)."""
        if not self.hybrid:
            return []
        I = self.snapshot_interval
        keys = _block_keys(tokens[:end], self.page_size)
        return [(p, keys[p // self.page_size - 1]) for p in range(-(-(start + 1) // I) * I, end + 1, I)]

    def take_snapshots(self, cache: PagedKVCache, taken: list[tuple[int, bytes]]):
        """Copies the states of rows of `cache` into the store, one snapshot per (row, block key) of `taken` (a
        key already stored is only marked used); the least recently used snapshots make room. Inside a
        `transaction` (a `generate` call) they are stored when it succeeds, and a failed call stores none."""
        if not taken:
            return
        rows = jnp.asarray([row for row, _ in taken], jnp.int32)
        states = _gather_rows((cache.conv_states, cache.recurrent_states), rows)
        keys = [key for _, key in taken]
        if self._pending is None:
            self._store(keys, states)
        else:
            self._pending.append((keys, states))

    def _store(self, keys: list[bytes], states):
        """Row i of `states` (per layer [n, ...] rows) becomes the snapshot of keys[i]."""
        written = {}  # slot -> row of `states`; a slot taken twice here (a store smaller than the batch) keeps
        # its last writer, whose key the index names (a scatter with a repeated index would keep either)
        for row, key in enumerate(keys):
            if key in self._snapshot_index:
                self._snapshot_index.move_to_end(key)
                continue
            if len(self._snapshot_index) < self.max_snapshots:
                used = set(self._snapshot_index.values())
                slot = next(s for s in range(self.max_snapshots) if s not in used)
            else:
                _, slot = self._snapshot_index.popitem(last=False)
            self._snapshot_index[key] = slot
            written[slot] = row
        if written:
            self._snapshots = _store_rows(self._snapshots, states, jnp.asarray(list(written.values()), jnp.int32),
                                          jnp.asarray(list(written), jnp.int32))

    def snapshot_rows(self, slots):
        """(conv states, recurrent states): per layer the store's rows `slots` (int32[n], -1: a fresh, zeroed
        state), a batch of n rows to start sequences from."""
        slots = jnp.asarray(slots, jnp.int32)
        return _gather_rows(self._snapshots, slots)

    @property
    def cached_snapshots(self) -> int:
        return len(self._snapshot_index)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot: every linear layer's state of one sequence (0 for a model without any)."""
        return self.config.state_bytes_per_sequence()

    def remember(self, prompts, tables, cache: PagedKVCache) -> PagedKVCache:
        """After a prefill: the index takes a reference on every whole page of each prompt (`tables[b]` its page
        table row) that it does not hold yet, so later calls can reuse them -> `cache` with those references."""
        refcounts = np.asarray(cache.refcounts).copy()
        for page in self.adopt(prompts, tables):
            refcounts[page] += 1
        return dataclasses.replace(cache, refcounts=jax.device_put(refcounts))

    def adopt(self, prompts, tables) -> list[int]:
        """Indexes the whole pages of each prompt (`tables[b]` its page table row) not indexed yet -> those pages:
        the caller adds the index's reference to each in the pool's counts. Every whole block of the prompt is
        marked recently used, last block first (as `match` does), so that a prefix's later blocks are evicted
        before the earlier ones they extend: dropping an earlier block first would leave the later ones
        unmatchable, holding pages no call can reuse."""
        pages = []
        for tokens, table in zip(prompts, tables):
            blocks = [(key, int(page)) for key, page in zip(_block_keys(tokens, self.page_size), table) if page >= 0]
            for key, page in reversed(blocks):
                if key not in self._index:
                    pages.append(page)
                    self._index[key] = page
                    if key in self._host_index:  # computed again (not copied back): the device copy replaces it
                        self._host_forget(self._host_index.pop(key))
                self._index.move_to_end(key)
        return pages

    def cache(self, page_table, lengths, snapshots=None) -> PagedKVCache:
        """A `PagedKVCache` over this pool for sequences with `page_table` / `lengths` (numpy); the rows' own
        references are added to the counts. A hybrid model's rows start from the states of the snapshot slots
        `snapshots` (int32[B], -1 or None: zeroed, a fresh sequence). The pool moves into the returned cache (it
        may be donated): give it back with `store`."""
        p = self._pools
        table = jnp.asarray(page_table, jnp.int32)
        B = table.shape[0]
        conv, recurrent = self.snapshot_rows(np.full((B,), -1, np.int32) if snapshots is None else snapshots)
        cache = PagedKVCache(keys=p.keys, values=p.values, page_table=table,
                             lengths=jnp.asarray(lengths, jnp.int32), refcounts=p.refcounts,
                             overflowed=jnp.zeros(table.shape[:1], bool), key_scales=p.key_scales,
                             value_scales=p.value_scales, conv_states=conv, recurrent_states=recurrent,
                             page_size=self.page_size)
        return dataclasses.replace(cache, refcounts=cache.count_pages(table, +1, cache.refcounts))

    def store(self, cache: PagedKVCache):
        """Takes the pool back from a finished call's cache, releasing its sequences' pages."""
        self._pools = _Pools.of(cache.release(jnp.ones((cache.batch,), bool)))

    # --- inspection ---------------------------------------------------------------------------------------------

    def pages(self) -> list[int]:
        """The pages the index holds (one reference each), least recently used first."""
        return list(self._index.values())

    @property
    def cached_pages(self) -> int:
        """Pages the index holds (whole blocks of prefixes computed before)."""
        return len(self._index)

    def free_pages(self) -> int:
        return int((np.asarray(self._pools.refcounts) == 0).sum())

    def nbytes(self) -> int:
        """The pool's bytes and (hybrid models) the snapshot store's (`max_snapshots` x `snapshot_bytes`)."""
        return planner.pool_bytes(self.config, num_pages=self.num_pages, page_size=self.page_size,
                                  cache_dtype=self.cache_dtype) + self.max_snapshots * self.snapshot_bytes


def _page_arrays(pool) -> tuple:
    """(keys, values, key_scales, value_scales) of a `PagedKVCache` or `_Pools`: the per-layer pools, whose
    axis 0 is the page."""
    return pool.keys, pool.values, pool.key_scales, pool.value_scales


@jax.jit
def _gather_pages(arrays, pages):
    return jax.tree.map(lambda a: a[pages], arrays)


def put_pages(arrays, refcounts, pages, data):
    """The pools `arrays` (`_page_arrays`) with `data` ([n, ...] per layer) in `pages` (int32[n]), and the index's
    reference added to those pages' counts -> (arrays, refcounts). Traceable (the engine's `programs.restore`)."""
    return (jax.tree.map(lambda a, d: a.at[pages].set(d.astype(a.dtype)), arrays, data),
            refcounts.at[pages].add(1))


write_pages = jax.jit(put_pages, donate_argnums=(0, 1))  # `put_pages` on the cache's own pool (donated)


def _to_device(data):
    """A host batch back in device memory, in the layout it was copied from (numpy: the default device)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
                        if isinstance(x, jax.Array) else jnp.asarray(x), data)


def _host_memory():
    """arrays -> their copy in host memory: the "pinned_host" memory kind of their devices where the backend has
    one, numpy arrays otherwise."""
    device = jax.local_devices()[0]
    if "pinned_host" in [m.kind for m in device.addressable_memories()]:
        return lambda data: jax.device_put(data, jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"),
                                                              data))
    return jax.device_get


@functools.partial(jax.jit, donate_argnums=(0,))
def _store_rows(store, states, rows, slots):
    """store[l][slots[i]] = states[l][rows[i]] for both kinds of state, every layer (the store donated)."""
    return jax.tree.map(lambda s, x: s.at[slots].set(x[rows].astype(s.dtype)), store, states)


@jax.jit
def _gather_rows(store, slots):
    """Per kind of state and layer, the store's rows `slots` (-1: zeros)."""
    return tuple(state_rows(kind, jnp.maximum(slots, 0), slots >= 0) for kind in store)


@dataclasses.dataclass(frozen=True)
class _Pools:
    """The parts of a paged cache that outlive a call: the page pools and their refcounts."""

    keys: tuple
    values: tuple
    key_scales: tuple
    value_scales: tuple
    refcounts: jax.Array

    def arrays(self) -> tuple:
        return self.keys, self.values, self.key_scales, self.value_scales, self.refcounts

    @classmethod
    def of(cls, cache: PagedKVCache) -> "_Pools":
        return cls(cache.keys, cache.values, cache.key_scales, cache.value_scales, cache.refcounts)
