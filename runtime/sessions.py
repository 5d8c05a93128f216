"""Sessions: one interface over every backend, `run(feeds) -> outputs`, numpy in and out.

Owns: loading an artifact folder (a cache entry or a bundle's artifact) with the backend it
was built for, importing that backend lazily (the runtime depends only on numpy).
OpenVINO blobs are imported with the compile config recorded at build time (an imported blob
does not remember its precision hint).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np


class Session(Protocol):
    input_names: list[str]
    output_names: list[str]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class OnnxRuntimeSession:
    def __init__(self, model_path: Path, threads: int | None = None):
        import onnxruntime as ort
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self._s = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self._s.get_inputs()]
        self.output_names = [o.name for o in self._s.get_outputs()]
        self._types = {i.name: i.type for i in self._s.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self._s.run(None, _cast(feeds, {k: _ORT_TYPES.get(v) for k, v in self._types.items()}))
        return dict(zip(self.output_names, outs))


class OpenVinoSession:
    def __init__(self, blob_path: Path, device: str, config: dict):
        import openvino as ov
        core = ov.Core()
        self._cm = core.import_model(Path(blob_path).read_bytes(), device, config)
        self.input_names = [p.get_any_name() for p in self._cm.inputs]
        self.output_names = [p.get_any_name() for p in self._cm.outputs]
        self._types = {p.get_any_name(): np.dtype(p.get_element_type().to_dtype()) for p in self._cm.inputs}
        self._request = self._cm.create_infer_request()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        res = self._request.infer(_cast(feeds, self._types))
        return {name: np.array(res[port]) for name, port in zip(self.output_names, self._cm.outputs)}


_ORT_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16),
              "tensor(int32)": np.dtype(np.int32), "tensor(int64)": np.dtype(np.int64)}


def _cast(feeds: dict[str, np.ndarray], types: dict) -> dict[str, np.ndarray]:
    """Feed each input in the dtype the artifact declares (e.g. fp16 graphs take fp16)."""
    return {k: np.ascontiguousarray(v, dtype=types.get(k) or v.dtype) for k, v in feeds.items()}


def open_artifact(folder: str | Path, metadata: dict, device: str | None = None) -> Session:
    """A session for an artifact folder, given its metadata (cache entry / bundle manifest)."""
    folder = Path(folder)
    backend = metadata["backend"]
    entry = folder / metadata["entry"]
    if backend == "onnxruntime":
        return OnnxRuntimeSession(entry)
    if backend == "openvino":
        return OpenVinoSession(entry, device or metadata.get("device", "CPU"), metadata.get("compile_config", {}))
    raise ValueError(f"no session for backend {backend!r} yet")
