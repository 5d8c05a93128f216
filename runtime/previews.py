"""Step previews: what the image looks like while it is denoised, made from the sampler's current estimate of
the clean latents, in numpy.

Owns: the preview methods and their names (ComfyUI's --preview-method: auto, latent2rgb, taesd), the linear
latent -> RGB projection (`project`: a family's LatentRGB factors and bias, as ComfyUI's Latent2RGBPreviewer and
stable-diffusion.cpp apply them; at the latents' resolution), a decoder's [-1, 1] output as uint8 pixels
(`to_pixels`, ComfyUI's preview_to_image), nearest upscaling to the image's size (`upscale`) and the check of
the method against a bundle (`check_preview`). Running a preview decoder (a TAESD-style tiny autoencoder, the
bundle's `preview_decoder`) is runtime/loading.py's; calling the previews each step is runtime/step_hooks.py's.
"""
from __future__ import annotations

import numpy as np

from .errors import UserError

METHODS = ("auto", "latent2rgb", "taesd")   # auto: the bundle's preview decoder where it has one, else latent2rgb
PREVIEW_DECODER = "preview_decoder"          # the bundle component a recipe's `preview:` builds


def check_preview(method, components, latent_rgb, name: str = "preview=") -> str:
    """The preview method a run uses, "taesd" or "latent2rgb" ("auto": taesd where the bundle has a preview
    decoder), checked against the bundle's components and family: one UserError naming `name` and the fix
    otherwise."""
    if method not in METHODS:
        raise UserError(f"{name}{method!r}: choose one of {', '.join(METHODS)}")
    if method == "auto":
        method = "taesd" if PREVIEW_DECODER in components or latent_rgb is None else "latent2rgb"
    if method == "taesd" and PREVIEW_DECODER not in components:
        raise UserError(f"{name}{method!r}: this bundle has no preview decoder; rebuild it with `preview: {{path: "
                        "taesd_decoder.safetensors}` in the recipe (a TAESD / TAESDXL / TAESD3 / TAEF1 file)"
                        + (", or use latent2rgb" if latent_rgb is not None else ""))
    if method == "latent2rgb" and latent_rgb is None:
        raise UserError(f"{name}{method!r}: this bundle's family has no latent -> RGB projection; use taesd")
    return method


def project(latents: np.ndarray, factors, bias) -> np.ndarray:
    """uint8 [h, w, 3]: latents [C, h, w] (the denoiser's space) projected to RGB in [-1, 1] by the [C, 3]
    factors plus the bias, then mapped to 0..255 as a decoded image is."""
    rgb = np.tensordot(np.asarray(factors, np.float32), latents.astype(np.float32), axes=(0, 0))   # [3, h, w]
    return to_pixels(rgb + np.asarray(bias, np.float32)[:, None, None])


def to_pixels(image: np.ndarray) -> np.ndarray:
    """[3, H, W] in [-1, 1] -> uint8 [H, W, 3] (clipped, rounded as generate writes images)."""
    return (np.clip(image.transpose(1, 2, 0) / 2 + 0.5, 0.0, 1.0) * 255).round().astype(np.uint8)


def upscale(image: np.ndarray, factor: int) -> np.ndarray:
    """uint8 [h, w, 3] -> [h * factor, w * factor, 3], nearest neighbour (a projection at the latents'
    resolution shown at the image's)."""
    return image if factor <= 1 else image.repeat(factor, axis=0).repeat(factor, axis=1)
