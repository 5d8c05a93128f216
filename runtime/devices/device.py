"""`Device`: one GPU or the CPU, described the way fingerprints and the runtime need it."""
from __future__ import annotations

from dataclasses import asdict, dataclass

BACKENDS = {"nvidia": ("tensorrt-rtx",), "amd": ("migraphx",), "intel": ("openvino",),
            "cpu": ("openvino", "onnxruntime"), "apple": ("onnxruntime-coreml",)}
# Windows: no MIGraphX; every DirectX 12 GPU also runs ONNX Runtime's DirectML EP (after the vendor's own backend)
WINDOWS_BACKENDS = {"nvidia": ("tensorrt-rtx", "onnxruntime-directml"), "amd": ("onnxruntime-directml",),
                    "intel": ("openvino", "onnxruntime-directml")}
ID_PREFIX = {"nvidia": "cuda", "amd": "rocm", "intel": "xpu", "apple": "mps"}
PCI_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel"}
DISPLAY_CLASSES = (0x0300, 0x0302, 0x0380)     # class >> 8: VGA, 3D controller, other display
KIND_RANK = {"discrete": 0, "integrated": 1, "cpu": 3}   # anything else sorts between GPUs and the CPU


@dataclass(frozen=True)
class Device:
    id: str            # "cpu", "cuda0", "rocm0", "xpu0": index per vendor in PCI-address order
    name: str          # marketing name when known, else e.g. "NVIDIA GPU 10de:2504"
    vendor: str        # nvidia | amd | intel | apple | cpu
    kind: str          # discrete | integrated | cpu
    arch: str          # sm_86 | gfx90a:sramecc+:xnack- | xe-hpg | x86-64-v4 ("" when unknown)
    memory: int        # bytes, 0 when unknown
    driver: str        # driver version, "" when unknown
    pci: str = ""      # "0000:01:00.0"
    backends: tuple[str, ...] = ()
    dx12: str = ""     # Windows: highest Direct3D 12 feature level, "12_1" ("" elsewhere / no D3D12)
    adapter: int = -1  # Windows: the DXGI adapter index (DirectML's device_id); -1 elsewhere
    available: int = 0  # the CPU: bytes a new process may take (Linux MemAvailable); 0 when unknown, and for GPUs

    def describe(self) -> dict:
        d = asdict(self)
        d["backends"] = list(self.backends)
        if not self.dx12:            # Linux/macOS records keep their shape
            del d["dx12"]
        if self.adapter < 0:
            del d["adapter"]
        if not self.available:
            del d["available"]
        return d


