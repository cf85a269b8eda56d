"""Load test of `jaxkv serve`: requests/s, output tokens/s, time to first token and latency at several numbers of
concurrent streaming clients, for the bundled model ("tiny") and the "small" preset (random weights, no tokenizer).

    python scripts/bench_serve.py [--models tiny,small] [--concurrency 1,8,32] [--requests 64] [--prompt-len 128]
                                  [--max-tokens 64] [--slots 32] [--max-len 512] [--out docs/bench/serve/serve.json]
    python scripts/bench_serve.py --quick      (a smoke test of a few seconds; see --help)

Per model, one server process: `python -m jaxkv.cli serve --port 0 (--model tiny | --preset small) --slots S
--max-len L`, every other flag at its default (prefix cache on). Once it prints its "listening on" line, one
warm-up request, then per concurrency level C a closed loop: C coroutines share one httpx.AsyncClient (at least C
connections); each sends a request, reads its stream to "data: [DONE]" and sends the next, until --requests have
been sent. Every request is POST /v1/completions with stream, temperature 0, ignore_eos (so each makes exactly
--max-tokens tokens), stream_options.include_usage, and a prompt of --prompt-len token ids drawn uniformly from
[0, 256) by a seeded numpy RNG: valid in both vocabularies (tiny 257, small 32000), and distinct per request so that
the prefix cache never serves a prompt.

Figures per (model, C): requests/s = requests completed / the level's wall seconds; output tokens/s = completion
tokens (each stream's usage chunk) / wall seconds; latency = send to [DONE]; time to first token (TTFT) = send to
the first chunk whose choice has non-empty text. A model without a tokenizer streams no text (its chunks carry
"token_ids"), so for it TTFT is send to the first chunk carrying a choice; the JSON names the basis per model and
holds both timings. Tokens arrive one engine dispatch at a time (the server's --steps-per-dispatch, 8 by default,
tokens per chunk; "chunks_per_request" in the JSON), so TTFT is the prefill plus the first dispatch, not one step.
Times are taken by the client, on the server's machine: the client's CPU competes with it. The JSON also holds
the settings and the server's /metrics?format=json after each level (counters cumulative since it started).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = {"tiny": ["--model", "tiny"], "small": ["--preset", "small"]}
HAS_TEXT = {"tiny": True, "small": False}  # the preset has no tokenizer: no streamed text
VOCAB = 256  # prompt ids below this are valid for every model here
SEED = 0
DEFAULT_OUT = "docs/bench/serve/serve.json"  # in the repository, wherever the script is run from
START_TIMEOUT_S = 900  # loading and compiling before "listening on" (slow on a CPU with a cold compile cache)
QUICK = {"models": ["tiny"], "concurrency": [1, 4], "requests": 8, "max_tokens": 16, "prompt_len": 32,
         "out": os.path.join(tempfile.gettempdir(), "bench_serve_quick.json")}  # never over the recorded figures


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, as jaxkv's own commands answer a bad flag
        print(f"bench_serve: error: {message}", file=sys.stderr)
        sys.exit(2)


def _ints(text):
    if not all(s.strip().isdigit() and int(s) >= 1 for s in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return [int(s) for s in text.split(",")]


def _models(text):
    bad = [s for s in text.split(",") if s not in SOURCES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown model {bad[0]!r}; choose from {', '.join(SOURCES)}")
    return list(dict.fromkeys(text.split(",")))  # each model once


def parse_args(argv=None):
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_models, default="tiny,small", help="tiny and/or small (default both)")
    p.add_argument("--concurrency", type=_ints, default="1,8,32", help="concurrent clients per level (1,8,32)")
    p.add_argument("--requests", type=int, default=64, help="requests per level, at least the concurrency (64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (128)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (64)")
    p.add_argument("--slots", type=int, default=32, help="the server's --slots (32)")
    p.add_argument("--max-len", type=int, default=512, help="the server's --max-len (512)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON file for the figures ({DEFAULT_OUT})")
    quick = ", ".join(f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                      for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"a smoke test, as if given {quick} (explicit options win)")
    args = p.parse_args(argv)
    if args.quick:  # its values as defaults: options given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    for name in ("requests", "prompt_len", "max_tokens", "slots", "max_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.requests < max(args.concurrency):
        p.error(f"--requests {args.requests} is less than the largest --concurrency ({max(args.concurrency)})")
    if args.prompt_len + args.max_tokens > args.max_len:
        p.error(f"--prompt-len + --max-tokens ({args.prompt_len + args.max_tokens}) exceeds --max-len {args.max_len}")
    return args


class Server:
    """`jaxkv serve` in a subprocess on a free port, once it is listening. Threads drain its stdout and stderr (a
    full pipe would block it); the stderr tail is kept to explain a failure."""

    def __init__(self, model: str, args):
        self.cmd = [sys.executable, "-m", "jaxkv.cli", "serve", "--port", "0", *SOURCES[model],
                    "--slots", str(args.slots), "--max-len", str(args.max_len)]
        started, self.url, ready = time.perf_counter(), None, threading.Event()
        self.stderr = collections.deque(maxlen=20)
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

        def read_stdout():
            for line in self.proc.stdout:
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()  # it exited without the line
        threading.Thread(target=read_stdout, daemon=True).start()
        ready.wait(START_TIMEOUT_S)
        if self.url is None:
            self.stop()
            raise RuntimeError(f"the server did not start: {''.join(self.stderr).strip()[-300:] or 'no output'}")
        self.startup_s = time.perf_counter() - started

    def stop(self):
        """SIGTERM (a graceful stop) -> its exit status; killed if it has not stopped within a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class RequestFailed(Exception):
    pass


