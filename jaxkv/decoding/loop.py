"""The compiled decode loop behind `generate` and `decode`: a `lax.while_loop` whose body runs one token per row
through the model and picks the next with the one decode step (`jaxkv.decoding.step.select`).

A row that emitted a stop token is done (its later tokens are -1, fed back as padding); the loop ends when every
row is done or the step budget is out. With a `stream`, each step's tokens reach the host through an ordered
io_callback, and an exception the stream raises surfaces as itself (`on_host_surfacing`).

`generate` streams through `run` instead: the same loop driven from the host a few steps at a time
(`streamed_loop`), since JAX never writes a program with a host callback to its persistent compilation cache.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh

from jaxkv import sharding
from jaxkv.cache import planner as memory
from jaxkv.cache.contiguous import KVCache
from jaxkv.cache.paged import PagedKVCache
from jaxkv.config import Config
from jaxkv.decoding import programs, step
from jaxkv.decoding.constrained import Grammar
from jaxkv.decoding.processing import Fresh, Processing


@flax.struct.dataclass
class LoopState:
    """The decode loop's carry.

    cache:   the KV cache (its `length` is the slot the next token goes to).
    logits:  float32[B, V], the logits the next token is sampled from.
    key:     the PRNG key; split every step, the half used for sampling is never reused.
    done:    bool[B], the sequence has stopped (a stop token, or an id outside the vocabulary); later tokens are -1.
    num_new: int32[B], tokens emitted before and including the stop token.
    step:    int32[], tokens emitted so far per row (the column the next one goes to).
    tokens:  int32[B, max_steps], the emitted tokens, -1 where a row had stopped or the loop ended.
    logprobs: float32[B, max_steps], log p(token) of each emitted token (`step.Selected.logprob`); garbage where
             `tokens` is -1.
    top_ids, top_logprobs: int32 and float32[B, max_steps, k], each step's k most likely tokens (k static, from
             the shape; k = 0 records none).
    processing: the rows' logits-processing state (`jaxkv.decoding.processing.Processing`: penalties, logit
             bias, min_tokens), advanced with every token emitted; None: none.
    grammar: the rows' constraint masks (`Grammar`), refilled on the host with every token emitted; None: no
             row is constrained (the step has no mask and no callback).
    """

    cache: KVCache
    logits: jax.Array
    key: jax.Array
    done: jax.Array
    num_new: jax.Array
    step: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    processing: Processing | None = None
    grammar: Grammar | None = None

    @classmethod
    def start(cls, cache, logits, key, done, *, width: int, top: int, processing=None,
              grammar=None) -> "LoopState":
        """The state before the first token: buffers of `width` columns (k = `top` alternatives each)."""
        B = logits.shape[0]
        return cls(cache=cache, logits=logits, key=key, done=done, num_new=jnp.zeros((B,), jnp.int32),
                   step=jnp.zeros((), jnp.int32), tokens=jnp.full((B, width), -1, jnp.int32),
                   logprobs=jnp.zeros((B, width), jnp.float32), top_ids=jnp.zeros((B, width, top), jnp.int32),
                   top_logprobs=jnp.zeros((B, width, top), jnp.float32), processing=processing,
                   grammar=grammar)


def emit(state: LoopState, *, sampler, stop_ids, stream, rows):
    """Picks one token per row (`step.select`) and records it -> (state, int32[B] tokens to feed back).

    The sampler sees the first `rows` rows (the caller's own, without batch padding). A row stops after a stop
    token or an id outside the vocabulary (recorded as emitted, so the host can report it; never fed back).
    With `stream`, the tokens and which rows emitted one go to the host as they are produced (an ordered
    io_callback: the compiled loop stays one loop, the host sees every step in order).
    """
    key, sample_key = jax.random.split(state.key)
    picked = step.select(state.logits, sample_key, sampler, stop_ids, top=state.top_ids.shape[-1], rows=rows,
                         processing=state.processing,
                         allowed=None if state.grammar is None else state.grammar.allowed)
    tokens, running = picked.tokens, ~state.done
    stopped = picked.stopped
    if state.grammar is not None:  # a row whose constraint is complete ends here ("stop")
        grammar, ended = state.grammar.advance(tokens, running & picked.valid & ~picked.stopped)
        state, stopped = state.replace(grammar=grammar), stopped | ended
    if state.processing is not None:
        state = state.replace(processing=state.processing.advance(tokens, running & picked.valid))
    if stream is not None:
        io_callback(functools.partial(call_stream, stream), None, tokens, running & picked.valid, ordered=True)

    def column(buf, x):
        return lax.dynamic_update_slice(buf, x[:, None], (0, state.step) + (0,) * (buf.ndim - 2))

    state = state.replace(key=key, done=state.done | stopped,
                          num_new=state.num_new + running.astype(jnp.int32), step=state.step + 1,
                          tokens=column(state.tokens, jnp.where(running, tokens, -1)),
                          logprobs=column(state.logprobs, picked.logprob), top_ids=column(state.top_ids, picked.top_ids),
                          top_logprobs=column(state.top_logprobs, picked.top_logprobs))
    return state, jnp.where(running & picked.valid, tokens, 0)


# stream -> the exception it raised in a running loop. XLA reports a host callback's exception as an opaque
# runtime error ("INTERNAL: ... CpuCallback error"), so the loop's caller re-raises the callback's own from here.
# Keyed by the stream (hashed by value, as jit's static argument is): a compiled loop calls the stream it was
# traced with, which equals the caller's.
_stream_errors: dict = {}


def call_stream(stream, tokens, emitted):
    try:
        stream(tokens, emitted)
    except BaseException as exc:
        _stream_errors[stream] = exc
        raise


def on_host_surfacing(stream, run):
    """`run()` (a decode loop, read back to the host) -> its result; if `stream` raised in it, that exception."""
    _stream_errors.pop(stream, None)
    try:
        return run()
    except Exception as exc:
        error = _stream_errors.pop(stream, None) if stream is not None else None
        if error is not None:
            raise error from exc
        raise


class LoopOut(NamedTuple):
    """What `decode_loop` returns (host code reads the first four and the log-probabilities; `LoopState` says
    what each holds)."""

    tokens: jax.Array  # int32[B, max_steps]
    num_new: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    forward_passes: jax.Array  # int32[], the decode forward passes run
    cache: KVCache
    logprobs: jax.Array  # float32[B, max_steps]
    top_ids: jax.Array  # int32[B, max_steps, k]
    top_logprobs: jax.Array  # float32[B, max_steps, k]
    # Speculative decoding only (`speculative_loop`), else None:
    proposed: jax.Array | None = None  # int32[B], proposals verified per row
    accepted: jax.Array | None = None  # int32[B], proposals kept and emitted per row
    verifies: jax.Array | None = None  # int32[], forward passes that verified proposals (the rest: plain steps)


@functools.partial(jax.jit, static_argnames=("config", "max_steps", "rows", "attention", "stream", "mesh",
                                             "logprobs"),
                   donate_argnames=("cache",))
def decode_loop(params, cache: KVCache, logits, key, sampler, stop_ids, done, steps, processing=None,
                grammar: Grammar | None = None, *,
                config: Config, max_steps: int, rows: int | None, attention: str, stream: Callable | None,
                mesh: Mesh | None, logprobs: int = 0) -> LoopOut:
    """Emits up to `steps` (traced, <= max_steps) tokens per row, feeding back all but the last, and stops early
    once every row is done (`done` may start true: batch filler rows). `logprobs`: k, the alternatives recorded
    per token (static; 0 records only each token's own log-probability). `processing`: the rows'
    `Processing` state (`LoopState`), or the `processing.Fresh` it is built from here; None: none. `grammar`: the
    constrained rows' `Grammar` (None: none)."""
    pick = functools.partial(emit, sampler=sampler, stop_ids=stop_ids, stream=stream, rows=rows)
    # Pick, then (while a row runs and tokens are left) feed back and pick again: steps - 1 forward passes at
    # most, the last token is never fed back, and a batch that stops at once runs none.
    carry = pick(_start(cache, logits, key, done, processing, grammar, max_steps=max_steps, logprobs=logprobs))
    state, _ = _continue(params, carry, steps, pick, config=config, attention=attention, mesh=mesh)
    return _out(state, mesh)


def _start(cache, logits, key, done, processing, grammar, *, max_steps: int, logprobs: int) -> LoopState:
    if isinstance(processing, Fresh):
        processing = processing.state(logits.shape[-1])
    return LoopState.start(cache, logits, key, done, width=max_steps, top=logprobs, processing=processing,
                           grammar=grammar)


def _continue(params, carry, steps, pick, *, config, attention, mesh):
    """(state, the tokens to feed back) after the loop's picks up to step `steps` (or until every row is done)."""
    paged = isinstance(carry[0].cache, PagedKVCache)

    def body(carry):
        state, feed = carry
        logits, cache = programs.forward(params, feed[:, None], state.cache, config=config, attention=attention,
                                         mesh=mesh, active=~state.done if paged else None)
        return pick(state.replace(cache=cache, logits=logits[:, 0]))

    return lax.while_loop(lambda c: (c[0].step < steps) & ~jnp.all(c[0].done), body, carry)


def _out(state: LoopState, mesh) -> LoopOut:
    out = LoopOut(tokens=state.tokens, num_new=state.num_new, done=state.done, forward_passes=state.step - 1,
                  cache=state.cache, logprobs=state.logprobs, top_ids=state.top_ids,
                  top_logprobs=state.top_logprobs)
    if mesh is not None:  # everything but the cache, readable by every process
        out = out._replace(**{name: sharding.replicated(getattr(out, name), mesh)
                              for name in out._fields if name != "cache"})
    return out


# A streamed loop's calls (`streamed_loop`) grow to about STREAM_CALL_S each, STREAM_CHUNK steps at most: a fast
# model shares one host round trip among several steps (on a loaded 2-core CPU a round trip costs more than a small
# model's step), a slow one still hands its tokens over step by step, and the stream hears at least ~50 times a
# second either way.
STREAM_CHUNK = 16
STREAM_CALL_S = 0.02


def _report(state: LoopState, start):
    """What a streamed loop's host reads after a call that began at step `start`: (steps so far, every row done,
    offset, int32[B, W] the token columns from offset, W = min(STREAM_CHUNK, the buffer's width)), the window
    holding every column the call wrote."""
    width = min(STREAM_CHUNK, state.tokens.shape[1])
    offset = jnp.clip(start, 0, state.tokens.shape[1] - width)
    return state.step, jnp.all(state.done), offset, lax.dynamic_slice_in_dim(state.tokens, offset, width, axis=1)


# `decode_loop` cut in two programs for a host that reads as it goes: the first pick, then the loop up to a bound.
# The pick and the loop body are decode_loop's own (`_start`, `_continue`), so the tokens are the same.
@functools.partial(jax.jit, static_argnames=("rows", "max_steps", "logprobs"), donate_argnames=("cache",))
def _first_step(cache, logits, key, sampler, stop_ids, done, processing, grammar, *, rows, max_steps, logprobs):
    pick = functools.partial(emit, sampler=sampler, stop_ids=stop_ids, stream=None, rows=rows)
    carry = pick(_start(cache, logits, key, done, processing, grammar, max_steps=max_steps, logprobs=logprobs))
    return carry, _report(carry[0], 0)


@functools.partial(jax.jit, static_argnames=("config", "rows", "attention", "mesh"), donate_argnames=("carry",))
def _next_steps(params, carry, until, sampler, stop_ids, *, config, rows, attention, mesh):
    """The loop on to step `until` (traced: any chunk, one program), or until every row is done."""
    pick = functools.partial(emit, sampler=sampler, stop_ids=stop_ids, stream=None, rows=rows)
    start = carry[0].step
    carry = _continue(params, carry, until, pick, config=config, attention=attention, mesh=mesh)
    return carry, _report(carry[0], start)


def streamed_loop(stream, params, cache, logits, key, sampler, stop_ids, done, steps, processing=None,
                  grammar: Grammar | None = None, *, config: Config, max_steps: int, rows: int | None,
                  attention: str, mesh: Mesh | None, logprobs: int = 0) -> LoopOut:
    """`decode_loop(..., stream=stream)` driven from the host: the first pick, then the loop in chunks, each
    step's tokens handed to `stream` in order between calls (an exception it raises is simply raised here). JAX
    never writes a program with a host callback (decode_loop's io_callback) to its persistent compilation cache,
    so a streamed decode_loop compiled again in every process; these programs have none (unless a constrained
    row's grammar brings its own) and are cached like the rest. Same picks in the same order: the same tokens."""
    steps, vocab = int(steps), logits.shape[-1]
    carry, report = _first_step(cache, logits, key, sampler, stop_ids, done, processing, grammar, rows=rows,
                                max_steps=max_steps, logprobs=logprobs)
    streamed, chunk, called = 0, 1, time.perf_counter()
    while True:
        step, finished, offset, window = map(np.asarray, report)
        step, offset = int(step), int(offset)
        if not finished and step < steps:  # the next chunk runs on the device while this one is streamed
            per_step = max(time.perf_counter() - called, 1e-6) / max(step - streamed, 1)
            chunk = max(1, min(2 * chunk, int(STREAM_CALL_S / per_step), STREAM_CHUNK))
            called = time.perf_counter()
            carry, report = _next_steps(params, carry, np.int32(min(step + chunk, steps)), sampler, stop_ids,
                                        config=config, rows=rows, attention=attention, mesh=mesh)
        for column in range(streamed, step):
            tokens = window[:, column - offset]  # -1 where a row was not running
            stream(tokens, (tokens >= 0) & (tokens < vocab))  # what `emit` streams: running & valid
        streamed = step
        if finished or step >= steps:
            return _out(carry[0], None)  # (a stream runs in one process, `generate`: every array is addressable)


def run(*args, stream: Callable | None, **kwargs) -> LoopOut:
    """`decode_loop`, or with a `stream` `streamed_loop`: what `generate` calls."""
    if stream is None:
        return decode_loop(*args, stream=None, **kwargs)
    return streamed_loop(stream, *args, **kwargs)


def steps_bound(capacity: int, ring: bool, steps: int) -> int:
    """The static size of the loop's token buffer: a plain cache can feed back at most `capacity` tokens, so one
    bound per cache shape serves every `steps` (no recompile per max_new_tokens); a ring has no such bound, so
    its steps are bucketed to powers of two."""
    return capacity + 1 if not ring else max(64, memory.next_pow2(steps))


def on_host(loop: LoopOut, to_host=np.asarray) -> LoopOut:
    """`decode_loop`'s output with everything but the cache read to host arrays."""
    return loop._replace(**{name: to_host(getattr(loop, name)) for name in loop._fields
                            if name != "cache" and getattr(loop, name) is not None})


@dataclasses.dataclass(frozen=True)
class StepStream:
    """Adapts a per-token callback `(row, token)` to the per-step io_callback. Hashable by value, so the same user
    callback reuses the compiled loop."""

    callback: Callable
    num_prompts: int

    def __call__(self, tokens, emitted):
        for b in range(self.num_prompts):  # filler rows (batch padding) are never reported
            if emitted[b]:
                self.callback(b, int(tokens[b]))


def step_stream(stream, rows: int, what: str = "prompt_index") -> StepStream | None:
    """A `generate(stream=...)` argument as the loop's stream (None: none), or ValueError."""
    if stream is None:
        return None
    if not callable(stream):
        raise ValueError(f"stream must be a callable ({what}, token_id), got {stream!r}")
    return StepStream(stream, rows)


@flax.struct.dataclass
class SpecState:
    """`speculative_loop`'s carry: the plain loop's state plus what speculating needs.

    last:     int32[B], each row's last emitted token, fed at the next pass (0 for a finished row).
    history:  int32[B, P], each row's tokens so far (prompt, then output) in its first `length[b]` entries: what the
              n-gram proposer searches.
    length:   int32[B].
    rate:     float32[B], the running estimate of the fraction of a row's proposals kept.
    idle:     int32[], plain steps since the last verify.
    wait:     int32[], plain steps before the next probe (longer after each probe that does not pay).
    passes:   int32[], forward passes run (verifies and plain steps).
    proposed, accepted: int32[B] (`LoopOut`); verifies: int32[].
    draft:    the draft model's cache (method "draft"), holding what the target's holds, or the MTP module's
              `MtpState` (method "mtp"); else None.
    """

    base: LoopState
    last: jax.Array
    history: jax.Array
    length: jax.Array
    rate: jax.Array
    idle: jax.Array
    wait: jax.Array
    passes: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    verifies: jax.Array
    draft: KVCache | None = None


def _draft_chain(params, cache, last, key, sampler, *, config, attention, k: int):
    """The draft model proposes: feeds the last token and each proposal in turn (k + 1 one-token passes, so its
    cache ends holding every proposal, whatever the verify keeps), drawing proposal i from its own distribution
    q_i (`Sampler.distribution` with the request's settings: a greedy row proposes the draft's argmax)
    -> (int32[B, k] proposals, float32[B, k, V] q, cache)."""
    def one(carry, key):
        cache, token = carry
        logits, cache = programs.forward(params, token[:, None], cache, config=config, attention=attention)
        q = sampler.distribution(logits[:, 0])
        drawn = jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32)
        return (cache, drawn), (drawn, q)

    (cache, _), (drawn, q) = lax.scan(one, (cache, last), jax.random.split(key, k + 1))
    return drawn[:k].T, jnp.swapaxes(q[:k], 0, 1), cache


@flax.struct.dataclass
class MtpState:
    """The MTP proposer's carry (method "mtp", `jaxkv.decoding.mtp`): its module's own cache, one position behind
    the target's, and the pairs (h_t, token_{t+1}) not yet fed to it (the target's hidden state at each position
    the last pass computed, and the token that followed), fed at the start of the next pass.

    cache:  the module's `KVCache` (its length + count = the target's), or over the paged cache (`generate` with
            n > 1, page_size, prefix_cache) its own `PagedKVCache` (each row's length + count[b] = the target's).
    hidden: [B, k + 1, D]; tokens: int32[B, k + 1]; count: the pairs pending (the rest padding), int32[] on the
            contiguous cache (one length for the batch), int32[B] on the paged one (a row's own; 0: finished).
    """

    cache: KVCache
    hidden: jax.Array
    tokens: jax.Array
    count: jax.Array

    @classmethod
    def pending(cls, cache, hidden, tokens, count, k: int) -> "MtpState":
        """The pairs hidden [B, T, D] / tokens [B, T] (the first `count` real) padded to k + 1."""
        B, T = tokens.shape
        pad = k + 1 - T
        return cls(cache=cache, hidden=jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))),
                   tokens=jnp.pad(jnp.maximum(tokens, 0), ((0, 0), (0, pad))), count=jnp.asarray(count, jnp.int32))


