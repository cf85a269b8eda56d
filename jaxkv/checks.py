"""Argument checks shared by the API and the command line, without importing JAX.

Every public entry point validates its arguments here before any compute (and the CLI before it imports JAX, so
a bad flag fails in well under a second). Each check raises `ArgumentError` (a `ValueError`) with a message naming
the argument, and the argument's name as `argument`, so that a caller (`jaxkv serve`) can name the field it came
from without reading the message.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import numpy as np

INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64)  # a seed is taken modulo 2**64: every 64-bit seed, signed or unsigned, is distinct


class ArgumentError(ValueError):
    """A refused argument: the ValueError every check raises, with the argument's name (`argument`)."""

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(message)
        self.argument = argument


@contextlib.contextmanager
def about(argument: str):
    """The ValueErrors the block raises are about `argument` (an entry point's own name for what it checks): they
    come out as ArgumentErrors naming it, with their messages."""
    try:
        yield
    except ValueError as exc:
        if isinstance(exc, ArgumentError) and exc.argument == argument:
            raise
        raise ArgumentError(str(exc), argument) from exc


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """`value` as an int in [minimum, maximum]. bool, float and str are refused (True tokens is a mistake)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{name} must be an integer, got {value!r}", name)
    if value < minimum:
        raise ArgumentError(f"{name} must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise ArgumentError(f"{name} must be <= {maximum}, got {value}", name)
    return int(value)


def check_float(name: str, value) -> float:
    """`value` as a finite float. Numbers only: the string "0.5" is refused rather than parsed."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"{name} must be a number, got {value!r}", name)
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{name} must be finite, got {value}", name)
    return value


def seed_words(seed) -> tuple[int, int]:
    """A seed in [-2**63, 2**64) -> (high, low) 32-bit words of seed mod 2**64: a threefry key's data.

    Seeds in [0, 2**32) give exactly `jax.random.PRNGKey(seed)`; larger ones are not truncated to 32 bits (seed 5
    and seed 2**32 + 5 are different keys)."""
    seed = check_int("seed", seed, SEED_RANGE[0], SEED_RANGE[1] - 1) % 2**64
    return seed >> 32, seed & 0xFFFFFFFF


