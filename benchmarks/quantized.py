"""Benchmark (issue 20): quantized weights for big models on a small machine, in one run.

Parts (--parts, default all):

1. gguf: the full-size FLUX.1-dev transformer (11.9 B parameters, BFL names as ComfyUI-GGUF files keep
   them; seeded random blocks) written as GGUF in Q8_0 and in Q4_K (the 2-D weights whose rows fit the
   type's block; the others F16, 1-D tensors F32, as city96's converter does), then, each step in a fresh
   process with its peak RSS sampled (the process tree's RSS and anonymous memory every 50 ms; a
   watchdog kills a step whose anonymous memory passes --cap-gib or when the machine runs low):
   - `precast export FILE.gguf --component transformer --dtype bf16` (GGUF blocks dequantized while
     streaming), against the plain copy of the same bytes (read the GGUF, write the export's size);
   - `precast compile` of that export for `onnxruntime` weights=int8 (MatMulNBits: the CPU fallback of a
     bf16-only model, computing in fp32), `openvino` weights=int8 and weights=int4 (NNCF; stored as IR
     since the export is over 4 GiB), and weights=gguf for both (the file's Q8_0 / Q4_0 blocks kept, each
     checked against the export): build time, peak RSS, artifact size;
   - the peer a user would pick for the ONNX Runtime artifact: onnxruntime.quantization's
     MatMulNBitsQuantizer on the same export (it loads the whole model), under the same watchdog;
   - each artifact opened with the runtime's session (runtime/sessions.py) and called once at 256x256
     (256 image tokens + 64 T5 tokens): load time, call time, peak host memory -- the 12 B CPU fallback.
   Disk: the GGUF is deleted once built from, each artifact once measured (peak ~50 GB).
2. slice: the Flux slice of benchmarks/flux_step.py (full width, 2 double + 2 single blocks, 1024 image +
   512 T5 tokens), exported fp32, built for onnxruntime (fp32, int8) and openvino (f32, int8, int4),
   each timed over --steps calls in a fresh process (median after a warm-up), output compared with the
   fp32 ONNX Runtime artifact (relative L2, the metric tests/test_quantized.py uses). Peaks measured in
   the same run: the f32 GEMM peak (flux_step.gemm_peak) and the int8 one an OpenVINO FullyConnected with
   int8-compressed weights reaches (4096^3): OpenVINO's CPU plugin quantizes the activations of a
   compressed-weight layer on the fly (DYNAMIC_QUANTIZATION_GROUP_SIZE 32 by default) and multiplies in
   int8 (VNNI), so int8 / int4 engines are bound by that peak, not the f32 one; ONNX Runtime's
   MatMulNBits (accuracy level 0, the default kept here for its error) dequantizes to f32.
3. unet (not in the default parts): the full-size SD 1.5 UNet (export_unet.py's random fp16 checkpoint),
   exported fp32, built static 512x512 batch 2 for ONNX Runtime fp32 (the reference), OpenVINO f32, OpenVINO
   int8 as precast builds it for the CPU (Linears int8, convolutions left float) and, in a child where this
   script patches precast's KEPT_FLOAT away, int8 convolutions too (how precast built it before): artifact
   size, the session's peak RSS and anonymous memory, median call, relative L2 error vs the reference.

All files live in one work folder (default benchmarks/results/work/quantized), deleted at the end, also
on failure or interrupt. Usage:
  .venv/bin/python benchmarks/quantized.py [--parts gguf,slice,unet] [--types Q8_0,Q4_K] [--steps 3]
      [--cap-gib 20] [--work DIR] [--json OUT] [--small]   (--small: a 1+1-block full-width Flux)
      [--builds onnxruntime-gguf,...] [--sessions LABEL,...]   (types: Q8_0, Q4_0, Q4_K)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
PRECAST = Path(sys.executable).with_name("precast")
GB = 1e9
SESSION_IMAGE, SESSION_T5 = 256, 64


# ---- GGUF files ---------------------------------------------------------------------------
def write_flux_gguf(path: Path, cfg, qtype_name: str, seed: int = 0) -> dict:
    """The transformer `cfg` as a GGUF file, streamed tensor by tensor (GGUFWriter's info-then-data
    order), random quant blocks with small float16 scales: every bit pattern of a Q8_0 / Q4_K block is
    a valid weight."""
    import gguf
    from precast.compiler.demo_dit import flux_layout
    Q = gguf.GGMLQuantizationType
    qtype = Q[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    layout = flux_layout(cfg)
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 64 << 20, dtype=np.uint8)          # random bytes reused at shifting offsets
    plan = []
    for name, shape in layout.items():
        if len(shape) == 1 or int(np.prod(shape)) <= 1024:
            plan.append((name, shape, Q.F32))
        elif shape[-1] % block:
            plan.append((name, shape, Q.F16))
        else:
            plan.append((name, shape, qtype))
    w = gguf.GGUFWriter(str(path), arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                         "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M}[qtype_name]))
    nbytes = {}
    for name, shape, t in plan:
        n = int(np.prod(shape))
        nbytes[name] = n * 4 if t == Q.F32 else n * 2 if t == Q.F16 else n // block * size
        quant = t not in (Q.F32, Q.F16)      # a quantized tensor's info is given in its byte shape
        w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size) if quant else shape,
                          np.dtype(np.float32 if t == Q.F32 else np.float16 if t == Q.F16 else np.uint8),
                          nbytes[name], raw_dtype=t if quant else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    counts: dict[str, int] = {}
    for i, (name, shape, t) in enumerate(plan):
        n = int(np.prod(shape))
        counts[t.name] = counts.get(t.name, 0) + 1
        if t in (Q.F32, Q.F16):
            w.write_tensor_data((rng.standard_normal(n) * 0.02).astype(np.float32 if t == Q.F32 else np.float16)
                                .reshape(shape))
            continue
        blocks = _random_bytes(pool, nbytes[name], i).reshape(-1, size)
        largest = {Q.Q8_0: 127, Q.Q4_0: 8, Q.Q4_K: 945 / 0.3 * 0.05}[t]          # |q| / d at most
        scale = (rng.uniform(0.5, 1.0, blocks.shape[0]) * 0.05 / largest).astype(np.float16)
        for off in ((0, 2) if t == Q.Q4_K else (0,)):          # Q8_0 / Q4_0: d; Q4_K: d and dmin
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        w.write_tensor_data(blocks.reshape(shape[0], -1))
    w.close()
    return {"tensors": counts, "bytes": path.stat().st_size}


def _random_bytes(pool: np.ndarray, n: int, salt: int) -> np.ndarray:
    start = (salt * 7919) % (len(pool) // 2)
    reps = -(-n // (len(pool) - start))
    out = np.empty(n, np.uint8)
    done = 0
    while done < n:
        take = min(n - done, len(pool) - start)
        out[done:done + take] = pool[start:start + take]
        done += take
        start = (start + 4099) % (len(pool) // 2)
    del reps
    return out


# ---- children -----------------------------------------------------------------------------
def child_session(spec: dict) -> dict:
    """An artifact (cache entry) opened with the runtime's session and called; or the peer quantizer."""
    if spec["kind"] == "peer-quantizer":
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
        t0 = time.perf_counter()
        model = onnx.load(spec["source"])
        q = MatMulNBitsQuantizer(model, bits=8, block_size=32, is_symmetric=True)
        q.process()
        out = Path(spec["out"]) / "peer.onnx"
        onnx.save_model(q.model.model, str(out), save_as_external_data=True, location="peer.onnx_data")
        return {"seconds": time.perf_counter() - t0}
    from precast.compiler.cache import parse_entry
    from precast.runtime.sessions import open_artifact
    entry = parse_entry(Path(spec["entry"]))
    meta = entry.metadata
    t0 = time.perf_counter()
    session = open_artifact(entry.path, {"backend": meta["backend"], **meta})
    load = time.perf_counter() - t0
    feeds = dict(np.load(spec["inputs"]))
    feeds = {k: v for k, v in feeds.items() if k in session.input_names}
    times, out = [], {}
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        out = session.run(feeds)
        times.append(time.perf_counter() - t0)
    np.save(Path(spec["out"]) / "out.npy", np.asarray(next(iter(out.values())), np.float32))
    return {"load_s": round(load, 2), "times": [round(t, 3) for t in times]}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res = child_session(spec)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    res["vm_hwm_gb"] = round(hwm * 1024 / GB, 3)
    (Path(spec["out"]) / "result.json").write_text(json.dumps(res))


