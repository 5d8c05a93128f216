"""A GGUF file's own quantized blocks kept in an engine (target option `weights: gguf`).

Owns: reading an export's gguf_blocks.json (written by export.py from sources/gguf_file.carried_blocks:
which weights the export copied unchanged from GGUF Q8_0 / Q4_0 tensors, and where those blocks lie),
checking that each weight still is what the export holds (its blocks, dequantized and cast to the
export's dtype, equal the export's bytes: a GGUF file changed since the export is refused by name), and
the two exact mappings, each block's values kept as they are (y = x @ (d * q)^T):
- Q8_0 (one fp16 scale d, 32 int8 q): ONNX Runtime MatMulNBits 8 bits, block 32, its implicit zero point
  128 (stored q + 128); OpenVINO an i8 constant [N, K/32, 32] times the scales [N, K/32, 1];
- Q4_0 (one fp16 scale d, 32 4-bit q stored first halves in the low nibbles, value d * (q - 8)):
  MatMulNBits 4 bits (consecutive values share a byte, the first in the low nibble; zero point 8);
  OpenVINO an i4 constant holding q - 8, same order.
A weight the record does not cover, or one cut from a fused weight where the cut is not whole blocks,
is quantized int8 by the target's own quantizer (quantize.py) and counted apart.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import BadInput
from .onnx_weights import Initializers

BLOCK = 32
TYPE_SIZE = {"Q8_0": 2 + 32, "Q4_0": 2 + 16}
BITS = {"Q8_0": 8, "Q4_0": 4}


class GgufBlocks:
    """An export component's gguf_blocks.json: `weight(name, index, exported)` gives the blocks of one
    weight (or a Slice's part of it) as stored in the GGUF file, checked against the export's values."""

    def __init__(self, path: Path, sources: tuple = ()):
        """`sources`: the GGUF files a build knows now (a recipe's), found in place of a recorded file
        that moved (same name and size; the blocks are checked against the export either way)."""
        self.path = Path(path)
        try:
            record = json.loads(self.path.read_text())
            self.files = {str(f): int(n) for f, n in record["files"].items()}
            self.tensors = {str(k): _checked(v) for k, v in record["tensors"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
            raise BadInput(f"{self.path}: unreadable or damaged ({type(e).__name__}: {e}); export again") from None
        moved = {}
        for f, size in self.files.items():
            have = os.path.getsize(f) if os.path.isfile(f) else None
            here = next((str(s) for s in sources if Path(s).name == Path(f).name and Path(s).is_file()
                         and os.path.getsize(s) == size), None)
            if have != size and here is not None:
                moved[f] = here
            elif have != size:
                raise BadInput(f"{f}: weights: gguf reads its blocks from this GGUF file, which the export was made "
                               f"from, but it is {'not there' if have is None else f'{have} bytes, not {size}'}: put it "
                               "back, export again, or build with weights: int8")
        for rec in self.tensors.values():
            row_bytes = rec["shape"][1] // BLOCK * TYPE_SIZE[rec["type"]]
            if any(f not in self.files or o + r * row_bytes > self.files[f] for f, o, r in rec["segments"]):
                raise BadInput(f"{self.path}: a recorded weight lies outside its GGUF file; export again")
            rec["segments"] = [[moved.get(f, f), o, r] for f, o, r in rec["segments"]]

    def weight(self, name: str, index, exported: np.ndarray) -> tuple[str, np.ndarray] | None:
        """(GGUF type, blocks uint8 [rows, K/32, type size]) of weight `name` ([N, K], as the export
        holds it; `index` a (rows, cols) slice of it or None), or None when it cannot be kept: not in the
        record, or a column cut that is not whole blocks. BadInput when the blocks are not the export's
        values (the GGUF file was replaced by another of the same size)."""
        rec = self.tensors.get(name)
        if rec is None or tuple(exported.shape) != tuple(rec["shape"]):
            return None
        n, k = rec["shape"]
        rows, cols = index if index is not None else (slice(None), slice(None))
        r0, r1, _ = rows.indices(n)
        c0, c1, _ = cols.indices(k)
        if c0 % BLOCK or c1 % BLOCK or r1 <= r0 or c1 <= c0:
            return None
        kind = rec["type"]
        blocks = self._rows(kind, k, rec["segments"], r0, r1)[:, c0 // BLOCK:c1 // BLOCK]
        want = np.asarray(exported[r0:r1, c0:c1])
        if not np.array_equal(dequantize(kind, blocks).astype(want.dtype).view(np.uint8), want.view(np.uint8)):
            files = sorted({s[0] for s in rec["segments"]})
            raise BadInput(f"{', '.join(files)}: the blocks of {name} no longer match the export made from this file "
                           f"(it was replaced or re-converted since): export again, or build with weights: int8")
        return kind, blocks

    def _rows(self, kind: str, k: int, segments: list, r0: int, r1: int) -> np.ndarray:
        per_row = k // BLOCK
        parts, start = [], 0
        for file, offset, count in segments:
            a, b = max(r0, start), min(r1, start + count)
            if a < b:
                m = np.memmap(file, np.uint8, "r", offset=int(offset) + (a - start) * per_row * TYPE_SIZE[kind],
                              shape=(b - a, per_row, TYPE_SIZE[kind]))
                parts.append(np.array(m))
                del m
            start += count
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _checked(rec) -> dict:
    """One tensor's record with its fields' types checked (a damaged record is one line, not a traceback)."""
    rec = dict(rec)
    n, k = (int(d) for d in rec["shape"])
    segments = [[str(f), int(o), int(r)] for f, o, r in rec["segments"]]
    if rec["type"] not in TYPE_SIZE or n <= 0 or k <= 0 or k % BLOCK or sum(r for _, _, r in segments) != n \
            or any(o < 0 or r <= 0 for _, o, r in segments):
        raise ValueError(f"bad entry {rec}")
    return {"type": rec["type"], "shape": [n, k], "segments": segments}


def of(found: tuple | None) -> GgufBlocks | None:
    """The record the export wrote, if any; `found`: (its path or None, the GGUF files the build knows now),
    as compile_component puts it in the job."""
    path, sources = found or (None, ())
    return GgufBlocks(path, sources) if path is not None and Path(path).is_file() else None


def scales(blocks: np.ndarray) -> np.ndarray:
    """Each block's fp16 scale d, as float32 [rows, blocks] (exact)."""
    return np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)


def values(kind: str, blocks: np.ndarray) -> np.ndarray:
    """Each block's 32 quantized values q, int8 [rows, blocks, 32], signed (Q4_0: nibble - 8)."""
    if kind == "Q8_0":
        return np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    qs = blocks[..., 2:]
    return (np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8) - 8)


