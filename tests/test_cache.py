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


def _compile_unet(export_dir, env):
    args = ["compile", export_dir, "--target", "onnxruntime", "--component", "unet", "--height", "64", "--width",
            "64", "--json"]
    proc = precast(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    (record,) = json.loads(proc.stdout)["artifacts"]
    return record


@pytest.mark.parametrize("sub", ["", "below"])
def test_cache_folder_that_is_a_file_is_one_clear_error(export_dir, tmp_path, sub):
    (tmp_path / "afile").write_text("not a folder")
    env = {"PRECAST_CACHE": str(tmp_path / "afile" / sub) if sub else str(tmp_path / "afile")}
    for args in (["cache", "ls"], ["cache", "gc"],
                 ["compile", export_dir, "--target", "onnxruntime", "--component", "unet"]):
        proc = precast(*args, env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert f"PRECAST_CACHE={env['PRECAST_CACHE']}" in line and "not a folder" in line


DAMAGES = {"not an object": "[1]", "files as a list": None, "garbled JSON": '{"key": "ab", "files": {'}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_entry_json_is_shown_evicted_and_collected(export_dir, tmp_path, damage):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    first = _compile_unet(export_dir, env)
    entry_json = next((tmp_path / "cache" / "entries").rglob("entry.json"))
    good = json.loads(entry_json.read_text())

    def spoil():
        if DAMAGES[damage] is None:
            entry_json.write_text(json.dumps({**good, "files": list(good["files"])}))
        else:
            entry_json.write_text(DAMAGES[damage])

    spoil()
    ls = precast("cache", "ls", env=env)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr
    assert f"{first['key'][:12]}  DAMAGED: entry.json" in ls.stdout and "1 entry," in ls.stdout
    (listed,) = json.loads(precast("cache", "ls", "--json", env=env, check=True).stdout)["entries"]
    assert listed["damaged"]
    show = precast("cache", "show", first["key"][:12], env=env)
    assert show.returncode == 0 and "verified  entry.json" in show.stdout
    second = _compile_unet(export_dir, env)            # evicted and rebuilt
    assert second["cache"] == "miss" and "entry.json" in second["evicted"]
    (rebuilt,) = Cache(tmp_path / "cache").list()
    assert second["key"] == first["key"] and rebuilt.damaged is None and Cache(tmp_path / "cache").verify(rebuilt) is None
    spoil()
    gc = json.loads(precast("cache", "gc", "--json", env=env, check=True).stdout)
    assert gc["removed"] == [first["key"]] and not entry_json.parent.exists()


@pytest.mark.parametrize("size", ["inf", "1e400", "-5G", "nan", "²G", "9" * 5000])
def test_gc_refuses_sizes_that_are_not_finite_and_non_negative(export_dir, tmp_path, size):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    _compile_unet(export_dir, env)
    proc = precast("cache", "gc", "--max-size", size, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: --max-size") and "non-negative size like" in proc.stderr
    assert len(Cache(tmp_path / "cache").list()) == 1        # nothing removed


def test_gc_max_size_units(tmp_path):
    from precast.compiler.cache import parse_size
    assert [parse_size(t) for t in ("0", "10", "5KB", "1.5g", "20G", "2T")] == [0, 10, 5 << 10, 3 << 29, 20 << 30, 2 << 40]


def test_closed_stdout_ends_quietly(tmp_path):
    """`precast cache ls | head -1`: the reader is gone before precast writes; no BrokenPipeError trace."""
    for args in (["cache", "ls"], ["cache", "ls", "--json"]):
        p = subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PRECAST_CACHE": str(tmp_path)})
        p.stdout.close()                      # the pipe's reader exits before precast has started
        err = p.stderr.read()
        assert p.wait(timeout=60) == 141 and err == "", err


def _export_entry(cache_root):
    """A cache entry as `precast build` leaves for a component's ONNX export (kind: export)."""
    def build(folder):
        (folder / "model.onnx").write_bytes(b"graph")
        return {"kind": "export", "component": "unet", "dtype": "fp16", "family": "sd1", "entry": "model.onnx"}
    entry, hit, _ = Cache(cache_root).get_or_build("ab" * 32, build, progress=False)
    return entry


def test_ls_names_the_stage_of_export_entries(export_dir, tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    _export_entry(tmp_path / "cache")
    engine = _compile_unet(export_dir, env)
    ls = precast("cache", "ls", env=env, check=True)
    rows = {line.split()[0]: line.split() for line in ls.stdout.splitlines()[:-1]}
    assert rows["ab" * 6][1:3] == ["unet", "export"] and "?" not in ls.stdout
    assert rows[engine["key"][:12]][1:3] == ["unet", "onnxruntime"]
    listed = json.loads(precast("cache", "ls", "--json", env=env, check=True).stdout)["entries"]
    assert sorted((e["stage"], e["component"]) for e in listed) == [("export", "unet"), ("onnxruntime", "unet")]
    show = json.loads(precast("cache", "show", "abab", "--json", env=env, check=True).stdout)
    assert show["stage"] == "export" and show["verified"] is True


def test_gc_without_max_size_says_its_default_and_keeps_verified_entries(export_dir, tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    _export_entry(tmp_path / "cache")
    (tmp_path / "cache" / "tmp" / "dead-999999999-x").mkdir(parents=True)     # a killed builder's folder
    stale_lock = tmp_path / "cache" / "locks" / ("0" * 64 + ".lock")           # an entry that is gone
    stale_lock.parent.mkdir(parents=True, exist_ok=True)
    stale_lock.touch()
    os.utime(stale_lock, (0, 0))
    gc = precast("cache", "gc", env=env, check=True)
    (line,) = gc.stdout.splitlines()
    assert line == ("removed 0 damaged entries, 1 stale temp folder, 1 stale lock file; no size limit (the default; "
                    "--max-size 20G also removes least recently used entries); 1 entry, 0.0 MB left"), line
    assert not stale_lock.exists()
    result = json.loads(precast("cache", "gc", "--json", env=env, check=True).stdout)
    assert result["max_size"] is None and result["removed"] == [] and result["entries"] == 1
    gc = precast("cache", "gc", "--max-size", "0", env=env, check=True)
    assert "1 least recently used to stay under --max-size 0; 0 entries" in gc.stdout, gc.stdout


def test_every_cache_command_has_help():
    from click.testing import CliRunner

    from precast.compiler.cli import main
    listing = CliRunner().invoke(main, ["cache", "--help"]).output
    assert "PRECAST_CACHE" in listing
    for name in ("ls", "show", "rm", "gc"):
        row = next(line for line in listing.splitlines() if line.strip().startswith(name + " "))
        assert len(row.split(None, 1)[1]) > 10, row
        text = CliRunner().invoke(main, ["cache", name, "--help"]).output
        assert "--json" in text and "Print" in text
    assert "Default: no size limit" in " ".join(CliRunner().invoke(main, ["cache", "gc", "--help"]).output.split())
