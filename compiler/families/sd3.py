"""Stable Diffusion 3 and 3.5 (medium, large, large-turbo): everything the compiler knows about them.

Owns: the evidence in a checkpoint's header (SAI joint_blocks; MMDiT-X's x_block.attn2: 3.5-medium; no QK
norm: 3-medium; else 3.5-large, 'turbo' in a name: large-turbo), their components (StableDiffusion3Pipeline's
names: CLIP-L and CLIP-G with projection, an optional T5-XXL -- a checkpoint without T5 exports without it,
the runtime feeds zeros -- the MMDiT of compiler/graphs/mmdit.py, the 16-channel VAE), how the parts must fit,
and their diffusers and OpenVINO GenAI folder layouts.
"""
from __future__ import annotations

from ..errors import BadInput
from ..graphs import mmdit
from ..sources.tensor_refs import CLIP_G, CLIP_L, DIT, Checkpoint
from .family import Component, Detected, Diffusers, Family, GenAI
from .shared import (CLIP_PROJECTED, CLIP_TOKENIZER, FLOW_EULER, FLOW_SCHEDULER, T5_MODEL, T5_TOKENIZER, VAE_MODEL,
                     VAES, clip, t5)

LOOKED_FOR = "joint_blocks.* (SD3)"
HINT = ("pass SD3's text encoders with --text-encoder clip_l.safetensors --text-encoder clip_g.safetensors "
        "[--text-encoder t5xxl_fp16.safetensors] (recipe: model.text_encoders)")
SAMPLE_SIZE = 128


def detect(ckpt: Checkpoint) -> Detected | None:
    """SD3-medium (no QK norm), SD3.5-medium (MMDiT-X: x_block.attn2 in the first blocks) or SD3.5-large
    (QK norm, no attn2); large-turbo has large's shapes, so only its name (file, folder or
    model_index) tells it apart."""
    keys = ckpt.refs
    ev = "joint_blocks.0.context_block.attn.qkv.weight"
    if not any(k.endswith(ev) for k in keys):
        return None
    if any(k.startswith(DIT + "joint_blocks.") and ".x_block.attn2." in k for k in keys):
        return Detected("sd3", "3.5-medium", ev + ", x_block.attn2 (MMDiT-X)")
    if DIT + "joint_blocks.0.context_block.attn.ln_q.weight" not in keys:
        return Detected("sd3", "3-medium", ev + ", no QK norm")
    names = [ckpt.path.lower(), str(ckpt.configs.get("model_index", {}).get("_name_or_path", "")).lower()]
    if any("turbo" in n for n in names):
        return Detected("sd3", "3.5-large-turbo", ev + ", QK norm, 'turbo' in the name")
    return Detected("sd3", "3.5-large", ev + ", QK norm")


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """An MMDiT reads the VAE's latents, T5's width as its context, CLIP-L | CLIP-G side by side
    (zero-padded to that width) and their two projections as its pooled vector."""
    if "transformer" not in configs:
        return
    dit = configs["transformer"]
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if vae and dit["in_channels"] != vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent channels; "
                       f"the SD3 transformer reads {dit['in_channels']}: give the model's own VAE (16 channels) with --vae")
    t5_cfg = configs.get("text_encoder_3")
    if t5_cfg and t5_cfg.get("d_model") != dit["context_dim"]:
        raise BadInput(f"{path}: the T5 encoder is {t5_cfg.get('d_model')} wide; the transformer's context_embedder reads "
                       f"{dit['context_dim']} (T5-XXL: 4096): give the T5 the model was trained with")
    clips = [configs[n] for n in ("text_encoder", "text_encoder_2") if n in configs]
    if len(clips) == 2 and clips[0]["hidden"] + clips[1]["hidden"] > dit["context_dim"]:
        raise BadInput(f"{path}: CLIP-L and CLIP-G are {clips[0]['hidden']} + {clips[1]['hidden']} wide, more than the "
                       f"transformer's context width {dit['context_dim']}: the text encoders come from another model")
    projected = [c.get("projection") for c in clips]
    if len(clips) == 2 and all(projected) and sum(projected) != dit["pooled_dim"]:
        raise BadInput(f"{path}: the CLIP projections give {projected[0]} + {projected[1]} pooled values; the "
                       f"transformer's y_embedder reads {dit['pooled_dim']}: the text encoders come from another model")


def _transformer_fields(cfg: dict) -> dict:
    """SD3Transformer2DModel's config fields; sample_size (latents) at most what its position table covers."""
    patch = cfg.get("patch") or 2
    return dict(patch_size=patch, pos_embed_max_size=cfg.get("pos_embed_max"), num_layers=cfg.get("depth"),
                pooled_projection_dim=cfg.get("pooled_dim"), caption_projection_dim=cfg.get("hidden"),
                qk_norm="rms_norm" if cfg.get("qk_norm") else None,
                dual_attention_layers=list(cfg.get("dual_attention_layers") or ()),
                sample_size=min(SAMPLE_SIZE, patch * (cfg.get("pos_embed_max") or 64)))


# CLIP-L and CLIP-G with projection (penultimate states + projected pooled); the VAE is kept fp32 in half exports
FAMILIES = (
    Family("sd3", {"text_encoder": clip("text_encoder", (CLIP_L,), "states+pooled", config_file="clip_l", missing_hint=HINT),
                   "text_encoder_2": clip("text_encoder_2", (CLIP_G,), "states+pooled", "openclip", "clip_g", HINT),
                   "text_encoder_3": t5("text_encoder_3", False, HINT),
                   "transformer": Component("transformer", (DIT,), "transformer", mmdit.mmdit_config, mmdit.build_mmdit),
                   **VAES},
           Diffusers("StableDiffusion3Pipeline", FLOW_SCHEDULER, SAMPLE_SIZE, transformer="SD3Transformer2DModel",
                     transformer_fields=_transformer_fields),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts,
           demos={"demo:tiny-sd3": {}, "demo:tiny-sd35-medium": {}, "demo:tiny-sd35-large": {}},
           genai=GenAI({"_class_name": "StableDiffusion3Pipeline", "scheduler": FLOW_EULER, "vae": VAE_MODEL,
                        "text_encoder": CLIP_PROJECTED, "tokenizer": CLIP_TOKENIZER, "text_encoder_2": CLIP_PROJECTED,
                        "tokenizer_2": CLIP_TOKENIZER, "text_encoder_3": T5_MODEL, "tokenizer_3": T5_TOKENIZER,
                        "transformer": ["diffusers", "SD3Transformer2DModel"]},
                       pooled_first=("text_encoder", "text_encoder_2"), spacing="training",  # the scheduler's default
                       static_shift_only=True)),
)