def dequantize(kind: str, blocks: np.ndarray) -> np.ndarray:
    """float32 [rows, blocks * 32]: gguf's own dequantization (d * q), as the export made its weights."""
    import gguf.quants
    rows = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1)
    return np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind]), np.float32)


def matmul_nbits(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """ONNX Runtime MatMulNBits B [N, K/32, 32 * bits / 8] (uint8, implicit zero point 2^(bits-1)),
    scales [N, K/32] (float32) and bits, holding the blocks' own values."""
    q = values(kind, blocks)
    if kind == "Q8_0":
        packed = q.view(np.uint8) ^ np.uint8(0x80)
    else:
        u = (q + 8).astype(np.uint8)
        packed = u[..., 0::2] | (u[..., 1::2] << 4)
    return np.ascontiguousarray(packed), scales(blocks), BITS[kind]


def nibbles(q: np.ndarray) -> np.ndarray:
    """Signed 4-bit values packed two a byte, the first in the low nibble (OpenVINO's i4 layout)."""
    u = (q & 0xF).astype(np.uint8)
    return np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << 4))


def into_openvino(model, blocks: GgufBlocks, parts: dict, export: Path) -> dict[str, int]:
    """Each MatMul(x, W, transpose_b) of an ov.Model (read from quantize.weights_as_parts' rewrite of
    `export`, its Linear weights made transpose_b) whose W the record holds: W replaced by its GGUF
    blocks, an i8 (Q8_0) / i4 (Q4_0) constant [N, K/32, 32] times the scales [N, K/32, 1] (f32), reshaped
    to [N, K] -- OpenVINO's pattern for grouped compressed weights, which its CPU plugin runs as a
    compressed FullyConnected. `parts`: the rewrite's part name -> (weight name, index). Returns
    GGUF type -> weights kept."""
    import onnx
    import openvino as ov
    import openvino.opset13 as ops

    reader = Initializers(onnx.load(str(export), load_external_data=False), Path(export).parent)
    kept: dict[str, int] = {}
    for op in list(model.get_ordered_ops()):
        if op.get_type_name() != "MatMul" or not op.get_attributes()["transpose_b"]:
            continue
        w = op.input_value(1).get_node()
        source = w.input_value(0).get_node() if w.get_type_name() == "Convert" else w
        if source.get_type_name() != "Constant":
            continue
        name = next((n for n in w.output(0).get_names() if n in parts or n in reader), None)
        if name is None:
            continue
        weight, index = parts.get(name, (name, None))
        if weight not in reader or (got := blocks.weight(weight, index, reader.array(weight))) is None:
            continue
        kind, raw = got
        q = values(kind, raw)
        if kind == "Q8_0":
            const = ops.constant(np.ascontiguousarray(q))
        else:
            tensor = ov.Tensor(ov.Type.i4, ov.Shape(list(q.shape)))
            np.copyto(tensor.data.reshape(-1).view(np.uint8), nibbles(q).reshape(-1))
            const = ops.constant(tensor)
        # f32 scales: kept fp16 (Converted where read) the IR is 6% smaller, but the CPU plugin then holds an
        # f32 copy of them besides (measured on the 12 B transformer: 15.3 GB anonymous against 13.8 GB)
        weights = ops.multiply(ops.convert(const, ov.Type.f32), ops.constant(scales(raw)[..., None]))
        full = ops.reshape(weights, ops.constant(np.array([q.shape[0], q.shape[1] * BLOCK], np.int64)), False)
        op.input(1).replace_source_output(full.output(0))
        kept[kind] = kept.get(kind, 0) + 1
    return dict(sorted(kept.items()))
