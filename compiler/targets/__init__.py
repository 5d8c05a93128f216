"""Backend targets, one module each, one interface (see base.py)."""
from __future__ import annotations

from ..errors import BadInput
from .base import POSITIONAL, BuildJob, Target, TargetSpec
from .migraphx import MigraphxTarget
from .onnxruntime import OnnxRuntimeTarget
from .openvino import OpenVinoTarget
from .tensorrt_rtx import TensorRtRtxTarget

TARGETS: dict[str, Target] = {t.name: t for t in (OnnxRuntimeTarget(), OpenVinoTarget(), TensorRtRtxTarget(),
                                                   MigraphxTarget())}
ALIASES = {"ort": "onnxruntime", "ov": "openvino", "trt": "tensorrt-rtx", "tensorrt": "tensorrt-rtx",
           "trt-rtx": "tensorrt-rtx", "mx": "migraphx"}


def get_target(name: str) -> Target:
    key = ALIASES.get(name, name)
    if key not in TARGETS:
        raise BadInput(f"target {name!r}: choose one of {', '.join(TARGETS)}")
    return TARGETS[key]


def parse_target(text: str, options: dict | None = None) -> TargetSpec:
    """'tensorrt-rtx:sm_86,sm_89' | 'openvino:GPU' | 'migraphx:gfx1100' | 'onnxruntime', plus options."""
    backend, _, arg = text.partition(":")
    target = get_target(backend.strip())
    opts = dict(options or {})
    if arg:
        field = POSITIONAL.get(target.name)
        if field is None:
            raise BadInput(f"target {text!r}: {target.name} takes no argument")
        opts[field] = arg.split(",") if field == "compute_capabilities" else arg
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}
    return TargetSpec(target.name, tuple(sorted(frozen.items())))


__all__ = ["BuildJob", "TargetSpec", "TARGETS", "get_target", "parse_target"]
