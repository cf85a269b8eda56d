"""The generation entry points: generate, generate_pmap, prefill, decode_step, decode. Knows nothing of tokenizers.

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

The pieces live in `jaxkv.decoding` (the one decode step, the loop, request normalization, the paged path);
this module holds the public entry points and their argument checks.

Several devices: `generate(..., mesh=mesh)` runs the same two jits SPMD over a ("data", "model") mesh (batch over
"data", heads and FFN over "model", the cache over both; the layout is `jaxkv.sharding`'s), from global arrays, so
it also runs across processes. `generate_pmap` is the data-parallel `jax.pmap` variant over local devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv import checks, sharding
from jaxkv.cache import planner as memory
from jaxkv.cache.contiguous import KVCache
from jaxkv.cache.paged import PagedKVCache
from jaxkv.cache.prefix import PrefixCache
from jaxkv.config import Config
from jaxkv.decoding import constrained, loop, paged, processing, programs, request, result, speculation
from jaxkv.decoding.speculation import Speculation
from jaxkv.decoding.phase import Phase, compile_seconds  # noqa: F401 (compile_seconds: its old home)
from jaxkv.decoding.request import MAX_TOP_LOGPROBS, STOP_ID_SLOTS, left_pad
from jaxkv.decoding.result import Generation
from jaxkv.io import generation as generation_config
from jaxkv.model import Model

__all__ = ["Generation", "Decoded", "prefill", "decode_step", "decode", "generate", "generate_pmap", "left_pad",
           "MAX_TOP_LOGPROBS", "STOP_ID_SLOTS"]


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
    return programs.prefill(*args, **kwargs)


def _prefill_args(params, tokens, start, *, config, capacity, attention="auto", cache_dtype=None, ring=False,
                  mesh=None):
    """Validates `prefill`'s arguments (ValueError before any compute) -> (args, kwargs) of `programs.prefill`."""
    request.check_config(config)
    tokens = request.check_batch_ids("tokens", tokens, length=True)
    B, T = tokens.shape
    start = request.check_batch_ids("start", start, B)
    capacity = checks.check_int("capacity", capacity, 1, config.max_positions)
    if T > capacity and not (ring and config.every_layer_sliding):  # full-attention layers keep every slot
        raise ValueError(f"the prompts take {T} slots, more than the cache's capacity of {capacity}")
    kwargs = dict(config=config, capacity=capacity, attention=request.attention(config, attention),
                  cache_dtype=request.cache_dtype(config, cache_dtype),
                  ring=bool(ring), mesh=mesh)
    return (params, tokens, start), kwargs


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
    return programs.decode_step(*args, **kwargs)


def _decode_step_args(params, tokens, cache, *, config, attention="auto", mesh=None):
    """Validates `decode_step`'s arguments -> (args, kwargs) of `programs.decode_step`."""
    request.check_config(config)
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a jaxkv.KVCache (from prefill), got {type(cache).__name__}")
    tokens = request.check_batch_ids("tokens", tokens, cache.batch)
    return (params, tokens, cache), dict(config=config, attention=request.attention(config, attention), mesh=mesh)


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


def _decode_args(params, cache, logits, key, sampler, stop_ids, *, config, steps, attention="auto", stream=None,
                 mesh=None):
    """Validates `decode`'s arguments (ValueError before any compute) -> (args, kwargs) of `loop.decode_loop`."""
    request.check_config(config)
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
    args = (params, cache, logits, key, request.as_sampler(sampler), request.as_stop_ids(stop_ids),
            jnp.zeros((cache.batch,), bool), jnp.int32(steps))
    kwargs = dict(config=config, max_steps=loop.steps_bound(cache.capacity, ring, steps), rows=None,
                  attention=request.attention(config, attention), stream=stream, mesh=mesh)
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
    out = loop.decode_loop(*args, **kwargs)
    return Decoded(out.tokens[:, :steps], out.num_new, out.done, out.cache)


