"""Mixture of experts (DeepSeek-V2 and V3, Qwen MoE, Mixtral, gpt-oss): the config, the router and the MoE
feed-forward block.

Shapes use the letters of `jaxkv.shapes`: M token rows (B * T flattened), X routed experts, A experts chosen per
token, I one expert's hidden width, J the shared experts' hidden width (n_shared_experts * I).

A MoE layer replaces the dense MLP: a float32 router scores the X experts per token and picks A of them; each
chosen expert (a SwiGLU of width I) runs on the token and the outputs are summed with the routing weights; the
shared experts (one SwiGLU of width J) run on every token and are added. gpt-oss's variant: a bias on the router's
logits and on every expert projection, and a clamped SwiGLU (`MoeConfig.swiglu_limit`); Llama 4's: the routing
weight scales each expert's input (`MoeConfig.scale_expert_input`). Routing follows transformers 5.24 exactly
(`route`), and every token is served by all its A experts (no capacity, nothing dropped).

Dispatch (how the A chosen experts run without a per-token Python loop, at a fixed shape; `dispatch=`):

- "grouped" (what "auto" picks): the M * A (token, expert) assignments sorted by expert, each expert's rows
  padded to whole tiles of t rows (t: about M * A / X, a power of two in [8, 128]), then a `fori_loop` over the
  tiles in use (a dynamic trip count; the buffers have the static bound ceil((M * A + X * (t - 1)) / t) tiles)
  multiplies each tile by its one expert's weights, indexed in place, and the rows are scattered back
  (`segment_sum`). The routed FLOPs plus the padding (at most t - 1 rows per expert), each used expert's weights
  read once per tile; a loop over tiles, never over tokens.
- "dense": every expert on every row, then a [M, X] combine matrix holding the routing weights (zero elsewhere).
  X / A times the routed FLOPs and [X, M, I] + [X, M, D] intermediates, but a handful of plain batched matmuls.
- "sorted": the sorted assignments through one grouped matmul per projection (`jax.lax.ragged_dot`, the
  per-expert counts as group sizes). The routed FLOPs where XLA has a grouped-matmul kernel; XLA:CPU (jax 0.10)
  lowers ragged_dot to a masked dense dot over all X groups of all M * A rows (A times "dense"'s FLOPs).
- "gather": each assignment gathers its expert's weights ([M, A, D, I]) for a batched matvec: only the chosen
  experts' weights are read, but copied once per assignment.

Measured on XLA:CPU (X 64, A 6, D 512, I 256, float32, one layer's routed experts, 2 shared cores, so +-30%),
ms for M rows: M=1: grouped 3.0, dense 3.8, gather 4.5, sorted 26.9; M=4: grouped 8.6, dense 20.7, gather 22.9;
M=16: dense 15.0, grouped 22.3; M=64: grouped 15.6, dense 73, sorted 329, gather 545; M=512: grouped 110,
dense 636 (`scripts` has no MoE benchmark yet; the figures came from timing `_DISPATCH` directly).

Ties in the router: `jax.lax.top_k` puts the lower index first among equal values; torch.topk (sorted=False)
makes no promise, so exact ties could route differently. The parity tests use continuous random weights, where a
tie has probability zero, and assert the gap between the A-th and (A+1)-th choice scores exceeds 1e-5.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import MoeConfig
from jaxkv.layers import quantized
from jaxkv.layers.linear import fan_in_init, linear, stored_out_in

__all__ = ["MoeConfig", "Moe", "route", "in_out_names", "from_out_in", "OUT_IN_ORDER", "DISPATCHES", "FLOAT32_PARAMS"]

DISPATCHES = ("auto", "dense", "sorted", "gather", "grouped")
# The parameters kept float32 whatever the model's dtype, as transformers keeps them: the router and its biases.
FLOAT32_PARAMS = frozenset({"router", "router_bias", "router_logit_bias"})


# Parameter leaf name -> the axes of its [out, in] form in the order of its [in, out] layout (as
# `jaxkv.layers.OUT_IN_ORDER`): experts [X, I, D] <-> [X, D, I] (gate, up) and [X, D, I] <-> [X, I, D] (down), the
# shared experts as a dense MLP. The router is [X, D] in both (float32, read once per token: like the lm_head).
OUT_IN_ORDER = {"we_gate": (0, 2, 1), "we_up": (0, 2, 1), "we_down": (0, 2, 1),
                "ws_gate": (1, 0), "ws_up": (1, 0), "ws_down": (1, 0)}


def in_out_names(moe: MoeConfig, d_model: int, dtype) -> frozenset[str]:
    """The MoE parameter names stored [in, out] (`jaxkv.layers.stored_out_in` of one expert's, or the shared
    experts', matrix); the others in OUT_IN_ORDER are [out, in]."""
    D, I, J = d_model, moe.moe_ffn_dim, moe.shared_ffn_dim
    names = set()
    if not stored_out_in(D, I, dtype):
        names |= {"we_gate", "we_up"}
    if not stored_out_in(I, D, dtype):
        names.add("we_down")
    if J and not stored_out_in(D, J, dtype):
        names |= {"ws_gate", "ws_up"}
    if J and not stored_out_in(J, D, dtype):
        names.add("ws_down")
    return frozenset(names)


def from_out_in(params: dict, moe: MoeConfig, d_model: int, dtype) -> dict:
    """One Moe module's parameters (name -> array) with every weight in its [out, in] form (PyTorch's: experts
    [X, I, D] gate/up and [X, D, I] down) -> the layout `in_out_names` says (numpy)."""
    names = in_out_names(moe, d_model, dtype)
    return {name: np.ascontiguousarray(np.asarray(w).transpose(OUT_IN_ORDER[name])) if name in names else w
            for name, w in params.items()}


def route(logits, moe: MoeConfig, bias=None):
    """The router's choice: float32 logits [M, X] -> (float32 weights [M, A], int32 expert ids [M, A]).

    transformers 5.24's DeepseekV2TopkRouter (softmax; "greedy" / "group_limited_greedy") and DeepseekV3TopkRouter
    (sigmoid, "noaux_tc" with `bias` float32[X], the e_score_correction_bias), in float32 and in their order of
    operations; GptOssTopKRouter's "topk_softmax" (the A best logits, then their softmax; a router.bias is already
    in the logits) and Llama4Router's "topk_sigmoid" (the A best logits, then their sigmoid). The A choices come
    best first; transformers' own order is unspecified (topk sorted=False), so
    compare them as sets. A weight belongs to the expert id beside it."""
    X, A = moe.n_routed_experts, moe.experts_per_token
    if logits.ndim != 2 or logits.shape[-1] != X:
        raise ValueError(f"router logits must be [M, X={X}], got shape {logits.shape}")
    if (bias is None) != (moe.topk_method != "noaux_tc"):
        raise ValueError(f"topk_method {moe.topk_method!r} {'needs' if bias is None else 'takes no'} a correction "
                         f"bias")
    logits = logits.astype(jnp.float32)
    if moe.scoring in ("topk_softmax", "topk_sigmoid"):
        top, ids = jax.lax.top_k(logits, A)
        weights = jax.nn.softmax(top, axis=-1) if moe.scoring == "topk_softmax" else jax.nn.sigmoid(top)
        return weights * jnp.float32(moe.routed_scaling_factor), ids.astype(jnp.int32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax" else jax.nn.sigmoid(logits)  # [M, X]
    M, G = logits.shape[0], moe.n_group
    if moe.topk_method == "greedy":
        weights, ids = jax.lax.top_k(scores, A)
    elif moe.topk_method == "group_limited_greedy":
        group_scores = scores.reshape(M, G, X // G).max(axis=-1)  # [M, G]
        eligible = _group_mask(group_scores, moe)  # [M, X]
        # Masked experts score 0, as transformers' masked_fill(0.0); the config ensures A eligible ones, so a
        # masked expert never outranks them (softmax and sigmoid scores are > 0).
        weights, ids = jax.lax.top_k(jnp.where(eligible, scores, 0.0), A)
    else:
        choice = scores + bias.astype(jnp.float32)  # [M, X]
        group_scores = jax.lax.top_k(choice.reshape(M, G, X // G), 2)[0].sum(axis=-1)  # [M, G]
        eligible = _group_mask(group_scores, moe)
        ids = jax.lax.top_k(jnp.where(eligible, choice, -jnp.inf), A)[1]
        weights = jnp.take_along_axis(scores, ids, axis=-1)  # the uncorrected scores
    if moe.norm_topk_prob:
        # transformers' V3 rule (its V2 router has none; DeepSeek's own V2 code divides the same way).
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * jnp.float32(moe.routed_scaling_factor), ids.astype(jnp.int32)


def _group_mask(group_scores, moe: MoeConfig):
    """bool[M, X]: the experts of each row's topk_group best groups."""
    M, G = group_scores.shape
    best = jax.lax.top_k(group_scores, moe.topk_group)[1]  # [M, topk_group]
    chosen = jnp.any(best[:, :, None] == jnp.arange(G), axis=1)  # [M, G]
    return jnp.repeat(chosen, moe.n_routed_experts // G, axis=1)


class Moe(nn.Module):
    """The MoE feed-forward block: x [B, T, D] -> [B, T, D] (routed experts + shared experts).

    Parameters: router float32[X, D] (+ router_bias float32[X] for "noaux_tc", router_logit_bias float32[X] under
    moe.router_logit_bias); we_gate, we_up [X, D, I] or [X, I, D] and we_down [X, I, D] or [X, D, I]
    (`in_out_names`), with moe.expert_bias we_gate_bias, we_up_bias [X, I] and we_down_bias [X, D]; ws_gate,
    ws_up, ws_down the shared experts
    (when n_shared_experts > 0 or shared_expert_ffn_dim is set), laid out as a dense MLP of width J; shared_gate
    [1, D] ([out, in]) under shared_expert_gate.

    The routing is sown into the "intermediates" collection as `expert_ids` int32[B, T, A] and `expert_weights`
    float32[B, T, A] (best first): `apply(..., mutable=["intermediates"])` returns it (padding tokens included);
    otherwise the sow is a no-op."""

    moe: MoeConfig
    d_model: int
    dtype: str = "float32"
    dispatch: str = "auto"

    @nn.compact
    def __call__(self, x):
        cfg, D = self.moe, self.d_model
        X, A, I, J = cfg.n_routed_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.shared_ffn_dim
        dtype = jnp.dtype(self.dtype)
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if x.ndim != 3 or x.shape[-1] != D:
            raise ValueError(f"Moe input must be [B, T, D={D}], got shape {x.shape}")
        in_out = in_out_names(cfg, D, dtype)
        # transformers keeps the router (and the bias) in float32 whatever the model's dtype.
        router = self.param("router", fan_in_init(D), (X, D), jnp.float32)
        bias = (self.param("router_bias", nn.initializers.zeros, (X,), jnp.float32)
                if cfg.topk_method == "noaux_tc" else None)

        def expert_weight(name, d_in, d_out):  # [X, in, out] or [X, out, in]
            shape = (X, d_in, d_out) if name in in_out else (X, d_out, d_in)
            return self.param(name, fan_in_init(d_in), shape, dtype)

        w_gate, w_up, w_down = expert_weight("we_gate", D, I), expert_weight("we_up", D, I), expert_weight(
            "we_down", I, D)
        biases = None
        if cfg.expert_bias:
            biases = tuple(self.param(name, nn.initializers.zeros, (X, width), dtype)
                           for name, width in (("we_gate_bias", I), ("we_up_bias", I), ("we_down_bias", D)))
        B, T = x.shape[:2]
        h = x.reshape(B * T, D)  # [M, D]
        logits = jnp.einsum("md,xd->mx", h.astype(jnp.float32), router)  # [M, X]
        if cfg.router_logit_bias:  # gpt-oss: F.linear(x, weight, bias)
            logits = logits + self.param("router_logit_bias", nn.initializers.zeros, (X,), jnp.float32)
        weights, ids = route(logits, cfg, bias)  # [M, A]
        dispatch = self.dispatch
        if dispatch == "auto":
            dispatch = "grouped"
        experts = Experts(w_gate, w_up, w_down, biases, ("we_gate" in in_out, "we_down" in in_out),
                          activation(cfg), cfg.scale_expert_input)
        y = _DISPATCH[dispatch](h, weights, ids, experts)  # float32 [M, D]
        y = y.astype(dtype).reshape(B, T, D)
        if J:
            shared = self._shared(x, in_out)
            if cfg.shared_expert_gate:  # Qwen3-Next: the shared expert's output times sigmoid(w . x), per token
                w = self.param("shared_gate", fan_in_init(D), (1, D), dtype)  # [out, in]
                shared = nn.sigmoid(linear(x, w, True)) * shared
            y = y + shared
        self.sow("intermediates", "expert_ids", ids.reshape(B, T, A))
        self.sow("intermediates", "expert_weights", weights.reshape(B, T, A))
        return y

    def _shared(self, x, in_out):  # [B, T, D] -> [B, T, D]
        D, J, dtype = self.d_model, self.moe.shared_ffn_dim, jnp.dtype(self.dtype)

        def dense(name, v, d_in, d_out):
            out_in = name not in in_out
            return linear(v, self.param(name, fan_in_init(d_in), (d_out, d_in) if out_in else (d_in, d_out), dtype),
                          out_in)

        return dense("ws_down", nn.silu(dense("ws_gate", x, D, J)) * dense("ws_up", x, D, J), J, D)


def _f32(a):
    """XLA:CPU (jax 0.10) has no batched or ragged bfloat16 x bfloat16 -> float32 dot ("Unsupported element type
    for DotThunk"); 16-bit products are exact in float32, so upcasting the operands gives the same float32-
    accumulated result. A quantized expert weight (`jaxkv.layers.quantized`; only the experts a dispatch picked,
    `w[ids]` or one expert's `w[e]`) is dequantized to float32."""
    return quantized.dequantized(a, jnp.float32).astype(jnp.float32)


def activation(moe: MoeConfig):
    """The experts' gated activation (gate, up) -> hidden: SwiGLU's silu(g) * u, or under moe.swiglu_limit
    gpt-oss's clamped form (transformers' GptOssExperts._apply_gate, in the weights' dtype)."""
    if moe.swiglu_limit is None:
        return lambda g, u: nn.silu(g) * u
    limit, alpha = moe.swiglu_limit, moe.swiglu_alpha

    def clamped(g, u):
        g = jnp.minimum(g, jnp.asarray(limit, g.dtype))
        u = jnp.clip(u, -jnp.asarray(limit, u.dtype), jnp.asarray(limit, u.dtype))
        return (u + 1) * (g * nn.sigmoid(g * jnp.asarray(alpha, g.dtype)))

    return clamped


class Experts(NamedTuple):
    """The routed experts as the dispatches read them: the stacked weights, their biases ((gate, up, down)
    [X, I], [X, I], [X, D], or None), the layouts (gate/up in-out, down in-out), the gated activation, and
    whether the routing weight scales each expert's input rather than its output (Llama 4)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    biases: tuple | None
    layouts: tuple[bool, bool]
    act: Callable
    scale_input: bool = False


def _expert_ffn(rows, experts: Experts, spec, weights=None, bias_of=None):
    """The gated FFN of expert weights `weights` ((gate, up, down), default the stacked ones) through
    `spec(rows, w, in_out)` (an einsum or grouped matmul); each product accumulates in float32 and rounds to the
    weights' dtype, as PyTorch's per-expert Linear does. `bias_of(b)` puts a stacked bias [X, width] in the shape
    of spec's output (the rows' own experts' biases), added after the rounding as transformers adds them."""
    gate, up, down = (experts.gate, experts.up, experts.down) if weights is None else weights
    gate_in_out, down_in_out = experts.layouts
    dtype = rows.dtype  # the model's (a quantized weight's dtype is its scale's)
    bias_g = bias_u = bias_d = 0
    if experts.biases is not None:
        bias_g, bias_u, bias_d = (bias_of(b) for b in experts.biases)
    g = spec(rows, gate, gate_in_out).astype(dtype) + bias_g
    u = spec(rows, up, gate_in_out).astype(dtype) + bias_u
    return spec(experts.act(g, u), down, down_in_out).astype(dtype) + bias_d


def _dense(h, weights, ids, experts: Experts):
    """Every expert on every row; the [M, X] combine matrix keeps the chosen ones."""
    M, X = h.shape[0], experts.gate.shape[0]

    def spec(rows, w, in_out):  # rows [M, in] or [X, M, in] -> [X, M, out]
        sub = "xmi" if rows.ndim == 3 else "mi"
        return jnp.einsum(f"{sub},{'xio' if in_out else 'xoi'}->xmo", _f32(rows), _f32(w))

    combine = jnp.zeros((M, X), jnp.float32).at[jnp.arange(M)[:, None], ids].add(weights)  # [M, X]
    rows = h
    if experts.scale_input:  # each expert's own scaled copy of the rows; an unchosen one's input is 0 -> output 0
        rows = (combine.T[:, :, None] * h[None].astype(jnp.float32)).astype(h.dtype)  # [X, M, D]
        combine = (combine > 0).astype(jnp.float32)
    y = _expert_ffn(rows, experts, spec, bias_of=lambda b: b[:, None, :])  # [X, M, D]
    return jnp.einsum("xmd,mx->md", y.astype(jnp.float32), combine)


def _sorted(h, weights, ids, experts: Experts):
    """Assignments sorted by expert, one grouped matmul per projection, scattered back."""
    M, A = ids.shape
    X = experts.gate.shape[0]
    flat = ids.reshape(M * A)
    order = jnp.argsort(flat, stable=True)  # [M * A], grouped by expert
    token = order // A  # the row each sorted assignment reads
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)  # [X], rows per expert, summing to M * A

    def spec(rows, w, in_out):  # rows [M * A, in] sorted -> [M * A, out]
        return jax.lax.ragged_dot(_f32(rows), _f32(w) if in_out else jnp.swapaxes(_f32(w), 1, 2), sizes)

    scale = weights.reshape(M * A)[order][:, None]  # [M * A, 1]
    rows = h[token]
    if experts.scale_input:
        rows, scale = (rows.astype(jnp.float32) * scale).astype(h.dtype), jnp.ones_like(scale)
    y = _expert_ffn(rows, experts, spec, bias_of=lambda b: b[flat[order]])  # [M * A, D]
    y = y.astype(jnp.float32) * scale
    return jax.ops.segment_sum(y, token, num_segments=M)


def _gather(h, weights, ids, experts: Experts):
    """Each assignment reads its own expert's weights."""

    def spec(rows, w, in_out):  # rows [M, in] or [M, A, in] -> [M, A, out]
        sub = "mai" if rows.ndim == 3 else "mi"
        return jnp.einsum(f"{sub},{'maio' if in_out else 'maoi'}->mao", _f32(rows), _f32(w[ids]))

    rows = h
    if experts.scale_input:  # [M, A, D]: each assignment's scaled copy
        rows = (weights[..., None] * h[:, None].astype(jnp.float32)).astype(h.dtype)
        weights = jnp.ones_like(weights)
    y = _expert_ffn(rows, experts, spec, bias_of=lambda b: b[ids])  # [M, A, D]
    return jnp.einsum("mad,ma->md", y.astype(jnp.float32), weights)


def _tile_rows(assignments: int, experts: int) -> int:
    """Rows per tile of "grouped": about one expert's average share of the assignments, a power of two in
    [8, 128] (each expert pads its rows to whole tiles, so smaller tiles waste less and loop more)."""
    return min(128, max(8, 1 << max(0, math.ceil(math.log2(max(1, assignments // experts))))))


def _grouped(h, weights, ids, experts: Experts):
    """Assignments sorted by expert, each expert's rows padded to whole tiles; a loop over the tiles in use (a
    dynamic count under the static bound ceil((M * A + X * (t - 1)) / t)) multiplies each tile by its one
    expert's weights, read in place."""
    M, A = ids.shape
    X, D = experts.gate.shape[0], h.shape[1]
    tile = _tile_rows(M * A, X)
    flat = ids.reshape(M * A)
    order = jnp.argsort(flat, stable=True)  # [M * A], grouped by expert
    sizes = jnp.bincount(flat, length=X)  # [X]
    padded = (sizes + tile - 1) // tile * tile  # [X], each expert's rows in whole tiles
    ends = jnp.cumsum(padded)  # [X], where each expert's tiles end
    expert_of = flat[order]  # [M * A]
    slot = ends[expert_of] - padded[expert_of] + jnp.arange(M * A) - (jnp.cumsum(sizes) - sizes)[expert_of]
    n_tiles = -(-(M * A + X * (tile - 1)) // tile)
    rows = n_tiles * tile
    token = jnp.full((rows,), M, jnp.int32).at[slot].set(order // A)  # M: an empty slot (reads a zero row)
    scale = jnp.zeros((rows,), jnp.float32).at[slot].set(weights.reshape(M * A)[order])
    tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_tiles) * tile, side="right"), X - 1)
    x = jnp.concatenate([h, jnp.zeros((1, D), h.dtype)])[token]  # [rows, D]
    if experts.scale_input:
        x, scale = (x.astype(jnp.float32) * scale[:, None]).astype(h.dtype), (scale > 0).astype(jnp.float32)
    x = x.reshape(n_tiles, tile, D)

    def spec(r, w, in_out):  # r [tile, in], w one expert's -> [tile, out]
        return jnp.einsum("ti,io->to" if in_out else "ti,oi->to", _f32(r), _f32(w))

    def body(j, out):
        e = tile_expert[j]
        y = _expert_ffn(x[j], experts, spec, (experts.gate[e], experts.up[e], experts.down[e]),
                        lambda b: b[e])  # [tile, D]
        return out.at[j].set(y.astype(jnp.float32))

    y = jax.lax.fori_loop(0, ends[-1] // tile, body, jnp.zeros((n_tiles, tile, D), jnp.float32))
    y = y.reshape(rows, D) * scale[:, None]
    return jax.ops.segment_sum(y, token, num_segments=M + 1)[:M]


_DISPATCH = {"dense": _dense, "sorted": _sorted, "gather": _gather, "grouped": _grouped}
