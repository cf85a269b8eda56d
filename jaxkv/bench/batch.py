"""`jaxkv run-batch` against driving `jaxkv.Engine` directly, on the same requests.

    jaxkv bench run-batch [--model tiny] [--requests 128] [--slots 8] [--reps 3] [--out F]
    python scripts/bench_run_batch.py ...            (the same)

One process, one model. The requests: --requests completions with token-id prompts of 16-128 tokens (numpy seed
--seed per repetition, so no repetition reuses another's prompts) and max_tokens uniform in [8, 64], greedy,
ignore_eos (every request runs to its max_tokens, whatever the model says). Two paths, each on its own engine
built as `jaxkv run-batch` builds it (`jaxkv.server.main.build`, --slots, max_len 256, prefix cache off so
neither path reuses the other's prompts), each warmed up with one repetition's requests first:

  engine:     `Engine.generate` of the requests' (prompt, max_new_tokens) with stop_tokens=[]: the engine alone.
  run-batch:  the requests as a Batch API file's bodies through `jaxkv.server.batch.run_lines` (the app's
              validation, the worker thread, detokenization, JSON records appended to a file), max_concurrent as
              run-batch's default.

Throughput = new tokens / wall seconds of the repetition (loading and compiling excluded); medians over --reps,
the paths alternating per repetition. Target (issue 33): run-batch within 5% of the engine's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

TARGET = 0.95  # run-batch throughput / engine throughput


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench run-batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    return p.parse_args(argv)


def make_requests(vocab_size: int, count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": [int(t) for t in rng.integers(1, vocab_size, size=int(rng.integers(16, 129)))],
             "max_tokens": int(rng.integers(8, 65))} for _ in range(count)]


def build(args):
    """(state, engine) as `jaxkv run-batch` builds them, with the benchmark's settings."""
    from jaxkv.server import batch, main as serve

    flags = batch.parser().parse_args(["-i", "-", "-o", "-", "--model", args.model, "--slots", str(args.slots),
                                       "--max-len", "256", "--no-prefix-cache"])
    serve.check_engine_options(flags)
    return serve.build(flags, warm=True)


def run_engine(engine, requests) -> tuple[float, int]:
    start = time.perf_counter()
    results = engine.generate([{"prompt": r["prompt"], "max_new_tokens": r["max_tokens"]} for r in requests],
                              stop_tokens=[])
    seconds = time.perf_counter() - start
    return seconds, sum(len(r.tokens) for r in results)


def run_batch(app, state, requests, directory: pathlib.Path, rep: int) -> tuple[float, int]:
    from jaxkv.server import batch

    lines = [batch.Line(i, batch.request_id(i, str(i).encode()), custom_id=f"r{i}", url="/v1/completions",
                        body={"model": state.model_name, "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                              "temperature": 0, "ignore_eos": True}) for i, r in enumerate(requests)]
    path = directory / f"results-{rep}.jsonl"
    writer = batch.Writer(path)
    progress = batch.Progress(len(lines), 0, enabled=False)
    start = time.perf_counter()
    try:
        asyncio.run(batch.run_lines(app, lines, writer, progress, state.worker.capacity))
    finally:
        writer.close()
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in path.read_text().splitlines()]
    bad = [r for r in records if r["response"] is None or r["response"]["status_code"] != 200]
    if bad:
        raise RuntimeError(f"run-batch answered {len(bad)} request(s) with an error: {bad[0]}")
    return seconds, sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records)


def run(args) -> dict:
    import jax

    from jaxkv.server.app import create_app

    state, _ = build(args)
    _, engine = build(args)  # the engine path's own engine, built alike
    vocab = state.model.config.vocab_size
    app = create_app(state)
    state.worker.start()
    figures = {"engine": [], "run-batch": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            directory = pathlib.Path(tmp)
            warm = make_requests(vocab, args.requests, args.seed + 1000)
            run_engine(engine, warm)
            run_batch(app, state, warm, directory, -1)
            for rep in range(args.reps):
                requests = make_requests(vocab, args.requests, args.seed + rep)
                for name in (("engine", "run-batch") if rep % 2 == 0 else ("run-batch", "engine")):
                    seconds, tokens = (run_engine(engine, requests) if name == "engine"
                                       else run_batch(app, state, requests, directory, rep))
                    figures[name].append({"seconds": seconds, "new_tokens": tokens, "tokens_per_s": tokens / seconds})
                    print(f"[bench run-batch] rep {rep}: {name} {tokens:,} tokens in {seconds:.2f} s "
                          f"({tokens / seconds:,.0f}/s)", file=sys.stderr, flush=True)
    finally:
        state.worker.close()
    medians = {name: statistics.median(f["tokens_per_s"] for f in runs) for name, runs in figures.items()}
    return {"model": args.model, "requests": args.requests, "slots": args.slots, "reps": args.reps,
            "device": jax.devices()[0].platform, "runs": figures, "tokens_per_s": medians,
            "ratio": medians["run-batch"] / medians["engine"], "target": TARGET}


def report(r: dict) -> str:
    e, b = r["tokens_per_s"]["engine"], r["tokens_per_s"]["run-batch"]
    verdict = "met" if r["ratio"] >= r["target"] else "MISSED"
    return (f"{r['model']}, {r['requests']} requests, {r['slots']} slots, median of {r['reps']} ({r['device']}):\n"
            f"  engine directly: {e:,.0f} new tokens/s\n"
            f"  run-batch:       {b:,.0f} new tokens/s  ({r['ratio']:.3f} of the engine's; target >= {r['target']}: "
            f"{verdict})")


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("requests", "slots", "reps"):
        if getattr(args, name) < 1:
            print(f"jaxkv bench run-batch: error: --{name} must be >= 1", file=sys.stderr)
            return 2
    r = run(args)
    print(report(r), flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(r, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
