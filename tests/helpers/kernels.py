"""Running the Pallas kernels against their XLA references: the platforms and blocks they run with, compiling each
(function, argument shapes) once, and the inputs the kernel test files share (random q/k/v with quantized or 16-bit
caches, ring offsets, page tables whose rows share pages, NaN in every slot no row may read).

On CPU the kernels run in the Pallas interpreter, both bodies (Mosaic "tpu" and Triton "gpu"). With
JAXKV_PALLAS_COMPILED=1 (set by scripts/device_check.py on a GPU or TPU machine) they run compiled, the device's
body only. Tolerances: helpers.tolerances ("kernel", keyed by the query's dtype).
"""

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import pallas
from jaxkv.cache import quantize

from helpers.tolerances import by_dtype

COMPILED = os.environ.get("JAXKV_PALLAS_COMPILED") == "1"
PLATFORMS = [pallas.default_platform()] if COMPILED else ["tpu", "gpu"]
INTERPRET = not COMPILED
# Small blocks so that S = 300 spans several blocks and ends in a partial one (interpret mode is slow).
BLOCKS = {"tpu": dict(decode_block_k=128, prefill_block_q=16, prefill_block_k=128),
          "gpu": dict(decode_block_k=64, prefill_block_q=16, prefill_block_k=32)}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # the contiguous kernels' (N, K): GQA is 4:1
S = 300  # cache slots: not a multiple of any block size
PAGES_PER_SEQUENCE = 5  # the paged layouts' page-table width: the groups of 2 or 4 pages the tests use do not divide it
PAGED_HEAD_DIM = 32  # the paged pools' head dim
TOLERANCES = by_dtype("kernel")  # kernel vs reference, keyed by the query's dtype (the reasons: helpers.tolerances)


def lowered_text(jitted, args, lowering_platform: str) -> str:
    """StableHLO text of `jitted` (a jax.jit function) traced on `args` and lowered for `lowering_platform` ("tpu",
    "cuda") from this host, without the device. A Triton body's lowering needs the GPU's compute capability:
    jax 0.10 took a default when no GPU was present; from jax 0.11 it comes from an abstract device, here an
    H100's (`jax.sharding.use_abstract_mesh`)."""
    target = contextlib.nullcontext()
    if lowering_platform in ("cuda", "rocm") and hasattr(jax.sharding, "AbstractDevice") and \
            jax.default_backend() != "gpu":
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
    with target:
        return jitted.trace(*args).lower(lowering_platforms=(lowering_platform,)).as_text()


# The interpreted kernels are big XLA programs and compiling them is most of this file's run time; XLA:CPU's backend
# optimisation level 0 compiles them ~40% faster (LLVM effort only: the HLO and its arithmetic are unchanged).
# Device runs keep the default pipeline.
COMPILER_OPTIONS = None if COMPILED else {"xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=None)
def compiled(fn, *arg_types):
    return jax.jit(fn).lower(*arg_types).compile(COMPILER_OPTIONS)


def run(fn, *args):
    """fn(*args), compiled once per (fn, argument shapes and dtypes); start and q_offset stay traced. An argument
    may be a tuple of arrays (a pytree)."""
    types = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), args)
    return compiled(fn, *types)(*args)


@functools.lru_cache(maxsize=None)
def _bound(fn, static, array_names):
    static = dict(static)

    def bound(*args):
        positional, named = args[:len(args) - len(array_names)], args[len(args) - len(array_names):]
        return fn(*positional, **static, **dict(zip(array_names, named)))

    return bound


def call(fn, *args, arrays=None, **static):
    """fn(*args, **arrays, **static) through `run`: compiled once per (fn, static keyword values, shapes), so that a
    loop over live lengths or query slots (traced arrays) reuses one program instead of dispatching op by op (an
    eager `lax.switch` re-traces and compiles its branches at every call). `static`: hashable keywords (scale,
    window, chunk, platform, ...); `arrays`: keyword arguments that are arrays (sinks, scales, fresh K/V)."""
    arrays = arrays or {}
    names = tuple(sorted(arrays))
    return run(_bound(fn, tuple(sorted(static.items())), names), *args, *(arrays[n] for n in names))


