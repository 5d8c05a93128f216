"""`--backend` / `--params-backend` grammar (stable-diffusion.cpp's, plus backend names and
DEVICE:BACKEND pins), as a table of accepted and refused strings with their errors, over a laptop's
devices (dGPU, iGPU, CPU); a device that is not here falls back with the reason, or is refused
under --strict."""
import pytest

from precast.runtime.assign import assign_modules, parse_assignment
from precast.runtime.devices import Device
from precast.runtime.errors import UserError

LAPTOP = [
    Device("cuda0", "NVIDIA GeForce RTX 3050 Ti Laptop GPU", "nvidia", "discrete", "sm_86", 4 << 30, "580.82.07",
           "0000:01:00.0", ("tensorrt-rtx",)),
    Device("xpu0", "Intel Iris Xe Graphics", "intel", "integrated", "xe-lp", 0, "", "0000:00:02.0", ("openvino",)),
    Device("cpu", "11th Gen Intel Core i7-1165G7", "cpu", "cpu", "x86-64-v4", 16 << 30, "", "",
           ("openvino", "onnxruntime")),
]


def ids(text, params=None):
    p = assign_modules(LAPTOP, text, params)
    return {m: (pl.device.id, pl.params.id) for m, pl in p.items()}


@pytest.mark.parametrize("text, want", [
    (None, {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),                 # default: discrete GPU first
    ("", {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),
    ("cpu", {"te": "cpu", "diffusion": "cpu", "vae": "cpu"}),
    ("te=cpu,vae=gpu0,unet=gpu0", {"te": "cpu", "diffusion": "cuda0", "vae": "cuda0"}),
    ("gpu1", {"te": "xpu0", "diffusion": "xpu0", "vae": "xpu0"}),
    ("TE=CPU, Diffusion=cuda0", {"te": "cpu", "diffusion": "cuda0", "vae": "cuda0"}),
    ("text_encoder=cpu", {"te": "cpu", "diffusion": "cuda0", "vae": "cuda0"}),
    ("clip=cpu,first-stage=xpu0,dit=cuda0", {"te": "cpu", "diffusion": "cuda0", "vae": "xpu0"}),
    ("all=cpu,vae=gpu", {"te": "cpu", "diffusion": "cpu", "vae": "cuda0"}),
    ("*=xpu0", {"te": "xpu0", "diffusion": "xpu0", "vae": "xpu0"}),
    ("cpu,default=cuda0", {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),   # later entries win
    ("vae=cpu,vae=xpu0", {"te": "cuda0", "diffusion": "cuda0", "vae": "xpu0"}),
    ("unet=cuda", {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),           # backend name -> first device
    ("te=intel", {"te": "xpu0", "diffusion": "cuda0", "vae": "cuda0"}),
    ("unet=NVIDIA GeForce RTX 3050 Ti Laptop GPU", {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),
    ("te=Intel Iris", {"te": "xpu0", "diffusion": "cuda0", "vae": "cuda0"}),        # unique prefix of a name
    ("vae=xp", {"te": "cuda0", "diffusion": "cuda0", "vae": "xpu0"}),               # unique prefix of an id
    ("auto", {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),
    ("all=openvino", {"te": "xpu0", "diffusion": "xpu0", "vae": "xpu0"}),         # a backend: its first device
    ("unet=onnxruntime", {"te": "cuda0", "diffusion": "cpu", "vae": "cuda0"}),
    ("te=cpu:onnxruntime,vae=cpu:OpenVINO", {"te": "cpu", "diffusion": "cuda0", "vae": "cpu"}),
    ("unet=gpu0:tensorrt_rtx,te=trt", {"te": "cuda0", "diffusion": "cuda0", "vae": "cuda0"}),
])
def test_accepted(text, want):
    assert {m: d for m, (d, _) in ids(text).items()} == want
    assert not any(p.fallback for p in assign_modules(LAPTOP, text).values())


@pytest.mark.parametrize("text, want", [
    ("all=openvino", {"te": "openvino", "diffusion": "openvino", "vae": "openvino"}),
    ("unet=onnxruntime", {"te": None, "diffusion": "onnxruntime", "vae": None}),
    ("te=cpu:onnxruntime,vae=cpu:OpenVINO", {"te": "onnxruntime", "diffusion": None, "vae": "openvino"}),
    ("ORT", {"te": "onnxruntime", "diffusion": "onnxruntime", "vae": "onnxruntime"}),
    ("unet=gpu0:tensorrt_rtx,te=trt", {"te": "tensorrt-rtx", "diffusion": "tensorrt-rtx", "vae": None}),
    ("te=cpu", {"te": None, "diffusion": None, "vae": None}),
])
def test_backend_names_pin_the_backend(text, want):
    assert {m: p.backend for m, p in assign_modules(LAPTOP, text).items()} == want


@pytest.mark.parametrize("devices, text, words", [
    (LAPTOP, "te=gpu7", "device 'gpu7': only 2 GPUs here"),
    (LAPTOP, "te=rocm", "no amd GPU here"),
    (LAPTOP, "te=cuda1", "device 'cuda1': not here"),
    (LAPTOP, "te=migraphx", "migraphx runs on an AMD GPU and there is none here"),
    (LAPTOP[2:], "te=gpu", "this machine has no GPU"),
    (LAPTOP[2:], "te=tensorrt-rtx", "tensorrt-rtx runs on an NVIDIA GPU and there is none here"),
    (LAPTOP[2:], "te=gpu0:tensorrt-rtx", "no GPU here"),
])
def test_a_device_that_is_not_here_falls_back_with_the_reason_unless_strict(devices, text, words):
    te = assign_modules(devices, text)["te"]
    assert te.device.id == devices[0].id and te.backend is None           # the default device, nothing pinned
    assert te.fallback.startswith(f"--backend {text}: ") and words in te.fallback, te.fallback
    assert te.fallback.endswith(f"using {devices[0].id} instead")
    with pytest.raises(UserError) as e:
        assign_modules(devices, text, strict=True)
    assert str(e.value).startswith(f"--backend {text}: ") and words in str(e.value) and "--strict" in str(e.value)


@pytest.mark.parametrize("text, error", [
    ("te=", "invalid backend assignment 'te='"),
    ("=cpu", "invalid backend assignment '=cpu'"),
    ("te=cpu,upscaler=", "invalid backend assignment 'upscaler='"),
    ("decoder=cpu", "unknown backend module 'decoder'"),
    ("te=tpu0", "unknown device 'tpu0'"),
    ("te=c", "ambiguous"),                                                          # cpu, cuda0
    ("te=cpu:tensorrt-rtx", "--backend te=cpu:tensorrt-rtx: tensorrt-rtx does not run on cpu"),
    ("unet=xpu0:onnxruntime", "onnxruntime does not run on xpu0"),
    ("vae=cuda0:openvino", "openvino does not run on cuda0"),
    ("te=cpu:", "expected DEVICE:BACKEND"),
    ("te=cpu:tvm", "unknown backend 'tvm' in 'cpu:tvm'"),                          # the backend is unknown
])
def test_refused(text, error):
    """Names that are no device or backend at all, or a backend on a device it does not run on: a
    mistake, with or without --strict."""
    for strict in (False, True):
        with pytest.raises(UserError) as e:
            assign_modules(LAPTOP, text, strict=strict)
        assert error in str(e.value)


def test_params_backend_offload():
    got = ids("unet=cuda0", "unet=cpu")
    assert got["diffusion"] == ("cuda0", "cpu") and got["te"] == ("cuda0", "cuda0")
    placements = assign_modules(LAPTOP, "cuda0", "cpu")
    assert all(p.offload for p in placements.values())
    with pytest.raises(UserError, match="unknown backend module 'weights'"):
        assign_modules(LAPTOP, None, "weights=cpu")


def test_gpu_means_integrated_when_no_discrete():
    no_dgpu = LAPTOP[1:]
    assert assign_modules(no_dgpu, "gpu")["diffusion"].device.id == "xpu0"
    with pytest.raises(UserError, match="no GPU"):
        assign_modules(LAPTOP[2:], "gpu", strict=True)


def test_params_backend_names_a_device():
    with pytest.raises(UserError, match="--params-backend unet=cpu:onnxruntime: names where weights live"):
        assign_modules(LAPTOP, None, "unet=cpu:onnxruntime")
    cpu_only = assign_modules(LAPTOP[2:], "cpu", "gpu")["te"]       # no GPU to hold weights: they stay put
    assert not cpu_only.offload and "weights stay on cpu" in cpu_only.fallback


def test_parse_keeps_unresolved_names():
    assert parse_assignment("te=cpu,vae=gpu0,unet=gpu0") == {"te": "cpu", "vae": "gpu0", "diffusion": "gpu0"}
