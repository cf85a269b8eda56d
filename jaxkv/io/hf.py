"""Loads a local Hugging Face checkpoint directory (config.json + safetensors weights) into a `jaxkv.Model`.

What is particular to an architecture (its config fields, tensor names, ignored and redundant tensors, name
prefixes) is its family's (`jaxkv.families`, one module per family, registered by model_type and found by
config.json's `architectures[0]`); this module asks the family and has no per-architecture branch. The loader works
in two phases so that a bad checkpoint fails with a clear `ValueError` or `FileNotFoundError` (naming the file,
tensor or config field) before anything large is allocated:

  1. Plan (small reads only): parse config.json into a `jaxkv.Config` (with caps on every size), derive the exact
     list of tensors and shapes that config implies (`Family.tensors`), and read the safetensors headers (names,
     shapes, dtypes; `jaxkv.io.safetensors_files`). Every expected tensor must be present with the expected
     shape, and every tensor present must be expected, ignored by the family, or a known redundant one.
  2. Load: read one tensor at a time, convert it to jaxkv's layout, cast it, and put it on the device.

The families' tables give each matrix in its [out, in] form; the loader then transposes those the config stores
[in, out] (`jaxkv.layers.in_out_names`, `OUT_IN_ORDER`: wq [D, N, H], wo [N, H, D], w_gate [D, F], ...; embeddings
and lm_head stay [V, D]). Redundant tensors that are dropped: `lm_head.weight` of a tied model (only after
checking that it equals the embedding) and those the family names (`Family.redundant`, `Family.ignored`); skipped
by design: the vision / audio towers of multimodal models (`Family.skipped`). Any other unused tensor is an error:
it most likely means the architecture is mis-mapped.

A family's extra modules outside the decoder (DeepSeek-V3's multi-token prediction, `Family.mtp`) are matched
the same way, each against its own tensor list, and load into `Model.mtp`; the decoder's params are the same
with or without them.

Also from config.json: `eos_token_id` (int or list) becomes Config.eos_ids, joined by generation_config.json's
when the directory has one (`generation_eos_ids`). Weights keep the checkpoint's dtype
unless `load_hf(..., dtype=...)` casts them; Config.dtype always records the params' dtype. Block-quantized FP8
checkpoints are dequantized at load (`jaxkv.io.fp8`), and so are MXFP4 ones (gpt-oss's experts, `jaxkv.io.mxfp4`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxkv import families
from jaxkv import moe as moe_lib
from jaxkv.config import DTYPES, Config
from jaxkv.decoding.mtp import Mtp
from jaxkv.families import tensors
from jaxkv.families.fields import MAX_PARAMS, Fields, eos_ids
from jaxkv.families.registry import Family
from jaxkv.families.tensors import TensorSpec
from jaxkv.io import fp8, mxfp4
from jaxkv.io.generation import FILE as GENERATION_CONFIG_FILE, SamplingDefaults, json_object as _json_object
from jaxkv.io.generation import read_file as read_generation_config
from jaxkv.io.safetensors_files import FLOAT_DTYPES, StoredTensor, read_headers, weight_files
from jaxkv.io.safetensors_files import read as _read
from jaxkv.layers import ALL_OUT_IN_ORDER, in_out_names
from jaxkv.model import Model

CONFIG_FILE = "config.json"
ARCHITECTURES = families.architectures()  # every `architectures[0]` a registered family loads


def read_config(directory: str | os.PathLike) -> dict:
    """The parsed config.json of a checkpoint directory. FileNotFoundError / ValueError naming the file."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; a Hugging Face checkpoint directory needs a {CONFIG_FILE}")
    return _json_object(path)


def generation_eos_ids(generation: dict | None, config: Config, *, source: str) -> tuple[int, ...]:
    """Config.eos_ids joined by generation_config.json's `eos_token_id` (an int or a list): chat releases list
    their end-of-turn tokens only there (Llama 3 and Qwen2.5 instruct, Gemma's <end_of_turn>), and transformers'
    `generate` stops at them. The config's ids first, then the new ones in the file's order."""
    if generation is None:
        return config.eos_ids
    extra = eos_ids(Fields(generation, source), config.vocab_size)
    return config.eos_ids + tuple(i for i in dict.fromkeys(extra) if i not in config.eos_ids)


def architecture(hf: dict, *, source: str) -> str:
    """`architectures[0]` of the config, which must be one a registered family loads."""
    families.of_config(hf, source=source)
    return hf["architectures"][0]


