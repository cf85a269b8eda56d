"""Per-row logits processing: what changes a row's distribution before its token is drawn, and the per-row state
that needs (`Processing`, carried by the decode loop and the engine's slots, applied by `step.process_logits`).

Today it holds the sampling parameters users send beside temperature and the filters, each as transformers and
vLLM define it, applied in vLLM's order (bias, then penalties, then the min-tokens mask):

- `logit_bias`: {token id: bias} added to the logits (OpenAI's; at most MAX_LOGIT_BIAS ids per row);
- `repetition_penalty` p (transformers' `RepetitionPenaltyLogitsProcessor`, over the prompt and the output):
  each token that appeared has its logit divided by p where it is positive, multiplied by p otherwise;
- `frequency_penalty` f and `presence_penalty` r (OpenAI's, over the output only):
  logit - count * f - (count > 0) * r;
- `min_tokens` m: the row's stop ids are -inf until it has emitted m tokens.

Each setting is one value per row, a traced pytree leaf: changing it never recompiles. Each part runs under a
`lax.cond` on "some row uses it", so a batch without penalties pays a few scalar reductions, no [B, V] work.
A grammar's packed token mask is meant to join as one more field with its own `lax.cond` (docs/design/decoding.md).

Letters as in `jaxkv.shapes`: B rows, V vocabulary, T prompt tokens, E = MAX_LOGIT_BIAS bias slots.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import checks

MAX_LOGIT_BIAS = checks.MAX_LOGIT_BIAS  # one fixed [B, E] shape for every request
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None,
           "min_tokens": 0}


@flax.struct.dataclass
class Penalties:
    """The per-row settings (host numpy arrays or device arrays; all neutral: nothing changes).

    repetition: float32[B], 1.0 off.    presence, frequency: float32[B], 0.0 off.    min_tokens: int32[B], 0 off.
    bias_ids: int32[B, E] token ids, -1 unused; bias: float32[B, E] added to those tokens' logits.
    """

    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array
    min_tokens: jax.Array
    bias_ids: jax.Array
    bias: jax.Array

    @classmethod
    def neutral(cls, rows: int) -> "Penalties":
        return cls(repetition=np.ones((rows,), np.float32), presence=np.zeros((rows,), np.float32),
                   frequency=np.zeros((rows,), np.float32), min_tokens=np.zeros((rows,), np.int32),
                   bias_ids=np.full((rows, MAX_LOGIT_BIAS), -1, np.int32),
                   bias=np.zeros((rows, MAX_LOGIT_BIAS), np.float32))

    def counts_output(self):
        """bool[]: some row's penalties read the token counts (repetition, presence or frequency on)."""
        return jnp.any(self.repetition != 1.0) | jnp.any(self.presence != 0.0) | jnp.any(self.frequency != 0.0)


def settings(*, repetition_penalty=None, presence_penalty=None, frequency_penalty=None, logit_bias=None,
             min_tokens=None, rows: int, padded: int, vocab_size: int, max_new_tokens: int | None = None,
             repeat: int = 1) -> Penalties:
    """Checked `generate`-style arguments -> host `Penalties` for `padded` rows (ValueError naming the argument).

    Each argument is a scalar for every prompt, or a list with one value per prompt (`rows` prompts; logit_bias a
    dict, or a list of dicts or None). None (or a None entry) is neutral. `repeat`: rows per prompt (generate's n
    samples, prompt-major). Rows past rows * repeat (batch padding) are neutral."""
    out = Penalties.neutral(padded)

    def fill(name, value, check):
        if value is None:
            return
        value = checks.per_row(name, value, rows, lambda v: NEUTRAL[name] if v is None else check(v))
        values = np.repeat(np.asarray(value if isinstance(value, list) else [value] * rows), repeat)
        getattr(out, {"repetition_penalty": "repetition", "presence_penalty": "presence",
                      "frequency_penalty": "frequency", "min_tokens": "min_tokens"}[name])[:len(values)] = values

    fill("repetition_penalty", repetition_penalty, checks.repetition_penalty)
    fill("presence_penalty", presence_penalty, lambda v: checks.openai_penalty("presence_penalty", v))
    fill("frequency_penalty", frequency_penalty, lambda v: checks.openai_penalty("frequency_penalty", v))

    def check_min(value):
        value = checks.check_int("min_tokens", value, 0)
        if max_new_tokens is not None and value > max_new_tokens:
            raise checks.ArgumentError(f"min_tokens ({value}) exceeds max_new_tokens ({max_new_tokens})",
                                       "min_tokens")
        return value

    fill("min_tokens", min_tokens, check_min)
    if logit_bias is not None:
        if isinstance(logit_bias, Mapping):
            biases = [logit_bias] * rows
        elif isinstance(logit_bias, Sequence) and len(logit_bias) == rows:
            biases = list(logit_bias)
        else:
            raise checks.ArgumentError(f"logit_bias must be a dict, or a list of {rows} (one per prompt, None: "
                                       f"none), got {type(logit_bias).__name__}", "logit_bias")
        for p, bias in enumerate(biases):
            ids, values = checks.logit_bias(bias, vocab_size)
            for r in range(p * repeat, (p + 1) * repeat):
                out.bias_ids[r, :len(ids)], out.bias[r, :len(ids)] = ids, values
    return out


