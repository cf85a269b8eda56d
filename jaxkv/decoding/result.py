"""What a finished `generate` call returns: `Generation`, its tokens, text, log-probabilities and measured
figures (`stats`), built from the decode loop's host arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxkv import roofline, sharding
from jaxkv.cache import planner as memory
from jaxkv.layers import quantized
from jaxkv.decoding.loop import LoopOut
from jaxkv.decoding.phase import Phase
from jaxkv.model import Model


@dataclasses.dataclass
class Generation:
    """Result of `generate`.

    tokens: per prompt, the new token ids; a stop token that ended the sequence is included, nothing after it
      (the one after a complete constraint too).
    finish_reasons: per prompt, "stop" (a stop token was emitted, or a constraint was completed by the last
      allowed token) or "length" (max_new_tokens reached).
    stats: measured figures of this call (seconds, tokens/s, cache bytes).
    logprobs: per prompt, the log-probability of each new token under the model's distribution, at temperature
      1 (log_softmax of the model's logits, before penalties, logit bias, min_tokens, a constraint and the
      sampling filters: `jaxkv.decoding.step`): one float per entry of tokens[i].
    top_logprobs: with `generate(logprobs=k)`, k > 0: per prompt, per new token, the k most likely
      (token id, log-probability) pairs under that same distribution, best first (ties: lower id first); else None.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict = dataclasses.field(default_factory=dict)
    text: list[str] | None = None  # decoded new tokens, when the model has a tokenizer
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class Request:
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
    penalties: object = None  # `processing.Penalties` per padded row (host arrays); None: neutral

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.token_lists]


def generation(model: Model, req: Request, loop: LoopOut, prefill_time: Phase, decode_time: Phase) -> Generation:
    """The `Generation` of a finished call: `loop` holds host arrays (`loop.on_host`) and the final cache (global
    arrays; a pmapped cache's leaves have a leading device axis, which changes no byte count)."""
    config = model.config
    out, num_new, stopped, forward_passes, cache = loop[:5]
    n, lengths = len(req.token_lists), req.lengths
    result = [out[b, : num_new[b]].tolist() for b in range(n)]
    for b, row in enumerate(result):
        bad = [t for t in row if not 0 <= t < config.vocab_size]
        if bad and bad[0] == -1:  # the row was stopped there (`step.select`)
            raise ValueError(f"prompt {b}: the model's logits became NaN after {len(row) - 1} new tokens")
        if bad:  # only a custom sampler can do this
            raise ValueError(f"the sampler returned token id {bad[0]} for prompt {b}, outside the vocabulary "
                             f"[0, {config.vocab_size})")
    reasons = ["stop" if stopped[b] else "length" for b in range(n)]
    decode_s = decode_time.run_s
    # The first new token comes from the prefill logits; each later one costs a one-token forward pass. The loop
    # stops once every row has stopped, so `forward_passes` is what ran (at most max_new_tokens - 1).
    steps = int(forward_passes)
    live = np.mean(lengths) + steps / 2  # windows, chunks and top-k bound it per layer (`roofline`)
    step_bytes = roofline.decode_bytes_per_step(config, req.plan.padded_batch, live, jnp.dtype(config.dtype).itemsize,
                                                jnp.dtype(req.plan.cache_dtype).itemsize,
                                                params=model.params if model.weights is not None else None)
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
        # The parameter arrays as held on their devices (`quantized.held_bytes`; weight-only quantization shrinks
        # them, `jaxkv.load(..., weights=)`), and the weights' quantization or None.
        "weight_bytes": quantized.held_bytes(model.params),
        "weights": None if model.weights is None else model.weights.mode,
        # Bytes a step must move (weights + live K/V read + new K/V written; jaxkv.roofline) and the rate achieved.
        "bytes_per_step": float(step_bytes),
        "achieved_GBps": float(step_bytes * steps_per_s / 1e9),
    }
    if loop.proposed is not None:  # speculative decoding (`jaxkv.Speculation`)
        proposed, accepted = int(np.sum(loop.proposed[:n])), int(np.sum(loop.accepted[:n]))
        stats.update({
            "spec_proposed": proposed,
            "spec_accepted": accepted,
            "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_verifies": int(loop.verifies),
            # Decode forward passes of the target (verifies and plain steps; the prefill not counted) and the
            # tokens each emitted per row (the first new token comes from the prefill).
            "target_forwards": steps,
            "tokens_per_target_forward": fed_back / n / steps if steps else 0.0,
        })
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
