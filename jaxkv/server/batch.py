"""`jaxkv run-batch`: an offline job over OpenAI's Batch API format, through the server's own request handling.

  jaxkv run-batch -i requests.jsonl -o results.jsonl [--model PATH|tiny] [engine flags as jaxkv serve's]
                  [--num-processes N --process-id I | --distributed] [--max-concurrent C] [--no-progress]
  jaxkv run-batch --merge -i requests.jsonl -o results.jsonl --num-processes N

Input: one request per line, `{"custom_id": "...", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`; custom_ids are unique (a repeated one refuses the job before it starts).
The file is read as bytes: lines end at LF only (a CR ends no line: between JSON tokens it is whitespace, so
CRLF files read as they should), each line is decoded as UTF-8 on its own, a UTF-8 BOM at the start of the file is
skipped, and a blank line (nothing but JSON whitespace) is no request and gets no record, though it counts for
line numbers.
Each body goes through the app `jaxkv serve` runs, in this process (an ASGI call, no socket), so it is validated,
answered and refused exactly as the server would. Output: one line per request, in the order they finish,

  {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "batch_req_...",
   "body": {... the server's answer ...}}, "error": null}

with the server's status and error body for a request it refuses (4xx), and `"response": null, "error": {"code":
"invalid_request", "message": ..., "line": n}` for a line that is no request (not UTF-8, not JSON, no custom_id,
another method or url, a streaming body): a bad line is a record, never a stopped job.

Durability: each record is one write of one whole line, at once (os.write on an O_APPEND descriptor), so a job
killed at any moment (kill -9) loses no finished result. Restarted with the same output, a job first drops a
partial last line (the one write a kill can cut), then skips every line whose custom_id (or, for a line without
one, whose id: a hash of its line number and text) is already there: no result is lost or written twice. A
request's id is that hash, so a rerun writes the same ids.

Across processes: `--num-processes N --process-id I` takes input lines I, I + N, I + 2N, ... and writes
`OUTPUT.part-I-of-N` (processes on one machine or many hosts, with or without a shared disk: copy the parts
together to merge); `--distributed` takes N and I from `jax.distributed.initialize()` (its cluster detection, or
--coordinator-address with --num-processes and --process-id). `--merge` then writes OUTPUT with every input line's
record in input order, and refuses (naming what is missing) while any part lacks one.

Progress: a line on stderr (requests done of this process's, errors, new tokens/s, ETA), rewritten in place on a
terminal, every 10 s otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import time

from jaxkv.server import main as serve

EXIT_USAGE = 2
URLS = ("/v1/completions", "/v1/chat/completions")
RETRY_STATUSES = (429, 503)  # the server is full for the moment: the request is retried, not recorded
JSON_WHITESPACE = b" \t\r\n"  # RFC 8259's four: a line of nothing else is blank


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(f"{message} (see jaxkv run-batch --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxkv run-batch", description="Run an OpenAI Batch API file (JSONL of /v1/completions and "
                                                    "/v1/chat/completions requests) through jaxkv's engine.")
    p.add_argument("-i", "--input", required=True, metavar="FILE", help="the requests, one JSON object per line")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the results (appended; a rerun skips what it holds); with --num-processes N > 1 each "
                        "process writes FILE.part-I-of-N")
    p.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes sharing the input")
    p.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index in [0, N)")
    p.add_argument("--distributed", action="store_true",
                   help="take N and I from jax.distributed.initialize() (cluster detection, or the flags)")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="with --distributed: jax.distributed's coordinator (process 0)")
    p.add_argument("--merge", action="store_true",
                   help="join the N parts of --output into --output, in input order (no model is loaded)")
    p.add_argument("--max-concurrent", type=int, default=None, metavar="C",
                   help="requests in flight at once (default: slots + 8 staging rows + max-waiting: the engine's "
                        "capacity, so none waits in the server's queue)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    serve.add_engine_options(p)
    p.set_defaults(api_key=None)
    return p


@dataclasses.dataclass
class Line:
    """One input line: `index` (0-based), its id (`request_id`), and its custom_id, url and body, or the reason
    it is no request (`error`)."""

    index: int
    request_id: str
    custom_id: str | None = None
    url: str | None = None
    body: dict | None = None
    error: str | None = None


def request_id(index: int, raw: bytes) -> str:
    return "batch_req_" + hashlib.sha256(f"{index}\n".encode() + raw).hexdigest()[:24]


def parse_line(index: int, raw: bytes | str) -> Line:
    """Line `index` (0-based) of the input, its bytes without the line ending (a str is taken as its UTF-8)."""
    raw = raw.encode() if isinstance(raw, str) else raw
    line = Line(index, request_id(index, raw))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # JSON text is UTF-8 (RFC 8259): this line cannot be read, the others can
        line.error = f"not UTF-8: byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line ({e.reason})"
        return line
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        line.error = f"not valid JSON ({e})"
        return line
    if not isinstance(item, dict):
        line.error = f"a request is a JSON object, got {type(item).__name__}"
        return line
    custom_id = item.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        line.custom_id = custom_id
    else:
        line.error = "custom_id must be a non-empty string"
        return line
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        line.error = f"unknown field(s) {unknown}"
    elif item.get("method") != "POST":
        line.error = f"method must be \"POST\", got {item.get('method')!r}"
    elif item.get("url") not in URLS:
        line.error = f"url must be one of {list(URLS)}, got {item.get('url')!r}"
    elif not isinstance(item.get("body"), dict):
        line.error = "body must be a JSON object (the request's body)"
    elif item["body"].get("stream"):
        line.error = "stream is not supported in a batch (each result is written whole)"
    else:
        line.url, line.body = item["url"], item["body"]
    return line


def read_lines(path: pathlib.Path):
    """(index, bytes) of each line of the input that is not blank, without its line ending. Lines end at LF only:
    a CR is JSON whitespace (a CRLF ending's CR is dropped, so a line's id does not depend on the ending; a CR
    inside a line stays in it). A UTF-8 BOM at the start of the file is skipped (editors on Windows write one).
    A blank line is skipped but counted: `index` is always the line's place in the file, so every process, a
    rerun and --merge number lines alike."""
    with open(path, "rb") as f:  # binary lines end at b"\n" only
        for index, raw in enumerate(f):
            if index == 0 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            if raw.strip(JSON_WHITESPACE):
                yield index, raw.rstrip(b"\n").rstrip(b"\r")


def part_path(output: pathlib.Path, process: int, processes: int) -> pathlib.Path:
    return output if processes == 1 else output.with_name(f"{output.name}.part-{process}-of-{processes}")


def check_input(path: pathlib.Path) -> list[int]:
    """The indices of the input's lines that are not blank (`read_lines`); a custom_id on two lines is a
    ValueError (which result would be whose?)."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    seen, indices = {}, []
    for index, raw in read_lines(path):
        indices.append(index)
        line = parse_line(index, raw)
        if line.custom_id is not None:
            if line.custom_id in seen:
                raise ValueError(f"{path}: custom_id {line.custom_id!r} is on lines {seen[line.custom_id] + 1} and "
                                 f"{index + 1}; custom_ids must be unique")
            seen[line.custom_id] = index
    return indices


