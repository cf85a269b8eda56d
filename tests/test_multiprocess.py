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


SHAPES = [(2, 4), (1, 8)]  # data split across the two processes; the model axis split across them


def _run_processes(shapes, num_processes: int = 2) -> list[list[dict]]:
    """Per process, its JSON line for each shape (in order)."""
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(num_processes),
                               *(f"{d}x{m}" for d, m in shapes)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    # Gloo prints its own connection lines to stdout, possibly between the worker's JSON lines: take the JSON ones.
    return [[json.loads(ln) for ln in out.splitlines() if ln.startswith("{")] for _, out, _ in outputs]


@pytest.fixture(scope="module")
def runs() -> dict:
    """One pair of processes generates on every mesh shape in turn (the process starts and the distributed
    handshake, most of a run, are paid once): shape -> each process's result."""
    per_process = _run_processes(SHAPES)
    assert all([r["shape"] for r in lines] == [f"{d}x{m}" for d, m in SHAPES] for lines in per_process)
    return {shape: [lines[i] for lines in per_process] for i, shape in enumerate(SHAPES)}


@pytest.mark.parametrize("shape", SHAPES)
def test_two_processes_generate_what_one_process_does(shape, runs):
    results = runs[shape]
    want = jaxkv.generate(jaxkv.Model.random(CONFIG, seed=SEED), PROMPTS, max_new_tokens=NEW_TOKENS,
                          stop_tokens=[]).tokens
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (2, 8, 4)
        assert r["tokens"] == want  # every process reads all the tokens
        assert r["kv_cache_bytes_per_device"] == r["kv_cache_bytes"] // 8
