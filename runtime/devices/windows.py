"""Windows: GPUs from DXGI adapter enumeration (every vendor), the CPU from the OS.

Owns: `devices_from_dxgi` (adapter descriptions -> `Device` records: vendor, name, dedicated or shared
memory, integrated vs discrete, driver version, Direct3D 12 feature level), `cpu_from_system` (the
CPU's name, ISA level and memory), and the probes that read both on a real Windows machine
(`dxgi_adapters`, `windows_system`), through ctypes against the documented APIs:
CreateDXGIFactory1 -> IDXGIFactory1::EnumAdapters1 -> IDXGIAdapter1::GetDesc1 (DXGI_ADAPTER_DESC1),
IDXGIAdapter::CheckInterfaceSupport(IDXGIDevice) for the user-mode driver version, D3D12CreateDevice
with a null device pointer for the highest feature level, IsProcessorFeaturePresent (runtime/cpu.py),
GlobalMemoryStatusEx and the registry's ProcessorNameString. Those probes import ctypes.windll / winreg
only when called, on Windows; they were written against the documentation and not run (no Windows
machine here). Recorded machines hold their answers as JSON (tests/data/machines/<name>/windows/
{dxgi.json, system.json}), which is what the tests read.

Integrated vs discrete: DXGI does not say. An AMD GPU whose device id is an APU's (amd.AMD_APU_IDS), an
Intel GPU its id table calls integrated, or any adapter with under 1 GiB of dedicated memory (an iGPU's
BIOS carve-out) is integrated; NVIDIA GPUs are discrete. Memory: a discrete GPU's dedicated memory; an
integrated GPU's dedicated + shared system memory (what the driver lets it use).
On a real machine NVML, when installed, replaces the DXGI records of NVIDIA GPUs (same order), and
OpenVINO's GPU properties name the Intel ones (runtime/devices/intel.py), as on Linux.
"""
from __future__ import annotations

import json
import os

from ..cpu import flags_from_windows_pf, isa_level
from .amd import AMD_APU_IDS, AMD_NAMES
from .device import PCI_VENDORS, WINDOWS_BACKENDS, BACKENDS, Device
from .intel import intel_gpu_info
from .nvidia import NVIDIA_NAMES, nvidia_arch

GiB = 1 << 30
DXGI_ADAPTER_FLAG_SOFTWARE = 2
MICROSOFT = 0x1414                       # the Basic Render Driver (WARP): not a GPU
FEATURE_LEVELS = ("12_2", "12_1", "12_0", "11_1", "11_0")   # D3D_FEATURE_LEVEL_*, highest first
FEATURE_LEVEL_VALUE = {"12_2": 0xC200, "12_1": 0xC100, "12_0": 0xC000, "11_1": 0xB100, "11_0": 0xB000}
# AMD gfx targets by PCI device id (partial; for the fingerprint's arch only, DirectML does not need it)
AMD_GFX = {0x744C: "gfx1100", 0x7480: "gfx1102", 0x73BF: "gfx1030", 0x73DF: "gfx1031", 0x73FF: "gfx1032",
           0x15BF: "gfx1103", 0x15C8: "gfx1103", 0x1681: "gfx1035", 0x164E: "gfx1036", 0x150E: "gfx1150"}


def nvidia_driver_from_umd(umd: str) -> str:
    """NVIDIA's Windows user-mode driver version 32.0.15.6094 -> the NVML/marketing form 560.94
    (the last five digits of the last two fields)."""
    parts = umd.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return umd
    digits = (parts[2] + parts[3].zfill(4))[-5:]
    return f"{int(digits[:3])}.{digits[3:]}"


