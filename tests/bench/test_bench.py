"""The benchmark's weight conversion: transformers must run the very same model, or the side-by-side is void."""

import json

import numpy as np
import pytest

import jaxkv
from jaxkv.config import Config

torch = pytest.importorskip("torch")


@pytest.fixture
def settles(monkeypatch):
    """The benchmarks pause 0.5 s before each timed phase (`bench.settle`, for the timings' quality, which these
    tests do not judge): here the pauses are counted, not slept (12 s of this file's run)."""
    from jaxkv.bench import decode as bench

    calls = []
    monkeypatch.setattr(bench, "settle", lambda: calls.append(None))
    return calls


@pytest.fixture
def small_roofline(monkeypatch):
    """`jaxkv bench`'s roofline stage measures its triad bandwidth over 512 MiB arrays and its matmul rate at
    2048^3, several times (seconds of the machine, for figures these tests do not judge): here at 4 MiB and 256^3,
    the same code. The GEMV meter, which the rows' fractions of the roofline are taken against, is left as it is."""
    import functools

    from jaxkv import roofline

    monkeypatch.setattr(roofline, "triad_bandwidth", functools.partial(roofline.triad_bandwidth, 1 << 22))
    monkeypatch.setattr(roofline, "matmul_flops", functools.partial(roofline.matmul_flops, 256))


@pytest.fixture
def scoring_warm_ups(monkeypatch):
    """`jaxkv bench run-batch` builds its engines as `jaxkv run-batch` builds them, warm: that also compiles prompt
    scoring's programs (echo + logprobs, one per continuation bucket: 5 at max_len 256, ~20 s of this file's run),
    which the benchmark's completions never run. Here the warm-ups are counted, not compiled
    (tests/server/test_app.py runs `warm_up_scoring` and the programs it compiles)."""
    from jaxkv.server import worker

    calls = []
    monkeypatch.setattr(worker, "warm_up_scoring", lambda model, max_len: calls.append(max_len))
    return calls


def test_to_hf_llama_gives_the_same_logits():
    from jaxkv.bench.decode import to_hf_llama

    cfg = Config(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=80,
                 max_positions=64)
    model = jaxkv.Model.random(cfg, seed=3)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        hf = to_hf_llama(model)(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf, atol=1e-4, rtol=1e-4)


