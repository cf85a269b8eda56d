"""An MLA model against its grouped-query twin of the same size: cache bytes per token and decode speed at long
context; the same as `jaxkv bench mla`. See jaxkv/bench/mla.py."""

import sys

from jaxkv.bench.mla import main

if __name__ == "__main__":
    sys.exit(main())
