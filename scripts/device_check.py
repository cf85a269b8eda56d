"""Checks jaxkv on a GPU or TPU: the Pallas kernels' tests compiled, kernel bandwidth, and the whole decode step.

Run from the repository root on the accelerator machine (issue 34; figures: docs/design/attention.md, "On a GPU"):

    python scripts/device_check.py                       # every section, each in its own process, in this order
    python scripts/device_check.py --sections tests,step  # some of them
    python scripts/device_check.py --interpret           # on CPU: the Pallas interpreter, tiny shapes (checks the
                                                         # script itself; the numbers say nothing)

Sections (each a subprocess with its own time limit, so one that fails or hangs does not stop the others; with
`--budget S` the whole run ends within S seconds, each section getting at most what is left):

  env        versions (python, jax, jaxlib, flax, numpy), devices, nvidia-smi's clocks and memory.
  copy       the device's copy bandwidth (a 4 GiB device-to-device copy, bytes read + written / time): the
             ceiling the bandwidth figures below are read against, next to the 4.8 TB/s datasheet figure.
  tests      the kernel test files (`tests/attention/test_{pallas,paged_decode_kernel,mla_decode_kernel,softcap,
             sinks,delta_rule_kernel}.py`) with JAXKV_PALLAS_COMPILED=1: the kernels compiled (interpret=False), the
             device's body only, against the XLA references, float32 and bfloat16 queries, float / int8 / fp8 caches,
             windows, rings, soft-capping, attention sinks (gpt-oss: contiguous decode over several splits and a
             ring, prefill, paged decode over int8 pools) and the speculative verify's query blocks.
  bandwidth  decode attention (one query per row) over live K/V of 1k / 8k / 32k tokens at batch 1 / 8 / 64,
             bfloat16 and int8 caches, contiguous and paged (page 16, pages shuffled in the pool): achieved
             bandwidth = live K/V bytes (and scales) read / time, for the Pallas kernel and the XLA reference. Each
             time is the median of 5 runs of a jitted `fori_loop` of calls (so dispatch is not measured); live
             bytes under 4x the L2 (60 MB on an H200) are marked: repeated calls then read from the L2.
  prefill    causal prefill attention, TFLOP/s counting only the unmasked half (4 B N H T (T+1) / 2 FLOPs).
  step       the whole decode step of a Llama-3-8B-shaped model (32 layers, 4096 wide, 32 query / 8 KV heads of
             128, FFN 14336, vocabulary 128256; random bfloat16 weights drawn on the device), `jaxkv.generate.decode`
             of 32 tokens over a cache holding 1k or 8k random tokens, batch 1 / 8 / 64, `attention="pallas"` and
             `"xla"`: tokens/s and the fraction of the roofline (weights + live K/V bytes per step, over the copy
             bandwidth measured in the same process).
  compile    seconds to lower and to compile the step section's decode loop (batch 1, 8,225 slots), pallas and
             xla, for 1 / 4 / 32 layers of the same model: the weights are abstract (jax.ShapeDtypeStruct), so
             nothing of the model is allocated and it runs on a CPU too (without --interpret: the "xla" path;
             "pallas" there would be the interpreter). Added in session 20, when the "xla" step's first call on the
             H200 outlasted 190 s where the "pallas" one took 10-13 s.
  engine     `jaxkv.Engine` at 64 slots on the same model: 64 requests of 960 prompt tokens and 128 new tokens,
             pallas and xla: decode tokens/s (generated tokens / the engine's decode seconds), after a warm-up run.

Prints a table per section; with $OUT set (the device tool) it also appends every figure to $OUT/device_check.json
(one JSON object per section) and the compiled tests' report to $OUT/kernel_tests.xml. On a CPU-only machine without --interpret it says so and exits with 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTIONS = ("env", "copy", "tests", "bandwidth", "step", "engine", "prefill", "compile")
# Seconds each section may take at most. The device tool lends 15 minutes a session and 10 a call: the first run
# (session 19) needed two calls (env,copy,tests,bandwidth,prefill; then step,engine) and ran out in both.
LIMITS = {"env": 60, "copy": 40, "tests": 240, "bandwidth": 160, "prefill": 40, "step": 250, "engine": 150,
          "compile": 300}
KERNEL_TESTS = ["tests/attention/test_pallas.py", "tests/attention/test_paged_decode_kernel.py",
                "tests/attention/test_mla_decode_kernel.py", "tests/attention/test_softcap.py",
                "tests/attention/test_sinks.py", "tests/attention/test_chunked.py",
                "tests/attention/test_delta_rule_kernel.py"]
# Filters, to spend a short device lease on the rows still owed (each section ignores those it has no use for).
FILTERS = {"batches": "batch sizes (bandwidth, step)", "lives": "live lengths (bandwidth, step)",
           "layouts": "layouts, contiguous / paged (bandwidth)", "caches": "cache dtypes, bfloat16 / int8 (bandwidth)",
           "attention": "attention paths, pallas / xla (step, engine, compile)",
           "layers": "layer counts, 1 / 4 / 32 (compile)"}
L2_BYTES = 60e6  # the H200's L2 (KINDS.md)
DATASHEET_BW = 4.8e12  # H200 HBM3e, the vendor's figure


def out_dir() -> Path | None:
    out = os.environ.get("OUT")
    return Path(out) if out else None


def record(section: str, figures: dict):
    """Appends one section's figures to $OUT/device_check.json (a JSON object per line)."""
    out = out_dir()
    if out is not None:
        with open(out / "device_check.json", "a") as f:
            f.write(json.dumps({"section": section, **figures}) + "\n")


