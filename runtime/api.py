"""The Python API for apps: open a bundle, see what would run where and why, load and run components
with numpy feeds, and generate images with the reference pipelines in one call.

Owns: the API's types (`Bundle`, `Report` and `ComponentPlan` -- `precast doctor`'s report as data --,
`Component`, `Pipeline`, `Image`), the `verify` argument's values ("auto" | "full", as `--verify`),
each family's generation defaults as `precast generate` applies them, and the per-step hooks (a
progress callback, a cancel hook raising `Cancelled`) wrapped around the pipelines' denoising loop.
Every argument is checked before anything loads: a wrong type or value is one UserError line naming
the keyword and the fix, in `precast generate`'s words for the same mistake (runtime/checks.py).
Selection, fallback and the `--backend` grammar are runtime/select.py's and runtime/assign.py's;
the pipelines are runtime/sd_pipeline.py's, dit_pipeline.py's and sd3_pipeline.py's, picked by family as
`precast generate` picks them (run_commands.pipeline_class). Imports numpy and the
runtime's own modules (the backends lazily, as they load); never the compiler, onnx or torch.

    from precast.runtime.api import open_bundle
    bundle = open_bundle("tiny-bundle")
    print(bundle.plan("te=cpu,unet=gpu0"))          # what would run where, and why
    image = bundle.txt2img("a red fox", steps=4, seed=1, on_step=lambda i, n: print(f"{i}/{n}"))
    image.save("fox.png")
    bundle.img2img("a red fox, oil painting", "fox.png", strength=0.6).save("painted.png")
    bundle.inpaint("a cat", "fox.png", "mask.png").save("cat.png")     # white = repaint
"""
from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

import numpy as np

from .assign import COMPONENT_MODULE, Placement, assign_modules, module_of
from .checks import (check_guidance, check_number, check_out, check_scheduler, check_seed, check_steps, check_strength,
                     check_text, is_int, shown, write_image)
from .devices import Device, apply_device_override, discover_devices
from .errors import Cancelled, UserError
from .manifest import Manifest, read_manifest
from .pipeline import (BundleModel, check_image_mode, describe_where, latent_factor, optimal_size, requests,
                       to_uint8)
from .select import (Candidate, component_report, installed_backends, load_component, nothing_runs,
                     passed_text, select_all, select_component)

__all__ = ["open_bundle", "Bundle", "Report", "ComponentPlan", "Option", "PassedOver", "Component", "Pipeline",
           "Image", "Cancelled", "UserError", "Verify", "Size", "CancelHook", "StepCallback"]

Verify = Literal["auto", "full"]
Size = Union[str, tuple[int, int], None]           # "WIDTHxHEIGHT", (width, height), or the bundle's optimal
ImageInput = Union[str, os.PathLike, np.ndarray]     # a PNG path, or uint8 [H, W] / [H, W, C] (C 1 to 4)
ControlSpec = tuple                                   # (ControlNet name, image[, scale[, start, end]])
StepCallback = Callable[[int, int], None]             # (steps done, total steps)
CancelHook = Union[Callable[[], bool], threading.Event, None]
DEFAULT_MODULES = ("te", "diffusion", "vae")          # what doctor assigns (assign_modules' default)
SD_DEFAULTS = {"steps": 20, "guidance": 7.5}          # `precast generate`'s for SD 1.x/2.x/XL
SD_SCHEDULER = "euler"


