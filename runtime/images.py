"""Image inputs of image-conditioned generation (img2img's init image, inpainting's mask), in numpy.

Owns the rules an input image goes through before the VAE encoder sees it:
- Reading: a PNG path (runtime/png.py's reader) or an array (numpy uint8 [H, W], [H, W, C] with C
  1 to 4, or anything np.asarray turns into one, such as a PIL image).
- Colour: greyscale becomes RGB (the grey repeated); an alpha channel is composited onto WHITE
  (a transparent pixel reads as white, as an image viewer shows it), rounded to uint8.
- Masks: reduced to one channel with the ITU-R 601 luma PIL's convert("L") uses (the integer formula,
  so a mask gives the same values as through diffusers' VaeImageProcessor); a mask's alpha channel is
  ignored (as convert("L") ignores it). After sizing, binarized as diffusers' mask_processor does
  (do_binarize: value / 255 >= 0.5 -> 1, i.e. luma >= 128, white = repaint; no normalization).
- Output size: `--size` when given; else the init image's own size, which must then be a multiple of
  the bundle's pixels per latent (8) on both sides (else one line: give --size). diffusers rounds it
  down and stretches instead; precast refuses rather than distort silently.
- Sizing: an image whose size is not the output size is centre-cropped to the output's aspect ratio
  (the crop rounded to whole pixels), then resized with a bilinear (triangle) filter, antialiased when
  downscaling (the filter widened by the scale factor, as PIL's Image.BILINEAR does), in float32.
  An image already at the output size is used as is (so the pipelines match diffusers bit for bit
  there). A mask must have the init image's size (else one line); it is then sized by the same rule.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import UserError
from .png import read_png

ImageSource = "str | os.PathLike | np.ndarray"


def _name(source, what: str) -> str:
    return f"{what} {source}" if isinstance(source, (str, os.PathLike)) else f"{what} (array)"


def load_pixels(source, what: str) -> np.ndarray:
    """uint8 [H, W, C] (C 1 to 4) from a PNG path or an array; UserError (one line) otherwise."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"{what} {source}: no such file" if not path.exists() else f"{what} {source}: not a file")
        return read_png(path, what)
    try:
        arr = np.asarray(source)
    except Exception as e:  # noqa: BLE001 - anything np.asarray refuses is a bad argument
        raise UserError(f"{what}: expected a PNG path or a uint8 array, got {type(source).__name__} ({e})") from None
    if arr.dtype.kind not in "biuf":       # None, bytes, text, objects: no pixels
        raise UserError(f"{what}: expected a PNG path (str or os.PathLike) or a uint8 array, got {type(source).__name__}")
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8) * 255
    if arr.dtype != np.uint8:
        raise UserError(f"{what}: expected a uint8 array (0..255), got {arr.dtype}; "
                        "convert with (x * 255).round().astype(np.uint8)")
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or not 1 <= arr.shape[2] <= 4 or not arr.shape[0] or not arr.shape[1]:
        raise UserError(f"{what}: expected an [H, W] or [H, W, C] uint8 array (C 1 to 4), got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def to_rgb(px: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3]: grey repeated, alpha composited onto white (rounded)."""
    c = px.shape[2]
    color = px[..., :3] if c >= 3 else np.repeat(px[..., :1], 3, axis=2)
    if c in (2, 4):
        a = px[..., -1:].astype(np.uint32)
        color = ((color.astype(np.uint32) * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)
    return np.ascontiguousarray(color)


def to_luma(px: np.ndarray) -> np.ndarray:
    """uint8 [H, W]: grey as stored; RGB by PIL's convert("L") integer luma (alpha ignored)."""
    if px.shape[2] < 3:
        return px[..., 0].copy()
    r, g, b = (px[..., i].astype(np.uint32) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)


def output_size(image: np.ndarray, what: str, source, factor: int) -> tuple[int, int]:
    """(width, height) when no size is given: the init image's own, multiples of `factor` only."""
    h, w = image.shape[:2]
    if w % factor or h % factor:
        fw, fh = max(factor, w // factor * factor), max(factor, h // factor * factor)
        give = f"--size WIDTHxHEIGHT (e.g. {fw}x{fh}" if what.startswith("--") else f"size=(width, height) (e.g. ({fw}, {fh})"
        raise UserError(f"{_name(source, what)} is {w}x{h}, not multiples of {factor}: give {give}; the image is "
                        "centre-cropped to its aspect ratio and resized)")
    return w, h


def crop_box(w: int, h: int, out_w: int, out_h: int) -> tuple[int, int, int, int]:
    """(left, top, width, height) of the centre crop of a w x h image to out_w:out_h."""
    if w * out_h > out_w * h:               # wider than the output: crop the sides
        cw = max(1, min(w, round(h * out_w / out_h)))
        return (w - cw) // 2, 0, cw, h
    ch = max(1, min(h, round(w * out_h / out_w)))
    return 0, (h - ch) // 2, w, ch


def _weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] bilinear (triangle) weights, the support widened by the scale when downscaling
    (antialiasing), each row normalized: PIL's resampling coefficients for BILINEAR, in float."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    centers = (np.arange(n_out) + 0.5) * scale
    x = np.arange(n_in) + 0.5
    w = np.clip(1.0 - np.abs(x[None, :] - centers[:, None]) / support, 0.0, None)
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """float32 [height, width, C] from [H, W, C]: separable antialiased bilinear."""
    h, w = image.shape[:2]
    x = image.astype(np.float32)
    if (h, w) == (height, width):
        return x
    x = np.einsum("oh,hwc->owc", _weights(h, height), x)
    return np.einsum("ow,hwc->hoc", _weights(w, width), x)


def fit(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """float32 [height, width, C] (values as the input's): centre-cropped to width:height, resized."""
    h, w = image.shape[:2]
    if (w, h) == (width, height):
        return image.astype(np.float32)
    left, top, cw, ch = crop_box(w, h, width, height)
    return resize(image[top:top + ch, left:left + cw], width, height)


def init_image(source, what: str = "--init-image") -> np.ndarray:
    """uint8 [H, W, 3] at the image's own size."""
    return to_rgb(load_pixels(source, what))


def mask_image(source, like: np.ndarray, what: str = "--mask") -> np.ndarray:
    """uint8 [H, W] luma, checked to have the init image `like`'s size."""
    luma = to_luma(load_pixels(source, what))
    if luma.shape != like.shape[:2]:
        raise UserError(f"{_name(source, what)} is {luma.shape[1]}x{luma.shape[0]} but the init image is "
                        f"{like.shape[1]}x{like.shape[0]}: a mask must have the init image's size (resize it to match)")
    return luma


def image_tensor(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """float32 [1, 3, height, width] in [-1, 1] (VaeImageProcessor's normalize: x / 255 * 2 - 1)."""
    x = fit(rgb, width, height) / np.float32(255.0)
    return (x * 2 - 1).transpose(2, 0, 1)[None].astype(np.float32)


def mask_tensor(luma: np.ndarray, width: int, height: int) -> np.ndarray:
    """float32 [1, 1, height, width] of 0 (keep) and 1 (repaint): mask_processor's binarize."""
    x = fit(luma[..., None], width, height)[..., 0] / np.float32(255.0)
    return (x >= 0.5).astype(np.float32)[None, None]
