"""The cache's guarantees with real processes: two builders of one key build once and get the
same bytes; a builder killed with SIGKILL leaves nothing loadable; a damaged entry is evicted
and rebuilt, never loaded."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import flip_byte, precast
from precast.compiler.cache import Cache, sha256_file


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from precast.compiler.demo_model import write_demo_model
    tmp = tmp_path_factory.mktemp("cache")
    write_demo_model(str(tmp / "tiny.safetensors"))
    precast("export", tmp / "tiny.safetensors", "--out", tmp / "onnx", "--component", "unet", check=True)
    return tmp / "onnx"


def _builder(export_dir, cache, target="tensorrt-rtx:sm_86"):
    cmd = [sys.executable, "-m", "precast.compiler.cli", "compile", str(export_dir), "--target", target,
           "--component", "unet", "--height", "64", "--width", "64", "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PRECAST_CACHE": str(cache)})


def test_two_builders_of_one_key_build_once(export_dir, tmp_path):
    cache = tmp_path / "cache"
    procs = [_builder(export_dir, cache) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out)["artifacts"][0])
    assert sorted(r["cache"] for r in results) == ["hit", "miss"]
    assert results[0]["key"] == results[1]["key"] and results[0]["path"] == results[1]["path"]
    entries = Cache(cache).list()
    assert len(entries) == 1 and Cache(cache).verify(entries[0]) is None


def test_sigkill_mid_build_leaves_no_entry(export_dir, tmp_path):
    cache = tmp_path / "cache"
    p = _builder(export_dir, cache)
    deadline = time.time() + 120
    while not ((cache / "tmp").exists() and any((cache / "tmp").iterdir())):  # the build has started
        assert p.poll() is None, "builder finished before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    c = Cache(cache)
    assert c.list() == [] and not list(cache.rglob("entry.json"))
    ls = json.loads(precast("cache", "ls", "--json", env={"PRECAST_CACHE": str(cache)}, check=True).stdout)
    assert ls["entries"] == []
    again = _builder(export_dir, cache)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert json.loads(out)["artifacts"][0]["cache"] == "miss"
    gc = json.loads(precast("cache", "gc", "--json", env={"PRECAST_CACHE": str(cache)}, check=True).stdout)
    assert gc["stale_temp_folders"] == 1 and len(c.list()) == 1


def test_damaged_entry_is_evicted_and_rebuilt(export_dir, tmp_path):
    cache = tmp_path / "cache"
    env = {"PRECAST_CACHE": str(cache)}
    args = ["compile", export_dir, "--target", "onnxruntime", "--component", "unet", "--height", "64", "--width",
            "64", "--json"]
    (first,) = json.loads(precast(*args, env=env, check=True).stdout)["artifacts"]
    data = next(p for p in (cache / "entries").rglob("model.onnx_data"))
    good = sha256_file(data)
    flip_byte(data, 100)
    (second,) = json.loads(precast(*args, env=env, check=True).stdout)["artifacts"]
    assert second["cache"] == "miss" and "sha256" in second["evicted"]
    assert sha256_file(data) == good and second["key"] == first["key"]
    data.unlink()
    (third,) = json.loads(precast(*args, env=env, check=True).stdout)["artifacts"]
    assert third["cache"] == "miss" and "missing" in third["evicted"]
