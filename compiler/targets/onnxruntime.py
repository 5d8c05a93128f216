"""ONNX Runtime target: a simplified ONNX (onnxsim) as the universal CPU fallback artifact.

Owns: simplifying the component graph (constant folding, shape inference) and writing it with
external data. Models past protobuf's 2 GB limit are copied unsimplified (onnxsim cannot hold
them), and the metadata says so.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from ...runtime.fingerprint import Fingerprint
from ..errors import BadInput
from .base import BuildJob, TargetSpec

PROTOBUF_LIMIT = 2 << 30


class OnnxRuntimeTarget:
    name = "onnxruntime"

    def toolchain(self) -> dict[str, str]:
        try:
            import onnxruntime
        except ImportError:
            raise BadInput("target onnxruntime: the onnxruntime package is not installed "
                           "(pip install 'precast[onnxruntime]')") from None
        import importlib.metadata
        out = {"onnxruntime": onnxruntime.__version__}
        try:  # the version from metadata: importing onnxsim costs seconds on every cache hit
            out["onnxsim"] = importlib.metadata.version("onnxsim")
        except importlib.metadata.PackageNotFoundError:
            out["onnxsim"] = "absent"
        return out

    def fingerprint(self, spec: TargetSpec) -> Fingerprint:
        return Fingerprint("onnxruntime", self.toolchain()["onnxruntime"], "any", "cpu", ("any",))

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        import onnx
        data = job.onnx_path.with_name(job.onnx_path.name + "_data")
        size = job.onnx_path.stat().st_size + (data.stat().st_size if data.exists() else 0)
        simplified, note = False, ""
        if spec.get("simplify", True) and size < PROTOBUF_LIMIT and self.toolchain()["onnxsim"] != "absent":
            import onnxsim
            model = onnx.load(str(job.onnx_path))
            model, ok = onnxsim.simplify(model, check_n=0)
            if ok:
                onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                                all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=1024)
                simplified = True
            del model
        if not simplified:
            note = "copied unsimplified" + (" (over protobuf's 2 GB limit)" if size >= PROTOBUF_LIMIT else "")
            shutil.copyfile(job.onnx_path, folder / "model.onnx")
            if data.exists():
                shutil.copyfile(data, folder / "model.onnx_data")
        return {"entry": "model.onnx", "simplified": simplified, "note": note}
