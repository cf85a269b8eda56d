"""Speculative decoding: a proposer guesses the next k tokens, one forward pass of the target over k + 1 positions
checks them, and every token that comes out is distributed exactly as plain decoding would produce it.

A step reads the weights and the cache once, whatever the number of positions it computes (decode is bandwidth
bound), so a verify pass that keeps m of k proposals emits m + 1 tokens for about the price of one step (plus
the wider products: `VERIFY_COST`).

`Speculation` is the one API (`jaxkv.generate(..., speculative=)`). The acceptance rule (`verify`) is standard
speculative sampling (Leviathan et al. 2023; Chen et al. 2023), applied to the distribution the sampler draws
from, after temperature, top-k, top-p and min-p (`Sampler.distribution`): proposal d with proposer probability
q(d) is kept with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from the residual
max(0, p - q) renormalized, and after k acceptances a bonus token is drawn from p. A deterministic proposer
(n-gram lookup) has q one-hot, so d is kept with probability p(d) and the residual is p without d. A greedy row's
p is one-hot at its argmax: a proposal is kept exactly when it is the argmax, and the token after the last
kept one is the argmax: token for token what plain greedy decoding emits (up to float rounding of the wider pass).

Letters as in `jaxkv.shapes`: B rows, V vocabulary, k proposals per verify (`num_tokens`), P history slots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.decoding import step
from jaxkv.sampling import Sampler, token_logprobs

METHODS = ("ngram", "draft", "mtp")
MAX_NUM_TOKENS = 16

# c_verify / c_step: what a verify pass over k + 1 positions costs against a one-token step, by platform. The
# adaptive rule speculates only while the expected tokens per verify exceed it. CPU: 2.75 measured on "small"
# float32 batch 1, k = 4 (`jaxkv bench speculative`, docs/design/speculation.md): XLA:CPU's products with a few
# rows cost several times one row's (docs/design/families.md, "Weight layout"). GPU/TPU read the weights once
# for a few rows at nearly one row's
# cost; 1.2 is an estimate, not yet measured here (docs/design/speculation.md).
VERIFY_COST = {"cpu": 2.75}
DEFAULT_VERIFY_COST = 1.2
# How that ratio grows with the batch a verify is part of, in the engine: c(W) = c(1) (1 + WIDTH_COST log2 W).
# CPU: 0.1, from per-pass times of the engine at 1 / 4 / 16 slots on "small" (c = 2.3 / 3.1 / 3.85 in one run,
# docs/design/speculation.md): W (k + 1) rows are a wider, slower product per row than W. GPU/TPU: 0 (a decode
# step of a few dozen rows is still bound by reading the weights), not yet measured.
WIDTH_COST = {"cpu": 0.1}
# After this many plain steps in a row, one verify is run anyway to re-measure the acceptance; each probe that
# finds speculating still does not pay multiplies the wait by PROBE_BACKOFF, up to MAX_PROBE_WAIT. A probe that
# keeps nothing costs VERIFY_COST - 1 steps (2 on CPU), so a text nothing predicts pays 3 probes in 256 tokens
# (one at the start, at 32 and at 160: about 2.5%); the price is that a text that becomes predictable later is
# noticed up to MAX_PROBE_WAIT steps late.
PROBE_EVERY = 32
PROBE_BACKOFF = 4
MAX_PROBE_WAIT = 1024
# A row's acceptance estimate before its first verify: high enough that the first verify runs (its expected
# tokens 1 + r + ... + r^k exceed VERIFY_COST), low enough that one verify keeping nothing stops the next.
INITIAL_RATE = 0.8
# Weight of the newest verify in a row's running acceptance estimate.
RATE_WEIGHT = 0.3


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How `jaxkv.generate` speculates (`speculative=Speculation(...)`).

    method: "ngram" (prompt lookup: the longest suffix of the sequence so far, prompt and output, of ngram_max
      down to ngram_min tokens that occurred before proposes the tokens that followed its latest occurrence),
      "draft" (a smaller `jaxkv.Model` with the same vocabulary proposes: it decodes k tokens, each drawn from
      its own distribution under the request's sampling settings, with its own KV cache kept in step with the
      target's), or "mtp" (the checkpoint's multi-token-prediction module, `Model.mtp`: its first module chained
      k times, fed its own output state, as vLLM and sglang chain DeepSeek-V3's one module).
    num_tokens: k, proposals per verify pass (1 to MAX_NUM_TOKENS).
    draft: the draft model (method "draft" only).
    adaptive: speculate for a batch only while the rows' running acceptance estimates predict more tokens per
      verify than a verify costs (`VERIFY_COST`), else take plain steps and probe again every PROBE_EVERY steps;
      False verifies every step.
    """

    method: str
    num_tokens: int = 4
    draft: Any = dataclasses.field(default=None, kw_only=True)
    ngram_max: int = dataclasses.field(default=4, kw_only=True)
    ngram_min: int = dataclasses.field(default=1, kw_only=True)
    adaptive: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, low, high in (("num_tokens", 1, MAX_NUM_TOKENS), ("ngram_max", 1, 64), ("ngram_min", 1, 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"Speculation {name} must be an integer in [{low}, {high}], got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"Speculation ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"Speculation adaptive must be a bool, got {self.adaptive!r}")
        if self.method == "draft" and self.draft is None:
            raise ValueError("Speculation('draft') needs draft=, a jaxkv.Model with the target's vocabulary")
        if self.method != "draft" and self.draft is not None:
            raise ValueError(f"draft= is only for method 'draft', not {self.method!r}")

    def check(self, model) -> "Plan":
        """The static plan for speculating on `model` (ValueError for a combination that cannot work)."""
        if self.method == "draft":
            from jaxkv.model import Model

            if not isinstance(self.draft, Model):
                raise ValueError(f"Speculation draft must be a jaxkv.Model, got {type(self.draft).__name__}")
            if self.draft.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({self.draft.config.vocab_size} ids) differs from "
                                 f"the target's ({model.config.vocab_size})")
            if self.draft.config.linear_attention is not None:
                # its rejected proposals would stay in its states: it rewinds by its length only
                raise ValueError("a hybrid draft model (linear_attention layers) is not supported yet: use an "
                                 "all-attention draft, or method 'ngram'")
        if self.method == "mtp":
            if getattr(model, "mtp", None) is None:
                raise ValueError("Speculation('mtp') needs a checkpoint with multi-token-prediction layers "
                                 "(num_nextn_predict_layers > 0); this model has none")
        return Plan(method=self.method, num_tokens=self.num_tokens, ngram_max=self.ngram_max,
                    ngram_min=self.ngram_min, adaptive=self.adaptive,
                    verify_cost=VERIFY_COST.get(jax.default_backend(), DEFAULT_VERIFY_COST),
                    width_cost=WIDTH_COST.get(jax.default_backend(), 0.0))


