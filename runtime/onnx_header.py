"""Reads which graph inputs of an ONNX file carry a default, from its protobuf wire format (no onnx).

Owns: `input_defaults(path)`: the graph inputs that also have an initializer, which ONNX IR >= 4
reads as inputs with a default value (the export's `token_embeddings_extra`, compiler/graphs/
clip_text.py). Only tags, lengths and names are read -- ModelProto.graph (7), GraphProto.initializer
(5) and .input (11), TensorProto.name (8), ValueInfoProto.name (1), as onnx/onnx.proto numbers them;
weights stored inside the file are skipped, not read (the file is memory-mapped).
"""
from __future__ import annotations

import mmap
from pathlib import Path


def _varint(buf, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def _fields(buf, start: int, end: int):
    """(field number, (start, end)) of each length-delimited field of the message at buf[start:end]."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 2:
            n, i = _varint(buf, i)
            yield key >> 3, (i, i + n)
            i += n
        elif wire == 0:
            i = _varint(buf, i)[1]
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {i}")


def _name(buf, span: tuple[int, int], field: int) -> str:
    return next((bytes(buf[a:b]).decode("utf-8", "replace") for f, (a, b) in _fields(buf, *span) if f == field), "")


def input_defaults(path: str | Path) -> set[str]:
    """Names of the graph inputs of the ONNX file at `path` that have an initializer (a default);
    empty for a file that is not such a model (the backend that loads it says what is wrong)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            graph = next((span for f, span in _fields(buf, 0, len(buf)) if f == 7), None)
            inputs, initializers = set(), set()
            for f, span in _fields(buf, *graph) if graph else ():
                if f == 11:
                    inputs.add(_name(buf, span, 1))
                elif f == 5:
                    initializers.add(_name(buf, span, 8))
            return inputs & initializers
    except (OSError, ValueError, IndexError):
        return set()
