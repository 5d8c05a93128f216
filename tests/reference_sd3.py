"""Test-only references for SD3 / SD3.5: diffusers SD3Transformer2DModel and transformers
CLIPTextModelWithProjection (torch CPU) holding exactly the weights of a SAI / ComfyUI-layout file.

The transformer goes through diffusers' own single-file converter
(`convert_sd3_transformer_checkpoint_to_diffusers`, which reads every size from the tensors), checked to
leave no key behind, and loads with strict=True. CLIP files already hold HF names.
"""
from __future__ import annotations

import torch
from diffusers import SD3Transformer2DModel
from diffusers.loaders import single_file_utils as sfu
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from precast.compiler.demo_dit import Vae16Config
from precast.compiler.demo_sd3 import CLIP_G_PREFIX, CLIP_L_PREFIX, SD3_PREFIX, VAE_PREFIX, ClipConfig, SD3Config
from reference_dit import component, dequantize, load_tensors


def sd3_diffusers_config(cfg: SD3Config, heads: int | None = None) -> dict:
    """SD3Transformer2DModel's config for a SAI-layout model; `heads` overrides cfg.heads (the
    weights do not fix it without QK norm)."""
    if cfg.mlp_ratio != 4:
        raise ValueError("diffusers' SD3 blocks fix mlp_ratio 4")
    heads = heads or cfg.heads
    return dict(sample_size=cfg.pos_embed_max * cfg.patch, patch_size=cfg.patch, in_channels=cfg.in_channels,
                num_layers=cfg.depth, attention_head_dim=cfg.hidden // heads, num_attention_heads=heads,
                joint_attention_dim=cfg.context_dim, caption_projection_dim=cfg.hidden,
                pooled_projection_dim=cfg.pooled_dim, out_channels=cfg.out_channels,
                pos_embed_max_size=cfg.pos_embed_max, dual_attention_layers=tuple(cfg.dual_attention_layers),
                qk_norm="rms_norm" if cfg.qk_norm else None)


def sai_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' converter on a copy; every SAI key must be consumed."""
    rest = dict(sd)
    out = sfu.convert_sd3_transformer_checkpoint_to_diffusers(rest)
    if rest:
        raise KeyError(f"keys the diffusers converter left behind: {sorted(rest)[:5]}")
    return out


def sd3_reference(state_dict_or_path, cfg: SD3Config, heads: int | None = None) -> SD3Transformer2DModel:
    """diffusers SD3Transformer2DModel holding the file's transformer (all-in-one or bare)."""
    model = SD3Transformer2DModel(**sd3_diffusers_config(cfg, heads))
    sd = dequantize(component(load_tensors(state_dict_or_path), SD3_PREFIX))
    strays = [k for k in sd if k.startswith(("text_encoders.", "first_stage_model."))]
    if strays:
        raise KeyError(f"not transformer keys: {strays[:3]}")
    model.load_state_dict(sai_to_diffusers(sd), strict=True)
    return model.eval()


def clip_hf_config(cfg: ClipConfig, act: str, heads: int | None = None) -> CLIPTextConfig:
    """CLIP-L: quick_gelu; CLIP-G (OpenCLIP bigG in HF names): gelu. Heads 64 wide unless given."""
    return CLIPTextConfig(vocab_size=cfg.vocab, hidden_size=cfg.width, intermediate_size=cfg.intermediate,
                          num_hidden_layers=cfg.layers, num_attention_heads=heads or max(1, cfg.width // 64),
                          max_position_embeddings=cfg.positions, hidden_act=act, projection_dim=cfg.projection,
                          bos_token_id=0, eos_token_id=2)


def clip_reference(state_dict_or_path, cfg: ClipConfig, which: str, heads: int | None = None
                   ) -> CLIPTextModelWithProjection:
    """`which`: "l" or "g"; the CLIP under SD3's all-in-one prefix, or a bare file's."""
    prefix, act = {"l": (CLIP_L_PREFIX, "quick_gelu"), "g": (CLIP_G_PREFIX, "gelu")}[which]
    model = CLIPTextModelWithProjection(clip_hf_config(cfg, act, heads))
    sd = dequantize(component(load_tensors(state_dict_or_path), prefix))
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    if not any(k.startswith("text_model.") for k in model.state_dict()):   # transformers 5 drops the level
        sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)
    return model.eval()


def vae_reference(state_dict_or_path, cfg: Vae16Config):
    """diffusers AutoencoderKL (16 channels, no quant convs, SD3's scale and shift) holding the VAE under
    SAI's `first_stage_model.` prefix (or a bare file's)."""
    from diffusers import AutoencoderKL
    from reference_dit import vae16_diffusers_config
    config = {**vae16_diffusers_config(cfg), "scaling_factor": 1.5305, "shift_factor": 0.0609}
    model = AutoencoderKL(**config)
    sd = dequantize(component(load_tensors(state_dict_or_path), VAE_PREFIX))
    converted = sfu.convert_ldm_vae_checkpoint(sd, config)
    if len(converted) != len(sd):
        raise KeyError(f"{len(sd)} VAE keys in the file, {len(converted)} converted")
    model.load_state_dict(converted, strict=True)
    return model.eval()
