"""MIGraphX target: parse_onnx with fixed input dims, optional fp16, compile for the GPU, save .mxr.

Owns: the MIGraphX build and its key: a .mxr records neither the gfx target nor the ROCm
version, so the fingerprint carries the full gfx name (features included) and both versions.
Written against the documented Python API (migraphx_py.cpp); not verified on hardware: no
AMD GPU or ROCm is reachable from here. Without ROCm the target fails with a clear message.
"""
from __future__ import annotations

import os
from pathlib import Path

from ...runtime.fingerprint import Fingerprint
from ..errors import BadInput
from .base import BuildJob, required_inputs, TargetSpec

NO_ROCM = ("target migraphx: needs ROCm with MIGraphX's Python module (import migraphx) and the AMD GPU it "
           "compiles for; not found on this machine. Build this target on a machine with that GPU "
           "(`precast plan` lists what each job needs).")


def _rocm_version() -> str:
    for path in ("/opt/rocm/.info/version", "/opt/rocm/.info/version-dev"):
        try:
            return Path(path).read_text().strip().split("-")[0]
        except OSError:
            continue
    return os.environ.get("ROCM_VERSION", "unknown")


class MigraphxTarget:
    name = "migraphx"

    def _mx(self):
        try:
            import migraphx
        except ImportError:
            raise BadInput(NO_ROCM) from None
        return migraphx

    def toolchain(self) -> dict[str, str]:
        mx = self._mx()
        return {"migraphx": getattr(mx, "__version__", "unknown"), "rocm": _rocm_version()}

    def fingerprint(self, spec: TargetSpec) -> Fingerprint:
        gfx = spec.get("gfx")
        if not gfx:
            raise BadInput("target migraphx: name the GPU's full gfx target, e.g. migraphx:gfx1100 "
                           "or gfx90a:sramecc+:xnack-")
        tc = self.toolchain()
        return Fingerprint("migraphx", f"{tc['migraphx']}+rocm{tc['rocm']}", "amd", "gpu", (str(gfx),))

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        with required_inputs(job, folder) as job:    # input defaults stripped (base.py)
            return self._build(job, spec, folder)

    def _build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        mx = self._mx()
        if not job.static:
            raise BadInput("target migraphx: compiles fixed input dims; give a static shape profile")
        dims = {name: list(opt) for name, (_, opt, _) in job.shapes.items()}
        program = mx.parse_onnx(str(job.onnx_path), map_input_dims=dims)
        if spec.get("fp16", False):
            mx.quantize_fp16(program)
        program.compile(mx.get_target("gpu"), offload_copy=True, fast_math=bool(spec.get("fast_math", True)))
        mx.save(program, str(folder / "model.mxr"), format="msgpack")
        return {"entry": "model.mxr", "gfx": spec.get("gfx"), "input_dims": dims, "fp16": bool(spec.get("fp16", False))}
