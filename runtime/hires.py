"""The hires fix (A1111's "Hires. fix"): a txt2img pass at the base size, its result upscaled -- the latents
(A1111's "Latent" upscalers) or the decoded image (a pixel filter, then encoded again) -- and denoised once
more at the target size as img2img from the upscaled latents with a denoising strength, each image's noise
drawn from its own seed at that size (so the second pass is `img2img` of the upscaled image, seed for seed).

Owns: `Hires` (the second pass: size, steps, denoising strength, upscaler; its record), `check_hires` (the
CLI's and the API's hires options checked before anything loads: a family that runs img2img, a second size
the denoiser's profiles cover, a VAE encoder for a pixel upscaler), `UPSCALERS` (precast's names and A1111's)
and `upscale_latents` (torch's interpolate: bilinear without antialiasing, or nearest-exact). The passes
themselves run in runtime/generate.py. Imports numpy and the runtime's own modules.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import check_number, check_steps, check_strength, shown
from .errors import UserError
from .image_size import latent_factor, outside_profiles, parse_size
from .images import crop_box
from .metadata import A1111_UPSCALERS
from .schedulers import start_index

# precast's name -> A1111's "Hires upscaler"; latent ones upscale the latents, "bilinear" the decoded image
# (runtime/images.py's resize: PIL's BILINEAR, a triangle filter on pixel centres) before it is encoded again
UPSCALERS = A1111_UPSCALERS
DEFAULTS = {"scale": 2.0, "denoise": 0.7, "upscaler": "latent"}      # A1111's
MAX_SCALE = 8.0
NAMES = {"cli": ("--hires-scale", "--hires-size", "--hires-steps", "--hires-denoise", "--hires-upscaler"),
         "api": ("hires_scale=", "hires_size=", "hires_steps=", "hires_denoise=", "hires_upscaler=")}


@dataclass(frozen=True)
class Hires:
    """The second pass: width x height px, `steps` (None: the first pass's; it runs int(steps x denoise) of
    them, as img2img), `denoise` (the img2img strength), `upscaler` (UPSCALERS), `scale` as asked (None when
    a size was)."""
    width: int
    height: int
    steps: int | None
    denoise: float
    upscaler: str
    scale: float | None = None

    @property
    def latent(self) -> bool:
        return self.upscaler.startswith("latent")

    def record(self, steps: int) -> dict:
        """The PNG record's `hires` settings (what --from-png reruns: the scale when one was asked, else the
        size); `steps`: the first pass's."""
        return {"scale": self.scale, "size": f"{self.width}x{self.height}", "steps": self.steps or steps,
                "denoise": self.denoise, "upscaler": self.upscaler}


def upscaler_name(name, option: str) -> str:
    """precast's upscaler name for precast's or A1111's (any case)."""
    by = {k.lower(): k for k in UPSCALERS} | {v.lower(): k for k, v in UPSCALERS.items()}
    if not isinstance(name, str) or name.strip().lower() not in by:
        raise UserError(f"{shown(option, name)}: choose one of {', '.join(UPSCALERS)} (A1111's "
                        f"{', '.join(repr(v) for v in UPSCALERS.values())} work too)")
    return by[name.strip().lower()]


