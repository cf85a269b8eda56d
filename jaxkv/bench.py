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

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import roofline
from jaxkv.cache import KVCache
from jaxkv.checkpoint import cast
from jaxkv.config import PRESETS, Config
from jaxkv.generate import _compile_seconds, decode
from jaxkv.sampling import Sampler

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- weights into transformers ----------------------------------------------------------------------------------


def to_hf_llama(model: jaxkv.Model):
    """The same weights as a transformers LlamaForCausalLM (float32, CPU, eager attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    p = jax.tree_util.tree_map(lambda a: np.array(a, np.float32), model.params)  # writable copies for torch
    D = cfg.d_model

    def t(a, in_dims=1):  # jaxkv weights are [out..., in...]; torch Linear's [out, in] once flattened
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


def _settle():
    """Lets the previous phase's worker threads go idle before the next is timed. OpenMP (torch) and XLA's thread
    pools spin for a while after their work ends; a bandwidth sample taken right after transformers' generate read
    a third slower than one taken before it (these machines have 2 cores)."""
    time.sleep(0.5)


def _median(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure_roofline(meter: roofline.GemvMeter, reps: int) -> dict:
    gemv = roofline.Measurement.of([meter.sample() for _ in range(reps)])
    weight_bytes = meter.nbytes
    triad = roofline.triad_bandwidth(reps=reps)
    flops = roofline.matmul_flops(reps=reps)
    return {"gemv_bytes": weight_bytes, "gemv_GBps": dataclasses.asdict(gemv),
            "triad_GBps": dataclasses.asdict(triad), "matmul_flops": dataclasses.asdict(flops)}


def bench_decode(name: str, config: Config, dtype: str, batch: int, args, meter: roofline.GemvMeter) -> dict:
    """jaxkv (and transformers, alternating) on one config, dtype and batch, with the read bandwidth sampled after
    each repetition: every fraction of the roofline is taken against the bandwidth measured beside it."""
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
    c0 = _compile_seconds[0]
    ours, theirs, prefill, bandwidths = [], [], [], []
    for _ in range(args.reps):
        _settle()
        stats = run().stats
        ours.append(stats["decode_tokens_per_s"])
        prefill.append(stats["prefill_s"] * 1e3)
        if hf is not None:
            _settle()
            t0 = time.perf_counter()
            hf.generate(prompts, 1)
            t1 = time.perf_counter()
            hf_tokens = hf.generate(prompts, args.new_tokens)
            t2 = time.perf_counter()
            theirs.append(batch * (args.new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
        _settle()
        bandwidths.append(statistics.median(meter.sample() for _ in range(3)))
    recompile_s = _compile_seconds[0] - c0
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
    return result


def decode_inputs(config: Config, batch: int, live: int, capacity: int, cache_dtype: str | None = None):
    """Arguments for `jaxkv.generate.decode` after `params`: a fresh cache of `capacity` slots holding `live`
    tokens (its contents are irrelevant to the cost), zero logits, a key, the greedy sampler and no stop tokens.
    The cache is donated by `decode`: take new inputs for every call."""
    cache = dataclasses.replace(KVCache.allocate(config, batch, capacity, dtype=cache_dtype), length=jnp.int32(live))
    return (cache, jnp.zeros((batch, config.vocab_size), jnp.float32), jax.random.PRNGKey(0), Sampler.make(),
            jnp.full((8,), -1, jnp.int32))


def _decode_steps_seconds(model, batch: int, live: int, capacity: int, steps: int, reps: int) -> float:
    """Median seconds per decode step at `live` cached tokens."""
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

    lives = [128, 256, 512, 1024, 2048, 4096]
    curves["live_lengths"] = lives
    curves["step_s_fixed_max_len"] = [_decode_steps_seconds(model, 1, n, 4096 + 64, 8, args.reps) for n in lives]
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
              f"{'GB/s':>6} {'of roof':>7} {'roof GB/s':>9} {'HF tok/s':>8} {'x HF':>5} {'HF roof':>7} {'same32':>6} {'RSS MB':>7}")


def table_row(r) -> str:
    d = r["decode_tokens_per_s"]
    hf = r.get("hf_decode_tokens_per_s", {}).get("median", float("nan"))
    ratio = r.get("ratio_vs_hf", {}).get("median", float("nan"))
    return (f"{r['config']:8} {r['dtype']:9} {r['batch']:>2} {r['compile_s']:9.1f} "
            f"{r['prefill_ms']['median']:10.1f} {d['median']:8.1f} {d['min']:7.1f}-{d['max']:<7.1f} "
            f"{r['achieved_GBps']:6.1f} {r['fraction_of_roofline']:7.0%} {r['roofline_GBps']['median']:9.1f} "
            f"{hf:8.1f} {ratio:5.2f} "
            f"{r.get('hf_fraction_of_roofline', float('nan')):7.0%} {str(r.get('greedy_first_32_equal', '-')):>6} "
            f"{r['peak_rss_mb']:7.0f}")


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
    ax.plot(curves["live_lengths"], np.array(curves["step_s_fixed_max_len"]) * 1e3, "o-", label="max_len 4160")
    ax.plot(curves["live_lengths"], np.array(curves["step_s_max_len_eq_live"]) * 1e3, "o-",
            label="max_len = live + 16")
    ax.set(xscale="log", xlabel="live cache length", ylabel="ms per decode step", title="small, batch 1")
    ax.legend()
    files.append(_save(fig, out / "step_vs_cache_length.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = np.array(curves["step_s_by_batch"])
    ax.plot(curves["batches"], steps * 1e3, "o-", label="ms per step")
    ax.set(xscale="log", xlabel="batch", ylabel="ms per decode step", title="small, live length 256")
    ax2 = ax.twinx()
    ax2.plot(curves["batches"], np.array(curves["batches"]) / steps, "s--", color="C1", label="tokens/s")
    ax2.set_ylabel("tokens/s")
    files.append(_save(fig, out / "step_vs_batch.png"))
    return files


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
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
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
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    biggest = max(roofline.weight_bytes_per_step(PRESETS[n], 1, 4) for n in names)
    meter = roofline.GemvMeter(biggest)
    roof = measure_roofline(meter, args.reps + 2)
    print_roofline(roof)
    print(TABLE_HEAD, flush=True)
    rows = []
    for n in names:
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(bench_decode(n, PRESETS[n], dtype, batch, args, meter))
                print(table_row(rows[-1]), flush=True)
    report = {"roofline": roof, "decode": rows, "args": vars(args), "jax": jax.__version__}
    if args.curves:
        curves = bench_curves(args)
        report["curves"] = curves
        report["plots"] = plot(curves, out)
        print(f"\ncached vs no-cache over {args.curve_tokens} tokens (small, batch 1, prompt {args.prompt_len}): "
              f"{curves['cached_total_s']:.2f} s vs {curves['nocache_total_s']:.2f} s = "
              f"{curves['nocache_speedup']:.1f}x")
        for n, a, b in zip(curves["live_lengths"], curves["step_s_fixed_max_len"], curves["step_s_max_len_eq_live"]):
            print(f"live {n:5d}: {a * 1e3:6.2f} ms/step at max_len 4160, {b * 1e3:6.2f} ms/step at max_len = live")
        for b, s in zip(curves["batches"], curves["step_s_by_batch"]):
            print(f"batch {b:3d}: {s * 1e3:6.2f} ms/step, {b / s:8.1f} tokens/s")
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=float))  # numpy scalars
    print(f"\nwrote {out / 'bench.json'}" + "".join(f", {p}" for p in report.get("plots", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
