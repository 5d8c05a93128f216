"""Detects a checkpoint's model family from tensor names and shapes (MODEL_FORMATS.md §1).

Owns: the family names and the evidence rules. Detection looks only at the header (names and
shapes), never at tensor data.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput
from .checkpoint import CLIP_MARKER, DIT, T5_MARKER, UNET, VAE, Checkpoint

SUPPORTED = {"sd1", "sd2", "sdxl", "sdxl-refiner", "flux", "chroma", "sd3"}
LOOKED_FOR = (f"{UNET}input_blocks.0.0.weight (SD/SDXL UNet), joint_blocks.* (SD3), double_blocks.* (Flux), "
              f"zero_convs.* (ControlNet), {VAE}decoder.conv_in.weight (VAE)")

# names a single file holds when it is one component of a diffusers folder saved on its own
DIFFUSERS_COMPONENT_NAMES = ("down_blocks.", "up_blocks.", "mid_block.", "conv_in.", "time_embedding.",
                             "text_model.", "encoder.down_blocks.", "decoder.up_blocks.")


@dataclass(frozen=True)
class Family:
    name: str          # sd1 | sd2 | sdxl | sdxl-refiner | sd3 | flux | chroma | controlnet | vae
    variant: str       # e.g. "inpaint", "v-pred", "" when plain
    evidence: str      # the keys/shapes that decided it, for messages

    @property
    def supported(self) -> bool:
        return self.name in SUPPORTED


def _has(ckpt: Checkpoint, suffix: str) -> bool:
    return any(k.endswith(suffix) for k in ckpt.refs)


def _shape_of(ckpt: Checkpoint, suffix: str) -> tuple[int, ...] | None:
    for k, ref in ckpt.refs.items():
        if k.endswith(suffix):
            return ref.shape
    return None


def detect_family(ckpt: Checkpoint) -> Family:
    keys = ckpt.refs
    if _has(ckpt, "joint_blocks.0.context_block.attn.qkv.weight"):
        return _sd3_variant(ckpt)
    if _has(ckpt, "double_blocks.0.img_attn.norm.key_norm.scale"):
        return _flux_or_chroma(ckpt)
    if _has(ckpt, "zero_convs.0.0.weight") and _has(ckpt, "input_hint_block.0.weight"):
        return Family("controlnet", "", "zero_convs.0.0.weight + input_hint_block.0.weight")
    conv_in = ckpt.refs.get(UNET + "input_blocks.0.0.weight")
    if conv_in is not None:
        in_ch = conv_in.shape[1] if len(conv_in.shape) == 4 else 0
        variant = {9: "inpaint", 8: "instruct-pix2pix"}.get(in_ch, "")
        label = ckpt.refs.get(UNET + "label_emb.0.0.weight")
        ctx = [ref.shape[1] for k, ref in keys.items()
               if k.startswith(UNET) and k.endswith("attn2.to_k.weight") and len(ref.shape) == 2]
        if label is not None:
            name, why = _sdxl_base_or_refiner(ckpt, label.shape[1], ctx[0] if ctx else None)
            return Family(name, variant, f"label_emb.0.0.weight {list(label.shape)}, {why}")
        proj_in = [ref.shape for k, ref in keys.items() if k.startswith(UNET) and k.endswith(".proj_in.weight")]
        if any(k.startswith("cond_stage_model.model.") for k in keys):
            return Family("sd2", variant, "cond_stage_model.model.* (OpenCLIP text encoder)")
        if proj_in and len(proj_in[0]) == 2 or (ctx and ctx[0] == 1024):
            return Family("sd2", variant, "linear proj_in / context 1024")
        ev = f"input_blocks.0.0.weight {list(conv_in.shape)}, no label_emb"
        if ctx:
            ev += f", attn2.to_k context {ctx[0]}"
        return Family("sd1", variant, ev)
    if VAE + "decoder.conv_in.weight" in keys or "decoder.conv_in.weight" in keys:
        return Family("vae", "", "decoder.conv_in.weight without a UNet")
    hint = ""
    if any(k.endswith((T5_MARKER, CLIP_MARKER)) for k in keys):
        hint = (" It holds a text encoder only (T5 or CLIP): give the model's checkpoint and this file with "
                "--text-encoder FILE (recipe: model.text_encoders).")
    elif any(k.startswith(DIFFUSERS_COMPONENT_NAMES) for k in keys):
        hint = (" These look like the tensors of one component of a diffusers folder (unet/, vae/, "
                "text_encoder/): pass the folder that holds model_index.json instead of the file.")
    raise BadInput(f"{ckpt.path}: not a recognised diffusion model checkpoint. Looked for: {LOOKED_FOR}. "
                   f"Found {len(keys)} tensors, e.g. {', '.join(sorted(keys)[:3]) or 'none'}.{hint}")


FLUX_UNSUPPORTED = (("nerf_blocks.", "Chroma Radiance (pixel-space nerf blocks)"),
                    ("__x0__", "Chroma x0-prediction"))


def _flux_or_chroma(ckpt: Checkpoint) -> Family:
    """Chroma (the distilled-guidance approximator instead of modulation Linears) before Flux; Flux
    dev (guidance_in) or schnell. A transformer that takes more input channels than it predicts
    is an image-conditioned variant (Fill: 384, Canny/Depth: 128 for 64 out), refused by name."""
    keys = ckpt.refs
    for marker, what in FLUX_UNSUPPORTED:
        if any(marker in k for k in keys):
            raise BadInput(f"{ckpt.path}: {what} (tensors {marker}*) is not supported yet; Flux.1 dev/schnell "
                           "and Chroma are")
    img_in, final = keys.get(DIT + "img_in.weight"), keys.get(DIT + "final_layer.linear.weight")
    if img_in is not None and final is not None and len(img_in.shape) == 2 and img_in.shape[1] > final.shape[0]:
        kind = {384: "Fill (inpainting)", 128: "Canny/Depth (structural control)"}.get(img_in.shape[1], "image-conditioned")
        raise BadInput(f"{ckpt.path}: img_in takes {img_in.shape[1]} channels for {final.shape[0]} out: a Flux {kind} "
                       "variant, not supported yet (Flux.1 dev/schnell and Chroma are)")
    if any(k.startswith(DIT + "distilled_guidance_layer.") for k in keys):
        return Family("chroma", "", "double_blocks.* with distilled_guidance_layer.*")
    variant = "dev" if DIT + "guidance_in.in_layer.weight" in keys else "schnell"
    return Family("flux", variant, "double_blocks.0.img_attn.norm.key_norm.scale" +
                  (", guidance_in" if variant == "dev" else ", no guidance_in"))


def _sd3_variant(ckpt: Checkpoint) -> Family:
    """SD3-medium (no QK norm), SD3.5-medium (MMDiT-X: x_block.attn2 in the first blocks) or SD3.5-large
    (QK norm, no attn2); large-turbo has large's shapes, so only its name (file, folder or
    model_index) tells it apart."""
    keys = ckpt.refs
    ev = "joint_blocks.0.context_block.attn.qkv.weight"
    if any(k.startswith(DIT + "joint_blocks.") and ".x_block.attn2." in k for k in keys):
        return Family("sd3", "3.5-medium", ev + ", x_block.attn2 (MMDiT-X)")
    if DIT + "joint_blocks.0.context_block.attn.ln_q.weight" not in keys:
        return Family("sd3", "3-medium", ev + ", no QK norm")
    names = [ckpt.path.lower(), str(ckpt.configs.get("model_index", {}).get("_name_or_path", "")).lower()]
    if any("turbo" in n for n in names):
        return Family("sd3", "3.5-large-turbo", ev + ", QK norm, 'turbo' in the name")
    return Family("sd3", "3.5-large", ev + ", QK norm")


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


def require_supported(ckpt: Checkpoint, family: Family) -> None:
    if family.name == "vae":
        raise BadInput(f"{ckpt.path}: holds a VAE only ({family.evidence}); give the whole model as the "
                       "checkpoint and this file as its VAE: --vae FILE (recipe: model.vae)")
    if not family.supported:
        raise BadInput(f"{ckpt.path}: detected {family.name}{' (' + family.variant + ')' if family.variant else ''} "
                       f"from {family.evidence}; {family.name} is not supported yet "
                       f"(supported: {', '.join(sorted(SUPPORTED))}).")
