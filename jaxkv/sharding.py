"""Sharding over a ("data", "model") device mesh: which mesh axis each array axis maps to. No model math.

The layout (Megatron-style tensor parallelism over "model", data parallelism over "data"):

  batch           -> "data"   tokens [B, T], start [B], logits [B, V], every cache leaf
  query heads N   -> "model"  wq [N, H, D] (and its bias [N, H]), wo [D, N, H]
  KV heads K      -> "model"  wk, wv [K, H, D] (and biases [K, H]); cache keys/values [B, K, S, H], scales [B, K, S]
  FFN hidden F    -> "model"  w_gate, w_up, w_fc [F, D] (and biases [F]), w_down [D, F]
  (weights a config stores [in, out] have the same axes transposed: wq [D, N, H], wo [N, H, D], w_down [F, D], ...)
  everything else: replicated (embeddings, lm_head, norms, the output-projection and down-projection biases, which
  are added after the all-reduce)

Arrays name their axes logically (`jaxkv.shapes`, plus HEADS, FFN, EMBED, VOCAB here); `RULES` maps logical axes
to mesh axes in one place, and `spec` refuses an array whose axes would use one mesh axis twice.

So each device computes its own heads' attention over its own slice of the cache, and the only collectives per
layer are two all-reduces (sum over "model") of [B, T, D] partial outputs: after the attention output projection
wo and after the FFN down projection. The cache never moves.

KV-head replication. Sharding KV heads over M "model" devices needs K % M == 0. When it does not hold (MQA/GQA with
fewer KV heads than devices, or a K that does not divide M), the KV projections are repeated along the KV-head
axis to K' = lcm(K, M) heads (`replicate_kv_heads`), and the model runs with a config of n_kv_heads = K'. Each
original head k becomes heads [k r, (k + 1) r) with r = K' / K (a repeat, not a tile). Why the attention is
unchanged: query head n reads KV head n // G with G = N / K; with G' = N / K' = G / r it reads repeated head
n // G', which holds original head (n // G') // r = n // (G' r) = n // G. The cost: the cache (and the K/V
projections) are r times larger in total, but each device holds only K' / M heads: device j's query heads
[j N / M, (j + 1) N / M) read repeated heads [j K' / M, (j + 1) K' / M), exactly its own cache shard.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxkv import shapes
from jaxkv.config import Config
from jaxkv.layers import OUT_IN_ORDER, in_out_names

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Logical axes beyond those of the cache (`jaxkv.shapes`): query heads N, FFN hidden F, model dim D, vocabulary V.
HEADS, FFN, EMBED, VOCAB = "heads", "ffn", "embed", "vocab"

# Logical axis -> mesh axis; a logical axis not listed is replicated. The one place the layout is decided.
RULES = {shapes.BATCH: DATA, HEADS: MODEL, shapes.KV_HEADS: MODEL, FFN: MODEL}

# Parameter leaf name -> logical axes of that array in the [out, in] form, and in the [in, out] form (which one a
# config stores: `jaxkv.model.in_out_names`). Names not listed are replicated: embeddings, lm_head, norms, and the
# wo / w_down biases (added after the all-reduce, on every device).
_PARAM_AXES = {
    "wq": (HEADS, shapes.HEAD_DIM, EMBED), "wk": (shapes.KV_HEADS, shapes.HEAD_DIM, EMBED),
    "wv": (shapes.KV_HEADS, shapes.HEAD_DIM, EMBED),
    "wq_bias": (HEADS, shapes.HEAD_DIM), "wk_bias": (shapes.KV_HEADS, shapes.HEAD_DIM),
    "wv_bias": (shapes.KV_HEADS, shapes.HEAD_DIM),
    "wo": (EMBED, HEADS, shapes.HEAD_DIM),
    "w_gate": (FFN, EMBED), "w_up": (FFN, EMBED), "w_fc": (FFN, EMBED),
    "w_gate_bias": (FFN,), "w_up_bias": (FFN,), "w_fc_bias": (FFN,),
    "w_down": (EMBED, FFN),
}
_IN_OUT_AXES = {name: tuple(_PARAM_AXES[name][i] for i in order) for name, order in OUT_IN_ORDER.items()}


def spec(logical_axes) -> P:
    """The PartitionSpec of an array with these logical axes (`RULES`); ValueError if two of its axes would map
    to the same mesh axis (an array cannot be split twice over one mesh axis)."""
    mesh_axes = tuple(RULES.get(axis) for axis in logical_axes)
    used = [a for a in mesh_axes if a is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {tuple(logical_axes)} map to mesh axes {mesh_axes}: a mesh axis used twice")
    return P(*mesh_axes)


KV_SPEC = spec(shapes.KV_AXES)  # cache keys/values [B, K, S, H]: P("data", "model", None, None)
KV_SCALE_SPEC = spec(shapes.KV_AXES[:3])  # int8/fp8 scales [B, K, S]
BATCH_SPEC = spec((shapes.BATCH,))  # the leading (batch) axis of tokens, start, logits


def check_mesh(mesh) -> Mesh:
    """The mesh to run on, or ValueError unless `mesh` is a `jax.sharding.Mesh` with axes exactly ("data", "model").

    The returned mesh has the same devices with Auto axis types (`jax.make_mesh` makes Explicit ones by default):
    jaxkv places every array itself with NamedShardings and lets the SPMD partitioner propagate the rest, with
    sharding constraints on the cache."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes must be {AXES} (batch over 'data', heads and FFN over 'model'), got "
                         f"{tuple(mesh.axis_names)}; e.g. jax.make_mesh((data, model), ('data', 'model'))")
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(AXES))


