"""Request normalization every entry point shares: prompts, stop ids, seeds, samplers, cache dtype, attention
name and the padded token layouts, each checked once here (ValueError naming the argument, before any compute).

`generate`, `generate_pmap`, `beam_search`, `score`, `jaxkv.Engine` and `jaxkv.PrefixCache` read their arguments
through these functions, so a prompt, a stop token or a cache dtype is refused with the same words everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import checks
from jaxkv.attention import api
from jaxkv.cache.dtypes import check_cache_dtype
from jaxkv.config import Config
from jaxkv.sampling import Sampler

STOP_ID_SLOTS = 8  # stop ids are padded to a multiple of this (with -1, never a token) so their number is traced
MAX_TOP_LOGPROBS = 20  # the most alternatives `generate(logprobs=k)` reports per token (OpenAI's API allows 20)


def check_config(config):
    if not isinstance(config, Config):
        raise ValueError(f"config must be a jaxkv.Config, got {type(config).__name__}")


def refuse_hybrid(config, *features: str):
    """ValueError when `config` is a hybrid model (`Config.linear_attention`) and any of `features` (names of what
    the caller asked for) is given: those run on paged or rewound caches, which do not carry the linear layers'
    states yet (issue 31). Called at the front doors, before any compute."""
    if features and config.linear_attention is not None:
        raise ValueError(f"{', '.join(features)} with a hybrid model (linear_attention layers, e.g. Qwen3-Next) is "
                         "not supported yet: its layers' states live in a contiguous cache only; use "
                         "jaxkv.generate without them")


def check_batch_ids(name: str, ids, batch: int | None = None, length: bool = False):
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


def token_lists(prompts, vocab_size: int, tokenizer, what: str = "prompt",
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


def stop_ids(stop_tokens, config: Config) -> np.ndarray:
    """int32[n] stop ids (None: the model's eos ids; an int: that one), padded with -1 to a multiple of
    STOP_ID_SLOTS."""
    ids = list(config.eos_ids) if stop_tokens is None else stop_tokens
    if isinstance(ids, (int, np.integer)):
        ids = [ids]
    ids = [checks.check_int("stop token", t, 0) for t in ids]
    for t in ids:
        if t >= config.vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {config.vocab_size})")
    slots = max(STOP_ID_SLOTS, -(-len(ids) // STOP_ID_SLOTS) * STOP_ID_SLOTS)
    return np.array(ids + [-1] * (slots - len(ids)), np.int32)


def as_stop_ids(ids):
    """`decode`'s stop ids (a list, or an int32 array padded with -1) as int32[n], n a multiple of STOP_ID_SLOTS
    (padded with -1), so their number is traced."""
    if isinstance(ids, jax.Array) and ids.ndim == 1 and ids.dtype == jnp.int32:
        return ids
    flat = np.asarray([] if ids is None else ids).ravel()
    if flat.size and not np.issubdtype(flat.dtype, np.integer):
        raise ValueError(f"stop_ids must be integer token ids, got {ids!r}")
    slots = max(STOP_ID_SLOTS, -(-flat.size // STOP_ID_SLOTS) * STOP_ID_SLOTS)
    return jax.device_put(np.concatenate([flat.astype(np.int32), np.full(slots - flat.size, -1, np.int32)]))


def prng_key(seed: int) -> np.ndarray:
    """The PRNG key of a seed, over the seed's full range (`checks.seed_words`), built on the host: for seeds below
    2**32 it equals `jax.random.PRNGKey(seed)`."""
    high, low = checks.seed_words(seed)
    if jax.config.jax_default_prng_impl != "threefry2x32":  # another key layout: fold the high word in
        return jax.random.fold_in(jax.random.PRNGKey(low), high) if high else jax.random.PRNGKey(low)
    return np.array([high, low], np.uint32)


def as_sampler(sampler):
    """A sampler as a pytree callable for the compiled loop. A `Sampler` or any other pytree (flax.struct
    dataclass, Partial) passes through, its leaves traced; a plain function becomes a leafless Partial (static,
    hashed by identity)."""
    if not callable(sampler):
        raise ValueError(f"sampler must be a callable (logits, key) -> token ids, got {sampler!r}")
    leaves, treedef = jax.tree.flatten(sampler)
    if treedef.num_leaves == 1 and leaves[0] is sampler:  # not a pytree: an opaque function
        return jax.tree_util.Partial(sampler)
    return sampler


def sampler_for(temperature, top_k, top_p, min_p, sampler, rows: int, batch: int):
    """(the sampler for the compiled loop, the rows it sees): a custom sampler sees exactly the caller's `rows`
    rows; the built-in `Sampler` gets one setting per row of the padded batch (filler rows greedy), so scalar and
    per-row settings share one compiled loop."""
    if sampler is not None:
        if temperature != 0.0 or top_k is not None or top_p is not None or min_p is not None:
            raise ValueError("pass either sampler or temperature/top_k/top_p/min_p, not both")
        return as_sampler(sampler), rows
    s = checks.sampling(temperature, top_k, top_p, min_p, rows=rows)
    disabled = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    per_row = {}
    for name, value in s.items():
        values = value if isinstance(value, list) else [value] * rows
        values = [disabled[name] if v is None else v for v in values] + [disabled[name]] * (batch - rows)
        per_row[name] = np.asarray(values, np.int32 if name == "top_k" else np.float32)
    return Sampler(**per_row), None


def cache_dtype(config: Config, dtype: str | None) -> str:
    """The cache dtype of a request: `dtype` checked (`jaxkv.cache.CACHE_DTYPES`), default the model's."""
    return check_cache_dtype(config.dtype if dtype is None else dtype)


def attention(config: Config, name: str | None, *, paged: bool = False) -> str:
    """The attention implementation of a request, resolved before compute: unknown names fail, and "auto"
    becomes a concrete static name for jit. Default the config's; `paged`: for the paged cache."""
    name = name or config.attention
    # A paged loop's kind is the config's (an MLA config has no Pallas paged kernel: "auto" is "xla" there, a
    # named "pallas" is refused); a contiguous one names the implementation for either kind, as the MLA layer
    # asks for the latent kind itself.
    kind = api.kind_of(latent=config.mla is not None, paged=True) if paged else "contiguous"
    return api.resolve(name, kind)


def optional_int(name: str, value, low: int = 1) -> int | None:
    return None if value is None else checks.check_int(name, value, low)


def left_pad(prompts, *, length: int | None = None):
    """Ragged prompts (lists of token ids) -> (int32[B, T] tokens, int32[B] start), numpy arrays for `prefill`:
    prompt b right-aligned in row b, after start[b] = T - len(prompt b) padding slots (token 0, never attended to).

    length: T, default the longest prompt; a fixed T (a bucket) lets different batches share a compiled shape.
    """
    lists = [list(map(int, p)) for p in prompts]
    if not lists or any(len(p) == 0 for p in lists):
        raise ValueError("left_pad needs at least one prompt, each of at least one token")
    longest = max(len(p) for p in lists)
    T = longest if length is None else checks.check_int("length", length, longest)
    tokens = np.zeros((len(lists), T), np.int32)
    start = np.array([T - len(p) for p in lists], np.int32)
    for b, p in enumerate(lists):
        tokens[b, start[b]:] = p
    return tokens, start


def right_pad(prompts, *, rows: int, length: int, cached=None):
    """Prompts for a paged prefill -> (int32[rows, length] tokens, int32[rows, length] positions): prompt b's
    tokens from `cached[b]` on (the slots its cached prefix already holds; default 0) at the left of row b, their
    positions cached[b], cached[b] + 1, ...; -1 after (padding, which writes nothing). Rows past the prompts are
    all padding."""
    tokens = np.zeros((rows, length), np.int32)
    positions = np.full((rows, length), -1, np.int32)
    for b, p in enumerate(prompts):
        skip = 0 if cached is None else cached[b]
        tokens[b, :len(p) - skip], positions[b, :len(p) - skip] = p[skip:], np.arange(skip, len(p))
    return tokens, positions