def run_step(label: str, cmd: list[str], log: Path, cap: float, timeout: float = 7200, env=None) -> dict:
    """A command in a fresh process group with the sampled peaks and the watchdog of flux_export.py."""
    from flux_export import run_child
    print(f"  {label:<44} ...", end="", flush=True)
    res = run_child([str(c) for c in cmd], log, timeout, env=env, anon_limit=cap, min_available=1.5 * (1 << 30))
    ok = res["rc"] == 0
    print(f" {'ok' if ok else 'FAILED rc ' + str(res['rc'])} in {res['wall_s']:.0f} s, peak RSS "
          f"{res['sampled_peak_rss_gb']:.2f} GB (anon {res['sampled_peak_anon_gb']:.2f})"
          + (f" [{res['watchdog_kill']}]" if res["watchdog_kill"] else ""), flush=True)
    if not ok and not res["watchdog_kill"]:
        from flux_export import tail
        print(tail(log, 8))
    res.pop("rss_timeline", None)
    return res


def run_session(label: str, work: Path, spec: dict, cap: float) -> dict:
    folder = work / f"child-{label.replace(' ', '_')}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = {**spec, "out": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec))
    res = run_step(label, [sys.executable, __file__, "--child", folder / "spec.json"], folder / "log.txt", cap)
    if (folder / "result.json").exists():
        res.update(json.loads((folder / "result.json").read_text()))
    return res


