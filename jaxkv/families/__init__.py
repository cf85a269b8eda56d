"""Model families: one module per Hugging Face family, each registering a `Family` per `model_type` it loads (its
architectures, config-field mapping, tensor names, ignored and redundant tensors).

  registry.py  Family, register, get(model_type), of_config (by `architectures[0]`), the supported lists
  fields.py    the config.json reader (`Fields`, caps) and the parsers families share (rope, layer types, eos)
  tensors.py   TensorSpec, its converters, and the spec lists families share (Llama-style decoder, experts)
  llama.py     llama, mistral, qwen2          qwen3.py     qwen3
  gemma.py     gemma2, gemma3_text, gemma3    gemma4.py    gemma4_text, gemma4
  gpt2.py      gpt2                           deepseek.py  deepseek_v2, deepseek_v3, deepseek_v32
  qwen3_moe.py qwen3_moe                      mixtral.py   mixtral
  qwen3_next.py qwen3_next (hybrid)          qwen3_5.py   qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe
  glm4_moe.py  glm4_moe                       gpt_oss.py   gpt_oss
  llama4.py    llama4_text, llama4

Importing the package imports every module in it, so each family registers itself: adding one is a module here
and its parity test, nothing else (docs/design/families.md). May import jaxkv.config (and numpy); the loader
(`jaxkv.io.hf`) imports this package, never the reverse.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from jaxkv.families.registry import Family, architectures, get, model_types, of_config, register

__all__ = ["Family", "architectures", "get", "model_types", "of_config", "register"]

_SHARED = {"registry", "fields", "tensors"}  # the modules that define no family

# In name order, which is the order of the supported lists in error messages.
for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if _module not in _SHARED:
        _importlib.import_module(f"{__name__}.{_module}")
