"""TensorRT-RTX target: ahead-of-time engine builds, on a machine with or without a GPU.

Owns: the builder config (compute capabilities from the spec in one spelling, `sm_86`, default
Ampere and newer; optimization profiles from the shape profile; optional weight streaming), what
cannot be built, refused before any work (fp32 / bf16 for Turing sm_75; refittable builds without
a driver), the builder's progress (bars on a terminal, heartbeat notes otherwise), its log (the
first error named in a failed build) and the cross-check of the engine header against our own
metadata.
Networks are strongly typed: precision comes from the ONNX dtypes (export fp16 for fp16).
Refittable / weight-stripped builds need a GPU driver at build time.
"""
from __future__ import annotations

import contextlib
import ctypes.util
import dataclasses
import importlib.metadata
import signal
import sys
import tempfile
import threading
from pathlib import Path

from ...runtime.errors import Terminated
from ...runtime.fingerprint import Fingerprint
from ...runtime.trt_header import CC_BITS, read_header
from ..errors import BadInput
from .base import BuildJob, required_inputs, TargetSpec
from .quantize import quantized, weights_problem
from .quantize_tensorrt import qdq_weights

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


def normalize_cc(cc) -> str:
    """One spelling for a compute capability: 'sm86', 'sm_86', 'SM_86', '86', 86, '8.6', 8.6 -> 'sm_86'."""
    c = str(cc).strip().lower().replace(".", "").replace("_", "")
    c = "sm_" + c.removeprefix("sm")
    if c not in KNOWN_CCS:
        raise BadInput(f"tensorrt-rtx compute capability {cc!r}: TensorRT-RTX builds for {', '.join(KNOWN_CCS)} "
                       "(also spelled sm86, 86 or 8.6)")
    return c


def normalize_ccs(ccs) -> tuple[str, ...]:
    """A CC list in any spelling -> sm_XX names, de-duplicated, in KNOWN_CCS (ascending) order."""
    if isinstance(ccs, str):
        ccs = [c for c in ccs.split(",") if c.strip()]
    return tuple(sorted({normalize_cc(c) for c in ccs or ()}, key=KNOWN_CCS.index))


def requested_ccs(spec: TargetSpec) -> tuple[str, ...]:
    return normalize_ccs(spec.get("compute_capabilities") or ())


# what Turing (sm_75) cannot build, found by building: TensorRT-RTX 1.x refuses with
# "FP32 GEMM is not supported" (fp32) / "model contains HW-specific datatypes: b16" (bf16)
TURING_DTYPES = ("fp32", "bf16")


def dtype_problem(dtype: str, spec: TargetSpec) -> str | None:
    """Why a component exported in `dtype` cannot become this engine, before anything is built."""
    ccs = requested_ccs(spec)
    if "sm_75" in ccs and dtype in TURING_DTYPES:
        rest = [c for c in ccs if c != "sm_75"]
        drop = (f"drop sm_75 (tensorrt-rtx:{','.join(rest)})" if rest else
                "build for another compute capability (e.g. tensorrt-rtx:sm_86)")
        return (f"the export is {dtype}, and TensorRT-RTX builds no {dtype} engines for Turing (sm_75: "
                + ("no FP32 GEMM" if dtype == "fp32" else "no bf16") +
                f"); export with --dtype fp16 (recipe precision: fp16) for sm_75, or {drop}")
    return None


def preflight(spec: TargetSpec) -> None:
    """Option combinations this machine cannot build, refused before any work."""
    refit = bool(spec.get("refittable", False)) or bool(spec.get("strip_weights", False))
    if refit and not _has_driver():
        raise BadInput("tensorrt-rtx refittable / weight-stripped builds need an NVIDIA GPU driver at build "
                       "time (no libcuda here); build them on a machine with a GPU, or drop the option")
    why = weights_problem("tensorrt-rtx", spec.get("weights"), requested_ccs(spec))
    if why:
        raise BadInput(f"target tensorrt-rtx: {why}")
    if refit and len(requested_ccs(spec)) != 1:
        raise BadInput("tensorrt-rtx refittable builds serve one compute capability; list exactly one")


class _Progress:
    """IProgressMonitor -> the phase and step as the note of the compile step's heartbeat (a
    spinner on a terminal, plain lines in a log: runtime/progress.py); and Ctrl-C: a
    KeyboardInterrupt raised inside TensorRT's callbacks is swallowed by TensorRT, so during a
    build SIGINT only sets `stop.interrupted` (`catching_sigint`), the next step cancels the build, and
    the caller raises KeyboardInterrupt after it."""

    def __new__(cls, trt, beat=None, stop=None):
        class Monitor(trt.IProgressMonitor):
            def __init__(self):
                trt.IProgressMonitor.__init__(self)
                self.steps = {}
                self.stop = stop if stop is not None else _Stop()

            def _note(self, text):
                if beat is not None:
                    beat.note = text

            def phase_start(self, phase_name, parent_phase, num_steps):
                self.steps[phase_name] = (0, num_steps)
                self._note(phase_name)

            def step_complete(self, phase_name, step):
                done, total = self.steps.get(phase_name, (0, 0))
                self.steps[phase_name] = (done + 1, total)
                self._note(f"{phase_name} {done + 1}/{total}")
                return not self.stop.interrupted  # False cancels the build

            def phase_finish(self, phase_name):
                self.steps.pop(phase_name, None)
                self._note(next(reversed(self.steps), ""))
        return Monitor()


