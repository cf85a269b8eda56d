"""The engine's device side: its state and the five compiled programs over it (`jaxkv.engine` schedules them).

The state (`State`) is one pytree of fixed shape, donated to each program, so nothing recompiles once they are
warm. S decode slots, Q staging rows, M page-table entries, P pages, V vocabulary; letters as in `jaxkv.shapes`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jaxkv import sharding
from jaxkv.cache import prefix
from jaxkv.cache.paged import PagedKVCache
from jaxkv.decoding import processing, programs, step
from jaxkv.decoding.request import MAX_TOP_LOGPROBS, STOP_ID_SLOTS
from jaxkv.model import Decoder
from jaxkv.sampling import Sampler

MAX_LOGPROBS = MAX_TOP_LOGPROBS  # top alternatives a request may ask for per token, as for `generate`
STOP_SLOTS = 4 * STOP_ID_SLOTS  # stop ids per request (padded with -1): a fixed shape for every request
FINISH_REASONS = (None, "stop", "length", "error")  # the decode step's finish codes 0..3


@flax.struct.dataclass
class State:
    """Everything the device holds between dispatches: S decode slots and R staging rows.

    cache:    the paged cache, batch S + Q: rows [0, S) are the decode slots, rows S + j the Q staging rows where
              prompts are prefilled before they move into a free slot (their pages move with them, not copied)
    staged:   float32[Q, V], the last prompt token's logits of each staging row whose prefill is complete
    logits:   float32[S, V], what each decoding slot samples its next token from
    keys:     uint32[S, 2], each slot's PRNG key, split once per token drawn
    decoding: bool[S], the slot holds a request that has not finished
    sampler:  `Sampler` with one setting per slot
    stop_ids: int32[S, STOP_SLOTS], padded with -1
    budget:   int32[S], tokens the slot's request may still emit
    top:      int32[S], top alternatives wanted per token (0: none)
    spec:     with speculation, the per-slot `jaxkv.engine.speculative.Slots` (each slot's last token, its
              history, its acceptance estimate); else None
    draft:    with a draft model proposing, its paged cache: only its pools are used, always under the main
              cache's page tables and lengths (`draft_rows`), so the draft's K/V of a token lives in the same page
              and slot as the target's and every page the target reserves, moves or frees carries the draft's too;
              its own tables stay empty. With the MTP proposer, the module's one-layer paged cache, used alike
              (the module's K/V for the pair (h_t, token_{t+1}) in the slot of position t). Else None
    staged_hidden: with the MTP proposer, float[Q, D] the target's hidden state (after its final norm) at each
              staging row's last prompt token: the module's first pair once the first token is drawn. Else None
    processing: each slot's logits-processing state (`jaxkv.decoding.processing.Processing`: penalties, logit
              bias, min_tokens; its token counts), rows [0, S)
    staged_processing: the same for the Q staging rows: set at `admit` (and `mark_prompt`), taken by the slot a
              request moves into (its counts still zero)
    grammar:  for a model with a tokenizer, each slot's constraint mask (`jaxkv.decoding.constrained.Grammar`,
              int32[S, ceil(V / 32)], all ones for an unconstrained slot; its handle names the engine's host-side
              matchers); else None
    constrained: bool[S], the slot's request has a constraint (with `grammar`; else None)
    """

    cache: PagedKVCache
    staged: jax.Array
    logits: jax.Array
    keys: jax.Array
    decoding: jax.Array
    sampler: Sampler
    stop_ids: jax.Array
    budget: jax.Array
    top: jax.Array
    spec: Any = None
    draft: Any = None
    staged_hidden: Any = None
    processing: Any = None
    staged_processing: Any = None
    grammar: Any = None
    constrained: Any = None


def finish_code(finished, nan, stopped):
    """int32[...] `FINISH_REASONS` codes: 0 going on, else 3 NaN logits, 1 a stop, 2 out of budget."""
    return jnp.where(finished, jnp.where(nan, 3, jnp.where(stopped, 1, 2)), 0)


def placed(state: State, mesh) -> State:
    """On a mesh, the cache keeps its layout (pools split over KV heads; `sharding.paged_cache_shardings`)."""
    return state.replace(cache=sharding.constrain_cache(state.cache, mesh))


def _free_pages(state: State) -> jax.Array:
    return jnp.sum(state.cache.refcounts == 0, dtype=jnp.int32)


def rows_of(cache: PagedKVCache, rows) -> PagedKVCache:
    """The cache's rows `rows` (int32[n], -1: an empty row) as a batch of their own over the same pools
    (`PagedKVCache.take_rows`: tables, lengths, flags and a hybrid model's states)."""
    return cache.take_rows(rows)


def draft_rows(draft: PagedKVCache, sub: PagedKVCache, lengths=None) -> PagedKVCache:
    """The draft's pools under the main cache's rows `sub` (their tables; `lengths`, else sub's): a cache the
    draft model writes and reads where the target's tokens live. Its tables must already hold a page for every
    slot the draft will write (the target's forward, or a `reserve`, took them), so the draft's own `reserve`
    takes nothing; what it does to the tables and counts is dropped (`draft_pools`)."""
    return dataclasses.replace(sub, keys=draft.keys, values=draft.values, key_scales=draft.key_scales,
                               value_scales=draft.value_scales,
                               lengths=sub.lengths if lengths is None else lengths)


def draft_pools(draft: PagedKVCache, view: PagedKVCache) -> PagedKVCache:
    """The pools the draft wrote through `view` (`draft_rows`) back into the draft's cache."""
    return dataclasses.replace(draft, keys=view.keys, values=view.values, key_scales=view.key_scales,
                               value_scales=view.value_scales)


def put_rows(cache: PagedKVCache, rows, sub: PagedKVCache) -> PagedKVCache:
    """`sub` (from `rows_of(cache, rows)`, then used) back into the cache: its pools and counts, its rows."""
    return cache.put_rows(rows, sub)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def admit(state: State, row, table_row, length, penalties, states=None, *, mesh=None):
    """A request into staging row `row` of the cache: its page-table row holds the pages of its cached prefix
    (`length` slots), each taking a reference. `penalties`: its `Penalties` (one row), its prompt unmarked (see
    `mark_prompt`). `states`: a hybrid model's (conv, recurrent) state rows [1, ...] per layer to resume from (the
    prefix cache's snapshot at `length`, zeros without a hit); None: the row's own (zeroed at its release)."""
    cache = state.cache
    cache = dataclasses.replace(cache, page_table=cache.page_table.at[row].set(table_row),
                                lengths=cache.lengths.at[row].set(length),
                                overflowed=cache.overflowed.at[row].set(False),
                                refcounts=cache.count_pages(table_row, +1, cache.refcounts))
    if states is not None:
        cache = cache.with_row_states(row[None], *states)
    j = row - state.logits.shape[0]
    staged = state.staged_processing
    staged = staged.replace(penalties=jax.tree.map(lambda all_rows, one: all_rows.at[j].set(one[0]),
                                                   staged.penalties, penalties),
                            prompt=staged.prompt.at[j].set(False))
    state = placed(state.replace(cache=cache, staged_processing=staged), mesh)
    return state, _free_pages(state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def mark_prompt(state: State, row, ids, *, mesh=None):
    """Staging row `row`'s prompt tokens (int32[n], -1 padding) marked for its repetition penalty: only requests
    with one pay for this."""
    j = row - state.logits.shape[0]
    staged = state.staged_processing
    prompt = staged.prompt.at[j].set(processing.mark(staged.prompt[j][None], ids[None])[0])
    return placed(state.replace(staged_processing=staged.replace(prompt=prompt)), mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "draft_config"), donate_argnames=("state",))
def prefill(params, state: State, rows, tokens, counts, draft=None, mtp=None, *, config, mesh=None,
            draft_config=None):
    """One prompt chunk per prefill row: tokens int32[R, C] (right-padded; counts int32[R] real, 0: no chunk)
    into staging rows `rows` int32[R] (cache rows S + j; -1: none), attending over the row's pages so far. Each
    row's last token's logits go to `staged[j]` (what the slot it moves to samples from first, once its prompt is
    complete). A chunk attends over its own fresh K/V and over the row's earlier slots as stored (`Decoder`'s
    `chunk`): a prompt prefilled in one chunk with no cached prefix reads nothing quantized, as generate's
    prefill.

    draft: with a draft model (`State.draft`; its `draft_config`), (its params, int32[R, C] its chunk, int32[R]
    its counts, int32[R] the slots it has written per row) -> the draft's chunk into its pools under the same
    rows, after the target's, which has reserved every page it needs: the draft's chunks start at slot 0 even
    after a prefix-cache hit (the cached pages hold the target's K/V; the draft's of an earlier request there are
    not relied on), so they trail the target's and never pass it.

    mtp: with the MTP proposer (`State.draft` its module's pools; `draft_config` its config), (the module's
    params, int32[R, C] the token after each chunk token, -1 after the prompt's last) -> the module fed the pairs
    (the chunk's hidden states, the next tokens) at the chunk's positions, under the same rows; the last prompt
    token's hidden state goes to `staged_hidden` (its pair waits for the first drawn token). After a prefix-cache
    hit the module's K/V over the cached pages are those an earlier request wrote (the same pairs but at the last
    cached position, whose next token may differ): only how many proposals are kept can depend on it."""
    from jaxkv.decoding.mtp import mtp_forward

    R, C = tokens.shape
    sub = rows_of(state.cache, rows)
    t = jnp.arange(C, dtype=jnp.int32)[None, :]
    positions = jnp.where(t < counts[:, None], sub.lengths[:, None] + t, -1)  # [R, C], -1: padding
    # XLA attention: the Pallas paged kernel takes one query per sequence.
    out = Decoder(config, mesh).apply({"params": params}, tokens, positions, sub, last_only=True, attention="xla",
                                      chunk=True, return_hidden=mtp is not None)
    (logits, new), hidden = (out[:2], out[2]) if mtp is not None else (out, None)
    S, Q = state.logits.shape[0], state.staged.shape[0]
    staging = jnp.where(counts > 0, rows - S, Q)  # out of range where a row has no chunk: dropped
    staged = state.staged.at[staging].set(logits[:, 0], mode="drop")
    state = state.replace(cache=put_rows(state.cache, rows, new), staged=staged)
    if mtp is not None:
        mtp_params, nexts = mtp
        view = draft_rows(state.draft, rows_of(state.cache, rows), sub.lengths)
        pairs = jnp.where(nexts >= 0, positions, -1)
        _, _, view = mtp_forward(mtp_params, params, hidden, jnp.maximum(nexts, 0), pairs, view,
                                 config=draft_config, attention="xla")
        last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
        state = state.replace(draft=draft_pools(state.draft, view),
                              staged_hidden=state.staged_hidden.at[staging].set(last, mode="drop"))
    if draft is not None:
        draft_params, draft_tokens, draft_counts, draft_written = draft
        view = draft_rows(state.draft, rows_of(state.cache, rows), jnp.where(rows >= 0, draft_written, 0))
        draft_positions = jnp.where(t < draft_counts[:, None], view.lengths[:, None] + t, -1)
        _, view = Decoder(draft_config).apply({"params": draft_params}, draft_tokens, draft_positions, view,
                                              last_only=True, attention="xla", chunk=True)
        state = state.replace(draft=draft_pools(state.draft, view))
    state = placed(state, mesh)
    return state, _free_pages(state)


def shift_slots(state: State, shifts) -> State:
    """Slot s takes over the request decoding in slot shifts[s] (-1: none): its page-table row, length and
    per-slot state move (no page is copied or recounted) and the source slot empties. Destinations are free slots
    and sources decoding ones (the host's compaction), so the two sets are disjoint."""
    S = state.logits.shape[0]
    moving = shifts >= 0
    src = jnp.maximum(shifts, 0)
    emptied = jnp.where(moving, src, S)
    cache = state.cache.move_rows(jnp.where(moving, jnp.arange(S, dtype=jnp.int32), -1), src)

    def pick(x):
        return jnp.where(moving.reshape((S,) + (1,) * (x.ndim - 1)), x[src], x)

    decoding = pick(state.decoding).at[emptied].set(False, mode="drop")
    return state.replace(cache=cache, logits=pick(state.logits), keys=pick(state.keys), decoding=decoding,
                         sampler=jax.tree.map(pick, state.sampler), stop_ids=pick(state.stop_ids),
                         budget=pick(state.budget), top=pick(state.top),
                         processing=jax.tree.map(pick, state.processing),
                         grammar=None if state.grammar is None else state.grammar.replace(
                             allowed=pick(state.grammar.allowed)),
                         constrained=jax.tree.map(pick, state.constrained),
                         spec=None if state.spec is None else state.spec.moved(pick))


def move_in(state: State, moves, keys, sampler: Sampler, stop_ids, budget, top, grammar=None) -> State:
    """Slot s takes the request prefilled in staging row moves[s] (-1: none) with its settings: the staging row's
    page-table row and length move to the slot (no page is copied or recounted) and the staging row empties.
    `grammar`: (int32[S, ceil(V / 32)] the first token's masks, bool[S] constrained) of the slots moved into
    (None: the engine has no masks)."""
    S = state.logits.shape[0]
    moving = moves >= 0
    # the staging row's cache row moves to the slot (tables, lengths, states); the staging row empties
    cache = state.cache.move_rows(jnp.where(moving, jnp.arange(S, dtype=jnp.int32), -1), S + jnp.maximum(moves, 0))

    def pick(new, old):
        return jnp.where(moving.reshape((S,) + (1,) * (old.ndim - 1)), new, old)

    staged = jax.tree.map(lambda x: x[jnp.maximum(moves, 0)], state.staged_processing)
    if grammar is not None:
        state = state.replace(grammar=state.grammar.replace(allowed=pick(grammar[0], state.grammar.allowed)),
                              constrained=pick(grammar[1], state.constrained))
    return state.replace(cache=cache, logits=pick(state.staged[jnp.maximum(moves, 0)], state.logits),
                         keys=pick(keys, state.keys), decoding=state.decoding | moving,
                         sampler=jax.tree.map(pick, sampler, state.sampler), stop_ids=pick(stop_ids, state.stop_ids),
                         budget=pick(budget, state.budget), top=pick(top, state.top),
                         processing=jax.tree.map(pick, staged, state.processing))


@functools.partial(jax.jit, static_argnames=("config", "attention", "steps", "width", "mesh"),
                   donate_argnames=("state",))
def decode(params, state: State, shifts, moves, keys, sampler, stop_ids, budget, top, grammar=None, *, config,
           attention, steps: int, width: int, mesh=None):
    """Moves decoding requests down into free slots (`shift_slots`), prefilled requests into free slots (`move_in`),
    then `steps` decode steps over slots [0, width) ->
    (state, per step: int32[S] tokens (-1: the slot did not decode), float32[S] their log-probabilities, the top
    alternatives, int32[S] finish codes (FINISH_REASONS)), int32[] free pages).

    Only the first `width` (W) slots are computed: the host packs requests into the lowest free slots and picks the
    smallest compiled width holding every decoding slot, so a lightly loaded engine does not pay for its empty
    slots (a decode step's cost grows with its batch). Slots at or past W must not be decoding.

    `grammar`: the moved-in slots' first masks (`move_in`). While a decoding slot is constrained, each step applies
    the slots' masks and then asks the host (one io_callback: `constrained.Grammar.advance`) to feed the slots'
    matchers their tokens and fill the next masks; a step with no constrained slot does neither (lax.cond)."""
    state = move_in(shift_slots(state, shifts), moves, keys, sampler, stop_ids, budget, top, grammar)
    S, W = state.logits.shape[0], width
    slots = jnp.arange(W, dtype=jnp.int32)

    def live(state):
        run, logits_w = state.decoding[:W], state.logits[:W]
        sampler_w = jax.tree.map(lambda x: x[:W], state.sampler)
        processing_w = jax.tree.map(lambda x: x[:W], state.processing)
        split = jax.vmap(jax.random.split)(state.keys[:W])  # [W, 2, key]: (the next key, this token's key)
        # The one decode step: NaN rows (the model could not place the row's last token) get -1 and stop; the
        # top alternatives are read only when a decoding slot asked for them.
        constrained_w = None if state.grammar is None else run & state.constrained[:W]
        any_constrained = None if state.grammar is None else jnp.any(constrained_w)
        picked = step.select(logits_w, split[:, 1], sampler_w, state.stop_ids[:W], top=MAX_LOGPROBS,
                             top_wanted=jnp.any(run & (state.top[:W] > 0)), processing=processing_w,
                             allowed=None if state.grammar is None else state.grammar.allowed[:W],
                             constrained=any_constrained)
        processing_w = processing_w.advance(picked.tokens, run & picked.valid)
        tokens, nan, stopped = picked.tokens, picked.nan, picked.stopped
        grammar = state.grammar
        if grammar is not None:  # the host feeds the constrained slots' matchers; a complete constraint stops
            def advance(grammar):
                emitted = constrained_w & picked.valid & ~picked.stopped
                grammar, ended = grammar.advance(jnp.zeros((S,), jnp.int32).at[:W].set(tokens),
                                                 jnp.zeros((S,), bool).at[:W].set(emitted))
                return grammar, ended[:W]

            grammar, ended = lax.cond(any_constrained, advance, lambda g: (g, jnp.zeros((W,), bool)), grammar)
            stopped = stopped | ended
        chosen, top_ids, top_logp = picked.logprob, picked.top_ids, picked.top_logprobs
        budget = state.budget[:W] - run
        finished = run & (stopped | (budget <= 0))
        going = run & ~finished

        def forward(state):
            # The first W slots as a batch of their own: the staging rows take no part in decoding.
            sub = rows_of(state.cache, slots)
            logits, sub = programs.forward(params, jnp.where(going, tokens, 0)[:, None], sub, config=config,
                                   attention=attention, active=going, mesh=mesh)
            return logits[:, 0], put_rows(state.cache, slots, sub)

        # The last token of a request is never fed back: a step where every slot finishes runs no model.
        logits, cache = lax.cond(jnp.any(going), forward, lambda s: (s.logits[:W], s.cache), state)
        # A finished request's pages are free at once (for the next admissions).
        cache = cache.release(jnp.zeros((cache.batch,), bool).at[:W].set(finished))
        code = finish_code(finished, nan, stopped)
        keys = jnp.where(run[:, None], split[:, 0], state.keys[:W])
        state = state.replace(cache=cache, logits=state.logits.at[:W].set(logits), keys=state.keys.at[:W].set(keys),
                              decoding=state.decoding.at[:W].set(going), budget=state.budget.at[:W].set(budget),
                              grammar=grammar,
                              processing=jax.tree.map(lambda x, w: x.at[:W].set(w), state.processing,
                                                      processing_w))
        state = placed(state, mesh)

        def full(x, fill):  # [W, ...] -> [S, ...]: the slots past W did not decode
            return jnp.full((S,) + x.shape[1:], fill, x.dtype).at[:W].set(x)

        return state, (full(jnp.where(run, tokens, -1), -1), full(chosen, 0), full(top_ids, 0), full(top_logp, 0),
                       full(code, 0))

    def idle(state):
        return state, (jnp.full((S,), -1, jnp.int32), jnp.zeros((S,), jnp.float32),
                       jnp.zeros((S, MAX_LOGPROBS), jnp.int32), jnp.zeros((S, MAX_LOGPROBS), jnp.float32),
                       jnp.zeros((S,), jnp.int32))

    def one_step(state, _):
        return lax.cond(jnp.any(state.decoding), live, idle, state)

    state, out = lax.scan(one_step, state, None, length=steps)
    return state, out, _free_pages(state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def release(state: State, rows, *, mesh=None):
    """Cache rows where `rows` (bool[S + Q]) is true drop their pages; such slots stop decoding."""
    S = state.logits.shape[0]
    state = placed(state.replace(cache=state.cache.release(rows), decoding=state.decoding & ~rows[:S]), mesh)
    return state, _free_pages(state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def refs(state: State, pages, delta, *, mesh=None):
    """refcounts[pages] += delta (int32[n] pages, -1 entries ignored): the prefix cache's index references."""
    cache = state.cache
    flat = jnp.where(pages >= 0, pages, cache.num_pages)
    cache = dataclasses.replace(cache, refcounts=cache.refcounts.at[flat].add(delta, mode="drop"))
    state = placed(state.replace(cache=cache), mesh)
    return state, _free_pages(state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def restore(state: State, pages, data, *, mesh=None):
    """Blocks copied back from the prefix cache's host tier (`PrefixCache.take_host`: [n, ...] per layer) into
    free `pages` (int32[n]) of the pool, each with the prefix index's reference -> (state, free pages)."""
    cache = state.cache
    (keys, values, key_scales, value_scales), refcounts = prefix.put_pages(
        (cache.keys, cache.values, cache.key_scales, cache.value_scales), cache.refcounts, pages, data)
    cache = dataclasses.replace(cache, keys=keys, values=values, key_scales=key_scales, value_scales=value_scales,
                                refcounts=refcounts)
    state = placed(state.replace(cache=cache), mesh)
    return state, _free_pages(state)


@functools.partial(jax.jit, static_argnames=("config", "batch", "num_pages", "page_size", "max_len", "dtype"))
def allocate(config, batch, *, num_pages, page_size, max_len, dtype):
    return PagedKVCache.allocate(config, batch, num_pages=num_pages, page_size=page_size, max_len=max_len,
                                 dtype=dtype)
