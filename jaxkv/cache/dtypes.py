"""The cache dtypes: their names, their sizes, which are quantized, and the check that names one.

float32, bfloat16 and float16 store K and V as they are (cast on write). int8 and float8_e4m3fn are quantized on
write (`jaxkv.cache.storage.quantize`), with one float32 scale per token per KV head beside the cache.

No JAX here: the `jaxkv` command offers these names as choices and the planner counts their bytes before JAX is
imported (ml_dtypes, imported only to name a dtype object, gives numpy the names bfloat16 and float8_e4m3fn).
"""

from __future__ import annotations

import numpy as np

CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}
# Quantized cache dtypes carry one float32 scale per token per KV head, for keys and for values.
QUANTIZED = ("int8", "float8_e4m3fn")
SCALE_BYTES = 4


def check_cache_dtype(cache_dtype) -> str:
    """The canonical name of a cache dtype (a name such as "int8" or a dtype such as jnp.int8), or ValueError."""
    if isinstance(cache_dtype, str) and cache_dtype in CACHE_DTYPES:
        return cache_dtype  # a name as the command line gives it: no ml_dtypes import (~0.8 s of `jaxkv --help`)
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8_e4m3fn with numpy, for dtype objects)

    try:
        name = np.dtype(cache_dtype).name
    except TypeError:
        name = None
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {list(CACHE_DTYPES)}, got {cache_dtype!r}")
    return name
