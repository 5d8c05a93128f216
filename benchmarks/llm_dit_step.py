"""Graph quality at full width: one transformer step of each LLM-conditioned family -- Z-Image(-Turbo), FLUX.2
klein (4B) and Qwen-Image -- as a 2-block slice, precast's OpenVINO engine vs every peer on the same weights.

Models (seeded random weights in the real key layouts, written into the work folder as bare bf16 files by
compiler/demo_zimage.py, demo_flux2.py and demo_qwenimage.py; the full-size shapes in full_configs, with their sources):

  zimage     Z-Image-Turbo at full width (dim 3840, 30 heads of 128, SwiGLU 10240, caption 2560): 2 of its 30
             main layers + its whole fixed part, 2 noise-refiner (image) and 2 context-refiner (caption) layers;
             original release names (fused attention.qkv), as z_image_turbo_bf16.safetensors
  flux2      FLUX.2 klein 4B at full width (hidden 3072, 24 heads of 128, MLP 9216, text 7680 = 3 x Qwen3-4B's
             2560): 1 of its 5 double-stream + 1 of its 20 single-stream blocks (the shared modulations, embedders
             and final layer whole); BFL names, as flux-2-klein-4b.safetensors
  qwenimage  Qwen-Image at full width (hidden 3072, 24 heads of 128, MLP 12288, text 3584): 2 of its 60
             double-stream blocks; diffusers names, as ComfyUI's qwen_image files

A 1024x1024 image, batch 1: the VAEs' 1/8 latents (128x128; 16 channels, FLUX.2's 32) in 2x2 patches -> 64x64 =
4096 image tokens for each. Text: zimage 256 tokens (ZImagePipeline keeps only a prompt's real tokens, of at most
512, and the runtime rounds them up to 32: 256 is a long prompt), flux2 512 (Flux2KleinPipeline pads every prompt
to its max_sequence_length 512 and the transformer reads the padding unmasked: 512 is what each step runs),
qwenimage 256 (QwenImagePipeline keeps the real tokens after its 34-token template, at most 1024, and drops an
all-ones mask: 256 is a long prompt). The inputs are what precast's runtime feeds (runtime/families/*.py: Z-Image's
timestep 1 - sigma and caption mask; FLUX.2's and Qwen-Image's packed latents and position ids), sigma 0.75.

Runners, each in a fresh process, one warm-up call then --steps timed calls, median reported; everything but
these families' parts is benchmarks/flux_step.py's, imported (its runner children, timing, GEMM peak, parity,
floor and report), as benchmarks/sd3_step.py does:

  precast              `precast export --dtype fp32 --component transformer` then `precast compile --target
                       openvino --height 1024 --width 1024 --t5-tokens TEXT` (a static profile, the target's
                       precision: f32 on a CPU without AMX), the blob opened with the runtime's OpenVinoSession
  torch                diffusers ZImageTransformer2DModel (through diffusers' own single-file converter, as
                       tests/test_zimage.py) / Flux2Transformer2DModel (the same, as tests/test_flux2.py) /
                       QwenImageTransformer2DModel (the file's names as they are, as tests/test_qwenimage.py)
                       holding the file's weights (strict load), PyTorch eager fp32; called as the pipelines call
                       them (Z-Image: lists of one latent and the caption's real rows, its output negated as the
                       pipeline does; Qwen-Image: img_shapes, no mask when it is all ones)
  onnxruntime          ONNX Runtime CPU (ORT_ENABLE_ALL) on a torch.onnx.export of that fp32 model (dynamo exporter,
                       opset 18, when onnxscript is importable, else TorchScript opset 17; static shapes).
                       Z-Image's and Qwen-Image's complex RoPE is written in reals for the export (neither
                       exporter takes complex tensors; same tables, same product: _rotate), FLUX.2's is real.
                       onnxscript is not in the project's venv: put it on PYTHONPATH, e.g.
                       `pip install --target DIR --no-deps onnxscript onnx-ir` and PYTHONPATH=DIR (TorchScript
                       exports Qwen-Image only: Z-Image stops at aten::pad_sequence, FLUX.2 at aten::rms_norm)
  openvino-f32         OpenVINO on that ONNX, read_model + compile_model, INFERENCE_PRECISION_HINT=f32
  openvino-f32-static  the same, reshaped to the run's static shapes first (as precast compiles)
  (--runners can add flux_step's others: torch-bf16, openvino (default config), precast-fp32-bf16 / precast-bf16 /
   precast-bf16-bf16)

Outputs are compared with PyTorch fp32: max|x - ref| / max|ref| (an f32 runner counts within 1e-3).
FLOPs are counted analytically (2 per multiply-add; count_flops): every Linear -- the embedders, the qkv / out /
MLP GEMMs of every block over the tokens it sees, the modulation and timestep GEMVs, the final layer over the image
tokens -- and attention's two matmuls (Q K^T, P V) over each block's sequence (Z-Image's refiners: image or caption
alone; the rest: image + text). The GEMM peak is measured in the same run (flux_step.gemm_peak, at the start and the
end, best taken); % of peak = FLOP / time / peak at the runner's compute precision; the bound: FLOP / f32 peak, the
shortest time any f32 runner can take (as in sd3_step.py).

Floor (the issue): precast >= 1.2x the best correct peer, per family.

Usage: PYTHONPATH=DIR .venv/bin/python benchmarks/llm_dit_step.py [--model zimage|flux2|qwenimage] [--steps N]
           [--runners a,b,...] [--no-profile] [--exporter auto|dynamo|torchscript] [--work DIR] [--keep]
           [--json OUT] [--small]
       (--model repeatable, default all three in turn, each in its own subfolder of the work folder, results in
        one JSON; --small: 256x256 px and 16 text tokens, same widths, to try the script; not a measurement)
Each family's files (checkpoint, exports, engine, torch ONNX: ~16 GB at peak, Z-Image's) are deleted as soon as it
is done, the work folder at the end unless --keep. The fp32 slices are 1.09 B parameters = 4.4 GB (zimage), 0.56 B
= 2.3 GB (flux2) and 0.72 B = 2.9 GB (qwenimage); the largest child (PyTorch, and the torch ONNX export, of
Z-Image) peaks near 11 GB.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
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
from sd3_step import bound, print_bound, step_arguments  # noqa: E402  (the f32 bound; shared options)

MODELS = ("zimage", "flux2", "qwenimage")
SIZE = {"image": 1024, "zimage": 256, "flux2": 512, "qwenimage": 256}    # px; text tokens (--small changes these)
DEFAULT_RUNNERS = "precast,torch,onnxruntime,openvino-f32,openvino-f32-static"
SIGMA = 0.75


# ---- shapes --------------------------------------------------------------------------------------
def full_configs() -> dict:
    """The released models' transformer shapes (the demo writers' config dataclasses)."""
    from precast.compiler.demo_flux2 import Flux2Config
    from precast.compiler.demo_qwenimage import QwenImageConfig
    from precast.compiler.demo_zimage import ZImageConfig
    return {
        # Tongyi-MAI/Z-Image-Turbo transformer/config.json = diffusers ZImageTransformer2DModel's defaults
        # (dim 3840, n_heads 30, n_layers 30, n_refiner_layers 2, cap_feat_dim 2560 = Qwen3-4B's hidden, in_channels
        # 16) = compiler/demo_zimage.py's ZIMAGE_TURBO; FFN int(3840 / 3 * 8) = 10240, adaLN width min(dim, 256)
        "zimage": ZImageConfig(dim=3840, heads=30, layers=30, refiner_layers=2, cap_dim=2560),
        # black-forest-labs/FLUX.2-klein-4B transformer/config.json: num_attention_heads 24 x attention_head_dim 128,
        # num_layers 5, num_single_layers 20, joint_attention_dim 7680 (3 x Qwen3-4B's 2560: compiler/families/
        # flux2.py), in_channels 128, mlp_ratio 3.0 (not diffusers' defaults, which are FLUX.2 dev's: 48 heads,
        # 8 + 48 blocks, 15360)
        "flux2": Flux2Config(hidden=3072, heads=24, depth=5, depth_single=20, context=7680),
        # Qwen/Qwen-Image transformer/config.json = diffusers QwenImageTransformer2DModel's defaults: 24 heads of 128,
        # num_layers 60, joint_attention_dim 3584 (Qwen2.5-VL-7B's hidden), in_channels 64 (benchmarks/
        # llm_dit_export.py's config)
        "qwenimage": QwenImageConfig(heads=24, head_dim=128, depth=60, context=3584),
    }


SLICE = {"zimage": {"layers": 2}, "flux2": {"depth": 1, "depth_single": 1}, "qwenimage": {"depth": 2}}


def slice_cfg(model: str):
    """The benchmarked slice: full width, 2 transformer blocks (the fixed parts whole)."""
    return dataclasses.replace(full_configs()[model], **SLICE[model])


def grid() -> int:
    """Packed latent rows (= columns): the VAE's 1/8 latents in 2x2 patches."""
    return SIZE["image"] // 8 // 2


