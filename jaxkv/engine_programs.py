"""The old path of `jaxkv.engine.programs`, kept for users and scripts: `jaxkv.engine_programs` is that module
itself (private names included), not a copy. New code imports `jaxkv.engine.programs`."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("jaxkv.engine.programs")