def per_row(name: str, value, rows: int | None, check):
    """A scalar setting, or one value per row (a sequence or 1-D array of length `rows`), each checked."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        return check(value)
    arr = list(np.asarray(value, dtype=object).ravel()) if isinstance(value, np.ndarray) else list(value)
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise ArgumentError(f"{name} per row must be 1-D, got shape {value.shape}", name)
    if rows is None:
        raise ArgumentError(f"{name} must be a single value here, got a sequence", name)
    if len(arr) != rows:
        raise ArgumentError(f"{name} has {len(arr)} values, one per prompt is {rows}", name)
    return [check(v) for v in arr]


def _temperature(value):
    value = check_float("temperature", value)
    if value < 0:
        raise ArgumentError(f"temperature must be >= 0 (0 is greedy), got {value}", "temperature")
    return value


def _top_k(value):
    # top_k >= the vocabulary keeps every token, as in transformers; the bound is int32, what the sampler holds.
    return None if value is None else check_int("top_k", value, 1, INT32_MAX)


def _top_p(value):
    if value is None:
        return None
    value = check_float("top_p", value)
    if not 0.0 < value <= 1.0:
        raise ArgumentError(f"top_p must be in (0, 1], got {value}", "top_p")
    return value


def _min_p(value):
    if value is None:
        return None
    value = check_float("min_p", value)
    if not 0.0 <= value <= 1.0:
        raise ArgumentError(f"min_p must be in [0, 1], got {value}", "min_p")
    return value


def sampling(temperature=0.0, top_k=None, top_p=None, min_p=None, *, rows: int | None = None) -> dict:
    """Checked sampling settings: {"temperature", "top_k", "top_p", "min_p"}, each a scalar or (with `rows`) a
    list of one value per row; None (or a None entry) disables a filter.

    A filter set while every row is greedy (temperature 0) would be silently ignored: refused instead, since it
    almost always means a temperature was forgotten.
    """
    out = {"temperature": per_row("temperature", temperature, rows, _temperature),
           "top_k": per_row("top_k", top_k, rows, _top_k),
           "top_p": per_row("top_p", top_p, rows, _top_p),
           "min_p": per_row("min_p", min_p, rows, _min_p)}
    temps = out["temperature"] if isinstance(out["temperature"], list) else [out["temperature"]]
    if all(t == 0.0 for t in temps):
        inactive = {"top_k": (None,), "top_p": (None, 1.0), "min_p": (None, 0.0)}  # values that filter nothing
        for name in ("top_k", "top_p", "min_p"):
            values = out[name] if isinstance(out[name], list) else [out[name]]
            if any(v not in inactive[name] for v in values):
                raise ArgumentError(f"{name} has no effect with temperature 0 (greedy decoding): set a temperature "
                                    f"> 0 to sample, or drop {name}", name)
    return out


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


def logit_bias(value, vocab_size: int | None):
    """A checked logit_bias: {token id: bias} (ids may be int-like strings, as JSON keys are) -> ([ids], [biases]).
    vocab_size None: ids are checked against the vocabulary later."""
    if value is None:
        return [], []
    if not isinstance(value, Mapping):
        raise ArgumentError(f"logit_bias must be a mapping {{token id: bias}}, got {type(value).__name__}",
                            "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ArgumentError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    ids, biases = [], []
    for token, bias in value.items():
        try:
            t = int(token)
        except (TypeError, ValueError):
            raise ArgumentError(f"logit_bias keys must be token ids, got {token!r}", "logit_bias") from None
        if isinstance(token, (bool, float)) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ArgumentError(f"logit_bias: token id {token!r} is outside the vocabulary [0, "
                                f"{vocab_size if vocab_size is not None else 'V'})", "logit_bias")
        ids.append(t)
        biases.append(check_float(f"logit_bias[{token!r}]", bias))
    return ids, biases


def repetition_penalty(value) -> float:
    value = check_float("repetition_penalty", value)
    if not value > 0:
        raise ArgumentError(f"repetition_penalty must be > 0 (1.0 is off), got {value}", "repetition_penalty")
    return value


def openai_penalty(name: str, value) -> float:
    """presence_penalty or frequency_penalty: OpenAI's range [-2, 2]."""
    value = check_float(name, value)
    if not -2.0 <= value <= 2.0:
        raise ArgumentError(f"{name} must be in [-2, 2] (0 is off), got {value}", name)
    return value


# Weight-only quantization flags, shared by `jaxkv generate`, `jaxkv serve` and (--weights) `jaxkv memory`.
WEIGHT_MODES = ("int8", "fp8", "int4")  # jaxkv.layers.quantized.WEIGHT_MODES (not imported here: no JAX)


def add_weight_flags(parser) -> None:
    """--weights, --weight-group-size, --quantize-embeddings: weight-only quantization (`weights_of`)."""
    parser.add_argument("--weights", choices=WEIGHT_MODES, default=None,
                        help="quantize the weights (weight-only): int8 or fp8 per output channel, int4 in groups; "
                             "default: as stored")
    parser.add_argument("--weight-group-size", type=int, default=None, metavar="G",
                        help="int4's inputs per scale (default 64)")
    parser.add_argument("--quantize-embeddings", action="store_true",
                        help="with --weights, also quantize the embedding tables and lm_head")


def check_weight_flags(args) -> None:
    """A weight flag that needs --weights without it, or --weight-group-size without int4: ValueError (no JAX)."""
    if args.weights is None and (args.weight_group_size is not None or args.quantize_embeddings):
        raise ArgumentError("--weight-group-size and --quantize-embeddings need --weights", "--weights")
    if args.weight_group_size is not None and args.weight_group_size < 1:
        raise ArgumentError(f"--weight-group-size must be a positive integer, got {args.weight_group_size}",
                            "--weight-group-size")
    if args.weight_group_size is not None and args.weights not in (None, "int4"):
        raise ArgumentError(f"--weight-group-size is int4's; --weights {args.weights} has one scale per channel",
                            "--weight-group-size")


def weights_of(args):
    """The `jaxkv.WeightQuant` the weight flags ask for (`check_weight_flags` first), or None."""
    check_weight_flags(args)
    if args.weights is None:
        return None
    from jaxkv.layers.quantized import DEFAULT_GROUP_SIZE, WeightQuant

    return WeightQuant(args.weights, args.weight_group_size or DEFAULT_GROUP_SIZE, args.quantize_embeddings)
