"""Selection over a real bundle on the recorded Windows and Mac machines: `precast doctor --json --sysroot`
on a copy of each recorded tree (tests/data/machines/win-*, m2-mac) with the backends such a machine has
installed written beside it (installed_backends.json: onnxruntime-directml + tensorrt-rtx on Windows,
onnxruntime with its CoreML EP on the Mac -- declared here, not recorded), so what a user there would
see is checked end to end: the artifact and EP each component gets, what is passed over and why.
Nothing here runs on Windows or macOS: discovery, fingerprints and selection only."""
import json
import shutil

import pytest

from conftest import ROOT, build_recipe, precast
from precast.runtime.select import installed_backends

MACHINES = f"{ROOT}/tests/data/machines"
WINDOWS = ("win-rtx3060-igpu", "win-laptop-780m", "win-rx7900xtx-desktop")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """UNet + VAE decoder (64x64) with a TensorRT-RTX sm_86 engine and a DirectML artifact each."""
    return build_recipe(tmp_path_factory.mktemp("winmac"),
                        "model: {source: demo:tiny-sd15}\ncomponents: [unet, vae_decoder]\n"
                        "profiles: {batch: 1, height: 64, width: 64}\n"
                        "targets: [{tensorrt-rtx: {compute_capabilities: [sm_86]}}, directml]\n")


def recorded(tmp_path, name, driver_umd=None):
    """A copy of the recorded machine with the backends it would have installed (this machine's versions,
    so the fingerprints' version checks are about the machine, not the build host)."""
    here = installed_backends()
    tree = tmp_path / name
    shutil.copytree(f"{MACHINES}/{name}", tree)
    if name.startswith("win-"):
        backends = {"onnxruntime": here["onnxruntime"], "onnxruntime-directml": here["onnxruntime"],
                    "tensorrt-rtx": here["tensorrt-rtx"]}
    else:
        backends = {"onnxruntime": here["onnxruntime"], "onnxruntime-coreml": here["onnxruntime"]}
    (tree / "installed_backends.json").write_text(json.dumps(backends))
    if driver_umd:             # the same machine after a driver update
        dxgi = json.loads((tree / "windows/dxgi.json").read_text())
        for a in dxgi:
            if a.get("VendorId") == 0x10DE:
                a["DriverVersion"] = driver_umd
        (tree / "windows/dxgi.json").write_text(json.dumps(dxgi))
    return tree