def median_seconds(fn, reps: int = 5) -> float:
    """Median wall seconds of fn() (which blocks until its results are ready), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_per_call(fn, *args, iters: int, reps: int = 5) -> float:
    """Median seconds per call of fn(q, *rest) -> like q, run `iters` times inside one jit with a data dependency
    (each query is perturbed by 0 * the previous output) so that XLA can neither hoist nor drop the calls."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    @jax.jit
    def loop(q, *rest):
        def body(_, carry):
            return fn(q + carry * 0, *rest).astype(q.dtype)
        return lax.fori_loop(0, iters, body, jnp.zeros_like(q))

    return median_seconds(lambda: loop(*args).block_until_ready(), reps) / iters


# --- sections -----------------------------------------------------------------------------------------------------


def section_env(args) -> int:
    import jax
    import jaxlib
    import numpy as np
    import flax

    figures = {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
               "flax": flax.__version__, "numpy": np.__version__, "backend": jax.default_backend(),
               "devices": [str(d) for d in jax.devices()]}
    try:
        figures["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip() or None
    except OSError:
        figures["commit"] = None
    for k, v in figures.items():
        print(f"{k}: {v}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,"
                              "clocks.max.sm,driver_version", "--format=csv"], capture_output=True, text=True,
                             timeout=20)
        print(smi.stdout.strip())
        figures["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"nvidia-smi: {e}")
    record("env", figures)
    import jaxkv  # noqa: F401  (the package imports under this jax)
    print("import jaxkv: ok")
    return 0


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + written), median of 5."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x * 1.0 + 0.0)  # one read, one write
    t = median_seconds(lambda: copy(x).block_until_ready())
    return 2 * nbytes / t


def section_copy(args) -> int:
    nbytes = (64 << 20) if args.interpret else (4 << 30)
    bw = copy_bandwidth(nbytes)
    print(f"device copy: {nbytes / 2**30:.2f} GiB, {bw / 1e9:.0f} GB/s (read + written); "
          f"{bw / DATASHEET_BW:.0%} of the {DATASHEET_BW / 1e12:.1f} TB/s datasheet")
    record("copy", {"bytes": nbytes, "gb_s": bw / 1e9})
    return 0


