"""Test-only references: diffusers / transformers models (torch CPU) holding the same weights.

Single-file checkpoints are converted with diffusers' own LDM converters (an independent
reading of the key layout); diffusers folders are made with `save_pretrained`.
"""
from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders import single_file_utils as sfu
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel

from precast.compiler.demo_model import SD1Config, random_tensor


def unet_diffusers_config(cfg: SD1Config, heads=8) -> dict:
    n = len(cfg.channel_mult)
    return dict(sample_size=16, in_channels=cfg.in_channels, out_channels=4, layers_per_block=cfg.num_res_blocks,
                block_out_channels=[cfg.model_channels * m for m in cfg.channel_mult],
                down_block_types=["CrossAttnDownBlock2D" if i in cfg.attention_levels else "DownBlock2D"
                                  for i in range(n)],
                up_block_types=["CrossAttnUpBlock2D" if i in cfg.attention_levels else "UpBlock2D"
                                for i in reversed(range(n))],
                cross_attention_dim=cfg.context_dim, attention_head_dim=heads,
                transformer_layers_per_block=cfg.transformer_depth, norm_num_groups=32)


def vae_diffusers_config(cfg: SD1Config) -> dict:
    n = len(cfg.vae_mult)
    return dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * n,
                up_block_types=["UpDecoderBlock2D"] * n, block_out_channels=[cfg.vae_ch * m for m in cfg.vae_mult],
                layers_per_block=cfg.vae_res_blocks, latent_channels=cfg.latent_channels, norm_num_groups=32)


def clip_config(cfg: SD1Config, heads: int) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=cfg.vocab, hidden_size=cfg.context_dim, intermediate_size=cfg.text_intermediate,
                          num_hidden_layers=cfg.text_layers, num_attention_heads=heads,
                          max_position_embeddings=cfg.max_positions, hidden_act="quick_gelu")