def doctor(bundle, tree, *args):
    proc = precast("doctor", bundle, "--json", "--sysroot", tree, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def picked(report):
    return {c: (r["device"], r["backend"], r["artifact"].split("/")[0]) for c, r in report["components"].items()}


def reasons(report, component, backend):
    return [(r["device"], r["reason"]) for r in report["components"][component]["passed_over"]
            if r["backend"] == backend]


def test_the_recorded_machines_report_their_installed_backends(tmp_path):
    for name, backends in (("win-laptop-780m", {"onnxruntime", "onnxruntime-directml", "tensorrt-rtx"}),
                           ("m2-mac", {"onnxruntime", "onnxruntime-coreml"})):
        report = json.loads(precast("doctor", "--json", "--sysroot", recorded(tmp_path, name)).stdout)
        assert set(report["installed_backends"]) == backends


def test_rtx3060_with_its_recorded_driver_runs_directml(bundle, tmp_path):
    """The recorded RTX 3060 has driver 560.94; the TensorRT-RTX engine needs >= 580.65: passed over with
    that reason, and the same GPU runs the DirectML artifact (the Intel iGPU's DirectML next in line)."""
    report = doctor(bundle, recorded(tmp_path, "win-rtx3060-igpu"))
    assert picked(report) == {c: ("cuda0", "onnxruntime-directml", f"{c}.onnxruntime-directml")
                              for c in ("unet", "vae_decoder")}
    for c in ("unet", "vae_decoder"):
        assert reasons(report, c, "tensorrt-rtx") == [("cuda0", "engine needs driver >= 580.65; device has 560.94")]
        then = [(t["device"], t["backend"], t["artifact"].split("/")[0]) for t in report["components"][c]["then"]]
        assert then == [("xpu0", "onnxruntime-directml", f"{c}.onnxruntime-directml"), ("cpu", "onnxruntime", "onnx")]


def test_rtx3060_after_a_driver_update_runs_tensorrt_rtx(bundle, tmp_path):
    report = doctor(bundle, recorded(tmp_path, "win-rtx3060-igpu", driver_umd="32.0.15.8065"))   # 580.65
    assert report["devices"][0]["driver"] == "580.65"
    assert picked(report) == {c: ("cuda0", "tensorrt-rtx", f"{c}.tensorrt-rtx-sm_86") for c in ("unet", "vae_decoder")}
    assert report["components"]["unet"]["then"][0]["backend"] == "onnxruntime-directml"   # same GPU, next in line
    pinned = doctor(bundle, recorded(tmp_path / "pin", "win-rtx3060-igpu", driver_umd="32.0.15.8065"),
                    "--backend", "directml")
    assert picked(pinned)["unet"] == ("cuda0", "onnxruntime-directml", "unet.onnxruntime-directml")


@pytest.mark.parametrize("name, gpus", [("win-laptop-780m", ["rocm0"]),
                                        ("win-rx7900xtx-desktop", ["rocm0", "rocm1"])])
def test_amd_windows_runs_directml_and_says_why_not_tensorrt_rtx(bundle, tmp_path, name, gpus):
    report = doctor(bundle, recorded(tmp_path, name))
    assert picked(report) == {c: ("rocm0", "onnxruntime-directml", f"{c}.onnxruntime-directml")
                              for c in ("unet", "vae_decoder")}
    devices = ", ".join(gpus + ["cpu"])
    for c in ("unet", "vae_decoder"):
        assert reasons(report, c, "tensorrt-rtx") == [(None, f"needs an NVIDIA GPU; none here (devices: {devices})")]
        assert [t["device"] for t in report["components"][c]["then"]] == gpus[1:] + ["cpu"]
    assert not any("coreml" in json.dumps(r) for r in report["components"].values())   # never offered on Windows


def test_m2_mac_runs_the_onnx_through_coreml_and_says_why_not_the_rest(bundle, tmp_path):
    report = doctor(bundle, recorded(tmp_path, "m2-mac"))
    for c in ("unet", "vae_decoder"):
        r = report["components"][c]
        assert (r["device"], r["backend"], r["artifact"]) == ("mps0", "onnxruntime-coreml", "onnx")
        assert r["note"] == "the bundle's ONNX through onnxruntime-coreml (compiled by the EP at load time)"
        assert reasons(report, c, "onnxruntime-directml") == [
            (None, "needs a Direct3D 12 GPU (Windows); none here (devices: mps0, cpu)")]
        assert reasons(report, c, "tensorrt-rtx") == [(None, "needs an NVIDIA GPU; none here (devices: mps0, cpu)")]
        assert [(t["device"], t["backend"]) for t in r["then"]] == [("cpu", "onnxruntime")]


def test_backends_another_os_has_are_refused_at_assignment(bundle, tmp_path):
    """--backend directml on the Mac and --backend coreml on Windows: the assignment falls back, says why,
    and the selection still picks what the machine runs."""
    mac = doctor(bundle, recorded(tmp_path, "m2-mac"), "--backend", "directml")
    assert "onnxruntime-directml" in mac["assignment"]["diffusion"]["fallback"]
    assert picked(mac)["unet"] == ("mps0", "onnxruntime-coreml", "onnx")
    win = doctor(bundle, recorded(tmp_path, "win-rx7900xtx-desktop"), "--backend", "coreml")
    assert "onnxruntime-coreml" in win["assignment"]["diffusion"]["fallback"]
    assert picked(win)["unet"] == ("rocm0", "onnxruntime-directml", "unet.onnxruntime-directml")


def test_doctor_text_on_a_recorded_windows_machine(bundle, tmp_path):
    out = precast("doctor", bundle, "--sysroot", recorded(tmp_path, "win-laptop-780m")).stdout
    assert "onnxruntime-directml" in out and "needs an NVIDIA GPU; none here" in out, out


def test_installed_backends_on_windows_with_only_the_directml_wheel(monkeypatch):
    """The DirectML wheel replaces onnxruntime on Windows and carries the CPU EP: both are reported,
    so the CPU fallback through ONNX Runtime stays offered."""
    import importlib.metadata
    import platform
    have = {"onnxruntime-directml": "1.22.0"}

    def version(dist):
        if dist not in have:
            raise importlib.metadata.PackageNotFoundError(dist)
        return have[dist]
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    assert installed_backends() == {"onnxruntime": "1.22.0", "onnxruntime-directml": "1.22.0"}
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert installed_backends() == {"onnxruntime": "1.22.0"}


def test_coreml_compiles_once_into_the_users_cache(bundle, tmp_path, monkeypatch):
    """The bundle's ONNX through the CoreML EP gets a ModelCacheDirectory keyed by the ONNX files' sha256s
    and the onnxruntime version (the EP does not notice a changed model by itself); the session is stubbed
    (no macOS here): what it is opened with is checked."""
    from precast.runtime import sessions
    from precast.runtime.assign import assign_modules
    from precast.runtime.devices import discover_devices
    from precast.runtime.manifest import read_manifest
    from precast.runtime.select import load_component, select_component
    monkeypatch.setenv("PRECAST_CACHE", str(tmp_path / "cache"))
    devices = discover_devices(f"{MACHINES}/m2-mac", {})
    m = read_manifest(bundle)
    sel = select_component(m, "vae_decoder", assign_modules(devices)["vae"], devices, {},
                           {"onnxruntime": "1.22.0", "onnxruntime-coreml": "1.22.0"})
    cache = sel.choice.ep_cache
    assert sel.choice.backend == "onnxruntime-coreml" and cache.startswith(str(tmp_path / "cache" / "coreml"))
    assert cache.endswith("-ort1.22.0")
    opened = {}
    monkeypatch.setattr(sessions, "OnnxRuntimeSession", lambda path, **kw: opened.update(kw, path=path) or "session")
    session, cand, _ = load_component(sel, ["sample"])
    assert session == "session" and opened["provider"] == "onnxruntime-coreml" and opened["cache_dir"] == cache
    assert (tmp_path / "cache" / "coreml").is_dir()
    other = select_component(m, "unet", assign_modules(devices)["diffusion"], devices, {},
                             {"onnxruntime": "1.22.0", "onnxruntime-coreml": "1.22.0"})
    assert other.choice.ep_cache != cache
