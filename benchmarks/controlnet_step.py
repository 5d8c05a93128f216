"""Issue 17's benchmark: one full-size SD1.5 ControlNet + UNet step (512x512 image, latent 64x64, CFG batch 2,
77 tokens) through precast's OpenVINO engines vs every peer on the same weights, one run; plus the plain UNet
step (an export without --controlnet) and the residual UNet fed zeros (what precast's runtime feeds when no
control is given).

Weights (seeded random, written into the work folder): compiler/demo_model.py's SD15 config (model_channels 320,
channel_mult (1,2,4,4), 2 res blocks, attention at levels 0-2, 8 heads, context 768; the UNet part of the file
is used) and compiler/demo_controlnet.py's LDM ControlNet for it with the real SD1.5 nets' hint channels
(16, 32, 96, 256); both fp16 files, every runner computes in fp32.

Steps measured (model keys in the JSON):

  controlnet   the ControlNet (sample, timestep, encoder_hidden_states, controlnet_cond 2x3x512x512 in [0, 1])
               then the UNet with its 13 residual inputs (down_block_{i}_additional_residual,
               mid_block_additional_residual) fed the ControlNet's outputs, scale 1.0 (the runtime's scale
               multiply is skipped everywhere alike)
  unet         the plain UNet (no residual inputs)
  unet-zeros   precast only: the residual UNet (the controlnet export's) fed zero residuals, vs the plain UNet

Runners, each call of each runner in a fresh process (benchmarks/flux_step.py's children machinery, imported),
2 threads, one warm-up call then --steps timed calls; with --rounds N every runner runs N times, the runners
interleaved round by round, and the median is over all timed calls of all rounds:

  precast              `precast export --dtype fp32 [--controlnet FILE:cn] --component unet` then `precast
                       compile --target openvino --batch 1 --height 512 --width 512 --tokens 77` (a static profile;
                       the profile doubles the UNet's / ControlNet's batch for CFG; the target's precision: f32 on
                       this CPU), the blobs opened with the runtime's OpenVinoSession
  torch                diffusers ControlNetModel + UNet2DConditionModel (down_block_additional_residuals=...,
                       mid_block_additional_residual=...), the same files read by diffusers' own LDM converters
                       (strict loads), PyTorch eager fp32
  onnxruntime          ONNX Runtime CPU (ORT_ENABLE_ALL) on torch.onnx.export of the two models (TorchScript
                       exporter, opset 17, dynamic batch / size axes as optimum exports them; the dynamo exporter
                       with --exporter dynamo when onnxscript is importable)
  openvino-f32         OpenVINO on that ONNX, read_model + compile_model, INFERENCE_PRECISION_HINT=f32
  openvino-f32-static  the same, reshaped to the run's static shapes first (as precast compiles)

Outputs (the UNet's out_sample) are compared with PyTorch fp32: max|x - ref| / max|ref| (f32: within 1e-3).
FLOPs are counted analytically from the config (2 per multiply-add): every convolution (direct-convolution
count, also for precast's Winograd convolutions), every Linear (incl. the time-embedding GEMVs) and the
attention matmuls (Q K^T, P V; self- and cross-attention); --small checks the conv + linear count against the
shapes of precast's exported graphs. The GEMM peak is measured in the same run (flux_step.gemm_peak, start and
end, best taken). % of peak = FLOP / time / f32 peak. The bound: FLOP / f32 peak is the shortest time any f32
runner can take; the largest speedup possible over a peer = peer time / bound.

Floor (the issue): precast >= 1.2x the best correct peer on the controlnet step; the plain UNet step unchanged
(within noise) from the README's figure (benchmarks/suite.py: batch 1, 3.78 s; here CFG batch 2 unless --batch).

Usage: .venv/bin/python benchmarks/controlnet_step.py [--small] [--steps N] [--rounds N] [--models a,b]
           [--runners a,b,...] [--plain-runners a,b,...] [--no-profile] [--exporter torchscript|dynamo]
           [--work DIR] [--keep] [--json OUT]
       (--small: the tiny demo config at 256 px, to try the script in a minute; not a measurement)
The work folder (checkpoints, exports, engines, torch ONNX: ~30 GB at peak) is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import flux_step as fs  # noqa: E402  (children, timing, GEMM peak, ov_profile, precast_cli, rel_err)
from machine import describe  # noqa: E402

SD15_HINT = (16, 32, 96, 256)       # the real SD1.5 ControlNets' input_hint_block channels
S = {"image": 512, "tokens": 77, "batch": 1, "small": False}      # batch: images per prompt (x2 for CFG)
OUT = "out_sample"
RUNNERS = ("precast", "torch", "onnxruntime", "openvino-f32", "openvino-f32-static")
LABELS = {"precast": "precast (OpenVINO engines)", "torch": "PyTorch eager fp32 (diffusers)",
          "onnxruntime": "ONNX Runtime (torch ONNX)", "openvino-f32": "OpenVINO (torch ONNX), f32 hint",
          "openvino-f32-static": "OpenVINO (torch ONNX), f32, static", "precast-zeros": "precast residual UNet, zeros"}


def cfg():
    from precast.compiler.demo_model import SD15, TINY
    return TINY if S["small"] else SD15


def hint():
    from precast.compiler.demo_controlnet import TINY_HINT
    return TINY_HINT if S["small"] else SD15_HINT


def latent() -> int:
    return S["image"] // 8


def cfg_batch() -> int:
    return 2 * S["batch"]


def n_residuals() -> int:
    c = cfg()
    return len(c.channel_mult) * (c.num_res_blocks + 1)         # conv_in + per level (res blocks + downsample) - 1


def residual_shapes() -> dict[str, tuple]:
    c, b, lat = cfg(), cfg_batch(), latent()
    shapes, i = {}, 0
    shapes[f"down_block_{i}_additional_residual"] = (b, c.model_channels, lat, lat)
    for lvl, m in enumerate(c.channel_mult):
        side = lat >> lvl
        for _ in range(c.num_res_blocks):
            i += 1
            shapes[f"down_block_{i}_additional_residual"] = (b, c.model_channels * m, side, side)
        if lvl < len(c.channel_mult) - 1:
            i += 1
            shapes[f"down_block_{i}_additional_residual"] = (b, c.model_channels * m, side // 2, side // 2)
    last = len(c.channel_mult) - 1
    shapes["mid_block_additional_residual"] = (b, c.model_channels * c.channel_mult[-1], lat >> last, lat >> last)
    return shapes


# ---- inputs and FLOPs ---------------------------------------------------------------------------
def make_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(17)
    b, lat = cfg_batch(), latent()
    return {"sample": rng.standard_normal((b, 4, lat, lat)).astype(np.float32),
            "timestep": np.full((b,), 500.0, np.float32),
            "encoder_hidden_states": rng.standard_normal((b, S["tokens"], cfg().context_dim)).astype(np.float32),
            "controlnet_cond": rng.uniform(0, 1, (b, 3, S["image"], S["image"])).astype(np.float32)}


def count_flops(part: str) -> dict:
    """GFLOP (2 per multiply-add) of one call of `part` (unet | controlnet) at the run's shapes, from the config:
    convolutions, linear layers (incl. time-embedding GEMVs), attention matmuls."""
    c, b, lat, T = cfg(), cfg_batch(), latent(), S["tokens"]
    mc, heads_ctx = c.model_channels, c.context_dim
    f = {"conv": 0, "linear": 0, "attention": 0}

    def conv(cin, cout, k, side):
        f["conv"] += 2 * b * side * side * cout * cin * k * k

    def lin(cin, cout, rows):
        f["linear"] += 2 * b * rows * cin * cout

    def res(cin, cout, side):
        conv(cin, cout, 3, side)
        lin(4 * mc, cout, 1)                                  # emb_layers
        conv(cout, cout, 3, side)
        if cin != cout:
            conv(cin, cout, 1, side)                          # skip_connection

    def attn(ch, side):
        n = side * side
        conv(ch, ch, 1, side)                                 # proj_in (1x1 conv in SD1)
        for _ in range(c.transformer_depth):
            lin(ch, ch, n * 3)                                # attn1 q, k, v
            f["attention"] += 2 * b * 2 * n * n * ch          # attn1 QK^T, PV
            lin(ch, ch, n)                                    # attn1 out
            lin(ch, ch, n)                                    # attn2 q
            lin(heads_ctx, ch, 2 * T)                         # attn2 k, v
            f["attention"] += 2 * b * 2 * n * T * ch          # attn2 QK^T, PV
            lin(ch, ch, n)                                    # attn2 out
            lin(ch, 8 * ch, n)                                # GEGLU proj
            lin(4 * ch, ch, n)                                # ff out
        conv(ch, ch, 1, side)                                 # proj_out

    lin(mc, 4 * mc, 1)                                        # time_embed
    lin(4 * mc, 4 * mc, 1)
    if part == "controlnet":                                  # input_hint_block: image side, 3 stride-2 convs
        hc, side = hint(), S["image"]
        conv(3, hc[0], 3, side)
        for a, bb in zip(hc, hc[1:]):
            conv(a, a, 3, side)
            side //= 2
            conv(a, bb, 3, side)
        conv(hc[-1], mc, 3, side)
    conv(4, mc, 3, lat)                                       # conv_in
    skips, ch = [mc], mc
    for lvl, m in enumerate(c.channel_mult):
        side = lat >> lvl
        for _ in range(c.num_res_blocks):
            res(ch, mc * m, side)
            ch = mc * m
            if lvl in c.attention_levels:
                attn(ch, side)
            skips.append(ch)
        if lvl < len(c.channel_mult) - 1:
            conv(ch, ch, 3, side // 2)                        # downsample, stride 2
            skips.append(ch)
    side = lat >> (len(c.channel_mult) - 1)
    res(ch, ch, side)
    attn(ch, side)
    res(ch, ch, side)
    if part == "controlnet":
        for i, s in enumerate(skips):                         # zero convs
            conv(s, s, 1, residual_shapes()[f"down_block_{i}_additional_residual"][2])
        conv(ch, ch, 1, side)                                 # middle_block_out
    else:
        for lvl in reversed(range(len(c.channel_mult))):
            side = lat >> lvl
            for _ in range(c.num_res_blocks + 1):
                cin = ch + skips.pop()
                res(cin, mc * c.channel_mult[lvl], side)
                ch = mc * c.channel_mult[lvl]
                if lvl in c.attention_levels:
                    attn(ch, side)
            if lvl > 0:
                conv(ch, ch, 3, side * 2)                     # upsample: nearest x2 then conv
        conv(mc, 4, 3, lat)                                   # conv_out
    total = sum(f.values())
    return {"gflop": round(total / 1e9, 2), "conv_gflop": round(f["conv"] / 1e9, 2),
            "linear_gflop": round(f["linear"] / 1e9, 2), "attention_gflop": round(f["attention"] / 1e9, 2),
            "conv_linear_gflop": round((f["conv"] + f["linear"]) / 1e9, 2), "gemv_gflop": 0.0}


def flops_of(model: str) -> dict:
    u = count_flops("unet")
    if model != "controlnet":
        return u
    cn = count_flops("controlnet")
    return {**{k: round(u[k] + cn[k], 2) for k in u}, "controlnet_gflop": cn["gflop"], "unet_gflop": u["gflop"]}


def graph_flops(onnx_path: str, shapes: dict) -> dict:
    """conv + linear GFLOP from an exported graph's static shapes (benchmarks/suite.py's counter): the check."""
    import suite
    return suite.count_flops(onnx_path, shapes)


# ---- the children (run by flux_step's child_main in a fresh process) ------------------------------
def _unet_cfg() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import reference as ref
    return ref.unet_diffusers_config(cfg())


def _torch_models(spec: dict):
    """diffusers UNet2DConditionModel (+ ControlNetModel) from the LDM files, fp32, eval."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel
    from diffusers.loaders import single_file_utils as sfu
    from safetensors.torch import load_file
    sys.path.insert(0, str(ROOT / "tests"))
    import reference as ref
    torch.set_num_threads(fs.THREADS)
    ucfg = _unet_cfg()
    sd = {k: v.float() for k, v in load_file(spec["checkpoint"]).items() if k.startswith("model.diffusion_model.")}
    unet = UNet2DConditionModel(**ucfg)
    unet.load_state_dict(sfu.convert_ldm_unet_checkpoint(sd, ucfg), strict=True)
    del sd
    net = None
    if spec.get("controlnet_file"):
        ccfg = ref.controlnet_config(ucfg, hint())
        sd = {k: v.float() for k, v in load_file(spec["controlnet_file"]).items()}
        net = ControlNetModel(**ccfg)
        net.load_state_dict(sfu.convert_controlnet_checkpoint(sd, ccfg), strict=True)
        net = net.eval()
        del sd
    return unet.eval(), net


