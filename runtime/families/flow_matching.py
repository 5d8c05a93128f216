"""What the flow-matching families (flux.py: Flux, Chroma; sd3.py: SD3, SD3.5) share: opening such a bundle,
the denoising loop and the checks of what they do not run.

Owns: FlowPipeline -- the size (2x2 latent patches of the VAE's scale), the T5 length to run with, the
bundle's schedule and defaults (the manifest's, else the family's), then per call: noise, flow-matching
Euler (runtime/flow.py) with classifier-free guidance where the family reads a negative prompt, the VAE's
scale and shift. A family module gives its conditioning (`encode`), how the transformer reads latents
(`to_transformer` / `from_transformer`), its timestep feed and any fixed feeds. Also `t5_length` and
`txt2img_only` (these families run no img2img / inpainting: their one-line refusals).
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from ..checks import check_steps
from ..errors import UserError
from ..flow import FlowEuler, FlowSchedule
from ..image_size import image_size, latent_factor
from ..loading import BundleModel, open_manifest
from ..manifest import Manifest
from .family import Family

SCHEDULER = "flow-euler"      # the only sampler these families run (flow-matching Euler, runtime/flow.py)


def t5_length(manifest: Manifest) -> int:
    """The T5 length to run with: the model's own (e.g. Flux dev 512, schnell 256) where a profile of the
    transformer covers it, else the longest its profiles were built for (padding to more tokens
    never loses any; a shorter length cuts the prompt)."""
    default = int(manifest.info.t5_tokens or 512)
    ranges = [p["t5_tokens"] for p in manifest.components["transformer"].get("profiles") or []
              if isinstance(p.get("t5_tokens"), list)]
    if not ranges or any(lo <= default <= hi for lo, _, hi in ranges):
        return default
    return int(max(opt for _, opt, _ in ranges))


def txt2img_only(manifest, init: bool, mask: bool, strength: float | None, steps: int,
                 names: str = "cli") -> tuple[str, None]:
    """A flow family's image mode: txt2img; an init image, mask or strength is one UserError."""
    n = {"cli": ("--init-image", "--mask", "--strength"), "api": ("init_image=", "mask=", "strength=")}[names]
    if mask and not init:
        raise UserError(f"{n[1]}: inpainting needs the image the mask applies to: give {n[0]} too")
    if init:
        raise UserError(f"{n[0]}: img2img and inpainting are for SD 1.x/2.x/XL bundles now; this one is "
                        f"{manifest.model.get('family')}")
    if strength is not None:
        raise UserError(f"{n[2]}: applies to img2img and inpainting; give {n[0]} too")
    return "txt2img", None


