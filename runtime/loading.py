"""Opening a bundle to generate, whatever its family: what every pipeline (runtime/families/) is built on.

Owns: BundleModel (a bundle opened to generate: devices, assignment, selection, verified loading in
loader threads or one at a time under a memory budget, the denoising loop's progress / hooks / timings,
its VAE passes (runtime/vae_passes.py's VaePasses: plain, blended tiles or exact tiles), a model at another image size
sharing its loaded engines (`at_size`, the hires fix's second pass), step previews (the preview decoder
loaded on first use, or runtime/previews.py's projection),
the report of what ran where, the sizes a chosen engine's profile takes, the prompt truncation warnings) and
the pixels' conversion (the image size is runtime/image_size.py's; the tokenizers a bundle carries and the text
state a denoiser reads are runtime/text_encoders.py's).
Imports numpy, the runtime's own modules, and lazily the backends in use; never the compiler, never a
family module (they import this).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .assign import assign_modules, module_of
from .budgets import keep_shared_plan, memory_summary
from .devices import apply_device_override, discover_devices
from .errors import UserError
from .image_size import latent_factor
from .manifest import Manifest, read_manifest
from .previews import PREVIEW_DECODER, project, to_pixels, upscale
from .progress import bar
from .prompts import weighted_ids
from .select import component_report, covers, installed_backends, load_component, select_all, select_component
from .text_encoders import bundle_tokenizers
from .vae_passes import VaePasses
from .vae_tiling import tile_requests
from .verified import verify_mode


def open_manifest(bundle) -> tuple:
    """(the bundle's manifest -- read and checked by read_manifest unless already read --, seconds it took)."""
    t0 = time.perf_counter()
    manifest = bundle if isinstance(bundle, Manifest) else read_manifest(bundle)
    return manifest, round(time.perf_counter() - t0, 3)


def _progress(total: int, enabled: bool):
    """The denoise loop's progress on stderr (runtime/progress.py: a tqdm bar on a terminal when
    tqdm is installed, else a plain line every PRECAST_PROGRESS_INTERVAL seconds)."""
    return bar(total, "denoise", unit="steps", enabled=enabled)


@dataclass
class Loaded:
    session: object
    where: dict
    reasons: list[str] = field(default_factory=list)


@contextmanager
def timed(stages: dict, name: str):
    """Adds the block's wall seconds to `stages[name]` (rounded to ms)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stages[name] = round(stages.get(name, 0.0) + time.perf_counter() - t0, 3)


class BundleModel(VaePasses):
    """A bundle opened to generate: its manifest read and checked, devices discovered, modules
    assigned, the tokenizers (small) checked before any engine, and each component in `needed`
    selected (fingerprint, profile, sha256) and loaded, with the reasons for every fallback.

    Selection reads headers and manifests only (one pass over every component, no hashing); then
    each needed component is verified (the sha256 of what its selection examines) and loaded by a
    pool of loader threads, one per 4 cores, in `needed` order (the backends release the GIL while
    they open a model, hashlib while it hashes), its fallbacks tried in order there. The components in `later` (the VAE decoder, which
    runs last) are left loading in the background: `component()` waits for one on first use, and
    `report()` for all. A load error is raised as the component's own UserError (one line), the
    first in `needed` order; `check_loading()` raises a background one as soon as it is known.
    When the memory plan loads components one at a time (their weights together exceed the device's
    budget, or on the CPU their expected peak its available memory: budgets.share_budgets; a CPU whose
    every plan is expected to exceed it is one warning on stderr, then tried), nothing is loaded up
    front: `component()` loads one on first use and releases the others under that plan first, so the
    text encoders are gone before the denoiser loads, and the denoiser before the VAE decoder.
    `stages` records the seconds of each stage (see README, "JSON output"): discover, assign,
    backends, tokenizers, select; per component verify and load (each in its own thread); ready
    (from the loads' start until the pipeline can run: every component but `later` loaded) and
    open (until the last component is loaded)."""

    def __init__(self, manifest: Manifest, needed: tuple[str, ...], reqs: dict, backend: str | None,
                 params_backend: str | None, sysroot: str, env, verify: bool | str, strict: bool = False,
                 later: tuple[str, ...] = (), vae_tiling: bool | None = None, vae_tile: int | None = None):
        if verify_mode(verify) == "full":    # every file hashed again, tokenizers included; records refreshed
            manifest = manifest.with_verify("full")
        self.manifest, self.needed = manifest, needed
        missing = [c for c in needed if c not in manifest.components]
        if missing:
            what = "img2img / inpainting" if "vae_encoder" in needed else "txt2img"
            raise UserError(f"{manifest.root}: {what} needs {', '.join(needed)}; the bundle lacks {', '.join(missing)}")
        self.stages: dict = {}
        self.run_stages: dict = {}      # the last call's: encode, first_step, denoise, wait_vae, decode
        self.batches: list[int] = []    # the last call's images per denoiser call
        # VAE tiling (runtime/vae_tiling.py): None = when past the engine's profile or the memory budget; the
        # tile's side in px; what the last passes did ({"decoder" / "encoder": record}, reset by the caller)
        self.vae_tiling, self.vae_tile, self.tiled, self.exact = vae_tiling, vae_tile, {}, {}
        # a one-shot caller's word that the next call is the last (`precast generate`): each component is released
        # once its stage is over -- the text encoders when denoising starts, the denoiser before decoding
        self.release_after_use = False
        reqs = tile_requests(manifest, reqs, vae_tiling, vae_tile, latent_factor(manifest))
        with timed(self.stages, "discover"):
            devices = discover_devices(sysroot, env)
            self.devices, self.device_warning = apply_device_override(devices, env)
        with timed(self.stages, "assign"):
            modules = ("te", "diffusion", "vae") + (("controlnet",) if any(c.startswith("controlnet_") for c in needed)
                                                    else ())
            self.placements = assign_modules(self.devices, backend, params_backend, modules, strict=strict)
        with timed(self.stages, "backends"):
            self.installed = installed_backends(sysroot)
        with timed(self.stages, "tokenizers"):
            self.tokenizers, self.embeddings = bundle_tokenizers(manifest, needed)
        with timed(self.stages, "select"):   # headers and manifests only: which artifact goes first for every component
            self.selections = select_all(manifest, self.placements, self.devices, reqs, self.installed, False,
                                         together=needed)
        for plan in memory_summary({c: s.choice.memory for c, s in self.selections.items()
                                    if c in needed and s.choice is not None}, self.devices).values():
            if plan["warning"]:       # the estimate may be pessimistic: said once, then tried
                print(f"warning: {plan['warning']}", file=sys.stderr, flush=True)
        # per component, in `needed` order whatever order the threads finish in (null until loaded)
        self.stages["verify"], self.stages["load"] = dict.fromkeys(needed), dict.fromkeys(needed)
        self.stages["ready"] = self.stages["open"] = None
        self.loaded: dict[str, Loaded] = {}
        self._ended: dict[str, float] = {}
        self._opened = time.perf_counter()
        checks = verify_mode(verify) != "off"    # "full" made the manifest hash everything again, above
        self.verify_files = checks
        self.one_at_a_time = {c for c, s in self.selections.items()
                              if c in needed and s.choice is not None and (s.choice.memory or {}).get("plan") == "one-at-a-time"}
        self._load_later = (manifest, reqs, checks)
        if self.one_at_a_time:      # loaded on first use, the others under the plan released first
            self._futures = {}
            self.stages["ready"] = 0.0
            return
        # one loader per 4 cores: on 2 cores parallel imports only slow the UNet's (measured: 2.82 s
        # against 2.01 s alone, benchmarks/startup.py); one loader there still overlaps the VAE decoder
        # with encoding and denoising
        workers = max(1, min(len(needed), (os.cpu_count() or 1) // 4))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="precast-load")
        self._futures: dict[str, Future] = {
            comp: self._pool.submit(self._open, manifest, comp, reqs.get(comp, {}), checks) for comp in needed}
        self._pool.shutdown(wait=False)     # its threads end with their loads
        try:
            for comp in needed:
                if comp not in later:
                    self.component(comp)
        except BaseException:
            for f in self._futures.values():
                f.cancel()
            raise
        self.stages["ready"] = round(max([self._ended[c] for c in needed if c not in later], default=self._opened)
                                     - self._opened, 3)
        if not any(c in later for c in needed):
            self.wait_loaded()

    def _open(self, manifest: Manifest, comp: str, request: dict, verify: bool) -> Loaded:
        """In a loader thread: verify what the component's selection examines (selection again, with
        the sha256 checks), then load the first candidate that loads (load_component tries the
        fallbacks in order)."""
        t0 = time.perf_counter()
        placement = self.placements[module_of(comp)]
        if verify:
            sel = select_component(manifest, comp, placement, self.devices, request, self.installed, True)
            keep_shared_plan(self.selections[comp], sel)     # a plan made over all components (one at a time)
            self.selections[comp] = sel
        else:
            sel = self.selections[comp]
        t1 = time.perf_counter()
        self.stages["verify"][comp] = round(t1 - t0, 3)
        outputs = [o["name"] for o in self.manifest.components[comp]["outputs"]]
        session, cand, reasons = load_component(sel, outputs, placement.offload)
        self._ended[comp] = time.perf_counter()
        self.stages["load"][comp] = round(self._ended[comp] - t1, 3)
        return Loaded(session, component_report(comp, cand, reasons), reasons)

    def component(self, comp: str) -> Loaded:
        """The loaded component, waiting for its loader thread the first time (one at a time: loaded
        here, after releasing the others under that plan)."""
        if comp in self.loaded and self.loaded[comp].session is not None:
            return self.loaded[comp]
        if self.one_at_a_time or comp not in self._futures:      # one at a time, or released (release())
            for other in self.one_at_a_time - {comp}:
                if other in self.loaded and self.loaded[other].session is not None and self._displaces(comp, other):
                    self.loaded[other] = dataclasses.replace(self.loaded[other], session=None)
            gc.collect()          # a session's memory goes with its last reference
            manifest, reqs, checks = self._load_later
            self.loaded[comp] = self._open(manifest, comp, reqs.get(comp, {}), checks)
            return self.loaded[comp]
        self.loaded[comp] = self._futures[comp].result()
        return self.loaded[comp]

    def _displaces(self, comp: str, other: str) -> bool:
        """One at a time: loading `comp` releases `other` when they run at different stages on the same
        device (text encoding, denoising -- the UNet or transformer with its ControlNets --, VAE)."""
        stages = {module_of(c).replace("controlnet", "diffusion") for c in (comp, other)}
        a, b = self.selections[comp].choice, self.selections[other].choice
        return len(stages) == 2 and (a is None or b is None or a.device.id == b.device.id)

    def check_loading(self) -> None:
        """Raise a background load's error now, if one has failed (called between denoising steps)."""
        for comp, f in self._futures.items():
            if comp not in self.loaded and f.done() and f.exception() is not None:
                self.component(comp)

    def wait_loaded(self) -> None:
        """Every component loaded, in `needed` order (so the first failure raised is deterministic);
        `stages["open"]` is then the wall time from the first load's start to the last one's end."""
        for comp in self.needed:
            if comp not in self.loaded:      # loaded once is enough (one at a time, or released after use)
                self.component(comp)
        self.stages["open"] = round(max(self._ended.values(), default=self._opened) - self._opened, 3)

    def text_limits(self) -> dict[str, int]:
        """Prompt tokens each text encoder reads (CLIP: 77 positions less BOS and EOS)."""
        return {comp: 75 for comp in self.tokenizers}

    def prompt_warnings(self, *prompts: str | None) -> list[str]:
        """What a text encoder will cut off, as diffusers warns: one line per prompt and encoder (its tokens
        counted without the weighting syntax, runtime/prompts.py)."""
        out = []
        for which, prompt in zip(("prompt", "negative prompt"), prompts):
            for comp, limit in self.text_limits().items() if prompt else ():
                n = len(weighted_ids(self.tokenizers[comp], prompt)[0])
                if n > limit:
                    out.append(f"the {which} is {n} tokens for {comp}, which reads the first {limit}; "
                               "the rest is ignored")
        return out

    def input_range(self, comp: str, name: str, axis: int) -> tuple[int, int] | None:
        """(min, max) along `axis` of input `name` that `comp`'s engine takes: the shape profile of the
        artifact loaded (before it loads: the one selection chose first); None for the bundle's ONNX,
        compiled at run time, which takes any size."""
        loaded = self.loaded.get(comp)
        if loaded is not None:
            artifact = next((a for a in self.manifest.artifacts(comp) if a.id == loaded.where.get("artifact")), None)
        else:
            choice = self.selections[comp].choice if comp in self.selections else None
            artifact = choice.artifact if choice else None
        shape = artifact.shapes.get(name) if artifact else None
        return (shape[0][axis], shape[2][axis]) if shape else None

    def batch_limit(self, comp: str, name: str, wanted: int, rows: int = 1) -> int:
        """Images one call of `comp` takes, at most `wanted` (1 at least): the largest batch of input `name`
        its engine's profile takes (input_range), over `rows` batch rows per image (2 where the CFG halves
        run in one call)."""
        r = self.input_range(comp, name, 0)
        return max(1, min(wanted, r[1] // rows)) if r else wanted

    step_hook = None     # an object with before(i, total) / after(done, total, latents): the Python API's callbacks

    def denoising(self, timesteps, progress: bool, latents=None):
        """(i, t) for each step of a denoising loop, with what every loop needs around its body: a
        VAE decoder that failed to load in the background stops the run before the step, the
        progress bar (closed on an error too: an exception in the body closes this generator),
        `step_hook` (before each step and before decoding; after each step, given `latents`: a callable
        returning the loop's current estimate of the clean latents, [N, C, h, w] in the denoiser's space,
        for previews -- called only when one is asked for) and `run_stages` first_step and denoise."""
        t0 = time.perf_counter()
        if self.release_after_use:     # the prompts are encoded: the text encoders' stage is over
            self.release(("te",))
        hook, total = self.step_hook, len(timesteps)
        with _progress(total, progress) as bar:
            for i, t in enumerate(timesteps):
                self.check_loading()
                if hook is not None:
                    hook.before(i, total)
                yield i, t
                bar.update(1)
                if hook is not None:
                    hook.after(i + 1, total, latents)
                if i == 0:
                    self.run_stages["first_step"] = round(time.perf_counter() - t0, 3)
        if hook is not None:
            hook.before(total, total)         # once more before decoding
        self.run_stages["denoise"] = round(time.perf_counter() - t0, 3)
        self.trim(keep=("vae_decoder", "vae_encoder", "preview_decoder"))

    def release(self, modules: tuple[str, ...]) -> None:
        """Loaded components of these modules ("te", "diffusion", "controlnet") let go of, sessions and futures
        (a later `component()` would load them again): their memory goes with their last reference."""
        for comp in [c for c in self.loaded if module_of(c) in modules and self.loaded[c].session is not None]:
            self.loaded[comp] = dataclasses.replace(self.loaded[comp], session=None)
            if comp in self._futures:
                del self._futures[comp]
        gc.collect()

    def trim(self, keep=()) -> None:
        """Loaded sessions other than `keep` give back the pages they read in place (an OpenVINO blob's mapped
        constants, sessions.OpenVinoSession.trim): between denoising and decoding the denoiser's are not
        needed, and its next call reads them again from the page cache (SD 1.5's UNet, OpenVINO: the decode
        stage's peak RSS 8.98 -> 4.8 GiB, benchmarks/memory.py)."""
        for comp, loaded in list(self.loaded.items()):
            if comp not in keep and hasattr(loaded.session, "trim"):
                loaded.session.trim()

    def at_size(self, width: int, height: int, reqs: dict) -> "BundleModel | None":
        """This model at width x height, sharing its loaded components, when every one's engine takes that
        size's shapes `reqs` (the family's requests; the VAE's as tile_requests makes them), else None."""
        reqs = tile_requests(self.manifest, reqs, self.vae_tiling, self.vae_tile, latent_factor(self.manifest))
        for comp in self.needed:
            loaded = self.loaded.get(comp)
            artifact = next((a for a in self.manifest.artifacts(comp) if a.id == loaded.where.get("artifact")), None) \
                if loaded is not None else (self.selections[comp].choice.artifact if self.selections[comp].choice
                                            else None)
            if artifact is not None and covers(artifact, reqs.get(comp, {})) is not None:
                return None
        other = copy.copy(self)
        other.width, other.height = width, height
        return other

    _preview = None      # (latents' shape, the preview decoder's session loaded for it)

    def preview(self, latents: np.ndarray, method: str, rgb) -> np.ndarray:
        """A step preview, uint8 [H, W, 3] at the image's size, of the first image of `latents` ([N, C, h, w] in
        the denoiser's space): method "taesd" runs the bundle's preview decoder (a TAESD-style tiny autoencoder, fed
        the latents / its config's latent_scale + latent_shift: 1 and 0 for TAESD, which decodes the denoiser's
        latents as they are), "latent2rgb" projects with the family's LatentRGB `rgb` (runtime/previews.py) and
        upscales that, nearest. `run_stages["preview"]` adds up their seconds."""
        with timed(self.run_stages, "preview"):
            x = np.ascontiguousarray(latents[:1], dtype=np.float32)
            if method == "taesd":
                cfg = self.manifest.components[PREVIEW_DECODER].get("config", {})
                x = x / np.float32(cfg.get("latent_scale", 1.0)) + np.float32(cfg.get("latent_shift", 0.0))
                return to_pixels(self.preview_decoder(x.shape).run({"latent_sample": x})["sample"][0].astype(np.float32))
            return upscale(project(x[0], rgb.factors, rgb.bias), self.width // x.shape[3])

    def preview_decoder(self, shape: tuple):
        """The preview decoder's session, selected for latents of `shape` and loaded (verified as the run's
        components are, fallbacks in order) on first use, on the VAE's device, again when the shape changes (a
        hires pass). It is no part of `needed`: a run without its previews never loads it, and `report` leaves
        it out."""
        if self._preview is None or self._preview[0] != tuple(shape):
            placement = self.placements[module_of(PREVIEW_DECODER)]
            sel = select_component(self.manifest, PREVIEW_DECODER, placement, self.devices,
                                   {"latent_sample": tuple(shape)}, self.installed, self.verify_files)
            outputs = [o["name"] for o in self.manifest.components[PREVIEW_DECODER]["outputs"]]
            self._preview = tuple(shape), load_component(sel, outputs, placement.offload)[0]
        return self._preview[1]

    def report(self) -> dict:
        """What ran where, in the schema `doctor --json` shares (see README, "JSON output")."""
        self.wait_loaded()
        return {"devices": [d.describe() for d in self.devices], "device_warning": self.device_warning,
                "installed_backends": self.installed,
                "assignment": {m: p.describe() for m, p in self.placements.items()},
                "components": {**{c: self.loaded[c].where for c in self.needed},
                               **{c: where for c, (_, where) in self.exact.items()}}}


def to_uint8(image: np.ndarray) -> np.ndarray:
    return (image * 255).round().astype(np.uint8)
