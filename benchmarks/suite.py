"""Benchmark suite (issue 7): precast's engines vs every peer, one command, one run.

Full-size SD 1.5 (random, deterministic fp16 weights in the LDM single-file layout: the
checkpoint of export_unet.py, written once into the work folder), three components, the same
inputs for every runner, outputs checked against PyTorch:

  unet          latent 64x64 (512x512 image), batch 1 by default (--batch 2 = as classifier-free
                guidance runs it), 77 tokens
  vae_decoder   latent 64x64 -> 512x512 image
  text_encoder  77 tokens (CLIP-L)

Runners, each in a fresh process (so one's memory and threads cannot bill another):

  torch            PyTorch eager, diffusers/transformers models built from the same single file by
                   diffusers' own LDM converters, fp32, torch's default threads
  onnxruntime      ONNX Runtime (CPU, default session options) on the torch-exported ONNX
  openvino         OpenVINO on the torch-exported ONNX as a user runs it: read_model + compile_model
                   with the default config (on this CPU the default precision hint is bf16)
  openvino-f32     the same with INFERENCE_PRECISION_HINT=f32
  openvino-f32-static  (extra, the strongest peer) the same ONNX reshaped to the static input shapes
  precast          precast's engine: `precast build` of a recipe with a static 512x512 profile
                   (OpenVINO CPU target; fp32), the artifact compiled through the cache
                   (compile_component) and run through the runtime's session (open_artifact)
  (precast-bf16), (precast-f16)  UNet only: our graph compiled with those precision hints (static,
                   without the f32-only rewrites), to show what the target's f32 choice is measured against

The torch-exported ONNX files (torch.onnx.export, TorchScript exporter, dynamic batch/size axes,
opset 17, as optimum exports them) are cached under the work folder. Each runner: one warm-up
call, then --steps timed calls; the median is reported, with the load average at its start.
The machine's fp32 GEMM peak is measured in the same run (torch and numpy 4096x4096 matmul,
best of both, at the start and at the end) and each result is given as % of it. UNet FLOPs
follow the issue's convention: convolutions + linear layers (677 GFLOP per sample at 64x64);
the attention matmuls (QK^T, PV) add 126 GFLOP and are reported separately.

OpenVINO per-op performance counters (PERF_COUNT) for precast's engine and the OpenVINO peer:
time per (op type, kernel) and the slowest nodes, printed and in the JSON.

Cold start: `precast build` time, then in a fresh process the runtime's Txt2Img over the bundle
(manifest, device discovery, selection with sha256 verification, loading each engine) and one
txt2img step to the first image; and per component, the cached load (sha256 of the blob +
import_model of the memory-mapped blob, as the runtime does it) vs compiling the bundle's ONNX
(read_model + reshape + the target's rewrites + compile_model with the recorded config).

Usage: .venv/bin/python benchmarks/suite.py [--only unet|vae|text ...] [--skip-peers] [--batch 1|2]
           [--steps N] [--no-profile] [--no-cold-start] [--ov-option K=V ...] [--work DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from machine import describe  # benchmarks/machine.py, beside this script

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PRECAST = Path(sys.executable).with_name("precast")
COMPONENTS = {"unet": "unet", "vae": "vae_decoder", "text": "text_encoder"}
PEERS = ("torch", "onnxruntime", "openvino", "openvino-f32", "openvino-f32-static")
PARITY_TOL = 1e-3                    # max|ours - torch| / max|torch|
SPEED_FLOOR = 1.10                   # ours at least 10% faster than OpenVINO on the torch-exported ONNX
PEAK_TARGET = 0.70                   # UNet step at >= 70% of the measured GEMM peak
CHILD_TIMEOUT_S = 3600
IMAGE, LATENT, TOKENS = 512, 64, 77

SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=[320, 640, 1280, 1280], cross_attention_dim=768, attention_head_dim=8,
                 down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, norm_num_groups=32)
SD15_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=512)
SD15_CLIP = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu")
PREFIX = {"unet": "model.diffusion_model.", "vae_decoder": "first_stage_model.", "text_encoder": "cond_stage_model."}
INPUT_NAMES = {"unet": ["sample", "timestep", "encoder_hidden_states"], "vae_decoder": ["latent_sample"],
               "text_encoder": ["input_ids"]}
OUTPUT_NAMES = {"unet": ["out_sample"], "vae_decoder": ["sample"],
                "text_encoder": ["last_hidden_state", "pooler_output"]}


# ---- inputs -----------------------------------------------------------------------------
def make_inputs(component: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng({"unet": 7, "vae_decoder": 8, "text_encoder": 9}[component])
    if component == "unet":
        return {"sample": rng.standard_normal((batch, 4, LATENT, LATENT)).astype(np.float32),
                "timestep": np.full((batch,), 500.0, np.float32),
                "encoder_hidden_states": rng.standard_normal((batch, TOKENS, 768)).astype(np.float32)}
    if component == "vae_decoder":
        return {"latent_sample": rng.standard_normal((1, 4, LATENT, LATENT)).astype(np.float32)}
    ids = np.full((1, TOKENS), 49407, np.int64)      # BOS, 20 words, EOS, padded with EOS (CLIP-L)
    ids[0, 0] = 49406
    ids[0, 1:21] = rng.integers(300, 49000, 20)
    return {"input_ids": ids}


# ---- the children -------------------------------------------------------------------------
def _vm_hwm_mb() -> float:
    status = open("/proc/self/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024


def _time_calls(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps + 1):                 # the first call is the warm-up
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def torch_model(component: str, ckpt: str):
    """diffusers / transformers model from the LDM single file, fp32, eval."""
    import torch
    from diffusers.loaders import single_file_utils as sfu
    from safetensors import safe_open
    prefix = PREFIX[component]
    with safe_open(ckpt, "pt") as f:
        sd = {k: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)}
    if component == "unet":
        from diffusers import UNet2DConditionModel
        model = UNet2DConditionModel(**SD15_UNET)
        model.load_state_dict(sfu.convert_ldm_unet_checkpoint(sd, SD15_UNET), strict=True)
    elif component == "vae_decoder":
        from diffusers import AutoencoderKL
        model = AutoencoderKL(**SD15_VAE)
        model.load_state_dict(sfu.convert_ldm_vae_checkpoint(sd, SD15_VAE), strict=True)
    else:
        from transformers import CLIPTextConfig, CLIPTextModel
        model = CLIPTextModel(CLIPTextConfig(**SD15_CLIP))
        te = sfu.convert_ldm_clip_checkpoint(sd)
        if not any(k.startswith("text_model.") for k in model.state_dict()):
            te = {k.removeprefix("text_model."): v for k, v in te.items()}
        missing, _ = model.load_state_dict({k: v for k, v in te.items() if "position_ids" not in k}, strict=False)
        assert not [m for m in missing if "position_ids" not in m], missing
    del sd
    torch.manual_seed(0)
    return model.eval()


class _Forward:
    """A plain-tensors-in, tuple-out wrapper per component (for eager calls and the exporter)."""

    @staticmethod
    def wrap(component: str, model):
        import torch

        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, *args):
                if component == "unet":
                    return (self.m(*args, return_dict=False)[0],)
                if component == "vae_decoder":
                    return (self.m.decode(args[0], return_dict=False)[0],)
                out = self.m(args[0])
                return out.last_hidden_state, out.pooler_output
        return W().eval()


def child_torch(spec: dict) -> dict:
    import torch
    comp = spec["component"]
    t0 = time.perf_counter()
    model = _Forward.wrap(comp, torch_model(comp, spec["checkpoint"]))
    load = time.perf_counter() - t0
    feeds = dict(np.load(spec["inputs"]))
    args = [torch.from_numpy(feeds[n]) for n in INPUT_NAMES[comp]]
    outs = {}

    def call():
        with torch.inference_mode():
            res = model(*args)
        outs.update({n: r.float().numpy() for n, r in zip(OUTPUT_NAMES[comp], res)})
    times = _time_calls(call, spec["steps"])
    return {"load_s": load, "times": times, "outputs": outs,
            "detail": f"diffusers/transformers eager fp32, torch {torch.__version__}, {torch.get_num_threads()} threads"}


def child_torch_export(spec: dict) -> dict:
    """torch.onnx.export (TorchScript exporter; dynamic axes) of one component."""
    import torch
    comp = spec["component"]
    model = _Forward.wrap(comp, torch_model(comp, spec["checkpoint"]))
    feeds = dict(np.load(spec["inputs"]))
    args = tuple(torch.from_numpy(feeds[n]) for n in INPUT_NAMES[comp])
    dyn = {"unet": {"sample": {0: "batch", 2: "height", 3: "width"}, "timestep": {0: "steps"},
                    "encoder_hidden_states": {0: "batch", 1: "sequence"},
                    "out_sample": {0: "batch", 2: "height", 3: "width"}},
           "vae_decoder": {"latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"},
                           "sample": {0: "batch", 2: "height", 3: "width"}},
           "text_encoder": {"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"},
                            "pooler_output": {0: "batch"}}}[comp]
    out = Path(spec["onnx"])
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(model, args, str(out), dynamo=False, opset_version=17, input_names=INPUT_NAMES[comp],
                          output_names=OUTPUT_NAMES[comp], dynamic_axes=dyn)
    return {"export_s": time.perf_counter() - t0, "exporter": "torch.onnx.export (TorchScript, dynamo=False), opset 17"}


def _typed(feeds: dict[str, np.ndarray], types: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v, dtype=types[k]) for k, v in feeds.items() if k in types}


def child_onnxruntime(spec: dict) -> dict:
    import onnxruntime as ort
    t0 = time.perf_counter()
    sess = ort.InferenceSession(spec["onnx"], providers=["CPUExecutionProvider"])
    load = time.perf_counter() - t0
    kinds = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(float16)": np.float16}
    feeds = _typed(dict(np.load(spec["inputs"])), {i.name: kinds[i.type] for i in sess.get_inputs()})
    names = [o.name for o in sess.get_outputs()]
    outs = {}
    times = _time_calls(lambda: outs.update(zip(names, sess.run(None, feeds))), spec["steps"])
    return {"load_s": load, "times": times, "outputs": outs,
            "detail": f"onnxruntime {ort.__version__} CPUExecutionProvider, default session options"}


def _ov_outputs(compiled, request, wanted: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for port in compiled.outputs:
        names = sorted(port.get_names())
        name = next((n for n in wanted if n in names), names[0] if names else port.get_any_name())
        out[name] = np.array(request.get_tensor(port).data)
    return out


def ov_profile(request, compiled, top: int = 10) -> dict:
    """Per-op performance counters of the last inference: time per (op type, kernel) and the
    slowest nodes. Fused 'Subgraph' nodes are labelled MHA when they hold a Softmax."""
    origin = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        names = rt["originalLayersNames"].astype(str).lower() if "originalLayersNames" in rt else ""
        ins = [str(op.input_value(i).get_partial_shape()).strip("[]").split(",") for i in range(op.get_input_size())]
        if "softmax" in names or (len(ins) == 3 and all(len(i) == 4 and "1" not in i[1:] for i in ins)
                                  and len({tuple(i) for i in ins}) > 1):
            names += " softmax"   # imported blobs keep no fused names: q, k^T, v (4-D, unbroadcast) is attention
        origin[op.get_friendly_name()] = names
    by_kind, count, nodes, total = collections.Counter(), collections.Counter(), [], 0.0
    for p in request.profiling_info:
        if not str(p.status).endswith("EXECUTED"):
            continue
        ms = p.real_time.total_seconds() * 1e3
        kind = p.node_type
        if kind == "Subgraph":
            kind = "Subgraph(MHA)" if "softmax" in origin.get(p.node_name, "") else "Subgraph(eltwise)"
        by_kind[(kind, p.exec_type)] += ms
        count[(kind, p.exec_type)] += 1
        nodes.append((ms, p.node_name, kind, p.exec_type))
        total += ms
    return {"total_ms": round(total, 1),
            "by_op": [{"op": k, "kernel": e, "ms": round(ms, 1), "share": round(ms / total, 4), "count": count[(k, e)]}
                      for (k, e), ms in by_kind.most_common(top)],
            "top_nodes": [{"node": n[:120], "op": k, "kernel": e, "ms": round(ms, 1)}
                          for ms, n, k, e in sorted(nodes, reverse=True)[:top]]}


def child_openvino(spec: dict) -> dict:
    import openvino as ov
    core = ov.Core()
    feeds_all = dict(np.load(spec["inputs"]))
    config = dict(spec.get("ov_config") or {})

    def compile_(extra: dict):
        model = core.read_model(spec["onnx"])
        if spec.get("static"):
            model.reshape({p.get_any_name(): ov.PartialShape(list(feeds_all[p.get_any_name()].shape))
                           for p in model.inputs})
        return core.compile_model(model, "CPU", {**config, **extra})
    t0 = time.perf_counter()
    compiled = compile_({})
    load = time.perf_counter() - t0
    request = compiled.create_infer_request()
    types = {p.get_any_name(): np.dtype(p.get_element_type().to_dtype()) for p in compiled.inputs}
    feeds = _typed(feeds_all, types)
    times = _time_calls(lambda: request.infer(feeds), spec["steps"])
    outs = _ov_outputs(compiled, request, OUTPUT_NAMES[spec['component']])
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    res = {"load_s": load, "times": times, "outputs": outs,
           "detail": f"openvino {ov.get_version().split('-')[0]} compile_model(read_model(onnx){', static' if spec.get('static') else ''}, "
                     f"{config or 'default config'}); precision {precision}, hint {compiled.get_property('PERFORMANCE_HINT')}, "
                     f"{compiled.get_property('NUM_STREAMS')} stream(s), {compiled.get_property('INFERENCE_NUM_THREADS')} threads"}
    if spec.get("profile"):
        del request, compiled
        prof_compiled = compile_({"PERF_COUNT": True})
        prof_req = prof_compiled.create_infer_request()
        prof_req.infer(feeds)
        prof_req.infer(feeds)
        res["profile"] = ov_profile(prof_req, prof_compiled)
    return res


def child_precast(spec: dict) -> dict:
    """Our engine: compile_component through the cache (a hit once built), then the runtime's
    session for the artifact (OpenVINO: import_model of the blob with its recorded config)."""
    os.environ["PRECAST_CACHE"] = spec["cache"]
    from precast.compiler.cache import Cache
    from precast.compiler.engines import ExportedComponent
    from precast.compiler.engines import compile_component
    from precast.compiler.profiles import ShapeProfile
    from precast.compiler.targets import parse_target
    from precast.runtime import sessions
    comp = spec["component"]
    info = spec["export"]
    exported = ExportedComponent(comp, Path(info["onnx"]), info["inputs"], info["outputs"])
    batch = spec["batch"]
    profile = ShapeProfile(batch=(batch,) * 3, cfg_doubling=False) if comp == "unet" else ShapeProfile()
    spec_t = parse_target("openvino", {"device": "CPU", **spec.get("target_options", {})})
    t0 = time.perf_counter()
    record, entry = compile_component(exported, spec_t, profile, Cache(Path(spec["cache"])), progress=False)
    compile_s = time.perf_counter() - t0
    if spec.get("compile_only"):
        return {"compile_component_s": compile_s, "cache": record["cache"]}
    t0 = time.perf_counter()
    session = sessions.open_artifact(entry.path, entry.metadata)
    load = time.perf_counter() - t0
    feeds = dict(np.load(spec["inputs"]))
    if comp == "text_encoder":      # as the runtime feeds it: the extra rows padded to a static engine's size
        from precast.runtime.embeddings import encoder_feeds
        feeds = encoder_feeds(session, comp, feeds["input_ids"].astype(np.int32), None, 768)
    outs = {}
    times = _time_calls(lambda: outs.update(session.run(feeds)), spec["steps"])
    cfg = entry.metadata.get("compile_config", {})
    cm = getattr(session, "_cm", None)
    props = {k: str(cm.get_property(k)) for k in ("INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT", "NUM_STREAMS",
                                                  "INFERENCE_NUM_THREADS")} if cm is not None else {}
    res = {"load_s": load, "times": times, "outputs": outs, "cache": record["cache"], "compiled_properties": props,
           "rewrites": entry.metadata.get("rewrites"), "blob_mb": round(entry.size / 1e6, 1),
           "compile_component_s": compile_s, "build_seconds": entry.metadata.get("build_seconds"),
           "compile_config": cfg, "static": entry.metadata.get("static"), "artifact": record["key"][:12],
           "detail": f"precast engine (openvino blob, {'static' if entry.metadata.get('static') else 'dynamic'} "
                     f"shapes, {props or cfg}, rewrites {entry.metadata.get('rewrites')}) via "
                     f"runtime.sessions.open_artifact; cache {record['cache']}"}
    if spec.get("profile"):
        import openvino as ov
        del session
        core = ov.Core()
        compiled = core.import_model((entry.path / entry.metadata["entry"]).read_bytes(), "CPU",
                                     {**cfg, "PERF_COUNT": True})
        req = compiled.create_infer_request()
        types = {p.get_any_name(): np.dtype(p.get_element_type().to_dtype()) for p in compiled.inputs}
        typed = {k: np.ascontiguousarray(v, dtype=types[k]) for k, v in feeds.items() if k in types}
        req.infer(typed)
        req.infer(typed)
        res["profile"] = ov_profile(req, compiled)
    return res


def child_cold_start(spec: dict) -> dict:
    """A fresh process: bundle -> first image through the runtime (Txt2Img, 1 step), then per
    component import_model of the cached blob vs compiling the bundle's ONNX."""
    t_proc = time.perf_counter()
    from precast.runtime.families.sd import Txt2Img
    import_s = time.perf_counter() - t_proc
    t0 = time.perf_counter()
    pipe = Txt2Img(spec["bundle"], width=IMAGE, height=IMAGE)
    init_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    image = pipe("a photo of a cat", steps=1, seed=0, progress=False)
    first_s = time.perf_counter() - t1
    where = {c: {k: v for k, v in w.items() if k in ("backend", "artifact", "how")} for c, w in pipe.report()["components"].items()}
    result = {"runtime_import_s": import_s, "txt2img_init_s": init_s, "first_image_s": first_s,
              "bundle_to_first_output_s": time.perf_counter() - t_proc, "image_shape": list(image.shape),
              "where": where, "per_component": {}}
    del pipe
    import openvino as ov
    from precast.compiler.targets import parse_target
    from precast.compiler.targets.openvino import OpenVinoTarget
    from precast.compiler.targets.openvino_winograd import rewrite_convolutions
    from precast.runtime import sessions
    from precast.runtime.manifest import read_manifest, verify_file
    manifest = read_manifest(spec["bundle"])
    root = Path(spec["bundle"])
    for comp in ("text_encoder", "unet", "vae_decoder"):
        arts = [a for a in manifest.artifacts(comp) if a.backend == "openvino"]
        if not arts:
            continue
        a = arts[0]
        t0 = time.perf_counter()
        for rel in a.files:
            verify_file(root, rel, manifest.files[rel])
        verify_s = time.perf_counter() - t0
        t0 = time.perf_counter()      # the runtime's cached load: import_model of the memory-mapped blob
        session = sessions.open_artifact(root, {"backend": "openvino", "entry": a.entry, **a.metadata})
        open_s = time.perf_counter() - t0
        del session
        info = manifest.components[comp]
        target = OpenVinoTarget()
        spec_t = parse_target("openvino", {"device": "CPU"})
        config = target.compile_config(spec_t)
        t0 = time.perf_counter()   # what a cache miss costs, less writing the blob: read, reshape, rewrites, compile
        model = ov.Core().read_model(str(root / info["onnx"]))
        model.reshape({k: ov.PartialShape(list(v[1])) for k, v in a.shapes.items()})
        rewrites = rewrite_convolutions(model) if a.metadata.get("rewrites", {}).get("winograd") else None
        compiled = ov.Core().compile_model(model, "CPU", config)
        build_s = time.perf_counter() - t0
        del compiled, model
        result["per_component"][comp] = {"sha256_verify_s": verify_s, "open_artifact_s": open_s,
                                         "compile_s": build_s, "rewrites": rewrites,
                                         "blob_mb": round(sum(manifest.files[r]["size"] for r in a.files) / 1e6, 1),
                                         "ratio": build_s / max(verify_s + open_s, 1e-9)}
    return result


