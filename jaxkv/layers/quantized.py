"""Weight-only quantization: which weights are quantized and how (`WeightQuant`, `quantize_params`), and how the
layers read a quantized weight (`einsum`, `rows`, `merged`, `dequantized`).

The quantized arrays are qwix's (Google's JAX quantization library, as tpu-inference and MaxText use it):
`qwix.quantize` makes a `qwix.QArray` (qvalue in the quantized dtype, float32 scale), `qwix.dequantize` undoes it.
A quantized parameter is a QArray leaf in the Flax "params" tree where the float array was; its qvalue has the
float array's shape (what Flax checks a stored parameter against), so the modules are the same with or without
quantization and each reads its weights through the functions here.

Modes (`WEIGHT_MODES`), symmetric absmax in every case:
  int8   one scale per output channel (every axis but the contracted ones); the channel's largest magnitude
         maps to 127.5 (qwix's bound: the top bucket used fully), the values are int8
  fp8    the same with float8_e4m3fn values (the largest magnitude maps to 448, the format's max)
  int4   one scale per `group_size` consecutive inputs of each output channel (groups along the innermost
         contracted axis, e.g. a head's H columns of wo [D, N, H]); the largest maps to 7.5, the values are int4

Which weights: every projection matrix (`PROJECTIONS`: attention, MLA, dense and expert FFNs, the hybrid models'
linear-attention projections, DeepSeek-V3.2's indexer projections, Gemma 4's per-layer projections) and, with
`WeightQuant.embeddings`, the embedding tables and lm_head (`EMBEDDINGS`). Never quantized: norms, biases, the MoE
router (routing is a top-k of its float32 logits; a small error there changes which experts run), the per-token
scalar gates (Qwen3-Next's shared_gate, Gated DeltaNet's w_a / w_b, the indexer's head weights), convolutions,
learned position tables, attention sinks, and DeepSeek's MTP modules (`Model.mtp`, a separate tree).

How a quantized weight is multiplied: dequantized (qvalue x scale, in float32), rounded to the activations' dtype
and multiplied as the float weight would be. This is what qwix's own `qwix.einsum` / `dot_general` do when one
operand is a float array (their "slow" path: weight-only quantization); calling `qwix.dequantize` directly lets
the product run in the activations' dtype, as the float model's does. Under jit, XLA fuses the dequantization
into the matmul's operand where the backend can (GPU, TPU), so a step reads the quantized bytes; on XLA:CPU the
fused loop converts in registers too. How int4 values are held depends on the backend and the jax release: GPU and
TPU pack two per byte; XLA:CPU holds one per byte up to jax 0.10 (so int4 saves no memory over int8 there) and
packs them from jax 0.11 (measured: `Generation.stats` "weight_bytes" of "tiny", 3,668,992 bytes on jax 0.10.2
and 2,194,432 on jax 0.12.1, int8's 3,523,584 on both). `int4_bits` asks the device, so the planner, `jaxkv
memory` and the stats agree with what it holds on every supported jax.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from qwix import QArray

WEIGHT_MODES = ("int8", "fp8", "int4")
QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}
BITS = {"int8": 8, "fp8": 8, "int4": 4}
DEFAULT_GROUP_SIZE = 64

# Parameter leaf name -> its contracted ("in") axes in the [out, in] form (`jaxkv.layers.linear.OUT_IN_ORDER`:
# the stored layout may be the transpose). The q/k/v projections are [heads, H, D], wo [D, N, H]; MLA's per-head
# wq_b [N, qk, q_rank], wk_b [N, nope, R] and wv_b [N, v, R] (wk_b is also contracted over nope by the absorbed
# attention: any scale layout is exact once dequantized); experts [X, out, in]; every other one [out, in].
PROJECTIONS = {
    **{name: (2,) for name in ("wq", "wq_gate", "wk", "wv", "wq_b", "wk_b", "wv_b", "we_gate", "we_up", "we_down")},
    "wo": (1, 2),
    **{name: (1,) for name in ("w_gate", "w_up", "w_fc", "w_down", "wq_a", "wkv_a", "ws_gate", "ws_up", "ws_down",
                               "w_qkv", "w_z", "w_out", "index_wq", "index_wk", "ple_gate", "ple_proj",
                               "projection")},
}
# The token embedding [V, D] (tied or not; Gemma 4's per-layer table [V, L P] is also named "embedding") and the
# untied head [V, D]: one scale per row (per vocabulary entry), read by lookups and by the head's product over D.
EMBEDDINGS = {"embedding": (1,), "lm_head": (1,)}


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How a model's weights are quantized (`jaxkv.load(..., weights=)`).

    mode: "int8", "fp8" (float8_e4m3fn) or "int4" (module docstring).
    group_size: int4's inputs per scale (each quantized weight's innermost contracted axis must be a multiple of
      it, or the quantization is refused naming the weight); ignored by int8 and fp8 (one scale per channel).
    embeddings: also quantize the embedding tables and lm_head (per row); off by default, as the anchors do:
      the head's error reaches every logit, and a lookup reads only B rows of the table per step.
    """

    mode: str
    group_size: int = DEFAULT_GROUP_SIZE
    embeddings: bool = False

    def __post_init__(self):
        if self.mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.mode!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if not isinstance(self.embeddings, bool):
            raise ValueError(f"embeddings must be a bool, got {self.embeddings!r}")

    @classmethod
    def of(cls, weights) -> "WeightQuant | None":
        """None, a mode name or a WeightQuant -> WeightQuant or None."""
        if weights is None or isinstance(weights, WeightQuant):
            return weights
        if isinstance(weights, str):
            return cls(weights)
        raise ValueError(f"weights must be None, one of {WEIGHT_MODES} or a jaxkv.WeightQuant, got {weights!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, source: str) -> "WeightQuant":
        if not isinstance(data, dict) or set(data) - {"mode", "group_size", "embeddings"} or "mode" not in data:
            raise ValueError(f"{source}: expected {{'mode', 'group_size', 'embeddings'}}, got {data!r}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def names(self) -> dict:
        """Quantized parameter name -> its contracted axes in the [out, in] form."""
        return {**PROJECTIONS, **(EMBEDDINGS if self.embeddings else {})}


def is_quantized(w) -> bool:
    return isinstance(w, QArray)


def _how(name: str, stored_shape, order, quant: WeightQuant):
    """(channelwise axes, tiled axes: {axis: tile}, the grouped axis) of parameter `name` stored with
    `stored_shape`; `order`: the axis order of its [in, out] layout when stored so (stored axis j is [out, in]
    axis order[j]), else None. int4's groups run along the innermost contracted axis of the [out, in] form."""
    in_axes = quant.names()[name]
    origin = list(order) if order is not None else list(range(len(stored_shape)))
    stored_in = [j for j, a in enumerate(origin) if a in in_axes]
    channelwise = tuple(j for j in range(len(stored_shape)) if j not in stored_in)
    last = origin.index(max(in_axes))
    if quant.mode != "int4":
        return channelwise, {}, last
    return channelwise, {j: (quant.group_size if j == last else 1) for j in stored_in}, last


def quantize_params(params, quant: WeightQuant | str, in_out: frozenset[str] = frozenset(), orders=None):
    """The Flax params tree with `quant`'s weights as qwix QArrays (module docstring). `in_out`, `orders`: the
    names stored [in, out] and their axis orders (`jaxkv.model.weight_layout`). Works on arrays (jitted per
    weight) and on jax.ShapeDtypeStruct trees under jax.eval_shape. A weight already quantized is refused."""
    quant = WeightQuant.of(quant)
    names = quant.names()
    qtype = QTYPES[quant.mode]
    plans = {}  # path -> (channelwise, tiled), checked for every weight before any is quantized
    for path, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]:
        where = "/".join(str(getattr(k, "key", k)) for k in path)
        if isinstance(w, QArray):
            raise ValueError(f"{where}: already quantized")
        if path[-1].key in names:
            order = orders[path[-1].key] if path[-1].key in in_out else None
            channelwise, tiled, grouped = _how(path[-1].key, w.shape, order, quant)
            plans[jax.tree_util.keystr(path)] = (where, w.shape[grouped], channelwise, tiled)
    if quant.mode == "int4":
        fits = math.gcd(*(size for _, size, _, _ in plans.values()))
        bad = next(((where, size) for where, size, _, _ in plans.values() if size % quant.group_size), None)
        if bad is not None:
            raise ValueError(f"{bad[0]}: its contracted axis of {bad[1]} is not a multiple of group_size "
                             f"{quant.group_size}; a group_size that fits every quantized weight of this model "
                             f"divides {fits}")

    def convert(path, w):
        plan = plans.get(jax.tree_util.keystr(path))
        if plan is None:
            return w
        _, _, channelwise, tiled = plan
        return _quantize(w, qtype=qtype, channelwise=channelwise, tiled=tuple(sorted(tiled.items())))

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_quantized)


