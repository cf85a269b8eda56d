"""Grouped-query attention as a decoder layer's attention: projections, q/k/v norms, rotation, the cache write, and
the attention itself asked of `jaxkv.attention.api` (kind "contiguous" or "paged" by the cache).

Parameters (the [out, in] form; `jaxkv.layers.linear.OUT_IN_ORDER` gives the stored layout): wq [N, H, D],
wk and wv [K, H, D] (none in a layer that shares another's K/V; no wv where the values are the keys), wo [D, N, H];
with config.qkv_bias: wq_bias [N, H], wk_bias, wv_bias [K, H]; with config.out_bias: wo_bias [D]; with
config.qk_norm: q_norm/scale, k_norm/scale [H]; with config.attention_sinks: sinks [N] (gpt-oss), one logit per
query head in every softmax's denominator.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxkv.attention import api
from jaxkv.attention.reference import masks_dead_values
from jaxkv.config import Config
from jaxkv.layers import quantized
from jaxkv.layers.linear import fan_in_init, linear, stored_out_in
from jaxkv.layers.norms import Norm
from jaxkv.layers.rope import apply_rope
from jaxkv.cache.paged import PagedKVCache


class Attention(nn.Module):
    config: Config
    layer: int
    mesh: Mesh | None = None  # with a mesh, a Pallas kernel runs per shard (`jaxkv.attention.api`)

    @nn.compact
    def __call__(self, x, rope, cache, start, prefill, attention: str, shared=None, chunk: bool = False,
                 query_scale=None):
        """x [B, T, D]; rope: (cos, sin) or None; start int32[B] -> ([B, T, D], cache, (k, v)).

        With a cache, the queries sit in slots [cache.length, cache.length + T) and attend over the cache (with
        `prefill`, the cache is empty and they attend over each other); without, they sit in slots [0, T) and
        attend over each other. With a `PagedKVCache`, `start` is instead bool[B, T], the tokens to store (right
        padding is not), and the queries sit in each row's own slots [lengths[b], lengths[b] + T); with `chunk`
        (a prompt chunk, `Decoder`) they attend over the pages before the chunk and over their own fresh K/V.

        The third output is this layer's fresh keys and values ([B, K, T, H], after norms and rotation; None for a
        layer that computes none). A layer that shares another's K/V (`Config.kv_source`) computes none and
        caches nothing: it attends over `shared`, its source layer's fresh K/V, during prefill and without a
        cache, and otherwise over the source layer's cache buffer, which that layer has already updated for these
        tokens.
        """
        cfg = self.config
        N, H = cfg.n_heads, cfg.layer_head_dim(self.layer)
        # One layout for all four projections, decided by the query width (KV-head replication on a mesh must not
        # change it); by the config's head_dim, so every layer's projections share it (`layers.in_out_names`).
        out_in = stored_out_in(cfg.d_model, N * cfg.head_dim, jnp.dtype(cfg.dtype))
        q = _project(self, "wq", x, N, out_in)  # [B, T, N, H]
        # Qwen3-Next's gated attention: the heads' outputs times sigmoid of a second query-sized projection
        gate = _project(self, "wq_gate", x, N, out_in) if cfg.attn_output_gate else None
        if cfg.qk_norm:  # Gemma 3, Qwen3: each head's query and key normalized before the rotation
            q = Norm(cfg, dim=H, name="q_norm")(q)
        if rope is not None:
            q = apply_rope(q, *rope)
            if cfg.qk_l2_norm:  # Llama 4: a weightless RMS norm after the rotation, rotary layers only
                q = Norm(cfg, dim=H, with_scale=False, name="q_l2_norm")(q)
        if query_scale is not None:  # Llama 4's NoPE layers: attention temperature tuning
            q = (q * query_scale[:, :, None, None]).astype(q.dtype)
        fresh = _keys_values(self, x, rope, out_in) if cfg.kv_source(self.layer) == self.layer else None
        k, v = shared if fresh is None else fresh  # [B, K, T, H]
        # gpt-oss's attention sinks; zeros at init (a zero logit still takes its share of every softmax)
        sinks = (self.param("sinks", nn.initializers.zeros, (N,), jnp.dtype(cfg.dtype))
                 if cfg.attention_sinks else None)
        if isinstance(cache, PagedKVCache):
            out, cache = self._paged(q, k, v, cache, start, prefill, attention, chunk, sinks)
        else:
            out, cache = self._contiguous(q, k, v, cache, start, prefill, attention, sinks)
        if gate is not None:
            out = out.astype(gate.dtype) * nn.sigmoid(gate)
        return _output(self, out, out_in), cache, fresh

    def _kwargs(self, sinks) -> dict:
        cfg = self.config
        kwargs = dict(scale=cfg.attention_scale, sliding_window=cfg.layer_window(self.layer),
                      softcap=cfg.attn_logit_softcap)
        if cfg.layer_chunk(self.layer) is not None:  # only then, as sinks: the call is otherwise as it was
            kwargs["chunk"] = cfg.layer_chunk(self.layer)
        if sinks is not None:  # only then, so a call without sinks is the very call it was before them
            kwargs["sinks"] = sinks.astype(jnp.float32)
        return kwargs

    def _contiguous(self, q, k, v, cache, start, prefill, attention: str, sinks=None):
        """Writes k, v [B, K, T, H] to a `KVCache` and attends over it (prefill: over k, v themselves, the cache
        only stores them; no cache: causally over k, v) -> ([B, T, N, H], cache)."""
        layer, source = self.layer, self.config.kv_source(self.layer)
        attend = api.get("contiguous", attention, mesh=self.mesh)
        kwargs = dict(self._kwargs(sinks), k_scale=None, v_scale=None, ring=False)
        q_offset = jnp.zeros((), jnp.int32) if cache is None else cache.length
        if cache is not None and prefill and source == layer:
            # An empty cache: the prompt attends over its own fresh (unquantized) K/V, O(T^2), whatever the
            # cache's size, dtype or ring layout; the cache only stores them. (Its dead slots hold zeros from
            # the allocation or finite padding K/V: nothing to zero.)
            cache = cache.write_prompt(layer, k, v)
        elif cache is not None and not prefill:
            if source == layer:
                # The XLA path needs dead value slots finite (0 x NaN is NaN): zeroed by the write, unless the
                # attention masks them itself (its live-prefix switch does) or a kernel serves the call.
                (k_scale, v_scale), ring = cache.scales(layer), cache.layer_ring(layer)
                zero = (not masks_dead_values(cache.layer_capacity(layer), k.shape[2])
                        and attend.serving(q, cache.keys[layer], cache.values[layer], start, q_offset,
                                           **dict(kwargs, k_scale=k_scale, v_scale=v_scale, ring=ring)) == "xla")
                cache = cache.write(layer, k, v, zero_dead_values=zero)
            # This layer's buffer, or its source layer's, already updated for these tokens.
            k, v = cache.keys[source], cache.values[source]
            (k_scale, v_scale), ring = cache.scales(source), cache.layer_ring(source)
            kwargs.update(k_scale=k_scale, v_scale=v_scale, ring=ring)
        return attend(q, k, v, start, q_offset, **kwargs), cache  # [B, T, N, H]

    def _paged(self, q, k, v, cache, valid, prefill, attention: str, chunk: bool = False, sinks=None):
        """Writes k, v [B, K, T, H] (the `valid` tokens) through the page table and attends -> ([B, T, N, H], cache).

        Prefill (an empty cache, right-padded prompts): the prompt attends over its own fresh K/V, causally, as
        for the contiguous cache; padding comes after every real token, so no real token sees it. A prompt chunk
        (`chunk`, XLA whatever `attention` says): the queries attend over their rows' pages before the chunk, as
        stored, and over the chunk's fresh K/V, causally (`paged_reference`'s `fresh`), so a prompt prefilled in
        one chunk reads nothing quantized, as in prefill. Otherwise (decode) the queries attend over their rows'
        pages, their own K/V included, as stored. A layer that shares another's K/V (`Config.kv_source`) writes
        nothing: in prefill k, v are its source's fresh K/V; otherwise it reads the source layer's pools, which
        that layer (an earlier one) has already written for these tokens."""
        source = self.config.kv_source(self.layer)
        kwargs = self._kwargs(sinks)
        if source == self.layer:
            cache = cache.write(self.layer, k, v, valid)
        if prefill:  # the contiguous kind over the fresh K/V: every row starts at slot 0
            zero = jnp.zeros((q.shape[0],), jnp.int32)
            return api.get("contiguous", attention)(q, k, v, zero, jnp.zeros((), jnp.int32), **kwargs), cache
        if chunk:  # no kernel reads a chunk's fresh K/V: plain XLA, as `Decoder` documents
            attend, kwargs = api.get("paged", "xla"), dict(kwargs, fresh=(k, v, valid))
        else:
            attend = api.get("paged", attention, mesh=self.mesh)
        lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)  # this chunk's own slots included
        k_scale, v_scale = cache.scales(source)
        out = attend(q, cache.keys[source], cache.values[source], cache.page_table, lengths,
                     cache.positions(q.shape[1]), k_scale=k_scale, v_scale=v_scale, **kwargs)
        return out, cache


def _project(module: Attention, name: str, x, heads: int, out_in: bool):
    """x [B, T, D] -> [B, T, heads, H]: the q, k or v projection `name` of `module`'s layer, with its bias."""
    cfg = module.config
    D, H, dtype = cfg.d_model, cfg.layer_head_dim(module.layer), jnp.dtype(cfg.dtype)
    if out_in:
        w = quantized.merged(module.param(name, fan_in_init(D), (heads, H, D), dtype), (heads * H, D))
    else:
        w = quantized.merged(module.param(name, fan_in_init(D), (D, heads, H), dtype), (D, heads * H))
    y = linear(x, w, out_in).reshape(*x.shape[:2], heads, H)
    if cfg.qkv_bias:
        y = y + module.param(name + "_bias", nn.initializers.zeros, (heads, H), dtype)
    return y


