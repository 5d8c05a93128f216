"""Benchmark: merging a LoRA while exporting the full-size SD 1.5 UNet, and swapping LoRAs on an
OpenVINO engine versus building a fresh one.

What it measures, in one run:

1. The full-size SD 1.5 checkpoint of benchmarks/export_unet.py (written once, reused) and a
   rank-64 kohya LoRA for it (every attention / feed-forward Linear and 1x1 projection of the
   UNet, diffusers-path kohya names, fp16, alpha 32), plus a second one (another seed).
2. `precast export CKPT --component unet --dtype fp16` in a fresh process, with and without
   `--lora LORA:0.8`; --repeat runs each (median). Floor: with-LoRA <= 1.5x plain.
3. OpenVINO (CPU), on the fp16 UNet export: a fresh build of the LoRA-A export (read + compile),
   then the swap A -> B on an already built engine (compiler/lora_swap.py, recompile mode: merge
   from the base weights + compile), and the experimental state mode's swap (no compile; see
   lora_swap.py for why it is not used). One inference at 64x64 checks swap == fresh build.

Usage: .venv/bin/python benchmarks/lora.py [--work DIR] [--json OUT] [--repeat N] [--skip-openvino]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
FLOOR = 1.5


def write_lora(ckpt: Path, path: Path, seed: int, rank: int = 64) -> None:
    from safetensors.numpy import save_file

    from precast.compiler.sources.checkpoint import UNET, open_checkpoint
    from precast.compiler.sources.lora_names import unet_diffusers_modules
    if path.exists():
        return
    c = open_checkpoint(ckpt)
    rel = [k[len(UNET):] for k in c.refs if k.startswith(UNET)]
    to_diff = unet_diffusers_modules(rel)
    rng = np.random.default_rng(seed)
    sd = {}
    for k in rel:
        shape = c.shape(UNET + k)
        module = k[:-len(".weight")]
        if not k.endswith(".weight") or ".transformer_blocks." not in k and not k.endswith(("proj_in.weight", "proj_out.weight")):
            continue
        if len(shape) < 2 or "norm" in module:
            continue
        name = "lora_unet_" + to_diff[module].replace(".", "_")
        tail = (1, 1) if len(shape) == 4 else ()
        sd[name + ".lora_down.weight"] = (rng.standard_normal((rank, shape[1], *tail)) * 0.02).astype(np.float16)
        sd[name + ".lora_up.weight"] = (rng.standard_normal((shape[0], rank, *tail)) * 0.02).astype(np.float16)
        sd[name + ".alpha"] = np.array(32.0, np.float16)
    save_file(sd, str(path))


def timed_export(ckpt: Path, out: Path, lora: Path | None, repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        cmd = [sys.executable, "-m", "precast.runtime.cli", "export", str(ckpt), "--out", str(out),
               "--component", "unet", "--dtype", "fp16", "--json"]
        if lora is not None:
            cmd += ["--lora", f"{lora}:0.8"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        runs.append(round(time.perf_counter() - t0, 3))
        if proc.returncode != 0:
            raise SystemExit(f"export failed: {proc.stderr[-2000:]}")
    return {"runs_s": runs, "median_s": statistics.median(runs), "cmd": " ".join(cmd)}


def openvino_swap(work: Path, lora_a: Path, lora_b: Path) -> dict:
    import openvino as ov

    from precast.compiler.export import export
    from precast.compiler.lora_swap import OpenVinoLoraEngine
    base_dir, a_dir = work / "lora_base_fp16", work / "lora_a_fp16"
    ckpt = work / "sd15_random_fp16.safetensors"
    if not (base_dir / "unet/model.onnx").exists():
        export(ckpt, base_dir, ["unet"], "fp16", progress=False)
    export(ckpt, work / "lora_b_fp16", ["unet"], "fp16", progress=False, loras=[(lora_b, 0.8)])
    export(ckpt, a_dir, ["unet"], "fp16", progress=False, loras=[(lora_a, 0.8)])
    cfg = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    rng = np.random.default_rng(0)
    feeds = {"sample": rng.standard_normal((1, 4, 8, 8)).astype(np.float32), "timestep": np.array([500.0], np.float32),
             "encoder_hidden_states": rng.standard_normal((1, 77, 768)).astype(np.float32)}
    out = {}
    t0 = time.perf_counter()
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(a_dir / "unet/model.onnx")), "CPU", cfg)
    out["fresh_build_s"] = round(time.perf_counter() - t0, 2)
    del compiled
    t0 = time.perf_counter()
    fresh_b = OpenVinoLoraEngine(work / "lora_b_fp16/unet/model.onnx", config=cfg)
    want = fresh_b.run(feeds)["out_sample"]
    del fresh_b
    engine = OpenVinoLoraEngine(base_dir / "unet/model.onnx", config=cfg)
    out["recompile_engine_build_s"] = round(time.perf_counter() - t0, 2)
    out["recompile_swap_to_a"] = engine.set_loras([(lora_a, 0.8)])
    out["recompile_swap_a_to_b"] = engine.set_loras([(lora_b, 0.8)])
    got = engine.run(feeds)["out_sample"]
    out["recompile_swap_rel_err_vs_fresh"] = float(np.abs(got - want).max() / np.abs(want).max())
    del engine
    state = OpenVinoLoraEngine(base_dir / "unet/model.onnx", config=cfg, mode="state", experimental=True)
    state.set_loras([(lora_a, 0.8)])
    out["state_swap_a_to_b"] = state.set_loras([(lora_b, 0.8)])
    got = state.run(feeds)["out_sample"]
    out["state_swap_rel_err_vs_fresh"] = float(np.abs(got - want).max() / np.abs(want).max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "lora.json")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-openvino", action="store_true")
    opts = ap.parse_args()
    from export_unet import ensure_checkpoint
    work = opts.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "sd15_random_fp16.safetensors"
    ensure_checkpoint(ckpt)
    lora_a, lora_b = work / "sd15_lora_r64_a.safetensors", work / "sd15_lora_r64_b.safetensors"
    write_lora(ckpt, lora_a, 1)
    write_lora(ckpt, lora_b, 2)
    plain = timed_export(ckpt, work / "lora_plain", None, opts.repeat)
    merged = timed_export(ckpt, work / "lora_merged", lora_a, opts.repeat)
    ratio = merged["median_s"] / plain["median_s"]
    results = {"lora_bytes": lora_a.stat().st_size, "export_plain": plain, "export_with_lora": merged,
               "ratio": round(ratio, 3), "floor": FLOOR, "pass": ratio <= FLOOR}
    print(f"export unet fp16: plain {plain['median_s']:.2f} s, with rank-64 LoRA {merged['median_s']:.2f} s "
          f"-> {ratio:.2f}x ({'PASS' if ratio <= FLOOR else 'FAIL'}, floor {FLOOR}x)")
    if not opts.skip_openvino:
        ov = openvino_swap(work, lora_a, lora_b)
        results["openvino"] = ov
        print(f"openvino CPU: fresh build {ov['fresh_build_s']} s; swap A->B (recompile) "
              f"{ov['recompile_swap_a_to_b']['total_s']} s (merge {ov['recompile_swap_a_to_b']['merge_s']} s), "
              f"rel err vs fresh {ov['recompile_swap_rel_err_vs_fresh']:.1e}; state-mode swap "
              f"{ov['state_swap_a_to_b']['total_s']} s, rel err {ov['state_swap_rel_err_vs_fresh']:.1e}")
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