CHILDREN = {"torch": child_torch, "torch-export": child_torch_export, "onnxruntime": child_onnxruntime,
            "openvino": child_openvino, "precast": child_precast, "cold-start": child_cold_start}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res = CHILDREN[spec["kind"]](spec)
    out = Path(spec["out"])
    outputs = res.pop("outputs", {})
    for name, arr in outputs.items():
        np.save(out / f"out_{name.replace('/', '_')}.npy", np.asarray(arr, np.float32))
    res["output_names"] = list(outputs)
    res["peak_rss_mb"] = round(_vm_hwm_mb(), 1)
    (out / "result.json").write_text(json.dumps(res, indent=1, default=str))


def run_child(kind: str, spec: dict, folder: Path, label: str) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = {**spec, "kind": kind, "out": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    load = os.getloadavg()
    print(f"  {label:<22} ...", end="", flush=True)
    t0 = time.perf_counter()
    with open(folder / "log.txt", "wb") as log:
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(folder / "spec.json")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=CHILD_TIMEOUT_S).returncode
    wall = time.perf_counter() - t0
    if rc != 0 or not (folder / "result.json").exists():
        tail = "\n".join((folder / "log.txt").read_text(errors="replace").splitlines()[-15:])
        print(f" FAILED (rc {rc})\n{tail}")
        return {"error": f"rc {rc}: {tail.splitlines()[-1] if tail else ''}", "log": str(folder / "log.txt")}
    res = json.loads((folder / "result.json").read_text())
    res.update(wall_s=round(wall, 1), load_avg_start=[round(x, 2) for x in load], folder=str(folder))
    if "times" in res:
        t = res["times"][1:]
        res["median_s"], res["min_s"] = statistics.median(t), min(t)
        print(f" median {res['median_s']:.3f} s (runs {', '.join(f'{x:.2f}' for x in res['times'])}; "
              f"first = warm-up), load {load[0]:.2f}, {wall:.0f} s wall", flush=True)
    else:
        print(f" done in {wall:.0f} s", flush=True)
    return res