class Plan(NamedTuple):
    """`Speculation`'s static part, hashable: what the compiled loop is traced with."""

    method: str
    num_tokens: int
    ngram_max: int
    ngram_min: int
    adaptive: bool
    verify_cost: float
    width_cost: float = 0.0

    def cost_at(self, width: int) -> float:
        """c_verify / c_step for a verify over `width` sequences (`WIDTH_COST`)."""
        return self.verify_cost * (1.0 + self.width_cost * math.log2(width))


def ngram_propose(history, length, k: int, ngram_min: int, ngram_max: int):
    """Prompt lookup over each row's tokens so far: history int32[B, P] (row b's first length[b] entries are its
    sequence) -> (int32[B, k] proposals, bool[B] found).

    For n from ngram_max down to ngram_min, the row's last n tokens are looked for earlier in the row (an
    occurrence that a token follows); the longest n that occurs wins, and its latest occurrence proposes the k
    tokens after it. A continuation that runs into the end of the sequence repeats with the period it implies
    (a run "a b a b" proposes "a b a b ..."). A row with no match proposes its last token (found False)."""
    B, P = history.shape
    pad = jnp.pad(history, ((0, 0), (0, ngram_max)), constant_values=-2)  # never equal to a token
    j = jnp.arange(P)
    found = jnp.zeros((B,), bool)
    follow = jnp.zeros((B,), jnp.int32)  # index of the first proposed token
    for n in range(ngram_max, ngram_min - 1, -1):
        suffix = jnp.take_along_axis(history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, P - 1), axis=1)
        same = jnp.ones((B, P), bool)
        for i in range(n):
            same &= pad[:, i: i + P] == suffix[:, i: i + 1]
        same &= (j[None, :] + n < length[:, None]) & (length[:, None] > n)
        latest = jnp.max(jnp.where(same, j[None, :], -1), axis=1)
        take = ~found & (latest >= 0)
        follow = jnp.where(take, latest + n, follow)
        found |= take
    period = jnp.maximum(length - follow, 1)
    index = follow[:, None] + jnp.arange(k)[None, :] % period[:, None]
    proposals = jnp.take_along_axis(history, jnp.clip(index, 0, P - 1), axis=1)
    last = jnp.take_along_axis(history, jnp.clip(length - 1, 0, P - 1)[:, None], axis=1)
    return jnp.where(found[:, None], proposals, last).astype(jnp.int32), found


