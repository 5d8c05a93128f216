"""Runs in a side environment (.venv-interop, `make interop-setup`: optimum-onnx, optimum-intel and the
transformers < 4.58 they need; .venv-interop-ov, `make interop-ov-setup`: optimum-intel 2.2), never in the test
process: tests/test_interop.py and test_openvino_genai_dit.py call it as a subprocess.

    .venv-interop/bin/python tests/interop_side.py SPEC.json

SPEC, to run a pipeline: {"module": "optimum.onnxruntime" | "optimum.intel", "class": pipeline class name, "folder": the pipeline
folder, "load": from_pretrained keywords, "call": pipeline keywords, "latents": .npy of the initial latents,
"latents_form": how the pipeline takes them (`packed`), "out": .npy the image is written to (float32 [H, W, 3] in
[0, 1], output_type="np")}. Prints one JSON line:
the pipeline class that ran and the versions of the packages that ran it.

SPEC, to export (the reverse direction, tests/test_foreign_onnx.py): {"export": {"tokenizer": a CLIP tokenizer
folder, "model": where the tiny diffusers StableDiffusionPipeline is saved, "out": the folder
`optimum-cli export onnx --task text-to-image` writes}}: a tiny SD 1.x pipeline with seeded random weights
(CLIP text 64 wide, 2 layers; UNet 32/64; a 4-level VAE, so latents are 1/8 of the image), exported by
optimum's own exporter (with its ONNX-vs-torch validation).
"""
import importlib
import json
import sys

import numpy as np
import torch


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for p in ("optimum", "optimum-onnx", "optimum-intel", "diffusers", "transformers", "onnxruntime", "openvino"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            pass
    return out


def packed(latents: torch.Tensor, form: str | None) -> torch.Tensor:
    """precast's unpacked [B, C, h, w] noise in the form the pipeline takes `latents` in: FLUX.2's 2x2
    patchified [B, 4C, h/2, w/2] ("patchify"), Qwen-Image's packed tokens [B, hw/4, 4C] ("pack")."""
    if form == "patchify":
        from diffusers import Flux2KleinPipeline
        return Flux2KleinPipeline._patchify_latents(latents)
    if form == "pack":
        from diffusers import QwenImagePipeline
        return QwenImagePipeline._pack_latents(latents, *latents.shape)
    return latents


def export_tiny_sd(tokenizer: str, model: str, out: str) -> dict:
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from optimum.exporters.onnx import main_export
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
                                attention_head_dim=8, norm_num_groups=16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16, 16, 16),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=8, sample_size=64)
    te = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=77, projection_dim=64))
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te.eval(), tokenizer=CLIPTokenizer.from_pretrained(tokenizer),
                                   unet=unet, scheduler=PNDMScheduler(skip_prk_steps=True), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(model)
    main_export(model, out, task="text-to-image", device="cpu")
    return {"exported": out, **versions()}


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    if "export" in spec:
        print(json.dumps(export_tiny_sd(**spec["export"])))
        return
    cls = getattr(importlib.import_module(spec["module"]), spec["class"])
    pipe = cls.from_pretrained(spec["folder"], **spec.get("load", {}))
    call = dict(spec.get("call", {}))
    if spec.get("latents"):
        call["latents"] = packed(torch.from_numpy(np.load(spec["latents"])), spec.get("latents_form"))
    image = pipe(output_type="np", **call).images[0]
    np.save(spec["out"], np.asarray(image, np.float32))
    print(json.dumps({"class": type(pipe).__name__, **versions()}))


if __name__ == "__main__":
    main(sys.argv[1])
