"""Checks the Pallas attention kernels on a GPU or TPU: the kernel tests compiled, then a micro-benchmark.

Run from the repository root on the accelerator machine:

    python scripts/device_check.py                # tests (compiled, not interpreted) + benchmark
    python scripts/device_check.py --bench-only   # benchmark only
    python scripts/device_check.py --tests-only

1. Tests: `pytest tests/attention/test_pallas.py` with JAXKV_PALLAS_COMPILED=1, which that file reads to call the
   kernels with interpret=False and only the device's kernel body (Triton on GPU, Mosaic on TPU).
2. Benchmark (bfloat16), each kernel timed in a jitted `fori_loop` so that dispatch overhead is not measured:
   * decode: achieved HBM bandwidth = bytes of *live* K/V (and, for the int8 cache, their scales) read / time, at
     several live lengths in a long cache, for a bfloat16 and an int8 cache, next to the XLA reference's time
     (which reads every slot);
   * prefill: causal TFLOP/s, counting only the unmasked half of QK^T and PV (4 * B * N * H * T(T+1)/2 FLOPs).

On a CPU-only machine it says so and exits with status 2; `--interpret` runs everything in the Pallas
interpreter instead (slow, tiny benchmark shapes, numbers meaningless), to check the script itself.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from jaxkv.attention import pallas, reference  # noqa: E402
from jaxkv.cache.storage import quantize  # noqa: E402


def run_tests(interpret: bool) -> int:
    env = dict(os.environ)
    if not interpret:
        env["JAXKV_PALLAS_COMPILED"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/attention/test_pallas.py"]
    print(f"$ {'' if interpret else 'JAXKV_PALLAS_COMPILED=1 '}{' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def time_per_call(fn, *args, iters: int) -> float:
    """Seconds per call of fn(q, *rest) -> like q, run `iters` times inside one jit with a data dependency
    (each query is perturbed by 0 * the previous output) so XLA can neither hoist nor drop the calls."""

    @jax.jit
    def loop(q, *rest):
        def body(_, carry):
            return fn(q + carry * 0, *rest).astype(q.dtype)
        return lax.fori_loop(0, iters, body, jnp.zeros_like(q))

    loop(*args).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        loop(*args).block_until_ready()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def bench_decode(small: bool, interpret: bool, platform: str, cache_dtype: str):
    B, N, K, H, S = (2, 8, 2, 64, 512) if small else (8, 32, 8, 128, 8192)
    lengths = (64, 512) if small else (128, 1024, 8192)
    iters = 2 if small else 100
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
    if cache_dtype == "int8":
        (k, k_scale), (v, v_scale) = quantize(k, cache_dtype), quantize(v, cache_dtype)
        slot_bytes = H + 4  # int8 values and a float32 scale per slot and KV head
    else:
        k, v, k_scale, v_scale = k.astype(cache_dtype), v.astype(cache_dtype), None, None
        slot_bytes = H * jnp.dtype(cache_dtype).itemsize
    start = jnp.zeros((B,), jnp.int32)
    kernel = functools.partial(pallas.attention, scale=H ** -0.5, interpret=interpret, platform=platform)
    xla = functools.partial(reference.attention, scale=H ** -0.5)
    print(f"\ndecode: B={B} N={N} K={K} H={H} S={S} q {jnp.dtype(dtype).name}, cache {cache_dtype}; "
          "GB/s = live K+V bytes / time")
    print(f"{'live':>8} {'pallas us':>10} {'pallas GB/s':>12} {'xla us':>10} {'xla GB/s (live)':>16}")
    for live in lengths:
        q_offset = jnp.int32(live - 1)
        live_bytes = 2 * B * K * live * slot_bytes
        t_kernel = time_per_call(lambda q, k, v, ks, vs: kernel(q, k, v, start, q_offset, k_scale=ks, v_scale=vs),
                                 q, k, v, k_scale, v_scale, iters=iters)
        t_xla = time_per_call(lambda q, k, v, ks, vs: xla(q, k, v, start, q_offset, k_scale=ks, v_scale=vs),
                              q, k, v, k_scale, v_scale, iters=iters)
        print(f"{live:>8} {t_kernel * 1e6:>10.1f} {live_bytes / t_kernel / 1e9:>12.1f} {t_xla * 1e6:>10.1f} "
              f"{live_bytes / t_xla / 1e9:>16.1f}")


def bench_prefill(small: bool, interpret: bool, platform: str):
    B, T, N, K, H = (1, 64, 4, 2, 64) if small else (4, 2048, 32, 8, 128)
    iters = 1 if small else 10
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, K, T, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, K, T, H)), dtype)
    start, q_offset = jnp.zeros((B,), jnp.int32), jnp.int32(0)
    flops = 4 * B * N * H * T * (T + 1) / 2  # QK^T and PV over the causal triangle
    print(f"\nprefill: B={B} T={T} N={N} K={K} H={H} {jnp.dtype(dtype).name}, causal; "
          f"{flops / 1e12:.3f} TFLOP per call")
    for name, fn in [("pallas", functools.partial(pallas.attention, interpret=interpret, platform=platform)),
                     ("xla", reference.attention)]:
        t = time_per_call(lambda q, k, v: fn(q, k, v, start, q_offset, scale=H ** -0.5), q, k, v, iters=iters)
        print(f"{name:>8}: {t * 1e3:8.3f} ms  {flops / t / 1e12:8.2f} TFLOP/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run in the Pallas interpreter (CPU allowed; slow; benchmark numbers meaningless)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--tests-only", action="store_true")
    only.add_argument("--bench-only", action="store_true")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    print(f"backend: {backend}; devices: {jax.devices()}")
    if backend not in ("gpu", "tpu") and not args.interpret:
        print("device_check needs a GPU or TPU: the compiled Pallas kernels cannot run on "
              f"{backend!r}. Use --interpret to run the interpreted kernels here instead.", file=sys.stderr)
        return 2
    if args.interpret:
        print("WARNING: interpret mode: kernels run in the Pallas interpreter; benchmark shapes are tiny and "
              "the numbers say nothing about the hardware.", file=sys.stderr)
    platform = pallas.default_platform()

    status = 0
    if not args.bench_only:
        status = run_tests(args.interpret)
        print(f"tests: {'passed' if status == 0 else f'FAILED (exit {status})'}", flush=True)
    if not args.tests_only:
        for cache_dtype in ("bfloat16", "int8"):
            bench_decode(args.interpret, args.interpret, platform, cache_dtype)
        bench_prefill(args.interpret, args.interpret, platform)
    return status


if __name__ == "__main__":
    sys.exit(main())