def model_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL]


def data_size(mesh: Mesh) -> int:
    return mesh.shape[DATA]


def sharded_kv_heads(config: Config, mesh: Mesh) -> int:
    """K' = the KV heads the model runs with on `mesh`: K if the model axis divides it, else lcm(K, M)."""
    K, M = config.n_kv_heads, model_size(mesh)
    return K if K % M == 0 else math.lcm(K, M)


def check_config(config: Config, mesh: Mesh) -> Config:
    """The config to run with on `mesh` (n_kv_heads = `sharded_kv_heads`), or ValueError when the query heads or
    the FFN hidden width do not divide over the model axis."""
    M = model_size(mesh)
    if config.n_heads % M:
        raise ValueError(f"n_heads ({config.n_heads}) must be divisible by the mesh's 'model' axis ({M})")
    if config.ffn_dim % M:
        raise ValueError(f"ffn_dim ({config.ffn_dim}) must be divisible by the mesh's 'model' axis ({M})")
    return config.replace(n_kv_heads=sharded_kv_heads(config, mesh))


def param_spec(path, config: Config) -> P:
    """The PartitionSpec of the parameter at a pytree `path` (keyed by its leaf name) of a model with `config`."""
    name = path[-1].key
    return spec((_IN_OUT_AXES if name in in_out_names(config) else _PARAM_AXES).get(name, ()))


def param_shardings(params, mesh: Mesh, config: Config):
    """NamedShardings for a params tree (same structure) of a model with `config`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: NamedSharding(mesh, param_spec(path, config)), params)


def cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a KVCache (same pytree structure): K/V and scales over (data, model), start over data,
    length replicated."""
    kv, scale = NamedSharding(mesh, KV_SPEC), NamedSharding(mesh, KV_SCALE_SPEC)
    return type(cache)(keys=tuple(kv for _ in cache.keys), values=tuple(kv for _ in cache.values),
                       start=NamedSharding(mesh, BATCH_SPEC), length=NamedSharding(mesh, P()),
                       key_scales=tuple(scale for _ in cache.key_scales),
                       value_scales=tuple(scale for _ in cache.value_scales), ring=cache.ring)


