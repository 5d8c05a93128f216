"""Graph quality at full width: one SD3.5-large MMDiT step (a 2-block slice), precast's OpenVINO engine vs
every peer on the same weights, one run.

Model (seeded random weights written by compiler/demo_sd3.py into the work folder): SD3.5-large at full width
(hidden 2432, 38 heads of 64, QK norm), 2 joint blocks (the second with SAI's pre-only context block, as the
last block of the full model) plus the embedders and the final layer (write_sd3_checkpoint with depth=2: a bare
SAI-layout file, bf16). A 1024x1024 image: 128x128 latents, 16 channels -> 4096 image tokens (patch 2), + 333
text tokens (77 CLIP + 256 T5), batch 1.

Runners, each in a fresh process, 2 threads (this machine's cores), one warm-up call then --steps timed calls,
median reported; everything but the SD3 parts is benchmarks/flux_step.py's, imported (its runner children,
timing, GEMM peak, parity, floor and report):

  precast              `precast export --dtype fp32` then `precast compile --target openvino --height 1024
                       --width 1024 --tokens 77 --t5-tokens 256` (a static profile, the target's precision:
                       f32 on this CPU, no AMX), the blob opened with the runtime's OpenVinoSession
  torch                diffusers SD3Transformer2DModel with the same file's weights (tests/reference_sd3.py:
                       diffusers' own SD3 single-file converter, strict load), PyTorch eager fp32
  onnxruntime          ONNX Runtime CPU (ORT_ENABLE_ALL) on a torch.onnx.export of that fp32 model (dynamo
                       exporter, opset 18, when onnxscript is importable, else TorchScript opset 17; static
                       shapes). onnxscript is not in the project's venv: put it on PYTHONPATH, e.g.
                       `pip install --target DIR --no-deps onnxscript onnx-ir` and PYTHONPATH=DIR
  openvino-f32         OpenVINO on that ONNX, read_model + compile_model, INFERENCE_PRECISION_HINT=f32
  openvino-f32-static  the same, reshaped to the run's static shapes first (as precast compiles)
  (--runners can add flux_step's others: torch-bf16, openvino (default config: bf16 on this CPU), and
   precast-fp32-bf16 / precast-bf16 / precast-bf16-bf16)

Outputs are compared with PyTorch fp32: max|x - ref| / max|ref| (an f32 runner counts within 1e-3).
FLOPs are counted analytically (2 per multiply-add): every Linear (patch embedding, context embedder, the
qkv / proj / MLP GEMMs of both streams, the modulation and embedder GEMVs, the final layer) and the joint
attention's two matmuls over all 4429 tokens in both blocks (as diffusers computes it; in the last block the
context rows' outputs are discarded, ~7% of that block's attention). The GEMM peak is measured in the same run
(flux_step.gemm_peak: 4096^3 torch / numpy / OpenVINO FullyConnected, at the start and the end, best taken);
% of peak = FLOP / time / peak at the runner's compute precision. The bound: FLOP / f32 peak is the shortest
time any f32 runner can take, so the largest speedup any engine can have over a peer is peer time / bound.

Floor (the issue): precast >= 1.2x the best correct peer.

Usage: PYTHONPATH=DIR .venv/bin/python benchmarks/sd3_step.py [--steps N] [--runners a,b,...] [--no-profile]
           [--exporter auto|dynamo|torchscript] [--work DIR] [--keep] [--json OUT] [--small]
       (--small: 256x256 px and 16+16 text tokens, to try the script in a minute; not a measurement)
The work folder (checkpoint, exports, engine, torch ONNX: ~8 GB at peak) is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import flux_step as fs  # noqa: E402  (benchmarks/flux_step.py: children, timing, GEMM peak, parity, report)
from machine import describe  # noqa: E402

MODEL = "sd3"
SIZE = {"image": 1024, "clip_tokens": 77, "t5_tokens": 256}     # --small changes these
DEFAULT_RUNNERS = "precast,torch,onnxruntime,openvino-f32,openvino-f32-static"


def sd3_cfg():
    from precast.compiler.demo_sd3 import SD35_LARGE
    return dataclasses.replace(SD35_LARGE, depth=2)


def tokens() -> tuple[int, int]:
    lat = SIZE["image"] // 8
    return (lat // 2) ** 2, SIZE["clip_tokens"] + SIZE["t5_tokens"]


# ---- the SD3 parts flux_step's run_model calls (patched in below) ----------------------------------
def make_inputs(model: str) -> dict[str, np.ndarray]:
    if model != MODEL:
        return _orig["make_inputs"](model)
    rng = np.random.default_rng(13)
    c, lat = sd3_cfg(), SIZE["image"] // 8
    return {"hidden_states": rng.standard_normal((1, c.in_channels, lat, lat)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, tokens()[1], c.context_dim)).astype(np.float32),
            "pooled_projections": rng.standard_normal((1, c.pooled_dim)).astype(np.float32),
            "timestep": np.array([750.0], np.float32)}          # sigma 0.75 x 1000, as the runtime feeds it


def count_flops(model: str) -> dict:
    """GFLOP (2 per multiply-add) of one call: Linears (GEMMs and the modulation / embedder GEMVs) and attention."""
    if model != MODEL:
        return _orig["count_flops"](model)
    c = sd3_cfg()
    h, mlp = c.hidden, c.mlp_hidden
    n_img, n_txt = tokens()
    seq = n_img + n_txt
    gemv = 2 * (256 * h + h * h) + 2 * (c.pooled_dim * h + h * h)          # t_embedder, y_embedder
    lin = 2 * n_img * c.in_channels * c.patch ** 2 * h + 2 * n_txt * c.context_dim * h   # x_embedder, context_embedder
    full = 3 * h * h + h * h + 2 * h * mlp                                     # qkv, proj, fc1, fc2 per token
    for n in range(c.depth):
        last = n == c.depth - 1
        gemv += 2 * 6 * h * h + 2 * (2 if last else 6) * h * h                # adaLN: x block, context block
        lin += 2 * n_img * full + 2 * n_txt * (3 * h * h if last else full)   # last context block: pre-only (qkv)
    gemv += 2 * 2 * h * h                                                      # final adaLN
    lin += 2 * n_img * h * c.patch ** 2 * c.out_channels                       # final linear
    att = c.depth * 2 * 2 * seq * seq * h                                      # Q K^T and P V, all heads
    total = lin + gemv + att
    return {"gflop": round(total / 1e9, 2), "linear_gflop": round((lin + gemv) / 1e9, 2),
            "attention_gflop": round(att / 1e9, 2), "gemv_gflop": round(gemv / 1e9, 3)}


def write_checkpoints(model: str, folder: Path) -> dict:
    if model != MODEL:
        return _orig["write_checkpoints"](model, folder)
    from precast.compiler.demo_sd3 import write_sd3_checkpoint
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = folder / "sd35_large_2blocks_bf16.safetensors"
    write_sd3_checkpoint(ckpt, sd3_cfg(), dtype="bf16", layout="bare")
    return {"checkpoint": str(ckpt), "write_s": round(time.perf_counter() - t0, 1),
            "bytes": ckpt.stat().st_size}


def precast_export(model: str, files: dict, out: Path, dtype: str) -> dict:
    if model != MODEL:
        return _orig["precast_export"](model, files, out, dtype)
    t0 = time.perf_counter()
    rep = fs.precast_cli("export", files["checkpoint"], "--out", out, "--dtype", dtype, "--component", "transformer")
    return {"dir": str(out), "component": "transformer", "wall_s": round(time.perf_counter() - t0, 1),
            "seconds": rep.get("seconds")}


def precast_compile(export: dict, cache: Path, options: list[str]) -> dict:
    env = {**os.environ, "PRECAST_CACHE": str(cache)}
    args = ["compile", export["dir"], "--target", "openvino", "--component", export["component"],
            "--height", SIZE["image"], "--width", SIZE["image"], "--tokens", SIZE["clip_tokens"],
            "--t5-tokens", SIZE["t5_tokens"]]
    for o in options:
        args += ["--option", o]
    t0 = time.perf_counter()
    rep = fs.precast_cli(*args, env=env)["artifacts"][0]
    return {"entry": rep["path"], "cache": rep["cache"], "seconds": rep["seconds"],
            "wall_s": round(time.perf_counter() - t0, 1), "size_mb": round(rep["size"] / 1e6, 1)}


def torch_reference(spec: dict):
    """diffusers SD3Transformer2DModel holding the file's weights (tests/reference_sd3.py), fp32, eval,
    wrapped to take the ONNX inputs in order and return one tensor."""
    if spec["model"] != MODEL:
        return _orig["torch_reference"](spec)
    import torch
    sys.path.insert(0, str(ROOT / "tests"))
    import reference_sd3 as ref
    torch.set_num_threads(fs.THREADS)
    inner = ref.sd3_reference(spec["checkpoint"], sd3_cfg())

    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = inner

        def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
            return self.m(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled_projections, timestep=timestep, return_dict=False)[0]
    return W().eval(), ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]


_orig = {n: getattr(fs, n) for n in ("make_inputs", "count_flops", "write_checkpoints", "precast_export",
                                     "torch_reference")}


def patch_flux_step(small: bool) -> None:
    """Point flux_step's run_model and children at the SD3 parts above (flux_step's files unchanged)."""
    if small:
        SIZE.update(image=256, clip_tokens=16, t5_tokens=16)
    fs.OUTPUT[MODEL] = "out_hidden_states"
    for name in ("make_inputs", "count_flops", "write_checkpoints", "precast_export", "precast_compile",
                 "torch_reference"):
        setattr(fs, name, globals()[name])
    fs.__file__ = str(Path(__file__).resolve())      # fs.run_child starts `python <fs.__file__> --child SPEC`


def bound(res: dict, peak: dict) -> dict:
    """The shortest time an f32 runner can take at the measured f32 GEMM peak, and what that leaves."""
    t_min = res["flops"]["gflop"] / peak["f32"]
    rows = res["runners"]
    out = {"gflop": res["flops"]["gflop"], "f32_peak_gflops": peak["f32"], "min_time_s": round(t_min, 3)}
    fl = res.get("floors") or {}
    if fl.get("best_peer"):
        out["best_peer"] = fl["best_peer"]
        out["best_peer_pct_of_f32_peak"] = rows[fl["best_peer"]].get("pct_of_f32_peak")
        out["max_possible_speedup_vs_best_peer"] = round(fl["best_peer_s"] / t_min, 3)
        out["floor_reachable"] = out["max_possible_speedup_vs_best_peer"] >= fs.SPEED_FLOOR
    if "median_s" in rows.get("precast", {}):
        out["precast_pct_of_f32_peak"] = rows["precast"].get("pct_of_f32_peak")
    return out


def step_arguments(ap: argparse.ArgumentParser, runners: str, json_name: str, small: str) -> None:
    """The options every slice-step benchmark takes (this one's and benchmarks/llm_dit_step.py's)."""
    ap.add_argument("--steps", type=int, default=3, help="timed calls per runner after one warm-up; median reported")
    ap.add_argument("--runners", default=runners, help=f"comma-separated (default {runners})")
    ap.add_argument("--no-profile", action="store_true", help="skip the OpenVINO per-op performance counters")
    ap.add_argument("--exporter", choices=["auto", "dynamo", "torchscript"], default="auto",
                    help="torch.onnx.export flavour for the ONNX peers (auto: dynamo when onnxscript is importable)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a new one under benchmarks/results)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--json", type=Path, default=HERE / "results" / json_name)
    ap.add_argument("--small", action="store_true", help=f"{small}: a quick try, not a measurement")


def print_bound(model: str, b: dict) -> None:
    """The f32 bound's line: the shortest time any f32 runner can take, and what it leaves the best peer."""
    print(f"{model + ' ' if model else ''}bound: {b['gflop']} GFLOP / f32 peak {b['f32_peak_gflops']} GFLOP/s = "
          f"{b['min_time_s'] * 1e3:.0f} ms; "
          + (f"best correct peer {b['best_peer']} at {b['best_peer_pct_of_f32_peak']}% of the f32 peak: no f32 engine "
             f"can be more than {b['max_possible_speedup_vs_best_peer']:.2f}x faster than it (floor {fs.SPEED_FLOOR}x "
             f"{'reachable' if b['floor_reachable'] else 'NOT reachable'})" if "best_peer" in b else "no correct peer"),
          flush=True)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        patch_flux_step(small=False)         # the children read their inputs from the spec's .npz
        fs.child_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_arguments(ap, DEFAULT_RUNNERS, "sd3_step.json", "256 px, 16+16 text tokens")
    opts = ap.parse_args()
    opts.precast_only = False
    patch_flux_step(opts.small)
    (HERE / "results").mkdir(exist_ok=True)
    root = (opts.work or Path(tempfile.mkdtemp(prefix="sd3_step_", dir=HERE / "results"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"work folder {root} ({shutil.disk_usage(root).free / 2**30:.0f} GiB free); image {SIZE['image']} px -> "
          f"{tokens()[0]} image tokens + {tokens()[1]} text tokens", flush=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        print(f"load average {load_start}; measuring GEMM peaks ...", flush=True)
        peak_start = fs.gemm_peak()
        print(f"  {peak_start}", flush=True)
        t0 = time.perf_counter()
        res = fs.run_model(MODEL, root, opts)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        peak_end = fs.gemm_peak()
        print(f"  GEMM peaks at the end: {peak_end}", flush=True)
        peak = {k: max(peak_start[k], peak_end[k]) for k in peak_start}
        for r in res["runners"].values():
            if "gflops" in r:
                r["pct_of_f32_peak"] = round(100 * r["gflops"] / peak["f32"], 1)
                r["pct_of_own_peak"] = round(100 * r["gflops"] / peak[r["compute_precision"]], 1)
        res["floors"] = fs.floors(res)
        res["bound"] = bound(res, peak)
        fs.print_report({MODEL: res}, peak, opts)
        print()
        print_bound("", res["bound"])
        out = {"started": started, "command": " ".join(["python", *sys.argv]),
               "machine": describe(("numpy", "onnx", "onnxruntime", "openvino", "torch", "diffusers", "transformers",
                                    "onnxscript")),
               "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
               "gemm_peak_gflops": {"start": peak_start, "end": peak_end, "used": peak},
               "settings": {"steps": opts.steps, "small": opts.small, **SIZE, "image_tokens": tokens()[0],
                            "text_tokens": tokens()[1], "tolerance": fs.TOL, "floor": fs.SPEED_FLOOR,
                            "threads": fs.THREADS, "runners": opts.runners, "sd3": dataclasses.asdict(sd3_cfg())},
               "results": {MODEL: res}}
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"\nwrote {opts.json}")
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
            print(f"work folder removed: {not root.exists()}")


if __name__ == "__main__":
    main()
