"""Windows and macOS from recorded outputs (tests/data/machines/win-*/windows/{dxgi.json,system.json},
m2-mac/macos/{sysctl.txt,SPDisplaysDataType.json,sw_vers.txt}): devices, kinds, memories, ranking,
--backend / PRECAST_DEVICE; the DirectML and Core ML fingerprint rules; the DirectML target's build."""
import os
from pathlib import Path

import pytest

from precast.runtime.assign import assign_modules
from precast.runtime.cpu import flags_from_sysctl, flags_from_windows_pf, isa_level
from precast.runtime.devices import apply_device_override, discover_devices
from precast.runtime.devices.windows import nvidia_driver_from_umd
from precast.runtime.fingerprint import Fingerprint, why_not_serves
from precast.runtime.select import device_fingerprint

MACHINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "machines")
DML = ("tensorrt-rtx", "onnxruntime-directml")


def machine(name, **env):
    return discover_devices(os.path.join(MACHINES, name), env)


def seen(devices):
    return [(d.id, d.kind, d.vendor, d.arch, d.memory) for d in devices]


def test_windows_rtx3060_with_intel_igpu():
    devs = machine("win-rtx3060-igpu")
    assert seen(devs) == [("cuda0", "discrete", "nvidia", "sm_86", 12616466432),
                          ("xpu0", "integrated", "intel", "xe-lp", 134217728 + 17106016256),
                          ("cpu", "cpu", "cpu", "x86-64-v3", 34212032512)]
    nv, igpu, cpu = devs
    assert (nv.name, nv.driver, nv.dx12, nv.adapter, nv.backends) == ("NVIDIA GeForce RTX 3060", "560.94", "12_2", 0, DML)
    assert (igpu.name, igpu.dx12, igpu.adapter, igpu.backends) == ("Intel(R) UHD Graphics 770", "12_1", 1,
                                                                    ("openvino", "onnxruntime-directml"))
    assert cpu.name == "12th Gen Intel(R) Core(TM) i7-12700K"     # the Basic Render Driver is no device


def test_windows_laptop_radeon_780m_is_integrated_with_shared_memory():
    devs = machine("win-laptop-780m")
    assert seen(devs) == [("rocm0", "integrated", "amd", "gfx1103", 536870912 + 8153726976),
                          ("cpu", "cpu", "cpu", "x86-64-v4", 16307453952)]
    assert devs[0].backends == ("onnxruntime-directml",) and devs[0].driver == "31.0.24033.1003"


def test_windows_rx7900xtx_ranks_before_the_cpus_igpu():
    devs = machine("win-rx7900xtx-desktop")
    assert seen(devs) == [("rocm0", "discrete", "amd", "gfx1100", 25753026560),
                          ("rocm1", "integrated", "amd", "gfx1036", 536870912 + 34283679744),
                          ("cpu", "cpu", "cpu", "x86-64-v4", 68567359488)]
    assert [d.backends for d in devs[:2]] == [("onnxruntime-directml",)] * 2     # no MIGraphX on Windows


def test_m2_mac_unified_memory():
    devs = machine("m2-mac")
    assert seen(devs) == [("mps0", "integrated", "apple", "apple-m2", 16 << 30), ("cpu", "cpu", "cpu", "arm64", 16 << 30)]
    assert devs[0].backends == ("onnxruntime-coreml",) and devs[0].driver == "14.5"


def test_describe_keeps_the_linux_shape_and_adds_windows_fields():
    assert machine("win-laptop-780m")[0].describe()["dx12"] == "12_2"
    assert "dx12" not in machine("m2-mac")[0].describe()


@pytest.mark.parametrize("name, backend, want", [
    ("win-rtx3060-igpu", "gpu", ("cuda0", None)), ("win-rtx3060-igpu", "xpu0", ("xpu0", None)),
    ("win-rtx3060-igpu", "directml", ("cuda0", "onnxruntime-directml")),
    ("win-rtx3060-igpu", "xpu0:dml", ("xpu0", "onnxruntime-directml")),
    ("win-rtx3060-igpu", "intel", ("xpu0", None)), ("win-rtx3060-igpu", "cpu", ("cpu", None)),
    ("win-laptop-780m", "amd", ("rocm0", None)), ("win-laptop-780m", "directml", ("rocm0", "onnxruntime-directml")),
    ("win-rx7900xtx-desktop", "rocm1", ("rocm1", None)), ("win-rx7900xtx-desktop", "gpu1", ("rocm1", None)),
    ("m2-mac", "gpu", ("mps0", None)), ("m2-mac", "coreml", ("mps0", "onnxruntime-coreml")),
    ("m2-mac", "apple", ("mps0", None)),
])
def test_backend_resolves(name, backend, want):
    p = assign_modules(machine(name), backend)["diffusion"]
    assert (p.device.id, p.backend) == want and not p.fallback


