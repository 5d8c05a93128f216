"""Weight-only fp8 / int8 for TensorRT-RTX: DequantizeLinear on each MatMul weight, streamed.

Owns `qdq_weights`, the rewrite the TensorRT-RTX target parses instead of the export when a build has
`weights: fp8 | int8`: every MatMul (or Gemm) weight that quantize.py's `_matmul_weight_sources` finds (read
directly, through Transpose(perm [1, 0]), through a constant Slice -- the parts of Flux's fused qkv /
modulation / linear1 weights -- or both) becomes q (fp8 e4m3, |q| <= 448, or int8, |q| <= 127) and one
scale per output channel from max|W|, symmetric, and a DequantizeLinear feeding the MatMul, which
TensorRT-RTX fuses into the GEMM. Orientation: the export writes MatMul(x, Transpose(W)) with W [N, K];
q is stored as the MatMul reads it, [K, N] (the Transpose and Slice between are removed when they feed
only that MatMul), so the DequantizeLinear has axis=1 and its N scales are the output channels'. The
scale is in the weight's own dtype (TensorRT-RTX networks are strongly typed: a bf16 graph dequantizes
to bf16). Streamed like quantize_onnxruntime: the export's weights are memory-mapped, each weight is
quantized in row chunks and appended to `out`_data as it is made, the other initializers copied one by
one, so a 12 B transformer needs host memory for about one weight, not the model.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from .onnx_weights import DataWriter, Initializers
from .quantize import _matmul_weight_sources, linear_count, shortfall

TOP = {"fp8": 448.0, "int8": 127.0}
CHUNK = 1 << 20             # elements of W converted to fp32 at a time (4 MiB, a few such temporaries)


def qdq_weights(source: Path, out: Path, weights: str) -> dict:
    """`source` (an export's model.onnx) rewritten to `out` (+ `out`_data) with each MatMul weight
    W ~ DequantizeLinear(q, scale, axis=1), q [K, N] fp8 e4m3 or int8, scale [N] per output channel
    from max|W| (in W's dtype). Returns what was done, for the artifact's metadata."""
    import onnx
    from onnx import helper
    if weights not in TOP:
        raise ValueError(f"qdq_weights: weights={weights!r}, expected fp8 or int8")
    source, out = Path(source), Path(out)
    model = onnx.load(str(source), load_external_data=False)
    reader = Initializers(model, source.parent)
    qtype = onnx.TensorProto.FLOAT8E4M3FN if weights == "fp8" else onnx.TensorProto.INT8
    done: dict = {}          # (weight, index, transposed) -> DequantizeLinear output (a weight two MatMuls share)
    dqs, names = [], {t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    count = folded = parts = 0
    linears = linear_count(model)
    with DataWriter(out.with_name(out.name + "_data")) as data:
        for node, (name, index), transposed, between in _matmul_weight_sources(model):
            key = (name, str(index), transposed)
            if key not in done:
                base = name if index is None and not any(k[0] == name for k in done) else f"{name}_part{len(done)}"
                while any(base + s in names for s in ("_q", "_scale", "_dq")):
                    base += "_"
                w = reader.array(name)
                q, scale = _quantize(w if index is None else w[index], transposed, weights, reader.dtype(name))
                del w
                qt = data.tensor(base + "_q", qtype, q)
                st = data.tensor(base + "_scale", reader.dtype(name), scale)
                del q
                model.graph.initializer.extend([qt, st])
                dqs.append(helper.make_node("DequantizeLinear", [qt.name, st.name], [base + "_dq"],
                                            name=base + "_dq", axis=1))
                names.update(base + s for s in ("_q", "_scale", "_dq"))
                done[key] = base + "_dq"
            node.input[1] = done[key]
            for a in node.attribute:
                if a.name == "transB":   # a Gemm (onnxsim's MatMul + Add) now reads B as q is stored, [K, N]
                    a.i = 0
            for b in between:
                model.graph.node.remove(b)
            folded += any(b.op_type == "Transpose" for b in between)
            parts += index is not None
            count += 1
        for dq in reversed(dqs):                  # first: they read initializers only
            model.graph.node.insert(0, dq)
        used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
        kept = []
        for t in model.graph.initializer:
            if t.name not in used:
                continue                          # a weight now read only through its quantized copies
            if t.name in reader and t.data_location == onnx.TensorProto.EXTERNAL:
                kept.append(data.tensor(t.name, t.data_type, reader.array(t.name)))    # copied, one at a time
            else:
                kept.append(t)                    # inline, or made above (already in the data file)
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    produced = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input} \
        | {t.name for t in model.graph.initializer}
    stale = [v for v in model.graph.value_info if v.name not in produced]    # the removed Transpose / Slice outputs
    for v in stale:
        model.graph.value_info.remove(v)
    onnx.save_model(model, str(out))
    return shortfall({"format": "fp8_e4m3" if weights == "fp8" else "int8", "scales": "per-channel", "symmetric": True,
                      "matmuls": count, "weights": len(done), "parts": parts, "transposes_folded": folded},
                     linears, f"{source} tensorrt-rtx weights={weights}")


def _quantize(w, transposed: bool, weights: str, dtype: int):
    """One weight as the MatMul reads it -- w.T ([N, K] stored) when `transposed`, else w ([K, N]) --
    quantized: (q [K, N] in fp8 e4m3 / int8, scale [N] in `dtype`'s numpy type). Converted to fp32
    CHUNK elements at a time; q is the only full-size array made (1 byte an element)."""
    import onnx
    top = TOP[weights]
    sdtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    qdtype = np.dtype(ml_dtypes.float8_e4m3fn) if weights == "fp8" else np.dtype(np.int8)
    rows, cols = w.shape
    step = max(1, CHUNK // max(cols, 1))
    # output channels: rows of the stored [N, K] when transposed, columns of the stored [K, N] otherwise
    amax = np.zeros(rows if transposed else cols, np.float32)
    for r in range(0, rows, step):
        part = np.abs(np.asarray(w[r:r + step], np.float32))
        if transposed:
            amax[r:r + step] = part.max(axis=1) if cols else 0
        else:
            np.maximum(amax, part.max(axis=0) if part.shape[0] else 0, out=amax)
    scale = np.where(amax > 0, amax / top, 1.0).astype(sdtype)    # rounded to W's dtype: the scale it runs with
    if sdtype != np.float32:
        tiny = ml_dtypes.finfo(sdtype).smallest_subnormal if sdtype.name == "bfloat16" \
            else np.finfo(sdtype).smallest_subnormal
        scale = np.where(scale.astype(np.float32) > 0, scale, tiny).astype(sdtype)
    inv = 1.0 / scale.astype(np.float32)
    q = np.empty((cols, rows) if transposed else (rows, cols), qdtype)
    for r in range(0, rows, step):
        part = np.asarray(w[r:r + step], np.float32) * (inv[r:r + step, None] if transposed else inv)
        if weights == "int8":
            np.rint(part, out=part)
        np.clip(part, -top, top, out=part)
        if transposed:
            q[:, r:r + step] = part.T.astype(qdtype)
        else:
            q[r:r + step] = part.astype(qdtype)
    return q, scale
