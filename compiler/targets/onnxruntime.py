"""ONNX Runtime target: the component graph simplified (onnxsim) and optimized ahead of time by
ONNX Runtime itself, as the CPU artifact.

Owns: simplifying (constant folding, shape inference; models past protobuf's 2 GB limit skip it,
onnxsim cannot hold them), then ONNX Runtime's own graph optimizations at their highest level
(fusions and the NCHWc layout for convolutions), saved with external data, so that a session
opens the result with optimizations off. Before that, input dimensions that the shape profile
fixes (all of them for a static profile) are pinned in the graph, so the session plans its
memory from known shapes, and group norms become instance norms (onnxruntime_groupnorm.py);
after it, the saved nodes are put in one canonical order (ONNX Runtime's varies run to run).
SD 1.5 UNet session here: 32 s as exported -> 4.1 s optimized ahead of time -> 2.1 s with
pinned shapes -> 1.6-1.8 s with the group-norm rewrite. The NCHWc layout depends on the CPU's vector width, so an optimized artifact serves one CPU ISA level
and one ONNX Runtime release (`optimize: false` gives the plain graph, which serves any CPU).
"""
from __future__ import annotations

import heapq
import importlib.metadata
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from ...runtime.cpu import cpu_flags, isa_level
from ...runtime.fingerprint import Fingerprint
from ..errors import BadInput
from .base import BuildJob, required_inputs, TargetSpec
from .onnxruntime_groupnorm import rewrite_group_norms
from . import gguf_blocks
from .quantize import quantize_onnxruntime, quantized

PROTOBUF_LIMIT = 2 << 30
OPTIMIZED = "all"       # metadata `optimized`: the level the saved graph went through
REWRITES = "pinned-dims-1,group-norm-1,sorted-nodes-1"   # bump when a rewrite changes: it is part of the cache key


class OnnxRuntimeTarget:
    name = "onnxruntime"

    def toolchain(self) -> dict[str, str]:
        try:
            import onnxruntime
        except ImportError:
            raise BadInput("target onnxruntime: the onnxruntime package is not installed "
                           "(pip install 'precast[onnxruntime]')") from None
        out = {"onnxruntime": onnxruntime.__version__, "precast_onnxruntime_rewrites": REWRITES}
        try:  # the version from metadata: importing onnxsim costs seconds on every cache hit
            out["onnxsim"] = importlib.metadata.version("onnxsim")
        except importlib.metadata.PackageNotFoundError:
            out["onnxsim"] = "absent"
        return out

    def dtype_problem(self, dtype: str, spec: TargetSpec, component: str | None = None) -> str | None:
        """Why a component in `dtype` cannot be an ONNX Runtime (CPU) artifact, before any work: its CPU
        provider has no bf16 kernels (MatMul, Sigmoid, ... refuse to load). A bf16 component built with
        `weights` int8 / int4 can: the quantizer makes its graph compute in fp32 (quantize.py)."""
        if dtype == "bf16" and not (spec.get("weights") and (component is None or quantized(component))):
            return ("the export is bf16, which ONNX Runtime's CPU provider cannot run; export it with --dtype fp32 "
                    "or fp16 for onnxruntime (recipe precision: fp32 or fp16; bf16 serves openvino and tensorrt-rtx)"
                    + ("" if spec.get("weights") or (component is not None and not quantized(component))
                       else ", or build it with weights: int8 (MatMulNBits, fp32 compute)"))
        return None

    def fingerprint(self, spec: TargetSpec) -> Fingerprint:
        arch = isa_level(cpu_flags()) if spec.get("optimize", True) else "any"
        return Fingerprint("onnxruntime", self.toolchain()["onnxruntime"], "any", "cpu", (arch,))

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        if not spec.get("optimize", True):   # the plain graph, input default kept (sessions.py lists it):
            return self._build(job, spec, folder)   # byte-identical to the export, stored once in a bundle
        with required_inputs(job, folder) as job:    # input defaults stripped (base.py) before pinning dims
            return self._build(job, spec, folder)

    def _build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        data = job.onnx_path.with_name(job.onnx_path.name + "_data")
        size = job.onnx_path.stat().st_size + (data.stat().st_size if data.exists() else 0)
        note = "not simplified (over protobuf's 2 GB limit)" if size >= PROTOBUF_LIMIT else ""
        optimize = bool(spec.get("optimize", True))
        weights_option = spec.get("weights") if quantized(job.component) else None
        with tempfile.TemporaryDirectory(dir=folder, prefix=".simplified-") as tmp:
            source = job.onnx_path
            simplified = False
            if weights_option == "gguf":     # onnxsim folds Transpose(W) into new tensors: the record names W
                note = note or "not simplified (weights: gguf reads the export's weights by name)"
            if spec.get("simplify", True) and not note and self.toolchain()["onnxsim"] != "absent":
                _note(job, "onnxsim")
                source = _simplified(job.onnx_path, Path(tmp), job.shapes if optimize else {}) or source
            simplified = source != job.onnx_path
            rewrites = {}
            weights = spec.get("weights") if quantized(job.component) else None
            compression = None
            if weights:     # weight-only MatMulNBits (quantize.py): after onnxsim, before ONNX Runtime's optimization
                _note(job, f"quantize {weights}")
                quantized_path = Path(tmp) / "quantized" / "model.onnx"
                quantized_path.parent.mkdir()
                carried = gguf_blocks.of(job.extra.get("gguf_blocks")) if weights == "gguf" else None
                compression = {"format": weights, **quantize_onnxruntime(
                    source, quantized_path, weights, spec.get("block_size"), carried,
                    f"{job.component} onnxruntime weights={weights}")}
                source = quantized_path
            if optimize:
                _note(job, "optimize")
                rewrites = _optimized(source, folder / "model.onnx", job.shapes)
            else:    # the graph as it is (byte-identical to the export when onnxsim changed nothing)
                for name in ("model.onnx", "model.onnx_data"):
                    if source.with_name(name).exists():
                        shutil.copyfile(source.with_name(name), folder / name)
        return {"entry": "model.onnx", "simplified": simplified, "note": note, "weights": compression,
                "optimized": OPTIMIZED if optimize else "none", "static": optimize and job.static,
                "rewrites": rewrites}