def precast_json(args: list, env=None) -> dict:
    proc = subprocess.run([str(PRECAST), *map(str, args), "--json"], cwd=ROOT, capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"precast {' '.join(map(str, args))}: rc {proc.returncode}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def compile_step(label: str, export: Path, cache: Path, target: str, options: list[str], image: int, t5: int | None,
                 work: Path, cap: float, component: str = "transformer", patch: str = "", batch: int = 1) -> dict:
    """`precast compile` in a sampled child; the artifact's cache entry and size from its --json. `patch`: Python
    run in the child before the CLI (a what-if: precast as it was before a change, its files unchanged)."""
    env = {**os.environ, "PRECAST_CACHE": str(cache)}
    tag = label.replace(" ", "_")
    report = work / f"{tag}.json"
    args = ["compile", str(export), "--target", target, "--component", component, "--batch", str(batch),
            "--height", str(image),
            "--width", str(image), *(["--t5-tokens", str(t5)] if t5 else []),
            *sum((["--option", o] for o in options), []), "--json"]
    cli = [str(PRECAST)] if not patch else \
        [sys.executable, "-c", f"{patch}; import sys; from precast.runtime.cli import main; sys.argv[0] = 'precast'; "
                               "sys.exit(main())"]
    cmd = ["bash", "-c", " ".join(shlex.quote(c) for c in [*cli, *args]) + f" > {shlex.quote(str(report))}"]
    res = run_step(label, cmd, work / f"{tag}.log", cap, env=env)
    if res["rc"] == 0:
        rep = json.loads(report.read_text())["artifacts"][0]
        res.update(entry=rep["path"], seconds=rep["seconds"], size_gb=round(rep["size"] / GB, 2))
    return res


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def session_inputs(path: Path, image: int, t5: int, cfg) -> None:
    from precast.runtime.families.flux import image_ids
    rng = np.random.default_rng(3)
    grid = image // 16
    np.savez(path, hidden_states=rng.standard_normal((1, grid * grid, 64)).astype(np.float32),
             encoder_hidden_states=rng.standard_normal((1, t5, cfg.context_in_dim)).astype(np.float32),
             pooled_projections=rng.standard_normal((1, cfg.vec_in_dim)).astype(np.float32),
             timestep=np.array([0.75], np.float32), guidance=np.array([3.5], np.float32),
             img_ids=image_ids(grid, grid), txt_ids=np.zeros((t5, 3), np.float32))


