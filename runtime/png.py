"""Writes an RGB uint8 image as PNG with the standard library (zlib), keeping the runtime thin."""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(image: np.ndarray) -> bytes:
    """image: [H, W, 3] uint8 -> the PNG file's bytes (what write_png writes)."""
    img = np.ascontiguousarray(image, dtype=np.uint8)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8, got {img.shape}")
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))  # filter type 0 per row
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b""))


def write_png(path: str | os.PathLike, image: np.ndarray) -> None:
    """image: [H, W, 3] uint8. Written to a temp file beside `path`, then renamed; the temp file is
    removed on any failure, so a failed write leaves nothing behind."""
    data = png_bytes(image)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass                                        # never created, or already gone
        raise