def _note(job: BuildJob, phase: str) -> None:
    """The phase in the compile step's heartbeat lines (runtime/progress.py)."""
    beat = job.extra.get("heartbeat")
    if beat is not None:
        beat.note = phase


def pin_input_dims(model, shapes: dict) -> None:
    """Fix each graph-input dimension that the profile does not let vary (min == max)."""
    for inp in model.graph.input:
        if inp.name not in shapes:
            continue
        low, _, high = shapes[inp.name]
        for dim, a, b in zip(inp.type.tensor_type.shape.dim, low, high):
            if a == b:
                dim.Clear()
                dim.dim_value = a


def _simplified(onnx_path: Path, tmp: Path, shapes: dict) -> Path | None:
    import onnx
    import onnxsim
    model = onnx.load(str(onnx_path))
    pin_input_dims(model, shapes)
    model, ok = onnxsim.simplify(model, check_n=0)
    if not ok:
        return None
    out = tmp / "model.onnx"
    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx_data", size_threshold=1024)
    return out


def _optimized(source: Path, out: Path, shapes: dict) -> dict:
    """ONNX Runtime loads `source` (input dims pinned, group norms rewritten), optimizes it at its
    highest level and writes the graph it would run to `out`, weights in `out`_data. Returns
    the rewrites made ({"group_norm": count})."""
    import onnx
    import onnxruntime as ort
    model = onnx.load(str(source), load_external_data=False)    # the graph; weights stay in their file
    pin_input_dims(model, shapes)
    rewritten = rewrite_group_norms(model)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3     # its warning that an NCHWc graph is CPU-specific: the fingerprint says so
    opts.optimized_model_filepath = str(out)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", out.name + "_data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(source.parent))
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    saved = onnx.load(str(out), load_external_data=False)
    if sort_nodes(saved.graph):       # ONNX Runtime writes its nodes in an order that varies run to run
        tmp = out.with_name(out.name + ".sorted")
        onnx.save_model(saved, str(tmp))
        tmp.replace(out)
    return {"group_norm": rewritten} if rewritten else {}


def sort_nodes(graph) -> bool:
    """Reorder `graph`'s nodes into one canonical topological order (ready nodes by first output,
    tensor names being stable) and renumber the names ONNX Runtime generates (`..._token_N` from
    a counter that varies, or a bare op type), so equal graphs serialize to equal bytes. False (graph untouched) when
    a node holds a subgraph, whose implicit inputs this order does not see."""
    nodes = list(graph.node)
    if any(a.type in (a.GRAPH, a.GRAPHS) for n in nodes for a in n.attribute):
        return False
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    waits = [{producer[x] for x in n.input if x in producer} for n in nodes]
    users: dict[int, list[int]] = {}
    for i, deps in enumerate(waits):
        for d in deps:
            users.setdefault(d, []).append(i)
    key = [(n.output[0] if n.output else "", n.op_type, i) for i, n in enumerate(nodes)]
    ready = [key[i] for i, deps in enumerate(waits) if not deps]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)[2]
        order.append(nodes[i])
        for u in users.get(i, ()):
            waits[u].discard(i)
            if not waits[u]:
                heapq.heappush(ready, key[u])
    if len(order) != len(nodes):      # a cycle cannot be: keep ONNX Runtime's order
        return False
    bases = [re.sub(r"_token_\d+$", "", n.name) for n in order]   # its counter, or none, varies
    seen = Counter(bases)
    for position, (node, base) in enumerate(zip(order, bases)):
        node.name = f"{base}_n{position}" if base == node.op_type or seen[base] > 1 or not base else base
    graph.ClearField("node")
    graph.node.extend(order)
    return True
