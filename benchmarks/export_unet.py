"""Benchmark: exporting the SD 1.5 UNet to ONNX with precast vs. diffusers + torch.onnx.export.

What it measures, in one run:

1. A full-size SD 1.5 single-file checkpoint (real LDM key layout, deterministic random fp16
   weights, ~2.1 GB) is written once into the work folder and reused while it still matches.
2. precast: `precast export CKPT --component unet` in a fresh process, for --dtype fp32 and
   --dtype fp16: wall time of the process and its own peak RSS (VmHWM at its exit); --repeat
   runs each (default 3) and reports the median time (disk writeback on a VM is noisy).
3. Peer: in a fresh process, diffusers' UNet2DConditionModel (SD 1.5 config) is built, loaded
   with the same weights through diffusers' LDM converter, and exported by torch.onnx.export
   (the classic TorchScript exporter, dynamo=False; the default dynamo exporter only if the
   classic one fails). Build+load and export are timed separately; peak RSS as above.
4. Both fp32 exports run in ONNX Runtime (CPU) on one small input; the relative difference
   max|ours - peer| / max|peer| is reported (the fp16 export too, against the peer's fp32).
5. A table with speed ratios (peer build+load+export / precast wall time) and PASS/FAIL for
   the floors (>= 10x faster, peak RSS <= 1.5 GB), and a JSON file with every number and a
   description of the machine.

Usage: .venv/bin/python benchmarks/export_unet.py [--work DIR] [--json OUT] [--repeat N]
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

from machine import describe  # benchmarks/machine.py, beside this script

import numpy as np

HERE = Path(__file__).resolve().parent
SPEED_FLOOR = 10.0              # precast at least 10x faster than the peer
RSS_FLOOR_MB = 1.5 * 1024       # peak RSS at most 1.5 GB (MB here = MiB = 1024 KiB)
PARITY_TOL = {"fp32": 1e-4, "fp16": 2e-2}

# The SD 1.5 UNet as diffusers describes it.
SD15_UNET_CONFIG = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=[320, 640, 1280, 1280], cross_attention_dim=768, attention_head_dim=8,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, norm_num_groups=32)


# ---- the checkpoint ---------------------------------------------------------------------
def _checkpoint_matches(path: Path) -> bool:
    """True if `path` holds exactly the SD 1.5 layout in fp16 and is exactly as long as its header says."""
    from precast.compiler.demo_model import EXTRA_TENSORS, SD15, sd1_layout
    from precast.compiler.errors import BadInput
    from precast.compiler.sources.safetensors_file import SafetensorsFile
    try:
        f = SafetensorsFile(path)
    except BadInput:
        return False
    try:
        want = {k: tuple(s) for k, s in sd1_layout(SD15).items()}
        want.update({k: a.shape for k, a in EXTRA_TENSORS.items()})
        got = {k: t.shape for k, t in f.tensors.items()}
        fp16 = all(f.tensors[k].dtype == "F16" for k in sd1_layout(SD15))
        end = max(t.end for t in f.tensors.values())
        return got == want and fp16 and end == path.stat().st_size
    finally:
        f.close()


def ensure_checkpoint(path: Path) -> float:
    """Write the SD 1.5 checkpoint unless a matching one is already there; returns seconds spent."""
    if path.exists() and _checkpoint_matches(path):
        print(f"reusing {path} ({path.stat().st_size / 1e9:.2f} GB)")
        return 0.0
    from precast.compiler.demo_model import SD15, random_tensor, sd1_layout, write_safetensors
    print(f"writing {path} (full-size SD 1.5, random fp16 weights) ...", flush=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    write_safetensors(str(path), sd1_layout(SD15), "fp16", lambda k, s: random_tensor(rng, k, s))
    seconds = time.perf_counter() - t0
    print(f"  {path.stat().st_size / 1e9:.2f} GB in {seconds:.0f} s")
    return seconds


# ---- running a measured child -----------------------------------------------------------
# Runs a module or script in the child and, at its exit, writes the child's own peak RSS
# (VmHWM, KiB) to a file. Not ru_maxrss: Linux carries the high-water mark of the memory the
# process had before exec() into it, and Python starts children with vfork, so ru_maxrss
# (from getrusage in the child or wait4 in the parent) is at least the parent's own peak.
PEAK_WRAPPER = """
import atexit, re, runpy, sys
peak_file, kind, target = sys.argv[1:4]
def _write_peak():
    status = open("/proc/self/status").read()
    open(peak_file, "w").write(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
atexit.register(_write_peak)
sys.argv = [target, *sys.argv[4:]]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, target.rsplit("/", 1)[0])  # the script's folder, as `python script` would
    runpy.run_path(target, run_name="__main__")