def paged_cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a PagedKVCache: the pools ([P, K, page_size, H]) and their scales split over KV heads on
    "model"; page tables, lengths, counts and flags replicated (every device reads every sequence's pages of its
    own heads). The "data" axis does not split a pool: sequences anywhere may share any page."""
    pool, scale, rep = (NamedSharding(mesh, P(None, MODEL, None, None)), NamedSharding(mesh, P(None, MODEL, None)),
                        NamedSharding(mesh, P()))
    return type(cache)(keys=tuple(pool for _ in cache.keys), values=tuple(pool for _ in cache.values),
                       page_table=rep, lengths=rep, refcounts=rep, overflowed=rep,
                       key_scales=tuple(scale for _ in cache.key_scales),
                       value_scales=tuple(scale for _ in cache.value_scales), page_size=cache.page_size)


def constrain_cache(cache, mesh: Mesh):
    """The cache with sharding constraints on every leaf (inside jit): K/V stay split over batch and KV heads (a
    paged cache's pools over KV heads)."""
    from jaxkv.paged_cache import PagedKVCache

    shardings = (paged_cache_shardings if isinstance(cache, PagedKVCache) else cache_shardings)(cache, mesh)
    return jax.lax.with_sharding_constraint(cache, shardings)


def replicate_kv_heads(params, config: Config, kv_heads: int):
    """Params whose wk, wv (and biases) are repeated along the KV-head axis from config.n_kv_heads to `kv_heads`
    (module docstring: the attention is unchanged). Host-side numpy; returns a new tree."""
    r = kv_heads // config.n_kv_heads
    if r == 1:
        return params

    in_out = in_out_names(config)

    def repeat(path, x):
        name = path[-1].key
        if name in ("wk", "wv", "wk_bias", "wv_bias"):  # KV heads: axis 0 of [K, H, D] and of the biases [K, H]
            return np.repeat(np.asarray(x), r, axis=OUT_IN_ORDER[name].index(0) if name in in_out else 0)
        return x

    return jax.tree_util.tree_map_with_path(repeat, params)


def global_array(value, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from a host value every process holds in full (same contents on every process).

    `make_array_from_callback` asks each process only for the slices its own devices hold, so this works across
    hosts; an array that already has `sharding` is returned as it is (no copy).
    """
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params, config: Config, mesh: Mesh):
    """(params as global arrays sharded over `mesh`, the config to run them with). See the module docstring."""
    mesh = check_mesh(mesh)
    sharded_config = check_config(config, mesh)
    params = replicate_kv_heads(params, config, sharded_config.n_kv_heads)
    return jax.tree.map(global_array, params, param_shardings(params, mesh, config)), sharded_config


def replicated(x, mesh: Mesh):
    """Inside jit: x gathered onto every device (small outputs every process must be able to read)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def to_host(x) -> np.ndarray:
    """A numpy copy of a fully replicated (or fully addressable) array, from this process's own shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def cache_bytes_per_device(cache) -> int:
    """Bytes of a cache's keys, values and scales held on one device (the first addressable device), read from the
    arrays' shards, so it reflects the actual sharding: on a mesh, `cache.nbytes()` / (data x KV-head shards)."""
    leaves = [*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales]
    if not leaves:
        return 0
    device = leaves[0].addressable_shards[0].device
    total = 0
    for leaf in leaves:
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def shard_attention(fn, mesh: Mesh):
    """Wraps an attention implementation (the `reference.attention` signature) so it runs per shard through
    `jax.shard_map`: each device sees its batch rows and its heads ([B/dp, T, N/M, H] queries over
    [B/dp, K/M, S, H] keys/values), which is what a Pallas kernel needs (a kernel cannot be auto-partitioned)."""
    q_spec = P(DATA, None, MODEL, None)

    def sharded(q, k, v, start, q_offset, *, k_scale=None, v_scale=None, **kwargs):
        scales = () if k_scale is None else (k_scale, v_scale)

        def per_shard(q, k, v, start, q_offset, *scales):
            ks, vs = scales if scales else (None, None)
            return fn(q, k, v, start, q_offset, k_scale=ks, v_scale=vs, **kwargs)

        in_specs = (q_spec, KV_SPEC, KV_SPEC, BATCH_SPEC, P()) + (KV_SCALE_SPEC,) * len(scales)
        return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
            q, k, v, start, q_offset, *scales)

    return sharded
