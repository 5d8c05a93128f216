"""The Python API for apps: open a bundle, see what would run where and why, load and run components
with numpy feeds, and generate images with the family's reference pipeline in one call.

Owns: `open_bundle`, `Bundle` (plan, load, pipeline, txt2img, img2img, inpaint; `load` returns a
runtime/component.py `Component`), the `verify` argument's values ("auto" | "full", as `--verify`), and `machine`, the devices and assignment
a call works with. What would run where is runtime/report.py's (`Report`); one generation (settings,
defaults, the family's pipeline, `Image`) is runtime/generate.py's; selection, fallback and the
`--backend` grammar are runtime/select.py's and runtime/assign.py's. `precast doctor` and `precast
generate` are built on this module. Every argument is checked before anything loads: a wrong type or
value is one UserError line naming the keyword and the fix. Imports numpy and the runtime's own modules
(the backends lazily, as they load); never the compiler, onnx or torch.

    from precast.runtime.api import open_bundle
    bundle = open_bundle("tiny-bundle")
    print(bundle.plan("te=cpu,unet=gpu0"))          # what would run where, and why
    image = bundle.txt2img("a red fox", steps=4, seed=1, on_step=lambda i, n: print(f"{i}/{n}"),
                           on_preview=lambda i, n, px: show(px))     # uint8 [h, w, 3] each step
    image.save("fox.png")                           # with A1111's parameters and precast's record
    for im in bundle.pipeline().images("a red fox", batch=4, count=2, seed=10):   # seeds 10..17
        im.save(f"fox-{im.seed}.png")
    bundle.img2img("a red fox, oil painting", "fox.png", strength=0.6).save("painted.png")
    bundle.inpaint("a cat", "fox.png", "mask.png").save("cat.png")     # white = repaint
    bundle.txt2img("a red fox", size=(512, 512), hires_scale=2, hires_denoise=0.6).save("fox-1024.png")  # hires fix
    bundle.txt2img("a red fox", size=(1024, 1024), vae_tiling=True)    # VAE decoded in overlapping tiles
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

import numpy as np

from .assign import COMPONENT_MODULE, Placement, assign_modules
from .checks import check_strength, check_vae_tiling, is_int, shown
from .component import Component
from .devices import Device, apply_device_override, discover_devices
from .errors import Cancelled, UserError
from .families import component_requests, family_of
from .generate import ControlSpec, Image, ImageInput, Pipeline, check_image_mode, check_settings, control_entries
from .hires import check_hires
from .image_size import latent_factor, optimal_size, parse_size
from .loading import timed
from .manifest import Manifest, read_manifest
from .report import ComponentPlan, Option, PassedOver, Report, plan_of, report_of
from .select import component_report, installed_backends, load_component, nothing_runs, select_all, select_component
from .step_hooks import CancelHook, PreviewCallback, StepCallback, preview_method
from .control import check_net

__all__ = ["open_bundle", "Bundle", "Report", "ComponentPlan", "Option", "PassedOver", "Component", "Pipeline",
           "Image", "Cancelled", "UserError", "Verify", "Size", "CancelHook", "StepCallback", "PreviewCallback"]

Verify = Literal["auto", "full"]
Size = Union[str, tuple[int, int], None]           # "WIDTHxHEIGHT", (width, height), or the bundle's optimal
DEFAULT_MODULES = ("te", "diffusion", "vae")          # what doctor assigns (assign_modules' default)


def _check_backends(backend, params_backend) -> None:
    """`backend` / `params_backend`: strings in the --backend grammar (runtime/assign.py), or None."""
    for name, text, e in (("backend=", backend, "'te=cpu,unet=gpu0'"), ("params_backend=", params_backend, "'cpu'")):
        if text is not None and not isinstance(text, str):
            raise UserError(f"{shown(name, text)}: expected a string in the --backend grammar, e.g. {e} (or None)")


# ---- bundles -------------------------------------------------------------------------------------
@dataclass
class Machine:
    """This machine as a call sees it: devices in rank order, the modules' placements, installed backends."""
    devices: list[Device]
    warning: str | None
    placements: dict[str, Placement]
    installed: dict[str, str]
    stages: dict = field(default_factory=dict)          # seconds: discover, assign, backends


