"""Z-Image (Tongyi-MAI's Z-Image-Turbo): everything the compiler knows about it.

Owns: the evidence in a checkpoint's header (the transformer's cap_embedder beside noise_refiner blocks with
unmodulated context_refiner blocks, in diffusers names after compiler/sources/zimage_names.py), its components
(the Qwen3 text encoder read at hidden_states[-2]: compiler/graphs/llm_encoder.py; the transformer:
compiler/graphs/zimage.py; the FLUX.1 VAE: compiler/graphs/ldm_vae.py), how the parts must fit (the transformer
patches the VAE's latent channels and reads the text encoder's width; the tokenizer is there), the tiny demo's
RoPE split, and its diffusers and OpenVINO GenAI folder layouts (ZImagePipeline).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from ..errors import BadInput
from ..graphs import llm_encoder, zimage
from ..sources.llm_tokenizer_files import llm_tokenizer_files
from ..sources.tensor_refs import DIT, LLM, Checkpoint
from .family import Component, Detected, Diffusers, Family, GenAI
from .shared import FLOW_EULER, FLOW_SCHEDULER, QWEN3_CHAT_NO_THINK, QWEN_TOKENIZER, VAE_MODEL, VAES

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




def _genai_adapt(ov, name: str, model, config: dict, report: dict):
    """OpenVINO GenAI's ZImagePipeline reads the text encoder's `last_hidden_state`, and feeds the transformer an
    additive float text mask (0 on the prompt's rows) and int32 position ids, which precast's graph derives from
    the mask itself (the same positions: accepted, not read); it negates the transformer's output on the host,
    where precast's graph outputs the velocity: negated back here."""
    from openvino import opset13 as ops
    from ..ov_io import computed_inputs, mapped_outputs, parameter
    if name == "text_encoder":
        model.output(0).get_tensor().set_names({"last_hidden_state"})
    elif name == "transformer":
        additive = parameter(ov, "encoder_attention_mask", ov.Type.f32, [-1, -1])
        mask = ops.convert(ops.greater(additive, ops.constant(np.float32(-1))), ov.Type.i32)
        ids = [parameter(ov, n, ov.Type.i32, [-1, -1, 3]) for n in ("txt_ids", "img_ids")]
        model = mapped_outputs(ov, computed_inputs(model, [additive, *ids], {"attention_mask": mask.output(0)}),
                               ops.negative)
    return model


GENAI = GenAI({"_class_name": "ZImagePipeline", "scheduler": FLOW_EULER, "tokenizer": QWEN_TOKENIZER,
               "text_encoder": ["transformers", "Qwen3Model"], "vae": VAE_MODEL,
               "transformer": ["diffusers", "ZImageTransformer2DModel"]},
              spacing="1/steps", static_shift_only=True, text_inputs=("input_ids", "attention_mask"),
              adapt=_genai_adapt, chat_template=QWEN3_CHAT_NO_THINK)


FAMILIES = (
    Family("zimage", {"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER, **VAES},
           Diffusers("ZImagePipeline", FLOW_SCHEDULER, 128, transformer="ZImageTransformer2DModel",
                     transformer_fields=_transformer_fields),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts, demos={"demo:tiny-z-image": DEMO},
           genai=GENAI),
)
