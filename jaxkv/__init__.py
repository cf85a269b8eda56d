"""jaxkv: KV-cached decoding for decoder-only transformers in JAX.

The public names are imported on first use (PEP 562), not here: `import jaxkv` stays cheap, so the `jaxkv`
command can read and check its arguments before JAX is imported. `jaxkv.generate`, `from jaxkv import generate`
and `dir(jaxkv)` work as with eager imports. A new public name is one more entry in `_EXPORTS`.
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys
import types as _types

# public name -> the module that defines it
_EXPORTS = {
    "CachePlan": "jaxkv.cache.planner",
    "BeamSearchResult": "jaxkv.beam_search",
    "Config": "jaxkv.config",
    "Decoded": "jaxkv.generate",
    "Choice": "jaxkv.constraints.spec",
    "Decoder": "jaxkv.model",
    "Engine": "jaxkv.engine",
    "Generation": "jaxkv.generate",
    "Grammar": "jaxkv.constraints.spec",
    "JsonSchema": "jaxkv.constraints.spec",
    "KVCache": "jaxkv.cache.contiguous",
    "Mla": "jaxkv.config",
    "SparseIndexer": "jaxkv.config",
    "WeightQuant": "jaxkv.layers.quantized",
    "LinearAttention": "jaxkv.config",
    "MoeConfig": "jaxkv.config",
    "Model": "jaxkv.model",
    "PRESETS": "jaxkv.config",
    "PagedKVCache": "jaxkv.cache.paged",
    "PrefixCache": "jaxkv.cache.prefix",
    "Regex": "jaxkv.constraints.spec",
    "RopeScaling": "jaxkv.rope_scaling",
    "LinearScaling": "jaxkv.rope_scaling",
    "ProportionalRope": "jaxkv.rope_scaling",
    "YarnScaling": "jaxkv.rope_scaling",
    "Sampler": "jaxkv.sampling",
    "Speculation": "jaxkv.decoding.speculation",
    "decode": "jaxkv.generate",
    "decode_step": "jaxkv.generate",
    "generate": "jaxkv.generate",
    "beam_search": "jaxkv.beam_search",
    "Hypothesis": "jaxkv.beam_search",
    "fork": "jaxkv.cache.paged",
    "generate_pmap": "jaxkv.generate",
    "kv_cache_bytes": "jaxkv.cache.planner",
    "left_pad": "jaxkv.generate",
    "load": "jaxkv.io.checkpoint",
    "logits": "jaxkv.model",
    "plan_cache": "jaxkv.cache.planner",
    "prefill": "jaxkv.generate",
    "release": "jaxkv.cache.paged",
    "save": "jaxkv.io.checkpoint",
    "score": "jaxkv.score",
}

__all__ = sorted(_EXPORTS)

# Modules that moved in the reshape (issue 28), old path -> new: the old path is the new module itself (the same
# object in sys.modules, private names included, so `from jaxkv.prefix_cache import _block_keys` and a
# monkeypatch through either path both work). New code imports the new path.
_OLD_MODULES = {
    "jaxkv.checkpoint": "jaxkv.io.checkpoint",
    "jaxkv.checkpoint_fp8": "jaxkv.io.fp8",
    "jaxkv.checkpoint_hf": "jaxkv.io.hf",
    "jaxkv.engine_programs": "jaxkv.engine.programs",
    "jaxkv.evaluate": "jaxkv.score",
    "jaxkv.memory": "jaxkv.cache.planner",
    "jaxkv.mla_attention": "jaxkv.layers.mla",
    "jaxkv.moe": "jaxkv.layers.moe",
    "jaxkv.paged_cache": "jaxkv.cache.paged",
    "jaxkv.prefix_cache": "jaxkv.cache.prefix",
}


class _OldModules(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Imports an old path (`_OLD_MODULES`) as its new module: one table instead of a stub file per old path."""

    def find_spec(self, name, path=None, target=None):
        if name in _OLD_MODULES:
            return _importlib_util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return _importlib.import_module(_OLD_MODULES[spec.name])  # its own name, spec and loader stay

    def exec_module(self, module):
        pass  # already executed, under its new name


_sys.meta_path.insert(0, _OldModules())


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # A submodule (jaxkv.sampling, jaxkv.memory, ...), as reachable after `import jaxkv` as when the eager
        # imports loaded them all.
        if name.isidentifier() and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
            return _importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS))


class _Package(_types.ModuleType):
    """Keeps a public function from being shadowed by the submodule of the same name. Importing `jaxkv.generate`
    (the module, from anywhere) makes Python set the package attribute `generate` to that module; the eager
    `from jaxkv.generate import generate` used to rebind it to the function, and this does the same."""

    def __setattr__(self, name, value):
        if isinstance(value, _types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
