"""The image size a run generates: the bundle's default, the multiples its VAE and denoiser need, the
sides it allows, and whether its engines' shape profiles cover it.

Owns: `latent_factor` (pixels per latent: 2 ** (VAE levels - 1)), `optimal_size` (the denoiser profile's
opt: what generate and doctor default to), `image_size` / `parse_size` (a size given as WIDTHxHEIGHT or
(width, height), checked against the bundle), MAX_SIDE, and `size_warning` (a size no prebuilt engine
covers: compiled at run time; `outside_profiles`, what it says). Standard library only.
"""
from __future__ import annotations

import re

from .checks import shown
from .errors import UserError


def latent_factor(manifest) -> int:
    cfg = manifest.components.get("vae_decoder", {}).get("config", {})
    return 2 ** (int(cfg.get("decoder_levels", 4)) - 1)


DENOISERS = ("unet", "transformer")


def optimal_size(manifest) -> tuple[int, int]:
    """(width, height) in pixels when none is given: the 'opt' of the denoiser's first shape profile,
    the size its engines were built for (64x64 for the tiny demo bundle). `generate` and `doctor`
    both default to it."""
    comp = next((manifest.components[c] for c in DENOISERS if c in manifest.components),
                next(iter(manifest.components.values())))
    prof = comp["profiles"][0]
    return int(prof["width"][1]), int(prof["height"][1])


def image_size(manifest, width: int | None, height: int | None, factor: int, why: str = "") -> tuple[int, int]:
    """(width, height): as given, else the bundle's optimal size; refused unless multiples of `factor`."""
    opt_w, opt_h = optimal_size(manifest)
    width, height = width or opt_w, height or opt_h
    if width % factor or height % factor:
        raise UserError(f"--size {width}x{height}: width and height must be multiples of {factor}"
                        + (f" ({why})" if why else ""))
    return width, height


MAX_SIDE = 4096  # px per side, unless the bundle's shape profiles declare more
_SIZE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")


def parse_size(size: str | tuple[int, int], manifest, name: str = "--size") -> tuple[int, int]:
    """'WIDTHxHEIGHT' (or the API's (width, height) ints) -> (width, height), checked against the bundle:
    ASCII digits, multiples of its VAE's factor, at most MAX_SIDE px per side or the largest side its
    profiles declare. `name`: the option or keyword the errors name (runtime/checks.py's `shown`)."""
    if isinstance(size, str):
        m = _SIZE.fullmatch(size.strip())
        if not m:
            raise UserError(f"{shown(name, size, quote=True)}: expected WIDTHxHEIGHT in pixels, e.g. 512x512")
        w, h = int(m.group(1)), int(m.group(2))
    else:
        w, h = size
    f = latent_factor(manifest)
    declared = [p[dim][2] for c in manifest.components.values() for p in c["profiles"] for dim in ("width", "height")]
    limit = max([MAX_SIDE, *declared])
    if not (f <= w <= limit and f <= h <= limit):
        raise UserError(f"{shown(name, size)}: each side must be {f} to {limit} px "
                        f"(the larger of {MAX_SIDE} and this bundle's largest profile)")
    if w % f or h % f:
        raise UserError(f"{shown(name, size)}: width and height must be multiples of {f}")
    return w, h


def outside_profiles(manifest, width: int, height: int) -> tuple[str, str] | None:
    """(what, fix) when width x height lies outside every shape profile the denoiser's engines were built for:
    "outside every shape profile of this bundle's unet engines (512x512)" and the recipe profile that would
    cover it; None when one covers it or the denoiser has no engines (its ONNX takes any size)."""
    name = next((c for c in DENOISERS if c in manifest.components), None)
    profiles = manifest.components[name].get("profiles") or [] if name else []
    if not profiles or not manifest.artifacts(name) or any(
            p["width"][0] <= width <= p["width"][2] and p["height"][0] <= height <= p["height"][2] for p in profiles):
        return None

    def size(p, i):
        return f"{p['width'][i]}x{p['height'][i]}"

    def widened(key, want):
        lo, opt, hi = profiles[0][key]
        lo, hi = min(lo, want), max(hi, want)
        return str(lo) if lo == hi else f"{{min: {lo}, opt: {opt}, max: {hi}}}"
    have = ", ".join(size(p, 1) if size(p, 0) == size(p, 2) else f"{size(p, 0)}..{size(p, 2)}" for p in profiles)
    return (f"outside every shape profile of this bundle's {name} engines ({have})",
            f"a recipe profile covering it, e.g. profiles: {{height: {widened('height', height)}, "
            f"width: {widened('width', width)}}}")


def size_warning(manifest, width: int, height: int) -> str | None:
    """One line when width x height lies outside every shape profile the denoiser's engines were built
    for: no prebuilt engine takes it, so the ONNX is compiled at run time, on every run (seconds to
    minutes); it names the profiles and a recipe profile that would cover the size."""
    out = outside_profiles(manifest, width, height)
    return None if out is None else (f"size {width}x{height} is {out[0]}: its ONNX is compiled at run time instead, "
                                     f"on every run (slow); to avoid that, rebuild with {out[1]}")
