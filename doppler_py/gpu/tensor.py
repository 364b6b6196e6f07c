"""GPU buffers with a shape and dtype: allocation, upload and readback.

f16 data is stored two halves per 32-bit word (little-endian), which is exactly the byte layout of a numpy
float16 array, so uploads are plain byte copies and shaders unpack pairs with `unpack2x16float`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from doppler_py.gpu.device import Gpu

DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "u32": np.dtype(np.uint32),
    "i32": np.dtype(np.int32),
    "u8": np.dtype(np.uint8),
}

# Bytes moved per write_buffer call when uploading big tensors, to bound transient host memory.
_UPLOAD_CHUNK = 64 << 20


def _usage(gpu: Gpu) -> int:
    usage = gpu.api.BufferUsage
    return usage.STORAGE | usage.COPY_SRC | usage.COPY_DST


def _padded(nbytes: int) -> int:
    # Storage bindings must be a multiple of 4 bytes and never empty.
    return max(4, (nbytes + 3) // 4 * 4)


@dataclass(eq=False)
class Tensor:
    """A storage buffer (or a region of one) holding a dense array of `dtype` with `shape`."""

    gpu: Gpu
    buffer: object
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0
    label: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def binding_size(self) -> int:
        return _padded(self.nbytes)

    @classmethod
    def empty(cls, gpu: Gpu, shape: tuple[int, ...] | int, dtype: str = "f32", label: str = "") -> Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        nbytes = _padded(math.prod(shape) * DTYPES[dtype].itemsize)
        gpu.check_buffer_size(nbytes, label or f"tensor {shape} {dtype}")
        buffer = gpu.device.create_buffer(size=nbytes, usage=_usage(gpu), label=label)
        return cls(gpu, buffer, shape, dtype, 0, label)

    @classmethod
    def from_numpy(cls, gpu: Gpu, array: np.ndarray, dtype: str | None = None, label: str = "") -> Tensor:
        """Upload `array` (converted to `dtype`, default: its own dtype) into a new buffer."""
        dtype = dtype or _dtype_name(array.dtype)
        tensor = cls.empty(gpu, array.shape, dtype, label)
        tensor.write(array)
        return tensor

    def write(self, array: np.ndarray) -> None:
        """Copy host data into this tensor (shape must match in element count)."""
        data = np.ascontiguousarray(array, dtype=DTYPES[self.dtype]).reshape(-1)
        if data.size != self.numel:
            raise ValueError(f"{self.label or 'tensor'}: expected {self.numel} elements, got {data.size}")
        write_bytes(self.gpu, self.buffer, self.offset, memoryview(data).cast("B"))

    def numpy(self) -> np.ndarray:
        """Read the tensor back to the host (blocks until queued GPU work is done)."""
        raw = self.gpu.queue.read_buffer(self.buffer, self.offset, self.binding_size)
        return np.frombuffer(raw, dtype=DTYPES[self.dtype], count=self.numel).reshape(self.shape).copy()

    def view(self, shape: tuple[int, ...], dtype: str | None = None, offset_bytes: int = 0) -> Tensor:
        """Another tensor over the same buffer (no copy)."""
        return Tensor(self.gpu, self.buffer, tuple(shape), dtype or self.dtype, self.offset + offset_bytes, self.label)

    def destroy(self) -> None:
        self.buffer.destroy()


def write_bytes(gpu: Gpu, buffer, offset: int, data: memoryview) -> None:
    """write_buffer in bounded chunks, padding the tail to a multiple of 4 bytes as WebGPU requires."""
    total = len(data)
    body = total - total % 4
    for start in range(0, body, _UPLOAD_CHUNK):
        end = min(body, start + _UPLOAD_CHUNK)
        gpu.queue.write_buffer(buffer, offset + start, data[start:end])
    if body != total:
        tail = bytes(data[body:]) + b"\0" * (4 - total % 4)
        gpu.queue.write_buffer(buffer, offset + body, tail)


def _dtype_name(dtype: np.dtype) -> str:
    for name, np_dtype in DTYPES.items():
        if np_dtype == dtype:
            return name
    if dtype == np.float64:
        return "f32"
    if dtype == np.int64:
        return "i32"
    raise TypeError(f"no GPU dtype for numpy {dtype}")
