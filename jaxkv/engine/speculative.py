"""The engine's decode program with speculation (`Engine(..., speculative=jaxkv.Speculation("ngram"))`).

The plain program keeps each slot's next-token logits and, each step, samples from them and feeds the token
back. Here a slot keeps its last emitted token instead (`Slots.last`), because a verify's last emitted token
(the residual or bonus draw) has no logits yet: each pass feeds every decoding slot's last token, and a slot
that speculates also feeds its k proposals behind it (k + 1 positions, `speculation.verify` per slot), so one
forward pass over the dispatch's W slots emits 1 token for a slot that does not speculate and up to k + 1 for
one that does. Every slot keeps its own count of accepted proposals (the paged cache's lengths are per row),
rewinds to its kept slots and gives back the pages its rejected tokens took (`PagedKVCache.rewind`).

A sampled slot's tokens depend on its own state only, never on the batch: whether it speculates is its own
adaptive rule (its running acceptance estimate, its own probe counters), and its PRNG key is split once per pass
it runs whatever kind of pass that is, so a request draws what it draws alone in the engine. A non-speculating
slot in a verify pass draws its token from the same logits (its first position) as in a plain pass. A greedy
slot's tokens are the argmax whatever the pass, so it also joins any verify pass when it has a match (free: the
pass costs the same), which keeps the greedy slots' probes in step.

Letters as in `jaxkv.shapes`: S slots, W computed slots, k proposals, H history entries, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention.pallas import MAX_DECODE_QUERIES
from jaxkv.decoding import speculation, step
from jaxkv.decoding.programs import apply as decoder_apply
from jaxkv.decoding.mtp import mtp_forward
from jaxkv.engine.programs import (MAX_LOGPROBS, State, draft_pools, draft_rows, finish_code, move_in, placed,
                                   put_rows, rows_of, shift_slots)
from jaxkv.model import Decoder


# A verify whose greedy slots kept more than this above their estimates (on average, as a fraction of k) is
# followed by another at once while their estimates climb towards paying: a load the proposer predicts well is
# found within a few passes of the first probe instead of a backed-off wait later.
RISING = 0.05

# What `decode` counts per dispatch: proposals verified, proposals kept, verify passes, forward passes, slots
# decoding summed over passes, tokens those passes emitted (a request's first token, from its prefill, not counted).
COUNTERS = ("spec_proposed", "spec_accepted", "spec_verifies", "target_forwards", "decode_rows_used",
            "pass_tokens")


@flax.struct.dataclass
class Slots:
    """Per-slot speculation state, beside `programs.State` (`State.spec`).

    last:    int32[S], the slot's last emitted token, fed at its next pass.
    history: int32[S, H], the slot's tokens so far (prompt, then output) in its first `length[s]` entries.
    length:  int32[S].
    rate:    float32[S], the running estimate of the fraction of its proposals kept.
    idle:    int32[S], passes since it last verified; wait: int32[S], passes before its next probe (a sampled
             slot's own probe clock).
    probe_idle, probe_wait: int32[], the greedy slots' shared probe clock (passes since they last verified,
             passes before they probe together).
    mtp_hidden, mtp_tokens, mtp_count: with the MTP proposer, each slot's pairs (h_t, token_{t+1}) not yet fed
             to the module ([S, k + 1, D] the target's hidden states after its final norm, int32[S, k + 1] the
             tokens after them, int32[S] how many are real): what its last pass kept, fed at the start of its next
             pass, so the module runs one position behind the target. Else None.
    """

    last: jax.Array
    history: jax.Array
    length: jax.Array
    rate: jax.Array
    idle: jax.Array
    wait: jax.Array
    probe_idle: jax.Array
    probe_wait: jax.Array
    mtp_hidden: jax.Array | None = None
    mtp_tokens: jax.Array | None = None
    mtp_count: jax.Array | None = None

    @classmethod
    def empty(cls, slots: int, width: int, mtp: tuple | None = None) -> "Slots":
        """`mtp`: (k, D, the hidden states' dtype) with the MTP proposer."""
        def z():  # (one buffer each: the state is donated)
            return jnp.zeros((slots,), jnp.int32)

        pairs = {} if mtp is None else dict(mtp_hidden=jnp.zeros((slots, mtp[0] + 1, mtp[1]), mtp[2]),
                                            mtp_tokens=jnp.zeros((slots, mtp[0] + 1), jnp.int32), mtp_count=z())
        return cls(last=z(), history=jnp.zeros((slots, width), jnp.int32), length=z(),
                   rate=jnp.zeros((slots,), jnp.float32), idle=z(), wait=z(),
                   probe_idle=jnp.zeros((), jnp.int32), probe_wait=jnp.zeros((), jnp.int32), **pairs)

    def moved(self, pick) -> "Slots":
        """The per-slot fields through `pick` (`programs.shift_slots`, `move_in`); the shared clock stays."""
        return self.replace(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)
                               if not f.name.startswith("probe_") and getattr(self, f.name) is not None})


