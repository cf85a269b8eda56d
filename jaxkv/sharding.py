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

Multi-head latent attention (config.mla). The cache row [c ; k_rope] (R + E numbers per token and layer) is shared
by every head, so the latent cache [B, 1, S, R + E] (and its int8/fp8 scales [B, 1, S]) is split over "data" only
and replicated over "model": each model shard holds its batch rows' whole rows. The per-head weights are split by
heads like wq/wo: wq [N, nope + E, D] or wq_b [N, nope + E, q_rank], the absorbed up-projections wk_b [N, nope, R]
and wv_b [N, dv, R], and wo [D, N, dv]; the down-projections wq_a [q_rank, D] and wkv_a [R + E, D], their norms
and biases are replicated (every model shard computes the same new latent row, D x (R + E) multiply-adds per
token, instead of an all-reduce of it). So device j forms its heads' latent-space queries, reads the full latent
once, and applies its heads' slices of wv_b and wo; the collectives per layer stay the two all-reduces of
[B, T, D]. The cost: per-device cache bytes are total / data, not total / (data x M). Splitting the row's R axis
over "model" instead would divide them by M, but then every head's score is a partial sum over R / M columns,
so each layer and step needs an all-reduce of the [B, N, T, S] scores (proportional to the cache length: N x 4
bytes per cached token against R + E cached numbers) before the softmax, plus the rope columns E to place; and
the heads could no longer be split over "model". Not built.

Mixture of experts (config.moe). Each expert is split like the dense FFN, over its hidden width I: we_gate and
we_up [X, I, D] split I, we_down [X, D, I] split I, the shared experts ws_gate/ws_up [J, D] and ws_down [D, J]
split J; the router [X, D] (and its bias) is replicated, so every model shard routes every token identically
(the same float32 logits from the same replicated inputs) and runs every chosen expert on its I / M columns; the
down projection's partial sums are all-reduced with the rest. Splitting the experts X over "model" (expert
parallelism) would keep each expert whole on one device but needs tokens sent to their experts' devices
(all-to-all) and lets the per-token expert gathers cross devices; splitting I keeps every dispatch ("dense",
"gather", "sorted") a plain partitioned einsum.

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
from jaxkv import moe as moe_lib
from jaxkv.layers import ALL_OUT_IN_ORDER, OUT_IN_ORDER, in_out_names, quantized

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Logical axes beyond those of the cache (`jaxkv.shapes`): query heads N, FFN hidden F, model dim D, vocabulary V;
# MLA's low ranks (q_rank, R) and its one latent "KV head"; the routed experts X.
HEADS, FFN, EMBED, VOCAB = "heads", "ffn", "embed", "vocab"
RANK, LATENT, EXPERTS = "rank", "latent", "experts"

# Logical axis -> mesh axis; a logical axis not listed is replicated. The one place the layout is decided. An
# expert's hidden width I is an FFN axis (split as the dense FFN's F).
RULES = {shapes.BATCH: DATA, HEADS: MODEL, shapes.KV_HEADS: MODEL, FFN: MODEL}