def tokens(model: str) -> tuple[int, int]:
    return grid() ** 2, SIZE[model]


# ---- the family parts flux_step's run_model calls (patched in below) ------------------------------
def make_inputs(model: str) -> dict[str, np.ndarray]:
    """What the runtime feeds the exported transformer (runtime/families/<model>.py)."""
    rng = np.random.default_rng({"zimage": 21, "flux2": 22, "qwenimage": 23}[model])
    c, g, n_txt = slice_cfg(model), grid(), SIZE[model]
    if model == "zimage":
        return {"hidden_states": rng.standard_normal((1, c.in_channels, 2 * g, 2 * g)).astype(np.float32),
                "encoder_hidden_states": rng.standard_normal((1, n_txt, c.cap_dim)).astype(np.float32),
                "attention_mask": np.ones((1, n_txt), np.int32),
                "timestep": np.array([1.0 - SIGMA], np.float32)}           # ZImagePipeline's (1000 - t) / 1000
    if model == "flux2":
        from precast.runtime.families.flux2 import latent_ids, text_ids
        return {"hidden_states": rng.standard_normal((1, g * g, c.in_channels)).astype(np.float32),
                "encoder_hidden_states": rng.standard_normal((1, n_txt, c.context)).astype(np.float32),
                "timestep": np.array([SIGMA], np.float32), "img_ids": latent_ids(g, g), "txt_ids": text_ids(n_txt)}
    from precast.runtime.families.qwenimage import latent_ids, text_ids
    return {"hidden_states": rng.standard_normal((1, g * g, c.in_channels)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, n_txt, c.context)).astype(np.float32),
            "encoder_hidden_states_mask": np.ones((1, n_txt), np.int32), "timestep": np.array([SIGMA], np.float32),
            "img_ids": latent_ids(g, g), "txt_ids": text_ids(n_txt, g, g)}


