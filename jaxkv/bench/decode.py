"""Decode benchmarks: jaxkv against the memory-bandwidth roofline and against transformers, side by side.

    python scripts/bench.py [options]      (or: jaxkv bench [options])

Everything is measured in one process and one run: the machine's read bandwidth and matmul rate first, then for
each config, dtype and batch the compile time, prefill time and decode rate of jaxkv, alternating with transformers
and with a fresh read-bandwidth sample (A B C A B C ...) on the same weights, since these machines are noisy: each
fraction of the roofline is against the bandwidth measured beside it. Figures are medians with min-max over `--reps`.
Then the cost curves: cached versus no-cache recompute per token against position, and a decode step's cost
against live cache length and against batch. Writes a JSON file and PNG plots (matplotlib, optional).

Note: running torch and JAX in one process cost JAX about 5% in earlier measurements on these machines, so the
jaxkv / transformers ratios understate jaxkv slightly.

The default run takes roughly 35-40 minutes on a 2-core CPU: it says its estimate up front and prints one line per
stage on stderr. JAX (and torch) are imported inside the functions that measure, so `--help` and a bad option
answer at once; `--replot bench.json` redraws the plots of an earlier run without measuring anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import resource
import statistics
import sys
import time

import numpy as np

import jaxkv  # lazy: jaxkv.Model and jaxkv.generate import JAX on first use
from jaxkv.config import PRESETS, Config

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- progress ---------------------------------------------------------------------------------------------------


class Progress:
    """One line per stage on stderr: time elapsed, the stage, and roughly how long is left.

    `stages` are (name, estimated seconds), known up front; the time left is the estimate for the stages still to
    run, scaled by how long the finished ones took against their estimates (a faster machine, a slower one)."""

    def __init__(self, title: str, stages: list[tuple[str, float]], stream=None):
        self.title, self.stages, self.stream = title, stages, stream
        self.done, self.t0, self.stage_t0 = 0, None, None
        self.spent = self.estimated = 0.0  # over the finished stages

    def _print(self, line: str):
        print(line, file=self.stream or sys.stderr, flush=True)

    def _clock(self) -> str:
        return f"[{_duration(time.perf_counter() - self.t0, clock=True)}]"

    def next(self):
        """Starts the next stage (ends the current one)."""
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
            total = sum(e for _, e in self.stages)
            self._print(f"{self.title}: {len(self.stages)} stages, roughly {_duration(total)} (an estimate from a "
                        f"2-core CPU; a faster machine takes less)")
        else:
            self.spent += now - self.stage_t0
            self.estimated += self.stages[self.done][1]
            self.done += 1
        self.stage_t0 = now
        name, estimate = self.stages[self.done]
        left = sum(e for _, e in self.stages[self.done:]) * (self.spent / self.estimated if self.estimated else 1)
        self._print(f"{self._clock()} {self.done + 1}/{len(self.stages)} {name} (about {_duration(left)} left)")

    def finish(self):
        self._print(f"{self._clock()} {self.title}: done")


def _duration(seconds: float, clock: bool = False) -> str:
    seconds = max(int(round(seconds)), 0)
    if clock:
        return f"{seconds // 60}:{seconds % 60:02d}"
    if seconds < 60:
        return f"{max(seconds, 1)} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


# Rough costs for the up-front estimate, fitted to the reference run on the 2-core dev machine
# (docs/bench/bench.json: 36 minutes for the defaults).
DECODE_S_PER_PARAM = 2.5e-10  # one batch-1 decode step (float32 and bfloat16 alike on CPU)
BATCH_STEP_GROWTH = 0.4  # a batch-B step costs 1 + 0.4 (B - 1) batch-1 steps
PREFILL_TOKENS_PER_STEP = 20  # prefill processes about 20 tokens in a decode step's time
HF_STEP_FACTOR = 2.0  # transformers' step against ours
COMPILE_S = 8.0  # one generate compile (prefill + decode loop)


def estimate_decode_row_s(config: Config, batch: int, args) -> float:
    step1 = DECODE_S_PER_PARAM * config.param_count()
    step = step1 * (1 + BATCH_STEP_GROWTH * (batch - 1))
    prefill = batch * args.prompt_len * step1 / PREFILL_TOKENS_PER_STEP
    ours = (args.reps + 1) * (prefill + args.new_tokens * step)
    theirs = (args.reps * (prefill + HF_STEP_FACTOR * (args.new_tokens + 2) * step) + 2.0) if args.hf else 0.0
    return COMPILE_S + ours + theirs + args.reps * 2.0  # 2 s: settling pauses and bandwidth samples


def estimate_curves_s(args) -> float:
    step1 = DECODE_S_PER_PARAM * PRESETS["small"].param_count()
    positions = args.prompt_len + args.curve_tokens / 2  # the mean of the nine positions measured
    recompute = 9 * (args.reps + 1) * positions * step1 / PREFILL_TOKENS_PER_STEP
    generate = 2 * args.curve_tokens * step1
    return 25 * COMPILE_S / 2 + recompute + generate + 30.0  # ~25 smaller compiles; the step-cost sweeps


# --- weights into transformers ----------------------------------------------------------------------------------


def to_hf_llama(model: jaxkv.Model):
    """The same weights as a transformers LlamaForCausalLM (float32, CPU, eager attention)."""
    import jax
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxkv.model import to_out_in

    cfg = model.config
    if cfg.positions != "rope" or cfg.ffn_kind != "swiglu" or cfg.norm_kind != "rmsnorm" or cfg.sliding_window:
        raise ValueError("to_hf_llama needs a Llama-style config (RoPE, SwiGLU, RMSNorm, no window)")
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
                         rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_positions,
                         tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.qkv_bias,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    hf = LlamaForCausalLM(hf_cfg).eval()
    # Writable float32 copies for torch, in the [out, in] form (torch Linear's layout once flattened).
    p = jax.tree_util.tree_map(lambda a: np.array(a, np.float32), to_out_in(model.params, cfg))

    def t(a, in_dims=1):  # [out..., in...] -> torch Linear's [out, in]
        return torch.from_numpy(np.ascontiguousarray(a.reshape(-1, int(np.prod(a.shape[a.ndim - in_dims:])))))

    state = {"model.embed_tokens.weight": torch.from_numpy(p["embedding"]),
             "model.norm.weight": torch.from_numpy(p["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = t(p["lm_head"])
    for i in range(cfg.n_layers):
        layer, pre = p[f"layer_{i}"], f"model.layers.{i}."
        a, m = layer["attn"], layer["mlp"]
        state.update({
            pre + "input_layernorm.weight": torch.from_numpy(layer["attn_norm"]["scale"]),
            pre + "post_attention_layernorm.weight": torch.from_numpy(layer["mlp_norm"]["scale"]),
            pre + "self_attn.q_proj.weight": t(a["wq"]), pre + "self_attn.k_proj.weight": t(a["wk"]),
            pre + "self_attn.v_proj.weight": t(a["wv"]),
            pre + "self_attn.o_proj.weight": t(a["wo"], in_dims=2),
            pre + "mlp.gate_proj.weight": t(m["w_gate"]), pre + "mlp.up_proj.weight": t(m["w_up"]),
            pre + "mlp.down_proj.weight": t(m["w_down"]),
        })
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")
    return hf


class HFRunner:
    """transformers generate with its static cache, greedy, never stopping early."""

    def __init__(self, model: jaxkv.Model, dtype: str):
        import torch

        self.torch = torch
        self.model = to_hf_llama(model).to({"float32": torch.float32, "bfloat16": torch.bfloat16,
                                            "float16": torch.float16}[dtype])

    def generate(self, prompts: np.ndarray, new_tokens: int):
        torch = self.torch
        ids = torch.from_numpy(prompts.astype(np.int64))
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                                      pad_token_id=0, eos_token_id=None)
        return out[:, prompts.shape[1]:].numpy()


# --- measurements -----------------------------------------------------------------------------------------------


def settle():
    """Lets the previous phase's worker threads go idle before the next is timed. OpenMP (torch) and XLA's thread
    pools spin for a while after their work ends; a bandwidth sample taken right after transformers' generate read
    a third slower than one taken before it (these machines have 2 cores)."""
    time.sleep(0.5)


def _median(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure_roofline(meter, reps: int) -> dict:
    """The read bandwidth (a roofline.GemvMeter), triad bandwidth and matmul rate, `reps` samples each."""
    from jaxkv import roofline

    gemv = roofline.Measurement.of([meter.sample() for _ in range(reps)])
    weight_bytes = meter.nbytes
    triad = roofline.triad_bandwidth(reps=reps)
    flops = roofline.matmul_flops(reps=reps)
    return {"gemv_bytes": weight_bytes, "gemv_GBps": dataclasses.asdict(gemv),
            "triad_GBps": dataclasses.asdict(triad), "matmul_flops": dataclasses.asdict(flops)}


def bench_decode(name: str, config: Config, dtype: str, batch: int, args, meter) -> dict:
    """jaxkv (and transformers, alternating) on one config, dtype and batch, with the read bandwidth sampled after
    each repetition (`meter`, a roofline.GemvMeter): every fraction of the roofline is taken against the bandwidth
    measured beside it."""
    # Long on purpose: one measurement round (warm-up, alternating repetitions, bandwidth samples), in order.
    from jaxkv import roofline
    from jaxkv.checkpoint import cast
    from jaxkv.decoding.phase import compile_seconds

    model = cast(jaxkv.Model.random(config, seed=0), dtype)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (batch, args.prompt_len))
    plist = prompts.tolist()
    run = lambda: jaxkv.generate(model, plist, max_new_tokens=args.new_tokens, stop_tokens=[])  # noqa: E731
    first = run()  # compile + warm-up
    compile_s = first.stats["compile_s"]
    hf = HFRunner(model, dtype) if args.hf else None
    if hf is not None:
        hf.generate(prompts, 2)  # warm-up
    c0 = compile_seconds[0]
    ours, theirs, prefill, bandwidths = [], [], [], []
    for _ in range(args.reps):
        settle()
        stats = run().stats
        ours.append(stats["decode_tokens_per_s"])
        prefill.append(stats["prefill_s"] * 1e3)
        if hf is not None:
            settle()
            t0 = time.perf_counter()
            hf.generate(prompts, 1)
            t1 = time.perf_counter()
            hf_tokens = hf.generate(prompts, args.new_tokens)
            t2 = time.perf_counter()
            theirs.append(batch * (args.new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
        settle()
        bandwidths.append(statistics.median(meter.sample() for _ in range(3)))
    recompile_s = compile_seconds[0] - c0
    live = args.prompt_len + (args.new_tokens - 1) / 2
    step_bytes = roofline.decode_bytes_per_step(config, batch, live, BYTES[dtype])
    tps = statistics.median(ours)
    result = {
        "config": name, "dtype": dtype, "batch": batch, "params": config.param_count(),
        "compile_s": compile_s, "recompile_s_after_warmup": recompile_s,
        "prefill_ms": _median(prefill), "decode_tokens_per_s": _median(ours),
        "bytes_per_step": step_bytes, "achieved_GBps": tps / batch * step_bytes / 1e9,
        "roofline_GBps": _median([b / 1e9 for b in bandwidths]),
        "roofline_tokens_per_s": statistics.median(bandwidths) / step_bytes * batch,
        "fraction_of_roofline": statistics.median(t / batch * step_bytes / b for t, b in zip(ours, bandwidths)),
        "peak_rss_mb": peak_rss_mb(),
    }
    if hf is not None:
        ratios = [a / b for a, b in zip(ours, theirs)]
        n = min(32, args.new_tokens)
        mine = np.array(first.tokens)
        differ = np.nonzero((mine != hf_tokens[:, :mine.shape[1]]).any(axis=0))[0]
        result.update({
            "hf_decode_tokens_per_s": _median(theirs), "ratio_vs_hf": _median(ratios),
            "hf_fraction_of_roofline": statistics.median(t / batch * step_bytes / b
                                                         for t, b in zip(theirs, bandwidths)),
            "greedy_first_32_equal": bool(np.array_equal(np.array([t[:n] for t in first.tokens]),
                                                         hf_tokens[:, :n])),
            # The first step at which any row's greedy token differs (None: all equal). Two correct bfloat16
            # implementations round differently and drift apart at near-ties; float32 ones should not.
            "greedy_first_difference": int(differ[0]) if differ.size else None,
        })
        if dtype != "float32":
            # transformers' own reference for a 16-bit row: the same (rounded) weights in float32. Where its
            # 16-bit run keeps to that for n tokens, ours must keep to its 16-bit run as far (issue 16).
            exact = HFRunner(model, "float32").generate(prompts, n)
            own = np.nonzero((hf_tokens[:, :n] != exact).any(axis=0))[0]
            result["hf_first_difference_from_float32"] = int(own[0]) if own.size else None
            needed = n if not own.size else int(own[0])
            result["greedy_tokens_as_far_as_hf_float32"] = not differ.size or int(differ[0]) >= needed
    return result


def decode_inputs(config: Config, batch: int, live: int, capacity: int, cache_dtype: str | None = None,
                  ring: bool = False):
    """Arguments for `jaxkv.generate.decode` after `params`: a fresh cache of `capacity` slots holding `live`
    tokens (its contents are irrelevant to the cost; `ring` as for `KVCache.allocate`), zero logits, a key, the
    greedy sampler and no stop tokens. The cache is donated by `decode`: take new inputs for every call."""
    import jax
    import jax.numpy as jnp

    from jaxkv.cache.contiguous import KVCache
    from jaxkv.sampling import Sampler

    cache = dataclasses.replace(KVCache.allocate(config, batch, capacity, dtype=cache_dtype, ring=ring),
                                length=jnp.int32(live))
    return (cache, jnp.zeros((batch, config.vocab_size), jnp.float32), jax.random.PRNGKey(0), Sampler.make(),
            jnp.full((8,), -1, jnp.int32))


def _decode_steps_seconds(model, batch: int, live: int, capacity: int, steps: int, reps: int) -> float:
    """Median seconds per decode step at `live` cached tokens."""
    import jax

    from jaxkv.generate import decode

    cfg = model.config

    def once():
        inputs = decode_inputs(cfg, batch, live, capacity)
        t0 = time.perf_counter()
        out = decode(model.params, *inputs, config=cfg, steps=steps + 1, attention="xla")
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / steps

    once()
    return statistics.median(once() for _ in range(reps))


def bench_curves(args) -> dict:
    """Cached vs no-cache per-token cost against position; step cost against live length and batch ("small")."""
    import jax
    import jax.numpy as jnp

    config = PRESETS["small"]
    model = jaxkv.Model.random(config, seed=0)
    prompt_len, new = args.prompt_len, args.curve_tokens
    positions = [prompt_len + int(n) for n in np.linspace(0, new, 9)]

    @jax.jit
    def recompute_last(params, tokens):  # the no-cache step: a full forward over the whole sequence
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return jaxkv.Decoder(config).apply({"params": params}, tokens, pos, None, last_only=True)[0]

    nocache, cached = [], []
    capacity = prompt_len + new + 64
    for p in positions:
        tokens = jnp.ones((1, p), jnp.int32)
        jax.block_until_ready(recompute_last(model.params, tokens))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(recompute_last(model.params, tokens))
            times.append(time.perf_counter() - t0)
        nocache.append(statistics.median(times))
        cached.append(_decode_steps_seconds(model, 1, p, capacity, 16, args.reps))
    # Totals over `new` generated tokens: the cached loop measured end to end; no-cache integrated over position.
    for _ in range(2):  # the first call compiles; keep the second
        gen = jaxkv.generate(model, [[1] * prompt_len], max_new_tokens=new, stop_tokens=[], max_len=capacity)
    cached_total = gen.stats["prefill_s"] + gen.stats["decode_s"]
    nocache_total = float(np.sum(np.interp(np.arange(prompt_len, prompt_len + new), positions, nocache)))
    curves = {"positions": positions, "nocache_s_per_token": nocache, "cached_s_per_token": cached,
              "cached_total_s": cached_total, "nocache_total_s": nocache_total,
              "nocache_speedup": nocache_total / cached_total}

    # The fixed capacity is the model's max positions (4,096; a larger cache could never be filled), so the
    # longest live length leaves room for the 8 timed steps.
    lives = [128, 256, 512, 1024, 2048, config.max_positions - 16]
    curves["live_lengths"] = lives
    curves["fixed_max_len"] = config.max_positions
    curves["step_s_fixed_max_len"] = [_decode_steps_seconds(model, 1, n, config.max_positions, 8, args.reps)
                                      for n in lives]
    curves["step_s_max_len_eq_live"] = [_decode_steps_seconds(model, 1, n, n + 16, 8, args.reps) for n in lives]
    batches = [1, 2, 4, 8, 16, 32]
    curves["batches"] = batches
    curves["step_s_by_batch"] = [_decode_steps_seconds(model, b, 256, 320, 8, args.reps) for b in batches]
    return curves


# --- output -----------------------------------------------------------------------------------------------------


def print_roofline(roof):
    g = roof["gemv_GBps"]
    print(f"roofline: GEMV read {g['median'] / 1e9:.1f} GB/s (min {g['low'] / 1e9:.1f}, max {g['high'] / 1e9:.1f}), "
          f"triad {roof['triad_GBps']['median'] / 1e9:.1f} GB/s, "
          f"matmul {roof['matmul_flops']['median'] / 1e9:.0f} GFLOP/s")


TABLE_HEAD = (f"{'config':8} {'dtype':9} {'B':>2} {'compile s':>9} {'prefill ms':>10} {'tok/s':>8} {'min-max':>15} "
              f"{'GB/s':>6} {'of roof':>7} {'roof GB/s':>9} {'HF tok/s':>8} {'x HF':>5} {'HF roof':>7} {'same32':>6}"
              f" {'diff':>4} {'hf32':>4} {'RSS MB':>7}")


def table_row(r) -> str:
    d = r["decode_tokens_per_s"]
    hf = r.get("hf_decode_tokens_per_s", {}).get("median", float("nan"))
    ratio = r.get("ratio_vs_hf", {}).get("median", float("nan"))
    return (f"{r['config']:8} {r['dtype']:9} {r['batch']:>2} {r['compile_s']:9.1f} "
            f"{r['prefill_ms']['median']:10.1f} {d['median']:8.1f} {d['min']:7.1f}-{d['max']:<7.1f} "
            f"{r['achieved_GBps']:6.1f} {r['fraction_of_roofline']:7.0%} {r['roofline_GBps']['median']:9.1f} "
            f"{hf:8.1f} {ratio:5.2f} "
            f"{r.get('hf_fraction_of_roofline', float('nan')):7.0%} {str(r.get('greedy_first_32_equal', '-')):>6} "
            f"{_step(r.get('greedy_first_difference')):>4} {_step(r.get('hf_first_difference_from_float32')):>4} "
            f"{r['peak_rss_mb']:7.0f}")


def _step(first_difference) -> str:
    """A table cell for a first-difference step: '-' where the tokens never differ (or were not compared)."""
    return "-" if first_difference is None else str(first_difference)


def plot(curves: dict, out: pathlib.Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install 'jaxkv[plot]')")
        return []
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curves["positions"], np.array(curves["nocache_s_per_token"]) * 1e3, "o-", label="no cache (recompute)")
    ax.plot(curves["positions"], np.array(curves["cached_s_per_token"]) * 1e3, "o-", label="KV cache")
    ax.set(xlabel="position (tokens of context)", ylabel="ms per generated token",
           title=f"small, batch 1: no-cache / cached total = {curves['nocache_speedup']:.1f}x")
    ax.legend()
    files.append(_save(fig, out / "cached_vs_nocache.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curves["live_lengths"], np.array(curves["step_s_fixed_max_len"]) * 1e3, "o-",
            label=f"max_len {curves.get('fixed_max_len', 4160)}")  # runs before this key was recorded: 4160
    ax.plot(curves["live_lengths"], np.array(curves["step_s_max_len_eq_live"]) * 1e3, "o-",
            label="max_len = live + 16")
    ax.set(xlabel="live cache length", ylabel="ms per decode step", title="small, batch 1")
    _powers_of_two_axis(ax, curves["live_lengths"])
    ax.legend()
    files.append(_save(fig, out / "step_vs_cache_length.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = np.array(curves["step_s_by_batch"])
    ax.plot(curves["batches"], steps * 1e3, "o-", label="ms per step")
    ax.set(xlabel="batch", ylabel="ms per decode step", title="small, live length 256")
    _powers_of_two_axis(ax, curves["batches"])
    ax2 = ax.twinx()
    ax2.plot(curves["batches"], np.array(curves["batches"]) / steps, "s--", color="C1", label="tokens/s")
    ax2.set_ylabel("tokens/s")
    ax.legend(handles=ax.get_lines() + ax2.get_lines(), loc="upper left")
    files.append(_save(fig, out / "step_vs_batch.png"))
    return files


def _powers_of_two_axis(ax, values):
    """A log2 x axis labelled at the measured values only, as plain numbers: matplotlib's default log axis labels
    minor ticks as "2 x 10^2, 3 x 10^2, ...", which overlap."""
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(values, [str(v) for v in values])


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="small,medium", help="comma-separated presets")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--curve-tokens", type=int, default=1024, help="generated tokens for the cached/no-cache curve")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--no-curves", dest="curves", action="store_false")
    p.add_argument("--out", default="bench_out", help="directory for bench.json and the plots")
    p.add_argument("--replot", metavar="BENCH_JSON", default=None,
                   help="only redraw the plots from an earlier run's bench.json into --out; measures nothing")
    return p.parse_args(argv)


def stages(names: list[str], args) -> list[tuple[str, float]]:
    """The run's stages with their rough durations, for the progress lines."""
    plan = [("roofline: read bandwidth, triad bandwidth, matmul rate", 5.0 * (args.reps + 2))]
    for n in names:
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                plan.append((f"{n} {dtype} batch {batch}: jaxkv{' and transformers' if args.hf else ''}",
                             estimate_decode_row_s(PRESETS[n], batch, args)))
    if args.curves:
        plan.append(("cost curves: cached vs no-cache, step vs cache length and batch", estimate_curves_s(args)))
    return plan


