"""Graph quality at full width: one Flux transformer step and one T5-XXL encode, precast's OpenVINO
engine vs every peer on the same weights, one run.

Models (seeded random weights written by compiler/demo_dit.py into the work folder):

  flux   a Flux.1-dev slice at full width: hidden 3072, 24 heads of 128, 2 double + 2 single blocks
         (bare BFL file, bf16), 1024 image tokens (512x512 px: (512/16)^2) + 512 T5 tokens, batch 1
  t5     a 4-layer slice of T5-XXL (d_model 4096, 64 heads, d_ff 10240; bf16 file), 512 tokens

Runners, each in a fresh process (so one's memory and threads cannot bill another):

  precast            `precast export --dtype fp32|bf16` then `precast compile --target openvino` with a
                     static profile (--height 512 --width 512 --t5-tokens 512), the blob loaded with the
                     runtime's OpenVinoSession (import_model, the compile config recorded at build time).
                     Variants: the fp32 export at the precision the target picks on this CPU (f32 without
                     AMX) = "precast" (the headline), the fp32 export with --option precision=bf16, the bf16
                     export at the target's precision and with precision=bf16.
  torch / torch-bf16 diffusers FluxTransformer2DModel / transformers T5EncoderModel (tests/reference_dit.py,
                     the same file's weights), PyTorch eager fp32 and bf16, 2 threads
  onnxruntime        ONNX Runtime CPU (ORT_ENABLE_ALL) on a torch.onnx.export of the fp32 model (the dynamo
                     exporter where onnxscript is installed, else TorchScript; opset 18 / 17). The TorchScript
                     exporter cannot export diffusers' Flux (aten::rms_norm at opset 17) and onnxscript is not in
                     the project's venv: for the Flux ONNX peers put it on PYTHONPATH, e.g.
                     `pip install --target DIR --no-deps onnxscript onnx-ir` and PYTHONPATH=DIR
  openvino           OpenVINO on that ONNX as a user runs it: read_model + compile_model, default config
                     (on this CPU, with avx512_bf16, OpenVINO's default inference precision is bf16)
  openvino-f32       the same with INFERENCE_PRECISION_HINT=f32
  openvino-f32-static  the same, reshaped to the run's static shapes first (as precast compiles)

Inputs are what the runtime feeds: packed latents, T5 states, pooled CLIP, sigma, guidance 3.5 and the
ids of precast.runtime.families.flux.image_ids (txt ids zero). Each runner: one warm-up call, then --steps
timed calls; the median is reported. Outputs are compared with PyTorch fp32 (max|x - ref| / max|ref|);
an f32 runner must be within 1e-3, a bf16 runner within the bound below, else its time does not count. The bf16
precast runs are also compared with precast's own f32 run (the RoPE angles are computed from the ids in
fp32 in every export dtype; a bf16-rounded angle would show here as a large error). On random weights the
error of bf16 is large everywhere (PyTorch's own bf16 run included), so a bf16 runner counts when it is
within max(5e-2, 2x PyTorch bf16's error), as the tests judge half precision against the reference's own.

Peaks and FLOPs: this CPU's GEMM peak is measured in the same run (4096^3: torch and numpy fp32, torch
bf16, and an OpenVINO FullyConnected at f32 and bf16 precision; best per precision). FLOPs are counted
analytically: every Linear (incl. the modulation GEMVs) + attention's two matmuls (Q K^T, P V), 2 per
multiply-add. % of peak = FLOP / time / peak at the runner's compute precision.

OpenVINO per-op performance counters (PERF_COUNT) for precast's engines and the OpenVINO peers: time
per (op type, kernel) with node counts and, for GEMM-like nodes, the GFLOP/s they reached; printed and
in the JSON. Fused 'Subgraph' nodes holding a Softmax are labelled MHA.

Floor (the issue): precast >= 1.2x the best correct peer, per model.

Usage: .venv/bin/python benchmarks/flux_step.py [--only flux|t5] [--steps N] [--precast-only]
           [--no-profile] [--exporter auto|dynamo|torchscript] [--work DIR] [--keep] [--json OUT]
The work folder (checkpoints, exports, engines, torch ONNX: ~45 GB at peak) is deleted at the end
unless --keep; each model's files are deleted as soon as that model is done.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py, beside this script

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PRECAST = Path(sys.executable).with_name("precast")
IMAGE, IMG_GRID, T5_TOKENS = 512, 32, 512          # 512 px -> 32x32 packed tokens = 1024
SPEED_FLOOR = 1.2
TOL = {"f32": 1e-3, "bf16": 5e-2}
CHILD_TIMEOUT_S = 3600
THREADS = os.cpu_count() or 1


def flux_cfg():
    from precast.compiler.demo_dit import FLUX_DEV
    return dataclasses.replace(FLUX_DEV, depth=2, depth_single=2)


def t5_cfg():
    from precast.compiler.demo_dit import T5_XXL
    return dataclasses.replace(T5_XXL, layers=4)


OUTPUT = {"flux": "out_hidden_states", "t5": "last_hidden_state"}


# ---- inputs and FLOPs ---------------------------------------------------------------------
def make_inputs(model: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng({"flux": 11, "t5": 12}[model])
    if model == "flux":
        from precast.runtime.families.flux import image_ids
        return {"hidden_states": rng.standard_normal((1, IMG_GRID * IMG_GRID, 64)).astype(np.float32),
                "encoder_hidden_states": rng.standard_normal((1, T5_TOKENS, 4096)).astype(np.float32),
                "pooled_projections": rng.standard_normal((1, 768)).astype(np.float32),
                "timestep": np.array([0.75], np.float32), "guidance": np.array([3.5], np.float32),
                "img_ids": image_ids(IMG_GRID, IMG_GRID), "txt_ids": np.zeros((T5_TOKENS, 3), np.float32)}
    ids = np.zeros((1, T5_TOKENS), np.int64)      # 90 word pieces, EOS (1), padded with 0 as Flux pipelines do
    ids[0, :90] = rng.integers(3, 32000, 90)
    ids[0, 90] = 1
    return {"input_ids": ids}


def count_flops(model: str) -> dict:
    """GFLOP (2 per multiply-add) of one call: Linears (GEMMs and the modulation GEMVs) and attention."""
    if model == "flux":
        c = flux_cfg()
        h, mlp, n_img, n_txt = c.hidden, c.mlp_hidden, IMG_GRID * IMG_GRID, T5_TOKENS
        seq = n_img + n_txt
        gemv = 2 * 2 * (256 * h + h * h) + 2 * (c.vec_in_dim * h + h * h)                    # time/guidance/vector_in
        gemv += c.depth * 2 * 2 * 6 * h * h + c.depth_single * 2 * 3 * h * h + 2 * 2 * h * h  # modulations, final
        lin = 2 * n_img * c.in_channels * h + 2 * n_txt * c.context_in_dim * h               # img_in, txt_in
        lin += c.depth * 2 * seq * (3 * h * h + h * h + 2 * h * mlp)                         # double: both streams
        lin += c.depth_single * 2 * seq * (h * (3 * h + mlp) + (h + mlp) * h)
        lin += 2 * n_img * h * c.out_channels
        att = (c.depth + c.depth_single) * 2 * 2 * seq * seq * h
    else:
        c = t5_cfg()
        inner, s = c.heads * c.d_kv, T5_TOKENS
        gemv = 0
        lin = c.layers * 2 * s * (4 * c.d_model * inner + 3 * c.d_model * c.d_ff)
        att = c.layers * 2 * 2 * s * s * inner
    total = lin + gemv + att
    return {"gflop": round(total / 1e9, 2), "linear_gflop": round((lin + gemv) / 1e9, 2),
            "attention_gflop": round(att / 1e9, 2), "gemv_gflop": round(gemv / 1e9, 3)}


# ---- GEMM peak ----------------------------------------------------------------------------
def gemm_peak(n: int = 4096, repeats: int = 4) -> dict:
    """Best n^3 GEMM rate (GFLOP/s), all cores: torch/numpy fp32, torch bf16, OpenVINO FullyConnected
    (constant weight, as every Linear of the engines) at f32 and bf16 precision."""
    import torch
    torch.set_num_threads(THREADS)
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ha, hb = ta.bfloat16(), tb.bfloat16()
    out = {}

    def best(fn):
        fn()
        return round(2 * n ** 3 / min(_time_calls(fn, repeats)[1:]) / 1e9, 1)
    out["torch_f32"] = best(lambda: torch.mm(ta, tb))
    out["numpy_f32"] = best(lambda: a @ b)
    out["torch_bf16"] = best(lambda: torch.mm(ha, hb))
    import openvino as ov
    import openvino.opset13 as ops
    x = ops.parameter([n, n], ov.Type.f32, name="x")
    model = ov.Model([ops.matmul(x, ops.constant(b), False, True)], [x])
    for prec in ("f32", "bf16"):
        cm = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": prec, "PERFORMANCE_HINT": "LATENCY"})
        req = cm.create_infer_request()
        out[f"openvino_{prec}"] = best(lambda: req.infer({0: a}))
        del req, cm
    out["f32"] = max(out["torch_f32"], out["numpy_f32"], out["openvino_f32"])
    out["bf16"] = max(out["torch_bf16"], out["openvino_bf16"])
    return out


# ---- the children -------------------------------------------------------------------------
def _time_calls(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps + 1):                 # the first call is the warm-up
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _vm_hwm_mb() -> float:
    status = open("/proc/self/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024


def torch_reference(spec: dict):
    """The diffusers / transformers model holding the checkpoint's weights, fp32, eval, wrapped to take
    plain tensors in the ONNX input order and return one tensor."""
    import torch
    sys.path.insert(0, str(ROOT / "tests"))
    import reference_dit as ref
    torch.set_num_threads(THREADS)
    if spec["model"] == "flux":
        inner = ref.flux_reference(spec["checkpoint"], flux_cfg())

        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = inner

            def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                        guidance):
                return self.m(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                              pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                              txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids",
                 "guidance"]
    else:
        inner = ref.t5_reference(spec["checkpoint"], t5_cfg())

        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = inner

            def forward(self, input_ids):
                return self.m(input_ids=input_ids).last_hidden_state
        names = ["input_ids"]
    return W().eval(), names


def _torch_args(feeds: dict, names: list[str], dtype=None) -> list:
    import torch
    args = []
    for n in names:
        t = torch.from_numpy(feeds[n])
        if dtype is not None and t.is_floating_point() and not n.endswith("_ids"):
            t = t.to(dtype)
        args.append(t)
    return args


def child_torch(spec: dict) -> dict:
    import torch
    t0 = time.perf_counter()
    model, names = torch_reference(spec)
    dtype = torch.bfloat16 if spec.get("dtype") == "bf16" else None
    if dtype is not None:
        model = model.to(dtype)
    load = time.perf_counter() - t0
    args = _torch_args(dict(np.load(spec["inputs"])), names, dtype)
    out = {}

    def call():
        with torch.inference_mode():
            out["y"] = model(*args)
    times = _time_calls(call, spec["steps"])
    return {"load_s": load, "times": times, "outputs": {OUTPUT[spec["model"]]: out["y"].float().numpy()},
            "detail": f"eager {spec.get('dtype', 'fp32')}, torch {torch.__version__}, {torch.get_num_threads()} threads"}


def child_torch_export(spec: dict) -> dict:
    """torch.onnx.export of the fp32 model: the dynamo exporter (onnxscript) or the TorchScript one,
    dynamic axes as optimum exports them."""
    import torch
    model, names = torch_reference(spec)
    args = tuple(_torch_args(dict(np.load(spec["inputs"])), names))
    out = Path(spec["onnx"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tried, errors = [], {}
    order = {"dynamo": ["dynamo"], "torchscript": ["torchscript"], "auto": ["dynamo", "torchscript"]}[spec["exporter"]]
    for how in order:
        if how == "dynamo":
            try:
                import onnxscript  # noqa: F401
            except ImportError:
                errors["dynamo"] = "onnxscript is not installed"
                continue
        t0 = time.perf_counter()
        tried.append(how)
        try:
            with torch.no_grad():
                if how == "dynamo":
                    dyn = ({"hidden_states": {1: "image_tokens"}, "encoder_hidden_states": {1: "t5_sequence"},
                            "img_ids": {0: "image_tokens"}, "txt_ids": {0: "t5_sequence"}}
                           if spec["model"] == "flux" else {"input_ids": {1: "sequence"}})
                    shapes = {n: dyn.get(n) for n in names}
                    prog = torch.onnx.export(model, args, dynamo=True, opset_version=18, input_names=names,
                                             output_names=[OUTPUT[spec["model"]]], dynamic_shapes=shapes,
                                             external_data=True)
                    prog.save(str(out), external_data=True)
                else:
                    dyn = ({"hidden_states": {1: "image_tokens"}, "encoder_hidden_states": {1: "t5_sequence"},
                            "img_ids": {0: "image_tokens"}, "txt_ids": {0: "t5_sequence"},
                            OUTPUT["flux"]: {1: "image_tokens"}}
                           if spec["model"] == "flux" else {"input_ids": {1: "sequence"}, OUTPUT["t5"]: {1: "sequence"}})
                    torch.onnx.export(model, args, str(out), dynamo=False, opset_version=17, input_names=names,
                                      output_names=[OUTPUT[spec["model"]]], dynamic_axes=dyn)
            return {"export_s": time.perf_counter() - t0, "exporter": how, "errors": errors,
                    "detail": f"torch.onnx.export ({'dynamo, opset 18' if how == 'dynamo' else 'TorchScript, opset 17'})"}
        except Exception as e:  # noqa: BLE001 -- the next exporter is tried, the error recorded
            errors[how] = f"{type(e).__name__}: {str(e)[:300]}"
            for f in out.parent.iterdir():
                f.unlink()
    raise RuntimeError(f"every exporter failed: {errors}")


def _typed(feeds: dict, types: dict) -> dict:
    return {k: np.ascontiguousarray(v, dtype=types[k]) for k, v in feeds.items() if k in types}


def child_onnxruntime(spec: dict) -> dict:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    t0 = time.perf_counter()
    sess = ort.InferenceSession(spec["onnx"], opts, providers=["CPUExecutionProvider"])
    load = time.perf_counter() - t0
    kinds = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    feeds = _typed(dict(np.load(spec["inputs"])), {i.name: kinds[i.type] for i in sess.get_inputs()})
    out = {}
    times = _time_calls(lambda: out.update(y=sess.run(None, feeds)[0]), spec["steps"])
    return {"load_s": load, "times": times, "outputs": {OUTPUT[spec["model"]]: out["y"]},
            "detail": f"onnxruntime {ort.__version__} CPUExecutionProvider, ORT_ENABLE_ALL, "
                      f"{opts.intra_op_num_threads or 'default'} intra-op threads"}


def ov_profile(request, compiled, top: int = 12) -> dict:
    """Per-op counters of the last inference: ms, share and node count per (op type, kernel), GFLOP/s of
    GEMM-like nodes (from the runtime model's shapes), the slowest nodes."""
    origin, flops = {}, {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        name = op.get_friendly_name()
        names = rt["originalLayersNames"].astype(str).lower() if "originalLayersNames" in rt else ""
        kind = rt["layerType"].astype(str) if "layerType" in rt else op.get_type_name()
        ins = [list(op.input_value(i).get_partial_shape()) for i in range(op.get_input_size())]
        ins = [[d.get_length() if d.is_static else -1 for d in s] for s in ins]
        if "softmax" in names or (not names and kind == "Subgraph" and sum(len(i) == 4 for i in ins) >= 3):
            names += " softmax"   # imported blobs keep no fused names: q, k, v (three 4-D inputs) is attention
        origin[name] = names
        if kind in ("FullyConnected", "MatMul") and op.get_output_size() and ins and all(d > 0 for d in ins[0]):
            out = [d.get_length() for d in op.get_output_partial_shape(0)] \
                if op.get_output_partial_shape(0).is_static else None
            if out:
                k = ins[0][-1]
                flops[name] = 2 * int(np.prod(out)) * k
    by_kind, count, fl, nodes, total = collections.Counter(), collections.Counter(), collections.Counter(), [], 0.0
    for p in request.profiling_info:
        if not str(p.status).endswith("EXECUTED"):
            continue
        ms = p.real_time.total_seconds() * 1e3
        kind = p.node_type
        if kind == "Subgraph":
            kind = "Subgraph(MHA)" if "softmax" in origin.get(p.node_name, "") else "Subgraph(eltwise)"
        key = (kind, p.exec_type)
        by_kind[key] += ms
        count[key] += 1
        fl[key] += flops.get(p.node_name, 0)
        nodes.append((ms, p.node_name, kind, p.exec_type))
        total += ms
    return {"total_ms": round(total, 1),
            "by_op": [{"op": k, "kernel": e, "ms": round(ms, 1), "share": round(ms / total, 4), "count": count[(k, e)],
                       "gflops": round(fl[(k, e)] / ms / 1e6, 1) if fl[(k, e)] and ms else None}
                      for (k, e), ms in by_kind.most_common(top)],
            "top_nodes": [{"node": n[:100], "op": k, "kernel": e, "ms": round(ms, 1)}
                          for ms, n, k, e in sorted(nodes, reverse=True)[:top]]}


def child_openvino(spec: dict) -> dict:
    """OpenVINO on the torch-exported ONNX: read_model (+ reshape when static) + compile_model."""
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
    out = np.array(request.get_tensor(compiled.outputs[0]).data, np.float32)
    prec = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    res = {"load_s": load, "times": times, "outputs": {OUTPUT[spec["model"]]: out}, "precision": prec,
           "detail": f"openvino {ov.get_version().split('-')[0]} compile_model(read_model(onnx)"
                     f"{', static' if spec.get('static') else ''}, {config or 'default config'}); precision {prec}, "
                     f"hint {compiled.get_property('PERFORMANCE_HINT')}, {compiled.get_property('NUM_STREAMS')} "
                     f"stream(s), {compiled.get_property('INFERENCE_NUM_THREADS')} threads"}
    if spec.get("profile"):
        del request, compiled
        prof = compile_({"PERF_COUNT": True})
        req = prof.create_infer_request()
        req.infer(feeds)
        req.infer(feeds)
        res["profile"] = ov_profile(req, prof)
    return res


def child_precast(spec: dict) -> dict:
    """precast's engine: the cache entry `precast compile` wrote, opened with the runtime's session."""
    import openvino as ov
    from precast.compiler.cache import parse_entry
    from precast.runtime.sessions import OpenVinoSession
    entry = parse_entry(Path(spec["entry"]))
    meta = entry.metadata
    t0 = time.perf_counter()
    session = OpenVinoSession(entry.path / meta["entry"], meta.get("device", "CPU"), meta.get("compile_config", {}))
    load = time.perf_counter() - t0
    feeds = dict(np.load(spec["inputs"]))
    if spec["model"] == "t5":
        feeds["input_ids"] = feeds["input_ids"].astype(np.int32)
    out = {}
    times = _time_calls(lambda: out.update(session.run(feeds)), spec["steps"])
    cm = session._cm
    prec = str(cm.get_property("INFERENCE_PRECISION_HINT"))
    res = {"load_s": load, "times": times, "outputs": {OUTPUT[spec["model"]]: out[OUTPUT[spec["model"]]]},
           "precision": prec, "compile_config": meta.get("compile_config"), "blob_mb": round(entry.size / 1e6, 1),
           "build_seconds": meta.get("build_seconds"),
           "detail": f"precast blob via runtime OpenVinoSession; {meta.get('compile_config')}; precision {prec}, "
                     f"{cm.get_property('NUM_STREAMS')} stream(s), {cm.get_property('INFERENCE_NUM_THREADS')} threads"}
    if spec.get("profile"):
        del session, cm
        compiled = ov.Core().import_model((entry.path / meta["entry"]).read_bytes(), "CPU",
                                          {**meta.get("compile_config", {}), "PERF_COUNT": True})
        req = compiled.create_infer_request()
        types = {p.get_any_name(): p.get_element_type() for p in compiled.inputs}
        typed = {}
        for k, v in feeds.items():
            if k not in types:
                continue
            if types[k] == ov.Type.bf16:
                from precast.runtime.sessions import to_bf16_bits
                typed[k] = ov.Tensor(to_bf16_bits(v), ov.Shape(list(v.shape)), ov.Type.bf16)
            else:
                typed[k] = np.ascontiguousarray(v, dtype=np.dtype(types[k].to_dtype()))
        req.infer(typed)
        req.infer(typed)
        res["profile"] = ov_profile(req, compiled)
    return res


CHILDREN = {"torch": child_torch, "torch-export": child_torch_export, "onnxruntime": child_onnxruntime,
            "openvino": child_openvino, "precast": child_precast}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res = CHILDREN[spec["kind"]](spec)
    out = Path(spec["out"])
    for name, arr in res.pop("outputs", {}).items():
        np.save(out / f"out_{name}.npy", np.asarray(arr, np.float32))
    res["peak_rss_mb"] = round(_vm_hwm_mb(), 1)
    (out / "result.json").write_text(json.dumps(res, indent=1, default=str))


def run_child(kind: str, spec: dict, folder: Path, label: str) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = {**spec, "kind": kind, "out": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    load = os.getloadavg()
    print(f"  {label:<34} ...", end="", flush=True)
    t0 = time.perf_counter()
    with open(folder / "log.txt", "wb") as log:
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(folder / "spec.json")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=CHILD_TIMEOUT_S).returncode
    wall = time.perf_counter() - t0
    if rc != 0 or not (folder / "result.json").exists():
        tail = "\n".join((folder / "log.txt").read_text(errors="replace").splitlines()[-12:])
        print(f" FAILED (rc {rc})\n{tail}")
        return {"error": f"rc {rc}: {tail.splitlines()[-1] if tail else ''}"}
    res = json.loads((folder / "result.json").read_text())
    res.update(wall_s=round(wall, 1), load_avg_start=[round(x, 2) for x in load], folder=str(folder))
    if "times" in res:
        t = res["times"][1:]
        res["median_s"], res["min_s"] = statistics.median(t), min(t)
        print(f" median {res['median_s'] * 1e3:8.0f} ms (runs {', '.join(f'{x:.2f}' for x in res['times'])} s; "
              f"first = warm-up), load {load[0]:.2f}, {wall:.0f} s wall", flush=True)
    else:
        print(f" done in {wall:.0f} s", flush=True)
    return res


# ---- parent-side steps ----------------------------------------------------------------------
def precast_cli(*args, env=None) -> dict:
    proc = subprocess.run([str(PRECAST), *map(str, args), "--json"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"precast {' '.join(map(str, args))} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def write_checkpoints(model: str, folder: Path) -> dict:
    from precast.compiler.demo_dit import TINY_FLUX_DEV, write_flux_checkpoint, write_t5_file
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if model == "flux":
        ckpt = folder / "flux_slice_bf16.safetensors"
        write_flux_checkpoint(ckpt, flux_cfg(), layout="bare", dtype="bf16")
        extra = {}
    else:   # precast exports a T5 beside a Flux transformer: a tiny one (T5-wide context) carries it
        ckpt = folder / "t5xxl_slice_bf16.safetensors"
        write_t5_file(ckpt, t5_cfg(), dtype="bf16")
        carrier = folder / "tiny_flux_carrier.safetensors"
        write_flux_checkpoint(carrier, dataclasses.replace(TINY_FLUX_DEV, context_in_dim=4096), layout="bare",
                              dtype="bf16")
        extra = {"carrier": str(carrier)}
    return {"checkpoint": str(ckpt), "write_s": round(time.perf_counter() - t0, 1), **extra}


def precast_export(model: str, files: dict, out: Path, dtype: str) -> dict:
    t0 = time.perf_counter()
    if model == "flux":
        rep = precast_cli("export", files["checkpoint"], "--out", out, "--dtype", dtype, "--component", "transformer")
        comp = "transformer"
    else:
        rep = precast_cli("export", files["carrier"], "--text-encoder", files["checkpoint"], "--out", out, "--dtype",
                          dtype, "--component", "text_encoder_2", "--set", "transformer.axes_dims_rope=[4,6,6]")
        comp = "text_encoder_2"
    return {"dir": str(out), "component": comp, "wall_s": round(time.perf_counter() - t0, 1),
            "seconds": rep.get("seconds")}


def precast_compile(export: dict, cache: Path, options: list[str]) -> dict:
    env = {**os.environ, "PRECAST_CACHE": str(cache)}
    args = ["compile", export["dir"], "--target", "openvino", "--component", export["component"], "--height", IMAGE,
            "--width", IMAGE, "--t5-tokens", T5_TOKENS]
    for o in options:
        args += ["--option", o]
    t0 = time.perf_counter()
    rep = precast_cli(*args, env=env)["artifacts"][0]
    return {"entry": rep["path"], "cache": rep["cache"], "seconds": rep["seconds"],
            "wall_s": round(time.perf_counter() - t0, 1), "size_mb": round(rep["size"] / 1e6, 1)}


def rel_err(a: Path, b: Path, name: str) -> float | None:
    fa, fb = a / f"out_{name}.npy", b / f"out_{name}.npy"
    if not (fa.exists() and fb.exists()):
        return None
    x, y = np.load(fa).astype(np.float64), np.load(fb).astype(np.float64)
    if x.shape != y.shape:
        return None
    return float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))


# (name, export dtype, target options, label)
PRECAST_VARIANTS = [("precast", "fp32", [], "precast fp32 export, target's precision"),
                    ("precast-fp32-bf16", "fp32", ["precision=bf16"], "precast fp32 export, precision=bf16"),
                    ("precast-bf16", "bf16", [], "precast bf16 export, target's precision"),
                    ("precast-bf16-bf16", "bf16", ["precision=bf16"], "precast bf16 export, precision=bf16")]
PEERS = ("torch", "torch-bf16", "onnxruntime", "openvino", "openvino-f32", "openvino-f32-static")


def run_model(model: str, root: Path, opts) -> dict:
    folder = root / model
    runs = folder / "runs"
    print(f"\n== {model} ==", flush=True)
    files = write_checkpoints(model, folder / "ckpt")
    print(f"  checkpoint {Path(files['checkpoint']).name} in {files['write_s']} s", flush=True)
    feeds = make_inputs(model)
    inputs = folder / "inputs.npz"
    np.savez(inputs, **feeds)
    common = {"model": model, "checkpoint": files["checkpoint"], "inputs": str(inputs), "steps": opts.steps}
    rows: dict[str, dict] = {}
    build: dict[str, dict] = {}

    exports = {}
    want = set(filter(None, opts.runners.split(","))) or {v[0] for v in PRECAST_VARIANTS} | set(PEERS)
    for name, dtype, options, label in PRECAST_VARIANTS:
        if name not in want:
            continue
        if dtype not in exports:
            exports[dtype] = precast_export(model, files, folder / f"export_{dtype}", dtype)
            print(f"  precast export --dtype {dtype}: {exports[dtype]['wall_s']} s", flush=True)
        comp = precast_compile(exports[dtype], folder / "cache", options)
        build[name] = {"export": exports[dtype], "compile": comp}
        print(f"  precast compile ({dtype} export{', ' + ' '.join(options) if options else ''}): {comp['wall_s']} s, "
              f"blob {comp['size_mb']} MB", flush=True)
        rows[name] = run_child("precast", {**common, "entry": comp["entry"], "profile": not opts.no_profile
                                           and name in ("precast", "precast-bf16-bf16", "precast-fp32-bf16")},
                               runs / name, label)
        rows[name]["label"] = label
    for dtype in exports:                    # the blobs are built; the exports are not needed any more
        if not opts.keep:
            shutil.rmtree(exports[dtype]["dir"], ignore_errors=True)

    if not opts.precast_only:
        rows["torch"] = run_child("torch", common, runs / "torch", "PyTorch eager fp32")   # the parity reference
        if "torch-bf16" in want:
            rows["torch-bf16"] = run_child("torch", {**common, "dtype": "bf16"}, runs / "torch-bf16",
                                           "PyTorch eager bf16")
        onnx_path = folder / "torch_onnx" / "model.onnx"
        exp = {"error": "skipped"} if not want & {"onnxruntime", "openvino", "openvino-f32", "openvino-f32-static"} \
            else run_child("torch-export", {**common, "onnx": str(onnx_path), "exporter": opts.exporter},
                        runs / "torch-export", "torch.onnx.export")
        build["torch-export"] = exp
        if "error" not in exp:
            if "onnxruntime" in want:
                rows["onnxruntime"] = run_child("onnxruntime", {**common, "onnx": str(onnx_path)},
                                                runs / "onnxruntime", "ONNX Runtime on torch ONNX")
            for name, cfg, static in (("openvino", {}, False),
                                      ("openvino-f32", {"INFERENCE_PRECISION_HINT": "f32"}, False),
                                      ("openvino-f32-static", {"INFERENCE_PRECISION_HINT": "f32"}, True)):
                if name not in want:
                    continue
                rows[name] = run_child("openvino", {**common, "onnx": str(onnx_path), "ov_config": cfg, "static": static,
                                                    "profile": not opts.no_profile and name != "openvino-f32-static"},
                                       runs / name, f"OpenVINO on torch ONNX{', ' + name[9:] if name[9:] else ''}")
    labels = {"torch": "PyTorch eager fp32", "torch-bf16": "PyTorch eager bf16", "onnxruntime": "ONNX Runtime (torch ONNX)",
              "openvino": "OpenVINO (torch ONNX), default cfg", "openvino-f32": "OpenVINO (torch ONNX), f32 hint",
              "openvino-f32-static": "OpenVINO (torch ONNX), f32, static"}
    for name, label in labels.items():
        if name in rows:
            rows[name]["label"] = label

    flops = count_flops(model)
    out_name = OUTPUT[model]
    ref_dir = Path(rows["torch"]["folder"]) if "folder" in rows.get("torch", {}) else None
    exported = {v[0]: v[1] for v in PRECAST_VARIANTS}
    for name, r in rows.items():
        if "median_s" not in r:
            continue
        # a bf16 export computes in bf16 whatever the hint (OpenVINO keeps a graph's explicit bf16 ops)
        low = name == "torch-bf16" or exported.get(name) == "bf16" or "bf" in str(r.get("precision", "")).lower()
        r["compute_precision"] = "bf16" if low else "f32"
        r["gflops"] = round(flops["gflop"] / r["median_s"], 1)
        r["rel_err_vs_torch_fp32"] = None if (ref_dir is None or name == "torch") else rel_err(Path(r["folder"]), ref_dir,
                                                                                                 out_name)
    # bf16 runs are judged against PyTorch's own bf16 error on these random weights (the tests' rule for
    # half precision): within max(TOL bf16, 2x torch-bf16's error)
    tol = dict(TOL)
    if rows.get("torch-bf16", {}).get("rel_err_vs_torch_fp32") is not None:
        tol["bf16"] = max(TOL["bf16"], 2 * rows["torch-bf16"]["rel_err_vs_torch_fp32"])
    for name, r in rows.items():
        if "median_s" in r:
            err = r["rel_err_vs_torch_fp32"]
            r["tolerance"] = tol[r["compute_precision"]]
            r["correct"] = True if name == "torch" else (None if err is None else err <= r["tolerance"])
    base = rows.get("precast", {})
    if "folder" in base:
        for name, r in rows.items():
            if name.startswith("precast-") and "folder" in r:
                r["rel_err_vs_precast_f32"] = rel_err(Path(r["folder"]), Path(base["folder"]), out_name)
    for r in rows.values():                  # keep the JSON small: no profile's top nodes twice
        r.pop("folder", None)
    if not opts.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return {"flops": flops, "inputs": {k: list(v.shape) for k, v in feeds.items()}, "build": build, "runners": rows,
            "checkpoint": files}


def floors(res: dict) -> dict:
    rows = res["runners"]
    peers = {n: r["median_s"] for n, r in rows.items() if n in PEERS and "median_s" in r and r.get("correct")}
    ours = {n: r["median_s"] for n, r in rows.items() if n.startswith("precast") and "median_s" in r
            and r.get("correct") is not False}
    if not peers or not ours:
        return {}
    best_peer = min(peers, key=peers.get)
    best_ours = min(ours, key=ours.get)
    f = {"best_peer": best_peer, "best_peer_s": round(peers[best_peer], 3), "floor": SPEED_FLOOR}
    for tag, name in (("target_default", "precast"), ("best_variant", best_ours)):
        if name in ours:
            sp = peers[best_peer] / ours[name]
            f[tag] = {"runner": name, "speedup": round(sp, 3), "pass": sp >= SPEED_FLOOR}
    return f


def print_report(results: dict, peak: dict, opts) -> None:
    print("\n" + "=" * 118)
    print(f"GEMM peak (4096^3, GFLOP/s): f32 {peak['f32']} (torch {peak['torch_f32']}, numpy {peak['numpy_f32']}, "
          f"OpenVINO FC {peak['openvino_f32']}); bf16 {peak['bf16']} (torch {peak['torch_bf16']}, "
          f"OpenVINO FC {peak['openvino_bf16']})")
    for model, res in results.items():
        rows, f = res["runners"], res["flops"]
        ours = rows.get("precast", {}).get("median_s")
        print(f"\n{model}: {f['gflop']} GFLOP per call (linear {f['linear_gflop']} incl. GEMV {f['gemv_gflop']}, "
              f"attention {f['attention_gflop']}); inputs {res['inputs']}")
        head = (f"{'runner':<40} {'prec':<5} {'ms/step':>8} {'min ms':>8} {'GFLOP/s':>8} {'%f32pk':>7} {'%ownpk':>7} "
                f"{'err vs torch':>12} {'peer/precast':>12}")
        print(head + "\n" + "-" * len(head))
        for name, r in rows.items():
            label = r.get("label", name)
            if "median_s" not in r:
                print(f"{label:<40} failed: {r.get('error', '')[:70]}")
                continue
            prec = r["compute_precision"]
            err = r.get("rel_err_vs_torch_fp32")
            err_s = "" if err is None else f"{err:.1e}" + ("" if r.get("correct") else " X")
            ratio = f"{r['median_s'] / ours:.2f}x" if ours and not name.startswith("precast") else ""
            print(f"{label:<40} {prec:<5} {r['median_s'] * 1e3:>8.0f} {r['min_s'] * 1e3:>8.0f} {r['gflops']:>8.1f} "
                  f"{100 * r['gflops'] / peak['f32']:>6.1f}% {100 * r['gflops'] / peak[prec]:>6.1f}% {err_s:>12} "
                  f"{ratio:>12}")
        bf = {n: r.get("rel_err_vs_precast_f32") for n, r in rows.items() if n.startswith("precast-")}
        if bf:
            print("precast variants vs precast f32 (rel err): " + ", ".join(f"{n} {e:.1e}" if e is not None else n
                                                                             for n, e in bf.items()))
        fl = res.get("floors") or {}
        if fl:
            parts = [f"best correct peer: {rows[fl['best_peer']].get('label', fl['best_peer'])} {fl['best_peer_s'] * 1e3:.0f} ms"]
            for tag in ("target_default", "best_variant"):
                if tag in fl:
                    parts.append(f"{tag} {fl[tag]['runner']}: {fl[tag]['speedup']:.2f}x "
                                 f"({'PASS' if fl[tag]['pass'] else 'FAIL'} vs {SPEED_FLOOR}x)")
            print("floor: " + "; ".join(parts))
    print("\nerr = max|x - torch fp32| / max|torch fp32| (X: above the tolerance, f32 1e-3 / bf16 max(5e-2, 2x torch "
          "bf16's): time does not count); peer/precast = the peer's time / precast's (fp32 export, target's precision) = precast's speedup; "
          "%ownpk = % of the GEMM peak at the runner's compute precision")
    for model, res in results.items():
        for name, r in res["runners"].items():
            if r.get("profile"):
                print_profile(f"{model} {r.get('label', name)} (PERF_COUNT)", r["profile"])


def print_profile(title: str, prof: dict) -> None:
    print(f"\n  {title}: {prof['total_ms']:.0f} ms in profiled nodes")
    for r in prof["by_op"]:
        g = f"{r['gflops']:7.1f} GFLOP/s" if r.get("gflops") else ""
        print(f"    {r['op']:<20} {r['kernel']:<26} {r['ms']:>8.1f} ms {100 * r['share']:>5.1f}%  x{r['count']:<4} {g}")
    print("    slowest nodes:")
    for r in prof["top_nodes"][:4]:
        print(f"      {r['ms']:>8.1f} ms  {r['op']:<18} {r['kernel']:<24} {r['node'][:60]}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=["flux", "t5"], help="run only this model (repeatable)")
    ap.add_argument("--steps", type=int, default=3, help="timed calls per runner after one warm-up; median reported")
    ap.add_argument("--precast-only", action="store_true", help="precast's variants only (no peers, no parity)")
    ap.add_argument("--runners", default="", help="comma-separated subset of runners (default: all), e.g. "
                    "precast,torch,openvino-f32")
    ap.add_argument("--no-profile", action="store_true", help="skip the OpenVINO per-op performance counters")
    ap.add_argument("--exporter", choices=["auto", "dynamo", "torchscript"], default="auto",
                    help="torch.onnx.export flavour for the ONNX peers (auto: dynamo when onnxscript is installed)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a new one under benchmarks/results)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (checkpoints, exports, engines)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "flux_step.json")
    opts = ap.parse_args()
    (HERE / "results").mkdir(exist_ok=True)
    root = (opts.work or Path(tempfile.mkdtemp(prefix="flux_step_", dir=HERE / "results"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(root).free / 2**30
    print(f"work folder {root} ({free_gb:.0f} GiB free; ~45 GiB needed at peak)", flush=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        print(f"load average {load_start}; measuring GEMM peaks ...", flush=True)
        peak_start = gemm_peak()
        print(f"  {peak_start}", flush=True)
        results = {}
        for model in opts.only or ["flux", "t5"]:
            results[model] = run_model(model, root, opts)
        peak_end = gemm_peak()
        peak = {k: max(peak_start[k], peak_end[k]) for k in peak_start}
        for res in results.values():
            for r in res["runners"].values():
                if "gflops" in r:
                    r["pct_of_f32_peak"] = round(100 * r["gflops"] / peak["f32"], 1)
                    r["pct_of_own_peak"] = round(100 * r["gflops"] / peak[r["compute_precision"]], 1)
            res["floors"] = floors(res)
        print_report(results, peak, opts)
        out = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": describe(("numpy", "onnx", "onnxruntime", "openvino", "torch", "diffusers", "transformers",
                                    "onnxscript")),
               "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
               "gemm_peak_gflops": {"start": peak_start, "end": peak_end, "used": peak},
               "settings": {"steps": opts.steps, "image": IMAGE, "image_tokens": IMG_GRID ** 2, "t5_tokens": T5_TOKENS,
                            "tolerance": TOL, "floor": SPEED_FLOOR, "threads": THREADS,
                            "flux": dataclasses.asdict(flux_cfg()), "t5": dataclasses.asdict(t5_cfg())},
               "results": results}
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"\nwrote {opts.json}")
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
