"""Generation: prefill, the decode step, and the `lax.scan` decode loop. Knows nothing of tokenizers.

The pipeline for one `generate` call:

  1. Host: validate everything (nothing is computed for bad input), pad the batch to a power of two and the
     prompts to a length bucket, left-aligned padding so that all sequences share one write slot.
  2. `prefill` (one jit): allocates the cache at its fixed shape, runs the whole padded prompt batch through the
     model in one pass, fills slots [0, T) and returns the last token's logits.
  3. `decode` (one jit, cache donated): a `lax.scan` over the new tokens. Each step samples a token from the
     previous logits, then runs only that token through the model: Q, K and V for one token, K and V appended at
     slot `length`, attention over the cache. Sequences that emitted a stop token are marked done and keep running
     as padding; the host drops everything after the stop token.

Shapes, sampling settings and seeds are arranged so nothing recompiles per prompt length or sampling setting:
prompt lengths and batch sizes are bucketed, sampling parameters, the PRNG key and the stop ids are traced values.

Several devices: `generate(..., mesh=mesh)` runs the same two jits SPMD over a ("data", "model") mesh (batch over
"data", heads and FFN over "model", the cache over both; the layout is `jaxkv.sharding`'s), from global arrays, so
it also runs across processes. `generate_pmap` is the data-parallel `jax.pmap` variant over local devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv import attention as attention_impls
from jaxkv import roofline, sharding
from jaxkv.cache import KVCache, check_cache_dtype
from jaxkv.config import Config
from jaxkv.model import Decoder, Model
from jaxkv.sampling import Sampler

MIN_PROMPT_BUCKET = 16  # prompts pad to a power of two >= this: lengths 1..500 compile 6 prefill shapes
CAPACITY_ROUNDING = 64  # default cache capacity: padded prompt + new tokens, rounded up to a multiple of this
STOP_ID_SLOTS = 8  # stop ids are padded to a multiple of this (with -1, never a token) so their number is traced


@dataclasses.dataclass
class Generation:
    """Result of `generate`.

    tokens: per prompt, the new token ids; a stop token that ended the sequence is included, nothing after it.
    finish_reasons: per prompt, "stop" (a stop token was emitted) or "length" (max_new_tokens reached).
    stats: measured figures of this call (seconds, tokens/s, cache bytes).
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict = dataclasses.field(default_factory=dict)
    text: list[str] | None = None  # decoded new tokens, when the model has a tokenizer


# --- compiled pieces ------------------------------------------------------------------------------------------


def _forward(params, tokens, cache, *, config, attention, prefill=False, last_only=False, mesh=None):
    """tokens int32[B, T] into the cache -> (float32[B, T or 1, V], cache). With a mesh, the cache keeps its
    (data, model) sharding (a constraint on the way out, so SPMD propagation cannot choose to gather it)."""
    logits, cache = Decoder(config, mesh).apply({"params": params}, tokens, cache.positions(tokens.shape[1]), cache,
                                                prefill=prefill, last_only=last_only, attention=attention)
    if mesh is not None:
        cache = sharding.constrain_cache(cache, mesh)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("config", "capacity", "attention", "cache_dtype", "ring", "mesh"))
def prefill(params, tokens, start, *, config: Config, capacity: int, attention: str, cache_dtype: str | None = None,
            ring: bool = False, mesh: Mesh | None = None):
    """Allocates a cache of `capacity` slots and fills slots [0, T) with the left-padded prompts.

    Args:
      tokens: int32[B, T], prompt b in tokens[b, start[b]:].
      start: int32[B], the number of padding slots before each prompt.
      cache_dtype: one of `jaxkv.cache.CACHE_DTYPES`; default config.dtype.
      ring: a ring cache of `capacity` slots (sliding-window models; `KVCache`); T may then exceed capacity.
      mesh: a ("data", "model") mesh (`jaxkv.sharding`): params, tokens and start are global arrays sharded as
        that module says, the config's n_kv_heads is the sharded (replicated) count, and the cache is allocated
        split over batch and KV heads.

    Returns:
      (float32[B, V] logits of each prompt's last token, the cache with length T).
    """
    cache = KVCache.allocate(config, tokens.shape[0], capacity, dtype=cache_dtype, start=start, ring=ring)
    if mesh is not None:
        cache = sharding.constrain_cache(cache, mesh)
    logits, cache = _forward(params, tokens, cache, config=config, attention=attention, prefill=True,
                             last_only=True, mesh=mesh)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("config", "attention", "mesh"), donate_argnames=("cache",))
