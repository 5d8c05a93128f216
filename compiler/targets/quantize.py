"""Weight-only quantization of a component graph, as a target option (`weights:`), not an export dtype.

Owns: which weight formats each backend takes (WEIGHTS), what is refused before any build
(`weights_problem`: a format the backend cannot run, FP8 for a GPU without FP8 tensor cores), which
components are quantized (QUANTIZED: every component but the VAEs, which are small and whose
convolutions decide image quality), and the graph rewrites themselves:
- OpenVINO: NNCF's weight compression on the ov.Model (int8: INT8_ASYM per output channel; int4:
  INT4_SYM in groups of `group_size`, default 64, a layer whose width the group does not divide
  adjusted to a smaller group; the first/last layers and convolutions NNCF keeps at int8).
- ONNX Runtime: its MatMulNBits contrib op (onnxruntime.quantization's MatMulNBitsQuantizer, 8 or 4
  bits, symmetric, blocks of `block_size` along K, default 32) on the MatMul weights, which the CPU
  provider runs; after onnxsim, before ONNX Runtime's own optimization.
- TensorRT-RTX: DequantizeLinear on each MatMul weight (fp8 e4m3 or int8, symmetric, one scale
  per output channel computed from the weights' absolute maximum); TensorRT-RTX fuses it into the GEMM.
The exports write MatMul(x, Transpose(W)); `fold_weight_transposes` first stores W transposed, so a
MatMul reads its weight initializer directly (what both quantizers look for).
"""
from __future__ import annotations

from pathlib import Path

WEIGHTS = {"openvino": ("int8", "int4"), "onnxruntime": ("int8", "int4"), "tensorrt-rtx": ("fp8", "int8")}
FP8_CCS = ("sm_89", "sm_120", "sm_121")     # Ada and Blackwell: FP8 tensor cores (sm_80 / sm_86 have none)
DEFAULT_GROUP = {"openvino": 64, "onnxruntime": 32}
REVISION = "weights-1"                       # bump when a quantizer changes: it is in the cache key (toolchain)


def quantized(component: str) -> bool:
    """Does the `weights` option apply to this component? (The VAEs keep their export precision.)"""
    return not component.startswith("vae_")


def weights_problem(backend: str, weights: str | None, ccs: tuple[str, ...] = ()) -> str | None:
    """Why `weights` cannot be built for `backend` (and these compute capabilities); None if it can."""
    if weights is None:
        return None
    allowed = WEIGHTS.get(backend, ())
    if weights not in allowed:
        return (f"weights={weights}: {backend} takes " + (", ".join(allowed) if allowed else "no weight quantization")
                + (" (weight-only fp8 is a TensorRT-RTX format)" if weights == "fp8" else ""))
    if backend == "tensorrt-rtx" and weights == "fp8":
        ccs = ccs or ("sm_80", "sm_86", "sm_89", "sm_120", "sm_121")   # the default set includes Ampere
        bad = [c for c in ccs if c not in FP8_CCS]
        if bad:
            keep = [c for c in ccs if c in FP8_CCS]
            return (f"weights=fp8 needs FP8 tensor cores (Ada sm_89, Blackwell sm_120/sm_121); {', '.join(bad)} "
                    f"has none: build tensorrt-rtx:{','.join(keep) or 'sm_89,sm_120'} for fp8, or weights=int8")
    return None


def fold_weight_transposes(model) -> int:
    """MatMul(x, Transpose(W, perm=[1, 0])) with W an initializer -> MatMul(x, W^T), W^T stored.
    Returns how many were folded. The Transpose goes only when nothing else reads it."""
    import numpy as np
    from onnx import numpy_helper
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    graph_outputs = {o.name for o in model.graph.output}
    folded = 0
    for t in [n for n in model.graph.node if n.op_type == "Transpose"]:
        w = t.input[0]
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
        users = readers.get(t.output[0], [])
        if w not in inits or perm != [1, 0] or len(inits[w].dims) != 2 or t.output[0] in graph_outputs \
                or not users or any(u.op_type != "MatMul" or list(u.input).index(t.output[0]) != 1 for u in users):
            continue
        arr = numpy_helper.to_array(inits[w], base_dir="")
        new = numpy_helper.from_array(np.ascontiguousarray(arr.T), t.output[0])
        model.graph.initializer.append(new)
        model.graph.node.remove(t)
        if len(readers.get(w, [])) == 1:
            model.graph.initializer.remove(inits[w])
        folded += 1
    return folded


