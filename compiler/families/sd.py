"""Stable Diffusion 1.x, 2.x, SDXL and the SDXL refiner: everything the compiler knows about them.

Owns: the evidence that tells them apart in a checkpoint's header (a UNet under model.diffusion_model.;
label_emb: SDXL, base or refiner; an OpenCLIP text encoder, linear proj_in or a 1024-wide context: SD 2.x;
the UNet's input channels: inpainting / instruct-pix2pix), the same rules for a ControlNet's encoder half
and for an optimum / diffusers ONNX folder's graphs, their components (CLIP-L / OpenCLIP-H / bigG text
encoders, the LDM UNet, the VAE), what the weights cannot say (SD 1.x: 8 heads; SD 2.x / SDXL: 64-wide
heads; SDXL: 6 time ids, the refiner 5), how the parts must fit (the UNet predicts the VAE's latent
channels and reads the text encoders' widths side by side), SD 2.x's v-prediction rule, and their
diffusers and OpenVINO GenAI folder layouts.
"""
from __future__ import annotations

import numpy as np

from ..errors import BadInput
from ..graphs import ldm_unet
from ..sources.tensor_refs import TEXT, UNET, Checkpoint
from .family import Component, Detected, Diffusers, Family, GenAI
from .shared import (CLIP_MODEL, CLIP_PROJECTED, CLIP_TOKENIZER, DPM_SOLVER, EULER, UNET_MODEL, VAE_MODEL, VAES,
                     clip)

LOOKED_FOR = f"{UNET}input_blocks.0.0.weight (SD/SDXL UNet)"
SDXL_TE1 = "conditioner.embedders.0.transformer.text_model."
SDXL_TE2 = ("conditioner.embedders.1.model.", "conditioner.embedders.1.transformer.text_model.")
REFINER_TE = ("conditioner.embedders.0.model.", "conditioner.embedders.0.transformer.text_model.")
OPENCLIP = "cond_stage_model.model."
UNET_C = Component("unet", (UNET,), "unet", ldm_unet.unet_config, ldm_unet.build_unet)


def detect(ckpt: Checkpoint) -> Detected | None:
    """SD 1.x / 2.x / SDXL base / refiner from the UNet's names and shapes; None without an LDM UNet."""
    keys = ckpt.refs
    conv_in = keys.get(UNET + "input_blocks.0.0.weight")
    if conv_in is None:
        return None
    in_ch = conv_in.shape[1] if len(conv_in.shape) == 4 else 0
    variant = {9: "inpaint", 8: "instruct-pix2pix"}.get(in_ch, "")
    label = keys.get(UNET + "label_emb.0.0.weight")
    ctx = [ref.shape[1] for k, ref in keys.items()
           if k.startswith(UNET) and k.endswith("attn2.to_k.weight") and len(ref.shape) == 2]
    if label is not None:
        name, why = _sdxl_base_or_refiner(ckpt, label.shape[1], ctx[0] if ctx else None)
        return Detected(name, variant, f"label_emb.0.0.weight {list(label.shape)}, {why}")
    proj_in = [ref.shape for k, ref in keys.items() if k.startswith(UNET) and k.endswith(".proj_in.weight")]
    if any(k.startswith(OPENCLIP) for k in keys):
        return Detected("sd2", variant, "cond_stage_model.model.* (OpenCLIP text encoder)")
    if proj_in and len(proj_in[0]) == 2 or (ctx and ctx[0] == 1024):
        return Detected("sd2", variant, "linear proj_in / context 1024")
    ev = f"input_blocks.0.0.weight {list(conv_in.shape)}, no label_emb"
    if ctx:
        ev += f", attn2.to_k context {ctx[0]}"
    return Detected("sd1", variant, ev)


def _sdxl_base_or_refiner(ckpt: Checkpoint, label_in: int, context: int | None) -> tuple[str, str]:
    """SDXL base (CLIP-L + bigG; 6 micro-conditioning ids) or refiner (bigG only; 5 ids, one of
    them the aesthetic score), from the text encoders when the checkpoint has them, else from the
    UNet alone: label_emb takes the pooled width + 256 per id, and the refiner's pooled width is
    its context width (one encoder), the base's is not (768 + 1280 context, 1280 pooled)."""
    keys = ckpt.refs
    if any(k.startswith("conditioner.embedders.1.") for k in keys):
        return "sdxl", "two text encoders"
    if any(k.startswith("conditioner.embedders.0.") for k in keys):
        return "sdxl-refiner", "one text encoder (bigG)"
    aesthetic = ckpt.configs.get("model_index", {}).get("requires_aesthetics_score")
    if isinstance(aesthetic, bool):
        return ("sdxl-refiner" if aesthetic else "sdxl"), f"model_index.json requires_aesthetics_score {aesthetic}"
    if label_in in (2816, 2560):
        return ("sdxl" if label_in == 2816 else "sdxl-refiner"), f"label_emb input {label_in}"
    if context is not None and label_in - 5 * 256 == context:
        return "sdxl-refiner", f"label_emb input {label_in} = context {context} + 5 x 256"
    return "sdxl", f"label_emb input {label_in} != context {context} + 5 x 256"


def controlnet_family(cfg: dict) -> str:
    """sd1 / sd2 / sdxl of a ControlNet's encoder config: label_emb is SDXL's, linear projections or a
    1024-wide context SD 2.x's (detect's rules, on the encoder half alone)."""
    if cfg["adm_in_channels"]:
        return "sdxl"
    return "sd2" if cfg["use_linear_projection"] or cfg["context_dim"] == 1024 else "sd1"


