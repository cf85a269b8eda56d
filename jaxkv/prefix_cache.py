"""The old path of `jaxkv.cache.prefix`, kept for users and scripts.

`jaxkv.prefix_cache` is that module itself, not a copy: every name resolves, private ones included. New code imports
`jaxkv.cache.prefix`.
"""

import sys

from jaxkv.cache import prefix as _module

sys.modules[__name__] = _module
