"""Beam search on the paged cache, scored exactly as transformers scores it.

Each prompt is prefilled once; its W beams are forks of it (`PagedKVCache.fork`): full pages are shared by
reference. Every step, each prompt's W*V continuations (beam score + the token's log-probability) are ranked, the
best W that do not end become the next beams, and those that end (a stop token, or the last allowed token) may
enter the prompt's W finished hypotheses. Choosing the next beams is a fork of page-table rows: the counts of the
pages move, no full page is copied, and the partly filled last page of a beam is copied only for the second and
later children that extend it (copy-on-write). Beams that are not chosen drop their pages in the same fork. A
finished hypothesis keeps only its token ids and score: no page.

The scoring is transformers' (`GenerationMixin._beam_search`, 4.50+), step for step, in float32:

  candidates  the best C of the W*V continuations, C = (1 + stop-id slots) * W (transformers keeps
              max(2, 1 + n_eos) * W; any C >= (1 + n_eos) * W selects the same beams and hypotheses, and a fixed
              C means no recompile per number of stop ids). On the first step beams 1..W-1 score -1e9, so all
              continuations come from the prompt.
  next beams  the best W candidates that do not end (ended ones get -1e9 added).
  finished    of the best W candidates (only those), each that ends scores sum_logprobs / length**length_penalty,
              length = tokens generated including the stop token; it replaces the worst of the W finished
              hypotheses if it beats it. A prompt whose W hypotheses are final adds no more: with
              early_stopping=True once it holds W; otherwise once the best running beam cannot beat the worst
              hypothesis, estimated at the current length (False), or at max_new_tokens when
              length_penalty > 0 ("never", the exact bound).
  the end     max_new_tokens, or every prompt final. A prompt that is final drops its beams' pages at once
              and its rows stop computing; its hypotheses are what transformers returns for it.

Where jaxkv departs (issue 50): transformers keeps W beams whatever happens, so when too few real continuations
exist (a constraint masks all but a few tokens to -inf; the first step's -1e9 copies of the prompt) the beam slots
fill with continuations of those copies, of ended beams (their stop token then followed by more) or of refused
tokens, and such fillers can finish with a -1e9 summed into their score. Here a beam is `real` only if it descends
from the prompt by allowed tokens without ending; only a real beam's continuation may finish, and a prompt with no
real beam left is final. Unconstrained (V >= C) every beam is real, so nothing changes there.

num_beams=1 is greedy search, as transformers runs it (which does no beam search for one beam).

Letters as in `jaxkv.shapes`: B prompts (padded to a power of two), W beams, C candidates, V vocabulary, S the
slots of a sequence (the static bound of the token buffers).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import checks
from jaxkv.cache import planner as memory
from jaxkv.cache.paged import PagedKVCache
from jaxkv.config import Config
from jaxkv.decoding import constrained, programs, request, step
from jaxkv.decoding.phase import Phase
from jaxkv.model import Model

NEG = -1.0e9  # transformers' score of an impossible choice (added, in float32, exactly as it adds it)
EARLY_STOPPING = (True, False, "never")


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One finished beam.

    tokens:        the new token ids; a stop token that ended it is included.
    score:         logprob / len(tokens) ** length_penalty: transformers' `sequences_scores`.
    logprob:       the sum of the tokens' log-probabilities.
    finish_reason: "stop" (it ended at a stop token) or "length" (max_new_tokens).
    text:          the decoded tokens, when the model has a tokenizer.
    """

    tokens: list[int]
    score: float
    logprob: float
    finish_reason: str
    text: str | None = None


