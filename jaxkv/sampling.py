"""Sampling: pure, jittable functions `(logits, key) -> token ids`.

Filters map float logits [B, V] to logits with the removed tokens set to -inf, so they compose:

    def my_sampler(logits, key):
        logits = top_p_filter(top_k_filter(logits / 0.8, 40), 0.95)
        return jax.random.categorical(key, logits)

`Sampler` composes temperature, top-k, top-p and min-p (in that order, as transformers does) with its parameters as
pytree leaves, so inside jit they are traced values: changing them never recompiles.

Ties are broken deterministically everywhere: among equal logits the lower token id ranks first.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax


def greedy(logits, key=None):
    """int32[B]: the highest-scoring token (the lowest id among ties). `key` is accepted and ignored."""
    del key
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _descending(logits):
    """(order, sorted logits): token ids by decreasing logit, ties by increasing id."""
    order = jnp.argsort(-logits, axis=-1, stable=True)  # [B, V]
    return order, jnp.take_along_axis(logits, order, axis=-1)


def _unsort(keep_sorted, order):
    """Scatters a mask over sorted positions back to token ids."""
    rows = jnp.arange(order.shape[0])[:, None]
    return jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)


def _rows(value, logits):
    """A setting (scalar, or one value per row [B]) as a [B, 1] column that broadcasts against [B, V] logits."""
    return jnp.broadcast_to(jnp.asarray(value), logits.shape[:1])[:, None]


def _top_k_keep(sorted_logits, k):
    V = sorted_logits.shape[-1]
    k = _rows(k, sorted_logits)
    k = jnp.where(k <= 0, V, k)  # 0 (or less) disables the filter
    return jnp.arange(V)[None, :] < k  # [B, V]


def _top_p_keep(sorted_logits, p):
    p = _rows(p, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep a token while the mass of the better-ranked tokens is still short of p: the smallest prefix whose mass
    # reaches p. The top token is always kept (mass_before == 0 < p for p > 0); p >= 1 keeps everything.
    return (mass_before < p) | (p >= 1.0)


def top_k_filter(logits, k):
    """Keeps exactly the k best tokens (ties broken by id, so never more than k); k <= 0 keeps all.
    k: a scalar or one value per row ([B]), as for every filter here."""
    order, sorted_logits = _descending(logits)
    keep = _unsort(_top_k_keep(sorted_logits, k), order)
    return jnp.where(keep, logits, -jnp.inf)


def top_p_filter(logits, p):
    """Nucleus: keeps the smallest set of best tokens whose probability mass reaches p (0 < p <= 1)."""
    order, sorted_logits = _descending(logits)
    keep = _unsort(_top_p_keep(sorted_logits, p), order)
    return jnp.where(keep, logits, -jnp.inf)


def min_p_filter(logits, min_p):
    """Keeps tokens whose probability is at least min_p times the top token's; min_p = 0 keeps all."""
    # p_i >= m * p_max  <=>  logit_i >= logit_max + log(m); log(0) = -inf keeps everything.
    threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(_rows(min_p, logits).astype(jnp.float32))
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _categorical(key, x):
    """int32[B] draws from logits x [B, V]: with one key, `jax.random.categorical`; with a key per row, each row
    drawn as a batch of one with its own key."""
    if key.ndim == 2 and key.shape[0] == x.shape[0] and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        draw = jax.vmap(lambda k, row: jax.random.categorical(k, row[None], axis=-1)[0])
        return draw(key, x).astype(jnp.int32)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