def test_directml_is_not_offered_on_linux_or_the_cpu():
    from precast.runtime.errors import UserError
    p = assign_modules(machine("rtx3060-desktop"), "directml")["diffusion"]   # Linux: falls back, says why
    assert p.backend is None and "onnxruntime-directml" in p.fallback
    with pytest.raises(UserError):
        assign_modules(machine("win-rtx3060-igpu"), "cpu:directml")
    assert assign_modules(machine("m2-mac"), "directml")["diffusion"].fallback


@pytest.mark.parametrize("name, value, first", [
    ("win-rtx3060-igpu", "xpu0", "xpu0"), ("win-rtx3060-igpu", "intel(r) uhd", "xpu0"),
    ("win-rx7900xtx-desktop", "rocm1", "rocm1"), ("win-rx7900xtx-desktop", "AMD Radeon RX", "rocm0"),
    ("m2-mac", "cpu", "cpu"), ("m2-mac", "mps0", "mps0"),
])
def test_precast_device(name, value, first):
    moved, warning = apply_device_override(machine(name), {"PRECAST_DEVICE": value})
    assert warning is None and moved[0].id == first


def test_cpu_feature_bits_per_os():
    pf = {"PF_SSSE3_INSTRUCTIONS_AVAILABLE": True, "PF_SSE4_1_INSTRUCTIONS_AVAILABLE": True,
          "PF_SSE4_2_INSTRUCTIONS_AVAILABLE": True, "PF_COMPARE_EXCHANGE128": True}
    assert isa_level(flags_from_windows_pf(pf), "AMD64") == "x86-64-v2"
    pf |= {"PF_AVX_INSTRUCTIONS_AVAILABLE": True, "PF_AVX2_INSTRUCTIONS_AVAILABLE": True, "PF_XSAVE_ENABLED": True}
    assert isa_level(flags_from_windows_pf(pf), "AMD64") == "x86-64-v3"
    assert isa_level(flags_from_windows_pf(pf | {"PF_AVX512F_INSTRUCTIONS_AVAILABLE": True}), "AMD64") == "x86-64-v4"
    intel_mac = {"machdep.cpu.features": "FPU VME SSE3 PCLMULQDQ SSSE3 FMA CX16 SSE4.1 SSE4.2 MOVBE POPCNT XSAVE AVX1.0 F16C",
                 "machdep.cpu.leaf7_features": "SMEP BMI1 AVX2 BMI2 ERMS", "machdep.cpu.extfeatures": "SYSCALL XD EM64T LAHF LZCNT"}
    assert isa_level(flags_from_sysctl(intel_mac), "x86_64") == "x86-64-v3"
    assert isa_level(set(), "arm64") == "arm64"


def test_nvidia_windows_driver_version():
    assert nvidia_driver_from_umd("32.0.15.6094") == "560.94"
    assert nvidia_driver_from_umd("31.0.15.3742") == "537.42"


def fp(name, i, backend, version="1.20.1"):
    return device_fingerprint(machine(name)[i], backend, version)


DIRECTML = "onnxruntime-directml/1.22.0/any-gpu/fl11_0"


@pytest.mark.parametrize("artifact, device, reason", [
    (DIRECTML, ("win-rtx3060-igpu", 0), None),
    (DIRECTML, ("win-rtx3060-igpu", 1), None),
    (DIRECTML, ("win-laptop-780m", 0), None),
    ("onnxruntime-directml/1.22.0/any-gpu/fl12_2", ("win-rtx3060-igpu", 1), "feature level 12.2; device has 12.1"),
    ("onnxruntime-directml/1.22.0/any-gpu/any", ("win-rx7900xtx-desktop", 1), None),
    (DIRECTML, ("win-rtx3060-igpu", 2), "run on a GPU, not cpu"),
    (DIRECTML, ("rtx3060-desktop", 0), "no Direct3D 12"),       # Linux: no feature level recorded
    ("onnxruntime-directml/1.22.0/amd-gpu/fl11_0", ("win-rtx3060-igpu", 0), "built for amd GPUs"),
    ("onnxruntime-directml/1.22.0/amd-gpu/fl11_0/driver>=32.0.11037.4004", ("win-laptop-780m", 0), "driver >= 32.0"),
    ("onnxruntime-directml/1.22.0/amd-gpu/fl11_0/driver>=31.0.24000.0", ("win-laptop-780m", 0), None),
    ("onnxruntime-coreml/1.22.0/apple-gpu/any/driver>=12.0", ("m2-mac", 0), None),
    ("onnxruntime-coreml/1.22.0/apple-gpu/apple-m3,apple-m4", ("m2-mac", 0), "apple-m2"),
    ("onnxruntime-coreml/1.22.0/apple-gpu/any/driver>=15.0", ("m2-mac", 0), "macOS >= 15.0"),
    ("onnxruntime-coreml/1.22.0/apple-gpu/any", ("m2-mac", 1), "not cpu"),
])
def test_ep_compatibility_rules(artifact, device, reason):
    name, i = device
    backend = artifact.split("/")[0]
    why = why_not_serves(Fingerprint.from_string(artifact), fp(name, i, backend))
    assert (why is None) == (reason is None), why
    if reason:
        assert reason in why


