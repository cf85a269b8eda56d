"""What lm-evaluation-harness's `local-completions` asks of `jaxkv serve`, timed: its log-likelihood requests
(`echo`, `logprobs: 1`, `max_tokens: 1`, `temperature: 0`, prompts as token ids) one at a time, against the same
requests with `max_tokens: 0` (scoring alone), and its `batch_size=B, num_concurrent=C` load (C clients each
sending requests of B prompts) with the statuses it gets back.

    python scripts/bench_loglikelihood.py [--lengths 16,64,256] [--requests 30] [--batch 64] [--concurrent 8]
                                          [--bursts 2] [--max-len 512] [--slots 8]

One server: `python -m jaxkv.cli serve --port 0 --model tiny --max-len L --slots S`, other flags at their defaults.
Per prompt length, `--requests` requests of one prompt each (random ids in [0, 256), seeded), sequential, for
max_tokens 1 and 0, after two untimed warm-up requests; the figure is the client's median and mean latency in
ms. Then `--bursts` times, C concurrent requests of B prompts each (64-token prompts, max_tokens 1): the
statuses counted and the wall time of the burst. Times are taken by the client on the server's machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np


def _start(args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "serve", "--port", "0", "--model", "tiny",
                             "--max-len", str(args.max_len), "--slots", str(args.slots)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, found.group(1)
    raise SystemExit(f"the server did not start: {proc.stderr.read()}")


def _body(prompt, max_tokens):
    return {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}  # lm-eval 0.4.13's `_create_payload(generate=False)`


def _sequential(url, rng, length, requests, max_tokens) -> list[float]:
    times = []
    with httpx.Client(timeout=300) as client:
        for i in range(requests + 2):
            prompt = rng.integers(0, 256, length).tolist()
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json=_body(prompt, max_tokens))
            elapsed = time.perf_counter() - start
            r.raise_for_status()
            if i >= 2:  # the first two: untimed warm-up
                times.append(elapsed * 1e3)
    return times


async def _burst(url, rng, batch, concurrent) -> tuple[collections.Counter, float, dict]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrent)) as client:
        async def one():
            prompts = [rng.integers(0, 256, 64).tolist() for _ in range(batch)]
            r = await client.post(url + "/v1/completions", json=_body(prompts, 1))
            return r.status_code, r.headers.get("retry-after")

        start = time.perf_counter()
        answers = await asyncio.gather(*(one() for _ in range(concurrent)))
        wall = time.perf_counter() - start
    return collections.Counter(s for s, _ in answers), wall, {s: h for s, h in answers if s != 200}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,64,256")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--slots", type=int, default=8)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    proc, url = _start(args)
    try:
        print(f"server: tiny, --max-len {args.max_len} --slots {args.slots}; {args.requests} sequential requests "
              f"per row (client latency, ms)")
        print(f"{'prompt tokens':>13} {'max_tokens':>10} {'median':>8} {'mean':>8}")
        for length in (int(x) for x in args.lengths.split(",")):
            for max_tokens in (1, 0):
                times = _sequential(url, rng, length, args.requests, max_tokens)
                print(f"{length:>13} {max_tokens:>10} {statistics.median(times):>8.2f} "
                      f"{statistics.fmean(times):>8.2f}")
        for i in range(args.bursts):
            statuses, wall, refused = asyncio.run(_burst(url, rng, args.batch, args.concurrent))
            print(f"burst {i + 1}: {args.concurrent} concurrent requests x {args.batch} prompts: "
                  f"statuses {dict(statuses)} (Retry-After on refusals: {refused or 'none'}) in {wall:.2f} s")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
