"""`precast generate` / `doctor` refuse bad options before any work: one line naming the option and
the fix, exit 2, no traceback, nothing written (no PNG, no temp file)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import precast
from precast.runtime.cli import _write_image, parse_size
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