# Parameter leaf name -> logical axes of that array in the [out, in] form, and in the [in, out] form (which one a
# config stores: `jaxkv.model.in_out_names`). Names not listed are replicated: embeddings, lm_head, norms, and the
# wo / w_down biases (added after the all-reduce, on every device).
_PARAM_AXES = {
    "wq": (HEADS, shapes.HEAD_DIM, EMBED), "wq_gate": (HEADS, shapes.HEAD_DIM, EMBED), "wk": (shapes.KV_HEADS, shapes.HEAD_DIM, EMBED),
    "wv": (shapes.KV_HEADS, shapes.HEAD_DIM, EMBED),
    "wq_bias": (HEADS, shapes.HEAD_DIM), "wq_gate_bias": (HEADS, shapes.HEAD_DIM), "wk_bias": (shapes.KV_HEADS, shapes.HEAD_DIM),
    "wv_bias": (shapes.KV_HEADS, shapes.HEAD_DIM),
    "wo": (EMBED, HEADS, shapes.HEAD_DIM), "sinks": (HEADS,),
    "w_gate": (FFN, EMBED), "w_up": (FFN, EMBED), "w_fc": (FFN, EMBED),
    "w_gate_bias": (FFN,), "w_up_bias": (FFN,), "w_fc_bias": (FFN,),
    "w_down": (EMBED, FFN),
    # MLA (wq and wo as above): the per-head up-projections; wq_a, wkv_a, the norms and biases are replicated.
    "wq_b": (HEADS, shapes.HEAD_DIM, RANK), "wk_b": (HEADS, shapes.HEAD_DIM, RANK),
    "wv_b": (HEADS, shapes.HEAD_DIM, RANK),
    # Mixture of experts: routed experts over their hidden width, the shared experts as a dense FFN.
    "we_gate": (EXPERTS, FFN, EMBED), "we_up": (EXPERTS, FFN, EMBED), "we_down": (EXPERTS, EMBED, FFN),
    "we_gate_bias": (EXPERTS, FFN), "we_up_bias": (EXPERTS, FFN),
    "ws_gate": (FFN, EMBED), "ws_up": (FFN, EMBED), "ws_down": (EMBED, FFN),
}
_IN_OUT_AXES = {name: tuple(_PARAM_AXES[name][i] for i in order)
                for name, order in {**ALL_OUT_IN_ORDER, **moe_lib.OUT_IN_ORDER}.items() if name in _PARAM_AXES}


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
# An MLA cache [B, 1, S, R + E] and its scales [B, 1, S]: over "data" only, the row replicated over "model".
LATENT_SPEC = spec((shapes.BATCH, LATENT, shapes.SEQUENCE, RANK))  # P("data", None, None, None)
LATENT_SCALE_SPEC = spec((shapes.BATCH, LATENT, shapes.SEQUENCE))
# A paged pool [P, K, page_size, H] and its scales [P, K, page_size]: over KV heads only (any sequence may read any
# page, so pages do not split over "data").
PAGE_POOL_SPEC = P(None, MODEL, None, None)
PAGE_SCALE_SPEC = P(None, MODEL, None)


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


def _repeated_heads(K: int, M: int) -> int:
    """K' = K if the model axis M divides it, else lcm(K, M) (module docstring, "KV-head replication")."""
    return K if K % M == 0 else math.lcm(K, M)


def sharded_kv_heads(config: Config, mesh: Mesh) -> int:
    """K' = the KV heads the model runs with on `mesh`: K if the model axis divides it, else lcm(K, M). An MLA
    model keeps its one latent row (replicated over "model", not repeated: module docstring)."""
    return config.n_kv_heads if config.mla is not None else _repeated_heads(config.n_kv_heads, model_size(mesh))


def check_paged_mesh(mesh) -> Mesh:
    """`check_mesh` for a paged cache (the engine, paged `generate`, a `PrefixCache`): ValueError unless its "data"
    axis is 1. Sequences anywhere may share any page, so a pool splits over KV heads on "model" only."""
    mesh = check_mesh(mesh)
    if data_size(mesh) != 1:
        raise ValueError(f"a paged cache splits heads and FFN over the mesh's 'model' axis only (sequences anywhere "
                         f"may share a page): its 'data' axis must be 1, got {data_size(mesh)} (run one per data "
                         f"shard)")
    return mesh


def check_config(config: Config, mesh: Mesh) -> Config:
    """The config to run with on `mesh` (n_kv_heads, and global_kv_heads where set, = `sharded_kv_heads`), or
    ValueError when the query heads or an FFN hidden width (the dense FFN's where a layer has one, each expert's,
    the K/V-sharing layers' own) do not divide over the model axis.

    Gemma 4's per-layer pieces shard as the rest: each layer's KV heads (its own count and head dim) over "model",
    repeated per layer where the axis does not divide them; the K/V-sharing layers hold no cache and read their
    source layer's shard (same heads, same devices); the per-layer input tables and projections and the layer
    scalars are replicated (small next to the layers)."""
    M = model_size(mesh)
    widths = {"n_heads": config.n_heads}
    moe = config.moe
    if moe is None or moe.first_dense_layers > 0:  # an all-MoE model never reads ffn_dim
        widths["ffn_dim"] = config.ffn_dim
    if moe is not None and any(moe.is_moe_layer(layer) for layer in range(config.n_layers)):
        widths["moe.moe_ffn_dim"] = moe.moe_ffn_dim  # the shared experts' J = n_shared_experts x I divides too
    if config.kv_shared_ffn_dim is not None:
        widths["kv_shared_ffn_dim"] = config.kv_shared_ffn_dim
    for name, width in widths.items():
        if width % M:
            raise ValueError(f"{name} ({width}) must be divisible by the mesh's 'model' axis ({M})")
    changes = {"n_kv_heads": sharded_kv_heads(config, mesh)}
    if config.global_kv_heads is not None:
        changes["global_kv_heads"] = _repeated_heads(config.global_kv_heads, M)
    return config.replace(**changes)


