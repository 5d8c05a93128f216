"""Test-only references for Flux.1 / Chroma / T5 / CLIP-L / the 16-channel VAE: diffusers and
transformers models (torch CPU) holding exactly the weights of a BFL / ComfyUI-layout file.

The transformer goes through this file's own BFL -> diffusers mapping (`flux_bfl_to_diffusers`),
because diffusers' Flux and Chroma single-file converters hard-code width 3072; tests prove the
mapping equal to diffusers' converters at that width. The VAE uses diffusers' size-agnostic LDM
converter; T5 and CLIP-L files already hold HF names. Every model is loaded with strict=True.
`save_diffusers_folder` writes the models as a diffusers pipeline folder (sharded where asked).
"""
from __future__ import annotations

import copy
import json
import os

import torch
from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.loaders import single_file_utils as sfu
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from precast.compiler.demo_dit import (CLIP_L_PREFIX, FLUX_PREFIX, SCALED_FP8_MARKER, T5_PREFIX, VAE_PREFIX,
                                       FluxConfig, Vae16Config)
from precast.compiler.demo_dit import T5Config as T5Shape
from precast.compiler.demo_model import SD1Config


# ------------------------------------------------------------------------------------- reading

def load_tensors(state_dict_or_path) -> dict[str, torch.Tensor]:
    if isinstance(state_dict_or_path, dict):
        return dict(state_dict_or_path)
    return load_file(str(state_dict_or_path))


