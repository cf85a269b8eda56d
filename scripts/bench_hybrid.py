"""A Qwen3-Next-shaped hybrid model against its all-attention twin of the same size: cache bytes and decode speed
at 1k-16k cached tokens; the same as `jaxkv bench hybrid`. See jaxkv/bench/hybrid.py."""

import sys

from jaxkv.bench.hybrid import main

if __name__ == "__main__":
    sys.exit(main())
