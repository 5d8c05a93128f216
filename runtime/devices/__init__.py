"""The devices a user's machine has, found at run time, ranked, with a user override.

Owns: `Device` (one GPU or the CPU, described the way fingerprints and the runtime need it),
`discover_devices` (read them from a root path, so tests can use recorded sysfs trees of machines we
don't have), `rank_devices` (discrete GPU > integrated GPU > CPU, then memory) and
`apply_device_override` (PRECAST_DEVICE moves one device to the front).

Sources, all read under `root`:
- CPU: /proc/cpuinfo through runtime.cpu, /proc/meminfo (MemTotal; MemAvailable, the CPU's automatic memory
  budget: runtime/budgets.py).
- PCI: /sys/bus/pci/devices/*/{vendor,device,class,revision}.
- NVIDIA: NVML (pynvml, optional, real machine only), else PCI + /proc/driver/nvidia + a partial id table.
- AMD: the KFD topology /sys/class/kfd/kfd/topology/nodes/*, matched to PCI devices.
- Intel GPU: OpenVINO GPU properties (optional, real machine only), else /sys/class/drm/card* + an id table.

Windows and macOS (runtime/devices/windows.py, macos.py): DXGI adapters (+ NVML, OpenVINO) and the
OS's CPU feature bits; sysctl + system_profiler. A recorded tree holding windows/dxgi.json or
macos/sysctl.txt is read as that OS; the real machine is probed per platform.system().

The runtime stays thin: this module imports the standard library only; pynvml and openvino are imported
inside the probes, only when asked for and only when `root` is the real machine's "/" (a recorded tree
describes another machine). Discovery never raises: whatever is missing or unreadable is skipped, and
the CPU is always there.
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import replace
from typing import Mapping

from ..cpu import cpu_flags, cpu_name, isa_level
from .amd import _amd, gfx_name  # noqa: F401
from .device import BACKENDS, ID_PREFIX, KIND_RANK, Device  # noqa: F401
from .intel import _intel, intel_gpu_info  # noqa: F401
from .nvidia import _nvidia, nvidia_arch  # noqa: F401
from .sysfs import _int, _keyvals, _natural, _read, _scan_pci  # noqa: F401

# ---------------------------------------------------------------------------------------------
# CPU

def _guard(fn, default):
    try:
        return fn()
    except Exception:          # e.g. a cpuinfo that isn't text: runtime.cpu only expects OSError
        return default


def _cpu(root: str, real: bool) -> Device:
    flags = _guard(lambda: cpu_flags(root), set())
    if real:
        arch, name = isa_level(flags, platform.machine()), _guard(lambda: cpu_name(root), "CPU")
    else:
        # A recorded tree describes another machine: take the architecture from its cpuinfo, not ours.
        cpuinfo = _read(os.path.join(root, "proc/cpuinfo")) or ""
        if {"sse2", "lm"} & flags or re.search(r"^flags\s*:", cpuinfo, re.M):
            arch = isa_level(flags, "x86_64")
        elif re.search(r"^Features\s*:", cpuinfo, re.M):
            arch = "aarch64"
        else:
            arch = ""
        name = _guard(lambda: cpu_name(root), "CPU") if re.search(r"^model name\s*:", cpuinfo, re.M) else "CPU"
    meminfo = _read(os.path.join(root, "proc/meminfo")) or ""

    def kib(key: str) -> int:
        m = re.search(rf"^{key}:\s*(\d+)\s*kB", meminfo, re.M)
        return int(m.group(1)) * 1024 if m else 0
    return Device("cpu", name, "cpu", "cpu", arch, kib("MemTotal"), "", "", BACKENDS["cpu"],
                  available=kib("MemAvailable"))


# ---------------------------------------------------------------------------------------------
# Public API

def _assign_ids(devices: list[Device]) -> list[Device]:
    """cuda0, cuda1, ... per vendor in PCI-address order (devices without an address last)."""
    out = []
    for vendor, prefix in ID_PREFIX.items():
        mine = [d for d in devices if d.vendor == vendor]
        mine.sort(key=lambda d: (d.pci == "", d.pci))           # stable: discovery order breaks ties
        out += [replace(d, id=f"{prefix}{i}") for i, d in enumerate(mine)]
    return out


def rank_devices(devices: list[Device]) -> list[Device]:
    """Discrete GPUs, then integrated GPUs, then the CPU; within each, more memory first, then by id."""
    return sorted(devices, key=lambda d: (KIND_RANK.get(d.kind, 2), -d.memory, _natural(d.id)))


def discover_devices(root: str = "/", env: Mapping[str, str] | None = None, probe_nvml: bool = True,
                     probe_openvino: bool = True) -> list[Device]:
    """The machine's devices under `root`, ranked; the CPU is always present (last).

    `env` (default os.environ) is read for HSA_OVERRIDE_GFX_VERSION and HSA_XNACK. PRECAST_DEVICE is not
    applied here: pass the result to apply_device_override, which returns the warning to show.
    NVML and OpenVINO are only asked when `root` is this machine's "/".
    """
    env = os.environ if env is None else env
    real = os.path.realpath(root or ".") == "/"
    system = platform.system() if real else ""
    try:
        other = _other_os(root, real, system, probe_nvml, probe_openvino)
    except Exception:
        other = None
    if other is not None:
        gpus, cpu = other
        return rank_devices(_assign_ids(gpus) + [cpu])
    try:
        pcis = _scan_pci(root)
    except Exception:
        pcis = {}
    gpus: list[Device] = []
    for probe in (lambda: _nvidia(root, pcis, probe_nvml and real),
                  lambda: _amd(root, pcis, env),
                  lambda: _intel(root, pcis, probe_openvino and real)):
        try:
            gpus += probe()
        except Exception:
            pass
    try:
        cpu = _cpu(root, real)
    except Exception:
        cpu = Device("cpu", "CPU", "cpu", "cpu", "", 0, "", "", BACKENDS["cpu"])
    return rank_devices(_assign_ids(gpus) + [cpu])


def _other_os(root: str, real: bool, system: str, probe_nvml: bool, probe_openvino: bool):
    """(gpus, cpu) for Windows / macOS (recorded or real), None for Linux."""
    from . import macos, windows
    if real and system == "Windows":
        answers = (windows.dxgi_adapters(), windows.windows_system())
    else:
        answers = None if real else windows.recorded(root)
    if answers is not None:
        gpus = windows.devices_from_dxgi(answers[0])
        if real and probe_nvml:
            from .nvidia import _nvml_devices
            gpus = windows.merge_nvml(gpus, _guard(_nvml_devices, None))
        if real and probe_openvino:
            from .intel import _openvino_gpus
            gpus = windows.merge_openvino(gpus, _guard(_openvino_gpus, None))
        return gpus, windows.cpu_from_system(answers[1])
    if real and system == "Darwin":
        mac = macos.macos_answers()
    else:
        mac = None if real else macos.recorded(root)
    if mac is not None:
        return macos.devices_from_macos(*mac)
    return None


def apply_device_override(devices: list[Device], env: Mapping[str, str] | None = None
                          ) -> tuple[list[Device], str | None]:
    """PRECAST_DEVICE=<id | name | unique prefix of either> (case-insensitive) moves that device to the front.

    ""/auto/default change nothing; `gpu` picks the first GPU. When the value names no device, or more
    than one, the devices come back unchanged with a warning naming the value and the device ids.
    """
    env = os.environ if env is None else env
    value = (env.get("PRECAST_DEVICE") or "").strip()
    want = value.lower()
    devices = list(devices)
    if want in ("", "auto", "default"):
        return devices, None
    if want == "gpu":
        matches = [d for d in devices if d.kind != "cpu"][:1]
    else:
        matches = [d for d in devices if want in (d.id.lower(), d.name.lower())]
        if not matches:
            matches = [d for d in devices if d.id.lower().startswith(want) or d.name.lower().startswith(want)]
    if len(matches) == 1:
        chosen = matches[0]
        return [chosen] + [d for d in devices if d is not chosen], None
    listing = ", ".join(f"{d.id} ({d.name})" for d in devices)
    why = f"matches {', '.join(d.id for d in matches)}" if matches else "names no device"
    return devices, f"PRECAST_DEVICE={value!r} {why}; keeping the default order (devices: {listing})"

