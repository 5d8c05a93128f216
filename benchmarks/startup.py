"""Start-up benchmark: bundle -> first image, per stage, warm and cold, vs the backend's own loads.

A full-size SD 1.5 bundle (random, deterministic fp16 weights in the LDM single-file layout:
export_unet.py's checkpoint; `precast build` of a static 512x512 fp32 recipe for the OpenVINO CPU
target, as benchmarks/suite.py builds it) is opened in fresh processes:

  precast   `Txt2Img(bundle)` then one 512x512 step to the first image, with the runtime's own
            per-stage record (discover, assign, tokenizers, select, verify, load per component,
            load wall time) plus the Python imports before it and the first image after it.
  backend   the same artifacts opened by the backend alone, no precast code in between: one
            `ov.Core().import_model` per blob (memory-mapped, with its recorded compile config),
            one after the other; its sum of load times is the floor's denominator.

Warm: page cache warm (the files just read). Cold: the page cache dropped before each process
(`/proc/sys/vm/drop_caches`, root), else a fresh copy of the bundle per run (then "cold" means
"not yet read by this process from a fresh inode", which the OS may still hold in memory; the JSON
says which). Runs are paired and interleaved (precast, backend, precast, backend, ...) so the noise
of a shared machine hits both sides; medians are reported.

Floor (issue "Start fast"): warm open (all components selected, verified and loaded) <= 1.2x the
sum of the backend's own load times for the same artifacts, measured in the same run.

The floor's ratio is the median over rounds of (open / backend sum) within a round (paired).

Usage: .venv/bin/python benchmarks/startup.py [--work DIR] [--repeat N] [--no-verify-run] [--keep]
           [--bundle EXISTING_BUNDLE] [--json OUT]
The work folder (default benchmarks/results/work-startup: checkpoint 2.1 GB, cache and bundle
about 13 GB) is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
PRECAST = Path(sys.executable).with_name("precast")
IMAGE, TOKENS = 512, 77
FLOOR = 1.2
CHILD_TIMEOUT_S = 3600


# ---- the bundle ----------------------------------------------------------------------------
def ensure_bundle(work: Path) -> Path:
    """The full-size SD 1.5 OpenVINO CPU bundle (suite.py's recipe), built once into `work`."""
    from export_unet import ensure_checkpoint    # the same checkpoint as the export and suite benchmarks
    work = work.resolve()     # the recipe's paths are read relative to its own folder
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "bundle"
    if (bundle / "manifest.json").exists():
        print(f"reusing {bundle}", flush=True)
        return bundle
    ckpt = work / "sd15_random_fp16.safetensors"
    ensure_checkpoint(ckpt)
    recipe = work / "sd15-static512.yaml"
    recipe.write_text(
        "# written by benchmarks/startup.py (suite.py's recipe)\nname: sd15-startup\n"
        f"model:\n  source: {ckpt}\n"
        "components: [text_encoder, unet, vae_decoder]\nprecision: fp32\n"
        f"profiles:\n  batch: 1\n  height: {IMAGE}\n  width: {IMAGE}\n  tokens: {TOKENS}\n"
        "targets:\n  - openvino: {device: CPU}\n")
    env = {**os.environ, "PRECAST_CACHE": str(work / "cache"), "PRECAST_PROGRESS": "plain"}
    print(f"precast build {recipe} ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(PRECAST), "build", str(recipe), "--out", str(bundle)], env=env, cwd=ROOT,
                          timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"precast build failed (rc {proc.returncode})")
    print(f"  bundle in {time.perf_counter() - t0:.0f} s", flush=True)
    return bundle



# ---- the children (fresh processes) ----------------------------------------------------------
def child_precast(spec: dict) -> dict:
    """precast's runtime over the bundle. mode "first-image": Txt2Img as `generate` opens it (the VAE
    decoder loading in the background) + one 512x512 step to the image; "open": Txt2Img with every
    component loaded on return (lazy=False); "open-serial": the loop before this change, in the
    same process layout (select_all with sha256, then load_component one component after another)."""
    t_proc = time.perf_counter()
    from precast.runtime.pipeline import NEEDED, Txt2Img, requests
    out = {"import_s": time.perf_counter() - t_proc}
    verify = spec.get("verify", True)
    t0 = time.perf_counter()
    if spec["mode"] == "open-serial":
        from precast.runtime.assign import COMPONENT_MODULE, assign_modules
        from precast.runtime.devices import discover_devices
        from precast.runtime.manifest import read_manifest
        from precast.runtime.pipeline import bundle_tokenizers
        from precast.runtime.select import installed_backends, load_component, select_all
        m = read_manifest(spec["bundle"])
        devices = discover_devices("/", os.environ)
        placements = assign_modules(devices, None, None)
        installed = installed_backends()
        bundle_tokenizers(m, NEEDED["sd1"])
        t_sel = time.perf_counter()
        sels = select_all(m, placements, devices, requests(m, 1, IMAGE, IMAGE), installed, verify)
        out["select_verify_s"] = time.perf_counter() - t_sel
        out["load_s"] = {}
        for comp in NEEDED["sd1"]:
            t1 = time.perf_counter()
            load_component(sels[comp], [o["name"] for o in m.components[comp]["outputs"]])
            out["load_s"][comp] = time.perf_counter() - t1
        out["open_s"] = time.perf_counter() - t0
        return out
    pipe = Txt2Img(spec["bundle"], width=IMAGE, height=IMAGE, verify=verify, lazy=spec["mode"] == "first-image")
    out["open_s"] = time.perf_counter() - t0
    if spec["mode"] == "first-image":
        t1 = time.perf_counter()
        image = pipe("a photo of a cat", steps=1, seed=0, progress=False)
        out["first_image_s"] = time.perf_counter() - t1
        out["image_shape"] = list(image.shape)
        out["run_stages"] = pipe.run_stages
    pipe.wait_loaded()
    out["stages"] = pipe.stages
    out["where"] = {c: w["artifact"] for c, w in pipe.report()["components"].items()}
    out["bundle_to_first_image_s"] = time.perf_counter() - t_proc
    return out


def child_backend(spec: dict) -> dict:
    """OpenVINO alone, no precast code: import_model of each blob precast loads, one after another,
    with its recorded compile config. "mmap": the blob memory-mapped into an ov.Tensor (the
    backend's cheapest documented way; what precast's session does); "bytes": read into bytes
    first, as OpenVINO's import_model example does."""
    import numpy as np
    t_proc = time.perf_counter()
    import openvino as ov
    out = {"import_s": time.perf_counter() - t_proc, "load_s": {}}
    for comp, blob, config in spec["blobs"]:
        t0 = time.perf_counter()
        core = ov.Core()
        if spec["how"] == "mmap":
            data = np.memmap(blob, dtype=np.uint8, mode="c")
            cm = core.import_model(ov.Tensor(data, shared_memory=True), "CPU", config)
        else:
            with open(blob, "rb") as f:
                data = f.read()
            cm = core.import_model(data, "CPU", config)
        cm.create_infer_request()
        out["load_s"][comp] = time.perf_counter() - t0
        out.setdefault("keep", []).append(cm)
    out.pop("keep")
    out["sum_s"] = sum(out["load_s"].values())
    return out


CHILDREN = {"precast": child_precast, "backend": child_backend}


def run_child(kind: str, spec: dict, cold: str | None) -> dict:
    """One measurement in a fresh process; `cold`: "drop" (page cache dropped first) or None."""
    if cold == "drop":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)], capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S, cwd=ROOT, env={**os.environ, "PRECAST_PROGRESS": "off"})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def can_drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def fresh_copy(bundle: Path, dest: Path) -> Path:
    """A copy of the bundle with new inodes (not hard links), for a cold start without drop_caches."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(bundle, dest)
    return dest


def blobs(bundle: Path) -> list:
    """(component, blob path, compile config) of the OpenVINO artifact precast picks per component."""
    m = json.loads((bundle / "manifest.json").read_text())
    out = []
    for comp in ("text_encoder", "unet", "vae_decoder"):
        a = next(a for a in m["artifacts"] if a["component"] == comp and a["backend"] == "openvino")
        out.append((comp, str(bundle / a["entry"]), a["metadata"].get("compile_config", {})))
    return out


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        res = CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
        print(json.dumps(res, default=str))
        return
    if sys.argv[1:2] == ["--build-only"]:
        ensure_bundle(Path(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work-startup")
    ap.add_argument("--bundle", type=Path, help="an existing SD 1.5 OpenVINO CPU bundle (512x512) instead of building")
    ap.add_argument("--repeat", type=int, default=3, help="warm rounds (cold: --cold-repeat)")
    ap.add_argument("--cold-repeat", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "startup.json")
    opts = ap.parse_args()
    from machine import describe
    work = opts.work.resolve()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    try:
        bundle = opts.bundle.resolve() if opts.bundle else ensure_bundle(work)
        bl = blobs(bundle)
        drop = can_drop_caches()
        print(f"cold starts: {'page cache dropped (/proc/sys/vm/drop_caches)' if drop else 'a fresh copy of the bundle'}",
              flush=True)
        rows: dict[str, list] = {}

        def measure(label, kind, spec, cold=None):
            t0 = time.perf_counter()
            r = run_child(kind, spec, cold)
            rows.setdefault(label, []).append(r)
            print(f"  {label:<28} {time.perf_counter() - t0:6.1f} s wall  "
                  f"{json.dumps({k: v for k, v in r.items() if k in ('open_s', 'sum_s', 'first_image_s')}, default=str)}",
                  flush=True)

        b = str(bundle)
        # warm: page cache warm (read once before the first round); paired and interleaved
        run_child("backend", {"blobs": bl, "how": "mmap"}, None)
        # the bundle's first open hashes every file and records it (README, "Trust model"): once, apart
        measure("first open (hashes all)", "precast", {"bundle": b, "mode": "open"})
        for i in range(opts.repeat):
            print(f"warm round {i + 1}/{opts.repeat}", flush=True)
            measure("warm backend (mmap)", "backend", {"blobs": bl, "how": "mmap"})
            measure("warm open", "precast", {"bundle": b, "mode": "open"})
            measure("warm open, verify off", "precast", {"bundle": b, "mode": "open", "verify": False})
            measure("warm open, serial (before)", "precast", {"bundle": b, "mode": "open-serial"})
            measure("warm first image", "precast", {"bundle": b, "mode": "first-image"})
        # once, after the warm rounds: reading 7 GB into bytes pushes the bundle out of a small page cache
        measure("warm backend (bytes)", "backend", {"blobs": bl, "how": "bytes"})
        run_child("backend", {"blobs": bl, "how": "mmap"}, None)
        for i in range(opts.cold_repeat):
            print(f"cold round {i + 1}/{opts.cold_repeat}", flush=True)
            for label, kind, spec in (("cold backend (mmap)", "backend", {"blobs": bl, "how": "mmap"}),
                                      ("cold open", "precast", {"bundle": b, "mode": "open"}),
                                      ("cold first image", "precast", {"bundle": b, "mode": "first-image"})):
                if drop:
                    measure(label, kind, spec, "drop")
                else:
                    copy = fresh_copy(bundle, work / "cold-copy")
                    spec = {**spec, "bundle": str(copy), "blobs": blobs(copy)} if kind == "precast" else \
                        {**spec, "blobs": blobs(copy)}
                    measure(label, kind, spec)
        summary = summarize(rows)
        print_summary(summary, drop)
        out = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": describe(("numpy", "openvino")), "bundle": b,
               "blobs_mb": {c: round(Path(p).stat().st_size / 1e6, 1) for c, p, _ in bl},
               "cold_method": "drop_caches" if drop else "fresh copy", "summary": summary, "runs": rows}
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {opts.json}")
    finally:
        if not opts.keep and not opts.bundle:
            shutil.rmtree(work, ignore_errors=True)
        elif not opts.keep:
            shutil.rmtree(work / "cold-copy", ignore_errors=True)


def summarize(rows: dict) -> dict:
    s = {}
    for label, rs in rows.items():
        d = {"n": len(rs)}
        for key in ("open_s", "sum_s", "first_image_s", "bundle_to_first_image_s", "import_s", "select_verify_s"):
            if any(key in r for r in rs):
                d[key] = med(r.get(key) for r in rs)
        for group in ("load_s",):
            if any(group in r for r in rs):
                d[group] = {c: med(r[group][c] for r in rs) for c in rs[0][group]}
        if any("stages" in r for r in rs):
            st = {}
            for k, v in rs[0]["stages"].items():
                st[k] = {c: med(r["stages"][k][c] for r in rs) for c in v} if isinstance(v, dict) else \
                    med(r["stages"][k] for r in rs)
            d["stages"] = st
        if any("run_stages" in r for r in rs):
            d["run_stages"] = {k: med(r["run_stages"].get(k) for r in rs) for k in rs[0]["run_stages"]}
        s[label] = d
    for temp in ("warm", "cold"):
        o, bk = s.get(f"{temp} open"), s.get(f"{temp} backend (mmap)")
        if o and bk:
            pairs = [a["open_s"] / b["sum_s"] for a, b in zip(rows[f"{temp} open"], rows[f"{temp} backend (mmap)"])]
            s[f"{temp} ratio"] = {"open_over_backend_sum": med(pairs),     # median of the rounds' paired ratios
                                  "per_round": [round(x, 3) for x in pairs],
                                  "ratio_of_medians": round(o["open_s"] / bk["sum_s"], 3),
                                  "open_plus_imports_over_backend_sum_plus_import":
                                      round((o["open_s"] + o["import_s"]) / (bk["sum_s"] + bk["import_s"]), 3)}
    nv = s.get("warm open, verify off")
    if nv and s.get("warm backend (mmap)"):
        s["warm ratio"]["verify_off_open_over_backend_sum"] = round(nv["open_s"] / s["warm backend (mmap)"]["sum_s"], 3)
    if s.get("warm ratio"):
        s["floor"] = {"limit": FLOOR, "met": s["warm ratio"]["open_over_backend_sum"] <= FLOOR}
    return s


def print_summary(s: dict, drop: bool) -> None:
    print("\n" + "=" * 96)
    print("medians, seconds (fresh process each; open = Txt2Img() from the bundle folder, after the runtime's imports)")
    for label, d in s.items():
        if "n" not in d:
            continue
        main_ = d.get("open_s", d.get("sum_s"))
        extra = ""
        if "load_s" in d:
            extra += "  loads " + ", ".join(f"{c} {v:.2f}" for c, v in d["load_s"].items())
        if "stages" in d:
            st = d["stages"]
            extra += ("  | " + ", ".join(f"{k} {v:.2f}" for k, v in st.items() if isinstance(v, (int, float)))
                      + "; verify " + ", ".join(f"{c} {v:.2f}" for c, v in st["verify"].items() if v is not None)
                      + "; load " + ", ".join(f"{c} {v:.2f}" for c, v in st["load"].items() if v is not None))
        if "first_image_s" in d:
            extra += f"  | first image {d['first_image_s']:.2f} {d.get('run_stages')}; bundle->image " \
                     f"{d['bundle_to_first_image_s']:.2f}"
        print(f"{label:<28} n={d['n']} {main_:7.2f} (imports {d.get('import_s', 0):.2f}){extra}")
    for temp in ("warm", "cold"):
        if f"{temp} ratio" in s:
            print(f"{temp} ratio: {json.dumps(s[f'{temp} ratio'])}")
    if "floor" in s:
        print(f"floor: warm open <= {FLOOR}x the backend's own loads: {'MET' if s['floor']['met'] else 'NOT MET'}")
    if not drop:
        print("(cold = a fresh copy of the bundle: the OS may still hold its pages; no drop_caches here)")


if __name__ == "__main__":
    main()