# ---- the report: doctor's, as data ---------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One way to run a component: an artifact (an engine's id, or "onnx": the bundle's ONNX compiled
    or loaded at run time) through a backend on a device."""
    artifact: str
    device: str
    device_name: str
    backend: str
    how: str
    note: str = ""
    memory: dict | None = None    # weights against the device's budget: plan resident / stream / ... (doctor's)


@dataclass(frozen=True)
class PassedOver:
    """An artifact, backend or assignment that was not used, and why."""
    artifact: str | None
    backend: str | None
    device: str | None
    reason: str

    def __str__(self) -> str:
        return passed_text(self.as_dict())

    def as_dict(self) -> dict:
        return {"artifact": self.artifact, "backend": self.backend, "device": self.device, "reason": self.reason}


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component runs (or would run) and why: the chosen option (None: nothing in the
    bundle can run here), a one-line reason, what was passed over, and the options tried next if
    the chosen one fails to load."""
    component: str
    module: str                              # te | diffusion | vae | ...: the --backend key
    chosen: Option | None
    why: str
    passed_over: tuple[PassedOver, ...] = ()
    then: tuple[Option, ...] = ()

    @property
    def artifact(self) -> str | None:
        return self.chosen.artifact if self.chosen else None

    @property
    def device(self) -> str | None:
        return self.chosen.device if self.chosen else None

    @property
    def backend(self) -> str | None:
        return self.chosen.backend if self.chosen else None

    def as_dict(self) -> dict:
        """doctor --json's record for the component (plus "why")."""
        return {**component_report(self.component, None, []), "module": self.module,
                **(_option_dict(self.component, self.chosen) if self.chosen else {}), "why": self.why,
                "passed_over": [p.as_dict() for p in self.passed_over],
                "then": [_option_dict(self.component, o) for o in self.then]}


@dataclass(frozen=True)
class Report:
    """What would run where, and why: `precast doctor BUNDLE --json` as data."""
    bundle: str
    family: str | None
    size: tuple[int, int]                    # (width, height) the engines were checked against
    devices: tuple[Device, ...]              # in rank order, the CPU last
    device_warning: str | None
    installed_backends: dict[str, str]       # backend -> version
    assignment: dict[str, dict]              # module -> {device, backend, params, asked, fallback}
    components: dict[str, ComponentPlan]
    missing_for_generate: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"bundle": self.bundle, "family": self.family, "size": f"{self.size[0]}x{self.size[1]}",
                "devices": [d.describe() for d in self.devices], "device_warning": self.device_warning,
                "installed_backends": dict(self.installed_backends), "assignment": dict(self.assignment),
                "components": {c: p.as_dict() for c, p in self.components.items()},
                "missing_for_generate": list(self.missing_for_generate)}

    def __str__(self) -> str:
        out = io.StringIO()
        describe_where(self.as_dict(), out)
        return out.getvalue().rstrip("\n")


def _option(c: Candidate) -> Option:
    d = c.describe()
    return Option(d["artifact"], d["device"], d["device_name"], d["backend"], d["how"], d["note"], d.get("memory"))


def _option_dict(component: str, o: Option) -> dict:
    return {"component": component, "device": o.device, "device_name": o.device_name, "backend": o.backend,
            "artifact": o.artifact, "how": o.how, "note": o.note, **({"memory": o.memory} if o.memory else {})}


def _why(placement: Placement, chosen: Option | None, passed_over: list[dict]) -> str:
    """One line: where the module was asked to run, and what runs it there."""
    if chosen is None:
        return "nothing in the bundle can run here: " + "; ".join(passed_text(r) for r in passed_over)
    module = placement.module
    if placement.fallback:
        asked = placement.fallback
    elif placement.asked:
        asked = f"{module} assigned to {placement.target} (asked: {placement.asked!r})"
    else:
        asked = f"{module} on the first device in rank order, {placement.device.id} (nothing asked)"
    what = (f"the bundle's ONNX through {chosen.backend}, compiled/loaded at run time" if chosen.artifact == "onnx"
            else f"prebuilt {chosen.backend} engine {chosen.artifact} fits {chosen.device}")
    return f"{asked}; {what}" + (f" ({chosen.note})" if chosen.note else "")


