"""Z-Image (Tongyi-MAI's Z-Image-Turbo): everything the compiler knows about it.

Owns: the evidence in a checkpoint's header (the transformer's cap_embedder beside noise_refiner blocks with
unmodulated context_refiner blocks, in diffusers names after compiler/sources/zimage_names.py), its components
(the Qwen3 text encoder read at hidden_states[-2]: compiler/graphs/llm_encoder.py; the transformer:
compiler/graphs/zimage.py; the FLUX.1 VAE: compiler/graphs/ldm_vae.py), how the parts must fit (the transformer
patches the VAE's latent channels and reads the text encoder's width; the tokenizer is there), the tiny demo's
RoPE split, and its diffusers folder layout (ZImagePipeline).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from ..errors import BadInput
from ..graphs import llm_encoder, zimage
from ..sources.llm_tokenizer_files import llm_tokenizer_files
from ..sources.tensor_refs import DIT, LLM, Checkpoint
from .family import Component, Detected, Diffusers, Family
from .shared import FLOW_SCHEDULER, VAES

LOOKED_FOR = "cap_embedder.* + noise_refiner.* (Z-Image)"
TE_HINT = ("Z-Image split files ship the Qwen3 text encoder on its own: pass it with --text-encoder "
           "qwen_3_4b.safetensors (recipe: model.text_encoders)")
QWEN3_THETA = 1_000_000.0       # Qwen3-4B's rope_theta, where its config.json is not at hand
TEXT_ENCODER = Component("text_encoder", (LLM,), "text_encoder",
                         partial(llm_encoder.llm_config, reads=(-2,), theta=QWEN3_THETA), llm_encoder.build_llm_encoder,
                         config_file="llm", missing_hint=TE_HINT, tokenizer="qwen2")
TRANSFORMER = Component("transformer", (DIT,), "transformer", zimage.zimage_config, zimage.build_zimage)
DEMO = {"transformer": {"axes_dims_rope": [4, 6, 6]}}   # the tiny demo's 16-wide heads (as the tiny Flux's)


def detect(ckpt: Checkpoint) -> Detected | None:
    keys = ckpt.refs
    if DIT + "cap_embedder.1.weight" not in keys or DIT + "noise_refiner.0.adaLN_modulation.0.weight" not in keys:
        return None
    return Detected("zimage", "turbo", "cap_embedder + noise_refiner.0.adaLN_modulation (Z-Image)")


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The transformer patches the VAE's latent channels and reads the text encoder's width; the tokenizer is there."""
    dit, te = configs.get("transformer"), configs.get("text_encoder")
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if dit and vae and dit["in_channels"] != vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent "
                       f"channels; the Z-Image transformer reads {dit['in_channels']}: give the model's own VAE (FLUX.1's "
                       "ae.safetensors, 16 channels) with --vae")
    if dit and te and te["hidden"] * len(te["reads"]) != dit["cap_dim"]:
        raise BadInput(f"{path}: the text encoder is {te['hidden']} wide; the Z-Image transformer's cap_embedder reads "
                       f"{dit['cap_dim']} (Qwen3-4B: 2560): give the text encoder the model was trained with")
    if te:
        llm_tokenizer_files(Path(path))


def _transformer_fields(cfg: dict) -> dict:
    """ZImageTransformer2DModel's config fields."""
    return dict(in_channels=cfg.get("in_channels"), dim=cfg.get("dim"), n_layers=cfg.get("layers"),
                n_refiner_layers=cfg.get("refiner_layers"), n_heads=cfg.get("heads"), n_kv_heads=cfg.get("heads"),
                cap_feat_dim=cfg.get("cap_dim"), axes_dims=cfg.get("axes_dims"), axes_lens=cfg.get("axes_lens"),
                rope_theta=cfg.get("theta"), t_scale=cfg.get("t_scale"), norm_eps=cfg.get("eps"),
                all_patch_size=[2], all_f_patch_size=[1])


FAMILIES = (
    Family("zimage", {"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER, **VAES},
           Diffusers("ZImagePipeline", FLOW_SCHEDULER, 128, transformer="ZImageTransformer2DModel",
                     transformer_fields=_transformer_fields),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts, demos={"demo:tiny-z-image": DEMO},
           no_genai="export-openvino-genai does not write Z-Image folders yet: OpenVINO GenAI 2026.4's ZImagePipeline "
                    "reads optimum-intel's layout (a transformer with an additive text mask and position-id inputs), "
                    "not precast's graphs"),
)