def finished(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(ids, custom_ids) of the records already in an output file. A partial last line (a write cut by a kill) is
    dropped from the file first; any other line that is no record refuses the file (it is not this job's)."""
    if not path.exists():
        return set(), set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    ids, custom_ids = set(), set()
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], 1):  # (records end at LF, as input lines do)
        try:
            record = json.loads(raw)
            ids.add(record["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: line {number} is not a run-batch result; pass another --output") from None
        if record.get("custom_id") is not None:
            custom_ids.add(record["custom_id"])
    if end < len(data):  # only once every whole line proved to be a record
        os.truncate(path, end)
    return ids, custom_ids


class Writer:
    """Appends records to the output, each as one write of one whole line."""

    def __init__(self, path: pathlib.Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict):
        try:
            data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        except UnicodeEncodeError:  # a lone surrogate (a line's "\ud800" escape): no UTF-8, so written escaped
            data = (json.dumps(record) + "\n").encode()
        while data:  # a regular file takes it in one write; the loop is for the rare short write
            data = data[os.write(self.fd, data):]

    def close(self):
        os.close(self.fd)


def error_record(line: Line) -> dict:
    return {"id": line.request_id, "custom_id": line.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": line.error, "line": line.index + 1}}


def response_record(line: Line, status: int, body) -> dict:
    return {"id": line.request_id, "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": line.request_id, "body": body}, "error": None}


async def call(app, url: str, body: dict) -> tuple[int, object]:
    """POST `body` to the ASGI `app` at `url` in this process -> (status, the JSON answer)."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": url, "raw_path": url.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent_body = False
    never = asyncio.Event()  # the client never disconnects: the job waits for every answer

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await never.wait()

    status, chunks = 500, []

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    text = b"".join(chunks)
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, {"error": {"message": text.decode(errors="replace"), "type": "server_error"}}


class Progress:
    """The stderr line: requests done of this process's, errors, new tokens/s, ETA."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.total, self.done, self.errors, self.tokens = total, done, 0, 0
        self.start_done, self.started, self.shown = done, time.perf_counter(), 0.0
        self.enabled, self.tty = enabled, sys.stderr.isatty()

    def add(self, error: bool, tokens: int):
        self.done += 1
        self.errors += error
        self.tokens += tokens
        self.show()

    def show(self, final: bool = False):
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self.shown < (0.5 if self.tty else 10.0):
            return
        self.shown = now
        elapsed = max(now - self.started, 1e-9)
        rate = (self.done - self.start_done) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = "--" if eta == float("inf") else f"{int(eta // 60)}m{int(eta % 60):02d}s"
        text = (f"run-batch: {self.done:,}/{self.total:,} requests, {self.errors:,} errors, "
                f"{self.tokens / elapsed:,.0f} new tokens/s, ETA {eta_text}")
        print(("\r" + text) if self.tty and not final else text, end="\n" if final or not self.tty else "",
              file=sys.stderr, flush=True)


async def run_lines(app, lines, writer: Writer, progress: Progress, max_concurrent: int):
    """Every line's record written as it finishes, `max_concurrent` requests in flight."""
    slots = asyncio.Semaphore(max_concurrent)

    async def one(line: Line):
        try:
            delay = 0.01
            while True:
                status, body = await call(app, line.url, line.body)
                if status not in RETRY_STATUSES:
                    break
                await asyncio.sleep(delay)  # full for now: the engine frees room as sequences finish
                delay = min(2 * delay, 1.0)
            writer.write(response_record(line, status, body))
            usage = body.get("usage") if isinstance(body, dict) else None
            progress.add(status != 200, usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0)
        finally:
            slots.release()

    tasks = set()
    for line in lines:
        if line.error is not None:
            writer.write(error_record(line))
            progress.add(True, 0)
            continue
        await slots.acquire()
        task = asyncio.create_task(one(line))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))