def decode_step(params, tokens, cache: KVCache, *, config: Config, attention: str = "auto", mesh: Mesh | None = None):
    """One decode step for a research loop: tokens int32[B] -> (float32[B, V] logits, cache).

    The cache is donated: XLA writes the new K/V into the input buffers in place, and the caller's cache is
    invalid afterwards. The caller must ensure `cache.length < cache.capacity`. `mesh`: as in `prefill`.
    """
    logits, cache = _forward(params, tokens[:, None], cache, config=config, attention=attention, mesh=mesh)
    return logits[:, 0], cache


@flax.struct.dataclass
class LoopState:
    """The decode loop's carry.

    cache:   the KV cache (its `length` is the slot the next token goes to).
    logits:  float32[B, V], the logits the next token is sampled from.
    key:     the PRNG key; split every step, the half used for sampling is never reused.
    done:    bool[B], the sequence has emitted a stop token; later tokens are padding.
    num_new: int32[B], tokens emitted before and including the stop token.
    """

    cache: KVCache
    logits: jax.Array
    key: jax.Array
    done: jax.Array
    num_new: jax.Array


def _emit(state: LoopState, sampler, stop_ids, stream):
    """Samples one token per sequence and updates the stop bookkeeping -> (state, int32[B] tokens).

    With `stream`, the tokens and which rows are still running go to the host as they are produced (an ordered
    io_callback: the compiled loop stays one loop, the host sees every step in order).
    """
    key, sample_key = jax.random.split(state.key)
    tokens = sampler(state.logits, sample_key).astype(jnp.int32)
    if stream is not None:
        io_callback(stream, None, tokens, ~state.done, ordered=True)
    num_new = state.num_new + (~state.done).astype(jnp.int32)
    done = state.done | jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
    return state.replace(key=key, done=done, num_new=num_new), tokens


@functools.partial(jax.jit, static_argnames=("config", "steps", "attention", "stream", "mesh"),
                   donate_argnames=("cache",))
def decode(params, cache: KVCache, logits, key, sampler, stop_ids, *, config: Config, steps: int, attention: str,
           stream: Callable | None = None, mesh: Mesh | None = None):
    """Samples `steps` tokens per sequence in one compiled `lax.scan`.

    Args:
      cache: the prefilled cache (donated: updated in place).
      logits: float32[B, V], the prompts' last logits.
      sampler: a pytree callable `(logits, key) -> int32[B]` (a `Sampler`, or a user function wrapped in
        `jax.tree_util.Partial`).
      stop_ids: int32[n], padded with -1.
      stream: optional host function (tokens int32[B], running bool[B]) called once per step, in order.
      mesh: as in `prefill`; the cache stays split over (data, model) every step, and the returned tokens,
        counts and flags are replicated so that every process can read them.

    Returns:
      (int32[B, steps] tokens, int32[B] tokens emitted up to and including the stop token, bool[B] stopped,
       the cache).
    """
    B = logits.shape[0]
    state = LoopState(cache=cache, logits=logits, key=key, done=jnp.zeros((B,), bool),
                      num_new=jnp.zeros((B,), jnp.int32))

    def body(state, _):
        state, tokens = _emit(state, sampler, stop_ids, stream)
        logits, cache = _forward(params, tokens[:, None], state.cache, config=config, attention=attention,
                                 mesh=mesh)
        return state.replace(cache=cache, logits=logits[:, 0]), tokens

    # steps - 1 forward passes: the last token is sampled but never fed back.
    state, tokens = lax.scan(body, state, length=steps - 1)
    state, last = _emit(state, sampler, stop_ids, stream)
    tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1)  # [B, steps]
    num_new, done = state.num_new, state.done
    if mesh is not None:
        tokens, num_new, done = (sharding.replicated(x, mesh) for x in (tokens, num_new, done))
    return tokens, num_new, done, state.cache