def models_from_single_file(path, cfg: SD1Config, unet_heads=8, text_heads=None):
    """(unet, vae, text_encoder) built by diffusers/transformers from an LDM single file."""
    sd = load_file(str(path))
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    ucfg, vcfg = unet_diffusers_config(cfg, unet_heads), vae_diffusers_config(cfg)
    unet = UNet2DConditionModel(**ucfg)
    unet.load_state_dict(sfu.convert_ldm_unet_checkpoint(sd, ucfg), strict=True)
    vae = AutoencoderKL(**vcfg)
    vae.load_state_dict(sfu.convert_ldm_vae_checkpoint(sd, vcfg), strict=True)
    te = CLIPTextModel(clip_config(cfg, text_heads or max(1, cfg.context_dim // 64)))
    te_sd = sfu.convert_ldm_clip_checkpoint(sd)  # -> text_model.*; transformers 5 names have no text_model.
    if not any(k.startswith("text_model.") for k in te.state_dict()):
        te_sd = {k.removeprefix("text_model."): v for k, v in te_sd.items()}
    te.load_state_dict({k: v for k, v in te_sd.items() if not k.endswith("position_ids")}, strict=False)
    missing = set(te.state_dict()) - set(te_sd)
    assert not {m for m in missing if not m.endswith("position_ids")}, missing
    return unet.eval(), vae.eval(), te.eval()


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (norm scales near 1), so a swapped weight/bias cannot hide."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.from_numpy(random_tensor(rng, name, tuple(p.shape))))
    return model.eval()


@torch.no_grad()
def run_unet(unet, sample, t, ctx):
    return unet(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(ctx)).sample.numpy()


@torch.no_grad()
def run_vae_encoder(vae, x):
    return vae.encode(torch.from_numpy(x)).latent_dist.parameters.numpy()


@torch.no_grad()
def run_vae_decoder(vae, z):
    return vae.decode(torch.from_numpy(z)).sample.numpy()


@torch.no_grad()
def run_text_encoder(te, ids):
    out = te(torch.from_numpy(ids.astype(np.int64)))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


# ---- SD 2.x / SDXL ----------------------------------------------------------------------------

def heads_per_level(cfg: SD1Config, head_dim: int = 64) -> list[int]:
    return [max(1, cfg.model_channels * m // head_dim) for m in cfg.channel_mult]


def unet_config_for(cfg: SD1Config) -> dict:
    """diffusers UNet2DConditionModel config for an SD 2.x / SDXL layout (64-wide heads)."""
    c = unet_diffusers_config(cfg, heads_per_level(cfg))
    c["use_linear_projection"] = cfg.use_linear
    if cfg.depth_per_level:
        c["transformer_layers_per_block"] = [max(1, d) for d in cfg.depth_per_level]
    if cfg.adm_in_channels:
        c.update(addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=cfg.adm_in_channels)
    return c


def openclip_model(sd, cfg: SD1Config, prefix: str, with_projection: bool):
    from transformers import CLIPTextModelWithProjection
    conf = CLIPTextConfig(vocab_size=cfg.vocab, hidden_size=cfg.text2_width, intermediate_size=cfg.text2_intermediate,
                          num_hidden_layers=cfg.text2_layers, num_attention_heads=max(1, cfg.text2_width // 64),
                          max_position_embeddings=cfg.max_positions, hidden_act="gelu",
                          projection_dim=cfg.text2_projection or cfg.text2_width)
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(conf)
    te_sd = sfu.convert_open_clip_checkpoint(model, sd, prefix=prefix)
    if not any(k.startswith("text_model.") for k in model.state_dict()):
        te_sd = {k.removeprefix("text_model."): v for k, v in te_sd.items()}
    if not with_projection:
        te_sd.pop("text_projection.weight", None)
    missing, unexpected = model.load_state_dict(te_sd, strict=False)
    assert not [m for m in missing if "position_ids" not in m] and not unexpected, (missing, unexpected)
    return model.eval()


def family_models(path, cfg: SD1Config) -> dict:
    """{component: reference model} for an SD 2.x / SDXL / refiner single file."""
    sd = load_file(str(path))
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    ucfg, vcfg = unet_config_for(cfg), vae_diffusers_config(cfg)
    unet = UNet2DConditionModel(**ucfg)
    unet.load_state_dict(sfu.convert_ldm_unet_checkpoint(sd, ucfg), strict=True)
    vae = AutoencoderKL(**vcfg)
    vae.load_state_dict(sfu.convert_ldm_vae_checkpoint(sd, vcfg), strict=True)
    out = {"unet": unet.eval(), "vae": vae.eval()}
    if cfg.family == "sd2":
        out["text_encoder"] = openclip_model(sd, cfg, "cond_stage_model.model.", False)
    elif cfg.family == "sdxl":
        te1 = CLIPTextModel(clip_config(cfg, max(1, (cfg.context_dim - cfg.text2_width) // 64)).__class__(
            vocab_size=cfg.vocab, hidden_size=cfg.context_dim - cfg.text2_width, intermediate_size=cfg.text_intermediate,
            num_hidden_layers=cfg.text_layers, num_attention_heads=max(1, (cfg.context_dim - cfg.text2_width) // 64),
            max_position_embeddings=cfg.max_positions, hidden_act="quick_gelu"))
        te_sd = {k.removeprefix("conditioner.embedders.0.transformer.text_model."): v for k, v in sd.items()
                 if k.startswith("conditioner.embedders.0.transformer.text_model.")}
        te1.load_state_dict({k: v for k, v in te_sd.items() if "position_ids" not in k}, strict=False)
        out["text_encoder"] = te1.eval()
        out["text_encoder_2"] = openclip_model(sd, cfg, "conditioner.embedders.1.model.", True)
    else:
        out["text_encoder_2"] = openclip_model(sd, cfg, "conditioner.embedders.0.model.", True)
    return out


@torch.no_grad()
def run_hidden(te, ids, layer_from_end: int = 2, final_norm: bool = False):
    out = te(torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
    h = out.hidden_states[-layer_from_end]
    if final_norm:
        h = getattr(te, "text_model", te).final_layer_norm(h)
    return h.numpy(), out


@torch.no_grad()
def run_unet_xl(unet, sample, t, ctx, text_embeds, time_ids):
    return unet(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(ctx),
                added_cond_kwargs={"text_embeds": torch.from_numpy(text_embeds),
                                   "time_ids": torch.from_numpy(time_ids)}).sample.numpy()


def controlnet_config(unet_cfg: dict, hint=(8, 8, 16, 16)) -> dict:
    """diffusers ControlNetModel's config for a UNet config (the tiny demos' hint channels)."""
    import inspect
    from diffusers import ControlNetModel
    fields = set(inspect.signature(ControlNetModel.__init__).parameters)
    return {**{k: v for k, v in unet_cfg.items() if k in fields}, "conditioning_embedding_out_channels": hint}


def controlnet_from_ldm(path, unet_cfg: dict):
    """diffusers' reading of an LDM ControlNet file (its single-file converter; SDXL's label_emb by hand,
    which the converter does not map)."""
    from diffusers import ControlNetModel
    from diffusers.loaders import single_file_utils as sfu
    from safetensors.torch import load_file
    sd = {k: v.float() for k, v in load_file(str(path)).items()}
    cfg = controlnet_config(unet_cfg)
    net = ControlNetModel(**cfg)
    conv = sfu.convert_controlnet_checkpoint(sd, cfg)
    for i in (0, 2):
        for p in ("weight", "bias"):
            key = f"control_model.label_emb.0.{i}.{p}"
            if key in sd:
                conv[f"add_embedding.linear_{1 + i // 2}.{p}"] = sd[key]
    net.load_state_dict(conv, strict=True)
    return net.eval()
