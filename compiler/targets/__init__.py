"""Backend targets, one module each, one interface (see base.py).

Owns: the target names and aliases, the options each takes (OPTIONS, OPTION_TYPES), parsing
`backend[:arg,...]` + options into a `TargetSpec` in one spelling (compute capabilities `sm_86`,
sorted and de-duplicated; gfx names lowercase; OpenVINO device names uppercase), so that equal
targets have equal cache keys, and `check_buildable`: what a target cannot build for an export's
dtype or on this machine, refused in one line before any work.
"""
from __future__ import annotations

from ...runtime.vae_segments import TILED
from ..errors import BadInput
from .base import POSITIONAL, BuildJob, Target, TargetSpec
from .directml import DirectMLTarget
from .migraphx import MigraphxTarget
from .onnxruntime import OnnxRuntimeTarget
from .openvino import OpenVinoTarget
from .quantize import weights_problem
from .tensorrt_rtx import TensorRtRtxTarget, normalize_ccs

TARGETS: dict[str, Target] = {t.name: t for t in (OnnxRuntimeTarget(), OpenVinoTarget(), TensorRtRtxTarget(),
                                                   MigraphxTarget(), DirectMLTarget())}
ALIASES = {"ort": "onnxruntime", "ov": "openvino", "trt": "tensorrt-rtx", "tensorrt": "tensorrt-rtx",
           "trt-rtx": "tensorrt-rtx", "mx": "migraphx", "directml": "onnxruntime-directml",
           "dml": "onnxruntime-directml"}


BOOL = (True, False)
OV_PRECISION_ALIASES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}   # recipe `precision` words -> OpenVINO's
OPTIONS: dict[str, dict[str, tuple]] = {   # option -> allowed values (empty: free-form)
    "onnxruntime": {"simplify": BOOL, "optimize": BOOL, "weights": (), "block_size": (16, 32, 64, 128, 256)},
    "openvino": {"device": (), "precision": ("f32", "bf16", "f16"), "performance_hint": ("LATENCY", "THROUGHPUT"),
                 "num_streams": (), "threads": (), "ir": BOOL, "compress_to_fp16": BOOL, "winograd": (),
                 "weights": (), "group_size": (32, 64, 128), "store": ("blob", "ir", "auto")},
    "tensorrt-rtx": {"compute_capabilities": (), "weight_streaming": BOOL, "refittable": BOOL, "strip_weights": BOOL,
                     "weights": ()},
    "migraphx": {"gfx": (), "fp16": BOOL, "fast_math": BOOL},
    "onnxruntime-directml": {},
}

_text = lambda v: isinstance(v, str) and bool(v)  # noqa: E731
MAX_COUNT = 4096   # threads / streams: past this a backend overflows or refuses at build time
_count = lambda v, least: isinstance(v, int) and not isinstance(v, bool) and least <= v <= MAX_COUNT  # noqa: E731
OPTION_TYPES: dict[str, tuple[str, object]] = {   # free-form option -> (what it takes, check)
    "device": ("a device name such as CPU or GPU.0", _text),
    "gfx": ("a gfx name such as gfx1100", _text),
    "threads": (f"an integer from 0 to {MAX_COUNT} (0: OpenVINO decides)", lambda v: _count(v, 0)),
    "num_streams": (f"an integer from 1 to {MAX_COUNT} or AUTO", lambda v: _count(v, 1) or v == "AUTO"),
    "winograd": ("true, false, or the smallest output side rewritten (an integer from 1, e.g. 32: the 16x16 "
                 "convolutions, whose transformed weights are most of the memory, stay direct)",
                 lambda v: type(v) is bool or _count(v, 1)),
    "weights": ("a weight format: int8, int4 or gguf (openvino, onnxruntime), fp8 or int8 (tensorrt-rtx)",
                lambda v: v in ("int8", "int4", "fp8", "gguf")),
    "compute_capabilities": ("a list such as [sm_86, sm_89]",
                             lambda v: _text(v) or (isinstance(v, list) and all(
                                 _text(c) or _count(c, 0) or type(c) is float for c in v))),
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
    if target.name == "openvino" and opts.get("precision") in OV_PRECISION_ALIASES:   # the recipe's spelling
        opts["precision"] = OV_PRECISION_ALIASES[opts["precision"]]
    allowed = OPTIONS[target.name]
    for k, v in opts.items():
        if k not in allowed:
            raise BadInput(f"target {target.name}: unknown option {k!r}; allowed: {', '.join(sorted(allowed))}")
        if allowed[k] and not any(type(v) is type(a) and v == a for a in allowed[k]):  # 1 is not true
            shown = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed[k])
            raise BadInput(f"target {target.name}: {k}={v!r}; allowed: {shown}")
        if k in OPTION_TYPES and not OPTION_TYPES[k][1](v):
            raise BadInput(f"target {target.name}: {k}={v!r}; expected {OPTION_TYPES[k][0]}")
    opts = _normalized(target.name, opts)
    _check_weights(target.name, opts)
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}
    return TargetSpec(target.name, tuple(sorted(frozen.items())))