class BeamSearchResult(list):
    """What `beam_search` returns: per prompt, its `num_return_sequences` best `Hypothesis`, best first (fewer
    where fewer finished: a constraint that admits fewer completions than that).

    result[i][j].tokens / .score, or the same by attribute: result.tokens[i][j], result.scores[i][j],
    result.text[i][j] (None without a tokenizer). `stats`: measured figures of the call (seconds, pages)."""

    def __init__(self, hypotheses, stats: dict):
        super().__init__(hypotheses)
        self.stats = stats

    @property
    def tokens(self) -> list[list[list[int]]]:
        return [[h.tokens for h in hyps] for hyps in self]

    @property
    def scores(self) -> list[list[float]]:
        return [[h.score for h in hyps] for hyps in self]

    @property
    def text(self) -> list[list[str]] | None:
        if any(h.text is None for hyps in self for h in hyps):
            return None
        return [[h.text for h in hyps] for hyps in self]


@flax.struct.dataclass
class _Beams:
    """The search's loop carry.

    cache:     the paged cache, row b * W + k: beam k of prompt b
    logits:    float32[B * W, V], what each beam continues from
    running:   float32[B, W], each beam's summed log-probabilities, best first (transformers' running scores)
    real:      bool[B, W], the beam is a hypothesis in the making: it descends from the prompt by allowed tokens
               and has not ended. False: one of transformers' fillers, a beam slot kept full with a -1e9 or
               -inf score (the first step's copies of the prompt, an ended or refused continuation picked
               because too few others remained); none of its continuations may become a hypothesis
    seqs:      int32[B, W, S], each beam's tokens so far (-1 after)
    scores:    float32[B, W], the finished hypotheses' scores, best first (-1e9: none yet)
    sums:      float32[B, W], their summed log-probabilities
    lengths:   int32[B, W], their token counts
    hyps:      int32[B, W, S], their tokens
    finished:  bool[B, W], the slot holds a finished hypothesis
    open:      bool[B], a running beam may still beat the worst finished hypothesis (transformers'
               is_early_stop_heuristic_unsatisfied)
    live:      bool[B], the prompt is still searching (its beams hold pages and compute)
    step:      int32[], tokens chosen so far
    peak:      int32[], the most pages in use after any step
    starved:   bool[], some beam found no free page (its row was poisoned): a planner bug if ever true
    grammar:   with a constraint, each beam's token mask (`constrained.Grammar`), rows as the cache's; else None
    """

    cache: PagedKVCache
    logits: jax.Array
    running: jax.Array
    real: jax.Array
    seqs: jax.Array
    scores: jax.Array
    sums: jax.Array
    lengths: jax.Array
    hyps: jax.Array
    finished: jax.Array
    open: jax.Array
    live: jax.Array
    step: jax.Array
    peak: jax.Array
    starved: jax.Array
    grammar: constrained.Grammar | None = None


