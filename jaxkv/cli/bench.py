"""`jaxkv bench [NAME] ...`: handed to the benchmark's own main() by module name, imported only then.

The CLI's only tie to `jaxkv.bench` (the one package that imports torch and transformers): nothing else in the
library imports it, and this module names it only inside `run`, so `jaxkv --help` never loads a benchmark.
"""

from __future__ import annotations

import importlib

# `jaxkv bench NAME ...` -> the module whose main() runs it (also scripts/bench_NAME.py), and the line that
# `jaxkv bench --help` shows for it (here, not read from the module: listing them must not import torch).
BENCH_SCENARIOS = {
    "sharing": ("jaxkv.bench.sharing", "parallel samples of one prompt and prompt caching, against what users run "
                                       "instead"),
    "engine": ("jaxkv.bench.engine", "continuous batching (jaxkv.Engine) against static batches of the same "
                                     "requests"),
    "beam": ("jaxkv.bench.beam", "beam search on the paged cache against transformers' beam search"),
    "mla": ("jaxkv.bench.mla", "multi-head latent attention against its grouped-query twin of the same size"),
    "layers": ("jaxkv.bench.layers", "per-layer rings (local layers) against a full-length cache on every layer"),
    "speculative": ("jaxkv.bench.speculative", "speculative decoding against its analytic limit; the n-gram "
                                               "proposer"),
    "constrained": ("jaxkv.bench.constrained", "constrained decoding: host mask time per token, the step's extra "
                                               "time, engine throughput"),
    "hybrid": ("jaxkv.bench.hybrid", "a hybrid (linear-attention) model against its all-attention twin"),
    "sparse": ("jaxkv.bench.sparse", "top-k latent attention and sinks with sliding windows against dense twins"),
    "run-batch": ("jaxkv.bench.batch", "jaxkv run-batch against driving jaxkv.Engine directly"),
    "host-cache": ("jaxkv.bench.host_cache", "the prefix cache's host tier against recomputing and a device hit"),
    "data-parallel": ("jaxkv.bench.data_parallel", "the data-parallel engine's throughput per (data, model) mesh"),
}
HELP = f"benchmarks: decode speed and {len(BENCH_SCENARIOS)} more (see jaxkv bench --help)"


def add_parser(commands):
    """`bench` listed for --help only: `main` hands `jaxkv bench ...` to `run` before the parser sees it."""
    commands.add_parser("bench", add_help=False, help=HELP)


def listing() -> str:
    """What `jaxkv bench --help` says before the decode benchmark's own options: every benchmark, a line each."""
    width = max(map(len, BENCH_SCENARIOS))
    lines = ["usage: jaxkv bench [NAME] [options]", "",
             "benchmarks (jaxkv bench NAME --help shows one's options; the same code as scripts/bench_*.py):",
             f"  {'(no NAME)':<{width}}  decode: jaxkv against the memory-bandwidth roofline and transformers "
             f"(its options below)"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in BENCH_SCENARIOS.items()]
    return "\n".join(lines) + "\n"


def run(argv: list[str]) -> int:
    """`argv`: what follows `jaxkv bench`. A scenario name runs its module (each has its own options); anything
    else is the decode benchmark's options (scripts/bench.py, same code)."""
    if argv[:1] and argv[0] in BENCH_SCENARIOS:
        return importlib.import_module(BENCH_SCENARIOS[argv[0]][0]).main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(listing())
    from jaxkv.bench import decode

    return decode.main(argv)