async def one_request(client, url, name, prompt, max_tokens) -> dict:
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first_chunk, first_text, tokens, done, chunks = time.perf_counter(), None, None, None, False, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RequestFailed(f"error event: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                now, chunks = time.perf_counter(), chunks + 1
                first_chunk = first_chunk or now
                first_text = first_text or (now if choice.get("text") else None)
    if not done or tokens is None:
        raise RequestFailed("the stream ended without " + ("a usage chunk" if done else "data: [DONE]"))
    return {"latency": time.perf_counter() - sent, "tokens": tokens, "chunks": chunks,
            "ttft_chunk": first_chunk and first_chunk - sent, "ttft_text": first_text and first_text - sent}


def _ms(values, q=50):
    values = [v for v in values if v is not None]
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


async def run_level(client, url, name, prompts, concurrency, args, has_text) -> dict:
    todo, results, errors = iter(prompts), [], []

    async def client_loop():  # next(todo) runs between awaits, so no two coroutines take the same prompt
        for prompt in todo:
            try:
                results.append(await one_request(client, url, name, prompt, args.max_tokens))
            except (RequestFailed, httpx.HTTPError) as e:
                errors.append(f"{type(e).__name__}: {e}")

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    # with a tokenizer, TTFT is to the first text (a request whose tokens decode to no text: to its first chunk)
    ttft = [(r["ttft_text"] if has_text else None) or r["ttft_chunk"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(prompts), "completed": len(results), "errors": len(errors),
            "first_error": errors[0] if errors else None, "wall_s": round(wall, 3),
            "requests_per_s": round(len(results) / wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
            "completion_tokens": tokens, "ttft_ms_p50": _ms(ttft), "ttft_ms_p90": _ms(ttft, 90),
            "latency_ms_p50": _ms([r["latency"] for r in results]),
            "chunks_per_request": float(np.median([r["chunks"] for r in results])) if results else None,
            "ttft_first_chunk_ms_p50": _ms([r["ttft_chunk"] for r in results]),
            "ttft_first_text_ms_p50": _ms([r["ttft_text"] for r in results])}


async def bench_model(server, model, args, record) -> None:
    rng, seen = np.random.default_rng(SEED), set()

    def prompt():  # distinct prompts: no request finds another's pages in the prefix cache
        while tuple(p := rng.integers(0, VOCAB, args.prompt_len).tolist()) in seen:
            pass
        seen.add(tuple(p))
        return p

    limits = httpx.Limits(max_connections=max(args.concurrency), max_keepalive_connections=max(args.concurrency))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        name = record["served_name"] = (await client.get(server.url + "/v1/models")).json()["data"][0]["id"]
        try:  # the same shapes as the levels: the first request's one-off costs are not in their figures
            record["warmup"] = await one_request(client, server.url, name, prompt(), args.max_tokens)
        except (RequestFailed, httpx.HTTPError) as e:
            raise RuntimeError(f"the warm-up request failed: {type(e).__name__}: {e}") from None
        for c in args.concurrency:
            level = await run_level(client, server.url, name, [prompt() for _ in range(args.requests)], c, args,
                                    HAS_TEXT[model])
            level["metrics"] = (await client.get(server.url + "/metrics?format=json")).json()
            record["levels"].append(level)
            print(ROW.format(model, *("-" if level[k] is None else f.format(level[k]) for k, f in COLUMNS.items())),
                  flush=True)


COLUMNS = {"concurrency": "{}", "completed": "{}", "errors": "{}", "wall_s": "{:.2f}", "requests_per_s": "{:.2f}",
           "output_tokens_per_s": "{:.1f}", "ttft_ms_p50": "{:.1f}", "ttft_ms_p90": "{:.1f}",
           "latency_ms_p50": "{:.1f}"}
ROW = "{:6} {:>4} {:>5} {:>4} {:>7} {:>8} {:>8} {:>12} {:>12} {:>15}"


def main(argv=None) -> int:
    args = parse_args(argv)
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    out = {"settings": vars(args) | {"seed": SEED, "prompt_ids": f"uniform in [0, {VOCAB}), distinct per request",
                                     "request": {"stream": True, "temperature": 0, "ignore_eos": True,
                                                 "stream_options": {"include_usage": True}}},
           "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "git": git.stdout.strip() or None},
           "models": {}}
    print(ROW.format("model", "C", "done", "err", "wall s", "req/s", "tok/s", "TTFT p50 ms", "TTFT p90 ms",
                     "latency p50 ms"))
    failed = False
    for model in args.models:
        record = out["models"][model] = {"ttft_basis": "first chunk with non-empty text" if HAS_TEXT[model] else
                                         "first chunk carrying a choice (no tokenizer: no text)", "levels": []}
        try:
            server = Server(model, args)
            record.update(server_cmd=server.cmd[1:], startup_s=round(server.startup_s, 1))
            try:
                asyncio.run(bench_model(server, model, args, record))
            finally:
                record["server_exit"] = server.stop()
        except (RuntimeError, httpx.HTTPError) as e:  # recorded; the other models still run
            record["error"] = f"{type(e).__name__}: {e}"
            print(f"{model}: {record['error']}", file=sys.stderr)
        failed |= "error" in record or any(level["errors"] for level in record["levels"])
    path = ROOT / DEFAULT_OUT if args.out == DEFAULT_OUT else pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