def _lowering(prepare, jitted):
    """A public wrapper's `.lower(...)`: the same checks, then the compiled function's `jax.stages.Lowered` (for
    HLO inspection)."""

    def lower(*args, **kwargs):
        args, kwargs = prepare(*args, **kwargs)
        return jitted.lower(*args, **kwargs)

    return lower




def _contiguous_request(model: Model, prompts, *, max_new_tokens, temperature, top_k, top_p, min_p, sampler, seed, stop_tokens,
             max_len, cache_dtype, attention, batch_multiple: int = 1, lookahead: int = 0,
             penalties=None) -> result.Request:
    """Validates a `generate` call (ValueError, before any compute) and lays it out as `memory.plan_cache` says:
    the batch padded to a power of two (then a multiple of `batch_multiple`, the devices it is split over), the
    prompts left-padded to a length bucket."""
    config = model.config
    token_lists = request.token_lists(prompts, config.vocab_size, model.tokenizer)
    max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens, 1)
    stop_ids = request.stop_ids(stop_tokens, config)
    key = request.prng_key(seed)
    cache_dtype = request.cache_dtype(config, cache_dtype)
    attention = request.attention(config, attention)
    max_len = request.optional_int("max_len", max_len)
    plan = memory.plan_cache(config, [len(p) for p in token_lists], max_new_tokens, max_len=max_len,
                             cache_dtype=cache_dtype, batch_multiple=batch_multiple, lookahead=lookahead)
    sample_fn, rows = request.sampler_for(temperature, top_k, top_p, min_p, sampler, len(token_lists), plan.padded_batch)
    tokens, start = request.left_pad(token_lists + [[0]] * (plan.padded_batch - plan.batch), length=plan.prompt_len)
    done = np.arange(plan.padded_batch) >= plan.batch
    penalties = processing.settings(**(penalties or {}), rows=len(token_lists), padded=plan.padded_batch,
                                    vocab_size=config.vocab_size, max_new_tokens=max_new_tokens)
    return result.Request(token_lists=token_lists, max_new_tokens=max_new_tokens, sampler=sample_fn, rows=rows,
                    stop_ids=stop_ids, key=key, attention=attention, plan=plan, tokens=tokens, start=start, done=done,
                    penalties=penalties)


