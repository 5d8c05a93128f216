"""Benchmark: what a user installs with each runtime extra, and how much of it the runtime loads.

The promise: the runtime (numpy + one vendor runtime) stays under 200 MB installed. For each extra
(none, onnxruntime, openvino, tensorrt-rtx) this script:

1. builds precast's wheel from this checkout (`pip wheel . --no-deps`, counting license warnings);
2. makes a fresh virtual environment without pip (`python3 -m venv --without-pip`: pip and
   setuptools are the user's tools, not precast's; what a default venv adds for them is measured
   once, apart) and installs `precast[EXTRA]` from the wheel into it with this interpreter's pip
   (`pip --python VENV/bin/python install`), from PyPI as a user would;
3. sums the bytes of every file under site-packages (apparent sizes, MB = 1e6; the `.pyc` files pip
   compiles at install time included), per distribution (from each dist-info's RECORD), largest
   first, with each large distribution's largest folders and files;
4. runs the runtime on a tiny bundle in that environment (`precast doctor`, and `precast generate`
   2 steps 64x64 where the extra can run the bundle on this CPU; for tensorrt-rtx, which needs an
   NVIDIA GPU, the imports and `trt.Runtime` the session starts with) while sampling
   /proc/self/maps and sys.modules, and reports which installed shared libraries and Python files
   were never loaded (for OpenVINO: the frontends for models precast never reads, the GPU / NPU
   plugins on a machine without them);
5. prints a table with the ratio to 200 MB and writes JSON (default benchmarks/results/install_size.json).

The tiny bundle is built once with this checkout's .venv (recipe tiny-sd15-rtx: ONNX Runtime, OpenVINO
CPU and a TensorRT-RTX sm_86 engine) into the work folder, which is deleted at the end (--keep keeps it).

Usage: .venv/bin/python benchmarks/install_size.py [--extras none,onnxruntime,openvino,tensorrt-rtx]
       [--work DIR] [--json OUT] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMISE_MB = 200.0
EXTRAS = ("none", "onnxruntime", "openvino", "tensorrt-rtx", "onnxruntime-before")
# what each row installs: precast's extra, plus packages (the layout before onnxsim moved to `compiler`)
INSTALLS = {"none": ("", ()), "onnxruntime": ("onnxruntime", ()), "openvino": ("openvino", ()),
            "tensorrt-rtx": ("tensorrt-rtx", ()), "onnxruntime-before": ("onnxruntime", ("onnxsim>=0.4",))}
# the backend each row runs the tiny bundle with on this CPU (None: doctor only)
RUNS_HERE = {"none": None, "onnxruntime": "onnxruntime", "openvino": "openvino", "tensorrt-rtx": None,
             "onnxruntime-before": "onnxruntime"}

# Runs inside the scratch venv: the runtime's CLI (or a TensorRT-RTX probe) while a thread samples
# the mapped files; at exit, writes every file the process mapped or imported.
PROBE = r'''
import atexit, json, os, sys, threading
out, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
seen = set()
def sample():
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    seen.add(parts[5].strip())
    except OSError:
        pass
def loop():
    while True:
        sample()
        threading.Event().wait(0.02)
threading.Thread(target=loop, daemon=True).start()
def dump():
    sample()
    for m in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            f = getattr(m, attr, None)
            if isinstance(f, str):
                seen.add(os.path.realpath(f))
    with open(out, "w") as f:
        json.dump(sorted(seen), f)
atexit.register(dump)
if mode == "cli":
    sys.argv = ["precast"] + args
    from precast.runtime.cli import main
    main()
else:   # what TensorRtRtxSession does before it needs a GPU
    import tensorrt_rtx as trt
    from cuda.bindings import runtime as cudart
    trt.Runtime(trt.Logger(trt.Logger.WARNING))
    print("tensorrt_rtx", trt.__version__, "and cuda.bindings.runtime imported; trt.Runtime created")
'''


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def must(cmd, **kw) -> subprocess.CompletedProcess:
    p = run(cmd, **kw)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def files_under(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                out[os.path.realpath(p)] = os.stat(p).st_size
    return out


def owners(sp: Path) -> dict[str, str]:
    """file (real path) -> the distribution whose RECORD lists it."""
    own = {}
    for info in sp.glob("*.dist-info"):
        name = info.name[:-len(".dist-info")].rsplit("-", 1)[0]
        record = info / "RECORD"
        if not record.exists():
            continue
        for line in record.read_text().splitlines():
            rel = line.rsplit(",", 2)[0]
            if rel:
                own[os.path.realpath(sp / rel)] = name
    return own


def kind(path: str) -> str:
    base = os.path.basename(path)
    if base.endswith((".so", ".pyd", ".dylib")) or ".so." in base:
        return "lib"
    if base.endswith((".py", ".pyc")):
        return "py"
    return "other"


def is_test(path: str, sp: Path) -> bool:
    parts = Path(path).relative_to(sp).parts
    return any(p in ("tests", "test", "testing") for p in parts[:-1])


def measure(sp: Path, loaded: set[str]) -> dict:
    files, own = files_under(sp), owners(sp)
    dists: dict[str, dict] = {}
    for path, size in files.items():
        d = dists.setdefault(own.get(path, "(not in any RECORD)"),
                             {"bytes": 0, "files": 0, "lib": 0, "lib_loaded": 0, "py": 0, "py_loaded": 0,
                              "other": 0, "tests": 0, "never_loaded_libs": {}, "folders": {}})
        d["bytes"] += size
        d["files"] += 1
        k = kind(path)
        d[k] += size
        if k != "other" and path in loaded:
            d[f"{k}_loaded"] += size
        if k == "lib" and path not in loaded:
            d["never_loaded_libs"][str(Path(path).relative_to(sp))] = size
        if is_test(path, sp):
            d["tests"] += size
        rel = Path(path).relative_to(sp).parts
        top = "/".join(rel[:2]) if len(rel) > 2 else rel[0]
        d["folders"][top] = d["folders"].get(top, 0) + size
    for d in dists.values():
        d["never_loaded_libs"] = dict(sorted(d["never_loaded_libs"].items(), key=lambda kv: -kv[1]))
        d["folders"] = dict(sorted(d["folders"].items(), key=lambda kv: -kv[1])[:8])
    versions = dict(i.name[:-len(".dist-info")].rsplit("-", 1) for i in sp.glob("*.dist-info"))
    for name, d in dists.items():
        d["version"] = versions.get(name)
    total = sum(files.values())
    blocks = sum(os.stat(p).st_blocks * 512 for p in files)
    return {"bytes": total, "disk_bytes": blocks, "files": len(files),
            "distributions": dict(sorted(dists.items(), key=lambda kv: -kv[1]["bytes"]))}


def build_wheel(work: Path) -> tuple[Path, dict]:
    out = work / "wheel"
    t = time.perf_counter()
    p = must([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-v", "-w", out], cwd=work)
    text = p.stdout + p.stderr
    wheel = next(out.glob("precast-*.whl"))
    warnings = [line for line in text.splitlines() if "license" in line.lower() and ("warning" in line.lower() or "deprecat" in line.lower())]
    backend = [line for line in text.splitlines() if "BuildBackendWarning" in line or "SetuptoolsDeprecationWarning" in line]
    return wheel, {"wheel": wheel.name, "bytes": wheel.stat().st_size, "seconds": round(time.perf_counter() - t, 1),
                   "license_warnings": len(warnings), "build_backend_warnings": backend}


def build_bundle(work: Path) -> Path:
    bundle = work / "bundle"
    env = dict(os.environ, PRECAST_CACHE=str(work / "cache"))
    must([ROOT / ".venv/bin/precast", "build", "tiny-sd15-rtx", "--out", bundle], env=env)
    return bundle


def pip_tools_size(work: Path) -> dict:
    """What a default `python3 -m venv` adds for installing (pip; setuptools too before Python 3.12)."""
    venv = work / "venv-default"
    must([sys.executable, "-m", "venv", venv])
    sp = site_packages(venv)
    m = measure(sp, set())
    shutil.rmtree(venv)
    return {d: round(v["bytes"] / 1e6, 1) for d, v in m["distributions"].items()}


def one_extra(extra: str, wheel: Path, bundle: Path, work: Path) -> dict:
    venv = work / f"venv-{extra}"
    must([sys.executable, "-m", "venv", "--without-pip", venv])
    name, more = INSTALLS[extra]
    req = f"precast{f'[{name}]' if name else ''} @ {wheel.as_uri()}"
    t = time.perf_counter()
    must([sys.executable, "-m", "pip", "--python", venv / "bin/python", "install", "--quiet",
          "--disable-pip-version-check", req, *more])
    install_s = time.perf_counter() - t
    sp = site_packages(venv)
    before = measure(sp, set())            # sizes as installed, before anything runs (no new .pyc)
    probe = work / "probe.py"
    probe.write_text(PROBE)
    loaded: set[str] = set()
    runs = []
    env = dict(os.environ, PRECAST_CACHE=str(work / f"cache-{extra}"))
    env.pop("PYTHONPATH", None)
    steps = [["cli", "doctor", bundle]]
    if RUNS_HERE[extra]:
        steps.append(["cli", "generate", bundle, "--prompt", "a cat", "--steps", "2", "--seed", "1",
                      "--size", "64x64", "--out", work / f"{extra}.png", "--backend", f"all={RUNS_HERE[extra]}"])
    if extra == "tensorrt-rtx":
        steps.append(["trt"])
    for step in steps:
        out = work / "loaded.json"
        p = run([venv / "bin/python", probe, out, *step], env=env, cwd=work)
        runs.append({"command": " ".join(str(s) for s in step[1:]) or "tensorrt-rtx probe", "rc": p.returncode,
                     "tail": (p.stdout + p.stderr).strip().splitlines()[-6:]})
        if out.exists():
            loaded |= set(json.loads(out.read_text()))
    m = measure(sp, loaded)
    for d, v in m["distributions"].items():   # sizes as installed; what ran only tells what was loaded
        v["bytes"] = before["distributions"].get(d, {}).get("bytes", v["bytes"])
    m.update(bytes=before["bytes"], disk_bytes=before["disk_bytes"], files=before["files"])
    return {"extra": extra, "install_seconds": round(install_s, 1), "runs": runs, **m}


def mb(b: int) -> str:
    return f"{b / 1e6:.1f}"


def report(results: list[dict], pip_tools: dict) -> None:
    print(f"\n{'extra':<19} {'site-packages':>14} {'vs 200 MB':>10} {'loaded libs+py':>15} {'never-loaded libs':>18} "
          f"{'tests':>8}")
    for r in results:
        dists = r["distributions"].values()
        loaded = sum(d["lib_loaded"] + d["py_loaded"] for d in dists)
        unused = sum(sum(d["never_loaded_libs"].values()) for d in dists)
        tests = sum(d["tests"] for d in dists)
        print(f"{r['extra']:<19} {mb(r['bytes']):>11} MB {r['bytes'] / 1e6 / PROMISE_MB:>9.2f}x "
              f"{mb(loaded):>12} MB {mb(unused):>15} MB {mb(tests):>5} MB")
    print(f"(a default venv adds, for installing: {', '.join(f'{k} {v} MB' for k, v in pip_tools.items())})")
    for r in results:
        print(f"\n== precast[{r['extra']}]: {mb(r['bytes'])} MB in {r['files']} files "
              f"({mb(r['disk_bytes'])} MB on disk); runs: " +
              "; ".join(f"{x['command'].split()[0] if x['command'] else x['command']} rc={x['rc']}" for x in r["runs"]))
        print(f"   {'distribution':<32} {'MB':>7} {'libs':>7} {'loaded':>7} {'python':>7} {'loaded':>7} {'other':>7} "
              f"{'tests':>6}")
        for name, d in r["distributions"].items():
            if d["bytes"] < 0.5e6:
                continue
            print(f"   {name:<32} {mb(d['bytes']):>7} {mb(d['lib']):>7} {mb(d['lib_loaded']):>7} {mb(d['py']):>7} "
                  f"{mb(d['py_loaded']):>7} {mb(d['other']):>7} {mb(d['tests']):>6}")
            big = {k: v for k, v in d["never_loaded_libs"].items() if v >= 1e6}
            if big:
                print("      never loaded: " + ", ".join(f"{Path(k).name} {mb(v)}" for k, v in list(big.items())[:12]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", default=",".join(EXTRAS),
                    help="rows to measure; onnxruntime-before = precast[onnxruntime] + onnxsim, the former extra")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work-install-size")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "install_size.json")
    ap.add_argument("--bundle", type=Path, help="a tiny bundle to run (default: built from tiny-sd15-rtx)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    for e in extras:
        if e not in EXTRAS:
            sys.exit(f"--extras: {e!r} is not one of {', '.join(EXTRAS)}")
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    try:
        wheel, wheel_info = build_wheel(args.work)
        print(f"wheel {wheel_info['wheel']} ({mb(wheel_info['bytes'])} MB, {wheel_info['license_warnings']} license warnings, "
              f"{len(wheel_info['build_backend_warnings'])} build-backend warnings)")
        bundle = args.bundle.resolve() if args.bundle else build_bundle(args.work)
        pip_tools = pip_tools_size(args.work)
        results = []
        for e in extras:
            print(f"installing precast[{e}] ...", flush=True)
            results.append(one_extra(e, wheel, bundle, args.work))
            shutil.rmtree(args.work / f"venv-{e}")
        report(results, pip_tools)
        from machine import describe  # noqa: E402  (benchmarks/machine.py)
        doc = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "promise_mb": PROMISE_MB,
               "units": "MB = 1e6 bytes, apparent file sizes under site-packages (pip's compiled .pyc included)",
               "machine": describe(()), "wheel": wheel_info, "venv_install_tools_mb": pip_tools, "extras": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"\nJSON: {args.json}")
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