def section_tests(args) -> int:
    env = dict(os.environ)
    if not args.interpret:
        env["JAXKV_PALLAS_COMPILED"] = "1"
    # No 8 fake host devices, no LLVM -O0 (tests/conftest.py sets them only when XLA_FLAGS is unset), no 75% of the
    # GPU's memory taken by each pytest worker.
    env["XLA_FLAGS"] = ""
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *KERNEL_TESTS]
    try:
        import xdist  # noqa: F401
        cmd[4:4] = ["-n", str(min(14, os.cpu_count() or 1))]  # compile-bound: the host's cores, not the GPU
    except ImportError:
        pass
    out = out_dir()
    if out is not None:
        cmd.insert(4, f"--junitxml={out / 'kernel_tests.xml'}")
    print(f"$ {'' if args.interpret else 'JAXKV_PALLAS_COMPILED=1 '}{' '.join(cmd[1:])}", flush=True)
    status = subprocess.call(cmd, cwd=ROOT, env=env)
    record("tests", {"exit": status, "files": KERNEL_TESTS})
    return status


def _device_normal(shape, dtype, seed):
    """Normal(0, 1) drawn on the device (host numpy would take minutes for gigabytes)."""
    import jax
    import jax.numpy as jnp

    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def section_bandwidth(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.attention import paged_reference, pallas, reference
    from jaxkv.cache.storage import quantize

    N, K, H = (8, 2, 64) if args.interpret else (32, 8, 128)
    batches = pick(args.batches, (1, 2) if args.interpret else (1, 8, 64))
    lives = (64, 256) if args.interpret else (1024, 8192, 32768)
    lives_shown = pick(args.lives, lives)
    page = 16
    iters = 1 if args.interpret else 20
    platform = pallas.default_platform()
    scale = H ** -0.5
    rows = []
    print(f"decode attention: N={N} K={K} H={H}, bfloat16 queries; GB/s = live K/V bytes read / time "
          "('L2': live bytes under 4x the L2, read from the cache on repeats)")
    print(f"{'layout':>10} {'cache':>8} {'B':>3} {'live':>6} {'MB live':>8} {'pallas us':>10} {'GB/s':>7} "
          f"{'xla us':>9} {'GB/s':>7}")

    def show(r):
        print(f"{r['layout']:>10} {r['cache']:>8} {r['B']:>3} {r['live']:>6} {r['live_mb']:>8.1f} "
              f"{r['pallas_us']:>10.1f} {r['pallas_gb_s']:>7.0f} {r['xla_us']:>9.1f} {r['xla_gb_s']:>7.0f}"
              f"{'  L2' if r['live_mb'] * 1e6 < 4 * L2_BYTES else ''}", flush=True)

    def measure(layout, cache_dtype, B, live, live_bytes, kernel, xla, *args):
        """Times the Pallas kernel and the XLA reference on the same arguments; one table row."""
        if live not in lives_shown or layout not in layouts:
            return
        tp, tx = (time_per_call(fn, *args, iters=iters) for fn in (kernel, xla))
        r = dict(layout=layout, cache=cache_dtype, B=B, live=live, live_mb=live_bytes / 1e6, pallas_us=tp * 1e6,
                 pallas_gb_s=live_bytes / tp / 1e9, xla_us=tx * 1e6, xla_gb_s=live_bytes / tx / 1e9)
        rows.append(r)
        show(r)

    layouts = pick(args.layouts, ("contiguous", "paged"))
    for cache_dtype in pick(args.caches, ("bfloat16", "int8")):
        for B in batches:
            S = max(lives)
            key = jax.random.PRNGKey(B)
            q = jax.random.normal(key, (B, 1, N, H), jnp.float32).astype(jnp.bfloat16)
            # Contiguous: [B, K, S, H], the live prefix of each row read.
            k = _device_normal((B, K, S, H), jnp.float32, 1)
            v = _device_normal((B, K, S, H), jnp.float32, 2)
            if cache_dtype == "int8":
                (k, ks), (v, vs) = quantize(k, "int8"), quantize(v, "int8")
                slot_bytes = H + 4
            else:
                k, v, ks, vs = k.astype(cache_dtype), v.astype(cache_dtype), None, None
                slot_bytes = H * 2
            start = jnp.zeros((B,), jnp.int32)
            kern = functools.partial(pallas.attention, scale=scale, interpret=args.interpret, platform=platform)
            for live in lives:
                off = jnp.int32(live - 1)
                measure("contiguous", cache_dtype, B, live, 2 * B * K * live * slot_bytes,
                        lambda q, k, v, ks, vs: kern(q, k, v, start, off, k_scale=ks, v_scale=vs),
                        lambda q, k, v, ks, vs: reference.attention(q, k, v, start, off, scale=scale, k_scale=ks,
                                                                    v_scale=vs),
                        q, k, v, ks, vs)
            # Paged: the same slots as pages of 16 in a shuffled pool; lengths traced, one table width.
            P, M = B * S // page, S // page
            def to_pages(x):  # [B, K, S, ...] -> [P, K, page, ...], row b's pages b * M .. b * M + M - 1
                return x.reshape(B, K, M, page, *x.shape[3:]).swapaxes(1, 2).reshape(P, K, page, *x.shape[3:])
            perm = np.random.default_rng(B).permutation(P)
            kp, vp = to_pages(k)[perm], to_pages(v)[perm]
            ksp = None if ks is None else to_pages(ks)[perm]
            vsp = None if vs is None else to_pages(vs)[perm]
            del k, v, ks, vs
            inverse = np.argsort(perm)
            table = jnp.asarray(inverse.reshape(B, M), jnp.int32)
            for live in lives:
                lengths = jnp.full((B,), live, jnp.int32)
                q_slots = (lengths - 1)[:, None]
                measure("paged", cache_dtype, B, live, 2 * B * K * live * slot_bytes,
                        lambda q, kp, vp, ks, vs: pallas.paged_attention(
                            q, kp, vp, table, lengths, q_slots, scale=scale, k_scale=ks, v_scale=vs,
                            interpret=args.interpret, platform=platform),
                        lambda q, kp, vp, ks, vs: paged_reference.paged_attention(
                            q, kp, vp, table, lengths, q_slots, scale=scale, k_scale=ks, v_scale=vs),
                        q, kp, vp, ksp, vsp)
            del kp, vp, ksp, vsp
    record("bandwidth", {"rows": rows})
    return 0


def section_prefill(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.attention import pallas, reference

    shapes = [(1, 64, 4, 2, 64)] if args.interpret else [(4, 2048, 32, 8, 128), (1, 8192, 32, 8, 128)]
    rows = []
    for B, T, N, K, H in shapes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.bfloat16)
        k = jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.bfloat16)
        start, off = jnp.zeros((B,), jnp.int32), jnp.int32(0)
        flops = 4 * B * N * H * T * (T + 1) / 2
        for name, fn in [("pallas", functools.partial(pallas.attention, interpret=args.interpret)),
                         ("xla", reference.attention)]:
            t = time_per_call(lambda q, k, v: fn(q, k, v, start, off, scale=H ** -0.5), q, k, v,
                              iters=1 if args.interpret else 5)
            rows.append(dict(impl=name, B=B, T=T, N=N, K=K, H=H, ms=t * 1e3, tflop_s=flops / t / 1e12))
            print(f"prefill B={B} T={T} N={N} K={K} H={H} bf16 causal {name:>7}: {t * 1e3:8.3f} ms "
                  f"{flops / t / 1e12:7.1f} TFLOP/s", flush=True)
    record("prefill", {"rows": rows})
    return 0


