"""Parallel samples and prompt caching against the unshared path and transformers; the same as
`jaxkv bench sharing`. See jaxkv/bench/sharing.py."""

import sys

from jaxkv.bench.sharing import main

if __name__ == "__main__":
    sys.exit(main())
