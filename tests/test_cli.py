"""The jaxkv command: streamed text, the figures line, --json, and one-line errors without tracebacks."""

import json
import subprocess
import sys

import pytest

import jaxkv
from jaxkv import cli
from conftest import CONFIGS
from test_checkpoint import byte_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model"
    config = CONFIGS["gqa"].replace(vocab_size=256)
    jaxkv.save(jaxkv.Model(config, jaxkv.Model.random(config, seed=5).params, byte_tokenizer()), path)
    return str(path)


def test_streams_text_then_prints_figures(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    expected = jaxkv.generate(jaxkv.load(model_dir), ["Hi"], max_new_tokens=6).text[0]
    text, figures = out.rstrip("\n").rsplit("\n", 1)
    assert text == "Hi" + expected
    assert "prompt tokens 2, new tokens 6" in figures and "decode" in figures and "KV cache" in figures


def test_json(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "4", "--json",
                     "--temperature", "0.9", "--top-k", "5", "--seed", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == len(result["tokens"]) == 4
    assert set(result) >= {"text", "prompt_tokens", "prefill_ms", "decode_tokens_per_s", "kv_cache_bytes"}


def test_cache_dtype(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "4", "--json",
                     "--cache-dtype", "int8"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = jaxkv.generate(jaxkv.load(model_dir), ["Hi"], max_new_tokens=4, cache_dtype="int8")
    assert result["cache_dtype"] == "int8" and result["tokens"] == expected.tokens[0]
    assert result["kv_cache_bytes"] == expected.stats["kv_cache_bytes"]


@pytest.mark.parametrize("args, match", [
    (["--cache-dtype", "int4"], "invalid choice"),
    (["--top-p", "2"], "top_p must be in"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--model", "/nonexistent/dir"], "no such directory"),
    (["--dtype", "float64"], "invalid choice"),
    (["--max-len", "3"], "exceeds max_len=3"),
])
def test_bad_arguments_give_one_line_and_status_2(model_dir, capsys, args, match):
    argv = ["generate", "--model", model_dir, "--prompt", "Hi", *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "Traceback" not in err


def test_console_script_in_a_subprocess(model_dir):
    """The real entry point, as a user runs it: a bad value exits 2 with one line and no traceback."""
    run = subprocess.run([sys.executable, "-m", "jaxkv.cli", "generate", "--model", model_dir, "--prompt", "Hi",
                          "--temperature", "-1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("jaxkv: error: temperature must be >= 0") and "Traceback" not in run.stderr
