"""The compiled forward programs every decoding path runs: a forward pass through the cache, the contiguous and
paged prefills, one decode step. The entry points (`jaxkv.generate`, `beam_search`, `score`, the engine) check
their arguments first (`jaxkv.decoding.request`); these assume checked, static-shaped inputs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import sharding
from jaxkv.cache.contiguous import KVCache
from jaxkv.cache.paged import PagedKVCache
from jaxkv.model import Decoder


def apply(params, tokens, positions, cache, *, config, mesh=None, step_states=False, **kwargs) -> tuple:
    """`Decoder(config, mesh).apply` -> its outputs as a tuple; with `step_states` (a hybrid model's verify) a
    last one: {linear layer: (conv [B, T, U, Y - 1], float32 [B, T, Hv, Dk, Dv])}, the states after each token
    (for `LayerStates.keep_step_states`)."""
    decoder = Decoder(config, mesh)
    if not step_states:
        return tuple(decoder.apply({"params": params}, tokens, positions, cache, **kwargs))
    out, sown = decoder.apply({"params": params}, tokens, positions, cache, step_states=True,
                              mutable=["intermediates"], **kwargs)
    sown = sown["intermediates"]
    return tuple(out) + ({layer: sown[f"layer_{layer}"]["linear_attn"]["step_states"][0]
                          for layer in config.linear_layers},)


def forward(params, tokens, cache, *, config, attention, prefill=False, last_only=False, mesh=None, active=None,
            return_hidden=False, step_states=False):
    """tokens int32[B, T] into the cache -> (float32[B, T or 1, V], cache), and with `return_hidden` the hidden
    states [B, T, D] the head read (`Decoder`), with `step_states` a hybrid model's states after each token
    (`apply`). With a mesh, the cache keeps its (data, model) sharding (a constraint on the way out, so SPMD
    propagation cannot choose to gather it). `active` (bool[B], paged caches): rows that store their tokens; the
    others are padding, so a finished sequence takes no more pages."""
    positions = cache.positions(tokens.shape[1])
    if active is not None:
        positions = jnp.where(active[:, None], positions, -1)
    out = apply(params, tokens, positions, cache, config=config, mesh=mesh, step_states=step_states,
                prefill=prefill, last_only=last_only, attention=attention, return_hidden=return_hidden)
    return (out[0], sharding.constrain_cache(out[1], mesh)) + tuple(out[2:])


@functools.partial(jax.jit, static_argnames=("config", "capacity", "attention", "cache_dtype", "ring", "mesh",
                                             "lookahead"))
def prefill(params, tokens, start, *, config, capacity, attention, cache_dtype, ring, mesh, lookahead=0):
    """Left-padded prompts (tokens int32[B, T], start int32[B]) into a fresh contiguous cache of `capacity`
    slots (`lookahead`: a speculative verify's k, the slots a ring holds beyond its window) -> (float32[B, V]
    the last token's logits, the cache)."""
    cache = sharding.constrain_cache(KVCache.allocate(config, tokens.shape[0], capacity, dtype=cache_dtype,
                                                      start=start, ring=ring, lookahead=lookahead), mesh)
    logits, cache = forward(params, tokens, cache, config=config, attention=attention, prefill=True,
                            last_only=True, mesh=mesh)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("config", "capacity", "attention", "cache_dtype", "mtp_config", "ring",
                                             "lookahead"))
def prefill_mtp(params, mtp_params, tokens, start, *, config, capacity, attention, cache_dtype, mtp_config,
                ring=False, lookahead=0):
    """`prefill`, and the MTP module's own cache (`jaxkv.decoding.mtp`) filled with the prompts' pairs (h_t,
    token_{t+1}) for every position but the last -> (float32[B, V] the last token's logits, the cache, the MTP
    cache, [B, D] the last position's hidden state: the pair (h_{T-1}, first new token) is fed once that token is
    drawn, so the MTP cache runs one position behind the main cache's)."""
    from jaxkv.decoding.mtp import mtp_forward

    cache = KVCache.allocate(config, tokens.shape[0], capacity, dtype=cache_dtype, start=start, ring=ring,
                             lookahead=lookahead)
    logits, cache, hidden = forward(params, tokens, cache, config=config, attention=attention, prefill=True,
                                    last_only=True, return_hidden=True)
    mtp = KVCache.allocate(mtp_config, tokens.shape[0], capacity, dtype=cache_dtype, start=start, ring=ring,
                           lookahead=lookahead)
    T = tokens.shape[1]
    following = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # the last pair's token: a placeholder
    _, _, mtp = mtp_forward(mtp_params, params, hidden, following, mtp.positions(T), mtp, config=mtp_config,
                            attention=attention, prefill=True)
    return logits[:, 0], cache, dataclasses.replace(mtp, length=mtp.length - 1), hidden[:, -1]


@functools.partial(jax.jit, static_argnames=("config", "attention", "num_pages", "page_size", "max_pages",
                                             "cache_dtype", "mtp_config"))
def prefill_mtp_paged(params, mtp_params, tokens, positions, parents, *, config, attention, num_pages, page_size,
                      max_pages, cache_dtype, mtp_config):
    """The MTP module's own paged pool (one layer, `Mtp.config`) for the paged speculative loop:
    the whole right-padded prompts (tokens, positions int32[B, T], -1 after each; never only a prefix-cache
    miss's suffix: the module's K/V is never read from cached pages) run through the target into a throwaway
    pool for their hidden states, the module prefilled from slot 0 with every pair (h_t, token_{t+1}) but the
    last, then the rows forked by `parents` as the target's -> (the module's pool, [R, D] the last prompt
    position's hidden state of each row: the pending pair, fed once the first new token is drawn, so the module
    runs one position behind the target)."""
    from jaxkv.decoding.mtp import mtp_forward

    B, T = tokens.shape
    scratch = PagedKVCache.allocate(config, B, num_pages=B * -(-T // page_size), page_size=page_size, max_len=T,
                                    dtype=cache_dtype)
    _, _, hidden = Decoder(config).apply({"params": params}, tokens, positions, scratch, prefill=True,
                                         last_only=True, attention=attention, return_hidden=True)
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)  # [B]
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    pairs = jnp.where(positions < last[:, None], positions, -1)  # the last prompt position's pair is pending
    mtp = PagedKVCache.allocate(mtp_config, B, num_pages=num_pages, page_size=page_size,
                                max_len=max_pages * page_size, dtype=cache_dtype)
    _, _, mtp = mtp_forward(mtp_params, params, hidden, following, pairs, mtp, config=mtp_config,
                            attention=attention, prefill=True)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return mtp.fork(parents), h_last[jnp.maximum(parents, 0)]


@functools.partial(jax.jit, static_argnames=("config", "attention", "mesh"), donate_argnames=("cache",))
def decode_step(params, tokens, cache: KVCache, *, config, attention, mesh):
    """tokens int32[B] at slot `cache.length` -> (float32[B, V] logits, the cache, donated)."""
    logits, cache = forward(params, tokens[:, None], cache, config=config, attention=attention, mesh=mesh)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("config", "attention", "num_pages", "page_size", "max_pages",
                                             "cache_dtype", "mesh"))
