"""The persistent compilation cache (`jaxkv.compile_cache`): a second process reads what the first compiled and
decodes the same tokens; JAXKV_COMPILE_CACHE=0 and `jaxkv generate --no-compile-cache` opt out. Each case runs
in fresh processes (the test suite itself runs with the cache off: tests/conftest.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxkv import compile_cache

CHILD = """
import json, jax
hits = []
jax.monitoring.register_event_listener(lambda e, **k: hits.append(e) if e.endswith("cache_hits") else None)
import jaxkv
g = jaxkv.generate(jaxkv.load("tiny"), [[5, 9, 2, 77]], max_new_tokens=6)
print(json.dumps({"hits": len(hits), "tokens": g.tokens, "dir": jax.config.jax_compilation_cache_dir}))
"""


def child(env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV} | env
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_process_reads_the_first_ones_programs(tmp_path):
    cache = tmp_path / "xla"
    first = child({compile_cache.ENV: str(cache)})
    assert first["hits"] == 0 and first["dir"] == str(cache)
    written = sorted(p.name for p in cache.iterdir())
    assert any("decode_loop" in name for name in written), written
    second = child({compile_cache.ENV: str(cache)})
    assert second["hits"] >= 2  # prefill and the decode loop
    assert second["tokens"] == first["tokens"]


def cli(env: dict, *flags: str) -> dict:
    """`jaxkv generate --json` in a fresh process under `env` (JAXKV_COMPILE_CACHE from the test's own environment
    dropped) -> its JSON line."""
    env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV} | env
    command = [sys.executable, "-m", "jaxkv.cli", "generate", "--prompt-ids", "5,9,2", "--max-new-tokens", "2",
               "--json", *flags]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_default_directory_and_opt_out(tmp_path):
    """Through the CLI, which turns the cache on the way the library does (importing jaxkv.model runs
    `compile_cache.setup`), so one process checks both: the default directory fills, the opt-out leaves none."""
    default = cli({"XDG_CACHE_HOME": str(tmp_path)})
    assert any((tmp_path / "jaxkv" / "xla").iterdir())
    off = cli({"XDG_CACHE_HOME": str(tmp_path / "other"), compile_cache.ENV: "0"})
    assert not (tmp_path / "other").exists()
    assert off["tokens"] == default["tokens"]


@pytest.mark.parametrize("value, expected", [("0", None), ("off", None), ("", None), ("/x/y", pathlib.Path("/x/y"))])
def test_directory_from_the_environment(value, expected, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, value)
    assert compile_cache.directory() == expected


def test_cli_no_compile_cache(tmp_path):
    """The flag alone keeps the cache off: without it the same environment fills $XDG_CACHE_HOME/jaxkv/xla
    (test_default_directory_and_opt_out's first process)."""
    got = cli({"XDG_CACHE_HOME": str(tmp_path)}, "--no-compile-cache")
    assert not (tmp_path / "jaxkv").exists() and len(got["tokens"]) == 2