# ---- parent-side pieces -------------------------------------------------------------------
def gemm_peak(n: int = 4096, repeats: int = 5) -> dict:
    """Best fp32 GEMM rate (GFLOP/s) of torch.mm and numpy matmul on n x n, all cores."""
    import torch
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    out = {}
    for name, fn in (("torch", lambda: torch.mm(ta, tb)), ("numpy", lambda: a @ b)):
        fn()
        best = min(_time_calls(fn, repeats)[1:])
        out[name] = round(2 * n ** 3 / best / 1e9, 1)
    out["best"] = max(out["torch"], out["numpy"])
    out["torch_threads"] = torch.get_num_threads()
    return out


def count_flops(onnx_path: str, shapes: dict[str, list[int]]) -> dict:
    """GFLOP (2 per multiply-add) of one call at these input shapes, from OpenVINO's static shapes:
    convolutions, matmuls with a 2-D (weight) operand, and activation x activation matmuls."""
    import openvino as ov
    model = ov.Core().read_model(onnx_path)
    model.reshape({p.get_any_name(): ov.PartialShape(shapes[p.get_any_name()]) for p in model.inputs
                   if p.get_any_name() in shapes})
    conv = lin = act = 0
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind == "Convolution":
            conv += 2 * int(np.prod(list(op.get_output_shape(0)))) * int(np.prod(list(op.input(1).get_shape())[1:]))
        elif kind == "MatMul":
            a = list(op.input(0).get_shape())
            k = a[-2] if op.get_attributes()["transpose_a"] else a[-1]
            flops = 2 * int(np.prod(list(op.get_output_shape(0)))) * k
            if len(list(op.input(1).get_shape())) == 2:
                lin += flops
            else:
                act += flops
    return {"conv_gflop": round(conv / 1e9, 1), "linear_gflop": round(lin / 1e9, 1),
            "attention_gflop": round(act / 1e9, 1), "gflop": round((conv + lin) / 1e9, 1),
            "convention": "convolutions + linear layers (attention matmuls listed apart)"}


