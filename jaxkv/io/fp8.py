"""Block-quantized FP8 checkpoints (DeepSeek-V3/R1's release, Qwen3's "-FP8" uploads): weights dequantized at load.

Such a checkpoint says so in config.json:

  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [bo, bi]}

and stores each quantized weight W [..., out, in] as float8_e4m3fn beside `<name>_scale_inv`, float32
[..., ceil(out / bo), ceil(in / bi)]: block (i, j) of W is W_f8[i bo:(i + 1) bo, j bi:(j + 1) bi] x scale_inv[i, j]
(the last blocks of a dimension that bo or bi does not divide are partial). Weights the quantizer left alone
(embeddings, norms, the head, the router) are stored as usual.

jaxkv dequantizes every such weight once, on the host, to the load dtype (default: the embedding's, bfloat16 in
these releases) and then runs the model as any other: the same arithmetic as transformers' FP8 path with
`dequantize=True`. What that costs: the weights take the load dtype's bytes in memory (2x the file's for bf16), and
decode reads them at that width; no FP8 matmul is used. "activation_scheme": "static" (stored activation scales)
and other quantization methods (GPTQ, AWQ, bitsandbytes, ...) are refused by name.

safetensors' numpy reader has no float8 type, so quantized tensors are read here from the file's header offsets
(`read_f8`) after `safe_open` has validated the file: still no pickle, nothing executed.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

F8_DTYPE = "F8_E4M3"  # the safetensors dtype of a quantized weight
SCALE_SUFFIX = "_scale_inv"
MAX_BLOCK = 1 << 16


def block_size(hf: dict, *, source: str) -> tuple[int, int] | None:
    """(bo, bi) of a block-quantized FP8 checkpoint's config.json, None when it has no quantization_config;
    ValueError naming the field for any quantization jaxkv does not read."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{source}: field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{source}: field 'quantization_config.quant_method' = {method!r} is not supported: jaxkv "
                         f"reads unquantized checkpoints and block-quantized FP8 ('fp8'); dequantize it first")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: field 'quantization_config.fmt' = {fmt!r} is not supported (only 'e4m3')")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{source}: field 'quantization_config.activation_scheme' = {scheme!r} is not supported "
                         f"(only 'dynamic': no stored activation scales)")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        raise ValueError(f"{source}: field 'quantization_config.weight_block_size' must be two positive integers "
                         f"[out, in], got {block!r} (per-tensor or per-channel FP8 is not supported)")
    return block[0], block[1]


def split_scales(stored: dict, block: tuple[int, int] | None) -> tuple[dict, dict]:
    """(the stored tensors without the scales, quantized weight name -> its scale tensor). Every F8 weight must
    have its `_scale_inv` beside it, of the block grid's shape, and every scale a weight; ValueError naming the
    tensor otherwise. Without `block` nothing is split (an F8 tensor then fails `match`'s dtype check)."""
    if block is None:
        return stored, {}
    scales = {name[:-len(SCALE_SUFFIX)]: t for name, t in stored.items() if name.endswith(SCALE_SUFFIX)}
    weights = {name: t for name, t in stored.items() if not name.endswith(SCALE_SUFFIX)}
    for name, scale in scales.items():
        w = weights.get(name)
        if w is None:
            raise ValueError(f"tensor {scale.name!r} in {scale.file} scales {name!r}, which the checkpoint does "
                             f"not hold")
        if w.dtype != F8_DTYPE:
            raise ValueError(f"tensor {scale.name!r} in {scale.file} scales {name!r}, which is stored as {w.dtype}, "
                             f"not {F8_DTYPE}")
        if len(w.shape) < 2 or scale.shape != grid(w.shape, block):
            raise ValueError(f"tensor {scale.name!r} in {scale.file} has shape {list(scale.shape)}; the blocks "
                             f"{list(block)} of {name!r} {list(w.shape)} need {list(grid(w.shape, block))}")
        if scale.dtype not in ("F32", "BF16", "F16"):
            raise ValueError(f"tensor {scale.name!r} in {scale.file} has dtype {scale.dtype}; expected F32")
    for name, w in weights.items():
        if w.dtype == F8_DTYPE and name not in scales:
            raise ValueError(f"tensor {name!r} in {w.file} is {F8_DTYPE} but its scales {name + SCALE_SUFFIX!r} "
                             f"are missing from the checkpoint")
    return weights, scales


def grid(shape, block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` [..., out, in]: [..., ceil(out / bo), ceil(in / bi)]."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 W [..., out, in] from its float8_e4m3fn values and float32 block scales (module docstring)."""
    out, inp = w.shape[-2:]
    s = np.asarray(scale_inv, np.float32)
    s = np.repeat(np.repeat(s, block[0], axis=-2)[..., :out, :], block[1], axis=-1)[..., :inp]
    return w.astype(np.float32) * s


def read_f8(file: Path, name: str) -> np.ndarray:
    """A float8_e4m3fn tensor, read through the safetensors header's offsets (the file is already validated)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        entry = header[name]
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if entry["dtype"] != F8_DTYPE or end - start != math.prod(shape):
            raise ValueError(f"{file}: tensor {name!r} is not a {F8_DTYPE} tensor of shape {list(shape)}")
        f.seek(8 + n + start)
        data = np.frombuffer(f.read(end - start), np.uint8)
    return data.view(ml_dtypes.float8_e4m3fn).reshape(shape)