def config_from_hf(hf_config: dict, *, source: str) -> Config:
    """The `jaxkv.Config` of a Hugging Face config.json (already parsed). `source` names it in error messages.

    Raises ValueError for an unsupported architecture or option, a missing or mistyped field, or a value beyond
    the sanity caps (`jaxkv.families.fields.MAX_*`), naming the field. The returned config has dtype "float32";
    `load_hf` sets the weights' dtype.
    """
    if not isinstance(hf_config, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(hf_config).__name__}")
    family = families.of_config(hf_config, source=source)
    fields = eos_fields = Fields(hf_config, source)
    if family.text_config:
        text = fields.text_config()
        kwargs = family.config(text)
        # the head's tying is the outer config's; transformers' generation config takes eos from the outer config,
        # then from text_config
        kwargs["tie_embeddings"] = fields.bool("tie_word_embeddings", True)
        eos_fields = fields if hf_config.get("eos_token_id") is not None else text
    else:
        kwargs = family.config(fields)
    kwargs["eos_ids"] = eos_ids(eos_fields, kwargs["vocab_size"])
    config = Config(**kwargs)
    if config.param_count() > MAX_PARAMS:
        raise ValueError(f"{source}: the config implies {config.param_count():,} parameters, beyond the supported "
                         f"maximum {MAX_PARAMS:,}; the config is likely corrupt")
    return config


def checkpoint_names(stored: dict[str, StoredTensor],
                     family: Family) -> tuple[dict[str, StoredTensor], Callable[[str], str]]:
    """(the stored tensors keyed by the names TensorSpec uses, how the checkpoint would spell such a name).

    The base model's tensors under one of the family's prefixes (or none: a base model saved alone, e.g. the
    original `gpt2` upload), the head under its name there; the family's `skipped` tensors (multimodal models'
    vision and audio towers) are left out here, the only tensors of any checkpoint skipped by design."""
    prefixes = family.prefixes
    used = [p for p in prefixes if any(name.startswith(p) for name in stored)]
    if len(used) > 1:
        raise ValueError(f"the checkpoint holds language-model tensors under both {used[0]!r} and {used[1]!r}; "
                         f"expected one of the two naming schemes")
    prefix = used[0] if used else next(iter(prefixes))
    by_name: dict[str, StoredTensor] = {}
    for name, t in stored.items():
        if family.skipped is not None and family.skipped.fullmatch(name):
            continue
        key = "lm_head.weight" if name in prefixes.values() else name.removeprefix(prefix)
        if key in by_name:
            raise ValueError(f"tensors {by_name[key].name!r} and {name!r} are both the model's {key!r}")
        by_name[key] = t
    # top-level groups stored outside the prefix (Qwen3-Next's `mtp.*`): a missing name of theirs is spelt as is
    outside = {key.split(".")[0] for key, t in by_name.items() if t.name == key}

    def stored_name(name: str) -> str:
        if name == "lm_head.weight":
            return prefixes[prefix]
        if name in by_name:
            return by_name[name].name
        return name if name.split(".")[0] in outside else prefix + name

    return by_name, stored_name


def tensor_specs(family: Family, config: Config, hf: dict, names) -> list[TensorSpec]:
    """Every tensor a checkpoint of `family` with `config` must hold (`names`: the stored ones, keyed as in
    `checkpoint_names`, for families whose naming varies by release), the embedding first."""
    return family.tensors(config, hf, frozenset(names)) + tensors.lm_head(config)


