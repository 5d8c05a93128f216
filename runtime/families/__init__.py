"""The model families the runtime runs, one module each, found by the manifest's `model.family`: sd.py (SD 1.x, 2.x,
XL and the XL refiner), flux.py (Flux.1 dev / schnell and Chroma), sd3.py (SD3 and SD3.5), zimage.py (Z-Image),
flux2.py (FLUX.2 klein and dev), qwenimage.py (Qwen-Image). Nothing else in the runtime branches on a family's name: it asks
the family's record (family.py) through `family_of` / `FAMILIES`. Facts the compiler needs too (latent scale and
shift, the released models' flow schedules and T5 lengths, the denoiser, the patch size) are read from here, so they
are written once. A new family is a module here, listed in MODULES.
"""
from __future__ import annotations

from ..errors import UserError
from ..image_size import DENOISERS, latent_factor
from . import flux, flux2, qwenimage, sd, sd3, zimage
from .family import Family, Flow

MODULES = (sd, flux, sd3, zimage, flux2, qwenimage)
FAMILIES: dict[str, Family] = {f.name: f for m in MODULES for f in m.FAMILIES}

__all__ = ["FAMILIES", "Family", "Flow", "component_requests", "family_of", "missing_for_generate"]


def family_of(manifest) -> Family:
    """The family of a bundle's manifest, or one UserError naming it and the families this precast runs."""
    name = manifest.model.get("family")
    if name not in FAMILIES:
        raise UserError(f"{manifest.root}: model.family {name!r} is not one this precast runs "
                        f"({', '.join(FAMILIES)}); a newer precast may: upgrade, or rebuild the bundle")
    return FAMILIES[name]


def missing_for_generate(manifest) -> list[str]:
    """The components `generate` needs for this bundle's family that the bundle does not have."""
    family = FAMILIES.get(manifest.model.get("family"))
    return [c for c in family.needs if c not in manifest.components] if family else []


def component_requests(manifest, batch: int, height: int, width: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """The input shapes each component of the bundle is called with at this size: the family's requests, which
    read the denoiser's inputs; for a bundle without one (a VAE or a text encoder shipped alone), the VAE decoder's
    latents from its own input's channels and the others at their profiles' sizes."""
    family = family_of(manifest)
    if any(d in manifest.components for d in DENOISERS):
        return family.requests(manifest, batch, height, width)
    vae = manifest.components.get("vae_decoder")
    shape = next((i.get("shape") for i in vae["inputs"] if i["name"] == "latent_sample"), None) if vae else None
    if not (isinstance(shape, list) and len(shape) == 4 and type(shape[1]) is int):
        return {}
    f = latent_factor(manifest)
    return {"vae_decoder": {"latent_sample": (batch, shape[1], height // f, width // f)}}
