"""Speculative decoding against its analytic limit and the n-gram proposer; the same as `jaxkv bench speculative`.
See jaxkv/bench/speculative.py."""

import sys

from jaxkv.bench.speculative import main

if __name__ == "__main__":
    sys.exit(main())