def match(specs: list[TensorSpec], by_name: dict[str, StoredTensor], stored_name: Callable[[str], str], *,
          family: Family, tied: bool, ignored: frozenset[str] = frozenset(),
          fp8_weights: bool = False,
          mxfp4_weights: bool = False) -> tuple[list[tuple[TensorSpec, StoredTensor]], StoredTensor | None]:
    """Pairs every expected tensor with its stored one (`checkpoint_names`), checking names, shapes and dtypes;
    refuses leftovers.

    Returns (pairs, the stored lm_head of a tied model, to be compared with the embedding, or None). The first
    pair is the embedding. `ignored`: names that may be present and are dropped (`Family.ignored`).
    `fp8_weights`: a block-quantized FP8 checkpoint, whose weights may also be F8_E4M3 (their scales already split
    off, `fp8.split_scales`). `mxfp4_weights`: an MXFP4 checkpoint, whose joined block/scale pairs
    (`mxfp4.join`) are weights too.
    """
    dtypes = [*FLOAT_DTYPES, *([fp8.F8_DTYPE] if fp8_weights else []), *([mxfp4.DTYPE] if mxfp4_weights else [])]
    by_name = dict(by_name)
    pairs = []
    for spec in specs:
        t = by_name.pop(spec.name, None)
        if t is None:
            raise ValueError(f"tensor {stored_name(spec.name)!r} is missing from the checkpoint")
        if t.shape != spec.shape:
            raise ValueError(f"tensor {t.name!r} in {t.file} has shape {list(t.shape)}, but config.json implies "
                             f"{spec.letters} = {list(spec.shape)}")
        if t.dtype not in dtypes:
            hint = " (an FP8 checkpoint needs its quantization_config in config.json)" if "F8" in t.dtype else ""
            raise ValueError(f"tensor {t.name!r} in {t.file} has dtype {t.dtype}; expected one of "
                             f"{', '.join(dtypes)}{hint}")
        pairs.append((spec, t))
    tied_head = by_name.pop("lm_head.weight", None) if tied else None
    if tied_head is not None and tied_head.shape != pairs[0][1].shape:
        raise ValueError(f"tensor 'lm_head.weight' in {tied_head.file} has shape {list(tied_head.shape)}, but the "
                         f"model ties it to the embedding of shape {list(pairs[0][1].shape)}")
    for name, t in by_name.items():
        if not family.redundant.fullmatch(name) and name not in ignored:
            raise ValueError(f"tensor {t.name!r} in {t.file} is not used by this architecture (is config.json's "
                             f"'architectures' right?)")
    return pairs, tied_head


def load_hf(directory: str | os.PathLike, *, dtype: str | None = None) -> Model:
    """Loads a Hugging Face checkpoint directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json) of a supported architecture (see ARCHITECTURES) into a `jaxkv.Model`.

    Args:
      directory: the checkpoint directory.
      dtype: "float32", "bfloat16" or "float16" to cast the weights to; None keeps the checkpoint's dtype (that
        of its embedding, for a checkpoint that mixes dtypes).

    Returns:
      Model(config, params, tokenizer=None, mtp), with config.dtype the params' dtype and `mtp` the family's
      multi-token-prediction modules (`jaxkv.decoding.mtp.Mtp`, same dtype) or None.

    Raises:
      FileNotFoundError: the directory, config.json, or a weight file or shard is missing.
      ValueError: anything else wrong with the checkpoint (see the module docstring), before large allocations.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be None or one of {DTYPES}, got {dtype!r}")
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    hf = read_config(root)
    source = str(root / CONFIG_FILE)
    family = families.of_config(hf, source=source)
    config = config_from_hf(hf, source=source)
    generation_file = read_generation_config(root)
    config = config.replace(eos_ids=generation_eos_ids(generation_file, config,
                                                       source=str(root / GENERATION_CONFIG_FILE)))
    sampling_defaults = None if generation_file is None else SamplingDefaults.from_dict(
        generation_file, source=str(root / GENERATION_CONFIG_FILE))  # before the weights: a bad file costs nothing
    mx = mxfp4.declared(hf)  # MXFP4 (gpt-oss): dequantized at load
    block = None if mx else fp8.block_size(hf, source=source)  # block-quantized FP8: dequantized at load
    stored, scales = fp8.split_scales(read_headers(*weight_files(root)), block)
    if mx:  # each (blocks, scales) pair becomes one weight; `scales` maps it to its pair
        stored, scales = mxfp4.join(stored)
    by_name, stored_name = checkpoint_names(stored, family)
    plan = None if family.mtp is None else family.mtp(config, hf, frozenset(by_name), source)
    mtp_stored = {}
    if plan is not None:  # the multi-token-prediction modules' tensors, matched apart from the decoder's
        prefixes = tuple(prefix for prefix, _ in plan.modules)
        mtp_stored = {name: t for name, t in by_name.items() if name.startswith(prefixes)}
        by_name = {name: t for name, t in by_name.items() if name not in mtp_stored}
    specs = tensor_specs(family, config, hf, by_name)
    pairs, tied_head = match(specs, by_name, stored_name, family=family, tied=config.tie_embeddings,
                             ignored=family.ignored(config, hf, by_name, source), fp8_weights=block is not None,
                             mxfp4_weights=mx)
    mtp_pairs = [match(module, {name: t for name, t in mtp_stored.items() if name.startswith(prefix)}, stored_name,
                       family=family, tied=False, fp8_weights=block is not None, mxfp4_weights=mx)[0]
                 for prefix, module in (plan.modules if plan is not None else ())]
    if tied_head is not None:
        _check_tied_head(tied_head, pairs[0][1])
    target = dtype or FLOAT_DTYPES.get(pairs[0][1].dtype, "bfloat16")
    config = config.replace(dtype=target)  # the weight layout follows the dtype (`layers.stored_out_in`)
    params = _load(pairs, target, config, scales, block)
    mtp = None if plan is None else _load_mtp(plan.config.replace(dtype=target), mtp_pairs, params, scales, block)
    return Model(config=config, params=params, tokenizer=None, mtp=mtp, sampling_defaults=sampling_defaults)


def _load_mtp(config: Config, modules, main: dict, scales, block) -> Mtp:
    """The multi-token-prediction modules' params (`jaxkv.decoding.mtp.Mtp`), one dict per module; a module's
    embedding or head kept only where it differs from the decoder's (DeepSeek-V3's release repeats both in its
    module, which would double their memory)."""
    shared = {"embedding": main["embedding"], "lm_head": main.get("lm_head", main["embedding"])}
    loaded = []
    for pairs in modules:
        params = _load(pairs, config.dtype, config, scales, block)
        for name, table in shared.items():
            if name in params and np.array_equal(np.asarray(params[name]), np.asarray(table)):
                del params[name]
        loaded.append(params)
    return Mtp(config, tuple(loaded))


def _check_tied_head(head: StoredTensor, embedding: StoredTensor):
    """A tied model's stored lm_head is redundant only if it really equals the embedding."""
    if not np.array_equal(_read(head), _read(embedding)):
        raise ValueError(f"tensor 'lm_head.weight' in {head.file} differs from the embedding {embedding.name!r}, "
                         f"but config.json sets tie_word_embeddings, so it would be silently dropped")


