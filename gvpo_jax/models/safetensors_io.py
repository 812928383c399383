"""Minimal safetensors reader/writer in numpy: lazy per-tensor reads, bf16 via ml_dtypes."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from gvpo_jax.models.config import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Reads the header once; `read(name)` loads only that tensor's bytes from disk."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
        except (OSError, struct.error, ValueError) as e:
            raise CheckpointError(
                f"{self.path}: not a readable safetensors file ({e}); re-export the checkpoint."
            ) from e
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.header: dict[str, dict] = header

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' has unsupported dtype {info['dtype']}; "
                f"convert it to one of {sorted(_DTYPES)}."
            )
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' has {end - begin} bytes for shape {shape} "
                f"{info['dtype']}; the file is corrupt, re-export it."
            )
        arr = np.fromfile(self.path, dtype=dtype, count=count, offset=self.data_start + begin)
        if arr.size != count:
            raise CheckpointError(f"{self.path}: tensor '{name}' is truncated; re-export the file.")
        return arr.reshape(shape)


TensorSource = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]


def write_file(path: Path, tensors: Iterable[TensorSource], metadata: dict | None = None) -> int:
    """Writes (name, shape, dtype, produce) tensors, calling `produce()` one at a time.

    Returns the number of data bytes written. Header layout follows the safetensors spec
    (u64 little-endian header length, JSON header padded to 8 bytes, then raw C-order data).
    """
    tensors = list(tensors)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in tensors:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": _NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape, dtype, produce in tensors:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"tensor '{name}' produced shape {arr.shape}, expected {shape}")
            f.write(arr.tobytes())
    return offset