def _take(x, index):
    """x[b, index[b, j], ...] for every b, j: a gather along the beam axis (x [B, n, ...], index [B, m])."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def _penalty(condition):
    """-1e9 where `condition`, else 0: what transformers adds as `condition.float() * -1e9`."""
    return jnp.where(condition, jnp.float32(NEG), jnp.float32(0.0))


def _choose(state: _Beams, *, stop_ids, max_new_tokens, length_penalty, early_stopping, num_beams: int,
            candidates: int):
    """One step of transformers' selection -> (state with the new beams and hypotheses, int32[B, W] the beams'
    parents, int32[B, W] their new tokens)."""
    B, W, _ = state.seqs.shape
    V = state.logits.shape[-1]
    t = state.step
    length = t + 1  # tokens generated once this step's token is appended
    allowed = None if state.grammar is None else state.grammar.allowed
    logp = step.log_probs(state.logits, allowed).reshape(B, W, V) + state.running[:, :, None]
    values, index = lax.top_k(logp.reshape(B, W * V), candidates)  # [B, C], best first
    parent, token = index // V, index % V
    ends = step.matches_stop(token, stop_ids) | (length >= max_new_tokens)  # [B, C]
    # A real beam continued by a token its constraint allows (a refused one scores -inf): only these can become
    # hypotheses. Unconstrained with V >= C, every candidate is real (beam 0's alone fill the first step's C).
    real = _take(state.real, parent) & jnp.isfinite(values)  # [B, C]
    extended = lax.dynamic_update_slice_in_dim(_take(state.seqs, parent), token[:, :, None], t, axis=2)  # [B, C, S]

    # The next beams: the best W candidates that do not end.
    running_values = values + _penalty(ends)
    running, pick = lax.top_k(running_values, num_beams)
    new_parent, new_token, seqs = _take(parent, pick), _take(token, pick), _take(extended, pick)
    running_real = _take(real & ~ends, pick)  # an ended candidate picked here (-1e9 added) is a filler

    # The finished hypotheses: the best W candidates that end may replace the worst ones.
    top = jnp.arange(candidates) < num_beams
    just = ends & top[None, :] & real  # a filler's continuation is never finished (its -1e9 score aside)
    score = values / jnp.power(length.astype(jnp.float32), length_penalty)
    if early_stopping is True:
        score = score + _penalty(jnp.all(state.finished, axis=1))[:, None]
    score = score + _penalty(~state.open)[:, None]
    score = score + _penalty(~just)
    merged = jnp.concatenate([state.scores, score], axis=1)  # [B, W + C]
    scores, keep = lax.top_k(merged, num_beams)
    sums = _take(jnp.concatenate([state.sums, values], axis=1), keep)
    lengths = _take(jnp.concatenate([state.lengths, jnp.broadcast_to(length, values.shape)], axis=1), keep)
    hyps = _take(jnp.concatenate([state.hyps, extended], axis=1), keep)
    finished = _take(jnp.concatenate([state.finished, just], axis=1), keep)

    # Can a running beam still beat the worst finished hypothesis? (transformers' _check_early_stop_heuristic)
    if early_stopping == "never":
        hypothetical = jnp.where(length_penalty > 0.0, max_new_tokens, length)
    else:
        hypothetical = length
    best = running[:, :1] / jnp.power(hypothetical.astype(jnp.float32), length_penalty)  # [B, 1]
    worst = jnp.where(finished, jnp.min(scores, axis=1, keepdims=True), jnp.float32(NEG))  # [B, W]
    is_open = state.open & jnp.any(best > worst, axis=1)
    # A prompt with no real beam left (its constraint admits fewer completions than W) is done: its fillers
    # could only add fillers.
    live = state.live & is_open & (length < max_new_tokens) & jnp.any(running_real, axis=1)
    if early_stopping is True:
        live &= ~jnp.all(finished, axis=1)
    state = state.replace(running=running, real=running_real, seqs=seqs, scores=scores, sums=sums, lengths=lengths,
                          hyps=hyps, finished=finished, open=is_open, live=live, step=length)
    return state, new_parent, new_token


@functools.partial(jax.jit, static_argnames=("config", "attention", "early_stopping", "num_beams", "candidates"),
                   donate_argnames=("cache",))
def _search(params, cache: PagedKVCache, logits, real, stop_ids, max_new_tokens, length_penalty, grammar=None, *,
            config: Config, attention: str, early_stopping, num_beams: int, candidates: int):
    """The whole search after prefill, one `lax.while_loop` (cache rows B * W, forked from the prompts) ->
    the final `_Beams`, every page released. `grammar`: the beams' `constrained.Grammar` (None: none); after
    each choice the host forks the chosen beams' matchers and feeds them their tokens."""
    BW, V = logits.shape
    W = num_beams
    B = BW // W
    S = cache.capacity  # the static bound of the token buffers (max_new_tokens < S, checked on the host)
    first = jnp.arange(W)[None, :] == 0  # [1, W]: beam 0 is the prompt; 1..W-1 are fillers until the first choice
    running = jnp.where(first, 0.0, jnp.float32(NEG)) * jnp.ones((B, 1), jnp.float32)
    state = _Beams(cache=cache, logits=logits, running=running, real=first & real[:, None],
                   seqs=jnp.full((B, W, S), -1, jnp.int32), scores=jnp.full((B, W), NEG, jnp.float32),
                   sums=jnp.zeros((B, W), jnp.float32), lengths=jnp.zeros((B, W), jnp.int32),
                   hyps=jnp.full((B, W, S), -1, jnp.int32), finished=jnp.zeros((B, W), bool),
                   open=real, live=real, step=jnp.zeros((), jnp.int32), peak=cache.pages_in_use(),
                   starved=jnp.any(cache.overflowed), grammar=grammar)
    rows = jnp.arange(BW, dtype=jnp.int32).reshape(B, W)
    chooser = functools.partial(_choose, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                                length_penalty=length_penalty, early_stopping=early_stopping, num_beams=W,
                                candidates=candidates)

    def choose(state):
        state, parent, token = chooser(state)
        if state.grammar is not None:  # the chosen beams' matchers: their parents' fed their new tokens
            parents = jnp.where(state.live[:, None], _take(rows, parent), -1).reshape(BW)
            state = state.replace(grammar=state.grammar.reorder(parents, token.reshape(BW)))
        return state, parent, token

    def cond(carry):
        return jnp.any(carry[0].live)

    def body(carry):
        state, parent, token = carry
        # The chosen beams as page-table rows: row b*W + k continues row b*W + parent[b, k]; a prompt that is done
        # keeps no row (its pages are released by the same fork).
        parents = jnp.where(state.live[:, None], _take(rows, parent), -1).reshape(BW)
        active = parents >= 0
        cache = state.cache.fork(parents)
        logits, cache = programs.forward(params, jnp.where(active, token.reshape(BW), 0)[:, None], cache, config=config,
                                 attention=attention, active=active)
        state = state.replace(cache=cache, logits=logits[:, 0], peak=jnp.maximum(state.peak, cache.pages_in_use()),
                              starved=state.starved | jnp.any(cache.overflowed))
        return choose(state)

    # Choose, then (while a prompt is live) fork, feed the chosen tokens and choose again: the last choice feeds
    # nothing back. (No lax.cond around the model: on XLA:CPU one made the pools be copied every step.)
    state, _, _ = lax.while_loop(cond, body, choose(state))
    return state.replace(cache=state.cache.release(jnp.ones((BW,), bool)))


