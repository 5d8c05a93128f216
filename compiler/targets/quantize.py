"""Weight-only quantization of a component graph, as a target option (`weights:`), not an export dtype.

Owns: which weight formats each backend takes (WEIGHTS), what is refused before any build
(`weights_problem`: a format the backend cannot run, FP8 for a GPU without FP8 tensor cores), which
components are quantized (QUANTIZED: every component but the VAEs, which are small and whose
convolutions decide image quality), the Linear matching every rewrite shares, and the graph rewrites
themselves (the ONNX ones here; OpenVINO's on the ov.Model in quantize_openvino.py, TensorRT-RTX's in
quantize_tensorrt.py):
- OpenVINO: NNCF's weight compression on the ov.Model (int8: INT8_ASYM per output channel; int4:
  INT4_SYM in groups of `group_size`, default 64, a layer whose width the group does not divide
  adjusted to a smaller group; the first/last layers and convolutions NNCF keeps at int8), read from
  the export as `weights_as_parts` rewrites it, Linear weights made transpose_b by
  `transposes_into_matmuls`.
- ONNX Runtime: its MatMulNBits contrib op (8 or 4 bits, symmetric, blocks of `block_size` along K,
  default 32; the blocks made by ONNX Runtime's own kernel, the one its MatMulNBitsQuantizer calls)
  on the MatMul weights, which the CPU provider runs; after onnxsim, before ONNX Runtime's own
  optimization. onnxsim fuses MatMul + Add on a 2-D input (time / modulation embeddings) into Gemm: a
  Gemm's weight is quantized the same way, its bias becoming MatMulNBits' bias input (one kernel).
  Streamed: one weight in memory at a time (a 12 B transformer quantizes in a few GB); a bf16 export
  comes out computing in fp32, so the CPU fallback of a bf16-only model is one build.
- TensorRT-RTX: DequantizeLinear on each MatMul weight (fp8 e4m3 or int8, symmetric, one scale
  per output channel computed from the weights' absolute maximum), quantize_tensorrt.py.
- `weights: gguf` (OpenVINO, ONNX Runtime): the Q8_0 / Q4_0 blocks of the .gguf file the export was
  made from kept as they are (gguf_blocks.py), the other weights int8 as above.
A constant MatMul operand reducing over fewer than MIN_K values is a table (Flux's RoPE frequencies),
not a Linear: never quantized (an int8 angle table shifts every position's rotation).
The exports write MatMul(x, Transpose(W)), fused weights cut by a Slice first. Every rewrite follows those
chains (`_matmul_weight_sources`; a weight's parts quantized one by one) and streams: one weight in memory
at a time. Each rewrite counts the graph's Linears apart from its own matching (`linear_count`) and says on
stderr, and in the artifact's metadata (`linears`, `unquantized`), when it quantized fewer (`shortfall`).
"""
from __future__ import annotations

import importlib.metadata
import logging
import sys
from pathlib import Path

import numpy as np

from ..errors import BadInput
from ..export_paths import beside
from . import gguf_blocks
from .onnx_weights import DataWriter, Initializers, link, nbytes, retype, row_part, slice_index, tensor_array

# gguf: the blocks of the .gguf file the export was made from, kept as they are (gguf_blocks.py)
WEIGHTS = {"openvino": ("int8", "int4", "gguf"), "onnxruntime": ("int8", "int4", "gguf"), "tensorrt-rtx": ("fp8", "int8")}
FP8_CCS = ("sm_89", "sm_120", "sm_121")     # Ada and Blackwell: FP8 tensor cores (sm_80 / sm_86 have none)
DEFAULT_GROUP = {"openvino": 64, "onnxruntime": 32}
MIN_K = 16      # a constant MatMul operand reducing over fewer values is a table (Flux's RoPE frequencies), not a Linear
REVISION = "weights-3"                       # bump when a quantizer changes: it is in the cache key (toolchain)


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


# --- OpenVINO: the export's ONNX as NNCF reads it (the compression: quantize_openvino.py) -----------------

