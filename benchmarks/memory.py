"""Benchmark: where the memory goes (issue 34) -- peak RSS per stage of a whole generation, per backend, beside
the weights' own bytes and stable-diffusion.cpp, and what each session option costs in memory and step time.

1. generate. Full-size SD 1.5 at 512x512 (export_unet.py's checkpoint: random, deterministic fp16 weights in the
   LDM single-file layout; --model sdxl: full-size SDXL base at 1024x1024, its checkpoint written here from
   compiler/demo_model.py's SDXL config, ~6.9 GB), `precast build` of an fp32 recipe for the OpenVINO CPU and ONNX Runtime targets
   (batch 1: the UNet runs batch 2 under CFG). Then `precast generate` (4 Euler steps, CFG 7, the machine's
   cores as threads) in a fresh process per backend (--backend all=B), its /proc/PID/smaps_rollup sampled every
   50 ms: Rss, Pss, Anonymous, file-backed = Rss - Anonymous. The child is the real CLI run in-process by this
   script (--child generate), with BundleModel's __init__, denoising and decode wrapped to write the time of
   each stage's start to a marks file (no runtime change): import (process start -> the bundle opens), load (->
   the text encoder and UNet loaded; the VAE decoder goes on loading in a loader thread), encode (the
   pipeline's set-up and the prompts), denoise, decode, write (PNG, exit). Per stage: the peak RSS, its
   anonymous / file-backed split at that sample, the peak of anonymous memory. Beside them: the weights' own
   bytes, the sum of each component's ONNX initializers in the bundle.
2. stable-diffusion.cpp on the same checkpoint (f32 and --type f16), sampled the same way, stages from its log
   lines: `sd-cli` built from source in the work folder (--sdcpp-src DIR: its source tree with ggml/ filled
   in; missing tokenizer vocab headers of other model families are stubbed, SD 1.5 reads CLIP's) or given
   (--sdcpp BIN). Without either, the issue's recorded numbers are printed, labelled recorded.
3. options (--options): the SD 1.5 UNet alone (batch 2, 512x512), one fresh process per session option:
   peak RSS while the session is created and while it runs (anonymous / file-backed), the median of
   --unet-calls calls after one warm-up, wall and process CPU seconds (steadier on a shared machine).
   OpenVINO: the bundle's blob as the runtime imports it (memory-mapped, its pages released while it is imported
   and after: blob_pages.import_blob), the same with its pages released only after the import, or kept (as
   before), a blob built without the Winograd rewrite (a second `precast build` with `winograd: false`), its
   pages released during or only after the import. ONNX Runtime, the bundle's optimized artifact:
   with the CPU arena (as before), without it (the runtime's), without the memory pattern, without both; and
   with the arena: without prepacking, initializers on the device allocator, the graph saved again with its
   prepacked weights in the external data file (session.save_external_prepacked_constant_initializers).

--low-memory SIZE adds the low-memory plan to 1: `--params-backend cpu:SIZE` (each component loaded when its stage
comes and freed after it), OpenVINO on a second bundle built without the Winograd rewrite (`winograd: false`).

Full-size runs wait until MemAvailable >= --min-available GiB (the machine is shared) and never overlap.
The work folder (default benchmarks/results/work/memory: checkpoint 2.1 GB, cache and bundles ~15 GB) is
deleted at the end unless --keep.

--openvino-options 'compress_to_fp16: true' builds every OpenVINO bundle with those target options too (the
weights kept in fp16 in the engine, f32 arithmetic).

Usage: .venv/bin/python benchmarks/memory.py [--model sd15|sdxl] [--backends openvino,onnxruntime] [--options] [--no-generate] [--low-memory 3.5G]
           [--sdcpp BIN | --sdcpp-src DIR] [--steps 4] [--unet-calls 2] [--work DIR] [--keep] [--json OUT]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
PRECAST = Path(sys.executable).with_name("precast")
PROMPT = "a photograph of an astronaut riding a horse"
GIB = 2 ** 30
# the run (2026-11-26, same checkpoint, 512x512, 4 Euler steps, CFG 7, 2 threads, AMD EPYC AVX2)
RECORDED_SDCPP = {"f32": {"peak_rss_gib": 4.3, "step_s": "47.5-53.4", "decode_s": "78-93", "total_s": "275-305"},
                  "f16": {"peak_rss_gib": 3.6}}
STAGES = ("import", "load", "encode", "denoise", "decode", "write")


# ---- sampling -----------------------------------------------------------------------------
def rollup(pid: int) -> dict | None:
    """Rss, Pss, Anonymous (bytes) and file-backed = Rss - Anonymous of a process, from smaps_rollup."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    v = {m.group(1): int(m.group(2)) * 1024 for m in re.finditer(r"^(\w+):\s+(\d+) kB", text, re.MULTILINE)}
    if "Rss" not in v:
        return None
    return {"rss": v["Rss"], "pss": v.get("Pss", 0), "anon": v.get("Anonymous", 0),
            "file": v["Rss"] - v.get("Anonymous", 0)}


