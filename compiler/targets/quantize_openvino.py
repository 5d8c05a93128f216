"""Weight-only quantization for OpenVINO (target option `weights: int8 | int4 | gguf`): NNCF's weight compression.

Owns: the ov.Model side: Linear weights made transpose_b (`transposes_into_matmuls`), and the compression
itself with its count of the Linears it reached (`compress_openvino`); on device CPU the convolutions are left
float (KEPT_FLOAT): its plugin widens an int8 convolution weight back to f32 when it compiles, so compressing
one costs fidelity and saves no memory. The export's ONNX rewritten for NNCF
first (`weights_as_parts`), which formats a backend takes and the Linear matching all rewrites share are
compiler/targets/quantize.py's.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

import numpy as np

from ..errors import BadInput
from .quantize import DEFAULT_GROUP, MIN_K, shortfall

# op types NNCF leaves float, by device: OpenVINO 2026.4's CPU plugin runs weight-compressed MatMuls
# (FullyConnected) from int8 / int4, but folds a compressed convolution's weight back to f32 at compile time
# (measured: benchmarks/quantized.py --parts unet, docs/benchmarks.md)
KEPT_FLOAT = {"CPU": ("Convolution", "GroupConvolution", "ConvolutionBackpropData")}


def transposes_into_matmuls(model) -> int:
    """MatMul(x, Transpose(W)) with W a 2-D constant (or a Convert of one) -> MatMul(x, W,
    transpose_b): how NNCF finds a Linear's weight, and no transposed copy of W is ever made
    (OpenVINO's reshape would fold one in memory)."""
    import openvino.opset13 as ops
    done = 0
    for op in list(model.get_ordered_ops()):
        if op.get_type_name() != "MatMul":
            continue
        t = op.input_value(1).get_node()
        if t.get_type_name() != "Transpose" or len(t.output(0).get_target_inputs()) != 1:
            continue
        w, perm = t.input_value(0).get_node(), t.input_value(1).get_node()
        source = w.input_value(0).get_node() if w.get_type_name() == "Convert" else w
        if source.get_type_name() != "Constant" or perm.get_type_name() != "Constant" \
                or len(w.get_output_partial_shape(0)) != 2 or list(np.asarray(perm.get_data())) != [1, 0]:
            continue
        attrs = op.get_attributes()
        new = ops.matmul(op.input_value(0), w.output(0), attrs["transpose_a"], not attrs["transpose_b"])
        new.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(new.output(0))
        done += 1
    return done


def compress_openvino(model, weights: str, group_size: int | None = None, what: str = "openvino",
                      device: str = "CPU"):
    """NNCF weight compression of an ov.Model (read from weights_as_parts' ONNX, its Linear weights
    made transpose_b by transposes_into_matmuls) for `device`, in place of it; returns (model, summary). Fewer
    Linears compressed than the model has is said on stderr as `what` and recorded (`shortfall`)."""
    # NNCF reports usage to OpenVINO's telemetry (a forked sender process per event) unless NNCF_CI is set,
    # read when nncf is imported: a precast build sends nothing anywhere
    os.environ.setdefault("NNCF_CI", "1")
    try:
        import nncf
    except ImportError:
        raise BadInput("target openvino weights=...: the nncf package is not installed "
                       "(pip install 'precast[quantize]')") from None
    logging.getLogger("nncf").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):    # NNCF's progress bar: stdout is `--json`'s
        out, summary = _nncf_compress(nncf, model, weights, group_size, KEPT_FLOAT.get(device.split(".")[0], ()))
    linears, done = _ov_linears(out)
    return out, shortfall({**summary, "matmuls": done}, linears, f"{what} weights={weights}")


def _nncf_compress(nncf, model, weights: str, group_size: int | None, kept_float: tuple[str, ...]):
    ignored = nncf.IgnoredScope(names=_tables(model), types=list(kept_float), validate=False)
    if weights in ("int8", "gguf"):       # gguf: the weights not kept as GGUF blocks (gguf_blocks.into_openvino)
        out = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM, ignored_scope=ignored)
        summary = {"mode": "int8_asym", "granularity": "per-channel"}
    else:
        group = group_size or DEFAULT_GROUP["openvino"]
        out = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group, ratio=1.0,
                                    ignored_scope=ignored, advanced_parameters=nncf.AdvancedCompressionParameters(
                                        group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))
        summary = {"mode": "int4_sym", "group_size": group, "backup": "int8_asym"}
    counts: dict[str, int] = {}
    for op in out.get_ordered_ops():
        if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in ("u8", "i8", "u4", "i4"):
            t = op.get_element_type().get_type_name()
            counts[t] = counts.get(t, 0) + 1
    summary["constants"] = counts
    summary["kept_float"] = sorted({op.get_type_name() for op in out.get_ordered_ops()} & set(kept_float))
    summary["nncf"] = nncf.__version__
    return out, summary


def _ov_linears(model) -> tuple[int, int]:
    """(Linears, Linears with a compressed weight) of an ov.Model: MatMuls whose B is computed from
    constants only, 2-D, reducing over K >= MIN_K values; compressed when one of those constants is a
    u8 / i8 / u4 / i4 one (NNCF's weight, scale and zero-point pattern)."""
    linears = done = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        shape = op.get_input_partial_shape(1)
        if len(shape) != 2 or not shape.is_static:
            continue
        k = shape[1].get_length() if op.get_attributes()["transpose_b"] else shape[0].get_length()
        stack, types, constant = [op.input_value(1).get_node()], set(), True
        while stack and constant:
            node = stack.pop()
            if node.get_type_name() == "Constant":
                types.add(node.get_element_type().get_type_name())
            elif node.get_type_name() == "Parameter" or node.get_input_size() == 0:
                constant = False
            else:
                stack.extend(v.get_node() for v in node.input_values())
        if constant and k >= MIN_K:
            linears += 1
            done += bool(types & {"u8", "i8", "u4", "i4"})
    return linears, done


def _tables(model) -> list[str]:
    """MatMuls of an ov.Model whose constant operand reduces over fewer than MIN_K values (a table such
    as Flux's RoPE frequencies, not a Linear): kept float."""
    names = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        w = op.input_value(1).get_node()
        source = w.input_value(0).get_node() if w.get_type_name() == "Convert" else w
        shape = w.get_output_partial_shape(0)
        if source.get_type_name() == "Constant" and len(shape) == 2 and shape.is_static:
            k = shape[1].get_length() if op.get_attributes()["transpose_b"] else shape[0].get_length()
            if k < MIN_K:
                names.append(op.get_friendly_name())
    return names
