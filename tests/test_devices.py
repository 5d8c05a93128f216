"""Device discovery over recorded machines (tests/data/machines/<name>: plain-file copies of the /proc and /sys
files discovery reads), as a user of each machine would see it: ranked ids, kinds, architectures, memory."""
import os
import shutil
import subprocess
import sys
import types


from precast.runtime.cpu import cpu_flags, isa_level
from precast.runtime.devices import Device, apply_device_override, discover_devices, rank_devices

MACHINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "machines")
GiB = 1 << 30


def machine(name, **env):
    return discover_devices(os.path.join(MACHINES, name), env)


def seen(devices):
    return [(d.id, d.kind, d.vendor, d.arch) for d in devices]


def test_rtx3060_desktop():
    devs = machine("rtx3060-desktop")
    assert seen(devs) == [("cuda0", "discrete", "nvidia", "sm_86"), ("cpu", "cpu", "cpu", "x86-64-v3")]
    gpu, cpu = devs
    assert (gpu.name, gpu.pci, gpu.driver, gpu.memory) == ("NVIDIA GeForce RTX 3060", "0000:2b:00.0", "580.82.07", 0)
    assert gpu.backends == ("tensorrt-rtx",)
    assert cpu.name == "AMD Ryzen 7 5800X 8-Core Processor"
    assert cpu.memory == 32783052 * 1024 and cpu.backends == ("openvino", "onnxruntime")


def test_rx7900xtx_desktop():
    devs = machine("rx7900xtx-desktop")
    assert seen(devs) == [("rocm0", "discrete", "amd", "gfx1100"), ("cpu", "cpu", "cpu", "x86-64-v4")]
    gpu = devs[0]
    assert (gpu.name, gpu.pci, gpu.driver) == ("AMD Radeon RX 7900 XTX", "0000:03:00.0", "6.12.12")
    assert gpu.memory == 25753026560                 # 24 GiB board, as the KFD frame-buffer heap reports it
    assert devs[1].memory == 65480136 * 1024


def test_hsa_override_gfx_version_replaces_the_reported_target():
    assert machine("rx7900xtx-desktop", HSA_OVERRIDE_GFX_VERSION="10.3.0")[0].arch == "gfx1030"
    assert machine("rx7900xtx-desktop", HSA_OVERRIDE_GFX_VERSION="11.0.0")[0].arch == "gfx1100"
    assert machine("rx7900xtx-desktop", HSA_OVERRIDE_GFX_VERSION="eleven")[0].arch == "gfx1100"   # ignored


def test_arc_a770_ranks_before_the_integrated_uhd770():
    devs = machine("arc-a770-desktop")
    assert seen(devs) == [("xpu1", "discrete", "intel", "xe-hpg"), ("xpu0", "integrated", "intel", "xe-lp"),
                          ("cpu", "cpu", "cpu", "x86-64-v3")]
    arc, uhd, cpu = devs
    assert (arc.name, arc.pci, arc.memory) == ("Intel Arc A770 Graphics", "0000:03:00.0", 16225243136)
    assert (uhd.name, uhd.pci, uhd.memory) == ("Intel UHD Graphics 770", "0000:00:02.0", 0)
    assert arc.backends == uhd.backends == ("openvino",)
    assert cpu.memory == 32566140 * 1024


def test_laptop_dgpu_then_igpu_then_cpu():
    devs = machine("laptop-igpu-dgpu")
    assert seen(devs) == [("cuda0", "discrete", "nvidia", "sm_86"), ("xpu0", "integrated", "intel", "xe-lp"),
                          ("cpu", "cpu", "cpu", "x86-64-v4")]
    nv, xe, cpu = devs
    assert (nv.name, nv.pci, nv.driver) == ("NVIDIA GeForce RTX 3050 Ti Laptop GPU", "0000:01:00.0", "570.172.08")
    assert (xe.name, xe.pci) == ("Intel Iris Xe Graphics", "0000:00:02.0")
    assert cpu.memory == 16107620 * 1024


def test_apu_node_is_integrated():
    devs = machine("apu")
    assert seen(devs) == [("rocm0", "integrated", "amd", "gfx1103"), ("cpu", "cpu", "cpu", "x86-64-v4")]
    assert (devs[0].name, devs[0].pci, devs[0].memory) == ("AMD Radeon 780M Graphics", "0000:c4:00.0", 2 * GiB)


def test_apu_with_separate_cpu_and_gpu_nodes_is_integrated(tmp_path):
    """Newer kernels build the topology themselves: a CPU node, then a GPU node with cpu_cores_count 0 whose
    carve-out is a frame-buffer heap. Still the 780M, still integrated."""
    root = tmp_path / "apu"
    shutil.copytree(os.path.join(MACHINES, "apu"), root)
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    combined = (nodes / "0/properties").read_text()
    (nodes / "1/mem_banks/0").mkdir(parents=True)
    (nodes / "1/properties").write_text(combined.replace("cpu_cores_count 16", "cpu_cores_count 0"))
    (nodes / "1/mem_banks/0/properties").write_text("heap_type 1\nsize_in_bytes 4294967296\nflags 0\n")
    (nodes / "0/properties").write_text("cpu_cores_count 16\nsimd_count 0\ngfx_target_version 0\n")
    (root / "sys/bus/pci/devices/0000:c4:00.0/mem_info_vram_total").unlink()
    devs = discover_devices(str(root), {})
    assert seen(devs) == [("rocm0", "integrated", "amd", "gfx1103"), ("cpu", "cpu", "cpu", "x86-64-v4")]
    assert devs[0].memory == 4 * GiB


