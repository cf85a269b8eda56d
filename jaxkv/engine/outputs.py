"""What the engine reports: `Event`s as tokens come out and a `Result` per finished request, and the reading of a
decode dispatch's device outputs into each slot's new tokens."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Event(NamedTuple):
    """Tokens a request produced in one dispatch (one event per request per dispatch that touched it).

    id: the request id `submit` returned. tokens: the new token ids (a stop token that ended it included).
    logprobs: each new token's log-probability under the model's distribution (temperature 1, before penalties,
    a constraint and sampling filters: `jaxkv.decoding.step`). finished: the request ended with this event;
    finish_reason: "stop", "length", "cancelled" or "error" then, else None.
    top_logprobs: with `submit(logprobs=k)`, per new token its k most likely (id, log-probability), best first;
    else None.
    """

    id: int
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass
class Result:
    """A finished request.

    tokens: the generated ids (the stop token that ended it included). logprobs: the log-probability of each
    under the model's distribution (temperature 1, before penalties, a constraint and sampling filters:
    `jaxkv.decoding.step`). top_logprobs: with `logprobs=k`, per token the k most likely (id, log-probability),
    best first; else None. finish_reason: "stop" (a stop token, or a constraint completed by the last allowed
    token), "length" (max_new_tokens), "cancelled" (`Engine.cancel`) or "error" (`error` says what: a callback
    raised, or the model's logits became NaN). prompt_tokens / cached_tokens: the prompt's length and how much of
    it came from the prefix cache. text: the decoded tokens, when the model has a tokenizer.
    """

    id: int
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0
    text: str | None = None
    error: str | None = None


class DecodeOut(NamedTuple):
    """A decode dispatch's outputs on the host, per step i and slot s (`programs.decode`)."""

    tokens: np.ndarray  # int32[steps, S], -1: the slot did not decode at that step
    chosen: np.ndarray  # float32[steps, S], each token's log-probability
    top_ids: np.ndarray  # int32[steps, S, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # float32[steps, S, MAX_LOGPROBS]
    codes: np.ndarray  # int32[steps, S], finish codes (`programs.FINISH_REASONS`), 0: going on


def slot_tokens(out: DecodeOut, slot: int, top: int):
    """One slot's share of a dispatch -> (new tokens, their log-probabilities, their top `top` alternatives (id,
    log-probability) per token, how many of them were fed back). A slot stops at its finish code: a NaN row
    (code 3) sampled nothing (the decode step released its pages); a finishing token is reported, not fed."""
    new, logp, alternatives, fed = [], [], [], 0
    for i in range(out.tokens.shape[0]):
        code = int(out.codes[i, slot])
        if code == 3:
            break
        if out.tokens[i, slot] < 0:
            continue  # the slot did not decode at this step
        new.append(int(out.tokens[i, slot]))
        logp.append(float(out.chosen[i, slot]))
        if top:
            alternatives.append([(int(a), float(b)) for a, b in
                                 zip(out.top_ids[i, slot, :top], out.top_logprobs[i, slot, :top])])
        if code:
            break
        fed += 1
    return new, logp, alternatives, fed
