"""DirectML target: the component ONNX prepared for ONNX Runtime's DirectML execution provider (Windows,
any DirectX 12 GPU: the seed app's path for AMD and integrated GPUs).

Owns: what the DirectML EP wants ahead of time -- input dimensions the profile fixes pinned in the graph
(onnxruntime.pin_input_dims: DirectML compiles its operators for known shapes, the equivalent of
free-dimension overrides at session time), and ONNX Runtime's *basic* graph optimizations (constant
folding, redundant-node elimination, semantics-preserving fusions into standard ONNX ops) applied and
saved here with the CPU EP: those run before partitioning and hold no EP-specific ops, so the result is
valid for the DirectML EP. The extended/layout levels are EP-specific (DirectML fuses at session creation
on the user's device) and cannot be saved without the EP, which is Windows-only: not done.
Precision: fp32 and fp16 exports (fp16 recommended: DirectML runs half on every DX12 GPU); bf16 is
refused (DirectML has no bf16 operators). No fp16 conversion here: export with --dtype fp16.
The fingerprint: onnxruntime-directml/<onnxruntime version here>/any-gpu/fl11_0 (DirectML's floor,
Direct3D 12 feature level 11_0); any onnxruntime-directml release serves it (standard ONNX ops only).
Built and table-tested here; execution not verified on hardware (no Windows machine).
"""
from __future__ import annotations

from pathlib import Path

from ...runtime.fingerprint import Fingerprint
from ..errors import BadInput
from .base import BuildJob, TargetSpec, required_inputs
from .onnxruntime import pin_input_dims

FEATURE_LEVEL = "fl11_0"
REWRITES = "pinned-dims-1,basic-opt-1,required-inputs-1"


class DirectMLTarget:
    name = "onnxruntime-directml"

    def toolchain(self) -> dict[str, str]:
        try:
            import onnxruntime
        except ImportError:
            raise BadInput("target onnxruntime-directml: prepares the ONNX with onnxruntime, which is not "
                           "installed (pip install 'precast[onnxruntime]')") from None
        return {"onnxruntime": onnxruntime.__version__, "precast_directml_rewrites": REWRITES}

    def dtype_problem(self, dtype: str, spec: TargetSpec) -> str | None:
        if dtype == "bf16":
            return ("the export is bf16, which DirectML cannot run; export it with --dtype fp16 (recommended) or "
                    "fp32 for onnxruntime-directml")
        return None

    def fingerprint(self, spec: TargetSpec) -> Fingerprint:
        return Fingerprint("onnxruntime-directml", self.toolchain()["onnxruntime"], "any", "gpu", (FEATURE_LEVEL,))

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        with required_inputs(job, folder) as job:    # token_embeddings_extra's default stripped before pinning
            return self._build(job, folder)

    def _build(self, job: BuildJob, folder: Path) -> dict:
        import onnx
        import onnxruntime as ort
        model = onnx.load(str(job.onnx_path), load_external_data=False)
        pin_input_dims(model, job.shapes)
        out = folder / "model.onnx"
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.log_severity_level = 3
        opts.optimized_model_filepath = str(out)
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx_data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                      str(job.onnx_path.parent))
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return {"entry": "model.onnx", "optimized": "basic", "static": job.static,
                "pinned": {n: list(lo) for n, (lo, _, hi) in job.shapes.items() if lo == hi},
                "feature_level": FEATURE_LEVEL}