def llama3_8b(interpret: bool):
    from jaxkv.config import Config

    if interpret:  # the same structure, tiny
        return Config(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                      max_positions=4096, rope_theta=500000.0, dtype="bfloat16")
    return Config(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                  max_positions=16384, rope_theta=500000.0, norm_eps=1e-5, dtype="bfloat16")


def device_params(config):
    """Random parameters drawn on the device: Normal(0, 0.02) weights, unit norm scales, zero biases (host numpy,
    as `Model.random` draws, would take minutes for 8B parameters)."""
    import jax
    import jax.numpy as jnp

    from jaxkv.model import param_shapes

    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config))
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    out = []
    for (path, leaf), key in zip(leaves, keys):
        name = path[-1].key
        if name == "scale" or name == "layer_scalar":
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        elif name.endswith("bias"):
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            out.append(normal(key, leaf.shape, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def random_cache(config, batch, capacity, live, seed):
    """A KVCache of `capacity` slots holding `live` tokens of random K/V (not zeros: see METHOD.md), each layer's
    buffer drawn directly in the cache dtype (no zeroed cache first, no float32 temporary: at batch 64 and 8k slots
    the cache alone is 69 GB, and the first run ran out of memory drawing over a zeroed one)."""
    import jax
    import jax.numpy as jnp

    from jaxkv.cache.contiguous import KVCache

    shape = (batch, config.n_kv_heads, capacity, config.head_dim or config.d_model // config.n_heads)
    draw = jax.jit(lambda key: jax.random.normal(key, shape, jnp.dtype(config.dtype)))
    keys = tuple(draw(jax.random.PRNGKey(seed + i)) for i in range(config.n_layers))
    values = tuple(draw(jax.random.PRNGKey(seed + 1000 + i)) for i in range(config.n_layers))
    return KVCache(keys=keys, values=values, start=jnp.zeros((batch,), jnp.int32), length=jnp.int32(live))


def memory_in_use_gb() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_in_use"] / 1e9 if "bytes_in_use" in stats else None


def section_step(args) -> int:
    import jax
    import jax.numpy as jnp

    from jaxkv import roofline
    from jaxkv.generate import decode
    from jaxkv.sampling import Sampler

    config = llama3_8b(args.interpret)
    batches = pick(args.batches, (1, 2) if args.interpret else (1, 8, 64))
    lives = pick(args.lives, (64, 256) if args.interpret else (1024, 8192))
    steps = 4 if args.interpret else 32
    capacity = max(lives) + steps + 1
    t0 = time.perf_counter()
    params = device_params(config)
    jax.block_until_ready(params)
    print(f"model: {config.param_count() / 1e9:.2f}B parameters, bfloat16, drawn in {time.perf_counter() - t0:.1f} s; "
          f"cache capacity {capacity}", flush=True)
    bw = copy_bandwidth((64 << 20) if args.interpret else (4 << 30))
    print(f"copy bandwidth (the roofline's): {bw / 1e9:.0f} GB/s")
    print(f"{'attention':>9} {'B':>3} {'live':>6} {'first s':>9} {'ms/step':>8} {'tokens/s':>9} {'GB/step':>8} "
          f"{'roofline':>8}")
    rows = []
    for attention in pick(args.attention, ("pallas", "xla")):
        for B in batches:
            compile_s = None
            for live in lives:
                def once():
                    cache = random_cache(config, B, capacity, live, seed=B)
                    inputs = (cache, jnp.zeros((B, config.vocab_size), jnp.float32), jax.random.PRNGKey(0),
                              Sampler.make(), jnp.full((8,), -1, jnp.int32))
                    jax.block_until_ready(inputs)
                    t = time.perf_counter()
                    out = decode(params, *inputs, config=config, steps=steps + 1, attention=attention)
                    jax.block_until_ready(out)
                    return time.perf_counter() - t
                # Said before the first call, so that a section killed at its limit shows what it was compiling (in
                # session 20 the "xla" step at B = 1 gave no row in 190 s).
                print(f"{attention:>9} {B:>3} {live:>6} first call (compile + run) ...", flush=True)
                try:
                    first = once()
                    if compile_s is None:
                        compile_s = first
                    step_s = statistics.median(once() for _ in range(3)) / steps
                except Exception as e:  # noqa: BLE001  (one configuration's failure is a figure too)
                    print(f"{attention:>9} {B:>3} {live:>6} FAILED: {type(e).__name__}: {str(e)[:400]} "
                          f"(GB in use: {memory_in_use_gb()})", flush=True)
                    rows.append(dict(attention=attention, B=B, live=live, error=f"{type(e).__name__}: {e}"[:2000]))
                    continue
                nbytes = roofline.decode_bytes_per_step(config, B, live + steps / 2, 2)
                r = dict(attention=attention, B=B, live=live, compile_s=compile_s, ms_per_step=step_s * 1e3,
                         tokens_s=B / step_s, gb_per_step=nbytes / 1e9, roofline=nbytes / step_s / bw)
                rows.append(r)
                print(f"{attention:>9} {B:>3} {live:>6} {compile_s:>9.1f} {step_s * 1e3:>8.2f} {B / step_s:>9.0f} "
                      f"{nbytes / 1e9:>8.2f} {r['roofline']:>8.0%}", flush=True)
    record("step", {"copy_gb_s": bw / 1e9, "steps": steps, "capacity": capacity, "rows": rows})
    return 0


def section_compile(args) -> int:
    import jax
    import jax.numpy as jnp

    from jaxkv.generate import decode
    from jaxkv.model import param_shapes
    from jaxkv.sampling import Sampler

    capacity, live = (97, 64) if args.interpret else (8225, 1024)
    attentions = pick(args.attention, ("pallas", "xla"))
    if jax.default_backend() == "cpu" and not args.interpret and "pallas" in attentions:
        raise SystemExit("compile: on a CPU the pallas path needs --interpret; pass --attention xla")
    print(f"{'attention':>9} {'layers':>6} {'lower s':>8} {'compile s':>9} {'HLO MB':>7}")
    rows = []
    for attention in attentions:
        for layers in pick(args.layers, (1, 4, 32)):
            config = llama3_8b(args.interpret).replace(n_layers=layers)
            cache = random_cache(config, 1, capacity, live, seed=0)
            inputs = (cache, jnp.zeros((1, config.vocab_size), jnp.float32), jax.random.PRNGKey(0), Sampler.make(),
                      jnp.full((8,), -1, jnp.int32))
            jax.block_until_ready(inputs)
            t0 = time.perf_counter()
            lowered = decode.lower(param_shapes(config), *inputs, config=config, steps=33, attention=attention)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            mb = len(lowered.as_text()) / 1e6
            rows.append(dict(attention=attention, layers=layers, lower_s=t1 - t0, compile_s=t2 - t1, hlo_mb=mb))
            print(f"{attention:>9} {layers:>6} {t1 - t0:>8.1f} {t2 - t1:>9.1f} {mb:>7.1f}", flush=True)
            del cache, inputs
    record("compile", {"backend": jax.default_backend(), "capacity": capacity, "rows": rows})
    return 0


def section_engine(args) -> int:
    import jax
    import numpy as np

    import jaxkv

    config = llama3_8b(args.interpret)
    model = jaxkv.Model(config=config, params=device_params(config))
    slots = 4 if args.interpret else 64
    prompt_len, new = (32, 8) if args.interpret else (960, 128)
    rng = np.random.default_rng(0)
    requests = [dict(prompt=rng.integers(1, config.vocab_size, prompt_len).tolist(), max_new_tokens=new)
                for _ in range(slots)]
    rows = []
    print(f"engine: {slots} slots, {slots} requests of {prompt_len} prompt + {new} new tokens")
    for attention in pick(args.attention, ("pallas", "xla")):
        try:
            engine = jaxkv.Engine(model, slots=slots, max_len=prompt_len + new, prefill_chunk=512 if not
                                  args.interpret else 16, prefill_rows=8, attention=attention,
                                  decode_widths=[slots])  # every slot busy: one decode program to compile
            t0 = time.perf_counter()
            engine.generate(requests, stop_tokens=[])  # compiles
            warm = time.perf_counter() - t0
            before = dict(engine.stats)
            t0 = time.perf_counter()
            engine.generate(requests, stop_tokens=[])
            wall = time.perf_counter() - t0
            s = {k: engine.stats[k] - before.get(k, 0) for k in engine.stats
                 if isinstance(engine.stats[k], (int, float))}
        except Exception as e:  # noqa: BLE001
            print(f"{attention}: FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
            rows.append(dict(attention=attention, error=f"{type(e).__name__}: {e}"[:2000]))
            continue
        r = dict(attention=attention, first_run_s=warm, wall_s=wall, prefill_s=s["prefill_s"],
                 decode_s=s["decode_s"], generated=s["generated_tokens"],
                 decode_tokens_s=s["generated_tokens"] / s["decode_s"], decode_steps=s["decode_steps"])
        rows.append(r)
        print(f"{attention:>7}: first run {warm:.1f} s; then {wall:.2f} s wall, prefill {s['prefill_s']:.2f} s, "
              f"decode {s['decode_s']:.2f} s for {s['generated_tokens']} tokens: "
              f"{r['decode_tokens_s']:.0f} tokens/s", flush=True)
        del engine
    record("engine", {"slots": slots, "prompt": prompt_len, "new": new, "rows": rows})
    return 0


def pick(chosen: str | None, default: tuple) -> tuple:
    """The values of a filter flag (comma-separated) that are among the section's own, in its order; all of them
    when the flag is unset. Values the section does not know are an error, not silently dropped."""
    if not chosen:
        return default
    wanted = [type(default[0])(x.strip()) for x in chosen.split(",") if x.strip()]
    unknown = [w for w in wanted if w not in default]
    if unknown:
        raise SystemExit(f"device_check: {unknown} not among {list(default)}")
    return tuple(d for d in default if d in wanted)


# --- driver -------------------------------------------------------------------------------------------------------


def run_section(name: str, args, budget_left: float) -> tuple[int, float]:
    """Runs one section in a fresh process (its own GPU client and memory) -> (exit status, seconds)."""
    limit = max(5.0, min(LIMITS[name], budget_left))
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--section", name]
    if args.interpret:
        cmd.append("--interpret")
    for flag in FILTERS:
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.92")
    if name == "compile":  # cold compiles: jaxkv's persistent cache would turn a repeat run into disk reads
        env["JAXKV_COMPILE_CACHE"] = "0"
    print(f"\n===== {name} (limit {limit:.0f} s) =====", flush=True)
    t0 = time.perf_counter()
    # A session of its own, so that a timeout kills the whole group: in the first run pytest's workers outlived
    # their killed parent and ran on beside the bandwidth section's timings.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        status = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"===== {name}: TIMED OUT after {limit:.0f} s", flush=True)
        status = 124
    return status, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run in the Pallas interpreter on any backend (tiny shapes; numbers meaningless)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    for flag, what in FILTERS.items():
        parser.add_argument(f"--{flag}", help=f"only these {what} (comma-separated; default all)")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = parser.parse_args(argv)

    if args.section:
        import jax
        if jax.default_backend() not in ("gpu", "tpu") and not args.interpret and args.section != "compile":
            print(f"device_check needs a GPU or TPU (backend {jax.default_backend()!r}); --interpret runs the "
                  "Pallas interpreter instead", file=sys.stderr)
            return 2
        return globals()[f"section_{args.section}"](args)

    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    deadline = time.perf_counter() + args.budget
    results = {}
    for name in names:
        left = deadline - time.perf_counter()
        if left < 5:
            results[name] = ("skipped: out of budget", 0.0)
            continue
        results[name] = run_section(name, args, left)
    print("\n===== summary =====")
    for name, (status, seconds) in results.items():
        print(f"{name:>10}: {status if isinstance(status, str) else ('ok' if status == 0 else f'exit {status}')} "
              f"({seconds:.0f} s)")
    return 0 if all(s == 0 for s, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