def _in_out_names(config: Config) -> frozenset[str]:
    """The names `config` stores [in, out]: `layers.in_out_names` plus the mixture of experts' own."""
    names = in_out_names(config)
    if config.moe is not None:
        names |= moe_lib.in_out_names(config.moe, config.d_model, config.dtype)
    return names


def param_spec(path, config: Config) -> P:
    """The PartitionSpec of the parameter at a pytree `path` (keyed by its leaf name) of a model with `config`."""
    name = path[-1].key
    return spec((_IN_OUT_AXES if name in _in_out_names(config) else _PARAM_AXES).get(name, ()))


def param_shardings(params, mesh: Mesh, config: Config):
    """NamedShardings for a params tree (same structure) of a model with `config`. A quantized weight
    (`jaxkv.layers.quantized`) is a QArray of shardings: its values split as the float weight, its scale on the
    same mesh axes where the scale's axis divides evenly (a per-channel scale's output axis), else replicated there
    (a scale shared along an axis, or fewer groups than devices)."""

    def sharding(path, leaf):
        spec_ = param_spec(path, config)
        if not quantized.is_quantized(leaf):
            return NamedSharding(mesh, spec_)
        axes = tuple(spec_) + (None,) * (leaf.scale.ndim - len(spec_))
        scale = P(*(a if a is not None and leaf.scale.shape[i] % mesh.shape[a] == 0 else None
                    for i, a in enumerate(axes)))
        return quantized.QArray(NamedSharding(mesh, spec_), NamedSharding(mesh, scale), qtype=leaf.qtype)

    return jax.tree_util.tree_map_with_path(sharding, params, is_leaf=quantized.is_quantized)


def is_latent(cache) -> bool:
    """Whether a KVCache is an MLA latent cache: keys only, the values being the keys' first R columns
    (`jaxkv.cache.zeroed_buffers`), or DeepSeek-V3.2's, whose value buffers hold one indexer key per slot, of
    another width than the latent row (any other cache's values are as wide as its keys)."""
    if not cache.keys:
        return False
    return not cache.values or (cache.keys[0].shape[1] == 1 and cache.values[0].shape[-1] != cache.keys[0].shape[-1])


def cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a KVCache (same pytree structure): K/V and scales over (data, model), start over data,
    length replicated; an MLA latent cache over data only (module docstring). A hybrid model's linear-layer states
    ([B, ...] per sequence) go over data, whole on each device: those layers' weights are replicated (not in
    `_PARAM_AXES`), so every "model" device computes the same state."""
    if is_latent(cache):
        kv, scale = NamedSharding(mesh, LATENT_SPEC), NamedSharding(mesh, LATENT_SCALE_SPEC)
    else:
        kv, scale = NamedSharding(mesh, KV_SPEC), NamedSharding(mesh, KV_SCALE_SPEC)
    return type(cache)(keys=tuple(kv for _ in cache.keys), values=tuple(kv for _ in cache.values),
                       start=NamedSharding(mesh, BATCH_SPEC), length=NamedSharding(mesh, P()),
                       key_scales=tuple(scale for _ in cache.key_scales),
                       value_scales=tuple(scale for _ in cache.value_scales),
                       conv_states=tuple(NamedSharding(mesh, BATCH_SPEC) for _ in cache.conv_states),
                       recurrent_states=tuple(NamedSharding(mesh, BATCH_SPEC) for _ in cache.recurrent_states),
                       rings=cache.rings, ring_lookahead=cache.ring_lookahead)


def paged_cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a PagedKVCache: the pools ([P, K, page_size, H]) and their scales split over KV heads on
    "model"; page tables, lengths, counts and flags replicated (every device reads every sequence's pages of its
    own heads). The "data" axis does not split a pool: sequences anywhere may share any page."""
    pool, scale, rep = (NamedSharding(mesh, PAGE_POOL_SPEC), NamedSharding(mesh, PAGE_SCALE_SPEC),
                        NamedSharding(mesh, P()))
    return type(cache)(keys=tuple(pool for _ in cache.keys), values=tuple(pool for _ in cache.values),
                       page_table=rep, lengths=rep, refcounts=rep, overflowed=rep,
                       key_scales=tuple(scale for _ in cache.key_scales),
                       value_scales=tuple(scale for _ in cache.value_scales),
                       conv_states=tuple(rep for _ in cache.conv_states),  # (rows like the tables: replicated)
                       recurrent_states=tuple(rep for _ in cache.recurrent_states), page_size=cache.page_size)


