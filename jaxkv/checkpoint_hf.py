"""The old path of `jaxkv.io.hf` (the Hugging Face loader), kept for users: `jaxkv.checkpoint_hf` is that module,
private names included."""

import sys

from jaxkv.io import hf as _m

sys.modules[__name__] = _m
