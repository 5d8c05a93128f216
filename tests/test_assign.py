"""`--backend` / `--params-backend` grammar (stable-diffusion.cpp's), as a table of accepted and
refused strings with their errors, over a laptop's devices (dGPU, iGPU, CPU)."""
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
])
def test_accepted(text, want):
    assert {m: d for m, (d, _) in ids(text).items()} == want


@pytest.mark.parametrize("text, error", [
    ("te=", "invalid backend assignment 'te='"),
    ("=cpu", "invalid backend assignment '=cpu'"),
    ("te=cpu,upscaler=", "invalid backend assignment 'upscaler='"),
    ("decoder=cpu", "unknown backend module 'decoder'"),
    ("te=gpu7", "device 'gpu7': only 2 GPU(s) here"),
    ("te=rocm", "no amd GPU here"),
    ("te=tpu0", "unknown device 'tpu0'"),
    ("te=c", "ambiguous"),                                                          # cpu, cuda0
])
def test_refused(text, error):
    with pytest.raises(UserError) as e:
        assign_modules(LAPTOP, text)
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
        assign_modules(LAPTOP[2:], "gpu")


def test_parse_keeps_unresolved_names():
    assert parse_assignment("te=cpu,vae=gpu0,unet=gpu0") == {"te": "cpu", "vae": "gpu0", "diffusion": "gpu0"}
