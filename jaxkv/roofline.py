"""The memory-bandwidth roofline of decoding: bytes a decode step must move, and the machine's measured bandwidth.

Decode is memory-bound: each step reads every weight once (the token embedding only for the B looked-up rows,
unless the head is tied to it) and the live K/V cache, and writes one token's K/V per sequence. At a sustained read
bandwidth W bytes/s, no implementation can exceed `W / bytes_per_step` steps per second; the fraction of that
reached is the honest measure of a decode loop.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import Config
from jaxkv.layers import quantized


def weight_bytes_per_step(config: Config, batch: int, bytes_per_element: int, params=None) -> int:
    """Weights a decode step reads: all of them, except that an untied token embedding is read only for the
    `batch` looked-up rows (and a learned position table for `batch` rows). With `params` (a parameter tree,
    quantized or not), their bytes at each dtype's width (`quantized.packed_bytes`: int4 as the device holds
    it, `quantized.int4_bits`; the scales included) instead of parameter count x `bytes_per_element`."""
    if params is not None:
        total, skipped = quantized.packed_bytes(params, quantized.int4_bits()), 0.0
        tables = [("embedding", config.vocab_size)] if not config.tie_embeddings else []
        if config.positions == "learned":
            tables.append(("pos_embedding", config.max_positions))
        for name, rows in tables:
            skipped += quantized.packed_bytes(params[name], quantized.int4_bits()) * (rows - batch) / rows
        return int(total - skipped)
    total = config.param_count()
    skipped = 0
    if not config.tie_embeddings:
        skipped += (config.vocab_size - batch) * config.d_model
    if config.positions == "learned":
        skipped += (config.max_positions - batch) * config.d_model
    return (total - skipped) * bytes_per_element


def kv_read_bytes_per_step(config: Config, live_len: float, cache_bytes_per_element: int) -> float:
    """Cached bytes one sequence's decode step reads at `live_len` tokens, per layer: its bytes per slot
    (`Config.kv_bytes_per_token`'s terms) times the slots it reads, at most its sliding window or chunk
    (`Config.layer_span`); DeepSeek-V3.2 (`Mla.indexer`) reads every indexer key but only `topk` latent rows."""
    bpe, total = cache_bytes_per_element, 0.0
    m = config.mla
    for layer in range(config.n_layers):
        if not config.caches_kv(layer):
            continue
        span = config.layer_span(layer)
        live = live_len if span is None else min(live_len, span)
        if m is not None and m.indexer is not None:
            total += m.row_dim * bpe * min(live, m.indexer.topk) + m.indexer.head_dim * bpe * live
        else:
            kinds = 1 if m is not None else 2
            total += kinds * config.layer_kv_heads(layer) * config.layer_head_dim(layer) * bpe * live
    return total


def decode_bytes_per_step(config: Config, batch: int, live_len: float, bytes_per_element: int = 4,
                          cache_bytes_per_element: int | None = None, params=None) -> float:
    """Bytes one decode step moves: weights read (`weight_bytes_per_step`; from `params` when given, e.g.
    quantized ones) + live K/V read (`kv_read_bytes_per_step`: windows, chunks and DeepSeek-V3.2's top-k bound
    it per layer) + new K/V written."""
    cache_bpe = bytes_per_element if cache_bytes_per_element is None else cache_bytes_per_element
    per_token = config.kv_bytes_per_token(cache_bpe)
    return weight_bytes_per_step(config, batch, bytes_per_element, params) + batch * (
        kv_read_bytes_per_step(config, live_len, cache_bpe) + per_token)


@dataclasses.dataclass
class Measurement:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values):
        return cls(statistics.median(values), min(values), max(values))


def _time(fn, *args, reps: int):
    fn(*args).block_until_ready()  # compile and warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


class GemvMeter:
    """Read bandwidth (bytes/s) of float32 matrix-vector products over one `nbytes` matrix, the access pattern of a
    batch-1 decode step, ready to sample again at any time: the bandwidth of these shared machines drifts by tens of
    percent within minutes, so the benchmark samples it beside every decode measurement.

    Each sample takes the better of the two orientations (x @ W over [in, out] and W @ x over [out, in]), since
    which one XLA:CPU reads faster depends on the machine and the shape: the roofline is what the best of them
    achieves, not what jaxkv's own layout achieves."""

    def __init__(self, nbytes: int = 1 << 30):
        cols = 4096
        rows = max(nbytes // (4 * cols), 1)
        self.w = jnp.asarray(np.random.default_rng(0).standard_normal((rows, cols), np.float32))
        self.nbytes = self.w.nbytes
        self._forms = [(jax.jit(lambda x, w: x @ w), jnp.ones((1, rows), jnp.float32)),
                       (jax.jit(lambda x, w: w @ x), jnp.ones((cols, 1), jnp.float32))]
        for fn, x in self._forms:  # compile and warm up
            fn(x, self.w).block_until_ready()

    def sample(self) -> float:
        best = 0.0
        for fn, x in self._forms:
            t0 = time.perf_counter()
            fn(x, self.w).block_until_ready()
            best = max(best, self.nbytes / (time.perf_counter() - t0))
        return best


def triad_bandwidth(nbytes: int = 1 << 29, reps: int = 7) -> Measurement:
    """STREAM triad a = b + s * c over float32 arrays of `nbytes` each: (2 reads + 1 write) * nbytes per pass."""
    n = nbytes // 4
    # The output reuses the donated input: a freshly allocated output pays page faults on first touch and ran at
    # a fraction of the bandwidth on these machines.
    triad = jax.jit(lambda a, c: a + 3.0 * c, donate_argnums=0)
    a, c = jnp.ones((n,), jnp.float32), jnp.full((n,), 2.0, jnp.float32)
    a = triad(a, c).block_until_ready()  # compile and warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a = triad(a, c).block_until_ready()
        times.append(time.perf_counter() - t0)
    return Measurement.of([3 * nbytes / t for t in times])


def matmul_flops(n: int = 2048, reps: int = 7) -> Measurement:
    """float32 FLOP/s of an n x n x n matmul."""
    a = jnp.asarray(np.random.default_rng(1).standard_normal((n, n), np.float32))
    times = _time(jax.jit(lambda a, b: a @ b), a, a, reps=reps)
    return Measurement.of([2 * n ** 3 / t for t in times])
