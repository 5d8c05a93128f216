"""One generation, as the Python API and `precast generate` both run it: the settings checked and defaulted
once, the bundle family's pipeline called, an `Image` back.

Owns: `Pipeline` (a family's pipeline, loaded, called per image -- or per batch x count images, seeds
seed, seed + 1, ... --: settings -> defaults from the family and the bundle -> image mode -> ControlNets ->
the per-step hooks -> `Image`s; the hires fix's two passes, runtime/hires.py), `Image` (its pixels, the
settings that made it, and the PNG with them: A1111's parameters and precast's record, runtime/metadata.py),
and the checks that need the bundle's family:
`check_scheduler` (sampler and sigma schedule), `check_image_mode` (the family's own), `check_settings`,
`control_entries` (the API's `controls=`). Value checks are runtime/checks.py's; the step hooks (progress,
preview and cancel callbacks) runtime/step_hooks.py's; the pipelines are runtime/families/'s.
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np

from .assign import module_of
from .checks import (check_batch, check_count, check_guidance, check_number, check_out, check_seed, check_steps,
                     check_text, shown, write_image)
from .errors import UserError
from .families import FAMILIES, family_of
from .families.family import reads_negative
from .loading import BundleModel, to_uint8
from .report import Report, plan_of, report_of
from .control import check_net, check_range, plan_controls
from .hires import Hires, check_hires, upscale_latents
from .image_size import latent_factor
from .images import image_tensor, init_image
from .metadata import PARAMETERS, RECORD, made_with, parameters_text, pixels_digest, record_text
from .png import png_bytes
from .sampler_names import SCHEDULES, parse_sampler, parse_schedule
from .step_hooks import CancelHook, PreviewCallback, StepCallback, preview_method, step_hooks, stop_check

ImageInput = Union[str, os.PathLike, np.ndarray]     # a PNG path, or uint8 [H, W] / [H, W, C] (C 1 to 4)
ControlSpec = tuple                                   # (ControlNet name, image[, scale[, start, end]])


# ---- settings that depend on the family -----------------------------------------------------------
def check_scheduler(scheduler, manifest, name: str = "--scheduler", schedule=None,
                    schedule_name: str = "--schedule") -> tuple[str | None, str | None]:
    """(sampler, sigma schedule) asked for, in precast's names (runtime/sampler_names.py reads A1111's and
    ComfyUI's too, and A1111's "DPM++ 2M Karras"), checked against the bundle's family; None where the
    family's default applies. On flow-matching families euler / heun / dpm++2m name their flow-euler /
    flow-heun / flow-dpm++2m, and the model's own schedule is the only one ("normal" names it)."""
    family = family_of(manifest)
    sampler = kind = None
    if scheduler is not None and scheduler != "":
        parsed = parse_sampler(scheduler)
        if parsed is None:
            groups: dict[tuple, list[str]] = {}
            for f in FAMILIES.values():
                groups.setdefault(f.samplers, []).append(f.title)
            raise UserError(f"{shown(name, scheduler)}: choose one of " + " or ".join(
                f"{', '.join(samplers)} ({' / '.join(titles)})" for samplers, titles in groups.items()) +
                "; A1111's and ComfyUI's names work too, e.g. 'DPM++ 2M Karras', 'dpmpp_2m_sde'")
        sampler, kind = parsed
        if sampler not in family.samplers and f"flow-{sampler}" in family.samplers:
            sampler = f"flow-{sampler}"
        if sampler not in family.samplers:
            owners = " / ".join(f.title for f in FAMILIES.values() if sampler in f.samplers)
            raise UserError(f"{shown(name, scheduler)}: is {owners}'s; {family.name} bundles take "
                            f"{', '.join(family.samplers)}")
    if schedule is not None and schedule != "":
        asked = parse_schedule(schedule)
        if asked is None:
            raise UserError(f"{shown(schedule_name, schedule)}: choose one of {', '.join(SCHEDULES)} (A1111's "
                            "'Karras', 'SGM Uniform' and ComfyUI's 'sgm_uniform' work too)")
        if kind not in (None, asked):
            raise UserError(f"{shown(schedule_name, schedule)}: {shown(name, scheduler)} names the {kind} schedule; "
                            "give one of them")
        kind = asked
    runs = family.schedules.get(sampler or family.samplers[0], ("normal",))
    if kind is not None and kind not in runs:
        if not family.schedules:
            raise UserError(f"{shown(schedule_name, kind)}: {family.title} samples on the model's own schedule (the "
                            f"shift it was trained with); leave {schedule_name.rstrip('=')} out")
        raise UserError(f"{shown(schedule_name, kind)}: {sampler or family.samplers[0]} runs "
                        f"{' or '.join(runs)}")
    return sampler, (kind if family.schedules else None)


