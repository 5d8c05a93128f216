"""Intel GPUs: OpenVINO GPU properties (real machine only), else /sys/class/drm + an id table."""
from __future__ import annotations

import os
import re
from dataclasses import replace

from .device import BACKENDS, Device
from .sysfs import _Pci, _gpus_of, _hex, _int, _keyvals, _listdir, _natural, _norm_pci, _read  # noqa: F401

# ---------------------------------------------------------------------------------------------
# Intel GPUs

# (first, last, arch, kind, {id: name}) by PCI device id; any other Intel GPU is an integrated one of an
# older or unlisted generation (arch ""). Partial.
INTEL_GPUS = (
    (0x5690, 0x56BF, "xe-hpg", "discrete",                 # DG2 / Arc A-series (Alchemist)
     {0x56A0: "Intel Arc A770 Graphics", 0x56A1: "Intel Arc A750 Graphics", 0x56A5: "Intel Arc A380 Graphics"}),
    (0x56C0, 0x56CF, "xe-hpg", "discrete", {}),            # Data Center GPU Flex (DG2)
    (0xE200, 0xE2FF, "xe2-hpg", "discrete",                # Arc B-series (Battlemage)
     {0xE20B: "Intel Arc B580 Graphics", 0xE20C: "Intel Arc B570 Graphics"}),
    (0x7D40, 0x7DFF, "xe-lpg", "integrated", {}),          # Meteor Lake / Arrow Lake iGPUs
    (0x6420, 0x64FF, "xe2-lpg", "integrated", {}),         # Lunar Lake iGPUs
    (0x4600, 0x46FF, "xe-lp", "integrated",                # Alder Lake
     {0x4680: "Intel UHD Graphics 770", 0x46A6: "Intel Iris Xe Graphics"}),
    (0xA700, 0xA7FF, "xe-lp", "integrated",                # Raptor Lake
     {0xA780: "Intel UHD Graphics 770", 0xA7A0: "Intel Iris Xe Graphics"}),
    (0x9A40, 0x9AFF, "xe-lp", "integrated",                # Tiger Lake
     {0x9A49: "Intel Iris Xe Graphics", 0x9A60: "Intel UHD Graphics"}),
)

# OpenVINO reports the graphics IP version (GPU_UARCH_VERSION "12.55.8"); the same names by (major, minor).
INTEL_ARCH_BY_IP = {(12, 0): "xe-lp", (12, 10): "xe-lp", (12, 55): "xe-hpg", (12, 56): "xe-hpg",
                    (12, 57): "xe-hpg", (12, 60): "xe-hpc", (12, 70): "xe-lpg", (12, 71): "xe-lpg",
                    (12, 74): "xe-lpg", (20, 1): "xe2-hpg", (20, 2): "xe2-hpg", (20, 4): "xe2-lpg"}


def intel_gpu_info(device_id: int) -> tuple[str, str, str]:
    """(arch, kind, name) for an Intel GPU PCI device id."""
    for first, last, arch, kind, names in INTEL_GPUS:
        if first <= device_id <= last:
            return arch, kind, names.get(device_id, f"Intel GPU 8086:{device_id:04x}")
    return "", "integrated", f"Intel GPU 8086:{device_id:04x}"


def _drm_intel_cards(root: str) -> list[tuple[str, int, int]]:
    """(pci address or "", device id, local memory bytes) for each Intel /sys/class/drm/cardN."""
    base = os.path.join(root, "sys/class/drm")
    out = []
    for card in sorted((c for c in _listdir(base) if re.fullmatch(r"card\d+", c)), key=_natural):
        dev = os.path.join(base, card, "device")
        if _hex(os.path.join(dev, "vendor")) != 0x8086:
            continue
        device_id = _hex(os.path.join(dev, "device"))
        if device_id is None:
            continue
        m = re.search(r"^PCI_SLOT_NAME=(\S+)", _read(os.path.join(dev, "uevent")) or "", re.M)
        addr = _norm_pci(m.group(1)) if m else ""
        if not addr:                                    # real sysfs: device -> ../../../0000:03:00.0
            addr = _norm_pci(os.path.basename(os.path.realpath(dev)))
        # Local memory: i915 has no merged sysfs file for it; Intel's backport i915 puts lmem_total_bytes
        # on the card (seen on both cardN and cardN/device); xe has per-tile physical_vram_size_bytes.
        lmem = (_int(os.path.join(dev, "lmem_total_bytes")) or _int(os.path.join(base, card, "lmem_total_bytes"))
                or sum(_int(os.path.join(dev, t, "physical_vram_size_bytes"))
                       for t in _listdir(dev) if re.fullmatch(r"tile\d+", t)))
        out.append((addr, device_id, lmem))
    return out


