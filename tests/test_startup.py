"""Start-up (issue "Start fast"): components verified and loaded side by side, the VAE decoder left
loading while the prompt is encoded and denoised, and the seconds of every stage in `doctor --json`
and `generate --json`. Fallbacks stay per component and reports stay in the same order whatever
order the loader threads finish in."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import flip_byte, precast

NEEDED = ["text_encoder", "unet", "vae_decoder"]


@pytest.fixture
def bundle(tiny_bundle):
    return tiny_bundle[0]


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and value >= 0


def _artifact_file(bundle, component: str, backend: str):
    manifest = json.loads((bundle / "manifest.json").read_text())
    art = next(a for a in manifest["artifacts"] if a["component"] == component and a["backend"] == backend)
    return art["id"], bundle / art["entry"]


def test_generate_json_reports_every_stage(bundle, tmp_path):
    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "2", "--out", tmp_path / "x.png", "--json")
    assert proc.returncode == 0, proc.stderr
    seconds = json.loads(proc.stdout)["seconds"]
    stages = seconds["stages"]
    for key in ("manifest", "discover", "assign", "backends", "tokenizers", "select", "ready", "open"):
        assert _seconds(stages[key]), (key, stages)
    for key in ("verify", "load"):
        assert list(stages[key]) == NEEDED and all(_seconds(v) for v in stages[key].values()), stages
    assert stages["ready"] <= stages["open"] + 1e-3
    assert set(seconds["run"]) == {"encode", "first_step", "denoise", "wait_vae", "decode"}
    assert all(_seconds(v) for v in seconds["run"].values()), seconds["run"]
    assert seconds["run"]["first_step"] <= seconds["run"]["denoise"]


def test_doctor_json_reports_stages_and_with_load_the_loads(bundle):
    plain = json.loads(precast("doctor", bundle, "--json").stdout)
    stages = plain["stages"]
    assert list(stages) == ["manifest", "discover", "assign", "backends", "select", "verify", "load", "open", "total"]
    assert all(_seconds(stages[k]) for k in ("manifest", "discover", "assign", "backends", "select", "verify", "total"))
    assert stages["load"] is None and stages["open"] is None and plain["loaded"] is None

    loaded = json.loads(precast("doctor", bundle, "--json", "--load").stdout)
    assert list(loaded["stages"]["load"]) == NEEDED and all(_seconds(v) for v in loaded["stages"]["load"].values())
    assert _seconds(loaded["stages"]["open"])
    assert list(loaded["loaded"]) == NEEDED
    for comp in NEEDED:   # what loaded is what selection chose
        assert loaded["loaded"][comp]["artifact"] == loaded["components"][comp]["artifact"]

    no_bundle = json.loads(precast("doctor", "--json").stdout)["stages"]
    assert list(no_bundle) == list(stages) and no_bundle["select"] is None and _seconds(no_bundle["discover"])
    proc = precast("doctor", "--load")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --load: loads a bundle's engines; give the BUNDLE too"]


def test_a_damaged_engine_falls_back_with_its_reason_while_the_others_load_in_parallel(bundle, tmp_path):
    """The UNet's OpenVINO blob changed: the UNet falls back to ONNX Runtime (checked in its own
    loader thread), the other components keep their engines, and the report is in the same order
    with the same content on every run."""
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    art_id, blob = _artifact_file(copy, "unet", "openvino")
    flip_byte(blob, blob.stat().st_size // 2)
    reports = []
    for i in range(2):
        proc = precast("generate", copy, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / f"{i}.png", "--json")
        assert proc.returncode == 0, proc.stderr
        reports.append(json.loads(proc.stdout))
    components = reports[0]["components"]
    assert list(components) == NEEDED
    assert components["unet"]["backend"] == "onnxruntime"
    assert any(r["artifact"] == art_id and "sha256 differs" in r["reason"] for r in components["unet"]["passed_over"])
    assert components["text_encoder"]["backend"] == components["vae_decoder"]["backend"] == "openvino"
    assert reports[1]["components"] == components
    assert list(reports[1]["seconds"]["stages"]["load"]) == NEEDED


def test_a_vae_decoder_that_cannot_load_is_one_error_not_a_traceback(bundle, tmp_path):
    """The VAE decoder loads in the background; when nothing of it can run, generate still exits 2
    with the component's own message and writes no image."""
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for rel in manifest["components"]["vae_decoder"]["files"] + [
            f for a in manifest["artifacts"] if a["component"] == "vae_decoder" for f in a["files"]]:
        flip_byte(copy / rel, 10)
    out = tmp_path / "x.png"
    proc = precast("generate", copy, "--prompt", "a cat", "--steps", "2", "--out", out)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: vae_decoder: nothing in the bundle can run here"), proc.stderr
    assert not out.exists()


def test_lazy_and_eager_open_give_the_same_image_and_report(bundle):
    from precast.runtime.families.sd import Txt2Img
    lazy = Txt2Img(bundle, width=64, height=64)
    eager = Txt2Img(bundle, width=64, height=64, lazy=False)
    assert eager.stages["open"] is not None and set(eager.loaded) == set(NEEDED)
    a = lazy("a cat", steps=2, progress=False)
    b = eager("a cat", steps=2, progress=False)
    assert (a == b).all()
    assert lazy.report()["components"] == eager.report()["components"]
    assert lazy.stages["open"] is not None and lazy.stages["ready"] <= lazy.stages["open"] + 1e-3
