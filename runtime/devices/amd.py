"""AMD GPUs: the KFD topology (gfx name with features, HSA_OVERRIDE_GFX_VERSION), matched to PCI devices."""
from __future__ import annotations

import os
from typing import Mapping

from .device import BACKENDS, PCI_VENDORS, Device
from .sysfs import _Pci, _gpus_of, _hex, _int, _keyvals, _listdir, _natural, _norm_pci, _read  # noqa: F401

# ---------------------------------------------------------------------------------------------
# AMD

# Partial: (PCI device id, revision) -> name, from libdrm's amdgpu.ids; revision None = any.
AMD_NAMES = {
    (0x744C, 0xC8): "AMD Radeon RX 7900 XTX",
    (0x744C, 0xCC): "AMD Radeon RX 7900 XT",
    (0x744C, 0xCE): "AMD Radeon RX 7900 GRE",
    (0x740F, 0x02): "AMD Instinct MI210",
    (0x15BF, 0xC1): "AMD Radeon 780M Graphics",
    (0x15BF, 0xC2): "AMD Radeon 780M Graphics",
}
# GPUs that are part of an APU (integrated): by PCI device id, and by the gfx target the KFD reports.
AMD_APU_IDS = {0x15DD, 0x15D8, 0x1636, 0x1638, 0x164C, 0x15E7, 0x163F, 0x1681, 0x164E, 0x1506, 0x15BF, 0x15C8,
               0x150E, 0x1586, 0x1114, 0x13C0}
AMD_APU_GFX = {"gfx801", "gfx902", "gfx909", "gfx90c", "gfx1033", "gfx1035", "gfx1036", "gfx1037", "gfx1103",
               "gfx1150", "gfx1151", "gfx1152", "gfx1153"}
# Targets whose full name (HIP's gcnArchName) carries target features, in this order.
SRAMECC_TARGETS = {"gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"}
XNACK_TARGETS = {"gfx801", "gfx810", "gfx900", "gfx902", "gfx904", "gfx906", "gfx908", "gfx909", "gfx90a",
                 "gfx90c", "gfx940", "gfx941", "gfx942", "gfx950", "gfx1010", "gfx1011", "gfx1012", "gfx1013"}
HSA_CAP_SRAM_EDCSUPPORTED = 0x04000000          # kfd_sysfs.h (0x00080000 is the retired old bit)
HSA_HEAP_FB_PUBLIC, HSA_HEAP_FB_PRIVATE = 1, 2  # kfd_sysfs.h heap types (0 system, 3 GDS, 4 LDS, 5 scratch)


def gfx_name(gfx_target_version: int) -> str:
    """90010 -> gfx90a, 110000 -> gfx1100, 100300 -> gfx1030."""
    v = gfx_target_version
    return f"gfx{v // 10000 % 100}{v // 100 % 100:x}{v % 100:x}"


def _gfx_override(env: Mapping[str, str]) -> str:
    """HSA_OVERRIDE_GFX_VERSION "11.0.0" -> gfx1100, "9.0.10" -> gfx90a (decimal parts); "" when unset/bad."""
    parts = (env.get("HSA_OVERRIDE_GFX_VERSION") or "").strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return ""
    major, minor, step = map(int, parts)
    return gfx_name(major * 10000 + minor * 100 + step)


def _gfx_features(gfx: str, capability: int, env: Mapping[str, str]) -> str:
    """":sramecc+:xnack-" for targets that have these features; "" for the others (e.g. gfx1100).
    sramecc from the node's capability bit; xnack is a per-process mode ROCr takes from HSA_XNACK
    (off unless HSA_XNACK=1)."""
    out = ""
    if gfx in SRAMECC_TARGETS:
        out += ":sramecc+" if capability & HSA_CAP_SRAM_EDCSUPPORTED else ":sramecc-"
    if gfx in XNACK_TARGETS:
        out += ":xnack+" if (env.get("HSA_XNACK") or "").strip() == "1" else ":xnack-"
    return out


