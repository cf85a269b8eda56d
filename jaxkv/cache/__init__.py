"""The KV caches, what they are stored in and what they cost.

  dtypes.py      the cache dtypes: names, bytes per element, which are quantized, the check (no JAX)
  geometry.py    per-layer slots (rings for sliding-window layers) and `CacheGeometry` (no JAX)
  storage.py     the zeroed per-layer buffers of a cache dtype, and int8/fp8 quantization on write
  contiguous.py  `KVCache`: fixed slots per sequence, left padding, ring buffers
  paged.py       `PagedKVCache`: page pools, page tables and refcounts; `fork` (copy-on-write) and `release`
  prefix.py      `PrefixCache`: a page pool kept across calls and an index of the prefixes it holds
  planner.py     bytes of a cache or a pool, and the layouts `generate` allocates (`plan_cache`, `plan_pages`)

May import: `jaxkv.config`, `jaxkv.checks`, `jaxkv.attention.reference` (contiguous.py: the live-slot mask it zeroes
dead values with) and `jaxkv.sharding` (prefix.py: a pool's layout on a mesh). Never the model, the decoding loops,
the engine or the server: they import this package, not the reverse.

The names below are imported on first use (PEP 562), as `jaxkv`'s are: `from jaxkv.cache import KVCache` works,
while `from jaxkv.cache import planner` (the `jaxkv` command, before it imports JAX) loads no JAX. Inside the
library, import from the module that defines a name (`jaxkv.cache.contiguous`, ...).
"""

import importlib as _importlib
import importlib.util as _importlib_util

# public name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(["BYTES_PER_ELEMENT", "CACHE_DTYPES", "QUANTIZED", "SCALE_BYTES", "check_cache_dtype"],
                    "dtypes"),
    **dict.fromkeys(["CacheGeometry", "cache_slots", "layer_cache_slots", "layer_slots"], "geometry"),
    **dict.fromkeys(["quantize", "zeroed_buffers", "zeroed_states"], "storage"),
    "KVCache": "contiguous",
    **dict.fromkeys(["NO_PAGE", "PagedKVCache", "fork", "release"], "paged"),
    "PrefixCache": "prefix",
    **dict.fromkeys(["CachePlan", "DEFAULT_PAGE_SIZE", "GIB", "MIN_CAPACITY", "MIN_PROMPT_BUCKET", "PagePlan",
                     "allocated_bytes", "expanded_kv_bytes_per_token", "full_length_cache_bytes", "kv_bytes_per_token",
                     "kv_cache_bytes", "page_bytes", "pages_for", "plan_cache", "plan_pages", "pool_bytes",
                     "sequences_that_fit", "shared_cache_bytes", "state_bytes_per_sequence", "weight_bytes"],
                    "planner"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # A submodule (jaxkv.cache.planner, ...), reachable as an attribute before anything imported it.
        if name.isidentifier() and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
            return _importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS))