"""


def run_measured(kind: str, target: str, args: list[str], log: Path) -> dict:
    """Run module or script `target` with `args` in a fresh process (output to `log`, page
    cache writeback settled first); its wall time and its own peak RSS in MB (MiB)."""
    os.sync()  # do not bill one run for the writeback of the files the previous one wrote
    peak_file = log.with_suffix(".peak")
    peak_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", PEAK_WRAPPER, str(peak_file), kind, target, *args]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parent).returncode
    wall = time.perf_counter() - t0
    peak = int(peak_file.read_text()) / 1024 if peak_file.exists() else None
    return {"cmd": [target, *args], "rc": rc, "wall_s": round(wall, 2),
            "peak_rss_mb": None if peak is None else round(peak, 1), "log": str(log)}


def _tail(log: str, n: int = 30) -> str:
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-n:])


def run_precast_once(ckpt: Path, out: Path, dtype: str, log: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    args = ["export", str(ckpt), "--component", "unet", "--out", str(out), "--dtype", dtype, "--json"]
    res = run_measured("module", "precast.compiler.cli", args, log)
    if res["rc"] != 0:
        raise SystemExit(f"precast export failed (rc {res['rc']}):\n{_tail(res['log'])}")
    text = log.read_text()
    report = json.loads(text[text.index("{"):])   # --json prints the report on stdout
    res["reported_s"] = report["seconds"]
    res["onnx"] = str(out / "unet" / "model.onnx")
    res["bytes"] = sum(report["components"][0]["files"].values())
    return res


def run_precast(ckpt: Path, out: Path, dtype: str, logs: Path, repeat: int) -> dict:
    """`repeat` runs (disk writeback on a VM is noisy): the median wall time, the highest peak."""
    print(f"precast export --dtype {dtype} ...", flush=True)
    runs = []
    for i in range(repeat):
        runs.append(run_precast_once(ckpt, out, dtype, logs / f"precast_{dtype}_{i}.log"))
        print(f"  {runs[-1]['wall_s']:.1f} s, peak RSS {runs[-1]['peak_rss_mb']:.0f} MB", flush=True)
    by_time = sorted(runs, key=lambda r: r["wall_s"])
    res = dict(by_time[(len(runs) - 1) // 2])      # the median run (the lower one for an even count)
    res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    res["runs"] = [{"wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"]} for r in runs]
    return res


def run_peer(ckpt: Path, out: Path, logs: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    timings = out / "timings.json"
    args = ["--peer-child", str(ckpt), str(out), str(timings)]
    print("peer: diffusers UNet2DConditionModel + torch.onnx.export ...", flush=True)
    res = run_measured("path", str(Path(__file__).resolve()), args, logs / "peer.log")
    if res["rc"] != 0:
        raise SystemExit(f"peer export failed (rc {res['rc']}):\n{_tail(res['log'])}")
    res.update(json.loads(timings.read_text()))
    res["bytes"] = sum(p.stat().st_size for p in out.iterdir() if p.name != "timings.json")
    res["files"] = sum(1 for p in out.iterdir() if p.name != "timings.json")
    print(f"  build+load {res['build_load_s']:.1f} s, export {res['export_s']:.1f} s ({res['exporter']}), "
          f"peak RSS {res['peak_rss_mb']:.0f} MB")
    return res


# ---- the peer, run inside its own process -----------------------------------------------
def peer_child(ckpt: str, out: str, timings: str) -> None:
    """Build + load the diffusers UNet from the single file, then torch.onnx.export it."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    from safetensors.torch import load_file

    class Wrapped(torch.nn.Module):  # plain tensor out, for the exporter
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states):
            return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

    t0 = time.perf_counter()
    unet = UNet2DConditionModel(**SD15_UNET_CONFIG)
    sd = {k: v.float() for k, v in load_file(ckpt).items() if v.is_floating_point()}
    unet.load_state_dict(convert_ldm_unet_checkpoint(sd, SD15_UNET_CONFIG), strict=True)
    del sd
    model = Wrapped(unet.eval()).eval()
    build_load = time.perf_counter() - t0

    args = (torch.randn(1, 4, 64, 64), torch.tensor([500.0]), torch.randn(1, 77, 768))
    common = dict(input_names=["sample", "timestep", "encoder_hidden_states"], output_names=["out_sample"],
                  opset_version=17, dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"},
                                                  "timestep": {0: "steps"},
                                                  "encoder_hidden_states": {0: "batch", 1: "sequence"},
                                                  "out_sample": {0: "batch", 2: "height", 3: "width"}})
    path = os.path.join(out, "model.onnx")
    t1 = time.perf_counter()
    try:
        with torch.no_grad():
            torch.onnx.export(model, args, path, dynamo=False, **common)
        exporter, classic_error = "torchscript (dynamo=False)", None
    except Exception as e:  # the classic exporter may be gone in a newer torch
        classic_error = f"{type(e).__name__}: {e}"
        print(f"classic exporter failed: {classic_error}; trying the dynamo exporter", flush=True)
        for p in Path(out).iterdir():
            p.unlink()
        t1 = time.perf_counter()
        with torch.no_grad():
            torch.onnx.export(model, args, path, dynamo=True, external_data=True, **common)
        exporter = "dynamo (default)"
    export = time.perf_counter() - t1
    Path(timings).write_text(json.dumps({
        "build_load_s": round(build_load, 2), "export_s": round(export, 2),
        "total_s": round(build_load + export, 2), "exporter": exporter, "classic_error": classic_error,
        "onnx": path, "torch_threads": torch.get_num_threads()}))


