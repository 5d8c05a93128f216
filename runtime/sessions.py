"""Sessions: one interface over every backend, `run(feeds) -> outputs`, numpy in and out.

Owns: loading an artifact folder (a cache entry or a bundle's artifact) with the backend it
was built for, importing that backend lazily (the runtime depends only on numpy), and
`open_candidate`: the session for what selection chose (an artifact, or the bundle's ONNX compiled
or loaded at run time by OpenVINO, ONNX Runtime or one of its device EPs, ONNX_ON_DEVICE).
OpenVINO blobs are imported with the compile config recorded at build time (an imported blob
does not remember its precision hint). Memory: a blob's pages are released while it is imported, once after,
and when the pipeline trims a session (runtime/blob_pages.py), ONNX Runtime runs without its CPU arena
(measured: benchmarks/memory.py).
"""
from __future__ import annotations

from . import blob_pages
from .onnx_header import input_defaults
from .openvino_attention import rewrite_attention
from .embeddings import EXTRA_TOKENS_INPUT
from .cpu import default_precision

import mmap
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np


class Session(Protocol):
    input_names: list[str]
    output_names: list[str]
    input_shapes: dict[str, list[int | None]]    # declared input dims, None where one varies

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class OnnxRuntimeSession:
    EPS = {"onnxruntime-directml": "DmlExecutionProvider", "onnxruntime-coreml": "CoreMLExecutionProvider"}

    def __init__(self, model_path: Path, threads: int | None = None, optimized: bool = False,
                 provider: str = "onnxruntime", device_index: int = 0, cache_dir: str | None = None):
        """`provider` onnxruntime-directml: the DirectML EP on DXGI adapter `device_index` (Windows,
        onnxruntime-directml wheel; its documented settings: memory pattern off, sequential execution);
        onnxruntime-coreml: the CoreML EP (macOS), ML Program format on all compute units, its compiled
        model cached in `cache_dir`. Both written against ONNX Runtime's documented API; not run here."""
        import onnxruntime as ort
        opts = ort.SessionOptions()
        # no CPU arena: it keeps every call's largest activations (its chunks grow by powers of two, the memory
        # pattern's block on top): SD 1.5 UNet 512x512 peak RSS 6.74 -> 4.95 GiB, step time within 3%
        # (benchmarks/memory.py --options)
        opts.enable_cpu_mem_arena = False
        providers: list = ["CPUExecutionProvider"]
        if provider == "onnxruntime-directml":
            opts.enable_mem_pattern = False
            opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            providers = [("DmlExecutionProvider", {"device_id": device_index}), "CPUExecutionProvider"]
        elif provider == "onnxruntime-coreml":
            options = {"ModelFormat": "MLProgram", "MLComputeUnits": "ALL"}
            if cache_dir:
                options["ModelCacheDirectory"] = cache_dir
            providers = [("CoreMLExecutionProvider", options), "CPUExecutionProvider"]
        if provider in self.EPS and self.EPS[provider] not in ort.get_available_providers():
            raise RuntimeError(f"{self.EPS[provider]} is not in this onnxruntime build "
                               f"({', '.join(ort.get_available_providers())})")
        if optimized:   # optimized when it was built: opening it skips ONNX Runtime's graph passes
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        if input_defaults(model_path):  # an input with a default is meant (token_embeddings_extra): ORT's
            opts.log_severity_level = 3   # warning about it on every load is kept off stderr (errors still shown)
        self._s = ort.InferenceSession(str(model_path), opts, providers=providers)
        # inputs with a default (the export's token_embeddings_extra) are inputs to precast too
        ins = [*self._s.get_inputs(), *self._s.get_overridable_initializers()]
        self.input_names = [i.name for i in ins]
        self.input_shapes = {i.name: [d if isinstance(d, int) and d > 0 else None for d in i.shape] for i in ins}
        self.output_names = [o.name for o in self._s.get_outputs()]
        self._types = {i.name: i.type for i in ins}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self._s.run(None, _cast(feeds, {k: _ORT_TYPES.get(v) for k, v in self._types.items()}))
        return dict(zip(self.output_names, outs))


