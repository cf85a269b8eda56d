"""Scoring: the log-probability of given continuations of given prompts, through the KV cache.

What evaluation harnesses ask of a model (multiple-choice log-likelihood, perplexity of a reference answer):
for each (prompt, continuation) pair, log p(c_j | prompt, c_<j) for every continuation token c_j, and whether
greedy decoding would have produced the continuation.

"Through the cache" means the same two passes `generate` makes, so a score reflects what decoding sees (the cache
dtype, its quantization, the attention implementation): one jit per batch allocates a contiguous cache, prefills
the left-padded prompts (the last prompt token's logits predict c_0), then runs every right-padded continuation as
one more chunk over that cache (its logits at j predict c_{j+1}). Padding after a continuation has position -1: its
hidden state is zeroed, and no real token attends to it (it comes after them all).

`cached_nll` (what a cache dtype costs in accuracy) runs the way generation does instead: prefill a prefix, then
one decode step per token through the cache, feeding the true next token (teacher forcing), so every token's
log-likelihood comes from logits computed over a cache in the chosen dtype. `jaxkv.logits` is the no-cache float
reference.

Shapes are bucketed as in `generate` (batch, prompt length and continuation length each a power of two), so
repeated calls compile once per bucket, not once per length. The [B, Tc, V] logits of a batch are bounded by
`LOGITS_BYTES`: more pairs than fit become several batches of one shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import checks
from jaxkv.cache import planner as memory
from jaxkv.config import Config
from jaxkv.decoding import programs, request
from jaxkv.decoding.request import MAX_TOP_LOGPROBS, left_pad
from jaxkv.model import Decoder, Model
from jaxkv.sampling import greedy, token_logprobs

# The float32 logits of one batch's continuation chunk ([B, Tc, V]) stay below this: a 128k vocabulary and 512-token
# continuations give 4 rows per batch, rather than gigabytes of logits for a large evaluation set.
LOGITS_BYTES = 1 << 30
CAPACITY_ROUNDING = 64  # cached_nll's capacities are rounded up to a multiple of this (never past max positions)


class Score(list):
    """The log-probability of each continuation token (a list of float, so `np.allclose(score, expected)` works).

    total:  the sum, log p(continuation | prompt).
    greedy: every continuation token was the most likely one (lowest id among ties, as greedy decoding picks):
            greedy decoding from the prompt would have produced the continuation.
    top_logprobs: with `score(..., top_logprobs=k)`, per continuation token the k most likely tokens at its
            position as (id, log-probability), best first; else None.
    """

    def __init__(self, logprobs, greedy: bool, top_logprobs=None):
        super().__init__(float(x) for x in logprobs)
        self.total = float(sum(self))
        self.greedy = bool(greedy)
        self.top_logprobs = top_logprobs

    def __repr__(self):
        return f"Score({list.__repr__(self)}, total={self.total}, greedy={self.greedy})"


@functools.partial(jax.jit, static_argnames=("config", "attention", "cache_dtype", "top"))
def _score_batch(params, prompts, start, continuations, lengths, *, config: Config, attention: str, cache_dtype: str,
                 top: int = 0):
    """prompts int32[B, Tp] left-padded (after start[b] padding slots), continuations int32[B, Tc] right-padded
    (lengths[b] real tokens) -> (float32[B, Tc] log p(continuations[b, j]), bool[B, Tc] it was the argmax,
    int32[B, Tc, top] and float32[B, Tc, top]: the `top` most likely ids at each position and their
    log-probabilities). Entries past a row's length are garbage."""
    B, Tp = prompts.shape
    Tc = continuations.shape[1]
    first, cache = programs.prefill(params, prompts, start, config=config, capacity=Tp + Tc, attention=attention,
                                    cache_dtype=cache_dtype, ring=False, mesh=None)  # [B, V]: predicts c_0
    real = jnp.arange(Tc)[None, :] < lengths[:, None]  # [B, Tc]
    positions = jnp.where(real, cache.positions(Tc), -1)
    rest, _ = Decoder(config).apply({"params": params}, continuations, positions, cache, attention=attention)
    logits = jnp.concatenate([first[:, None], rest[:, :-1]], axis=1)  # [B, Tc, V]: logits[:, j] predicts c_j
    flat = logits.reshape(B * Tc, -1)
    chosen, top_ids, top_logp = token_logprobs(flat, continuations.reshape(-1), top)
    is_best = greedy(flat) == continuations.reshape(-1)
    return chosen.reshape(B, Tc), is_best.reshape(B, Tc), top_ids.reshape(B, Tc, top), top_logp.reshape(B, Tc, top)