def token_logprobs(logits, tokens, k: int = 0):
    """Log-probabilities under the model's own distribution (temperature 1, no filters) of float[B, V] logits.

    Returns (float32[B] log p(tokens[b]), int32[B, k] ids and float32[B, k] log-probabilities of the k most likely
    tokens, best first, ties by lower id). A token outside [0, V) gets NaN.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    V = logp.shape[-1]
    ok = (tokens >= 0) & (tokens < V)
    chosen = jnp.take_along_axis(logp, jnp.clip(tokens, 0, V - 1)[:, None], axis=-1)[:, 0]
    chosen = jnp.where(ok, chosen, jnp.nan)
    if k == 0:
        return chosen, jnp.zeros(tokens.shape + (0,), jnp.int32), jnp.zeros(tokens.shape + (0,), jnp.float32)
    top_logp, top_ids = lax.top_k(logp, k)
    return chosen, top_ids.astype(jnp.int32), top_logp


@flax.struct.dataclass
class Sampler:
    """temperature -> top-k -> top-p -> min-p -> categorical; temperature 0 is greedy.

    Each field is a scalar (every row) or one value per row ([B]): a batch can mix greedy rows and rows sampled
    with different settings in one compiled step. Fields are pytree leaves (traced inside jit: changing them
    never recompiles). Disabled values: top_k 0, top_p 1.0, min_p 0.0.
    """

    temperature: jax.Array | float = 0.0
    top_k: jax.Array | int = 0
    top_p: jax.Array | float = 1.0
    min_p: jax.Array | float = 0.0

    @classmethod
    def make(cls, temperature=0.0, top_k=None, top_p=None, min_p=None) -> "Sampler":
        """From generate-style arguments (None = disabled), as arrays so values never become static. Each may be a
        scalar or a sequence with one value per row (a None entry disables that row's filter)."""

        def arr(value, disabled, dtype):
            if value is None:
                return jnp.asarray(disabled, dtype)
            if isinstance(value, (list, tuple)):
                value = [disabled if v is None else v for v in value]
            return jnp.asarray(value, dtype)

        return cls(temperature=arr(temperature, 0.0, jnp.float32), top_k=arr(top_k, 0, jnp.int32),
                   top_p=arr(top_p, 1.0, jnp.float32), min_p=arr(min_p, 0.0, jnp.float32))

    def __call__(self, logits, key):
        """int32[B] tokens from float[B, V] logits. `key`: one PRNG key for the batch, or one per row ([B, 2]
        raw keys): then row b draws exactly what a batch of that row alone would draw with key[b], whatever
        shares the batch (what the engine's per-request seeds rely on)."""
        logits = logits.astype(jnp.float32)
        temperature = _rows(self.temperature, logits)  # [B, 1]
        greedy_tokens = greedy(logits)

        def sample(_):
            sampled = _categorical(key, self.filtered(logits))
            return jnp.where(temperature[:, 0] <= 0.0, greedy_tokens, sampled)

        # An all-greedy batch skips the sampling work entirely.
        return lax.cond(jnp.all(temperature <= 0.0), lambda _: greedy_tokens, sample, None)

    def filtered(self, logits):
        """float32[B, V]: the logits a sampled row draws from (temperature, then top-k, top-p, min-p; removed
        tokens -inf). A greedy row's (temperature 0) come out scaled by 1e6 and are not what it uses."""
        logits = logits.astype(jnp.float32)
        x = logits / jnp.maximum(_rows(self.temperature, logits), 1e-6)
        # Sorting the vocabulary is the expensive part: skip it unless some row has top-k or top-p on.
        needs_sort = jnp.any(jnp.asarray(self.top_k) > 0) | jnp.any(jnp.asarray(self.top_p) < 1.0)
        x = lax.cond(needs_sort, self._sorted_filters, lambda x: x, x)
        return min_p_filter(x, self.min_p)

    def distribution(self, logits):
        """float32[B, V]: the probabilities `__call__` draws each row's token from: softmax of `filtered` for a
        sampled row, one-hot at `greedy` for a greedy row (what speculative sampling compares proposals with)."""
        logits = logits.astype(jnp.float32)
        greedy_rows = _rows(self.temperature, logits) <= 0.0  # [B, 1]
        one_hot = jax.nn.one_hot(greedy(logits), logits.shape[-1], dtype=jnp.float32)

        def sampled(_):
            return jnp.where(greedy_rows, one_hot, jax.nn.softmax(self.filtered(logits), axis=-1))

        return lax.cond(jnp.all(greedy_rows), lambda _: one_hot, sampled, None)

    def _sorted_filters(self, x):
        """top-k then top-p (over the renormalized top-k survivors) with a single sort."""
        order, sorted_x = _descending(x)
        keep = _top_k_keep(sorted_x, self.top_k)
        sorted_x = jnp.where(keep, sorted_x, -jnp.inf)
        keep &= _top_p_keep(sorted_x, self.top_p)
        return jnp.where(_unsort(keep, order), x, -jnp.inf)