@functools.partial(jax.jit, static_argnames=("config", "attention", "steps", "width", "plan", "mesh", "draft_config",
                                            "draft_attention"),
                   donate_argnames=("state",))
def decode(params, state: State, shifts, moves, keys, sampler, stop_ids, budget, top, prompts, prompt_lengths,
           draft_params=None, grammar=None, *, config, attention, steps: int, width: int, plan, mesh=None,
           draft_config=None, draft_attention=None):
    """`programs.decode` with speculation: moves, then the slots that just moved in draw their first token from
    their prefill's logits, then `steps` passes over slots [0, width) ->
    (state, per emitted position: int32[1 + steps (k + 1), S] tokens (-1: none), their log-probabilities, top
    alternatives and finish codes, int32[] free pages, int32[6] `COUNTERS`). prompts int32[S, H] /
    prompt_lengths int32[S]: each moving slot's prompt (the n-gram proposer's history; other rows ignored).
    plan: the checked `speculation.Plan`. Method "draft": draft_params / draft_config / draft_attention the
    draft model's, its pools in `state.draft` (its prompt prefilled there by `programs.prefill`). Method "mtp":
    the same three of the checkpoint's first MTP module (`Model.mtp`), its pools in `state.draft` (the prompt's
    pairs written by `programs.prefill`, the last one's hidden state in `state.staged_hidden`); each slot's
    pending pairs in `Slots.mtp_*`. `grammar`: the moved-in slots' first masks (`programs.decode`); while a
    decoding slot is constrained, every draw is masked (a verify's k + 1 positions by the masks after each
    proposal the constraint allows, `Rows.draft_masks`) and each pass's kept tokens go to the host's matchers
    (`settle`), a completed constraint ending its slot there."""
    S, W, k = state.logits.shape[0], width, plan.num_tokens
    drafting, mtp = plan.method == "draft", plan.method == "mtp"
    cost = plan.cost_at(W)  # c_verify / c_step of a verify over W slots
    # A verify writes k slots past the last token: within the target's positions and the draft's
    max_positions = min(config.max_positions, draft_config.max_positions) if drafting else config.max_positions
    moving = moves >= 0
    state = move_in(shift_slots(state, shifts), moves, keys, sampler, stop_ids, budget, top, grammar)
    # A slot that moves in has one pending pair: its last prompt position's hidden state (its prefill's), and the
    # first token, drawn below.
    moved_hidden = state.staged_hidden[jnp.maximum(moves, 0)] if mtp else None  # [S, D]
    spec = state.spec
    spec = spec.replace(history=jnp.where(moving[:, None], prompts, spec.history),
                        length=jnp.where(moving, prompt_lengths, spec.length),
                        rate=jnp.where(moving, speculation.INITIAL_RATE, spec.rate),
                        idle=jnp.where(moving, 0, spec.idle),
                        wait=jnp.where(moving, speculation.PROBE_EVERY, spec.wait))
    state = state.replace(spec=spec)
    slots = jnp.arange(W, dtype=jnp.int32)
    top_wanted = jnp.any(state.decoding[:W] & (state.top[:W] > 0))
    hybrid = config.linear_attention is not None  # a verify keeps the states after each slot's kept tokens

    def w(x):  # the first W slots
        return x[:W]

    def full(x, fill):  # [W, ...] -> [S, ...]: the slots past W did not decode
        return jnp.full((S,) + x.shape[1:], fill, x.dtype).at[:W].set(x)

    def constrained_now(state):
        """bool[]: a decoding slot is constrained (None: the engine has no masks)."""
        return None if state.grammar is None else jnp.any(w(state.decoding) & w(state.constrained))

    def allowed(state):
        return None if state.grammar is None else w(state.grammar.allowed)

    def settle(state, run, tokens, count, nan, stopped, logprob, top_ids, top_logp):
        """Records a pass's tokens per slot (tokens [W, T], the first count[s] emitted), ends the slots that
        stopped or ran out of budget (their pages released) -> (state, the pass's outputs as [T, S] blocks).
        The constrained slots' kept tokens go to their matchers first; one whose constraint they complete ends
        at that token."""
        T = tokens.shape[1]
        if state.grammar is not None:
            def feed(grammar):
                grammar, ended_at = grammar.advance_verified(
                    jnp.zeros((S, T), jnp.int32).at[:W].set(tokens),
                    jnp.full((S,), -1, jnp.int32).at[:W].set(jnp.where(run, count - 1, -1)))
                return grammar, ended_at[:W]

            grammar, ended_at = lax.cond(constrained_now(state), feed,
                                         lambda g: (g, jnp.full((W,), -1, jnp.int32)), state.grammar)
            hit = run & (ended_at >= 0)
            count = jnp.where(hit, jnp.minimum(count, ended_at + 1), count)
            stopped = stopped | hit
            state = state.replace(grammar=grammar)
        budget = w(state.budget) - count
        finished = run & (stopped | (budget <= 0))
        emitted = jnp.arange(T)[None, :] < count[:, None]
        last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        spec = state.spec
        history, length = speculation.append_history(w(spec.history), w(spec.length), tokens, count)
        spec = spec.replace(last=spec.last.at[:W].set(jnp.where(run & ~finished, last, w(spec.last))),
                            history=spec.history.at[:W].set(history), length=spec.length.at[:W].set(length))
        cache = state.cache.release(jnp.zeros((state.cache.batch,), bool).at[:W].set(finished))
        state = state.replace(cache=cache, decoding=state.decoding.at[:W].set(jnp.where(run, ~finished,
                                                                                        w(state.decoding))),
                              budget=state.budget.at[:W].set(budget), spec=spec)
        code = finish_code(finished, nan, stopped)
        code = jnp.where(jnp.arange(T)[None, :] == count[:, None] - 1, code[:, None], 0)  # at its last token

        def block(x, fill):  # [W, T, ...] -> [T, S, ...]
            return jnp.swapaxes(full(x, fill), 0, 1)

        out = (block(jnp.where(emitted & run[:, None], tokens, -1), -1), block(logprob, 0), block(top_ids, 0),
               block(top_logp, 0), block(code, 0))
        return placed(state, mesh), out

    def pend(state, which, hidden, tokens, count):
        """Slots `which` (bool[W]) get their pending MTP pairs: hidden [W, T, D], tokens int32[W, T], the first
        count[w] real (T <= k + 1; padded)."""
        spec = state.spec
        pad = k + 1 - tokens.shape[1]
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).astype(spec.mtp_hidden.dtype)
        tokens = jnp.pad(jnp.maximum(tokens, 0), ((0, 0), (0, pad)))

        def put(field, new):
            old = getattr(spec, field)
            return old.at[:W].set(jnp.where(which.reshape((W,) + (1,) * (new.ndim - 1)), new, old[:W]))

        return state.replace(spec=spec.replace(mtp_hidden=put("mtp_hidden", hidden),
                                               mtp_tokens=put("mtp_tokens", tokens),
                                               mtp_count=put("mtp_count", count)))

    # The slots that just moved in: their first token, from their prefill's logits (as the plain program's
    # first step draws it).
    run = w(state.decoding & moving)
    split = jax.vmap(jax.random.split)(w(state.keys))  # [W, 2, key]: (the next key, this token's key)
    picked = step.select(w(state.logits), split[:, 1], jax.tree.map(w, state.sampler), w(state.stop_ids),
                         top=MAX_LOGPROBS, top_wanted=top_wanted, allowed=allowed(state),
                         constrained=constrained_now(state))
    state = state.replace(keys=state.keys.at[:W].set(jnp.where(run[:, None], split[:, 0], w(state.keys))))
    state, first = settle(state, run, picked.tokens[:, None], run.astype(jnp.int32), picked.nan, picked.stopped,
                          picked.logprob[:, None], picked.top_ids[:, None], picked.top_logprobs[:, None])
    if mtp:
        state = pend(state, w(moving), w(moved_hidden)[:, None], picked.tokens[:, None], run.astype(jnp.int32))

    def decide(state) -> Pass:
        """What the next pass does, from the state alone (so a sampled slot's choice is its own whatever ran
        before it in the dispatch)."""
        run = w(state.decoding)
        spec = state.spec
        split = jax.vmap(jax.random.split)(w(state.keys))
        if drafting or mtp:  # these proposers always have proposals; drafted only in a verify pass (`check`)
            proposals, found = jnp.zeros((W, k), jnp.int32), jnp.ones((W,), bool)
        else:
            proposals, found = speculation.ngram_propose(w(spec.history), w(spec.length), k, plan.ngram_min,
                                                         plan.ngram_max)
        rate_before = w(spec.rate)
        gain = speculation.expected_tokens(rate_before, k)
        # Room for the lookahead: two tokens of budget left, and k positions past the last within the model's.
        lengths = w(state.cache.lengths)
        room = run & (w(state.budget) >= 2) & (lengths + k + 1 <= max_positions)
        candidate = found & room  # could speculate this pass
        greedy = jnp.broadcast_to(jnp.asarray(w(state.sampler.temperature)) <= 0.0, (W,))
        # A sampled slot follows its own rule, at one sequence's verify cost, with its own probe clock: its draws
        # must not depend on what shares the batch (a sampled request draws what it draws alone).
        sampled = candidate & ~greedy & (~jnp.bool_(plan.adaptive) | (gain >= plan.verify_cost)
                                         | (w(spec.idle) >= w(spec.wait)))
        # The greedy slots decide together (their tokens are the argmax whichever kind of pass draws them): a
        # verify of this width pays when the tokens it is expected to add, summed over the greedy candidates,
        # beat what it costs beyond a plain pass for every running slot (at one slot: the sampled slot's rule),
        # or their shared probe clock is due. They join any verify pass (free: the pass costs the same whoever
        # fills its positions).
        together = greedy & candidate
        running = jnp.sum(run)
        pays = extra(together, gain) >= running * (cost - 1.0)
        probe = (spec.probe_idle >= spec.probe_wait) & jnp.any(together)
        verifying = jnp.any(sampled) | jnp.where(plan.adaptive, pays | probe, jnp.any(together))
        wants = (sampled | together) & verifying
        return Pass(run=run, split=split, proposals=proposals, rate_before=rate_before, greedy=greedy,
                    together=together, running=running, verifying=verifying, wants=wants)

    def forward(state, inputs, real, steps=False):
        """-> (logits, the cache, and with the MTP proposer the hidden states [W, T, D] the head read, with `steps`
        a hybrid model's states after each position)."""
        sub = rows_of(state.cache, slots)
        positions = jnp.where(real, sub.lengths[:, None] + jnp.arange(inputs.shape[1])[None, :], -1)
        # (a verify's k + 1 queries go through the paged decode kernel too, up to its query block)
        out = decoder_apply(params, jnp.where(real, inputs, 0), positions, sub, config=config, mesh=mesh,
                            attention=attention if inputs.shape[1] <= MAX_DECODE_QUERIES else "xla",
                            return_hidden=mtp, step_states=steps)
        return (out[0], put_rows(state.cache, slots, out[1])) + tuple(out[2:])

    def mtp_feed(state, run):
        """Every running slot's pending pairs into the module (under the slot's pages, at the positions just
        below the target's length: the module runs one behind) -> (state, float32[W, V] the module's logits
        after each slot's last pair: its first proposal's q, [W, D] its h' there: the chain's next input)."""
        spec = state.spec
        count = jnp.where(run, w(spec.mtp_count), 0)
        lengths = w(state.cache.lengths) - count
        T = k + 1
        i = jnp.arange(T)[None, :]
        positions = jnp.where(i < count[:, None], lengths[:, None] + i, -1)
        view = draft_rows(state.draft, rows_of(state.cache, slots), lengths)
        logits, h, view = mtp_forward(draft_params, params, w(spec.mtp_hidden), w(spec.mtp_tokens), positions,
                                      view, config=draft_config, attention=draft_attention)
        last = jnp.maximum(count - 1, 0)[:, None, None]
        state = state.replace(draft=draft_pools(state.draft, view),
                              spec=spec.replace(mtp_count=spec.mtp_count.at[:W].set(
                                  jnp.where(run, 0, w(spec.mtp_count)))))
        return (state, jnp.take_along_axis(logits, last, axis=1)[:, 0],
                jnp.take_along_axis(h, last, axis=1)[:, 0])

    def draft_step(state, tokens, real, lengths):
        """One draft token per row (tokens int32[W], real bool[W]) at slot lengths[w], under the rows'
        tables (which hold a page for it) -> (float32[W, V] the draft's logits, state)."""
        view = draft_rows(state.draft, rows_of(state.cache, slots), lengths)
        positions = jnp.where(real, lengths, -1)[:, None]
        logits, view = Decoder(draft_config).apply({"params": draft_params}, jnp.where(real, tokens, 0)[:, None],
                                                   positions, view, attention=draft_attention)
        return logits[:, 0], state.replace(draft=draft_pools(state.draft, view))

    def plain(state, d: Pass):
        """One token per running slot, drawn as the plain program draws it -> `check`'s results at T = 1."""
        run, sampler_w = d.run, jax.tree.map(w, state.sampler)
        lengths = w(state.cache.lengths)
        if mtp:  # the module is fed at every pass, so that it stays one position behind
            state = mtp_feed(state, run)[0]
        logits, cache, *hidden = forward(state, w(state.spec.last)[:, None], run[:, None])
        if drafting:  # the draft's cache keeps every token the target's does
            state = draft_step(state.replace(cache=cache), w(state.spec.last), run, lengths)[1]
        picked = step.select(logits[:, 0], d.split[:, 1], sampler_w, w(state.stop_ids), top=MAX_LOGPROBS,
                             top_wanted=top_wanted, allowed=allowed(state), constrained=constrained_now(state))
        if mtp:  # the pair (h at the fed token, the token drawn after it) waits for the next pass
            state = pend(state, run, hidden[0], picked.tokens[:, None], run.astype(jnp.int32))
        return (state.replace(cache=cache), run.astype(jnp.int32), picked.tokens[:, None], picked.nan,
                picked.stopped, picked.logprob[:, None], picked.top_ids[:, None], picked.top_logprobs[:, None],
                jnp.zeros((W,), jnp.int32))

    def check(state, d: Pass):
        """A verify pass: each slot that wants to speculate feeds its last token and its k proposals, the
        others their last token alone -> (state, count[W] tokens emitted, tokens [W, k + 1], nan, stopped,
        their log-probabilities and top alternatives, kept[W] proposals kept)."""
        run, wants, pass_keys, sampler_w = d.run, d.wants, d.split[:, 1], jax.tree.map(w, state.sampler)
        written = w(state.cache.lengths)
        q, props = None, d.proposals
        if drafting:
            state, props, q = draft_chain(state, d, written)
        elif mtp:
            state, props, q = mtp_chain(state, d, written)
        inputs = jnp.concatenate([w(state.spec.last)[:, None], props], axis=1)  # [W, k + 1]
        real = run[:, None] & ((jnp.arange(k + 1) == 0)[None, :] | wants[:, None])
        logits, cache, *hidden = forward(state, inputs, real, steps=hybrid)
        after_each = hidden.pop() if hybrid else None  # a hybrid model's states after each position
        masks = None
        if state.grammar is not None:  # each position's draw under its slot's constraint, the proposals checked first
            def draft_masks():
                return state.grammar.draft_masks(jnp.zeros((S, k), jnp.int32).at[:W].set(props))[:W]

            words = state.grammar.allowed.shape[-1]
            masks = lax.cond(constrained_now(state), draft_masks,
                             lambda: jnp.full((W, k + 1, words), -1, jnp.int32))

        def per_slot(top):  # each slot's draws from its own key (`verify`'s per-row keys)
            return speculation.verify(logits, props, pass_keys, sampler_w, q=q, top=top, allowed=masks,
                                      constrained=constrained_now(state))

        out = lax.cond(top_wanted, lambda: per_slot(MAX_LOGPROBS), lambda: per_slot(0)._replace(
            top_ids=jnp.zeros((W, k + 1, MAX_LOGPROBS), jnp.int32),
            top_logprobs=jnp.zeros((W, k + 1, MAX_LOGPROBS), jnp.float32)))
        # A slot that does not speculate draws from its first position as a plain pass would.
        picked = step.select(logits[:, 0], pass_keys, sampler_w, w(state.stop_ids), top=MAX_LOGPROBS,
                             top_wanted=top_wanted, allowed=allowed(state), constrained=constrained_now(state))
        m = jnp.where(wants, jnp.minimum(out.accepted, w(state.budget) - 1), 0)
        tokens = jnp.where(wants[:, None], out.tokens, jnp.concatenate(
            [picked.tokens[:, None], jnp.full((W, k), -1, jnp.int32)], axis=1))
        i = jnp.arange(k + 1)[None, :]
        ends = (step.matches_stop(tokens, w(state.stop_ids)) | (tokens < 0)) & (i <= m[:, None])
        ended = jnp.any(ends, axis=1)
        count = jnp.where(run, jnp.where(ended, jnp.argmax(ends, axis=1) + 1, m + 1), 0)
        last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        nan = jnp.where(wants, last < 0, picked.nan)
        # The kept slots: the last token and the kept proposals; the pages past them go back.
        sub = rows_of(cache, slots)
        if hybrid:  # the states after the kept tokens (a state cannot be rewound as the length is)
            sub = sub.keep_step_states(after_each, count)
        sub = sub.rewind(written + count)
        cache = put_rows(cache, slots, sub)
        sel = lambda a, b: jnp.where(wants.reshape((W,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        logprob = sel(out.logprob, jnp.concatenate([picked.logprob[:, None], jnp.zeros((W, k))], axis=1))
        top_ids = sel(out.top_ids, jnp.concatenate(
            [picked.top_ids[:, None], jnp.zeros((W, k, MAX_LOGPROBS), jnp.int32)], axis=1))
        top_logp = sel(out.top_logprobs, jnp.concatenate(
            [picked.top_logprobs[:, None], jnp.zeros((W, k, MAX_LOGPROBS), jnp.float32)], axis=1))
        kept = jnp.where(wants, jnp.minimum(out.accepted, count), 0)
        spec = state.spec
        rate = jnp.where(wants, (1 - speculation.RATE_WEIGHT) * w(spec.rate)
                         + speculation.RATE_WEIGHT * out.accepted / k, w(spec.rate))
        pays = speculation.expected_tokens(rate, k) >= plan.verify_cost
        wait = jnp.where(pays, speculation.PROBE_EVERY,
                         jnp.minimum(speculation.PROBE_BACKOFF * w(spec.wait), speculation.MAX_PROBE_WAIT))
        spec = spec.replace(rate=spec.rate.at[:W].set(rate),
                            wait=spec.wait.at[:W].set(jnp.where(wants, wait, w(spec.wait)).astype(jnp.int32)))
        state = state.replace(cache=cache, spec=spec)
        if mtp:  # the pairs at the kept positions: (h at the last token and each kept proposal, the next token)
            state = pend(state, run, hidden[0], tokens, count)
        return state, count, tokens, nan, ended, logprob, top_ids, top_logp, kept

    def draft_chain(state, d: Pass, written):
        """The draft proposes (`loop`'s chain, per slot): pages for the verify's k + 1 slots first (the
        target's forward then takes none), then k + 1 one-token draft passes, feeding each slot's last token
        and its proposals in turn (the last fed so that the draft's cache holds every proposal, whatever the
        verify keeps; a slot that does not speculate feeds its last token only), proposal i drawn from the
        draft's q_i under the slot's own settings and key -> (state, int32[W, k] proposals, float32[W, k, V])."""
        run, wants, sampler_w = d.run, d.wants, jax.tree.map(w, state.sampler)
        sub = rows_of(state.cache, slots).reserve(jnp.where(run, jnp.where(wants, k + 1, 1), 0))
        state = state.replace(cache=put_rows(state.cache, slots, sub))
        draft_keys = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, 1), k + 1))(d.split[:, 1])

        def one(carry, i):
            state, token = carry
            real = run & ((i == 0) | wants)
            logits, state = draft_step(state, token, real, written + i)
            q = sampler_w.distribution(logits)
            drawn = jax.vmap(jax.random.categorical)(draft_keys[:, i], jnp.log(q)).astype(jnp.int32)
            return (state, drawn), (drawn, q)

        (state, _), (drawn, q) = lax.scan(one, (state, w(state.spec.last)), jnp.arange(k + 1))
        return state, drawn[:k].T, jnp.swapaxes(q[:k], 0, 1)

    def mtp_chain(state, d: Pass, written):
        """The MTP module proposes (`loop._mtp_chain`, per slot): pages for the verify's k + 1 slots first, the
        pending pairs fed (`mtp_feed`), proposal 1 drawn from the module's q after them, then each next one from
        the module fed its own h' and the proposal before, at the slot's next positions (writes past the module's
        length, overwritten by the pairs the verify keeps), each under the slot's own settings and a key folded
        from its pass key -> (state, int32[W, k] proposals, float32[W, k, V] q)."""
        run, wants, sampler_w = d.run, d.wants, jax.tree.map(w, state.sampler)
        sub = rows_of(state.cache, slots).reserve(jnp.where(run, jnp.where(wants, k + 1, 1), 0))
        state = state.replace(cache=put_rows(state.cache, slots, sub))
        state, logits, h = mtp_feed(state, run)
        chain_keys = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, 1), k))(d.split[:, 1])
        real = run & wants

        def one(carry, i):
            state, logits, h = carry
            q = sampler_w.distribution(logits)
            drawn = jax.vmap(jax.random.categorical)(chain_keys[:, i], jnp.log(q)).astype(jnp.int32)
            view = draft_rows(state.draft, rows_of(state.cache, slots), written + i)
            logits, h, view = mtp_forward(draft_params, params, h[:, None], drawn[:, None],
                                          jnp.where(real, written + i, -1)[:, None], view, config=draft_config,
                                          attention=draft_attention)
            return (state.replace(draft=draft_pools(state.draft, view)), logits[:, 0], h[:, 0]), (drawn, q)

        (state, _, _), (drawn, q) = lax.scan(one, (state, logits, h), jnp.arange(k))
        return state, drawn.T, jnp.swapaxes(q, 0, 1)

    def after(state, counts, d: Pass, results):
        """The pass's bookkeeping: probe clocks, keys, its tokens recorded (`settle`), the counters ->
        (state, counts, the pass's outputs as [T, S] blocks)."""
        state, count, tokens, nan, stopped, logprob, top_ids, top_logp, kept = results
        run, wants = d.run, d.wants
        # (a plain pass's `stopped` is select's; a verify's the stop or NaN it ran into)
        spec = state.spec
        idle = jnp.where(wants, 0, jnp.where(run, w(spec.idle) + 1, w(spec.idle)))
        # The greedy slots' clock (its first probe comes at once: the engine knows nothing of its load yet). After
        # a verify: if their updated estimates say verifying pays, it goes on (`pays`) and the clock restarts;
        # if they kept clearly more than estimated (the estimates still rising towards paying), probe again next
        # pass; else back off.
        joined = d.greedy & wants  # (wants implies a verify pass)
        verified = jnp.any(joined)
        again = extra(d.together, speculation.expected_tokens(w(spec.rate), k)) >= d.running * (cost - 1.0)
        rising = (jnp.sum(jnp.where(joined, w(spec.rate) - d.rate_before, 0.0))
                  > speculation.RATE_WEIGHT * RISING * jnp.sum(joined))
        probe_wait = jnp.where(again, speculation.PROBE_EVERY, jnp.where(rising, 0, jnp.minimum(
            jnp.maximum(speculation.PROBE_BACKOFF * spec.probe_wait, speculation.PROBE_EVERY),
            speculation.MAX_PROBE_WAIT)))
        spec = spec.replace(idle=spec.idle.at[:W].set(idle),
                            probe_idle=jnp.where(verified, 0, spec.probe_idle + jnp.any(run)).astype(jnp.int32),
                            probe_wait=jnp.where(verified, probe_wait, spec.probe_wait).astype(jnp.int32))
        state = state.replace(keys=state.keys.at[:W].set(jnp.where(run[:, None], d.split[:, 0], w(state.keys))),
                              spec=spec)
        state, out = settle(state, run, tokens, count, nan, stopped, logprob, top_ids, top_logp)
        counts = counts + jnp.stack([jnp.sum(jnp.where(wants, k, 0)), jnp.sum(kept),
                                     (d.verifying & jnp.any(run)).astype(jnp.int32),
                                     jnp.any(run).astype(jnp.int32), jnp.sum(run, dtype=jnp.int32),
                                     jnp.sum(count)])
        return state, counts, out

    # The passes: a while loop whose every turn is one verify pass or a run of plain passes up to the next pass
    # that verifies, so the branch between the two (a lax.cond carrying the cache pools: measured at 16 slots to
    # cost a quarter of a plain pass when taken per pass) is paid once per run. Outputs land in rows from a
    # cursor: k + 1 per verify pass, 1 per plain pass (rows never written stay -1: nothing emitted).
    def write(rows, out, cursor):
        return tuple(lax.dynamic_update_slice(r, o, (cursor,) + (0,) * (r.ndim - 1)) for r, o in zip(rows, out))

    def live(c: Turn):
        return (c.passes < steps) & jnp.any(c.state.decoding)

    def plain_step(c: Turn) -> Turn:
        state, counts, out = after(c.state, c.counts, c.next, plain(c.state, c.next))
        return Turn(state, counts, write(c.rows, out, c.cursor), c.cursor + 1, c.passes + 1, decide(state))

    def verify_step(c: Turn) -> Turn:
        state, counts, out = after(c.state, c.counts, c.next, check(c.state, c.next))
        return Turn(state, counts, write(c.rows, out, c.cursor), c.cursor + k + 1, c.passes + 1, decide(state))

    def plain_run(c: Turn) -> Turn:
        return lax.while_loop(lambda c: live(c) & ~c.next.verifying, plain_step, plain_step(c))

    R = 1 + steps * (k + 1)
    rows = tuple(jnp.concatenate([a, jnp.full((R - 1,) + a.shape[1:], -1 if i == 0 else 0, a.dtype)], axis=0)
                 for i, a in enumerate(first))
    turn = Turn(state, jnp.zeros((len(COUNTERS),), jnp.int32), rows, jnp.ones((), jnp.int32),
                jnp.zeros((), jnp.int32), decide(state))
    turn = lax.while_loop(live, lambda c: lax.cond(c.next.verifying, verify_step, plain_run, c), turn)
    return turn.state, turn.rows, jnp.sum(turn.state.cache.refcounts == 0, dtype=jnp.int32), turn.counts


def extra(together, gain):
    """The tokens a verify is expected to add beyond a plain pass, summed over the greedy candidates."""
    return jnp.sum(jnp.where(together, gain - 1.0, 0.0))


class Pass(NamedTuple):
    """One pass's choice (`decide`): run bool[W] the slots decoding, split [W, 2, key] (the slot's next key,
    this pass's), proposals int32[W, k] (n-gram; the draft's come in `check`), rate_before float32[W], greedy
    bool[W], together bool[W] the greedy candidates, running int32[], verifying bool[], wants bool[W] the
    slots that speculate in it."""

    run: jax.Array
    split: jax.Array
    proposals: jax.Array
    rate_before: jax.Array
    greedy: jax.Array
    together: jax.Array
    running: jax.Array
    verifying: jax.Array
    wants: jax.Array


class Turn(NamedTuple):
    """The pass loop's carry: the state, the counters, the output rows, the next free row, passes run, and
    the next pass's choice."""

    state: State
    counts: jax.Array
    rows: tuple
    cursor: jax.Array
    passes: jax.Array
    next: Pass


def history_width(max_len: int, k: int) -> int:
    """H: a slot's history holds its whole sequence, prompt and output, plus a verify's k + 1 tokens."""
    return max_len + k + 1

