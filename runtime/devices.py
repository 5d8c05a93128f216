"""The devices a user's machine has, found at run time, ranked, with a user override.

Owns: `Device` (one GPU or the CPU, described the way fingerprints and the runtime need it),
`discover_devices` (read them from a root path, so tests can use recorded sysfs trees of machines we
don't have), `rank_devices` (discrete GPU > integrated GPU > CPU, then memory) and
`apply_device_override` (PRECAST_DEVICE moves one device to the front).

Sources, all read under `root`:
- CPU: /proc/cpuinfo through runtime.cpu, /proc/meminfo.
- PCI: /sys/bus/pci/devices/*/{vendor,device,class,revision}.
- NVIDIA: NVML (pynvml, optional, real machine only), else PCI + /proc/driver/nvidia + a partial id table.
- AMD: the KFD topology /sys/class/kfd/kfd/topology/nodes/*, matched to PCI devices.
- Intel GPU: OpenVINO GPU properties (optional, real machine only), else /sys/class/drm/card* + an id table.

The runtime stays thin: this module imports the standard library only; pynvml and openvino are imported
inside the probes, only when asked for and only when `root` is the real machine's "/" (a recorded tree
describes another machine). Discovery never raises: whatever is missing or unreadable is skipped, and
the CPU is always there.
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, replace
from typing import Mapping

from .cpu import cpu_flags, cpu_name, isa_level

BACKENDS = {"nvidia": ("tensorrt-rtx",), "amd": ("migraphx",), "intel": ("openvino",),
            "cpu": ("openvino", "onnxruntime")}
ID_PREFIX = {"nvidia": "cuda", "amd": "rocm", "intel": "xpu"}
PCI_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel"}
DISPLAY_CLASSES = (0x0300, 0x0302, 0x0380)     # class >> 8: VGA, 3D controller, other display
KIND_RANK = {"discrete": 0, "integrated": 1, "cpu": 3}   # anything else sorts between GPUs and the CPU


@dataclass(frozen=True)
class Device:
    id: str            # "cpu", "cuda0", "rocm0", "xpu0": index per vendor in PCI-address order
    name: str          # marketing name when known, else e.g. "NVIDIA GPU 10de:2504"
    vendor: str        # nvidia | amd | intel | cpu
    kind: str          # discrete | integrated | cpu
    arch: str          # sm_86 | gfx90a:sramecc+:xnack- | xe-hpg | x86-64-v4 ("" when unknown)
    memory: int        # bytes, 0 when unknown
    driver: str        # driver version, "" when unknown
    pci: str = ""      # "0000:01:00.0"
    backends: tuple[str, ...] = ()

    def describe(self) -> dict:
        d = asdict(self)
        d["backends"] = list(self.backends)
        return d


# ---------------------------------------------------------------------------------------------
# Reading files that may be missing, unreadable, or odd

def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _hex(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text.strip(), 16) if text else None
    except ValueError:
        return None


def _int(path: str) -> int:
    text = _read(path)
    try:
        return int(text.strip()) if text else 0
    except ValueError:
        return 0


def _keyvals(path: str) -> dict[str, int]:
    """A KFD properties file: one "key value" per line; values are integers."""
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _natural(s: str) -> tuple:
    """"cuda10" sorts after "cuda2"."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


_PCI_ADDR = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def _norm_pci(addr: str) -> str:
    """"00000000:2B:00.0" (NVML) or "0000:2b:00.0" (sysfs) -> "0000:2b:00.0"; "" when not an address."""
    m = _PCI_ADDR.match(addr.strip())
    if not m:
        return ""
    dom, bus, dev, fn = m.groups()
    return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


@dataclass(frozen=True)
class _Pci:
    addr: str
    vendor: int
    device: int
    cls: int           # 24-bit class code, 0 when unreadable
    revision: int      # -1 when unreadable

    @property
    def is_display(self) -> bool:
        return (self.cls >> 8) in DISPLAY_CLASSES


def _scan_pci(root: str) -> dict[str, _Pci]:
    """Every PCI function under root/sys/bus/pci/devices, by address (plain folders or sysfs symlinks)."""
    base = os.path.join(root, "sys/bus/pci/devices")
    out: dict[str, _Pci] = {}
    for entry in sorted(_listdir(base)):
        addr = _norm_pci(entry)
        d = os.path.join(base, entry)
        vendor, device = _hex(os.path.join(d, "vendor")), _hex(os.path.join(d, "device"))
        if not addr or vendor is None or device is None:
            continue
        cls = _hex(os.path.join(d, "class"))
        rev = _hex(os.path.join(d, "revision"))
        out[addr] = _Pci(addr, vendor, device, cls or 0, -1 if rev is None else rev)
    return out


def _gpus_of(pcis: dict[str, _Pci], vendor: str) -> dict[str, _Pci]:
    return {a: p for a, p in pcis.items() if PCI_VENDORS.get(p.vendor) == vendor and p.is_display}


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
        from_sysfs[addr] = Device("", name, "nvidia", "discrete", nvidia_arch(p.device), 0, driver, addr,
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
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", _read(os.path.join(root, "proc/meminfo")) or "", re.M)
    memory = int(m.group(1)) * 1024 if m else 0
    return Device("cpu", name, "cpu", "cpu", arch, memory, "", "", BACKENDS["cpu"])


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
