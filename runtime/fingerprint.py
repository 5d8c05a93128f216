"""Fingerprints: what makes an engine incompatible, and which devices an artifact serves.

Owns: the `Fingerprint` value (backend, backend version, vendor, device type, architectures,
driver floor), its stable string form, and one compatibility rule per backend:

- tensorrt-rtx: exactly the compute capabilities it was built for, the same TensorRT-RTX
  release, a driver at or above the floor;
- migraphx: one full gfx name (features included) and the same MIGraphX + ROCm versions;
- openvino: one device type, CPU ISA level / GPU architecture, and the same OpenVINO version;
- onnxruntime: plain ONNX (arch `any`) serves any CPU with ONNX Runtime; a graph ONNX Runtime
  optimized ahead of time serves one CPU ISA level with the same ONNX Runtime release.
- onnxruntime-directml (Windows, any vendor): the ONNX prepared for the DirectML EP, arch the lowest
  Direct3D 12 feature level it needs (`fl11_0`: DirectML's own floor; `any` the same), vendor `any` or
  one vendor; a driver floor only with one vendor (Windows driver versions are per vendor); any
  onnxruntime-directml release (the graph holds only standard ONNX ops);
- onnxruntime-coreml (macOS): the ONNX through the CoreML EP, compiled on the device and cached by
  it; vendor apple, arch `any` or the chips listed, driver floor = the macOS version.

The runtime matches against these, so this module imports nothing beyond the standard library.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fingerprint:
    backend: str                    # tensorrt-rtx | migraphx | openvino | onnxruntime
    backend_version: str            # e.g. 1.7.1.116; migraphx: "2.12.0+rocm6.4.1"
    vendor: str                     # nvidia | amd | intel | any
    device_type: str                # gpu | cpu
    arch: tuple[str, ...]           # artifact: what it serves; device: its one architecture
    driver: str = ""                # artifact: driver floor; device: installed driver version
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def to_string(self) -> str:
        s = f"{self.backend}/{self.backend_version}/{self.vendor}-{self.device_type}/{','.join(self.arch)}"
        if self.driver:
            s += f"/driver>={self.driver}"
        return s

    @classmethod
    def from_string(cls, s: str) -> "Fingerprint":
        parts = s.split("/")
        if len(parts) not in (4, 5) or "-" not in parts[2]:
            raise ValueError(f"not a fingerprint string: {s!r} (expected backend/version/vendor-type/arch[,arch][/driver>=X])")
        vendor, _, dtype = parts[2].partition("-")
        driver = parts[4].removeprefix("driver>=") if len(parts) == 5 else ""
        return cls(parts[0], parts[1], vendor, dtype, tuple(a for a in parts[3].split(",") if a), driver)

    def __str__(self) -> str:
        return self.to_string()


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.replace("-", ".").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def version_at_least(have: str, floor: str) -> bool:
    return not floor or (bool(have) and _version_tuple(have) >= _version_tuple(floor))


def why_not_serves(artifact: Fingerprint, device: Fingerprint) -> str | None:
    """None when `artifact` may run on `device`; otherwise the reason, in words."""
    a, d = artifact, device
    if a.backend != d.backend:
        return f"artifact is for {a.backend}, device offers {d.backend}"
    if a.backend == "onnxruntime":
        if d.device_type != "cpu":
            return f"ONNX Runtime artifacts run on the CPU, not {d.device_type}"
        if a.arch in ((), ("any",)):
            return None
        if a.backend_version != d.backend_version:   # pre-optimized graphs hold ORT's internal ops
            return f"optimized by onnxruntime {a.backend_version}, installed is {d.backend_version or 'none'}"
        arch = d.arch[0] if d.arch else "?"
        return None if a.arch == (arch,) else f"graph optimized for {','.join(a.arch)} CPUs; this CPU is {arch}"
    if a.backend in ("onnxruntime-directml", "onnxruntime-coreml"):
        return _why_not_ort_ep(a, d)
    if a.device_type != d.device_type:
        return f"built for a {a.device_type}, device is a {d.device_type}"
    if a.backend_version != d.backend_version:
        return f"built with {a.backend} {a.backend_version}, installed is {d.backend_version or 'none'}"
    arch = d.arch[0] if d.arch else "?"
    if a.backend == "tensorrt-rtx":
        if arch not in a.arch:
            return f"engine built for {', '.join(a.arch)}; device is {arch}"
        if not version_at_least(d.driver, a.driver):
            return f"engine needs driver >= {a.driver}; device has {d.driver or 'none'}"
        return None
    if a.backend == "migraphx":
        return None if a.arch == (arch,) else f"program compiled for {','.join(a.arch)}; device is {arch}"
    if a.backend == "openvino":
        return None if a.arch == (arch,) else f"blob compiled for {','.join(a.arch)}; device is {arch}"
    return f"unknown backend {a.backend}"


def _feature_level(arch: str) -> tuple[int, ...]:
    """'fl12_1' -> (12, 1); () when it is none."""
    return _version_tuple(arch.removeprefix("fl").replace("_", ".")) if arch.startswith("fl") else ()


def _why_not_ort_ep(a: Fingerprint, d: Fingerprint) -> str | None:
    if d.device_type != "gpu":
        return f"{a.backend} artifacts run on a GPU, not {d.device_type}"
    if a.vendor not in ("any", d.vendor):
        return f"built for {a.vendor} GPUs; device is {d.vendor}"
    arch = d.arch[0] if d.arch else ""
    if a.backend == "onnxruntime-directml":
        floors = [_feature_level(x) for x in a.arch if x != "any"]
        have = _feature_level(arch)
        if floors and (not have or have < min(floors)):
            need = min((x for x in a.arch if x != "any"), key=_feature_level)
            return f"needs Direct3D 12 feature level {need[2:].replace('_', '.')}; device has " + (
                arch[2:].replace("_", ".") if have else "no Direct3D 12")
        if a.driver and a.vendor != "any" and not version_at_least(d.driver, a.driver):
            return f"needs {a.vendor} driver >= {a.driver}; device has {d.driver or 'none'}"
        return None
    if a.arch not in ((), ("any",)) and arch not in a.arch:
        return f"Core ML artifact for {', '.join(a.arch)}; device is {arch or '?'}"
    if not version_at_least(d.driver, a.driver):
        return f"needs macOS >= {a.driver}; device has {d.driver or 'unknown'}"
    return None
