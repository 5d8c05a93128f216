"""The machine a benchmark ran on, as every benchmark's JSON records it: CPU (name, ISA level, the
flags that decide precision, AMX, hypervisor), cores, memory, OS, Python, the versions of the
packages the benchmark compares, and the git commit (and whether compiler/ or runtime/ differ from it)."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRECISION_FLAGS = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_fp16"}


def describe(packages: tuple[str, ...]) -> dict:
    from precast.runtime.cpu import cpu_flags, cpu_name, isa_level
    flags = cpu_flags()
    mem_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    versions = {}
    for pkg in packages:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    commit, dirty = _git_state()
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "ram_gib": round(mem_kb / 2**20, 1), "isa": isa_level(flags),
            "relevant_flags": sorted(flags & PRECISION_FLAGS), "amx": "amx_tile" in flags,
            "virtualization": "KVM guest" if "hypervisor" in flags else "bare metal", "gpu": "none",
            "os": platform.platform(), "python": platform.python_version(), "git_commit": commit,
            "compiler_or_runtime_modified": dirty, "versions": versions}


def _git_state() -> tuple[str | None, bool | None]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "compiler", "runtime"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        return None, None
    return commit, dirty