# ---- part 1: GGUF at full size ------------------------------------------------------------
BUILDS = [("onnxruntime-int8", "onnxruntime", ["weights=int8"]), ("onnxruntime-gguf", "onnxruntime", ["weights=gguf"]),
          ("openvino-int8", "openvino", ["weights=int8"]), ("openvino-gguf", "openvino", ["weights=gguf"]),
          ("openvino-int4", "openvino", ["weights=int4"])]
# per file type: what its user builds (gguf: the file's own blocks kept, Q8_0 / Q4_0 only)
BUILDS_FOR = {"Q8_0": ("onnxruntime-int8", "onnxruntime-gguf", "openvino-int8", "openvino-gguf", "openvino-int4"),
              "Q4_0": ("onnxruntime-gguf", "openvino-gguf"), "Q4_K": ("openvino-int4",)}


def part_gguf(work: Path, qtype: str, cfg, opts) -> dict:
    from flux_export import plain_copy
    out: dict = {"type": qtype}
    src = work / f"flux1-dev-{qtype}.gguf"
    print(f"[gguf {qtype}] writing {src.name}", flush=True)
    t0 = time.perf_counter()
    out["file"] = write_flux_gguf(src, cfg, qtype)
    out["write_s"] = round(time.perf_counter() - t0, 1)
    print(f"  written: {out['file']['bytes'] / GB:.2f} GB in {out['write_s']} s; {out['file']['tensors']}", flush=True)
    export = work / f"export-{qtype}"
    out["export"] = run_step("precast export --dtype bf16", [PRECAST, "export", src, "--component", "transformer",
                                                             "--dtype", "bf16", "--out", export],
                             work / f"export-{qtype}.log", opts.cap)
    if out["export"]["rc"]:
        return out
    out["export"]["out_gb"] = round(folder_bytes(export / "transformer") / GB, 2)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    out["copy"] = plain_copy(src, folder_bytes(export / "transformer"), work, logs, f"copy-{qtype}")
    print(f"  plain copy of the GGUF to the export's size: {out['copy'].get('wall_s')} s", flush=True)
    inputs = work / "session_inputs.npz"
    session_inputs(inputs, SESSION_IMAGE, SESSION_T5, cfg)
    builds = [b for b in BUILDS if b[0] in BUILDS_FOR[qtype] and (not opts.builds or b[0] in opts.builds)]
    for label, target, options in builds:
        cache = work / f"cache-{qtype}-{label}"
        b = compile_step(f"compile {label}", export, cache, target, options, SESSION_IMAGE, SESSION_T5, work, opts.cap)
        out[label] = b
        if b["rc"] == 0 and (not opts.sessions or label in opts.sessions):
            b["session"] = run_session(f"session {label}", work, {"kind": "session", "entry": b["entry"],
                                                                    "inputs": str(inputs), "steps": 1}, opts.cap)
        shutil.rmtree(cache, ignore_errors=True)
    src.unlink()                    # weights=gguf reads its blocks from it: kept until the builds are done
    if qtype == opts.types[0] and not opts.no_peer:
        peer = work / "peer"
        peer.mkdir(exist_ok=True)
        out["peer_quantizer"] = run_session("peer: MatMulNBitsQuantizer", work,
                                            {"kind": "peer-quantizer", "source": str(export / "transformer" / "model.onnx")},
                                            opts.cap)
        shutil.rmtree(peer, ignore_errors=True)
    shutil.rmtree(export, ignore_errors=True)
    return out


