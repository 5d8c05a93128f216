"""Parts several families share: the LDM VAE's two components, CLIP and T5 text-encoder components, the
latent factor and channels of a checkpoint's VAE, and the diffusers / transformers class names their folders name.
"""
from __future__ import annotations

import re
from functools import partial

from ..graphs import clip_text, ldm_vae, t5_encoder, vae_segments
from ..sources.tensor_refs import T5, VAE
from .family import Component

VAE_ENC = Component("vae_encoder", (VAE,), "vae", ldm_vae.vae_config, ldm_vae.build_vae_encoder,
                    (VAE + "encoder.", VAE + "quant_conv."))
VAE_DEC = Component("vae_decoder", (VAE,), "vae", ldm_vae.vae_config, ldm_vae.build_vae_decoder,
                    (VAE + "decoder.", VAE + "post_quant_conv."))
# the decoder and encoder cut at their GroupNorms, for exact tiling (compiler/graphs/vae_segments.py); asked for by name
VAE_DEC_TILED = Component("vae_decoder_tiled", (VAE,), "vae", ldm_vae.vae_config, vae_segments.build_vae_decoder_tiled,
                          (VAE + "decoder.", VAE + "post_quant_conv."), optional=True)
VAE_ENC_TILED = Component("vae_encoder_tiled", (VAE,), "vae", ldm_vae.vae_config, vae_segments.build_vae_encoder_tiled,
                          (VAE + "encoder.", VAE + "quant_conv."), optional=True)
VAES = {"vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC, "vae_encoder_tiled": VAE_ENC_TILED,
        "vae_decoder_tiled": VAE_DEC_TILED}

# diffusers / transformers classes, as model_index.json names them
CLIP_TOKENIZER = ["transformers", "CLIPTokenizer"]
T5_TOKENIZER = ["transformers", "T5TokenizerFast"]
QWEN2_TOKENIZER = ["transformers", "Qwen2Tokenizer"]
CLIP_MODEL = ["transformers", "CLIPTextModel"]
CLIP_PROJECTED = ["transformers", "CLIPTextModelWithProjection"]
T5_MODEL = ["transformers", "T5EncoderModel"]
UNET_MODEL = ["diffusers", "UNet2DConditionModel"]
VAE_MODEL = ["diffusers", "AutoencoderKL"]
EULER = ["diffusers", "EulerDiscreteScheduler"]
FLOW_EULER = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
DPM_SOLVER = "DPMSolverMultistepScheduler"
FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
QWEN_TOKENIZER = ["transformers", "Qwen2TokenizerFast"]
# The part of Qwen3's chat template the pipelines render (user turns, the assistant's turn opened; with
# enable_thinking false an empty think block: Flux2KleinPipeline's), written for OpenVINO GenAI, which templates the
# prompt with the template its tokenizer carries and always with thinking off. ZImagePipeline renders thinking on:
# QWEN3_CHAT_NO_THINK never writes the think block.
_QWEN3_TURNS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n")
QWEN3_CHAT = (_QWEN3_TURNS + "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
              "{% endif %}{% endif %}")
QWEN3_CHAT_NO_THINK = _QWEN3_TURNS + "{% endif %}"


def clip(name: str, prefixes: tuple[str, ...], use: str, tokenizer: str = "clip", config_file: str = "",
         missing_hint: str = "") -> Component:
    """A CLIP text encoder (compiler/graphs/clip_text.py: `use` picks its hidden state and pooled output);
    tokenizer "clip": OpenAI's CLIP-L, "openclip": an OpenCLIP encoder (H, bigG)."""
    return Component(name, prefixes, name, partial(clip_text.clip_text_config, use=use, openai=tokenizer == "clip"),
                     clip_text.build_clip_text, config_file=config_file, missing_hint=missing_hint, tokenizer=tokenizer)


def t5(name: str, mask_input: bool, hint: str) -> Component:
    """A T5-XXL encoder (compiler/graphs/t5_encoder.py), with an attention-mask input where the family feeds one."""
    return Component(name, (T5,), name, partial(t5_encoder.t5_config, mask_input=mask_input),
                     t5_encoder.build_t5_encoder, config_file="t5", missing_hint=hint, tokenizer="t5")


def latent_factor_of(refs) -> int:
    """Pixels per latent of the model's VAE: 2 ** (levels - 1) (8 for every released SD / Flux VAE);
    8 when the checkpoint has no VAE."""
    levels = {int(m.group(1)) for k in refs if (m := re.match(re.escape(VAE) + r"(?:decoder\.up|encoder\.down)\.(\d+)\.", k))}
    return 2 ** (max(levels)) if levels else 8


def latent_channels_of(refs) -> int | None:
    """Channels of the model's latents, from its VAE's decoder (or encoder); None when the checkpoint has no VAE."""
    for key, axis, per in (("decoder.conv_in.weight", 1, 1), ("encoder.conv_out.weight", 0, 2)):
        if VAE + key in refs:
            return refs[VAE + key].shape[axis] // per
    return None