def _intel_sysfs(root: str, pcis: dict[str, _Pci]) -> list[Device]:
    found: dict[str, tuple[int, int]] = {a: (p.device, 0) for a, p in _gpus_of(pcis, "intel").items()}
    unaddressed = []
    for addr, device_id, lmem in _drm_intel_cards(root):
        if addr:
            found[addr] = (device_id, lmem)
        else:
            unaddressed.append((device_id, lmem))
    out = []
    for addr, (device_id, lmem) in [*found.items(), *(("", x) for x in unaddressed)]:
        arch, kind, name = intel_gpu_info(device_id)
        out.append(Device("", name, "intel", kind, arch, lmem if kind == "discrete" else 0, "", addr,
                          BACKENDS["intel"]))
    return out


def _openvino_gpus() -> list[Device] | None:
    """Intel GPUs as OpenVINO's GPU plugin sees them; None when openvino is missing or lists none."""
    try:
        import openvino as ov
        core = ov.Core()
        names = [n for n in core.available_devices if n.startswith("GPU")]
    except Exception:
        return None
    out = []
    for n in names:
        def prop(key, default=None):
            try:
                return core.get_property(n, key)
            except Exception:
                return default
        full_arch = str(prop("DEVICE_ARCHITECTURE", ""))          # "GPU: vendor=0x8086 arch=v12.55.8"
        vendor = re.search(r"vendor=(0x[0-9a-fA-F]+)", full_arch)
        if vendor and int(vendor.group(1), 16) != 0x8086:
            continue
        ip = re.search(r"(\d+)\.(\d+)", str(prop("GPU_UARCH_VERSION", "")) or full_arch)
        arch = ""
        if ip:
            major, minor = int(ip.group(1)), int(ip.group(2))
            arch = INTEL_ARCH_BY_IP.get((major, minor), f"intel-gpu-{major}.{minor}")
        kind = "discrete" if "DISCRETE" in str(prop("DEVICE_TYPE", "")).upper() else "integrated"
        pci = ""
        info = prop("DEVICE_PCI_INFO")
        if info is not None:
            try:
                pci = f"{int(info.domain):04x}:{int(info.bus):02x}:{int(info.device):02x}.{int(info.function)}"
            except Exception:
                pci = ""
        try:
            memory = int(prop("GPU_DEVICE_TOTAL_MEM_SIZE", 0) or 0)
        except (TypeError, ValueError):
            memory = 0
        out.append(Device("", str(prop("FULL_DEVICE_NAME", "") or n), "intel", kind, arch, memory, "", pci,
                          BACKENDS["intel"]))
    return out or None


def _intel(root: str, pcis: dict[str, _Pci], probe_openvino: bool) -> list[Device]:
    from_sysfs = _intel_sysfs(root, pcis)
    # OpenVINO costs half a second to import: ask it only when sysfs shows an Intel GPU, or when sysfs
    # can't tell: no PCI devices at all (a container), or WSL (GPUs behind /dev/dxg, not in sysfs).
    if not probe_openvino or (pcis and not from_sysfs and not os.path.exists(os.path.join(root, "dev/dxg"))):
        return from_sysfs
    ov = _openvino_gpus()
    if ov is None:
        return from_sysfs
    # OpenVINO describes the devices it can run on; sysfs adds what it doesn't say (the PCI address
    # when DEVICE_PCI_INFO is missing: matched by kind, in order).
    rest = list(from_sysfs)
    out = []
    for d in ov:
        match = next((s for s in rest if d.pci and s.pci == d.pci), None)
        if match is None and not d.pci:
            match = next((s for s in rest if s.kind == d.kind), None)
        if match is not None:
            rest.remove(match)
            d = replace(d, pci=d.pci or match.pci, arch=d.arch or match.arch)
        out.append(d)
    return out