def rel_err(ours: Path, ref: Path, names: list[str]) -> float | None:
    errs = []
    for n in names:
        a, b = ours / f"out_{n}.npy", ref / f"out_{n}.npy"
        if not a.exists() or not b.exists():
            return None
        x, y = np.load(a).astype(np.float64), np.load(b).astype(np.float64)
        if x.shape != y.shape:
            return None
        errs.append(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return max(errs)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    return describe(("numpy", "onnx", "onnxruntime", "openvino", "torch", "diffusers", "transformers"))


def ensure_checkpoint(work: Path) -> Path:
    sys.path.insert(0, str(HERE))
    from export_unet import ensure_checkpoint as ensure  # the same file as the export benchmark
    ckpt = work / "sd15_random_fp16.safetensors"
    ensure(ckpt)
    return ckpt


def code_digest() -> str:
    """Digest of the graph-builder code (the export cache's own `builder_digest`) and of the OpenVINO
    target with its rewrites, which compile-cache keys do not cover: each code version gets its own
    cache folder."""
    from precast.compiler.bundle import builder_digest
    h = hashlib.sha256(builder_digest().encode())
    for p in sorted((ROOT / "compiler" / "targets").glob("openvino*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:10]


def build_bundle(ckpt: Path, suite: Path, cache: Path, components: list[str], batch_profile: int) -> dict:
    """`precast build` of a static 512x512 fp32 recipe for the OpenVINO CPU target."""
    recipe = suite / "sd15-static512.yaml"
    recipe.write_text(
        "# written by benchmarks/suite.py\nname: sd15-suite\n"
        f"model:\n  source: {ckpt}\n"
        f"components: [{', '.join(components)}]\nprecision: fp32\n"
        f"profiles:\n  batch: {batch_profile}\n  height: {IMAGE}\n  width: {IMAGE}\n  tokens: {TOKENS}\n"
        "targets:\n  - openvino: {device: CPU}\n")
    bundle = suite / "bundle"
    env = {**os.environ, "PRECAST_CACHE": str(cache)}
    print(f"precast build {recipe.name} ({', '.join(components)}) ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(PRECAST), "build", str(recipe), "--out", str(bundle), "--json"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"precast build failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    manifest = json.loads((bundle / "manifest.json").read_text())
    print(f"  bundle in {wall:.0f} s", flush=True)
    return {"wall_s": round(wall, 1), "recipe": str(recipe), "bundle": str(bundle), "report": report,
            "components": {c: {"onnx": str(bundle / v["onnx"]), "inputs": v["inputs"], "outputs": v["outputs"]}
                           for c, v in manifest["components"].items()}}


def print_profile(title: str, prof: dict) -> None:
    print(f"\n  {title}: {prof['total_ms'] / 1e3:.2f} s in profiled nodes")
    for r in prof["by_op"]:
        print(f"    {r['op']:<20} {r['kernel']:<26} {r['ms']:>9.1f} ms {100 * r['share']:>5.1f}%  x{r['count']}")
    print("    slowest nodes:")
    for r in prof["top_nodes"][:5]:
        print(f"      {r['ms']:>8.1f} ms  {r['op']:<18} {r['kernel']:<24} {r['node'][:60]}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=list(COMPONENTS), help="run only these components (repeatable)")
    ap.add_argument("--skip-peers", action="store_true", help="precast only (outputs still checked against a "
                                                             "cached torch output when there is one)")
    ap.add_argument("--batch", type=int, default=1, choices=(1, 2), help="UNet batch (2 = classifier-free guidance)")
    ap.add_argument("--steps", type=int, default=3, help="timed calls per runner after one warm-up; median reported")
    ap.add_argument("--no-profile", action="store_true", help="skip the OpenVINO per-op performance counters")
    ap.add_argument("--no-cold-start", action="store_true", help="skip the cold-start measurement")
    ap.add_argument("--no-static-peer", action="store_true", help="skip openvino-f32-static (the extra peer)")
    ap.add_argument("--precisions", default="bf16,f16", help="UNet: our graph also compiled with these OpenVINO "
                    "precision hints (static shapes, no rewrites), to show what f32 is chosen over; '' to skip")
    ap.add_argument("--ov-option", action="append", default=[], metavar="K=V",
                    help="extra OpenVINO target option for precast's engine (e.g. precision=bf16)")
    ap.add_argument("--precast-variant", action="append", default=[], metavar="LABEL:K=V[,K=V]",
                    help="UNet: also run precast's engine built with these target options, in the same run (e.g. "
                         "winograd16:winograd=16); its lead over the best peer and its blob size are printed")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "suite.json")
    opts = ap.parse_args()
    work = opts.work.resolve()
    suite = work / "suite"
    suite.mkdir(parents=True, exist_ok=True)
    components = [COMPONENTS[c] for c in (opts.only or list(COMPONENTS))]
    target_options = {}
    for kv in opts.ov_option:
        k, _, v = kv.partition("=")
        target_options[k] = option_value(v)
    variants = {}
    for text in opts.precast_variant:
        label, _, kvs = text.partition(":")
        variants[label] = {**target_options, **{k: option_value(v) for k, _, v in
                                                (kv.partition("=") for kv in kvs.split(",") if kv)}}

    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = loadavg()
    print(f"load average {load_start}; measuring fp32 GEMM peak ...", flush=True)
    peak_start = gemm_peak()
    print(f"  {peak_start}")
    ckpt = ensure_checkpoint(work)

    digest = code_digest()
    cache = suite / f"cache-{digest}"
    for old in suite.glob("cache-*"):
        if old != cache:                              # builds of an older graph/target code (GBs each),
            shutil.rmtree(old, ignore_errors=True)    # and the bundle that links to them
            shutil.rmtree(suite / "bundle", ignore_errors=True)
    bundle = build_bundle(ckpt, suite, cache, ["text_encoder", "unet", "vae_decoder"], 1)

    results: dict[str, dict] = {}
    for comp in components:
        print(f"\n== {comp} ==", flush=True)
        feeds = make_inputs(comp, opts.batch if comp == "unet" else 1)
        inputs = suite / "inputs" / f"{comp}_b{opts.batch if comp == 'unet' else 1}.npz"
        inputs.parent.mkdir(parents=True, exist_ok=True)
        np.savez(inputs, **feeds)
        shapes = {k: list(v.shape) for k, v in feeds.items()}
        if comp == "text_encoder":
            shapes["token_embeddings_extra"] = [1, 768]
        flops = count_flops(bundle["components"][comp]["onnx"], shapes)
        runs_dir = suite / "runs" / f"{comp}_b{shapes[next(iter(shapes))][0]}"
        torch_onnx = suite / "torch_onnx" / comp / "model.onnx"
        stamp = torch_onnx.with_name("stamp.txt")
        want_stamp = f"{ckpt.stat().st_size} {ckpt.stat().st_mtime_ns} torch {version('torch')}"
        common = {"component": comp, "checkpoint": str(ckpt), "inputs": str(inputs), "steps": opts.steps,
                  "batch": opts.batch if comp == "unet" else 1}
        rows: dict[str, dict] = {}
        if not opts.skip_peers:
            if not (torch_onnx.exists() and stamp.exists() and stamp.read_text() == want_stamp):
                shutil.rmtree(torch_onnx.parent, ignore_errors=True)
                r = run_child("torch-export", {**common, "onnx": str(torch_onnx)}, runs_dir / "torch-export",
                              "torch.onnx.export")
                if "error" in r:
                    raise SystemExit("torch.onnx.export failed; see " + r["log"])
                stamp.write_text(want_stamp)
            rows["torch"] = run_child("torch", common, runs_dir / "torch", "torch")
            rows["onnxruntime"] = run_child("onnxruntime", {**common, "onnx": str(torch_onnx)},
                                            runs_dir / "onnxruntime", "onnxruntime")
            ov_variants = [("openvino", {}, False), ("openvino-f32", {"INFERENCE_PRECISION_HINT": "f32"}, False)]
            if not opts.no_static_peer:
                ov_variants.append(("openvino-f32-static", {"INFERENCE_PRECISION_HINT": "f32"}, True))
            for name, cfg, static in ov_variants:
                rows[name] = run_child("openvino", {**common, "onnx": str(torch_onnx), "ov_config": cfg,
                                                    "static": static,
                                                    "profile": name == "openvino-f32" and not opts.no_profile},
                                       runs_dir / name, name)
        rows["precast"] = run_child("precast", {**common, "cache": str(cache), "export": bundle["components"][comp],
                                                "target_options": target_options, "profile": not opts.no_profile},
                                    runs_dir / "precast", "precast")
        for label, options in (variants.items() if comp == "unet" else ()):
            run_child("precast", {**common, "cache": str(cache), "export": bundle["components"][comp],   # built first,
                                  "target_options": options, "compile_only": True},     # so the peak is the run's
                      runs_dir / f"precast-{label}-build", f"precast build {label}")
            rows[f"precast-{label}"] = run_child("precast", {**common, "cache": str(cache),
                                                             "export": bundle["components"][comp],
                                                             "target_options": options, "profile": False},
                                                 runs_dir / f"precast-{label}", f"precast {label} {options}")
        if comp == "unet":   # our graph at the other precisions the CPU offers (f32 is the target's choice)
            for prec in [p for p in opts.precisions.split(",") if p]:
                rows[f"precast-{prec}"] = run_child(
                    "openvino", {**common, "onnx": bundle["components"][comp]["onnx"], "static": True,
                                 "ov_config": {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": prec}},
                    runs_dir / f"precast-{prec}", f"precast graph, {prec}")
        ref_dir = runs_dir / "torch"
        peak = peak_start["best"]
        for name, r in rows.items():
            if "median_s" not in r:
                continue
            r["gflops"] = round(flops["gflop"] / r["median_s"], 1)
            r["pct_of_peak"] = round(100 * flops["gflop"] / r["median_s"] / peak, 1)
            r["rel_err_vs_torch"] = None if name == "torch" else rel_err(Path(r["folder"]), ref_dir,
                                                                           OUTPUT_NAMES[comp])
            r["parity_ok"] = None if r["rel_err_vs_torch"] is None else r["rel_err_vs_torch"] <= PARITY_TOL
        results[comp] = {"inputs": shapes, "flops": flops, "runners": rows}

    cold = None
    if not opts.no_cold_start:
        print("\n== cold start ==", flush=True)
        cold = run_child("cold-start", {"bundle": bundle["bundle"]}, suite / "runs" / "cold_start",
                         "bundle -> first image")
        cold["precast_build_wall_s"] = bundle["wall_s"]

    peak_end = gemm_peak()
    load_end = loadavg()
    peak = max(peak_start["best"], peak_end["best"])
    for comp, res in results.items():       # % of the better of the two peak measurements
        for r in res["runners"].values():
            if "median_s" in r:
                r["pct_of_peak"] = round(100 * res["flops"]["gflop"] / r["median_s"] / peak, 1)

    floors = check_floors(results, peak)
    print_report(results, peak, peak_start, peak_end, load_start, load_end, cold, floors, opts)
    out = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "machine": machine(), "load_avg": {"start": load_start, "end": load_end},
           "gemm_peak_gflops": {"start": peak_start, "end": peak_end, "used": peak},
           "settings": {"unet_batch": opts.batch, "steps": opts.steps, "image": IMAGE, "tokens": TOKENS,
                        "parity_tol": PARITY_TOL, "target_options": target_options, "code_digest": digest},
           "bundle": {k: v for k, v in bundle.items() if k != "report"}, "results": results, "cold_start": cold,
           "floors": floors,
           "notes": ["precast's UNet engine is compiled for the measured batch (static shapes); the bundle's own "
                     "UNet engine is batch 2 (classifier-free guidance) and is what the cold start runs",
                     "page cache warm for every load (files just written or read)"]}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {opts.json}")


def option_value(text: str):
    """A target option's value as a recipe gives it: true / false, an integer, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.isdigit() else text


def check_floors(results: dict, peak: float) -> dict:
    floors = {}
    for comp, res in results.items():
        rows = res["runners"]
        ours = rows.get("precast", {})
        if "median_s" not in ours:
            continue
        f = {"parity": ours.get("parity_ok")}
        peers = {n: r["median_s"] for n, r in rows.items() if not n.startswith("precast") and "median_s" in r}
        if peers:
            f["fastest"] = all(ours["median_s"] < t for t in peers.values())
            ov = [rows[n]["median_s"] for n in ("openvino", "openvino-f32") if "median_s" in rows.get(n, {})]
            if ov:
                f["speedup_vs_best_openvino_on_torch_onnx"] = round(min(ov) / ours["median_s"], 3)
                f["ge_10pct_faster_than_openvino"] = min(ov) / ours["median_s"] >= SPEED_FLOOR
            if "median_s" in rows.get("openvino-f32-static", {}):
                f["speedup_vs_openvino_f32_static"] = round(rows["openvino-f32-static"]["median_s"] / ours["median_s"], 3)
        if comp == "unet":
            f["pct_of_peak"] = ours["pct_of_peak"]
            f["ge_70pct_of_peak"] = ours["pct_of_peak"] >= 100 * PEAK_TARGET
        floors[comp] = f
    return floors


def print_report(results, peak, peak_start, peak_end, load_start, load_end, cold, floors, opts) -> None:
    print("\n" + "=" * 100)
    print(f"fp32 GEMM peak (4096^3, best of torch/numpy): start {peak_start['best']} GFLOP/s, "
          f"end {peak_end['best']} GFLOP/s; used {peak}. Load average start {load_start}, end {load_end}.")
    head = f"{'component':<13} {'runner':<20} {'median s':>9} {'min s':>7} {'GFLOP/s':>8} {'% peak':>7} " \
           f"{'rel err':>9} {'ours x':>7}  load"
    print(head + "\n" + "-" * len(head))
    for comp, res in results.items():
        rows = res["runners"]
        ours = rows.get("precast", {}).get("median_s")
        for name, r in rows.items():
            if "median_s" not in r:
                print(f"{comp:<13} {name:<20} {'failed: ' + r.get('error', '')[:60]}")
                continue
            err = "" if r.get("rel_err_vs_torch") is None else f"{r['rel_err_vs_torch']:.1e}" + \
                ("" if r["parity_ok"] else "!")
            ratio = f"{r['median_s'] / ours:.2f}x" if ours and name != "precast" else ""
            name = name if not name.startswith("precast-") else f"({name})"
            print(f"{comp:<13} {name:<20} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['gflops']:>8.1f} "
                  f"{r['pct_of_peak']:>6.1f}% {err:>9} {ratio:>7}  {r['load_avg_start'][0]:.2f}")
        f = res["flops"]
        print(f"{'':<13} ({f['gflop']} GFLOP per call = conv {f['conv_gflop']} + linear {f['linear_gflop']}; "
              f"attention matmuls {f['attention_gflop']} not counted; inputs {res['inputs']})")
    print("rel err = max|x - torch| / max|torch| over the outputs ('!' = above the 1e-3 tolerance); "
          "ours x = runner time / precast time; (precast-P) = our graph with OpenVINO precision hint P "
          "(static, no f32-only rewrites), not what the target builds on this CPU")
    for comp, res in results.items():      # precast's engine and its variants against the best peer within parity
        rows = res["runners"]
        peers = {n: r["median_s"] for n, r in rows.items()
                 if not n.startswith("precast") and "median_s" in r and r.get("parity_ok") is not False}
        if not peers:
            continue
        best = min(peers, key=peers.get)
        for name, r in rows.items():
            if name.startswith("precast") and "median_s" in r and "blob_mb" in r:
                print(f"{comp} {name}: {peers[best] / r['median_s']:.2f}x the best peer within the tolerance ({best}),"
                      f" blob {r['blob_mb']} MB, rewrites {r.get('rewrites')}")
    for comp, res in results.items():
        for name in ("precast", "openvino-f32"):
            prof = res["runners"].get(name, {}).get("profile")
            if prof:
                print_profile(f"{comp} {name} per-op profile (PERF_COUNT)", prof)
    if cold:
        print("\ncold start (fresh process, page cache warm):")
        if "error" in cold:
            print(f"  failed: {cold['error']}")
        else:
            print(f"  precast build (recipe -> bundle, cache as found): {cold['precast_build_wall_s']:.1f} s")
            print(f"  bundle -> first image (Txt2Img, 1 step, 512x512): {cold['bundle_to_first_output_s']:.1f} s "
                  f"(import {cold['runtime_import_s']:.1f} s, select + verify + load {cold['txt2img_init_s']:.1f} s, "
                  f"encode + 1 UNet step + decode {cold['first_image_s']:.1f} s)")
            for comp, c in cold["per_component"].items():
                print(f"  {comp:<13} blob {c['blob_mb']:>7.1f} MB: cached load = sha256 {c['sha256_verify_s']:.1f} s + "
                      f"import_model (mmap) {c['open_artifact_s']:.1f} s vs compile (read_model, reshape, rewrites, "
                      f"compile_model) {c['compile_s']:.1f} s: {c['ratio']:.1f}x")
    print("\nfloors:")
    for comp, f in floors.items():
        print(f"  {comp}: {json.dumps(f)}")


if __name__ == "__main__":
    main()
