"""Flux.1 (dev, schnell) and Chroma: everything the compiler knows about them.

Owns: the evidence in a checkpoint's header (BFL double_blocks; Chroma's distilled_guidance_layer instead of
modulation Linears; dev's guidance_in; the variants refused by name: image-conditioned Fill / Canny / Depth,
Chroma Radiance, x0-prediction), their components (CLIP-L and T5-XXL for Flux, T5 with an attention mask
for Chroma, the BFL transformer of compiler/graphs/flux.py, the 16-channel VAE), how the parts must fit
(the transformer packs 2x2 patches of the VAE's latent channels and reads T5's and CLIP's widths), the
tiny demos' RoPE split, and their diffusers and OpenVINO GenAI folder layouts.
"""
from __future__ import annotations

from ..demo_dit import DEMO_AXES
from ..errors import BadInput
from ..graphs import flux
from ..sources.tensor_refs import CLIP_L, DIT, Checkpoint
from .family import Component, Detected, Diffusers, Family, GenAI
from .shared import (CLIP_MODEL, CLIP_TOKENIZER, FLOW_EULER, FLOW_SCHEDULER, T5_MODEL, T5_TOKENIZER, VAE_MODEL, VAES,
                     clip, t5)

LOOKED_FOR = "double_blocks.* (Flux)"
UNSUPPORTED = (("nerf_blocks.", "Chroma Radiance (pixel-space nerf blocks)"),
               ("__x0__", "Chroma x0-prediction"))
T5_HINT = ("Flux and Chroma single files usually ship without T5-XXL: pass it with --text-encoder "
           "t5xxl_fp16.safetensors (recipe: model.text_encoders)")
CLIP_HINT = "pass CLIP-L with --text-encoder clip_l.safetensors (recipe: model.text_encoders)"
TRANSFORMER = Component("transformer", (DIT,), "transformer", flux.flux_config, flux.build_flux)
DEMO = {"transformer": {"axes_dims_rope": DEMO_AXES}}    # the tiny demos' 16-wide heads (compiler/demo_dit.py)


def detect(ckpt: Checkpoint) -> Detected | None:
    """Chroma (the distilled-guidance approximator instead of modulation Linears) before Flux; Flux
    dev (guidance_in) or schnell. A transformer that takes more input channels than it predicts
    is an image-conditioned variant (Fill: 384, Canny/Depth: 128 for 64 out), refused by name."""
    keys = ckpt.refs
    if not any(k.endswith("double_blocks.0.img_attn.norm.key_norm.scale") for k in keys):
        return None
    for marker, what in UNSUPPORTED:
        if any(marker in k for k in keys):
            raise BadInput(f"{ckpt.path}: {what} (tensors {marker}*) is not supported yet; Flux.1 dev/schnell "
                           "and Chroma are")
    img_in, final = keys.get(DIT + "img_in.weight"), keys.get(DIT + "final_layer.linear.weight")
    if img_in is not None and final is not None and len(img_in.shape) == 2 and img_in.shape[1] > final.shape[0]:
        kind = {384: "Fill (inpainting)", 128: "Canny/Depth (structural control)"}.get(img_in.shape[1], "image-conditioned")
        raise BadInput(f"{ckpt.path}: img_in takes {img_in.shape[1]} channels for {final.shape[0]} out: a Flux {kind} "
                       "variant, not supported yet (Flux.1 dev/schnell and Chroma are)")
    if any(k.startswith(DIT + "distilled_guidance_layer.") for k in keys):
        return Detected("chroma", "", "double_blocks.* with distilled_guidance_layer.*")
    variant = "dev" if DIT + "guidance_in.in_layer.weight" in keys else "schnell"
    return Detected("flux", variant, "double_blocks.0.img_attn.norm.key_norm.scale" +
                    (", guidance_in" if variant == "dev" else ", no guidance_in"))


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The transformer packs 2x2 patches of the VAE's latent channels (64 = 4 x 16), reads T5's width as
    its context and (Flux) CLIP-L's pooled width as its vector."""
    if "transformer" not in configs:
        return
    dit = configs["transformer"]
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if vae and dit["out_channels"] != 4 * vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent channels; the {family.name} transformer "
                       f"predicts {dit['out_channels']} = 4 x {dit['out_channels'] // 4}: give the model's own VAE "
                       "(Flux's ae.safetensors, 16 channels) with --vae")
    encoders = {c.tokenizer: configs.get(n) for n, c in family.components.items() if c.tokenizer}
    t5_cfg = encoders.get("t5")
    if t5_cfg and t5_cfg.get("d_model") and t5_cfg["d_model"] != dit["context_dim"]:
        raise BadInput(f"{path}: the T5 encoder is {t5_cfg['d_model']} wide; the transformer reads {dit['context_dim']} "
                       "(T5-XXL: 4096): give the T5 the model was trained with")
    clip_cfg = encoders.get("clip")
    if clip_cfg and dit["vec_dim"] and clip_cfg.get("hidden") != dit["vec_dim"]:
        raise BadInput(f"{path}: the CLIP text encoder is {clip_cfg.get('hidden')} wide; the transformer's vector_in "
                       f"reads {dit['vec_dim']} (CLIP-L: 768)")