def _lin(n: int, k: int, m: int) -> int:
    """FLOP of n rows through a k -> m Linear."""
    return 2 * n * k * m


def _att(n: int, width: int) -> int:
    """FLOP of Q K^T and P V over n tokens, all heads (width = heads x head_dim)."""
    return 2 * 2 * n * n * width


def _zimage_flops(c, n_img: int, n_txt: int) -> tuple[int, int, int]:
    d, ad = c.dim, min(c.dim, 256)
    n_txt = -(-n_txt // 32) * 32                 # diffusers pads the caption to a multiple of 32 (SEQ_MULTI_OF)
    seq = n_img + n_txt

    def block(n):                                # qkv, out, SwiGLU w1 w3 w2
        return _lin(n, d, 4 * d) + 3 * _lin(n, d, c.ffn)
    gemv = _lin(1, 256, 1024) + _lin(1, 1024, ad)                               # t_embedder
    gemv += (c.refiner_layers + c.layers) * _lin(1, ad, 4 * d) + _lin(1, ad, d)  # adaLN of modulated blocks, final
    lin = _lin(n_img, 4 * c.in_channels, d) + _lin(n_txt, c.cap_dim, d)          # x_embedder, cap_embedder
    lin += c.refiner_layers * (block(n_img) + block(n_txt)) + c.layers * block(seq)
    lin += _lin(n_img, d, 4 * c.in_channels)                                     # final linear (image rows)
    att = c.refiner_layers * (_att(n_img, d) + _att(n_txt, d)) + c.layers * _att(seq, d)
    return lin, gemv, att


def _flux2_flops(c, n_img: int, n_txt: int) -> tuple[int, int, int]:
    h, mlp, seq = c.hidden, c.mlp, n_img + n_txt
    gemv = _lin(1, c.time_dim, h) + _lin(1, h, h)                               # time_in
    gemv += 2 * _lin(1, h, 6 * h) + _lin(1, h, 3 * h) + _lin(1, h, 2 * h)        # shared modulations, final adaLN
    lin = _lin(n_img, c.in_channels, h) + _lin(n_txt, c.context, h)             # img_in, txt_in
    lin += c.depth * (_lin(seq, h, 4 * h) + _lin(seq, h, 2 * mlp) + _lin(seq, mlp, h))   # both streams' rows
    lin += c.depth_single * (_lin(seq, h, 3 * h + 2 * mlp) + _lin(seq, h + mlp, h))
    lin += _lin(n_img, h, c.in_channels)                                         # final linear
    return lin, gemv, (c.depth + c.depth_single) * _att(seq, h)


def _qwenimage_flops(c, n_img: int, n_txt: int) -> tuple[int, int, int]:
    h, seq = c.hidden, n_img + n_txt
    gemv = _lin(1, c.time_dim, h) + _lin(1, h, h) + c.depth * 2 * _lin(1, h, 6 * h) + _lin(1, h, 2 * h)
    lin = _lin(n_img, c.in_channels, h) + _lin(n_txt, c.context, h)             # img_in, txt_in
    lin += c.depth * (_lin(seq, h, 4 * h) + _lin(seq, h, 4 * h) + _lin(seq, 4 * h, h))  # qkv + out, MLP 4h
    lin += _lin(n_img, h, c.in_channels)                                         # proj_out
    return lin, gemv, c.depth * _att(seq, h)


def count_flops(model: str) -> dict:
    """GFLOP (2 per multiply-add) of one call: Linears (GEMMs and the modulation / embedder GEMVs) and attention."""
    fn = {"zimage": _zimage_flops, "flux2": _flux2_flops, "qwenimage": _qwenimage_flops}[model]
    lin, gemv, att = fn(slice_cfg(model), *tokens(model))
    total = lin + gemv + att
    return {"gflop": round(total / 1e9, 2), "linear_gflop": round((lin + gemv) / 1e9, 2),
            "attention_gflop": round(att / 1e9, 2), "gemv_gflop": round(gemv / 1e9, 3)}


def components(model: str) -> list:
    """The demo writers' bare transformer file of the slice (no prefix, as the released split files)."""
    c = slice_cfg(model)
    if model == "zimage":
        from precast.compiler.demo_zimage import zimage_components
        return zimage_components(c, layout="bare")
    if model == "flux2":
        from precast.compiler.demo_flux2 import flux2_components
        return flux2_components(c, layout="bare")
    from precast.compiler.demo_qwenimage import qwenimage_layout
    from precast.compiler.demo_weights import Component
    return [Component("transformer", "", qwenimage_layout(c), True)]


def write_checkpoints(model: str, folder: Path) -> dict:
    from precast.compiler.demo_weights import parameter_count, write_components
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = folder / f"{model}_2blocks_bf16.safetensors"
    comps = components(model)
    write_components(ckpt, comps, 0, "bf16")
    return {"checkpoint": str(ckpt), "write_s": round(time.perf_counter() - t0, 1), "bytes": ckpt.stat().st_size,
            "parameters": sum(parameter_count(c.layout) for c in comps)}


def precast_export(model: str, files: dict, out: Path, dtype: str) -> dict:
    t0 = time.perf_counter()
    rep = fs.precast_cli("export", files["checkpoint"], "--out", out, "--dtype", dtype, "--component", "transformer")
    return {"dir": str(out), "component": "transformer", "model": model, "wall_s": round(time.perf_counter() - t0, 1),
            "seconds": rep.get("seconds")}


def precast_compile(export: dict, cache: Path, options: list[str]) -> dict:
    env = {**os.environ, "PRECAST_CACHE": str(cache)}
    args = ["compile", export["dir"], "--target", "openvino", "--component", export["component"],
            "--height", SIZE["image"], "--width", SIZE["image"], "--t5-tokens", SIZE[export["model"]]]
    for o in options:
        args += ["--option", o]
    t0 = time.perf_counter()
    rep = fs.precast_cli(*args, env=env)["artifacts"][0]
    return {"entry": rep["path"], "cache": rep["cache"], "seconds": rep["seconds"],
            "wall_s": round(time.perf_counter() - t0, 1), "size_mb": round(rep["size"] / 1e6, 1)}


# ---- the torch references ------------------------------------------------------------------------
def _state_dict(path: str) -> dict:
    from safetensors.torch import load_file
    return {k: v.float() for k, v in load_file(path).items()}


def _zimage_model(path: str):
    """ZImageTransformer2DModel from the original names through diffusers' single-file converter
    (tests/test_zimage.py)."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    c = slice_cfg("zimage")
    model = ZImageTransformer2DModel(in_channels=c.in_channels, dim=c.dim, n_layers=c.layers,
                                     n_refiner_layers=c.refiner_layers, n_heads=c.heads, n_kv_heads=c.heads,
                                     cap_feat_dim=c.cap_dim)         # RoPE: the released (32, 48, 48), theta 256
    model.load_state_dict(convert_z_image_transformer_checkpoint_to_diffusers(_state_dict(path)), strict=True)
    return model


def _flux2_model(path: str):
    """Flux2Transformer2DModel from BFL's names through diffusers' single-file converter (tests/test_flux2.py)."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    c = slice_cfg("flux2")
    model = Flux2Transformer2DModel(in_channels=c.in_channels, num_layers=c.depth, num_single_layers=c.depth_single,
                                    attention_head_dim=c.hidden // c.heads, num_attention_heads=c.heads,
                                    joint_attention_dim=c.context, mlp_ratio=c.mlp_ratio,
                                    guidance_embeds=False)            # RoPE: the released (32, 32, 32, 32), theta 2000
    model.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(_state_dict(path)), strict=True)
    return model


