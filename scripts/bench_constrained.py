"""Constrained decoding's costs (mask time per token, the step's extra time, engine throughput at 0/50/100%
constrained); the same as `jaxkv bench constrained`. See jaxkv/bench/constrained.py."""

import sys

from jaxkv.bench.constrained import main

if __name__ == "__main__":
    sys.exit(main())
