"""Decode benchmarks against the roofline and transformers; the same as `jaxkv bench`. See jaxkv/bench/decode.py."""

import sys

from jaxkv.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
