"""Benchmark: the full-size SDXL UNet (2.6 B parameters) on this CPU, in one run.

1. A full-size SDXL UNet single file (LDM layout, deterministic random fp16 weights, ~5.1 GB) is
   written once into the work folder.
2. precast export of the UNet (fp16 and fp32): wall time and the process's own peak RSS
   (streaming matters at this size).
3. One UNet step at 1024x1024 (latent 128x128), batch 1, fp32 compute, 2 threads:
   precast's export compiled by OpenVINO (static shapes, f32 hint) vs PyTorch eager (diffusers,
   same weights). OpenVINO on a torch-exported ONNX is the third peer, run with --torch-export
   (tracing a 2.6 B-parameter fp32 model needs ~20+ GB: off by default on a 24 GB machine).
   Outputs are compared (relative max error vs PyTorch).

Usage: .venv/bin/python benchmarks/sdxl.py [--work DIR] [--json OUT] [--skip-steps] [--torch-export]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from export_unet import machine, run_measured  # noqa: E402  (same measuring harness)

SDXL_UNET_CONFIG = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=[320, 640, 1280],
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], transformer_layers_per_block=[1, 2, 10],
    attention_head_dim=[5, 10, 20], cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    norm_num_groups=32)


def ensure_checkpoint(path: Path) -> float:
    from precast.compiler.demo_model import SDXL, random_tensor, unet_layout, write_safetensors
    shapes = unet_layout(SDXL)
    want = sum(2 * int(np.prod(s)) for s in shapes.values())
    if path.exists() and path.stat().st_size > want:
        return 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    write_safetensors(str(path), shapes, "fp16", lambda k, s: random_tensor(rng, k, s))
    return time.perf_counter() - t0


def feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"sample": rng.standard_normal((1, 4, 128, 128)).astype(np.float32),
            "timestep": np.array([500.0], np.float32),
            "encoder_hidden_states": rng.standard_normal((1, 77, 2048)).astype(np.float32),
            "text_embeds": rng.standard_normal((1, 1280)).astype(np.float32),
            "time_ids": np.array([[1024, 1024, 0, 0, 1024, 1024]], np.float32)}


def step_openvino(onnx_path: str, out_npy: str) -> None:
    """Child: compile the UNet for the CPU with static shapes and time one step."""
    import openvino as ov
    core = ov.Core()
    f = feeds()
    t0 = time.perf_counter()
    model = core.read_model(onnx_path)
    model.reshape({k: ov.PartialShape(list(v.shape)) for k, v in f.items()})
    cm = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"})
    compile_s = time.perf_counter() - t0
    req = cm.create_infer_request()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        res = req.infer({k: v.astype(np.float16 if cm.input(k).get_element_type().get_type_name() == "f16" else v.dtype)
                         for k, v in f.items()})
        times.append(time.perf_counter() - t)
    np.save(out_npy, np.array(res[cm.outputs[0]], dtype=np.float32))
    print(json.dumps({"compile_s": round(compile_s, 2), "step_s": [round(x, 2) for x in times]}))


def step_torch(ckpt: str, out_npy: str) -> None:
    """Child: diffusers SDXL UNet, fp32, the same weights, one step (after one warm-up)."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    from safetensors.torch import load_file
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    sd = load_file(ckpt)
    for k in list(sd):  # widen one tensor at a time: the fp16 copy is freed as we go (~11 GB peak)
        sd[k] = sd[k].float()
    with torch.device("meta"):  # no random init of 2.6 B parameters we are about to replace
        unet = UNet2DConditionModel(**SDXL_UNET_CONFIG)
    unet.load_state_dict(convert_ldm_unet_checkpoint(sd, SDXL_UNET_CONFIG), strict=True, assign=True)
    del sd
    unet.eval()
    load_s = time.perf_counter() - t0
    f = {k: torch.from_numpy(v) for k, v in feeds().items()}
    times = []
    with torch.no_grad():
        for _ in range(2):
            t = time.perf_counter()
            out = unet(f["sample"], f["timestep"], f["encoder_hidden_states"],
                       added_cond_kwargs={"text_embeds": f["text_embeds"], "time_ids": f["time_ids"]}).sample
            times.append(time.perf_counter() - t)
    np.save(out_npy, out.numpy())
    print(json.dumps({"load_s": round(load_s, 2), "step_s": [round(x, 2) for x in times]}))