# --- host side ------------------------------------------------------------------------------------------------

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]  # running total of tracing + lowering + compiling in this process (all threads)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **_: _compile_seconds.__setitem__(0, _compile_seconds[0] + duration)
    if event in _COMPILE_EVENTS else None)


class _Phase:
    """Wall time of a phase, split into compile time (from JAX's compile events) and the rest."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), _compile_seconds[0]
        return self

    def __exit__(self, *exc):
        self.compile_s = _compile_seconds[0] - self.c0
        self.run_s = max(time.perf_counter() - self.t0 - self.compile_s, 0.0)

    @classmethod
    def empty(cls) -> "_Phase":
        """A phase that took no time (for a path that does not time it separately)."""
        phase = cls()
        phase.compile_s = phase.run_s = 0.0
        return phase


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _token_lists(prompts, vocab_size: int, tokenizer) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError("prompts must be a list of token-id lists (or of strings, for a model with a tokenizer)")
    if any(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a model with a tokenizer; this one has none: pass token ids")
        prompts = [tokenizer.encode(p).ids if isinstance(p, str) else p for p in prompts]
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for i, prompt in enumerate(prompts):
        arr = np.asarray(prompt)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ValueError(f"prompt {i} must be a flat list of integer token ids")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            raise ValueError(f"prompt {i}: token id {int(arr[bad][0])} is outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in arr])
    return out


def _sampler(temperature, top_k, top_p, min_p, sampler):
    if sampler is not None:
        if temperature != 0.0 or top_k is not None or top_p is not None or min_p is not None:
            raise ValueError("pass either sampler or temperature/top_k/top_p/min_p, not both")
        if isinstance(sampler, Sampler):
            return sampler
        if not callable(sampler):
            raise ValueError(f"sampler must be a callable (logits, key) -> token ids, got {sampler!r}")
        # Partial keeps the function in the pytree's static structure: the same function never recompiles.
        return jax.tree_util.Partial(sampler)
    temperature = _check_float("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None:
        top_k = _check_int("top_k", top_k, 1)
    if top_p is not None:
        top_p = _check_float("top_p", top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_p is not None:
        min_p = _check_float("min_p", min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    return Sampler.make(temperature, top_k, top_p, min_p)


def _stop_ids(stop_tokens, config: Config) -> np.ndarray:
    ids = list(config.eos_ids) if stop_tokens is None else stop_tokens
    if isinstance(ids, (int, np.integer)):
        ids = [ids]
    ids = [_check_int("stop token", t, 0) for t in ids]
    for t in ids:
        if t >= config.vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {config.vocab_size})")
    slots = max(STOP_ID_SLOTS, -(-len(ids) // STOP_ID_SLOTS) * STOP_ID_SLOTS)
    return np.array(ids + [-1] * (slots - len(ids)), np.int32)


def plan_shapes(lengths: Sequence[int], max_new_tokens: int, max_len: int | None, config: Config):
    """Validates lengths and picks (padded batch, padded prompt length T, cache capacity S, ring). Raises ValueError.

    A sliding-window model gets a ring cache of at most `window` slots (memory O(window), not O(sequence)), so its
    sequences are limited by max positions only; `max_len` below the window gives a plain cache of that size.
    """
    longest = max(lengths)
    for i, n in enumerate(lengths):
        if n + max_new_tokens > config.max_positions:
            raise ValueError(f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{n + max_new_tokens} positions, beyond the model's max positions "
                             f"({config.max_positions})")
    window = config.sliding_window
    bucket = max(MIN_PROMPT_BUCKET, _next_pow2(longest))
    if max_len is not None:
        max_len = _check_int("max_len", max_len, 1)
    if window is not None and (max_len is None or max_len >= window):
        default = -(-(bucket + max_new_tokens) // CAPACITY_ROUNDING) * CAPACITY_ROUNDING
        # Never more than the window; a ring that never wraps (capacity < window) is just a plain cache.
        return _next_pow2(len(lengths)), bucket, min(default, window), True
    if max_len is not None and longest + max_new_tokens > max_len:
        raise ValueError(f"the longest prompt has {longest} tokens; prompt_len + max_new_tokens = "
                         f"{longest} + {max_new_tokens} = {longest + max_new_tokens} exceeds max_len={max_len}")
    if max_len is None:
        capacity = -(-(bucket + max_new_tokens) // CAPACITY_ROUNDING) * CAPACITY_ROUNDING
    else:
        capacity = max_len
    # The padded prompt and the new tokens must fit: shrink the bucket rather than overflow the cache.
    padded_len = min(bucket, capacity - max_new_tokens)
    return _next_pow2(len(lengths)), padded_len, capacity, False


@dataclasses.dataclass
class _Request:
    """A validated `generate` call, laid out for the compiled pieces (host numpy arrays)."""

    token_lists: list[list[int]]
    max_new_tokens: int
    sampler: Callable
    stop_ids: np.ndarray  # int32[n], padded with -1
    seed: int
    cache_dtype: str
    attention: str  # resolved: "xla" or "pallas"
    capacity: int
    ring: bool
    tokens: np.ndarray  # int32[padded batch, T], left-padded
    start: np.ndarray  # int32[padded batch]

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.token_lists]


def _request(model: Model, prompts, *, max_new_tokens, temperature, top_k, top_p, min_p, sampler, seed, stop_tokens,
             max_len, cache_dtype, attention, batch_multiple: int = 1) -> _Request:
    """Validates a `generate` call (ValueError, before any compute) and pads it: the batch to a power of two, then
    up to a multiple of `batch_multiple` (the devices it is split over), the prompts to a length bucket."""
    config = model.config
    token_lists = _token_lists(prompts, config.vocab_size, model.tokenizer)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    sample_fn = _sampler(temperature, top_k, top_p, min_p, sampler)
    stop_ids = _stop_ids(stop_tokens, config)
    seed = _check_int("seed", seed, -(2 ** 63))
    cache_dtype = check_cache_dtype(config.dtype if cache_dtype is None else cache_dtype)
    # Resolved here, before compute: unknown names fail, and "auto" becomes a concrete static name for jit.
    attention = attention_impls.resolve(attention or config.attention)
    lengths = [len(p) for p in token_lists]
    batch, T, capacity, ring = plan_shapes(lengths, max_new_tokens, max_len, config)
    batch = -(-batch // batch_multiple) * batch_multiple

    # Left padding: prompt b occupies slots [T - len_b, T). Filler rows (batch padding) hold a single token.
    tokens = np.zeros((batch, T), np.int32)
    start = np.full((batch,), T - 1, np.int32)
    for b, prompt in enumerate(token_lists):
        tokens[b, T - len(prompt):] = prompt
        start[b] = T - len(prompt)
    return _Request(token_lists=token_lists, max_new_tokens=max_new_tokens, sampler=sample_fn, stop_ids=stop_ids,
                    seed=seed, cache_dtype=cache_dtype, attention=attention, capacity=capacity, ring=ring,
                    tokens=tokens, start=start)


def _generation(model: Model, req: _Request, out, num_new, stopped, cache: KVCache, prefill_time: _Phase,
                decode_time: _Phase) -> Generation:
    """The `Generation` of a finished call: host arrays out [B, steps], num_new [B], stopped [B], and the final
    cache (global arrays; a pmapped cache's leaves have a leading device axis, which changes no byte count)."""
    config = model.config
    n, lengths = len(req.token_lists), req.lengths
    batch, max_new_tokens = req.tokens.shape[0], req.max_new_tokens
    result = [out[b, : num_new[b]].tolist() for b in range(n)]
    reasons = ["stop" if stopped[b] else "length" for b in range(n)]
    decode_s = decode_time.run_s
    # The first new token comes from the prefill logits; the decode phase runs max_new_tokens - 1 one-token steps
    # (every row runs all of them, finished rows as padding, so steps are the honest unit).
    steps = max_new_tokens - 1
    live = np.mean(lengths) + steps / 2
    if config.sliding_window is not None:
        live = min(live, config.sliding_window)
    step_bytes = roofline.decode_bytes_per_step(config, batch, live, jnp.dtype(config.dtype).itemsize,
                                                jnp.dtype(req.cache_dtype).itemsize)
    steps_per_s = steps / decode_s if decode_s > 0 and steps > 0 else 0.0
    stats = {
        "prompt_tokens": int(sum(lengths)),
        "new_tokens": int(sum(len(r) for r in result)),
        "padded_batch": batch,
        "padded_prompt_len": req.tokens.shape[1],
        "cache_capacity": req.capacity,
        "cache_dtype": req.cache_dtype,
        "cache_ring": req.ring,
        "kv_cache_bytes": cache.nbytes(),
        # Read from the cache arrays' shards on one device: total / (data x KV-head shards) on a mesh.
        "kv_cache_bytes_per_device": sharding.cache_bytes_per_device(cache),
        # Seconds exclude tracing and compiling, which are reported apart (zero once a shape is warm).
        "prefill_s": prefill_time.run_s,
        "decode_s": decode_s,
        "compile_s": prefill_time.compile_s + decode_time.compile_s,
        "decode_steps": steps,
        "decode_steps_per_s": steps_per_s,
        "decode_tokens_per_s": n * steps_per_s,
        # Bytes a step must move (weights + live K/V read + new K/V written; jaxkv.roofline) and the rate achieved.
        "bytes_per_step": float(step_bytes),
        "achieved_GBps": float(step_bytes * steps_per_s / 1e9),
    }
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(r, skip_special_tokens=True) for r in result]
    return Generation(tokens=result, finish_reasons=reasons, stats=stats, text=text)