class OpenVinoSession:
    """A compiled blob imported with its recorded config, a saved IR (model.xml: how big models are
    stored) compiled with it, or (`from_onnx`) the bundle's ONNX compiled at load time -- the
    fallback when no blob serves this machine."""

    def __init__(self, path: Path, device: str, config: dict, from_onnx: bool = False, budget: int | None = None):
        import openvino as ov
        core = ov.Core()
        if budget is not None and not device.upper().startswith("CPU"):
            config = {**config, **openvino_gpu_memory(budget, _max_alloc(core, device))}
        if from_onnx:
            model = core.read_model(str(path))
            restore_input_defaults(model, ov)
            if device.upper().startswith("CPU"):     # as the OpenVINO target does: half attention fused
                rewrite_attention(model)
            self._cm = core.compile_model(model, device, config)
        elif Path(path).suffix == ".xml":     # rewrites already in the IR; its .bin read memory-mapped
            self._cm = core.compile_model(core.read_model(str(path)), device, config)
        else:  # the blob memory-mapped (copy-on-write), not read into bytes: 5-6x faster for a 3.4 GB
            # UNet. The compiled model keeps using the mapped memory, so the map lives as long as it does.
            self._blob = np.memmap(path, dtype=np.uint8, mode="c")
            self._cm = blob_pages.import_blob(core, ov, self._blob, device, config)
        self.input_names = [_port_name(p) for p in self._cm.inputs]
        self.input_shapes = {n: [d.get_length() if d.is_static else None for d in p.get_partial_shape()]
                             for n, p in zip(self.input_names, self._cm.inputs)}
        self.output_names = [_port_name(p) for p in self._cm.outputs]
        # OpenVINO's Python API hands bf16 data out as float16 views of the bf16 bits: kept as bits here
        self._bf16 = {n for n, p in zip(self.input_names + self.output_names, [*self._cm.inputs, *self._cm.outputs])
                      if p.get_element_type() == ov.Type.bf16}
        self._types = {n: np.dtype(p.get_element_type().to_dtype()) for n, p in zip(self.input_names, self._cm.inputs)
                       if n not in self._bf16}
        self._ov = ov
        self._request = self._cm.create_infer_request()

    def trim(self) -> bool:
        """Drop the imported blob's pages from RSS between uses (release_pages): what the compiled model reads
        in place (the Winograd-transformed constants: 4.2 GiB of SD 1.5's UNet) comes back from the page cache
        at its next call. False when there is nothing to drop."""
        blob = getattr(self, "_blob", None)
        return blob is not None and blob_pages.release_pages(blob, clean_parts=True)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = _cast({k: v for k, v in feeds.items() if k not in self._bf16}, self._types)
        for k in self._bf16 & set(feeds):
            v = np.asarray(feeds[k])
            inputs[k] = self._ov.Tensor(to_bf16_bits(v), self._ov.Shape(list(v.shape)), self._ov.Type.bf16)
        res = self._request.infer(inputs)
        out = {}
        for name, port in zip(self.output_names, self._cm.outputs):
            arr = np.array(res[port])
            out[name] = from_bf16_bits(arr.view(np.uint16)) if name in self._bf16 else arr
        return out


def openvino_gpu_memory(budget: int, max_alloc: int | None) -> dict[str, str]:
    """OpenVINO GPU plugin properties for a memory budget (bytes of device memory the component may take;
    an iGPU's is host memory it shares): AVAILABLE_DEVICE_MEM_SIZE (ov::intel_gpu::hint::available_device_mem,
    the device memory the plugin plans its allocations against) and, where the budget is larger than the
    device's largest single allocation (GPU_DEVICE_MAX_ALLOC_MEM_SIZE, often 4 GiB on Intel GPUs, less than
    one 12 B model's weights), GPU_ENABLE_LARGE_ALLOCATIONS. NOT VERIFIED ON HARDWARE (no Intel GPU here)."""
    out = {"AVAILABLE_DEVICE_MEM_SIZE": str(int(budget))}
    if max_alloc is not None and budget > max_alloc:
        out["GPU_ENABLE_LARGE_ALLOCATIONS"] = "YES"
    return out


def _max_alloc(core, device: str) -> int | None:
    try:
        return int(core.get_property(device, "GPU_DEVICE_MAX_ALLOC_MEM_SIZE"))
    except Exception:       # a plugin without the property (or no such device): nothing to widen
        return None