@functools.partial(jax.jit, static_argnames=("qtype", "channelwise", "tiled"))
def _quantize(w, *, qtype, channelwise, tiled):
    # absmax over float32 copies: a bfloat16 max rounds the scale before it is computed
    return qwix.quantize(w.astype(jnp.float32), qtype, channelwise_axes=channelwise, tiled_axes=dict(tiled),
                         scale_dtype=jnp.float32)


def dequantized(w, dtype):
    """A weight as a float array of `dtype`: a QArray dequantized (float32 qvalue x scale, then rounded); a
    float array as it is."""
    if isinstance(w, QArray):
        return qwix.dequantize(w).astype(dtype)
    return w


def einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) accumulating in float32, w a float array or a QArray (dequantized to x's dtype)."""
    return jnp.einsum(spec, x, dequantized(w, x.dtype), preferred_element_type=jnp.float32)


def rows(table, ids, dtype):
    """table[ids] along axis 0 (an embedding lookup) as `dtype`; a quantized table's rows and their scales only."""
    if isinstance(table, QArray):
        picked = QArray(jnp.take(table.qvalue, ids, axis=0), jnp.take(table.scale, ids, axis=0), qtype=table.qtype)
        return qwix.dequantize(picked).astype(dtype)
    return jnp.take(table, ids, axis=0)


def merged(w, shape):
    """w.reshape(shape) for a reshape that merges runs of adjacent axes (a [heads, H, D] projection to
    [heads H, D]). A QArray's scale is merged alike: a run's scale is kept whole where every axis but the last has
    a scale per index (the last may have groups: a head's groups stay within it), and a run whose axes all share
    one scale keeps one; any other run cannot be expressed and is an error."""
    if not isinstance(w, QArray):
        return w.reshape(shape)
    old, new = list(w.qvalue.shape), [int(n) for n in shape]
    if -1 in new:
        new[new.index(-1)] = math.prod(old) // -math.prod(new)
    scale_shape, i = [], 0
    for size in new:
        run = [i]
        while math.prod(old[run[0]:run[-1] + 1]) < size:
            run.append(run[-1] + 1)
        if math.prod(old[run[0]:run[-1] + 1]) != size:
            raise ValueError(f"merged: {tuple(old)} -> {tuple(new)} is not a merge of adjacent axes")
        scales = [w.scale.shape[a] for a in run]
        if all(s == old[a] for s, a in zip(scales[:-1], run[:-1])):
            scale_shape.append(math.prod(scales))
        elif all(s == 1 for s in scales):
            scale_shape.append(1)
        else:
            raise ValueError(f"merged: a scale of shape {w.scale.shape} cannot follow {tuple(old)} -> {tuple(new)}")
        i = run[-1] + 1
    return QArray(w.qvalue.reshape(new), w.scale.reshape(scale_shape), qtype=w.qtype)


def held_bytes(params) -> int:
    """Bytes the parameter arrays hold on their devices (each shard once, replicas not counted): what XLA
    allocated, so int4 values held one per byte count one byte each."""
    total = 0
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.on_device_size_in_bytes() for s in leaf.addressable_shards if s.replica_id == 0)
        else:
            total += np.asarray(leaf).nbytes
    return total