def detect_onnx(comps: dict, index: dict, hidden) -> str:
    """The family of an optimum / diffusers ONNX folder from its graphs' IO (compiler/foreign_onnx.py):
    SDXL with text_encoder_2 or a UNet taking text_embeds / time_ids (the refiner: text_encoder_2 alone),
    else SD 2.x for a 1024-wide text state, SD 1.x otherwise. `hidden(component)`: its text-state width."""
    unet = comps.get("unet")
    xl_unet = unet is not None and {"text_embeds", "time_ids"} <= {i["name"] for i in unet.inputs}
    if "text_encoder_2" in comps or xl_unet or "XL" in str(index.get("_class_name", "")):
        return "sdxl" if "text_encoder" in comps or "text_encoder_2" not in comps else "sdxl-refiner"
    width = next((h for h in (hidden(comps[n]) for n in ("text_encoder", "unet") if n in comps) if h), None)
    return "sd2" if width == 1024 else "sd1"


def v_prediction(ckpt: Checkpoint) -> str | None:
    """ComfyUI's rule for SD 2.x: the last attention block's norm1 bias has std > 0.09 in v-models."""
    biases = sorted((k for k in ckpt.refs if k.startswith("model.diffusion_model.output_blocks.")
                     and k.endswith(".1.transformer_blocks.0.norm1.bias")),
                    key=lambda k: int(k.split(".")[3]))
    if biases and float(np.std(ckpt.read(biases[-1]).astype(np.float32))) > 0.09:
        return "v_prediction"
    return None


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The UNet predicts the VAE's latent channels and reads the text encoders' widths side by side."""
    if "unet" not in configs:
        return
    unet = configs["unet"]
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if vae and unet["out_channels"] != vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent channels; the UNet predicts "
                       f"{unet['out_channels']}: give a VAE made for this model with --vae (SD 1.x/2.x/XL: 4 channels)")
    names = [n for n in family.components if n.startswith("text_encoder")]
    if not names or any(n not in configs for n in names):   # the widths add up only when all are here
        return
    widths = [configs[n]["hidden"] for n in names]
    if unet["context_dim"] and sum(widths) != unet["context_dim"]:
        raise BadInput(f"{path}: the text encoder output is {' + '.join(map(str, widths))} wide; the UNet's "
                       f"cross-attention reads {unet['context_dim']}: the text encoder and UNet come from "
                       "different models")


SD_PARTS = {"safety_checker": [None, None], "feature_extractor": [None, None]}   # OnnxStableDiffusionPipeline's keys
SD_GENAI = GenAI({"_class_name": "StableDiffusionPipeline", "scheduler": EULER, "tokenizer": CLIP_TOKENIZER,
                  "text_encoder": CLIP_MODEL, "unet": UNET_MODEL, "vae": VAE_MODEL, **SD_PARTS,
                  "requires_safety_checker": False})
SDXL_GENAI = GenAI({"_class_name": "StableDiffusionXLPipeline", "scheduler": EULER, "tokenizer": CLIP_TOKENIZER,
                    "text_encoder": CLIP_MODEL, "unet": UNET_MODEL, "vae": VAE_MODEL, "tokenizer_2": CLIP_TOKENIZER,
                    "text_encoder_2": CLIP_PROJECTED, "force_zeros_for_empty_prompt": True,
                    "requires_aesthetics_score": False}, pooled_first=("text_encoder_2",))


def _sd(name: str, text_encoders: dict, diffusers: Diffusers, unet_defaults: dict, **facts) -> Family:
    return Family(name, {**text_encoders, "unet": UNET_C, **VAES}, diffusers, {"unet": unet_defaults},
                  check_parts=check_parts, controlnet_family=controlnet_family, **facts)


def _xl(pipeline: str, base: bool) -> Diffusers:
    return Diffusers(pipeline, DPM_SOLVER, 128, {"force_zeros_for_empty_prompt": base, "requires_aesthetics_score": not base},
                     unet_plain_level=0, vae_force_upcast=True)


FAMILIES = (
    _sd("sd1", {"text_encoder": clip("text_encoder", (TEXT,), "last")},
        Diffusers("OnnxStableDiffusionPipeline", DPM_SOLVER, 64, SD_PARTS), {"num_heads_default": 8},
        demos={"demo:tiny-sd15": {}}, genai=SD_GENAI, foreign_onnx=True),
    _sd("sd2", {"text_encoder": clip("text_encoder", (OPENCLIP, TEXT), "penultimate", "openclip")},
        Diffusers("OnnxStableDiffusionPipeline", DPM_SOLVER, 96, SD_PARTS), {"head_dim_default": 64},
        guess_prediction=v_prediction, genai=SD_GENAI, foreign_onnx=True),
    # the SDXL VAE overflows in fp16 (activations past 65504)
    _sd("sdxl", {"text_encoder": clip("text_encoder", (SDXL_TE1,), "states"),
                 "text_encoder_2": clip("text_encoder_2", SDXL_TE2, "states+pooled", "openclip")},
        _xl("StableDiffusionXLPipeline", True), {"head_dim_default": 64, "time_ids": 6}, fp32_vae=True,
        genai=SDXL_GENAI),
    _sd("sdxl-refiner", {"text_encoder_2": clip("text_encoder_2", REFINER_TE, "states+pooled", "openclip")},
        _xl("StableDiffusionXLImg2ImgPipeline", False), {"head_dim_default": 64, "time_ids": 5}, fp32_vae=True),
)