def restore_input_defaults(model, ov) -> int:
    """An ONNX input with an initializer default (the text encoder's token_embeddings_extra, see
    compiler/graphs/clip_text.py) is read by OpenVINO as a constant: made a parameter again (first
    dimension dynamic), so precast's embeddings still reach the graph. Returns how many."""
    if any(EXTRA_TOKENS_INPUT in p.get_names() for p in model.inputs):
        return 0
    count = 0
    for op in model.get_ops():
        if op.get_type_name() == "Constant" and EXTRA_TOKENS_INPUT in op.output(0).get_names():
            shape = op.output(0).get_partial_shape()
            param = ov.opset13.parameter(ov.PartialShape([-1, shape[1]]), op.output(0).get_element_type(),
                                         name=EXTRA_TOKENS_INPUT)
            param.output(0).set_names({EXTRA_TOKENS_INPUT})
            op.output(0).replace(param.output(0))
            model.add_parameters([param])
            count += 1
    if count:
        model.validate_nodes_and_infer_types()
    return count


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), rounding to nearest even, as a cast does."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _port_name(port) -> str:
    """The model-level name of an OpenVINO port (a tensor may carry internal names too)."""
    names = sorted(port.get_names())
    public = [n for n in names if not n.rsplit("_", 1)[-1].isdigit()]
    return (public or names or [port.get_any_name()])[0]


class TensorRtRtxSession:
    """A TensorRT-RTX engine on an NVIDIA GPU, driven through cuda-bindings (no torch, no pycuda).

    Written against the documented API (TensorRT-RTX 1.7 python bindings, cuda.bindings.runtime);
    NOT VERIFIED ON HARDWARE: no NVIDIA GPU is reachable where this was written."""

    def __init__(self, engine_path: Path, device_index: int = 0, weight_budget: int | None = None):
        import tensorrt_rtx as trt
        from cuda.bindings import runtime as cudart
        self._trt, self._cudart = trt, cudart
        _cuda_check(cudart.cudaSetDevice(device_index))
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        with map_engine(engine_path) as blob:   # deserialized from the page cache: no host copy of the engine
            validity, diagnostics = runtime.get_engine_validity(blob)
            if validity == trt.EngineValidity.INVALID:
                raise RuntimeError(f"TensorRT-RTX says the engine is invalid here (diagnostics bitmask {int(diagnostics)})")
            self._engine = runtime.deserialize_cuda_engine(blob)
        if self._engine is None:
            raise RuntimeError(f"TensorRT-RTX could not deserialize {engine_path}")
        if weight_budget is not None:
            self._engine.weight_streaming_budget_v2 = int(weight_budget)
        config = self._engine.create_runtime_config()
        self._context = self._engine.create_execution_context(config)
        self._stream = _cuda_check(cudart.cudaStreamCreate())
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        is_input = {n: self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = [n for n in names if is_input[n]]
        self.input_shapes = {n: [d if d >= 0 else None for d in self._engine.get_tensor_shape(n)]
                             for n in self.input_names}
        self.output_names = [n for n in names if not is_input[n]]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        trt, cudart, ctx = self._trt, self._cudart, self._context
        buffers = []
        try:
            for name in self.input_names:
                arr = np.ascontiguousarray(feeds[name], dtype=trt.nptype(self._engine.get_tensor_dtype(name)))
                ctx.set_input_shape(name, arr.shape)
                ptr = _cuda_check(cudart.cudaMallocAsync(arr.nbytes, self._stream))
                buffers.append(ptr)
                _cuda_check(cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes,
                                                   cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream))
                ctx.set_tensor_address(name, ptr)
            outputs = {}
            for name in self.output_names:
                shape = tuple(ctx.get_tensor_shape(name))
                out = np.empty(shape, dtype=trt.nptype(self._engine.get_tensor_dtype(name)))
                ptr = _cuda_check(cudart.cudaMallocAsync(out.nbytes, self._stream))
                buffers.append(ptr)
                ctx.set_tensor_address(name, ptr)
                outputs[name] = (out, ptr)
            if not ctx.execute_async_v3(self._stream):
                raise RuntimeError("TensorRT-RTX execution failed")
            for out, ptr in outputs.values():
                _cuda_check(cudart.cudaMemcpyAsync(out.ctypes.data, ptr, out.nbytes,
                                                   cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream))
            _cuda_check(cudart.cudaStreamSynchronize(self._stream))
            return {name: out for name, (out, _) in outputs.items()}
        finally:
            for ptr in buffers:
                cudart.cudaFreeAsync(ptr, self._stream)