def _check_early_stopping(value):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if value == "never":
        return "never"
    raise ValueError(f"early_stopping must be True, False or 'never', got {value!r}")


def beam_search(model: Model, prompts, *, num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, num_return_sequences: int = 1,
                stop_tokens: Sequence[int] | None = None, max_len: int | None = None, cache_dtype: str | None = None,
                page_size: int = memory.DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                attention: str | None = None, constraint=None) -> BeamSearchResult:
    """Beam search for a batch of prompts on a paged cache, with transformers' scoring (see the module docstring).

    Args:
      model: a `jaxkv.Model`.
      prompts: token-id lists, or strings for a model with a tokenizer (one prompt: a list of one).
      num_beams: W >= 1 beams per prompt (1: greedy search).
      max_new_tokens: the most tokens a hypothesis may have (>= 1).
      length_penalty: a hypothesis scores sum_logprobs / len ** length_penalty (> 0 favours longer ones).
      early_stopping: True (a prompt ends once it holds W finished hypotheses), False (once no running beam can
        beat them, judged at the current length) or "never" (judged at the best length any beam could reach),
        as in transformers.
      num_return_sequences: hypotheses returned per prompt, 1..num_beams.
      stop_tokens: ids that end a hypothesis (included in it). None: the model's eos ids; []: only the length.
      max_len: bound on each sequence's slots (prompt + new tokens); default: the longest prompt + max_new_tokens
        rounded up to a power of two.
      cache_dtype: one of `jaxkv.cache.CACHE_DTYPES` (default the model's dtype).
      page_size: slots per page.
      num_pages: the page pool to use; default what the plan needs (`stats["pages_needed"]`, rounded up to a
        power of two). A pool too small for the worst case is a ValueError.
      attention: "auto", "xla" or "pallas" (the paged decode kernel); default the config's.
      constraint: as in `jaxkv.generate` (one for every prompt, or one per prompt, None for none): each beam's
        continuations are scored under its own matcher's mask (a chosen beam's matcher is its parent's, fed the
        beam's token), so every hypothesis that ends at a stop token satisfies its constraint; one cut by
        max_new_tokens ("length") may not. A constraint that admits fewer completions than num_return_sequences
        gives fewer hypotheses: the beam slots left over hold no hypothesis (transformers would return its -1e9
        or -inf scored fillers there). Needs a stop token.

    Returns:
      A `BeamSearchResult`: per prompt, its best `num_return_sequences` `Hypothesis` (tokens, score, logprob,
      finish_reason, text), best first, each ending at its first stop token (or at max_new_tokens); fewer only
      as `constraint` says; `.stats` with the pages used ("pages_in_use_peak" after any step,
      "pages_needed" the planner's bound, "pages_in_use_end" after the search, 0) and the bytes W private caches
      per prompt would need ("kv_cache_bytes_unshared").

    Raises:
      ValueError: before any compute, for bad settings or prompts, or what cannot fit (max_len, the model's
        positions, num_pages).
    """
    config = model.config
    num_beams = checks.check_int("num_beams", num_beams, 1)
    num_return_sequences = checks.check_int("num_return_sequences", num_return_sequences, 1)
    if num_return_sequences > num_beams:
        raise ValueError(f"num_return_sequences={num_return_sequences} exceeds num_beams={num_beams}: beam search "
                         f"keeps num_beams hypotheses per prompt")
    max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens, 1)
    length_penalty = checks.check_float("length_penalty", length_penalty)
    early_stopping = _check_early_stopping(early_stopping)
    if num_beams == 1:  # transformers runs greedy search: the first hypothesis to end is the answer
        early_stopping = True
    token_lists = request.token_lists(prompts, config.vocab_size, model.tokenizer)
    stop_ids = request.stop_ids(stop_tokens, config)
    cache_dtype = request.cache_dtype(config, cache_dtype)
    attention = request.attention(config, attention, paged=True)  # MLA: "xla" (no paged kernel)
    max_len = request.optional_int("max_len", max_len)
    page_size = checks.check_int("page_size", page_size, 1)
    lengths = [len(p) for p in token_lists]
    plan, pool = _pool(config, lengths, num_beams, max_new_tokens, page_size, cache_dtype, max_len, num_pages)
    B, W = plan.prefill_batch, num_beams
    tokens, positions = request.right_pad(token_lists, rows=B, length=plan.prompt_len)
    real = np.arange(B) < len(token_lists)
    parents = np.where(np.repeat(real, W), np.repeat(np.arange(B), W), -1).astype(np.int32)
    candidates = min((1 + len(stop_ids)) * W, W * config.vocab_size)
    grammar_rows = constrained.rows_for(model, constraint, len(token_lists), rows=B * W, stop_ids=stop_ids, repeat=W)
    if grammar_rows is not None and not (stop_ids >= 0).any():
        raise ValueError("beam search with a constraint needs a stop token (stop_tokens=[] leaves a complete "
                         "constraint nothing to end with)")

    with Phase() as prefill_time:
        logits, cache = programs.prefill_paged(model.params, jax.device_put(tokens), jax.device_put(positions),
                                       jax.device_put(parents), config=config, attention=attention, num_pages=pool,
                                       page_size=page_size, max_pages=plan.max_pages, cache_dtype=cache_dtype)
        start_pages = int(cache.pages_in_use())
    with Phase() as search_time, constrained.carried(grammar_rows) as grammar:
        state = _search(model.params, cache, logits, jax.device_put(real), jax.device_put(stop_ids),
                        jnp.int32(max_new_tokens), jnp.float32(length_penalty), grammar, config=config,
                        attention=attention, early_stopping=early_stopping, num_beams=W, candidates=candidates)
        final_cache = state.cache
        state = jax.device_get(state.replace(cache=None, grammar=None))  # everything but the pools, to the host
    end_pages = int(final_cache.pages_in_use())
    if bool(state.starved) or bool(np.isnan(state.scores[:len(token_lists)]).any()):
        raise RuntimeError("the beams ran out of pages or positions; the plan should have prevented it")

    hypotheses = _hypotheses(model, state, len(token_lists), num_return_sequences, stop_ids)
    per_page = memory.page_bytes(config, page_size, cache_dtype)
    peak = max(int(state.peak), start_pages)
    steps = int(state.step)
    stats = {
        "prompt_tokens": int(sum(lengths)),  # each prompt prefilled once, not once per beam
        "num_beams": W, "page_size": page_size, "num_pages": pool, "cache_dtype": cache_dtype,
        "steps": steps,  # tokens chosen per beam before every prompt was done
        "pages_needed": plan.pages_needed,  # the planner's bound on pages in use at any time
        "pages_in_use_peak": peak, "kv_bytes_in_use_peak": peak * per_page,
        "pages_in_use_end": end_pages,
        # What W private contiguous caches of prompt + max_new_tokens slots per prompt would need.
        "kv_cache_bytes_unshared": plan.unshared_bytes,
        "kv_cache_bytes": memory.pool_bytes(config, num_pages=pool, page_size=page_size, cache_dtype=cache_dtype,
                                            rows=B * W),  # (a hybrid model's states: one row per beam)
        "prefill_s": prefill_time.run_s, "search_s": search_time.run_s,
        "compile_s": prefill_time.compile_s + search_time.compile_s,
    }
    return BeamSearchResult(hypotheses, stats)


