"""The CPU's ISA level (x86-64-v1..v4, plus amx/bf16 marks) from /proc/cpuinfo flags.

Owns: the ISA level that OpenVINO CPU blobs are keyed by and that picks a CPU precision
(bf16 only where AMX makes it faster). Reads from a root path so tests can use recorded trees.
"""
from __future__ import annotations

import os
import platform

V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def cpu_flags(root: str = "/") -> set[str]:
    try:
        with open(os.path.join(root, "proc/cpuinfo")) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_level(flags: set[str], machine: str | None = None) -> str:
    """'x86-64-v4+amx', 'x86-64-v3', ... or the machine name on other architectures."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
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
