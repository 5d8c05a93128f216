"""What a pip user gets: the wheel carries the shipped recipes and SPDX license metadata without
build warnings; from an installed wheel, with no checkout around, `precast plan tiny-flux` and
`precast build tiny-sd15` find their recipes by name, and a wrong name lists the shipped ones; a
bundle's files are counted alike by `bundle pack`, `inspect` and `unpack`."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, precast

SHIPPED = sorted(p.stem for p in Path(ROOT, "compiler", "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """precast's wheel, built as a user's `pip wheel` would, from a copy of the sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("compiler", "runtime"):
        shutil.copytree(Path(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(Path(ROOT, name), src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-v", "-w", str(tmp / "dist"),
                           "--disable-pip-version-check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return next((tmp / "dist").glob("precast-*.whl")), proc.stdout + proc.stderr


def test_wheel_ships_the_recipes_with_spdx_license_and_no_build_warnings(wheel):
    path, log = wheel
    assert "tiny-sd15" in SHIPPED and "tiny-flux" in SHIPPED
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {f"precast/compiler/recipes/{n}.yaml" for n in SHIPPED} <= names
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    warnings = [line for line in log.splitlines() if "BuildBackendWarning" in line or "DeprecationWarning" in line]
    assert not warnings, warnings


def test_runtime_extras_hold_no_build_tools(wheel):
    """`precast[onnxruntime]` is the runtime only: the graph simplifier belongs to the compiler."""
    with zipfile.ZipFile(wheel[0]) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any("onnxsim" in r and 'extra == "compiler"' in r for r in requires)
    for extra in ("onnxruntime", "openvino", "tensorrt-rtx"):
        mine = [r.split()[1] for r in requires if f'extra == "{extra}"' in r]
        assert mine and not any(r.startswith(("onnxsim", "onnx>", "onnx=", "pyyaml", "safetensors")) for r in mine), mine


def test_top_level_recipes_folder_is_the_shipped_one():
    assert os.path.realpath(Path(ROOT, "recipes")) == os.path.realpath(Path(ROOT, "compiler", "recipes"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed into a fresh venv (no deps: they come from this interpreter's
    site-packages through PYTHONPATH), and a runner for its `precast` in an empty folder."""
    tmp = tmp_path_factory.mktemp("installed")
    venv, cwd = tmp / "venv", tmp / "work"
    cwd.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--disable-pip-version-check", str(wheel[0])], check=True)
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "PRECAST_CACHE": str(tmp / "cache")}

    def run(*args, exe="precast"):
        return subprocess.run([str(venv / "bin" / exe), *map(str, args)], capture_output=True, text=True,
                              cwd=cwd, env=env)
    where = run("-c", "import precast.compiler.recipe as r; print(r.__file__)", exe="python")
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr     # the wheel's copy, not the checkout
    return run, cwd


def test_installed_plan_and_build_take_shipped_recipe_names(installed):
    run, cwd = installed
    plan = run("plan", "tiny-flux")
    assert plan.returncode == 0, plan.stderr
    assert "transformer.onnxruntime" in plan.stdout
    build = run("build", "tiny-sd15", "--out", "b")
    assert build.returncode == 0, build.stderr
    assert "bundle b in" in build.stdout
    assert run("bundle", "verify", "b").returncode == 0


def test_unknown_recipe_name_lists_the_shipped_ones(installed):
    run, _ = installed
    for args in (("plan", "tiny-sd16"), ("build", "recipes/tiny-sd15.yaml", "--out", "x")):
        proc = run(*args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert args[1] in lines[0] and "not the name of a recipe precast ships" in lines[0]
        assert all(name in lines[0] for name in SHIPPED), lines[0]


def test_shipped_recipe_reads_your_checkpoint_from_the_current_folder(installed):
    run, cwd = installed
    proc = run("build", "sd15", "--out", "x")
    assert proc.returncode == 2
    assert f"{cwd / 'v1-5-pruned-emaonly.safetensors'} does not exist" in proc.stderr, proc.stderr


def test_pack_inspect_unpack_count_the_same_files(installed, tmp_path):
    from precast.runtime.verified import RECORD_FILE
    run, cwd = installed
    if not (cwd / "b").exists():
        assert run("build", "tiny-sd15", "--out", "b").returncode == 0
    bundle = cwd / "b"
    bundle_file = lambda p: p.is_file() and p.name != RECORD_FILE   # noqa: E731  (verify records are not the bundle's)
    files = sum(1 for p in bundle.rglob("*") if bundle_file(p))
    folders = sum(1 for p in bundle.rglob("*") if p.is_dir())
    words = f"{files} files (+{folders} folders)"
    pack = precast("bundle", "pack", bundle, "--out", tmp_path / "b.tar.gz", check=True)
    assert pack.stdout.startswith(f"packed {words} -> "), pack.stdout
    inspect = precast("bundle", "inspect", bundle, check=True)
    assert f"total      {words}, " in inspect.stdout, inspect.stdout
    unpack = precast("bundle", "unpack", tmp_path / "b.tar.gz", "--out", tmp_path / "u", check=True)
    assert unpack.stdout.startswith(f"unpacked {words} -> "), unpack.stdout
    assert sum(1 for p in (tmp_path / "u").rglob("*") if bundle_file(p)) == files
    with_json = precast("bundle", "pack", bundle, "--out", tmp_path / "c.tar", "--json", check=True)
    assert '"files": %d, "folders": %d' % (files, folders) in with_json.stdout


def test_architecture_page_names_only_modules_that_exist():
    import re
    text = Path(ROOT, "docs", "architecture.md").read_text()
    named = set(re.findall(r"`((?:compiler|runtime|benchmarks|tests)/[\w/.-]*)`", text))
    assert len(named) > 30
    missing = sorted(p for p in named if not Path(ROOT, p).exists())
    assert not missing, f"docs/architecture.md names paths that are gone: {missing}"
