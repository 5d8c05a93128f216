"""Model families and their components: which graphs a family exports, where each one's weights
live in a checkpoint, and the conventions the weights cannot say.

Owns: the component table per family (diffusers/optimum folder names; key prefixes, first present
wins, so single files and diffusers folders both bind; the keys each graph must consume), and each
family's defaults (SD 1.x: 8 heads; SD 2.x / SDXL: 64-wide heads; SDXL: 6 time ids, refiner 5;
latent scale and shift; which VAE precision is safe; how parts must fit together, e.g. a Flux
VAE's 16 latent channels); and what `--set C.FIELD=V` / recipe `model.set` may override
(SET_FIELDS, each field with the values it takes).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from .errors import BadInput
from .graphs import clip_text, flux, ldm_unet, ldm_vae, mmdit, t5_encoder
from .sources.checkpoint import CLIP_G, CLIP_L, DIT, T5, TEXT, UNET, VAE


@dataclass(frozen=True)
class Component:
    name: str                      # optimum folder name
    prefixes: tuple[str, ...]      # where its weights may live; the first one present is used
    config_name: str               # diffusers subfolder whose config.json applies; override namespace
    make_config: Callable
    build: Callable
    scopes: tuple[str, ...] = ()   # keys that must all be consumed (default: the chosen prefix)
    config_file: str = ""          # key of its diffusers config in Checkpoint.configs (default: config_name)
    missing_hint: str = ""         # what to do when a checkpoint lacks it

    @property
    def config_key(self) -> str:
        return self.config_file or self.config_name

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
T5_HINT = ("Flux and Chroma single files usually ship without T5-XXL: pass it with --text-encoder "
           "t5xxl_fp16.safetensors (recipe: model.text_encoders)")
FLUX_CLIP = Component("text_encoder", (CLIP_L,), "text_encoder", partial(clip_text.clip_text_config, role="sd1"),
                      clip_text.build_clip_text, config_file="clip_l",
                      missing_hint="pass CLIP-L with --text-encoder clip_l.safetensors (recipe: model.text_encoders)")
DIT_C = Component("transformer", (DIT,), "transformer", flux.flux_config, flux.build_flux)


def _t5(name: str, mask_input: bool, hint: str = T5_HINT) -> Component:
    return Component(name, (T5,), name, partial(t5_encoder.t5_config, mask_input=mask_input),
                     t5_encoder.build_t5_encoder, config_file="t5", missing_hint=hint)


# SD3: CLIP-L and CLIP-G with projection (penultimate states + projected pooled), T5 optional
SD3_HINT = ("pass SD3's text encoders with --text-encoder clip_l.safetensors --text-encoder clip_g.safetensors "
            "[--text-encoder t5xxl_fp16.safetensors] (recipe: model.text_encoders)")
SD3_CLIPS = {n: Component(n, (prefix,), n, partial(clip_text.clip_text_config, role=role), clip_text.build_clip_text,
                          config_file=cfg, missing_hint=SD3_HINT)
             for n, prefix, role, cfg in (("text_encoder", CLIP_L, "sd3-l", "clip_l"),
                                          ("text_encoder_2", CLIP_G, "sd3-g", "clip_g"))}
MMDIT_C = Component("transformer", (DIT,), "transformer", mmdit.mmdit_config, mmdit.build_mmdit)


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
    # DiT families: diffusers' pipeline component names (FluxPipeline: CLIP-L + T5; ChromaPipeline: T5 only)
    "flux": {"text_encoder": FLUX_CLIP, "text_encoder_2": _t5("text_encoder_2", False), "transformer": DIT_C,
             "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
    "chroma": {"text_encoder": _t5("text_encoder", True), "transformer": DIT_C,
               "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
    # StableDiffusion3Pipeline's names; a checkpoint without T5 exports without it (the runtime feeds zeros)
    "sd3": {**SD3_CLIPS, "text_encoder_3": _t5("text_encoder_3", False, SD3_HINT), "transformer": MMDIT_C,
            "vae_encoder": VAE_ENC, "vae_decoder": VAE_DEC},
}
DENOISER = {"sd1": "unet", "sd2": "unet", "sdxl": "unet", "sdxl-refiner": "unet", "flux": "transformer",
            "chroma": "transformer", "sd3": "transformer"}

# What the weights cannot say, per family (a diffusers config.json or --set wins).
DEFAULTS: dict[str, dict[str, dict]] = {
    "sd1": {"unet": {"num_heads_default": 8}},
    "sd2": {"unet": {"head_dim_default": 64}},
    "sdxl": {"unet": {"head_dim_default": 64, "time_ids": 6}},
    "sdxl-refiner": {"unet": {"head_dim_default": 64, "time_ids": 5}},
}
TEXT_POSITIONS = 77  # every supported CLIP text encoder (CLIP-L, OpenCLIP-H, bigG) has 77 positions
LATENT_SCALE = {"sd1": 0.18215, "sd2": 0.18215, "sdxl": 0.13025, "sdxl-refiner": 0.13025, "flux": 0.3611,
                "chroma": 0.3611, "sd3": 1.5305}
# latent = scale * (z - shift) (BFL AutoEncoderParams, SAI SD3LatentFormat)
LATENT_SHIFT = {"flux": 0.1159, "chroma": 0.1159, "sd3": 0.0609}
SD3_VARIANTS = ("3-medium", "3.5-medium", "3.5-large", "3.5-large-turbo")
# T5 text length the transformer is built and run for (diffusers' max_sequence_length defaults)
T5_TOKENS = {"flux": {"dev": 512, "schnell": 256}, "chroma": {"": 512}, "sd3": {v: 256 for v in SD3_VARIANTS}}
PACKED_2X2 = {"flux", "chroma"}     # transformers fed 2x2-packed latent tokens (SD3 patchifies inside its graph)
# The SDXL and Flux VAEs overflow in fp16 (activations past 65504; TensorRT's demo forces the Flux
# VAE out of fp16): exported in fp32 unless the user brings an fp16-safe VAE or asks knowingly.
FP32_VAE_FAMILIES = {"sdxl", "sdxl-refiner", "flux", "chroma", "sd3"}


# Flow-matching schedules (diffusers FlowMatchEulerDiscreteScheduler configs as released) and the
# pipelines' default steps and guidance: dev 28 / 3.5 (distilled guidance), schnell 4 / none,
# Chroma 35 / 5.0 (real classifier-free guidance with a negative prompt).
DYNAMIC = {"use_dynamic_shifting": True, "shift": 3.0, "base_shift": 0.5, "max_shift": 1.15,
           "base_image_seq_len": 256, "max_image_seq_len": 4096}
# SD3 (StableDiffusion3Pipeline, SAI sd3_infer.py): static shift 3.0 over the scheduler's own spacing
# (down to the training schedule's last sigma); 3-medium 28 steps / CFG 7.0, 3.5-large and 3.5-medium
# 40 / 4.5 (3.5-medium's skip-layer guidance is not run), large-turbo 4 steps without CFG.
SD3_FLOW = {"use_dynamic_shifting": False, "shift": 3.0, "spacing": "training"}
FLOW = {("flux", "dev"): (DYNAMIC, 28, 3.5), ("flux", "schnell"): ({"use_dynamic_shifting": False, "shift": 1.0}, 4, 0.0),
        ("chroma", ""): (DYNAMIC, 35, 5.0),
        ("sd3", "3-medium"): (SD3_FLOW, 28, 7.0), ("sd3", "3.5-medium"): (SD3_FLOW, 40, 4.5),
        ("sd3", "3.5-large"): (SD3_FLOW, 40, 4.5), ("sd3", "3.5-large-turbo"): (SD3_FLOW, 4, 1.0)}
UNSUPPORTED_SCHEDULER_FIELDS = ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                                "invert_sigmas", "stochastic_sampling")
SCHEDULER_FIELDS = ("use_dynamic_shifting", "shift", "base_shift", "max_shift", "base_image_seq_len",
                    "max_image_seq_len", "time_shift_type")


def flow_defaults(family: str, variant: str, scheduler_json: dict, where: str) -> dict | None:
    """{scheduler, steps, guidance} for a flow-matching family: the folder's scheduler config where it
    has one (its fields checked), else the released model's."""
    if (family, variant) not in FLOW:
        return None
    sched, steps, guidance = FLOW[(family, variant)]
    sched = dict(sched)
    for name in SCHEDULER_FIELDS:
        if name not in scheduler_json or scheduler_json[name] is None:
            continue
        sched[name] = scheduler_json[name]
    for name in UNSUPPORTED_SCHEDULER_FIELDS:      # these change the schedule in ways not sampled here
        if scheduler_json.get(name):
            raise BadInput(f"{where}: {name} = {scheduler_json[name]!r} is not supported yet (leave it out)")
    problem = flow_problem(sched)
    if problem:
        raise BadInput(f"{where}: {problem}")
    return {"scheduler": sched, "steps": steps, "guidance": guidance}


