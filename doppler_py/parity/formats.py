"""Production formats in parity: each engine against HF float32 on the weights that engine itself holds.

A quantised engine and HF on the original weights differ by the quantisation error, which says nothing about
the engine's arithmetic. So each engine's reference is HF transformers in float32 on a copy of the folder whose
matrices are replaced by the values that engine holds: for doppler-gpu, its RDRR shards read back (F16 widened,
Q4_K dequantised here from the block bytes); for ours, our own quantiser's blocks dequantised. What remains is
arithmetic: f16 KV cache and f16 activations in doppler-gpu, f32 in ours.

Tolerances (`f16_tolerance`): one f16 rounding moves a value by at most u = 2^-11 of itself. A logit is a dot
product of the final hidden state h with a row w of the head, so a relative error e of h moves it by at most
e * |w| * |h| (Cauchy-Schwarz), |w| * |h| being the step's `logit_scale`. RMSNorm rescales errors with their
values, and a random matrix maps a relative error of its input to about the same relative error of its output, so
the relative errors of the roundings on a path add up: e <= roundings * u to first order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from doppler_py.gpu.weights import dequantize_blocks, quantize_blocks
from doppler_py.parity.doppler_model import DopplerParityError

F16_UNIT_ROUNDOFF = 2.0**-11
Q4K_BLOCK = 256  # values per Q4_K super-block
Q4K_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values
Q4K_SUBBLOCK = 32


# f16 roundings per layer on the residual path that HF on the held weights does not share, under doppler-gpu's
# Q4K configs with f32 activations ("af32"): keys and values go through its f16 KV cache. Weights, embeddings and
# the head are the held values themselves, which the reference holds too.
Q4K_AF32_ROUNDINGS_PER_LAYER = 2


def f16_tolerance(roundings: int, logit_scale: np.ndarray) -> np.ndarray:
    """The largest |Δlogit| `roundings` f16 roundings on the path allow at steps of `logit_scale` (max |w| * |h|)."""
    return roundings * F16_UNIT_ROUNDOFF * logit_scale


def dequantize_q4k_rows(raw: np.ndarray, shape: tuple[int, int], name: str) -> np.ndarray:
    """Q4_K blocks laid out row by row (each row padded to whole super-blocks) -> f32 [rows, cols].

    A super-block of 256 holds 8 sub-blocks of 32: value = d * scale_j * q - dmin * min_j, with 6-bit scale_j and
    min_j packed into 12 bytes (sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7; 4..7 in bytes 8..11's
    nibbles, their top 2 bits in the high bits of bytes 0..7), q the 4-bit values: each 32 bytes hold sub-block
    2c in their low nibbles and 2c + 1 in their high ones."""
    rows, cols = shape
    per_row = -(-cols // Q4K_BLOCK)
    if raw.size != rows * per_row * Q4K_BLOCK_BYTES:
        raise DopplerParityError(
            f"{name}: Q4_K data for [{rows}, {cols}] must be {rows * per_row * Q4K_BLOCK_BYTES} bytes, got {raw.size}"
        )
    blocks = raw.reshape(rows * per_row, Q4K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].astype(np.uint16)
    scales = np.concatenate([packed[:, 0:4] & 63, (packed[:, 8:12] & 15) | ((packed[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
    nibbles = blocks[:, 16:].reshape(-1, 4, 32)
    q = np.stack([nibbles & 15, nibbles >> 4], axis=2).reshape(-1, 8, Q4K_SUBBLOCK).astype(np.float32)
    values = d[:, :, None] * scales[:, :, None] * q - dmin[:, :, None] * mins[:, :, None]
    return values.reshape(rows, per_row * Q4K_BLOCK)[:, :cols]


def rdrr_tensors(rdrr_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a doppler-gpu RDRR folder as the float32 values it holds, by the manifest's names."""
    manifest = json.loads((rdrr_dir / "manifest.json").read_text())
    shards = [np.fromfile(rdrr_dir / shard["filename"], dtype=np.uint8) for shard in manifest["shards"]]
    tensors = {}
    for name, info in manifest["tensors"].items():
        raw = shards[info["shard"]][info["offset"] : info["offset"] + info["size"]]
        shape = tuple(info["shape"])
        dtype = info["dtype"]
        if dtype == "F32":
            tensors[name] = raw.view(np.float32).reshape(shape)
        elif dtype == "F16":
            tensors[name] = raw.view(np.float16).astype(np.float32).reshape(shape)
        elif dtype == "Q4_K_M" and info.get("layout") == "row" and len(shape) == 2:
            tensors[name] = dequantize_q4k_rows(raw, shape, name)
        else:
            raise DopplerParityError(f"{rdrr_dir}: tensor {name} of dtype {dtype} layout {info.get('layout')}")
    return tensors


def our_held_tensors(folder: Path, precision: str) -> dict[str, np.ndarray]:
    """The folder's tensors as our loader holds them in `precision` ("f16", "q4_0", "q4_1", "q8_0"): every matrix
    (2-D tensor) through our quantiser and back; vectors (norms, biases) stay float32."""
    tensors = load_file(str(folder / "model.safetensors"))
    held = {}
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if value.ndim == 2:
            raw = quantize_blocks(value, precision, name)
            value = dequantize_blocks(raw, precision, value.shape, name)
        held[name] = value
    return held


def write_held_folder(source: Path, tensors: dict[str, np.ndarray], out: Path) -> Path:
    """A copy of the HF folder `source` whose tensors are replaced by `tensors` (the same names and shapes)."""
    original = load_file(str(source / "model.safetensors"))
    missing = sorted(set(original) - set(tensors))
    if missing:
        raise DopplerParityError(f"{source}: the held weights lack {', '.join(missing)}")
    for name, value in original.items():
        if tensors[name].shape != value.shape:
            raise DopplerParityError(f"{name}: held shape {tensors[name].shape}, the folder's {value.shape}")
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, out / item.name)
    held = {name: np.ascontiguousarray(tensors[name], dtype=np.float32) for name in original}
    save_file(held, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