def test_directml_target_builds_here(tmp_path):
    """The tiny VAE decoder in fp16, pinned to a 64x64 profile: a basic-optimized ONNX that ONNX Runtime
    (CPU here) loads with static input dims; bf16 is refused before any work."""
    import onnx
    import onnxruntime as ort
    from precast.compiler.demo_model import write_demo_model
    from precast.compiler.export import export
    from precast.compiler.targets import BuildJob, dtype_problem, get_target, parse_target
    write_demo_model(str(tmp_path / "tiny.safetensors"))
    out = Path(export(tmp_path / "tiny.safetensors", tmp_path / "fp16", ["vae_decoder"], "fp16", progress=False)["out"])
    onnx_path = out / "vae_decoder" / "model.onnx"
    model = onnx.load(str(onnx_path), load_external_data=False)
    inputs = [{"name": i.name, "shape": [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]}
              for i in model.graph.input]
    latent = inputs[0]
    shape = (1, 4, 8, 8) if len(latent["shape"]) == 4 else None
    spec = parse_target("directml")
    target = get_target("dml")
    folder = tmp_path / "artifact"
    folder.mkdir()
    meta = target.build(BuildJob(onnx_path, "vae_decoder", inputs, {latent["name"]: (shape, shape, shape)}, False),
                        spec, folder)
    assert meta["optimized"] == "basic" and meta["static"] and meta["pinned"] == {latent["name"]: list(shape)}
    s = ort.InferenceSession(str(folder / meta["entry"]), providers=["CPUExecutionProvider"])
    assert s.get_inputs()[0].shape == list(shape)
    assert str(target.fingerprint(spec)).startswith("onnxruntime-directml/") and str(target.fingerprint(spec)).endswith(
        "/any-gpu/fl11_0")
    assert "bf16" in dtype_problem(spec, "bf16") and dtype_problem(spec, "fp16") is None


def test_directml_text_encoder_keeps_textual_inversion_rows(tmp_path):
    """The text encoder's token_embeddings_extra (a one-zero-row default) is stripped before the profile
    pins dims, as for ONNX Runtime: the artifact builds, and a row it is fed (token id = vocab) reaches
    the output."""
    import json as _json

    import numpy as np
    import onnxruntime as ort
    from conftest import precast
    from precast.compiler.demo_model import TINY, write_demo_model
    write_demo_model(str(tmp_path / "tiny.safetensors"))
    precast("export", tmp_path / "tiny.safetensors", "--out", tmp_path / "exp", "--component", "text_encoder",
            check=True)
    proc = precast("compile", tmp_path / "exp", "--target", "directml", "--json",
                   env={"PRECAST_CACHE": str(tmp_path / "cache")}, check=True)
    art = _json.loads(proc.stdout[proc.stdout.index("{"):])["artifacts"][0]
    s = ort.InferenceSession(art["artifact"], providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in s.get_inputs()}
    rows = np.zeros([d if isinstance(d, int) else 1 for d in shapes["token_embeddings_extra"]], np.float32)
    ids = np.zeros([d if isinstance(d, int) else 1 for d in shapes["input_ids"]], np.int32)
    ids[0, 1] = TINY.vocab                        # the first extra row
    plain = s.run(None, {"input_ids": ids, "token_embeddings_extra": rows})[0]
    rows[0] = np.random.default_rng(0).standard_normal(rows.shape[1])
    fed = s.run(None, {"input_ids": ids, "token_embeddings_extra": rows})[0]
    assert np.isfinite(plain).all() and np.abs(fed - plain).max() > 1e-3