def generate(model: Model, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, sampler: Callable | None = None, seed: int = 0,
             stop_tokens: Sequence[int] | None = None, max_len: int | None = None, cache_dtype: str | None = None,
             attention: str | None = None, stream: Callable | None = None, mesh: Mesh | None = None) -> Generation:
    """Generates up to `max_new_tokens` tokens for each prompt.

    Args:
      prompts: a list of token-id lists, of any lengths; or, for a model with a tokenizer, a string or a list of
        strings.
      temperature, top_k, top_p, min_p: sampling; temperature 0 is greedy. None disables a filter.
      sampler: instead of the above, a jittable `(logits float32[B, V], key) -> int32[B]`.
      seed: PRNG seed; the key is split every step.
      stop_tokens: ids that end a sequence (included in its output). None: the model's eos ids; []: never stop.
      max_len: cache capacity in slots; must hold the longest prompt plus max_new_tokens. Default: just enough,
        rounded up so that similar requests share a compiled shape. A sliding-window model's cache is a ring of
        at most `window` slots (see `plan_shapes`).
      cache_dtype: "float32", "bfloat16", "float16", "int8" or "float8_e4m3fn" (int8/fp8: quantized on write
        with a float32 scale per token per KV head). Default: the model's dtype.
      attention: "auto", "xla" or "pallas"; default config.attention ("auto": Pallas on GPU/TPU, XLA on CPU).
      stream: optional host callback `(prompt_index, token_id)`, called for every new token as the compiled loop
        produces it (tokens after a stop token are not passed). With `mesh`, single-process only (each step's
        [B] tokens are gathered to one device for the callback).
      mesh: a `jax.sharding.Mesh` with axes ("data", "model"): the batch is split over "data" (padded up to a
        multiple of it), attention heads and the FFN hidden width over "model" (Megatron-style), the cache over
        batch and KV heads; see `jaxkv.sharding`, which also explains how KV heads fewer than the "model" axis
        are replicated. n_heads and ffn_dim must divide by the "model" axis. Works across processes (after
        `jax.distributed.initialize`): every process calls generate with the same arguments and gets all tokens.

    Raises:
      ValueError: for any bad argument, before any compute.
    """
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
            lambda leaf: sharding.global_array(leaf, NamedSharding(mesh, spec)), x)

    with _Phase() as prefill_time:
        logits, cache = prefill(params, put(req.tokens, sharding.BATCH_SPEC), put(req.start, sharding.BATCH_SPEC),
                                config=config, capacity=req.capacity, attention=req.attention,
                                cache_dtype=req.cache_dtype, ring=req.ring, mesh=mesh)
        logits.block_until_ready()
    with _Phase() as decode_time:
        replicated = PartitionSpec()
        out, num_new, stopped, cache = decode(params, cache, logits, put(jax.random.PRNGKey(req.seed), replicated),
                                              put(req.sampler, replicated), put(req.stop_ids, replicated),
                                              config=config, steps=req.max_new_tokens, attention=req.attention,
                                              stream=on_step, mesh=mesh)
        out, num_new, stopped = (sharding.to_host(x) for x in (out, num_new, stopped))
    return _generation(model, req, out, num_new, stopped, cache, prefill_time, decode_time)


