"""`precast generate` / `doctor` refuse bad options before any work: one line naming the option and
the fix, exit 2, no traceback, nothing written (no PNG, no temp file)."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import precast
from precast.runtime.checks import write_image as _write_image
from precast.runtime.image_size import parse_size
from precast.runtime.errors import UserError
from precast.runtime.manifest import read_manifest


@pytest.fixture
def bundle(tiny_bundle):
    return tiny_bundle[0]


def _one_error_line(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(w in line for w in words), line


@pytest.mark.parametrize("args, words", [
    (["--size", "²x64"], ["--size '²x64'", "WIDTHxHEIGHT"]),
    (["--size", "100000x100000"], ["--size 100000x100000", "8 to 4096 px"]),
    (["--size", "4104x512"], ["4096 px"]),
    (["--size", "0x64"], ["--size 0x64"]),
    (["--size", "63x64"], ["multiples of 8"]),
    (["--backend", "unet=gpu²"], ["unknown device 'gpu²'"]),
    (["--params-backend", "gpu²"], ["unknown device 'gpu²'"]),
    (["--seed", "-1"], ["--seed -1", "0 or more"]),
    (["--guidance", "nan"], ["--guidance nan", "finite"]),
    (["--guidance", "inf"], ["--guidance inf", "finite"]),
])
def test_generate_refuses_bad_options_before_work(bundle, tmp_path, args, words):
    proc = precast("generate", bundle, "--prompt", "x", "--steps", "1", "--out", tmp_path / "x.png", *args)
    _one_error_line(proc, *words)
    assert os.listdir(tmp_path) == []


def test_prompt_that_is_not_utf8_is_one_line(bundle, tmp_path):
    for option in ("--prompt", "--negative"):
        cmd = [sys.executable, "-m", "precast.runtime.cli", "generate", str(bundle), "--prompt", "cat", option,
               b"caf\xff", "--steps", "1", "--size", "64x64", "--out", str(tmp_path / "x.png")]
        _one_error_line(subprocess.run(cmd, capture_output=True, text=True), option, "UTF-8")
    assert os.listdir(tmp_path) == []


def test_out_that_is_a_folder_or_has_no_folder_leaves_nothing(bundle, tmp_path):
    (tmp_path / "dir").mkdir()
    proc = precast("generate", bundle, "--prompt", "x", "--steps", "1", "--size", "64x64", "--out", tmp_path / "dir")
    _one_error_line(proc, f"--out {tmp_path / 'dir'}", "is a folder")
    proc = precast("generate", bundle, "--prompt", "x", "--steps", "1", "--size", "64x64",
                   "--out", tmp_path / "nope" / "x.png")
    _one_error_line(proc, "does not exist")
    assert sorted(os.listdir(tmp_path)) == ["dir"] and os.listdir(tmp_path / "dir") == []


def test_generate_writes_only_the_png(bundle, tmp_path):
    proc = precast("generate", bundle, "--prompt", "x", "--steps", "1", "--size", "64x64", "--out", tmp_path / "a.png")
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path) == ["a.png"] and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("fail", ["write", "replace"])
def test_a_failed_png_write_leaves_no_temp_file(tmp_path, monkeypatch, fail):
    """An OSError part-way through (the disk fills while the temp file is written, or the rename
    fails after it was written) is one user error, and the temp file is gone."""
    from precast.runtime import png

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    if fail == "replace":
        monkeypatch.setattr(png.os, "replace", full)
    else:
        class Half:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[:10])
                self.f.flush()
                full()
        monkeypatch.setattr(png, "open", lambda p, mode: Half(open(p, mode)), raising=False)
    with pytest.raises(UserError, match=r"--out .*x.png: cannot write \(No space left on device\)"):
        _write_image(tmp_path / "x.png", np.zeros((4, 4, 3), np.uint8))
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):                       # write_png itself removes its temp file
        png.write_png(tmp_path / "y.png", np.zeros((4, 4, 3), np.uint8))
    assert os.listdir(tmp_path) == []


def test_doctor_parses_sizes_as_generate_does(bundle):
    for size, words in (("63x64", ["multiples of 8"]), ("²x64", ["WIDTHxHEIGHT"]), ("9000x64", ["4096 px"])):
        _one_error_line(precast("doctor", bundle, "--size", size), f"--size", *words)
    for args in (["--backend", "unet=gpu²"], ["--params-backend", "gpu²"]):
        _one_error_line(precast("doctor", bundle, *args), "unknown device 'gpu²'")


def test_sizes_the_unet_graph_will_serve_are_not_refused(bundle):
    """Multiples of 8 that are not multiples of the UNet's downsampling (72, 8) are the graph's to serve."""
    m = read_manifest(bundle)
    assert parse_size("72x72", m) == (72, 72) and parse_size("8x8", m) == (8, 8)
    assert parse_size("4096X512", m) == (4096, 512)
    m.components["unet"]["profiles"][0]["width"] = [64, 64, 8192]     # a bundle built for more
    assert parse_size("8192x64", m) == (8192, 64)
    with pytest.raises(UserError, match="8 to 8192 px"):
        parse_size("8200x64", m)


def test_out_that_is_a_device_or_pipe_is_not_replaced(bundle, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out in (fifo, tmp_path / "dangling"):
        proc = precast("generate", bundle, "--prompt", "x", "--steps", "1", "--size", "64x64", "--out", out)
        _one_error_line(proc, f"--out {out}", "not a regular file")
    assert fifo.is_fifo() and (tmp_path / "dangling").is_symlink()


@pytest.mark.parametrize("steps", ["0", "1001", "100000000000000000000"])
def test_steps_out_of_range_are_refused_before_loading(bundle, tmp_path, steps):
    proc = precast("generate", bundle, "--prompt", "x", "--steps", steps, "--size", "64x64", "--out", tmp_path / "x.png")
    _one_error_line(proc, f"--steps {steps}", "1 to 1000")
    assert os.listdir(tmp_path) == []


# ---- every option checked before anything is loaded -----------------------------------------------

@pytest.fixture
def hollow(bundle, tmp_path):
    """The tiny bundle's manifest alone: any tokenizer, engine or ONNX read would fail ('missing')."""
    folder = tmp_path / "hollow"
    folder.mkdir()
    (folder / "manifest.json").write_bytes((bundle / "manifest.json").read_bytes())
    return folder