# ---- parity -----------------------------------------------------------------------------
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(double)": np.float64}


def run_onnx(path: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Run one model on CPU, each input cast to the dtype the model declares; output as float32."""
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    typed = {i.name: feeds[i.name].astype(ORT_DTYPES[i.type]) for i in sess.get_inputs()}
    out = sess.run(None, typed)[0].astype(np.float32)
    del sess
    return out


def parity(ours: dict[str, str], peer_onnx: str) -> dict:
    rng = np.random.default_rng(1)
    feeds = {"sample": rng.standard_normal((1, 4, 32, 32)).astype(np.float32),
             "timestep": np.array([500.0], np.float32),
             "encoder_hidden_states": rng.standard_normal((1, 77, 768)).astype(np.float32)}
    print("parity in onnxruntime (sample [1,4,32,32]) ...", flush=True)
    ref = run_onnx(peer_onnx, feeds).astype(np.float64)
    result = {}
    for dtype, path in ours.items():
        try:
            a = run_onnx(path, feeds)
            err = float(np.abs(a - ref).max() / np.abs(ref).max())
            result[dtype] = {"rel_err": err, "tol": PARITY_TOL[dtype], "ok": err <= PARITY_TOL[dtype]}
        except Exception as e:  # e.g. an fp16 kernel missing on CPU
            result[dtype] = {"rel_err": None, "error": f"{type(e).__name__}: {e}", "ok": False}
        print(f"  precast {dtype} vs peer fp32: {result[dtype]}")
    return result


# ---- machine and report -----------------------------------------------------------------
def machine() -> dict:
    return describe(("precast", "numpy", "onnx", "onnxruntime", "torch", "diffusers", "safetensors"))


def summarize(precast_runs: dict[str, dict], peer: dict) -> list[dict]:
    rows = [{"tool": "peer: diffusers + torch.onnx.export, fp32",
             "time_s": peer["total_s"], "wall_s": peer["wall_s"], "peak_rss_mb": peer["peak_rss_mb"],
             "detail": f"build+load {peer['build_load_s']:.1f} s + export {peer['export_s']:.1f} s; "
                       f"exporter: {peer['exporter']}"}]
    for dtype, r in precast_runs.items():
        speed = peer["total_s"] / r["wall_s"]
        rows.append({"tool": f"precast export --dtype {dtype}", "time_s": r["wall_s"], "wall_s": r["wall_s"],
                     "peak_rss_mb": r["peak_rss_mb"], "speedup": round(speed, 1),
                     "speedup_wall": round(peer["wall_s"] / r["wall_s"], 1),
                     "speed_floor": "PASS" if speed >= SPEED_FLOOR else "FAIL",
                     "rss_floor": "PASS" if r["peak_rss_mb"] <= RSS_FLOOR_MB else "FAIL",
                     "detail": f"median of {len(r['runs'])} process wall times "
                               f"({', '.join(str(x['wall_s']) for x in r['runs'])} s)"})
    return rows


def print_table(rows: list[dict], par: dict) -> None:
    head = f"{'tool':<44} {'time (s)':>9} {'peak RSS (MB)':>14} {'speed ratio':>12}  {'>=10x':>5} {'<=1.5GB':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        ratio = f"{r['speedup']:.1f}x" if "speedup" in r else "1.0x"
        print(f"{r['tool']:<44} {r['time_s']:>9.1f} {r['peak_rss_mb']:>14.0f} {ratio:>12}  "
              f"{r.get('speed_floor', ''):>5} {r.get('rss_floor', ''):>7}")
        print(f"    {r['detail']}")
    print("speed ratio = peer (build+load+export, torch import excluded) / precast process wall time")
    print("process wall times (interpreter start and imports included): "
          + ", ".join(f"{r['tool'].split(',')[0]} {r['wall_s']:.1f} s" for r in rows))
    for dtype, p in par.items():
        err = "n/a (" + p.get("error", "") + ")" if p["rel_err"] is None else f"{p['rel_err']:.2e}"
        print(f"parity precast {dtype} vs peer: max|a-b|/max|b| = {err}  (tol {PARITY_TOL[dtype]:g}) "
              f"{'PASS' if p['ok'] else 'FAIL'}")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--peer-child":
        peer_child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work", help="checkpoint, exports, logs")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "export_unet.json", help="results file")
    ap.add_argument("--repeat", type=int, default=3, help="precast runs per dtype; the median is reported")
    opts = ap.parse_args()
    work = opts.work.resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    ckpt = work / "sd15_random_fp16.safetensors"
    write_s = ensure_checkpoint(ckpt)
    ours = {d: run_precast(ckpt, work / f"precast_{d}", d, logs, opts.repeat) for d in ("fp32", "fp16")}
    peer = run_peer(ckpt, work / "peer", logs)
    par = parity({d: r["onnx"] for d, r in ours.items()}, peer["onnx"])
    rows = summarize(ours, peer)
    print_table(rows, par)

    results = {"machine": machine(), "checkpoint": {"path": str(ckpt), "bytes": ckpt.stat().st_size,
                                                    "write_s": round(write_s, 1)},
               "floors": {"speedup_min": SPEED_FLOOR, "peak_rss_max_mb": RSS_FLOOR_MB},
               "precast": ours, "peer": peer, "parity": par, "table": rows,
               "note": "page cache warm for every run (the checkpoint was just written or read)"}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {opts.json}")


if __name__ == "__main__":
    main()
