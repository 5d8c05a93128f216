"""macOS: Apple Silicon (one integrated GPU on unified memory) or an Intel Mac (its iGPU / AMD dGPU), the CPU.

Owns: `devices_from_macos` (recorded answers -> `Device` records) and `macos_answers` (the real
machine's: `sysctl hw.memsize machdep.cpu.brand_string hw.optional.arm64 machdep.cpu.features
machdep.cpu.leaf7_features machdep.cpu.extfeatures`, `system_profiler SPDisplaysDataType -json`,
platform.mac_ver()). Recorded machines hold them as tests/data/machines/<name>/macos/{sysctl.txt,
SPDisplaysDataType.json, sw_vers.txt}. The real-machine probe runs two subprocesses and was not run
here (no Mac).

An Apple GPU: vendor `apple`, kind `integrated`, arch the chip (`apple-m2`), memory the unified memory
(hw.memsize: CPU and GPU share it), driver the macOS version (the Core ML EP's floor is an OS
version). Backends: ONNX Runtime's CoreML EP. An Intel Mac's AMD or Intel GPU has no backend here.
"""
from __future__ import annotations

import json
import os
import re

from ..cpu import flags_from_sysctl, isa_level, parse_sysctl
from .device import BACKENDS, Device

VENDORS = {"apple": "apple", "amd": "amd", "ati": "amd", "intel": "intel", "nvidia": "nvidia"}


def _size(text: str) -> int:
    m = re.match(r"\s*([\d.]+)\s*([MG])B", text or "")
    return int(float(m.group(1)) * (1 << (30 if m.group(2) == "G" else 20))) if m else 0


def devices_from_macos(sysctl: dict[str, str], displays: dict, macos_version: str = "") -> tuple[list[Device], Device]:
    """(GPUs in system_profiler order, the CPU)."""
    memory = int(sysctl.get("hw.memsize", "0") or 0)
    arm = sysctl.get("hw.optional.arm64", "0").strip() == "1"
    brand = sysctl.get("machdep.cpu.brand_string", "").strip() or "CPU"
    cpu_arch = "arm64" if arm else isa_level(flags_from_sysctl(sysctl), "x86_64")
    cpu = Device("cpu", brand, "cpu", "cpu", cpu_arch, memory, "", "", BACKENDS["cpu"])
    gpus = []
    for g in displays.get("SPDisplaysDataType", []):
        if g.get("sppci_device_type", "spdisplays_gpu") != "spdisplays_gpu":
            continue
        name = g.get("sppci_model") or g.get("_name") or "GPU"
        vendor_text = str(g.get("spdisplays_vendor", "")).lower()
        vendor = next((v for k, v in VENDORS.items() if k in vendor_text), "apple" if arm else "")
        if not vendor:
            continue
        builtin = g.get("sppci_bus") == "spdisplays_builtin"
        if vendor == "apple":
            chip = re.sub(r"^apple\s+", "", name.strip().lower()).replace(" ", "-")
            gpus.append(Device("", name, "apple", "integrated", f"apple-{chip}", memory, macos_version, "",
                               BACKENDS["apple"]))
        else:       # an Intel Mac's GPU: discovered, ranked, but no backend runs on it here
            vram = _size(g.get("spdisplays_vram", "") or g.get("spdisplays_vram_shared", ""))
            gpus.append(Device("", name, vendor, "integrated" if builtin else "discrete", "", vram, macos_version,
                               "", ()))
    return gpus, cpu


def recorded(root: str) -> tuple[dict, dict, str] | None:
    folder = os.path.join(root, "macos")
    if not os.path.isfile(os.path.join(folder, "sysctl.txt")):
        return None
    with open(os.path.join(folder, "sysctl.txt")) as f:
        sysctl = parse_sysctl(f.read())
    try:
        with open(os.path.join(folder, "SPDisplaysDataType.json")) as f:
            displays = json.load(f)
    except (OSError, ValueError, RecursionError):
        displays = {}
    try:
        with open(os.path.join(folder, "sw_vers.txt")) as f:
            version = parse_sysctl(f.read()).get("ProductVersion", "")
    except OSError:
        version = ""
    return sysctl, displays, version


def macos_answers() -> tuple[dict, dict, str]:   # macOS only: not run here
    import platform
    import subprocess
    names = ["hw.memsize", "machdep.cpu.brand_string", "hw.optional.arm64", "machdep.cpu.features",
             "machdep.cpu.leaf7_features", "machdep.cpu.extfeatures"]
    out = subprocess.run(["sysctl", *names], capture_output=True, text=True, timeout=10).stdout
    try:
        displays = json.loads(subprocess.run(["system_profiler", "SPDisplaysDataType", "-json"],
                                             capture_output=True, text=True, timeout=30).stdout)
    except (ValueError, OSError, subprocess.SubprocessError, RecursionError):
        displays = {}
    return parse_sysctl(out), displays, platform.mac_ver()[0]