def component(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` with it removed (an all-in-one file), or all of them (a bare file)."""
    if any(k.startswith(prefix) for k in sd):
        return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def dequantize(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float32 tensors; ComfyUI scaled fp8 undone (`weight * scale_weight`), its marker and scales dropped."""
    out = {}
    for k, v in sd.items():
        if k == SCALED_FP8_MARKER or k.endswith((".scale_weight", ".scale_input")):
            continue
        scale = sd.get(k[: -len("weight")] + "scale_weight") if k.endswith(".weight") else None
        out[k] = v.float() * scale.float() if scale is not None else v.float()
    return out


# ------------------------------------------------------------------------- BFL -> diffusers names

_TOP = {"img_in": "x_embedder", "txt_in": "context_embedder",
        "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
        "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
        "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
        "final_layer.linear": "proj_out",
        "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
        "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj"}
_DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
           "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
           "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
           "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
           "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
           "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
           "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
_DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear",
           "norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


def _rename(rest: str, table: dict[str, str]) -> str | None:
    """`rest` is `<module>.<weight|bias>` or a full parameter name in `table`."""
    if rest in table:
        return table[rest]
    module, _, param = rest.rpartition(".")
    return f"{table[module]}.{param}" if module in table else None


def flux_bfl_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL Flux / Chroma transformer names (no prefix) -> diffusers Flux/ChromaTransformer2DModel names.
    Sizes come from the tensors (any width). Fused tensors are split as views: qkv in three equal
    parts (q, k, v), single-block linear1 into q, k, v (hidden rows each) and the MLP input; the final
    adaLN's (shift, scale) halves become diffusers' (scale, shift). Every key must be used."""
    hidden = sd["img_in.weight"].shape[0]
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        parts = key.split(".")
        new = None
        if parts[0] == "double_blocks":
            n, rest = parts[1], ".".join(parts[2:])
            module, _, param = rest.rpartition(".")
            if module in _DOUBLE_QKV:
                for name, piece in zip(_DOUBLE_QKV[module], t.chunk(3, dim=0)):
                    out[f"transformer_blocks.{n}.{name}.{param}"] = piece
                continue
            new = _rename(rest, _DOUBLE)
            new = new and f"transformer_blocks.{n}.{new}"
        elif parts[0] == "single_blocks":
            n, rest = parts[1], ".".join(parts[2:])
            if rest in ("linear1.weight", "linear1.bias"):
                names = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
                sizes = (hidden, hidden, hidden, t.shape[0] - 3 * hidden)
                for name, piece in zip(names, t.split(sizes, dim=0)):
                    out[f"single_transformer_blocks.{n}.{name}.{parts[-1]}"] = piece
                continue
            new = _rename(rest, _SINGLE)
            new = new and f"single_transformer_blocks.{n}.{new}"
        elif key.startswith("final_layer.adaLN_modulation.1."):
            shift, scale = t.chunk(2, dim=0)
            out[f"norm_out.linear.{parts[-1]}"] = torch.cat([scale, shift])
            continue
        elif key.startswith("distilled_guidance_layer.layers."):
            i, layer, param = parts[2], parts[3], parts[4]
            linear = {"in_layer": "linear_1", "out_layer": "linear_2"}[layer]
            new = f"distilled_guidance_layer.layers.{i}.{linear}.{param}"
        elif key.startswith("distilled_guidance_layer.norms.") and key.endswith(".scale"):
            new = key[: -len("scale")] + "weight"
        else:
            new = _rename(key, _TOP)
        if new is None:
            raise KeyError(f"no diffusers name for BFL key {key!r}")
        out[new] = t
    return out


# ----------------------------------------------------------------------------------- configs

def flux_diffusers_config(cfg: FluxConfig) -> dict:
    if cfg.mlp_ratio != 4.0 or not cfg.qkv_bias:
        raise ValueError("diffusers' Flux/Chroma blocks fix mlp_ratio 4 and qkv biases")
    common = dict(patch_size=1, in_channels=cfg.in_channels, out_channels=cfg.out_channels, num_layers=cfg.depth,
                  num_single_layers=cfg.depth_single, attention_head_dim=cfg.head_dim, num_attention_heads=cfg.heads,
                  joint_attention_dim=cfg.context_in_dim, axes_dims_rope=tuple(cfg.axes_dim))
    if cfg.chroma:
        return dict(common, approximator_num_channels=cfg.approximator_in,
                    approximator_hidden_dim=cfg.approximator_hidden, approximator_layers=cfg.approximator_layers)
    return dict(common, pooled_projection_dim=cfg.vec_in_dim, guidance_embeds=cfg.guidance_embed)


def t5_hf_config(cfg: T5Shape) -> T5Config:
    return T5Config(vocab_size=cfg.vocab, d_model=cfg.d_model, d_ff=cfg.d_ff, num_heads=cfg.heads, d_kv=cfg.d_kv,
                    num_layers=cfg.layers, feed_forward_proj="gated-gelu", relative_attention_num_buckets=cfg.buckets,
                    relative_attention_max_distance=128, dropout_rate=0.0, layer_norm_epsilon=1e-6,
                    is_encoder_decoder=False, use_cache=False)


def clip_l_hf_config(cfg: SD1Config, heads: int | None = None) -> CLIPTextConfig:
    w = cfg.context_dim
    return CLIPTextConfig(vocab_size=cfg.vocab, hidden_size=w, intermediate_size=cfg.text_intermediate,
                          num_hidden_layers=cfg.text_layers, num_attention_heads=heads or max(1, w // 64),
                          max_position_embeddings=cfg.max_positions, hidden_act="quick_gelu", projection_dim=w,
                          bos_token_id=0, eos_token_id=2)


def vae16_diffusers_config(cfg: Vae16Config) -> dict:
    n = len(cfg.ch_mult)
    return dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * n,
                up_block_types=["UpDecoderBlock2D"] * n, block_out_channels=[cfg.ch * m for m in cfg.ch_mult],
                layers_per_block=cfg.res_blocks, latent_channels=cfg.latent_channels, norm_num_groups=32,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)


# ---------------------------------------------------------------------------------- references

def flux_reference(state_dict_or_path, cfg: FluxConfig) -> FluxTransformer2DModel:
    """diffusers FluxTransformer2DModel (dev: guidance_embeds) holding the file's transformer."""
    if cfg.chroma:
        raise ValueError("a Chroma config: use chroma_reference")
    model = FluxTransformer2DModel(**flux_diffusers_config(cfg))
    sd = dequantize(component(load_tensors(state_dict_or_path), FLUX_PREFIX))
    model.load_state_dict(flux_bfl_to_diffusers(_only_transformer(sd)), strict=True)
    return model.eval()


def chroma_reference(state_dict_or_path, cfg: FluxConfig) -> ChromaTransformer2DModel:
    if not cfg.chroma:
        raise ValueError("a Flux config: use flux_reference")
    model = ChromaTransformer2DModel(**flux_diffusers_config(cfg))
    sd = dequantize(component(load_tensors(state_dict_or_path), FLUX_PREFIX))
    model.load_state_dict(flux_bfl_to_diffusers(_only_transformer(sd)), strict=True)
    return model.eval()


def _only_transformer(sd: dict) -> dict:
    """A bare transformer file is all transformer; refuse other components' keys instead of guessing."""
    strays = [k for k in sd if k.startswith(("text_encoders.", "vae.", "encoder.", "decoder."))]
    if strays:
        raise KeyError(f"not transformer keys: {strays[:3]}")
    return sd


def t5_reference(state_dict_or_path, cfg: T5Shape) -> T5EncoderModel:
    model = T5EncoderModel(t5_hf_config(cfg))
    sd = dequantize(component(load_tensors(state_dict_or_path), T5_PREFIX))
    if "encoder.embed_tokens.weight" in model.state_dict() and "encoder.embed_tokens.weight" not in sd:
        sd["encoder.embed_tokens.weight"] = sd["shared.weight"]     # tied to shared; the files hold it once
    model.load_state_dict(sd, strict=True)
    return model.eval()


def clip_l_reference(state_dict_or_path, cfg: SD1Config, heads: int | None = None) -> CLIPTextModel:
    model = CLIPTextModel(clip_l_hf_config(cfg, heads))
    sd = dequantize(component(load_tensors(state_dict_or_path), CLIP_L_PREFIX))
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    if not any(k.startswith("text_model.") for k in model.state_dict()):   # transformers 5 drops the level
        sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)
    return model.eval()


def vae16_reference(state_dict_or_path, cfg: Vae16Config) -> AutoencoderKL:
    config = vae16_diffusers_config(cfg)
    model = AutoencoderKL(**config)
    sd = dequantize(component(load_tensors(state_dict_or_path), VAE_PREFIX))
    converted = sfu.convert_ldm_vae_checkpoint(sd, config)
    if len(converted) != len(sd):     # one diffusers key per file key: none left behind by the converter
        raise KeyError(f"{len(sd)} VAE keys in the file, {len(converted)} converted")
    model.load_state_dict(converted, strict=True)
    return model.eval()


# ------------------------------------------------------------------------------ diffusers folder

SCHEDULERS = {   # FlowMatchEulerDiscreteScheduler configs of the released pipelines
    "flux-dev": dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                     max_image_seq_len=4096),
    "flux-schnell": dict(shift=1.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15,
                         base_image_seq_len=256, max_image_seq_len=4096),
    "chroma": dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                   max_image_seq_len=4096),   # ChromaPipeline's calculate_shift defaults
}
_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def save_diffusers_folder(folder, transformer, vae, t5, clip=None, *, variant: str | None = None,
                          max_shard_size: str | int | None = None) -> str:
    """A diffusers FluxPipeline / ChromaPipeline folder: transformer/, vae/, the T5 (text_encoder_2/ for
    Flux, text_encoder/ for Chroma), CLIP-L (text_encoder/, Flux only), scheduler/, model_index.json.
    `variant` ("fp16"/"bf16") casts and names the weight files as diffusers variants; `max_shard_size`
    shards the transformer and the T5 with an index.json. No tokenizers (they would need a download)."""
    import diffusers
    folder = str(folder)
    chroma = isinstance(transformer, ChromaTransformer2DModel)
    family = "chroma" if chroma else ("flux-dev" if transformer.config.guidance_embeds else "flux-schnell")
    if chroma == (clip is not None):
        raise ValueError("Flux folders need CLIP-L; Chroma folders have none")
    dtype = _DTYPES[variant]
    cast = (lambda m: copy.deepcopy(m).to(dtype)) if dtype else (lambda m: m)
    shard = {"max_shard_size": max_shard_size} if max_shard_size else {}
    cast(transformer).save_pretrained(os.path.join(folder, "transformer"), variant=variant, **shard)
    cast(vae).save_pretrained(os.path.join(folder, "vae"), variant=variant)
    t5_dir = "text_encoder" if chroma else "text_encoder_2"
    cast(t5).save_pretrained(os.path.join(folder, t5_dir), variant=variant, **shard)
    if clip is not None:
        cast(clip).save_pretrained(os.path.join(folder, "text_encoder"), variant=variant)
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **SCHEDULERS[family]).save_pretrained(
        os.path.join(folder, "scheduler"))
    index = {"_class_name": "ChromaPipeline" if chroma else "FluxPipeline", "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", type(transformer).__name__], "vae": ["diffusers", "AutoencoderKL"]}
    if chroma:
        index.update(text_encoder=["transformers", "T5EncoderModel"], tokenizer=[None, None],
                     image_encoder=[None, None], feature_extractor=[None, None])
    else:
        index.update(text_encoder=["transformers", "CLIPTextModel"], tokenizer=[None, None],
                     text_encoder_2=["transformers", "T5EncoderModel"], tokenizer_2=[None, None])
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return folder