def _transformer_fields(cfg: dict, pooled: bool) -> dict:
    """FluxTransformer2DModel's config fields (precast feeds 2x2-packed tokens: patch_size 1)."""
    out = dict(patch_size=1, guidance_embeds=bool(cfg.get("guidance", False)), num_layers=cfg.get("depth"),
               num_single_layers=cfg.get("depth_single"), axes_dims_rope=cfg.get("axes_dim"))
    if pooled:
        out["pooled_projection_dim"] = cfg.get("vec_dim")
    return out


def _diffusers(pipeline: str, pooled: bool) -> Diffusers:
    return Diffusers(pipeline, FLOW_SCHEDULER, 128, transformer="FluxTransformer2DModel",
                     transformer_fields=lambda cfg: _transformer_fields(cfg, pooled))


# diffusers' pipeline component names (FluxPipeline: CLIP-L + T5; ChromaPipeline: T5 only); the Flux VAE
# overflows in fp16 (TensorRT's demo forces it out of fp16 too)
FAMILIES = (
    Family("flux", {"text_encoder": clip("text_encoder", (CLIP_L,), "last", config_file="clip_l", missing_hint=CLIP_HINT),
                    "text_encoder_2": t5("text_encoder_2", False, T5_HINT), "transformer": TRANSFORMER, **VAES},
           _diffusers("FluxPipeline", True), fp32_vae=True, text_encoder_files=True, check_parts=check_parts,
           demos={"demo:tiny-flux-dev": DEMO, "demo:tiny-flux-schnell": DEMO},
           genai=GenAI({"_class_name": "FluxPipeline", "scheduler": FLOW_EULER, "vae": VAE_MODEL,
                        "text_encoder": CLIP_MODEL, "tokenizer": CLIP_TOKENIZER, "text_encoder_2": T5_MODEL,
                        "tokenizer_2": T5_TOKENIZER, "transformer": ["diffusers", "FluxTransformer2DModel"]},
                       spacing="1/steps")),    # FluxPipeline's own sigmas
    Family("chroma", {"text_encoder": t5("text_encoder", True, T5_HINT), "transformer": TRANSFORMER, **VAES},
           _diffusers("ChromaPipeline", False), fp32_vae=True, text_encoder_files=True, check_parts=check_parts,
           demos={"demo:tiny-chroma": DEMO},
           no_genai="OpenVINO GenAI has no Chroma pipeline (its Text2ImagePipeline runs SD 1.x / 2.x, SDXL, SD3 and "
                    "Flux), so export-openvino-genai cannot write one"),
)
