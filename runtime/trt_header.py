"""Reads the header of a TensorRT-RTX engine (undocumented layout, seen in 1.7.1).

Owns: magic, file size, TensorRT-RTX version and the compute-capability bitmask, so that an
engine can be checked against its sidecar metadata and a device without loading it. The
layout is only trusted after the magic and a known major version check out.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"vtrt"
CC_BITS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_120", "sm_121"]  # bit i -> compute capability
KNOWN_MAJORS = {1}


@dataclass(frozen=True)
class EngineHeader:
    size: int
    version: str                  # "1.7.1.116"
    compute_capabilities: tuple[str, ...]
    unknown_cc_bits: int          # bits set beyond the ones we can name


class HeaderError(ValueError):
    pass


def read_header(head: bytes) -> EngineHeader:
    if len(head) < 40:
        raise HeaderError(f"engine header is {len(head)} bytes; expected at least 40")
    if head[:4] != MAGIC:
        raise HeaderError(f"not a TensorRT-RTX engine (magic {head[:4]!r}, expected {MAGIC!r})")
    major, minor, patch, build = head[24:28]
    if major not in KNOWN_MAJORS:
        raise HeaderError(f"engine from TensorRT-RTX {major}.{minor}.{patch}: header layout unknown")
    (size,) = struct.unpack("<Q", head[16:24])
    (mask,) = struct.unpack("<Q", head[32:40])
    ccs = tuple(cc for i, cc in enumerate(CC_BITS) if mask >> i & 1)
    return EngineHeader(size, f"{major}.{minor}.{patch}.{build}", ccs, mask >> len(CC_BITS))