def test_mi210_ids_follow_pci_order_and_carry_target_features():
    devs = machine("mi210-server")
    # The KFD lists 0000:83 first; ids follow the PCI address, whatever the PCI class (0x0380 and 0x1200).
    assert seen(devs) == [("rocm0", "discrete", "amd", "gfx90a:sramecc+:xnack-"),
                          ("rocm1", "discrete", "amd", "gfx90a:sramecc+:xnack-"),
                          ("cpu", "cpu", "cpu", "x86-64-v3")]
    assert [d.pci for d in devs[:2]] == ["0000:03:00.0", "0000:83:00.0"]
    assert all(d.name == "AMD Instinct MI210" and d.memory == 68702699520 for d in devs[:2])
    assert machine("mi210-server", HSA_XNACK="1")[0].arch == "gfx90a:sramecc+:xnack+"


def test_precast_device_moves_the_igpu_first():
    devs = machine("laptop-igpu-dgpu")
    moved, warning = apply_device_override(devs, {"PRECAST_DEVICE": "xpu0"})
    assert warning is None
    assert [d.id for d in moved] == ["xpu0", "cuda0", "cpu"]
    assert [d.id for d in apply_device_override(devs, {"PRECAST_DEVICE": "XPU0"})[0]] == ["xpu0", "cuda0", "cpu"]


def test_precast_device_by_unique_name_prefix():
    devs = machine("laptop-igpu-dgpu")
    moved, warning = apply_device_override(devs, {"PRECAST_DEVICE": "intel iris"})
    assert warning is None and moved[0].id == "xpu0"
    moved, warning = apply_device_override(list(reversed(devs)), {"PRECAST_DEVICE": "NVIDIA GeForce"})
    assert warning is None and moved[0].id == "cuda0"
    moved, warning = apply_device_override(devs, {"PRECAST_DEVICE": "cpu"})
    assert warning is None and [d.id for d in moved] == ["cpu", "cuda0", "xpu0"]


def test_precast_device_naming_nothing_warns_and_changes_nothing():
    devs = machine("laptop-igpu-dgpu")
    moved, warning = apply_device_override(devs, {"PRECAST_DEVICE": "nothing"})
    assert moved == devs
    assert "'nothing'" in warning and all(i in warning for i in ("cuda0", "xpu0", "cpu"))


def test_precast_device_ambiguous_warns_and_changes_nothing():
    devs = machine("mi210-server")
    moved, warning = apply_device_override(devs, {"PRECAST_DEVICE": "rocm"})
    assert moved == devs and "'rocm'" in warning and "rocm0" in warning and "rocm1" in warning
    # Two identical cards share a name: the name is ambiguous, the ids are not.
    assert apply_device_override(devs, {"PRECAST_DEVICE": "AMD Instinct MI210"})[1] is not None
    assert apply_device_override(devs, {"PRECAST_DEVICE": "rocm1"})[0][0].pci == "0000:83:00.0"


def test_precast_device_unset_or_auto_changes_nothing():
    devs = machine("arc-a770-desktop")
    for env in ({}, {"PRECAST_DEVICE": ""}, {"PRECAST_DEVICE": "auto"}):
        assert apply_device_override(devs, env) == (devs, None)


def test_empty_root_is_just_a_cpu(tmp_path):
    devs = discover_devices(str(tmp_path), {})
    assert len(devs) == 1 and devs[0].id == "cpu" and devs[0].kind == "cpu" and devs[0].vendor == "cpu"


def test_a_weird_machine_never_raises(tmp_path):
    """Garbage where numbers should be, folders where files should be, binary junk: skipped, never raised."""
    def put(rel, data):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    put("proc/cpuinfo", b"\xff\xfe garbage\nflags :\n")
    put("proc/meminfo", b"MemTotal: lots kB\n")
    put("sys/bus/pci/devices/0000:01:00.0/vendor", b"0x10de\n")
    put("sys/bus/pci/devices/0000:01:00.0/device", b"not hex\n")
    put("sys/bus/pci/devices/not-an-address/vendor", b"0x1002\n")
    (tmp_path / "sys/bus/pci/devices/0000:02:00.0/vendor").mkdir(parents=True)
    put("sys/class/kfd/kfd/topology/nodes/1/properties", b"gfx_target_version 110000\nlocation_id x\njunk\n")
    put("sys/class/kfd/kfd/topology/nodes/1/mem_banks/0/properties", b"heap_type one\n")
    put("sys/class/drm/card0/device/vendor", b"0x8086\n")
    put("sys/class/drm/card0/device/device", b"\x00\x01")
    devs = discover_devices(str(tmp_path), {})
    assert devs[-1].id == "cpu"
    assert seen(devs) == [("rocm0", "discrete", "amd", "gfx1100"), ("cpu", "cpu", "cpu", "x86-64-v1")]


