"""`jaxkv run-batch` as users run it: a subprocess over an OpenAI Batch API file. Its answers are the server's for
the same bodies; killed (SIGKILL) at random moments and resumed, it ends with exactly one result per request,
equal to an uninterrupted run's; two processes and --merge equal one; bad lines are error records."""

import codecs
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from helpers.server import chat_model_dir, start_server

pytestmark = pytest.mark.xdist_group("server")

ENGINE = ["--slots", "2", "--max-len", "96", "--prefill-chunk", "32", "--served-model-name", "tiny-chat"]


def requests_file(path: pathlib.Path) -> pathlib.Path:
    """28 lines: greedy completions (text and token-id prompts, n=2, logprobs, echo, stop strings), chats, a
    request the server refuses (400) and lines that are no request."""
    lines = []
    for i in range(20):
        body = {"model": "tiny-chat", "prompt": f"The KV cache {i} holds", "max_tokens": 4 + i % 7,
                "temperature": 0}
        if i % 5 == 1:
            body |= {"n": 2, "logprobs": 2}
        if i % 5 == 2:
            body |= {"echo": True, "logprobs": 1, "stop": [" "]}
        if i % 5 == 3:
            body |= {"prompt": [1 + i, 2, 3, 4, 5]}
        lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})
    for i in range(4):
        lines.append({"custom_id": f"chat{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": f"hello {i}"}],
                               "max_tokens": 6, "temperature": 0}})
    lines.append({"custom_id": "bad-body", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny-chat", "prompt": "x", "max_tokens": 3, "temperature": 5}})
    text = [json.dumps(line) for line in lines]
    text += ["{not json", json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
             json.dumps({"custom_id": "stream", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny-chat", "prompt": "x", "stream": True}})]
    path.write_text("\n".join(text) + "\n")
    return path


def run_batch(*args, env=None, check=True):
    proc = subprocess.run([sys.executable, "-m", "jaxkv.cli", "run-batch", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def answer(record: dict):
    """What a record says, without what differs between runs (the completion's id and creation time)."""
    response = record["response"]
    if response is None:
        return record["error"]
    body = {k: v for k, v in response["body"].items() if k not in ("id", "created")}
    return response["status_code"], body


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    model = chat_model_dir(root)
    inputs = requests_file(root / "requests.jsonl")
    env = {**os.environ, "JAXKV_COMPILE_CACHE": str(root / "xla")}  # later runs start warm
    out = root / "full.jsonl"
    run_batch("-i", inputs, "-o", out, "--model", model, *ENGINE, env=env)
    return root, model, inputs, env, out


def test_every_line_has_one_record_and_bad_lines_are_error_records(job):
    root, _, inputs, _, out = job
    got = records(out)
    assert len(got) == len(inputs.read_text().splitlines()) == 28
    assert len({r["id"] for r in got}) == 28
    by_custom = {r["custom_id"]: r for r in got}
    assert by_custom["bad-body"]["response"]["status_code"] == 400
    assert by_custom["bad-body"]["response"]["body"]["error"]["param"] == "temperature"
    assert "method" in by_custom["get"]["error"]["message"] and by_custom["get"]["error"]["line"] == 27
    assert "stream" in by_custom["stream"]["error"]["message"]
    assert "JSON" in by_custom[None]["error"]["message"] and by_custom[None]["error"]["line"] == 26
    ok = [r for r in got if r["response"] is not None and r["response"]["status_code"] == 200]
    assert len(ok) == 24
    for r in ok:
        assert r["response"]["request_id"] == r["id"] and r["error"] is None


def test_answers_equal_the_servers_for_the_same_bodies(job):
    root, model, inputs, env, out = job
    # the job's compile cache: the server compiles the same programs as run-batch (same ENGINE flags), so it
    # starts warm; the answers are compared, not how the programs were built
    proc, url = start_server(["--model", str(model), *ENGINE], env={"JAXKV_COMPILE_CACHE": env["JAXKV_COMPILE_CACHE"]})
    try:
        by_custom = {r["custom_id"]: r for r in records(out)}
        with httpx.Client(base_url=url, timeout=120) as client:
            for raw in inputs.read_text().splitlines():
                try:
                    item = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                if item.get("method") != "POST" or item["body"].get("stream"):
                    continue
                r = client.post(item["url"], json=item["body"])
                want = (r.status_code, {k: v for k, v in r.json().items() if k not in ("id", "created")})
                assert answer(by_custom[item["custom_id"]]) == want, item["custom_id"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_killed_at_random_moments_and_resumed_loses_and_repeats_nothing(job):
    root, model, inputs, env, out = job
    want = {r["id"]: answer(r) for r in records(out)}
    path = root / "killed.jsonl"
    rng = np.random.default_rng(0)
    # Three kills (ten, then four before: each costs a process start, ~5 s of CPU): the first while the process
    # starts, before any result (at a random poll), then two after a random 1-9 more results each (at a random
    # moment while it writes). The final run resumes from wherever the last kill left the file.
    for kill in range(3):
        before = len(path.read_text().splitlines()) if path.exists() else 0
        if before == len(want):
            break
        target = before + (0 if kill == 0 else int(rng.integers(1, 10)))  # 0: killed while starting
        proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "run-batch", "-i", str(inputs), "-o", str(path),
                                 "--model", str(model), *ENGINE, "--no-progress"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            lines = path.read_bytes().count(b"\n") if path.exists() else 0
            if lines >= target and (target > before or rng.random() < 0.2):
                break
            time.sleep(0.01 + 0.05 * rng.random())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    run_batch("-i", inputs, "-o", path, "--model", model, *ENGINE, "--no-progress", env=env)
    got = records(path)
    assert sorted(r["id"] for r in got) == sorted(want)  # each once
    assert {r["id"]: answer(r) for r in got} == want


@pytest.fixture(scope="module")
def split(job):
    """The job's input over two processes (--num-processes 2), process 1 with --data-parallel-size 2 (an engine per
    data shard, on 2 of the 8 host devices): the parts' path, and process 1's records, read before --merge.
    test_data_parallel_engines_give_the_same_answers checks process 1's answers: a run of its own cost a process
    start, a model load and the engines' compiles, ~10% of this file."""
    root, model, inputs, env, _ = job
    parts = root / "split.jsonl"
    procs = [subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "run-batch", "-i", str(inputs), "-o", str(parts),
                               "--model", str(model), *ENGINE, "--num-processes", "2", "--process-id", str(i),
                               *(["--data-parallel-size", "2"] if i == 1 else []), "--no-progress"], env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    return parts, records(parts.with_name("split.jsonl.part-1-of-2"))


def test_two_processes_and_merge_equal_one(job, split):
    root, model, inputs, env, out = job
    parts, _ = split
    first = records(parts.with_name("split.jsonl.part-0-of-2"))
    # process 0 took lines 0, 2, 4, ...: the even completions c0, c2, ... (lines 0-19)
    assert {int(r["custom_id"][1:]) % 2 for r in first if (r["custom_id"] or "")[1:].isdigit()} == {0}
    incomplete = run_batch("--merge", "-i", inputs, "-o", root / "early.jsonl", "--num-processes", "3",
                           check=False)
    assert incomplete.returncode == 2 and "missing" in incomplete.stderr
    run_batch("--merge", "-i", inputs, "-o", parts, "--num-processes", "2")
    merged, full = records(parts), {r["id"]: r for r in records(out)}
    assert [r["id"] for r in merged] == [r["id"] for r in sorted(full.values(), key=lambda r: _line(r, inputs))]
    assert [answer(r) for r in merged] == [answer(full[r["id"]]) for r in merged]


def _line(record, inputs) -> int:
    from jaxkv.server.batch import parse_line

    for index, raw in enumerate(inputs.read_text().splitlines()):
        if parse_line(index, raw).request_id == record["id"]:
            return index
    raise AssertionError(record)


def test_bad_flags_and_files_are_one_line_errors(job, tmp_path):
    root, model, inputs, env, _ = job
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n' * 2)
    for args, match in [(["-i", dup, "-o", tmp_path / "o"], "custom_id 'a' is on lines 1 and 2"),
                        (["-i", tmp_path / "none", "-o", tmp_path / "o"], "no such file"),
                        (["-i", inputs, "-o", tmp_path / "o", "--process-id", "1"], "go together"),
                        (["-i", inputs, "-o", tmp_path / "o", "--num-processes", "2", "--process-id", "2"],
                         "--process-id must be in"),
                        (["-i", inputs, "-o", inputs], "not a run-batch result")]:
        proc = run_batch(*args, check=False)
        assert proc.returncode == 2 and match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_data_parallel_engines_give_the_same_answers(job, split):
    """--data-parallel-size 2 (an engine per data shard, on 2 of the 8 host devices): every answer equals the
    single engine's (greedy). Process 1 of the split run's (`split`): the odd lines, 14 of 28, completions with
    n = 2 and logprobs, echo and stop strings, token-id prompts, chats, error records."""
    _, _, _, _, out = job
    _, dp = split
    full = {r["id"]: answer(r) for r in records(out)}
    assert len(dp) == 14
    assert {r["id"]: answer(r) for r in dp} == {r["id"]: full[r["id"]] for r in dp}


def test_bytes_that_are_not_utf8_cr_bom_and_blank_lines(job, tmp_path):
    """Issue 50, item 6: the input is read as bytes and lines end at LF only. A line that is not UTF-8 (a stray
    0xFF, a multi-byte character cut short) is an error record naming its line, and the job goes on; a bare CR
    is JSON whitespace, inside a line or before its LF; a UTF-8 BOM at the file's start is skipped; blank lines
    get no record but count for line numbers; a custom_id that is a lone surrogate (legal JSON, no UTF-8) is
    written escaped. Rerun, and split over two processes then merged, every line keeps its number."""
    _, model, _, env, _ = job

    def line(custom_id, prompt=b'"Hi"', sep=b", "):
        body = {"model": "tiny-chat", "prompt": "PROMPT", "max_tokens": 2, "temperature": 0}
        item = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
        return json.dumps(item).encode().replace(b'"PROMPT"', prompt).replace(b", ", sep)  # (ASCII: escapes)

    inputs = tmp_path / "odd.jsonl"
    inputs.write_bytes(b"\n".join([
        codecs.BOM_UTF8 + line("a") + b"\r",  # 1: the BOM, a CRLF ending
        b" \t\r",  # 2: blank
        line("bad", prompt=b'"\xffHi"'),  # 3: not UTF-8
        line("b", sep=b",\r "),  # 4: bare CRs between JSON tokens
        b"",  # 5: blank
        line("cut", prompt=b'"\xe2\x82"'),  # 6: a 3-byte character cut short
        line("\ud800"),  # 7: the custom_id "\ud800" (a lone surrogate, escaped)
        line("c"),  # 8: the last line, without an LF
    ]))
    out = tmp_path / "odd-out.jsonl"
    run_batch("-i", inputs, "-o", out, "--model", model, *ENGINE, "--no-progress", env=env)
    got = records(out)
    assert len(got) == 6, got
    by_custom = {r["custom_id"]: r for r in got if r["custom_id"] is not None}
    assert set(by_custom) == {"a", "b", "c", "\ud800"}
    assert {r["response"]["status_code"] for r in by_custom.values()} == {200}
    assert len({answer(r)[1]["choices"][0]["text"] for r in by_custom.values()}) == 1  # the same request
    errors = sorted((r for r in got if r["custom_id"] is None), key=lambda r: r["error"]["line"])
    assert [r["error"]["line"] for r in errors] == [3, 6]
    assert "not UTF-8: byte 0xff at byte" in errors[0]["error"]["message"]
    assert "not UTF-8: byte 0xe2 at byte" in errors[1]["error"]["message"]
    assert b'"custom_id": "\\ud800"' in out.read_bytes()  # escaped: the output stays UTF-8
    written = out.read_bytes()
    run_batch("-i", inputs, "-o", out, "--model", model, *ENGINE, "--no-progress", env=env)
    assert out.read_bytes() == written  # a rerun finds every line done, bad ones included

    # Two processes: lines 1, 3, 5, 7 and 2, 4, 6, 8 (blank lines included in the count). Parts holding exactly
    # those records are already done for each process (nothing rerun); --merge orders them by line.
    number = {"a": 1, "b": 4, "\ud800": 7, "c": 8}
    parts = tmp_path / "odd-split.jsonl"
    for i in range(2):
        mine = [r for r in got if (number.get(r["custom_id"]) or r["error"]["line"]) % 2 == (i + 1) % 2]
        part = parts.with_name(f"{parts.name}.part-{i}-of-2")
        part.write_text("".join(json.dumps(r) + "\n" for r in mine))
        before = part.read_bytes()
        run_batch("-i", inputs, "-o", parts, "--num-processes", "2", "--process-id", i, "--no-progress", env=env)
        assert part.read_bytes() == before
    run_batch("--merge", "-i", inputs, "-o", parts, "--num-processes", "2")
    assert [r["custom_id"] or r["error"]["line"] for r in records(parts)] == ["a", 3, "b", 6, "\ud800", "c"]
