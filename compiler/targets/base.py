"""The one interface every backend target implements, and the values it receives.

Owns: `TargetSpec` (backend + options, parsed from `backend[:arg,...]` or a recipe mapping),
`BuildJob` (one component ONNX + its input shapes), and the `Target` protocol:
toolchain() -> versions (BadInput when the backend is not installed), fingerprint(spec) ->
the fingerprint class the artifact will serve, build(job, folder) -> metadata.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ...runtime.fingerprint import Fingerprint

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