def _mtp_feed(mtp_params, params, mtp: MtpState, *, config, attention):
    """Feeds the pending pairs (k + 1 positions, the padding rewound) -> (the state, nothing pending; float32[B, V]
    the module's logits after the last pair: the first proposal's; its h' [B, D])."""
    from jaxkv.decoding.mtp import mtp_forward

    T = mtp.tokens.shape[1]
    positions = mtp.cache.positions(T)
    if isinstance(mtp.cache, PagedKVCache):  # each row its own pairs; padding (-1) is not stored and takes no page
        positions = jnp.where(jnp.arange(T)[None, :] < mtp.count[:, None], positions, -1)
    logits, h, cache = mtp_forward(mtp_params, params, mtp.hidden, mtp.tokens, positions, mtp.cache,
                                   config=config, attention=attention)
    if isinstance(cache, PagedKVCache):  # (mtp_forward advanced each row by its real pairs)
        last = jnp.maximum(mtp.count - 1, 0)[:, None, None]  # each row's last real pair's outputs
        return (mtp.replace(cache=cache, count=jnp.zeros_like(mtp.count)),
                jnp.take_along_axis(logits, last, axis=1)[:, 0], jnp.take_along_axis(h, last, axis=1)[:, 0])
    last = mtp.count - 1  # the last real pair's outputs
    cache = dataclasses.replace(cache, length=mtp.cache.length + mtp.count)
    return (mtp.replace(cache=cache, count=jnp.zeros((), jnp.int32)),
            lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False),
            lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False))


