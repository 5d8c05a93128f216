"""Engine selection on recorded machines: an engine built for another GPU is passed over with the
reason, a damaged artifact is refused, a load failure falls back -- and the runtime says why."""
import json
import shutil

import pytest

from conftest import ROOT, flip_byte, precast
from precast.runtime.assign import assign_modules
from precast.runtime.devices import discover_devices
from precast.runtime.manifest import read_manifest
from precast.runtime.select import installed_backends, load_component, select_component

MACHINES = f"{ROOT}/tests/data/machines"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("selection")
    env = {"PRECAST_CACHE": str(tmp / "cache")}
    out = {}
    for cc in ("sm_89", "sm_86"):
        recipe = tmp / f"{cc}.yaml"
        recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [vae_decoder]\n"
                          "profiles: {batch: 1, height: 64, width: 64}\n"
                          f"targets: [{{tensorrt-rtx: {{compute_capabilities: [{cc}]}}}}, {{openvino: {{device: CPU}}}}]\n")
        precast("build", recipe, "--out", tmp / cc, env=env, check=True)
        out[cc] = tmp / cc
    return out


def doctor(bundle, machine=None, *args):
    extra = ["--sysroot", f"{MACHINES}/{machine}"] if machine else []
    proc = precast("doctor", bundle, "--json", *extra, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_sm89_engine_on_an_sm86_machine_falls_back_with_the_reason(bundles):
    report = doctor(bundles["sm_89"], "rtx3060-desktop")
    assert report["devices"][0]["id"] == "cuda0" and report["devices"][0]["arch"] == "sm_86"
    vae = report["components"]["vae_decoder"]
    assert vae["module"] == "vae"
    trt = next(r for r in vae["passed_over"] if r["backend"] == "tensorrt-rtx")
    assert trt["device"] == "cuda0" and trt["artifact"].startswith("vae_decoder.tensorrt-rtx")
    assert "engine built for sm_89; device is sm_86" in trt["reason"]
    # the recorded desktop's CPU is x86-64-v3; our OpenVINO blob was compiled for this machine's ISA: where that
    # is another level (an AVX-512 machine) the blob is passed over too and the ONNX fallback runs on the CPU;
    # where this machine is x86-64-v3 too (an AVX2 one) the blob serves the desktop's CPU
    from precast.runtime.cpu import isa_level, os_cpu_flags
    here, there = isa_level(os_cpu_flags()), isa_level(os_cpu_flags(f"{MACHINES}/rtx3060-desktop"))
    assert there == "x86-64-v3"
    if here == there:
        assert vae["device"] == "cpu" and vae["backend"] == "openvino", vae
    else:
        assert any("blob compiled for" in r["reason"] for r in vae["passed_over"] if r["backend"] == "openvino")
        assert vae["device"] == "cpu" and vae["artifact"] == "onnx"


def test_matching_engine_is_chosen_for_the_gpu(bundles):
    vae = doctor(bundles["sm_86"], "rtx3060-desktop")["components"]["vae_decoder"]
    assert vae["device"] == "cuda0" and vae["backend"] == "tensorrt-rtx"
    assert vae["then"][-1]["artifact"] == "onnx"  # the CPU fallback stays in line behind it


def test_assignment_moves_a_module_to_the_cpu(bundles):
    vae = doctor(bundles["sm_86"], "rtx3060-desktop", "--backend", "vae=cpu")["components"]["vae_decoder"]
    assert vae["device"] == "cpu"
    (trt,) = [r for r in vae["passed_over"] if r["backend"] == "tensorrt-rtx"]   # there, but not on the CPU
    assert trt["reason"] == "not tried: vae is assigned to cpu (--backend)"


def test_doctor_lists_the_tensorrt_rtx_engines_it_passes_over_without_a_gpu(bundles):
    """On this machine (no NVIDIA GPU) doctor said `passed_over: []` for a bundle holding a TensorRT-RTX
    engine: it never looked at engines for devices that are not here. Now each is named with the reason,
    in the JSON and the text."""
    vae = doctor(bundles["sm_86"])["components"]["vae_decoder"]
    (trt,) = [r for r in vae["passed_over"] if r["backend"] == "tensorrt-rtx"]
    assert trt["artifact"].startswith("vae_decoder.tensorrt-rtx-sm_86") and trt["device"] is None
    assert trt["reason"] == "needs an NVIDIA GPU; none here (devices: cpu)"
    text = precast("doctor", bundles["sm_86"])
    assert f"passed over: {trt['artifact']}: needs an NVIDIA GPU; none here" in text.stdout, text.stdout


def test_strict_refuses_to_fall_back_from_the_gpu(bundles):
    """The sm_89 engine cannot serve the recorded RTX 3060 (sm_86): by default the VAE falls back to the
    CPU with the reason; with --strict doctor exits 2 naming where it had to run and why not."""
    assert doctor(bundles["sm_89"], "rtx3060-desktop", "--backend", "vae=cuda0")["components"]["vae_decoder"][
        "device"] == "cpu"
    proc = precast("doctor", bundles["sm_89"], "--sysroot", f"{MACHINES}/rtx3060-desktop", "--backend", "vae=cuda0",
                   "--strict", "--json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error = json.loads(proc.stdout)
    assert error["exit"] == 2 and error["error"].startswith(
        "vae_decoder: nothing in the bundle can run on cuda0 (--strict):"), error
    assert "engine built for sm_89; device is sm_86" in error["error"]
    assert proc.stderr.startswith("error: vae_decoder: nothing in the bundle can run on cuda0 (--strict):")
    ok = doctor(bundles["sm_86"], "rtx3060-desktop", "--backend", "vae=cuda0", "--strict")
    assert ok["components"]["vae_decoder"]["backend"] == "tensorrt-rtx" and ok["strict"] is True


def test_a_pinned_backend_runs_the_bundles_onnx_when_it_has_no_engine(bundles):
    """This bundle has no ONNX Runtime engine: `vae=cpu:onnxruntime` runs its ONNX through ONNX Runtime,
    ahead of the OpenVINO blob; --strict leaves the blob out."""
    vae = doctor(bundles["sm_86"], None, "--backend", "vae=cpu:onnxruntime")["components"]["vae_decoder"]
    assert (vae["device"], vae["backend"], vae["artifact"]) == ("cpu", "onnxruntime", "onnx")
    assert vae["then"][0]["backend"] == "openvino" and vae["then"][0]["note"].startswith(
        "fallback: nothing for cpu:onnxruntime fits")
    strict = doctor(bundles["sm_86"], None, "--backend", "vae=cpu:onnxruntime", "--strict")["components"]["vae_decoder"]
    assert strict["backend"] == "onnxruntime" and strict["then"] == []


def test_engine_that_cannot_load_here_falls_back_at_load_time(bundles):
    """The sm_86 engine passes every check on the recorded RTX 3060, but this machine has no GPU:
    loading fails, the reason is kept, and the next candidate runs."""
    m = read_manifest(bundles["sm_86"])
    devices = discover_devices(f"{MACHINES}/rtx3060-desktop", {})
    placement = assign_modules(devices)["vae"]
    sel = select_component(m, "vae_decoder", placement, devices, {"latent_sample": (1, 4, 8, 8)},
                           installed_backends())
    assert sel.choice.backend == "tensorrt-rtx"
    session, cand, reasons = load_component(sel, ["sample"])
    assert cand.backend == "openvino" and cand.device.id == "cpu"
    assert any(r["backend"] == "tensorrt-rtx" and r["device"] == "cuda0" and r["reason"].startswith("failed to load")
               for r in reasons)
    out = session.run({"latent_sample": __import__("numpy").zeros((1, 4, 8, 8), "float32")})
    assert out["sample"].shape == (1, 3, 64, 64)


def test_corrupted_artifact_is_refused(bundles, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundles["sm_89"], copy)
    blob = next(copy.rglob("model.blob"))
    flip_byte(blob, 100)
    vae = doctor(copy)["components"]["vae_decoder"]   # this machine: the blob would otherwise be chosen
    assert any("sha256 differs" in r["reason"] for r in vae["passed_over"])
    assert vae["artifact"] == "onnx" and vae["backend"] == "openvino"
    intact = doctor(bundles["sm_89"])["components"]["vae_decoder"]
    assert intact["artifact"] != "onnx"


def test_profile_that_does_not_cover_the_request(bundles):
    vae = doctor(bundles["sm_86"], "rtx3060-desktop", "--size", "128x128")["components"]["vae_decoder"]
    assert any("outside the engine's profile" in r["reason"] for r in vae["passed_over"])
    assert vae["artifact"] == "onnx"


def test_device_override_warning(bundles):
    proc = precast("doctor", "--sysroot", f"{MACHINES}/laptop-igpu-dgpu", env={"PRECAST_DEVICE": "nothing"})
    assert proc.returncode == 0 and "nothing" in proc.stderr
    report = json.loads(precast("doctor", "--json", "--sysroot", f"{MACHINES}/laptop-igpu-dgpu",
                                env={"PRECAST_DEVICE": "xpu0"}).stdout)
    assert [d["id"] for d in report["devices"]] == ["xpu0", "cuda0", "cpu"]


def test_fallback_onnx_is_hashed_only_when_it_is_loaded(bundles, tmp_path):
    """With an engine ahead of it the bundle's ONNX is not hashed at selection (a UNet's is GBs);
    if it comes to loading it, a damaged one is refused with the reason."""
    copy = tmp_path / "b"
    shutil.copytree(bundles["sm_86"], copy)
    data = next(copy.rglob("model.onnx_data"))
    flip_byte(data, 10)
    m = read_manifest(copy)
    devices = discover_devices(f"{MACHINES}/rtx3060-desktop", {})
    sel = select_component(m, "vae_decoder", assign_modules(devices)["vae"], devices,
                           {"latent_sample": (1, 4, 8, 8)}, installed_backends())
    assert sel.viable[-1].artifact is None and not any("damaged" in r["reason"] for r in sel.refused)
    only_onnx = type(sel)(sel.component, [sel.viable[-1]], list(sel.refused))
    with pytest.raises(Exception, match="the bundle's ONNX is damaged"):
        load_component(only_onnx, ["sample"])
