"""Windows file behaviour, simulated here (runtime/fileops.py with WINDOWS set, os.replace / os.rename made
to fail as Windows' do): renames retried while another process holds a file open, then one clear line;
a folder renamed onto an empty --out; an interrupted bundle swap put back; a liveness check that sends
no signal; bundle archives refused when a member is a Windows device name, a character Windows refuses,
or differs from another only in case; unpacking refused up front past MAX_PATH without long paths.
None of this ran on Windows."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import precast
from precast.compiler import bundle_archive
from precast.compiler.bundle_writer import commit_bundle
from precast.compiler.bundle_archive import _write_archive, pack_bundle, unpack_bundle
from precast.compiler.cache import Cache
from precast.compiler.errors import BadInput
from precast.runtime import fileops
from precast.runtime.fileops import FileBusy, case_collision, rename_dir, replace_file, windows_name_problem
from precast.runtime.staging import Staging


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("winfiles")
    (tmp / "r.yaml").write_text("model: {source: demo:tiny-sd15}\ncomponents: [vae_decoder]\n"
                                "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")
    precast("build", tmp / "r.yaml", "--out", tmp / "b", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    return tmp / "b"


@pytest.fixture
def windows(monkeypatch):
    """fileops as on Windows; the sleeps between tries recorded instead of slept."""
    slept = []
    monkeypatch.setattr(fileops, "WINDOWS", True)
    monkeypatch.setattr(fileops, "long_paths_enabled", lambda: True)     # its registry read needs Windows
    monkeypatch.setattr(fileops.time, "sleep", slept.append)
    return slept


def held_open(monkeypatch, name, times, real=None):
    """os.<name> raising PermissionError (WinError 32, a sharing violation) the first `times` calls."""
    real = real or getattr(os, name)
    calls = []

    def op(src, dst, *a, **k):
        calls.append((src, dst))
        if len(calls) <= times:
            raise PermissionError(13, "The process cannot access the file because it is being used by another process",
                                  str(dst))
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, name, op)
    return calls


def test_replace_is_retried_with_backoff_while_the_target_is_held_open(tmp_path, monkeypatch, windows):
    (tmp_path / "new").write_text("new")
    (tmp_path / "out").write_text("old")
    calls = held_open(monkeypatch, "replace", 3)
    replace_file(tmp_path / "new", tmp_path / "out")
    assert len(calls) == 4 and windows == [0.05, 0.1, 0.2] and (tmp_path / "out").read_text() == "new"


def test_replace_gives_up_with_one_clear_line(tmp_path, monkeypatch, windows):
    (tmp_path / "new").write_text("new")
    held_open(monkeypatch, "replace", 99)
    with pytest.raises(FileBusy) as e:
        replace_file(tmp_path / "new", tmp_path / "out")
    assert windows == list(fileops.RETRY_DELAYS)
    assert isinstance(e.value, PermissionError) and "in use by another process" in e.value.strerror
    assert str(tmp_path / "out") in e.value.strerror


def test_no_retry_off_windows(tmp_path, monkeypatch):
    """Elsewhere a PermissionError is a permission problem: raised at once, as it was."""
    (tmp_path / "new").write_text("new")
    calls = held_open(monkeypatch, "replace", 99)
    with pytest.raises(PermissionError) as e:
        replace_file(tmp_path / "new", tmp_path / "out")
    assert len(calls) == 1 and not isinstance(e.value, FileBusy)


def windows_rename(monkeypatch):
    """os.rename as Windows' MoveFile: refuses any existing target, an empty folder included."""
    real = os.rename

    def rename(src, dst):
        if os.path.lexists(dst):
            raise FileExistsError(17, "Cannot create a file when that file already exists", str(dst))
        real(src, dst)
    monkeypatch.setattr(os, "rename", rename)


def test_a_folder_is_renamed_onto_an_empty_folder_as_posix_does(tmp_path, monkeypatch, windows):
    windows_rename(monkeypatch)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    rename_dir(tmp_path / "src", tmp_path / "empty")
    assert (tmp_path / "empty" / "f").read_text() == "x"
    (tmp_path / "src").mkdir()
    with pytest.raises(FileExistsError):            # a folder with files in it is never replaced
        rename_dir(tmp_path / "src", tmp_path / "empty")