class Verified(NamedTuple):
    """What `verify` returns for B rows and k proposals.

    tokens:   int32[B, k + 1], position i's outcome: proposal i where kept (i < accepted), at i == accepted the
              residual or bonus draw (-1 where that position's logits were NaN), -1 after.
    accepted: int32[B], the leading proposals kept (0..k).
    logprob:  float32[B, k + 1], log p(token) at temperature 1 under the model's logits (`step.Selected`).
    top_ids, top_logprobs: int32 and float32[B, k + 1, t], the t most likely tokens at each position.
    """

    tokens: jax.Array
    accepted: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def verify(logits, proposals, key, sampler: Sampler, *, q=None, top: int = 0, allowed=None,
           constrained=None) -> Verified:
    """The acceptance rule (module docstring) for B rows: logits float32[B, k + 1, V] (position i: the target's
    logits for the token after input i, where the inputs are the last emitted token and the k proposals),
    proposals int32[B, k], q float32[B, k, V] the proposer's distributions (None: one-hot at the proposals).
    key: one PRNG key for the batch, or one per row ([B, 2] raw keys, the engine's): then row b's draws depend on
    key[b] alone, whatever shares the batch. allowed: None, or int32[B, k + 1, ceil(V / 32)] the constraint's
    masks at the k + 1 positions (`Grammar.draft_masks`): p is drawn from the masked logits (a proposal the mask
    refuses has p = 0: rejected), the log-probabilities are still the model's (`step`); constrained: None, or a
    traced bool, apply them only when true."""
    B, T, V = logits.shape
    k = T - 1
    flat = logits.reshape(B * T, V)
    nan = step.nan_rows(flat).reshape(B, T)
    model_logits = logits.astype(jnp.float32)
    processed = step.process_logits(flat).astype(jnp.float32).reshape(B, T, V)
    if allowed is not None:
        def masked(x):
            return step.constrain(x.reshape(B * T, V), model_logits.reshape(B * T, V),
                                  allowed.reshape(B * T, -1)).reshape(B, T, V)

        processed = masked(processed) if constrained is None else lax.cond(constrained, masked, lambda x: x,
                                                                            processed)
    p = jax.vmap(sampler.distribution, in_axes=1, out_axes=1)(processed)  # [B, T, V]
    per_row = key.ndim == 2 and key.shape[0] == B and key.dtype == jnp.uint32
    if per_row:
        accept_key, draw_key = jnp.swapaxes(jax.vmap(jax.random.split)(key), 0, 1)  # [2, B, key]
    else:
        accept_key, draw_key = jax.random.split(key)
    valid = (proposals >= 0) & (proposals < V)
    d = jnp.clip(proposals, 0, V - 1)
    p_d = jnp.take_along_axis(p[:, :k], d[..., None], axis=-1)[..., 0]  # [B, k]
    q_d = 1.0 if q is None else jnp.take_along_axis(q, d[..., None], axis=-1)[..., 0]
    u = 1.0 - (jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_key) if per_row
               else jax.random.uniform(accept_key, (B, k)))  # (0, 1]: a probability-0 token is never kept
    keep = (u * q_d <= p_d) & valid & ~nan[:, :k]
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # [B]
    # The residual at the first rejection (the bonus distribution p after k acceptances: q counts as 0 there).
    p_m = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    at = jnp.minimum(accepted, k - 1)[:, None]
    if q is None:
        q_m = jax.nn.one_hot(jnp.take_along_axis(d, at, axis=1)[:, 0], V, dtype=jnp.float32)
    else:
        q_m = jnp.take_along_axis(q, at[..., None], axis=1)[:, 0]
    q_m = jnp.where((accepted < k)[:, None], q_m, 0.0)
    residual = jnp.maximum(p_m - q_m, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, p_m)  # rounding left nothing: p itself
    if per_row:
        drawn = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(draw_key, residual)
    else:
        drawn = jax.random.categorical(draw_key, jnp.log(residual), axis=-1)
    drawn = drawn.astype(jnp.int32)
    nan_m = jnp.take_along_axis(nan, accepted[:, None], axis=1)[:, 0]
    drawn = jnp.where(nan_m, -1, drawn)
    i = jnp.arange(T)[None, :]
    padded = jnp.concatenate([proposals, jnp.full((B, 1), -1, jnp.int32)], axis=1)
    tokens = jnp.where(i < accepted[:, None], padded, jnp.where(i == accepted[:, None], drawn[:, None], -1))
    logprob, top_ids, top_logprobs = jax.vmap(lambda lg, t: token_logprobs(lg, t, top), in_axes=1,
                                              out_axes=1)(model_logits, tokens)
    return Verified(tokens=tokens.astype(jnp.int32), accepted=accepted, logprob=logprob, top_ids=top_ids,
                    top_logprobs=top_logprobs)


