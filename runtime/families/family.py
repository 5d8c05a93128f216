"""What a model family is to precast: the facts its runtime module declares, read through the registry
(runtime/families/__init__.py) by the runtime and, for the facts both sides need, by the compiler.

Owns the `Family`, `Flow` and `LatentRGB` records (and whether a variant reads a negative prompt). Plain data: no
family's code is here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Flow:
    """A released flow-matching model's schedule (diffusers FlowMatchEulerDiscreteScheduler fields) and the
    defaults its pipeline generates with; the T5 length its transformer is built and run for."""
    scheduler: dict
    steps: int
    guidance: float
    t5_tokens: int | None = None
    negative: bool | None = None      # the variant's own Family.negative (FLUX.2 dev: distilled guidance)


@dataclass(frozen=True)
class LatentRGB:
    """The linear latent -> RGB projection a step's preview is made with (ComfyUI's latent_formats.py
    `latent_rgb_factors` and `latent_rgb_factors_bias`, which stable-diffusion.cpp uses too): for denoiser
    latents x [C, h, w], rgb = sum_c x[c] * factors[c] + bias, in [-1, 1]."""
    factors: tuple[tuple[float, float, float], ...]     # one (R, G, B) row per latent channel
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Family:
    """One value of a manifest's `model.family` and everything generic code asks of it."""
    name: str                         # the manifest's model.family (and the compiler's family name)
    title: str                        # as messages name it: "SD 1.x", "Flux"
    needs: tuple[str, ...]            # the components `generate` loads, in order
    denoiser: str                     # "unet" or "transformer": its profile's opt is the default size
    latent_scale: float               # decoder input = latents / scale + shift
    pipeline: type                    # the txt2img pipeline (a loading.BundleModel)
    requests: Callable                # (manifest, batch, height, width) -> {component: {input: shape}}
    latent_shift: float = 0.0
    patch: int = 1                    # latents per denoiser token side: 2 where a DiT reads 2x2 patches
    optional: tuple[str, ...] = ()    # components loaded when the bundle has them (SD3's T5)
    steps: int = 20                   # generate's defaults where the bundle records none
    guidance: float = 7.5
    samplers: tuple[str, ...] = ()    # the --scheduler names it takes; the first is the default
    # sampler -> the --schedule names (sigma schedules) it runs, the first its default; a sampler not here
    # runs the model's own schedule only (flow matching: the shift the model was trained with)
    schedules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    negative: bool = True             # whether a negative prompt is used (Flux: distilled guidance, none)
    image_modes: bool = False         # img2img and inpainting
    img2img: bool = False             # img2img without inpainting (the flow families that run it)
    controlnets: bool = False
    variants: dict[str, Flow] = field(default_factory=dict)    # flow-matching: the released models' defaults
    # (manifest, init: bool, mask: bool, strength, steps, names "cli" | "api") -> (mode, strength), checked
    check_mode: Callable | None = None
    latent_rgb: LatentRGB | None = None    # the previews' projection (runtime/previews.py); None: no projection


def reads_negative(family: Family, model: dict) -> bool:
    """Whether a bundle's model (its manifest's `model`) reads a negative prompt (classifier-free guidance): its
    variant's word, else its family's (distilled guidance reads none)."""
    flow = family.variants.get(model.get("variant") or "")
    return family.negative if flow is None or flow.negative is None else flow.negative
