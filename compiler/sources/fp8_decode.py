"""Decoding fp8 weights (F8_E4M3 / F8_E5M2, and ComfyUI's scaled fp8) straight into an export's dtype.

Owns: a lookup table over byte pairs -- 65536 entries, each the two target values of two fp8 bytes
-- so a tensor decodes with one gather per two elements instead of ml_dtypes' per-element cast
(5-7x faster here: the 12 B Flux transformer from fp8 exported at 3.4x the plain copy time, as
fast as bf16 with the table). A scaled tensor gets its own table of round(float32(byte) * scale),
computed as the reference computes it, so the bytes are those of float32 dequantization + cast.
"""
from __future__ import annotations

from functools import lru_cache

import ml_dtypes
import numpy as np

from ..direct_io import aligned_empty

KINDS = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_WORD = {2: np.uint16, 4: np.uint32}        # target itemsize -> the integer type of one value


def _values(kind: str, target: np.dtype, scale: float | None) -> np.ndarray:
    """The 256 fp8 values in the target dtype (times `scale` in float32 first, where given)."""
    values = np.arange(256, dtype=np.uint8).view(KINDS[kind]).astype(np.float32)
    if scale is not None:
        values = values * np.float32(scale)
    with np.errstate(over="ignore"):        # past the target's range: inf, refused by the writer's check
        return values.astype(target)


def _pair_table(values: np.ndarray) -> np.ndarray:
    """65536 entries: entry (hi << 8 | lo) holds the values of byte lo then byte hi, as one integer
    twice the target's width (little-endian: lo's value first)."""
    word = _WORD[values.dtype.itemsize]
    bits = values.view(word).astype(np.uint64)
    shift = np.uint64(8 * values.dtype.itemsize)
    pairs = bits[np.arange(65536) & 0xFF] | (bits[np.arange(65536) >> 8] << shift)
    return pairs.astype({np.uint16: np.uint32, np.uint32: np.uint64}[word])


CHUNK = 1 << 18                             # byte pairs gathered per np.take (10-15 % faster than one gather)
TARGETS = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


@lru_cache(maxsize=8)
def _cached_table(kind: str, target: str) -> np.ndarray:
    return _pair_table(_values(kind, TARGETS[target], None))


def decode_fp8(raw: np.ndarray, kind: str, target, scale: float | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """fp8 bytes (a uint8 array of any shape) -> the same shape in `target` (bfloat16, float16 or
    float32), each value float32(fp8) [* scale] rounded to the target; into `out` (a byte buffer of
    that size, reused by the caller) where given, else a new aligned buffer."""
    target = np.dtype(target)
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    table = _cached_table(kind, target.name) if scale is None else _pair_table(_values(kind, target, scale))
    even = flat.size - flat.size % 2
    out = (aligned_empty(flat.size * target.itemsize) if out is None else out).view(target)   # aligned: a direct write takes it
    pairs, into = flat[:even].view(np.uint16), out[:even].view(table.dtype)
    for i in range(0, pairs.size, CHUNK):      # gathered in place, a cache-sized chunk at a time: no temporary
        np.take(table, pairs[i:i + CHUNK], out=into[i:i + CHUNK], mode="clip")   # uint16: always in range
    if even != flat.size:
        out[-1] = _values(kind, target, scale)[flat[-1]]
    return out.reshape(raw.shape)