def test_pack_over_an_archive_held_open(bundle, tmp_path, monkeypatch, windows):
    out = tmp_path / "b.tar"
    out.write_bytes(b"an earlier archive, open in an uploader")
    held_open(monkeypatch, "replace", 99)
    with pytest.raises(BadInput, match=r"--out .*b\.tar: cannot write it \(.*in use by another process"):
        pack_bundle(bundle, out)
    assert out.read_bytes().startswith(b"an earlier") and not list(tmp_path.glob(".b.tar.tmp-*"))


def test_unpack_into_an_empty_folder_with_windows_rename(bundle, tmp_path, monkeypatch, windows):
    archive = tmp_path / "b.tar"
    pack_bundle(bundle, archive)
    windows_rename(monkeypatch)
    (tmp_path / "out").mkdir()
    unpack_bundle(archive, tmp_path / "out")
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_unpack_retries_then_says_the_folder_is_in_use(bundle, tmp_path, monkeypatch, windows):
    archive = tmp_path / "b.tar"
    pack_bundle(bundle, archive)
    held_open(monkeypatch, "rename", 99)
    with pytest.raises(BadInput, match=r"--out .*out: cannot write \(.*in use by another process.*\); nothing was kept"):
        unpack_bundle(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.unpacking-*"))


def test_replacing_a_bundle_held_open_keeps_it(bundle, tmp_path, monkeypatch, windows):
    """A running generate holds the old bundle's files: Windows will not move its folder. One line, and the
    old bundle stays where it was; if the new one cannot be moved in, the old one is put back."""
    out = tmp_path / "out"
    shutil.copytree(bundle, out)
    with Staging(out, "building") as stage:
        shutil.copytree(bundle, stage.path, dirs_exist_ok=True)
        real = os.rename
        calls = held_open(monkeypatch, "rename", 99)
        with pytest.raises(BadInput, match=r"--out .*out: a file in it is held open by another process"):
            commit_bundle(stage)
        assert calls[0][0] == out and (out / "manifest.json").is_file() and stage.path.is_dir()

        def rename(src, dst):                           # the old bundle moves aside; the new one is held
            if Path(src) == stage.path:
                raise PermissionError(13, "Access is denied", str(src))
            real(src, dst)
        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(BadInput):
            commit_bundle(stage)
    assert (out / "manifest.json").is_file() and not list(tmp_path.glob(".out.*"))


def test_cache_gc_asks_windows_whether_a_builder_lives_without_signalling(tmp_path, monkeypatch, windows):
    """On Windows os.kill(pid, 0) is no probe: it sends CTRL_C_EVENT (0) or kills the process. gc asks
    OpenProcess instead (stubbed here)."""
    cache = Cache(tmp_path / "cache")
    (cache.tmp / f"k-{os.getpid()}-abc").mkdir(parents=True)
    (cache.tmp / "k-999999999-abc").mkdir()

    def no_kill(*a):
        raise AssertionError("os.kill must not be called on Windows")
    monkeypatch.setattr(os, "kill", no_kill)
    monkeypatch.setattr(fileops, "_windows_process_alive", lambda pid: pid == os.getpid())
    assert cache.gc()["stale_temp_folders"] == 1
    assert [p.name for p in cache.tmp.iterdir()] == [f"k-{os.getpid()}-abc"]


def test_cache_gc_survives_a_lock_file_windows_will_not_unlink(tmp_path, monkeypatch):
    """Windows refuses to unlink a file held open (filelock's own release removes it there)."""
    cache = Cache(tmp_path / "cache")
    cache.locks.mkdir(parents=True)
    lock = cache.locks / ("ab" * 32 + ".lock")
    lock.write_text("")
    os.utime(lock, (1, 1))
    real = Path.unlink

    def unlink(self, missing_ok=False):
        if self == lock:
            raise PermissionError(13, "The process cannot access the file", str(self))
        real(self, missing_ok=missing_ok)
    monkeypatch.setattr(Path, "unlink", unlink)
    assert cache.gc()["stale_locks"] == 0 and lock.exists()


@pytest.mark.parametrize("name, words", [
    ("onnx/CON", "device name"), ("onnx/nul.txt", "device name"), ("artifacts/com1.json/x", "device name"),
    ("onnx/a:b", "character Windows does not allow"), ("onnx/what?", "character Windows does not allow"),
    ("onnx/trailing.", "dot or space"), ("onnx/trailing ", "dot or space"),
])
def test_windows_name_problems(name, words):
    assert words in windows_name_problem(name)


def test_portable_names_pass():
    for name in ("onnx/vae_decoder/model.onnx_data", "artifacts/unet/tensorrt-rtx-sm_86+sm_89-0123abcd/model.engine",
                 "onnx/tokenizer/merges.txt", "onnx/console.json", "onnx/CONFIG.json"):
        assert windows_name_problem(name) is None, name


def test_case_collisions():
    seen = {}
    assert case_collision("onnx/unet/model.onnx", seen) is None
    assert case_collision("onnx/unet/config.json", seen) is None
    assert case_collision("onnx/unet/Model.onnx", seen) == "onnx/unet/model.onnx"
    assert case_collision("ONNX/x", seen) == "onnx"                 # a folder differing in case


def archive_with(bundle, tmp_path, extra: dict[str, bytes]) -> Path:
    """The bundle packed with `extra` files added, listed in its manifest with their true size and sha256."""
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for rel, data in extra.items():
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes(data)
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    archive = tmp_path / "b.tar"
    _write_archive(copy, ["manifest.json"] + sorted(manifest["files"]), "", archive)
    return archive


@pytest.mark.parametrize("extra, words", [
    ({"onnx/vae_decoder/MODEL.onnx": b"other"},    # sorted: MODEL.onnx comes first, model.onnx is refused
     "member 'onnx/vae_decoder/model.onnx': differs only in case from 'onnx/vae_decoder/MODEL.onnx'"),
    ({"Onnx/readme.txt": b"x"}, "member 'onnx': differs only in case from 'Onnx'"),
    ({"onnx/aux.json": b"{}"}, "'aux.json' is a device name on Windows"),
    ({"onnx/x|y": b"x"}, "character Windows does not allow"),
])
def test_unpack_refuses_names_windows_or_macos_cannot_hold(bundle, tmp_path, extra, words):
    archive = archive_with(bundle, tmp_path, extra)
    with pytest.raises(BadInput) as e:
        unpack_bundle(archive, tmp_path / "out")
    assert words in str(e.value) and str(e.value).endswith("nothing was written"), e.value
    assert not (tmp_path / "out").exists()


def test_unpack_refuses_paths_past_max_path_without_long_paths(bundle, tmp_path, monkeypatch, windows):
    archive = tmp_path / "b.tar"
    pack_bundle(bundle, archive)
    deep = tmp_path / ("d" * 120) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(fileops, "long_paths_enabled", lambda: False)
    with pytest.raises(BadInput, match=r"Windows allows 259 unless long paths are enabled.*; unpack into a shorter "
                                       r"folder .*nothing was written"):
        unpack_bundle(archive, deep / "out")
    assert list(deep.iterdir()) == []
    monkeypatch.setattr(fileops, "long_paths_enabled", lambda: True)
    unpack_bundle(archive, deep / "out")
    assert (deep / "out" / "manifest.json").is_file()


def test_bundle_archive_uses_the_helpers():
    """pack/unpack go through fileops (so the Windows behaviour above is theirs), not os.rename/os.replace."""
    source = Path(bundle_archive.__file__).read_text()
    assert "os.rename(" not in source and "os.replace(" not in source


def test_a_damaged_entry_windows_could_not_remove_is_one_line(tmp_path, monkeypatch):
    """Windows keeps a file another process holds open (a bundle's hard link to it, loaded by a running
    precast): the damaged entry survives its eviction in part, and the rebuild says so instead of failing
    on the rename."""
    cache = Cache(tmp_path / "cache")
    entry, hit, _ = cache.get_or_build("ab" * 32, lambda folder: (folder / "w.bin").write_bytes(b"x" * 10) and {})
    (entry.path / "w.bin").write_bytes(b"y" * 10)
    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, ignore_errors=False: real(path, ignore_errors)
                        if Path(path) != entry.path else (Path(path) / "entry.json").unlink())
    with pytest.raises(BadInput, match=r"cache entry abababababab \(w.bin does not match its sha256\) could not be "
                                       r"removed: a file in it is held open by another process"):
        cache.get_or_build("ab" * 32, lambda folder: {})
