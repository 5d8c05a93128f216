"""Progress as a user sees it without a terminal (a CI log): plain lines on stderr every
PRECAST_PROGRESS_INTERVAL seconds and one at the end, nothing for a step under the threshold,
nothing at all with PRECAST_PROGRESS=off, and stdout left to the JSON report."""
import json
import re
import time

import pytest

from conftest import precast

FAST = {"PRECAST_PROGRESS_INTERVAL": "0.05"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from precast.compiler.demo_model import write_demo_model
    tmp = tmp_path_factory.mktemp("progress")
    write_demo_model(str(tmp / "tiny.safetensors"))
    return tmp


def test_compile_without_a_tty_prints_plain_heartbeats_and_clean_json(tiny, tmp_path):
    env = {**FAST, "PRECAST_CACHE": str(tmp_path / "cache")}
    exp = precast("export", tiny / "tiny.safetensors", "--out", tmp_path / "onnx", "--component", "vae_decoder",
                  "--json", env=env)
    assert exp.returncode == 0, exp.stderr
    assert json.loads(exp.stdout)["components"][0]["name"] == "vae_decoder"      # stdout: the report only
    assert all(line.startswith("export: ") for line in exp.stderr.splitlines()), exp.stderr
    proc = precast("compile", tmp_path / "onnx", "--target", "openvino", "--target", "tensorrt-rtx:sm_86",
                   "--height", "64", "--width", "64", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [(a["backend"], a["cache"]) for a in report["artifacts"]] == [("openvino", "miss"), ("tensorrt-rtx", "miss")]
    lines = proc.stderr.splitlines()
    for what in ("compile vae_decoder for openvino", "compile vae_decoder for tensorrt-rtx:sm_86"):
        ticks = [ln for ln in lines if ln.startswith(what) and ln.endswith(" s...")]
        assert ticks and all(re.fullmatch(re.escape(what) + r"( \(.+\))?: \d+\.\d s\.\.\.", ln) for ln in ticks), lines
        assert re.fullmatch(re.escape(what) + r": done in \d+\.\d s", [ln for ln in lines if ln.startswith(what)][-1])
    assert "\r" not in proc.stderr and "Traceback" not in proc.stderr


def test_progress_off_and_cache_hits_print_nothing(tiny, tmp_path):
    env = {**FAST, "PRECAST_CACHE": str(tmp_path / "cache"), "PRECAST_PROGRESS": "off"}
    precast("export", tiny / "tiny.safetensors", "--out", tmp_path / "onnx", "--component", "vae_decoder",
            env=env, check=True)
    args = ("compile", tmp_path / "onnx", "--target", "openvino", "--height", "64", "--width", "64", "--json")
    proc = precast(*args, env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    hit = precast(*args, env={**env, "PRECAST_PROGRESS": "", "PRECAST_PROGRESS_INTERVAL": "10"})
    assert hit.returncode == 0 and hit.stderr == "", hit.stderr      # a hit well under a second: silent


def test_bar_lines_and_the_end_line(monkeypatch, capsys):
    from precast.runtime.progress import bar
    monkeypatch.setenv("PRECAST_PROGRESS_INTERVAL", "0.05")
    with bar(3_400_000_000, "export", unit="B") as b:
        b.update(1_200_000_000)
        time.sleep(0.2)
        b.update(2_200_000_000)
    err = capsys.readouterr()
    assert err.out == ""
    lines = err.err.splitlines()
    assert re.fullmatch(r"export: 1\.2/3\.4 GB \(35%\), \d+\.\d s", lines[0]), lines
    assert re.fullmatch(r"export: 3\.4/3\.4 GB \(100%\), \d+\.\d s \(done\)", lines[-1]), lines


def test_denoise_loop_progress_without_tqdm_on_a_pipe(monkeypatch, capsys):
    from precast.runtime.loading import _progress
    monkeypatch.setenv("PRECAST_PROGRESS_INTERVAL", "0.05")
    b = _progress(4, True)
    for _ in range(4):
        time.sleep(0.05)
        b.update(1)
    b.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines and re.fullmatch(r"denoise: 4/4 steps \(100%\), \d+\.\d s \(done\)", lines[-1]), lines
    _progress(4, False).close()                         # disabled: nothing
    assert capsys.readouterr().err == ""


def test_heartbeat_is_silent_under_a_second_and_beats_after(monkeypatch, capsys):
    from precast.runtime.progress import heartbeat
    monkeypatch.delenv("PRECAST_PROGRESS_INTERVAL", raising=False)
    with heartbeat("compile unet for openvino"):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""                 # default: 10 s lines, nothing under 1 s
    monkeypatch.setenv("PRECAST_PROGRESS_INTERVAL", "0.05")
    with heartbeat("compile unet for openvino") as beat:
        beat.note = "Building engine"
        time.sleep(0.2)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"compile unet for openvino \(Building engine\): \d+\.\d s\.\.\.", lines[0]), lines
    assert re.fullmatch(r"compile unet for openvino: done in \d+\.\d s", lines[-1]), lines
    with pytest.raises(RuntimeError):                    # a failed step: no "done" line
        with heartbeat("compile unet for openvino"):
            time.sleep(0.07)
            raise RuntimeError("boom")
    assert "done" not in capsys.readouterr().err
