"""The prefix cache's host tier: time to first token of a host hit against recomputing the prefix and a device
hit; the same as `jaxkv bench host-cache`. See jaxkv/bench/host_cache.py."""

import sys

from jaxkv.bench.host_cache import main

if __name__ == "__main__":
    sys.exit(main())
