"""The one decode step: what every decoding path does with a row's logits once the model has produced them.

`select` is where a sampled token is checked: the logits go through `process_logits` (the one hook a strategy
plugs into: penalties, logit bias, min_tokens) and a constraint's mask, the sampler picks a token per row, a row
whose logits are NaN gets -1 and stops, stop ids are matched, and the token's log-probability (and the k most
likely alternatives, when asked for) are read from the model's own logits, before any of that. `generate`,
`decode` and the engine call `select`; beam search picks its tokens itself (top-k over beams) but through the same
`log_probs` and `matches_stop`, so the hook and the stop rule are the same for every path.

The log-probabilities every path reports (README "Log-probabilities", docs/design/decoding.md, issue 50): the
log_softmax of the logits the model produced, at temperature 1, before anything jaxkv does to them (logit_bias,
penalties, min_tokens, a constraint's mask, temperature and the sampling filters). That is vLLM's default
(`logprobs_mode="raw_logprobs"`) and what `jaxkv.score` gives: a token a constraint forces reports the model's
log-probability of it (not 0), and the top alternatives are the model's most likely tokens, allowed or not.

Letters as in `jaxkv.shapes`: B rows, V vocabulary, k alternatives, n stop-id slots (padded with -1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.constraints import mask as constraint_mask
from jaxkv.sampling import token_logprobs


def process_logits(logits, processing=None, stop_ids=None):
    """float32[B, V] -> float32[B, V]: the logits a token is picked from (its log-probability is read from the
    model's logits before this, the module docstring).

    It is the seam for what changes the distribution itself rather than how it is sampled (penalties, a
    verifier's target): every decode path (`generate`, `decode`, the engine, beam search)
    looks it up here when it is traced, so replacing it (and clearing JAX's compile caches) changes them all.
    processing: a path's per-row state (`jaxkv.decoding.processing.Processing`: logit bias, penalties,
    min_tokens; None: none, the identity), with the rows' stop ids (what min_tokens holds back).
    NaN rows are detected before it runs (a NaN row stops whatever the hook makes of it)."""
    return logits if processing is None else processing.apply(logits, stop_ids)


def log_probs(logits, allowed=None):
    """float32[B, V]: log_softmax of the processed logits (beam search's scores), then -inf where `allowed` (as in
    `select`) leaves a token out. The mask comes after the log_softmax, not before: the allowed tokens keep the
    model's log-probabilities (not renormalized over the allowed set), as transformers' beam search applies its
    prefix_allowed_tokens_fn to log_softmax'ed scores, and as every other path reports them (the module
    docstring; issue 50)."""
    logp = jax.nn.log_softmax(process_logits(logits).astype(jnp.float32), axis=-1)
    return logp if allowed is None else constraint_mask.apply(logp, allowed)


def constrain(logits, model_logits, allowed):
    """float32[B, V] processed logits under int32[B, ceil(V / 32)] packed masks (the tokens left out: -inf).

    A row the processing left no allowed token keeps the allowed ones at the model's logits instead: min_tokens
    holds the stop ids back, and a complete constraint allows nothing else. The constraint wins (it can produce
    no more text), so the stop token is emitted and the row ends "stop" before min_tokens."""
    masked = constraint_mask.apply(logits, allowed)
    stuck = jnp.all(masked == -jnp.inf, axis=-1, keepdims=True)
    return jnp.where(stuck, constraint_mask.apply(model_logits.astype(masked.dtype), allowed), masked)


def nan_rows(logits):
    """bool[B]: rows whose logits hold a NaN: the model could not place the row's last token (a full cache, a
    position past the model's range; see `jaxkv.model.Decoder`)."""
    return jnp.any(jnp.isnan(logits), axis=-1)


def matches_stop(tokens, stop_ids):
    """bool[...]: tokens int32[...] that are one of the stop ids: int32[n] shared by every row, or int32[B, n]
    one list per row (tokens [B, ...]). Padding (-1) never matches, as no token is negative after `select`."""
    if stop_ids.ndim == 2:
        per_row = stop_ids.reshape(stop_ids.shape[:1] + (1,) * (tokens.ndim - 1) + stop_ids.shape[1:])
        return jnp.any(tokens[..., None] == per_row, axis=-1)
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


class Selected(NamedTuple):
    """What `select` returns for B rows.

    tokens:   int32[B], the picked tokens; -1 where the row's logits were NaN.
    nan:      bool[B], the row's logits were NaN.
    valid:    bool[B], the token is in [0, V) (a custom sampler may return anything; -1 is not valid).
    stopped:  bool[B], the row ends here: a stop id, or an invalid token (a NaN row included).
    logprob:  float32[B], log p(token) under the model's logits at temperature 1 (the module docstring:
              before `process_logits`, the constraint and the sampler's filters; NaN where the token is not valid).
    top_ids, top_logprobs: int32 and float32[B, k], the k most likely tokens under the same distribution, best
              first (k = 0: none).
    """

    tokens: jax.Array
    nan: jax.Array
    valid: jax.Array
    stopped: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def select(logits, key, sampler, stop_ids, *, top: int = 0, top_wanted=None, rows: int | None = None,
           processing=None, allowed=None, constrained=None) -> Selected:
    """One decode step's token choice for B rows of float32[B, V] logits (see the module docstring).

    key: what `sampler` takes as its key (one PRNG key, or one per row for the engine's per-slot keys).
    sampler: `(logits, key) -> int32[rows]`; it sees the first `rows` rows (None: all B), the rest get token 0
      (batch filler that the caller ignores).
    top: k, the alternatives read per row (static).
    top_wanted: None, or a traced bool: read the k alternatives only when it is true (zeros otherwise), so a
      batch where nobody asked for them does not pay for a top-k over the vocabulary.
    processing: the rows' `Processing` state for `process_logits` (None: none); the caller advances it with the
      tokens it keeps (`Processing.advance`).
    allowed: None, or int32[B, ceil(V / 32)], a constraint's packed token mask (`jaxkv.constraints.mask`): the
      tokens it leaves out get -inf after `process_logits`, so they are never picked (`constrain`); the
      log-probabilities are still the model's.
    constrained: None, or a traced bool: apply `allowed` only when it is true (a batch with no constrained row
      skips the unpacking).
    """
    B, V = logits.shape
    model_logits = logits
    nan = nan_rows(logits)
    logits = process_logits(logits, processing, stop_ids)
    if allowed is not None and constrained is not None:
        logits = lax.cond(constrained, constrain, lambda logits, *_: logits, logits, model_logits, allowed)
    elif allowed is not None:
        logits = constrain(logits, model_logits, allowed)
    tokens = sampler(logits if rows is None else logits[:rows], key)
    want = (B if rows is None else rows,)
    if getattr(tokens, "shape", None) != want or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"the sampler must return integer token ids of shape {want}, got "
                         f"{getattr(tokens, 'shape', None)} {getattr(tokens, 'dtype', type(tokens).__name__)}")
    tokens = tokens.astype(jnp.int32)
    if rows is not None and rows < B:
        tokens = jnp.concatenate([tokens, jnp.zeros((B - rows,), jnp.int32)])
    # A NaN row emits -1 and stops, rather than whatever id a sampler makes of NaN.
    tokens = jnp.where(nan, -1, tokens)
    valid = (tokens >= 0) & (tokens < V)
    stopped = matches_stop(tokens, stop_ids) | ~valid

    def alternatives(logits):
        return token_logprobs(logits, tokens, top)

    if top_wanted is None or top == 0:
        logprob, top_ids, top_logprobs = alternatives(model_logits)
    else:
        def chosen_only(logits):
            return (token_logprobs(logits, tokens)[0], jnp.zeros((B, top), jnp.int32),
                    jnp.zeros((B, top), jnp.float32))

        logprob, top_ids, top_logprobs = lax.cond(top_wanted, alternatives, chosen_only, model_logits)
    return Selected(tokens=tokens, nan=nan, valid=valid, stopped=stopped, logprob=logprob, top_ids=top_ids,
                    top_logprobs=top_logprobs)
