"""`jaxkv bench [NAME] ...`: handed to the benchmark's own main() by module name, imported only then.

The CLI's only tie to `jaxkv.bench` (the one package that imports torch and transformers): nothing else in the
library imports it, and this module names it only inside `run`, so `jaxkv --help` never loads a benchmark.
"""

from __future__ import annotations

import importlib

# `jaxkv bench NAME ...` -> the module whose main() runs it (also scripts/bench_NAME.py)
BENCH_SCENARIOS = {"sharing": "jaxkv.bench.sharing", "engine": "jaxkv.bench.engine", "beam": "jaxkv.bench.beam",
                   "mla": "jaxkv.bench.mla", "layers": "jaxkv.bench.layers",
                   "speculative": "jaxkv.bench.speculative", "constrained": "jaxkv.bench.constrained",
                   "hybrid": "jaxkv.bench.hybrid", "sparse": "jaxkv.bench.sparse", "run-batch": "jaxkv.bench.batch",
                   "host-cache": "jaxkv.bench.host_cache", "data-parallel": "jaxkv.bench.data_parallel"}


def add_parser(commands):
    """`bench` listed for --help only: `main` hands `jaxkv bench ...` to `run` before the parser sees it."""
    commands.add_parser("bench", add_help=False,
                        help="decode benchmarks against the memory roofline and transformers (see jaxkv bench --help)")


def run(argv: list[str]) -> int:
    """`argv`: what follows `jaxkv bench`. A scenario name runs its module (each has its own options); anything
    else is the decode benchmark's options (scripts/bench.py, same code)."""
    if argv[:1] and argv[0] in BENCH_SCENARIOS:
        return importlib.import_module(BENCH_SCENARIOS[argv[0]]).main(argv[1:])
    from jaxkv.bench import decode

    return decode.main(argv)