def prompt_ids(token_lists: Sequence[Sequence[int]], rows: int, length: int | None = None) -> np.ndarray:
    """int32[rows, T] each row's prompt tokens, -1 after (rows past the lists: none). T: `length`, else the longest
    prompt rounded up to a power of two (so that calls share a compiled `start`)."""
    longest = max((len(p) for p in token_lists), default=1)
    T = length or 1 << max(longest - 1, 0).bit_length()
    out = np.full((rows, T), -1, np.int32)
    for b, p in enumerate(token_lists):
        out[b, :len(p)] = p
    return out


def mark(present, ids):
    """present bool[B, V] with the tokens ids int32[B, T] (-1: none) set."""
    B, V = present.shape
    return present.at[jnp.arange(B)[:, None], jnp.where(ids >= 0, ids, V)].set(True, mode="drop")


@flax.struct.dataclass
class Processing:
    """One per-row logits-processing state: the settings and what they have seen.

    penalties: `Penalties` (per row).
    counts:    int32[B, V], how many times each token was emitted by the row (its output, not its prompt).
    prompt:    bool[B, V], the tokens of the row's prompt (what repetition_penalty sees beside the output).
    generated: int32[B], tokens the row has emitted (what min_tokens compares with).
    """

    penalties: Penalties
    counts: jax.Array
    prompt: jax.Array
    generated: jax.Array

    def apply(self, logits, stop_ids):
        """float32[B, V] logits -> the processed logits (module docstring). stop_ids: int32[n] for every row or
        int32[B, n] per row (-1 padding): the ids min_tokens holds back."""
        p = self.penalties
        B, V = logits.shape
        x = logits.astype(jnp.float32)
        rows = jnp.arange(B)[:, None]
        none = lambda x: x  # noqa: E731

        def bias(x):
            return x.at[rows, jnp.where(p.bias_ids >= 0, p.bias_ids, V)].add(p.bias, mode="drop")

        def penalize(x):
            seen = self.counts > 0
            repetition = p.repetition[:, None]
            x = jnp.where(seen | self.prompt, jnp.where(x > 0, x / repetition, x * repetition), x)
            return x - self.counts.astype(jnp.float32) * p.frequency[:, None] - seen * p.presence[:, None]

        def hold(x):
            ids = jnp.broadcast_to(stop_ids, (B,) + stop_ids.shape[-1:])
            held = (ids >= 0) & (self.generated < p.min_tokens)[:, None]
            return x.at[rows, jnp.where(held, ids, V)].set(-jnp.inf, mode="drop")

        x = lax.cond(jnp.any(p.bias_ids >= 0), bias, none, x)
        x = lax.cond(p.counts_output(), penalize, none, x)
        return lax.cond(jnp.any(self.generated < p.min_tokens), hold, none, x)

    def advance(self, tokens, emitted):
        """The state after each row with `emitted` (bool[B]) emitted tokens int32[B] (ids in [0, V))."""
        B, V = self.counts.shape
        counted = jnp.where(emitted, tokens, V)  # out of range: dropped
        return self.replace(counts=self.counts.at[jnp.arange(B), counted].add(1, mode="drop"),
                            generated=self.generated + emitted.astype(jnp.int32))


@flax.struct.dataclass
class Fresh:
    """What a compiled loop builds its `Processing` state from, inside its own jit (no program of its own to
    compile per shape): the settings and prompts int32[B, T] (-1 padding, `prompt_ids`; T a shape the loop
    already compiles for, such as the cache's capacity)."""

    penalties: Penalties
    prompts: jax.Array

    def state(self, vocab_size: int) -> Processing:
        """The state before a row's first token: no output yet."""
        B = self.prompts.shape[0]
        return Processing(penalties=self.penalties, counts=jnp.zeros((B, vocab_size), jnp.int32),
                          prompt=mark(jnp.zeros((B, vocab_size), bool), self.prompts),
                          generated=jnp.zeros((B,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("vocab_size",))
def start(penalties: Penalties, prompts, *, vocab_size: int) -> Processing:
    """`Fresh(penalties, prompts).state(vocab_size)` as a program of its own (the engine's, once per pool)."""
    return Fresh(penalties, prompts).state(vocab_size)


def requested(arguments: Mapping) -> list[str]:
    """The names among `generate`-style penalty arguments ({name: value}) set to something other than neutral."""
    def neutral(name, value):
        if value is None or (name == "logit_bias" and isinstance(value, Mapping) and not value):
            return True
        values = value if isinstance(value, (list, tuple, np.ndarray)) and name != "logit_bias" else [value]
        return all(v is None or (name != "logit_bias" and v == NEUTRAL[name]) or (name == "logit_bias" and not v)
                   for v in values)
    return [name for name, value in arguments.items() if not neutral(name, value)]