def expected_tokens(rate, k: int):
    """float32[B]: tokens a verify emits when each proposal is kept with probability `rate`: 1 + r + ... + r^k."""
    return sum(rate ** i for i in range(k + 1))


def append_history(history, length, tokens, count):
    """Writes tokens[b, :count[b]] to history[b, length[b]:] (what the n-gram proposer searches) -> (history,
    length + count)."""
    B, T = tokens.shape
    at = length[:, None] + jnp.arange(T)[None, :]
    at = jnp.where(jnp.arange(T)[None, :] < count[:, None], at, history.shape[1])  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    return history.at[rows, at].set(tokens, mode="drop"), length + count


def room(cache, running, k: int, max_positions: int):
    """bool[]: a verify's k + 1 writes from each row's length fit `cache` (its slots, unless every layer is a ring)
    and the positions below `max_positions` (the positions the model has: none past them is ever computed). The
    request itself only has to fit without the lookahead (`plan_cache`, `plan_pages`), so near the end of the
    slots or positions the loop takes plain steps instead, as the engine does per slot.

    The contiguous cache's rows share the write slot and every row is computed, finished or not, so its longest
    row (the least `start`) decides; a paged row that has finished stores nothing (`programs.forward`'s
    `active`), so only the `running` rows count there."""
    from jaxkv.cache.paged import PagedKVCache

    if isinstance(cache, PagedKVCache):
        end = cache.lengths + k + 1  # slots held after the verify; its last position is end - 1
        return jnp.all(((end <= cache.capacity) & (end <= max_positions)) | ~running)
    end = cache.length + k + 1
    fits = end - jnp.min(cache.start) <= max_positions
    return fits if cache.ring else fits & (end <= cache.capacity)


def prompt_history(token_lists, rows: int, width: int):
    """The n-gram proposer's starting history: int32[rows, width] with row b's prompt in its first
    len(token_lists[b]) entries (rows past the list: empty), and int32[rows] those lengths."""
    import numpy as np

    history, length = np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32)
    for b, tokens in enumerate(token_lists):
        history[b, : len(tokens)], length[b] = tokens, len(tokens)
    return history, length


def prefill_draft(draft, token_lists, *, rows: int, max_new_tokens: int, lookahead: int, attention):
    """The draft model's own contiguous cache with `token_lists` prefilled (left-padded; padded with empty rows to
    `rows`), room for max_new_tokens more slots each and the verify's `lookahead` (k) where the draft's positions
    allow (`room` stops the verifies where they do not) -> the cache. ValueError, before any compute, where the
    draft cannot follow the sequence itself (it is fed every token): the longest prompt plus max_new_tokens
    beyond its positions (as the engine refuses a max_len beyond them)."""
    from jaxkv.cache import planner
    from jaxkv.decoding import programs, request

    longest, limit = max(map(len, token_lists)), draft.config.max_positions
    if longest + max_new_tokens > limit:
        raise ValueError(f"the draft model has {limit} positions; the longest prompt has {longest} tokens, which "
                         f"with max_new_tokens={max_new_tokens} need {longest + max_new_tokens}")
    request.check_config(draft.config)
    bucket = max(planner.MIN_PROMPT_BUCKET, planner.next_pow2(longest))
    tokens, start = request.left_pad(list(token_lists) + [[0]] * (rows - len(token_lists)), length=bucket)
    # (slots past bucket - longest + limit are past the longest row's positions: never written)
    capacity = min(planner.next_pow2(bucket + max_new_tokens + lookahead), bucket - longest + limit)
    _, cache = programs.prefill(draft.params, jax.device_put(tokens), jax.device_put(start), config=draft.config,
                                capacity=capacity,
                                attention=request.attention(draft.config, attention),
                                cache_dtype=request.cache_dtype(draft.config, None), ring=False, mesh=None)
    return cache
