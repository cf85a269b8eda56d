"""The data-parallel engine's throughput per ("data", "model") mesh on the same requests; the same as
`jaxkv bench data-parallel`. See jaxkv/bench/data_parallel.py."""

import sys

from jaxkv.bench.data_parallel import main

if __name__ == "__main__":
    sys.exit(main())