def devices_from_dxgi(adapters: list[dict]) -> list[Device]:
    """DXGI_ADAPTER_DESC1 fields (Description, VendorId, DeviceId, Revision, DedicatedVideoMemory,
    SharedSystemMemory, Flags) plus DriverVersion and FeatureLevel -> GPUs, in enumeration order."""
    out = []
    for index, a in enumerate(adapters):
        vendor_id, device_id = int(a.get("VendorId", 0)), int(a.get("DeviceId", 0))
        if int(a.get("Flags", 0)) & DXGI_ADAPTER_FLAG_SOFTWARE or vendor_id == MICROSOFT:
            continue
        vendor = PCI_VENDORS.get(vendor_id)
        if vendor is None:
            continue
        dedicated, shared = int(a.get("DedicatedVideoMemory", 0)), int(a.get("SharedSystemMemory", 0))
        name = str(a.get("Description", "")).strip()
        driver = str(a.get("DriverVersion", ""))
        arch = ""
        if vendor == "nvidia":
            kind, arch = "discrete", nvidia_arch(device_id)
            name = name or NVIDIA_NAMES.get(device_id, f"NVIDIA GPU 10de:{device_id:04x}")
            driver = nvidia_driver_from_umd(driver) if driver else ""
        elif vendor == "amd":
            kind = "integrated" if device_id in AMD_APU_IDS or dedicated < GiB else "discrete"
            arch = AMD_GFX.get(device_id, "")
            name = name or AMD_NAMES.get((device_id, int(a.get("Revision", 0))), f"AMD GPU 1002:{device_id:04x}")
        else:
            arch, kind, table_name = intel_gpu_info(device_id)
            if not any(first <= device_id <= last for first, last, *_ in _intel_ranges()):
                kind = "integrated" if dedicated < GiB else "discrete"
            name = name or table_name
        memory = dedicated if kind == "discrete" else dedicated + shared
        level = str(a.get("FeatureLevel", ""))
        out.append(Device("", name, vendor, kind, arch, memory, driver, "",
                          WINDOWS_BACKENDS[vendor] if level else BACKENDS[vendor], level, index))
    return out


def _intel_ranges():
    from .intel import INTEL_GPUS
    return INTEL_GPUS


def cpu_from_system(system: dict) -> Device:
    """{"brand", "machine", "processor_features": {PF_name: bool}, "memory"} (or "flags": [...] when
    archspec answered) -> the CPU device."""
    flags = set(system.get("flags") or ()) or flags_from_windows_pf(system.get("processor_features") or {})
    arch = isa_level(flags, system.get("machine") or "AMD64")
    return Device("cpu", str(system.get("brand") or "CPU"), "cpu", "cpu", arch, int(system.get("memory") or 0),
                  "", "", BACKENDS["cpu"])


def recorded(root: str) -> tuple[list[dict], dict] | None:
    """A recorded Windows machine's (adapters, system), or None when `root` holds none."""
    folder = os.path.join(root, "windows")
    if not os.path.isfile(os.path.join(folder, "dxgi.json")):
        return None
    with open(os.path.join(folder, "dxgi.json")) as f:
        adapters = json.load(f)
    try:
        with open(os.path.join(folder, "system.json")) as f:
            system = json.load(f)
    except OSError:
        system = {}
    return adapters, system


# ---------------------------------------------------------------------------------------------
# The real machine (Windows only; written against the documentation, not run here)

