"""The device side of constrained decoding: a packed token bitmask applied to logits inside the compiled step.

The host fills int32[B, W] words, W = ceil(V / 32), as llguidance writes them: token i is bit i % 32 (least
significant first) of word i // 32. Unpacking is a shift and an AND per token; a disallowed token's logit becomes
-inf, so sampling and beam scores see only what the constraint allows (the reported log-probabilities are the
model's, read before the mask: `jaxkv.decoding.step`). A row whose
words are all ones (-1) is unchanged: rows without a constraint in a constrained batch.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def words(vocab_size: int) -> int:
    """W, the int32 words of one row's mask."""
    return (vocab_size + 31) // 32


def unpack(bits, vocab_size: int):
    """int32[..., W] packed mask -> bool[..., V], token i allowed where bit i % 32 of word i // 32 is set."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    # A logical shift, so word bit 31 (the sign) reads as 0/1 like the others.
    flat = lax.shift_right_logical(bits[..., :, None], jnp.broadcast_to(shifts, bits.shape + (32,))) & 1  # [..., W, 32]
    return (flat.reshape(bits.shape[:-1] + (bits.shape[-1] * 32,)) != 0)[..., :vocab_size]


def apply(logits, bits):
    """float[..., V] logits with the tokens that int32[..., W] `bits` disallow set to -inf."""
    allowed = unpack(bits, logits.shape[-1])
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