BASE = ["sample", "timestep", "encoder_hidden_states"]


def _wrappers(unet, net, n_res: int):
    """Plain-tensor modules for calls and for the exporter: controlnet -> residuals tuple; unet(+residuals)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = net

        def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond):
            down, mid = self.m(sample, timestep, encoder_hidden_states, controlnet_cond=controlnet_cond,
                               conditioning_scale=1.0, return_dict=False)
            return (*down, mid)

    class UNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = unet

        def forward(self, sample, timestep, encoder_hidden_states, *res):
            kw = {}
            if res:
                kw = {"down_block_additional_residuals": tuple(res[:-1]), "mid_block_additional_residual": res[-1]}
            return self.m(sample, timestep, encoder_hidden_states, return_dict=False, **kw)[0]
    return (Net().eval() if net is not None else None), UNet().eval()


def child_cn_torch(spec: dict) -> dict:
    import torch
    t0 = time.perf_counter()
    unet, net = _torch_models(spec)
    cnw, uw = _wrappers(unet, net, n_residuals())
    load = time.perf_counter() - t0
    feeds = {k: torch.from_numpy(v) for k, v in np.load(spec["inputs"]).items()}
    base = [feeds[n] for n in BASE]
    out = {}

    def call():
        with torch.inference_mode():
            res = cnw(*base, feeds["controlnet_cond"]) if cnw is not None else ()
            out["y"] = uw(*base, *res)
    times = fs._time_calls(call, spec["steps"])
    return {"load_s": load, "times": times, "outputs": {OUT: out["y"].float().numpy()},
            "detail": f"diffusers eager fp32, torch {torch.__version__}, {torch.get_num_threads()} threads"}


def child_cn_torch_export(spec: dict) -> dict:
    """torch.onnx.export of one graph (spec['graph']: controlnet | unet-res | unet)."""
    import torch
    unet, net = _torch_models(spec)
    cnw, uw = _wrappers(unet, net, n_residuals())
    feeds = {k: torch.from_numpy(v) for k, v in np.load(spec["inputs"]).items()}
    res_names = list(residual_shapes())
    base = [feeds[n] for n in BASE]
    img = {0: "batch", 2: "height", 3: "width"}
    dyn = {"sample": img, "timestep": {0: "steps"}, "encoder_hidden_states": {0: "batch", 1: "sequence"}}
    if spec["graph"] == "controlnet":
        model, args, names, outs = cnw, (*base, feeds["controlnet_cond"]), BASE + ["controlnet_cond"], res_names
        dyn["controlnet_cond"] = {0: "batch", 2: "image_height", 3: "image_width"}
        for i, n in enumerate(res_names):
            dyn[n] = {0: "batch", 2: f"h{i}", 3: f"w{i}"}
    else:
        res = []
        if spec["graph"] == "unet-res":
            with torch.no_grad():
                res = list(cnw(*base, feeds["controlnet_cond"]))
            for i, n in enumerate(res_names):
                dyn[n] = {0: "batch", 2: f"h{i}", 3: f"w{i}"}
        model, args, names, outs = uw, (*base, *res), BASE + (res_names if res else []), [OUT]
        dyn[OUT] = img
    out = Path(spec["onnx"])
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        if spec.get("exporter") == "dynamo":
            shapes = {n: {k: torch.export.Dim.AUTO for k in dyn[n]} for n in names}
            prog = torch.onnx.export(model, args, dynamo=True, opset_version=18, input_names=names,
                                     output_names=outs, dynamic_shapes=shapes, external_data=True)
            prog.save(str(out), external_data=True)
            how = "dynamo, opset 18"
        else:
            torch.onnx.export(model, args, str(out), dynamo=False, opset_version=17, input_names=names,
                              output_names=outs, dynamic_axes={k: v for k, v in dyn.items() if k in names + outs})
            how = "TorchScript (dynamo=False), opset 17"
    return {"export_s": time.perf_counter() - t0, "exporter": how,
            "detail": f"torch.onnx.export of the {spec['graph']} graph ({how})"}


def _chain(spec: dict, make_session):
    """The step over one or two graphs: make_session(path_or_entry, role) -> (run(feeds) -> {name: array})."""
    feeds = dict(np.load(spec["inputs"]))
    t0 = time.perf_counter()
    cn = make_session(spec["graphs"]["controlnet"], "controlnet") if "controlnet" in spec["graphs"] else None
    unet = make_session(spec["graphs"]["unet"], "unet")
    load = time.perf_counter() - t0
    base = {k: feeds[k] for k in BASE}
    cn_feeds = {**base, "controlnet_cond": feeds["controlnet_cond"]}
    zeros = {n: np.zeros(s, np.float32) for n, s in residual_shapes().items()} if spec.get("zeros") else {}
    out = {}

    def call():
        res = cn(cn_feeds) if cn is not None else zeros
        out.update(unet({**base, **res}))
    times = fs._time_calls(call, spec["steps"])
    return load, times, out[OUT]


def child_cn_precast(spec: dict) -> dict:
    from precast.compiler.cache import parse_entry
    from precast.runtime.sessions import OpenVinoSession
    meta_of = {}

    def make(entry_path, role):
        entry = parse_entry(Path(entry_path))
        meta = entry.metadata
        s = OpenVinoSession(entry.path / meta["entry"], meta.get("device", "CPU"), meta.get("compile_config", {}))
        meta_of[role] = {"compile_config": meta.get("compile_config"), "blob_mb": round(entry.size / 1e6, 1),
                         "precision": str(s._cm.get_property("INFERENCE_PRECISION_HINT")),
                         "threads": s._cm.get_property("INFERENCE_NUM_THREADS")}
        return s.run
    load, times, y = _chain(spec, make)
    res = {"load_s": load, "times": times, "outputs": {OUT: y}, "engines": meta_of,
           "precision": meta_of["unet"]["precision"],
           "detail": f"precast blobs via runtime OpenVinoSession; {meta_of}"}
    if spec.get("profile"):
        import openvino as ov
        prof = {}
        for role, path in spec["graphs"].items():
            entry = parse_entry(Path(path))
            meta = entry.metadata
            compiled = ov.Core().import_model((entry.path / meta["entry"]).read_bytes(), "CPU",
                                              {**meta.get("compile_config", {}), "PERF_COUNT": True})
            req = compiled.create_infer_request()
            feeds = dict(np.load(spec["inputs"]))
            names = [p.get_any_name() for p in compiled.inputs]
            f = {n: feeds[n] if n in feeds else np.zeros(residual_shapes()[n], np.float32) for n in names}
            req.infer(f)
            req.infer(f)
            prof[role] = fs.ov_profile(req, compiled)
            del req, compiled
        res["profile"] = prof
    return res


def child_cn_onnxruntime(spec: dict) -> dict:
    import onnxruntime as ort

    def make(path, role):
        o = ort.SessionOptions()
        o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
        names = [i.name for i in s.get_inputs()]
        outs = [o.name for o in s.get_outputs()]
        return lambda feeds: dict(zip(outs, s.run(None, {n: feeds[n] for n in names})))
    load, times, y = _chain(spec, make)
    return {"load_s": load, "times": times, "outputs": {OUT: y},
            "detail": f"onnxruntime {ort.__version__} CPUExecutionProvider, ORT_ENABLE_ALL"}


def child_cn_openvino(spec: dict) -> dict:
    import openvino as ov
    core = ov.Core()
    feeds_all = {**dict(np.load(spec["inputs"])), **{n: np.zeros(s, np.float32) for n, s in residual_shapes().items()}}
    config = dict(spec.get("ov_config") or {})
    precision = {}

    known = set(feeds_all) | {OUT}

    def name(port) -> str:      # a port may carry several tensor names (OpenVINO's own beside the ONNX one)
        return next((n for n in sorted(port.get_names()) if n in known), port.get_any_name())

    def make(path, role):
        model = core.read_model(path)
        if spec.get("static"):
            model.reshape({p: ov.PartialShape(list(feeds_all[name(p)].shape)) for p in model.inputs})
        cm = core.compile_model(model, "CPU", config)
        req = cm.create_infer_request()
        names = [name(p) for p in cm.inputs]
        outs = [(name(o), o) for o in cm.outputs]
        precision[role] = str(cm.get_property("INFERENCE_PRECISION_HINT"))

        def run(feeds):
            req.infer({i: feeds[n] for i, n in enumerate(names)})
            return {n: req.get_tensor(o).data for n, o in outs}      # views: each graph has its own request
        return run
    load, times, y = _chain(spec, make)
    return {"load_s": load, "times": times, "outputs": {OUT: np.array(y)}, "precision": precision.get("unet"),
            "detail": f"openvino {ov.get_version().split('-')[0]} compile_model(read_model(onnx)"
                      f"{', static' if spec.get('static') else ''}, {config}); precision {precision}"}


fs.CHILDREN.update({"cn-torch": child_cn_torch, "cn-torch-export": child_cn_torch_export,
                    "cn-precast": child_cn_precast, "cn-onnxruntime": child_cn_onnxruntime,
                    "cn-openvino": child_cn_openvino})


# ---- parent side ---------------------------------------------------------------------------------
def write_files(folder: Path) -> dict:
    from precast.compiler.demo_controlnet import write_demo_controlnet
    from precast.compiler.demo_model import random_tensor, sd1_layout, write_safetensors
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = folder / ("tiny_sd1.safetensors" if S["small"] else "sd15_random_fp16.safetensors")
    rng = np.random.default_rng(0)
    write_safetensors(str(ckpt), sd1_layout(cfg()), "fp16", lambda k, s: random_tensor(rng, k, s))
    net = folder / "cn.safetensors"
    write_demo_controlnet(str(net), cfg(), seed=4, dtype="fp16", hint_channels=hint())
    return {"checkpoint": str(ckpt), "controlnet_file": str(net), "write_s": round(time.perf_counter() - t0, 1),
            "bytes": ckpt.stat().st_size + net.stat().st_size}


def precast_build(files: dict, folder: Path, with_net: bool) -> dict:
    """precast export (fp32, unet [+ controlnet_cn]) then precast compile for OpenVINO with the static profile."""
    out = folder / ("export_cn" if with_net else "export_plain")
    t0 = time.perf_counter()
    args = ["export", files["checkpoint"], "--out", out, "--dtype", "fp32", "--component", "unet"]
    if with_net:
        args += ["--controlnet", f"{files['controlnet_file']}:cn"]
    fs.precast_cli(*args)
    export_s = time.perf_counter() - t0
    comps = ["unet", "controlnet_cn"] if with_net else ["unet"]
    check = {}
    if S["small"]:       # the analytic count vs the exported graphs' static shapes
        feeds = {**make_inputs(), **residual_shapes()}
        shapes = {k: list(v.shape) if hasattr(v, "shape") else list(v) for k, v in feeds.items()}
        for c in comps:
            g = graph_flops(str(out / c / "model.onnx"), shapes)
            a = count_flops("controlnet" if c.startswith("controlnet") else "unet")
            check[c] = {"graph_conv_linear_gflop": g["gflop"], "analytic_conv_linear_gflop": a["conv_linear_gflop"],
                        "graph_attention_gflop": g["attention_gflop"], "analytic_attention_gflop": a["attention_gflop"]}
    env = {**os.environ, "PRECAST_CACHE": str(folder / "cache")}
    args = ["compile", out, "--target", "openvino", "--batch", S["batch"], "--height", S["image"], "--width",
            S["image"], "--tokens", S["tokens"]]
    for c in comps:
        args += ["--component", c]
    t0 = time.perf_counter()
    rep = fs.precast_cli(*args, env=env)
    compile_s = time.perf_counter() - t0
    arts = {a["component"]: {"entry": a["path"], "seconds": a["seconds"], "size_mb": round(a["size"] / 1e6, 1)}
            for a in rep["artifacts"]}
    shutil.rmtree(out, ignore_errors=True)
    return {"export_s": round(export_s, 1), "compile_wall_s": round(compile_s, 1), "artifacts": arts,
            "flop_check": check}


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[2]).read_text())
        S.update(spec["S"])
        fs.child_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed calls per runner process after one warm-up")
    ap.add_argument("--rounds", type=int, default=1, help="fresh processes per runner, interleaved round by round")
    ap.add_argument("--models", default="controlnet,unet", help="controlnet,unet (unet-zeros comes with both)")
    ap.add_argument("--runners", default=",".join(RUNNERS), help="runners of the controlnet step")
    ap.add_argument("--plain-runners", default=",".join(RUNNERS), help="runners of the plain UNet step")
    ap.add_argument("--batch", type=int, default=1, help="images per prompt (the UNet sees 2x for CFG)")
    ap.add_argument("--no-profile", action="store_true", help="skip OpenVINO per-op counters for precast")
    ap.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "controlnet_step.json")
    ap.add_argument("--small", action="store_true", help="tiny config at 256 px: a quick try, not a measurement")
    opts = ap.parse_args()
    S.update(small=opts.small, batch=opts.batch)
    if opts.small:
        S.update(image=256)
    fs.__file__ = str(Path(__file__).resolve())          # fs.run_child starts `python <this> --child SPEC`
    models = [m for m in opts.models.split(",") if m]
    want = {"controlnet": [r for r in opts.runners.split(",") if r] if "controlnet" in models else [],
            "unet": [r for r in opts.plain_runners.split(",") if r] if "unet" in models else []}
    (HERE / "results").mkdir(exist_ok=True)
    root = (opts.work or Path(tempfile.mkdtemp(prefix="controlnet_step_", dir=HERE / "results"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"work folder {root} ({shutil.disk_usage(root).free / 2**30:.0f} GiB free); {S}", flush=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        print(f"load average {load_start}; measuring GEMM peaks ...", flush=True)
        peak_start = fs.gemm_peak()
        print(f"  {peak_start}", flush=True)
        files = write_files(root / "ckpt")
        print(f"checkpoints written in {files['write_s']} s", flush=True)
        inputs = root / "inputs.npz"
        np.savez(inputs, **make_inputs())
        common = {"checkpoint": files["checkpoint"], "inputs": str(inputs), "steps": opts.steps, "S": dict(S)}
        build = {}
        t_build = time.perf_counter()
        if "precast" in want["controlnet"] or "precast" in want["unet"]:
            build["precast-cn"] = precast_build(files, root, with_net=True)
            print(f"precast controlnet export + compile: {build['precast-cn']}", flush=True)
        if "precast" in want["unet"]:
            build["precast-plain"] = precast_build(files, root, with_net=False)
            print(f"precast plain export + compile: {build['precast-plain']}", flush=True)
        onnx_peers = {"onnxruntime", "openvino-f32", "openvino-f32-static"}
        graphs_needed = (["controlnet", "unet-res"] if onnx_peers & set(want["controlnet"]) else []) + \
            (["unet"] if onnx_peers & set(want["unet"]) else [])
        onnx = {}
        for g in graphs_needed:
            path = root / "torch_onnx" / g / "model.onnx"
            r = fs.run_child("cn-torch-export", {**common, "controlnet_file": files["controlnet_file"], "graph": g,
                                                  "onnx": str(path), "exporter": opts.exporter},
                             root / "runs" / f"export-{g}", f"torch.onnx.export {g}")
            build[f"torch-export-{g}"] = r
            if "error" not in r:
                onnx[g] = str(path)
        build["wall_s"] = round(time.perf_counter() - t_build, 1)

        def spec_of(model: str, runner: str) -> tuple[str, dict] | None:
            cn = model == "controlnet"
            base = {**common, "model": model}
            if runner == "torch":
                return "cn-torch", {**base, "controlnet_file": files["controlnet_file"] if cn else None}
            if runner in ("precast", "precast-zeros"):
                arts = build["precast-cn" if (cn or runner == "precast-zeros") else "precast-plain"]["artifacts"]
                graphs = {"unet": arts["unet"]["entry"], **({"controlnet": arts["controlnet_cn"]["entry"]} if cn else {})}
                return "cn-precast", {**base, "graphs": graphs, "zeros": runner == "precast-zeros",
                                      "profile": not opts.no_profile and runner == "precast"}
            need = ["controlnet", "unet-res"] if cn else ["unet"]
            if any(g not in onnx for g in need):
                return None
            graphs = {"unet": onnx[need[-1]], **({"controlnet": onnx["controlnet"]} if cn else {})}
            if runner == "onnxruntime":
                return "cn-onnxruntime", {**base, "graphs": graphs}
            return "cn-openvino", {**base, "graphs": graphs, "ov_config": {"INFERENCE_PRECISION_HINT": "f32"},
                                   "static": runner == "openvino-f32-static"}

        plan = [("controlnet", r) for r in want["controlnet"]] + [("unet", r) for r in want["unet"]]
        if "precast" in want["unet"] and "precast-cn" in build:
            plan.append(("unet", "precast-zeros"))
        runs: dict[tuple, list] = {k: [] for k in plan}
        for rnd in range(opts.rounds):
            print(f"\n== round {rnd + 1}/{opts.rounds} ==", flush=True)
            for model, runner in plan:
                sp = spec_of(model, runner)
                if sp is None:
                    runs[(model, runner)].append({"error": "no torch ONNX"})
                    continue
                kind, spec = sp
                if rnd:
                    spec["profile"] = False
                runs[(model, runner)].append(fs.run_child(kind, spec, root / "runs" / model / runner / f"r{rnd}",
                                                          f"{model}: {LABELS[runner]}"))
        peak_end = fs.gemm_peak()
        print(f"GEMM peaks at the end: {peak_end}", flush=True)
        peak = {k: max(peak_start[k], peak_end[k]) for k in peak_start}
        results = summarize(runs, peak)
        out = {"started": started, "command": " ".join(["python", *sys.argv]),
               "machine": describe(("numpy", "onnx", "onnxruntime", "openvino", "torch", "diffusers", "transformers",
                                    "onnxscript")),
               "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
               "gemm_peak_gflops": {"start": peak_start, "end": peak_end, "used": peak},
               "settings": {"steps": opts.steps, "rounds": opts.rounds, **S, "cfg_batch": cfg_batch(),
                            "latent": latent(), "tolerance": fs.TOL["f32"], "floor": fs.SPEED_FLOOR,
                            "threads": fs.THREADS, "exporter": opts.exporter, "hint_channels": list(hint()),
                            "sd": dataclasses.asdict(cfg())},
               "build": build, "results": results}
        print_report(out)
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"\nwrote {opts.json}")
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
            print(f"work folder removed: {not root.exists()}")


def summarize(runs: dict, peak: dict) -> dict:
    results = {}
    for (model, runner), rs in runs.items():
        ok = [r for r in rs if "times" in r]
        row = {"label": LABELS[runner], "rounds": rs}
        if ok:
            timed = [t for r in ok for t in r["times"][1:]]
            row.update(median_s=statistics.median(timed), min_s=min(timed),
                       round_medians_s=[round(statistics.median(r["times"][1:]), 3) for r in ok],
                       load_avg_at_start=[r["load_avg_start"][0] for r in ok], folder=ok[0]["folder"],
                       peak_rss_mb=max(r.get("peak_rss_mb", 0) for r in ok))
            for k in ("profile", "engines", "precision", "detail"):
                if k in ok[0]:
                    row[k] = ok[0][k]
        else:
            row["error"] = rs[0].get("error") if rs else "not run"
        results.setdefault(model, {"runners": {}})["runners"][runner] = row
    for model, res in results.items():
        fl = flops_of("unet" if model == "unet" else model)
        res["flops"] = fl
        rows = res["runners"]
        ref = rows.get("torch", {}).get("folder")
        for name, r in rows.items():
            if "median_s" not in r:
                continue
            r["gflops"] = round(fl["gflop"] / r["median_s"], 1)
            r["pct_of_f32_peak"] = round(100 * r["gflops"] / peak["f32"], 1)
            r["pct_of_f32_peak_conv_linear"] = round(100 * fl["conv_linear_gflop"] / r["median_s"] / peak["f32"], 1)
            r["rel_err_vs_torch_fp32"] = None if (ref is None or name == "torch") else \
                fs.rel_err(Path(r["folder"]), Path(ref), OUT)
            r["correct"] = True if name == "torch" else (r["rel_err_vs_torch_fp32"] is not None
                                                         and r["rel_err_vs_torch_fp32"] <= fs.TOL["f32"])
        peers = {n: r["median_s"] for n, r in rows.items() if n in RUNNERS[1:] and r.get("correct")}
        if "median_s" in rows.get("precast", {}) and peers:
            best = min(peers, key=peers.get)
            sp = peers[best] / rows["precast"]["median_s"]
            t_min = fl["gflop"] / peak["f32"]
            res["floor"] = {"best_peer": best, "best_peer_s": round(peers[best], 3), "speedup": round(sp, 3),
                            "floor": fs.SPEED_FLOOR, "pass": sp >= fs.SPEED_FLOOR,
                            "bound_s": round(t_min, 3), "max_possible_speedup_vs_best_peer": round(peers[best] / t_min, 3),
                            "floor_reachable": peers[best] / t_min >= fs.SPEED_FLOOR}
        if model == "unet" and "folder" in rows.get("precast-zeros", {}) and "folder" in rows.get("precast", {}):
            z = rows["precast-zeros"]
            z["rel_err_vs_precast_plain"] = fs.rel_err(Path(z["folder"]), Path(rows["precast"]["folder"]), OUT)
            z["time_vs_precast_plain"] = round(z["median_s"] / rows["precast"]["median_s"], 3)
    for res in results.values():
        for r in res["runners"].values():
            r.pop("folder", None)
            for x in r.get("rounds", []):
                x.pop("folder", None)
                x.pop("profile", None)
    return results


def print_report(out: dict) -> None:
    peak = out["gemm_peak_gflops"]["used"]
    s = out["settings"]
    print("\n" + "=" * 100)
    print(f"GEMM peak f32 {peak['f32']} GFLOP/s (torch {peak['torch_f32']}, numpy {peak['numpy_f32']}, "
          f"OpenVINO FC {peak['openvino_f32']}); load {out['load_avg']}; {s['image']} px, CFG batch {s['cfg_batch']}, "
          f"{s['tokens']} tokens, {s['threads']} threads, {s['rounds']} round(s) x {s['steps']} timed calls")
    for model, res in out["results"].items():
        f = res["flops"]
        print(f"\n### {model} step: {f['gflop']} GFLOP (conv {f['conv_gflop']}, linear {f['linear_gflop']}, "
              f"attention {f['attention_gflop']}{', ControlNet ' + str(f['controlnet_gflop']) if 'controlnet_gflop' in f else ''})\n")
        print("| runner | median | min | rounds' medians | GFLOP/s | % f32 peak (conv+lin only) | max err / max\\|ref\\| | "
              "peer / precast |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        ours = res["runners"].get("precast", {}).get("median_s")
        for name, r in res["runners"].items():
            if "median_s" not in r:
                print(f"| {r['label']} | failed: {str(r.get('error'))[:80]} | | | | | | |")
                continue
            err = r.get("rel_err_vs_torch_fp32")
            err_s = "reference" if name == "torch" else ("—" if err is None else f"{err:.1e}" + ("" if r["correct"] else " ✗"))
            if name == "precast-zeros" and r.get("rel_err_vs_precast_plain") is not None:
                err_s += f" (vs precast plain {r['rel_err_vs_precast_plain']:.1e})"
            ratio = f"{r['median_s'] / ours:.2f}×" if ours and name in RUNNERS[1:] else ""
            if name == "precast-zeros" and ours:
                ratio = f"{r['time_vs_precast_plain']:.3f}× precast plain's time"
            print(f"| {r['label']} | {r['median_s']:.2f} s | {r['min_s']:.2f} s | "
                  f"{', '.join(f'{x:.2f}' for x in r['round_medians_s'])} | {r['gflops']:.0f} | {r['pct_of_f32_peak']}% "
                  f"({r['pct_of_f32_peak_conv_linear']}%) | {err_s} | {ratio} |")
        fl = res.get("floor")
        if fl:
            print(f"\nprecast vs best correct peer ({fl['best_peer']} {fl['best_peer_s']:.2f} s): {fl['speedup']:.2f}× "
                  f"({'PASS' if fl['pass'] else 'FAIL'} vs {fl['floor']}×); bound {f['gflop']} GFLOP / {peak['f32']} = "
                  f"{fl['bound_s']:.2f} s -> at most {fl['max_possible_speedup_vs_best_peer']:.2f}× over that peer "
                  f"(floor {'reachable' if fl['floor_reachable'] else 'NOT reachable'})")
    for model, res in out["results"].items():
        prof = res["runners"].get("precast", {}).get("profile")
        for role, p in (prof or {}).items():
            fs.print_profile(f"{model} precast {role} (PERF_COUNT)", p)


if __name__ == "__main__":
    main()