def weights_as_parts(source: Path, out_dir: Path, parts: dict | None = None) -> Path:
    """`source` rewritten into `out_dir` for NNCF, which compresses only a constant a MatMul reads
    directly (or through Transpose / Convert), and for OpenVINO's CPU plugin, which keeps compressed
    weights compressed only in an fp32 graph. Returns the new model.onnx; nothing big is copied:
    - each Slice with constant bounds of a 2-D weight (a fused qkv / modulation weight cut into its
      parts) becomes an initializer of its own: a slice of rows names the same bytes of the export's
      weights file (hard-linked into `out_dir`; copied where it cannot be), a slice of columns is copied;
    - a bf16 / fp16 graph computes in fp32: its weights of 1 MiB or more stay half precision behind a
      Cast to fp32 (OpenVINO's decompression pattern), smaller initializers are widened.
    `parts`, where given, is filled with each part's name -> (the weight's name, its numpy index)."""
    import onnx
    model = onnx.load(str(source), load_external_data=False)
    reader = Initializers(model, Path(source).parent)
    inits = {t.name: t for t in model.graph.initializer}
    for name, tensor in {e.value: t.name for t in inits.values() for e in t.external_data if e.key == "location"}.items():
        link(beside(Path(source), name, tensor), out_dir / name)
    half = (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16)
    widen = {t: onnx.TensorProto.FLOAT for t in half if reader.had(t)}
    made = []
    with DataWriter(out_dir / "parts.onnx_data") as data:
        for node in [n for n in model.graph.node if n.op_type == "Slice"]:
            w = inits.get(node.input[0])
            if w is None or len(w.dims) != 2 or (index := slice_index(node, inits)) is None:
                continue
            made.append(row_part(w, index, node.output[0]) or
                        data.tensor(node.output[0], w.data_type, np.ascontiguousarray(reader.array(w.name)[index])))
            if parts is not None:
                parts[node.output[0]] = (w.name, index)
            model.graph.node.remove(node)
        model.graph.initializer.extend(made)
        used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output} \
            | {i.name for i in model.graph.input}
        kept, casts = [], []
        for t in model.graph.initializer:
            if t.name not in used:
                continue
            if t.data_type not in widen:
                kept.append(t)
            elif nbytes(t) >= (1 << 20):        # stays half; a Cast makes it fp32 where it is read
                casts.append(onnx.helper.make_node("Cast", [t.name + "_half"], [t.name], to=onnx.TensorProto.FLOAT,
                                                   name=t.name + "_cast"))
                t.name += "_half"
                kept.append(t)
            else:
                arr = tensor_array(t, out_dir)
                kept.append(data.tensor(t.name, onnx.TensorProto.FLOAT, np.asarray(arr, np.float32)))
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    retype(model.graph, widen)
    for cast in reversed(casts):         # first: they read initializers only
        model.graph.node.insert(0, cast)
    out = out_dir / "model.onnx"
    onnx.save_model(model, str(out))
    return out


# --- ONNX Runtime ------------------------------------------------------------------------------