def merge(input_path: pathlib.Path, output: pathlib.Path, processes: int) -> int:
    """Writes `output` from its parts, every input line's record in input order -> the record count. ValueError
    naming the first missing record while a part lacks any."""
    if output.exists() and output.stat().st_size:
        raise ValueError(f"{output}: exists and is not empty; --merge writes a new file")
    records = []
    for i in range(processes):
        path = part_path(output, i, processes)
        if not path.exists():
            raise ValueError(f"{path}: missing (process {i} has not run)")
        by_id, by_custom = {}, {}
        for raw in path.read_bytes().split(b"\n"):
            try:
                record = json.loads(raw)
                by_id[record["id"]] = raw
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a partial last line: that request is missing, found below
            if record.get("custom_id") is not None:
                by_custom[record["custom_id"]] = raw
        records.append((by_id, by_custom))
    out, missing = [], []
    for index, raw in read_lines(input_path):
        line = parse_line(index, raw)
        by_id, by_custom = records[index % processes]
        found = by_custom.get(line.custom_id) if line.custom_id is not None else None
        found = found if found is not None else by_id.get(line.request_id)
        if found is None:
            missing.append((index, line.custom_id))
        else:
            out.append(found)
    if missing:
        index, custom_id = missing[0]
        raise ValueError(f"{len(missing)} result(s) missing, the first line {index + 1} (custom_id {custom_id!r}) "
                         f"of process {index % processes}: rerun that process with the same flags to finish it")
    tmp = output.with_name(output.name + ".merging")
    tmp.write_bytes(b"".join(r + b"\n" for r in out))
    os.replace(tmp, output)
    return len(out)


