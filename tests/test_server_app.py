"""The server's pieces without a network: the text stream (whole characters, stop strings), the app in process on a
model without a tokenizer or chat template, and `jaxkv serve`'s argument errors."""

import json
import socket
import subprocess
import sys
import time

import pytest

import jaxkv
from jaxkv.server.text import TextStream
from conftest import FAST_COMPILE

# One worker runs this module, so its in-process app (a module fixture) is built once, not once per xdist worker.
pytestmark = pytest.mark.xdist_group("server_app")

starlette = pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def tokenizer():
    return jaxkv.load("tiny").tokenizer  # byte-level: a multi-byte character is several tokens


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_text_stream_releases_whole_characters(tokenizer):
    text = "héllo → wörld ✓"
    tokens = ids(tokenizer, text)
    assert len(tokens) > len(text)  # some characters span several tokens
    stream, released = TextStream(tokenizer), []
    for t in tokens:
        released.append(stream.add([t]))
    released.append(stream.finish())
    assert "".join(released) == text
    assert all("\ufffd" not in piece for piece in released)  # never half a character


def test_text_stream_stops_at_the_token_that_completes_a_stop_string(tokenizer):
    text = "one two three four"
    tokens = ids(tokenizer, text)
    stream = TextStream(tokenizer, stop=["thr", "xyz"])
    released = [stream.add(tokens[i:i + 5]) for i in range(0, len(tokens), 5)]  # dispatches of 5 tokens
    assert "".join(released) == "one two "
    assert stream.stopped and stream.tokens_used == len(ids(tokenizer, "one two thr"))
    assert stream.add(ids(tokenizer, "more")) == "" and stream.finish() == ""
    # a tail that may begin a stop string is held back until it cannot
    stream = TextStream(tokenizer, stop=["abc"])
    assert stream.add(ids(tokenizer, "xab")) == "x"
    assert stream.add(ids(tokenizer, "d")) == "abd"
    assert stream.finish() == ""
    stream = TextStream(tokenizer, stop=["abc"])
    stream.add(ids(tokenizer, "xab"))
    assert stream.finish() == "ab"  # the sequence ended: nothing can complete it


@pytest.fixture(scope="module")
def app_client():
    """The app in process on the test-tiny preset (random weights, no tokenizer, no chat template)."""
    from starlette.testclient import TestClient

    from jaxkv.server import main as server_main
    from jaxkv.server.app import create_app

    args = server_main.parser().parse_args(["--preset", "test-tiny", "--slots", "2", "--max-len", "64"])
    server_main.check(args)
    state, engine = server_main.build(args)
    state.worker.start()
    with TestClient(create_app(state)) as client:
        yield client, state
    state.worker.close()


def test_model_without_a_tokenizer_answers_with_token_ids(app_client):
    client, state = app_client
    prompt = [5, 6, 7, 8, 9]
    expected = jaxkv.generate(state.model, [prompt], max_new_tokens=12).tokens[0]
    r = client.post("/v1/completions", json={"model": "test-tiny", "prompt": prompt, "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == expected
    with client.stream("POST", "/v1/completions", json={"model": "test-tiny", "prompt": prompt, "max_tokens": 12,
                                                        "temperature": 0, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    # /metrics is the engine thread's snapshot after its latest step: the answer may arrive just before it
    deadline = time.time() + 10
    while client.get("/metrics?format=json").json()["pages_held"] and time.time() < deadline:
        time.sleep(0.01)
    assert client.get("/metrics?format=json").json()["pages_held"] == 0


@pytest.mark.parametrize("body,path,words", [
    ({"prompt": "text"}, "/v1/completions", "no tokenizer"),
    ({"prompt": [1, 2], "stop": ["x"]}, "/v1/completions", "stop strings need"),
    ({"prompt": [1, 2], "echo": True}, "/v1/completions", "need a model with a tokenizer"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions", "no chat template"),
])
def test_what_needs_text_is_a_clear_400(app_client, body, path, words):
    client, _ = app_client
    r = client.post(path, json={"model": "test-tiny", **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def run_serve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jaxkv.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,words", [
    (["--slots", "0"], "--slots"),
    (["--port", "70000"], "--port"),
    (["--preset", "nope"], "unknown preset"),
    (["--model", "tiny", "--preset", "small"], "not allowed with"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_flags_are_one_line_errors(args, words):
    r = run_serve(*args, timeout=60)
    assert r.returncode == 2 and words in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_taken_port_and_missing_model_are_one_line_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = run_serve("--port", str(s.getsockname()[1]), timeout=60)
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
    r = run_serve("--port", "0", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr


def test_the_issue_flags_parse():
    from jaxkv.server.main import check, parser

    args = parser().parse_args(["--model", "tiny", "--host", "0.0.0.0", "--port", "8001", "--slots", "4",
                                "--max-len", "128", "--cache-dtype", "int8", "--page-size", "8", "--api-key", "K"])
    check(args)
    assert (args.model, args.host, args.port, args.slots, args.max_len, args.cache_dtype, args.page_size,
            args.api_key) == ("tiny", "0.0.0.0", 8001, 4, 128, "int8", 8, "K")


def test_sigint_lets_the_stream_finish_and_exits_0():
    import signal
    import threading
    import time

    import httpx

    from test_server import start_server

    proc, url = start_server(["--preset", "test-tiny", "--slots", "2", "--max-len", "512"])
    try:
        lines = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"model": "test-tiny", "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
                                    "ignore_eos": True, "temperature": 0}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.time() + 30
        while not httpx.get(url + "/metrics?format=json").json()["sequences_running"] and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        t.join(60)
        assert lines[-1] == "data: [DONE]"  # finished, not cut off
        tokens = [tok for line in lines[:-1] for tok in json.loads(line[6:])["choices"][0]["token_ids"]]
        assert len(tokens) == 400
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tensor_parallel_server_answers_as_generate():
    """--tensor-parallel-size 2 on two (forced host) devices: weights and pools (the prefix cache's too) split over
    "model"; greedy text equals `jaxkv.generate` on one device, a shared prompt hits the prefix cache. More devices
    than there are is one line, status 2."""
    import httpx

    from test_server import start_server

    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}", "JAX_PLATFORMS": "cpu"}
    proc, url = start_server(["--model", "tiny", "--slots", "1", "--max-len", "128", "--tensor-parallel-size", "2"],
                             env=env)
    try:
        assert "split over 2 devices" in proc.ready_line
        model = jaxkv.load("tiny")
        header = "Once upon a time, in a land far away, there lived"  # > one page of 16 tokens
        for prompt in (header + " a king", header + " a dragon"):  # the second reuses the first's cached pages
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == jaxkv.generate(model, [prompt], max_new_tokens=16).text[0]
        assert httpx.get(url + "/metrics?format=json").json()["prefix_hit_tokens"] >= 16
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    r = run_serve("--model", "tiny", "--tensor-parallel-size", "64", "--port", "0")
    assert r.returncode == 2 and "needs that many devices" in r.stderr and "Traceback" not in r.stderr