def test_profile_decode_accounts_for_the_step(tmp_path):
    """scripts/profile_decode.py: per-op times from the profiler trace, matched to the compiled HLO."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "profile_decode.py"
    spec = importlib.util.spec_from_file_location("profile_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "p.json"
    assert module.main(["--config", "test-tiny", "--steps", "8", "--live", "16", "--capacity", "32",
                        "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    # The ops found in the trace are the decode loop's: dots for every layer's projections and the head, and
    # their time is part of (not more than) the measured step.
    assert r["by_kind_ms"]["dot"] > 0
    assert r["ops_per_step"] >= 7 * 2 + 1  # 7 weight matrices per layer, 2 layers, the head
    assert 0 < r["ops_ms"] <= r["step_ms"]
    with pytest.raises(SystemExit):
        module.parse_args(["--live", "400", "--capacity", "384"])


def test_bench_runs_side_by_side_and_samples_the_roofline_beside_each_row(tmp_path, capsys, settles, small_roofline):
    import json

    from jaxkv.bench import decode as bench

    assert bench.main(["--configs", "test-tiny", "--dtypes", "float32", "--batches", "1,2", "--reps", "2",
                       "--new-tokens", "40", "--no-curves", "--out", str(tmp_path)]) == 0
    # Progress on stderr: the estimate up front, then one line per stage (roofline, two rows), then done.
    progress = capsys.readouterr().err.splitlines()
    assert progress[0].startswith("jaxkv bench: 3 stages, roughly ")
    assert [line.split()[1] for line in progress[1:4]] == ["1/3", "2/3", "3/3"]
    assert "test-tiny float32 batch 2" in progress[3] and progress[4].endswith("jaxkv bench: done")
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["batch"], r["dtype"]) for r in report["decode"]] == [(1, "float32"), (2, "float32")]
    for r in report["decode"]:
        # The fraction is against the bandwidth sampled beside the run, so it lies between the figures implied by
        # the slowest and fastest bandwidth samples.
        achieved = r["achieved_GBps"]
        low, high = r["roofline_GBps"]["min"], r["roofline_GBps"]["max"]
        assert 0 < low <= high
        tps = r["decode_tokens_per_s"]
        assert achieved / high * tps["min"] / tps["median"] * 0.999 <= r["fraction_of_roofline"]
        assert r["fraction_of_roofline"] <= achieved / low * tps["max"] / tps["median"] * 1.001
        # float32 on both sides: the same greedy tokens, and a measured ratio.
        assert r["greedy_first_32_equal"] and r["greedy_first_difference"] is None
        assert r["ratio_vs_hf"]["median"] > 0 and r["recompile_s_after_warmup"] == 0
    assert settles  # before the timed phases


def test_gemv_meter_reads_its_whole_matrix():
    from jaxkv import roofline

    meter = roofline.GemvMeter(nbytes=1 << 22)
    assert meter.nbytes == 1 << 22 and meter.w.shape == (256, 4096)
    assert 1e8 < meter.sample() < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s on anything this runs on


def test_progress_scales_the_time_left_by_how_the_finished_stages_went(monkeypatch):
    import io

    from jaxkv.bench import decode as bench

    clock = iter([0.0, 0.0, 20.0, 20.0, 50.0, 50.0])  # stage 1 takes 20 s where 10 were estimated: 2x slower
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    progress = bench.Progress("job", [("one", 10.0), ("two", 30.0)], stream=out)
    progress.next()
    progress.next()
    progress.finish()
    assert out.getvalue().splitlines() == [
        "job: 2 stages, roughly 40 s (an estimate from a 2-core CPU; a faster machine takes less)",
        "[0:00] 1/2 one (about 40 s left)",
        "[0:20] 2/2 two (about 1 min left)",  # 30 s estimated, x2
        "[0:50] job: done",
    ]


def test_default_run_estimate_is_about_the_measured_36_minutes():
    """The up-front estimate against the reference run (docs/bench/bench.json: 36 minutes on the dev machine)."""
    from jaxkv.bench import decode as bench

    args = bench.parse_args([])
    total = sum(seconds for _, seconds in bench.stages(args.configs.split(","), args))
    assert 25 * 60 < total < 50 * 60


def test_bench_help_answers_without_importing_jax():
    import subprocess
    import sys
    import time

    code = ("import sys\nfrom jaxkv.bench import decode as bench\ntry:\n    bench.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('jax imported:', 'jax' in sys.modules)")
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--replot" in run.stdout and run.stdout.endswith("jax imported: False\n")
    assert time.perf_counter() - t0 < 3.0  # about 0.3 s; importing JAX would add seconds


def test_replot_redraws_an_earlier_run_with_readable_powers_of_two_axes(tmp_path):
    import json
    import pathlib

    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from jaxkv.bench import decode as bench

    earlier = pathlib.Path(__file__).resolve().parents[2] / "docs" / "bench" / "bench.json"
    assert bench.main(["--replot", str(earlier), "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cached_vs_nocache.png", "step_vs_batch.png", "step_vs_cache_length.png"]
    # The cache-length axis: a label at each measured length, plain numbers, no minor-tick labels to collide.
    lives = json.loads(earlier.read_text())["curves"]["live_lengths"]
    ax = Figure().subplots()
    ax.plot(lives, lives)
    bench._powers_of_two_axis(ax, lives)
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(n) for n in lives]
    assert len(ax.xaxis.get_minorticklocs()) == 0
    assert bench.main(["--replot", str(tmp_path / "missing.json")]) == 2


def test_cache_accuracy_says_how_long_before_its_minutes_of_work():
    """scripts/cache_accuracy.py: a stage per cache dtype and step, and an estimate near the ~7 minutes measured."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "cache_accuracy.py"
    spec = importlib.util.spec_from_file_location("cache_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plan = module.stages(module.HELDOUT_WINDOWS, 8, 256)
    assert len(plan) == 1 + 5 + 6  # load; perplexity per cache dtype; the greedy reference, then each dtype
    assert 5 * 60 < sum(seconds for _, seconds in plan) < 12 * 60


def test_sharing_scenario_runs_and_reports_its_targets(tmp_path, settles):
    """`jaxkv bench sharing` end to end on the tiny preset: shared vs unshared vs transformers, prompt caching."""
    from jaxkv import cli

    out = tmp_path / "sharing.json"
    assert cli.main(["bench", "sharing", "--config", "test-tiny", "--prompt-len", "40", "--n", "3", "--new-tokens",
                     "4", "--reps", "1", "--calls", "3", "--suffix-len", "5", "--page-size", "8",
                     "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["distinct_samples"] == 3
    assert r["prefix_hit_tokens"] == [0, 40, 40]  # calls 2 and 3 reuse the 5 whole pages of the shared prompt
    assert r["shared_peak_bytes"] < r["unshared_needed_bytes"] <= r["unshared_allocated_bytes"]
    for key in ("speedup_vs_unshared", "speedup_vs_hf", "ttft_ratio", "peak_bytes_ratio"):
        assert r[key] > 0
    assert settles


def test_engine_scenario_counts_what_it_reports(tmp_path, capsys, settles):
    """`jaxkv bench engine` end to end on the tiny preset: every path produces every requested token, the
    padding counts follow from the requests, the ratios from the measured seconds, and the engine's greedy
    tokens equal static jaxkv's."""
    from jaxkv import cli
    from jaxkv.bench import engine as bench_engine

    out = tmp_path / "engine.json"
    argv = ["--config", "test-tiny", "--requests", "7", "--slots", "3", "--min-prompt", "5", "--max-prompt", "30",
            "--mean-new", "4", "--max-new", "12", "--seed", "1"]
    assert cli.main(["bench", "engine", *argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    requests = bench_engine.make_requests(256, bench_engine.parse_args(argv))
    new = [m for _, m in requests]
    assert r["requested_new_tokens"] == sum(new)
    batches = [new[:3], new[3:6], new[6:]]  # static batches of 3 in submission order, each running its largest
    static_rows = sum(padded * max(b) for padded, b in zip((4, 4, 1), batches))  # generate pads 3 rows to 4
    for name, p in r["paths"].items():
        assert p["generated_tokens"] == p["useful_rows"] == sum(new), name
        assert 0 <= p["decode_padding"] <= 1 and 0 <= p["prefill_padding"] <= 1, name
        assert p["slot_occupancy"] == pytest.approx(1 - p["decode_padding"])
        assert p["slot_occupancy"] == pytest.approx(p["useful_rows"] / p["computed_rows"])
        assert p["tokens_per_s"] == pytest.approx(sum(new) / p["median_s"])
        assert p["median_s"] == p["seconds"][0] > 0
    assert r["paths"]["static"]["computed_rows"] == static_rows
    assert r["paths"]["transformers"]["computed_rows"] == sum(len(b) * max(b) for b in batches)
    engine = r["paths"]["engine"]
    steps = engine["engine_stats"]["decode_steps"]  # each step computes the occupied width (1, 2 or 3 of 3 slots)
    assert engine["computed_rows"] == engine["engine_stats"]["decode_rows_computed"]
    assert steps <= engine["computed_rows"] < steps * 3 and engine["computed_rows"] >= engine["useful_rows"]
    assert engine["compiles_in_timed_runs"] == r["paths"]["static"]["compiles_in_timed_runs"] == 0  # warmed up
    med = r["median_s"]
    assert r["speedup_vs_static"] == pytest.approx(med["static"] / med["engine"])
    assert r["speedup_vs_hf"] == pytest.approx(med["transformers"] / med["engine"])
    assert r["engine_matches_static"] == 7
    assert "engine equals static jaxkv for 7 of 7 requests" in printed
    assert bench_engine.parse_args(["--quick", "--requests", "5"]).requests == 5  # explicit options win
    assert bench_engine.parse_args(["--quick"]).max_new == bench_engine.QUICK["max_new"]
    assert settles


def test_beam_scenario_reports_time_bytes_and_matches(tmp_path, capsys, settles):
    """`jaxkv bench beam --quick` end to end (the tiny preset): per K the measured seconds and their ratio, jaxkv's
    peak pages against K private caches, transformers' cache as measured, and equal best hypotheses."""
    import importlib

    from jaxkv.config import PRESETS
    from jaxkv.cache.planner import kv_bytes_per_token

    bench_beam = importlib.import_module("jaxkv.bench.beam")  # the module itself, whatever the package attribute

    out = tmp_path / "beam.json"
    # one K (--quick's 2, not 2 and 4): each K runs the same code, a compile of jaxkv's and a run of transformers'
    assert bench_beam.main(["--quick", "--beams", "2", "--batch", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    a = r["args"]
    assert (a["config"], a["prompt_len"], a["new_tokens"], a["batch"]) == ("test-tiny", 40, 8, 2)
    per_token = kv_bytes_per_token(PRESETS["test-tiny"])
    assert sorted(r["beams"]) == ["2"]
    for K, row in r["beams"].items():
        K = int(K)
        jx, hf = row["jaxkv"], row["transformers"]
        assert jx["compiles_in_timed_runs"] == 0 and jx["steps"] == 8 and row["generated_tokens"] == [8, 8]
        assert row["speedup_vs_hf"] == pytest.approx(hf["median_s"] / jx["median_s"])
        assert jx["median_s"] == jx["seconds"][0] > 0 and hf["forwards"] == 8  # the prefill + 7 steps
        assert jx["kv_cache_bytes_unshared"] == row["hf_cache_bytes_estimate"] == 2 * K * 48 * per_token
        assert jx["kv_bytes_in_use_peak"] < jx["kv_cache_bytes_unshared"]
        assert row["peak_bytes_ratio"] == pytest.approx(jx["kv_cache_bytes_unshared"] / jx["kv_bytes_in_use_peak"])
        assert hf["cache_bytes_measured"] in (None, 2 * K * 47 * per_token)  # the last token is never fed back
        assert row["tokens_equal"] == [True, True]  # float32 on both sides
    assert printed.count("best hypothesis equals transformers' for 2 of 2 prompt(s)") == 1
    assert bench_beam.main(["--beams", "4,x"]) == 2
    assert settles


def test_16_bit_rows_compare_with_transformers_float32(tmp_path, capsys, settles, small_roofline):
    """A bfloat16 row also runs transformers in float32 on the same (rounded) weights, and says how far its own
    bfloat16 run keeps to that, and whether ours keeps to its bfloat16 run as far (issue 16, target 3)."""
    import json

    from jaxkv.bench import decode as bench

    assert bench.main(["--configs", "test-tiny", "--dtypes", "bfloat16", "--batches", "1", "--reps", "1",
                       "--new-tokens", "40", "--no-curves", "--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "bench.json").read_text())["decode"]
    own, ours = r["hf_first_difference_from_float32"], r["greedy_first_difference"]
    assert own is None or 0 <= own < 32
    assert r["greedy_tokens_as_far_as_hf_float32"] == (ours is None or ours >= (32 if own is None else own))
    assert "hf32" in capsys.readouterr().out and settles


def test_bench_mla_quick(tmp_path, capsys):
    """`jaxkv bench mla`: twins of equal size (0.1%), the MLA cache 4x smaller as allocated and as planned."""
    import json

    from jaxkv import cli

    # --layers 2: the benchmark's models at a quarter of their 8 layers (every figure is per layer or a ratio)
    assert cli.main(["bench", "mla", "--quick", "--layers", "2", "--contexts", "16,24", "--steps", "2",
                     "--out", str(tmp_path / "mla.json")]) == 0
    result = json.loads((tmp_path / "mla.json").read_text())
    gqa, mla = result["configs"]["gqa"], result["configs"]["mla"]
    assert abs(mla["params"] - gqa["params"]) <= 1e-3 * gqa["params"]
    assert gqa["bytes_per_token"] == 2 * 2 * 4 * 64 * 4 and mla["bytes_per_token"] == 2 * (96 + 32) * 4
    for row in result["contexts"]:
        for name in ("gqa", "mla"):
            assert row[name]["cache_bytes_allocated"] == row[name]["cache_bytes_planned"]
        assert row["bytes_ratio"] == 4.0 and row["gqa"]["step_ms"] > 0 and row["mla"]["step_ms"] > 0
    # the verdict: the bytes target met at every context, the speed one as the longest context's figures say
    assert result["met"] == {"bytes_ratio": True,
                             "speed_ratio_at_longest": result["contexts"][-1]["speed_ratio"] >= 1.0}
    assert "bytes ratio" in capsys.readouterr().out


def test_bench_hybrid_quick(tmp_path, capsys):
    """`jaxkv bench hybrid`: twins of equal size (0.1%); the cache allocated as planned, the hybrid's K/V a quarter of
    the twin's per token plus a fixed state, so the twin's cache overtakes it as the context grows."""
    import json

    from jaxkv import cli

    # --layers 4: 3 linear-attention layers and 1 full (the 8-layer benchmark's 3 : 1), so every figure is per
    # layer or a ratio of the same kind
    assert cli.main(["bench", "hybrid", "--quick", "--layers", "4", "--contexts", "16,128", "--steps", "2",
                     "--out", str(tmp_path / "hybrid.json")]) == 0
    result = json.loads((tmp_path / "hybrid.json").read_text())
    hybrid, twin = result["configs"]["hybrid"], result["configs"]["twin"]
    assert abs(hybrid["params"] - twin["params"]) <= 1e-3 * twin["params"]
    assert 4 * hybrid["kv_bytes_per_token"] == twin["kv_bytes_per_token"] == 4 * 2 * 4 * 64 * 4
    assert hybrid["state_bytes_per_sequence"] == 3 * (1024 * 3 * 4 + 8 * 64 * 64 * 4) and not twin[
        "state_bytes_per_sequence"]
    short, long = result["rows"]
    for row in (short, long):
        for name in ("hybrid", "twin"):
            assert row[name]["cache_bytes_allocated"] == row[name]["cache_bytes_planned"]
            assert row[name]["step_ms"] > 0
    assert short["bytes_ratio"] < 1 < long["bytes_ratio"]  # the state costs more than 18 tokens of K/V, less than 130
    # The prefix part (--quick: 256 shared + 16 own tokens, snapshots every 128): the hybrid resumes at the head's
    # last snapshot boundary, without snapshots it prefills everything, the twin reuses the head's 16 whole pages.
    prefix = result["prefix"]
    assert prefix["hit_tokens"] == {"hybrid_snapshots": 256, "hybrid_no_snapshots": 0, "twin_pages": 256}
    assert prefix["snapshot_bytes"] == hybrid["state_bytes_per_sequence"] and prefix["snapshots_kept"] >= 2
    assert all(ms > 0 for ms in prefix["ttft_ms"].values())
    (verify,) = result["verify"]  # --quick: k = 2 at batch 1
    assert verify["k"] == 2 and verify["step_state_bytes"] == 3 * hybrid["state_bytes_per_sequence"]
    assert all(ms > 0 for ms in verify["ms"].values())
    out = capsys.readouterr().out
    assert "bytes ratio" in out and "time to first token" in out and "keeping the state after each" in out


def test_bench_sparse_quick(tmp_path, capsys):
    """`jaxkv bench sparse`: the indexer's keys are allocated as planned beside the latent rows (a quarter more per
    token), the dense twin is the same model without the indexer, the sparse attention alone reads its top-k rows
    whatever the context; the gpt-oss-shaped rings hold what the planner says, less than every layer full."""
    import json

    from jaxkv import cli
    from jaxkv.bench.sparse import sparse_twins

    # --layers 2: a quarter of the benchmark's 8 layers (one sliding and one full in the gpt-oss part)
    assert cli.main(["bench", "sparse", "--quick", "--layers", "2", "--contexts", "160,600", "--window-context",
                     "600", "--steps", "2", "--topk", "64", "--out", str(tmp_path / "sparse.json")]) == 0
    result = json.loads((tmp_path / "sparse.json").read_text())
    sparse, dense = sparse_twins(64, layers=2)
    configs = result["sparse"]["configs"]
    assert configs["sparse"]["kv_bytes_per_token"] == 2 * (128 + 32) * 4 and configs["dense"][
        "kv_bytes_per_token"] == 2 * 128 * 4
    assert configs["sparse"]["params"] - configs["dense"]["params"] == sparse.param_count() - dense.param_count() > 0
    for row in result["sparse"]["rows"]:
        for name in ("sparse", "dense"):
            assert row[name]["cache_bytes_allocated"] == row[name]["cache_bytes_planned"] and row[name]["step_ms"] > 0
        assert row["attention_ms"]["sparse"] > 0 and row["attention_ms"]["dense"] > 0
    w = result["windows"]
    slot = 2 * 4 * 64 * 4  # K and V, 4 KV heads of 64, float32
    assert w["windows"]["cache_bytes_allocated"] == w["windows"]["cache_bytes_planned"] == (
        602 + 128) * slot
    assert w["full"]["cache_bytes_allocated"] == 2 * 602 * slot
    out = capsys.readouterr().out
    assert "dense/sparse" in out and "full / windows" in out


def test_bench_layers_quick(tmp_path, capsys):
    """`jaxkv bench layers`: past the window the rings allocate what the planner says, less than full length."""
    import json

    from jaxkv import cli

    # --layers 6: half the benchmark's 12 layers, in its proportions (5 local : 1 global)
    assert cli.main(["bench", "layers", "--quick", "--layers", "6", "--contexts", "600", "--steps", "2", "--reps",
                     "1", "--out", str(tmp_path / "layers.json")]) == 0
    result = json.loads((tmp_path / "layers.json").read_text())
    (row,) = result["contexts"]
    for name in ("rings", "full"):
        assert row[name]["cache_bytes_allocated"] == row[name]["cache_bytes_planned"] and row[name]["step_ms"] > 0
    slot = 2 * 4 * 64 * 4  # K and V, 4 KV heads of 64, float32
    assert row["rings"]["cache_bytes_allocated"] == (602 + 5 * 512) * slot
    assert row["full"]["cache_bytes_allocated"] == 6 * 602 * slot
    # the verdict: met or not as the longest context's figures say
    assert result["met"] == {"bytes_ratio_at_longest": row["bytes_ratio"] >= 3.5,
                             "speed_ratio_at_longest": row["speed_ratio"] >= 1.0}
    out = capsys.readouterr().out
    assert "bytes ratio" in out and "6 layers (5 local with a window of 512, 1 global)" in out


def test_bench_speculative_quick(tmp_path, capsys):
    """`jaxkv bench speculative --quick`: the test proposer's acceptance follows its rate (all kept at 1, none at
    0), every run's tokens equal plain decoding's, and the speed-ups and the analytic limits are figures."""
    import json

    from jaxkv import cli
    from jaxkv.bench import speculative

    # --quick's sizes (checked here), but the engine part at 1 request at once, not 2: one decode width (1) for the
    # plain, speculative and verifying engines to compile, not two (the rows' figures are the same at any width)
    quick = vars(speculative.parse_args(["--quick"]))
    assert {name: quick[name] for name in speculative.QUICK} == {**speculative.QUICK, "concurrency": [2]}
    sizes = [f"--{name.replace('_', '-')}={value}" for name, value in speculative.QUICK.items()]
    assert cli.main(["bench", "speculative", *sizes, "--concurrency", "1", "--rates", "0,1",
                     "--out", str(tmp_path / "s.json")]) == 0
    r = json.loads((tmp_path / "s.json").read_text())
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["a=1"]["acceptance"] > 0.9 and rows["a=0"]["acceptance"] == 0.0
    assert rows["a=1"]["tokens_per_forward"] > 4 and rows["a=0"]["tokens_per_forward"] == 1.0
    assert all(row["same_tokens"] for row in rows.values()) and r["ngram"]["same_tokens"]
    assert r["verify_cost"] > 0 and all(row["speedup"] > 0 and row["analytic"] > 0 for row in rows.values())
    assert r["bundled"]["same_tokens"] and 0 <= r["bundled"]["acceptance"] <= 1
    assert [e["concurrency"] for e in r["engine"]] == [1]
    assert all(e["same_tokens"] and e["speedup"] > 0 for e in r["engine"])
    assert "measured/analytic" in capsys.readouterr().out


def test_bench_run_batch_quick(tmp_path, capsys, scoring_warm_ups):
    """`jaxkv bench run-batch`: both paths generate every token asked for (ignore_eos: the same count), the ratio
    is theirs."""
    from jaxkv import cli
    from jaxkv.bench.batch import make_requests

    assert cli.main(["bench", "run-batch", "--requests", "3", "--slots", "1", "--reps", "1",
                     "--out", str(tmp_path / "rb.json")]) == 0
    result = json.loads((tmp_path / "rb.json").read_text())
    asked = sum(r["max_tokens"] for r in make_requests(257, 3, 0))
    assert result["runs"]["engine"][0]["new_tokens"] == result["runs"]["run-batch"][0]["new_tokens"] == asked
    rates = result["tokens_per_s"]
    assert result["ratio"] == pytest.approx(rates["run-batch"] / rates["engine"])
    assert "of the engine's" in capsys.readouterr().out
    assert scoring_warm_ups == [256, 256]  # both engines built warm, as `jaxkv run-batch --max-len 256` builds one


def test_bench_host_cache_quick(tmp_path, capsys):
    """`jaxkv bench host-cache`: the host hit finds the prefix's whole pages cached (copied back), the recompute
    none (the bench checks both), and the ratio is the medians'."""
    from jaxkv import cli

    assert cli.main(["bench", "host-cache", "--config", "test-tiny", "--prefix-len", "64", "--suffix-len", "4", "--reps",
                     "1", "--out", str(tmp_path / "hc.json")]) == 0
    result = json.loads((tmp_path / "hc.json").read_text())
    assert result["host_stats"]["restored_pages"] >= 2 * 3  # 3 whole pages of the 64-token prefix (of 16), x2 reps
    t = result["ttft_s"]
    assert result["ratio"] == pytest.approx(t["recompute"] / t["host hit"])
    assert "host hit" in capsys.readouterr().out


def test_bench_data_parallel_quick(tmp_path, capsys):
    """`jaxkv bench data-parallel`: every mesh gives the first mesh's tokens; a row per mesh."""
    from jaxkv import cli

    # 2 requests: one per data shard of the 2x1 mesh (1 slot each)
    assert cli.main(["bench", "data-parallel", "--requests", "2", "--slots", "1", "--meshes", "1x1,2x1",
                     "--reps", "1", "--out", str(tmp_path / "dp.json")]) == 0
    result = json.loads((tmp_path / "dp.json").read_text())
    assert [r["mesh"] for r in result["rows"]] == ["1x1", "2x1"]
    assert all(r["same_tokens_as_first_mesh"] and r["tokens_per_s"] > 0 for r in result["rows"])
    assert "new tokens/s" in capsys.readouterr().out