def load_with_weights(path: Path):
    """onnx.load with the external weights read into the model here: onnx refuses a weights file
    with more than one hard link, and the cache hard-links exports into bundles."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    files: dict[str, bytes] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        where = {e.key: e.value for e in t.external_data}
        name = where["location"]
        if name not in files:
            files[name] = (Path(path).parent / name).read_bytes()
        offset = int(where.get("offset", 0))
        length = int(where.get("length", len(files[name]) - offset))
        t.raw_data = files[name][offset:offset + length]
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]
    return model


def matmul_weights(model):
    """(MatMul node, its 2-D weight initializer) for each MatMul that reads one as its B input."""
    inits = {t.name: t for t in model.graph.initializer}
    return [(n, inits[n.input[1]]) for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]


# --- OpenVINO ----------------------------------------------------------------------------------

def compress_openvino(model, weights: str, group_size: int | None = None):
    """NNCF weight compression of an ov.Model in place of it; returns (model, summary)."""
    import logging
    try:
        import nncf
    except ImportError:
        from ..errors import BadInput
        raise BadInput("target openvino weights=...: the nncf package is not installed "
                       "(pip install 'precast[quantize]')") from None
    logging.getLogger("nncf").setLevel(logging.ERROR)
    if weights == "int8":
        out = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        summary = {"mode": "int8_asym", "granularity": "per-channel"}
    else:
        group = group_size or DEFAULT_GROUP["openvino"]
        out = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group, ratio=1.0,
                                    advanced_parameters=nncf.AdvancedCompressionParameters(
                                        group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))
        summary = {"mode": "int4_sym", "group_size": group, "backup": "int8_asym"}
    counts: dict[str, int] = {}
    for op in out.get_ordered_ops():
        if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in ("u8", "i8", "u4", "i4"):
            t = op.get_element_type().get_type_name()
            counts[t] = counts.get(t, 0) + 1
    summary["constants"] = counts
    summary["nncf"] = nncf.__version__
    return out, summary


# --- ONNX Runtime ------------------------------------------------------------------------------

def quantize_onnxruntime(source: Path, out: Path, weights: str, block_size: int | None = None) -> dict:
    """MatMulNBits (8 or 4 bits) for `source`'s MatMul weights, written to `out` (+ `out`_data)."""
    import logging

    import onnx
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as e:
        from ..errors import BadInput
        raise BadInput(f"target onnxruntime weights={weights}: onnxruntime's quantizer cannot load ({e}); "
                       "pip install 'precast[quantize]'") from None
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = load_with_weights(source)
    folded = fold_weight_transposes(model)
    bits = 8 if weights == "int8" else 4
    block = block_size or DEFAULT_GROUP["onnxruntime"]
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=True)
    q.process()
    model = q.model.model
    count = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits")
    left = sum(1 for n in model.graph.node if n.op_type == "MatMul")
    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + "_data", size_threshold=1024)
    return {"op": "MatMulNBits", "bits": bits, "block_size": block, "symmetric": True, "matmuls": count,
            "matmuls_float": left, "transposes_folded": folded}


# --- TensorRT-RTX ------------------------------------------------------------------------------

def qdq_weights(source: Path, out: Path, weights: str) -> dict:
    """DequantizeLinear on each MatMul weight: W ~ q * scale, q fp8 e4m3 (|q| <= 448) or int8
    (|q| <= 127), one fp32 scale per output channel (W's column, as MatMul reads W[K, N]) from max|W|."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper
    model = load_with_weights(source)
    folded = fold_weight_transposes(model)
    count = 0
    for node, init in matmul_weights(model):
        w = numpy_helper.to_array(init, base_dir="").astype(np.float32)
        top = 448.0 if weights == "fp8" else 127.0
        amax = np.abs(w).max(axis=0)
        scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
        if weights == "fp8":
            import ml_dtypes
            q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            qt = helper.make_tensor(init.name + "_q", onnx.TensorProto.FLOAT8E4M3FN, q.shape,
                                    q.view(np.uint8).tobytes(), raw=True)
        else:
            qt = numpy_helper.from_array(np.clip(np.round(w / scale), -127, 127).astype(np.int8), init.name + "_q")
        if init.data_type != onnx.TensorProto.FLOAT:     # scale in the weight's own type (strongly typed)
            scale = scale.astype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
        st = numpy_helper.from_array(scale, init.name + "_scale")
        model.graph.initializer.remove(init)
        model.graph.initializer.extend([qt, st])
        dq = helper.make_node("DequantizeLinear", [qt.name, st.name], [init.name], name=init.name + "_dq", axis=1)
        model.graph.node.insert(list(model.graph.node).index(node), dq)
        count += 1
    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + "_data", size_threshold=1024)
    return {"format": "fp8_e4m3" if weights == "fp8" else "int8", "scales": "per-channel", "symmetric": True,
            "matmuls": count, "transposes_folded": folded}


def quantizer_versions(spec) -> dict:
    """What made a quantized artifact, for its cache key: precast's quantizer revision and the
    quantizing package's version (NNCF for OpenVINO; ONNX Runtime's own quantizer is covered by the
    onnxruntime version already in the toolchain)."""
    import importlib.metadata
    out = {"precast": REVISION}
    if spec.backend == "openvino":
        try:
            out["nncf"] = importlib.metadata.version("nncf")
        except importlib.metadata.PackageNotFoundError:
            out["nncf"] = "absent"
    return out