def score(model: Model, prompts, continuations, *, cache_dtype: str | None = None,
          attention: str | None = None, top_logprobs: int = 0) -> list[Score]:
    """Log-probabilities of `continuations[i]` given `prompts[i]`, computed through the KV cache (module docstring).

    Args:
      prompts, continuations: equally many token-id lists (each non-empty); or, for a model with a tokenizer,
        strings (each encoded separately; a continuation without the tokenizer's special tokens, so no BOS lands
        in the middle). Each prompt plus its continuation fits the model's max positions.
      cache_dtype: the cache dtype the prompts are cached in (`jaxkv.cache.CACHE_DTYPES`); default the model's.
      attention: "auto", "xla" or "pallas"; default config.attention.
      top_logprobs: k in [0, 20]: also report, per continuation token, the k most likely tokens at its position
        (`Score.top_logprobs`; what an evaluation harness reads to tell whether each token was the greedy one).

    Returns:
      one `Score` per pair, in order: the log-probability of each continuation token under the model's
      distribution (temperature 1, no filter), with `.total` and `.greedy`.

    Raises:
      ValueError: for any bad argument, before any compute.
    """
    config = model.config
    prompt_lists = request.token_lists(prompts, config.vocab_size, model.tokenizer, "prompt")
    cont_lists = request.token_lists(continuations, config.vocab_size, model.tokenizer, "continuation", special_tokens=False)
    if len(prompt_lists) != len(cont_lists):
        raise ValueError(f"{len(prompt_lists)} prompts and {len(cont_lists)} continuations: pass one continuation "
                         f"per prompt")
    for i, (p, c) in enumerate(zip(prompt_lists, cont_lists)):
        if len(p) + len(c) > config.max_positions:
            raise ValueError(f"pair {i}: the prompt ({len(p)} tokens) and continuation ({len(c)}) exceed the model's "
                             f"max positions ({config.max_positions})")
    cache_dtype = request.cache_dtype(config, cache_dtype)
    attention = request.attention(config, attention)
    k = checks.check_int("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    top = MAX_TOP_LOGPROBS if k else 0  # one compiled program for every k > 0

    Tp = max(memory.MIN_PROMPT_BUCKET, memory.next_pow2(max(map(len, prompt_lists))))
    Tc = max(memory.MIN_PROMPT_BUCKET, memory.next_pow2(max(map(len, cont_lists))))
    fit = max(1, LOGITS_BYTES // (Tc * config.vocab_size * 4))
    rows = min(memory.next_pow2(len(prompt_lists)), 1 << (fit.bit_length() - 1))  # powers of two
    out = []
    for lo in range(0, len(prompt_lists), rows):
        batch_prompts, batch_conts = prompt_lists[lo:lo + rows], cont_lists[lo:lo + rows]
        filler = memory.next_pow2(len(batch_prompts)) - len(batch_prompts)  # a short last batch: its own bucket
        tokens, start = left_pad(batch_prompts + [[0]] * filler, length=Tp)
        conts = np.zeros((len(batch_prompts) + filler, Tc), np.int32)
        lengths = np.zeros((len(conts),), np.int32)
        for b, c in enumerate(batch_conts):
            conts[b, :len(c)], lengths[b] = c, len(c)
        logprobs, best, top_ids, top_logp = _score_batch(
            model.params, jax.device_put(tokens), jax.device_put(start), jax.device_put(conts),
            jax.device_put(lengths), config=config, attention=attention, cache_dtype=cache_dtype, top=top)
        logprobs, best, top_ids, top_logp = (np.asarray(x) for x in (logprobs, best, top_ids, top_logp))
        for b, c in enumerate(batch_conts):
            tops = None
            if k:
                tops = [[(int(i), float(lp)) for i, lp in zip(top_ids[b, j, :k], top_logp[b, j, :k])]
                        for j in range(len(c))]
            out.append(Score(logprobs[b, :len(c)], best[b, :len(c)].all(), tops))
    return out


# --- teacher-forced scoring through the decode step -------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "attention"))
def _teacher_forced_nll(params, logits, cache, targets, *, config: Config, attention: str):
    """logits [B, V] predict targets[:, 0]; each later target is predicted after feeding the one before it."""

    def body(carry, target_and_next):
        logits, cache = carry
        target, feed = target_and_next
        nll = -jax.nn.log_softmax(logits, axis=-1)[jnp.arange(target.shape[0]), target]
        logits, cache = programs.forward(params, feed[:, None], cache, config=config, attention=attention)
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
    cache_dtype = request.cache_dtype(cfg, cache_dtype)
    attention = request.attention(cfg, attention)
    capacity = min(-(-arr.shape[1] // CAPACITY_ROUNDING) * CAPACITY_ROUNDING, cfg.max_positions)
    ring = cfg.sliding_window is not None and capacity > cfg.sliding_window
    if ring:
        capacity = cfg.sliding_window
    B = arr.shape[0]
    logits, cache = programs.prefill(model.params, jnp.asarray(arr[:, :prefix]), jnp.zeros((B,), jnp.int32),
                                     config=cfg, capacity=capacity, attention=attention, cache_dtype=cache_dtype,
                                     ring=ring, mesh=None)
    nll = _teacher_forced_nll(model.params, logits, cache, jnp.asarray(arr[:, prefix:]), config=cfg,
                              attention=attention)
    return np.asarray(nll)
