"""The value checks of a generation's settings that `precast generate` (runtime/run_commands.py) and the
Python API (runtime/api.py, runtime/generate.py) share, run before anything loads: steps, seed, batch,
count, guidance, strength, VAE tiling, prompt text, the output path, and the PNG write itself (the checks
that need the bundle's family -- scheduler, image mode, hires fix -- are runtime/generate.py's and
runtime/hires.py's).

Owns the wording: each mistake is one UserError line naming the setting as its caller spells it --
an option (`--steps 0: ...`) or a keyword (`steps='10': ...`, any name ending in "=") -- and the fix,
the same words from both. Types are checked too, since an app can pass anything: a bool or a str is
no number here, a float no whole number. Imports the runtime's own modules only, lazily.
"""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

from .errors import UserError
from .png import write_png

MAX_STEPS = 1000   # the schedules' training timesteps: more steps than that repeat timesteps


SHOWN = 120      # characters of a value an error line shows (a 1 MB prompt is not echoed back)


def shown(name: str, value, quote: bool = False) -> str:
    """A setting and its value as an error names them: `--steps 0` (an option; `quote`: its value
    repr'd) or `steps='10'` (a keyword, ending in "=": always repr'd); a long value cut to SHOWN characters."""
    text = repr(value) if quote or name.endswith("=") else str(value)
    if len(text) > SHOWN:
        text = f"{text[:SHOWN]}... ({len(text)} characters)"
    return f"{name}{text}" if name.endswith("=") else f"{name} {text}"


def is_int(value) -> bool:
    """A whole number: int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_number(value, name: str, example: str) -> float:
    """A finite real number (not a bool, not a str) -> float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"{shown(name, value)}: must be a finite number, {example}")
    return float(value)


def check_steps(steps, name: str = "--steps") -> int:
    if not is_int(steps) or not 1 <= steps <= MAX_STEPS:
        raise UserError(f"{shown(name, steps)}: must be a whole number from 1 to {MAX_STEPS} "
                        "(the noise schedule's timesteps)")
    return int(steps)


def check_seed(seed, name: str = "--seed") -> int:
    if not is_int(seed) or seed < 0:
        raise UserError(f"{shown(name, seed)}: must be a whole number, 0 or more (negative seeds are refused)")
    return int(seed)


MAX_BATCH = 64      # images per run (the compiler's largest profile batch)
MAX_COUNT = 10000   # runs


def check_batch(batch, name: str = "--batch") -> int:
    """Images generated together (one denoiser call where the bundle's profiles allow it)."""
    if not is_int(batch) or not 1 <= batch <= MAX_BATCH:
        raise UserError(f"{shown(name, batch)}: must be a whole number from 1 to {MAX_BATCH} (images per run)")
    return int(batch)


def check_count(count, name: str = "--count") -> int:
    """Runs, one after another."""
    if not is_int(count) or not 1 <= count <= MAX_COUNT:
        raise UserError(f"{shown(name, count)}: must be a whole number from 1 to {MAX_COUNT} (runs, one after another)")
    return int(count)


MAX_GUIDANCE = 1000.0     # |guidance| past this is no setting a UI offers (A1111 30, ComfyUI 100); 1e39 overflows fp32


def check_guidance(guidance, name: str = "--guidance") -> float:
    value = check_number(guidance, name, "e.g. 7.5")
    if abs(value) > MAX_GUIDANCE:
        raise UserError(f"{shown(name, guidance)}: must be from -{MAX_GUIDANCE:g} to {MAX_GUIDANCE:g}, e.g. 7.5")
    return value


def check_strength(strength, name: str = "--strength") -> float:
    """img2img / inpainting's share of the schedule: more than 0, at most 1."""
    share = check_number(strength, name, "more than 0 and at most 1")
    if not 0 < share <= 1:
        raise UserError(f"{shown(name, strength)}: must be more than 0 and at most 1 "
                        "(the share of the schedule run from the noised image; 1 = from pure noise)")
    return share


def check_vae_tiling(tiling, tile, factor: int, names: str = "cli") -> tuple[bool | None, int | None]:
    """(tiling, tile): VAE tiling forced (True), never (False) or when needed (None), and the tile's side in
    pixels (None: the default), a multiple of the VAE's `factor` pixels per latent, 8 latents at least."""
    t_name, s_name = ("--vae-tiling", "--vae-tile") if names == "cli" else ("vae_tiling=", "vae_tile=")
    if tiling is not None and not isinstance(tiling, bool):
        raise UserError(f"{shown(t_name, tiling)}: expected True (always tile), False (never) or None (when the "
                        "image is past the VAE engine's profile or its memory)")
    if tile is not None and (not is_int(tile) or tile < 8 * factor or tile % factor or tile > 16384):
        raise UserError(f"{shown(s_name, tile)}: must be a whole number of pixels from {8 * factor} to 16384, a "
                        f"multiple of {factor} (the VAE's pixels per latent), e.g. 512")
    return tiling, None if tile is None else int(tile)


def check_text(text, name: str) -> str:
    """A prompt: text that encodes as UTF-8."""
    if not isinstance(text, str):
        raise UserError(f"{shown(name, text)}: expected text (str)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        label = shown(name, text) if name.endswith("=") else name     # the CLI's text cannot be printed
        raise UserError(f"{label}: not valid UTF-8 text; pass it in UTF-8 (check the terminal's locale)") from None
    return text


def check_out(out, name: str = "--out") -> Path:
    """Refuse a path that cannot become a PNG file before any work is done."""
    if not isinstance(out, (str, os.PathLike)):
        raise UserError(f"{shown(name, out)}: expected a file path such as image.png")
    out = os.fsdecode(out)
    path = Path(out)
    if path.is_dir() or out.endswith(os.sep):
        raise UserError(f"{shown(name, out)}: is a folder; give a file path such as {path / 'image.png'}")
    if os.path.lexists(path) and not path.is_file():
        raise UserError(f"{shown(name, out)}: exists and is not a regular file (a device, pipe or broken link); "
                        "choose another path")
    if not path.parent.is_dir():
        raise UserError(f"{shown(name, out)}: folder {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"{shown(name, out)}: folder {path.parent} is not writable; choose another path")
    if path.suffix.lower() != ".png":   # never a PNG written over a checkpoint or under a .jpg name
        raise UserError(f"{shown(name, out)}: precast writes PNG images; give a path ending in .png, "
                        f"such as {path.with_suffix('.png')}")
    return path


def write_image(path: Path, image, name: str = "--out", text: dict[str, str] | None = None) -> None:
    """The PNG (with `text` chunks: runtime/png.py) is written to a temp file beside `path` and renamed
    into place (write_png removes the temp file on any failure, so a failed write leaves nothing behind)."""
    try:
        write_png(path, image, text)
    except OSError as e:
        raise UserError(f"{shown(name, str(path))}: cannot write ({e.strerror or e})") from None