def _qwenimage_model(path: str):
    """QwenImageTransformer2DModel holding the file's diffusers names as they are (tests/test_qwenimage.py)."""
    from diffusers import QwenImageTransformer2DModel
    c = slice_cfg("qwenimage")
    model = QwenImageTransformer2DModel(in_channels=c.in_channels, out_channels=c.in_channels // 4, num_layers=c.depth,
                                        attention_head_dim=c.head_dim, num_attention_heads=c.heads,
                                        joint_attention_dim=c.context)  # RoPE: the released (16, 56, 56)
    model.load_state_dict(_state_dict(path), strict=True)
    return model


# ---- real-valued RoPE for torch.onnx.export ----------------------------------------------------------
# diffusers' Z-Image and Qwen-Image rotate q and k as complex64 products (view_as_complex, torch.polar tables),
# which neither exporter takes (dynamo: "No decompositions registered for the complex-valued input"; TorchScript:
# no complex at all). For the ONNX peers' export only, the same tables and the same product are written in reals:
# (a + ib)(c + is) = (ac - bs) + i(as + bc), the pairs interleaved as view_as_real leaves them. The torch runner,
# the parity reference, runs diffusers' own complex code.
def _rotate(x, cos, sin):
    """x [..., D] as D/2 interleaved (real, imag) pairs times cos + i sin (broadcast to [..., D/2])."""
    import torch
    a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


