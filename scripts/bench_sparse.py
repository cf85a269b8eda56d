"""DeepSeek-V3.2's top-k sparse latent attention against its dense MLA twin (4k-64k cached tokens), and gpt-oss's
sinks with alternating windows against all-full layers; the same as `jaxkv bench sparse`. See
jaxkv/bench/sparse.py."""

import sys

from jaxkv.bench.sparse import main

if __name__ == "__main__":
    sys.exit(main())
