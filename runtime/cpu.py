"""The CPU's ISA level (x86-64-v1..v4, plus amx/bf16 marks) from the CPU's feature flags.

Owns: the ISA level that OpenVINO CPU blobs are keyed by and that picks a CPU precision
(bf16 only where AMX makes it faster). Reads from a root path so tests can use recorded trees.
Flags, in Linux's /proc/cpuinfo names, come per OS from (`os_cpu_flags`):
- Linux: /proc/cpuinfo;
- Windows: archspec's CPUID reading when that optional package is installed (imported lazily; the
  only Windows source of the AMX bits), else kernel32 IsProcessorFeaturePresent (documented PF_*
  bits: SSSE3/SSE4.1/SSE4.2/AVX/AVX2/AVX512F; the rest of each level is implied by them, see
  `flags_from_windows_pf`);
- macOS: sysctl machdep.cpu.features / leaf7_features / extfeatures (Intel Macs); Apple Silicon is
  `arm64`.
The Windows and macOS mappings take recorded outputs, so they are tested on Linux.
"""
from __future__ import annotations

import os
import platform

V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def cpu_flags(root: str = "/") -> set[str]:
    """The CPU's flags (Linux names): `os_cpu_flags` on this machine, /proc/cpuinfo under a recorded root."""
    if root in ("/", "") and platform.system() in ("Windows", "Darwin"):
        try:
            return os_cpu_flags(root)
        except Exception:
            return set()
    return _proc_flags(root)


def _proc_flags(root: str) -> set[str]:
    try:
        with open(os.path.join(root, "proc/cpuinfo")) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# IsProcessorFeaturePresent constants (winnt.h) -> Linux flag names
WINDOWS_PF = {"PF_COMPARE_EXCHANGE128": (14, "cx16"), "PF_SSE3_INSTRUCTIONS_AVAILABLE": (13, "pni"),
              "PF_XSAVE_ENABLED": (17, "xsave"), "PF_SSSE3_INSTRUCTIONS_AVAILABLE": (36, "ssse3"),
              "PF_SSE4_1_INSTRUCTIONS_AVAILABLE": (37, "sse4_1"), "PF_SSE4_2_INSTRUCTIONS_AVAILABLE": (38, "sse4_2"),
              "PF_AVX_INSTRUCTIONS_AVAILABLE": (39, "avx"), "PF_AVX2_INSTRUCTIONS_AVAILABLE": (40, "avx2"),
              "PF_AVX512F_INSTRUCTIONS_AVAILABLE": (41, "avx512f")}
# What a PF bit implies: every shipped x86-64 CPU with SSE4.2 has POPCNT and LAHF in 64-bit mode, every
# AVX2 CPU has FMA/BMI1/BMI2/F16C/MOVBE (Haswell+, Excavator+), every AVX512F client/server CPU has
# BW/CD/DQ/VL (Skylake-SP+, Zen 4+; Xeon Phi excepted). Windows exposes no PF bit for AMX.
WINDOWS_IMPLIED = {"sse4_2": {"popcnt", "lahf_lm"}, "avx2": {"fma", "bmi1", "bmi2", "f16c", "movbe", "abm"},
                   "avx512f": {"avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
# sysctl machdep.cpu.* feature words -> Linux flag names (the rest: lower case as they are)
SYSCTL_NAMES = {"SSE4.1": "sse4_1", "SSE4.2": "sse4_2", "AVX1.0": "avx", "LAHF": "lahf_lm", "LZCNT": "abm",
                "SSE3": "pni", "CX16": "cx16", "AMX_TILE": "amx_tile", "AMX_BF16": "amx_bf16"}


def flags_from_windows_pf(present: dict[str, bool]) -> set[str]:
    """IsProcessorFeaturePresent answers {PF_name: bool} -> Linux flag names, implied ones added."""
    flags = {WINDOWS_PF[k][1] for k, v in present.items() if v and k in WINDOWS_PF}
    for bit, more in WINDOWS_IMPLIED.items():
        if bit in flags:
            flags |= more
    return flags


def flags_from_sysctl(values: dict[str, str]) -> set[str]:
    """sysctl machdep.cpu.features / leaf7_features / extfeatures (Intel Macs) -> Linux flag names."""
    out = set()
    for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features", "machdep.cpu.extfeatures"):
        for word in (values.get(key) or "").split():
            out.add(SYSCTL_NAMES.get(word.upper(), word.lower().replace(".", "_")))
    return out


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl name ...` output ("name: value" lines) -> {name: value}."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _windows_flags() -> set[str]:   # Windows only: not run here
    try:
        import archspec.cpu     # optional, lazily: CPUID through its vendored reader, AMX included
        return {str(f) for f in archspec.cpu.host().features}
    except Exception:
        pass
    import ctypes
    present = ctypes.windll.kernel32.IsProcessorFeaturePresent
    return flags_from_windows_pf({name: bool(present(num)) for name, (num, _) in WINDOWS_PF.items()})


def _sysctl(*names: str) -> dict[str, str]:   # macOS only
    import subprocess
    out = subprocess.run(["sysctl", *names], capture_output=True, text=True, timeout=10).stdout
    return parse_sysctl(out)


def os_cpu_flags(root: str = "/", system: str | None = None) -> set[str]:
    """This OS's CPU flags in Linux names: /proc/cpuinfo under `root` on Linux (and for recorded
    trees), the CPU's own feature bits through the OS on Windows and macOS (real machine only)."""
    system = system or platform.system()
    if system == "Windows" and root in ("/", ""):
        return _windows_flags()
    if system == "Darwin" and root in ("/", ""):
        return flags_from_sysctl(_sysctl("machdep.cpu.features", "machdep.cpu.leaf7_features",
                                         "machdep.cpu.extfeatures"))
    return _proc_flags(root)


def isa_level(flags: set[str], machine: str | None = None) -> str:
    """'x86-64-v4+amx', 'x86-64-v3', ... or the machine name on other architectures."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64", "x86_64h"):
        return machine.lower()
    level = "x86-64-v1"
    if V2 <= flags:
        level = "x86-64-v2"
        if V3 - {"abm"} <= flags:
            level = "x86-64-v3"
            if V4 <= flags:
                level = "x86-64-v4"
    if "amx_tile" in flags and "amx_bf16" in flags:
        level += "+amx"
    return level


def cpu_name(root: str = "/") -> str:
    try:
        with open(os.path.join(root, "proc/cpuinfo")) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Components that embed a float input with sinusoids (the denoiser's timestep, Flux's guidance, RoPE
# angles from position ids): under OpenVINO's bf16 hint the CPU plugin rounds t * 1000 and the angles
# to bf16 before sin/cos (750 -> 752; RoPE 0.18 rad off at 1024 px; measured, benchmarks/flux_step.py),
# so they compile with the f32 hint. Their matrix multiplies still run in the weights' precision:
# a bf16 export's run as bf16 GEMMs (AMX where present), with the rest of the graph in f32.
SINUSOID_COMPONENTS = ("transformer", "unet")


def default_precision(device: str, isa: str, component: str | None = None) -> str:
    """OpenVINO inference precision: bf16 only where AMX makes it faster (measured here without
    AMX: SD1.5 UNet 6.9 s bf16 vs 5.0 s f32), and never for SINUSOID_COMPONENTS on the CPU; f16 on
    GPUs (not verified on hardware)."""
    if device.upper().startswith("CPU"):
        return "bf16" if isa.endswith("+amx") and component not in SINUSOID_COMPONENTS else "f32"
    return "f16"