def torch_export(ckpt: str, onnx_dir: str) -> None:
    """Child: export the same UNet with torch.onnx.export (TorchScript exporter, external data)."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    from safetensors.torch import load_file
    sd = {k: v.float() for k, v in load_file(ckpt).items()}
    unet = UNet2DConditionModel(**SDXL_UNET_CONFIG)
    unet.load_state_dict(convert_ldm_unet_checkpoint(sd, SDXL_UNET_CONFIG), strict=True)
    del sd
    unet.eval()

    class Wrapped(torch.nn.Module):
        def __init__(self, u):
            super().__init__()
            self.u = u

        def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
            return self.u(sample, timestep, encoder_hidden_states,
                          added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}).sample
    f = tuple(torch.from_numpy(v) for v in feeds().values())
    os.makedirs(onnx_dir, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(Wrapped(unet), f, f"{onnx_dir}/model.onnx", opset_version=17, dynamo=False,
                          input_names=list(feeds()), output_names=["out_sample"])
    print(json.dumps({"export_s": round(time.perf_counter() - t0, 2)}))


def child(kind: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(HERE / "results" / "work"))
    ap.add_argument("--json", default=str(HERE / "results" / "sdxl.json"))
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-export", action="store_true", help="reuse the exports in the work folder")
    ap.add_argument("--reuse-ours", action="store_true", help="reuse the OpenVINO step result in --json")
    ap.add_argument("--torch-export", action="store_true")
    ap.add_argument("--child", nargs="+")
    args = ap.parse_args()
    if args.child:
        {"openvino": step_openvino, "torch": step_torch, "torch_export": torch_export}[args.child[0]](*args.child[1:])
        return
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ckpt = work / "sdxl_unet_random_fp16.safetensors"
    result = {"machine": machine(), "load_start": os.getloadavg(), "write_s": round(ensure_checkpoint(ckpt), 1)}
    previous = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
    for dtype in () if args.skip_export else ("fp16", "fp32"):
        out = work / f"sdxl_precast_{dtype}"
        r = run_measured("module", "precast.compiler.cli",
                         ["export", str(ckpt), "--component", "unet", "--out", str(out), "--dtype", dtype],
                         work / "logs" / f"sdxl_export_{dtype}.log")
        result[f"export_{dtype}"] = r
        print(f"precast export --dtype {dtype}: {r['wall_s']} s, peak RSS {r['peak_rss_mb']} MB (rc {r['rc']})")
    if not args.skip_steps:
        ours = previous.get("ours") if args.reuse_ours and previous.get("ours") else \
            child("openvino", str(work / "sdxl_precast_fp32/unet/model.onnx"), str(work / "sdxl_ov.npy"))
        for key in ("export_fp16", "export_fp32"):
            result.setdefault(key, previous.get(key))
        peer = child("torch", str(ckpt), str(work / "sdxl_torch.npy"))
        result.update(ours=ours, torch=peer)
        if "error" not in ours and "error" not in peer:
            a, b = np.load(work / "sdxl_ov.npy"), np.load(work / "sdxl_torch.npy")
            result["rel_err_vs_torch"] = float(np.abs(a - b).max() / np.abs(b).max())
            result["speedup_vs_torch"] = round(min(peer["step_s"]) / min(ours["step_s"]), 2)
        print(json.dumps({k: result.get(k) for k in ("ours", "torch", "rel_err_vs_torch", "speedup_vs_torch")},
                         indent=1))
        if args.torch_export:  # the third peer: OpenVINO on a torch-exported ONNX
            result["torch_export"] = exp = child("torch_export", str(ckpt), str(work / "sdxl_torch_onnx"))
            if "error" not in exp:
                result["openvino_on_torch_export"] = peer2 = child(
                    "openvino", str(work / "sdxl_torch_onnx/model.onnx"), str(work / "sdxl_ov_torch.npy"))
                if "error" not in peer2 and "error" not in ours:
                    result["speedup_vs_openvino_on_torch_export"] = round(min(peer2["step_s"]) / min(ours["step_s"]), 2)
            print(json.dumps({k: result.get(k) for k in ("torch_export", "openvino_on_torch_export")}, indent=1))
    result["load_end"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
