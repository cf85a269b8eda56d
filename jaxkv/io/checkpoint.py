"""Loading and saving models: `load` (Hugging Face directory, jaxkv directory or "tiny") and `save` (orbax).

A jaxkv directory holds:
  jaxkv_config.json  the Config, as JSON, with a format version
  params/            the parameter tree, an orbax checkpoint
  tokenizer.json     the tokenizer (`tokenizers` format), when the model has one
  weights.json       how the weights are quantized (`jaxkv.WeightQuant` as JSON), when they are: each quantized
                     weight is then stored as {"qvalue", "scale"} (int8 / float8_e4m3fn / int4 values, float32
                     scales), read back bit-exactly without quantizing again

Restore checks every stored array's shape and dtype against what the config implies before reading any array, and
refuses a mismatch instead of casting silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp

from jaxkv.config import DTYPES, Config, LinearAttention, LinearScaling, Mla, MoeConfig, ProportionalRope, RopeScaling, YarnScaling
from jaxkv.io import generation
from jaxkv.layers import moe as moe_lib
from jaxkv.io.hf import load_hf
from jaxkv.layers import quantized
from jaxkv.model import Model, from_out_in, param_shapes, quantize_weights, to_out_in, weight_layout

CONFIG_FILE = "jaxkv_config.json"
PARAMS_DIR = "params"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "weights.json"
FORMAT_VERSION = 2  # 2: weights laid out as `layers.in_out_names` says; 1: all [out, in] (converted on read)
READ_VERSIONS = (1, 2)
TINY_DIR = pathlib.Path(__file__).parents[1] / "tiny"  # jaxkv/tiny, the bundled model


def config_to_dict(config: Config) -> dict:
    return {"format_version": FORMAT_VERSION, **dataclasses.asdict(config)}


def config_from_dict(data: dict, *, source: str) -> Config:
    data = dict(data)
    version = data.pop("format_version", None)
    if version not in READ_VERSIONS:
        raise ValueError(f"{source}: unsupported format_version {version!r} (this jaxkv reads {READ_VERSIONS})")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{source}: unknown config field(s) {unknown}")
    # Nested configs are stored as objects; Llama-3 scaling, linear scaling, proportional rope and YaRN are told
    # apart by their fields.
    scaling = data.get("rope_scaling")
    if scaling is not None:
        kind = (RopeScaling if isinstance(scaling, dict) and "low_freq_factor" in scaling
                else LinearScaling if isinstance(scaling, dict) and set(scaling) == {"factor"}
                else ProportionalRope if isinstance(scaling, dict) and "rotary_fraction" in scaling else YarnScaling)
        data["rope_scaling"] = _nested(kind, scaling, "rope_scaling", source)
    if data.get("mla") is not None:
        data["mla"] = _nested(Mla, data["mla"], "mla", source)
    if data.get("linear_attention") is not None:
        data["linear_attention"] = _nested(LinearAttention, data["linear_attention"], "linear_attention", source)
    if data.get("moe") is not None:
        moe = data["moe"]
        if isinstance(moe, dict) and isinstance(moe.get("dense_layers"), list):  # JSON has no tuples
            moe = dict(moe, dense_layers=tuple(moe["dense_layers"]))
        data["moe"] = _nested(MoeConfig, moe, "moe", source)
    if "eos_ids" in data:
        data["eos_ids"] = tuple(data["eos_ids"])
    if data.get("layer_types") is not None:
        data["layer_types"] = tuple(data["layer_types"])
    try:
        return Config(**data)
    except TypeError as e:  # a missing required field
        raise ValueError(f"{source}: {e}") from None


def _nested(kind, value, field: str, source: str):
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {field} must be an object, got {value!r}")
    try:
        return kind(**value)
    except TypeError as e:  # a missing or unknown field
        raise ValueError(f"{source}: {field}: {e}") from None


def _check_dtype(dtype):
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def cast(model: Model, dtype: str | None) -> Model:
    """The model with parameters (and config.dtype) cast to `dtype`; None returns it unchanged."""
    _check_dtype(dtype)
    if dtype is None or dtype == model.config.dtype:
        return model
    if model.weights is not None:
        raise ValueError(f"the model's weights are quantized ({model.weights.mode}); cast the float model to "
                         f"{dtype} before quantizing it")
    config = model.config.replace(dtype=dtype)

    def convert(path, a):  # a mixture of experts' router stays float32, as transformers keeps it (`jaxkv.moe.Moe`)
        return a if path[-1].key in moe_lib.FLOAT32_PARAMS else a.astype(jnp.dtype(dtype))

    def convert_tree(params, old: Config, new: Config):
        params = jax.tree_util.tree_map_with_path(convert, params)
        # the layout follows the dtype (`layers.stored_out_in`)
        if weight_layout(new)[0] != weight_layout(old)[0]:
            params = jax.tree_util.tree_map(jnp.asarray, from_out_in(to_out_in(params, old), new))
        return params

    mtp = model.mtp  # DeepSeek's multi-token-prediction modules (`jaxkv.decoding.mtp.Mtp`), cast alike
    if mtp is not None:
        block = mtp.config.replace(dtype=dtype)
        mtp = dataclasses.replace(mtp, config=block,
                                  params=tuple(convert_tree(p, mtp.config, block) for p in mtp.params))
    return Model(config, convert_tree(model.params, model.config, config), model.tokenizer, mtp,
                 model.sampling_defaults)


def _load_tokenizer(directory: pathlib.Path):
    path = directory / TOKENIZER_FILE
    if not path.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"{path}: reading it needs the `tokenizers` package (pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types for malformed files
        raise ValueError(f"{path}: not a valid tokenizer file ({e})") from None


def save(model: Model, directory: str | os.PathLike) -> None:
    """Writes `model` (config, parameters, tokenizer, sampling defaults as generation_config.json) to a new
    directory; refuses to overwrite one."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory}: exists and is not empty; refusing to overwrite it")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_dict(model.config), indent=2) + "\n")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / PARAMS_DIR, _stored_form(model.params))
    checkpointer.wait_until_finished()
    if model.weights is not None:
        (directory / WEIGHTS_FILE).write_text(json.dumps(model.weights.to_dict(), indent=2) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save(str(directory / TOKENIZER_FILE))
    generation.write(model.sampling_defaults, directory)


def load_saved(directory: str | os.PathLike, *, dtype: str | None = None) -> Model:
    """Reads a directory written by `save`, bit-exactly."""
    import orbax.checkpoint as ocp

    _check_dtype(dtype)
    directory = pathlib.Path(directory).absolute()
    config_path = directory / CONFIG_FILE
    try:
        data = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{config_path}: missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    version = data.get("format_version")
    config = config_from_dict(data, source=str(config_path))
    quant = _read_weights(directory / WEIGHTS_FILE)
    if quant is not None and version == 1:
        raise ValueError(f"{config_path}: format_version 1 predates quantized weights")
    params_dir = directory / PARAMS_DIR
    if not params_dir.is_dir():
        raise FileNotFoundError(f"{params_dir}: missing parameter checkpoint")
    checkpointer = ocp.StandardCheckpointer()
    try:
        stored = checkpointer.metadata(params_dir).item_metadata.tree
    except Exception as e:  # orbax raises assorted types for a damaged checkpoint
        raise ValueError(f"{params_dir}: unreadable orbax checkpoint ({e})") from None
    expected = param_shapes(config)
    if version == 1:  # stored in the [out, in] form
        expected = to_out_in(expected, config)
    if quant is not None:
        expected = _stored_form(jax.eval_shape(lambda p: quantized.quantize_params(p, quant, *weight_layout(config)),
                                               expected))
    _check_against_config(stored, expected, str(params_dir))
    params = checkpointer.restore(params_dir)
    if version == 1:
        params = jax.tree_util.tree_map(jnp.asarray, from_out_in(params, config))
    model = Model(config, _from_stored_form(params), _load_tokenizer(directory),
                  sampling_defaults=generation.read(directory), weights=quant)
    return cast(model, dtype)


def _stored_form(params):
    """The params tree as saved: each quantized weight (a qwix QArray) as {"qvalue", "scale"}."""
    return jax.tree.map(lambda w: {"qvalue": w.qvalue, "scale": w.scale} if quantized.is_quantized(w) else w,
                        params, is_leaf=quantized.is_quantized)


def _from_stored_form(params):
    """The inverse of `_stored_form`."""
    if isinstance(params, dict) and set(params) == {"qvalue", "scale"}:
        return quantized.QArray(jnp.asarray(params["qvalue"]), jnp.asarray(params["scale"]))
    if isinstance(params, dict):
        return {k: _from_stored_form(v) for k, v in params.items()}
    return params


def _read_weights(path: pathlib.Path):
    """The WeightQuant of a saved directory's weights.json, or None without one."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return quantized.WeightQuant.from_dict(data, source=str(path))


def _check_against_config(stored, expected, source: str):
    """Every expected array is stored with its exact shape and dtype, and nothing else is stored."""
    flat_stored = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    flat_expected = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(expected)[0]}
    missing = sorted(set(flat_expected) - set(flat_stored))
    extra = sorted(set(flat_stored) - set(flat_expected))
    if missing:
        raise ValueError(f"{source}: missing parameter(s) {missing[:5]}")
    if extra:
        raise ValueError(f"{source}: parameter(s) not used by this config {extra[:5]}")
    for name, want in flat_expected.items():
        got = flat_stored[name]
        if tuple(got.shape) != tuple(want.shape) or jnp.dtype(got.dtype) != jnp.dtype(want.dtype):
            raise ValueError(f"{source}: parameter {name} is stored as {jnp.dtype(got.dtype).name}{list(got.shape)}"
                             f" but the config needs {jnp.dtype(want.dtype).name}{list(want.shape)}")


def load(source: str | os.PathLike, *, dtype: str | None = None, weights=None) -> Model:
    """A model from "tiny" (the bundled default), a directory written by `save`, or a Hugging Face directory.

    dtype: cast the parameters (None: as stored).
    weights: weight-only quantization, "int8", "fp8", "int4" or a `jaxkv.WeightQuant` (group size, embeddings;
      `jaxkv.layers.quantized`): the loaded (and cast) float weights are quantized. A checkpoint saved quantized
      loads as stored; naming another quantization for it is an error. None: as stored.
    """
    _check_dtype(dtype)
    quant = quantized.WeightQuant.of(weights)
    model = _load(source, dtype)
    if quant is not None and model.weights is not None:
        if model.weights != quant:
            raise ValueError(f"{source}: its weights are stored quantized as {model.weights}, not {quant}; load "
                             f"the float checkpoint to quantize it otherwise")
        return model
    return quantize_weights(model, quant)


def _load(source, dtype) -> Model:
    if isinstance(source, str) and source == "tiny":
        return load_saved(TINY_DIR, dtype=dtype)
    directory = pathlib.Path(source)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such directory (pass a checkpoint directory or 'tiny')")
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (pass a checkpoint directory or 'tiny')")
    if (directory / CONFIG_FILE).exists():
        return load_saved(directory, dtype=dtype)
    model = load_hf(directory, dtype=dtype)
    if model.tokenizer is None:
        model.tokenizer = _load_tokenizer(directory)
    return model
