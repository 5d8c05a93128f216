"""NVIDIA GPUs: NVML when installed (real machine only), else sysfs PCI + /proc/driver/nvidia + a partial id table."""
from __future__ import annotations

import os
import re
from dataclasses import replace

from .device import BACKENDS, Device
from .sysfs import _Pci, _gpus_of, _hex, _int, _keyvals, _listdir, _natural, _norm_pci, _read  # noqa: F401

# ---------------------------------------------------------------------------------------------
# NVIDIA

# Partial: PCI device-id ranges by GPU family (first match wins; Hopper and GB100 are carved out of the
# wider ranges around them). Ids outside every range get arch "" (unknown), e.g. Volta, Pascal.
NVIDIA_ARCH_RANGES = (
    (0x1E00, 0x1FFF, "sm_75"),    # TU102/TU104/TU106/TU117 (Turing)
    (0x2180, 0x21FF, "sm_75"),    # TU116 (GTX 16xx)
    (0x20B0, 0x20FF, "sm_80"),    # GA100 (A100, A30)
    (0x2300, 0x234F, "sm_90"),    # GH100 (H100, H200, GH200)
    (0x2200, 0x25FF, "sm_86"),    # GA102/GA103/GA104/GA106/GA107 (Ampere consumer and workstation)
    (0x2680, 0x28FF, "sm_89"),    # AD102/AD103/AD104/AD106/AD107 (Ada)
    (0x2900, 0x29FF, "sm_100"),   # GB100 (B100/B200)
    (0x2B00, 0x2FFF, "sm_120"),   # GB202/GB203/GB205/GB206/GB207 (Blackwell consumer)
)

# Partial: marketing names as NVML reports them, for the ids we have seen on users' machines.
NVIDIA_NAMES = {
    0x2204: "NVIDIA GeForce RTX 3090",
    0x2206: "NVIDIA GeForce RTX 3080",
    0x2484: "NVIDIA GeForce RTX 3070",
    0x2503: "NVIDIA GeForce RTX 3060",
    0x2504: "NVIDIA GeForce RTX 3060",            # GA106 Lite Hash Rate
    0x2520: "NVIDIA GeForce RTX 3060 Laptop GPU",
    0x25A0: "NVIDIA GeForce RTX 3050 Ti Laptop GPU",
    0x25A2: "NVIDIA GeForce RTX 3050 Laptop GPU",
    0x2684: "NVIDIA GeForce RTX 4090",
    0x2704: "NVIDIA GeForce RTX 4080",
    0x2786: "NVIDIA GeForce RTX 4070",
    0x2860: "NVIDIA GeForce RTX 4070 Laptop GPU",
    0x2882: "NVIDIA GeForce RTX 4060",
    0x28A0: "NVIDIA GeForce RTX 4060 Laptop GPU",
    0x28E0: "NVIDIA GeForce RTX 4060 Laptop GPU",
    0x2B85: "NVIDIA GeForce RTX 5090",
}


# Board memory by PCI device id, for ids sold with one memory size only (an RTX 3060 comes with 8 or 12
# GB: not listed); without NVML this is what a memory budget starts from (runtime/select.py).
NVIDIA_MEMORY = {0x2882: 8 << 30, 0x28A0: 8 << 30, 0x28E0: 8 << 30,      # RTX 4060 / 4060 Laptop
                 0x2786: 12 << 30, 0x2704: 16 << 30, 0x2684: 24 << 30,   # RTX 4070, 4080, 4090
                 0x2B85: 32 << 30}                                       # RTX 5090


def nvidia_arch(device_id: int) -> str:
    for first, last, arch in NVIDIA_ARCH_RANGES:
        if first <= device_id <= last:
            return arch
    return ""


def _nvidia_driver(root: str) -> str:
    version = (_read(os.path.join(root, "sys/module/nvidia/version")) or "").strip()
    if version:
        return version
    # "NVRM version: NVIDIA UNIX [Open ]Kernel Module [for x86_64]  580.82.07  Release Build ..."
    text = _read(os.path.join(root, "proc/driver/nvidia/version")) or ""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else ""


def _nvidia_proc_model(root: str, addr: str) -> str:
    """The driver's own name for the GPU: /proc/driver/nvidia/gpus/<pci>/information "Model:" line."""
    text = _read(os.path.join(root, "proc/driver/nvidia/gpus", addr, "information")) or ""
    m = re.search(r"^Model:\s*(.+?)\s*$", text, re.M)
    return m.group(1) if m else ""


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _nvml_devices() -> list[Device] | None:
    """NVIDIA GPUs as NVML sees them; None when pynvml is missing or NVML can't start (no driver)."""
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # the "pynvml" shim package warns about its own name
            import pynvml
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    out = []
    try:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception:
            return None
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            driver = ""
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
            except Exception:
                continue
            fields = {}
            for key, get in (("name", lambda: _text(pynvml.nvmlDeviceGetName(h))),
                             ("arch", lambda: "sm_%d%d" % tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h))),
                             ("memory", lambda: int(pynvml.nvmlDeviceGetMemoryInfo(h).total)),
                             ("pci", lambda: _norm_pci(_text(pynvml.nvmlDeviceGetPciInfo(h).busId)))):
                try:
                    fields[key] = get()
                except Exception:
                    pass
            out.append(Device("", fields.get("name") or "NVIDIA GPU", "nvidia", "discrete", fields.get("arch", ""),
                              fields.get("memory", 0), driver, fields.get("pci", ""), BACKENDS["nvidia"]))
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def _nvidia(root: str, pcis: dict[str, _Pci], probe_nvml: bool) -> list[Device]:
    driver = _nvidia_driver(root)
    from_sysfs = {}
    for addr, p in _gpus_of(pcis, "nvidia").items():
        name = _nvidia_proc_model(root, addr) or NVIDIA_NAMES.get(p.device) or f"NVIDIA GPU 10de:{p.device:04x}"
        from_sysfs[addr] = Device("", name, "nvidia", "discrete", nvidia_arch(p.device), NVIDIA_MEMORY.get(p.device, 0), driver, addr,
                                  BACKENDS["nvidia"])
    nvml = _nvml_devices() if probe_nvml else None
    if nvml is None:
        return list(from_sysfs.values())
    # NVML works: it is the authority on which GPUs the driver runs (a GPU bound to vfio-pci or nouveau
    # is in sysfs but not here). Fill what an NVML call could not answer from sysfs.
    out = []
    for d in nvml:
        s = from_sysfs.get(d.pci)
        if s:
            d = replace(d, name=s.name if d.name == "NVIDIA GPU" else d.name, arch=d.arch or s.arch,
                        driver=d.driver or s.driver)
        out.append(d)
    return out


