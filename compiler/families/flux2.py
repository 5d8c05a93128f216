"""FLUX.2 klein (Black Forest Labs' 4B / 9B, distilled and base): everything the compiler knows about it.

Owns: the evidence in a checkpoint's header (the transformer's shared single_stream_modulation, in diffusers names
after compiler/sources/flux2_names.py; FLUX.2 dev -- a guidance embedder, Mistral's text model -- refused by
name; klein base told from the distilled model by a diffusers folder's model_index.json `is_distilled`, the
weights being alike), its components (the Qwen3 text encoder read at hidden_states 9, 18 and 27, stacked as
Flux2KleinPipeline stacks them: compiler/graphs/llm_encoder.py; the transformer: compiler/graphs/flux2.py; the
FLUX.2 VAE with its latents' batch-norm statistics: compiler/graphs/flux2_vae.py), how the parts must fit (the
transformer packs 2x2 patches of the VAE's latent channels and reads the stacked states' width; the tokenizer
is there), the tiny demo's RoPE split, and its diffusers folder layout (Flux2KleinPipeline).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from ..errors import BadInput
from ..graphs import flux2, flux2_vae, ldm_vae, llm_encoder, vae_segments
from ..sources.llm_tokenizer_files import llm_tokenizer_files
from ..sources.tensor_refs import DIT, LLM, VAE, Checkpoint
from .family import Component, Detected, Diffusers, Family
from .shared import FLOW_SCHEDULER

LOOKED_FOR = "single_stream_modulation.* (FLUX.2)"
TE_HINT = ("FLUX.2 klein split files ship the Qwen3 text encoder on its own: pass it with --text-encoder "
           "qwen_3_4b.safetensors (klein 9B: qwen_3_8b; recipe: model.text_encoders)")
READS = (9, 18, 27)             # Flux2KleinPipeline's text_encoder_out_layers (Qwen3-4B and -8B: 36 layers)
QWEN3_THETA = 1_000_000.0
TEXT_ENCODER = Component("text_encoder", (LLM,), "text_encoder",
                         partial(llm_encoder.llm_config, reads=READS, theta=QWEN3_THETA), llm_encoder.build_llm_encoder,
                         config_file="llm", missing_hint=TE_HINT, tokenizer="qwen2")
TRANSFORMER = Component("transformer", (DIT,), "transformer", flux2.flux2_config, flux2.build_flux2)
VAES = {"vae_encoder": Component("vae_encoder", (VAE,), "vae", flux2_vae.flux2_vae_config, ldm_vae.build_vae_encoder,
                                 (VAE + "encoder.", VAE + "quant_conv.")),
        "vae_decoder": Component("vae_decoder", (VAE,), "vae", flux2_vae.flux2_vae_config, ldm_vae.build_vae_decoder,
                                 (VAE + "decoder.", VAE + "post_quant_conv.")),
        "vae_encoder_tiled": Component("vae_encoder_tiled", (VAE,), "vae", flux2_vae.flux2_vae_config,
                                       vae_segments.build_vae_encoder_tiled,
                                       (VAE + "encoder.", VAE + "quant_conv."), optional=True),
        "vae_decoder_tiled": Component("vae_decoder_tiled", (VAE,), "vae", flux2_vae.flux2_vae_config,
                                       vae_segments.build_vae_decoder_tiled,
                                       (VAE + "decoder.", VAE + "post_quant_conv."), optional=True)}
DEMO = {"transformer": {"axes_dims_rope": [4, 4, 4, 4]}}   # the tiny demo's 16-wide heads


def detect(ckpt: Checkpoint) -> Detected | None:
    if DIT + "single_stream_modulation.linear.weight" not in ckpt.refs:
        return None
    if DIT + "time_guidance_embed.guidance_embedder.linear_1.weight" in ckpt.refs:
        raise BadInput(f"{ckpt.path}: a FLUX.2 transformer with a guidance embedder: FLUX.2 dev (Mistral-Small-3.2 "
                       "text encoder), not supported yet; FLUX.2 klein 4B / 9B are")
    distilled = (ckpt.configs.get("model_index") or {}).get("is_distilled", True) is not False
    return Detected("flux2", "klein" if distilled else "klein-base", "single_stream_modulation (FLUX.2)"
                    + ("" if distilled else ", model_index.json is_distilled false"))


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The transformer packs 2x2 patches of the VAE's latent channels and reads the stacked states' width; the
    tokenizer is there."""
    dit, te = configs.get("transformer"), configs.get("text_encoder")
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if dit and vae and dit["in_channels"] != 4 * vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent "
                       f"channels; the FLUX.2 transformer reads {dit['in_channels']} = 4 x {dit['in_channels'] // 4}: "
                       "give the model's own VAE (flux2-vae.safetensors, 32 channels) with --vae")
    if dit and te and te["hidden"] * len(te["reads"]) != dit["context_dim"]:
        raise BadInput(f"{path}: the text encoder is {te['hidden']} wide ({len(te['reads'])} layers stacked: "
                       f"{te['hidden'] * len(te['reads'])}); the FLUX.2 transformer's context_embedder reads "
                       f"{dit['context_dim']} (klein 4B: Qwen3-4B, 3 x 2560; 9B: Qwen3-8B, 3 x 4096): give the text "
                       "encoder the model was trained with")
    if te:
        llm_tokenizer_files(Path(path))


def _transformer_fields(cfg: dict) -> dict:
    """Flux2Transformer2DModel's config fields (precast feeds packed tokens: patch_size 1)."""
    return dict(patch_size=1, in_channels=cfg.get("in_channels"), num_layers=cfg.get("depth"),
                num_single_layers=cfg.get("depth_single"), attention_head_dim=cfg.get("head_dim"),
                num_attention_heads=cfg.get("heads"), joint_attention_dim=cfg.get("context_dim"),
                axes_dims_rope=cfg.get("axes_dim"), rope_theta=cfg.get("theta"),
                guidance_embeds=bool(cfg.get("guidance")))


FAMILIES = (
    Family("flux2", {"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER, **VAES},
           Diffusers("Flux2KleinPipeline", FLOW_SCHEDULER, 128, transformer="Flux2Transformer2DModel",
                     transformer_fields=_transformer_fields),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts, demos={"demo:tiny-flux2-klein": DEMO},
           no_genai="OpenVINO GenAI has no FLUX.2 pipeline (its Text2ImagePipeline runs SD 1.x / 2.x, SDXL, SD3 and "
                    "Flux), so export-openvino-genai cannot write one"),
)