def dxgi_adapters() -> list[dict]:
    import ctypes
    from ctypes import wintypes

    class GUID(ctypes.Structure):
        _fields_ = [("Data1", wintypes.DWORD), ("Data2", wintypes.WORD), ("Data3", wintypes.WORD),
                    ("Data4", ctypes.c_ubyte * 8)]

    def guid(text: str) -> GUID:
        import uuid
        u = uuid.UUID(text)
        return GUID(u.time_low, u.time_mid, u.time_hi_version, (ctypes.c_ubyte * 8)(*u.bytes[8:]))

    class LUID(ctypes.Structure):
        _fields_ = [("LowPart", wintypes.DWORD), ("HighPart", wintypes.LONG)]

    class DXGI_ADAPTER_DESC1(ctypes.Structure):
        _fields_ = [("Description", wintypes.WCHAR * 128), ("VendorId", wintypes.UINT), ("DeviceId", wintypes.UINT),
                    ("SubSysId", wintypes.UINT), ("Revision", wintypes.UINT),
                    ("DedicatedVideoMemory", ctypes.c_size_t), ("DedicatedSystemMemory", ctypes.c_size_t),
                    ("SharedSystemMemory", ctypes.c_size_t), ("AdapterLuid", LUID), ("Flags", wintypes.UINT)]

    def method(obj, index: int, *argtypes):
        """The COM method at vtable `index` of interface pointer `obj` (HRESULT stdcall)."""
        vtable = ctypes.cast(obj, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p))).contents
        proto = ctypes.WINFUNCTYPE(ctypes.c_long, ctypes.c_void_p, *argtypes)
        fn = proto(vtable[index])
        return lambda *args: fn(obj, *args)

    dxgi = ctypes.windll.dxgi
    try:
        d3d12 = ctypes.windll.d3d12
    except OSError:
        d3d12 = None
    factory = ctypes.c_void_p()
    iid_factory1 = guid("770aae78-f26f-4dba-a829-253c83d1b387")
    if dxgi.CreateDXGIFactory1(ctypes.byref(iid_factory1), ctypes.byref(factory)) != 0:
        return []
    iid_dxgi_device = guid("54ec77fa-1377-44e6-8c32-88fd5f44c84c")
    iid_d3d12_device = guid("189819f1-1db6-4b57-be54-1821339b85f7")
    out = []
    try:
        index = 0
        while True:
            adapter = ctypes.c_void_p()
            # IDXGIFactory1::EnumAdapters1 is vtable slot 12 (IUnknown 3, IDXGIObject 4, IDXGIFactory 5)
            hr = method(factory, 12, wintypes.UINT, ctypes.POINTER(ctypes.c_void_p))(index, ctypes.byref(adapter))
            if hr != 0:           # DXGI_ERROR_NOT_FOUND: no more adapters
                break
            try:
                desc = DXGI_ADAPTER_DESC1()
                method(adapter, 10, ctypes.POINTER(DXGI_ADAPTER_DESC1))(ctypes.byref(desc))   # GetDesc1
                umd = ctypes.c_longlong()
                driver = ""
                if method(adapter, 9, ctypes.POINTER(GUID), ctypes.POINTER(ctypes.c_longlong))(
                        ctypes.byref(iid_dxgi_device), ctypes.byref(umd)) == 0:   # CheckInterfaceSupport
                    v = umd.value
                    driver = f"{v >> 48 & 0xFFFF}.{v >> 32 & 0xFFFF}.{v >> 16 & 0xFFFF}.{v & 0xFFFF}"
                level = ""
                if d3d12 is not None:
                    for name in FEATURE_LEVELS:   # null ppDevice: S_FALSE (1) when creation would succeed
                        if d3d12.D3D12CreateDevice(adapter, FEATURE_LEVEL_VALUE[name],
                                                   ctypes.byref(iid_d3d12_device), None) in (0, 1):
                            level = name
                            break
                out.append({"Description": desc.Description, "VendorId": desc.VendorId, "DeviceId": desc.DeviceId,
                            "SubSysId": desc.SubSysId, "Revision": desc.Revision,
                            "DedicatedVideoMemory": desc.DedicatedVideoMemory,
                            "DedicatedSystemMemory": desc.DedicatedSystemMemory,
                            "SharedSystemMemory": desc.SharedSystemMemory, "Flags": desc.Flags,
                            "DriverVersion": driver, "FeatureLevel": level})
            finally:
                method(adapter, 2)()       # Release
            index += 1
    finally:
        method(factory, 2)()
    return out


def windows_system() -> dict:
    import ctypes
    import platform
    import winreg
    from ..cpu import _windows_flags

    class MEMORYSTATUSEX(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]
    status = MEMORYSTATUSEX()
    status.dwLength = ctypes.sizeof(MEMORYSTATUSEX)
    memory = status.ullTotalPhys if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)) else 0
    try:
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"HARDWARE\DESCRIPTION\System\CentralProcessor\0") as k:
            brand = str(winreg.QueryValueEx(k, "ProcessorNameString")[0]).strip()
    except OSError:
        brand = platform.processor()
    return {"brand": brand, "machine": platform.machine(), "flags": sorted(_windows_flags()), "memory": memory}


def merge_nvml(dxgi: list[Device], nvml: list[Device] | None) -> list[Device]:
    """NVML's NVIDIA records (arch, memory, driver) in place of DXGI's, in order; DirectML stays offered."""
    if not nvml:
        return dxgi
    mine = iter(nvml)
    out = []
    for d in dxgi:
        if d.vendor == "nvidia":
            n = next(mine, None)
            if n is not None:
                from dataclasses import replace
                d = replace(n, backends=d.backends, dx12=d.dx12, adapter=d.adapter)
        out.append(d)
    return out


def merge_openvino(dxgi: list[Device], ov: list[Device] | None) -> list[Device]:
    """OpenVINO's Intel GPU properties (architecture, integrated/discrete) for the DXGI adapter whose
    name its FULL_DEVICE_NAME starts with ("Intel(R) UHD Graphics 770 (iGPU)")."""
    from dataclasses import replace
    out = []
    for d in dxgi:
        if d.vendor == "intel":
            match = next((o for o in ov or () if o.name.lower().startswith(d.name.lower())), None)
            if match is not None:
                d = replace(d, arch=match.arch or d.arch, kind=match.kind or d.kind)
        out.append(d)
    return out
