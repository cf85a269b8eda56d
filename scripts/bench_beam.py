"""Beam search (`jaxkv.beam_search`) on the paged cache against transformers' beam search; the same as
`jaxkv bench beam`. See jaxkv/bench/beam.py."""

import sys

from jaxkv.bench.beam import main

if __name__ == "__main__":
    sys.exit(main())