class _Stop:
    """Whether SIGINT / SIGTERM came during a TensorRT-RTX build (set by `catching_sigint`, read by the monitor)."""
    interrupted = False


@contextlib.contextmanager
def catching_sigint(monitor):
    """SIGINT / SIGTERM set monitor.interrupted instead of raising in the middle of TensorRT's C++ parser or
    build (which then stops at its next step), and are raised after it -- in place of whatever error the
    stopped build ended with (in the main thread only; elsewhere, as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []

    def handler(signum, frame):
        monitor.interrupted = True
        caught.append(signum)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Exception:
        if not caught:
            raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if caught:
        raise KeyboardInterrupt if caught[0] == signal.SIGINT else Terminated(caught[0])


class _Logger:
    """TensorRT's log at ERROR level, kept: a failed build names its first error. Without a GPU
    driver every build also logs 'CUDA driver version is insufficient' -- expected for an AOT
    build here, and misleading beside the real error, so it is dropped then."""

    def __new__(cls, trt):
        no_driver = not _has_driver()

        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.errors: list[str] = []

            def log(self, severity, msg):
                if severity > trt.ILogger.Severity.ERROR:
                    return
                if no_driver and "driver version is insufficient" in msg:
                    return
                if "BuildCanceled" in msg:       # Ctrl-C: said as `interrupted` by the CLI
                    return
                self.errors.append(msg)
                print(f"[TensorRT-RTX] {msg}", file=sys.stderr)
        return Logger()


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

    def dtype_problem(self, dtype: str, spec: TargetSpec) -> str | None:
        return dtype_problem(dtype, spec)

    def preflight(self, spec: TargetSpec) -> None:
        preflight(spec)

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        with required_inputs(job, folder) as job:    # input defaults stripped (base.py)
            weights = spec.get("weights") if quantized(job.component) else None
            if not weights:
                return {**self._build(job, spec, folder), "weights": None}
            # weight-only fp8 / int8 (quantize_tensorrt.py): DequantizeLinear on each MatMul weight, the
            # parts of fused weights too, in the ONNX parsed (streamed: about one weight in host memory)
            with tempfile.TemporaryDirectory(dir=folder, prefix=".qdq-") as tmp:
                path = Path(tmp) / "model.onnx"
                info = qdq_weights(job.onnx_path, path, weights)
                meta = self._build(dataclasses.replace(job, onnx_path=path), spec, folder)
            return {**meta, "weights": {"format": weights, **info}}

    def _build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        # SIGINT / SIGTERM caught from the first TensorRT call on: a KeyboardInterrupt raised in a callback
        # while the parser or the builder runs (its logger) would be swallowed by TensorRT and the build go on
        stop = _Stop()
        with catching_sigint(stop):
            return self._build_caught(job, spec, folder, stop)

    def _build_caught(self, job: BuildJob, spec: TargetSpec, folder: Path, stop: "_Stop") -> dict:
        trt = self._trt()
        preflight(spec)
        refit = bool(spec.get("refittable", False)) or bool(spec.get("strip_weights", False))
        ccs = requested_ccs(spec)
        logger = _Logger(trt)
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
        config.progress_monitor = _Progress(trt, job.extra.get("heartbeat"), stop)
        if stop.interrupted:        # before the build: nothing to cancel (catching_sigint raises the signal's error)
            raise RuntimeError("interrupted before the TensorRT-RTX build")
        engine = folder / "model.engine"
        with open(engine, "wb") as f:
            # streamed to the file chunk by chunk: no whole serialized engine held in memory
            # (SD 1.5 UNet fp32: peak RSS 10.9 -> 10.55 GB, same bytes)
            writer = _FileWriter(trt, f)
            built = builder.build_serialized_network_to_stream(network, config, writer)
        if writer.error is not None:
            raise OSError(f"writing the TensorRT-RTX engine {engine}: {writer.error}") from writer.error
        if not built:
            why = logger.errors[0] if logger.errors else "no error logged"
            raise RuntimeError(f"TensorRT-RTX failed to build an engine for {job.component} "
                               f"({', '.join(ccs or DEFAULT_CCS)}): {why}")
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