def constrain_cache(cache, mesh: Mesh | None):
    """The cache with sharding constraints on every leaf (inside jit): K/V stay split over batch and KV heads (a
    paged cache's pools over KV heads). No mesh (one device): the cache as it is."""
    from jaxkv.cache.paged import PagedKVCache

    if mesh is None:
        return cache
    shardings = (paged_cache_shardings if isinstance(cache, PagedKVCache) else cache_shardings)(cache, mesh)
    return jax.lax.with_sharding_constraint(cache, shardings)


def replicate_kv_heads(params, config: Config, run_config: Config | int):
    """Params whose wk, wv (and biases) are repeated along the KV-head axis from each layer's KV heads in `config`
    to its KV heads in `run_config` (`check_config`; an int: n_kv_heads to repeat to; module docstring: the
    attention is unchanged). Host-side numpy; returns a new tree."""
    if isinstance(run_config, int):
        run_config = config.replace(n_kv_heads=run_config)
    repeats = {f"layer_{layer}": run_config.layer_kv_heads(layer) // config.layer_kv_heads(layer)
               for layer in range(config.n_layers)}
    if set(repeats.values()) == {1}:
        return params

    in_out = in_out_names(config)

    def repeat(path, x):
        name = path[-1].key
        r = next((repeats[k.key] for k in path if getattr(k, "key", None) in repeats), 1)
        if name in ("wk", "wv", "wk_bias", "wv_bias") and r > 1:  # KV heads: axis 0 of [K, H, D] and biases [K, H]
            axis = OUT_IN_ORDER[name].index(0) if name in in_out else 0
            # a quantized weight's scale is per KV head (an output axis): repeated alike
            return jax.tree.map(lambda a: np.repeat(np.asarray(a), r, axis=axis), x)
        return x

    return jax.tree_util.tree_map_with_path(repeat, params, is_leaf=quantized.is_quantized)


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
    params = replicate_kv_heads(params, config, sharded_config)
    return jax.tree.map(global_array, params, param_shardings(params, mesh, config)), sharded_config


class _LastSharded:
    """`shard_params` remembered for the last (params, config, mesh): repeated `generate(..., mesh=)` calls on
    one model do not re-copy its weights. Keyed by the params' identity (a pytree of arrays is not hashable) and
    by the config (the same params under a `dataclasses.replace`d config may shard or lay out differently). One
    entry: holding more would keep old models' device copies alive."""

    def __init__(self):
        self.entry = None

    def __call__(self, params, config: Config, mesh: Mesh):
        entry = self.entry
        if entry is not None and entry[0] is params and entry[1] == config and entry[2] == mesh:
            return entry[3], entry[4]
        sharded, sharded_config = shard_params(params, config, mesh)
        self.entry = (params, config, mesh, sharded, sharded_config)
        return sharded, sharded_config


sharded_weights = _LastSharded()  # (params, config, mesh) -> (sharded params, their config)


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
    arrays' shards, so it reflects the actual sharding: on a mesh, `cache.nbytes()` / (data x KV-head shards);
    an MLA latent cache `cache.nbytes()` / data."""
    leaves = [*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales,
              *getattr(cache, "conv_states", ()), *getattr(cache, "recurrent_states", ())]
    if not leaves:
        return 0
    device = leaves[0].addressable_shards[0].device
    total = 0
    for leaf in leaves:
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def _sinks_operand(sinks, num_heads: int, head_axis):
    """(operands, in_specs) for attention sinks float32[N] (or None: none) passed into a shard_map, split over
    `head_axis` exactly as the queries' head axis is, so each shard gets its own heads' sinks. Checked before the
    shard_map, so a wrong shape is the attention's own ValueError, not a partitioning error or a per-shard shape."""
    from jaxkv.attention.reference import check_sinks  # here: jaxkv.attention's api imports this module

    sinks = check_sinks(sinks, num_heads)
    return ((), ()) if sinks is None else ((sinks,), (P(head_axis),))


