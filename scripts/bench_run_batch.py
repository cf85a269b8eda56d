"""`jaxkv run-batch` against driving `jaxkv.Engine` directly on the same requests; the same as
`jaxkv bench run-batch`. See jaxkv/bench/batch.py."""

import sys

from jaxkv.bench.batch import main

if __name__ == "__main__":
    sys.exit(main())