def flow_problem(sched: dict) -> str | None:
    """Why a flow-matching schedule cannot be sampled (the runtime checks a manifest's the same way)."""
    from ..runtime.flow import schedule_problem
    return schedule_problem(sched)


def latent_factor_of(refs) -> int:
    """Pixels per latent of the model's VAE: 2 ** (levels - 1) (8 for every released SD / Flux VAE);
    8 when the checkpoint has no VAE."""
    import re
    levels = {int(m.group(1)) for k in refs if (m := re.match(re.escape(VAE) + r"(?:decoder\.up|encoder\.down)\.(\d+)\.", k))}
    return 2 ** (max(levels)) if levels else 8


def check_parts(family: str, configs: dict[str, dict], path: str, vae_file: str | None = None) -> None:
    """Components of one model must fit each other: a Flux/Chroma transformer packs 2x2 patches of
    the VAE's latent channels (64 = 4 x 16), and reads T5's width; an SD UNet predicts the VAE's
    latent channels and reads the text encoders' widths side by side."""
    if "unet" in configs:
        _check_sd_parts(family, configs, path, vae_file)
    if family == "sd3" and "transformer" in configs:
        _check_sd3_parts(configs, path, vae_file)
    if family not in ("flux", "chroma") or "transformer" not in configs:
        return
    dit = configs["transformer"]
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if vae and dit["out_channels"] != 4 * vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent channels; the {family} transformer "
                       f"predicts {dit['out_channels']} = 4 x {dit['out_channels'] // 4}: give the model's own VAE "
                       "(Flux's ae.safetensors, 16 channels) with --vae")
    t5 = configs.get("text_encoder_2" if family == "flux" else "text_encoder")
    if t5 and t5.get("d_model") and t5["d_model"] != dit["context_dim"]:
        raise BadInput(f"{path}: the T5 encoder is {t5['d_model']} wide; the transformer reads {dit['context_dim']} "
                       "(T5-XXL: 4096): give the T5 the model was trained with")
    clip = configs.get("text_encoder") if family == "flux" else None
    if clip and dit["vec_dim"] and clip.get("hidden") != dit["vec_dim"]:
        raise BadInput(f"{path}: the CLIP text encoder is {clip.get('hidden')} wide; the transformer's vector_in "
                       f"reads {dit['vec_dim']} (CLIP-L: 768)")