def _keys_values(module: Attention, x, rope, out_in: bool):
    """x [B, T, D] -> this layer's fresh (k, v) [B, K, T, H]: projected, normalized and rotated, in the cache
    layout."""
    cfg, layer = module.config, module.layer
    K, H = cfg.layer_kv_heads(layer), cfg.layer_head_dim(layer)
    k = _project(module, "wk", x, K, out_in)  # [B, T, K, H]
    # Gemma 4's global layers: the values are the key projection's output, before its norm and rotation
    v = k if cfg.layer_values_from_keys(layer) else _project(module, "wv", x, K, out_in)
    if cfg.qk_norm:
        k = Norm(cfg, dim=H, name="k_norm")(k)
    if cfg.value_norm:  # Gemma 4: an RMS norm without a weight over each value head
        v = Norm(cfg, dim=H, with_scale=False, name="v_norm")(v)
    if rope is not None:
        k = apply_rope(k, *rope)
        if cfg.qk_l2_norm:
            k = Norm(cfg, dim=H, with_scale=False, name="k_l2_norm")(k)
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _output(module: Attention, out, out_in: bool):
    """The heads' outputs [B, T, N, H] -> [B, T, D] through wo (and its bias)."""
    cfg = module.config
    D, N, H, dtype = cfg.d_model, cfg.n_heads, cfg.layer_head_dim(module.layer), jnp.dtype(cfg.dtype)
    if out_in:
        wo = quantized.merged(module.param("wo", fan_in_init(N * H), (D, N, H), dtype), (D, N * H))
    else:
        wo = quantized.merged(module.param("wo", fan_in_init(N * H), (N, H, D), dtype), (N * H, D))
    y = linear(out.reshape(*out.shape[:2], N * H), wo, out_in)  # [B, T, D]
    if cfg.out_bias:
        y = y + module.param("wo_bias", nn.initializers.zeros, (D,), dtype)
    return y
