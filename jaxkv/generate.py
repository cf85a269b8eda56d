"""Generation: prefill, the decode step, and the decode loop. Knows nothing of tokenizers.

The pipeline for one `generate` call:

  1. Host: validate everything (nothing is computed for bad input) and lay the batch out as
     `jaxkv.memory.plan_cache` says: the batch padded to a power of two, the prompts left-padded to a length
     bucket so that all sequences share one write slot, the cache capacity a power of two.
  2. `prefill` (one jit): allocates the cache at its fixed shape, runs the whole padded prompt batch through the
     model in one pass, fills slots [0, T) and returns the last token's logits.
  3. `decode` (one jit, cache donated): a `lax.while_loop` over the new tokens. Each step samples a token from
     the previous logits, then runs only that token through the model: Q, K and V for one token, K and V
     appended at slot `length`, attention over the cache. A row that emitted a stop token is done (its later
     tokens are -1, fed back as padding); the loop ends when every row is done or max_new_tokens are out. Each
     step also records the sampled token's log-probability (and with `logprobs=k` the k most likely tokens) under
     the logits it was sampled from, at temperature 1 and before any filter.

Shapes, sampling settings and seeds are arranged so nothing recompiles per prompt length, step count or sampling
setting: prompt lengths, batch sizes and capacities are bucketed; the step count, sampling parameters (one per
row), the PRNG key and the stop ids are traced values.

Several devices: `generate(..., mesh=mesh)` runs the same two jits SPMD over a ("data", "model") mesh (batch over
"data", heads and FFN over "model", the cache over both; the layout is `jaxkv.sharding`'s), from global arrays, so
it also runs across processes. `generate_pmap` is the data-parallel `jax.pmap` variant over local devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv import attention as attention_impls
from jaxkv import checks, memory, roofline, sharding
from jaxkv.cache import KVCache, check_cache_dtype
from jaxkv.config import Config
from jaxkv.model import Decoder, Model
from jaxkv.mla_attention import paged_attention_name
from jaxkv.paged_cache import PagedKVCache
from jaxkv.sampling import Sampler, token_logprobs

STOP_ID_SLOTS = 8  # stop ids are padded to a multiple of this (with -1, never a token) so their number is traced
MAX_TOP_LOGPROBS = 20  # the most alternatives `generate(logprobs=k)` reports per token (OpenAI's API allows 20)


@dataclasses.dataclass
class Generation:
    """Result of `generate`.

    tokens: per prompt, the new token ids; a stop token that ended the sequence is included, nothing after it.
    finish_reasons: per prompt, "stop" (a stop token was emitted) or "length" (max_new_tokens reached).
    stats: measured figures of this call (seconds, tokens/s, cache bytes).
    logprobs: per prompt, the log-probability of each new token under the model's distribution before any
      sampling filter, at temperature 1 (log_softmax of the raw logits): one float per entry of tokens[i].
    top_logprobs: with `generate(logprobs=k)`, k > 0: per prompt, per new token, the k most likely
      (token id, log-probability) pairs under that same distribution, best first (ties: lower id first); else None.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict = dataclasses.field(default_factory=dict)
    text: list[str] | None = None  # decoded new tokens, when the model has a tokenizer
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


# --- compiled pieces ------------------------------------------------------------------------------------------


def _forward(params, tokens, cache, *, config, attention, prefill=False, last_only=False, mesh=None, active=None):
    """tokens int32[B, T] into the cache -> (float32[B, T or 1, V], cache). With a mesh, the cache keeps its
    (data, model) sharding (a constraint on the way out, so SPMD propagation cannot choose to gather it).
    `active` (bool[B], paged caches): rows that store their tokens; the others are padding, so a finished
    sequence takes no more pages."""
    positions = cache.positions(tokens.shape[1])
    if active is not None:
        positions = jnp.where(active[:, None], positions, -1)
    logits, cache = Decoder(config, mesh).apply({"params": params}, tokens, positions, cache,
                                                prefill=prefill, last_only=last_only, attention=attention)
    return logits, sharding.constrain_cache(cache, mesh)


def _check_config(config):
    if not isinstance(config, Config):
        raise ValueError(f"config must be a jaxkv.Config, got {type(config).__name__}")


def _check_batch_ids(name: str, ids, batch: int | None = None, length: bool = False):
    """ids as an integer array [B] (or [B, T] with `length`; a list becomes a numpy array), or ValueError."""
    if not hasattr(ids, "dtype"):
        ids = np.asarray(ids)
    if ids.ndim != (2 if length else 1) or not jnp.issubdtype(ids.dtype, jnp.integer) or 0 in ids.shape:
        want = "int32[B, T]" if length else "int32[B]"
        raise ValueError(f"{name} must be a non-empty integer array {want}, got shape {ids.shape} and dtype "
                         f"{ids.dtype}")
    if batch is not None and ids.shape[0] != batch:
        raise ValueError(f"{name} has {ids.shape[0]} rows, the cache has {batch}")
    return ids


@functools.partial(jax.jit, static_argnames=("config", "capacity", "attention", "cache_dtype", "ring", "mesh"))
def _prefill(params, tokens, start, *, config, capacity, attention, cache_dtype, ring, mesh):
    cache = sharding.constrain_cache(KVCache.allocate(config, tokens.shape[0], capacity, dtype=cache_dtype,
                                                      start=start, ring=ring), mesh)
    logits, cache = _forward(params, tokens, cache, config=config, attention=attention, prefill=True,
                             last_only=True, mesh=mesh)
    return logits[:, 0], cache


def prefill(params, tokens, start, *, config: Config, capacity: int, attention: str = "auto",
            cache_dtype: str | None = None, ring: bool = False, mesh: Mesh | None = None):
    """Allocates a cache of `capacity` slots and fills slots [0, T) with the left-padded prompts (one jit).

    Args:
      tokens: int32[B, T], prompt b in tokens[b, start[b]:] (`left_pad` builds both from ragged prompts).
      start: int32[B], the number of padding slots before each prompt.
      capacity: S, cache slots per row: at least T (unless `ring`), at most config.max_positions.
      attention: "auto" (Pallas on GPU/TPU, XLA on CPU), "xla" or "pallas".
      cache_dtype: one of `jaxkv.cache.CACHE_DTYPES`; default config.dtype.
      ring: a ring cache of `capacity` slots (sliding-window models; `KVCache`); T may then exceed capacity.
      mesh: a ("data", "model") mesh (`jaxkv.sharding`): params, tokens and start are global arrays sharded as
        that module says, the config's n_kv_heads is the sharded (replicated) count, and the cache is allocated
        split over batch and KV heads.

    Returns:
      (float32[B, V] logits of each prompt's last token, the cache with length T).

    Raises:
      ValueError: before any compute, for shapes that cannot fit (T > capacity without a ring, capacity beyond
        the model's max positions) or bad arguments.
    """
    args, kwargs = _prefill_args(params, tokens, start, config=config, capacity=capacity, attention=attention,
                                 cache_dtype=cache_dtype, ring=ring, mesh=mesh)
    return _prefill(*args, **kwargs)