def _mtp_chain(mtp_params, params, cache, logits, h, key, sampler, *, config, attention, k: int):
    """k proposals from the MTP module: the first drawn from `logits` (after the pending pairs), each next one
    from the module fed its own h' and the proposal (one position each; the chain's cache is dropped after, so
    its writes, and on the paged cache the pages they took, are as if never made) -> (int32[B, k] proposals,
    float32[B, k, V] q)."""
    from jaxkv.decoding.mtp import mtp_forward

    def one(carry, key):
        cache, logits, h = carry
        q = sampler.distribution(logits)
        drawn = jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32)
        logits, h, cache = mtp_forward(mtp_params, params, h[:, None], drawn[:, None], cache.positions(1), cache,
                                       config=config, attention=attention)
        return (cache, logits[:, 0], h[:, 0]), (drawn, q)

    _, (drawn, q) = lax.scan(one, (cache, logits, h), jax.random.split(key, k))
    return drawn.T, jnp.swapaxes(q, 0, 1)


@functools.partial(jax.jit, static_argnames=("config", "max_steps", "attention", "stream", "logprobs", "plan",
                                             "draft_config"),
                   donate_argnames=("cache",))  # (the draft cache is not returned: nothing to alias it to)
def speculative_loop(params, cache: KVCache, logits, key, sampler, stop_ids, done, steps, history, length,
                     draft_params=None, draft_cache=None, grammar: Grammar | None = None, *, config: Config,
                     max_steps: int, attention: str, stream: Callable | None, logprobs: int, plan,
                     draft_config: Config | None = None) -> LoopOut:
    """`decode_loop` with speculation (`jaxkv.decoding.speculation`): each pass either
    verifies k proposals (the inputs: the last token and the proposals, k + 1 positions) or, when the adaptive
    rule says speculating does not pay, takes a plain one-token step. The batch shares the cache's write slot,
    so a verify keeps, for every running row, the proposals all running rows kept (m, the least): every token
    still comes out as `speculation.verify` draws it, and the cache's length rewinds to the kept slots (the
    rejected slots' K/V lie past it, unseen, until overwritten; a paged row's length rewinds the same way and
    gives back the pages past it, `PagedKVCache.rewind`). A verify needs k slots beyond the last token, within
    the model's positions (`speculation.room`): where they do not fit, the pass is a plain step.
    history int32[B, P] and length int32[B]: each row's prompt (`SpecState`). Method "draft": the draft model's
    params, config and its cache prefilled with the same prompts (same slots). Method "mtp": draft_params the
    MTP module's params, draft_cache its `MtpState` (`programs.prefill_mtp`'s cache, and the last prompt
    position's hidden state as the one pending pair, whose token is the first one drawn here), draft_config its
    config. `grammar`: the constrained rows (`decode_loop`'s); a verify's proposals are checked against each
    row's constraint first (the masks at the k + 1 positions applied to its logits: a proposal the constraint
    refuses is rejected, and every drawn token is allowed), then the kept tokens fed to the row's matcher."""
    from jaxkv.decoding import speculation

    B, k = logits.shape[0], plan.num_tokens
    max_positions = config.max_positions if draft_config is None else min(config.max_positions,
                                                                          draft_config.max_positions)
    paged = isinstance(cache, PagedKVCache)  # finished rows then store nothing (`programs.forward`'s `active`)
    # a verify writes k + 1 columns at the current step
    base = LoopState.start(cache, logits, key, done, width=max_steps + k + 1, top=logprobs, grammar=grammar)
    pick = functools.partial(emit, sampler=sampler, stop_ids=stop_ids, stream=stream, rows=None)
    base, feed = pick(base)
    mtp = plan.method == "mtp"
    if mtp:  # draft_cache: (the module's cache, [B, D] the last prompt position's hidden state)
        draft_cache = MtpState.pending(draft_cache[0], draft_cache[1][:, None], feed[:, None],
                                       (~done).astype(jnp.int32) if paged else 1, k)
    history, length = speculation.append_history(history, length, base.tokens[:, :1], (~done).astype(jnp.int32))
    zeros = jnp.zeros((B,), jnp.int32)
    state = SpecState(base=base, last=feed, history=history, length=length,
                      rate=jnp.full((B,), speculation.INITIAL_RATE, jnp.float32),
                      idle=jnp.zeros((), jnp.int32), wait=jnp.int32(speculation.PROBE_EVERY),
                      passes=jnp.zeros((), jnp.int32), proposed=zeros,
                      accepted=zeros, verifies=jnp.zeros((), jnp.int32), draft=draft_cache)

    def plain(state, proposed):
        del proposed
        running = ~state.base.done
        logits, cache, *hidden = programs.forward(params, state.last[:, None], state.base.cache, config=config,
                                                  attention=attention, active=running if paged else None,
                                                  return_hidden=mtp)
        if state.draft is not None and not mtp:  # the draft's cache follows the target's
            state = state.replace(draft=programs.forward(draft_params, state.last[:, None], state.draft,
                                                         config=draft_config, attention=attention)[1])
        base, feed = pick(state.base.replace(cache=cache, logits=logits[:, 0]))
        if mtp:  # the pair (h at the fed token, the token drawn after it) waits for the next pass
            state = state.replace(draft=MtpState.pending(state.draft.cache, hidden[0], feed[:, None],
                                                         running.astype(jnp.int32) if paged else 1, k))
        history, length = speculation.append_history(state.history, state.length,
                                                     base.tokens[:, base.step - 1][:, None], running.astype(jnp.int32))
        return state.replace(base=base, last=feed, history=history, length=length, idle=state.idle + 1,
                             passes=state.passes + 1)

    def check(state, proposed):
        proposals, mtp_logits, mtp_h, _ = proposed
        s = state.base
        running = ~s.done
        key, verify_key, draft_key = jax.random.split(s.key, 3)
        written = s.cache.lengths if paged else s.cache.length
        q, draft = None, state.draft
        if mtp:
            proposals, q = _mtp_chain(draft_params, params, draft.cache, mtp_logits, mtp_h, draft_key, sampler,
                                      config=draft_config, attention=attention, k=k)
        elif draft is not None:  # (the n-gram proposals come from `body`)
            proposals, q, draft = _draft_chain(draft_params, draft, state.last, draft_key, sampler,
                                               config=draft_config, attention=attention, k=k)
        inputs = jnp.concatenate([state.last[:, None], proposals], axis=1)  # [B, k + 1]
        hybrid = config.linear_attention is not None  # its states after each position: the kept one is restored
        logits, cache, *hidden = programs.forward(params, inputs, s.cache, config=config, attention=attention,
                                                  active=running if paged else None, return_hidden=mtp,
                                                  step_states=hybrid)
        after_each = hidden.pop() if hybrid else None
        # each position's draw under its constraint's mask, proposals included (the log-probabilities: the model's)
        masks = None if s.grammar is None else s.grammar.draft_masks(proposals)
        out = speculation.verify(logits, proposals, verify_key, sampler, q=q, top=logprobs, allowed=masks)
        # Keep what every running row kept, and no more tokens than the budget allows.
        m = jnp.min(jnp.where(running, out.accepted, k))
        m = jnp.clip(jnp.minimum(m, steps - s.step - 1), 0, k)
        i = jnp.arange(k + 1)[None, :]
        ends = (step.matches_stop(out.tokens, stop_ids) | (out.tokens < 0)) & (i <= m)
        grammar = s.grammar
        if grammar is not None:  # the kept tokens to the matchers; a completed constraint ends its row there
            grammar, ended_at = grammar.advance_verified(out.tokens, m)
            ends |= (i == ended_at[:, None]) & (i <= m)
        first_end = jnp.argmax(ends, axis=1)
        ended = jnp.any(ends, axis=1) & running
        count = jnp.where(running, jnp.where(ended, first_end + 1, m + 1), 0)  # tokens each row emits
        emitted = i < count[:, None]
        tokens = jnp.where(emitted, out.tokens, -1)
        if stream is not None:
            for c in range(k + 1):
                io_callback(functools.partial(call_stream, stream), None, tokens[:, c], emitted[:, c],
                            ordered=True)

        def block(buf, x):
            return lax.dynamic_update_slice(buf, x, (0, s.step) + (0,) * (buf.ndim - 2))

        # The kept slots: the last token and the kept proposals (a row that stopped keeps those before its stop,
        # as a plain step stores every token but the stop). A paged row gives back the pages past them.
        if hybrid:
            cache = cache.keep_step_states(after_each, count if paged else m + 1)
        cache = (cache.rewind(written + count) if paged
                 else dataclasses.replace(cache, length=written + m + 1))
        base = s.replace(key=key, cache=cache, done=s.done | ended, grammar=grammar,
                         num_new=s.num_new + count, step=s.step + m + 1, tokens=block(s.tokens, tokens),
                         logprobs=block(s.logprobs, out.logprob), top_ids=block(s.top_ids, out.top_ids),
                         top_logprobs=block(s.top_logprobs, out.top_logprobs))
        last = jnp.take_along_axis(out.tokens, jnp.full((B, 1), m), axis=1)[:, 0]
        last = jnp.where(running & ~ended & (last >= 0), last, 0)
        history, length = speculation.append_history(state.history, state.length, tokens, count)
        kept = jnp.minimum(out.accepted, count)
        rate = jnp.where(running, (1 - speculation.RATE_WEIGHT) * state.rate
                         + speculation.RATE_WEIGHT * out.accepted / k, state.rate)
        if mtp:  # the pairs at the kept positions: (h at the last token and each kept proposal, the next token)
            # (the paged rows: each its own kept slots, `count`)
            draft = MtpState.pending(draft.cache, hidden[0], out.tokens, count if paged else m + 1, k)
        elif draft is not None:
            draft = dataclasses.replace(draft, length=state.draft.length + m + 1)  # (its own slots)
        pays = jnp.min(jnp.where(running, speculation.expected_tokens(rate, k), jnp.inf)) >= plan.verify_cost
        wait = jnp.where(pays, speculation.PROBE_EVERY, jnp.minimum(speculation.PROBE_BACKOFF * state.wait,
                                                                    speculation.MAX_PROBE_WAIT))
        return state.replace(base=base, last=last, history=history, length=length, rate=rate, draft=draft,
                             wait=wait.astype(jnp.int32),
                             idle=jnp.zeros((), jnp.int32), passes=state.passes + 1,
                             proposed=state.proposed + jnp.where(running, k, 0),
                             accepted=state.accepted + kept, verifies=state.verifies + 1)

    def body(state):
        running = ~state.base.done
        mtp_logits = mtp_h = None
        if state.draft is None:
            proposals, found = speculation.ngram_propose(state.history, state.length, k, plan.ngram_min,
                                                         plan.ngram_max)
        else:
            proposals, found = jnp.zeros((B, k), jnp.int32), jnp.ones_like(running)
        if mtp:  # every pass feeds the module the pairs the last one left (a plain step too: it stays in step)
            synced, mtp_logits, mtp_h = _mtp_feed(draft_params, params, state.draft, config=draft_config,
                                                  attention=attention)
            state = state.replace(draft=synced)
        plain_steps = jnp.ones((), jnp.int32)
        if plan.adaptive:
            expected = jnp.min(jnp.where(running, speculation.expected_tokens(state.rate, k), jnp.inf))
            gain = jnp.where(found, speculation.expected_tokens(state.rate, k), 1.0)
            every = jnp.all(found | ~running)
            worth = jnp.min(jnp.where(running, gain, jnp.inf)) >= plan.verify_cost
            speculate = every & (worth | (state.idle >= state.wait))
            if not mtp:  # (the MTP module is fed at every pass: one plain step at a time)
                # While the rates say speculating does not pay, only the next probe can verify: run the plain
                # steps up to it in one inner loop, without the proposer or this rule at every step.
                plain_steps = jnp.where(expected >= plan.verify_cost, 1, jnp.maximum(state.wait - state.idle, 1))
        else:
            speculate = jnp.bool_(True)
        # A verify needs room for k more tokens than it may emit; near the budget's end, plain steps. Likewise
        # near the end of the cache's slots or the positions (the draft's too): the request fits without them.
        speculate &= state.base.step + 1 < steps
        speculate &= speculation.room(state.base.cache, running, k, max_positions)
        if state.draft is not None and not mtp:
            speculate &= speculation.room(state.draft, running, k, max_positions)
        return lax.cond(speculate, check, plain_run, state, (proposals, mtp_logits, mtp_h, plain_steps))

    def plain_run(state, proposed):
        """`plain` steps, proposed[3] of them at most, ending early when a row finishes (the rule may then
        change) or the loop's own end comes."""
        done = state.base.done

        def more(carry):
            s, i = carry
            return (i < proposed[3]) & (s.base.step < steps) & jnp.all(s.base.done == done)

        return lax.while_loop(more, lambda c: (plain(c[0], None), c[1] + 1), (plain(state, None), 1))[0]

    state = lax.while_loop(lambda s: (s.base.step < steps) & ~jnp.all(s.base.done), body, state)
    s = state.base
    return LoopOut(tokens=s.tokens[:, :max_steps], num_new=s.num_new, done=s.done,
                   forward_passes=state.passes, cache=s.cache,
                   logprobs=s.logprobs[:, :max_steps], top_ids=s.top_ids[:, :max_steps],
                   top_logprobs=s.top_logprobs[:, :max_steps], proposed=state.proposed, accepted=state.accepted,
                   verifies=state.verifies)
