"""The old path of `jaxkv.io.fp8` (block-quantized FP8 checkpoints), kept for users: `jaxkv.checkpoint_fp8` is that
module, private names included."""

import sys

from jaxkv.io import fp8 as _m

sys.modules[__name__] = _m
