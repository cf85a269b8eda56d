"""The old path of `jaxkv.io.checkpoint` (load, save, the jaxkv directory format), kept for users:
`jaxkv.checkpoint` is that module, private names included."""

import sys

from jaxkv.io import checkpoint as _m

sys.modules[__name__] = _m
