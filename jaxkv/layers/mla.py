"""Multi-head latent attention (DeepSeek-V2/V3) as a decoder layer's attention: projections, latent cache, both forms.

Letters as in `jaxkv.shapes` (R = kv_lora_rank, E = qk_rope_head_dim); nope = qk_nope_head_dim, dv = v_head_dim.
Per token the layer computes the latent row [c ; k_rope] (c = norm(x W_kva[:R]), k_rope = rope(x W_kva[R:]), one
for all heads) and caches only that: the `KVCache` of an MLA config has one "KV head" of width R + E and no values
(`jaxkv.cache.zeroed_buffers`). Head n's key and value would be [c W_kb[n]^T ; k_rope] and c W_vb[n]^T.

Two forms, equal up to float rounding:

  expanded  (no cache, prefill): the fresh rows are up-projected to per-head keys and values and attended over
            causally, O(T^2) over the prompt as the other families' prefill; the cache only stores the rows.
  absorbed  (decode over the cache): W_kb is folded into the query (q_lat[n] = W_kb[n]^T q_nope[n]), the attention
            runs over the cached rows themselves (`jaxkv.attention.mla_reference`), and W_vb is applied to its
            latent-space output. A step reads R + E numbers per cached token and forms nothing per head of cache length.

Parameters (the [out, in] form; `jaxkv.layers.linear.ALL_OUT_IN_ORDER` gives the stored layout of the first four):
  wq [N, nope+E, D]  or  wq_a [q_rank, D], q_norm/scale [q_rank], wq_b [N, nope+E, q_rank]   (q_lora_rank set)
  wkv_a [R+E, D], kv_norm/scale [R], wk_b [N, nope, R], wv_b [N, dv, R], wo [D, N, dv]
  with config.qkv_bias: wq_a_bias [q_rank], wkv_a_bias [R+E]; with config.out_bias: wo_bias [D].
The rotary columns (the last E of each head's query, the last E of wkv_a) use the halves convention
(`layers.apply_rope`); checkpoints with DeepSeek's interleaved pairs are permuted on load (`checkpoint_hf`).

DeepSeek-V3.2 (`Mla.indexer`): the layer's `Indexer` (`jaxkv.layers.indexer`, params under attn/indexer) scores the
cached slots and each query attends to its top-k only (`jaxkv.attention.indexer`): its keys are written as the
cache's values ([B, 1, T, Di]); decode gathers each query's k rows (`mla_reference.sparse_attention`,
`paged_mla.sparse_paged_mla_attention`), prefill and a prompt chunk mask the rest; with no more than k slots in
the cache every live slot is read and nothing is scored.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxkv.attention import api, indexer, mla_reference, paged_mla
from jaxkv.attention.paged_reference import before_chunk, fresh_mask, gather_pages
from jaxkv.attention.paged_reference import live_mask as paged_live_mask
from jaxkv.attention.reference import MASKED, Unsupported, softmax, live_mask
from jaxkv.cache.paged import PagedKVCache
from jaxkv.config import Config
from jaxkv.layers.indexer import Indexer
from jaxkv.layers import quantized
from jaxkv.layers.linear import fan_in_init, linear, mla_out_in
from jaxkv.layers.norms import Norm
from jaxkv.layers.rope import apply_rope


def expanded_attention(q_nope, q_rope, c, k_rope, wk_b, wv_b, start, q_offset, *, scale: float,
                       sliding_window: int | None = None, keep=None):
    """Attention with per-head keys and values up-projected from latent rows: the plain MLA formula.

    Args:
      q_nope: [B, T, N, nope], q_rope: [B, T, N, E] (rotated) queries for slots [q_offset, q_offset + T).
      c: [B, S, R] normalized latents, k_rope: [B, S, E] rotated shared keys of slots [0, S).
      wk_b: [N, nope, R], wv_b: [N, dv, R] the up-projections.
      start: int32[B] first live slot; q_offset: int32[].
      keep: None, or bool[B, T, S]: the slots each query may read at most (DeepSeek-V3.2's top-k selection).

    Returns:
      [B, T, N, dv] in q_nope's dtype.
    """
    dtype = q_nope.dtype
    f32 = jnp.float32
    k_nope = jnp.einsum("bsr,nkr->bsnk", c, wk_b, preferred_element_type=f32).astype(dtype)  # [B, S, N, nope]
    v = jnp.einsum("bsr,nvr->bsnv", c, wv_b, preferred_element_type=f32).astype(dtype)  # [B, S, N, dv]
    scores = (jnp.einsum("btnk,bsnk->bnts", q_nope, k_nope, preferred_element_type=f32)
              + jnp.einsum("btne,bse->bnts", q_rope, k_rope, preferred_element_type=f32)) * scale  # [B, N, T, S]
    live = live_mask(start, q_offset, q_nope.shape[1], c.shape[1], sliding_window)  # [B, T, S]
    if keep is not None:
        live &= keep
    weights = softmax(jnp.where(live[:, None], scores, MASKED))
    return jnp.einsum("bnts,bsnv->btnv", weights, v.astype(f32)).astype(dtype)


def absorbed_attention(q_nope, q_rope, rows, wk_b, wv_b, start, q_offset, *, scale: float, latent_scale=None,
                       sliding_window: int | None = None, ring: bool = False, attention: str = "xla",
                       mesh: Mesh | None = None, sparse=None):
    """The same attention over cached latent rows [B, S, R + E] without forming per-head keys or values:
    q_nope, q_rope [B, T, N, nope | E] -> [B, T, N, dv] (see the module docstring). `attention` names the
    latent-attention implementation of a decode step (`jaxkv.attention.api`, kind "latent"); "auto" falls through
    to the XLA reference where the Pallas kernel does not apply (widths the kernel does not take). More than one
    query per sequence is the XLA reference whatever `attention` says: the kernel decodes one. With a `mesh`, a
    Pallas kernel runs per shard (`jaxkv.sharding.shard_latent_attention`): it cannot be partitioned.
    `sparse`: None, or (slots int32[B, T, K], valid bool[B, T, K]): each query reads only those slots
    (DeepSeek-V3.2, `jaxkv.attention.mla_reference.sparse_attention`; plain XLA, "pallas" by name is refused)."""
    dtype = q_nope.dtype
    R = wk_b.shape[-1]
    # 16-bit weights: a 16-bit product, as PyTorch rounds one (XLA:CPU has no unfused batched bf16 x bf16 -> f32 dot).
    q_lat = jnp.einsum("btnk,nkr->btnr", q_nope, wk_b,
                       preferred_element_type=jnp.float32 if dtype == jnp.float32 else None)  # [B, T, N, R]
    q = jnp.concatenate([q_lat, q_rope.astype(jnp.float32)], axis=-1)  # [B, T, N, R + E]
    if sparse is not None:
        _check_sparse(attention)
        out = mla_reference.sparse_attention(q, rows, *sparse, latent_dim=R, scale=scale, latent_scale=latent_scale)
    else:
        kwargs = dict(latent_dim=R, scale=scale, latent_scale=latent_scale, sliding_window=sliding_window, ring=ring)
        attend = api.get("latent", attention if q.shape[1] == 1 else "xla", mesh=mesh)
        out = attend(q, rows, start, q_offset, **kwargs)  # [B, T, N, R] float32
    return jnp.einsum("btnr,nvr->btnv", out.astype(dtype), wv_b, preferred_element_type=jnp.float32).astype(dtype)


def paged_absorbed_attention(q_nope, q_rope, cache: PagedKVCache, layer: int, wk_b, wv_b, valid, *, scale: float,
                             sliding_window: int | None = None, fresh_rows=None, attention: str = "xla",
                             index=None):
    """`absorbed_attention` over a keys-only `PagedKVCache` (after this chunk's rows are written): the queries of
    the `valid` tokens (bool[B, T]) sit in each row's slots [lengths[b], lengths[b] + T). `fresh_rows` [B, T, R + E]:
    a prompt chunk's own latent rows as computed, which it attends over instead of their stored (quantized) copy
    (`paged_mla`'s `fresh`). `attention`: `jaxkv.attention.api`'s kind "paged_latent", whose one implementation
    is plain XLA (`jaxkv.attention.paged_mla`): there is no Pallas paged latent kernel yet. `index`: None, or
    DeepSeek-V3.2's (q [B, T, Hi, Di], weights [B, T, Hi], this chunk's keys [B, T, Di], topk, scale), the first
    three from `Indexer`: a decode step then reads only each query's top-k slots through the page table, a prompt
    chunk masks the rest.
    -> [B, T, N, dv]"""
    dtype = q_nope.dtype
    R = wk_b.shape[-1]
    # 16-bit weights: a 16-bit product, as PyTorch rounds one (XLA:CPU has no unfused batched bf16 x bf16 -> f32 dot).
    q_lat = jnp.einsum("btnk,nkr->btnr", q_nope, wk_b,
                       preferred_element_type=jnp.float32 if dtype == jnp.float32 else None)  # [B, T, N, R]
    q = jnp.concatenate([q_lat, q_rope.astype(jnp.float32)], axis=-1)  # [B, T, N, R + E]
    lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)  # this chunk's own rows included
    q_slots = cache.positions(q.shape[1])
    fresh = None if fresh_rows is None else (fresh_rows, valid)
    latent_scale, key_scale = cache.scales(layer)  # key_scale: the indexer keys' (the values' scales)
    selection = None if index is None else _paged_selection(cache, layer, index, lengths, q_slots, valid, fresh,
                                                              key_scale)
    if selection is None:
        out = api.get("paged_latent", attention)(
            q, cache.keys[layer], cache.page_table, lengths, q_slots, latent_dim=R, scale=scale,
            sliding_window=sliding_window, latent_scale=latent_scale, fresh=fresh)  # [B, T, N, R] float32
    elif fresh is not None:  # a prompt chunk reads every page anyway: the selection is a mask
        out = paged_mla.paged_mla_attention(q, cache.keys[layer], cache.page_table, lengths, q_slots, latent_dim=R,
                                            scale=scale, latent_scale=latent_scale, fresh=fresh, keep=selection)
    else:  # decode (or a verify): each query reads only its own slots
        out = paged_mla.sparse_paged_mla_attention(q, cache.keys[layer], cache.page_table, *selection,
                                                   latent_dim=R, scale=scale, latent_scale=latent_scale)
    return jnp.einsum("btnr,nvr->btnv", out.astype(dtype), wv_b, preferred_element_type=jnp.float32).astype(dtype)


def _check_sparse(attention: str):
    """Sparse (top-k) latent attention is plain XLA: "pallas" by name is refused, never quietly replaced."""
    if attention == "pallas":
        raise Unsupported("attention implementation 'pallas' cannot serve DeepSeek-V3.2's top-k sparse latent "
                          "attention (there is no sparse latent kernel): use 'auto' or 'xla'")


def index_scale(config: Config) -> float:
    """What multiplies an indexer query-key dot before its relu: Di ** -0.5."""
    return config.mla.indexer.head_dim ** -0.5


def contiguous_selection(config: Config, index, keys, key_scale, start, q_offset):
    """(slots, valid) of `jaxkv.attention.indexer.top_slots` for T queries (slots [q_offset, q_offset + T)) over a
    contiguous cache's S slots of indexer keys (keys [B, S, Di], key_scale float32[B, S] or None), or None when
    S <= topk (every live slot is read: the dense path is the same attention)."""
    topk, S = config.mla.indexer.topk, keys.shape[1]
    if S <= topk:
        return None
    q, weights = index
    keys = keys.astype(jnp.float32) if key_scale is None else keys.astype(jnp.float32) * key_scale[..., None]
    live = live_mask(start, q_offset, q.shape[1], S)
    return indexer.top_slots(indexer.scores(q, weights, keys, scale=index_scale(config)), live, topk)


def _paged_selection(cache: PagedKVCache, layer: int, index, lengths, q_slots, valid, fresh, key_scale):
    """A paged step's top-k selection, None when the table holds no more than topk slots (all read): (slots,
    valid) for decode; for a prompt chunk (`fresh`), a keep mask over the pages' slots then the chunk's own."""
    q, weights, own, topk, scale = index
    pages = gather_pages(cache.values[layer], cache.page_table)[:, 0].astype(jnp.float32)  # [B, S, Di]
    if key_scale is not None:
        pages = pages * gather_pages(key_scale, cache.page_table)[:, 0, :, None]
    S = pages.shape[1]
    live = paged_live_mask(lengths, q_slots, S)
    if fresh is not None:  # the pages before the chunk, then the chunk's own keys as computed
        live = before_chunk(live, jnp.arange(S, dtype=jnp.int32)[None, None, :], q_slots)
        pages = jnp.concatenate([pages, own.astype(jnp.float32)], axis=1)
        live = jnp.concatenate([live, fresh_mask(q_slots, valid)], axis=2)
    if live.shape[-1] <= topk:
        return None
    index_scores = indexer.scores(q, weights, pages, scale=scale)
    if fresh is not None:
        return indexer.keep_mask(index_scores, live, topk)
    return indexer.top_slots(index_scores, live, topk)


def paged_attention_name(requested: str, config: Config) -> str:
    """The attention implementation a loop over a `PagedKVCache` passes the model, kept for its callers: it is
    `jaxkv.attention.api.resolve(requested, kind)` of the config's paged kind, so an MLA config gets "xla" for
    "auto" (there is no Pallas paged latent kernel yet) and `Unsupported` (a NotImplementedError) for "pallas" by
    name, before anything is compiled."""
    return api.resolve(requested, api.kind_of(latent=config.mla is not None, paged=True))


class MlaAttention(nn.Module):
    """A decoder layer's attention for a config with `mla`; the interface of `jaxkv.model.Attention`."""

    config: Config
    layer: int
    mesh: Mesh | None = None  # with a mesh, a Pallas kernel runs per shard (`jaxkv.sharding`'s MLA layout)

    @nn.compact
    def __call__(self, x, rope, cache, start, prefill, attention: str, chunk: bool = False):
        """x [B, T, D]; rope: (cos, sin) [B, T, E]; start int32[B] -> ([B, T, D], cache). Slots, masking and
        `chunk` as in `jaxkv.model.Attention`. `attention` picks the decode step's latent attention
        (`absorbed_attention`); the expanded form (prefill, no cache) is plain XLA."""
        cfg, m = self.config, self.config.mla
        D, N, R, E = cfg.d_model, cfg.n_heads, m.kv_lora_rank, m.qk_rope_head_dim
        nope, dv, qk = m.qk_nope_head_dim, m.v_head_dim, m.qk_head_dim
        dtype = jnp.dtype(cfg.dtype)
        out_in = mla_out_in(cfg)
        paged = isinstance(cache, PagedKVCache)
        if paged:  # "pallas" asked for by name is refused even in prefill: never quietly run the XLA path instead
            api.check(attention, "paged_latent")
        dense = functools.partial(_dense, self, out_in)

        q_a = None
        if m.q_lora_rank is None:
            q = dense("wq", x, D, (N, qk))  # [B, T, N, nope + E]
        else:
            q_a = dense("wq_a", x, D, (m.q_lora_rank,), cfg.qkv_bias)
            q_a = Norm(cfg, dim=m.q_lora_rank, eps=m.latent_norm_eps, name="q_norm")(q_a)
            q = dense("wq_b", q_a, m.q_lora_rank, (N, qk))  # [B, T, N, nope + E]
        q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], *rope)
        index = index_keys = None
        if m.indexer is not None:  # DeepSeek-V3.2: its keys are cached as the values, one head of Di
            index_q, index_w, index_k = Indexer(cfg, name="indexer")(x, q_a, rope)
            index, index_keys = (index_q, index_w), index_k[:, None]  # [B, 1, T, Di]
        kv_a = dense("wkv_a", x, D, (R + E,), cfg.qkv_bias)  # [B, T, R + E]
        c = Norm(cfg, dim=R, eps=m.latent_norm_eps, name="kv_norm")(kv_a[..., :R])  # [B, T, R]
        k_rope = apply_rope(kv_a[:, :, None, R:], *rope)[:, :, 0]  # [B, T, E]
        # The up-projections reach the attention implementations (kernels included) as float arrays: a quantized
        # one is dequantized here, once per call (`jaxkv.layers.quantized`).
        wk_b = quantized.dequantized(self.param("wk_b", fan_in_init(R), (N, nope, R), dtype), dtype)
        wv_b = quantized.dequantized(self.param("wv_b", fan_in_init(R), (N, dv, R), dtype), dtype)
        scale = cfg.attention_scale

        if cache is None or prefill:
            if cache is not None:  # an empty cache: attend over the fresh rows, store them
                rows = jnp.concatenate([c, k_rope], axis=-1)[:, None]  # [B, 1, T, R + E]
                if paged:  # right-padded prompts: `start` is bool[B, T], the real tokens (padding not stored)
                    cache = cache.write(self.layer, rows, index_keys, start)
                    start = jnp.zeros((x.shape[0],), jnp.int32)  # every row starts at slot 0; padding comes last
                else:
                    cache = cache.write_prompt(self.layer, rows, index_keys)
            q_offset = jnp.zeros((), jnp.int32)
            keep = None
            T = x.shape[1]
            if index is not None and T > m.indexer.topk:  # a longer prompt than topk: each query its top-k
                live = live_mask(start, q_offset, T, T)
                keep = indexer.keep_mask(indexer.scores(*index, index_keys[:, 0], scale=index_scale(cfg)), live,
                                         m.indexer.topk)
            out = expanded_attention(q_nope, q_rope, c, k_rope, wk_b, wv_b, start, q_offset, scale=scale,
                                     sliding_window=cfg.layer_window(self.layer), keep=keep)
        elif paged:  # decode, or a prompt chunk continuing cached pages (the engine): the queries read their pages
            rows = jnp.concatenate([c, k_rope], axis=-1)  # [B, T, R + E]
            cache = cache.write(self.layer, rows[:, None], index_keys, start)
            if index is not None:
                index = (*index, index_keys[:, 0], m.indexer.topk, index_scale(cfg))
            out = paged_absorbed_attention(q_nope, q_rope, cache, self.layer, wk_b, wv_b, start, scale=scale,
                                           sliding_window=cfg.layer_window(self.layer),
                                           fresh_rows=rows if chunk else None, attention=attention,
                                           index=index)  # [B, T, N, dv]
        else:
            q_offset = cache.length
            cache = cache.write(self.layer, jnp.concatenate([c, k_rope], axis=-1)[:, None], index_keys)
            latent_scale, key_scale = (None if a is None else a[:, 0] for a in cache.scales(self.layer))
            sparse = None if index is None else contiguous_selection(
                cfg, index, cache.values[self.layer][:, 0], key_scale, cache.start, q_offset)
            out = absorbed_attention(q_nope, q_rope, cache.keys[self.layer][:, 0], wk_b, wv_b, cache.start,
                                     q_offset, scale=scale, latent_scale=latent_scale,
                                     sliding_window=cfg.layer_window(self.layer), ring=cache.layer_ring(self.layer),
                                     attention=attention, mesh=self.mesh, sparse=sparse)  # [B, T, N, dv]

        if out_in["wo"]:
            wo = quantized.merged(self.param("wo", fan_in_init(N * dv), (D, N, dv), dtype), (D, N * dv))
        else:
            wo = quantized.merged(self.param("wo", fan_in_init(N * dv), (N, dv, D), dtype), (N * dv, D))
        y = linear(out.reshape(*out.shape[:2], N * dv), wo, out_in["wo"])  # [B, T, D]
        if cfg.out_bias:
            y = y + self.param("wo_bias", nn.initializers.zeros, (D,), dtype)
        return y, cache


def _dense(module: MlaAttention, out_in: dict, name: str, y, d_in: int, out_shape: tuple, bias: bool = False):
    """y [B, T, d_in] -> [B, T, *out_shape] through `module`'s projection `name`, stored as `out_in[name]` says."""
    dtype = jnp.dtype(module.config.dtype)
    shape = (*out_shape, d_in) if out_in[name] else (d_in, *out_shape)
    w = module.param(name, fan_in_init(d_in), shape, dtype)
    w = quantized.merged(w, (-1, d_in) if out_in[name] else (d_in, -1))
    y = linear(y, w, out_in[name]).reshape(*y.shape[:2], *out_shape)
    if bias:
        y = y + module.param(name + "_bias", nn.initializers.zeros, out_shape, dtype)
    return y
