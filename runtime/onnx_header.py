"""Reads which graph inputs of an ONNX file carry a default, from its protobuf wire format (no onnx).

Owns: `input_defaults(path)` (the wire format read by runtime/protobuf.py): the graph inputs that also have an initializer, which ONNX IR >= 4
reads as inputs with a default value (the export's `token_embeddings_extra`, compiler/graphs/
clip_text.py). Only tags, lengths and names are read -- ModelProto.graph (7), GraphProto.initializer
(5) and .input (11), TensorProto.name (8), ValueInfoProto.name (1), as onnx/onnx.proto numbers them;
weights stored inside the file are skipped, not read (the file is memory-mapped).
"""
from __future__ import annotations

import mmap
from pathlib import Path

from .protobuf import field_spans


def _name(buf, span: tuple[int, int], field: int) -> str:
    return next((bytes(buf[v[0]:v[1]]).decode("utf-8", "replace") for f, wire, v in field_spans(buf, *span)
                 if f == field and wire == 2), "")


def input_defaults(path: str | Path) -> set[str]:
    """Names of the graph inputs of the ONNX file at `path` that have an initializer (a default);
    empty for a file that is not such a model (the backend that loads it says what is wrong)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            graph = next((span for f, wire, span in field_spans(buf) if f == 7 and wire == 2), None)
            inputs, initializers = set(), set()
            for f, wire, span in field_spans(buf, *graph) if graph else ():
                if wire != 2:
                    continue
                if f == 11:
                    inputs.add(_name(buf, span, 1))
                elif f == 5:
                    initializers.add(_name(buf, span, 8))
            return inputs & initializers
    except (OSError, ValueError, IndexError):
        return set()
