"""The jaxkv command: streamed text, the figures line, --json, and one-line errors without tracebacks."""

import json
import os
import subprocess
import sys
import time

import pytest

import jaxkv
from jaxkv import cli
from helpers.models import CONFIGS
from helpers.text import byte_tokenizer


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
    # The wait before the first token is accounted for: JAX's import, the checkpoint's load, compilation.
    for part in ("first token", "import", "load", "compile", "prefill"):
        assert part in figures


def test_json(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "4", "--json",
                     "--temperature", "0.9", "--top-k", "5", "--seed", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == len(result["tokens"]) == 4
    assert set(result) >= {"text", "prompt_tokens", "prefill_ms", "decode_tokens_per_s", "kv_cache_bytes",
                           "import_s", "load_s", "compile_s"}
    assert result["compile_s"] >= 0 and result["load_s"] > 0


def test_speculative_prints_its_figures_and_the_same_text(model_dir, capsys):
    args = ["generate", "--model", model_dir, "--prompt", "Hi Hi Hi Hi", "--max-new-tokens", "12"]
    assert cli.main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--json", "--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and "spec_proposed" not in plain
    assert spec["spec_proposed"] >= 0 and spec["target_forwards"] <= 11 and "tokens_per_target_forward" in spec
    assert cli.main(args + ["--speculative-method", "ngram"]) == 0
    assert "speculative:" in capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1]
    assert cli.main(args + ["--json", "--speculative-method", "draft", "--draft-model", model_dir]) == 0
    drafted = json.loads(capsys.readouterr().out)  # the model drafting for itself: every proposal kept
    assert drafted["tokens"] == plain["tokens"] and drafted["spec_acceptance_rate"] > 0.9
    assert cli.main(args + ["--speculative-method", "mtp"]) == 2
    assert "multi-token-prediction layers" in capsys.readouterr().err  # the tiny model has none
    assert cli.main(args + ["--speculative-method", "draft"]) == 2
    assert "--draft-model" in capsys.readouterr().err


def test_logprobs(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "3", "--json",
                     "--logprobs", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    want = jaxkv.generate(jaxkv.load(model_dir), ["Hi"], max_new_tokens=3, logprobs=2)
    assert result["logprobs"] == want.logprobs[0] and len(result["top_logprobs"]) == 3
    assert [[tuple(alt) for alt in step] for step in result["top_logprobs"]] == want.top_logprobs[0]


def test_penalties(model_dir, capsys):
    args = ["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "8", "--json"]
    assert cli.main(args) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    assert cli.main(args + ["--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "1",
                            "--logit-bias", f"{plain[0]}:-50,7:1.5", "--min-tokens", "2"]) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    want = jaxkv.generate(jaxkv.load(model_dir), ["Hi"], max_new_tokens=8, repetition_penalty=1.5,
                          presence_penalty=0.5, frequency_penalty=1.0, logit_bias={plain[0]: -50.0, 7: 1.5},
                          min_tokens=2).tokens[0]
    assert got == want != plain


def test_n_samples(model_dir, capsys):
    args = ["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "5", "--n", "3",
            "--temperature", "0.9", "--seed", "2"]
    assert cli.main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    want = jaxkv.generate(jaxkv.load(model_dir), ["Hi"], max_new_tokens=5, n=3, temperature=0.9, seed=2)
    assert [s["tokens"] for s in result["samples"]] == want.tokens
    assert result["prompt_tokens"] == 2 and result["kv_cache_bytes_unshared"] > 0
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for j, text in enumerate(want.text):
        assert f"--- sample {j + 1} of 3 (length) ---\nHi{text}\n" in out
    assert "shared by 3 samples" in out.rstrip().rsplit("\n", 1)[1]


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
    (["--logprobs", "21"], "logprobs must be <= 20"),
])
def test_bad_arguments_give_one_line_and_status_2(model_dir, capsys, args, match):
    argv = ["generate", "--model", model_dir, "--prompt", "Hi", *args]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert match in err and err.count("\n") == 1 and "Traceback" not in err
    assert out == ""  # not even the prompt: it is echoed once generation has started


