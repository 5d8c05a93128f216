"""Backend targets, one module each, one interface (see base.py)."""
from __future__ import annotations

from ..errors import BadInput
from .base import POSITIONAL, BuildJob, Target, TargetSpec
from .migraphx import MigraphxTarget
from .onnxruntime import OnnxRuntimeTarget
from .openvino import OpenVinoTarget
from .tensorrt_rtx import TensorRtRtxTarget, requested_ccs

TARGETS: dict[str, Target] = {t.name: t for t in (OnnxRuntimeTarget(), OpenVinoTarget(), TensorRtRtxTarget(),
                                                   MigraphxTarget())}
ALIASES = {"ort": "onnxruntime", "ov": "openvino", "trt": "tensorrt-rtx", "tensorrt": "tensorrt-rtx",
           "trt-rtx": "tensorrt-rtx", "mx": "migraphx"}


BOOL = (True, False)
OPTIONS: dict[str, dict[str, tuple]] = {   # option -> allowed values (empty: free-form)
    "onnxruntime": {"simplify": BOOL, "optimize": BOOL},
    "openvino": {"device": (), "precision": ("f32", "bf16", "f16"), "performance_hint": ("LATENCY", "THROUGHPUT"),
                 "num_streams": (), "threads": (), "ir": BOOL, "compress_to_fp16": BOOL, "winograd": BOOL},
    "tensorrt-rtx": {"compute_capabilities": (), "weight_streaming": BOOL, "refittable": BOOL, "strip_weights": BOOL},
    "migraphx": {"gfx": (), "fp16": BOOL, "fast_math": BOOL},
}

_text = lambda v: isinstance(v, str) and bool(v)  # noqa: E731
MAX_COUNT = 4096   # threads / streams: past this a backend overflows or refuses at build time
_count = lambda v, least: isinstance(v, int) and not isinstance(v, bool) and least <= v <= MAX_COUNT  # noqa: E731
OPTION_TYPES: dict[str, tuple[str, object]] = {   # free-form option -> (what it takes, check)
    "device": ("a device name such as CPU or GPU.0", _text),
    "gfx": ("a gfx name such as gfx1100", _text),
    "threads": (f"an integer from 0 to {MAX_COUNT} (0: OpenVINO decides)", lambda v: _count(v, 0)),
    "num_streams": (f"an integer from 1 to {MAX_COUNT} or AUTO", lambda v: _count(v, 1) or v == "AUTO"),
    "compute_capabilities": ("a list such as [sm_86, sm_89]",
                             lambda v: _text(v) or (isinstance(v, list) and all(_text(c) or _count(c, 0) for c in v))),
}


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
    allowed = OPTIONS[target.name]
    for k, v in opts.items():
        if k not in allowed:
            raise BadInput(f"target {target.name}: unknown option {k!r}; allowed: {', '.join(sorted(allowed))}")
        if allowed[k] and not any(type(v) is type(a) and v == a for a in allowed[k]):  # 1 is not true
            shown = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed[k])
            raise BadInput(f"target {target.name}: {k}={v!r}; allowed: {shown}")
        if k in OPTION_TYPES and not OPTION_TYPES[k][1](v):
            raise BadInput(f"target {target.name}: {k}={v!r}; expected {OPTION_TYPES[k][0]}")
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}
    spec = TargetSpec(target.name, tuple(sorted(frozen.items())))
    if target.name == "tensorrt-rtx":
        requested_ccs(spec)  # names each unknown compute capability
    if target.name == "migraphx" and spec.get("gfx") and not str(spec.get("gfx")).startswith("gfx"):
        raise BadInput(f"target migraphx: gfx {spec.get('gfx')!r}: expected a gfx name such as gfx1100 or gfx90a:sramecc+:xnack-")
    return spec


__all__ = ["BuildJob", "TargetSpec", "TARGETS", "get_target", "parse_target"]