def _prefill_args(params, tokens, start, *, config, capacity, attention="auto", cache_dtype=None, ring=False,
                  mesh=None):
    """Validates `prefill`'s arguments (ValueError before any compute) -> (args, kwargs) of `_prefill`."""
    _check_config(config)
    tokens = _check_batch_ids("tokens", tokens, length=True)
    B, T = tokens.shape
    start = _check_batch_ids("start", start, B)
    capacity = checks.check_int("capacity", capacity, 1, config.max_positions)
    if T > capacity and not (ring and config.every_layer_sliding):  # full-attention layers keep every slot
        raise ValueError(f"the prompts take {T} slots, more than the cache's capacity of {capacity}")
    kwargs = dict(config=config, capacity=capacity, attention=attention_impls.resolve(attention),
                  cache_dtype=check_cache_dtype(config.dtype if cache_dtype is None else cache_dtype),
                  ring=bool(ring), mesh=mesh)
    return (params, tokens, start), kwargs


@functools.partial(jax.jit, static_argnames=("config", "attention", "mesh"), donate_argnames=("cache",))
def _decode_step(params, tokens, cache: KVCache, *, config, attention, mesh):
    logits, cache = _forward(params, tokens[:, None], cache, config=config, attention=attention, mesh=mesh)
    return logits[:, 0], cache


def decode_step(params, tokens, cache: KVCache, *, config: Config, attention: str = "auto", mesh: Mesh | None = None):
    """One decode step for a research loop: tokens int32[B] -> (float32[B, V] logits, cache).

    The token goes to slot `cache.length` of every row; the cache is donated (XLA writes the new K/V into its
    buffers in place, and the caller's cache is invalid afterwards). A plain cache holds `capacity` tokens: a
    step on a full cache is not an error the host can see without waiting for the device, so instead its logits
    are NaN, `cache.overflowed` becomes true and `cache.check()` fails under `jax.experimental.checkify`
    (nothing plausible comes out). A row whose position reaches config.max_positions likewise gets NaN logits.
    `mesh`: as in `prefill`.
    """
    args, kwargs = _decode_step_args(params, tokens, cache, config=config, attention=attention, mesh=mesh)
    return _decode_step(*args, **kwargs)