def prefill_paged(params, tokens, positions, parents, *, config, attention, num_pages, page_size, max_pages,
                  cache_dtype, mesh=None):
    """Prefills right-padded prompts (positions -1 after each) into a fresh pool, then forks the rows that decode
    from them: row r continues prompt parents[r] (-1: an empty filler row) -> (float32[R, V] logits, cache). With
    a mesh the pools are split over KV heads (`sharding.paged_cache_shardings`)."""
    cache = PagedKVCache.allocate(config, tokens.shape[0], num_pages=num_pages, page_size=page_size,
                                  max_len=max_pages * page_size, dtype=cache_dtype)
    cache = sharding.constrain_cache(cache, mesh)
    logits, cache = Decoder(config, mesh).apply({"params": params}, tokens, positions, cache, prefill=True,
                                                last_only=True, attention=attention)
    return logits[jnp.maximum(parents, 0), 0], sharding.constrain_cache(cache.fork(parents), mesh)


@functools.partial(jax.jit, static_argnames=("config", "attention"))
def prefill_chunk(params, tokens, positions, cache, *, config, attention):
    """One right-padded prompt chunk per row (positions -1 after each, or all -1: the row takes no part) continuing
    the rows of a paged cache (`Decoder`'s `chunk`) -> (float32[B, V] each row's last real token's logits, the
    cache). A hybrid model's prefix-cache prefill runs its prompts as a series of these, so that a chunk ends at
    every state-snapshot boundary (`jaxkv.cache.prefix`)."""
    logits, cache = Decoder(config).apply({"params": params}, tokens, positions, cache, last_only=True,
                                          attention=attention, chunk=True)
    return logits[:, 0], cache


@jax.jit
def fork(cache: PagedKVCache, parents):
    """`cache.fork(parents)`, compiled."""
    return cache.fork(parents)


@functools.partial(jax.jit, static_argnames=("config", "attention", "mesh"))
def prefill_suffix(params, tokens, positions, cache, parents, *, config, attention, mesh=None):
    """Prefills right-padded prompt suffixes (positions -1 after each) into a cache whose rows already hold their
    cached prefixes, attending over those pages (as stored) and over their own fresh K/V (`Decoder`'s `chunk`)
    -> (float32[R, V] logits of the rows forked by `parents`, the prefilled page table, the forked cache)."""
    cache = sharding.constrain_cache(cache, mesh)
    logits, cache = Decoder(config, mesh).apply({"params": params}, tokens, positions, cache, last_only=True,
                                                attention=attention, chunk=True)
    return logits[jnp.maximum(parents, 0), 0], cache.page_table, sharding.constrain_cache(cache.fork(parents), mesh)