def _check_sd3_parts(configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """An MMDiT reads the VAE's latents, T5's width as its context, CLIP-L | CLIP-G side by side
    (zero-padded to that width) and their two projections as its pooled vector."""
    dit = configs["transformer"]
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if vae and dit["in_channels"] != vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent channels; "
                       f"the SD3 transformer reads {dit['in_channels']}: give the model's own VAE (16 channels) with --vae")
    t5 = configs.get("text_encoder_3")
    if t5 and t5.get("d_model") != dit["context_dim"]:
        raise BadInput(f"{path}: the T5 encoder is {t5.get('d_model')} wide; the transformer's context_embedder reads "
                       f"{dit['context_dim']} (T5-XXL: 4096): give the T5 the model was trained with")
    clips = [configs[n] for n in ("text_encoder", "text_encoder_2") if n in configs]
    if len(clips) == 2 and clips[0]["hidden"] + clips[1]["hidden"] > dit["context_dim"]:
        raise BadInput(f"{path}: CLIP-L and CLIP-G are {clips[0]['hidden']} + {clips[1]['hidden']} wide, more than the "
                       f"transformer's context width {dit['context_dim']}: the text encoders come from another model")
    projected = [c.get("projection") for c in clips]
    if len(clips) == 2 and all(projected) and sum(projected) != dit["pooled_dim"]:
        raise BadInput(f"{path}: the CLIP projections give {projected[0]} + {projected[1]} pooled values; the "
                       f"transformer's y_embedder reads {dit['pooled_dim']}: the text encoders come from another model")


def _check_sd_parts(family: str, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    unet = configs["unet"]
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if vae and unet["out_channels"] != vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent channels; the UNet predicts "
                       f"{unet['out_channels']}: give a VAE made for this model with --vae (SD 1.x/2.x/XL: 4 channels)")
    names = [n for n in FAMILIES.get(family, {}) if n.startswith("text_encoder")]
    if not names or any(n not in configs for n in names):   # the widths add up only when all are here
        return
    widths = [configs[n]["hidden"] for n in names]
    if unet["context_dim"] and sum(widths) != unet["context_dim"]:
        raise BadInput(f"{path}: the text encoder output is {' + '.join(map(str, widths))} wide; the UNet's "
                       f"cross-attention reads {unet['context_dim']}: the text encoder and UNet come from "
                       "different models")


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
    "transformer": {"axes_dims_rope": ("a list of even integers summing to the head width, e.g. [16, 56, 56]",
                                       lambda v: isinstance(v, list) and bool(v) and all(_is_int(a, 2) and a % 2 == 0
                                                                                        for a in v)),
                    "theta": ("a number above 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                              and 0 < v < float("inf")),
                    "num_heads": POSITIVE,      # SD3 without QK norm: heads are not in the weights (SAI: 64 wide)
                    "fp32_blocks": ("a list of joint-block indices computed in fp32 in half exports, e.g. [35]",
                                    lambda v: isinstance(v, list) and all(_is_int(b, 0) for b in v))},
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
