"""Kills lose nothing: a build stopped by SIGTERM / SIGINT removes what it was writing and exits 143 / 130;
one killed with SIGKILL leaves a locked-no-more staging folder that the next build into that --out and
`precast cache gc` remove; a kill at any step of the swap that replaces a bundle leaves `--out` holding the
old or the new whole bundle (at once where the system exchanges folders atomically, after recovery where it
takes two renames). Real subprocesses, real signals."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import precast

RECIPE = ("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
          "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")


def start_build(tmp_path, out):
    (tmp_path / "r.yaml").write_text(RECIPE)
    env = {**os.environ, "PRECAST_CACHE": str(tmp_path / "cache")}
    # SIGINT as a foreground process has it: a shell starts background jobs (`make test &`) with SIGINT ignored,
    # which the build would inherit (Python then installs no KeyboardInterrupt handler)
    return subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "build", tmp_path / "r.yaml", "--out", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_staging(tmp_path, proc, timeout=120):
    """Block until the build's staging folder exists (and a cache entry is being built), then return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        staged = list(tmp_path.glob(".out.building-*"))
        if staged and list((tmp_path / "cache" / "tmp").glob("*")):
            return staged[0]
        assert proc.poll() is None, f"the build ended before it could be interrupted:\n{proc.stderr.read()}"
        time.sleep(0.02)
    raise AssertionError("no staging folder appeared")


def hidden(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out"))


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_terminated_build_removes_what_it_was_writing(tmp_path, sig, code):
    for attempt in range(3):     # the tiny build can end between the staging check and the signal on a loaded machine
        folder = tmp_path / f"try{attempt}"
        folder.mkdir()
        proc = start_build(folder, folder / "out")
        wait_for_staging(folder, proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            break
        assert (folder / "out" / "manifest.json").is_file(), err      # it had finished, whole: try again
    tmp_path = folder
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ")
    assert hidden(tmp_path) == [] and not (tmp_path / "out").exists()
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []          # the cache entry being built, too
    assert list((tmp_path / "cache" / "staging").iterdir()) == []


def test_a_killed_build_is_cleaned_up_by_gc_and_by_the_next_build(tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    proc = start_build(tmp_path, tmp_path / "out")
    staged = wait_for_staging(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert hidden(tmp_path) == [staged.name]                          # what SIGKILL leaves: nothing can run
    gc = precast("cache", "gc", env=env, check=True)
    assert f"removed {staged.name}, left by process {proc.pid} which is gone" in gc.stdout
    assert "1 stale temp folder" in gc.stdout and hidden(tmp_path) == []

    proc = start_build(tmp_path, tmp_path / "out")
    staged = wait_for_staging(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    precast("build", tmp_path / "r.yaml", "--out", tmp_path / "out", env=env, check=True)
    assert hidden(tmp_path) == [] and not staged.exists()
    precast("bundle", "verify", tmp_path / "out", check=True)


def test_gc_leaves_a_live_build_alone(tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    proc = start_build(tmp_path, tmp_path / "out")
    staged = wait_for_staging(tmp_path, proc)
    precast("cache", "gc", env=env, check=True)
    assert staged.exists()                                            # locked by its live writer
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    precast("bundle", "verify", tmp_path / "out", check=True)


# A bundle swap killed at each of its steps: the child replaces `old` at --out by `new` through
# runtime/staging.py and SIGKILLs itself just before its step number `stop` (exchange or two renames).
SWAP = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from precast.runtime import staging
    out, new, registry, stop, exchange = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    steps = []
    def step(fn):
        def run(*a, **k):
            steps.append(fn.__name__)
            if len(steps) == stop:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return run
    staging.rename_dir = step(staging.rename_dir)
    staging.exchange_dirs = step(staging.exchange_dirs if exchange else (lambda a, b: False))
    with staging.Staging(out, "building", registry) as s:
        shutil.copytree(new, s.path, dirs_exist_ok=True)
        staging.shutil.rmtree = step(shutil.rmtree)
        s.commit()
    print(" ".join(steps))
""")


@pytest.fixture(scope="module")
def two_bundles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swap")
    (tmp / "r.yaml").write_text("model: {source: demo:tiny-sd15}\ncomponents: [vae_decoder]\n"
                                "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")
    env = {"PRECAST_CACHE": str(tmp / "cache")}
    precast("build", tmp / "r.yaml", "--out", tmp / "old", env=env, check=True)
    (tmp / "r.yaml").write_text((tmp / "r.yaml").read_text().replace("targets: [onnxruntime]",
                                                                        "targets: [{openvino: {device: CPU}}]"))
    precast("build", tmp / "r.yaml", "--out", tmp / "new", env=env, check=True)
    return tmp / "old", tmp / "new"


def backend_of(bundle):
    return {a["backend"] for a in json.loads((bundle / "manifest.json").read_text())["artifacts"]}


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_kill_at_any_step_of_the_swap_keeps_a_whole_bundle(two_bundles, tmp_path, exchange):
    import shutil
    old, new = two_bundles
    out, registry = tmp_path / "out", tmp_path / "cache" / "staging"
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    run = lambda stop: subprocess.run([sys.executable, "-c", SWAP, out, new, registry, str(stop), "1" if exchange else "0"],
                                      capture_output=True, text=True)
    shutil.copytree(old, out)
    done = run(0)                                                    # no kill: the steps it takes
    assert done.returncode == 0, done.stderr
    steps = done.stdout.split()
    assert backend_of(out) == {"openvino"} and len(steps) == (3 if exchange else 6), steps
    seen = set()
    for stop in range(1, len(steps) + 1):
        shutil.rmtree(out)
        shutil.copytree(old, out)
        killed = run(stop)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        if exchange:                                                 # atomic: never a moment without a bundle
            assert (out / "manifest.json").is_file()
        gc = precast("cache", "gc", env=env, check=True)
        assert hidden(tmp_path) == [], (stop, gc.stdout)
        precast("bundle", "verify", out, check=True)
        seen.add(frozenset(backend_of(out)))
    assert seen == {frozenset({"onnxruntime"}), frozenset({"openvino"})}   # killed before and after the switch


def test_an_archive_a_killed_pack_left_half_written_goes_with_the_next_pack(two_bundles, tmp_path):
    """`bundle pack` writes .NAME.packing-PID, locked while it lives; one whose writer died (here: a child
    that locked it and was killed) is removed by the next pack to that name, a live one is not."""
    old, _ = two_bundles
    dead = tmp_path / ".b.tar.zst.packing-1"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from precast.runtime.fileops import hold_path
        open({str(dead)!r}, "wb").write(b"x" * 1000)
        fd = hold_path({str(dead)!r}); print("held", flush=True); time.sleep(60)""")],
        stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    precast("bundle", "pack", old, "--out", tmp_path / "b.tar.zst", check=True)
    assert dead.exists()                                            # its writer lives: kept
    child.send_signal(signal.SIGKILL)
    child.wait()
    precast("bundle", "pack", old, "--out", tmp_path / "b.tar.zst", check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.zst"]
