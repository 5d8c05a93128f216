"""Reading protobuf's wire format, as far as the runtime needs it without the protobuf or onnx packages:
a sentencepiece model (runtime/sentencepiece_model.py) and the graph inputs of an ONNX file
(runtime/onnx_header.py).

Owns: `varint`, `field_spans` (the fields of one message by number and wire type, the length-delimited
ones as (start, end) spans of the buffer, so an mmap is read without copying) and `proto_fields` (the
same with the bytes). Malformed input is a ValueError. Standard library only.
"""
from __future__ import annotations


def varint(buf, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def field_spans(buf, start: int = 0, end: int | None = None):
    """(field number, wire type, value) of each field of the message at buf[start:end], in file order:
    value is an int for varints, the (start, end) span of its bytes for the other wire types."""
    pos, end = start, len(buf) if end is None else end
    while pos < end:
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire in (1, 2, 5):
            if wire == 2:
                size, pos = varint(buf, pos)
            else:
                size = 8 if wire == 1 else 4
            if pos + size > end:
                raise ValueError(f"field {number} runs past the end")
            value, pos = (pos, pos + size), pos + size
        else:
            raise ValueError(f"field {number} has wire type {wire}")
        if number == 0:
            raise ValueError("field number 0")
        yield number, wire, value


def proto_fields(buf: bytes):
    """(field number, wire type, value) of each field of one serialized message: value is an int for
    varints, bytes for the other wire types."""
    for number, wire, value in field_spans(buf):
        yield number, wire, value if wire == 0 else bytes(buf[value[0]:value[1]])
