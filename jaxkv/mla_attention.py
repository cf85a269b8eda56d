"""The old path of the multi-head latent attention layer, kept for users: the module is `jaxkv.layers.mla`."""

import sys

from jaxkv.layers import mla as _m

sys.modules[__name__] = _m
