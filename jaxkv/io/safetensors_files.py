"""Safetensors files of a Hugging Face checkpoint directory: which files (one model.safetensors, or shards through
model.safetensors.index.json), their headers (names, shapes, dtypes; no data), and reading one tensor.

Only safetensors is read, through `safetensors.safe_open(framework="numpy")`: never pickle, so a checkpoint cannot
run code. `safe_open` reads only the header and checks that the file covers every tensor's byte range, so a
truncated file is caught before any data is read. FP8 tensors, which numpy's reader lacks, go through
`jaxkv.io.fp8.read_f8`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy, so safe_open(framework="numpy") can read BF16)
import numpy as np
import safetensors
from safetensors import safe_open

from jaxkv.io import fp8

# Checkpoint dtypes (safetensors names) that can hold weights, and their jaxkv names.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor's name as written in its file, the file, and what its header says (no data is read)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "F32", "BF16", ...


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """(safetensors files, the index's tensor -> file map or None, the index path or None).

    transformers' order: a single model.safetensors first, then a sharded one through its index."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single], None, None
    if index.is_file():
        weight_map = read_index(index)
        shards = []
        for name in sorted(set(weight_map.values())):
            path = directory / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard named in {index} is missing")
            shards.append(path)
        return shards, weight_map, index
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    if pickles:
        raise ValueError(f"{directory}: has only {', '.join(pickles)} (a pickle-based PyTorch checkpoint), which "
                         f"jaxkv does not read because unpickling can run arbitrary code; convert it to "
                         f"safetensors (e.g. `model.save_pretrained(dir, safe_serialization=True)` in transformers)")
    raise FileNotFoundError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} found")


def read_index(path: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; each shard must be a plain file name beside the index."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path}: expected an object with a non-empty 'weight_map' of tensor name -> file")
    for tensor, name in weight_map.items():
        # Shards sit next to the index; a path that leaves the directory is refused rather than followed.
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{path}: tensor {tensor!r} maps to {name!r}, which is not a file name in the "
                             f"checkpoint directory")
    return weight_map


def read_headers(files: list[Path], weight_map: dict[str, str] | None, index: Path | None) -> dict[str, StoredTensor]:
    """name -> StoredTensor for every tensor in `files`, from their headers alone.

    A truncated or corrupt file fails here: safe_open checks that the file covers every tensor's byte range.
    With an index, each tensor must sit in the shard the index names, and each tensor of a shard must be listed.
    """
    stored: dict[str, StoredTensor] = {}
    for path in files:
        for name, shape, dtype in header(path):
            if name in stored:
                raise ValueError(f"tensor {name!r} appears in both {stored[name].file} and {path}")
            if weight_map is not None and weight_map.get(name) != path.name:
                where = f"puts it in {weight_map[name]!r}" if name in weight_map else "does not list it"
                raise ValueError(f"{path}: holds tensor {name!r}, but {index} {where}")
            stored[name] = StoredTensor(name, path, shape, dtype)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in stored:
                raise ValueError(f"{index}: lists tensor {name!r} in {file!r}, but that file does not hold it")
    return stored


def header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of each tensor in the file's header."""
    try:
        with safe_open(path, framework="numpy") as f:
            out = []
            for name in f.keys():
                piece = f.get_slice(name)
                out.append((name, tuple(int(n) for n in piece.get_shape()), piece.get_dtype()))
            return out
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None


def read(t: StoredTensor) -> np.ndarray:
    """The tensor's data (an FP8 one as float8_e4m3fn); ValueError naming the file and tensor."""
    try:
        if t.dtype == fp8.F8_DTYPE:
            return fp8.read_f8(t.file, t.name)
        with safe_open(t.file, framework="numpy") as f:
            return f.get_tensor(t.name)
    except (safetensors.SafetensorError, OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{t.file}: could not read tensor {t.name!r}: {e}") from None