def _normalized(backend: str, opts: dict) -> dict:
    """One spelling per value, so equal targets key equal: CCs 'sm86' / '86' / '8.6' -> 'sm_86'
    (sorted, once each; an empty list is the default set, as if not given); gfx names lowercase;
    OpenVINO device names uppercase (CPU, GPU.1)."""
    out = dict(opts)
    if backend == "tensorrt-rtx" and "compute_capabilities" in out:
        ccs = normalize_ccs(out["compute_capabilities"])   # names each unknown compute capability
        if ccs:
            out["compute_capabilities"] = list(ccs)
        else:
            del out["compute_capabilities"]
    if backend == "migraphx" and out.get("gfx"):
        gfx = str(out["gfx"]).strip().lower()
        if not gfx.startswith("gfx"):
            raise BadInput(f"target migraphx: gfx {out['gfx']!r}: expected a gfx name such as gfx1100 or "
                           "gfx90a:sramecc+:xnack-")
        out["gfx"] = gfx
    if backend == "openvino" and isinstance(out.get("device"), str):
        out["device"] = out["device"].strip().upper()
    if backend == "openvino" and out.get("compress_to_fp16") and out.get("weights"):
        raise BadInput(f"target openvino: compress_to_fp16 and weights={out['weights']} both set how the weights are "
                       "stored; choose one")
    return out


def _check_weights(backend: str, opts: dict) -> None:
    """Weight-only quantization (option `weights`, quantize.py): a format the backend cannot build, FP8
    for a GPU without FP8 tensor cores, or a group/block size without weights, refused in one line."""
    weights = opts.get("weights")
    sized = next((k for k in ("group_size", "block_size") if k in opts), None)
    if sized and weights is None:
        raise BadInput(f"target {backend}: {sized} applies to quantized weights only; add weights=int4 or int8")
    if backend == "openvino" and sized and weights != "int4":
        raise BadInput("target openvino: group_size applies to weights=int4 (int8 is per channel); drop it")
    why = weights_problem(backend, weights, normalize_ccs(opts.get("compute_capabilities") or ()))
    if why:
        raise BadInput(f"target {backend}: {why}")


DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def io_dtype(io: list[dict]) -> str:
    """An exported component's dtype from its inputs and outputs (bf16 > fp16 > fp32: half exports
    keep some fp32 inputs, such as the timestep)."""
    found = {DTYPES.get(v.get("dtype")) for v in io}
    return next((d for d in ("bf16", "fp16") if d in found), "fp32")


def shape_problem(spec: TargetSpec, component: str | None) -> str | None:
    """Why `spec` cannot build `component` whatever its precision (the shapes it takes), or None."""
    if spec.backend == "migraphx" and component in TILED.values():
        return f"MIGraphX compiles fixed shapes, and {component} takes tiles of any size; drop it from the " \
               "components or build it for another target"
    return None


def dtype_problem(spec: TargetSpec, dtype: str, component: str | None = None) -> str | None:
    """Why `spec` cannot build `component` (any, when None) exported in `dtype` (fp32 / fp16 / bf16);
    None if it can."""
    if (why := shape_problem(spec, component)) is not None:
        return why
    check = getattr(TARGETS[spec.backend], "dtype_problem", None)
    if check is None:
        return None
    return check(dtype, spec, component) if spec.backend == "onnxruntime" else check(dtype, spec)


def check_buildable(spec: TargetSpec, dtype: str, component: str) -> None:
    """Everything about (target, dtype) that can be refused before any work: the backend is
    installed, the dtype buildable, the options possible on this machine. BadInput otherwise."""
    target = TARGETS[spec.backend]
    why = dtype_problem(spec, dtype, component)
    if why:
        raise BadInput(f"{component} for {spec.label()}: {why}")
    target.toolchain()                      # BadInput when the backend is not installed
    if hasattr(target, "preflight"):
        target.preflight(spec)


__all__ = ["BuildJob", "TargetSpec", "TARGETS", "check_buildable", "dtype_problem", "get_target", "io_dtype",
           "parse_target", "shape_problem"]
