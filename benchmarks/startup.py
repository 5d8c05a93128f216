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

Flux slice (`--flux-slice`; `--no-sd15` runs it alone): a full-size Flux bundle cannot be built on a
24 GB machine: the 12 B transformer's bf16 weights alone are 23.8 GB (flux_export.json:
parts.flux-bf16.source.bytes; RAM 23.5 GiB), OpenVINO compiles it from weights held in memory, at the
f32 precision it picks on a CPU without AMX (47.6 GB of weights; the slice below, 1.03 B parameters,
peaks at 11.9 GB RSS loading its 4.1 GB f32 blob: flux_step_final.json), and ONNX Runtime's CPU
provider has no bf16 kernels. So the part builds flux_step.py's full-width slice (hidden 3072, 24
heads, 2 double + 2 single blocks, bf16 bare BFL file, 512x512 = 1024 image tokens + 512 T5 tokens;
its functions, imported) into a transformer-only bundle for the OpenVINO CPU target (`precast build`,
--flux-dtype fp32 by default as flux_step's headline) and measures, each in a fresh process: the
stages (manifest, discover, select, verify, load) and one transformer step; first open after the
build (its verification records: nothing hashed), an open with --verify full (every file of the
artifact hashed: what a first open cost before), warm opens, and cold opens (page cache dropped, else
a fresh copy, whose new inodes void the records: hashed again); each against OpenVINO's own
import_model of the same blob (+ its first inference), paired and interleaved.

Usage: .venv/bin/python benchmarks/startup.py [--work DIR] [--repeat N] [--no-verify-run] [--keep]
           [--bundle EXISTING_BUNDLE] [--json OUT] [--flux-slice [--no-sd15] [--flux-dtype fp32|bf16]]
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
    from precast.runtime.families.sd import NEEDED, requests
    from precast.runtime.families.sd import Txt2Img
    out = {"import_s": time.perf_counter() - t_proc}
    verify = spec.get("verify", True)
    t0 = time.perf_counter()
    if spec["mode"] == "open-serial":
        from precast.runtime.assign import COMPONENT_MODULE, assign_modules
        from precast.runtime.devices import discover_devices
        from precast.runtime.manifest import read_manifest
        from precast.runtime.text_encoders import bundle_tokenizers
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


# ---- the Flux slice part ----------------------------------------------------------------------
FLUX_STEP_INPUTS = "flux_inputs.npz"


def ensure_flux_bundle(work: Path, dtype: str) -> Path:
    """flux_step.py's full-width Flux slice as a transformer-only OpenVINO CPU bundle, built once."""
    import numpy as np
    from flux_step import make_inputs, write_checkpoints    # benchmarks/flux_step.py: the same slice and inputs
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "flux-bundle"
    if not (work / FLUX_STEP_INPUTS).exists():
        np.savez(work / FLUX_STEP_INPUTS, **make_inputs("flux"))
    if (bundle / "manifest.json").exists():
        print(f"reusing {bundle}", flush=True)
        return bundle
    files = write_checkpoints("flux", work / "ckpt")
    print(f"flux slice checkpoint in {files['write_s']} s", flush=True)
    recipe = work / "flux-slice.yaml"
    recipe.write_text(
        "# written by benchmarks/startup.py --flux-slice (benchmarks/flux_step.py's slice)\nname: flux-slice-startup\n"
        f"model:\n  source: {files['checkpoint']}\n"
        f"components: [transformer]\nprecision: {dtype}\n"
        f"profiles:\n  batch: 1\n  height: {IMAGE}\n  width: {IMAGE}\n  t5_tokens: 512\n"
        "targets:\n  - openvino: {device: CPU}\n")
    env = {**os.environ, "PRECAST_CACHE": str(work / "cache"), "PRECAST_PROGRESS": "plain"}
    print(f"precast build {recipe} ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(PRECAST), "build", str(recipe), "--out", str(bundle)], env=env, cwd=ROOT,
                          timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"precast build failed (rc {proc.returncode})")
    print(f"  bundle in {time.perf_counter() - t0:.0f} s", flush=True)
    shutil.rmtree(work / "ckpt", ignore_errors=True)        # the checkpoint is not needed past the build
    return bundle


def child_flux(spec: dict) -> dict:
    """precast's runtime over the transformer-only bundle, stage by stage, as the pipeline opens a
    component (discover devices and backends, select, verify the chosen artifact through the
    records, load), then one transformer step on flux_step's inputs. Bytes hashed are counted."""
    t_proc = time.perf_counter()
    import numpy as np
    from precast.runtime.assign import assign_modules
    from precast.runtime.devices import discover_devices
    from precast.runtime.manifest import bytes_hashed, read_manifest
    from precast.runtime.families.sd import requests
    from precast.runtime.select import installed_backends, load_component, select_all
    out = {"import_s": time.perf_counter() - t_proc, "stages": {}}
    st = out["stages"]
    t0 = time.perf_counter()
    m = read_manifest(spec["bundle"])
    st["manifest"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    devices = discover_devices("/", os.environ)
    placements = assign_modules(devices, None, None)
    installed = installed_backends()
    st["discover"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    sels = select_all(m, placements, devices, requests(m, 1, IMAGE, IMAGE), installed, False)
    st["select"] = time.perf_counter() - t1
    sel = sels["transformer"]
    choice = sel.viable[0]
    t1 = time.perf_counter()
    hashed0 = bytes_hashed()
    checked = m.with_verify(spec.get("verify", "auto"))
    problem = next((p for rel in (choice.artifact.files if choice.artifact else m.components["transformer"]["files"])
                    if (p := checked.verify_file(rel))), None)
    checked.save_records()
    st["verify"] = time.perf_counter() - t1
    out["hashed_bytes"] = bytes_hashed() - hashed0
    if problem:
        raise SystemExit(problem)
    t1 = time.perf_counter()
    session, cand, _ = load_component(sel, [o["name"] for o in m.components["transformer"]["outputs"]])
    st["load"] = time.perf_counter() - t1
    out["open_s"] = time.perf_counter() - t0
    out["artifact"] = cand.artifact.id if cand.artifact else "onnx"
    feeds = dict(np.load(spec["inputs"]))
    t1 = time.perf_counter()
    session.run(feeds)
    out["first_step_s"] = time.perf_counter() - t1
    out["open_plus_step_s"] = out["open_s"] + out["first_step_s"]
    return out


def child_flux_backend(spec: dict) -> dict:
    """OpenVINO alone on the same blob: import_model (memory-mapped, its recorded compile config) +
    an infer request, then one inference on the same inputs."""
    import numpy as np
    t_proc = time.perf_counter()
    import openvino as ov
    out = {"import_s": time.perf_counter() - t_proc}
    _, blob, config = spec["blobs"][0]
    t0 = time.perf_counter()
    data = np.memmap(blob, dtype=np.uint8, mode="c")
    cm = ov.Core().import_model(ov.Tensor(data, shared_memory=True), "CPU", config)
    req = cm.create_infer_request()
    out["sum_s"] = out["load_s"] = time.perf_counter() - t0
    feeds = dict(np.load(spec["inputs"]))
    types = {p.get_any_name(): p.get_element_type() for p in cm.inputs}
    typed = {k: np.ascontiguousarray(v, dtype=np.dtype(types[k].to_dtype())) for k, v in feeds.items() if k in types}
    t1 = time.perf_counter()
    req.infer(typed)
    out["first_step_s"] = time.perf_counter() - t1
    out["open_plus_step_s"] = out["load_s"] + out["first_step_s"]
    return out


def flux_blob(bundle: Path) -> list:
    m = json.loads((bundle / "manifest.json").read_text())
    a = next(a for a in m["artifacts"] if a["component"] == "transformer" and a["backend"] == "openvino")
    return [("transformer", str(bundle / a["entry"]), a["metadata"].get("compile_config", {}))]


def run_flux_part(work: Path, dtype: str, repeat: int, cold_repeat: int, drop: bool) -> dict:
    bundle = ensure_flux_bundle(work, dtype)
    inputs = str(work.resolve() / FLUX_STEP_INPUTS)
    bl = flux_blob(bundle)
    rows: dict[str, list] = {}

    def measure(label, kind, spec, cold=None):
        t0 = time.perf_counter()
        r = run_child(kind, {**spec, "inputs": inputs}, cold)
        rows.setdefault(label, []).append(r)
        print(f"  {label:<34} {time.perf_counter() - t0:6.1f} s wall  " + json.dumps(
            {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
             if k in ("open_s", "load_s", "first_step_s", "hashed_bytes")}), flush=True)

    b = str(bundle)
    # the first open after `precast build`: the build's verification records stand for the hashes
    measure("first open after build", "flux", {"bundle": b})
    measure("open, verify full", "flux", {"bundle": b, "verify": "full"})
    for i in range(repeat):
        print(f"flux warm round {i + 1}/{repeat}", flush=True)
        measure("warm backend (mmap)", "flux-backend", {"blobs": bl})
        measure("warm open", "flux", {"bundle": b})
    for i in range(cold_repeat):
        print(f"flux cold round {i + 1}/{cold_repeat}", flush=True)
        if drop:
            measure("cold backend (mmap)", "flux-backend", {"blobs": bl}, "drop")
            measure("cold open", "flux", {"bundle": b}, "drop")
        else:
            copy = fresh_copy(bundle, work / "flux-cold-copy")
            measure("cold backend (mmap)", "flux-backend", {"blobs": flux_blob(copy)})
            copy = fresh_copy(bundle, work / "flux-cold-copy")
            measure("cold open", "flux", {"bundle": str(copy)})
    summary = {}
    for label, rs in rows.items():
        d = {"n": len(rs)}
        for key in ("open_s", "load_s", "first_step_s", "open_plus_step_s", "import_s", "hashed_bytes"):
            if any(key in r for r in rs):
                d[key] = med(r.get(key) for r in rs)
        if any("stages" in r for r in rs):
            d["stages"] = {k: med(r["stages"][k] for r in rs) for k in rs[0]["stages"]}
        summary[label] = d
    for temp in ("warm", "cold"):
        o, bk = rows.get(f"{temp} open"), rows.get(f"{temp} backend (mmap)")
        if o and bk:
            summary[f"{temp} ratio"] = {
                "open_over_backend_load": med(a["open_s"] / x["load_s"] for a, x in zip(o, bk)),
                "open_plus_step_over_backend": med(a["open_plus_step_s"] / x["open_plus_step_s"]
                                                   for a, x in zip(o, bk))}
    print_flux_summary(summary, drop)
    return {"bundle": b, "dtype": dtype, "blob_mb": round(Path(bl[0][1]).stat().st_size / 1e6, 1),
            "bundle_mb": round(sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) / 1e6, 1),
            "cold_method": "drop_caches" if drop else "fresh copy", "summary": summary, "runs": rows}


def print_flux_summary(s: dict, drop: bool) -> None:
    print("\n" + "=" * 96)
    print("Flux slice (OpenVINO CPU, transformer only): medians, seconds, fresh process each")
    print(f"{'':<26}{'manifest':>9}{'discover':>9}{'select':>8}{'verify':>8}{'load':>8}{'open':>8}"
          f"{'1st step':>9}{'hashed MB':>10}")
    for label, d in s.items():
        if "n" not in d:
            continue
        st = d.get("stages", {})
        cells = [st.get(k) for k in ("manifest", "discover", "select", "verify")] + \
                [st.get("load", d.get("load_s")), d.get("open_s", d.get("load_s")), d.get("first_step_s")]
        hashed = d.get("hashed_bytes")
        print(f"{label:<26}" + "".join(f"{c:>{w}.3f}" if c is not None else f"{'-':>{w}}"
                                        for c, w in zip(cells, (9, 9, 8, 8, 8, 8, 9)))
              + (f"{hashed / 1e6:>10.0f}" if hashed is not None else f"{'-':>10}"))
    for temp in ("warm", "cold"):
        if f"{temp} ratio" in s:
            print(f"{temp} ratio: {json.dumps(s[f'{temp} ratio'])}")
    if not drop:
        print("(cold = a fresh copy of the bundle: new inodes, so its records do not apply and it is hashed)")


CHILDREN = {"precast": child_precast, "backend": child_backend, "flux": child_flux,
            "flux-backend": child_flux_backend}


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
    ap.add_argument("--json", type=Path, default=None, help="default results/startup.json "
                    "(results/startup_flux_slice.json with --no-sd15)")
    ap.add_argument("--flux-slice", action="store_true", help="also the Flux slice part (see the docstring)")
    ap.add_argument("--no-sd15", action="store_true", help="skip the SD 1.5 part (with --flux-slice)")
    ap.add_argument("--flux-dtype", choices=["fp32", "bf16"], default="fp32", help="the slice's export precision")
    opts = ap.parse_args()
    if opts.json is None:
        opts.json = HERE / "results" / ("startup_flux_slice.json" if opts.no_sd15 else "startup.json")
    if opts.no_sd15 and not opts.flux_slice:
        ap.error("--no-sd15 leaves nothing to run: add --flux-slice")
    if opts.no_sd15:
        return flux_only(opts)
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
        flux = run_flux_part(work, opts.flux_dtype, opts.repeat, opts.cold_repeat, drop) if opts.flux_slice else None
        out = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": describe(("numpy", "openvino")), "bundle": b,
               "blobs_mb": {c: round(Path(p).stat().st_size / 1e6, 1) for c, p, _ in bl},
               "cold_method": "drop_caches" if drop else "fresh copy", "summary": summary, "runs": rows,
               **({"flux_slice": flux} if flux else {})}
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {opts.json}")
    finally:
        if not opts.keep and not opts.bundle:
            shutil.rmtree(work, ignore_errors=True)
        elif not opts.keep:
            shutil.rmtree(work / "cold-copy", ignore_errors=True)


def flux_only(opts) -> None:
    from machine import describe
    work = opts.work.resolve()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    try:
        drop = can_drop_caches()
        part = run_flux_part(work, opts.flux_dtype, opts.repeat, opts.cold_repeat, drop)
        out = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": describe(("numpy", "openvino")), "flux_slice": part}
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {opts.json}")
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


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