def inputs(B, T, heads, H, dtype, num_slots=S, seed=0, cache_dtype=None):
    """q [B, T, N, H] in dtype; k, v [B, K, S, H] in cache_dtype (default: dtype); and their scales
    (float32 [B, K, S], or () for an unquantized cache)."""
    N, K = HEADS[heads]
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=shape).astype(np.float32)
               for shape in [(B, T, N, H), (B, K, num_slots, H), (B, K, num_slots, H)])
    cache_dtype = jnp.dtype(cache_dtype or dtype).name
    if cache_dtype in ("int8", "float8_e4m3fn"):
        (k, k_scale), (v, v_scale) = quantize(k, cache_dtype), quantize(v, cache_dtype)
        scales = (k_scale, v_scale)
    else:
        k, v, scales = jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype), ()
    return jnp.asarray(q, dtype), k, v, scales


def ring_offsets(num_slots):
    """(start, q_offset) pairs: a fresh ring (q_offset < S, the slots past it never written), the first wrap,
    steady state far past S (q_offset = 3 S + 5), with ragged starts: a row that started long ago (the whole
    ring live), one that started a few slots back (its live slots wrap past index 0 or not), one whose start is
    the query itself."""
    wrapped = 3 * num_slots + 5
    return [([0, 40, 69], 69), ([0, 0, 0], num_slots - 1), ([0, 1, num_slots], num_slots),
            ([0, wrapped - 10, wrapped], wrapped), ([wrapped - 100, 2 * num_slots, wrapped - 3], wrapped),
            ([0, wrapped - 7, wrapped - num_slots + 1], wrapped + num_slots - 7)]


def page_layout(lengths, page_size, seed):
    """(page_table int32[B, M], live bool[P, page_size], P): row 0 owns its pages; every other row starts with a
    prefix of row 0's pages (one page more than it fills, when row 0 has it: that page's tail is live for row 0 and
    past the row's own length), then pages of its own; the pool has two free pages; physical ids are shuffled."""
    rng = np.random.default_rng(seed)
    needed = [-(-n // page_size) for n in lengths]
    table = np.full((len(lengths), PAGES_PER_SEQUENCE), -1, np.int64)
    table[0, :needed[0]] = np.arange(needed[0])
    P = needed[0]
    for b, n in enumerate(needed[1:], 1):
        shared = min(n, needed[0], 1 + b % 2)
        table[b, :shared] = table[0, :shared]
        table[b, shared:n] = np.arange(P, P + n - shared)
        P += n - shared
    P += 2  # free pages
    perm = rng.permutation(P)
    table = np.where(table >= 0, perm[np.maximum(table, 0)], -1)
    live = np.zeros((P, page_size), bool)
    for b, n in enumerate(lengths):
        for s in range(n):
            live[table[b, s // page_size], s % page_size] = True
    return jnp.asarray(table, jnp.int32), live, P


def page_pool(P, K, page_size, pool_dtype, rng):
    """(k, v, scales): float pools in pool_dtype, or int8 / float8 pools quantized with the cache's `quantize` so
    that kernel and reference read the same stored numbers; scales () for a float pool."""
    k, v = (rng.normal(size=(P, K, page_size, PAGED_HEAD_DIM)).astype(np.float32) for _ in range(2))
    if pool_dtype in ("int8", "float8_e4m3fn"):
        (k, k_scale), (v, v_scale) = quantize(k, pool_dtype), quantize(v, pool_dtype)
        return k, v, (k_scale, v_scale)
    return jnp.asarray(k, pool_dtype), jnp.asarray(v, pool_dtype), ()


def poison(x, live):
    """x [P, K, page_size, ...] with NaN at every slot no row may read (int8 has no NaN: unchanged)."""
    if x.dtype == jnp.int8:
        return x
    dead = jnp.asarray(~live).reshape(live.shape[0], 1, live.shape[1], *([1] * (x.ndim - 3)))
    return jnp.where(dead, jnp.nan, x).astype(x.dtype)


def edge_lengths(page_size):
    """The whole table, 1, page - 1, page, page + 1, 0 (and the same set permuted, so that the long row is not
    always the one that owns the shared pages)."""
    lengths = [PAGES_PER_SEQUENCE * page_size, 1, page_size - 1, page_size, page_size + 1, 0]
    return lengths, lengths[3:] + lengths[:3]