def _load(pairs: list[tuple[TensorSpec, StoredTensor]], target: str, config: Config, scales=None,
          block=None) -> dict:
    """Reads, converts and casts each tensor in turn (one host copy at a time) into the nested params dict; an
    FP8 weight is dequantized with its block scales first (`scales`: weight name -> scale tensor), an MXFP4 one
    from its (blocks, scales) pair (`scales`: weight name -> the pair)."""
    params: dict = {}
    in_out = in_out_names(config)
    for spec, t in pairs:
        w = None if t.dtype == mxfp4.DTYPE else _read(t)
        if t.dtype == fp8.F8_DTYPE:
            w = fp8.dequantize(w, _read(scales[t.name]), block)
        elif t.dtype == mxfp4.DTYPE:
            w = mxfp4.read_joined(scales[t.name])
        # safetensors has no checksum; random bytes in the data region usually decode to some NaN or inf.
        if not np.isfinite(w).all():
            raise ValueError(f"tensor {t.name!r} in {t.file} holds NaN or infinite values (corrupt checkpoint?)")
        for path, value in spec.convert(w).items():
            if path[-1] in in_out:  # the mapping above is to the [out, in] form; this weight is stored [in, out]
                value = np.ascontiguousarray(value.transpose(ALL_OUT_IN_ORDER[path[-1]]))
            # the router stays float32 whatever the model's dtype (`jaxkv.layers.moe.Moe` declares it so)
            dtype = "float32" if path[-1] in moe_lib.FLOAT32_PARAMS else target
            with np.errstate(over="ignore"):  # reported just below, with the tensor's name
                value = value.astype(dtype)
            if not np.isfinite(value).all():
                raise ValueError(f"tensor {t.name!r} in {t.file} overflows {dtype}; load it with a wider dtype")
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            # one expert of a per-expert checkpoint stays on the host until `_stack_experts`
            node[path[-1]] = value if isinstance(path[-1], int) else jnp.asarray(value)
    if config.moe is not None:
        _stack_experts(params, config, target)
    return params


def _stack_experts(params: dict, config: Config, dtype: str):
    """Each MoE layer's experts as [X, ...] arrays (stacked from per-expert tensors, which `_load` put under the
    expert's index), then the experts and shared experts laid out as `jaxkv.layers.moe.in_out_names` says for
    `dtype`."""
    m = config.moe
    for i in range(config.n_layers):
        if not m.is_moe_layer(i):
            continue
        node = params[f"layer_{i}"]["mlp"]
        for name in ("we_gate", "we_up", "we_down"):
            if isinstance(node[name], dict):
                node[name] = np.stack([node[name][j] for j in range(m.n_routed_experts)])
        laid_out = moe_lib.from_out_in({k: node[k] for k in moe_lib.OUT_IN_ORDER if k in node}, m, config.d_model,
                                       dtype)
        node.update({k: jnp.asarray(v) for k, v in laid_out.items()})
