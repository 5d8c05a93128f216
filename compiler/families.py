"""Model families and their components: which graphs a family exports, where each one's weights
live in a checkpoint, and the conventions the weights cannot say.

Owns: the component table per family (optimum folder names; key prefixes, first present wins,
so single files and diffusers folders both bind; the keys each graph must consume), and each
family's defaults (SD 1.x: 8 heads; SD 2.x / SDXL: 64-wide heads; SDXL: 6 time ids, refiner 5;
latent scale; which VAE precision is safe); and what `--set C.FIELD=V` / recipe `model.set` may
override (SET_FIELDS, each field with the values it takes).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from .graphs import clip_text, ldm_unet, ldm_vae
from .sources.checkpoint import TEXT, UNET, VAE


@dataclass(frozen=True)
class Component:
    name: str                      # optimum folder name
    prefixes: tuple[str, ...]      # where its weights may live; the first one present is used
    config_name: str               # diffusers subfolder whose config.json applies; override namespace
    make_config: Callable
    build: Callable
    scopes: tuple[str, ...] = ()   # keys that must all be consumed (default: the chosen prefix)

    def prefix_in(self, keys) -> str | None:
        for p in self.prefixes:
            if any(k.startswith(p) for k in keys):
                return p
        return None


def _text(name, prefixes, config_name, role) -> Component:
    return Component(name, prefixes, config_name, partial(clip_text.clip_text_config, role=role),
                     clip_text.build_clip_text)


UNET_C = Component("unet", (UNET,), "unet", ldm_unet.unet_config, ldm_unet.build_unet)
VAE_ENC = Component("vae_encoder", (VAE,), "vae", ldm_vae.vae_config, ldm_vae.build_vae_encoder,
                    (VAE + "encoder.", VAE + "quant_conv."))
VAE_DEC = Component("vae_decoder", (VAE,), "vae", ldm_vae.vae_config, ldm_vae.build_vae_decoder,
                    (VAE + "decoder.", VAE + "post_quant_conv."))
SDXL_TE1 = "conditioner.embedders.0.transformer.text_model."
SDXL_TE2 = ("conditioner.embedders.1.model.", "conditioner.embedders.1.transformer.text_model.")
REFINER_TE = ("conditioner.embedders.0.model.", "conditioner.embedders.0.transformer.text_model.")

FAMILIES: dict[str, dict[str, Component]] = {
    "sd1": {"text_encoder": _text("text_encoder", (TEXT,), "text_encoder", "sd1"),
            "unet": UNET_C, "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
    "sd2": {"text_encoder": _text("text_encoder", ("cond_stage_model.model.", TEXT), "text_encoder", "sd2"),
            "unet": UNET_C, "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
    "sdxl": {"text_encoder": _text("text_encoder", (SDXL_TE1,), "text_encoder", "sdxl-l"),
             "text_encoder_2": _text("text_encoder_2", SDXL_TE2, "text_encoder_2", "sdxl-g"),
             "unet": UNET_C, "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
    "sdxl-refiner": {"text_encoder_2": _text("text_encoder_2", REFINER_TE, "text_encoder_2", "sdxl-g"),
                     "unet": UNET_C, "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
}

# What the weights cannot say, per family (a diffusers config.json or --set wins).
DEFAULTS: dict[str, dict[str, dict]] = {
    "sd1": {"unet": {"num_heads_default": 8}},
    "sd2": {"unet": {"head_dim_default": 64}},
    "sdxl": {"unet": {"head_dim_default": 64, "time_ids": 6}},
    "sdxl-refiner": {"unet": {"head_dim_default": 64, "time_ids": 5}},
}
TEXT_POSITIONS = 77  # every supported text encoder (CLIP-L, OpenCLIP-H, bigG) has 77 positions
LATENT_SCALE = {"sd1": 0.18215, "sd2": 0.18215, "sdxl": 0.13025, "sdxl-refiner": 0.13025}
# The SDXL VAE overflows in fp16 (activations past 65504): exported in fp32 unless the user
# brings the fp16-fix VAE or asks for fp16 knowingly.
FP32_VAE_FAMILIES = {"sdxl", "sdxl-refiner"}


def overrides_for(family: str, component: Component, user: dict) -> dict:
    return {**DEFAULTS.get(family, {}).get(component.config_name, {}), **user.get(component.config_name, {})}


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _choice(*names):
    return " or ".join(names), lambda v: v in names


POSITIVE = ("a positive integer", lambda v: _is_int(v, 1))
NON_NEGATIVE = ("an integer >= 0", lambda v: _is_int(v, 0))
_TEXT_FIELDS = {"num_heads": POSITIVE, "clip_skip": POSITIVE, "eos_token_id": NON_NEGATIVE,
                "activation": _choice("quick_gelu", "gelu")}
# Override namespace (Component.config_name, plus `model`) -> field -> (what it takes, check).
SET_FIELDS: dict[str, dict[str, tuple[str, Callable]]] = {
    "model": {"prediction": _choice("epsilon", "v_prediction")},
    "text_encoder": _TEXT_FIELDS,
    "text_encoder_2": _TEXT_FIELDS,
    "unet": {"num_heads": ("a positive integer or a list of them (one per level), e.g. 8 or [5, 10, 20]",
                           lambda v: _is_int(v, 1) or (isinstance(v, list) and bool(v) and all(_is_int(h, 1) for h in v))),
             "head_dim": POSITIVE, "time_ids": NON_NEGATIVE, "addition_time_embed_dim": POSITIVE, "groups": POSITIVE},
    "vae": {"groups": POSITIVE},
}


def set_problem(component, field, value) -> str | None:
    """Why `component.field = value` is not an override precast reads (None when it is one)."""
    fields = SET_FIELDS.get(component)
    if fields is None:
        return f"unknown component {component!r}; known: {', '.join(sorted(SET_FIELDS))}"
    if field not in fields:
        return f"unknown field {field!r}; known for {component}: {', '.join(sorted(fields))}"
    what, ok = fields[field]
    return None if ok(value) else f"expected {what}, got {value!r}"
