"""The old path of `jaxkv.cache.planner`, kept for users and scripts.

`jaxkv.memory` is that module itself, not a copy: every name resolves, private ones included. New code imports
`jaxkv.cache.planner`.
"""

import sys

from jaxkv.cache import planner as _module

sys.modules[__name__] = _module
