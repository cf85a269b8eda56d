"""A Gemma-3-shaped model with per-layer rings against the same model with a full-length cache on every layer:
cache bytes and decode speed at long context; the same as `jaxkv bench layers`. See jaxkv/bench/layers.py."""

import sys

from jaxkv.bench.layers import main

if __name__ == "__main__":
    sys.exit(main())