def quantize_onnxruntime(source: Path, out: Path, weights: str, block_size: int | None = None,
                         carried=None, what: str = "") -> dict:
    """MatMulNBits (8 or 4 bits) for `source`'s MatMul weights, written to `out` (+ `out`_data),
    one weight at a time: `source`'s external weights are memory-mapped and each quantized weight or
    other initializer is appended to `out`_data as it is made, so a 12 B transformer needs host memory
    for one weight, not the model. A bf16 graph (which ONNX Runtime's CPU provider cannot run) comes out
    computing in fp32: its other initializers, inputs, outputs and casts made fp32.
    weights=gguf: a weight `carried` (gguf_blocks.GgufBlocks) holds keeps its GGUF blocks (Q8_0 8 bits,
    Q4_0 4 bits, block 32); the others are quantized int8.
    A Gemm (onnxsim's MatMul + Add on a 2-D input) becomes MatMulNBits with its C as the bias input (one
    kernel, the bias added as the output is written) -- or an Add after it where C is not one value per output.
    Fewer Linears quantized than the graph has (`linear_count`) is said on stderr as `what` and recorded."""

    import onnx
    try:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
    except ImportError as e:
        raise BadInput(f"target onnxruntime weights={weights}: onnxruntime's quantizer cannot load ({e}); "
                       "pip install 'precast[quantize]'") from None
    logging.getLogger("onnxruntime").setLevel(logging.WARNING)
    bits = 4 if weights == "int4" else 8
    block = block_size or DEFAULT_GROUP["onnxruntime"]
    from_gguf = {}                             # GGUF type -> weights that keep its blocks
    model = onnx.load(str(source), load_external_data=False)
    reader = Initializers(model, Path(source).parent)
    widen = {onnx.TensorProto.BFLOAT16: onnx.TensorProto.FLOAT}
    count, folded, done = 0, 0, {}
    linears, dims = linear_count(model), {t.name: list(t.dims) for t in model.graph.initializer}
    with DataWriter(out.with_name(out.name + "_data")) as data:
        for node, (name, index), transposed, between in _matmul_weight_sources(model):
            key = (name, str(index), transposed)   # the orientation decides K and N
            if key not in done:      # a weight two MatMuls share is quantized once
                # GGUF blocks run along K: a weight read through a Transpose ([N, K]) can keep them
                got = carried.weight(name, index, reader.array(name)) if carried is not None and transposed else None
                if got is not None:
                    packed, scales, nbits = gguf_blocks.matmul_nbits(*got)
                    n_out, k, nblock = packed.shape[0], packed.shape[1] * gguf_blocks.BLOCK, gguf_blocks.BLOCK
                    from_gguf[got[0]] = from_gguf.get(got[0], 0) + 1
                else:
                    w = reader.array(name)
                    w = (w if index is None else w[index]).astype(np.float32)   # [N, K] through a Transpose, else [K, N]
                    if not transposed:
                        w = w.T
                    n_out, k = w.shape
                    nbits, nblock = bits, block
                    packed, scales = _nbits(w, bits, block, quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits)
                    del w
                act = widen.get(reader.dtype(name), reader.dtype(name))
                scales = scales.astype(onnx.helper.tensor_dtype_to_np_dtype(act))
                part = name if index is None and not any(d[0] == name for d in done) else f"{name}_part{len(done)}"
                qname, sname = part + f"_Q{nbits}", part + "_scales"
                model.graph.initializer.extend([data.tensor(qname, onnx.TensorProto.UINT8, packed),
                                                data.tensor(sname, act, scales)])
                done[key] = (qname, sname, k, n_out, nbits, nblock)
            qname, sname, k, n_out, nbits, nblock = done[key]
            bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else ""
            node.op_type, node.domain = "MatMulNBits", "com.microsoft"
            del node.input[1:]
            del node.attribute[:]        # a Gemm's transB, alpha, beta: said by the packing
            node.input.extend([qname, sname])
            if bias and dims.get(bias) == [n_out]:
                node.input.extend(["", "", bias])          # no zero points, no g_idx: the bias input
            elif bias:
                at = list(model.graph.node).index(node) + 1
                model.graph.node.insert(at, onnx.helper.make_node(
                    "Add", [node.output[0] + "_nobias", bias], [node.output[0]], name=node.name + "_bias"))
                node.output[0] += "_nobias"
            node.attribute.extend([onnx.helper.make_attribute(a, v) for a, v in
                                   (("K", k), ("N", n_out), ("bits", nbits), ("block_size", nblock))])
            for b in between:
                model.graph.node.remove(b)
            folded += any(b.op_type == "Transpose" for b in between)
            count += 1
        used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output} \
            | {i.name for i in model.graph.input}
        kept = []
        for t in model.graph.initializer:
            if t.name in reader and t.name in used:
                kind = reader.dtype(t.name)
                arr = reader.array(t.name)
                if kind in widen:
                    arr, kind = arr.astype(np.float32), widen[kind]
                kept.append(data.tensor(t.name, kind, arr))
            elif t.name not in reader:
                kept.append(t)                   # made above (already in the data file)
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    retype(model.graph, widen)
    onnx.save_model(model, str(out))
    left = sum(1 for n in model.graph.node if n.op_type in ("MatMul", "Gemm"))
    return shortfall({"op": "MatMulNBits", "bits": bits, "block_size": block, "symmetric": True, "matmuls": count,
            "matmuls_float": left, "transposes_folded": folded,
            **({"gguf_blocks": dict(sorted(from_gguf.items())), "requantized": len(done) - sum(from_gguf.values())}
               if weights == "gguf" else {}),
            **({"activations": "fp32 (from bf16)"} if reader.had(onnx.TensorProto.BFLOAT16) else {})},
        linears, what or f"{source} onnxruntime weights={weights}")


