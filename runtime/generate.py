"""One generation, as the Python API and `precast generate` both run it: the settings checked and defaulted
once, the bundle family's pipeline called, an `Image` back.

Owns: `Pipeline` (a family's pipeline, loaded, called per image: settings -> defaults from the family and
the bundle -> image mode -> ControlNets -> the per-step hooks -> `Image`), `Image`, the step hooks (a
progress callback, a cancel hook raising `Cancelled`), and the checks that need the bundle's family:
`check_scheduler`, `check_image_mode` (the family's own), `check_settings`, `control_entries` (the API's
`controls=`). Value checks are runtime/checks.py's; the pipelines are runtime/families/'s.
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from .assign import module_of
from .checks import (check_guidance, check_number, check_out, check_seed, check_steps, check_text, shown,
                     write_image)
from .errors import Cancelled, UserError
from .families import FAMILIES, family_of
from .loading import BundleModel, to_uint8
from .report import Report, plan_of, report_of
from .control import check_net, check_range, plan_controls
from .images import init_image
from .png import png_bytes

ImageInput = Union[str, os.PathLike, np.ndarray]     # a PNG path, or uint8 [H, W] / [H, W, C] (C 1 to 4)
ControlSpec = tuple                                   # (ControlNet name, image[, scale[, start, end]])
StepCallback = Callable[[int, int], None]             # (steps done, total steps)
CancelHook = Union[Callable[[], bool], threading.Event, None]


# ---- settings that depend on the family -----------------------------------------------------------
def check_scheduler(scheduler, manifest, name: str = "--scheduler") -> str | None:
    """The scheduler asked for, lower case (None: the family's default), checked against the bundle's family:
    one of the samplers it runs ("euler" also names flow-matching Euler, where that is the only one)."""
    if scheduler is None:
        return None
    groups: dict[tuple, list[str]] = {}
    for f in FAMILIES.values():
        groups.setdefault(f.samplers, []).append(f.title)
    known = [s for samplers in groups for s in samplers]
    sched = scheduler.lower() if isinstance(scheduler, str) else None
    if sched not in ("", *known):
        raise UserError(f"{shown(name, scheduler)}: choose one of " + " or ".join(
            f"{', '.join(samplers)} ({' / '.join(titles)})" for samplers, titles in groups.items()))
    family = family_of(manifest)
    if len(family.samplers) == 1 and sched in ("", "euler", family.samplers[0]):
        return None                          # its one sampler ("euler" names flow-matching Euler too)
    if sched in ("", *family.samplers):
        return sched or None
    if len(family.samplers) == 1:
        raise UserError(f"{shown(name, scheduler)}: {family.name} samples with {family.samplers[0]} (the scheduler it "
                        f"was trained for); leave {name.rstrip('=')} out")
    owners = " / ".join(f.title for f in FAMILIES.values() if sched in f.samplers)
    raise UserError(f"{shown(name, scheduler)}: is {owners}'s; {family.name} bundles take "
                    f"{' or '.join(family.samplers)}")


def check_image_mode(manifest, init: bool, mask: bool, strength: float | None, steps: int,
                     names: str = "cli") -> tuple[str, float | None]:
    """(mode, strength): txt2img, or img2img / inpainting where the family runs them, checked by the family
    (runtime/families/) before anything loads."""
    return family_of(manifest).check_mode(manifest, init, mask, strength, steps, names)


def check_settings(manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel) -> str | None:
    """The settings `precast generate` checks before loading anything, in its words (runtime/checks.py)
    named as keywords (None: the default); returns the scheduler, lower case (None: the default)."""
    check_text(prompt, "prompt=")
    check_text(negative, "negative=")
    if steps is not None:
        check_steps(steps, "steps=")
    check_seed(seed, "seed=")
    if guidance is not None:
        check_guidance(guidance, "guidance=")
    if on_step is not None and not callable(on_step):
        raise UserError(f"on_step={on_step!r}: expected a callable taking (steps done, total steps), or None")
    _stop_check(cancel)
    return check_scheduler(scheduler, manifest, "scheduler=")


def unused_negative(manifest) -> str | None:
    """Why a negative prompt does nothing with this bundle's family, or None when it is used."""
    family = family_of(manifest)
    return None if family.negative else f"is not used by {family.title} (distilled guidance, no negative prompt)"


def control_entries(manifest, controls: Sequence[ControlSpec] | None, guess_mode: bool) -> list[tuple]:
    """`controls=` checked before anything loads: each (name, image[, scale[, start, end]]) entry ->
    (name, uint8 RGB image, scale, start, end), its numbers, its image, then its net against the bundle
    (runtime/control.py's checks, as for --controlnet / --control-start / --control-end)."""
    entry = "(controlnet name, image[, scale[, start, end]])"
    if controls is None:
        controls = ()
    if isinstance(controls, (str, bytes, Mapping, np.ndarray)) or not isinstance(controls, Iterable):
        raise UserError(f"controls=: expected a list of {entry} tuples, got {type(controls).__name__}")
    out = []
    for i, c in enumerate(controls):
        at = f"controls[{i}]"
        if not isinstance(c, (tuple, list)) or len(c) not in (2, 3, 5):
            got = f"{len(c)} items" if isinstance(c, (tuple, list)) else type(c).__name__
            raise UserError(f"{at}: expected {entry}, got {got}")
        if not isinstance(c[0], str):
            raise UserError(f"{at}: the first item names the ControlNet (a str, e.g. 'canny'), got {type(c[0]).__name__}")
        scale = check_number(c[2], f"{at} scale=", "e.g. 0.8") if len(c) > 2 else 1.0
        start, end = (check_number(c[3], f"{at} start=", "a fraction of the steps, e.g. 0"),
                      check_number(c[4], f"{at} end=", "a fraction of the steps, e.g. 1")) if len(c) == 5 else (0.0, 1.0)
        check_range(start, end, f"{at} start={start!r}, end={end!r}")
        image = init_image(c[1], f"{at} image")
        check_net(manifest, c[0], f"{at} name=")
        out.append((c[0], image, scale, start, end))
    if guess_mode and not out:
        raise UserError("guess_mode=True: give controls too")
    return out


# ---- images --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Image:
    """A generated image and the settings that made it."""
    pixels: np.ndarray                       # float32 [H, W, 3] in [0, 1]
    prompt: str
    negative: str
    seed: int
    steps: int
    guidance: float
    scheduler: str
    warnings: tuple[str, ...] = ()           # prompt cut off by a text encoder, unused negative prompt
    mode: str = "txt2img"                    # txt2img | img2img | inpaint
    strength: float | None = None            # img2img / inpaint: the share of the schedule run

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.pixels.shape[1], self.pixels.shape[0]

    def to_uint8(self) -> np.ndarray:
        """[H, W, 3] uint8, rounded as `precast generate` writes it."""
        return to_uint8(self.pixels)

    def png(self) -> bytes:
        """The PNG file's bytes: the same bytes `precast generate --out` writes for this image."""
        return png_bytes(self.to_uint8())

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the PNG as `precast generate --out` does: `path` checked first (a .png file in a folder
        that exists; UserError, one line, otherwise), then a temp file renamed into place, so a failed
        write leaves nothing behind."""
        out = check_out(path, "path=")
        write_image(out, self.to_uint8(), "path=")
        return out


# ---- the per-step hooks --------------------------------------------------------------------------
def _stop_check(cancel: CancelHook) -> Callable[[], bool] | None:
    if cancel is None:
        return None
    if isinstance(cancel, threading.Event) or hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise UserError(f"cancel={cancel!r}: expected a callable returning True to stop, or a threading.Event")


@dataclass
class _StepHook:
    """BundleModel.step_hook for one call: `stop` asked before each step and before decoding
    (Cancelled if it says stop), `on_step(done, total)` called after each step."""
    stop: Callable[[], bool] | None
    on_step: StepCallback | None

    def before(self, i: int, total: int) -> None:
        if self.stop is not None and self.stop():
            raise Cancelled(i, total)

    def after(self, done: int, total: int) -> None:
        if self.on_step is not None:
            self.on_step(done, total)


@contextmanager
def _step_hooks(pipe: BundleModel, on_step: StepCallback | None, cancel: CancelHook) -> Iterator[None]:
    """The pipeline's step_hook set for one call (none when there is nothing to call)."""
    stop = _stop_check(cancel)
    pipe.step_hook = _StepHook(stop, on_step) if on_step is not None or stop is not None else None
    try:
        yield
    finally:
        pipe.step_hook = None


# ---- the pipeline --------------------------------------------------------------------------------
class Pipeline:
    """A bundle's reference pipeline (its family's), loaded once and called per image. `report` is what
    was loaded where (load failures that fell back included)."""

    def __init__(self, path: Path, pipe: BundleModel):
        self.path, self.pipe = path, pipe
        self.family: str = pipe.family
        self.size: tuple[int, int] = (pipe.width, pipe.height)
        self.defaults: dict = dict(pipe.defaults)

    @property
    def report(self) -> Report:
        r = self.pipe.report()
        plans = {c: plan_of(r["components"][c], self.pipe.placements[module_of(c)]) for c in self.pipe.needed}
        return report_of(self.path, self.pipe.manifest, self.size, self.pipe.devices, self.pipe.device_warning,
                         self.pipe.installed, self.pipe.placements, plans)

    def __call__(self, prompt: str, *, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, scheduler: str | None = None,
                 on_step: StepCallback | None = None, cancel: CancelHook = None,
                 show_progress: bool = False, init_image: ImageInput | None = None, mask: ImageInput | None = None,
                 strength: float | None = None, controls: Sequence[ControlSpec] = (), guess_mode: bool = False) -> Image:
        """One image. `steps`/`guidance` default as `precast generate`'s (the bundle's where it records them
        -- Flux, Chroma, SD3 --, else its family's: SD 20 / 7.5); `scheduler`: one of the family's samplers
        (SD: euler, the default, or dpm++2m; Flux/Chroma/SD3: flow-euler only). `on_step(done, total)` after
        each denoising step; `cancel` (a callable returning True, or a threading.Event) is checked before
        each step and before decoding: Cancelled when set. `show_progress`: the CLI's progress bar on
        stderr. `init_image` (img2img) and `mask` (inpainting, white = repaint): a PNG path or a uint8
        array, fitted to the pipeline's size (runtime/images.py); they need a pipeline opened with
        image_input=True (Bundle.img2img / inpaint do that). `controls`: (ControlNet name, control
        image[, scale[, start, end]]) each, the nets loaded by bundle.pipeline(..., controlnets=names);
        `guess_mode` as `--guess-mode`."""
        manifest = self.pipe.manifest
        sched = check_settings(manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel)
        steps = self.defaults["steps"] if steps is None else int(steps)
        guidance = self.defaults["guidance"] if guidance is None else float(guidance)
        seed = int(seed)
        mode, strength = check_image_mode(manifest, init_image is not None, mask is not None, strength, steps, "api")
        used = sched or family_of(manifest).samplers[0]
        kwargs = {"negative": negative, "steps": steps, "seed": seed, "guidance": guidance, "scheduler": used,
                  "progress": show_progress}
        if mode != "txt2img":
            from . import images
            if not getattr(self.pipe, "image_input", False):
                raise UserError("init_image=: this pipeline was opened for txt2img (no VAE encoder loaded); open it with "
                                "bundle.pipeline(..., image_input=True), or call bundle.img2img / bundle.inpaint")
            init = kwargs["init_image"] = images.init_image(init_image, "init_image")
            kwargs["mask"] = images.mask_image(mask, init, "mask") if mask is not None else None
            kwargs["strength"] = strength
        if controls or guess_mode:
            kwargs["controls"] = self._controls(controls, guess_mode)
            kwargs["guess_mode"] = guess_mode
        unused = unused_negative(manifest) if negative else None
        warnings = [f"the negative prompt {unused}"] if unused else []
        with _step_hooks(self.pipe, on_step, cancel):
            pixels = self.pipe(prompt, **kwargs)
        warnings += self.pipe.prompt_warnings(prompt, negative)
        return Image(pixels, prompt, negative, seed, steps, float(guidance), used, tuple(warnings), mode, strength)

    def _controls(self, controls: Sequence[ControlSpec], guess_mode: bool) -> list:
        """runtime/control.py's plan of the checked `controls=` entries, every net loaded in this pipeline;
        UserError (one line) otherwise."""
        entries = control_entries(self.pipe.manifest, controls, guess_mode)
        plan = plan_controls(self.pipe.manifest, [(e[1], e[2]) for e in entries], [e[0] for e in entries],
                             [e[3] for e in entries], [e[4] for e in entries])
        missing = [c.component for c in plan if c.component not in self.pipe.needed]
        if missing:
            raise UserError(f"controls=: {missing[0]} is not loaded in this pipeline; open it with "
                            f"bundle.pipeline(..., controlnets=[...]) or pass controls to bundle.txt2img")
        return plan
