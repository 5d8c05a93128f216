"""Module assignment: which device runs each module, and where its weights live.

Owns: the `--backend` grammar, following stable-diffusion.cpp: comma-separated entries; an
entry without `=` (or with key all/default/*) sets the default; `module=device` sets one
module; later entries win; module names case-insensitive with `-`/`_` ignored, with aliases
(diffusion: model, unet, dit; te: clip, text, textencoder, cond, t5; vae: firststage,
autoencoder, tae; controlnet: control; upscaler). Device names: ""/auto/default, cpu, gpu
(first GPU), gpuN (N-th GPU in rank order), a device id (cuda0, rocm0, xpu0), a backend or
vendor name (its first device), an exact device name, a unique prefix.
`--params-backend` uses the same grammar; `cpu` there means offload (e.g. TensorRT-RTX
weight streaming) where the backend supports it.
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
COMPONENT_MODULE = {"unet": "diffusion", "transformer": "diffusion", "text_encoder": "te", "text_encoder_2": "te", "vae_decoder": "vae", "vae_encoder": "vae",
                    "controlnet": "controlnet"}
BACKEND_VENDOR = {"cuda": "nvidia", "nvidia": "nvidia", "tensorrt": "nvidia", "tensorrtrtx": "nvidia", "trt": "nvidia",
                  "rocm": "amd", "amd": "amd", "hip": "amd", "migraphx": "amd",
                  "xpu": "intel", "intel": "intel", "openvino": "intel", "sycl": "intel"}


def _norm(s: str) -> str:
    return s.strip().lower().replace("-", "").replace("_", "")


def parse_assignment(text: str | None) -> dict[str, str]:
    """'te=cpu,vae=gpu0,gpu' -> {'*': 'gpu', 'te': 'cpu', 'vae': 'gpu0'} (device names unresolved)."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            out["*"] = part.strip()
            continue
        key, _, value = part.partition("=")
        if not key.strip() or not value.strip():
            raise UserError(f"invalid backend assignment '{part.strip()}'")
        k = _norm(key)
        if k in ("all", "default", "*"):
            out["*"] = value.strip()
        elif k in ALIAS:
            out[ALIAS[k]] = value.strip()
        else:
            raise UserError(f"unknown backend module '{key.strip()}' (modules: {', '.join(MODULES)})")
    return out


def resolve_device(name: str, devices: list[Device]) -> Device:
    """A device name as the user typed it -> the device (devices in rank order, CPU last)."""
    n = name.strip().lower()
    gpus = [d for d in devices if d.kind != "cpu"]
    if n in ("", "auto", "default"):
        return devices[0]
    if n == "gpu":
        if not gpus:
            raise UserError("device 'gpu': this machine has no GPU (devices: " + _ids(devices) + ")")
        return gpus[0]
    numbered = re.fullmatch(r"gpu([0-9]{1,6})", n)  # ASCII digits only ('gpu²' is a name, not a number)
    if numbered:
        i = int(numbered.group(1))
        if i >= len(gpus):
            raise UserError(f"device '{name}': only {len(gpus)} GPU(s) here (devices: {_ids(devices)})")
        return gpus[i]
    for d in devices:
        if n in (d.id.lower(), d.name.lower()):
            return d
    vendor = BACKEND_VENDOR.get(_norm(n))
    if vendor:
        for d in devices:
            if d.vendor == vendor and d.kind != "cpu":
                return d
        raise UserError(f"device '{name}': no {vendor} GPU here (devices: {_ids(devices)})")
    matches = [d for d in devices if d.id.lower().startswith(n) or d.name.lower().startswith(n)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"device '{name}' is ambiguous: {', '.join(d.id for d in matches)}")
    raise UserError(f"unknown device '{name}' (devices: {_ids(devices)})")


def _ids(devices: list[Device]) -> str:
    return ", ".join(f"{d.id} ({d.name})" for d in devices)


@dataclass(frozen=True)
class Placement:
    module: str
    device: Device
    params: Device          # where weights live; == device unless offloaded
    offload: bool


def assign_modules(devices: list[Device], backend: str | None = None, params_backend: str | None = None,
                   modules: tuple[str, ...] = ("te", "diffusion", "vae")) -> dict[str, Placement]:
    runs = parse_assignment(backend)
    params = parse_assignment(params_backend)
    out = {}
    for m in modules:
        dev = resolve_device(runs.get(m, runs.get("*", "")), devices)
        p_name = params.get(m, params.get("*"))
        p = dev if p_name is None else resolve_device(p_name, devices)
        out[m] = Placement(m, dev, p, offload=p.id != dev.id)
    return out