def _processes(args) -> tuple[int, int]:
    """(N, I) from the flags, or from jax.distributed under --distributed."""
    if args.distributed:
        import jax

        jax.distributed.initialize(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id)
        return jax.process_count(), jax.process_index()
    if args.num_processes is None and "jax" in sys.modules:
        import jax  # already running under jax.distributed (a wrapper initialized it): its count and index

        if jax.process_count() > 1:
            return jax.process_count(), jax.process_index()
    n = 1 if args.num_processes is None else args.num_processes
    i = 0 if args.process_id is None else args.process_id
    return n, i


def check(args):
    if args.distributed and args.merge:
        raise ValueError("--merge joins finished parts: it takes --num-processes, not --distributed")
    if not args.distributed:
        if args.coordinator_address is not None:
            raise ValueError("--coordinator-address goes with --distributed")
        if (args.num_processes is None) != (args.process_id is None) and not args.merge:
            raise ValueError("--num-processes and --process-id go together")
        if args.num_processes is not None and args.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
        if args.process_id is not None and not 0 <= args.process_id < (args.num_processes or 1):
            raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    if args.merge and args.num_processes is None:
        raise ValueError("--merge needs --num-processes (how many parts)")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise ValueError(f"--max-concurrent must be >= 1, got {args.max_concurrent}")
    if not args.merge:
        serve.check_engine_options(args)


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        check(args)
        input_path, output = pathlib.Path(args.input), pathlib.Path(args.output)
        requests = check_input(input_path)
        if args.merge:
            count = merge(input_path, output, args.num_processes)
            print(f"jaxkv run-batch: {output}: {count:,} results merged from {args.num_processes} parts",
                  file=sys.stderr)
            return 0
        processes, process = _processes(args)
        path = part_path(output, process, processes)
        done_ids, done_custom = finished(path)
    except (ValueError, OSError) as e:
        print(f"jaxkv run-batch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    mine = [index for index in requests if index % processes == process]
    todo = []
    for index, raw in read_lines(input_path):
        if index % processes != process:
            continue
        line = parse_line(index, raw)
        if line.request_id in done_ids or (line.custom_id is not None and line.custom_id in done_custom):
            continue
        todo.append(line)
    progress = Progress(len(mine), len(mine) - len(todo), not args.no_progress)
    if not todo:
        progress.show(final=True)
        return 0
    try:
        state, engine = serve.build(args, warm=False)  # compiles what the requests use, as they come
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"jaxkv run-batch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from jaxkv.server.app import create_app

    app = create_app(state)
    max_concurrent = args.max_concurrent or state.worker.capacity  # slots + staging rows + max-waiting
    writer = Writer(path)
    state.worker.start()
    progress.started = time.perf_counter()  # rates from the first request on, not from loading and compiling
    try:
        asyncio.run(run_lines(app, todo, writer, progress, max_concurrent))
    except KeyboardInterrupt:  # every finished result is written; a rerun goes on from there
        return 130
    finally:
        state.worker.close()
        writer.close()
    progress.show(final=True)
    return 0