def _decode_step_args(params, tokens, cache, *, config, attention="auto", mesh=None):
    """Validates `decode_step`'s arguments -> (args, kwargs) of `_decode_step`."""
    _check_config(config)
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a jaxkv.KVCache (from prefill), got {type(cache).__name__}")
    tokens = _check_batch_ids("tokens", tokens, cache.batch)
    return (params, tokens, cache), dict(config=config, attention=attention_impls.resolve(attention), mesh=mesh)


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
    logprobs: float32[B, max_steps], log p(token) of each emitted token under `logits` at temperature 1 with no
             filter (`sampling.token_logprobs`); garbage where `tokens` is -1. None: not recorded.
    top_ids, top_logprobs: int32 and float32[B, max_steps, k], each step's k most likely tokens (k static, from
             the shape; k = 0 records none). None: not recorded.
    """

    cache: KVCache
    logits: jax.Array
    key: jax.Array
    done: jax.Array
    num_new: jax.Array
    step: jax.Array
    tokens: jax.Array
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def _emit(state: LoopState, *, sampler, stop_ids, stream, rows, vocab_size):
    """Samples one token per row and updates the stop bookkeeping -> (state, int32[B] tokens to feed back).

    The sampler sees the first `rows` rows (the caller's own, without batch padding). A row stops after a stop
    token or an id outside the vocabulary (recorded as emitted, so the host can report it; never fed back).
    With `stream`, the tokens and which rows emitted one go to the host as they are produced (an ordered
    io_callback: the compiled loop stays one loop, the host sees every step in order).
    """
    B = state.logits.shape[0]
    key, sample_key = jax.random.split(state.key)
    logits = state.logits if rows is None else state.logits[:rows]
    tokens = sampler(logits, sample_key)
    want = (B if rows is None else rows,)
    if getattr(tokens, "shape", None) != want or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"the sampler must return integer token ids of shape {want}, got "
                         f"{getattr(tokens, 'shape', None)} {getattr(tokens, 'dtype', type(tokens).__name__)}")
    tokens = tokens.astype(jnp.int32)
    if rows is not None and rows < B:
        tokens = jnp.concatenate([tokens, jnp.zeros((B - rows,), jnp.int32)])
    running = ~state.done
    # NaN logits mean the row's last token did not fit (a full cache, a position past the model's range; see
    # `Decoder`): emit -1 and stop the row rather than whatever id a sampler makes of NaN.
    tokens = jnp.where(jnp.any(jnp.isnan(state.logits), axis=-1), -1, tokens)
    valid = (tokens >= 0) & (tokens < vocab_size)
    if stream is not None:
        io_callback(functools.partial(_call_stream, stream), None, tokens, running & valid, ordered=True)
    out = lax.dynamic_update_slice(state.tokens, jnp.where(running, tokens, -1)[:, None], (0, state.step))
    if state.logprobs is not None:
        state = _record_logprobs(state, tokens)
    stopped = jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1) | ~valid
    state = state.replace(key=key, done=state.done | stopped, num_new=state.num_new + running.astype(jnp.int32),
                          step=state.step + 1, tokens=out)
    return state, jnp.where(running & valid, tokens, 0)


# stream -> the exception it raised in a running loop. XLA reports a host callback's exception as an opaque
# runtime error ("INTERNAL: ... CpuCallback error"), so the loop's caller re-raises the callback's own from here.
# Keyed by the stream (hashed by value, as jit's static argument is): a compiled loop calls the stream it was
# traced with, which equals the caller's.
_stream_errors: dict = {}


def _call_stream(stream, tokens, emitted):
    try:
        stream(tokens, emitted)
    except BaseException as exc:
        _stream_errors[stream] = exc
        raise


def _on_host_surfacing(stream, run):
    """`run()` (a decode loop, read back to the host) -> its result; if `stream` raised in it, that exception."""
    _stream_errors.pop(stream, None)
    try:
        return run()
    except Exception as exc:
        error = _stream_errors.pop(stream, None) if stream is not None else None
        if error is not None:
            raise error from exc
        raise


def _record_logprobs(state: LoopState, tokens) -> LoopState:
    """Writes column `step` of the log-probability buffers: the tokens' and the top k's, from the raw logits
    the tokens were sampled from (before the sampler's temperature and filters, so what a row reports does not
    depend on how it was sampled)."""
    chosen, top_ids, top_logprobs = token_logprobs(state.logits, tokens, state.top_ids.shape[-1])
    column = lambda buf, x: lax.dynamic_update_slice(  # noqa: E731
        buf, x[:, None], (0, state.step) + (0,) * (buf.ndim - 2))
    return state.replace(logprobs=column(state.logprobs, chosen), top_ids=column(state.top_ids, top_ids),
                         top_logprobs=column(state.top_logprobs, top_logprobs))


class _LoopOut(NamedTuple):
    """What `_decode_loop` returns (host code reads the first four and the log-probabilities; `LoopState` says
    what each holds)."""

    tokens: jax.Array  # int32[B, max_steps]
    num_new: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    forward_passes: jax.Array  # int32[], the decode forward passes run
    cache: KVCache
    logprobs: jax.Array  # float32[B, max_steps]
    top_ids: jax.Array  # int32[B, max_steps, k]
    top_logprobs: jax.Array  # float32[B, max_steps, k]


@functools.partial(jax.jit, static_argnames=("config", "max_steps", "rows", "attention", "stream", "mesh",
                                             "logprobs"),
                   donate_argnames=("cache",))
def _decode_loop(params, cache: KVCache, logits, key, sampler, stop_ids, done, steps, *, config: Config,
                 max_steps: int, rows: int | None, attention: str, stream: Callable | None, mesh: Mesh | None,
                 logprobs: int = 0) -> _LoopOut:
    """The loop behind `decode`: emits up to `steps` (traced, <= max_steps) tokens per row, feeding back all but
    the last, and stops early once every row is done (`done` may start true: batch filler rows). `logprobs`: k,
    the alternatives recorded per token (static; 0 records only each token's own log-probability)."""
    B = logits.shape[0]
    state = LoopState(cache=cache, logits=logits, key=key, done=done, num_new=jnp.zeros((B,), jnp.int32),
                      step=jnp.zeros((), jnp.int32), tokens=jnp.full((B, max_steps), -1, jnp.int32),
                      logprobs=jnp.zeros((B, max_steps), jnp.float32),
                      top_ids=jnp.zeros((B, max_steps, logprobs), jnp.int32),
                      top_logprobs=jnp.zeros((B, max_steps, logprobs), jnp.float32))

    emit = functools.partial(_emit, sampler=sampler, stop_ids=stop_ids, stream=stream, rows=rows,
                             vocab_size=config.vocab_size)

    paged = isinstance(cache, PagedKVCache)

    def body(carry):
        state, feed = carry
        logits, cache = _forward(params, feed[:, None], state.cache, config=config, attention=attention, mesh=mesh,
                                 active=~state.done if paged else None)
        return emit(state.replace(cache=cache, logits=logits[:, 0]))

    # Sample, then (while a row runs and tokens are left) feed back and sample again: steps - 1 forward passes at
    # most, the last token is never fed back, and a batch that stops at once runs none.
    state, _ = lax.while_loop(lambda c: (c[0].step < steps) & ~jnp.all(c[0].done), body, emit(state))
    out = _LoopOut(tokens=state.tokens, num_new=state.num_new, done=state.done, forward_passes=state.step - 1,
                   cache=state.cache, logprobs=state.logprobs, top_ids=state.top_ids,
                   top_logprobs=state.top_logprobs)
    if mesh is not None:  # everything but the cache, readable by every process
        out = out._replace(**{name: sharding.replicated(getattr(out, name), mesh)
                              for name in out._fields if name != "cache"})
    return out


class Decoded(NamedTuple):
    """What `decode` returns.

    tokens:  int32[B, steps], the sampled ids; -1 after a row stopped (and after the loop ended early because
             every row had stopped). A row's output is tokens[b, :num_new[b]]. A -1 inside it means the row's
             logits were NaN (its tokens no longer fit the cache or the model's positions) and stopped it there.
    num_new: int32[B], tokens emitted per row, up to and including its stop token.
    done:    bool[B], the row emitted a stop token (or an id outside the vocabulary, which also stops it).
    cache:   the cache after the loop: it holds every emitted token but the last one of each row.
    """

    tokens: jax.Array
    num_new: jax.Array
    done: jax.Array
    cache: KVCache


def _steps_bound(capacity: int, ring: bool, steps: int) -> int:
    """The static size of the loop's token buffer: a plain cache can feed back at most `capacity` tokens, so one
    bound per cache shape serves every `steps` (no recompile per max_new_tokens); a ring has no such bound, so
    its steps are bucketed to powers of two."""
    return capacity + 1 if not ring else max(64, memory._next_pow2(steps))


def _decode_args(params, cache, logits, key, sampler, stop_ids, *, config, steps, attention="auto", stream=None,
                 mesh=None):
    """Validates `decode`'s arguments (ValueError before any compute) -> (args, kwargs) of `_decode_loop`."""
    _check_config(config)
    if not isinstance(cache, (KVCache, PagedKVCache)):
        raise ValueError(f"cache must be a jaxkv.KVCache (from prefill) or a PagedKVCache, got "
                         f"{type(cache).__name__}")
    steps = checks.check_int("steps", steps, 1)
    if np.shape(logits) != (cache.batch, config.vocab_size):
        raise ValueError(f"logits must be float32[{cache.batch}, {config.vocab_size}] (the cache's batch and the "
                         f"vocabulary), got shape {np.shape(logits)}")
    paged = isinstance(cache, PagedKVCache)
    ring = False if paged else cache.ring
    if not ring and steps - 1 > cache.capacity:
        raise ValueError(f"steps={steps} feeds back {steps - 1} tokens; the cache holds only {cache.capacity}")
    if paged:
        _check_pages(cache, steps, config)
    elif not isinstance(cache.length, jax.core.Tracer) and cache.start.is_fully_addressable:
        # Known on the host (one scalar read, after the prefill has run): refuse what cannot fit, before compute.
        length, first = int(cache.length), int(np.min(np.asarray(cache.start)))
        if not cache.ring and length + steps - 1 > cache.capacity:
            raise ValueError(f"the cache holds {length} of {cache.capacity} slots; steps={steps} would write "
                             f"{steps - 1} more (the last sampled token is not fed back): at most "
                             f"{cache.capacity - length + 1} steps fit")
        if length - first + steps - 1 > config.max_positions:
            raise ValueError(f"steps={steps} would take a sequence to position {length - first + steps - 2}, past "
                             f"the model's max positions ({config.max_positions})")
    if stream is not None and not callable(stream):
        raise ValueError(f"stream must be a callable (tokens, running), got {stream!r}")
    args = (params, cache, logits, key, _as_sampler(sampler), _as_stop_ids(stop_ids),
            jnp.zeros((cache.batch,), bool), jnp.int32(steps))
    kwargs = dict(config=config, max_steps=_steps_bound(cache.capacity, ring, steps), rows=None,
                  attention=attention_impls.resolve(attention), stream=stream, mesh=mesh)
    return args, kwargs


def _check_pages(cache: PagedKVCache, steps: int, config: Config):
    """A paged cache known on the host: refuse steps whose slots, positions or pages cannot fit, before compute."""
    if isinstance(cache.lengths, jax.core.Tracer):
        return  # inside a user's jit: a row that finds no page is poisoned instead (`PagedKVCache`)
    lengths, table = np.asarray(cache.lengths), np.asarray(cache.page_table)
    end = lengths + steps - 1  # slots written by the end: the last sampled token is not fed back
    if end.max() > cache.capacity:
        raise ValueError(f"steps={steps} would take a sequence to {int(end.max())} slots; its page table holds "
                         f"{cache.capacity}")
    if end.max() > config.max_positions:
        raise ValueError(f"steps={steps} would take a sequence past the model's max positions "
                         f"({config.max_positions})")
    held = (table >= 0).sum(axis=1)
    need = int(np.maximum(-(-end // cache.page_size) - held, 0).sum())
    free = int((np.asarray(cache.refcounts) == 0).sum())
    if need > free:
        raise ValueError(f"steps={steps} needs {need} more pages; the pool has {free} free")


def decode(params, cache: KVCache, logits, key, sampler, stop_ids, *, config: Config, steps: int,
           attention: str = "auto", stream: Callable | None = None, mesh: Mesh | None = None) -> Decoded:
    """Samples up to `steps` tokens per row in one compiled loop (a `lax.while_loop`: `steps` is a traced bound,
    so different step counts reuse one compiled loop per cache shape, and the loop ends as soon as every row has
    stopped).

    Args:
      cache: the prefilled cache (donated: updated in place). A plain cache must have room for the steps - 1
        tokens fed back (ValueError otherwise, before compute).
      logits: float32[B, V], the logits of each row's last token (from `prefill` or `decode_step`).
      key: a PRNG key (`jax.random.PRNGKey(seed)`); split every step.
      sampler: `(logits float32[B, V], key) -> int32[B]`: a `jaxkv.Sampler`, any pytree callable (a
        `flax.struct` dataclass, a `jax.tree_util.Partial`: its array leaves are traced, so new values never
        recompile), or a plain function (static: the same function reuses the compiled loop).
      stop_ids: the ids that stop a row (a list, or an int32 array padded with -1).
      stream: optional host function (tokens int32[B], emitted bool[B]) called once per step, in order.
      mesh: as in `prefill`; the cache stays split over (data, model) every step, and the returned tokens,
        counts and flags are replicated so that every process can read them.

    Returns:
      `Decoded(tokens, num_new, done, cache)`. To continue a row from where it ended, feed its last token:
      `logits, cache = decode_step(params, tokens[:, -1], cache, config=config)` (after an early exit, take each
      row's tokens[b, num_new[b] - 1]), then call `decode` again with those logits and a fresh key.
    """
    args, kwargs = _decode_args(params, cache, logits, key, sampler, stop_ids, config=config, steps=steps,
                                attention=attention, stream=stream, mesh=mesh)
    out = _decode_loop(*args, **kwargs)
    return Decoded(out.tokens[:, :steps], out.num_new, out.done, out.cache)


def _lowering(prepare, jitted):
    """A public wrapper's `.lower(...)`: the same checks, then the compiled function's `jax.stages.Lowered` (for
    HLO inspection)."""

    def lower(*args, **kwargs):
        args, kwargs = prepare(*args, **kwargs)
        return jitted.lower(*args, **kwargs)

    return lower


prefill.lower = _lowering(_prefill_args, _prefill)
decode_step.lower = _lowering(_decode_step_args, _decode_step)
decode.lower = _lowering(_decode_args, _decode_loop)


def _as_sampler(sampler):
    """A sampler as a pytree callable for the compiled loop. A `Sampler` or any other pytree (flax.struct
    dataclass, Partial) passes through, its leaves traced; a plain function becomes a leafless Partial (static,
    hashed by identity)."""
    if not callable(sampler):
        raise ValueError(f"sampler must be a callable (logits, key) -> token ids, got {sampler!r}")
    leaves, treedef = jax.tree.flatten(sampler)
    if treedef.num_leaves == 1 and leaves[0] is sampler:  # not a pytree: an opaque function
        return jax.tree_util.Partial(sampler)
    return sampler


def _as_stop_ids(stop_ids):
    """Stop ids as int32[n], n a multiple of STOP_ID_SLOTS (padded with -1), so their number is traced."""
    if isinstance(stop_ids, jax.Array) and stop_ids.ndim == 1 and stop_ids.dtype == jnp.int32:
        return stop_ids
    ids = np.asarray([] if stop_ids is None else stop_ids).ravel()
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"stop_ids must be integer token ids, got {stop_ids!r}")
    slots = max(STOP_ID_SLOTS, -(-ids.size // STOP_ID_SLOTS) * STOP_ID_SLOTS)
    return jax.device_put(np.concatenate([ids.astype(np.int32), np.full(slots - ids.size, -1, np.int32)]))


def left_pad(prompts, *, length: int | None = None):
    """Ragged prompts (lists of token ids) -> (int32[B, T] tokens, int32[B] start), numpy arrays for `prefill`:
    prompt b right-aligned in row b, after start[b] = T - len(prompt b) padding slots (token 0, never attended to).

    length: T, default the longest prompt; a fixed T (a bucket) lets different batches share a compiled shape.
    """
    token_lists = [list(map(int, p)) for p in prompts]
    if not token_lists or any(len(p) == 0 for p in token_lists):
        raise ValueError("left_pad needs at least one prompt, each of at least one token")
    longest = max(len(p) for p in token_lists)
    T = longest if length is None else checks.check_int("length", length, longest)
    tokens = np.zeros((len(token_lists), T), np.int32)
    start = np.array([T - len(p) for p in token_lists], np.int32)
    for b, p in enumerate(token_lists):
        tokens[b, start[b]:] = p
    return tokens, start


# --- host side ------------------------------------------------------------------------------------------------

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
compile_seconds = [0.0]  # running total of tracing + lowering + compiling in this process (all threads)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **_: compile_seconds.__setitem__(0, compile_seconds[0] + duration)
    if event in _COMPILE_EVENTS else None)


class _Phase:
    """Wall time of a phase, split into compile time (from JAX's compile events) and the rest."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), compile_seconds[0]
        return self

    def __exit__(self, *exc):
        self.compile_s = compile_seconds[0] - self.c0
        self.run_s = max(time.perf_counter() - self.t0 - self.compile_s, 0.0)

    @classmethod
    def empty(cls) -> "_Phase":
        """A phase that took no time (for a path that does not time it separately)."""
        phase = cls()
        phase.compile_s = phase.run_s = 0.0
        return phase


def _token_lists(prompts, vocab_size: int, tokenizer, what: str = "prompt",
                 special_tokens: bool = True) -> list[list[int]]:
    """Checked token-id lists (ValueError naming `what` and the index otherwise). Strings are encoded with the
    tokenizer; `special_tokens=False` adds no BOS (a text that continues another, as `jaxkv.score`'s
    continuations do)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"{what}s must be a list of token-id lists (or of strings, for a model with a tokenizer)")
    if any(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError(f"text {what}s need a model with a tokenizer; this one has none: pass token ids")
        encode = tokenizer.encode if special_tokens else functools.partial(tokenizer.encode, add_special_tokens=False)
        prompts = [encode(p).ids if isinstance(p, str) else p for p in prompts]
    if len(prompts) == 0:
        raise ValueError(f"{what}s is empty: pass at least one {what}")
    out = []
    for i, prompt in enumerate(prompts):
        arr = np.asarray(prompt)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ValueError(f"{what} {i} must be a flat list of integer token ids")
        if arr.size == 0:
            raise ValueError(f"{what} {i} is empty: a {what} needs at least one token")
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            raise ValueError(f"{what} {i}: token id {int(arr[bad][0])} is outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in arr])
    return out


def _sampler(temperature, top_k, top_p, min_p, sampler, rows: int, batch: int):
    """(the sampler for the compiled loop, the rows it sees): a custom sampler sees exactly the caller's `rows`
    rows; the built-in `Sampler` gets one setting per row of the padded batch (filler rows greedy), so scalar and
    per-row settings share one compiled loop."""
    if sampler is not None:
        if temperature != 0.0 or top_k is not None or top_p is not None or min_p is not None:
            raise ValueError("pass either sampler or temperature/top_k/top_p/min_p, not both")
        return _as_sampler(sampler), rows
    s = checks.sampling(temperature, top_k, top_p, min_p, rows=rows)
    disabled = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    per_row = {}
    for name, value in s.items():
        values = value if isinstance(value, list) else [value] * rows
        values = [disabled[name] if v is None else v for v in values] + [disabled[name]] * (batch - rows)
        per_row[name] = np.asarray(values, np.int32 if name == "top_k" else np.float32)
    return Sampler(**per_row), None


def _stop_ids(stop_tokens, config: Config) -> np.ndarray:
    ids = list(config.eos_ids) if stop_tokens is None else stop_tokens
    if isinstance(ids, (int, np.integer)):
        ids = [ids]
    ids = [checks.check_int("stop token", t, 0) for t in ids]
    for t in ids:
        if t >= config.vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {config.vocab_size})")
    slots = max(STOP_ID_SLOTS, -(-len(ids) // STOP_ID_SLOTS) * STOP_ID_SLOTS)
    return np.array(ids + [-1] * (slots - len(ids)), np.int32)


def _key(seed: int) -> np.ndarray:
    """The PRNG key of a seed, over the seed's full range (`checks.seed_words`), built on the host: for seeds below
    2**32 it equals `jax.random.PRNGKey(seed)`."""
    high, low = checks.seed_words(seed)
    if jax.config.jax_default_prng_impl != "threefry2x32":  # another key layout: fold the high word in
        return jax.random.fold_in(jax.random.PRNGKey(low), high) if high else jax.random.PRNGKey(low)
    return np.array([high, low], np.uint32)


@dataclasses.dataclass
class _Request:
    """A validated `generate` call, laid out for the compiled pieces (host numpy arrays)."""

    token_lists: list[list[int]]
    max_new_tokens: int
    sampler: Callable
    rows: int | None  # rows the sampler sees (a custom sampler: the caller's batch), None: all
    stop_ids: np.ndarray  # int32[n], padded with -1
    key: np.ndarray
    attention: str  # resolved: "xla" or "pallas"
    plan: memory.CachePlan
    tokens: np.ndarray  # int32[padded batch, T], left-padded
    start: np.ndarray  # int32[padded batch]
    done: np.ndarray  # bool[padded batch]: filler rows start done, so they never hold the loop open

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.token_lists]


def _request(model: Model, prompts, *, max_new_tokens, temperature, top_k, top_p, min_p, sampler, seed, stop_tokens,
             max_len, cache_dtype, attention, batch_multiple: int = 1) -> _Request:
    """Validates a `generate` call (ValueError, before any compute) and lays it out as `memory.plan_cache` says:
    the batch padded to a power of two (then a multiple of `batch_multiple`, the devices it is split over), the
    prompts left-padded to a length bucket."""
    config = model.config
    token_lists = _token_lists(prompts, config.vocab_size, model.tokenizer)
    max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens, 1)
    stop_ids = _stop_ids(stop_tokens, config)
    key = _key(seed)
    cache_dtype = check_cache_dtype(config.dtype if cache_dtype is None else cache_dtype)
    # Resolved here, before compute: unknown names fail, and "auto" becomes a concrete static name for jit.
    attention = attention_impls.resolve(attention or config.attention)
    if max_len is not None:
        max_len = checks.check_int("max_len", max_len, 1)
    plan = memory.plan_cache(config, [len(p) for p in token_lists], max_new_tokens, max_len=max_len,
                             cache_dtype=cache_dtype, batch_multiple=batch_multiple)
    sample_fn, rows = _sampler(temperature, top_k, top_p, min_p, sampler, len(token_lists), plan.padded_batch)
    tokens, start = left_pad(token_lists + [[0]] * (plan.padded_batch - plan.batch), length=plan.prompt_len)
    done = np.arange(plan.padded_batch) >= plan.batch
    return _Request(token_lists=token_lists, max_new_tokens=max_new_tokens, sampler=sample_fn, rows=rows,
                    stop_ids=stop_ids, key=key, attention=attention, plan=plan, tokens=tokens, start=start, done=done)


def _generation(model: Model, req: _Request, loop: _LoopOut, prefill_time: _Phase,
                decode_time: _Phase) -> Generation:
    """The `Generation` of a finished call: `loop` holds host arrays (`_on_host`) and the final cache (global
    arrays; a pmapped cache's leaves have a leading device axis, which changes no byte count)."""
    config = model.config
    out, num_new, stopped, forward_passes, cache = loop[:5]
    n, lengths = len(req.token_lists), req.lengths
    result = [out[b, : num_new[b]].tolist() for b in range(n)]
    for b, row in enumerate(result):
        bad = [t for t in row if not 0 <= t < config.vocab_size]
        if bad and bad[0] == -1:  # the row was stopped there (`_emit`)
            raise ValueError(f"prompt {b}: the model's logits became NaN after {len(row) - 1} new tokens")
        if bad:  # only a custom sampler can do this
            raise ValueError(f"the sampler returned token id {bad[0]} for prompt {b}, outside the vocabulary "
                             f"[0, {config.vocab_size})")
    reasons = ["stop" if stopped[b] else "length" for b in range(n)]
    decode_s = decode_time.run_s
    # The first new token comes from the prefill logits; each later one costs a one-token forward pass. The loop
    # stops once every row has stopped, so `forward_passes` is what ran (at most max_new_tokens - 1).
    steps = int(forward_passes)
    live = np.mean(lengths) + steps / 2
    if config.sliding_window is not None:
        live = min(live, config.sliding_window)
    step_bytes = roofline.decode_bytes_per_step(config, req.plan.padded_batch, live, jnp.dtype(config.dtype).itemsize,
                                                jnp.dtype(req.plan.cache_dtype).itemsize)
    steps_per_s = steps / decode_s if decode_s > 0 and steps > 0 else 0.0
    fed_back = sum(max(len(r) - 1, 0) for r in result)  # tokens that came out of decode forward passes
    stats = {
        "prompt_tokens": int(sum(lengths)),
        "new_tokens": int(sum(len(r) for r in result)),
        "padded_batch": req.plan.padded_batch,
        "padded_prompt_len": req.plan.prompt_len,
        "cache_capacity": req.plan.capacity,
        "cache_dtype": req.plan.cache_dtype,
        "cache_ring": req.plan.ring,
        # What the call needs (prompts x (longest prompt + max_new_tokens), `jaxkv.kv_cache_bytes`) and what the
        # cache arrays hold (padded batch x capacity, `jaxkv.memory.plan_cache`).
        "kv_cache_bytes_requested": req.plan.requested_bytes,
        "kv_cache_bytes": cache.nbytes(),
        # Read from the cache arrays' shards on one device: total / (data x KV-head shards) on a mesh.
        "kv_cache_bytes_per_device": sharding.cache_bytes_per_device(cache),
        # Seconds exclude tracing and compiling, which are reported apart (zero once a shape is warm).
        "prefill_s": prefill_time.run_s,
        "decode_s": decode_s,
        "compile_s": prefill_time.compile_s + decode_time.compile_s,
        "decode_steps": steps,
        "decode_steps_per_s": steps_per_s,
        "decode_tokens_per_s": fed_back / decode_s if decode_s > 0 else 0.0,
        # Bytes a step must move (weights + live K/V read + new K/V written; jaxkv.roofline) and the rate achieved.
        "bytes_per_step": float(step_bytes),
        "achieved_GBps": float(step_bytes * steps_per_s / 1e9),
    }
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(r, skip_special_tokens=True) for r in result]
    logprobs = [loop.logprobs[b, : num_new[b]].tolist() for b in range(n)]
    top = None
    if loop.top_ids.shape[-1]:
        top = [[list(zip(ids.tolist(), values.tolist()))
                for ids, values in zip(loop.top_ids[b, : num_new[b]], loop.top_logprobs[b, : num_new[b]])]
               for b in range(n)]
    return Generation(tokens=result, finish_reasons=reasons, stats=stats, text=text, logprobs=logprobs,
                      top_logprobs=top)


def _on_host(loop: _LoopOut, to_host=np.asarray) -> _LoopOut:
    """`_decode_loop`'s output with everything but the cache read to host arrays."""
    return loop._replace(**{name: to_host(getattr(loop, name)) for name in loop._fields if name != "cache"})


def generate(model: Model, prompts, *, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
             sampler: Callable | None = None, seed: int = 0, stop_tokens: Sequence[int] | None = None,
             max_len: int | None = None, cache_dtype: str | None = None, attention: str | None = None,
             stream: Callable | None = None, mesh: Mesh | None = None, n: int = 1,
             page_size: int | None = None, prefix_cache=None, logprobs: int = 0) -> Generation:
    """Generates up to `max_new_tokens` tokens for each prompt.

    Args:
      prompts: a list of token-id lists, of any lengths; or, for a model with a tokenizer, a string or a list of
        strings.
      temperature, top_k, top_p, min_p: sampling; temperature 0 is greedy. None disables a filter; a filter with
        temperature 0 is refused (it would do nothing). Each is a number, or a list with one value per prompt (a
        None entry disables that prompt's filter): greedy and sampled prompts mix in one call. top_k >= the
        vocabulary keeps every token.
      sampler: instead of the above, a jittable `(logits float32[B, V], key) -> int32[B]`, called with the B
        prompts given (never batch padding). A pytree (a `jaxkv.Sampler`-like flax.struct dataclass, a
        `jax.tree_util.Partial` holding arrays) has its leaves traced: new values never recompile. An id outside
        the vocabulary stops that prompt and raises ValueError.
      seed: PRNG seed, any integer in [-2**63, 2**64) (taken modulo 2**64, never truncated to 32 bits); the key
        is split every step.
      stop_tokens: ids that end a sequence (included in its output). None: the model's eos ids; []: never stop.
        The loop ends as soon as every prompt has stopped (`stats["decode_steps"]` counts the steps run).
      max_len: cache capacity in slots, at most the model's max positions; must hold the longest prompt plus
        max_new_tokens. Default: a power of two, so that similar requests share compiled shapes
        (`jaxkv.memory.plan_cache` gives the exact layout; stats report requested and allocated bytes). A
        sliding-window model's cache is a ring of at most `window` slots.
      cache_dtype: "float32", "bfloat16", "float16", "int8" or "float8_e4m3fn" (int8/fp8: quantized on write
        with a float32 scale per token per KV head). Default: the model's dtype.
      attention: "auto", "xla" or "pallas"; default config.attention ("auto": Pallas on GPU/TPU, XLA on CPU).
      stream: optional host callback `(prompt_index, token_id)`, called for every new token as the compiled loop
        produces it (tokens after a stop token are not passed). If it raises, the loop stops and generate raises
        that exception. With `mesh`, single-process only (each step's [B] tokens are gathered to one device for
        the callback).
      n: samples per prompt. With n > 1 (or a page_size) the cache is paged (`jaxkv.paged_cache`): each prompt
        is prefilled once and its n samples fork from it, sharing its full pages (its partly filled last page is
        copied per sample). Results are prompt-major: tokens[i * n + j] is sample j of prompt i (`stream` gets that
        row index). Each row draws its own samples; a per-prompt sampling setting applies to all its samples.
        `stats` adds the pages in use at the peak and the bytes private caches would have taken.
      page_size: slots per page of the paged cache (default 16 when n > 1); None and n == 1: the contiguous cache.
        With a paged cache, max_len bounds each sequence's slots (its page table), not the pool.
      prefix_cache: a `jaxkv.PrefixCache` (prompt caching): the call runs in its page pool, reuses the pages of
        any prefix it holds (whole pages of token ids) and prefills only the rest; the new prompts' pages stay
        cached for later calls. `stats` adds "prefix_hit_tokens" and "prefilled_tokens". A call that raises
        leaves the prefix cache as it found it.
      mesh: a `jax.sharding.Mesh` with axes ("data", "model"): the batch is split over "data" (padded up to a
        multiple of it), attention heads and the FFN hidden width over "model" (Megatron-style), the cache over
        batch and KV heads; see `jaxkv.sharding`, which also explains how KV heads fewer than the "model" axis
        are replicated. n_heads and ffn_dim must divide by the "model" axis. Works across processes (after
        `jax.distributed.initialize`): every process calls generate with the same arguments and gets all tokens.
        With the paged cache (n > 1, page_size, prefix_cache): a mesh with data 1, in one process; the pools
        split over KV heads (a prefix_cache built with `PrefixCache(..., mesh=mesh)`).
      logprobs: k in [0, MAX_TOP_LOGPROBS]. Every call fills `Generation.logprobs` (each new token's
        log-probability under the model's own distribution: temperature 1, no filter); k > 0 also fills
        `top_logprobs` with the k most likely tokens at each step. Both are computed inside the compiled loop.

    Raises:
      ValueError: for any bad argument, before any compute (and for a custom sampler's out-of-vocabulary id).
    """
    n = checks.check_int("n", n, 1)
    logprobs = checks.check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    if prefix_cache is not None:
        from jaxkv.prefix_cache import PrefixCache

        if not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a jaxkv.PrefixCache, got {type(prefix_cache).__name__}")
        page_size = prefix_cache.page_size if page_size is None else page_size
    if page_size is not None or n > 1 or prefix_cache is not None:
        if mesh is not None:
            mesh = sharding.check_paged_mesh(mesh)
            if jax.process_count() > 1:
                raise ValueError("n > 1, page_size and prefix_cache with a mesh run in one process only")
        return _generate_paged(model, prompts, n=n, page_size=memory.DEFAULT_PAGE_SIZE if page_size is None
                               else checks.check_int("page_size", page_size, 1), max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
                               seed=seed, stop_tokens=stop_tokens, cache_dtype=cache_dtype, attention=attention,
                               stream=stream, prefix_cache=prefix_cache, max_len=max_len, logprobs=logprobs,
                               mesh=mesh)
    if mesh is not None:
        mesh = sharding.check_mesh(mesh)
        if stream is not None and jax.process_count() > 1:
            # The callback runs on one device's host (device 0's process); the other processes would see nothing.
            raise ValueError("stream is not supported with a mesh spanning several processes")
    req = _request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, sampler=sampler, seed=seed, stop_tokens=stop_tokens, max_len=max_len,
                   cache_dtype=cache_dtype, attention=attention,
                   batch_multiple=1 if mesh is None else sharding.data_size(mesh))
    on_step = None
    if stream is not None:
        if not callable(stream):
            raise ValueError(f"stream must be a callable (prompt_index, token_id), got {stream!r}")
        on_step = _StepStream(stream, len(req.token_lists))
    params, config = model.params, model.config
    if mesh is None:
        # device_put, not jnp.asarray: the latter compiles a staging function per shape.
        put = lambda x, spec: jax.device_put(x)  # noqa: E731
    else:
        params, config = _sharded_params(model, mesh)
        put = lambda x, spec: jax.tree.map(  # noqa: E731
            lambda leaf: sharding.global_array(np.asarray(leaf), NamedSharding(mesh, spec)), x)

    plan, replicated = req.plan, PartitionSpec()
    with _Phase() as prefill_time:
        logits, cache = _prefill(params, put(req.tokens, sharding.BATCH_SPEC), put(req.start, sharding.BATCH_SPEC),
                                 config=config, capacity=plan.capacity, attention=req.attention,
                                 cache_dtype=plan.cache_dtype, ring=plan.ring, mesh=mesh)
        logits.block_until_ready()
    with _Phase() as decode_time:
        loop = _on_host_surfacing(on_step, lambda: _on_host(_decode_loop(
            params, cache, logits, put(req.key, replicated), put(req.sampler, replicated),
            put(req.stop_ids, replicated), put(req.done, sharding.BATCH_SPEC),
            put(np.int32(req.max_new_tokens), replicated), config=config,
            max_steps=_steps_bound(plan.capacity, plan.ring and config.every_layer_sliding, req.max_new_tokens),
            rows=req.rows, attention=req.attention,
            stream=on_step, mesh=mesh, logprobs=logprobs), sharding.to_host))
    return _generation(model, req, loop, prefill_time, decode_time)


@functools.partial(jax.jit, static_argnames=("config", "attention", "num_pages", "page_size", "max_pages",
                                             "cache_dtype", "mesh"))
def _prefill_paged(params, tokens, positions, parents, *, config, attention, num_pages, page_size, max_pages,
                   cache_dtype, mesh=None):
    """Prefills right-padded prompts (positions -1 after each) into a fresh pool, then forks the rows that decode
    from them: row r continues prompt parents[r] (-1: an empty filler row) -> (float32[R, V] logits, cache). With
    a mesh the pools are split over KV heads (`sharding.paged_cache_shardings`)."""
    cache = PagedKVCache.allocate(config, tokens.shape[0], num_pages=num_pages, page_size=page_size,
                                  max_len=max_pages * page_size, dtype=cache_dtype)
    cache = sharding.constrain_cache(cache, mesh)
    logits, cache = Decoder(config, mesh).apply({"params": params}, tokens, positions, cache, prefill=True,
                                                last_only=True, attention=attention)
    return logits[jnp.maximum(parents, 0), 0], sharding.constrain_cache(cache.fork(parents), mesh)


@functools.partial(jax.jit, static_argnames=("config", "attention", "mesh"))
def _prefill_suffix(params, tokens, positions, cache, parents, *, config, attention, mesh=None):
    """Prefills right-padded prompt suffixes (positions -1 after each) into a cache whose rows already hold their
    cached prefixes, attending over those pages (as stored) and over their own fresh K/V (`Decoder`'s `chunk`)
    -> (float32[R, V] logits of the rows forked by `parents`, the prefilled page table, the forked cache)."""
    cache = sharding.constrain_cache(cache, mesh)
    logits, cache = Decoder(config, mesh).apply({"params": params}, tokens, positions, cache, last_only=True,
                                                attention=attention, chunk=True)
    return logits[jnp.maximum(parents, 0), 0], cache.page_table, sharding.constrain_cache(cache.fork(parents), mesh)


def _generate_paged(model: Model, prompts, *, n, page_size, max_new_tokens, temperature, top_k, top_p, min_p,
                    sampler, seed, stop_tokens, cache_dtype, attention, stream, prefix_cache=None,
                    max_len=None, logprobs=0, mesh=None) -> Generation:
    """`generate` on a paged cache: each prompt prefilled once (after its cached prefix, with a prefix cache),
    its n samples forked from it. With a mesh (data 1): weights Megatron-style over "model", the pools over KV
    heads, everything else on every device, as `jaxkv.Engine` runs on one."""
    config = model.config
    token_lists = _token_lists(prompts, config.vocab_size, model.tokenizer)
    max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens, 1)
    stop_ids, key = _stop_ids(stop_tokens, config), _key(seed)
    cache_dtype = check_cache_dtype(config.dtype if cache_dtype is None else cache_dtype)
    attention = paged_attention_name(attention or config.attention, config)  # MLA: "xla" (no paged kernel)
    if max_len is not None:
        max_len = checks.check_int("max_len", max_len, 1)
    pages = memory.plan_pages(config, [len(p) for p in token_lists], max_new_tokens, n=n, page_size=page_size,
                              cache_dtype=cache_dtype, max_len=max_len)
    rows = pages.batch * n
    if sampler is None:  # per-prompt settings, repeated for each of the prompt's samples
        settings = checks.sampling(temperature, top_k, top_p, min_p, rows=pages.batch)
        temperature, top_k, top_p, min_p = ([v for v in settings[name] for _ in range(n)]
                                            if isinstance(settings[name], list) else settings[name]
                                            for name in ("temperature", "top_k", "top_p", "min_p"))
    sample_fn, sampler_rows = _sampler(temperature, top_k, top_p, min_p, sampler, rows, pages.padded_rows)
    on_step = None
    if stream is not None:
        if not callable(stream):
            raise ValueError(f"stream must be a callable (row_index, token_id), got {stream!r}")
        on_step = _StepStream(stream, rows)
    if prefix_cache is not None:
        prefix_cache.check(model, cache_dtype, page_size, mesh)
    # A call that fails at any point (a refused make_room, a sampler or stream that raises half way) leaves the
    # prefix cache's index and pool as it found them.
    with prefix_cache.transaction() if prefix_cache is not None else contextlib.nullcontext():
        hits = [[] for _ in token_lists]  # cached pages of each prompt's prefix
        if prefix_cache is not None:
            hits = [prefix_cache.match(p) for p in token_lists]
            # The pages this call adds: everything the plan counts but the prefix pages it reuses.
            prefix_cache.make_room(pages.pages_needed - sum(map(len, hits)), keep={p for h in hits for p in h})
        hit = [len(h) * page_size for h in hits]  # tokens found in the cache
        T = max(memory.MIN_PROMPT_BUCKET, memory._next_pow2(max(len(p) - h for p, h in zip(token_lists, hit))))
        tokens = np.zeros((pages.prefill_batch, T), np.int32)
        positions = np.full((pages.prefill_batch, T), -1, np.int32)
        for b, (p, h) in enumerate(zip(token_lists, hit)):
            tokens[b, :len(p) - h], positions[b, :len(p) - h] = p[h:], np.arange(h, len(p))
        parents = np.full((pages.padded_rows,), -1, np.int32)
        parents[:rows] = np.repeat(np.arange(pages.batch), n)
        done = np.arange(pages.padded_rows) >= rows

        params, run_config = (model.params, config) if mesh is None else _sharded_params(model, mesh)
        with _Phase() as prefill_time:
            if prefix_cache is None:
                logits, cache = _prefill_paged(params, jax.device_put(tokens), jax.device_put(positions),
                                               jax.device_put(parents), config=run_config, attention=attention,
                                               num_pages=pages.num_pages, page_size=page_size,
                                               max_pages=pages.max_pages, cache_dtype=cache_dtype, mesh=mesh)
            else:
                table = np.full((pages.prefill_batch, pages.max_pages), -1, np.int32)
                for b, h in enumerate(hits):
                    table[b, :len(h)] = h
                lengths = np.zeros((pages.prefill_batch,), np.int32)
                lengths[:len(hit)] = hit
                logits, prefilled, cache = _prefill_suffix(
                    params, jax.device_put(tokens), jax.device_put(positions), prefix_cache.cache(table, lengths),
                    jax.device_put(parents), config=run_config, attention=attention, mesh=mesh)
                cache = prefix_cache.remember(token_lists, np.asarray(prefilled), cache)
            logits.block_until_ready()
        with _Phase() as decode_time:
            loop = _on_host_surfacing(on_step, lambda: _on_host(_decode_loop(
                params, cache, logits, jax.device_put(key), sample_fn, jax.device_put(stop_ids),
                jax.device_put(done), jax.device_put(np.int32(max_new_tokens)), config=run_config,
                max_steps=_steps_bound(cache.capacity, False, max_new_tokens), rows=sampler_rows,
                attention=attention, stream=on_step, mesh=mesh, logprobs=logprobs)))
        cache = loop.cache
        overflowed = bool(np.asarray(cache.overflowed).any())
        peak = int(cache.pages_in_use())  # nothing is freed while decoding, so the end is the peak
        if prefix_cache is not None:
            prefix_cache.store(cache)  # the rows' pages released; the prefixes' stay cached
    if overflowed:  # the plan sizes the pool for the whole call: a bug if this happens
        raise RuntimeError("the paged pool ran out of pages; the plan should have prevented it")
    plan = memory.CachePlan(batch=rows, padded_batch=pages.padded_rows, prompt_len=T,
                            capacity=pages.max_pages * page_size, ring=False, cache_dtype=cache_dtype,
                            requested_bytes=pages.requested_bytes, allocated_bytes=pages.allocated_bytes)
    req = _Request(token_lists=[p for p in token_lists for _ in range(n)], max_new_tokens=max_new_tokens,
                   sampler=sample_fn, rows=sampler_rows, stop_ids=stop_ids, key=key, attention=attention, plan=plan,
                   tokens=tokens, start=np.zeros((pages.prefill_batch,), np.int32), done=done)
    result = _generation(model, req, loop, prefill_time, decode_time)
    page_bytes = memory.page_bytes(config, page_size, cache_dtype)
    result.stats.update({
        "prompt_tokens": int(sum(len(p) for p in token_lists)),  # each prompt once, not once per sample
        "n": n, "page_size": page_size,
        "num_pages": pages.num_pages if prefix_cache is None else prefix_cache.num_pages,
        # Pages held at the end (with a prefix cache: also the cached prefixes that other calls left).
        "pages_in_use_peak": peak, "kv_bytes_in_use_peak": peak * page_bytes,
        # What batch x n private contiguous sequences of prompt + max_new_tokens tokens would need.
        "kv_cache_bytes_unshared": pages.unshared_bytes,
        "prefix_hit_tokens": int(sum(hit)),
        "prefilled_tokens": int(sum(len(p) for p in token_lists) - sum(hit)),
    })
    if prefix_cache is not None:
        result.stats["kv_cache_bytes"] = prefix_cache.nbytes()
    return result


_sharded_cache: list = []  # [(params, config, mesh, sharded params, sharded config)]: the last model sharded


def _sharded_params(model: Model, mesh: Mesh):
    """`sharding.shard_params` of the model, remembered for the last (params, config, mesh) so that repeated
    calls do not re-copy the weights. The config is part of the key: the same params under another config (a
    `dataclasses.replace`d model) may shard or lay out differently."""
    if (_sharded_cache and _sharded_cache[0][0] is model.params and _sharded_cache[0][1] == model.config
            and _sharded_cache[0][2] == mesh):
        return _sharded_cache[0][3:]
    params, config = sharding.shard_params(model.params, model.config, mesh)
    _sharded_cache[:] = [(model.params, model.config, mesh, params, config)]
    return params, config


def generate_pmap(model: Model, prompts, *, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None,
                  min_p=None, sampler: Callable | None = None, seed: int = 0,
                  stop_tokens: Sequence[int] | None = None, max_len: int | None = None,
                  cache_dtype: str | None = None, attention: str | None = None,
                  stream: Callable | None = None, logprobs: int = 0) -> Generation:
    """`generate`, data-parallel over this process's local devices with `jax.pmap` (for scripts built on pmap).

    The padded batch is split evenly over the devices (padded further when it does not divide); each device runs
    the same prefill and decode loop on its rows with a replicated copy of the weights. Greedy tokens equal
    `generate`'s. Sampling draws from a per-device key (the seed's key split per device), so sampled tokens
    differ from `generate`'s while following the same distribution. `stream` is not supported, nor a custom
    `sampler` (it would see each device's rows, not the caller's batch). `jax.pmap` is in maintenance mode;
    `generate(..., mesh=...)` is the scalable path (weights sharded too, multi-host).
    """
    logprobs = checks.check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    if stream is not None:
        raise ValueError("stream is not supported by generate_pmap")
    if sampler is not None:
        raise ValueError("a custom sampler is not supported by generate_pmap (it would see each device's share of "
                         "the batch): use generate, or generate(..., mesh=...)")
    devices = jax.local_devices()
    n = len(devices)
    req = _request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, sampler=sampler, seed=seed, stop_tokens=stop_tokens, max_len=max_len,
                   cache_dtype=cache_dtype, attention=attention, batch_multiple=n)
    plan = req.plan
    batch, T = req.tokens.shape
    max_steps = _steps_bound(plan.capacity, plan.ring and model.config.every_layer_sliding, req.max_new_tokens)
    run = _pmapped(model.config, plan.capacity, req.attention, plan.cache_dtype, plan.ring, max_steps, n, logprobs)
    keys = jax.random.split(jnp.asarray(req.key), n)
    per_device = lambda x: x.reshape(n, batch // n, *x.shape[1:])  # noqa: E731
    # Each device's per-row settings travel with its rows.
    sampler_rows = jax.tree.map(per_device, req.sampler)
    with _Phase() as time_all:
        loop = run(model.params, per_device(req.tokens), per_device(req.start), keys, sampler_rows, req.stop_ids,
                   per_device(req.done), np.int32(req.max_new_tokens))
        # [devices, rows per device, ...] -> [batch, ...]; the pass count is each device's, the most of them ran.
        loop = _on_host(loop, lambda x: np.asarray(x).reshape(batch, *x.shape[2:]) if x.ndim > 1 else np.asarray(x))
        loop = loop._replace(forward_passes=int(np.max(loop.forward_passes)))
    # One compiled program: its time is reported as decode time, prefill_s is 0.
    return _generation(model, req, loop, _Phase.empty(), time_all)


@functools.lru_cache(maxsize=16)
def _pmapped(config, capacity, attention, cache_dtype, ring, max_steps, num_devices, logprobs):
    """The pmapped prefill + decode loop for one shape (cached, so the same shapes never re-trace)."""

    def run(params, tokens, start, key, sampler, stop_ids, done, steps):
        logits, cache = _prefill(params, tokens, start, config=config, capacity=capacity, attention=attention,
                                 cache_dtype=cache_dtype, ring=ring, mesh=None)
        return _decode_loop(params, cache, logits, key, sampler, stop_ids, done, steps, config=config,
                            max_steps=max_steps, rows=None, attention=attention, stream=None, mesh=None,
                            logprobs=logprobs)

    return jax.pmap(run, in_axes=(None, 0, 0, 0, 0, None, 0, None), devices=jax.local_devices()[:num_devices])


@dataclasses.dataclass(frozen=True)
class _StepStream:
    """Adapts a per-token callback to the per-step io_callback. Hashable by value, so the same user callback
    reuses the compiled loop."""

    callback: Callable
    num_prompts: int

    def __call__(self, tokens, emitted):
        for b in range(self.num_prompts):  # filler rows (batch padding) are never reported
            if emitted[b]:
                self.callback(b, int(tokens[b]))