def generate(model: Model, prompts, *, max_new_tokens: int, temperature=None, top_k=None, top_p=None, min_p=None,
             sampler: Callable | None = None, seed: int = 0, stop_tokens: Sequence[int] | None = None,
             max_len: int | None = None, cache_dtype: str | None = None, attention: str | None = None,
             stream: Callable | None = None, mesh: Mesh | None = None, n: int = 1,
             page_size: int | None = None, prefix_cache=None, logprobs: int = 0,
             speculative: Speculation | None = None, repetition_penalty=None, presence_penalty=None,
             frequency_penalty=None, logit_bias=None, min_tokens=None, constraint=None,
             sampling: str | None = None) -> Generation:
    """Generates up to `max_new_tokens` tokens for each prompt.

    Args:
      prompts: a list of token-id lists, of any lengths; or, for a model with a tokenizer, a string or a list of
        strings.
      temperature, top_k, top_p, min_p: sampling; temperature 0 (the default) is greedy. None disables a filter
        (or, with sampling="checkpoint", leaves it to the checkpoint); a filter with
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
      logprobs: k in [0, request.MAX_TOP_LOGPROBS]. Every call fills `Generation.logprobs` (each new token's
        log-probability under the model's own distribution: temperature 1, before the penalties, bias,
        min_tokens, a constraint and the filters; `jaxkv.decoding.step`); k > 0 also fills
        `top_logprobs` with the k most likely tokens at each step. Both are computed inside the compiled loop.
      speculative: a `jaxkv.Speculation`: a proposer guesses k tokens and one forward pass over k + 1 positions
        verifies them (`jaxkv.decoding.speculation`); the output is distributed exactly as without it (greedy:
        the same tokens, up to float rounding of the wider pass). A call is valid exactly when it is without
        speculation: the cache gets up to k more slots where the model's positions (and max_len) allow (a
        sliding-window model's rings window + k slots: a verify writes k + 1 tokens at once), and where a
        verify's k + 1 writes would not fit, the loop takes plain steps. `stats` adds "spec_proposed", "spec_accepted",
        "spec_acceptance_rate", "spec_verifies", "target_forwards" and "tokens_per_target_forward". With the
        paged cache (n > 1, page_size, prefix_cache) each verify's rejected slots and the pages they took are
        given back; the prefix cache only ever indexes prompt pages. Every method ("ngram", "draft", "mtp") on
        both caches; not yet: a mesh, a custom `sampler` (the built-in sampling settings only), the penalties,
        logit_bias and min_tokens below (ValueError).
      repetition_penalty: p > 0, transformers' (over the prompt and the output: a token that appeared has its
        logit divided by p where positive, multiplied by p otherwise); 1.0 or None: off.
      presence_penalty, frequency_penalty: OpenAI's, in [-2, 2] (over the output: logit - count * frequency -
        (count > 0) * presence); 0.0 or None: off.
      logit_bias: {token id: bias} added to the logits (at most 300 ids, each in the vocabulary); None: none.
      min_tokens: a prompt's stop tokens (eos included) cannot be drawn before it has this many new tokens
        (<= max_new_tokens); 0 or None: off.
        Each of these five is one value for every prompt or a list with one per prompt (logit_bias: a dict, or
        a list of dicts or None). They change the logits before temperature and the filters (bias, then the
        penalties, then min_tokens, as vLLM orders them; `jaxkv.decoding.processing`); the reported
        log-probabilities stay the model's (`logprobs`). They are traced: new values never recompile.
      constraint: a `jaxkv.JsonSchema`, `Regex`, `Choice` or `Grammar` for every prompt, or a list with one per
        prompt (None: that prompt is unconstrained); needs a model with a tokenizer. At each step a packed mask
        of the tokens the constraint allows (filled on the host by llguidance, `jaxkv.constraints`) is applied
        to the logits in the compiled step: disallowed tokens get -inf, so greedy picks the argmax among the
        allowed ones (`logprobs` stay the model's, before the mask). Stop tokens are allowed only where the
        constraint may end; a row whose constraint is complete (nothing but a stop token could follow) emits a
        stop token next (even before min_tokens) and ends "stop", the token included as a chosen one is; one
        completed by its last allowed token (no room for the stop token) ends "stop" without it. A row that runs
        out of max_new_tokens before its constraint is complete ends with "length" and is listed in
        `stats["constraint_incomplete"]`. With n > 1 each sample has its own matcher.
        With `speculative`, each verify applies the masks at its k + 1 positions (a proposal the constraint
        refuses is rejected before it could be kept). Not yet: a mesh.

      sampling: "checkpoint": temperature, top_k, top_p, min_p and repetition_penalty default to the checkpoint's
        generation_config.json (`model.sampling_defaults`, `jaxkv.io.generation`: transformers' meaning, so
        do_sample false is greedy); each one given here overrides it. A model without one is greedy. None: jaxkv's
        defaults (greedy, no filters).

    Raises:
      ValueError: for any bad argument, before any compute (and for a custom sampler's out-of-vocabulary id).
    """
    settings = generation_config.resolve(model.sampling_defaults, sampling, dict(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty))
    temperature, top_k, top_p, min_p = (settings[k] for k in ("temperature", "top_k", "top_p", "min_p"))
    repetition_penalty = settings["repetition_penalty"]
    n = checks.check_int("n", n, 1)
    logprobs = checks.check_int("logprobs", logprobs, 0, request.MAX_TOP_LOGPROBS)
    if constraint is not None and mesh is not None:
        raise ValueError("constraint does not work with a mesh yet")
    request.refuse_hybrid(model.config, *(["mesh"] if mesh is not None else []))
    penalties = dict(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                     frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens)
    spec = None
    if speculative is not None:
        spec = _speculation_plan(model, speculative, sampler=sampler, mesh=mesh)
        if processing.requested(penalties):
            raise ValueError(f"speculative decoding does not take {', '.join(processing.requested(penalties))} "
                             "yet (each verified position would need the penalties of the proposals before it)")
    if spec is not None and page_size is None and n == 1 and prefix_cache is None:
        return _generate_speculative(model, prompts, spec, speculative.draft, max_new_tokens=max_new_tokens,
                                     temperature=temperature,
                                     top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, stop_tokens=stop_tokens,
                                     max_len=max_len, cache_dtype=cache_dtype, attention=attention,
                                     stream=stream, logprobs=logprobs, constraint=constraint)
    if prefix_cache is not None:
        if not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a jaxkv.PrefixCache, got {type(prefix_cache).__name__}")
        page_size = prefix_cache.page_size if page_size is None else page_size
    if page_size is not None or n > 1 or prefix_cache is not None:
        if mesh is not None:
            mesh = sharding.check_paged_mesh(mesh)
            if jax.process_count() > 1:
                raise ValueError("n > 1, page_size and prefix_cache with a mesh run in one process only")
        return paged.generate_paged(model, prompts, n=n, page_size=memory.DEFAULT_PAGE_SIZE if page_size is None
                               else checks.check_int("page_size", page_size, 1), max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
                               seed=seed, stop_tokens=stop_tokens, cache_dtype=cache_dtype, attention=attention,
                               stream=stream, prefix_cache=prefix_cache, max_len=max_len, logprobs=logprobs,
                               mesh=mesh, speculative=spec, penalties=penalties, constraint=constraint,
                               draft=None if speculative is None else speculative.draft)
    if mesh is not None:
        mesh = sharding.check_mesh(mesh)
        if stream is not None and jax.process_count() > 1:
            # The callback runs on one device's host (device 0's process); the other processes would see nothing.
            raise ValueError("stream is not supported with a mesh spanning several processes")
    req = _contiguous_request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, sampler=sampler, seed=seed, stop_tokens=stop_tokens, max_len=max_len,
                   cache_dtype=cache_dtype, attention=attention, penalties=penalties,
                   batch_multiple=1 if mesh is None else sharding.data_size(mesh))
    on_step = loop.step_stream(stream, len(req.token_lists))
    grammar_rows = constrained.rows_for(model, constraint, len(req.token_lists), rows=req.plan.padded_batch,
                                        stop_ids=req.stop_ids)
    params, config = model.params, model.config
    if mesh is None:
        # device_put, not jnp.asarray: the latter compiles a staging function per shape.
        put = lambda x, spec: jax.device_put(x)  # noqa: E731
    else:
        params, config = sharding.sharded_weights(model.params, model.config, mesh)
        put = lambda x, spec: jax.tree.map(  # noqa: E731
            lambda leaf: sharding.global_array(np.asarray(leaf), NamedSharding(mesh, spec)), x)

    plan, replicated = req.plan, PartitionSpec()
    with Phase() as prefill_time:
        logits, cache = programs.prefill(params, put(req.tokens, sharding.BATCH_SPEC), put(req.start, sharding.BATCH_SPEC),
                                 config=config, capacity=plan.capacity, attention=req.attention,
                                 cache_dtype=plan.cache_dtype, ring=plan.ring, mesh=mesh)
        logits.block_until_ready()
    # (the prompts padded to the cache's capacity: a shape the loop compiles for anyway)
    rows = processing.Fresh(req.penalties, processing.prompt_ids(req.token_lists, plan.padded_batch,
                                                                 max(plan.capacity, plan.prompt_len)))
    with Phase() as decode_time, constrained.carried(grammar_rows) as grammar:
        out = loop.on_host(loop.run(
            params, cache, logits, put(req.key, replicated), put(req.sampler, replicated),
            put(req.stop_ids, replicated), put(req.done, sharding.BATCH_SPEC),
            put(np.int32(req.max_new_tokens), replicated), put(rows, sharding.BATCH_SPEC), grammar=grammar,
            config=config,
            max_steps=loop.steps_bound(plan.capacity, plan.ring and config.every_layer_sliding, req.max_new_tokens),
            rows=req.rows, attention=req.attention,
            stream=on_step, mesh=mesh, logprobs=logprobs), sharding.to_host)
    gen = result.generation(model, req, out, prefill_time, decode_time)
    constrained.report(grammar_rows, gen, len(req.token_lists))
    return gen