_sharded_cache: list = []  # [(params, mesh, sharded params, config)]: the last model sharded, reused by identity


def _sharded_params(model: Model, mesh: Mesh):
    """`sharding.shard_params` of the model, remembered for the last (params, mesh) so that repeated calls do
    not re-copy the weights."""
    if _sharded_cache and _sharded_cache[0][0] is model.params and _sharded_cache[0][1] == mesh:
        return _sharded_cache[0][2:]
    params, config = sharding.shard_params(model.params, model.config, mesh)
    _sharded_cache[:] = [(model.params, mesh, params, config)]
    return params, config


def generate_pmap(model: Model, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, min_p: float | None = None, sampler: Callable | None = None,
                  seed: int = 0, stop_tokens: Sequence[int] | None = None, max_len: int | None = None,
                  cache_dtype: str | None = None, attention: str | None = None,
                  stream: Callable | None = None) -> Generation:
    """`generate`, data-parallel over this process's local devices with `jax.pmap` (for scripts built on pmap).

    The padded batch is split evenly over the devices (padded further when it does not divide); each device runs
    the same prefill and decode loop on its rows with a replicated copy of the weights. Greedy tokens equal
    `generate`'s. Sampling draws from a per-device key (the seed's key split per device), so sampled tokens
    differ from `generate`'s while following the same distribution. `stream` is not supported. `jax.pmap` is in
    maintenance mode; `generate(..., mesh=...)` is the scalable path (weights sharded too, multi-host).
    """
    if stream is not None:
        raise ValueError("stream is not supported by generate_pmap")
    devices = jax.local_devices()
    n = len(devices)
    req = _request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, sampler=sampler, seed=seed, stop_tokens=stop_tokens, max_len=max_len,
                   cache_dtype=cache_dtype, attention=attention, batch_multiple=n)
    batch, T = req.tokens.shape
    run = _pmapped(model.config, req.capacity, req.attention, req.cache_dtype, req.ring, req.max_new_tokens, n)
    keys = jax.random.split(jax.random.PRNGKey(req.seed), n)
    with _Phase() as time_all:
        out, num_new, stopped, cache = run(model.params, req.tokens.reshape(n, batch // n, T),
                                           req.start.reshape(n, batch // n), keys, req.sampler, req.stop_ids)
        out, num_new, stopped = (np.asarray(x).reshape(batch, *x.shape[2:]) for x in (out, num_new, stopped))
    # One compiled program: its time is reported as decode time, prefill_s is 0.
    return _generation(model, req, out, num_new, stopped, cache, _Phase.empty(), time_all)


@functools.lru_cache(maxsize=16)
def _pmapped(config, capacity, attention, cache_dtype, ring, steps, num_devices):
    """The pmapped prefill + decode loop for one shape (cached, so the same shapes never re-trace)."""

    def run(params, tokens, start, key, sampler, stop_ids):
        logits, cache = prefill(params, tokens, start, config=config, capacity=capacity, attention=attention,
                                cache_dtype=cache_dtype, ring=ring)
        return decode(params, cache, logits, key, sampler, stop_ids, config=config, steps=steps, attention=attention)

    return jax.pmap(run, in_axes=(None, 0, 0, 0, None, None), devices=jax.local_devices()[:num_devices])


@dataclasses.dataclass(frozen=True)
class _StepStream:
    """Adapts a per-token callback to the per-step io_callback. Hashable by value, so the same user callback
    reuses the compiled loop."""

    callback: Callable
    num_prompts: int

    def __call__(self, tokens, running):
        for b in range(self.num_prompts):  # filler rows (batch padding) are never reported
            if running[b]:
                self.callback(b, int(tokens[b]))
