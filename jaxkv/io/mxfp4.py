"""MXFP4 checkpoints (gpt-oss as released): expert weights dequantized at load.

Such a checkpoint says so in config.json (`"quantization_config": {"quant_method": "mxfp4", ...}`) and stores each
quantized weight W as two uint8 tensors beside each other:

  <name>_blocks  [..., R, G, 16]   32 FP4 (E2M1) values per block, two per byte: the low nibble first
  <name>_scales  [..., R, G]       one E8M0 exponent per block of 32: the block's values times 2 ** (scale - 127)

transformers (integrations/mxfp4.py, `convert_moe_packed_tensors`) decodes a nibble through the E2M1 table
(`FP4_VALUES`), multiplies by the block's power of two and lays the R rows of G * 32 values out as [..., G * 32,
R]: for gpt-oss's experts, `gate_up_proj` [X, D, 2 * I] from blocks [X, 2 * I, D / 32, 16] and `down_proj`
[X, I, D] from [X, D, I / 32, 16], the layout of its unquantized parameters. jaxkv does the same once, on the host,
to the load dtype (every FP4 value times a power of two is exact in bfloat16 and float32), then runs the model as
any other: the weights take the load dtype's bytes in memory and decode reads them at that width (no FP4 matmul).

`join` pairs the two tensors into one `StoredTensor` named `<name>` of the dequantized shape and dtype `DTYPE`, so
the loader matches it against the family's tensor list like any weight; a block of the wrong size, scales of the
wrong shape or a half-missing pair is a ValueError naming the tensor.
"""

from __future__ import annotations

import numpy as np

from jaxkv.io.safetensors_files import StoredTensor, read

DTYPE = "MXFP4"  # the dtype `join` gives a (blocks, scales) pair
BLOCKS, SCALES = "_blocks", "_scales"
VALUES_PER_BLOCK = 32  # FP4 values per scale: 16 bytes of two nibbles
# E2M1: sign, two exponent bits, one mantissa bit (transformers' FP4_VALUES, by nibble)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def declared(hf: dict) -> bool:
    """Whether config.json declares MXFP4 weights (`quantization_config.quant_method` "mxfp4")."""
    q = hf.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def join(stored: dict[str, StoredTensor]) -> tuple[dict[str, StoredTensor], dict[str, tuple]]:
    """(the stored tensors with each `<name>_blocks` / `<name>_scales` pair replaced by one tensor `<name>` of the
    dequantized shape and dtype DTYPE, name -> (blocks, scales)). ValueError naming the tensor for a pair that is
    incomplete or whose shapes or dtypes are not MXFP4's."""
    blocks = {name[:-len(BLOCKS)]: t for name, t in stored.items() if name.endswith(BLOCKS)}
    scales = {name[:-len(SCALES)]: t for name, t in stored.items() if name.endswith(SCALES)}
    out = {name: t for name, t in stored.items()
           if not ((name.endswith(BLOCKS) and name[:-len(BLOCKS)] in blocks)
                   or (name.endswith(SCALES) and name[:-len(SCALES)] in scales))}
    parts = {}
    for name in sorted(set(blocks) | set(scales)):
        b, s = blocks.get(name), scales.get(name)
        if b is None or s is None:
            have, missing = (b, name + SCALES) if s is None else (s, name + BLOCKS)
            raise ValueError(f"tensor {have.name!r} in {have.file} is half of an MXFP4 weight: {missing!r} is "
                             f"missing from the checkpoint")
        for t in (b, s):
            if t.dtype != "U8":
                raise ValueError(f"tensor {t.name!r} in {t.file} has dtype {t.dtype}; MXFP4 blocks and scales are U8")
        if len(b.shape) != 4 or b.shape[-1] != VALUES_PER_BLOCK // 2:
            raise ValueError(f"tensor {b.name!r} in {b.file} has shape {list(b.shape)}; MXFP4 expert blocks are "
                             f"[X, R, G, {VALUES_PER_BLOCK // 2}] (16 bytes: 32 values per block)")
        if tuple(s.shape) != tuple(b.shape[:-1]):
            raise ValueError(f"tensor {s.name!r} in {s.file} has shape {list(s.shape)}; the blocks {b.name!r} "
                             f"{list(b.shape)} need one scale each: {list(b.shape[:-1])}")
        X, R, G, _ = b.shape
        out[name] = StoredTensor(name=b.name[:-len(BLOCKS)], file=b.file, shape=(X, G * VALUES_PER_BLOCK, R),
                                 dtype=DTYPE)
        parts[name] = (b, s)
    return out, parts


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [X, G * 32, R] from uint8 blocks [X, R, G, 16] and scales [X, R, G] (module docstring)."""
    blocks = np.asarray(blocks, np.uint8)
    values = np.empty((*blocks.shape[:-1], VALUES_PER_BLOCK), np.float32)  # [X, R, G, 32]
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore"):  # an exponent past float32's range is inf: the loader reports it by name
        values = np.ldexp(values, np.asarray(scales, np.int32)[..., None] - 127)
    X, R, G, _ = values.shape
    return np.ascontiguousarray(values.reshape(X, R, G * VALUES_PER_BLOCK).transpose(0, 2, 1))


def read_joined(parts: tuple[StoredTensor, StoredTensor]) -> np.ndarray:
    """The dequantized float32 weight of a joined pair (`join`)."""
    return dequantize(read(parts[0]), read(parts[1]))
