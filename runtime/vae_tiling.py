"""VAE tiling: latents decoded (and images encoded) in overlapping tiles, blended, so an image past the VAE
engine's shape profile, or past its device's memory, is made by that engine at a size it takes (what
diffusers' AutoencoderKL.tiled_decode / tiled_encode, ComfyUI's VAEDecodeTiled and stable-diffusion.cpp do;
the code is precast's own).

Owns: `Tiling` (one pass's tile and overlap, in latents, and why), `plan` (whether a pass is tiled and how:
forced, past the loaded engine's profile, past the memory budget), `tile_requests` (the VAE shapes selection
asks for when the image is past every profile of the component, so its engine is chosen for the tiles),
`run_tiled` (tiles cut, run, blended), `vae_bytes` (the memory a pass's size is estimated to take).

Tiles are placed in latent space: along each side as few tiles of `tile` latents as overlap by `overlap`
latents or more, spread evenly edge to edge (every tile the same size, as a fixed-shape engine needs). Each
tile's output is weighted by a separable linear ramp rising across the whole overlap (the least along that
side) from each of its edges, and the
weighted sum divided by the sum of the weights (ComfyUI's feathered blend), so across an overlap one tile
fades into the next. The VAE's GroupNorms and attention see one tile at a time: a tiled image is close to
the plain one, not equal (the closer the larger the tiles). Standard library and numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_TILE = 512        # px per tile side when none is asked (diffusers' default for SD, at most the engine's)
OVERLAP = 4               # the overlap is 1/OVERLAP of the tile (diffusers' tile_overlap_factor 0.25)
BYTES_PER_PIXEL = 4608    # a VAE pass's peak per pixel: SD's VAE, fp32, 4438 measured (benchmarks/generate_features.py)
MIN_TILE = 16             # latents: the smallest tile a memory budget shrinks to
INPUTS = {"vae_decoder": ("latent_sample", True), "vae_encoder": ("sample", False)}   # (input, fed latents)


@dataclass(frozen=True)
class Tiling:
    """How one VAE pass is tiled: tiles of tile_h x tile_w latents overlapping by `overlap` latents."""
    tile_h: int
    tile_w: int
    overlap: int
    why: str

    def grid(self, h: int, w: int) -> tuple[int, int]:
        """(rows, columns) of tiles over h x w latents."""
        return len(starts(h, self.tile_h, self.overlap)), len(starts(w, self.tile_w, self.overlap))

    def record(self, h: int, w: int, factor: int) -> dict:
        """What the PNG's record and generate's report say of it (pixels; the overlap: the least there is)."""
        rows, cols = self.grid(h, w)
        least = min(overlaps(n, t, self.overlap) for n, t in ((h, self.tile_h), (w, self.tile_w)) if n > t)
        return {"tiles": f"{cols}x{rows}", "tile": f"{self.tile_w * factor}x{self.tile_h * factor}",
                "overlap": least * factor, "why": self.why}


def vae_bytes(height: int, width: int) -> int:
    """Estimated peak bytes of one VAE pass over a height x width px image (activations, fp32)."""
    return BYTES_PER_PIXEL * height * width


def starts(length: int, tile: int, overlap: int) -> list[int]:
    """Where the tiles along one side begin: one tile when it fits, else as few as overlap by `overlap` or
    more, evenly spread from 0 to length - tile."""
    if length <= tile:
        return [0]
    n = -(-(length - overlap) // (tile - overlap))
    return [(i * (length - tile) + (n - 1) // 2) // (n - 1) for i in range(n)]


def overlaps(length: int, tile: int, overlap: int) -> int:
    """The least overlap of neighbouring tiles along one side (0 for one tile): `overlap` or more."""
    at = starts(length, tile, overlap)
    return tile - max(b - a for a, b in zip(at, at[1:])) if len(at) > 1 else 0


def ramp(size: int, overlap: int) -> np.ndarray:
    """[size] weights: rising linearly over `overlap` from each end, 1 between (never 0)."""
    i = np.arange(size, dtype=np.float32)
    return np.minimum(1.0, np.minimum(i + 1, size - i) / np.float32(overlap + 1)).astype(np.float32)


def plan(hw: tuple[int, int], engine: tuple[tuple[int, int], tuple[int, int]] | None, forced: bool | None,
         tile_px: int | None, factor: int, budget: int | None, what: str = "its engine") -> Tiling | None:
    """The tiling of a pass over hw = (h, w) latents, or None for one plain call. `engine`: ((min, max) of h,
    (min, max) of w) in latents the loaded engine takes, None for any (the ONNX compiled at run time);
    `forced`: True (--vae-tiling), False (never), None (when the image is past the engine's profile or
    `budget` bytes); `tile_px`: the tile side asked for (default DEFAULT_TILE), kept within the engine's
    profile and shrunk (halved) until a tile's estimate fits the budget."""
    if forced is False:
        return None
    h, w = hw
    px = f"{w * factor}x{h * factor} px"
    why = "--vae-tiling" if forced else None
    if why is None and engine and (h > engine[0][1] or w > engine[1][1]):
        why = f"{px} is past the largest size {what} takes, {engine[1][1] * factor}x{engine[0][1] * factor} px"
    if why is None and budget is not None and vae_bytes(h * factor, w * factor) > budget:
        why = f"{px} is estimated at {vae_bytes(h * factor, w * factor) / 2**30:.1f} GiB, past the " \
              f"{budget / 2**30:.1f} GiB its device has for it"
    if why is None:
        return None
    t = (tile_px or DEFAULT_TILE) // factor
    while budget is not None and t > MIN_TILE and vae_bytes(t * factor, t * factor) > budget:
        t //= 2
    th = tw = t
    if engine:      # a tile size the engine takes
        th, tw = (max(lo, min(t, hi)) for lo, hi in engine)
    th, tw = min(th, h), min(tw, w)
    if (th, tw) == (h, w):
        return None
    return Tiling(th, tw, min(th, tw) // OVERLAP, why)


def tile_requests(manifest, reqs: dict, forced: bool | None, tile_px: int | None, factor: int) -> dict:
    """`reqs` (component -> input -> shape, for selection) with a VAE component's shape replaced by its tile's
    when it will be tiled: forced, or the image past every profile the component's engines were built for."""
    out = dict(reqs)
    for comp, (name, latent) in INPUTS.items():
        shape = (reqs.get(comp) or {}).get(name)
        spec = manifest.components.get(comp)
        if shape is None or spec is None or forced is False:
            continue
        unit = 1 if latent else factor
        h, w = shape[2] // unit, shape[3] // unit          # latents
        profiles = [((p["height"][0] // factor, p["height"][2] // factor), (p["width"][0] // factor,
                     p["width"][2] // factor)) for p in spec.get("profiles") or []] if manifest.artifacts(comp) else []
        if not forced and (not profiles or any(hh[0] <= h <= hh[1] and ww[0] <= w <= ww[1] for hh, ww in profiles)):
            continue
        engine = max(profiles, key=lambda p: p[0][1] * p[1][1]) if profiles else None
        tiling = plan((h, w), engine, True, tile_px, factor, None)
        if tiling is not None:
            out[comp] = {**reqs[comp], name: (*shape[:2], tiling.tile_h * unit, tiling.tile_w * unit)}
    return out


def run_tiled(run, x: np.ndarray, tiling: Tiling, factor: int, decode: bool) -> np.ndarray:
    """run(tile) -> output over x in tiles, blended: decode, x latents [N, C, h, w] -> [N, C', h*f, w*f];
    encode, x pixels [N, C, h*f, w*f] -> [N, C', h, w]. Tiles are placed in latents either way."""
    into, out_f = (1, factor) if decode else (factor, 1)
    h, w = x.shape[2] // into, x.shape[3] // into
    th, tw = min(tiling.tile_h, h), min(tiling.tile_w, w)
    weight = ramp(th * out_f, overlaps(h, th, tiling.overlap) * out_f)[:, None] * \
        ramp(tw * out_f, overlaps(w, tw, tiling.overlap) * out_f)[None, :]
    out = total = None
    for y in starts(h, th, tiling.overlap):
        for x0 in starts(w, tw, tiling.overlap):
            t = np.asarray(run(np.ascontiguousarray(x[:, :, y * into:(y + th) * into, x0 * into:(x0 + tw) * into])),
                           np.float32)
            if out is None:
                out = np.zeros((x.shape[0], t.shape[1], h * out_f, w * out_f), np.float32)
                total = np.zeros((h * out_f, w * out_f), np.float32)
            rows, cols = slice(y * out_f, (y + th) * out_f), slice(x0 * out_f, (x0 + tw) * out_f)
            out[:, :, rows, cols] += t * weight
            total[rows, cols] += weight
    return out / total
