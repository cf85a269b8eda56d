"""The family registry: `Family` (what jaxkv knows of one Hugging Face `model_type`), `register`, `get`, and
`of_config` (the family of a parsed config.json, by its `architectures[0]`).

A family says everything architecture-specific the loader needs; the loader (`jaxkv.io.hf`) asks it and has no
per-architecture branch of its own.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

from jaxkv.config import Config
from jaxkv.families.fields import Fields
from jaxkv.families.tensors import ROTARY_BUFFER, TensorSpec

BASE = {"model.": "lm_head.weight"}


@dataclasses.dataclass(frozen=True)
class MtpPlan:
    """The multi-token-prediction modules a checkpoint holds (DeepSeek-V3's `num_nextn_predict_layers`):
    `config`, the one-layer config each module's decoder layer runs with; `modules`, per module its stored-name
    prefix (every stored tensor under it is the module's) and the tensors it must hold, paths into that module's
    own params (`jaxkv.decoding.mtp`)."""

    config: Config
    modules: tuple[tuple[str, list[TensorSpec]], ...]


def _nothing_ignored(config: Config, hf: dict, names: Iterable[str], source: str) -> frozenset[str]:
    return frozenset()


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model type.

    Attributes:
      model_type: config.json's `model_type`, the registry key.
      architectures: the `architectures[0]` names it loads (the model classes: "LlamaForCausalLM", ...).
      config: Fields -> the `jaxkv.Config` keyword arguments (eos_ids excepted: the loader reads them).
      tensors: (config, config.json, the stored tensor names as in TensorSpec) -> every tensor the checkpoint
        must hold, embedding first, the untied head excepted (the loader adds it).
      prefixes: the base model's name prefix -> the untied head's name under it; a checkpoint uses one of them
        (or none: a base model saved alone). Multimodal models hold their language model under either of two.
      skipped: tensors outside the language model that jaxkv skips by design (vision / audio towers), or None.
      redundant: tensors dropped as carrying no learned state (rotary buffers, GPT-2's mask buffers).
      ignored: (config, config.json, stored names, source) -> names the checkpoint may hold that the model does
        not use and the loader drops (as transformers' `_keys_to_ignore_on_load_unexpected`).
      text_config: the language model's config is config.json's `text_config` (multimodal models); the head's
        tying (default true) and eos_token_id (when set) are then the outer config's.
      mtp: (config, config.json, stored names, source) -> the checkpoint's multi-token-prediction modules
        (`MtpPlan`), loaded apart from the decoder into `Model.mtp`, or None when it holds none.
    """

    model_type: str
    architectures: tuple[str, ...]
    config: Callable[[Fields], dict]
    tensors: Callable[[Config, dict, frozenset], list[TensorSpec]]
    prefixes: dict[str, str] = dataclasses.field(default_factory=lambda: dict(BASE))
    skipped: re.Pattern | None = None
    redundant: re.Pattern = ROTARY_BUFFER
    ignored: Callable[[Config, dict, Iterable[str], str], frozenset[str]] = _nothing_ignored
    text_config: bool = False
    mtp: Callable[[Config, dict, frozenset, str], MtpPlan | None] | None = None


_FAMILIES: dict[str, Family] = {}
_BY_ARCHITECTURE: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds `family`; its model_type and architectures must be new."""
    if family.model_type in _FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is already registered")
    for name in family.architectures:
        if name in _BY_ARCHITECTURE:
            raise ValueError(f"architecture {name!r} is already registered by {_BY_ARCHITECTURE[name].model_type!r}")
    _FAMILIES[family.model_type] = family
    _BY_ARCHITECTURE.update({name: family for name in family.architectures})
    return family


def model_types() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def architectures() -> tuple[str, ...]:
    """Every architecture name the registered families load, in registration order."""
    return tuple(_BY_ARCHITECTURE)


def get(model_type: str) -> Family:
    """The family registered under `model_type`; ValueError listing the supported ones otherwise."""
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(_FAMILIES)}")
    return family


def of_config(hf: dict, *, source: str) -> Family:
    """The family of a parsed config.json, by `architectures[0]` (the model class: what the loader has always
    required, and what tells a multimodal checkpoint's class apart)."""
    archs = hf.get("architectures")
    supported = ", ".join(_BY_ARCHITECTURE)
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"{source}: field 'architectures' must be a non-empty list of names, got {archs!r}; "
                         f"supported: {supported}")
    if archs[0] not in _BY_ARCHITECTURE:
        raise ValueError(f"{source}: unsupported architecture {archs[0]!r} (field 'architectures'); "
                         f"supported: {supported}")
    return _BY_ARCHITECTURE[archs[0]]
