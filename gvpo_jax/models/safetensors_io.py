"""Minimal safetensors reader/writer in numpy: lazy per-tensor reads, bf16 via ml_dtypes."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from gvpo_jax.errors import FaultError
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


def _malformed(path: Path, reason: str) -> CheckpointError:
    """The one-sentence error for a file that is not (or no longer) valid safetensors."""
    return CheckpointError(
        f"{path} is not a valid safetensors file ({reason}); re-download or re-export it."
    )


def _is_count(x) -> bool:
    """A JSON value usable as a dimension or a byte offset (JSON's true is no count)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_header(path: Path, header, data_bytes: int) -> dict[str, dict]:
    """The header's tensor entries, each checked to lie within the file's `data_bytes`.

    Checked when the file is opened, so a truncated or garbled file is named before any
    tensor is converted (a load reads gigabytes before it reaches the last tensor)."""
    if not isinstance(header, dict):
        raise _malformed(path, f"its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and isinstance(info.get("shape"), list)
            and all(_is_count(d) for d in info["shape"])
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
            and all(_is_count(x) for x in info["data_offsets"])
        ):
            raise _malformed(
                path, f"tensor '{name}' lacks a valid dtype, shape or pair of data_offsets"
            )
        begin, end = info["data_offsets"]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is not None and end - begin != math.prod(info["shape"]) * dtype.itemsize:
            raise _malformed(
                path,
                f"tensor '{name}' has {end - begin} bytes for shape {tuple(info['shape'])} "
                f"{info['dtype']}",
            )
        if begin > end or end > data_bytes:
            raise _malformed(
                path,
                f"tensor '{name}' spans bytes {begin}-{end} of the data but the file holds "
                f"{data_bytes}: it is truncated",
            )
    return header


class SafetensorsFile:
    """Reads and checks the header once; `read(name)` loads only that tensor's bytes from disk.

    Raises CheckpointError, naming the file, for a file that cannot be read, is not
    safetensors, or is truncated."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                fits = header_len is not None and header_len <= size - 8
                text = f.read(header_len) if fits else b""
        except OSError as e:
            raise CheckpointError(
                f"{self.path} cannot be read ({e.strerror or e}); check that it is a readable file."
            ) from e
        if header_len is None:
            raise _malformed(self.path, f"it has {len(head)} bytes")
        if not fits:
            raise _malformed(
                self.path, f"its header of {header_len} bytes is longer than the file's {size}"
            )
        try:
            header = json.loads(text)
        except ValueError as e:  # json's errors and UnicodeDecodeError
            raise _malformed(self.path, f"its header is not JSON: {e}") from e
        self.data_start = 8 + header_len
        self.header: dict[str, dict] = _check_header(self.path, header, size - self.data_start)

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
        begin, _ = info["data_offsets"]
        count = math.prod(shape)
        try:
            arr = np.fromfile(self.path, dtype=dtype, count=count, offset=self.data_start + begin)
        except OSError as e:
            raise CheckpointError(
                f"{self.path} cannot be read ({e.strerror or e}); check that it is a readable file."
            ) from e
        if arr.size != count:  # shortened since it was opened
            raise _malformed(self.path, f"tensor '{name}' is truncated")
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
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for name, shape, dtype, produce in tensors:
                arr = np.ascontiguousarray(produce(), dtype=dtype)
                if arr.shape != tuple(shape):
                    raise ValueError(
                        f"tensor '{name}' produced shape {arr.shape}, expected {shape}"
                    )
                f.write(arr.tobytes())
    except OSError as e:  # a full disk, a quota: the machine's fault, not the caller's
        with contextlib.suppress(OSError):  # a truncated file would pass for weights
            Path(path).unlink(missing_ok=True)
        raise write_error(path, e) from e
    return offset


def write_error(path, error: OSError) -> FaultError:
    """The one-sentence error for a weight file the system refused to write."""
    return FaultError(
        f"{path} could not be written ({error.strerror or error}); free space (or fix the "
        "directory's permissions) and rerun."
    )