def machine(sysroot: str, backend: str | None, params_backend: str | None, strict: bool,
            modules: tuple[str, ...] = DEFAULT_MODULES) -> Machine:
    """Devices discovered (PRECAST_DEVICE applied), `modules` assigned by the --backend strings, the installed
    backends read; each stage timed."""
    stages: dict = {}
    with timed(stages, "discover"):
        devices, warning = apply_device_override(discover_devices(sysroot, os.environ), os.environ)
    with timed(stages, "assign"):
        placements = assign_modules(devices, backend, params_backend, modules, strict=strict)
    with timed(stages, "backends"):
        installed = installed_backends(sysroot)
    return Machine(devices, warning, placements, installed, stages)


@dataclass(eq=False)
class Bundle:
    """An opened bundle (its manifest read and checked). Every method takes the `--backend` grammar
    (runtime/assign.py: e.g. "te=cpu,vae=gpu0,unet=gpu0", "all=openvino", "unet=cpu:onnxruntime"),
    `params_backend` ("cpu": weights offloaded where the engine streams them), `size` ("WIDTHxHEIGHT"
    or (width, height); default: the bundle's optimal size) and `strict` (run where asked, or
    UserError: no fallback)."""
    path: Path
    manifest: Manifest
    verify: Verify = "auto"
    sysroot: str = "/"
    _pipelines: dict = field(default_factory=dict, repr=False)
    remote: object = field(default=None, repr=False)    # opened from an oci:// ref: runtime/oci/store.py's Opened

    @property
    def family(self) -> str | None:
        return self.manifest.info.family

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self.manifest.components)

    @property
    def optimal_size(self) -> tuple[int, int]:
        """(width, height): the denoiser profile's opt, the default size."""
        return optimal_size(self.manifest)

    def plan(self, backend: str | None = None, *, params_backend: str | None = None, size: Size = None,
             strict: bool = False) -> Report:
        """What would load where, and why, for every component (nothing is loaded; files are verified
        as `verify` says; memory plans are made over the components generate loads, `Report.memory`): `precast
        doctor BUNDLE` as data. `Report.stages`: the seconds of each stage (discover, assign, backends; select:
        headers only; verify: the same selection with the checks)."""
        _check_backends(backend, params_backend)
        w, h = self._size(size)
        m = self._machine(backend, params_backend, strict)
        family = family_of(self.manifest)
        reqs = component_requests(self.manifest, 1, h, w)
        together = tuple(c for c in family.needs if c in self.manifest.components)   # generate's memory plan
        stages = {**m.stages, "select": 0.0, "verify": 0.0}
        with timed(stages, "select"):    # headers and manifests only
            select_all(self.manifest, m.placements, m.devices, reqs, m.installed, False, together=together)
        with timed(stages, "verify"):    # the same selection with the sha256 checks (every component)
            sels = select_all(self.manifest, m.placements, m.devices, reqs, m.installed, self.verify,
                              together=together)
        if strict:
            stuck = next((s for s in sels.values() if s.choice is None), None)
            if stuck:
                raise UserError(nothing_runs(stuck.component, stuck.target, stuck.refused))
        plans = {c: plan_of(component_report(c, s.choice, s.refused), m.placements[COMPONENT_MODULE.get(c, "diffusion")],
                            s.viable[1:]) for c, s in sels.items()}
        return report_of(self.path, self.manifest, (w, h), m.devices, m.warning, m.installed, m.placements, plans,
                         stages)

    def load(self, component: str, backend: str | None = None, *, params_backend: str | None = None,
             size: Size = None, strict: bool = False) -> Component:
        """One component, selected, verified and loaded as `precast generate` loads it (the next
        candidate is tried when one fails to load; the reasons are in `Component.plan`)."""
        if not isinstance(component, str) or component not in self.manifest.components:
            raise UserError(f"{self.path}: no component {component!r} (it has {', '.join(self.components)})")
        _check_backends(backend, params_backend)
        w, h = self._size(size)
        m = self._machine(backend, params_backend, strict)
        placement = m.placements[COMPONENT_MODULE.get(component, "diffusion")]
        request = component_requests(self.manifest, 1, h, w).get(component, {})
        sel = select_component(self.manifest, component, placement, m.devices, request, m.installed, self.verify)
        if strict and sel.choice is None:
            raise UserError(nothing_runs(component, sel.target, sel.refused))
        outputs = [o["name"] for o in self.manifest.components[component]["outputs"]]
        session, cand, reasons = load_component(sel, outputs, placement.offload)
        rest = sel.viable[sel.viable.index(cand) + 1:]
        return Component(self, component, session, plan_of(component_report(component, cand, reasons), placement, rest))

    def pipeline(self, backend: str | None = None, *, params_backend: str | None = None, size: Size = None,
                 strict: bool = False, image_input: bool = False, controlnets: Sequence[str] = (),
                 vae_tiling: bool | None = None, vae_tile: int | None = None) -> Pipeline:
        """The family's pipeline, loaded (kept: the same arguments return the same pipeline).
        `image_input`: the VAE encoder loaded too, for img2img and inpainting (SD 1.x/2.x/XL bundles that
        have one; img2img for Flux, Chroma, SD3, Z-Image and Qwen-Image too); such a pipeline also serves txt2img.
        `controlnets`: the bundle's ControlNets (by name) to load for `controls=` calls. `vae_tiling`: the VAE decodes (and encodes) in overlapping tiles --
        True always, False never, None (default) when the image is past its engine's profile or its device's
        memory --, `vae_tile` px a side (default 512, within the engine's profile; runtime/vae_tiling.py)."""
        _check_backends(backend, params_backend)
        vae_tiling, vae_tile = check_vae_tiling(vae_tiling, vae_tile, latent_factor(self.manifest), "api")
        controlnets = () if controlnets is None else controlnets
        if isinstance(controlnets, (str, bytes)) or not isinstance(controlnets, Iterable) \
                or not all(isinstance(n, str) for n in controlnets):
            raise UserError(f"controlnets={controlnets!r}: expected a list of the bundle's ControlNet names, e.g. ['canny']")
        w, h = self._size(size)
        nets = tuple(sorted(set(controlnets)))
        key = (backend, params_backend, w, h, strict, nets, vae_tiling, vae_tile)
        if (*key, True) in self._pipelines and not image_input:
            return self._pipelines[(*key, True)]
        key = (*key, image_input)
        if key not in self._pipelines:
            cls = family_of(self.manifest).pipeline
            extra = {"image_input": True} if image_input else {}
            if vae_tiling is not None or vae_tile is not None:
                extra.update(vae_tiling=vae_tiling, vae_tile=vae_tile)
            if nets:
                for n in nets:
                    check_net(self.manifest, n, "controlnets=")
                extra["controlnets"] = tuple(f"controlnet_{n}" for n in nets)
            pipe = cls(self.manifest, backend, params_backend, width=w, height=h, sysroot=self.sysroot,
                       strict=strict, verify=self.verify, **extra)
            self._pipelines[key] = Pipeline(self.path, pipe, lambda size, image_input: self.pipeline(
                backend, params_backend=params_backend, size=size, strict=strict, image_input=image_input,
                controlnets=nets, vae_tiling=vae_tiling, vae_tile=vae_tile))
        return self._pipelines[key]

    def txt2img(self, prompt: str, *, negative: str = "", steps: int | None = None, seed: int = 0,
                guidance: float | None = None, scheduler: str | None = None, size: Size = None,
                backend: str | None = None, params_backend: str | None = None, strict: bool = False,
                on_step: StepCallback | None = None, cancel: CancelHook = None,
                show_progress: bool = False, controls: Sequence[ControlSpec] = (), guess_mode: bool = False,
                schedule: str | None = None, on_preview: PreviewCallback | None = None, preview: str = "auto",
                hires_scale: float | None = None, hires_size: Size = None, hires_steps: int | None = None,
                hires_denoise: float | None = None, hires_upscaler: str | None = None,
                vae_tiling: bool | None = None, vae_tile: int | None = None) -> Image:
        """One image in one call: `pipeline(...)` (loaded once per backend/size) then `Pipeline.__call__`.
        The same image as `precast generate` with the same settings. Several (`--batch` / `--count`):
        `pipeline(...).images(prompt, batch=N, count=M, ...)`, a list. `controls`: ControlNets, each
        (name, image[, scale[, start, end]]) as `--controlnet NAME --control IMAGE:SCALE`. `scheduler` /
        `schedule`: the sampler and SD's sigma schedule, as `--scheduler` / `--schedule`
        (docs/runtime.md#samplers). `on_preview(done, total, image)`: a preview each step, `preview` its method
        (docs/runtime.md#previews). `hires_scale` (or `hires_size`), `hires_steps`, `hires_denoise`,
        `hires_upscaler`: the hires fix (runtime/hires.py), as `--hires-*`; `vae_tiling` / `vae_tile` as
        `pipeline`'s."""
        check_settings(self.manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel, schedule)
        preview_method(self.manifest, on_preview, preview)
        check_image_mode(self.manifest, False, False, None, 1, "api")   # an inpainting UNet needs an image and mask
        controls = control_entries(self.manifest, controls, guess_mode)
        family = family_of(self.manifest)
        hires = check_hires(self.manifest, family, self._size(size), hires_scale, hires_size, hires_steps,
                            hires_denoise, hires_upscaler, family.steps if steps is None else steps, "api")
        pipe = self.pipeline(backend, params_backend=params_backend, size=size, strict=strict,
                             controlnets=[c[0] for c in controls], image_input=bool(hires and not hires.latent),
                             vae_tiling=vae_tiling, vae_tile=vae_tile)
        return pipe(prompt, negative=negative, steps=steps, seed=seed, guidance=guidance, scheduler=scheduler,
                    schedule=schedule, on_step=on_step, cancel=cancel, show_progress=show_progress, controls=controls,
                    guess_mode=guess_mode, on_preview=on_preview, preview=preview, hires_scale=hires_scale,
                    hires_size=hires_size, hires_steps=hires_steps, hires_denoise=hires_denoise,
                    hires_upscaler=hires_upscaler)

    def img2img(self, prompt: str, image: ImageInput, *, strength: float | None = None, negative: str = "",
                steps: int | None = None, seed: int = 0, guidance: float | None = None, scheduler: str | None = None,
                size: Size = None, backend: str | None = None, params_backend: str | None = None,
                strict: bool = False, on_step: StepCallback | None = None, cancel: CancelHook = None,
                show_progress: bool = False, controls: Sequence[ControlSpec] = (), guess_mode: bool = False,
                schedule: str | None = None, on_preview: PreviewCallback | None = None, preview: str = "auto",
                vae_tiling: bool | None = None, vae_tile: int | None = None) -> Image:
        """img2img in one call (SD 1.x/2.x/XL bundles with a vae_encoder): `image` (a PNG path or a uint8
        array) encoded, noised to the first of the int(steps x strength) steps it runs (strength: more
        than 0, at most 1; default 0.8), then denoised as txt2img. `size`: default the image's own
        (multiples of 8); another size centre-crops the image to its aspect ratio and resizes it.
        `precast generate --init-image` with the same settings writes the same PNG. `vae_tiling` / `vae_tile`
        as `pipeline`'s (the encoder too)."""
        return self._image_mode(prompt, image, None, strength, negative, steps, seed, guidance, scheduler, size,
                                backend, params_backend, strict, on_step, cancel, show_progress, controls, guess_mode,
                                schedule, on_preview, preview, vae_tiling, vae_tile)

    def inpaint(self, prompt: str, image: ImageInput, mask: ImageInput, *, strength: float | None = None,
                negative: str = "", steps: int | None = None, seed: int = 0, guidance: float | None = None,
                scheduler: str | None = None, size: Size = None, backend: str | None = None,
                params_backend: str | None = None, strict: bool = False, on_step: StepCallback | None = None,
                cancel: CancelHook = None, show_progress: bool = False, controls: Sequence[ControlSpec] = (),
                guess_mode: bool = False, schedule: str | None = None, on_preview: PreviewCallback | None = None,
                preview: str = "auto", vae_tiling: bool | None = None, vae_tile: int | None = None) -> Image:
        """Inpainting in one call: `mask` (the image's size; white = repaint, luma >= 128) says what is
        painted anew. An inpainting UNet (9 input channels) sees the mask and the masked image; a plain
        UNet inpaints by latent blending. `strength` default 1.0 (from pure noise); otherwise as img2img.
        `precast generate --init-image --mask` with the same settings writes the same PNG."""
        if mask is None:
            raise UserError("mask=: inpainting needs a mask (white = repaint); for img2img call bundle.img2img")
        return self._image_mode(prompt, image, mask, strength, negative, steps, seed, guidance, scheduler, size,
                                backend, params_backend, strict, on_step, cancel, show_progress, controls, guess_mode,
                                schedule, on_preview, preview, vae_tiling, vae_tile)

    def _image_mode(self, prompt, image, mask, strength, negative, steps, seed, guidance, scheduler, size, backend,
                    params_backend, strict, on_step, cancel, show_progress, controls=(), guess_mode=False,
                    schedule=None, on_preview=None, preview="auto", vae_tiling=None, vae_tile=None) -> Image:
        """Everything checked before any engine loads: settings, the images, the mode against the bundle."""
        from . import images
        check_settings(self.manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel, schedule)
        preview_method(self.manifest, on_preview, preview)
        if strength is not None:
            check_strength(strength, "strength=")
        init = images.init_image(image, "init_image")
        mask_px = images.mask_image(mask, init, "mask") if mask is not None else None
        check_image_mode(self.manifest, True, mask is not None, strength,
                         family_of(self.manifest).steps if steps is None else steps, "api")
        controls = control_entries(self.manifest, controls, guess_mode)
        if size is None:
            size = images.output_size(init, "init_image", image if not isinstance(image, np.ndarray) else None,
                                      latent_factor(self.manifest))
        pipe = self.pipeline(backend, params_backend=params_backend, size=size, strict=strict, image_input=True,
                             controlnets=[c[0] for c in controls], vae_tiling=vae_tiling, vae_tile=vae_tile)
        return pipe(prompt, negative=negative, steps=steps, seed=seed, guidance=guidance, scheduler=scheduler,
                    schedule=schedule, on_step=on_step, cancel=cancel, show_progress=show_progress, init_image=init,
                    mask=mask_px,
                    strength=strength, controls=controls, guess_mode=guess_mode, on_preview=on_preview, preview=preview)

    # ---- helpers ---------------------------------------------------------------------------------
    def _size(self, size: Size) -> tuple[int, int]:
        if size is None:
            return self.optimal_size
        if not isinstance(size, str):
            try:
                w, h = size
            except (TypeError, ValueError):
                w = h = None
            if not (is_int(w) and is_int(h)):
                raise UserError(f"size={size!r}: expected 'WIDTHxHEIGHT' or (width, height) in whole pixels, "
                                "e.g. (512, 512)")
            size = (int(w), int(h))
        return parse_size(size, self.manifest, "size=")

    def _machine(self, backend: str | None, params_backend: str | None, strict: bool) -> Machine:
        extra = tuple(dict.fromkeys(COMPONENT_MODULE.get(c, "diffusion") for c in self.manifest.components))
        return machine(self.sysroot, backend, params_backend, strict,
                       DEFAULT_MODULES + tuple(x for x in extra if x not in DEFAULT_MODULES))


