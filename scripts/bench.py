"""Decode benchmarks against the roofline and transformers; the same as `jaxkv bench`. See jaxkv/bench.py."""

import sys

from jaxkv.bench import main

if __name__ == "__main__":
    sys.exit(main())
