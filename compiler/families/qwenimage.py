"""Qwen-Image (Alibaba's 20 B text-to-image MMDiT): everything the compiler knows about it.

Owns: the evidence in a checkpoint's header (the transformer's txt_norm beside img_mod.1 blocks, diffusers names;
the edit / layered variants refused by their names), its components (Qwen2.5-VL's text model read at its last
hidden state, after the final norm: compiler/graphs/llm_encoder.py; the transformer: compiler/graphs/qwenimage.py;
the Qwen-Image VAE on one frame with its latents' statistics: compiler/graphs/qwenimage_vae.py, in diffusers names
or Wan's: compiler/sources/qwen_vae_names.py), how the parts must fit (the transformer packs 2x2 patches of the
VAE's latent channels and reads the text model's width; the tokenizer is there), the tiny demo's RoPE split, and its
diffusers folder layout (QwenImagePipeline).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from ..errors import BadInput
from ..graphs import llm_encoder, qwenimage, qwenimage_vae
from ..sources.llm_tokenizer_files import llm_tokenizer_files
from ..sources.tensor_refs import DIT, LLM, VAE, Checkpoint
from .family import Component, Detected, Diffusers, Family
from .shared import FLOW_SCHEDULER

LOOKED_FOR = "txt_norm.* + transformer_blocks.0.img_mod.* (Qwen-Image)"
TE_HINT = ("Qwen-Image split files ship the Qwen2.5-VL text encoder on its own: pass it with --text-encoder "
           "qwen_2.5_vl_7b.safetensors (recipe: model.text_encoders)")
QWEN25_THETA = 1_000_000.0      # Qwen2.5-VL-7B's rope_theta, where its config.json is not at hand
TEXT_ENCODER = Component("text_encoder", (LLM,), "text_encoder",
                         partial(llm_encoder.llm_config, reads=(-1,), theta=QWEN25_THETA),
                         llm_encoder.build_llm_encoder,
                         config_file="llm", missing_hint=TE_HINT, tokenizer="qwen2")
TRANSFORMER = Component("transformer", (DIT,), "transformer", qwenimage.qwenimage_config, qwenimage.build_qwenimage)
VAES = {"vae_encoder": Component("vae_encoder", (VAE,), "vae", qwenimage_vae.qwen_vae_config,
                                 qwenimage_vae.build_qwen_vae_encoder, (VAE + "encoder.", VAE + "quant_conv.")),
        "vae_decoder": Component("vae_decoder", (VAE,), "vae", qwenimage_vae.qwen_vae_config,
                                 qwenimage_vae.build_qwen_vae_decoder, (VAE + "decoder.", VAE + "post_quant_conv."))}
DEMO = {"transformer": {"axes_dims_rope": [4, 6, 6]}}   # the tiny demo's 16-wide heads


def detect(ckpt: Checkpoint) -> Detected | None:
    if DIT + "txt_norm.weight" not in ckpt.refs or DIT + "transformer_blocks.0.img_mod.1.weight" not in ckpt.refs:
        return None
    return Detected("qwenimage", "base", "txt_norm + transformer_blocks.0.img_mod.1 (Qwen-Image)")


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The transformer packs 2x2 patches of the VAE's latent channels and reads the text model's width; the
    tokenizer is there."""
    dit, te = configs.get("transformer"), configs.get("text_encoder")
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if dit and vae and dit["in_channels"] != 4 * vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent "
                       f"channels; the Qwen-Image transformer reads {dit['in_channels']} = 4 x "
                       f"{dit['in_channels'] // 4}: give the model's own VAE (the folder's vae/, 16 channels) with "
                       "--vae")
    if dit and te and te["hidden"] != dit["context_dim"]:
        raise BadInput(f"{path}: the text encoder is {te['hidden']} wide; the Qwen-Image transformer's txt_in reads "
                       f"{dit['context_dim']} (Qwen2.5-VL-7B: 3584): give the text encoder the model was trained with")
    if te:
        llm_tokenizer_files(Path(path))


def _transformer_fields(cfg: dict) -> dict:
    """QwenImageTransformer2DModel's config fields."""
    return dict(patch_size=2, in_channels=cfg.get("in_channels"), out_channels=(cfg.get("out_channels") or 0) // 4,
                num_layers=cfg.get("depth"), attention_head_dim=cfg.get("head_dim"),
                num_attention_heads=cfg.get("heads"), joint_attention_dim=cfg.get("context_dim"),
                axes_dims_rope=cfg.get("axes_dim"))


FAMILIES = (
    Family("qwenimage", {"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER, **VAES},
           Diffusers("QwenImagePipeline", FLOW_SCHEDULER, 128, transformer="QwenImageTransformer2DModel",
                     transformer_fields=_transformer_fields),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts, demos={"demo:tiny-qwen-image": DEMO},
           no_genai="export-openvino-genai does not write Qwen-Image folders yet: OpenVINO GenAI 2026.4's "
                    "QwenImagePipeline reads optimum-intel's layout (a transformer taking the grid's height and width, "
                    "a 5-D VAE), not precast's graphs"),
)