def open_bundle(path: str | os.PathLike, *, verify: Verify = "auto", sysroot: str = "/", backend: str | None = None,
                pull: bool = True, ca: str | None = None, plain_http: bool = False) -> Bundle:
    """Reads and checks a bundle's manifest (UserError, one line, if it is not a bundle). `verify`, as
    `--verify`: "auto" hashes each file once per file state (records trusted while the file is
    unchanged), "full" hashes every file again on every load. `sysroot`: read devices from a recorded
    tree (tests). `path` may be a registry reference, "oci://HOST/REPO:TAG" (the remote extra): what this
    machine selects -- under `backend`, the --backend grammar, when given -- is pulled into the local store
    (runtime/oci/store.py: one copy of each blob whatever the references) and opened from there; with the
    registry unreachable, a reference pulled before opens as it was (a note on stderr). `pull=False`
    downloads no engine: `plan()` says what would run once pulled, `Bundle.remote.files` what a pull fetches.
    `ca` (a PEM file) and `plain_http`: the registry's TLS, as --ca / --plain-http (default: the system store,
    PRECAST_REGISTRY_CA, PRECAST_REGISTRY_PLAIN_HTTP)."""
    if not isinstance(path, (str, os.PathLike)):
        raise UserError(f"path={path!r}: expected the bundle's folder (a str or os.PathLike), e.g. 'build/demo/bundle'")
    mode = str(verify).lower()
    if mode not in ("auto", "full"):
        raise UserError(f"verify={verify!r}: expected 'auto' or 'full'")
    if not isinstance(sysroot, (str, os.PathLike)):
        raise UserError(f"sysroot={sysroot!r}: expected a folder (a str or os.PathLike) holding a recorded machine's "
                        "/proc and /sys, or '/' for this one")
    if isinstance(path, str) and path.startswith("oci://"):
        from .oci import need_remote
        need_remote()
        from .oci.store import open_ref
        _check_backends(backend, None)
        opened = open_ref(path, machine(sysroot, backend, None, False, DEFAULT_MODULES + tuple(
            dict.fromkeys(m for m in COMPONENT_MODULE.values() if m not in DEFAULT_MODULES))), pull=pull, ca=ca,
            plain_http=plain_http)
        return Bundle(Path(opened.folder), opened.manifest(), mode if opened.local else False, sysroot, remote=opened)
    return Bundle(Path(path), read_manifest(path), mode, sysroot)
