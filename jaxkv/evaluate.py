"""The old home of `cached_nll`, now `jaxkv.score.cached_nll` (scoring lives in one module): kept so that
`jaxkv.evaluate.cached_nll` still works."""

import importlib
import sys

# By import_module: `from jaxkv import score` would give the function `jaxkv.score`, not the module.
sys.modules[__name__] = importlib.import_module("jaxkv.score")