class Sampler(threading.Thread):
    """smaps_rollup of `pid` every `interval` s, each sample stamped with time.monotonic() (reading it takes the
    kernel a walk over the mappings: ~0.25 s for a 9 GiB process, so big ones are sampled less often; VmHWM, the
    kernel's own peak, is recorded beside it)."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval, self.samples = pid, interval, []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            r = rollup(self.pid)
            if r is not None:
                self.samples.append((time.monotonic(), r))
            self.stop.wait(self.interval)


def stage_table(samples: list, marks: list[tuple[str, float]], t_start: float, t_end: float) -> dict:
    """{stage: {seconds, peak_rss, anon_at_peak, file_at_peak, peak_anon, pss_at_peak}}: stage i runs from its
    mark to the next one (the first from the process start, the last to its end)."""
    bounds = [(name, t) for name, t in marks]
    out = {}
    for i, (name, t0) in enumerate(bounds):
        t1 = bounds[i + 1][1] if i + 1 < len(bounds) else t_end
        inside = [r for t, r in samples if t0 <= t < t1] or [r for t, r in samples if t < t1][-1:]
        if not inside:
            continue
        top = max(inside, key=lambda r: r["rss"])
        out[name] = {"seconds": round(t1 - t0, 2), "peak_rss": top["rss"], "anon_at_peak": top["anon"],
                     "file_at_peak": top["file"], "pss_at_peak": top["pss"],
                     "peak_anon": max(r["anon"] for r in inside)}
    return out


def mem_available() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))


def wait_for_memory(min_gib: float, what: str, max_wait: float = 3600) -> float:
    """Block until MemAvailable >= min_gib (the machine is shared); returns what was available."""
    t0 = time.monotonic()
    while (avail := mem_available()) < min_gib * GIB:
        if time.monotonic() - t0 > max_wait:
            raise SystemExit(f"{what}: only {avail / GIB:.1f} GiB available after {max_wait:.0f} s of waiting")
        print(f"  waiting: {avail / GIB:.1f} GiB available, {what} needs {min_gib} GiB free first", flush=True)
        time.sleep(30)
    return avail


def measured(cmd: list[str], log: Path, marks_file: Path | None = None, line_marks=None, env=None,
             timeout: float = 3600) -> dict:
    """Run `cmd`, sampling it; stage marks from `marks_file` (lines 'monotonic name') or from `line_marks`
    (a function: a stderr/stdout line -> a stage name or None, stamped when the line arrives)."""
    if marks_file is not None:
        marks_file.unlink(missing_ok=True)
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    marks, lines = [("import" if marks_file else "start", t_start)], []
    with open(log, "w") as f:
        for line in _lines(proc.stdout):      # a progress bar's \r ends a line too
            now = time.monotonic()
            f.write(f"{now - t_start:9.2f} {line}\n")
            lines.append(line)
            name = line_marks(line) if line_marks else None
            if name and name not in {m[0] for m in marks}:
                marks.append((name, now))
    rc = proc.wait(timeout=timeout)
    t_end = time.monotonic()
    sampler.stop.set()
    sampler.join()
    extra = {}
    if marks_file is not None and marks_file.exists():
        for row in marks_file.read_text().split("\n"):
            parts = row.split(" ", 1)
            if len(parts) == 2 and parts[1].startswith("vmhwm="):
                extra["vmhwm"] = int(parts[1][6:])
            elif len(parts) == 2:
                marks.append((parts[1], float(parts[0])))
    marks.sort(key=lambda m: m[1])
    peak = max((r for _, r in sampler.samples), key=lambda r: r["rss"], default=None)
    return {"rc": rc, "wall_s": round(t_end - t_start, 2), "marks": [(n, round(t - t_start, 3)) for n, t in marks],
            "stages": stage_table(sampler.samples, marks, t_start, t_end), "peak": peak, "lines": lines, **extra,
            "samples_mib": [(round(t - t_start, 2), *(r[k] >> 20 for k in ("rss", "anon", "file")))
                            for t, r in sampler.samples]}


def _lines(stream):
    """Lines of a binary stream as they arrive, ended by \n or \r (empty ones skipped)."""
    buf = b""
    while chunk := os.read(stream.fileno(), 65536):
        buf += chunk
        *done, buf = re.split(rb"[\r\n]", buf)
        yield from (d.decode(errors="replace") for d in done if d.strip())
    if buf.strip():
        yield buf.decode(errors="replace")


# ---- children -------------------------------------------------------------------------------
def child_generate(spec: dict) -> None:
    """The real `precast generate`, in this process, with stage marks (see the module docstring)."""
    out = open(spec["marks"], "a", buffering=1)

    def mark(name: str) -> None:
        out.write(f"{time.monotonic():.4f} {name}\n")
    atexit.register(lambda: out.write(f"0 vmhwm={_vmhwm()}\n"))
    from precast.runtime import loading
    from precast.runtime.cli import main
    model = loading.BundleModel
    init, denoising, decode = model.__init__, model.denoising, model.decode

    def init_(self, *a, **k):
        mark("load")
        init(self, *a, **k)
        mark("encode")

    def denoising_(self, *a, **k):
        for i, item in enumerate(denoising(self, *a, **k)):
            if i == 0:
                mark("denoise")
            yield item

    def decode_(self, *a, **k):
        mark("decode")
        try:
            return decode(self, *a, **k)
        finally:
            mark("write")
    model.__init__, model.denoising, model.decode = init_, denoising_, decode_
    sys.argv = ["precast", *spec["argv"]]
    main()


def _vmhwm() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def unet_feeds():
    import numpy as np
    rng = np.random.default_rng(7)
    return {"sample": rng.standard_normal((2, 4, 64, 64)).astype(np.float32),
            "timestep": np.full((2,), 500.0, np.float32),
            "encoder_hidden_states": rng.standard_normal((2, 77, 768)).astype(np.float32)}


def child_unet(spec: dict) -> None:
    """One UNet session made the way `spec["variant"]` says, one warm-up call and `calls` timed calls."""
    out = open(spec["marks"], "a", buffering=1)

    def mark(name: str) -> None:
        out.write(f"{time.monotonic():.4f} {name}\n")
    atexit.register(lambda: out.write(f"0 vmhwm={_vmhwm()}\n"))
    import numpy as np
    feeds = unet_feeds()
    mark("load")
    session = open_variant(spec)
    mark("warmup")
    session(feeds)
    mark("run")
    times, cpu = [], []
    for _ in range(spec["calls"]):
        t0, c0 = time.perf_counter(), time.process_time()
        session(feeds)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    mark("end")
    Path(spec["result"]).write_text(json.dumps({"times": times, "cpu": cpu}))
    del np


def open_variant(spec: dict):
    """A callable feeds -> outputs for the UNet as the variant opens it."""
    folder, meta, variant = Path(spec["folder"]), spec["metadata"], spec["variant"]
    entry = folder / meta["entry"]
    if meta["backend"] == "openvino":
        from precast.runtime import blob_pages, sessions
        if variant.get("keep_pages"):      # as before release_pages: the imported blob's pages stay mapped in
            blob_pages.release_pages = lambda blob, clean_parts=False: False
        if variant.get("release_after"):  # as before import_blob: the pages dropped once the import is done
            blob_pages.RELEASE_EVERY = 1e9
        s = sessions.open_artifact(folder, meta)
        return s.run
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL     # optimized when built
    opts.enable_cpu_mem_arena = not variant.get("no_arena")
    opts.enable_mem_pattern = not variant.get("no_mem_pattern")
    for k, v in variant.get("config", {}).items():
        opts.add_session_config_entry(k, v)
    s = ort.InferenceSession(str(entry), opts, providers=["CPUExecutionProvider"])
    run = ort.RunOptions()
    if variant.get("shrink"):      # the arena gives back its unused chunks after every call
        run.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return lambda feeds: s.run(None, feeds, run)


def child_ort_prepacked(spec: dict) -> None:
    """The optimized ONNX Runtime artifact saved again with its prepacked weights in the external data file."""
    import onnxruntime as ort
    out = Path(spec["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.optimized_model_filepath = str(out)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", out.name + "_data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    ort.InferenceSession(spec["source"], opts, providers=["CPUExecutionProvider"])


def run_child(kind: str, spec: dict, folder: Path, label: str, min_gib: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "marks": str(folder / f"{label}.marks"), "result": str(folder / f"{label}.result.json")}
    (folder / f"{label}.spec.json").write_text(json.dumps(spec, indent=1))
    wait_for_memory(min_gib, label)
    print(f"  {label} ...", flush=True)
    r = measured([sys.executable, __file__, "--child", kind, str(folder / f"{label}.spec.json")],
                 folder / f"{label}.log", Path(spec["marks"]), env={**os.environ, **spec.get("env", {})})
    if Path(spec["result"]).exists():
        r.update(json.loads(Path(spec["result"]).read_text()))
    if r["rc"] != 0:
        print(f"    FAILED (rc {r['rc']}): {' | '.join(r['lines'][-5:])}", flush=True)
    return r


# ---- the bundle and the weights --------------------------------------------------------------
MODELS = {   # --model: the full-size checkpoint's config (compiler/demo_model.py), its size, its components
    "sd15": ("SD15", 512, "text_encoder, unet, vae_decoder"),
    "sdxl": ("SDXL", 1024, "text_encoder, text_encoder_2, unet, vae_decoder"),
}


def ensure_model_checkpoint(model: str, path: Path) -> None:
    """The full-size checkpoint (random, deterministic fp16 weights, LDM single-file layout), written once:
    SD 1.5 by export_unet.py; SDXL here, from compiler/demo_model.py's SDXL config (~6.9 GB)."""
    if model == "sd15":
        from export_unet import ensure_checkpoint
        ensure_checkpoint(path)
        return
    import numpy as np
    from precast.compiler import demo_model
    layout = demo_model.sd1_layout(getattr(demo_model, MODELS[model][0]))
    expect = sum(2 * int(np.prod(s)) for s in layout.values())
    if path.exists() and path.stat().st_size > expect:
        print(f"reusing {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
        return
    print(f"writing {path} (full-size {model}, random fp16 weights) ...", flush=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    demo_model.write_safetensors(str(path) + ".part", layout, "fp16", lambda k, s: demo_model.random_tensor(rng, k, s))
    os.replace(str(path) + ".part", path)
    print(f"  {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)


def ensure_bundle(work: Path, ckpt: Path, name: str, targets: str, min_gib: float, model: str = "sd15") -> Path:
    """A full-size fp32 bundle of MODEL at its size (SD 1.5 512x512, SDXL 1024x1024), batch 1, built once into
    work/NAME."""
    _, size, components = MODELS[model]
    bundle = work / name
    if (bundle / "manifest.json").exists():
        print(f"reusing {bundle}", flush=True)
        return bundle
    recipe = work / f"{name}.yaml"
    recipe.write_text(f"# written by benchmarks/memory.py\nname: {model}-{name}\nmodel:\n  source: {ckpt}\n"
                      f"components: [{components}]\nprecision: fp32\n"
                      f"profiles:\n  batch: 1\n  height: {size}\n  width: {size}\n  tokens: 77\n"
                      f"targets:\n{targets}")
    wait_for_memory(min_gib, f"precast build {name}")
    print(f"precast build {recipe} ...", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PRECAST_CACHE": str(work / "cache"), "PRECAST_PROGRESS": "plain"}
    with open(work / f"build-{name}.log", "w") as log:
        if subprocess.run([str(PRECAST), "build", str(recipe), "--out", str(bundle)], env=env, cwd=ROOT,
                          stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"precast build failed; see {work / f'build-{name}.log'}")
    print(f"  bundle in {time.perf_counter() - t0:.0f} s", flush=True)
    return bundle


def weight_bytes(bundle: Path) -> dict[str, int]:
    """Per component: the bytes of its ONNX initializers (external data and inline), from the bundle's ONNX."""
    import onnx
    from precast.compiler.targets.onnx_weights import nbytes
    manifest = json.loads((bundle / "manifest.json").read_text())
    out = {}
    for comp, info in manifest["components"].items():
        model = onnx.load(str(bundle / info["onnx"]), load_external_data=False)
        out[comp] = sum(nbytes(t) for t in model.graph.initializer)
    return out


def artifacts(bundle: Path) -> dict:
    """{component: {backend: (folder, metadata, bytes)}} from the bundle's manifest."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    out: dict = {}
    for a in manifest["artifacts"]:
        size = sum(manifest["files"][f]["size"] for f in a["files"])
        meta = {"backend": a["backend"], "entry": a["entry"], **a.get("metadata", {})}
        out.setdefault(a["component"], {})[a["backend"]] = (str(bundle), meta, size)
    return out


# ---- stable-diffusion.cpp ------------------------------------------------------------------
def ensure_sdcpp(work: Path, src: Path | None, binary: Path | None) -> Path | None:
    if binary:
        return binary
    built = work / "sdcpp" / "build" / "bin" / "sd-cli"
    if built.exists():
        return built
    if src is None:
        return None
    vocab = src / "src" / "tokenizers" / "vocab"
    for header, names in _VOCAB_STUBS.items():      # other families' tokenizers: absent from some source copies
        if not (vocab / header).exists():
            (vocab / header).write_text("".join(f"static const unsigned char {n}[] = {{0}};  // stub\n" for n in names))
    build = work / "sdcpp" / "build"
    print(f"building stable-diffusion.cpp from {src} ...", flush=True)
    for cmd in (["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DSD_WEBP=OFF",
                 "-DSD_WEBM=OFF", "-DGGML_NATIVE=ON"],
                ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", "sd-cli"]):
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode:
            print("  stable-diffusion.cpp did not build; its recorded numbers are shown instead")
            return None
    return built if built.exists() else None


_VOCAB_STUBS = {"gemma2_merges.hpp": ["gemma2_merges_utf8_c_str"], "gemma2_vocab.hpp": ["gemma2_vocab_json_utf8_c_str"],
                "gemma_merges.hpp": ["gemma_merges_utf8_c_str"], "gemma_vocab.hpp": ["gemma_vocab_json_utf8_c_str"],
                "gpt_oss_merges.hpp": ["gpt_oss_merges_utf8_c_str"],
                "gpt_oss_vocab.hpp": ["gpt_oss_vocab_json_utf8_c_str"],
                "mistral_merges.hpp": ["mistral_merges_utf8_c_str"],
                "mistral_vocab.hpp": ["mistral_vocab_json_utf8_c_str"], "qwen_merges.hpp": ["qwen2_merges_utf8_c_str"],
                "t5.hpp": ["t5_tokenizer_json_str"], "umt5.hpp": ["umt5_tokenizer_json_str"]}


def sdcpp_stage(line: str) -> str | None:
    """stable-diffusion.cpp's log line -> the stage that starts there."""
    for pattern, stage in (("loading model from", "load"), ("parse '", "encode"), ("generating image:", "denoise"),
                           (r"decoding \d+ latents", "decode"), ("decode_first_stage completed", "write")):
        if re.search(pattern, line):
            return stage
    return None


# ---- report ----------------------------------------------------------------------------------
def gib(n) -> str:
    return "" if n is None else f"{n / GIB:.2f}"


def print_generate(rows: dict, weights: dict[str, int]) -> None:
    total = sum(weights.values())
    print("\nweights (fp32 ONNX initializers): " + ", ".join(f"{c} {gib(b)}" for c, b in weights.items())
          + f"; total {gib(total)} GiB")
    head = f"{'runner':<22} {'stage':<8} {'s':>6} {'peak RSS':>9} {'anon':>6} {'file':>6} {'max anon':>9}  x weights"
    print(head + "\n" + "-" * len(head))
    for name, r in rows.items():
        for stage, s in r.get("stages", {}).items():
            print(f"{name:<22} {stage:<8} {s['seconds']:>6.1f} {gib(s['peak_rss']):>9} {gib(s['anon_at_peak']):>6} "
                  f"{gib(s['file_at_peak']):>6} {gib(s['peak_anon']):>9}  {s['peak_rss'] / total:.2f}")
        if r.get("peak"):
            print(f"{name:<22} {'PEAK':<8} {r['wall_s']:>6.1f} {gib(r['peak']['rss']):>9} {gib(r['peak']['anon']):>6} "
                  f"{gib(r['peak']['file']):>6} {'':>9}  {r['peak']['rss'] / total:.2f}"
                  + (f"   (VmHWM {gib(r['vmhwm'])})" if r.get("vmhwm") else ""))
    print("GiB; anon / file = anonymous and file-backed RSS at the stage's peak sample; max anon = the stage's "
          "highest anonymous RSS; x weights = peak RSS / the weights' bytes")


def print_options(rows: dict) -> None:
    head = (f"{'option':<52} {'load peak':>9} {'run peak':>9} {'anon':>6} {'file':>6} {'step s':>7} "
            f"{'cpu s':>6}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, r in rows.items():
        if r.get("rc") or "times" not in r:
            print(f"{name:<52} failed")
            continue
        load, run = r["stages"].get("load", {}), r["stages"].get("run", {})
        print(f"{name:<52} {gib(load.get('peak_rss')):>9} {gib(run.get('peak_rss')):>9} {gib(run.get('anon_at_peak')):>6} "
              f"{gib(run.get('file_at_peak')):>6} "
              f"{statistics.median(r['times']):>7.2f} {statistics.median(r.get('cpu') or [0]):>6.1f}")
    print("GiB; load peak = while the session is created; run peak (anonymous / file-backed) = over the timed calls; "
          "step s = median UNet call (batch 2, 512x512), cpu s = its process CPU "
          "seconds (all threads: steadier than wall time on a shared machine)")


# ---- main ------------------------------------------------------------------------------------
def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[3]).read_text())
        {"generate": child_generate, "unet": child_unet, "ort-prepacked": child_ort_prepacked}[sys.argv[2]](spec)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="sd15", help="the full-size model (its size: "
                    "SD 1.5 512x512, SDXL 1024x1024)")
    ap.add_argument("--backends", default="openvino,onnxruntime")
    ap.add_argument("--no-generate", action="store_true", help="skip the whole-generation runs")
    ap.add_argument("--options", action="store_true", help="also the UNet-only session options table")
    ap.add_argument("--sdcpp", type=Path, help="a stable-diffusion.cpp sd-cli binary")
    ap.add_argument("--sdcpp-src", type=Path, help="stable-diffusion.cpp source (ggml/ filled in), built in the work folder")
    ap.add_argument("--sdcpp-types", default="f32,f16", help="stable-diffusion.cpp weight types to run ('' none)")
    ap.add_argument("--low-memory", default=None, metavar="SIZE", help="also generate with --params-backend cpu:SIZE "
                    "(components one at a time; OpenVINO on a blob built without Winograd), e.g. 3.5G")
    ap.add_argument("--openvino-options", default="", metavar="YAML",
                    help="more options of every OpenVINO target built, e.g. 'compress_to_fp16: true'")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--unet-calls", type=int, default=2)
    ap.add_argument("--only", action="append", help="options: only the variants whose name holds this (repeatable)")
    ap.add_argument("--min-available", type=float, default=14.0, help="GiB available before each full-size run")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work" / "memory")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "memory.json")
    opts = ap.parse_args()
    from machine import describe
    work = opts.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, side = opts.model, MODELS[opts.model][1]
    size = f"{side}x{side}"
    ckpt = work / f"{model}_random_fp16.safetensors"
    ensure_model_checkpoint(model, ckpt)
    ov_extra = f", {opts.openvino_options}" if opts.openvino_options else ""
    targets = "".join(f"  - {t}\n" for t in ((f"openvino: {{device: CPU{ov_extra}}}",) if "openvino" in opts.backends else ())
                      + (("onnxruntime",) if "onnxruntime" in opts.backends else ()))
    bundle = ensure_bundle(work, ckpt, "bundle", targets, opts.min_available, model)
    weights = weight_bytes(bundle)
    result = {"machine": describe(("numpy", "onnxruntime", "openvino")), "load_start": os.getloadavg(),
              "settings": {"model": model, "size": size, "steps": opts.steps, "guidance": 7.0, "scheduler": "euler",
                           "threads": os.cpu_count()},
              "weights": weights, "artifact_bytes": {c: {b: v[2] for b, v in a.items()}
                                                    for c, a in artifacts(bundle).items()}}
    runs = work / "runs"
    gen: dict = {}
    if not opts.no_generate:
        print("\n== generate ==", flush=True)
        for backend in opts.backends.split(","):
            argv = ["generate", str(bundle), "--prompt", PROMPT, "--steps", str(opts.steps), "--guidance", "7",
                    "--seed", "0", "--size", size, "--backend", f"all={backend}", "--out",
                    str(runs / f"{backend}.png"), "--json"]
            gen[f"precast {backend}"] = r = run_child("generate", {"argv": argv}, runs, backend, opts.min_available)
            text = "\n".join(r.pop("lines"))
            if r["rc"] == 0:
                report = json.loads(text[text.index("{"):])
                r["seconds"] = report["seconds"]
                r["where"] = {c: (w["backend"], w["artifact"]) for c, w in report["components"].items()}
        if opts.low_memory:          # one component at a time under a budget: the low-memory plan
            plain = ensure_bundle(work, ckpt, "bundle-nowinograd",
                                  f"  - openvino: {{device: CPU, winograd: false{ov_extra}}}\n",
                                  opts.min_available, model) if "openvino" in opts.backends else None
            for folder, backend in ((plain, "openvino"), (bundle, "onnxruntime")):
                if backend not in opts.backends.split(","):
                    continue
                name = f"{backend} cpu:{opts.low_memory}"       # openvino: the blob without Winograd
                argv = ["generate", str(folder), "--prompt", PROMPT, "--steps", str(opts.steps), "--guidance", "7",
                        "--seed", "0", "--size", size, "--backend", f"all={backend}", "--params-backend",
                        f"cpu:{opts.low_memory}", "--out", str(runs / f"{backend}-low.png"), "--json"]
                gen[name] = r = run_child("generate", {"argv": argv}, runs, f"{backend}-low", opts.min_available)
                text = "\n".join(r.pop("lines"))
                if r["rc"] == 0:
                    report = json.loads(text[text.index("{"):])
                    r["seconds"] = report["seconds"]
                    r["plans"] = {c: (w.get("memory") or {}).get("plan") for c, w in report["components"].items()}
        sdcpp = ensure_sdcpp(work, opts.sdcpp_src, opts.sdcpp)
        if sdcpp:
            for wtype in filter(None, opts.sdcpp_types.split(",")):
                wait_for_memory(opts.min_available, f"stable-diffusion.cpp {wtype}")
                print(f"  stable-diffusion.cpp {wtype} ...", flush=True)
                cmd = [str(sdcpp), "-m", str(ckpt), "-p", PROMPT, "--steps", str(opts.steps), "--cfg-scale", "7",
                       "-W", str(side), "-H", str(side), "-s", "0", "-t", str(os.cpu_count()), "--sampling-method", "euler",
                       "-o", str(runs / f"sdcpp-{wtype}.png"), "-v", "--type", wtype]
                r = measured(cmd, runs / f"sdcpp-{wtype}.log", line_marks=sdcpp_stage)
                r.pop("lines")
                gen[f"stable-diffusion.cpp {wtype}"] = r
        else:
            result["sdcpp_recorded"] = RECORDED_SDCPP
        result["generate"] = gen
        print_generate(gen, weights)
        if not sdcpp:
            print(f"stable-diffusion.cpp: not built here; RECORDED (issue 34, not measured in this run): {RECORDED_SDCPP}")
    if opts.options:
        print("\n== UNet session options ==", flush=True)
        arts = artifacts(bundle)["unet"]
        variants: dict = {}
        if "openvino" in arts:
            folder, meta, _ = arts["openvino"]
            variants["openvino blob, pages kept (before)"] = (folder, meta, {"keep_pages": True})
            variants["openvino blob, pages released after import (before)"] = (folder, meta, {"release_after": True})
            variants["openvino blob, pages released during import (runtime)"] = (folder, meta, {})
            plain = ensure_bundle(work, ckpt, "bundle-nowinograd",
                                  f"  - openvino: {{device: CPU, winograd: false{ov_extra}}}\n", opts.min_available)
            folder2, meta2, _ = artifacts(plain)["unet"]["openvino"]
            variants["openvino blob without Winograd, pages released after import"] = (folder2, meta2,
                                                                                      {"release_after": True})
            variants["openvino blob without Winograd"] = (folder2, meta2, {})
        if "onnxruntime" in arts:
            folder, meta, _ = arts["onnxruntime"]
            variants["onnxruntime, CPU arena (before)"] = (folder, meta, {})
            variants["onnxruntime, no CPU arena (runtime)"] = (folder, meta, {"no_arena": True})
            variants["onnxruntime, arena, enable_mem_pattern=0"] = (folder, meta, {"no_mem_pattern": True})
            variants["onnxruntime, arena shrunk after each call"] = (folder, meta, {"shrink": True})
            variants["onnxruntime, no arena, enable_mem_pattern=0"] = (folder, meta, {"no_arena": True,
                                                                                    "no_mem_pattern": True})
            variants["onnxruntime, arena, disable_prepacking=1"] = (
                folder, meta, {"config": {"session.disable_prepacking": "1"}})
            variants["onnxruntime, arena, use_device_allocator_for_initializers"] = (
                folder, meta, {"config": {"session.use_device_allocator_for_initializers": "1"}})
            packed = work / "ort-prepacked" / "model.onnx"
            if not packed.exists():
                run_child("ort-prepacked", {"source": str(Path(folder) / meta["entry"]), "out": str(packed)}, runs,
                          "ort-prepacked-save", opts.min_available)
            if packed.exists():
                variants["onnxruntime, arena, prepacked weights in the data file"] = (
                    str(packed.parent), {**meta, "entry": packed.name}, {})
        opt_rows = {}
        for name, (folder, meta, variant) in variants.items():
            if opts.only and not any(w in name for w in opts.only):
                continue
            label = "unet-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
            r = run_child("unet", {"folder": folder, "metadata": meta, "variant": variant, "calls": opts.unet_calls},
                          runs, label, opts.min_available)
            r.pop("lines")
            opt_rows[name] = r
        result["options"] = opt_rows
        print_options(opt_rows)
    result["load_end"] = os.getloadavg()
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nwrote {opts.json}")
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