class FlowPipeline(BundleModel):
    """Text-to-image over a flow-matching bundle; a family module's subclass says how its transformer is
    conditioned and fed. `spec`: the family's record, set on the subclass."""
    families: dict[str, Family] = {}     # the family records this pipeline runs, by name
    size_why = "{family} reads 2x2 latent patches of the VAE's 1/{f} scale"

    def __init__(self, bundle: str | Path | Manifest, backend: str | None = None, params_backend: str | None = None,
                 width: int | None = None, height: int | None = None, sysroot: str = "/", env=None,
                 verify: bool | str = True, strict: bool = False, lazy: bool = True):
        """`width`/`height` default to the bundle's optimal size (its transformer profile's opt);
        `strict`: every module runs where `backend` assigns it, or a UserError (no fallback);
        `lazy`: the VAE decoder goes on loading while the prompt is encoded and denoised."""
        env = os.environ if env is None else env
        manifest, manifest_s = open_manifest(bundle)
        info = manifest.info
        family = self.family = info.family
        if family not in self.families:
            raise UserError(f"{manifest.root}: {self.refusal}; this one is {family}")
        self.spec = self.families[family]
        f = 2 * latent_factor(manifest)
        width, height = image_size(manifest, width, height, f, self.size_why.format(family=family, f=f // 2))
        self.check_io(manifest)
        self.width, self.height = width, height
        self.t5_tokens = t5_length(manifest)
        needed = self.spec.needs[:-2] + tuple(c for c in self.spec.optional if c in manifest.components) + \
            self.spec.needs[-2:]
        super().__init__(manifest, needed, self.spec.requests(manifest, 1, height, width), backend, params_backend,
                         sysroot, env, verify, strict, later=("vae_decoder",) if lazy else ())
        self.stages = {"manifest": manifest_s, **self.stages}
        self.latent_scale = float(info.latent_scale or self.spec.latent_scale)
        self.latent_shift = float(self.spec.latent_shift if info.latent_shift is None else info.latent_shift)
        self.schedule = FlowSchedule.from_config(info.scheduler or self.default_schedule)
        self.defaults = {"steps": int(info.steps or self.spec.steps),
                         "guidance": float(self.spec.guidance if info.guidance is None else info.guidance)}

    default_schedule: dict = {}          # the schedule of a bundle whose manifest records none
    refusal = ""                         # "the X pipeline runs Y bundles"

    # ---- what a family gives ---------------------------------------------------------------------
    def check_io(self, manifest: Manifest) -> None:
        """The manifest's transformer IO as this family's transformer has it, else one UserError."""

    def noise(self, seed: int) -> np.ndarray:
        """The seed's starting noise, as the transformer's latents are shaped before `to_transformer`."""
        raise NotImplementedError

    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The transformer's text inputs for one prompt."""
        raise NotImplementedError

    def to_transformer(self, latents: np.ndarray) -> np.ndarray:
        return latents

    def from_transformer(self, x: np.ndarray) -> np.ndarray:
        return x

    def image_tokens(self, x: np.ndarray) -> int:
        """Image tokens the transformer sees (the dynamic shift's resolution)."""
        return (x.shape[2] // 2) * (x.shape[3] // 2)

    def timestep(self, sampler: FlowEuler, i: int, t) -> np.ndarray:
        return np.full((1,), t, np.float32)

    def fixed_feeds(self, transformer, guidance: float) -> dict[str, np.ndarray]:
        """Inputs every step takes unchanged (position ids, distilled guidance)."""
        return {}

    # ---- generation --------------------------------------------------------------------------------
    def __call__(self, prompt: str, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, latents: np.ndarray | None = None, progress: bool = True,
                 scheduler: str = SCHEDULER) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]. `latents`: starting noise shaped as
        `noise` makes it, instead of the seed's. Guidance above 1 runs the negative prompt too (CFG) in the
        families that read one. `scheduler`: flow-euler, the one these families run."""
        steps = self.defaults["steps"] if steps is None else steps
        guidance = self.defaults["guidance"] if guidance is None else guidance
        check_steps(steps)
        x = self.to_transformer(self.noise(seed) if latents is None else latents.astype(np.float32))
        sampler = FlowEuler(self.schedule, steps, self.image_tokens(x))
        run = self.run_stages = {}
        t0 = time.perf_counter()
        cond = self.encode(prompt)
        cfg = self.spec.negative and guidance > 1.0
        uncond = self.encode(negative) if cfg else None
        transformer = self.component("transformer").session
        fixed = self.fixed_feeds(transformer, guidance)
        run["encode"] = round(time.perf_counter() - t0, 3)
        for i, t in self.denoising(sampler.timesteps, progress):
            step = {"hidden_states": x, "timestep": self.timestep(sampler, i, t), **fixed}
            v = transformer.run({**step, **cond})["out_hidden_states"].astype(np.float32)
            if cfg:
                v_neg = transformer.run({**step, **uncond})["out_hidden_states"].astype(np.float32)
                v = v_neg + np.float32(guidance) * (v - v_neg)
            x = sampler.step(v, i, x)
        del transformer          # one at a time: the VAE decoder may load only once the denoiser is released
        image = self.decode(self.from_transformer(x) / np.float32(self.latent_scale) + np.float32(self.latent_shift))
        return np.clip(image / 2 + 0.5, 0.0, 1.0)
