"""Multi-host generation on one machine: 2 processes x 4 CPU devices, a coordinator on 127.0.0.1, one global
("data", "model") mesh over all 8 devices. Each process runs `tests/multiprocess_worker.py`; their tokens must
equal single-process generation of the same model."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import jaxkv
from multiprocess_worker import CONFIG, NEW_TOKENS, PROMPTS, SEED
from helpers.env import FAST_COMPILE

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(data: int, model: int, num_processes: int = 2) -> list[dict]:
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(num_processes), str(data),
                               str(model)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(num_processes)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    failed = [(rc, err[-3000:]) for rc, _, err in outputs if rc != 0]
    assert not failed, f"a worker process failed: {failed}"
    # Gloo prints its own connection lines to stdout, possibly after the worker's JSON line: take the JSON one.
    return [json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))) for _, out, _ in outputs]


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_two_processes_generate_what_one_process_does(shape):
    results = _run_processes(*shape)
    want = jaxkv.generate(jaxkv.Model.random(CONFIG, seed=SEED), PROMPTS, max_new_tokens=NEW_TOKENS,
                          stop_tokens=[]).tokens
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (2, 8, 4)
        assert r["tokens"] == want  # every process reads all the tokens
        assert r["kv_cache_bytes_per_device"] == r["kv_cache_bytes"] // 8