def test_this_machine_has_its_cpu_last_with_its_isa_level():
    devs = discover_devices("/")
    cpu = devs[-1]
    assert (cpu.id, cpu.kind, cpu.vendor) == ("cpu", "cpu", "cpu")
    assert cpu.arch == isa_level(cpu_flags())
    assert [d for d in devs if d.kind == "cpu"] == [cpu]


def test_rank_discrete_integrated_cpu_then_memory_then_id():
    def dev(id, kind, memory):
        return Device(id, id, "x", kind, "", memory, "")
    ranked = rank_devices([dev("cpu", "cpu", 64 * GiB), dev("xpu0", "integrated", 0),
                           dev("cuda10", "discrete", 8 * GiB), dev("cuda2", "discrete", 8 * GiB),
                           dev("rocm0", "discrete", 24 * GiB)])
    assert [d.id for d in ranked] == ["rocm0", "cuda2", "cuda10", "xpu0", "cpu"]


def test_describe_is_plain_json():
    import json
    d = machine("laptop-igpu-dgpu")[0].describe()
    assert json.loads(json.dumps(d)) == d
    assert d == {"id": "cuda0", "name": "NVIDIA GeForce RTX 3050 Ti Laptop GPU", "vendor": "nvidia",
                 "kind": "discrete", "arch": "sm_86", "memory": 0, "driver": "570.172.08", "pci": "0000:01:00.0",
                 "backends": ["tensorrt-rtx"]}


def test_nvml_answers_on_the_real_machine(monkeypatch):
    """With NVML present (a stand-in pynvml here: this machine has no NVIDIA driver) its answers win."""
    class Mem:
        total = 12 << 30

    class Pci:
        busId = b"00000000:2B:00.0"
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: "580.82.07",
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA GeForce RTX 3060", nvmlDeviceGetCudaComputeCapability=lambda h: (8, 6),
        nvmlDeviceGetMemoryInfo=lambda h: Mem(), nvmlDeviceGetPciInfo=lambda h: Pci())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    devs = discover_devices("/", {}, probe_openvino=False)
    assert devs[0] == Device("cuda0", "NVIDIA GeForce RTX 3060", "nvidia", "discrete", "sm_86", 12 << 30,
                             "580.82.07", "0000:2b:00.0", ("tensorrt-rtx",))
    assert [d.id for d in discover_devices("/", {}, probe_nvml=False, probe_openvino=False)] == ["cpu"]
    # A recorded tree describes another machine: NVML is never asked.
    assert machine("rtx3060-desktop")[0].memory == 0


def test_openvino_gpu_properties(monkeypatch):
    """OpenVINO's GPU answers (a stand-in openvino here: this machine has no Intel GPU) map to the same names."""
    from precast.runtime.devices import intel as devices_mod
    props = {
        "GPU.0": {"FULL_DEVICE_NAME": "Intel(R) UHD Graphics 770 (iGPU)", "DEVICE_TYPE": "Type.INTEGRATED",
                  "DEVICE_ARCHITECTURE": "GPU: vendor=0x8086 arch=v12.0.0", "GPU_UARCH_VERSION": "12.0.0",
                  "GPU_DEVICE_TOTAL_MEM_SIZE": 26 << 30,
                  "DEVICE_PCI_INFO": types.SimpleNamespace(domain=0, bus=0, device=2, function=0)},
        "GPU.1": {"FULL_DEVICE_NAME": "Intel(R) Arc(TM) A770 Graphics (dGPU)", "DEVICE_TYPE": "Type.DISCRETE",
                  "DEVICE_ARCHITECTURE": "GPU: vendor=0x8086 arch=v12.55.8", "GPU_DEVICE_TOTAL_MEM_SIZE": 16225243136},
    }

    class Core:
        available_devices = ["CPU", "GPU.0", "GPU.1"]

        def get_property(self, dev, key):
            return props[dev][key]
    monkeypatch.setitem(sys.modules, "openvino", types.SimpleNamespace(Core=Core))
    igpu, arc = devices_mod._openvino_gpus()
    assert (igpu.kind, igpu.arch, igpu.pci, igpu.memory) == ("integrated", "xe-lp", "0000:00:02.0", 26 << 30)
    assert (arc.name, arc.kind, arc.arch, arc.pci) == ("Intel(R) Arc(TM) A770 Graphics (dGPU)", "discrete",
                                                        "xe-hpg", "")


def test_the_runtime_stays_thin():
    """Importing discovery, and discovering a recorded machine, loads neither pynvml nor openvino."""
    code = ("import sys; from precast.runtime.devices import discover_devices; "
            f"discover_devices({os.path.join(MACHINES, 'laptop-igpu-dgpu')!r}); "
            "print(sorted(m for m in ('pynvml', 'openvino') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