def main(argv=None) -> int:
    # Long on purpose: the benchmark's stages in the order they run and print.
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    if args.replot:
        try:
            curves = json.loads(pathlib.Path(args.replot).read_text())["curves"]
        except (OSError, ValueError, KeyError) as e:
            print(f"jaxkv bench: error: --replot {args.replot}: no curves to plot ({e!r})", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        print("wrote " + ", ".join(plot(curves, out)))
        return 0
    names = [c for c in args.configs.split(",") if c]
    for n in names:
        if n not in PRESETS:
            print(f"jaxkv bench: error: unknown config {n!r}; choose from {sorted(PRESETS)}", file=sys.stderr)
            return 2
    if args.hf:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            print("transformers/torch not installed: skipping the side-by-side (pip install 'jaxkv[test]')")
            args.hf = False
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress("jaxkv bench", stages(names, args))
    progress.next()
    import jax

    from jaxkv import roofline

    biggest = max(roofline.weight_bytes_per_step(PRESETS[n], 1, 4) for n in names)
    meter = roofline.GemvMeter(biggest)
    roof = measure_roofline(meter, args.reps + 2)
    print_roofline(roof)
    print(TABLE_HEAD, flush=True)
    rows = []
    for n in names:
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                progress.next()
                rows.append(bench_decode(n, PRESETS[n], dtype, batch, args, meter))
                print(table_row(rows[-1]), flush=True)
    report = {"roofline": roof, "decode": rows, "args": vars(args), "jax": jax.__version__}
    if args.curves:
        progress.next()
        curves = bench_curves(args)
        report["curves"] = curves
        report["plots"] = plot(curves, out)
        print(f"\ncached vs no-cache over {args.curve_tokens} tokens (small, batch 1, prompt {args.prompt_len}): "
              f"{curves['cached_total_s']:.2f} s vs {curves['nocache_total_s']:.2f} s = "
              f"{curves['nocache_speedup']:.1f}x")
        for n, a, b in zip(curves["live_lengths"], curves["step_s_fixed_max_len"], curves["step_s_max_len_eq_live"]):
            print(f"live {n:5d}: {a * 1e3:6.2f} ms/step at max_len {curves.get('fixed_max_len', 4160)}, "
                  f"{b * 1e3:6.2f} ms/step at max_len = live + 16")
        for b, s in zip(curves["batches"], curves["step_s_by_batch"]):
            print(f"batch {b:3d}: {s * 1e3:6.2f} ms/step, {b / s:8.1f} tokens/s")
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=float))  # numpy scalars
    print(f"\nwrote {out / 'bench.json'}" + "".join(f", {p}" for p in report.get("plots", [])), flush=True)
    progress.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
