"""A soak test of `jaxkv serve`: mixed load for --minutes, then idle; checks that nothing leaks or fails.

    python scripts/soak_serve.py [--minutes 30] [--clients 12] [--slots 4] [--json FILE] [--seed 0]
                                 [--malformed 0.1]

Starts `jaxkv serve` (the bundled model with a chat template added, --slots, max_len 256) as a subprocess and runs
--clients concurrent clients (raw HTTP, httpx) for --minutes. Each client loops over requests drawn at random:

  completions, streamed or not; n = 1-3; logprobs; echo; short (3-20 token) or long (130-190 token) prompts
  chat completions, streamed or not
  malformed (about 10%, --malformed): not JSON, an unknown field, a wrong type, max_tokens past the context, an
    unknown model: each must get its own 4xx (400, or 404 for the model)
  streams the client drops after a few chunks (a disconnect), and non-streamed requests it gives up on before the
    answer (a cancel: the server must free their slots)

Checks, each printed with its figure: no 5xx at all; every 4xx the one expected for its request, and no 4xx for a
well-formed one; after the load, once idle (a few seconds), the engine holds no sequence, slot or page
(GET /metrics: sequences_held 0, slots_free == slots, pages_held 0); the server's resident memory (VmRSS of its
process) at the end within 5% of its value after warm-up (the first minute, or the first 20% of a shorter run).
Prints per minute: requests finished, responses by status, p50/p99 latency of whole (non-streamed) answers and of
time to first chunk of streams, new tokens/s, RSS. Exit status 0 if every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ("the cache keeps keys and values of every token so each step computes only the new one and reads "
         "the rest from memory which is why decoding is bound by bandwidth").split()


def model_dir(root: pathlib.Path) -> pathlib.Path:
    from jaxkv.io.checkpoint import TINY_DIR

    directory = root / "soak-model"
    shutil.copytree(TINY_DIR, directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return directory


def start_server(directory: pathlib.Path, slots: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "serve", "--port", "0", "--model", str(directory),
                             "--slots", str(slots), "--max-len", "256", "--served-model-name", "soak"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = []

    def read():
        for line in proc.stdout:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                found.append(m.group(1))
                break
        for _ in proc.stdout:  # keep the pipe drained
            pass

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not found:
        proc.kill()
        raise SystemExit(f"soak: the server did not start: {proc.stderr.read()}")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, found[0]


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def draw(rng: random.Random, malformed: float = 0.10) -> dict:
    """One request: (kind, url, body or raw bytes, stream, expected status, drop after n chunks / give up);
    `malformed`: the share of malformed requests (the well-formed ones keep their mix whatever it is)."""
    r = rng.random()
    if r < malformed:
        kind = rng.choice(["json", "field", "type", "context", "model"])
        body = {"model": "soak", "prompt": "hello", "max_tokens": 4}
        if kind == "json":
            return {"kind": "bad-json", "url": "/v1/completions", "raw": b'{"model": "soak", "prompt": ', "expect": 400}
        if kind == "field":
            body["no_such_field"] = 1
        elif kind == "type":
            body["max_tokens"] = "four"
        elif kind == "context":
            body["max_tokens"] = 10_000
        else:
            body["model"] = "not-served"
        return {"kind": f"bad-{kind}", "url": "/v1/completions", "body": body,
                "expect": 404 if kind == "model" else 400}
    r = 0.10 + 0.90 * (r - malformed) / (1 - malformed)  # in [0.10, 1): r itself at the default share
    long = rng.random() < 0.3
    prompt = text(rng, rng.randint(22, 30) if long else rng.randint(1, 3))  # byte-level: ~130-190 / 3-20 tokens
    stream = rng.random() < 0.5
    if r < 0.35:  # chat
        body = {"model": "soak", "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(4, 24),
                "temperature": rng.choice([0, 0.8]), "stream": stream}
        url, kind = "/v1/chat/completions", "chat"
    else:
        body = {"model": "soak", "prompt": prompt, "max_tokens": rng.randint(4, 24), "n": rng.choice([1, 1, 2, 3]),
                "temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.15 and not stream:
            body["echo"] = True
            body.setdefault("logprobs", 1)
        url, kind = "/v1/completions", "completion"
    request = {"kind": kind + ("-stream" if stream else ""), "url": url, "body": body, "expect": 200}
    if stream and rng.random() < 0.12:
        request["drop_after"] = rng.randint(1, 3)  # a client that disconnects mid-stream
    if not stream and rng.random() < 0.05:
        request["give_up_s"] = rng.uniform(0.05, 0.3)  # a client that cancels before the answer
    return request


class Tally:
    def __init__(self):
        self.minutes = collections.defaultdict(lambda: {"finished": 0, "statuses": collections.Counter(),
                                                        "latency": [], "ttft": [], "tokens": 0})
        self.total = collections.Counter()
        self.unexpected = []  # (kind, status, expected, detail)

    def record(self, minute: int, req: dict, status: int, latency: float | None, ttft: float | None, tokens: int,
               detail: str = ""):
        m = self.minutes[minute]
        m["finished"] += 1
        m["statuses"][status] += 1
        m["tokens"] += tokens
        if latency is not None:
            m["latency"].append(latency)
        if ttft is not None:
            m["ttft"].append(ttft)
        self.total[status] += 1
        if status >= 500 or (status != req["expect"] and status not in (0,)):
            self.unexpected.append((req["kind"], status, req["expect"], detail[:200]))


async def client(http, rng: random.Random, tally: Tally, start: float, until: float, malformed: float = 0.10):
    import httpx

    while time.monotonic() < until:
        req = draw(rng, malformed)
        minute = int((time.monotonic() - start) // 60)
        t0 = time.monotonic()
        try:
            if req.get("body", {}).get("stream"):
                ttft, chunks, tokens, status = None, 0, 0, 0
                detail = ""
                async with http.stream("POST", req["url"], json=req["body"]) as r:
                    status = r.status_code
                    if status != 200:
                        detail = (await r.aread()).decode(errors="replace")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunks += 1
                        tokens += 1
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        if req.get("drop_after") and chunks >= req["drop_after"]:
                            break  # leaving the block closes the connection mid-stream
                tally.record(minute, req, status, None, ttft, tokens, detail)
            else:
                content = req.get("raw") if "raw" in req else json.dumps(req["body"]).encode()
                call = http.post(req["url"], content=content, headers={"content-type": "application/json"})
                if req.get("give_up_s"):
                    try:
                        r = await asyncio.wait_for(call, req["give_up_s"])
                    except asyncio.TimeoutError:
                        tally.record(minute, req, 0, None, None, 0)  # cancelled by the client: no status
                        continue
                else:
                    r = await call
                usage = r.json().get("usage") if r.status_code == 200 else None
                tally.record(minute, req, r.status_code, time.monotonic() - t0, None,
                             usage["completion_tokens"] if usage else 0, "" if r.status_code == 200 else r.text)
        except httpx.HTTPError as e:
            tally.unexpected.append((req["kind"], "transport", req["expect"], repr(e)))


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def soak(url: str, args, pid: int) -> dict:
    import httpx

    tally = Tally()
    rss = []
    start = time.monotonic()
    until = start + 60 * args.minutes
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        tasks = [asyncio.create_task(client(http, rng, tally, start, until, args.malformed)) for rng in rngs]
        while any(not t.done() for t in tasks):
            await asyncio.sleep(min(5.0, max(0.1, until - time.monotonic())))
            rss.append((time.monotonic() - start, rss_bytes(pid)))
        await asyncio.gather(*tasks)
        await asyncio.sleep(args.idle_s)  # idle: cancelled sequences and disconnected streams wind down
        metrics = (await http.get("/metrics", params={"format": "json"})).json()
    rss.append((time.monotonic() - start, rss_bytes(pid)))
    return {"tally": tally, "rss": rss, "metrics": metrics, "seconds": time.monotonic() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=5.0, help="idle seconds after the load, before the last checks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--malformed", type=float, default=0.10, metavar="SHARE",
                   help="the share of malformed requests, in [0, 1) (a short run: more, so that each kind comes)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 0 <= args.malformed < 1:
        p.error(f"--malformed must be in [0, 1), got {args.malformed}")
    root = pathlib.Path(tempfile.mkdtemp(prefix="soak-"))
    proc, url = start_server(model_dir(root), args.slots)
    try:
        out = asyncio.run(soak(url, args, proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    tally, rss, metrics = out["tally"], out["rss"], out["metrics"]
    print(f"soak: {args.minutes:g} min, {args.clients} clients, {args.slots} slots; {sum(tally.total.values()):,} "
          f"requests")
    print("| minute | finished | statuses | p50 / p99 answer s | p50 / p99 first chunk s | new tokens/s | RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    per_minute = []
    for minute in sorted(tally.minutes):
        m = tally.minutes[minute]
        window = [b for t, b in rss if minute * 60 <= t < (minute + 1) * 60] or [rss[-1][1]]
        row = {"minute": minute + 1, "finished": m["finished"], "statuses": dict(m["statuses"]),
               "p50_s": percentile(m["latency"], 0.5), "p99_s": percentile(m["latency"], 0.99),
               "ttft_p50_s": percentile(m["ttft"], 0.5), "ttft_p99_s": percentile(m["ttft"], 0.99),
               "tokens_per_s": m["tokens"] / 60, "rss_mib": window[-1] / 2**20}
        per_minute.append(row)
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(m["statuses"].items()))
        print(f"| {row['minute']} | {row['finished']} | {statuses} | {row['p50_s']:.2f} / {row['p99_s']:.2f} | "
              f"{row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | {row['tokens_per_s']:.0f} | "
              f"{row['rss_mib']:.0f} |")
    warm_s = min(60.0, 0.2 * 60 * args.minutes)
    warm = next((b for t, b in rss if t >= warm_s), rss[-1][1])
    growth = rss[-1][1] / warm - 1
    fives = sum(v for k, v in tally.total.items() if isinstance(k, int) and k >= 500)
    checks = {
        "no 5xx": fives == 0,
        "every status as expected": not tally.unexpected,
        "idle: no sequence held": metrics["sequences_held"] == 0 and metrics["sequences_running"] == 0,
        "idle: every slot free": metrics["slots_free"] == metrics["slots_total"],
        "idle: no page held": metrics["pages_held"] == 0,
        "RSS growth after warm-up < 5%": growth < 0.05,
    }
    print(f"5xx: {fives}; unexpected statuses: {len(tally.unexpected)} {tally.unexpected[:5]}")
    print(f"idle: sequences held {metrics['sequences_held']}, running {metrics['sequences_running']}, slots free "
          f"{metrics['slots_free']}/{metrics['slots_total']}, pages held {metrics['pages_held']} (cached "
          f"{metrics['pages_cached']}); disconnects {metrics['disconnects']}; finished "
          f"{dict(metrics['finished'])}")
    print(f"RSS: {warm / 2**20:.1f} MiB after warm-up ({warm_s:.0f} s), {rss[-1][1] / 2**20:.1f} MiB at the end: "
          f"{100 * growth:+.2f}%")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "minutes": args.minutes, "clients": args.clients, "slots": args.slots, "malformed": args.malformed,
            "per_minute": per_minute,
            "statuses": {str(k): v for k, v in tally.total.items()}, "unexpected": tally.unexpected,
            "rss_after_warmup": warm, "rss_end": rss[-1][1], "rss_growth": growth, "idle_metrics": metrics,
            "checks": checks}, indent=1, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
