"""The decoder: `(params, tokens, positions, cache) -> (logits, cache)`, Flax linen applied functionally.

The cache is an explicit immutable pytree (`jaxkv.cache.KVCache`) that goes in and comes out; there is no Flax
mutable "cache" collection. With a cache, the T new tokens' keys and values are written to slots
[cache.length, cache.length + T) and the queries attend over the cache. Without one (`cache=None`), the tokens
attend causally to each other only: the no-cache recompute reference.

The Decoder assembles each layer from the pieces of `jaxkv.layers` its config asks for (GQA or MLA attention,
dense MLP or mixture of experts, Gemma's extra norms and per-layer inputs); the attention implementation is
asked of `jaxkv.attention.api` by the attention layers, by name ("auto", "xla", "pallas") and cache kind.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxkv import compile_cache
from jaxkv.cache.contiguous import KVCache
from jaxkv.config import Config
from jaxkv.layers import moe as moe_lib
from jaxkv.layers import quantized
from jaxkv.layers.gated_delta import GatedDeltaNet
from jaxkv.layers.gqa import Attention
from jaxkv.layers.linear import ALL_OUT_IN_ORDER, fan_in_init, in_out_names, linear
from jaxkv.layers.mla import MlaAttention
from jaxkv.layers.mlp import Mlp, activation
from jaxkv.layers.norms import Norm
from jaxkv.layers.per_layer import PerLayerInputs
from jaxkv.layers.rope import rope_angles
from jaxkv.cache.paged import PagedKVCache

compile_cache.setup()  # before anything compiles: programs come from / go to the persistent cache


class Block(nn.Module):
    config: Config
    layer: int
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x, rope, cache, start, prefill, attention: str, shared=None, layer_input=None,
                 chunk: bool = False, real=None, step_states: bool = False, query_scale=None):
        """-> (x, cache, this layer's fresh K/V or None); `shared`: the fresh K/V of the layer this one reads
        (`Config.kv_source`); `layer_input` [B, T, P]: its per-layer input (`Config.per_layer_input_dim`);
        `query_scale` [B, T]: multiplies the queries (Llama 4's attention temperature, `Config.attn_temperature`);
        `chunk`: a prompt chunk over a paged cache (`Decoder`); `real` bool[B, T]: the tokens that are not
        padding (what a linear-attention layer's state may take); `step_states`: a linear layer sows its state
        after each token (`GatedDeltaNet`)."""
        cfg = self.config
        if cfg.layer_is_linear(self.layer):  # Gated DeltaNet: a state in the cache, no K/V
            attn = GatedDeltaNet(cfg, self.layer, name="linear_attn")
            h, cache = attn(Norm(cfg, name="attn_norm")(x), cache, real, attention, step_states)
            fresh = None
        elif cfg.mla is not None:
            attn = MlaAttention(cfg, self.layer, self.mesh, name="attn")
            h, cache = attn(Norm(cfg, name="attn_norm")(x), rope, cache, start, prefill, attention, chunk)
            fresh = None
        else:
            attn = Attention(cfg, self.layer, self.mesh, name="attn")
            h, cache, fresh = attn(Norm(cfg, name="attn_norm")(x), rope, cache, start, prefill, attention, shared,
                                   chunk, query_scale)
        if cfg.post_norms:  # Gemma 2/3/4: each branch's output normalized before the residual add
            h = Norm(cfg, name="post_attn_norm")(h)
        x = x + h
        h = ffn(cfg, self.layer)(Norm(cfg, name="mlp_norm")(x))
        if cfg.post_norms:
            h = Norm(cfg, name="post_mlp_norm")(h)
        x = x + h
        if cfg.per_layer_input_dim is not None:
            # Gemma 4: the per-layer input gates a P-wide projection of the stream, added back normalized
            D, P, dtype = cfg.d_model, cfg.per_layer_input_dim, jnp.dtype(cfg.dtype)
            gate = self.param("ple_gate", fan_in_init(D), (P, D), dtype)  # [out, in], as every non-listed weight
            up = self.param("ple_proj", fan_in_init(P), (D, P), dtype)
            h = activation(cfg, linear(x, gate, True)) * layer_input
            x = x + Norm(cfg, name="post_ple_norm")(linear(h, up, True))
        if cfg.layer_scalar:  # Gemma 4: the layer's output times a learned scalar
            x = x * self.param("layer_scalar", nn.initializers.ones, (1,), jnp.dtype(cfg.dtype))
        return x, cache, fresh


def ffn(config: Config, layer: int) -> nn.Module:
    """The feed-forward block of `layer` (named "mlp"): the dense `Mlp` of ffn_dim, or from layer
    moe.first_dense_layers on (DeepSeek's `first_k_dense_replace`) the mixture of experts (`jaxkv.layers.moe.Moe`)."""
    if config.moe is not None and config.moe.is_moe_layer(layer):
        return moe_lib.Moe(config.moe, config.d_model, config.dtype, name="mlp")
    return Mlp(config, config.layer_ffn_dim(layer), name="mlp")


class Decoder(nn.Module):
    config: Config
    mesh: Mesh | None = None  # set when running sharded over a ("data", "model") mesh (`jaxkv.sharding`)

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache | None = None, *, prefill: bool = False,
                 last_only: bool = False, attention: str | None = None, chunk: bool = False,
                 return_hidden: bool = False, step_states: bool = False):
        """Runs T tokens through the model.

        Args:
          tokens: int32[B, T].
          positions: int32[B, T] position ids; a negative position marks a padding token, whose hidden state is
            zeroed (so whatever its embedding holds cannot matter) and which no real token attends to.
          cache: with a cache, tokens go to slots [cache.length, cache.length + T) and attend over the cache;
            positions must then equal `cache.positions(T)`. Without, tokens attend causally to each other.
          prefill: the cache is empty (length 0): the tokens attend over their own fresh K/V, so prefill costs
            O(T^2) rather than O(T S) and is exact whatever the cache dtype; the cache stores them (a ring cache
            shorter than T keeps the last S).
          last_only: compute logits for the last token only ([B, 1, V]), all generation needs after prefill.
          attention: implementation name; defaults to config.attention.
          chunk: (a `PagedKVCache` only, not with `prefill`) the tokens are a chunk of prompt continuing each
            row (the engine's chunked prefill, a suffix after a prefix-cache hit): they attend over the row's
            earlier slots as stored (quantized in an int8/fp8 pool) and over the chunk's own fresh K/V, as
            prefill attends over a whole prompt's, so a prompt prefilled in one chunk from an empty row gives
            prefill's logits (up to float32 rounding) whatever the cache dtype. Plain XLA attention. Without
            it (a decode step) every query reads every slot as stored, its own included.
          return_hidden: also return the hidden states the head reads, [B, T, D] after the final norm (every
            token, whatever `last_only`): what DeepSeek's multi-token-prediction modules read
            (`jaxkv.decoding.mtp`).
          step_states: (hybrid models, a speculative verify) each linear layer runs the tokens one by one and
            sows its state after each (`GatedDeltaNet`); apply with mutable=["intermediates"] to read them
            (`jaxkv.decoding.programs.forward` does).

        Returns:
          (float32[B, T or 1, V] logits, the updated cache or None), and with `return_hidden` the hidden states
          third. A row's logits are NaN when its tokens do not fit: a position >= config.max_positions, or (plain
          cache) slots past the capacity; the cache's `overflowed` / `check()` report the latter. A chunk longer
          than the capacity is a ValueError.
        """
        cfg = self.config
        T = tokens.shape[1]
        attention = attention or cfg.attention
        if chunk and (prefill or not isinstance(cache, PagedKVCache)):
            raise ValueError("chunk=True continues a PagedKVCache's rows with a prompt chunk: not with prefill=True "
                             "or another cache")
        x, embedding, rope, layer_inputs = _embed(self, tokens, positions)
        real = positions >= 0  # [B, T]

        paged = isinstance(cache, PagedKVCache)
        if paged:
            # Each row writes its real tokens at its own slots; pages for them first (a row that finds none is
            # marked overflowed and poisoned below).
            cache = cache.reserve(jnp.sum(real, axis=1, dtype=jnp.int32))
            start = real  # [B, T]: what Attention stores
        else:
            # Without a cache, padding must be on the left (as generate lays it out): the first real token's index.
            start = jnp.sum(~real, axis=1, dtype=jnp.int32) if cache is None else cache.start  # [B]
        # Rows whose result would be plausible garbage get NaN logits instead (below): a position past the
        # model's range (learned tables would clamp it), or a write past a plain cache's end (dropped by
        # `KVCache.write`). Sizes known at trace time were refused before this point.
        poisoned = jnp.any(positions >= cfg.max_positions, axis=1)  # [B]
        if paged:
            poisoned |= cache.overflowed
        elif cache is not None and not cache.ring:
            poisoned |= cache.length + T > cache.capacity
        sources = {cfg.kv_source(layer) for layer in range(cfg.n_layers) if not cfg.stores_kv(layer)}
        fresh = {}  # a K/V source layer's fresh keys and values, for the layers that share them
        temperature = None if cfg.attn_temperature is None else query_temperature(positions, cfg.attn_temperature)
        for layer in range(cfg.n_layers):
            nope = cfg.layer_is_nope(layer)  # Llama 4's NoPE layers: no rotation, the temperature instead
            layer_rope = None if rope is None or nope else rope[_rope_key(cfg, layer)]
            layer_input = None if layer_inputs is None else layer_inputs[:, :, layer]
            x, cache, kv = Block(cfg, layer, self.mesh, name=f"layer_{layer}")(
                x, layer_rope, cache, start, prefill, attention, fresh.get(cfg.kv_source(layer)), layer_input,
                chunk, real, step_states=step_states, query_scale=temperature if nope else None)
            if layer in sources and kv is not None:
                fresh[layer] = kv
        if cache is not None:
            cache = cache.advance(jnp.sum(real, axis=1, dtype=jnp.int32) if paged else T)

        logits, hidden = _logits(self, x, embedding, real if last_only and paged else None, last_only, return_hidden)
        logits = jnp.where(poisoned[:, None, None], jnp.nan, logits)
        if return_hidden:
            return logits, cache, hidden
        return logits, cache


def _embed(module: Decoder, tokens, positions):
    """The token (and learned position) embeddings of `module`'s config -> (x [B, T, D] with padding tokens
    zeroed, the embedding table, the (cos, sin) per `_rope_key` or None, Gemma 4's per-layer inputs or None)."""
    cfg = module.config
    dtype = jnp.dtype(cfg.dtype)
    embedding = module.param("embedding", fan_in_init(cfg.d_model), (cfg.vocab_size, cfg.d_model), dtype)
    x = quantized.rows(embedding, tokens, dtype)  # [B, T, D]
    if cfg.embed_scale is not None:  # Gemma: sqrt(D), rounded to the dtype first as transformers does
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    real = positions >= 0  # [B, T]
    rope = None
    if cfg.positions == "learned":
        table = module.param("pos_embedding", fan_in_init(cfg.d_model), (cfg.max_positions, cfg.d_model), dtype)
        # Padding tokens have negative positions; read row 0 for them (their state is zeroed just below).
        x = x + jnp.take(table, jnp.maximum(positions, 0), axis=0)
    else:
        # One (cos, sin) per distinct (base, scaling, head dim) among the layers (Gemma 3/4: local and global).
        rope = {}
        for layer in range(cfg.n_layers):
            if _rope_key(cfg, layer) not in rope:
                rope[_rope_key(cfg, layer)] = rope_angles(positions, cfg, layer)
    layer_inputs = None
    if cfg.per_layer_input_dim is not None:
        layer_inputs = PerLayerInputs(cfg, name="per_layer_inputs")(tokens, x)  # [B, T, L, P]
    x = jnp.where(real[..., None], x, jnp.zeros((), x.dtype))
    return x, embedding, rope, layer_inputs


def _logits(module: Decoder, x, embedding, real, last_only: bool, return_hidden: bool = False):
    """x [B, T, D] -> (float32[B, T or 1, V] logits, the normed x [B, T, D] with `return_hidden` else None): the
    final norm and the head (the embedding if tied), soft-capped where the config says. `last_only`: the last
    token's only, each row's last real one where `real` (bool[B, T], right padding) is given, else the last column."""
    cfg = module.config
    T = x.shape[1]
    final_norm = Norm(cfg, name="final_norm")
    hidden = final_norm(x) if return_hidden else None  # every token's, before `last_only` picks
    if last_only and real is not None:  # right padding: each row's last real token
        last = T - 1 - jnp.argmax(real[:, ::-1], axis=1)  # [B]
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    elif last_only:  # left padding (or none): the last column
        x = x[:, -1:]
    x = final_norm(x)
    if cfg.tie_embeddings:
        logits = quantized.einsum("btd,vd->btv", x, embedding)
    else:
        shape = (cfg.vocab_size, cfg.d_model)
        head = module.param("lm_head", fan_in_init(cfg.d_model), shape, jnp.dtype(cfg.dtype))
        logits = quantized.einsum("btd,vd->btv", x, head)
    if cfg.final_logit_softcap is not None:  # Gemma 2: cap * tanh(logits / cap), in float32
        cap = jnp.float32(cfg.final_logit_softcap)
        logits = jnp.tanh(logits / cap) * cap
    return logits, hidden


def query_temperature(positions, temperature: tuple[float, float]):
    """Llama 4's attention temperature tuning of its NoPE layers: float32[B, T] query scales
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 for positions p (padding, p < 0, gets 1)."""
    floor_scale, attn_scale = temperature
    p = jnp.maximum(positions, 0).astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


def _rope_key(config: Config, layer: int):
    """What `layer`'s (cos, sin) depend on: its rope base and scaling, and its head dim."""
    return (*config.layer_rope(layer), config.layer_head_dim(layer))


def param_shapes(config: Config) -> dict:
    """The parameter tree as jax.ShapeDtypeStruct leaves: what `config` implies, without allocating anything."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(Decoder(config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]


def weight_layout(config: Config) -> tuple[frozenset[str], dict]:
    """(the names `config` stores [in, out], name -> axis order of the [in, out] form): `layers.in_out_names`
    plus the mixture of experts' own (`jaxkv.layers.moe.in_out_names`)."""
    if config.moe is None:
        return in_out_names(config), ALL_OUT_IN_ORDER
    return (in_out_names(config) | moe_lib.in_out_names(config.moe, config.d_model, config.dtype),
            {**ALL_OUT_IN_ORDER, **moe_lib.OUT_IN_ORDER})


def from_out_in(params, config: Config):
    """A parameter tree with every weight in the [out, in] form -> `config`'s layout (numpy)."""
    names, orders = weight_layout(config)

    def convert(path, x):
        name = path[-1].key
        return np.ascontiguousarray(np.asarray(x).transpose(orders[name])) if name in names else x

    return jax.tree_util.tree_map_with_path(convert, params)


def to_out_in(params, config: Config):
    """The inverse of `from_out_in`: every weight in the [out, in] form (numpy), e.g. for PyTorch.
    `jax.ShapeDtypeStruct` leaves (`param_shapes`) give the shapes of that form."""
    names, orders = weight_layout(config)

    def convert(path, x):
        name = path[-1].key
        if name not in names:
            return x
        back = tuple(int(i) for i in np.argsort(orders[name]))
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(tuple(x.shape[i] for i in back), x.dtype)
        return np.ascontiguousarray(np.asarray(x).transpose(back))

    return jax.tree_util.tree_map_with_path(convert, params)


def init_params(config: Config, seed: int = 0) -> dict:
    """Random parameters for `config` (the Flax "params" dict), drawn with numpy.

    Same distributions as the modules' Flax initializers (norm scales 1, biases 0, everything else
    Normal(0, 1/sqrt(fan_in))), but without compiling an init function: a jitted Flax init spends seconds
    compiling one threefry sampler per parameter on CPU; this takes milliseconds. Each weight is drawn in its
    [out, in] form and then laid out as the config stores it, so a seed gives the same model whatever the layout.
    """
    shapes = param_shapes(config)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        if name in ("layer_scalar", "gate_norm"):
            return np.ones(leaf.shape, leaf.dtype)
        if name == "scale":  # a Gemma norm multiplies by (1 + scale)
            return np.full(leaf.shape, 0 if config.norm_kind == "gemma_rmsnorm" else 1, leaf.dtype)
        if name.endswith("bias"):
            return np.zeros(leaf.shape, leaf.dtype)
        shape = to_out_in({name: leaf}, config)[name].shape
        # In the [out, in] form: embedding tables are [rows, D]; q/k/v projections [heads, H, D]; wo [D, N, H];
        # MLA's per-head wq_b, wk_b, wv_b [heads, width, rank]; experts [X, outputs, inputs]; every other weight
        # [outputs, inputs].
        if name in ("embedding", "pos_embedding", "wq", "wk", "wv"):
            fan_in = config.d_model
        elif name in ("wq_b", "wk_b", "wv_b", "we_gate", "we_up", "we_down"):
            fan_in = shape[-1]
        else:
            fan_in = math.prod(shape[1:])
        return rng.normal(0.0, 1.0 / math.sqrt(fan_in), shape).astype(leaf.dtype)

    params = from_out_in(jax.tree_util.tree_map_with_path(draw, shapes), config)
    return jax.tree_util.tree_map(jnp.asarray, params)


@dataclasses.dataclass
class Model:
    """A config, its parameters (the Flax "params" dict) and optionally a tokenizer."""

    config: Config
    params: dict
    tokenizer: object | None = None
    # DeepSeek-V3's multi-token-prediction modules (`jaxkv.decoding.mtp.Mtp`) when the checkpoint holds them, else
    # None; apart from `params`, so the decoder's parameter tree is the same with or without them.
    mtp: object | None = None
    # generation_config.json's sampling (`jaxkv.io.generation.SamplingDefaults`) or None: what
    # `generate(..., sampling="checkpoint")`, `jaxkv generate` and `jaxkv serve` sample with by default
    sampling_defaults: object | None = None
    # How `params` are quantized (`jaxkv.layers.quantized.WeightQuant`: weight-only int8 / fp8 / int4, made by
    # `quantize_weights` or `jaxkv.load(..., weights=)`), or None for float weights
    weights: quantized.WeightQuant | None = None

    @classmethod
    def random(cls, config: Config, seed: int = 0) -> "Model":
        """Random weights: Normal(0, 1/sqrt(fan_in)) projections, unit norms, zero biases."""
        return cls(config=config, params=init_params(config, seed))

    def apply(self, tokens, positions, cache=None, **kwargs):
        """`Decoder(config).apply` with this model's parameters; see `Decoder.__call__`.

        Called eagerly with a cache whose length is a concrete value, a chunk that does not fit is a ValueError
        before compute; under jit (a traced length) the overflow shows as NaN logits and `cache.overflowed`."""
        if isinstance(cache, KVCache) and not cache.ring and not isinstance(cache.length, jax.core.Tracer):
            T, length = np.shape(tokens)[1], int(cache.length)
            if length + T > cache.capacity:
                raise ValueError(f"cannot write {T} tokens at slot {length} of a cache of {cache.capacity} slots")
        return Decoder(self.config).apply({"params": self.params}, tokens, positions, cache, **kwargs)


def quantize_weights(model: Model, weights) -> Model:
    """The model with its weights quantized (`jaxkv.layers.quantized`: "int8", "fp8", "int4" or a
    `WeightQuant`); None returns it unchanged. A model already quantized is refused (quantize the float model: a
    second rounding would compound the first)."""
    quant = quantized.WeightQuant.of(weights)
    if quant is None:
        return model
    if model.weights is not None:
        raise ValueError(f"the model's weights are already quantized ({model.weights.mode}); load the float "
                         f"checkpoint to quantize it as {quant.mode}")
    names, orders = weight_layout(model.config)
    params = quantized.quantize_params(model.params, quant, names, orders)
    return dataclasses.replace(model, params=params, weights=quant)


@functools.partial(jax.jit, static_argnames=("config", "attention"))
def _full_forward(params, tokens, *, config: Config, attention: str):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return Decoder(config).apply({"params": params}, tokens, positions, None, attention=attention)[0]


def logits(model: Model, tokens, *, attention: str | None = None) -> np.ndarray:
    """float32[B, T, V]: the full forward pass over `tokens` ([B, T] ids, or one list of ids) with no cache.

    This recomputes everything from scratch: the reference that cached decoding is tested against.
    """
    arr = np.asarray(tokens)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty [batch, seq] array of integer ids, got shape {arr.shape} "
                         f"and dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= model.config.vocab_size)
    if bad.any():
        raise ValueError(f"token id {int(arr[bad][0])} is outside the vocabulary [0, {model.config.vocab_size})")
    if arr.shape[1] > model.config.max_positions:
        raise ValueError(f"{arr.shape[1]} tokens exceed the model's max positions ({model.config.max_positions})")
    attention = attention or model.config.attention
    return np.asarray(_full_forward(model.params, jnp.asarray(arr, jnp.int32), config=model.config,
                                    attention=attention))