def timed_session(part: str, label: str, b: dict, inputs: Path, work: Path, opts) -> None:
    """Build `b`'s artifact opened in a fresh child, called --steps times after a warm-up: its run, median and
    output (kept as work/<part>-<label>.npy for relative_errors)."""
    b["run"] = run_session(f"{part} {label}", work, {"kind": "session", "entry": b["entry"], "inputs": str(inputs),
                                                      "steps": opts.steps + 1}, opts.cap)
    t = b["run"].get("times", [])[1:]
    b["median_s"] = statistics.median(t) if t else None
    out_file = work / f"child-{part}_{label.replace(' ', '_')}" / "out.npy"
    if out_file.exists():
        shutil.copy(out_file, work / f"{part}-{label.replace(' ', '_')}.npy")


def relative_errors(part: str, runs: dict, work: Path) -> None:
    """Each run's relative L2 error against the ONNX Runtime fp32 artifact's output."""
    ref = np.load(work / f"{part}-onnxruntime-fp32.npy").astype(np.float64)
    for label, b in runs.items():
        f = work / f"{part}-{label.replace(' ', '_')}.npy"
        if f.exists():
            b["rel_l2"] = float(np.linalg.norm(np.load(f).astype(np.float64) - ref) / np.linalg.norm(ref))


# ---- part 2: the full-width slice step ----------------------------------------------------
def part_slice(work: Path, opts) -> dict:
    import flux_step
    cfg = flux_step.flux_cfg()
    files = flux_step.write_checkpoints("flux", work / "slice")
    export = work / "slice-export"
    precast_json(["export", files["checkpoint"], "--out", export, "--dtype", "fp32", "--component", "transformer"])
    inputs = work / "slice_inputs.npz"
    np.savez(inputs, **flux_step.make_inputs("flux"))
    peak = flux_step.gemm_peak()
    peak["openvino_int8_weights"] = int8_fc_peak()
    f32_peak = peak["f32"]
    runs = {}
    for label, target, options in (("onnxruntime-fp32", "onnxruntime", []), ("onnxruntime-int8", "onnxruntime",
                                   ["weights=int8"]), ("openvino-f32", "openvino", []),
                                   ("openvino-int8", "openvino", ["weights=int8"]),
                                   ("openvino-int4", "openvino", ["weights=int4"])):
        cache = work / "slice-cache"
        b = compile_step(f"slice compile {label}", export, cache, target, options, flux_step.IMAGE,
                         flux_step.T5_TOKENS, work, opts.cap)
        if b["rc"] == 0:
            timed_session("slice", label, b, inputs, work, opts)
        runs[label] = b
    relative_errors("slice", runs, work)
    gflop = flux_step.count_flops("flux")["gflop"]
    for b in runs.values():
        if b.get("median_s"):
            b["gflops"] = round(gflop / b["median_s"], 1)
    return {"runs": runs, "gflop": gflop, "gemm_peak": peak, "f32_peak": f32_peak}


# ---- part 3: the full-size SD 1.5 UNet, int8 with and without its convolutions ---------------
UNET_BUILDS = (   # label, target, options, what-if patch (precast as it was: NNCF also compressing convolutions)
    ("onnxruntime-fp32", "onnxruntime", [], ""),
    ("openvino-f32", "openvino", [], ""),
    ("openvino-int8", "openvino", ["weights=int8"], ""),
    ("openvino-int8 convs too", "openvino", ["weights=int8"],
     "from precast.compiler.targets import quantize_openvino as q; q.KEPT_FLOAT.clear()"),
)


def part_unet(work: Path, opts) -> dict:
    """Full-size SD 1.5 UNet (export_unet.py's random fp16 checkpoint) exported fp32 and built static 512x512,
    batch 2 (CFG): ONNX Runtime fp32 (the reference), OpenVINO f32, OpenVINO int8 as precast builds it for the
    CPU (Linears int8, convolutions float) and as it did before (convolutions int8 too): artifact size, the
    session's peak RSS, median call, relative L2 error against the reference."""
    from export_unet import ensure_checkpoint
    from memory import unet_feeds
    ckpt = work / "sd15.safetensors"
    ensure_checkpoint(ckpt)
    export = work / "unet-export"
    precast_json(["export", ckpt, "--out", export, "--dtype", "fp32", "--component", "unet"])
    ckpt.unlink()
    inputs = work / "unet_inputs.npz"
    np.savez(inputs, **unet_feeds())
    runs = {}
    for label, target, options, patch in UNET_BUILDS:
        cache = work / "unet-cache"
        b = compile_step(f"unet compile {label}", export, cache, target, options, 512, None, work, opts.cap,
                         component="unet", patch=patch)     # batch 1 image: the UNet runs 2 (CFG)
        if b["rc"] == 0:
            from precast.compiler.cache import parse_entry
            b["weights"] = parse_entry(Path(b["entry"])).metadata.get("weights")
            timed_session("unet", label, b, inputs, work, opts)
            shutil.rmtree(Path(b["entry"]), ignore_errors=True)
        runs[label] = b
    relative_errors("unet", runs, work)
    shutil.rmtree(export, ignore_errors=True)
    return {"runs": runs}