def check_hires(manifest, family, base: tuple[int, int], scale=None, size=None, steps=None, denoise=None,
                upscaler=None, base_steps: int = 20, names: str = "cli") -> Hires | None:
    """The hires options (None: not given) checked against the bundle, in the CLI's or the API's words
    (`names`), before anything loads: the second size (base x scale, floored to the VAE's multiple, or
    WIDTHxHEIGHT, at least the base on each side), inside a profile of the denoiser's engines; steps and
    the denoising strength leaving a step to run; the upscaler. None when neither scale nor size is given."""
    o_scale, o_size, o_steps, o_denoise, o_upscaler = NAMES[names]
    if scale is None and size is None:
        stray = next((o for o, v in ((o_steps, steps), (o_denoise, denoise), (o_upscaler, upscaler)) if v is not None),
                     None)
        if stray:
            raise UserError(f"{stray}: applies to the hires fix; give {o_scale} or {o_size} too")
        return None
    if scale is not None and size is not None:
        raise UserError(f"{o_size}: give {o_scale} or {o_size}, not both")
    what = shown(o_scale, scale) if scale is not None else shown(o_size, size, quote=True)
    if not (family.image_modes or family.img2img):
        raise UserError(f"{what}: the hires fix's second pass is img2img, which {family.title} bundles do not run "
                        "(SD 1.x/2.x/XL, Flux, Chroma, SD3, Z-Image and Qwen-Image do); generate at the larger size "
                        "instead")
    f = latent_factor(manifest)
    if scale is not None:
        scale = check_number(scale, o_scale, f"more than 1, e.g. {DEFAULTS['scale']:g}")
        if not 1 < scale <= MAX_SCALE:
            raise UserError(f"{what}: must be more than 1 and at most {MAX_SCALE:g}")
        width, height = (int(side * scale) // f * f for side in base)
        width, height = parse_size((width, height), manifest, o_scale)
    else:
        width, height = parse_size(size, manifest, o_size)
        if width < base[0] or height < base[1] or (width, height) == base:
            raise UserError(f"{what}: must be larger than the first pass's {base[0]}x{base[1]} (at least as large "
                            "on each side)")
    outside = outside_profiles(manifest, width, height)
    if outside:
        raise UserError(f"{what}: the second pass at {width}x{height} is {outside[0]}; rebuild with {outside[1]}, "
                        "or ask for a smaller hires size")
    upscaler = upscaler_name(DEFAULTS["upscaler"] if upscaler is None else upscaler, o_upscaler)
    if not upscaler.startswith("latent") and "vae_encoder" not in manifest.components:
        raise UserError(f"{shown(o_upscaler, upscaler)}: encodes the upscaled image with the VAE encoder, which this "
                        "bundle lacks: use a latent upscaler, or rebuild with vae_encoder in the recipe's components")
    if steps is not None:
        steps = check_steps(steps, o_steps)
    denoise = check_strength(DEFAULTS["denoise"] if denoise is None else denoise, o_denoise)
    if family.image_modes and start_index(steps or base_steps, denoise) >= (steps or base_steps):   # SD's rule
        raise UserError(f"{shown(o_denoise, denoise)} with {steps or base_steps} steps runs no step "
                        f"(int(steps x denoise) = 0): raise {o_denoise} or {o_steps}")
    return Hires(width, height, steps, denoise, upscaler, scale)


def upscale_latents(x: np.ndarray, height: int, width: int, upscaler: str) -> np.ndarray:
    """[N, C, h, w] -> [N, C, height, width], as torch.nn.functional.interpolate(x, size, mode) with mode
    "bilinear" (align_corners=False, no antialiasing: A1111's "Latent") or "nearest-exact"; another aspect
    ratio is centre-cropped to it first, as img2img crops an init image (runtime/images.py crop_box)."""
    left, top, cw, ch = crop_box(x.shape[3], x.shape[2], width, height)
    x = x[:, :, top:top + ch, left:left + cw]
    def axis(n_in: int, n_out: int):
        scale = n_in / n_out
        if upscaler == "latent-nearest-exact":
            i = np.minimum(np.floor((np.arange(n_out) + 0.5) * scale).astype(np.int64), n_in - 1)
            return i, i, np.zeros(n_out, np.float32)
        src = np.maximum((np.arange(n_out) + 0.5) * scale - 0.5, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        return i0, np.minimum(i0 + 1, n_in - 1), (src - i0).astype(np.float32)
    x = x.astype(np.float32)
    i0, i1, t = axis(x.shape[2], height)
    x = x[:, :, i0] * (1 - t)[:, None] + x[:, :, i1] * t[:, None]
    j0, j1, u = axis(x.shape[3], width)
    return np.ascontiguousarray(x[..., j0] * (1 - u) + x[..., j1] * u, dtype=np.float32)
