"""Continuous batching (`jaxkv.Engine`) against static batches of jaxkv.generate and transformers; the same as
`jaxkv bench engine`. See jaxkv/bench/engine.py."""

import sys

from jaxkv.bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