def _plan(where: dict, placement: Placement, then: list[Candidate] = ()) -> ComponentPlan:
    """A component's plan from its doctor/generate record (select.component_report) and placement."""
    w = where
    option = Option(w["artifact"], w["device"], w["device_name"], w["backend"], w["how"], w["note"], w.get("memory")) \
        if w["device"] is not None else None
    return ComponentPlan(w["component"], w["module"], option, _why(placement, option, w["passed_over"]),
                         tuple(PassedOver(**r) for r in w["passed_over"]), tuple(_option(c) for c in then))


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
        from .png import png_bytes
        return png_bytes(self.to_uint8())

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the PNG as `precast generate --out` does: `path` checked first (a .png file in a folder
        that exists; UserError, one line, otherwise), then a temp file renamed into place, so a failed
        write leaves nothing behind."""
        out = check_out(path, "path=")
        write_image(out, self.to_uint8(), "path=")
        return out


# ---- components ----------------------------------------------------------------------------------
class Component:
    """One loaded component: `run({input: array}) -> {output: array}` on its backend and device."""

    def __init__(self, bundle: "Bundle", name: str, session, plan: ComponentPlan):
        self.bundle, self.name, self.session, self.plan = bundle, name, session, plan
        spec = bundle.manifest.components[name]
        self.inputs: dict[str, list] = {i["name"]: i.get("shape") for i in spec["inputs"]}     # manifest IO
        self.outputs: dict[str, list] = {o["name"]: o.get("shape") for o in spec["outputs"]}

    @property
    def input_names(self) -> list[str]:
        return list(self.session.input_names)

    @property
    def output_names(self) -> list[str]:
        return list(self.session.output_names)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs the component; each feed is cast to the dtype the artifact declares. A text encoder's
        textual-inversion input (`token_embeddings_extra`) is filled in when only `input_ids` is fed. Each
        feed is checked against the manifest's IO first (rank, fixed dimensions, a numeric dtype)."""
        if not isinstance(feeds, Mapping):
            raise UserError(f"{self.name}: feeds={type(feeds).__name__}: expected a dict of input name -> numpy "
                            f"array (it takes {', '.join(self.input_names)})")
        feeds = self._with_defaults({k: self._feed(k, v) for k, v in feeds.items()})
        names = self.input_names
        missing = [n for n in names if n not in feeds]
        unknown = sorted(set(feeds) - set(names))
        if missing or unknown:
            what = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                           unknown and f"no input named {', '.join(unknown)}"]))
            raise UserError(f"{self.name}: {what} (it takes {', '.join(names)})")
        return dict(self.session.run(feeds))

    __call__ = run

    def _feed(self, name: str, value) -> np.ndarray:
        label = f"{self.name}: feeds[{name!r}]"
        try:
            arr = np.asarray(value)
        except ValueError as e:       # ragged nested lists
            raise UserError(f"{label}: not an array ({e})") from None
        if arr.dtype.kind not in "biuf":
            raise UserError(f"{label}: expected a numeric numpy array, got {type(value).__name__} of {arr.dtype}")
        fixed = (getattr(self.session, "input_shapes", None) or {}).get(name)   # the loaded artifact's dims
        named = self.inputs.get(name) or []                                     # the manifest's, by name
        want = fixed or named
        if want and (arr.ndim != len(want) or any(isinstance(d, int) and d != n for d, n in zip(want, arr.shape))):
            dims = [d if isinstance(d, int) else (named[i] if i < len(named) else "?") for i, d in enumerate(want)]
            raise UserError(f"{label} has shape {list(arr.shape)}; the loaded {self.name} takes "
                            f"[{', '.join(map(str, dims))}] (named dimensions vary; the image size is set when it loads: "
                            f"bundle.load({self.name!r}, size=...))")
        return arr

    def _with_defaults(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from .embeddings import EXTRA_TOKENS_INPUT, encoder_feeds
        if EXTRA_TOKENS_INPUT in self.input_names and EXTRA_TOKENS_INPUT not in feeds and "input_ids" in feeds:
            hidden = int(self.bundle.manifest.components[self.name].get("config", {}).get("hidden", 768))
            feeds = {**encoder_feeds(self.session, self.name, feeds["input_ids"], None, hidden), **feeds}
        return feeds

    def __repr__(self) -> str:
        return f"<Component {self.name}: {self.plan.artifact} via {self.plan.backend} on {self.plan.device}>"


# ---- pipelines -----------------------------------------------------------------------------------
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


class Pipeline:
    """A bundle's reference txt2img pipeline, loaded once and called per image. `report` is what
    was loaded where (load failures that fell back included)."""

    def __init__(self, bundle: "Bundle", pipe: BundleModel):
        self.bundle, self.pipe = bundle, pipe
        self.family: str = pipe.family
        self.size: tuple[int, int] = (pipe.width, pipe.height)
        self.defaults: dict = dict(getattr(pipe, "defaults", SD_DEFAULTS))

    @property
    def dit(self) -> bool:
        """A transformer denoiser (Flux, Chroma, SD3): flow-matching Euler only, as `generate` tells them."""
        return "transformer" in self.pipe.manifest.components

    @property
    def report(self) -> Report:
        r = self.pipe.report()
        plans = {c: _plan(r["components"][c], self.pipe.placements[module_of(c)]) for c in self.pipe.needed}
        return self.bundle._report(self.size, self.pipe.devices, self.pipe.device_warning, self.pipe.installed,
                                   self.pipe.placements, plans)

    def __call__(self, prompt: str, *, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, scheduler: str | None = None,
                 on_step: StepCallback | None = None, cancel: CancelHook = None,
                 show_progress: bool = False, init_image: ImageInput | None = None, mask: ImageInput | None = None,
                 strength: float | None = None, controls: Sequence[ControlSpec] = (), guess_mode: bool = False) -> Image:
        """One image. `steps`/`guidance` default as `precast generate`'s (SD 20 / 7.5; Flux, Chroma and
        SD3 from the bundle); `scheduler`: SD euler (default) or dpm++2m; Flux/Chroma/SD3 flow-euler only.
        `on_step(done, total)` after each denoising step; `cancel` (a callable returning True, or a
        threading.Event) is checked before each step and before decoding: Cancelled when set.
        `show_progress`: the CLI's progress bar on stderr. `init_image` (img2img) and `mask` (inpainting,
        white = repaint): a PNG path or a uint8 array, fitted to the pipeline's size (runtime/images.py);
        they need a pipeline opened with image_input=True (Bundle.img2img / inpaint do that). `controls`:
        (ControlNet name, control image[, scale[, start, end]]) each, the nets loaded by
        bundle.pipeline(..., controlnets=names); `guess_mode` as `--guess-mode`."""
        sched = _check_settings(self.pipe.manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel)
        steps = self.defaults["steps"] if steps is None else int(steps)
        guidance = self.defaults["guidance"] if guidance is None else float(guidance)
        seed = int(seed)
        mode, strength = check_image_mode(self.pipe.manifest, init_image is not None, mask is not None, strength,
                                          steps, "api")
        kwargs = {"negative": negative, "steps": steps, "seed": seed, "guidance": guidance, "progress": show_progress}
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
        warnings = []
        if self.dit:
            from .dit_pipeline import SCHEDULER
            used = SCHEDULER
            if negative and self.family == "flux":
                warnings.append("the negative prompt is not used by Flux (distilled guidance, no negative prompt)")
        else:
            used = kwargs["scheduler"] = sched or SD_SCHEDULER
        with _step_hooks(self.pipe, on_step, cancel):
            pixels = self.pipe(prompt, **kwargs)
        warnings += self.pipe.prompt_warnings(prompt, negative)
        return Image(pixels, prompt, negative, seed, steps, float(guidance), used, tuple(warnings), mode, strength)


    def _controls(self, controls: Sequence[ControlSpec], guess_mode: bool) -> list:
        """runtime/control.py's plan of the checked `controls=` entries, every net loaded in this pipeline;
        UserError (one line) otherwise."""
        from .control import plan_controls
        entries = _control_entries(self.pipe.manifest, controls, guess_mode)
        plan = plan_controls(self.pipe.manifest, [(e[1], e[2]) for e in entries], [e[0] for e in entries],
                             [e[3] for e in entries], [e[4] for e in entries])
        missing = [c.component for c in plan if c.component not in self.pipe.needed]
        if missing:
            raise UserError(f"controls=: {missing[0]} is not loaded in this pipeline; open it with "
                            f"bundle.pipeline(..., controlnets=[...]) or pass controls to bundle.txt2img")
        return plan


def _control_entries(manifest, controls: Sequence[ControlSpec] | None, guess_mode: bool) -> list[tuple]:
    """`controls=` checked before anything loads: each (name, image[, scale[, start, end]]) entry ->
    (name, uint8 RGB image, scale, start, end), its numbers, its image, then its net against the bundle
    (runtime/control.py's checks, as for --controlnet / --control-start / --control-end)."""
    from .control import check_net, check_range
    from .images import init_image
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


def _check_settings(manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel) -> str | None:
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


def _check_backends(backend, params_backend) -> None:
    """`backend` / `params_backend`: strings in the --backend grammar (runtime/assign.py), or None."""
    for name, text, e in (("backend=", backend, "'te=cpu,unet=gpu0'"), ("params_backend=", params_backend, "'cpu'")):
        if text is not None and not isinstance(text, str):
            raise UserError(f"{shown(name, text)}: expected a string in the --backend grammar, e.g. {e} (or None)")


# ---- bundles -------------------------------------------------------------------------------------
@dataclass
class _Machine:
    devices: list[Device]
    warning: str | None
    placements: dict[str, Placement]
    installed: dict[str, str]


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

    @property
    def family(self) -> str | None:
        return self.manifest.model.get("family")

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
        as `verify` says): `precast doctor BUNDLE` as data."""
        _check_backends(backend, params_backend)
        w, h = self._size(size)
        m = self._machine(backend, params_backend, strict)
        sels = select_all(self.manifest, m.placements, m.devices, requests(self.manifest, 1, h, w), m.installed,
                          self.verify)
        if strict:
            stuck = next((s for s in sels.values() if s.choice is None), None)
            if stuck:
                raise UserError(nothing_runs(stuck.component, stuck.target, stuck.refused))
        plans = {c: _plan(component_report(c, s.choice, s.refused), m.placements[COMPONENT_MODULE.get(c, "diffusion")],
                          s.viable[1:]) for c, s in sels.items()}
        return self._report((w, h), m.devices, m.warning, m.installed, m.placements, plans)

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
        request = requests(self.manifest, 1, h, w).get(component, {})
        sel = select_component(self.manifest, component, placement, m.devices, request, m.installed, self.verify)
        if strict and sel.choice is None:
            raise UserError(nothing_runs(component, sel.target, sel.refused))
        outputs = [o["name"] for o in self.manifest.components[component]["outputs"]]
        session, cand, reasons = load_component(sel, outputs, placement.offload)
        rest = sel.viable[sel.viable.index(cand) + 1:]
        return Component(self, component, session, _plan(component_report(component, cand, reasons), placement, rest))

    def pipeline(self, backend: str | None = None, *, params_backend: str | None = None, size: Size = None,
                 strict: bool = False, image_input: bool = False, controlnets: Sequence[str] = ()) -> Pipeline:
        """The family's pipeline, loaded (kept: the same arguments return the same pipeline).
        `image_input`: the VAE encoder loaded too, for img2img and inpainting (SD 1.x/2.x/XL bundles that
        have one); such a pipeline also serves txt2img. `controlnets`: the bundle's ControlNets (by name)
        to load for `controls=` calls."""
        _check_backends(backend, params_backend)
        controlnets = () if controlnets is None else controlnets
        if isinstance(controlnets, (str, bytes)) or not isinstance(controlnets, Iterable) \
                or not all(isinstance(n, str) for n in controlnets):
            raise UserError(f"controlnets={controlnets!r}: expected a list of the bundle's ControlNet names, e.g. ['canny']")
        w, h = self._size(size)
        nets = tuple(sorted(set(controlnets)))
        key = (backend, params_backend, w, h, strict, nets)
        if (*key, True) in self._pipelines and not image_input:
            return self._pipelines[(*key, True)]
        key = (*key, image_input)
        if key not in self._pipelines:
            from .run_commands import pipeline_class     # the family's pipeline, as `precast generate` picks it
            cls = pipeline_class(self.manifest)
            extra = {"image_input": True} if image_input else {}
            if nets:
                from .control import check_net
                for n in nets:
                    check_net(self.manifest, n, "controlnets=")
                extra["controlnets"] = tuple(f"controlnet_{n}" for n in nets)
            pipe = cls(self.manifest, backend, params_backend, width=w, height=h, sysroot=self.sysroot,
                       strict=strict, verify=self.verify, **extra)
            self._pipelines[key] = Pipeline(self, pipe)
        return self._pipelines[key]

    def txt2img(self, prompt: str, *, negative: str = "", steps: int | None = None, seed: int = 0,
                guidance: float | None = None, scheduler: str | None = None, size: Size = None,
                backend: str | None = None, params_backend: str | None = None, strict: bool = False,
                on_step: StepCallback | None = None, cancel: CancelHook = None,
                show_progress: bool = False, controls: Sequence[ControlSpec] = (), guess_mode: bool = False) -> Image:
        """One image in one call: `pipeline(...)` (loaded once per backend/size) then `Pipeline.__call__`.
        The same image as `precast generate` with the same settings. `controls`: ControlNets, each
        (name, image[, scale[, start, end]]) as `--controlnet NAME --control IMAGE:SCALE`."""
        _check_settings(self.manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel)
        check_image_mode(self.manifest, False, False, None, 1, "api")   # an inpainting UNet needs an image and mask
        controls = _control_entries(self.manifest, controls, guess_mode)
        pipe = self.pipeline(backend, params_backend=params_backend, size=size, strict=strict,
                             controlnets=[c[0] for c in controls])
        return pipe(prompt, negative=negative, steps=steps, seed=seed, guidance=guidance, scheduler=scheduler,
                    on_step=on_step, cancel=cancel, show_progress=show_progress, controls=controls,
                    guess_mode=guess_mode)

    def img2img(self, prompt: str, image: ImageInput, *, strength: float | None = None, negative: str = "",
                steps: int | None = None, seed: int = 0, guidance: float | None = None, scheduler: str | None = None,
                size: Size = None, backend: str | None = None, params_backend: str | None = None,
                strict: bool = False, on_step: StepCallback | None = None, cancel: CancelHook = None,
                show_progress: bool = False, controls: Sequence[ControlSpec] = (), guess_mode: bool = False) -> Image:
        """img2img in one call (SD 1.x/2.x/XL bundles with a vae_encoder): `image` (a PNG path or a uint8
        array) encoded, noised to the first of the int(steps x strength) steps it runs (strength: more
        than 0, at most 1; default 0.8), then denoised as txt2img. `size`: default the image's own
        (multiples of 8); another size centre-crops the image to its aspect ratio and resizes it.
        `precast generate --init-image` with the same settings writes the same PNG."""
        return self._image_mode(prompt, image, None, strength, negative, steps, seed, guidance, scheduler, size,
                                backend, params_backend, strict, on_step, cancel, show_progress, controls, guess_mode)

    def inpaint(self, prompt: str, image: ImageInput, mask: ImageInput, *, strength: float | None = None,
                negative: str = "", steps: int | None = None, seed: int = 0, guidance: float | None = None,
                scheduler: str | None = None, size: Size = None, backend: str | None = None,
                params_backend: str | None = None, strict: bool = False, on_step: StepCallback | None = None,
                cancel: CancelHook = None, show_progress: bool = False, controls: Sequence[ControlSpec] = (),
                guess_mode: bool = False) -> Image:
        """Inpainting in one call: `mask` (the image's size; white = repaint, luma >= 128) says what is
        painted anew. An inpainting UNet (9 input channels) sees the mask and the masked image; a plain
        UNet inpaints by latent blending. `strength` default 1.0 (from pure noise); otherwise as img2img.
        `precast generate --init-image --mask` with the same settings writes the same PNG."""
        if mask is None:
            raise UserError("mask=: inpainting needs a mask (white = repaint); for img2img call bundle.img2img")
        return self._image_mode(prompt, image, mask, strength, negative, steps, seed, guidance, scheduler, size,
                                backend, params_backend, strict, on_step, cancel, show_progress, controls, guess_mode)

    def _image_mode(self, prompt, image, mask, strength, negative, steps, seed, guidance, scheduler, size, backend,
                    params_backend, strict, on_step, cancel, show_progress, controls=(), guess_mode=False) -> Image:
        """Everything checked before any engine loads: settings, the images, the mode against the bundle."""
        from . import images
        _check_settings(self.manifest, prompt, negative, steps, seed, guidance, scheduler, on_step, cancel)
        if strength is not None:
            check_strength(strength, "strength=")
        init = images.init_image(image, "init_image")
        mask_px = images.mask_image(mask, init, "mask") if mask is not None else None
        check_image_mode(self.manifest, True, mask is not None, strength,
                         SD_DEFAULTS["steps"] if steps is None else steps, "api")
        controls = _control_entries(self.manifest, controls, guess_mode)
        if size is None:
            size = images.output_size(init, "init_image", image if not isinstance(image, np.ndarray) else None,
                                      latent_factor(self.manifest))
        pipe = self.pipeline(backend, params_backend=params_backend, size=size, strict=strict, image_input=True,
                             controlnets=[c[0] for c in controls])
        return pipe(prompt, negative=negative, steps=steps, seed=seed, guidance=guidance, scheduler=scheduler,
                    on_step=on_step, cancel=cancel, show_progress=show_progress, init_image=init, mask=mask_px,
                    strength=strength, controls=controls, guess_mode=guess_mode)

    # ---- helpers ---------------------------------------------------------------------------------
    def _size(self, size: Size) -> tuple[int, int]:
        if size is None:
            return self.optimal_size
        from .run_commands import parse_size
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

    def _machine(self, backend: str | None, params_backend: str | None, strict: bool) -> _Machine:
        devices, warning = apply_device_override(discover_devices(self.sysroot, os.environ), os.environ)
        extra = tuple(dict.fromkeys(COMPONENT_MODULE.get(c, "diffusion") for c in self.manifest.components))
        modules = DEFAULT_MODULES + tuple(x for x in extra if x not in DEFAULT_MODULES)
        placements = assign_modules(devices, backend, params_backend, modules, strict=strict)
        return _Machine(devices, warning, placements, installed_backends(self.sysroot))

    def _report(self, size, devices, warning, installed, placements, plans) -> Report:
        from .run_commands import _missing_for_generate
        return Report(str(self.path), self.family, tuple(size), tuple(devices), warning, dict(installed),
                      {mod: p.describe() for mod, p in placements.items()}, plans,
                      tuple(_missing_for_generate(self.manifest)))


def open_bundle(path: str | os.PathLike, *, verify: Verify = "auto", sysroot: str = "/") -> Bundle:
    """Reads and checks a bundle's manifest (UserError, one line, if it is not a bundle). `verify`, as
    `--verify`: "auto" hashes each file once per file state (records trusted while the file is
    unchanged), "full" hashes every file again on every load. `sysroot`: read devices from a recorded
    tree (tests)."""
    if not isinstance(path, (str, os.PathLike)):
        raise UserError(f"path={path!r}: expected the bundle's folder (a str or os.PathLike), e.g. 'build/demo/bundle'")
    mode = str(verify).lower()
    if mode not in ("auto", "full"):
        raise UserError(f"verify={verify!r}: expected 'auto' or 'full'")
    return Bundle(Path(path), read_manifest(path), mode, sysroot)
