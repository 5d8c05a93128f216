"""Module assignment: which device (and, when the user pins one, which backend) runs each module,
and where its weights live.

Owns: the `--backend` grammar, following stable-diffusion.cpp: comma-separated entries; an
entry without `=` (or with key all/default/*) sets the default; `module=value` sets one
module; later entries win; module names case-insensitive with `-`/`_` ignored, with aliases
(diffusion: model, unet, dit; te: clip, text, textencoder, cond, t5; vae: firststage,
autoencoder, tae; controlnet: control; upscaler). A value is a DEVICE, a BACKEND, or
DEVICE:BACKEND. Devices: ""/auto/default, cpu, gpu (first GPU), gpuN (N-th GPU in rank order), a
device id (cuda0, rocm0, xpu0), a vendor name (cuda, nvidia, rocm, amd, xpu, intel: its first GPU),
an exact device name, a unique prefix. Backends (openvino, onnxruntime/ort, tensorrt-rtx/trt,
migraphx) pin the backend and run on its first device here (OpenVINO: an Intel GPU, else the CPU).
A device that is not here (`gpu` on a machine without one, `cuda1` with one NVIDIA GPU,
`tensorrt-rtx` without an NVIDIA GPU) falls back to the default device with the reason kept in
the placement, unless `strict` (then it is a UserError); a name that is no device at all, or a
backend on a device it does not run on (`cpu:tensorrt-rtx`), is always a UserError.
`--params-backend` uses the same grammar (devices only); `cpu` there means offload (e.g.
TensorRT-RTX weight streaming) where the backend supports it. It also takes memory budgets, one
per device, as entries DEVICE:SIZE (`--params-backend cuda0:8G,cpu:16G`; SIZE in bytes or with
K/M/G/T, binary units, as --max-vram tools take them); the selection (runtime/select.py,
`memory_plan`) holds each component's weights against them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .devices import Device
from .errors import UserError

MODULES = {"diffusion": ("diffusion", "model", "unet", "dit"),
           "te": ("te", "clip", "text", "textencoder", "cond", "t5"),
           "vae": ("vae", "firststage", "autoencoder", "tae"),
           "controlnet": ("controlnet", "control"),
           "upscaler": ("upscaler",)}
ALIAS = {alias: module for module, aliases in MODULES.items() for alias in aliases}
def module_of(component: str) -> str:
    """The module a bundle component runs as (`controlnet_<name>`: controlnet)."""
    return "controlnet" if component.startswith("controlnet_") else COMPONENT_MODULE[component]


# a module no --backend entry names runs where this one does (a ControlNet beside its UNet)
FOLLOWS = {"controlnet": "diffusion"}
COMPONENT_MODULE = {"unet": "diffusion", "transformer": "diffusion", "text_encoder": "te", "text_encoder_2": "te",
                    "text_encoder_3": "te", "vae_decoder": "vae", "vae_encoder": "vae", "preview_decoder": "vae",
                    "vae_decoder_tiled": "vae", "vae_encoder_tiled": "vae",
                    "controlnet": "controlnet"}
# vendor names -> the vendor's first GPU
VENDOR_NAMES = {"cuda": "nvidia", "nvidia": "nvidia", "rocm": "amd", "amd": "amd", "hip": "amd",
                "xpu": "intel", "intel": "intel", "sycl": "intel", "mps": "apple", "apple": "apple", "metal": "apple"}
# backend names (normalised: lower case, no '-'/'_') -> the backend
BACKEND_NAMES = {"openvino": "openvino", "ov": "openvino", "onnxruntime": "onnxruntime", "ort": "onnxruntime",
                 "tensorrtrtx": "tensorrt-rtx", "tensorrt": "tensorrt-rtx", "trt": "tensorrt-rtx",
                 "trtrtx": "tensorrt-rtx", "migraphx": "migraphx", "directml": "onnxruntime-directml",
                 "dml": "onnxruntime-directml", "onnxruntimedirectml": "onnxruntime-directml",
                 "coreml": "onnxruntime-coreml", "onnxruntimecoreml": "onnxruntime-coreml"}
# backend -> the device vendors it runs on here, in preference order ("cpu": the CPU)
BACKEND_RUNS_ON = {"openvino": ("intel", "cpu"), "onnxruntime": ("cpu",), "tensorrt-rtx": ("nvidia",),
                   "migraphx": ("amd",), "onnxruntime-directml": ("nvidia", "amd", "intel"),
                   "onnxruntime-coreml": ("apple",)}
VENDOR_WORDS = {"apple": "an Apple GPU", "nvidia": "an NVIDIA GPU", "amd": "an AMD GPU", "intel": "an Intel GPU", "cpu": "the CPU"}
_ID = re.compile(r"(cuda|rocm|xpu|mps)([0-9]{1,6})")


def _norm(s: str) -> str:
    return s.strip().lower().replace("-", "").replace("_", "")


def parse_assignment(text: str | None, option: str = "--backend") -> dict[str, str]:
    """'te=cpu,vae=gpu0,gpu' -> {'*': 'gpu', 'te': 'cpu', 'vae': 'gpu0'} (values unresolved)."""
    return {m: value for m, (_, value) in _entries(text, option).items()}


def _entries(text: str | None, option: str) -> dict[str, tuple[str, str]]:
    """module -> (the entry as typed, its value)."""
    out: dict[str, tuple[str, str]] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            out["*"] = (part.strip(), part.strip())
            continue
        key, _, value = part.partition("=")
        if not key.strip() or not value.strip():
            raise UserError(f"{option}: invalid backend assignment '{part.strip()}'; expected MODULE=DEVICE, "
                            "e.g. te=cpu,unet=gpu0")
        k = _norm(key)
        if k in ("all", "default", "*"):
            out["*"] = (part.strip(), value.strip())
        elif k in ALIAS:
            out[ALIAS[k]] = (part.strip(), value.strip())
        else:
            raise UserError(f"{option}: unknown backend module '{key.strip()}' (modules: {', '.join(MODULES)})")
    return out


def backend_name(text: str) -> str | None:
    """The backend a name means ('ORT', 'tensorrt_rtx', ...), or None."""
    return BACKEND_NAMES.get(_norm(text))


def split_value(value: str) -> tuple[str, str | None]:
    """'cpu:onnxruntime' -> ('cpu', 'onnxruntime'); 'onnxruntime' -> ('', 'onnxruntime'); 'gpu0' -> ('gpu0', None)."""
    v = value.strip()
    if ":" in v:
        dev, _, back = v.rpartition(":")
        if backend_name(back):
            return dev.strip(), backend_name(back)
        if not back.strip():
            raise UserError(f"'{value}': expected DEVICE:BACKEND, e.g. cpu:onnxruntime "
                            f"(backends: {', '.join(BACKEND_RUNS_ON)})")
    if backend_name(v):
        return "", backend_name(v)
    return v, None


class _Absent(Exception):
    """A device the user named in a valid form, but that this machine does not have."""


def _find_device(name: str, devices: list[Device]) -> Device:
    """A device name as the user typed it -> the device (devices in rank order, CPU last).
    Raises _Absent for a well-formed name of a device that is not here, UserError for a name
    that is no device at all."""
    n = name.strip().lower()
    gpus = [d for d in devices if d.kind != "cpu"]
    if n in ("", "auto", "default"):
        return devices[0]
    if n == "gpu":
        if not gpus:
            raise _Absent(f"device 'gpu': this machine has no GPU (devices: {_ids(devices)})")
        return gpus[0]
    numbered = re.fullmatch(r"gpu([0-9]{1,6})", n)  # ASCII digits only ('gpu²' is a name, not a number)
    if numbered:
        i = int(numbered.group(1))
        if i >= len(gpus):
            raise _Absent(f"device '{name}': " + (f"only {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} here" if gpus
                                                    else "no GPU here") + f" (devices: {_ids(devices)})")
        return gpus[i]
    for d in devices:
        if n in (d.id.lower(), d.name.lower()):
            return d
    if _ID.fullmatch(n):
        raise _Absent(f"device '{name}': not here (devices: {_ids(devices)})")
    vendor = VENDOR_NAMES.get(_norm(n))
    if vendor:
        for d in devices:
            if d.vendor == vendor and d.kind != "cpu":
                return d
        raise _Absent(f"device '{name}': no {vendor} GPU here (devices: {_ids(devices)})")
    matches = [d for d in devices if d.id.lower().startswith(n) or d.name.lower().startswith(n)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"device '{name}' is ambiguous: {', '.join(d.id for d in matches)}")
    if ":" in name:                                  # DEVICE:BACKEND whose BACKEND is none (split_value kept it whole)
        raise UserError(f"unknown backend '{name.rpartition(':')[2].strip()}' in '{name}' (DEVICE:BACKEND, e.g. "
                        f"cpu:onnxruntime; backends: {', '.join(BACKEND_RUNS_ON)})")
    raise UserError(f"unknown device '{name}' (devices: {_ids(devices)}; or a backend: "
                    f"{', '.join(BACKEND_RUNS_ON)})")


def _runs_on(backend: str, device: Device) -> bool:
    if backend in ("onnxruntime-directml", "onnxruntime-coreml") and backend not in device.backends:
        return False     # DirectML: Windows GPUs only (Device.backends says); Core ML: macOS
    return (device.vendor if device.kind != "cpu" else "cpu") in BACKEND_RUNS_ON[backend]


def resolve(value: str, devices: list[Device], strict: bool = False) -> tuple[Device, str | None, str]:
    """A --backend value -> (device, pinned backend or None, fallback reason or "").

    A device or backend that is not here falls back to the default device (no backend pinned),
    with the reason; with `strict` it is a UserError instead."""
    dev_name, backend = split_value(value)
    try:
        if backend is None:
            return _find_device(dev_name, devices), None, ""
        if dev_name:
            dev = _find_device(dev_name, devices)
            if not _runs_on(backend, dev):
                raise UserError(f"{backend} does not run on {dev.id} ({dev.name}); it runs on "
                                + " or ".join(VENDOR_WORDS[v] for v in BACKEND_RUNS_ON[backend]))
            return dev, backend, ""
        for vendor in BACKEND_RUNS_ON[backend]:      # a backend alone: its first device here
            for d in devices:
                if (d.vendor if d.kind != "cpu" else "cpu") == vendor and _runs_on(backend, d):
                    return d, backend, ""
        raise _Absent(f"{backend} runs on "
                      + " or ".join(VENDOR_WORDS[v] for v in BACKEND_RUNS_ON[backend])
                      + f" and there is none here (devices: {_ids(devices)})")
    except _Absent as e:
        if strict:
            raise UserError(f"{e} (--strict: no fallback)") from None
        return devices[0], None, f"{e}; using {devices[0].id} instead"


def resolve_device(name: str, devices: list[Device]) -> Device:
    """A device name -> the device; a device that is not here is a UserError (no fallback)."""
    try:
        return _find_device(name, devices)
    except _Absent as e:
        raise UserError(str(e)) from None


def _ids(devices: list[Device]) -> str:
    return ", ".join(f"{d.id} ({d.name})" for d in devices)


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int | None:
    """'8G' / '8GiB' / '512M' / '1.5g' / '1048576' -> bytes; None when it is no size."""
    m = _SIZE.fullmatch(text.strip())
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else None


def split_budgets(text: str | None, devices: list[Device]) -> tuple[str, dict[str, int]]:
    """--params-backend 'te=cpu,cuda0:8G,cpu:16G' -> ('te=cpu', {'cuda0': 8 GiB, 'cpu': 16 GiB}):
    the DEVICE:SIZE entries taken out as budgets (device id -> bytes), the rest left as it was."""
    rest, budgets = [], {}
    for part in (text or "").split(","):
        dev, sep, size = part.rpartition(":")
        amount = parse_size(size) if sep and "=" not in part else None
        if amount is None:
            rest.append(part)
            continue
        try:
            budgets[_find_device(dev, devices).id] = amount
        except _Absent as e:
            raise UserError(f"--params-backend {part.strip()}: a budget for {e}") from None
        except UserError as e:
            raise UserError(f"--params-backend {part.strip()}: {e}") from None
    return ",".join(rest), budgets


@dataclass(frozen=True)
class Placement:
    module: str
    device: Device
    params: Device          # where weights live; == device unless offloaded
    offload: bool
    backend: str | None = None   # the backend the user pinned (--backend unet=onnxruntime, te=cpu:openvino)
    asked: str = ""              # the --backend value for this module as typed ("" = the default)
    fallback: str = ""           # why the module is not where it was asked to run ("" = it is)
    strict: bool = False         # --strict: run where asked or refuse; never fall back
    budgets: tuple = ()          # ((device id, bytes), ...): --params-backend DEVICE:SIZE memory budgets

    @property
    def target(self) -> str:
        """'cpu' or 'cpu:onnxruntime': where the module is asked to run."""
        return self.device.id + (f":{self.backend}" if self.backend else "")

    def describe(self) -> dict:
        return {"device": self.device.id, "backend": self.backend, "params": self.params.id,
                "asked": self.asked or None, "fallback": self.fallback or None,
                **({"budgets": dict(self.budgets)} if self.budgets else {})}


def assign_modules(devices: list[Device], backend: str | None = None, params_backend: str | None = None,
                   modules: tuple[str, ...] = ("te", "diffusion", "vae"), strict: bool = False) -> dict[str, Placement]:
    runs = _entries(backend, "--backend")
    params_backend, budgets = split_budgets(params_backend, devices)
    params = _entries(params_backend, "--params-backend")
    out = {}
    for m in modules:
        typed, asked = runs.get(m, runs.get(FOLLOWS.get(m, "*"), runs.get("*", ("", ""))))
        try:
            dev, pin, why = resolve(asked, devices, strict)
        except UserError as e:
            raise UserError(f"--backend {typed}: {e}" if typed else str(e)) from None
        if why:
            why = f"--backend {typed}: {why}"
        p_typed, p_name = params.get(m, params.get("*", ("", None)))
        p = dev
        if p_name is not None:
            if all(split_value(p_name)):
                raise UserError(f"--params-backend {p_typed}: names where weights live: a device such as cpu, "
                                "not DEVICE:BACKEND")
            try:
                p_dev, _, p_why = resolve(p_name, devices, strict)
            except UserError as e:
                raise UserError(f"--params-backend {p_typed}: {e}") from None
            if p_why:
                why = "; ".join(filter(None, [why, f"--params-backend {p_typed}: {p_why.rsplit('; ', 1)[0]}; "
                                                   f"weights stay on {dev.id}"]))
            else:
                p = p_dev
        out[m] = Placement(m, dev, p, offload=p.id != dev.id, backend=pin, asked=asked, fallback=why, strict=strict,
                           budgets=tuple(sorted(budgets.items())))
    return out
