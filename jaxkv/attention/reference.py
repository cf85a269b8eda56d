"""Attention in plain jax.numpy: the specification every kernel is tested against.

Computes in float32 whatever the input dtype. Masking uses `jnp.where` with a large finite negative, never an
additive -inf: a row with no live key then gets a uniform (finite) distribution instead of NaN, and a NaN or
garbage value in a masked slot cannot leak into a live row (values of dead slots are zeroed too, because
0 * NaN is NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # large finite negative: exp(MASKED - max) underflows to exactly 0 for any live max


def attention(q, k, v, live, *, scale: float):
    """Softmax attention of queries over cached keys and values.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, K, S, H] keys and values, K dividing N; query head n reads KV head n // (N // K).
      live: bool[B, T, S], which slots each query may attend to.
      scale: multiplies q.k (1 / sqrt(H) for standard attention).

    Returns:
      [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(live[:, None, None, :, :], scores, MASKED)  # [B, K, G, T, S]
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    # Slots that no query may see (padding, not yet written) may hold anything; zero them so 0 * NaN cannot occur.
    any_live = jnp.any(live, axis=1)  # [B, S]
    v = jnp.where(any_live[:, None, :, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("bkgts,bksh->btkgh", weights, v.astype(jnp.float32))  # [B, T, K, G, H]
    return out.reshape(B, T, N, H).astype(q.dtype)