def shard_attention(fn, mesh: Mesh):
    """Wraps an attention implementation (the `reference.attention` signature) so it runs per shard through
    `jax.shard_map`: each device sees its batch rows and its heads ([B/dp, T, N/M, H] queries over
    [B/dp, K/M, S, H] keys/values, and its heads' attention sinks [N/M] if any), which is what a Pallas kernel needs
    (a kernel cannot be auto-partitioned)."""
    q_spec = P(DATA, None, MODEL, None)

    def sharded(q, k, v, start, q_offset, *, k_scale=None, v_scale=None, sinks=None, **kwargs):
        scales = () if k_scale is None else (k_scale, v_scale)
        # sinks [N] split like q's heads (axis 2); without them the shard_map is the very one it was
        extra, extra_specs = _sinks_operand(sinks, q.shape[2], q_spec[2])

        def per_shard(q, k, v, start, q_offset, *rest):
            ks, vs = rest[:2] if scales else (None, None)
            own = {"sinks": rest[-1]} if extra else {}
            return fn(q, k, v, start, q_offset, k_scale=ks, v_scale=vs, **own, **kwargs)

        in_specs = (q_spec, KV_SPEC, KV_SPEC, BATCH_SPEC, P()) + (KV_SCALE_SPEC,) * len(scales) + extra_specs
        return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
            q, k, v, start, q_offset, *scales, *extra)

    return sharded


def shard_paged_attention(fn, mesh: Mesh):
    """Wraps a paged attention (the `jaxkv.attention.pallas.paged_attention` signature) so it runs per shard
    through `jax.shard_map`, as `shard_attention` does for the contiguous cache: each device sees every
    sequence's queries of its own heads ([B, T, N/M, H]) over its own KV heads of the pools ([P, K/M, ps, H],
    `paged_cache_shardings`), with the page tables, lengths and slots whole (replicated), its heads' attention sinks
    [N/M] if any, and returns its heads' outputs. No collective: a head's attention reads only its own KV head."""
    q_spec = P(None, None, MODEL, None)

    def sharded(q, k_pages, v_pages, page_table, lengths, q_slots, *, k_scale=None, v_scale=None, sinks=None,
                **kwargs):
        scales = () if k_scale is None else (k_scale, v_scale)
        # sinks [N] split like q's heads (axis 2); without them the shard_map is the very one it was
        extra, extra_specs = _sinks_operand(sinks, q.shape[2], q_spec[2])

        def per_shard(q, k_pages, v_pages, page_table, lengths, q_slots, *rest):
            ks, vs = rest[:2] if scales else (None, None)
            own = {"sinks": rest[-1]} if extra else {}
            return fn(q, k_pages, v_pages, page_table, lengths, q_slots, k_scale=ks, v_scale=vs, **own, **kwargs)

        in_specs = (q_spec, PAGE_POOL_SPEC, PAGE_POOL_SPEC, P(), P(), P()) + (PAGE_SCALE_SPEC,) * len(scales)
        return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs + extra_specs, out_specs=q_spec,
                             check_vma=False)(q, k_pages, v_pages, page_table, lengths, q_slots, *scales, *extra)

    return sharded


def shard_latent_attention(fn, mesh: Mesh):
    """Wraps an MLA latent attention (the `jaxkv.attention.mla.attention` signature) so it runs per shard through
    `jax.shard_map`, as `shard_attention` does for the other families: each device sees its batch rows and its
    heads' queries ([B/dp, T, N/M, R + E]) over its batch rows' whole latent ([B/dp, S, R + E], replicated over
    "model"), and returns its heads' latent-space outputs [B/dp, T, N/M, R]."""
    q_spec = P(DATA, None, MODEL, None)
    latent_spec, latent_scale_spec = P(DATA, None, None), P(DATA, None)

    def sharded(q, latent, start, q_offset, *, latent_scale=None, **kwargs):
        scales = () if latent_scale is None else (latent_scale,)

        def per_shard(q, latent, start, q_offset, *scales):
            return fn(q, latent, start, q_offset, latent_scale=scales[0] if scales else None, **kwargs)

        in_specs = (q_spec, latent_spec, BATCH_SPEC, P()) + (latent_scale_spec,) * len(scales)
        return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
            q, latent, start, q_offset, *scales)

    return sharded
