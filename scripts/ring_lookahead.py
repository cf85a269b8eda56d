"""A sliding-window model under speculation: a ring of window + k slots against a plain cache masked to the window.

    python scripts/ring_lookahead.py [--window 128] [--prompt-len 128] [--new-tokens 1024] [--k 4] [--rate 0.8]
                                     [--reps 3]

The "small" preset with `sliding_window` set, float32, batch 1, greedy. The test-only proposer of `jaxkv bench
speculative` (the target's true greedy tokens with probability --rate) verifies every pass (adaptive off), so both
layouts run the same passes and keep the same tokens. For each layout: the cache bytes allocated and the decode
time of `loop.speculative_loop` (median of --reps after a compile run), then their ratio. The ring is what
`jaxkv.generate(..., speculative=)` allocates (`plan_cache(..., lookahead=k)`); the plain cache (prompt +
new tokens + k slots) is what it allocated before (docs/design/speculation.md, "Sliding windows").
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.bench.speculative import oracle_proposer
from jaxkv.cache import planner
from jaxkv.config import PRESETS
from jaxkv.decoding import loop, programs, speculation
from jaxkv.sampling import Sampler


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    config = PRESETS["small"].replace(sliding_window=args.window, dtype="float32")
    model = jaxkv.Model.random(config, seed=0)
    k, new = args.k, args.new_tokens
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, args.prompt_len).tolist()
    plain_run = jaxkv.generate(model, [prompt], max_new_tokens=new, stop_tokens=[])
    truth = np.asarray(prompt + plain_run.tokens[0] + [0] * (k + 2), np.int32)
    tokens, start = jaxkv.left_pad([prompt])
    spec = speculation.Speculation("ngram", k, adaptive=False).check(model)
    sampler = Sampler.make(temperature=[0.0])
    history, length = speculation.prompt_history([prompt], 1, args.prompt_len + new + k + 2)
    layouts = {
        "ring window + k": dict(ring=True, capacity=args.window + k, lookahead=k),
        "plain cache": dict(ring=False, capacity=planner.next_pow2(args.prompt_len + new + k), lookahead=0),
    }
    print(f"small, sliding_window={args.window}, prompt {args.prompt_len}, {new} new tokens, k={k}, "
          f"proposer right with probability {args.rate}, every pass verifying, median of {args.reps}")
    print("| layout | slots per layer | cache MiB | decode s | tokens/s | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    figures = {}
    with oracle_proposer(truth, args.rate, config.vocab_size):
        for name, layout in layouts.items():
            times, out = [], None
            for rep in range(args.reps + 1):
                logits, cache = programs.prefill(model.params, tokens, start, config=config, attention="xla",
                                                 cache_dtype="float32", mesh=None, **layout)
                logits.block_until_ready()
                t0 = time.perf_counter()
                out = loop.speculative_loop(
                    model.params, cache, logits, jax.random.PRNGKey(0), sampler, jnp.full((8,), -1, jnp.int32),
                    jnp.zeros((1,), bool), jnp.int32(new), history, length, config=config,
                    max_steps=loop.steps_bound(layout["capacity"], layout["ring"], new), attention="xla",
                    stream=None, logprobs=0, plan=spec)
                out.tokens.block_until_ready()
                if rep:  # the first run compiles
                    times.append(time.perf_counter() - t0)
            got = np.asarray(out.tokens)[0, :new].tolist()
            seconds = statistics.median(times)
            figures[name] = seconds
            print(f"| {name} | {cache.capacity} | {cache.nbytes() / 2**20:.2f} | {seconds:.3f} | "
                  f"{new / seconds:.1f} | {got == plain_run.tokens[0]} |")
    ring, plain = figures["ring window + k"], figures["plain cache"]
    print(f"ring / plain decode time: {ring / plain:.3f}")


if __name__ == "__main__":
    main()