def _nbits(w, bits: int, block: int, kernel):
    """ONNX Runtime's own block quantizer (the kernel MatMulNBitsQuantizer calls) on one weight w[N, K]:
    (packed uint8 [N, K/block, block*bits/8], scales [N, K/block]), symmetric, K zero-padded to the block."""
    n_out, k = w.shape
    blocks = -(-k // block)
    kw = np.zeros((blocks * block, n_out), np.float32)     # the kernel reads W as [K, N], row-major
    kw[:k] = w.T
    packed = np.zeros((n_out, blocks, block * bits // 8), np.uint8)
    scales = np.zeros((n_out, blocks), np.float32)
    zero_points = np.zeros((n_out, -(-blocks * bits // 8)), np.uint8)
    kernel(packed, kw, scales, zero_points, block, n_out, blocks * block, True)
    return packed, scales


def _gemm_ok(n) -> bool:
    """A MatMul, or a Gemm that is one (A untransposed, alpha 1, beta 1: onnxsim's MatMul + Add fusion)."""
    if n.domain not in ("", "ai.onnx"):
        return False
    if n.op_type == "MatMul":
        return True
    a = {x.name: x for x in n.attribute}
    return n.op_type == "Gemm" and (a["transA"].i if "transA" in a else 0) == 0 \
        and (a["alpha"].f if "alpha" in a else 1.0) == 1.0 and (a["beta"].f if "beta" in a else 1.0) == 1.0


def _trans_b(n) -> bool:
    return n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)


def _matmul_weight_sources(model):
    """(MatMul or Gemm node, weight, transposed, [nodes between them]) for each MatMul -- or Gemm with A
    untransposed and alpha = beta = 1, what onnxsim makes of MatMul + Add on a 2-D input -- whose B is a
    2-D initializer reducing over K >= MIN_K values, read directly, through Transpose(perm [1, 0]), through
    a Slice with constant bounds (a fused qkv or modulation weight cut into its parts), or both; a weight is
    (initializer name, numpy index or None); `transposed`: the weight is stored [N, K] (read through a
    Transpose, or by a Gemm with transB = 1), else [K, N]. The nodes between are returned for removal, so
    each must feed nothing else."""
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in model.graph.output}
    found = []
    for n in list(model.graph.node):
        if not _gemm_ok(n):
            continue
        x, between, transposed, index = n.input[1], [], _trans_b(n), None
        for _ in range(2):
            if x in inits:
                break
            p = producer.get(x)
            if p is None or x in outputs or len(readers[x]) != 1:
                x = None
                break
            if p.op_type == "Transpose" and not any(b.op_type == "Transpose" for b in between) and index is None \
                    and next((list(a.ints) for a in p.attribute if a.name == "perm"), [1, 0]) == [1, 0]:
                transposed = not transposed
            elif p.op_type == "Slice" and index is None and (index := slice_index(p, inits)) is not None:
                pass
            else:
                x = None
                break
            between.append(p)
            x = p.input[0]
        if x in inits and len(inits[x].dims) == 2 and _reduced(inits[x].dims, index, transposed) >= MIN_K:
            found.append((n, (x, index), transposed, between))
    return found


def linear_count(model) -> int:
    """MatMul / Gemm nodes of an ONNX graph whose B is a constant -- an initializer or Constant, through
    any nodes whose other inputs are constants too (Transpose, Slice, Cast, Reshape, ...) -- 2-D and
    reducing over K >= MIN_K values: the graph's Linears, counted apart from the rewrites' own matching
    so that a weight they pass over shows (`shortfall`)."""
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    const = set(inits)
    for n in model.graph.node:            # in topological order, as ONNX keeps them
        if all(i in const for i in n.input if i):
            const.update(n.output)
    count = 0
    for n in model.graph.node:
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in const:
            continue
        x, flips = n.input[1], _trans_b(n)
        while x not in inits and x in producer and producer[x].op_type != "Constant":
            flips ^= producer[x].op_type == "Transpose"
            x = producer[x].input[0]
        dims = list(inits[x].dims) if x in inits else \
            next((list(a.t.dims) for a in producer[x].attribute if a.name == "value"), []) if x in producer else []
        count += len(dims) == 2 and dims[1 if flips else 0] >= MIN_K
    return count


def shortfall(info: dict, linears: int, what: str) -> dict:
    """`info` (a quantizer's summary, its `matmuls` the Linears it quantized) with `linears` and, when
    fewer were quantized, `unquantized` -- said on stderr too: a build never keeps float weights silently."""
    info = {**info, "linears": linears}
    left = linears - info["matmuls"]
    if left > 0:
        info["unquantized"] = left
        print(f"note: {what}: quantized {info['matmuls']} of the graph's {linears} Linear weights; {left} stay "
              f"float (a weight read in a way the quantizer does not follow)", file=sys.stderr)
    return info


def _reduced(dims, index, transposed: bool) -> int:
    """K, the length a MatMul reduces over, of a weight [rows, cols] (maybe sliced; [N, K] when read
    through a Transpose, else [K, N])."""
    rows, cols = index if index is not None else (slice(None), slice(None))
    axis, part = (1, cols) if transposed else (0, rows)
    return len(range(*part.indices(int(dims[axis]))))


def quantizer_versions(spec) -> dict:
    """What made a quantized artifact, for its cache key: precast's quantizer revision and the
    quantizing package's version (NNCF for OpenVINO; ONNX Runtime's own quantizer is covered by the
    onnxruntime version already in the toolchain)."""
    out = {"precast": REVISION}
    if spec.backend == "openvino":
        try:
            out["nncf"] = importlib.metadata.version("nncf")
        except importlib.metadata.PackageNotFoundError:
            out["nncf"] = "absent"
    return out