@functools.cache
def int4_bits(backend: str | None = None) -> int:
    """Bits one int4 value takes on `backend`'s devices (None: the default backend): 4 where XLA packs two per
    byte (GPU, TPU; XLA:CPU from jax 0.11), 8 where it holds one per byte (XLA:CPU up to jax 0.10). Read once per
    backend off a small int4 array's allocation, not from a version table."""
    n = 4096
    x = jax.device_put(jnp.zeros((n,), jnp.int4), jax.local_devices(backend=backend)[0])
    return 4 if x.addressable_data(0).on_device_size_in_bytes() * 8 < n * 6 else 8


def packed_bytes(params, int4_bits: int = 4) -> int:
    """Bytes of a parameter tree (arrays or jax.ShapeDtypeStructs) at each dtype's width, an int4 value at
    `int4_bits` bits (4: packed, as GPUs and TPUs hold them; the planner passes what the device holds,
    `int4_bits()`)."""
    if int4_bits not in (4, 8):
        raise ValueError(f"int4_bits must be 4 (packed) or 8 (one per byte), got {int4_bits!r}")
    total = 0
    for leaf in jax.tree.leaves(params):
        bits = int4_bits if jnp.dtype(leaf.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else \
            8 * jnp.dtype(leaf.dtype).itemsize
        total += -(-math.prod(leaf.shape) * bits // 8)
    return total