def _qwenimage_real_rope(model, g: int, n_txt: int) -> None:
    """QwenEmbedRope's tables for the run's static shapes as constant (cos, sin); apply_rotary_emb_qwen in reals."""
    import torch
    from diffusers.models.transformers import transformer_qwenimage as tq
    with torch.no_grad():
        freqs = model.pos_embed([[(1, g, g)]], device=torch.device("cpu"), max_txt_seq_len=n_txt)
    pairs = tuple((f.real.float()[None, :, None], f.imag.float()[None, :, None]) for f in freqs)  # [1, S, 1, D/2]
    model.pos_embed.forward = lambda *args, **kwargs: pairs
    tq.apply_rotary_emb_qwen = lambda x, f, use_real=True, use_real_unbind_dim=-1: _rotate(x, *f)


def _zimage_real_rope(model) -> None:
    """RopeEmbedder's complex tables as [len, D/2, 2] reals (gathered and padded as before, concatenated over the
    pairs' axis; the int32 position ids gathered as int64: the dynamo exporter writes int32 GatherND indices, which
    ONNX Runtime refuses) and ZSingleStreamAttnProcessor's rotation in reals (its code otherwise, line for line)."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers import transformer_z_image as tz
    rope = model.rope_embedder
    tables = [torch.view_as_real(f) for f in rope.precompute_freqs_cis(rope.axes_dims, rope.axes_lens, rope.theta)]
    model.rope_embedder = lambda ids: torch.cat([t[ids[:, i].long()] for i, t in enumerate(tables)], dim=-2)

    class RealRopeProcessor(tz.ZSingleStreamAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
            q, k, v = (p(hidden_states).unflatten(-1, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
            q = attn.norm_q(q) if attn.norm_q is not None else q
            k = attn.norm_k(k) if attn.norm_k is not None else k
            if freqs_cis is not None:
                cos, sin = freqs_cis.unsqueeze(2).unbind(-1)            # [B, S, 1, D/2]
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if attention_mask is not None and attention_mask.ndim == 2:
                attention_mask = attention_mask[:, None, None, :]
            out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                        backend=self._attention_backend, parallel_config=self._parallel_config)
            out = attn.to_out[0](out.flatten(2, 3).to(q.dtype))
            return attn.to_out[1](out) if len(attn.to_out) > 1 else out
    for m in model.modules():
        if isinstance(getattr(m, "processor", None), tz.ZSingleStreamAttnProcessor):
            m.processor = RealRopeProcessor()


def torch_reference(spec: dict):
    """The diffusers model holding the file's weights, fp32, eval, wrapped to take the ONNX inputs in order and
    return one tensor, called as its pipeline calls it."""
    import torch
    torch.set_num_threads(fs.THREADS)
    model = spec["model"]
    inner = {"zimage": _zimage_model, "flux2": _flux2_model, "qwenimage": _qwenimage_model}[model](spec["checkpoint"])
    with np.load(spec["inputs"]) as feeds:      # the children run at the parent's size: read it off the inputs
        g, n_txt = math.isqrt(feeds["hidden_states"].shape[-2]), feeds["encoder_hidden_states"].shape[1]
    if spec["kind"] == "torch-export" and model == "qwenimage":
        _qwenimage_real_rope(inner, g, n_txt)
    elif spec["kind"] == "torch-export" and model == "zimage":
        _zimage_real_rope(inner)

    class ZImage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = inner

        def forward(self, hidden_states, encoder_hidden_states, timestep):
            # one latent [C, F=1, H, W] and the caption's rows (all real: the mask is all ones), output negated
            out = self.m([hidden_states[0].unsqueeze(1)], timestep, [encoder_hidden_states[0]], return_dict=False)[0]
            return -out[0].squeeze(1).unsqueeze(0)

    class Flux2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = inner

        def forward(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids):
            return self.m(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                          img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]

    class QwenImage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = inner

        def forward(self, hidden_states, encoder_hidden_states, timestep):
            # QwenImagePipeline drops an all-ones mask (encoder_hidden_states_mask None); RoPE from img_shapes
            return self.m(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                          img_shapes=[[(1, g, g)]], return_dict=False)[0]
    wrap = {"zimage": ZImage, "flux2": Flux2, "qwenimage": QwenImage}[model]
    names = {"zimage": ["hidden_states", "encoder_hidden_states", "timestep"],
             "flux2": ["hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"],
             "qwenimage": ["hidden_states", "encoder_hidden_states", "timestep"]}[model]
    return wrap().eval(), names


_PARTS = ("make_inputs", "count_flops", "write_checkpoints", "precast_export", "precast_compile", "torch_reference")


def patch_flux_step(small: bool) -> None:
    """Point flux_step's run_model and children at this file's parts (flux_step's files unchanged)."""
    if small:
        SIZE.update(image=256, zimage=16, flux2=16, qwenimage=16)
    for m in MODELS:
        fs.OUTPUT[m] = "out_hidden_states"
    for name in _PARTS:
        setattr(fs, name, globals()[name])
    fs.__file__ = str(Path(__file__).resolve())      # fs.run_child starts `python <fs.__file__> --child SPEC`


# ---- the run ------------------------------------------------------------------------------------
def run_family(model: str, root: Path, opts) -> dict:
    print(f"\n{model}: {dataclasses.asdict(slice_cfg(model))}; {tokens(model)[0]} image + {tokens(model)[1]} text "
          f"tokens; {count_flops(model)['gflop']} GFLOP per call", flush=True)
    t0 = time.perf_counter()
    try:
        res = fs.run_model(model, root, opts)
    except (Exception, SystemExit) as e:   # noqa: BLE001 -- one family's failure must not lose the others'
        print(f"  {model} FAILED: {type(e).__name__}: {str(e)[-1500:]}", flush=True)
        return {"error": f"{type(e).__name__}: {str(e)[-1500:]}", "wall_s": round(time.perf_counter() - t0, 1)}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def finish(res: dict, peak: dict) -> None:
    """% of peak per runner, the floor and the bound, with the run's best GEMM peaks."""
    for r in res["runners"].values():
        if "gflops" in r:
            r["pct_of_f32_peak"] = round(100 * r["gflops"] / peak["f32"], 1)
            r["pct_of_own_peak"] = round(100 * r["gflops"] / peak[r["compute_precision"]], 1)
    res["floors"] = fs.floors(res)
    res["bound"] = bound(res, peak)


def settings(opts, models: list[str]) -> dict:
    return {"steps": opts.steps, "small": opts.small, **SIZE, "image_tokens": grid() ** 2, "tolerance": fs.TOL,
            "floor": fs.SPEED_FLOOR, "threads": fs.THREADS, "runners": opts.runners, "sigma": SIGMA,
            "full_configs": {m: dataclasses.asdict(c) for m, c in full_configs().items()},
            "slices": {m: dataclasses.asdict(slice_cfg(m)) for m in models}}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=MODELS,
                    help="this family only (repeatable; default: all three in turn)")
    step_arguments(ap, DEFAULT_RUNNERS, "llm_dit_step.json", "256 px, 16 text tokens")
    opts = ap.parse_args()
    opts.precast_only = False
    return opts


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        patch_flux_step(small=False)         # the children read their inputs from the spec's .npz
        fs.child_main(sys.argv[2])
        return
    opts = parse_args()
    models = opts.model or list(MODELS)
    patch_flux_step(opts.small)
    (HERE / "results").mkdir(exist_ok=True)
    root = (opts.work or Path(tempfile.mkdtemp(prefix="llm_dit_step_", dir=HERE / "results"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"work folder {root} ({shutil.disk_usage(root).free / 2**30:.0f} GiB free); image {SIZE['image']} px -> "
          f"{grid() ** 2} image tokens; text tokens {', '.join(f'{m} {SIZE[m]}' for m in models)}", flush=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        print(f"load average {load_start}; measuring GEMM peaks ...", flush=True)
        peak_start = fs.gemm_peak()
        print(f"  {peak_start}", flush=True)
        results = {m: run_family(m, root, opts) for m in models}
        peak_end = fs.gemm_peak()
        print(f"  GEMM peaks at the end: {peak_end}", flush=True)
        peak = {k: max(peak_start[k], peak_end[k]) for k in peak_start}
        done = {m: r for m, r in results.items() if "runners" in r}
        for res in done.values():
            finish(res, peak)
        fs.print_report(done, peak, opts)
        print()
        for m, res in done.items():
            print_bound(m, res["bound"])
        for m, res in results.items():
            if "error" in res:
                print(f"{m} FAILED: {res['error'][:300]}")
        out = {"started": started, "command": " ".join(["python", *sys.argv]),
               "machine": describe(("numpy", "onnx", "onnxruntime", "openvino", "torch", "diffusers", "transformers",
                                    "onnxscript")),
               "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
               "gemm_peak_gflops": {"start": peak_start, "end": peak_end, "used": peak},
               "settings": settings(opts, models), "results": results}
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"\nwrote {opts.json}")
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)
            print(f"work folder removed: {not root.exists()}")


if __name__ == "__main__":
    main()
