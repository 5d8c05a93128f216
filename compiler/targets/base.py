"""The one interface every backend target implements, and the values it receives.

Owns: `TargetSpec` (backend + options, parsed from `backend[:arg,...]` or a recipe mapping),
`BuildJob` (one component ONNX + its input shapes), and the `Target` protocol:
toolchain() -> versions (BadInput when the backend is not installed), fingerprint(spec) ->
the fingerprint class the artifact will serve, build(job, folder) -> metadata.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from ...runtime.fingerprint import Fingerprint
from ..export_paths import beside

POSITIONAL = {"tensorrt-rtx": "compute_capabilities", "openvino": "device", "migraphx": "gfx"}
Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class TargetSpec:
    backend: str
    options: tuple[tuple[str, object], ...] = ()

    def get(self, name: str, default=None):
        return dict(self.options).get(name, default)

    def describe(self) -> dict:
        return {"backend": self.backend, **{k: v for k, v in self.options}}

    def label(self) -> str:
        """'tensorrt-rtx:sm_86,sm_89 weight_streaming=true' -- the form `--target` accepts, plus options."""
        field = POSITIONAL.get(self.backend)
        out = self.backend
        rest = []
        for k, v in self.options:
            if k == field:
                out += ":" + (",".join(v) if isinstance(v, (list, tuple)) else str(v))
            else:
                rest.append(f"{k}={json.dumps(v)}")
        return " ".join([out, *rest])


@dataclass(frozen=True)
class BuildJob:
    onnx_path: Path
    component: str
    inputs: list[dict]                 # [{name, dtype, shape}] as the ONNX declares them
    shapes: Shapes                     # input name -> (min, opt, max)
    progress: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def static(self) -> bool:
        return all(mn == mx for mn, _, mx in self.shapes.values())


class Target(Protocol):
    name: str

    def toolchain(self) -> dict[str, str]: ...

    def fingerprint(self, spec: TargetSpec) -> Fingerprint: ...

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict: ...


@contextmanager
def required_inputs(job: BuildJob, folder: Path) -> Iterator[BuildJob]:
    """The job with every graph input that has an initializer default (the text encoder's
    `token_embeddings_extra`, optional for other tools) made required again: OpenVINO, TensorRT and
    MIGraphX would fold such an input into a constant, and precast's runtime feeds it always.
    The stripped graph is written to a temporary folder inside `folder`, its weights copied (text
    encoders only: no other graph has an input default). OpenVINO instead restores the parameter
    in memory (runtime/sessions.py restore_input_defaults)."""
    import onnx
    model = onnx.load(str(job.onnx_path), load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    defaults = [t for t in model.graph.initializer if t.name in inputs]
    if not defaults:
        yield job
        return
    for t in defaults:
        model.graph.initializer.remove(t)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".required-") as tmp:
        for name, tensor in {e.value: t.name for t in model.graph.initializer for e in t.external_data
                             if e.key == "location"}.items():
            # copied: onnx (hence onnxsim) refuses hard-linked weights, OpenVINO and onnx symlinks out of the folder
            shutil.copyfile(beside(job.onnx_path, name, tensor), Path(tmp) / name)
        path = Path(tmp) / job.onnx_path.name
        path.write_bytes(model.SerializeToString(deterministic=True))
        yield dataclasses.replace(job, onnx_path=path)
