"""A submitted request as the engine's host side tracks it (`Request`: its settings, state and what it has produced),
and the padded page lists the device programs take."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass
class Request:
    """A submitted request and what it has produced (host side)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    settings: tuple  # (temperature, top_k, top_p, min_p) with disabled values 0.0, 0, 1.0, 0.0
    key: np.ndarray
    stop_ids: np.ndarray  # int32[STOP_SLOTS]
    top: int
    callback: Callable | None
    pages: int  # pages it holds at most (prompt + max_new_tokens - 1 slots written)
    state: str = "waiting"  # -> "prefilling" -> "ready" (prompt done) -> "decoding" -> "finished"
    row: int = -1  # the cache row it holds: a staging row S + j while prefilling and ready, then its slot
    written: int = 0  # slots of its sequence written so far (cached prefix, prefilled prompt, fed-back tokens)
    draft_written: int = 0  # with a draft model, the prompt slots its prefill has written (from 0, whatever hit)
    cached: int = 0  # prompt tokens found in the prefix cache
    hit_pages: tuple = ()
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    penalties: object = None  # its `jaxkv.decoding.processing.Penalties` (one row, host arrays)
    matcher: object = None  # its constraint's llguidance matcher (`jaxkv.constraints.matcher`); None: none



def padded(pages: list[int], size: int) -> np.ndarray:
    """int32[size]: `pages` then -1 (one compiled shape for any number of pages)."""
    out = np.full((size,), -1, np.int32)
    out[:len(pages)] = pages
    return out


def generate_calls(requests, defaults: dict) -> list[dict]:
    """`generate`'s requests -> one dict of `submit` arguments each ("prompt" included), `defaults` under each;
    a malformed list or a request without a prompt is a ValueError before anything is submitted."""
    if isinstance(requests, (str, dict)) or not isinstance(requests, Sequence) or not requests:
        raise ValueError("requests must be a non-empty list of prompts or of dicts of submit arguments")
    calls = [dict(defaults, **r) if isinstance(r, dict) else dict(defaults, prompt=r) for r in requests]
    for i, call in enumerate(calls):
        if "prompt" not in call:
            raise ValueError(f"request {i} has no prompt")
    return calls
