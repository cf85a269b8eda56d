"""Scoring text through the KV cache: what a cache dtype (or any cache change) costs in accuracy.

`cached_nll` runs the way generation does (prefill a prefix, then one decode step per token through the cache),
but feeds the true next token instead of a sampled one (teacher forcing), so every token's log-likelihood comes
from logits computed over a cache in the chosen dtype. `jaxkv.logits` is the no-cache float reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import attention as attention_impls
from jaxkv.cache import check_cache_dtype
from jaxkv.config import Config
from jaxkv.generate import _forward, prefill
from jaxkv.model import Model

CAPACITY_ROUNDING = 64  # capacities are rounded up to a multiple of this (never past max positions): fewer shapes


@functools.partial(jax.jit, static_argnames=("config", "attention"))
def _teacher_forced_nll(params, logits, cache, targets, *, config: Config, attention: str):
    """logits [B, V] predict targets[:, 0]; each later target is predicted after feeding the one before it."""

    def body(carry, target_and_next):
        logits, cache = carry
        target, feed = target_and_next
        nll = -jax.nn.log_softmax(logits, axis=-1)[jnp.arange(target.shape[0]), target]
        logits, cache = _forward(params, feed[:, None], cache, config=config, attention=attention)
        return (logits[:, 0], cache), nll

    # Target i is scored from the current logits, then fed so the next logits predict target i + 1.
    _, nll = lax.scan(body, (logits, cache), (targets.T, targets.T))
    return nll.T  # [B, N]


def cached_nll(model: Model, tokens, *, prefix: int = 1, cache_dtype: str | None = None,
               attention: str | None = None) -> np.ndarray:
    """float32[B, N - prefix]: -log p(token t | tokens < t) for t = prefix .. N-1, through the KV cache.

    Args:
      tokens: int[B, N] (or one list of ids), all rows the same length.
      prefix: tokens prefilled before scoring starts (>= 1).
      cache_dtype: the cache dtype to measure ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn").
    """
    cfg = model.config
    arr = np.asarray(tokens, np.int32)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or not 1 <= prefix < arr.shape[1]:
        raise ValueError(f"tokens must be [batch, N] with 1 <= prefix < N, got shape {arr.shape}, prefix {prefix}")
    if ((arr < 0) | (arr >= cfg.vocab_size)).any():
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    if arr.shape[1] > cfg.max_positions:
        raise ValueError(f"{arr.shape[1]} tokens exceed the model's max positions ({cfg.max_positions})")
    cache_dtype = check_cache_dtype(cfg.dtype if cache_dtype is None else cache_dtype)
    attention = attention_impls.resolve(attention or cfg.attention)
    capacity = min(-(-arr.shape[1] // CAPACITY_ROUNDING) * CAPACITY_ROUNDING, cfg.max_positions)
    ring = cfg.sliding_window is not None and capacity > cfg.sliding_window
    if ring:
        capacity = cfg.sliding_window
    B = arr.shape[0]
    logits, cache = prefill(model.params, jnp.asarray(arr[:, :prefix]), jnp.zeros((B,), jnp.int32), config=cfg,
                            capacity=capacity, attention=attention, cache_dtype=cache_dtype, ring=ring)
    nll = _teacher_forced_nll(model.params, logits, cache, jnp.asarray(arr[:, prefix:]), config=cfg,
                              attention=attention)
    return np.asarray(nll)
