"""The old path of the mixture of experts, kept for users: the module is `jaxkv.layers.moe`."""

import sys

from jaxkv.layers import moe as _m

sys.modules[__name__] = _m