def _hypotheses(model: Model, state: _Beams, prompts: int, per_prompt: int, stop_ids) -> list[list[Hypothesis]]:
    """The best `per_prompt` finished hypotheses of each prompt, from the final state on the host: fewer where
    fewer finished (a slot that holds none scores -1e9 or less and is no hypothesis)."""
    stop_set = {int(t) for t in stop_ids if t >= 0}
    hypotheses = []
    for b in range(prompts):
        hyps = []
        for j in np.flatnonzero(state.finished[b])[:per_prompt]:  # best first, as the scores are sorted
            row = state.hyps[b, j, :state.lengths[b, j]].tolist()
            text = model.tokenizer.decode(row, skip_special_tokens=True) if model.tokenizer is not None else None
            hyps.append(Hypothesis(tokens=row, score=float(state.scores[b, j]), logprob=float(state.sums[b, j]),
                                   finish_reason="stop" if row and row[-1] in stop_set else "length", text=text))
        hypotheses.append(hyps)
    return hypotheses


def _pool(config, lengths, num_beams, max_new_tokens, page_size, cache_dtype, max_len, num_pages):
    """The search's page plan and the pool it runs in (the plan's, or `num_pages` if that holds the worst case)."""
    plan = memory.plan_pages(config, lengths, max_new_tokens, n=num_beams, page_size=page_size,
                             cache_dtype=cache_dtype, max_len=max_len)
    if num_pages is None:
        return plan, plan.num_pages
    pool = checks.check_int("num_pages", num_pages, 1)
    if pool < plan.pages_needed:
        raise ValueError(f"{num_beams} beams of {len(lengths)} prompt(s) with max_new_tokens={max_new_tokens} "
                         f"may hold {plan.pages_needed} pages of {page_size} slots at once; num_pages={pool} "
                         f"cannot hold them")
    return plan, pool