def _kfd_gpu_nodes(root: str) -> list[tuple[dict[str, int], int]]:
    """(properties, local memory bytes) for each KFD GPU node, in node order (CPU nodes skipped)."""
    base = os.path.join(root, "sys/class/kfd/kfd/topology/nodes")
    out = []
    for node in sorted((n for n in _listdir(base) if n.isdigit()), key=int):
        props = _keyvals(os.path.join(base, node, "properties"))
        if props.get("gfx_target_version", 0) == 0:       # a CPU node (or a GPU the kernel can't name)
            continue
        # Memory: the node's frame-buffer heaps only, FB_PUBLIC (1) + FB_PRIVATE (2). The kernel reports a
        # dGPU's VRAM as one of these (public with a large BAR, else one private heap of the total) and an
        # APU's carve-out the same way; system memory (0) and GDS/LDS/scratch (3-5) are not the GPU's.
        banks = os.path.join(base, node, "mem_banks")
        memory = 0
        for bank in _listdir(banks):
            b = _keyvals(os.path.join(banks, bank, "properties"))
            if b.get("heap_type") in (HSA_HEAP_FB_PUBLIC, HSA_HEAP_FB_PRIVATE):
                memory += max(b.get("size_in_bytes", 0), 0)
        out.append((props, memory))
    return out


def _kfd_pci(props: dict[str, int]) -> str:
    """A node's PCI address: location_id = bus << 8 | device << 3 | function, domain apart; "" if unknown."""
    loc = props.get("location_id", 0)
    if loc <= 0:
        return ""
    return f"{props.get('domain', 0):04x}:{loc >> 8 & 0xFF:02x}:{loc >> 3 & 0x1F:02x}.{loc & 7}"


def _amd(root: str, pcis: dict[str, _Pci], env: Mapping[str, str]) -> list[Device]:
    nodes = _kfd_gpu_nodes(root)
    gpus = _gpus_of(pcis, "amd")
    override = _gfx_override(env)
    driver = (_read(os.path.join(root, "sys/module/amdgpu/version")) or "").strip()

    # Pair KFD nodes with PCI functions: by the node's location first (any class: Instinct cards are
    # often "processing accelerators", 0x1200), then the rest in order against unclaimed AMD GPUs.
    pairs: list[tuple[str, dict | None, int]] = []   # (pci address, node properties, node memory)
    claimed: set[str] = set()
    leftover = []
    for props, memory in nodes:
        addr = _kfd_pci(props)
        p = pcis.get(addr)
        if p and PCI_VENDORS.get(p.vendor) == "amd" and addr not in claimed:
            claimed.add(addr)
            pairs.append((addr, props, memory))
        else:
            leftover.append((addr, props, memory))
    free = [a for a in sorted(gpus) if a not in claimed]
    for addr, props, memory in leftover:
        if free:
            addr = free.pop(0)
        elif addr in claimed:
            addr = ""
        claimed.add(addr)
        pairs.append((addr, props, memory))
    pairs += [(a, None, 0) for a in free]            # AMD GPUs without a KFD node (no compute driver)

    out = []
    for addr, props, memory in pairs:
        p = pcis.get(addr)
        device_id = p.device if p else (props or {}).get("device_id", 0)
        revision = p.revision if p else -1
        reported = gfx_name(props["gfx_target_version"]) if props else ""
        arch = ""
        if props:
            gfx = override or reported
            arch = gfx + _gfx_features(gfx, props.get("capability", 0), env)
        if not memory and addr:
            memory = _int(os.path.join(root, "sys/bus/pci/devices", addr, "mem_info_vram_total"))
        apu = ((props or {}).get("cpu_cores_count", 0) > 0 or device_id in AMD_APU_IDS
               or reported in AMD_APU_GFX)
        name = (AMD_NAMES.get((device_id, revision)) or AMD_NAMES.get((device_id, None))
                or f"AMD GPU 1002:{device_id:04x}")
        out.append(Device("", name, "amd", "integrated" if apu else "discrete", arch, memory, driver, addr,
                          BACKENDS["amd"]))
    return out


