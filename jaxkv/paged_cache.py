"""The old path of `jaxkv.cache.paged`, kept for users and scripts.

`jaxkv.paged_cache` is that module itself, not a copy: every name resolves, private ones included. New code imports
`jaxkv.cache.paged`.
"""

import sys

from jaxkv.cache import paged as _module

sys.modules[__name__] = _module