def _speculation_plan(model, speculative, *, sampler, mesh):
    """`generate(speculative=)` checked against the rest of the call -> the static `speculation.Plan`."""
    if not isinstance(speculative, Speculation):
        raise ValueError(f"speculative must be a jaxkv.Speculation, got {type(speculative).__name__}")
    plan = speculative.check(model)
    if sampler is not None:
        raise ValueError("speculative decoding needs the sampler's distribution: use temperature/top_k/top_p/min_p, "
                         "not a custom sampler")
    if mesh is not None:
        raise ValueError("speculative decoding does not take a mesh yet")
    return plan


def _generate_speculative(model, prompts, spec, draft, *, max_new_tokens, temperature, top_k, top_p, min_p, seed,
                          stop_tokens, max_len, cache_dtype, attention, stream, logprobs,
                          constraint=None) -> Generation:
    """`generate` with speculation on the contiguous cache (`loop.speculative_loop`); `draft`: the draft model
    (method "draft"), prefilled with the same prompts into a cache of the same slots."""
    req = _contiguous_request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, min_p=min_p, sampler=None, seed=seed, stop_tokens=stop_tokens,
                              max_len=max_len, cache_dtype=cache_dtype, attention=attention,
                              lookahead=spec.num_tokens)
    on_step = loop.step_stream(stream, len(req.token_lists))
    grammar_rows = constrained.rows_for(model, constraint, len(req.token_lists), rows=req.plan.padded_batch,
                                        stop_ids=req.stop_ids)
    plan, k = req.plan, spec.num_tokens
    draft_args, draft_kwargs = (), {}
    if draft is not None:
        draft_args = (draft.params, speculation.prefill_draft(draft, req.token_lists, rows=plan.padded_batch,
                                                              max_new_tokens=req.max_new_tokens, lookahead=k,
                                                              attention=attention))
        draft_kwargs = {"draft_config": draft.config}
    # (a ring's capacity does not bound the sequence: the history holds the whole of it)
    history, length = speculation.prompt_history(req.token_lists, plan.padded_batch,
                                                 plan.prompt_len + req.max_new_tokens + k + 2 if plan.ring
                                                 else plan.capacity + k + 2)
    with Phase() as prefill_time:
        if spec.method == "mtp":  # the module's cache filled from the prompt too (one position behind)
            logits, cache, mtp_cache, hidden = programs.prefill_mtp(
                model.params, model.mtp.params[0], jax.device_put(req.tokens), jax.device_put(req.start),
                config=model.config, capacity=plan.capacity, attention=req.attention, cache_dtype=plan.cache_dtype,
                mtp_config=model.mtp.config, ring=plan.ring, lookahead=k)
            draft_args, draft_kwargs = (model.mtp.params[0], (mtp_cache, hidden)), {"draft_config": model.mtp.config}
        else:
            logits, cache = programs.prefill(model.params, jax.device_put(req.tokens), jax.device_put(req.start),
                                             config=model.config, capacity=plan.capacity, attention=req.attention,
                                             cache_dtype=plan.cache_dtype, ring=plan.ring, mesh=None, lookahead=k)
        logits.block_until_ready()
    with Phase() as decode_time, constrained.carried(grammar_rows) as grammar:
        out = loop.on_host_surfacing(on_step, lambda: loop.on_host(loop.speculative_loop(
            model.params, cache, logits, req.key, req.sampler, req.stop_ids, req.done,
            np.int32(req.max_new_tokens), history, length, *draft_args, grammar=grammar, config=model.config,
            max_steps=loop.steps_bound(plan.capacity, plan.ring and model.config.every_layer_sliding,
                                       req.max_new_tokens), attention=req.attention,
            stream=on_step, logprobs=logprobs, plan=spec, **draft_kwargs)))
    gen = result.generation(model, req, out, prefill_time, decode_time)
    constrained.report(grammar_rows, gen, len(req.token_lists))
    return gen


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
    logprobs = checks.check_int("logprobs", logprobs, 0, request.MAX_TOP_LOGPROBS)
    # Tried on 2 CPU devices in session 20: a hybrid model's pmapped loop did not finish in 5 minutes (as a
    # (4, 2) mesh hung): refused until that is understood.
    request.refuse_hybrid(model.config, "generate_pmap")
    if stream is not None:
        raise ValueError("stream is not supported by generate_pmap")
    if sampler is not None:
        raise ValueError("a custom sampler is not supported by generate_pmap (it would see each device's share of "
                         "the batch): use generate, or generate(..., mesh=...)")
    devices = jax.local_devices()
    n = len(devices)
    req = _contiguous_request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, sampler=sampler, seed=seed, stop_tokens=stop_tokens, max_len=max_len,
                   cache_dtype=cache_dtype, attention=attention, batch_multiple=n)
    plan = req.plan
    batch, T = req.tokens.shape
    max_steps = loop.steps_bound(plan.capacity, plan.ring and model.config.every_layer_sliding, req.max_new_tokens)
    run = _pmapped(model.config, plan.capacity, req.attention, plan.cache_dtype, plan.ring, max_steps, n, logprobs)
    keys = jax.random.split(jnp.asarray(req.key), n)
    per_device = lambda x: x.reshape(n, batch // n, *x.shape[1:])  # noqa: E731
    # Each device's per-row settings travel with its rows.
    sampler_rows = jax.tree.map(per_device, req.sampler)
    with Phase() as time_all:
        out = run(model.params, per_device(req.tokens), per_device(req.start), keys, sampler_rows, req.stop_ids,
                   per_device(req.done), np.int32(req.max_new_tokens))
        # [devices, rows per device, ...] -> [batch, ...]; the pass count is each device's, the most of them ran.
        out = loop.on_host(out, lambda x: np.asarray(x).reshape(batch, *x.shape[2:]) if x.ndim > 1 else np.asarray(x))
        out = out._replace(forward_passes=int(np.max(out.forward_passes)))
    # One compiled program: its time is reported as decode time, prefill_s is 0.
    return result.generation(model, req, out, Phase.empty(), time_all)


@functools.lru_cache(maxsize=16)
def _pmapped(config, capacity, attention, cache_dtype, ring, max_steps, num_devices, logprobs):
    """The pmapped prefill + decode loop for one shape (cached, so the same shapes never re-trace)."""

    def run(params, tokens, start, key, sampler, stop_ids, done, steps):
        logits, cache = programs.prefill(params, tokens, start, config=config, capacity=capacity,
                                         attention=attention, cache_dtype=cache_dtype, ring=ring, mesh=None)
        return loop.decode_loop(params, cache, logits, key, sampler, stop_ids, done, steps, config=config,
                                max_steps=max_steps, rows=None, attention=attention, stream=None, mesh=None,
                                logprobs=logprobs)

    return jax.pmap(run, in_axes=(None, 0, 0, 0, 0, None, 0, None), devices=jax.local_devices()[:num_devices])


prefill.lower = _lowering(_prefill_args, programs.prefill)
decode_step.lower = _lowering(_decode_step_args, programs.decode_step)
decode.lower = _lowering(_decode_args, loop.decode_loop)