LONG_PROMPT = "The KV cache " * 1600  # 20,800 characters


@pytest.mark.parametrize("args, match", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,-2"], "a prompt id must be >= 0"),
    (["--prompt", LONG_PROMPT, "--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
    # greedy by flag (without --generation-config ignore a sampling checkpoint may take a filter alone)
    (["--prompt", "Hi", "--top-k", "5", "--generation-config", "ignore"], "top_k has no effect with temperature 0"),
    (["--prompt", "Hi", "--top-k", "5", "--temperature", "0"], "top_k has no effect with temperature 0"),
    (["--prompt", "Hi", "--temperature", "nan"], "temperature must be finite"),
    (["--prompt", "Hi", "--seed", str(2**64)], "seed must be <="),
    (["--prompt", "Hi", "--max-len", "0"], "max_len must be >= 1"),
    (["--prompt", "Hi", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--prompt", "Hi", "--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
    (["--prompt", "Hi", "--logit-bias", "5"], "--logit-bias takes ID:BIAS pairs"),
    (["--prompt", "Hi", "--min-tokens", "100"], "min_tokens must be <= 64"),
    (["--prompt", "Hi", "--model", "/nonexistent/dir"], "/nonexistent/dir: no such directory"),
])
def test_flags_are_checked_before_the_model_is_loaded(no_load, capsys, args, match):
    """Every flag is checked before JAX is imported or a checkpoint read: the load is never reached."""
    err = usage_error(capsys, ["generate", *args], match)
    assert len(err) < 200  # the 20,000-character prompt is not echoed


@pytest.fixture
def no_load(monkeypatch):
    """jaxkv.checkpoint.load fails the test: flags must be refused before it."""
    import jaxkv.checkpoint

    def load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(jaxkv.checkpoint, "load", load)


def usage_error(capsys, argv, match) -> str:
    """Runs `jaxkv ARGV`, which must exit 2 with one line on stderr (saying `match`), nothing on stdout."""
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("jaxkv: error: ") and match in err
    assert "Traceback" not in err
    return err


# `jaxkv ARGV` in a fresh interpreter, then one more stdout line saying whether JAX got imported.
CLI_THEN_REPORT = """
import sys
from jaxkv import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as e:  # --help and --version exit from argparse
    code = e.code
sys.stdout.flush()
print("jax imported:", "jax" in sys.modules)
sys.exit(code)
"""


def run_cli_fresh(*argv):
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", CLI_THEN_REPORT, *argv], capture_output=True, text=True,
                         timeout=120)
    return run, time.perf_counter() - t0


# The budget for `--help` or a bad flag in a fresh interpreter. Measured about 0.25 s on the 2-core dev machine
# (Python, NumPy, ml_dtypes; importing JAX, Flax and Pallas would add 1-8 s); generous, so a loaded machine does
# not fail it, while JAX's import alone would still go near it.
FAST_S = 3.0


COMMANDS = ("generate", "memory", "serve", "run-batch", "bench")


def test_help_is_fast_lists_every_command_and_imports_no_jax():
    """Issue 50, item 10: serve and run-batch (dispatched before the parser) are listed too, each command with a
    one-line summary, and listing them imports neither JAX nor the server."""
    run, seconds = run_cli_fresh("--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.endswith("jax imported: False\n")
    lines = run.stdout.splitlines()
    for command in COMMANDS:
        line = next((line for line in lines if line.startswith(f"    {command} ")), None)
        assert line is not None and len(line.split()) > 2, (command, run.stdout)  # the name, then its summary
    assert seconds < FAST_S


def test_a_mistyped_command_names_every_command(capsys):
    err = usage_error(capsys, ["serv"], "invalid choice: 'serv'")
    assert all(f"'{command}'" in err for command in COMMANDS) and "(see jaxkv --help)" in err


def test_bench_help_lists_every_benchmark(capsys):
    """Issue 50, item 10: `jaxkv bench --help` names every benchmark in jaxkv/bench/ with a line saying what it
    measures, then the decode benchmark's own options (the one without a name)."""
    import importlib.util
    import pathlib

    from jaxkv.bench import __path__ as bench_path
    from jaxkv.cli.bench import BENCH_SCENARIOS

    with pytest.raises(SystemExit) as exit_:  # argparse's --help, of the decode benchmark
        cli.main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    modules = {f"jaxkv.bench.{p.stem}" for p in pathlib.Path(bench_path[0]).glob("*.py")} - {
        "jaxkv.bench.__init__", "jaxkv.bench.decode"}
    assert {module for module, _ in BENCH_SCENARIOS.values()} == modules  # a new benchmark is listed
    lines = out.splitlines()
    for name, (module, _) in BENCH_SCENARIOS.items():
        assert importlib.util.find_spec(module) is not None
        line = next((line for line in lines if line.startswith(f"  {name} ")), None)
        assert line is not None and len(line.split()) > 3, (name, out)
    assert "--configs" in out  # the decode benchmark's options follow


def test_bad_flag_fails_fast_with_one_line_before_jax_and_before_any_output():
    run, seconds = run_cli_fresh("generate", "--prompt", LONG_PROMPT, "--top-p", "2.0", "--temperature", "0.7")
    assert run.returncode == 2
    assert run.stdout == "jax imported: False\n"  # nothing printed before the error
    assert run.stderr == "jaxkv: error: top_p must be in (0, 1], got 2.0\n"
    assert seconds < FAST_S


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"jaxkv {metadata.version('jaxkv')}\n"


def test_console_script_in_a_subprocess(model_dir):
    """The real entry point, as a user runs it: a bad value exits 2 with one line and no traceback."""
    run = subprocess.run([sys.executable, "-m", "jaxkv.cli", "generate", "--model", model_dir, "--prompt", "Hi",
                          "--temperature", "-1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("jaxkv: error: temperature must be >= 0") and "Traceback" not in run.stderr


# --- beam search: jaxkv generate --num-beams K ---------------------------------------------------------------------


def test_beam_search_prints_the_best_hypothesis(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "5",
                     "--num-beams", "2"]) == 0
    out = capsys.readouterr().out
    want = jaxkv.beam_search(jaxkv.load(model_dir), ["Hi"], num_beams=2, max_new_tokens=5)
    text, figures = out.rstrip("\n").rsplit("\n", 1)
    assert text == "Hi" + want.text[0][0]
    assert "the best of 2 beams" in figures and f"new tokens {len(want.tokens[0][0])}" in figures
    for part in ("import", "load", "compile", "prefill", "search", "KV cache"):
        assert part in figures


def test_beam_search_json_has_every_hypothesis_best_first(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "4", "--json",
                     "--num-beams", "3", "--num-return-sequences", "3", "--length-penalty", "0.5",
                     "--early-stopping", "never"]) == 0
    result = json.loads(capsys.readouterr().out)
    want = jaxkv.beam_search(jaxkv.load(model_dir), ["Hi"], num_beams=3, max_new_tokens=4, length_penalty=0.5,
                             early_stopping="never", num_return_sequences=3)[0]
    assert result["prompt"] == "Hi"
    assert [set(h) for h in result["hypotheses"]] == [{"tokens", "text", "score", "logprob", "finish_reason"}] * 3
    assert [h["tokens"] for h in result["hypotheses"]] == [h.tokens for h in want]
    assert [h["score"] for h in result["hypotheses"]] == [h.score for h in want]
    assert [h["score"] for h in result["hypotheses"]] == sorted((h.score for h in want), reverse=True)
    assert result["text"] == want[0].text and result["stats"]["num_beams"] == 3
    assert result["stats"]["pages_in_use_end"] == 0 and result["load_s"] > 0


@pytest.mark.parametrize("args, match", [
    (["--num-beams", "0"], "num_beams must be >= 1"),
    (["--num-beams", "two"], "invalid int value"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "--num-return-sequences 3 exceeds --num-beams 2"),
    (["--num-beams", "2", "--num-return-sequences", "0"], "num_return_sequences must be >= 1"),
    (["--num-beams", "2", "--length-penalty", "inf"], "length_penalty must be finite"),
    (["--num-beams", "2", "--early-stopping", "sometimes"], "invalid choice"),
    (["--length-penalty", "2"], "--length-penalty is only used with --num-beams > 1"),
    (["--num-beams", "1", "--early-stopping", "true"], "--early-stopping is only used with --num-beams > 1"),
    (["--num-return-sequences", "1"], "--num-return-sequences is only used with --num-beams > 1"),
    (["--num-beams", "2", "--temperature", "0.7"], "--temperature samples; beam search"),
    (["--num-beams", "2", "--top-k", "5"], "--top-k samples; beam search"),
    (["--num-beams", "2", "--top-p", "0.9"], "--top-p samples; beam search"),
    (["--num-beams", "2", "--min-p", "0.1"], "--min-p samples; beam search"),
    (["--num-beams", "2", "--n", "2"], "--n is for sampling"),
    (["--num-beams", "2", "--logprobs", "1"], "--logprobs is for sampling"),
    (["--num-beams", "2", "--repetition-penalty", "1.2"], "--repetition-penalty is for sampling and greedy"),
])
def test_beam_flags_are_checked_before_the_model_is_loaded(no_load, capsys, args, match):
    usage_error(capsys, ["generate", "--prompt", "Hi", *args], match)


def test_bad_beam_flag_fails_fast_before_jax():
    run, seconds = run_cli_fresh("generate", "--prompt", "Hi", "--num-beams", "2", "--top-k", "5")
    assert run.returncode == 2 and run.stdout == "jax imported: False\n"
    assert run.stderr.startswith("jaxkv: error: --top-k samples") and run.stderr.count("\n") == 1
    assert seconds < FAST_S


def test_bench_beam_is_handed_to_jaxkv_bench_beam(monkeypatch):
    """`jaxkv bench beam ARGS` calls jaxkv.bench.beam.main(ARGS), imported only then."""
    import importlib.machinery
    import types

    seen = []
    fake = types.ModuleType("jaxkv.bench.beam")
    fake.__spec__ = importlib.machinery.ModuleSpec("jaxkv.bench.beam", None)  # find_spec reads it
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "jaxkv.bench.beam", fake)
    # The package's own dict, not setattr: its undo must put back exactly what was there (nothing, or the real
    # module), never leave the fake as jaxkv.bench.beam for every later test in the process.
    import jaxkv.bench

    monkeypatch.setitem(vars(jaxkv.bench), "beam", fake)
    assert cli.main(["bench", "beam", "--quick"]) == 0
    assert seen == [["--quick"]]


# --- jaxkv memory: the README's line, and lengths generate would refuse (issue 50, item 10) ----------------------


def test_memory_without_a_model_plans_for_the_bundled_one(capsys):
    """The README's `jaxkv memory --tokens 1024 --n 16 --new-tokens 128` runs as written: with no model named,
    the bundled "tiny" one, as `jaxkv generate` takes."""
    readme = ["memory", "--tokens", "1024", "--n", "16", "--new-tokens", "128"]
    assert cli.main(readme) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny: ") and "with sharing" in out
    assert cli.main([*readme, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert cli.main([*readme, "--json", "--model", "tiny"]) == 0
    assert default == json.loads(capsys.readouterr().out) and default["model"] == "tiny"


def test_memory_refuses_lengths_past_the_models_positions(capsys, tmp_path):
    """What `jaxkv.generate` refuses (a sequence past the model's max positions) is an error naming both
    numbers, not an allocation printed without a word; at the limit it plans as before, and a model described by
    hand (no max positions) has no bound."""
    err = usage_error(capsys, ["memory", "--model", "tiny", "--tokens", "4096"], "--tokens 4,096")
    assert "max positions (2,048)" in err
    with pytest.raises(ValueError, match="max positions"):  # the refusal it stands for
        jaxkv.plan_cache(jaxkv.load("tiny").config, [1], 1, max_len=4096)
    err = usage_error(capsys, ["memory", "--tokens", "2000", "--n", "2", "--new-tokens", "49"], "2,049 positions")
    assert "max positions (2,048)" in err
    assert cli.main(["memory", "--tokens", "2000", "--n", "2", "--new-tokens", "48", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 2000
    config = tmp_path / "config.json"  # a Hugging Face config of 512 positions
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                                  "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}))
    usage_error(capsys, ["memory", "--config", str(config), "--tokens", "513"], "max positions (512)")
    assert cli.main(["memory", "--config", str(config), "--tokens", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["allocated_bytes"] > 0
    assert cli.main(["memory", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--tokens", "1000000"]) == 0
    capsys.readouterr()


# --- the streaming generate and the persistent compile cache (issue 50, item 11) -------------------------------


def test_streamed_text_is_the_json_text(model_dir, capsys):
    """The streaming path (the loop driven from the host, `jaxkv.decoding.loop.streamed_loop`) prints the tokens
    --json returns (the compiled loop in one call), sampled with a seed and penalties."""
    args = ["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "40", "--temperature", "1.0",
            "--top-k", "50", "--seed", "11", "--repetition-penalty", "1.2", "--generation-config", "ignore"]
    assert cli.main(args) == 0
    streamed = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0]
    assert cli.main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert streamed == "Hi" + result["text"] and result["new_tokens"] == 40


# `jaxkv ARGV` in a fresh interpreter that records JAX's persistent-cache log (which programs it read, compiled,
# or would not write) into the file named by $CACHE_LOG. Every program is written (no minimum compile time), so a
# second run that compiles nothing again misses nothing.
CLI_LOGGING_CACHE = """
import json, logging, os, sys
messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logger = logging.getLogger("jax._src.compiler")
logger.setLevel(logging.DEBUG)
logger.addHandler(handler)
from jaxkv import cli, compile_cache
compile_cache.MIN_COMPILE_SECONDS = 0.0
code = cli.main(sys.argv[1:])
with open(os.environ["CACHE_LOG"], "w") as f:
    json.dump([m for m in messages if "persistent" in m.lower()], f)
sys.exit(code)
"""


def test_streaming_generate_reads_its_decode_loop_from_the_compile_cache(model_dir, tmp_path):
    """Issue 50, item 11: the quickstart (streaming) stores its decode loop in the persistent compilation cache
    on the first run and reads it back on the second, printing the same text. It never did: the loop streamed
    through an io_callback, and JAX writes no program with a host callback to the cache."""
    from jaxkv.decoding import loop

    cache, log = tmp_path / "xla", tmp_path / "log.json"
    env = {**os.environ, "JAXKV_COMPILE_CACHE": str(cache), "CACHE_LOG": str(log)}
    argv = [sys.executable, "-c", CLI_LOGGING_CACHE, "generate", "--model", model_dir, "--prompt", "Hi",
            "--max-new-tokens", "12", "--temperature", "1.0", "--seed", "3"]
    runs = []
    for _ in range(2):
        run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        runs.append((run.stdout.rstrip("\n").rsplit("\n", 1)[0], json.loads(log.read_text()),
                     sorted(p.name for p in cache.iterdir())))
    (text, first_log, first_entries), (again, second_log, second_entries) = runs
    assert not [m for m in first_log if "host callbacks" in m], first_log
    loop_programs = [f"jit_{f.__name__}" for f in (loop._first_step, loop._next_steps)]
    for name in loop_programs:
        assert any(entry.startswith(name + "-") for entry in first_entries), (name, first_entries)
    assert not [m for m in second_log if "MISS" in m], second_log  # nothing compiled again
    assert all(any(name in m for m in second_log if "hit" in m) for name in loop_programs), second_log
    assert second_entries == first_entries and again == text
