"""What generate's features cost on the SD 1.5 512x512 pipeline (issue 33's benchmark): precast, OpenVINO CPU.

A full-size SD 1.5 bundle (random, deterministic fp16 weights in the LDM single-file layout: export_unet.py's
checkpoint; `precast build` of an fp32 recipe for the OpenVINO CPU target, batch 1..4 at 512x512) is built in
the work folder, then:

1. Sampler overhead: per sampler, the seconds a denoising step spends outside the UNet -- the whole loop of
   Txt2Img (CFG concatenation, the sampler's arithmetic, its noise, hooks) with the UNet's session replaced by
   one that returns a stored output at once, over --overhead-steps steps --, in ms per step and as a share of
   the UNet's own time for that step (its median 512x512 CFG call, measured in the same process, times the
   calls the sampler makes a step).
2. Batch: `--batch 4` (one UNet call of 8 rows per step, one VAE call per image) against 4 single runs of
   the same seeds, in images/s, each image made end to end (prompt encoded, STEPS steps, decoded).
3. VAE decode at 1024x1024 (128x128 latents), each in a fresh process: plain (the bundle's VAE ONNX compiled
   by OpenVINO at run time for that size: no engine of the bundle takes it) against tiled (the bundle's
   512x512 engine over 3x3 tiles overlapping by 128 px, runtime/vae_tiling.py, as generate picks it): decode
   seconds (median of REPEAT), the process's peak RSS (VmHWM at its end; ru_maxrss too, which on Linux carries
   the parent's mark over exec) and its RSS after the load; and the two images' PSNR. Then exact (the bundle's
   `vae_decoder_tiled` engine, segment by segment in tiles with whole-image GroupNorms, runtime/vae_segments.py,
   as generate picks it when the bundle has one) the same way, and its PSNR against the plain decode.
   `--parts vae` builds a bundle of the two VAE decoders alone.

Ratios are printed with the CPU's name; a JSON file keeps every number. The work folder (default
benchmarks/results/work/generate_features: checkpoint 2.1 GB, cache and bundle ~8 GB) is deleted at the end
unless --keep.

Usage: .venv/bin/python benchmarks/generate_features.py [--work DIR] [--steps N] [--repeat N] [--keep]
           [--json OUT] [--samplers a,b,...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
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
PROMPT = "a photograph of an astronaut riding a horse"
SAMPLERS = ("euler", "euler-a", "heun", "dpm2", "dpm2-a", "dpm++2m", "dpm++2m-sde", "dpm++sde", "ddim", "unipc", "lcm")


def ensure_bundle(work: Path, vae_only: bool = False) -> Path:
    """The full-size SD 1.5 OpenVINO CPU bundle, batch 1..4 at 512x512, built once into `work` (`vae_only`: its
    VAE decoders alone, plain and tiled)."""
    from export_unet import ensure_checkpoint
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "bundle"
    if (bundle / "manifest.json").exists():
        print(f"reusing {bundle}", flush=True)
        return bundle
    ckpt = work / "sd15_random_fp16.safetensors"
    ensure_checkpoint(ckpt)
    recipe = work / "sd15-features.yaml"
    recipe.write_text("# written by benchmarks/generate_features.py\nname: sd15-features\n"
                      f"model:\n  source: {ckpt}\ncomponents: [{'' if vae_only else 'text_encoder, unet, '}"
                      "vae_decoder, vae_decoder_tiled]\nprecision: fp32\n"
                      "profiles:\n  batch: {min: 1, opt: 1, max: 4}\n  height: 512\n  width: 512\n  tokens: 77\n"
                      "targets:\n  - openvino: {device: CPU}\n")
    print(f"precast build {recipe} ...", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PRECAST_CACHE": str(work / "cache"), "PRECAST_PROGRESS": "plain"}
    if subprocess.run([str(PRECAST), "build", str(recipe), "--out", str(bundle)], env=env, cwd=ROOT).returncode:
        raise SystemExit("precast build failed")
    print(f"  bundle in {time.perf_counter() - t0:.0f} s", flush=True)
    return bundle


# ---- 1. sampler overhead -------------------------------------------------------------------
class StoredUNet:
    """A UNet session that returns one stored output at once, counting its calls."""

    def __init__(self, session, out):
        self.session, self.out, self.calls = session, out, 0
        self.input_names, self.output_names = session.input_names, session.output_names

    def run(self, feeds):
        self.calls += 1
        return {"out_sample": self.out}


def sampler_overhead(bundle: Path, samplers: tuple[str, ...], steps: int = 200, unet_runs: int = 3) -> dict:
    import numpy as np
    from precast.runtime.api import open_bundle
    pipe = open_bundle(str(bundle)).pipeline(size=(512, 512)).pipe
    unet = pipe.component("unet")
    feeds = {"sample": np.random.default_rng(0).standard_normal((2, 4, 64, 64)).astype(np.float32),
             "timestep": np.full((2,), 999.0, np.float32),
             "encoder_hidden_states": np.zeros((2, 77, 768), np.float32)}
    times = []
    for _ in range(unet_runs + 1):
        t0 = time.perf_counter()
        out = unet.session.run(feeds)["out_sample"]
        times.append(time.perf_counter() - t0)
    unet_s = statistics.median(times[1:])       # the first call warms up
    print(f"UNet 512x512 CFG call: {unet_s * 1e3:.0f} ms (median of {unet_runs})", flush=True)
    real = pipe.loaded["unet"]
    rows = {}
    try:
        for name in samplers:
            n = min(steps, 50) if name == "lcm" else steps     # LCM's distillation schedule: 50 steps at most
            stub = StoredUNet(unet.session, out * np.float32(0.1))
            pipe.loaded["unet"] = type(real)(stub, real.where, real.reasons)
            pipe(PROMPT, steps=n, seed=1, scheduler=name, progress=False, decode=False)      # warm
            stub.calls = 0
            runs = []
            for _ in range(3):
                pipe(PROMPT, steps=n, seed=1, scheduler=name, progress=False, decode=False)
                runs.append(pipe.run_stages["denoise"])      # the loop alone (ms resolution over STEPS steps)
            per_step = statistics.median(runs) / n
            calls = stub.calls / (3 * n)
            rows[name] = {"steps": n, "ms_per_step": round(per_step * 1e3, 3), "unet_calls_per_step": round(calls, 2),
                          "pct_of_unet_step": round(100 * per_step / (unet_s * calls), 3)}
            print(f"  {name:<12} {per_step * 1e3:7.2f} ms/step outside the UNet ({calls:.2f} UNet calls/step): "
                  f"{rows[name]['pct_of_unet_step']:.3f} % of the UNet's time", flush=True)
    finally:
        pipe.loaded["unet"] = real
    return {"unet_ms": round(unet_s * 1e3, 1), "steps": steps, "samplers": rows}


# ---- 2. batch 4 against 4 single runs ---------------------------------------------------------
def batch_speed(bundle: Path, steps: int) -> dict:
    from precast.runtime.api import open_bundle
    pipeline = open_bundle(str(bundle)).pipeline(size=(512, 512))
    pipeline(PROMPT, steps=1, seed=0)          # warm: every component loaded and run once
    t0 = time.perf_counter()
    singles = [pipeline(PROMPT, steps=steps, seed=10 + i) for i in range(4)]
    single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch = pipeline.images(PROMPT, steps=steps, seed=10, batch=4)
    batch_s = time.perf_counter() - t0
    same = all(a.png() == b.png() for a, b in zip(singles, batch))
    out = {"steps": steps, "single_s": round(single_s, 2), "batch_s": round(batch_s, 2),
           "single_images_per_s": round(4 / single_s, 4), "batch_images_per_s": round(4 / batch_s, 4),
           "speedup": round(single_s / batch_s, 3), "unet_calls": pipeline.pipe.batches, "same_images": same}
    print(f"batch 4: {batch_s:.1f} s ({out['batch_images_per_s']:.3f} images/s) vs 4 single runs {single_s:.1f} s "
          f"({out['single_images_per_s']:.3f} images/s): {out['speedup']:.2f}x; images equal: {same}", flush=True)
    return out


# ---- 3. VAE decode at 1024x1024, plain and tiled (children) -----------------------------------
def child_vae(mode: str, bundle: str, out_npy: str, repeat: int) -> None:
    """In a fresh process: load the VAE decoder as generate would for 1024x1024 and decode REPEAT times."""
    import numpy as np
    from precast.runtime.api import open_bundle
    from precast.runtime.vae_segments import run_program as decode_exact
    from precast.runtime.vae_tiling import plan, run_tiled
    t0 = time.perf_counter()
    b = open_bundle(bundle)
    comp = b.load("vae_decoder_tiled", "cpu:openvino") if mode == "exact" else \
        b.load("vae_decoder", "cpu:openvino", size=(1024, 1024) if mode == "plain" else (512, 512))
    load_s = time.perf_counter() - t0
    rss_loaded = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS")))
    z = np.random.default_rng(0).standard_normal((1, 4, 128, 128)).astype(np.float32)

    def run(x):
        if mode == "exact":
            return decode_exact(comp.run, b.manifest.components["vae_decoder_tiled"], x)
        return comp.run({"latent_sample": x})["sample"]
    tiling = None
    if mode == "tiled":
        shape = b.manifest.artifacts("vae_decoder")[0].shapes["latent_sample"]
        tiling = plan((128, 128), ((shape[0][2], shape[2][2]), (shape[0][3], shape[2][3])), None, None, 8, None)
    times = []
    for _ in range(repeat):
        t1 = time.perf_counter()
        image = run_tiled(run, z, tiling, 8, True) if tiling else run(z)
        times.append(time.perf_counter() - t1)
    np.save(out_npy, image)
    hwm = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
    print(json.dumps({"mode": mode, "artifact": comp.plan.artifact, "load_s": round(load_s, 2),
                      "decode_s": [round(t, 3) for t in times], "peak_rss_mib": round(hwm / 1024, 1),
                      "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "rss_after_load_mib": round(rss_loaded / 1024, 1),
                      "tiling": tiling.record(128, 128, 8) if tiling else None}))


def vae_decode(bundle: Path, work: Path, repeat: int) -> dict:
    import numpy as np
    out = {}
    for mode in ("plain", "tiled", "exact"):
        npy = work / f"vae_{mode}.npy"
        proc = subprocess.run([sys.executable, __file__, "--vae-child", mode, str(bundle), str(npy), str(repeat)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"VAE child {mode} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["median_decode_s"] = statistics.median(r["decode_s"])
        out[mode] = r
        print(f"VAE decode 1024x1024 {mode:<5}: {r['median_decode_s']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB "
              f"(after load {r['rss_after_load_mib']:.0f} MiB; ru_maxrss {r['ru_maxrss_mib']:.0f}) via "
              f"{r['artifact']}" + (f", {r['tiling']['tiles']} tiles of {r['tiling']['tile']}" if r["tiling"] else ""),
              flush=True)
    a, b, c = (np.clip(np.load(work / f"vae_{m}.npy").astype(np.float64) / 2 + 0.5, 0, 1)
               for m in ("plain", "tiled", "exact"))
    out["psnr_db"] = round(10 * math.log10(1 / float(np.mean((a - b) ** 2))), 2)
    out["exact_psnr_db"] = round(10 * math.log10(1 / max(float(np.mean((a - c) ** 2)), 1e-30)), 2)
    out["time_ratio"] = round(out["tiled"]["median_decode_s"] / out["plain"]["median_decode_s"], 3)
    out["peak_ratio"] = round(out["tiled"]["peak_rss_mib"] / out["plain"]["peak_rss_mib"], 3)
    out["exact_time_ratio"] = round(out["exact"]["median_decode_s"] / out["plain"]["median_decode_s"], 3)
    out["exact_peak_ratio"] = round(out["exact"]["peak_rss_mib"] / out["plain"]["peak_rss_mib"], 3)
    plain_act = (out["plain"]["peak_rss_mib"] - out["plain"]["rss_after_load_mib"]) * 2**20
    out["plain_activation_bytes_per_pixel"] = round(plain_act / (1024 * 1024))
    print(f"tiled / plain: time {out['time_ratio']:.2f}x, peak RSS {out['peak_ratio']:.2f}x; PSNR {out['psnr_db']} dB; "
          f"plain decode's peak above its load: {out['plain_activation_bytes_per_pixel']} bytes per pixel", flush=True)
    print(f"exact / plain: time {out['exact_time_ratio']:.2f}x, peak RSS {out['exact_peak_ratio']:.2f}x; PSNR "
          f"{out['exact_psnr_db']} dB", flush=True)
    return out


def child_part(part: str, bundle: str, arg: str) -> None:
    """Parts 1 and 2 in a fresh process each, so that no pipeline outlives its part (two fp32 SD 1.5
    pipelines and a batch of 4 hold ~15 GB)."""
    if part == "sampler":
        samplers, steps = arg.split(":")
        out = sampler_overhead(Path(bundle), tuple(samplers.split(",")), int(steps))
    else:
        out = batch_speed(Path(bundle), int(arg))
    print(json.dumps(out))


def run_part(part: str, bundle: Path, arg: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--part-child", part, str(bundle), arg], stdout=subprocess.PIPE,
                          text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"part {part} failed (rc {proc.returncode})")
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--vae-child":
        child_vae(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--part-child":
        child_part(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work" / "generate_features")
    ap.add_argument("--steps", type=int, default=20, help="steps of each image in the batch part")
    ap.add_argument("--repeat", type=int, default=3, help="VAE decodes per child")
    ap.add_argument("--overhead-steps", type=int, default=200, help="steps of each sampler's loop on the stored UNet")
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--json", type=Path, default=HERE / "results" / "generate_features.json")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--parts", default="sampler,batch,vae", help="which parts to run (default all three)")
    args = ap.parse_args()
    from machine import describe
    t0 = time.perf_counter()
    machine = {**describe(("openvino", "numpy")), "load_average_at_start": os.getloadavg()}
    print(f"CPU: {machine['cpu']} ({machine['cores']} cores, {machine['ram_gib']} GiB); work folder {args.work}",
          flush=True)
    work = args.work.resolve()
    try:
        parts = args.parts.split(",")
        bundle = ensure_bundle(work, vae_only=parts == ["vae"])
        result = {"machine": machine}
        if "sampler" in parts:
            result["sampler_overhead"] = run_part("sampler", bundle, f"{args.samplers}:{args.overhead_steps}")
        if "batch" in parts:
            result["batch"] = run_part("batch", bundle, str(args.steps))
        if "vae" in parts:
            result["vae_1024"] = vae_decode(bundle, work, args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    said = []
    if "sampler_overhead" in result:
        worst = max(result["sampler_overhead"]["samplers"].items(), key=lambda kv: kv[1]["pct_of_unet_step"])
        said.append(f"sampler overhead at most {worst[1]['ms_per_step']:.2f} ms, {worst[1]['pct_of_unet_step']:.3f} % "
                    f"of a UNet step ({worst[0]})")
    if "batch" in result:
        said.append(f"batch 4 {result['batch']['speedup']:.2f}x the images/s of 4 single runs")
    if "vae_1024" in result:
        v = result["vae_1024"]
        said.append(f"tiled VAE decode at 1024x1024 {v['time_ratio']:.2f}x the time and {v['peak_ratio']:.2f}x the "
                    f"peak RSS of plain ({v['psnr_db']} dB); exact {v['exact_time_ratio']:.2f}x and "
                    f"{v['exact_peak_ratio']:.2f}x ({v['exact_psnr_db']} dB)")
    print(f"\n{machine['cpu']}: {'; '.join(said)}; {result['seconds']:.0f} s in all; {args.json}", flush=True)


if __name__ == "__main__":
    main()