def int8_fc_peak(n: int = 4096, repeats: int = 4) -> float:
    """GFLOP/s of an n^3 OpenVINO FullyConnected whose weight is int8-compressed as NNCF writes it
    (u8 -> f32, minus zero point, times per-channel scale), f32 activations, default CPU config."""
    import openvino as ov
    import openvino.opset13 as ops
    import flux_step
    rng = np.random.default_rng(0)
    a = rng.random((n, n), np.float32)
    q = ops.constant(rng.integers(0, 256, (n, n), dtype=np.uint8))
    zp = ops.constant(np.full((n, 1), 128, np.uint8))
    scale = ops.constant(np.full((n, 1), 0.01, np.float32))
    w = ops.multiply(ops.subtract(ops.convert(q, "f32"), ops.convert(zp, "f32")), scale)
    x = ops.parameter([n, n], ov.Type.f32, name="x")
    model = ov.Model([ops.matmul(x, w, False, True)], [x])
    req = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                   "PERFORMANCE_HINT": "LATENCY"}).create_infer_request()
    req.infer({0: a})
    return round(2 * n ** 3 / min(flux_step._time_calls(lambda: req.infer({0: a}), repeats)[1:]) / 1e9, 1)


# ---- report -------------------------------------------------------------------------------
def print_report(res: dict) -> None:
    print("\n== issue 20 benchmark ==")
    for g in res.get("gguf", []):
        e, c = g.get("export", {}), g.get("copy", {})
        print(f"\nGGUF {g['type']} ({g['file']['bytes'] / GB:.2f} GB) -> bf16 export {e.get('out_gb')} GB: "
              f"{e.get('wall_s')} s, peak RSS {e.get('sampled_peak_rss_gb')} GB (anon {e.get('sampled_peak_anon_gb')}); "
              f"plain copy {c.get('wall_s')} s -> {e.get('wall_s', 0) / max(c.get('wall_s') or 1, 1e-9):.2f}x")
        print(f"  {'artifact':<20}{'build s':>9}{'peak RSS GB':>13}{'size GB':>9}{'load s':>8}{'call s':>8}"
              f"{'session peak GB':>17}")
        for label, _, _ in BUILDS:
            b = g.get(label)
            if not b:
                continue
            s = b.get("session", {})
            print(f"  {label:<20}{b.get('wall_s', 0):>9.0f}{b.get('sampled_peak_rss_gb', 0):>13.2f}"
                  f"{b.get('size_gb', 0) or 0:>9.2f}{s.get('load_s', 0) or 0:>8.1f}"
                  f"{(s.get('times') or [0])[0]:>8.1f}{s.get('sampled_peak_rss_gb', 0):>17.2f}"
                  + (f"  [{b['watchdog_kill']}]" if b.get("watchdog_kill") else ""))
        for kind in ("onnxruntime", "openvino"):     # keeping the file's blocks against quantizing again
            kept, redone = g.get(f"{kind}-gguf", {}).get("wall_s"), g.get(f"{kind}-int8", {}).get("wall_s")
            if kept and redone:
                print(f"  {kind}: weights=gguf builds in {kept / redone:.2f}x the time of weights=int8")
        p = g.get("peer_quantizer")
        if p:
            print(f"  peer MatMulNBitsQuantizer: rc {p['rc']} after {p['wall_s']:.0f} s, peak RSS "
                  f"{p['sampled_peak_rss_gb']:.2f} GB" + (f" [{p['watchdog_kill']}]" if p.get("watchdog_kill") else ""))
    u = res.get("unet")
    if u:
        print("\nSD 1.5 UNet, full size, 512x512, batch 2 (reference: ONNX Runtime fp32)")
        print(f"  {'artifact':<26}{'size GB':>9}{'median s':>10}{'session peak GB':>17}{'anon GB':>9}{'rel L2':>9}"
              f"  int8 constants")
        for label, b in u["runs"].items():
            r = b.get("run", {})
            print(f"  {label:<26}{b.get('size_gb', 0) or 0:>9.2f}{b.get('median_s') or 0:>10.2f}"
                  f"{r.get('sampled_peak_rss_gb', 0):>17.2f}{r.get('sampled_peak_anon_gb', 0):>9.2f}"
                  f"{b.get('rel_l2', 0):>9.4f}  {(b.get('weights') or {}).get('constants', '')}")
    s = res.get("slice")
    if s:
        print(f"\nFlux slice step (full width, 2+2 blocks, 1024+512 tokens, {s['gflop']} GFLOP/call; "
              f"f32 GEMM peak {s['f32_peak']} GFLOP/s, OpenVINO int8-weight FC peak "
              f"{s['gemm_peak'].get('openvino_int8_weights')} GFLOP/s)")
        base = s["runs"].get("onnxruntime-fp32", {}).get("median_s")
        ov = s["runs"].get("openvino-f32", {}).get("median_s")
        print(f"  {'artifact':<20}{'median s':>10}{'GFLOP/s':>9}{'vs ORT f32':>11}{'vs OV f32':>10}{'rel L2':>9}"
              f"{'size GB':>9}{'peak RSS GB':>13}")
        for label, b in s["runs"].items():
            m = b.get("median_s")
            print(f"  {label:<20}{m or 0:>10.2f}{b.get('gflops', 0) or 0:>9.1f}"
                  f"{(base / m) if m and base else 0:>11.2f}{(ov / m) if m and ov else 0:>10.2f}"
                  f"{b.get('rel_l2', 0):>9.4f}{b.get('size_gb', 0) or 0:>9.2f}"
                  f"{b.get('run', {}).get('sampled_peak_rss_gb', 0):>13.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--parts", default="gguf,slice")
    ap.add_argument("--types", default="Q8_0,Q4_K")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cap-gib", type=float, default=20.0)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--work", default=str(HERE / "results" / "work" / "quantized"))
    ap.add_argument("--json", default=str(HERE / "results" / "quantized.json"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--builds", default="", help="only these builds (e.g. onnxruntime-gguf,openvino-gguf)")
    ap.add_argument("--sessions", default="", help="open a session only for these builds (default: every build)")
    opts = ap.parse_args()
    opts.builds = [b for b in opts.builds.split(",") if b]
    opts.sessions = [b for b in opts.sessions.split(",") if b]
    if opts.child:
        return child_main(opts.child)
    from machine import describe
    from precast.compiler.demo_dit import FLUX_DEV
    opts.cap = opts.cap_gib * (1 << 30)
    opts.types = opts.types.split(",")
    cfg = dataclasses.replace(FLUX_DEV, depth=1, depth_single=1) if opts.small else FLUX_DEV
    work = Path(opts.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict = {"machine": describe(("onnxruntime", "openvino", "nncf", "gguf", "numpy")), "small": opts.small}
    try:
        parts = opts.parts.split(",")
        if "gguf" in parts:
            res["gguf"] = [part_gguf(work, t, cfg, opts) for t in opts.types]
        if "slice" in parts:
            res["slice"] = part_slice(work, opts)
        if "unet" in parts:
            res["unet"] = part_unet(work, opts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(res, indent=1, default=str))
    print_report(res)
    print(f"\n(json: {opts.json}; work folder {work} deleted)")


if __name__ == "__main__":
    main()
