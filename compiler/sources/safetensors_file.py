"""A strict, lazy reader for single-file .safetensors checkpoints.

Owns: validating the header before any tensor is touched (header length within the file,
JSON without duplicate keys, known dtypes, shape x dtype = byte length in exact integers,
tensors covering the data area exactly: no overlaps, gaps or trailing bytes) and
reading one tensor at a time with a positioned read, so the peak memory of a conversion is
near the largest tensor rather than the whole model.
"""
from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import direct_io
from ..errors import BadInput

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors spec caps the header at 100 MB

# safetensors dtype -> (bytes per element, numpy dtype for the raw bytes)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "<f8"), "F32": (4, "<f4"), "F16": (2, "<f2"), "BF16": (2, "<u2"),
    "I64": (8, "<i8"), "I32": (4, "<i4"), "I16": (2, "<i2"), "I8": (1, "i1"),
    "U64": (8, "<u8"), "U32": (4, "<u4"), "U16": (2, "<u2"), "U8": (1, "u1"),
    "BOOL": (1, "?"), "F8_E4M3": (1, "u1"), "F8_E5M2": (1, "u1"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")   # the ones a weight may be stored in


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int


def _bad(path: str, what: str) -> BadInput:
    return BadInput(f"{path}: not a valid .safetensors file: {what}. "
                    "Re-download or re-save the checkpoint (a truncated download is the usual cause).")


class _HeaderError(ValueError):
    """Raised inside json.loads by the hooks below; turned into one BadInput line."""


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _HeaderError(f"key '{key}' appears twice in the header")
        out[key] = value
    return out


def _no_constant(name: str):
    raise _HeaderError(f"header holds {name}, which is not JSON")


def _load_json(path: str, blob: bytes):
    try:
        return json.loads(blob.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _HeaderError as e:
        raise _bad(path, str(e)) from None
    except RecursionError:
        raise _bad(path, "header nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, ints past Python's digit limit
        raise _bad(path, f"header is not valid UTF-8 JSON ({e})") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _byte_count(shape: list, width: int, limit: int) -> int:
    """width x prod(shape) in Python ints, stopping once past `limit` (no overflow, no huge products)."""
    if 0 in shape:
        return 0
    n = width
    for d in shape:
        n *= d
        if n > limit:
            return limit + 1
    return n


def _tensor(path: str, key: str, entry, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad(path, f"tensor '{key}' entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(path, f"tensor '{key}' has unknown dtype {_short(dtype)} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"tensor '{key}' shape {_short(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise _bad(path, f"tensor '{key}' data_offsets {_short(offsets)} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _bad(path, f"tensor '{key}' data_offsets [{begin}, {end}] lie outside the "
                         f"{data_size}-byte data area")
    want = _byte_count(shape, DTYPES[dtype][0], data_size)
    if end - begin != want:
        needs = f"{want}" if want <= data_size else f"more than the {data_size}-byte data area"
        raise _bad(path, f"tensor '{key}' holds {end - begin} bytes but {dtype}{_short(shape)} needs {needs}")
    return dtype, tuple(shape), begin, end


def parse_header(path: str, head: bytes, file_size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate a safetensors header; `head` holds at least the first 8 + header-length bytes.
    As the safetensors spec asks, the tensors must cover the data area exactly: no overlaps, no
    gaps, no bytes after the last tensor (nothing unaccounted for can hide in a file)."""
    if file_size < 8 or len(head) < 8:
        raise _bad(path, f"file is {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES:
        raise _bad(path, f"header length {n} exceeds the 100 MB limit")
    if 8 + n > file_size:
        raise _bad(path, f"header length {n} runs past the end of the {file_size}-byte file")
    header = _load_json(path, head[8:8 + n])
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    data_start = 8 + n
    data_size = file_size - data_start
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for key, entry in header.items():
        dtype, shape, begin, end = _tensor(path, key, entry, data_size)
        tensors[key] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
        spans.append((begin, end, key))
    spans.sort()
    cursor, last = 0, None
    for begin, end, key in spans:
        if begin < cursor:
            raise _bad(path, f"tensors '{last}' and '{key}' overlap in the data area")
        if begin > cursor:
            raise _bad(path, f"bytes [{cursor}, {begin}) of the data area belong to no tensor")
        cursor, last = end, key
    if cursor != data_size:
        raise _bad(path, f"{data_size - cursor} bytes after the last tensor belong to no tensor")
    return tensors, metadata


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """An open .safetensors file: header parsed and checked; tensors read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO must not block the open
        except OSError as e:
            raise BadInput(f"{self.path}: cannot open ({e.strerror})") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise BadInput(f"{self.path}: not a file; give the path of a .safetensors file")
        size = st.st_size
        head = os.pread(self._fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if len(head) == 8 and 8 + n <= min(size, 8 + MAX_HEADER_BYTES):
            head += os.pread(self._fd, n, 8)
        try:
            self.tensors, self.metadata = parse_header(self.path, head, size)
        except BadInput:
            self.close()
            raise
        self._direct_fd = direct_io.open_direct(self.path)   # large reads into a Scratch bypass the page cache

    def close(self) -> None:
        for name in ("_fd", "_direct_fd"):
            if getattr(self, name, -1) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)

    def __del__(self):
        self.close()

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, key: str, raw: bool = False, rows: tuple[int, int] | None = None,
             into: direct_io.Scratch | None = None) -> np.ndarray:
        """One tensor as numpy: BF16 widened to float32 and F8 decoded to float32 through ml_dtypes,
        or (`raw`) BF16 / F8 as ml_dtypes arrays over the bytes read, with no conversion. `rows` (a, b):
        only rows a..b-1 of its first axis are read (a large tensor written in parts). `into`: the bytes
        land in that thread's reused buffer (past the page cache where they can), valid until its next read."""
        info = self.tensors[key]
        shape, start, end = info.shape, info.start, info.end
        if rows is not None:
            row = (end - start) // shape[0]
            shape, start, end = (rows[1] - rows[0], *shape[1:]), start + rows[0] * row, start + rows[1] * row
        try:
            data = direct_io.read_range(self._fd, self._direct_fd, start, end, into) if into is not None \
                else np.frombuffer(os.pread(self._fd, end - start, start), np.uint8)
        except EOFError:
            data = np.empty(0, np.uint8)
        if data.size != end - start:
            raise _bad(self.path, f"tensor '{key}' could not be read in full (file changed while reading?)")
        arr = data.view(DTYPES[info.dtype][1]).reshape(shape)
        if info.dtype == "BF16" or info.dtype.startswith("F8"):
            kind = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
                    "F8_E5M2": ml_dtypes.float8_e5m2}[info.dtype]
            if raw:
                return arr.view(kind)
            return bf16_to_f32(arr) if info.dtype == "BF16" else arr.view(kind).astype(np.float32)
        return arr
