"""TensorRT-RTX target: ahead-of-time engine builds, on a machine with or without a GPU.

Owns: the builder config (compute capabilities from the spec, default Ampere and newer;
optimization profiles from the shape profile; optional weight streaming), the builder's
progress as bars, and the cross-check of the engine header against our own metadata.
Networks are strongly typed: precision comes from the ONNX dtypes (export fp16 for fp16).
Refittable / weight-stripped builds need a GPU driver at build time.
"""
from __future__ import annotations

import ctypes.util
import importlib.metadata
from pathlib import Path

from ...runtime.fingerprint import Fingerprint
from ...runtime.trt_header import CC_BITS, read_header
from ..errors import BadInput
from .base import BuildJob, TargetSpec

DEFAULT_CCS = ("sm_80", "sm_86", "sm_89", "sm_120", "sm_121")  # what a build with no CC list serves
KNOWN_CCS = ("sm_75",) + DEFAULT_CCS
DRIVER_FLOOR = {"12": "525.60", "13": "580.65"}                 # CUDA runtime major -> minimum driver


def _cuda_major() -> str:
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("-", "_")
        if name.startswith("tensorrt_rtx_cu"):
            return name.removeprefix("tensorrt_rtx_cu").split("_")[0]
    return "12"


def _has_driver() -> bool:
    return ctypes.util.find_library("cuda") is not None


def requested_ccs(spec: TargetSpec) -> tuple[str, ...]:
    ccs = spec.get("compute_capabilities") or ()
    if isinstance(ccs, str):
        ccs = [c for c in ccs.split(",") if c]
    norm = []
    for cc in ccs:
        c = str(cc).lower().replace(".", "")
        c = c if c.startswith("sm_") else "sm_" + c.removeprefix("sm")
        if c not in KNOWN_CCS:
            raise BadInput(f"tensorrt-rtx compute capability {cc!r}: TensorRT-RTX builds for {', '.join(KNOWN_CCS)}")
        norm.append(c)
    return tuple(sorted(set(norm), key=KNOWN_CCS.index))


class _Progress:
    """IProgressMonitor -> one tqdm bar per builder phase."""

    def __new__(cls, trt, enabled: bool):
        from tqdm import tqdm

        class Monitor(trt.IProgressMonitor):
            def __init__(self):
                trt.IProgressMonitor.__init__(self)
                self.bars = {}

            def phase_start(self, phase_name, parent_phase, num_steps):
                self.bars[phase_name] = tqdm(total=num_steps, desc=f"tensorrt-rtx {phase_name}", leave=False,
                                             disable=None if enabled else True)

            def step_complete(self, phase_name, step):
                bar = self.bars.get(phase_name)
                if bar is not None:
                    bar.update(1)
                return True

            def phase_finish(self, phase_name):
                bar = self.bars.pop(phase_name, None)
                if bar is not None:
                    bar.close()
        return Monitor()


def _FileWriter(trt, f):
    """IStreamWriter -> an open binary file; a write error (disk full) is kept in `.error`."""
    class FileWriter(trt.IStreamWriter):
        def __init__(self):
            trt.IStreamWriter.__init__(self)
            self.error: OSError | None = None

        def write(self, data) -> int:
            try:
                return f.write(data)
            except OSError as e:             # TensorRT would only log it; the build then fails
                self.error = self.error or e
                return 0
    return FileWriter()


class TensorRtRtxTarget:
    name = "tensorrt-rtx"

    def _trt(self):
        try:
            import tensorrt_rtx
        except ImportError:
            raise BadInput("target tensorrt-rtx: the tensorrt-rtx package is not installed "
                           "(pip install 'precast[tensorrt-rtx]')") from None
        return tensorrt_rtx

    def toolchain(self) -> dict[str, str]:
        return {"tensorrt-rtx": self._trt().__version__, "cuda": _cuda_major()}

    def fingerprint(self, spec: TargetSpec) -> Fingerprint:
        return Fingerprint("tensorrt-rtx", self.toolchain()["tensorrt-rtx"], "nvidia", "gpu",
                           requested_ccs(spec) or DEFAULT_CCS, DRIVER_FLOOR.get(_cuda_major(), ""))

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        trt = self._trt()
        refit = bool(spec.get("refittable", False)) or bool(spec.get("strip_weights", False))
        if refit and not _has_driver():
            raise BadInput("tensorrt-rtx refittable / weight-stripped builds need an NVIDIA GPU driver at build "
                           "time (no libcuda here); build them on a machine with a GPU, or drop the option")
        ccs = requested_ccs(spec)
        if refit and len(ccs) != 1:
            raise BadInput("tensorrt-rtx refittable builds serve one compute capability; list exactly one")
        logger = trt.Logger(trt.Logger.ERROR)
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(job.onnx_path)):
            errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT-RTX could not parse {job.onnx_path}: {errors}")
        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            profile.set_shape(name, *job.shapes[name])
        config.add_optimization_profile(profile)
        config.num_compute_capabilities = len(ccs)
        for i, cc in enumerate(ccs):
            config.set_compute_capability(getattr(trt.ComputeCapability, cc.replace("sm_", "SM")), i)
        if spec.get("weight_streaming", False):
            config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
        if refit:
            config.set_flag(trt.BuilderFlag.STRIP_PLAN if spec.get("strip_weights") else trt.BuilderFlag.REFIT)
        config.progress_monitor = _Progress(trt, job.progress)
        engine = folder / "model.engine"
        with open(engine, "wb") as f:
            # streamed to the file chunk by chunk: no whole serialized engine held in memory
            # (SD 1.5 UNet fp32: peak RSS 10.9 -> 10.55 GB, same bytes)
            writer = _FileWriter(trt, f)
            built = builder.build_serialized_network_to_stream(network, config, writer)
        if writer.error is not None:
            raise OSError(f"writing the TensorRT-RTX engine {engine}: {writer.error}") from writer.error
        if not built:
            raise RuntimeError(f"TensorRT-RTX failed to build an engine for {job.component}")
        del parser, network
        size = engine.stat().st_size
        with open(engine, "rb") as f:
            header = read_header(f.read(64))
        expected = ccs or DEFAULT_CCS
        problems = []
        if header.size != size:
            problems.append(f"header size {header.size} != file size {size}")
        if not trt.__version__.startswith(header.version.rsplit(".", 1)[0]):
            problems.append(f"header version {header.version} != tensorrt_rtx {trt.__version__}")
        if ccs and header.compute_capabilities != ccs:
            problems.append(f"header CCs {header.compute_capabilities} != requested {ccs}")
        if not ccs and not set(DEFAULT_CCS) <= set(header.compute_capabilities):
            problems.append(f"header CCs {header.compute_capabilities} do not cover the default {DEFAULT_CCS}")
        if problems:
            raise RuntimeError("engine header disagrees with the build: " + "; ".join(problems))
        return {"entry": "model.engine", "compute_capabilities": list(expected),
                "header": {"version": header.version, "compute_capabilities": list(header.compute_capabilities),
                           "unknown_cc_bits": header.unknown_cc_bits, "size": header.size},
                "weight_streaming": bool(spec.get("weight_streaming", False)), "refittable": refit,
                "profile": {k: [list(s) for s in v] for k, v in job.shapes.items()}}


assert len(CC_BITS) == len(KNOWN_CCS)