@pytest.mark.parametrize("args, words", [
    (["--scheduler", "ddim9"], ["'--scheduler': 'ddim9' is not one of 'euler', 'euler-a', 'heun'"]),
    (["--scheduler", "flow-euler"], ["--scheduler flow-euler", "take euler, euler-a, heun"]),
    (["--backend", "unet=tpu0"], ["--backend unet=tpu0: unknown device 'tpu0'"]),
    (["--backend", "te=cpu:tensorrt-rtx"], ["--backend te=cpu:tensorrt-rtx: tensorrt-rtx does not run on cpu"]),
    (["--backend", "=cpu"], ["--backend: invalid backend assignment '=cpu'"]),
    (["--params-backend", "weights=cpu"], ["--params-backend: unknown backend module 'weights'"]),
    (["--size", "63x64"], ["--size 63x64", "multiples of 8"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--steps", "0"], ["--steps 0"]),
    (["--guidance", "nan"], ["--guidance nan"]),
    (["--steps", "two"], ["'--steps': 'two' is not a valid integer"]),
])
def test_bad_values_are_refused_before_anything_is_loaded(hollow, tmp_path, args, words):
    """--scheduler was free text checked after every engine had loaded (1.4 s and 255 MB on the tiny model,
    minutes at full size). Now each option is checked first: against a bundle with nothing but its
    manifest, the error names the option, not a file the load would have missed."""
    proc = precast("generate", hollow, "--prompt", "x", "--out", tmp_path / "x.png", *args)
    _one_error_line(proc, *words)
    assert "missing" not in proc.stderr and not (tmp_path / "x.png").exists()


def test_the_hollow_bundle_would_fail_at_load(hollow, tmp_path):
    """The control for the test above: with every option good, the missing files are what fails."""
    proc = precast("generate", hollow, "--prompt", "x", "--steps", "1", "--out", tmp_path / "x.png")
    _one_error_line(proc, "tokenizer/vocab.json: missing")


def test_without_size_generate_and_doctor_use_the_bundles_optimal_size(bundle, tmp_path):
    """`generate` defaulted to 512x512 (the tiny bundle's engines are built for 64x64, so it silently fell
    back to the ONNX) while `doctor` used the profile. Both now use the denoiser profile's opt."""
    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / "x.png", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["size"] == "64x64"
    assert all(c["artifact"] != "onnx" for c in report["components"].values()), report["components"]
    assert json.loads(precast("doctor", bundle, "--json").stdout)["size"] == "64x64"
    assert struct.unpack(">II", (tmp_path / "x.png").read_bytes()[16:24]) == (64, 64)    # the PNG's IHDR


# ---- one JSON schema for doctor and generate; errors as JSON with --json -----------------------------

COMPONENT_KEYS = {"module", "component", "device", "device_name", "backend", "artifact", "how", "note", "passed_over"}
PASSED_KEYS = {"artifact", "backend", "device", "reason"}


def test_doctor_and_generate_describe_components_with_the_same_keys(bundle, tmp_path):
    out = tmp_path / "x.png"
    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "2", "--seed", "3", "--out", out,
                   "--backend", "unet=gpu", "--sysroot", tmp_path, "--json")   # an empty sysroot: a CPU-only machine
    assert proc.returncode == 0, proc.stderr
    gen = json.loads(proc.stdout)
    assert {k: gen[k] for k in ("size", "steps", "seed", "scheduler", "guidance", "out", "strict")} == {
        "size": "64x64", "steps": 2, "seed": 3, "scheduler": "euler", "guidance": 7.5, "out": str(out), "strict": False}
    assert set(gen["seconds"]) == {"check", "load", "generate", "total", "stages", "run"}
    proc = precast("doctor", bundle, "--backend", "unet=gpu", "--sysroot", tmp_path, "--json")
    doc = json.loads(proc.stdout)
    shared = {"devices", "device_warning", "installed_backends", "assignment", "components", "bundle", "size",
              "strict"}
    assert shared <= set(gen) and shared <= set(doc)
    assert gen["assignment"] == doc["assignment"]
    assert doc["assignment"]["diffusion"]["asked"] == "gpu" and doc["assignment"]["diffusion"]["device"] == "cpu"
    for report in (gen, doc):
        for name, comp in report["components"].items():
            assert COMPONENT_KEYS <= set(comp) and all(set(r) == PASSED_KEYS for r in comp["passed_over"]), comp
    assert set(doc["components"]["unet"]) - set(gen["components"]["unet"]) == {"then"}
    for report in (gen, doc):   # the GPU asked for is not here: the fallback and its reason, in both
        first = report["components"]["unet"]["passed_over"][0]
        assert first["artifact"] is None and first["reason"].startswith("--backend unet=gpu: device 'gpu': this "
                                                                        "machine has no GPU"), first


@pytest.mark.parametrize("command", ["doctor", "generate"])
def test_errors_are_json_with_json(tmp_path, command):
    extra = ["--prompt", "x", "--out", tmp_path / "x.png"] if command == "generate" else []
    for target, words in ((tmp_path / "nope", "not a precast bundle: the path does not exist"),
                          (__file__, "not a precast bundle: it is a file, not a folder"),
                          (tmp_path, "not a precast bundle (no manifest.json)")):
        proc = precast(command, target, *extra, "--json")
        _one_error_line(proc, f"{target}: {words}")
        assert json.loads(proc.stdout) == {"error": proc.stderr.strip()[len("error: "):], "exit": 2}
    proc = precast(command, tmp_path, *extra, "--backend", "te=", "--json")
    assert proc.returncode == 2 and json.loads(proc.stdout)["exit"] == 2
    if command == "generate":     # a click usage error too
        proc = precast("generate", tmp_path, *extra, "--scheduler", "ddim9", "--json")
        _one_error_line(proc, "'ddim9' is not one of")
        assert json.loads(proc.stdout)["error"].startswith("Invalid value for '--scheduler'")


# ---- --backend forms the README promises, on a real bundle ---------------------------------------------

@pytest.mark.parametrize("backend, want", [
    ("all=openvino", {"text_encoder": "openvino", "unet": "openvino", "vae_decoder": "openvino"}),
    ("unet=onnxruntime", {"text_encoder": "openvino", "unet": "onnxruntime", "vae_decoder": "openvino"}),
    ("te=cpu:onnxruntime", {"text_encoder": "onnxruntime", "unet": "openvino", "vae_decoder": "openvino"}),
    ("onnxruntime", {"text_encoder": "onnxruntime", "unet": "onnxruntime", "vae_decoder": "onnxruntime"}),
    ("vae=cpu:ort,te=OpenVINO,unet=cpu", {"text_encoder": "openvino", "unet": "openvino", "vae_decoder": "onnxruntime"}),
])
def test_backend_names_and_device_backend_pins(bundle, backend, want):
    """`all=openvino` said 'no intel GPU here', `unet=onnxruntime` 'unknown device'."""
    proc = precast("doctor", bundle, "--backend", backend, "--json")
    assert proc.returncode == 0, proc.stderr
    comps = json.loads(proc.stdout)["components"]
    assert {c: v["backend"] for c, v in comps.items()} == want
    assert all(v["device"] == "cpu" and v["artifact"] != "onnx" for v in comps.values())


def test_generate_runs_on_the_backend_pinned(bundle, tmp_path):
    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / "x.png",
                   "--backend", "all=onnxruntime", "--strict", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {v["backend"] for v in report["components"].values()} == {"onnxruntime"}
    assert report["strict"] is True


@pytest.mark.parametrize("backend, words", [
    ("unet=gpu", "device 'gpu': this machine has no GPU"),
    ("unet=cuda0", "device 'cuda0': not here"),
    ("unet=tensorrt-rtx", "tensorrt-rtx runs on an NVIDIA GPU and there is none here"),
])
def test_a_gpu_that_is_not_here_falls_back_unless_strict(bundle, tmp_path, backend, words):
    """On a machine with only a CPU (an empty recorded tree): the module falls back to the CPU with the
    reason, as for a missing engine; --strict refuses instead, exit 2, naming the value."""
    args = ("doctor", bundle, "--backend", backend, "--sysroot", tmp_path)
    proc = precast(*args)
    assert proc.returncode == 0, proc.stderr
    assert f"passed over: --backend {backend}: {words}" in proc.stdout, proc.stdout
    assert "(fell back: --backend " in proc.stdout
    _one_error_line(precast(*args, "--strict"), f"--backend {backend}: {words}", "--strict")
    out = tmp_path / "x.png"
    _one_error_line(precast("generate", bundle, "--prompt", "x", "--out", out, "--backend", backend, "--sysroot",
                            tmp_path, "--strict"), f"--backend {backend}: {words}")
    assert not out.exists()
