"""Compatibility rules, one table per backend, and the fingerprint string form."""
import pytest

from precast.runtime.cpu import isa_level
from precast.runtime.fingerprint import Fingerprint, why_not_serves

TRT = "tensorrt-rtx/1.7.1.116/nvidia-gpu/{arch}/driver>=580.65"


def dev(backend, version, vendor, dtype, arch, driver=""):
    return Fingerprint(backend, version, vendor, dtype, (arch,), driver)


@pytest.mark.parametrize("artifact, device, serves, reason", [
    (TRT.format(arch="sm_89"), dev("tensorrt-rtx", "1.7.1.116", "nvidia", "gpu", "sm_86", "580.82"), False, "sm_86"),
    (TRT.format(arch="sm_86"), dev("tensorrt-rtx", "1.7.1.116", "nvidia", "gpu", "sm_86", "580.82"), True, None),
    (TRT.format(arch="sm_80,sm_86,sm_89"), dev("tensorrt-rtx", "1.7.1.116", "nvidia", "gpu", "sm_89", "581.0"), True, None),
    (TRT.format(arch="sm_80,sm_86"), dev("tensorrt-rtx", "1.7.1.116", "nvidia", "gpu", "sm_75", "581.0"), False, "sm_75"),
    (TRT.format(arch="sm_86"), dev("tensorrt-rtx", "1.8.0.10", "nvidia", "gpu", "sm_86", "590.1"), False, "1.8.0.10"),
    (TRT.format(arch="sm_86"), dev("tensorrt-rtx", "1.7.1.116", "nvidia", "gpu", "sm_86", "570.10"), False, "driver"),
    ("migraphx/2.12.0+rocm6.4.1/amd-gpu/gfx1100", dev("migraphx", "2.12.0+rocm6.4.1", "amd", "gpu", "gfx1030"), False, "gfx1030"),
    ("migraphx/2.12.0+rocm6.4.1/amd-gpu/gfx1100", dev("migraphx", "2.12.0+rocm6.4.1", "amd", "gpu", "gfx1100"), True, None),
    ("migraphx/2.12.0+rocm6.4.1/amd-gpu/gfx90a:sramecc+:xnack-",
     dev("migraphx", "2.12.0+rocm6.4.1", "amd", "gpu", "gfx90a:sramecc-:xnack-"), False, "gfx90a:sramecc-"),
    ("migraphx/2.12.0+rocm6.4.1/amd-gpu/gfx1100", dev("migraphx", "2.12.0+rocm6.3.0", "amd", "gpu", "gfx1100"), False, "rocm6.3.0"),
    ("openvino/2026.4.1-22982/any-cpu/x86-64-v4", dev("openvino", "2026.3.0-1234", "any", "cpu", "x86-64-v4"), False, "2026.3.0"),
    ("openvino/2026.4.1-22982/any-cpu/x86-64-v4", dev("openvino", "2026.4.1-22982", "any", "cpu", "x86-64-v3"), False, "x86-64-v3"),
    ("openvino/2026.4.1-22982/any-cpu/x86-64-v4", dev("openvino", "2026.4.1-22982", "any", "cpu", "x86-64-v4"), True, None),
    ("openvino/2026.4.1-22982/intel-gpu/xe-hpg", dev("openvino", "2026.4.1-22982", "any", "cpu", "x86-64-v4"), False, "cpu"),
    ("onnxruntime/1.31.1/any-cpu/any", dev("onnxruntime", "1.20.0", "any", "cpu", "x86-64-v2"), True, None),
    ("onnxruntime/1.31.1/any-cpu/any", dev("openvino", "2026.4.1-22982", "any", "cpu", "x86-64-v4"), False, "onnxruntime"),
    ("onnxruntime/1.31.1/any-cpu/x86-64-v4", dev("onnxruntime", "1.31.1", "any", "cpu", "x86-64-v4"), True, None),
    ("onnxruntime/1.31.1/any-cpu/x86-64-v4", dev("onnxruntime", "1.31.1", "any", "cpu", "x86-64-v3"), False, "x86-64-v3"),
    ("onnxruntime/1.31.1/any-cpu/x86-64-v4", dev("onnxruntime", "1.32.0", "any", "cpu", "x86-64-v4"), False, "1.32.0"),
])
def test_compatibility_rules(artifact, device, serves, reason):
    why = why_not_serves(Fingerprint.from_string(artifact), device)
    assert (why is None) == serves, why
    if reason:
        assert reason in why


@pytest.mark.parametrize("s", [TRT.format(arch="sm_80,sm_86"), "migraphx/2.12.0+rocm6.4.1/amd-gpu/gfx90a:sramecc+:xnack-",
                               "openvino/2026.4.1-22982/any-cpu/x86-64-v4+amx", "onnxruntime/1.31.1/any-cpu/any"])
def test_string_form_round_trips(s):
    assert Fingerprint.from_string(s).to_string() == s


def test_string_form_rejects_garbage():
    with pytest.raises(ValueError):
        Fingerprint.from_string("tensorrt-rtx sm_86")


@pytest.mark.parametrize("flags, level", [
    ({"sse4_2", "ssse3", "sse4_1", "popcnt", "cx16", "lahf_lm"}, "x86-64-v2"),
    ({"sse4_2", "ssse3", "sse4_1", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
      "movbe", "xsave"}, "x86-64-v3"),
    ({"sse4_2", "ssse3", "sse4_1", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
      "movbe", "xsave", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "amx_tile", "amx_bf16"},
     "x86-64-v4+amx"),
    (set(), "x86-64-v1"),
])
def test_isa_levels(flags, level):
    assert isa_level(flags, "x86_64") == level
