"""Memory-mapped reading of safetensors files (one or sharded), with typed errors.

We parse the header ourselves (8-byte little-endian length + JSON) and hand out `np.memmap` views, so a
tensor goes from the page cache straight into a GPU upload without a second full copy in host memory, and
every malformed file produces a `ModelFormatError` that names the file and tensor.

Block-quantised tensors kept from a GGUF are stored as raw ggml block bytes (dtype U8, shape
[N, K/32 * block_bytes]); the header's `__metadata__["doppler.quant"]` JSON maps their names to
{"format": "q4_1", "shape": [N, K]}.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import ModelFormatError, UnsupportedModelError

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": None,  # read as uint16 and widened
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
    "I8": np.int8,
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int
    quant: dict | None = None  # {"format": ..., "shape": [N, K]} for kept GGUF blocks

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return tuple(self.quant["shape"]) if self.quant else self.shape


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and metadata of one safetensors file; validates offsets against the file size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: truncated safetensors file (no header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            raise ModelFormatError(f"{path}: header length {header_len} exceeds the file ({size} bytes); truncated?")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFormatError(f"{path}: '__metadata__' must map names to strings")
    try:
        quant = json.loads(metadata.get("doppler.quant", "{}"))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path}: metadata 'doppler.quant' is not valid JSON ({exc})") from exc
    if not isinstance(quant, dict):
        raise ModelFormatError(f"{path}: metadata 'doppler.quant' must be a JSON object")
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        dtype, shape, begin, end = _entry(path, name, entry)
        itemsize = 2 if dtype == "BF16" else np.dtype(_DTYPES[dtype]).itemsize
        if end - begin != itemsize * math.prod(shape):
            raise ModelFormatError(f"{path}: tensor {name}: {end - begin} bytes do not hold {dtype}{list(shape)}")
        if base + end > size:
            raise ModelFormatError(
                f"{path}: tensor {name} ends at byte {base + end} but the file has {size} bytes; truncated file"
            )
        info = _quant(path, name, quant.get(name))
        tensors[name] = TensorInfo(name, path, dtype, shape, base + begin, base + end, info)
    return tensors, metadata


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked for its type."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ModelFormatError(f"{path}: tensor {name}: malformed header entry {entry!r:.200}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ModelFormatError(f"{path}: tensor {name}: shape {shape!r:.100} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ModelFormatError(f"{path}: tensor {name}: data_offsets {offsets!r:.100} are not [begin, end]")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise UnsupportedModelError(f"{path}: tensor {name}: dtype {dtype!r:.40} is not supported")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _quant(path: Path, name: str, info: object) -> dict | None:
    """The checked 'doppler.quant' record of a tensor kept as GGUF blocks, or None."""
    if info is None:
        return None
    fields = info if isinstance(info, dict) else {}
    fmt, shape = fields.get("format"), fields.get("shape")
    if not isinstance(fmt, str) or not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ModelFormatError(f"{path}: tensor {name}: 'doppler.quant' entry {info!r:.100} is not a block format")
    return info


def index_folder(folder: Path) -> dict[str, TensorInfo]:
    """All tensors of a model folder: `model.safetensors`, or the shards listed by the index file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelFormatError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder}: no *.safetensors files")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ModelFormatError(f"{path}: listed in the index but missing")
        tensors.update(read_header(path)[0])
    return tensors


def load_array(info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped view of the tensor (BF16 is widened to float32, which copies)."""
    raw = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.start, shape=(info.end - info.start,))
    if info.dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    return raw.view(_DTYPES[info.dtype]).reshape(info.shape)