def check_image_mode(manifest, init: bool, mask: bool, strength: float | None, steps: int,
                     names: str = "cli") -> tuple[str, float | None]:
    """(mode, strength): txt2img, or img2img / inpainting where the family runs them, checked by the family
    (runtime/families/) before anything loads."""
    return family_of(manifest).check_mode(manifest, init, mask, strength, steps, names)


def check_settings(manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel,
                   schedule=None) -> tuple[str | None, str | None]:
    """The settings `precast generate` checks before loading anything, in its words (runtime/checks.py)
    named as keywords (None: the default); returns (sampler, sigma schedule) as check_scheduler does."""
    check_text(prompt, "prompt=")
    check_text(negative, "negative=")
    if steps is not None:
        check_steps(steps, "steps=")
    check_seed(seed, "seed=")
    if guidance is not None:
        check_guidance(guidance, "guidance=")
    if on_step is not None and not callable(on_step):
        raise UserError(f"on_step={on_step!r}: expected a callable taking (steps done, total steps), or None")
    stop_check(cancel)
    return check_scheduler(scheduler, manifest, "scheduler=", schedule, "schedule=")


def unused_negative(manifest) -> str | None:
    """Why a negative prompt does nothing with this bundle's family, or None when it is used."""
    family = family_of(manifest)
    if reads_negative(family, manifest.model):
        return None
    model = family.title if not family.negative else f"{family.title} {manifest.model.get('variant')}"   # the variant's
    return f"is not used by {model} (distilled guidance, no negative prompt)"


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
    inputs: dict = field(default_factory=dict)     # init_image / mask / controls (by the sha256 of their
    #                                                pixels, however given), guess_mode
    made_with: dict = field(default_factory=dict)  # the bundle and what ran where (runtime/metadata.made_with)
    schedule: str | None = None              # the sigma schedule (SD); None: the model's own (flow matching)
    hires: dict | None = None                # the hires fix's second pass (runtime/hires.py Hires.record) and
    #                                          "base", the first pass's size
    vae_tiling: dict | None = None           # asked (forced, tile) and what was tiled (runtime/vae_tiling.py)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.pixels.shape[1], self.pixels.shape[0]

    def to_uint8(self) -> np.ndarray:
        """[H, W, 3] uint8, rounded as `precast generate` writes it."""
        return to_uint8(self.pixels)

    @property
    def settings(self) -> dict:
        """The exact settings that made it: what `precast generate --from-png` reruns (`size`: the first
        pass's under a hires fix)."""
        hires = {"hires": {k: v for k, v in self.hires.items() if k != "base"}} if self.hires else {}
        tiling = {"vae_tiling": self.vae_tiling} if self.vae_tiling else {}
        return {"prompt": self.prompt, "negative": self.negative, "steps": self.steps, "seed": self.seed,
                "guidance": self.guidance, "scheduler": self.scheduler, "schedule": self.schedule,
                "size": self.hires["base"] if self.hires else "{}x{}".format(*self.size),
                "mode": self.mode, "strength": self.strength, **self.inputs, **hires, **tiling}

    @property
    def parameters(self) -> str:
        """A1111's infotext ("prompt\\nNegative prompt: ...\\nSteps: 20, Sampler: Euler, ..."), as its PNG carries."""
        return parameters_text(self.settings, self.made_with)

    @property
    def record(self) -> dict:
        """precast's record, as its PNG carries it: the bundle, what ran where, precast's version, `settings`."""
        return {**self.made_with, "settings": self.settings}

    def png(self) -> bytes:
        """The PNG file's bytes: the same bytes `precast generate --out` writes for this image, with A1111's
        `parameters` and precast's `precast` text chunks (nothing time-dependent: the same image, the same bytes)."""
        return png_bytes(self.to_uint8(), self.text_chunks())

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the PNG as `precast generate --out` does (the bytes of png()): `path` checked first (a .png
        file in a folder that exists; UserError, one line, otherwise), then a temp file renamed into place,
        so a failed write leaves nothing behind."""
        out = check_out(path, "path=")
        write_image(out, self.to_uint8(), "path=", self.text_chunks())
        return out

    def text_chunks(self) -> dict[str, str]:
        """The PNG's text chunks: `parameters` (A1111's infotext) and `precast` (the record, JSON)."""
        return {PARAMETERS: self.parameters, RECORD: record_text(self.record)}


# ---- the pipeline --------------------------------------------------------------------------------
class Pipeline:
    """A bundle's reference pipeline (its family's), loaded once and called per image. `report` is what
    was loaded where (load failures that fell back included)."""

    def __init__(self, path: Path, pipe: BundleModel, opener: Callable | None = None):
        """`opener(size, image_input)`: the bundle's Pipeline at another size (Bundle.pipeline with this one's
        other arguments), for a hires fix whose second size this one's engines do not take."""
        self.path, self.pipe, self._opener = path, pipe, opener
        self.family: str = pipe.family
        self.size: tuple[int, int] = (pipe.width, pipe.height)
        self.defaults: dict = dict(pipe.defaults)
        self._made: dict | None = None

    @property
    def report(self) -> Report:
        r = self.pipe.report()
        plans = {c: plan_of(r["components"][c], self.pipe.placements[module_of(c)]) for c in self.pipe.needed}
        return report_of(self.path, self.pipe.manifest, self.size, self.pipe.devices, self.pipe.device_warning,
                         self.pipe.installed, self.pipe.placements, plans)

    def __call__(self, prompt: str, *, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, scheduler: str | None = None, schedule: str | None = None,
                 on_step: StepCallback | None = None, cancel: CancelHook = None,
                 show_progress: bool = False, init_image: ImageInput | None = None, mask: ImageInput | None = None,
                 strength: float | None = None, controls: Sequence[ControlSpec] = (), guess_mode: bool = False,
                 on_preview: PreviewCallback | None = None, preview: str = "auto", hires_scale: float | None = None,
                 hires_size=None, hires_steps: int | None = None, hires_denoise: float | None = None,
                 hires_upscaler: str | None = None) -> Image:
        """One image. `steps`/`guidance` default as `precast generate`'s (the bundle's where it records them
        -- Flux, Chroma, SD3 --, else its family's: SD 20 / 7.5); `scheduler`: one of the family's samplers
        (SD: euler, the default, euler-a, heun, dpm2, dpm2-a, dpm++2m, dpm++2m-sde, dpm++sde, ddim, unipc, lcm;
        Flux/Chroma/SD3: flow-euler, the default, flow-heun, flow-dpm++2m), in precast's, A1111's or ComfyUI's
        names, A1111's "DPM++ 2M Karras" included; `schedule`: SD's sigma schedule, normal (the default),
        karras, exponential or sgm-uniform (docs/runtime.md#samplers). `on_step(done, total)` after
        each denoising step; `on_preview(done, total, image)` after it, with a preview of the image so far
        (uint8 [H, W, 3]; `preview`: "auto", "latent2rgb" or "taesd", docs/runtime.md#previews); `cancel` (a
        callable returning True, or a threading.Event) is checked before each step and before decoding:
        Cancelled when set. `show_progress`: the CLI's progress bar on
        stderr. `init_image` (img2img) and `mask` (inpainting, white = repaint): a PNG path or a uint8
        array, fitted to the pipeline's size (runtime/images.py); they need a pipeline opened with
        image_input=True (Bundle.img2img / inpaint do that). `controls`: (ControlNet name, control
        image[, scale[, start, end]]) each, the nets loaded by bundle.pipeline(..., controlnets=names);
        `guess_mode` as `--guess-mode`. `hires_scale` (or `hires_size`, "WIDTHxHEIGHT" or (width, height)),
        `hires_steps`, `hires_denoise`, `hires_upscaler`: the hires fix, as `--hires-*` (runtime/hires.py: the
        image made at this pipeline's size, upscaled, then img2img at the larger size). Several images: `images`."""
        return self.images(prompt, negative=negative, steps=steps, seed=seed, guidance=guidance, scheduler=scheduler,
                           schedule=schedule, on_step=on_step, cancel=cancel, show_progress=show_progress,
                           init_image=init_image, mask=mask, strength=strength, controls=controls,
                           guess_mode=guess_mode, on_preview=on_preview, preview=preview, hires_scale=hires_scale,
                           hires_size=hires_size, hires_steps=hires_steps, hires_denoise=hires_denoise,
                           hires_upscaler=hires_upscaler)[0]

    def images(self, prompt: str, *, batch: int = 1, count: int = 1, negative: str = "", steps: int | None = None,
               seed: int = 0, guidance: float | None = None, scheduler: str | None = None,
               schedule: str | None = None,
               on_step: StepCallback | None = None, cancel: CancelHook = None, show_progress: bool = False,
               init_image: ImageInput | None = None, mask: ImageInput | None = None, strength: float | None = None,
               controls: Sequence[ControlSpec] = (), guess_mode: bool = False,
               on_preview: PreviewCallback | None = None, preview: str = "auto", hires_scale: float | None = None,
               hires_size=None, hires_steps: int | None = None, hires_denoise: float | None = None,
               hires_upscaler: str | None = None) -> list[Image]:
        """`count` runs of `batch` images, one run after another: batch x count `Image`s, in order, with seeds
        seed, seed + 1, ... (as A1111 numbers a batch); each image's noise is drawn from its own seed, so
        image i is the image `pipeline(..., seed=seed + i)` makes, pixel for pixel (and its PNG byte for
        byte). A run's batch goes through the denoiser in one call where the engines' shape profiles take
        it (recipe `profiles.batch`), else in as many calls as they need; the prompts are encoded once per
        run. `on_step(done, total)` counts each denoising loop's steps (one loop per call); `on_preview` shows
        the first image of each call; under a hires fix each pass is a call. The other settings as `__call__`."""
        manifest = self.pipe.manifest
        sched, kind = check_settings(manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel,
                                     schedule)
        batch, count = check_batch(batch, "batch="), check_count(count, "count=")
        method = preview_method(manifest, on_preview, preview)
        steps = self.defaults["steps"] if steps is None else int(steps)
        guidance = self.defaults["guidance"] if guidance is None else float(guidance)
        seed = int(seed)
        mode, strength = check_image_mode(manifest, init_image is not None, mask is not None, strength, steps, "api")
        family = family_of(manifest)
        hires = check_hires(manifest, family, self.size, hires_scale, hires_size, hires_steps, hires_denoise,
                            hires_upscaler, steps, "api")
        if hires is not None and (mode != "txt2img" or controls or guess_mode):
            raise UserError(f"{'hires_scale=' if hires.scale else 'hires_size='}: the hires fix is a txt2img option "
                            "(A1111's): leave out init_image, mask and controls")
        used = sched or family.samplers[0]
        kind = kind or (family.schedules[used][0] if family.schedules else None)
        kwargs = {"negative": negative, "steps": steps, "guidance": guidance, "scheduler": used,
                  "progress": show_progress, **({"schedule": kind} if kind else {})}
        inputs: dict = {}
        if mode != "txt2img":
            from . import images
            if not getattr(self.pipe, "image_input", False):
                raise UserError("init_image=: this pipeline was opened for txt2img (no VAE encoder loaded); open it with "
                                "bundle.pipeline(..., image_input=True), or call bundle.img2img / bundle.inpaint")
            init = kwargs["init_image"] = images.init_image(init_image, "init_image")
            kwargs["strength"] = strength
            inputs["init_image"] = {"sha256": pixels_digest(init)}
            if mask is not None:        # inpainting (the families that run it)
                kwargs["mask"] = images.mask_image(mask, init, "mask")
                inputs["mask"] = {"sha256": pixels_digest(kwargs["mask"])}
        if controls or guess_mode:
            entries = control_entries(self.pipe.manifest, controls, guess_mode)
            kwargs["controls"] = self._controls(entries)
            kwargs["guess_mode"] = guess_mode
            inputs["controls"] = [{"controlnet": e[0], "image": {"sha256": pixels_digest(e[1])}, "scale": e[2],
                                   "start": e[3], "end": e[4]} for e in entries]
            inputs["guess_mode"] = guess_mode
        unused = unused_negative(manifest) if negative else None
        warnings = [f"the negative prompt {unused}"] if unused else []
        pixels = []
        self.pipe.tiled.clear()
        with step_hooks(self.pipe, on_step, cancel, on_preview, method):
            for run in range(count):
                seeds = list(range(seed + run * batch, seed + (run + 1) * batch))
                made = self._hires(prompt, seeds, kwargs, hires) if hires else self.pipe(prompt, seeds=seeds, **kwargs)
                pixels += list(made)
        warnings += self.pipe.prompt_warnings(prompt, negative)
        made = self.made_with()
        tiled = {k: v for k, v in self.pipe.tiled.items() if v}
        tiling = {"forced": self.pipe.vae_tiling, "tile": self.pipe.vae_tile, **tiled} \
            if tiled or self.pipe.vae_tiling is not None or self.pipe.vae_tile else None
        record = {**hires.record(steps), "base": "{}x{}".format(*self.size)} if hires else None
        return [Image(px, prompt, negative, seed + i, steps, float(guidance), used, tuple(warnings), mode, strength,
                      inputs, made, kind, record, tiling) for i, px in enumerate(pixels)]

    def _hires(self, prompt: str, seeds: list[int], kwargs: dict, hires: Hires) -> np.ndarray:
        """The hires fix for `seeds` (runtime/hires.py): the first pass here; its latents upscaled (a latent
        upscaler) or its images decoded, rounded to uint8 and resized as img2img resizes an init image, then
        encoded; the second pass img2img from those latents at the hires size, each image's noise from its seed
        there. It runs on this pipeline's engines where they take the hires size (BundleModel.at_size), else on
        the bundle's pipeline at that size."""
        manifest, f = self.pipe.manifest, latent_factor(self.pipe.manifest)
        w, h = hires.width, hires.height
        encoder = not hires.latent
        second = self.pipe.at_size(w, h, family_of(manifest).requests(manifest, 1, h, w)) \
            if encoder <= getattr(self.pipe, "image_input", False) else None
        if second is None:
            if self._opener is None:
                raise UserError(f"hires_size=({w}, {h}): this pipeline's engines do not take it; open it through "
                                "bundle.pipeline(...) so the hires pass can open its own")
            second = self._opener((w, h), encoder).pipe
            second.tiled.clear()
        first = self.pipe(prompt, seeds=seeds, decode=encoder, **kwargs)
        if encoder:
            init = np.concatenate([second.encode_image(image_tensor(to_uint8(px), w, h)) for px in first])
        else:
            init = upscale_latents(first, h // f, w // f, hires.upscaler)
        hook, second.step_hook = second.step_hook, self.pipe.step_hook
        try:
            out = second(prompt, seeds=seeds, init_latents=init, strength=hires.denoise,
                         **{**kwargs, "steps": hires.steps or kwargs["steps"]})
        finally:
            second.step_hook = hook
        if second.tiled is not self.pipe.tiled:
            self.pipe.tiled.update(second.tiled)
        return out

    def made_with(self) -> dict:
        """The bundle and what ran where (runtime/metadata.made_with), as the images' PNGs record it."""
        if self._made is None:
            family = family_of(self.pipe.manifest)
            self._made = made_with(self.pipe.manifest, self.pipe.report()["components"],
                                   not reads_negative(family, self.pipe.manifest.model))
        return self._made

    def _controls(self, entries: list[tuple]) -> list:
        """runtime/control.py's plan of the checked `controls=` entries, every net loaded in this pipeline;
        UserError (one line) otherwise."""
        plan = plan_controls(self.pipe.manifest, [(e[1], e[2]) for e in entries], [e[0] for e in entries],
                             [e[3] for e in entries], [e[4] for e in entries])
        missing = [c.component for c in plan if c.component not in self.pipe.needed]
        if missing:
            raise UserError(f"controls=: {missing[0]} is not loaded in this pipeline; open it with "
                            f"bundle.pipeline(..., controlnets=[...]) or pass controls to bundle.txt2img")
        return plan