@contextmanager
def map_engine(path: str | Path):
    """A serialized engine as a read-only buffer over the file's pages (TensorRT-RTX takes any
    buffer): a multi-GB engine is not copied into process memory before it goes to the GPU."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            yield view
        finally:
            view.release()


def _cuda_check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


class MigraphxSession:
    """A compiled MIGraphX program (.mxr). Written against migraphx's documented Python API;
    NOT VERIFIED ON HARDWARE (no AMD GPU / ROCm reachable where this was written)."""

    def __init__(self, mxr_path: Path, output_names: list[str]):
        import migraphx
        self._mx = migraphx
        self._program = migraphx.load(str(mxr_path), format="msgpack")
        self.input_names = list(self._program.get_parameter_names())
        shapes = self._program.get_parameter_shapes()     # MIGraphX programs are compiled for fixed dims
        self.input_shapes = {n: [int(d) for d in shapes[n].lens()] for n in self.input_names}
        self.output_names = list(output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = {k: self._mx.argument(np.ascontiguousarray(v)) for k, v in feeds.items()}
        results = self._program.run(args)
        return {name: np.array(r) for name, r in zip(self.output_names, results)}


_ORT_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16),
              "tensor(int32)": np.dtype(np.int32), "tensor(int64)": np.dtype(np.int64)}


def _cast(feeds: dict[str, np.ndarray], types: dict) -> dict[str, np.ndarray]:
    """Feed each input in the dtype the artifact declares (e.g. fp16 graphs take fp16); a 0-d feed (an
    optimum export's scalar timestep) stays 0-d (np.ascontiguousarray would make it [1])."""
    return {k: np.asarray(v, dtype=types.get(k) or v.dtype, order="C") for k, v in feeds.items()}



def open_artifact(folder: str | Path, metadata: dict, device: str | None = None,
                  output_names: list[str] | None = None, device_index: int = 0,
                  weight_budget: int | None = None) -> Session:
    """A session for an artifact, given its metadata (cache entry or bundle manifest entry)."""
    folder = Path(folder)
    backend = metadata["backend"]
    entry = folder / metadata["entry"]
    if backend == "onnxruntime":
        return OnnxRuntimeSession(entry, optimized=metadata.get("optimized") == "all")
    if backend == "onnxruntime-directml":
        return OnnxRuntimeSession(entry, provider=backend, device_index=device_index)
    if backend == "openvino":
        return OpenVinoSession(entry, device or metadata.get("device", "CPU"), metadata.get("compile_config", {}),
                               budget=weight_budget)
    if backend == "tensorrt-rtx":
        return TensorRtRtxSession(entry, device_index, weight_budget)
    if backend == "migraphx":
        return MigraphxSession(entry, output_names or [])
    raise ValueError(f"no session for backend {backend!r}")


ONNX_ON_DEVICE = ("onnxruntime-directml", "onnxruntime-coreml")    # ONNX Runtime EPs running an ONNX on a GPU


def open_candidate(c, output_names: list[str], offload: bool = False):
    """A session for one of select.py's candidates (its checks passed): an artifact through open_artifact,
    or the bundle's ONNX through OpenVINO, ONNX Runtime or an ONNX Runtime device EP."""
    if c.artifact is None:
        if c.backend in ONNX_ON_DEVICE:
            return OnnxRuntimeSession(c.entry, provider=c.backend, device_index=max(c.device.adapter, 0),
                                               cache_dir=_writable(c.ep_cache))
        if c.backend == "openvino":
            config = {"PERFORMANCE_HINT": "LATENCY",
                      "INFERENCE_PRECISION_HINT": default_precision("CPU", c.device.arch, c.component)}
            return OpenVinoSession(c.entry, "CPU", config, from_onnx=True)
        return OnnxRuntimeSession(c.entry)
    meta = {"backend": c.backend, "entry": c.artifact.entry, **c.artifact.metadata}
    index = int("".join(ch for ch in c.device.id if ch.isdigit()) or 0)
    if c.backend == "onnxruntime-directml" and c.device.adapter >= 0:
        index = c.device.adapter      # DirectML's device_id is the DXGI adapter index
    budget = 0 if offload and c.artifact.metadata.get("weight_streaming") else c.weight_budget
    device = "CPU" if c.device.kind == "cpu" else f"GPU.{index}"
    return open_artifact(_bundle_root(c), meta,  # weight_budget: streamed (TensorRT-RTX) or told (OpenVINO GPU)
                                  device=device if c.backend == "openvino" else None,
                                  output_names=output_names, device_index=index, weight_budget=budget)


def _writable(folder: str) -> str | None:
    """`folder`, created if need be; None (the EP compiles again on each load) when it cannot be."""
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
            return folder
    except OSError:
        pass
    return None


def _bundle_root(c) -> Path:
    entry = Path(c.entry)
    return Path(str(entry)[: -len(c.artifact.entry)]) if c.artifact else entry.parent
