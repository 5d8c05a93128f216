"""What the flow-matching families (flux.py: Flux, Chroma; sd3.py: SD3, SD3.5) share: opening such a bundle,
the denoising loop and the checks of what they do not run.

Owns: FlowPipeline -- the size (2x2 latent patches of the VAE's scale), the T5 length to run with, the
bundle's schedule and defaults (the manifest's, else the family's), then per call: noise (each image's from
its own seed, as many images per transformer call as its profile takes), a flow-matching sampler on that
schedule (runtime/flow.py: Euler, Heun, DPM++ 2M) with classifier-free guidance where the family reads a
negative prompt, the VAE's scale and shift; img2img (an init image encoded by the bundle's VAE encoder -- its
distribution's mean, scaled as the decoder's latents are -- and mixed with the noise at the first sigma the
strength leaves, sigma * noise + (1 - sigma) * latents, then the rest of the schedule: diffusers' get_timesteps
and FlowMatchEulerDiscreteScheduler.scale_noise); the step previews' estimate (x - sigma * v, unpacked). A family module
gives its conditioning (`encode`), how the transformer reads latents (`to_transformer` / `from_transformer`), its
timestep feed, any fixed feeds and, where it differs from the usual, how guidance combines the two velocities
(`guide`) and, where its latents are normalised otherwise, `encode_image`. Also `t5_length`, `txt2img_only`
(the families that run no img2img / inpainting: their one-line refusals), `img2img_mode` and `first_step` (the
families that run img2img: Flux, Chroma, SD3, Z-Image, Qwen-Image; no inpainting), `check_latent_stats` and `chat_cut_warnings`
(what an LLM text encoder's family cuts off a prompt: Z-Image, FLUX.2, Qwen-Image).
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from ..checks import check_steps, check_strength
from ..errors import UserError
from ..flow import SAMPLERS, FlowEuler, FlowSchedule
from ..image_size import image_size, latent_factor
from ..images import image_tensor
from ..loading import BundleModel, open_manifest
from ..manifest import Manifest
from .family import Family, reads_negative

SCHEDULER = "flow-euler"      # the default sampler of these families (runtime/flow.py SAMPLERS: the others)
FLOW_SAMPLERS = tuple(SAMPLERS)       # the --scheduler names these families take (flow-euler first)
IMG2IMG_STRENGTH = 0.6     # the default strength of diffusers' Flux / SD3 / ZImage / QwenImage Img2ImgPipelines
NAMES = {"cli": ("--init-image", "--mask", "--strength"), "api": ("init_image=", "mask=", "strength=")}


def chat_cut_warnings(tokenizer, template, limit: int, prompts, where: str, reader: str = "the text encoder",
                      drop: int = 0) -> list[str]:
    """One line per prompt an LLM text encoder's family cuts off: its tokens in the family's chat template `where`
    names (less the `drop` the pipeline removes), past the `limit` that `reader` reads."""
    out = []
    for which, prompt in zip(("prompt", "negative prompt"), prompts):
        n = len(tokenizer.chat(prompt, template, 1 << 30)) - drop if prompt else 0
        if n > limit:
            out.append(f"the {which} is {n} tokens in {where}, of which {reader} reads the first {limit}; the rest "
                       "is ignored")
    return out


def check_latent_stats(cfg: dict, keys: tuple[str, str], n: int, field: str, what: str) -> None:
    """A VAE config's per-channel latent statistics (mean key, std key): n finite numbers each, the stds
    positive; else one UserError naming `field`.KEY and `what` they should be."""
    for key in keys:
        values = cfg.get(key)
        if not isinstance(values, list) or len(values) != n or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in values) or \
                (key == keys[1] and min(values) <= 0):
            raise UserError(f"{field}.{key}: not the {n} {what}; rebuild or re-download the bundle")


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
    n = NAMES[names]
    if mask and not init:
        raise UserError(f"{n[1]}: inpainting needs the image the mask applies to: give {n[0]} too")
    if init:
        raise UserError(f"{n[0]}: img2img and inpainting are for SD 1.x/2.x/XL bundles now (img2img for Flux, Chroma, SD3, "
                        f"Z-Image and Qwen-Image too); this one is {manifest.model.get('family')}")
    if strength is not None:
        raise UserError(f"{n[2]}: applies to img2img and inpainting; give {n[0]} too")
    return "txt2img", None


def first_step(steps: int, strength: float) -> int:
    """The first step an img2img run takes: these pipelines' get_timesteps (init_timestep = min(steps * strength,
    steps), no int() first, unlike SD's; t_start = int(steps - init_timestep)): at least one step is run."""
    return int(max(steps - min(steps * strength, steps), 0))


def img2img_mode(manifest, init: bool, mask: bool, strength: float | None, steps: int,
                 names: str = "cli") -> tuple[str, float | None]:
    """(mode, strength) of a flow family that runs img2img: txt2img, or img2img from an init image (strength
    default 0.6, diffusers' for these families, in (0, 1]; the bundle must have its VAE encoder).
    Inpainting is one UserError."""
    n = NAMES[names]
    if mask:
        raise UserError(f"{n[1]}: inpainting is for SD 1.x/2.x/XL bundles now; this one is "
                        f"{manifest.model.get('family')}, which runs img2img: leave out {n[1]}")
    if not init:
        if strength is not None:
            raise UserError(f"{n[2]}: applies to img2img; give {n[0]} too")
        return "txt2img", None
    if "vae_encoder" not in manifest.components:
        raise UserError(f"{manifest.root}: img2img encodes the image with the VAE encoder, which this bundle lacks: "
                        "rebuild it with vae_encoder in the recipe's components")
    return "img2img", check_strength(IMG2IMG_STRENGTH if strength is None else strength, n[2])


class FlowPipeline(BundleModel):
    """Text-to-image over a flow-matching bundle; a family module's subclass says how its transformer is
    conditioned and fed. `spec`: the family's record, set on the subclass."""
    families: dict[str, Family] = {}     # the family records this pipeline runs, by name
    size_why = "{family} reads 2x2 latent patches of the VAE's 1/{f} scale"

    def __init__(self, bundle: str | Path | Manifest, backend: str | None = None, params_backend: str | None = None,
                 width: int | None = None, height: int | None = None, sysroot: str = "/", env=None,
                 verify: bool | str = True, strict: bool = False, lazy: bool = True, vae_tiling: bool | None = None,
                 vae_tile: int | None = None, image_input: bool = False):
        """`width`/`height` default to the bundle's optimal size (its transformer profile's opt);
        `strict`: every module runs where `backend` assigns it, or a UserError (no fallback);
        `lazy`: the VAE decoder goes on loading while the prompt is encoded and denoised;
        `image_input`: the VAE encoder is loaded too (img2img, where the family runs it; the bundle must have it);
        `vae_tiling` / `vae_tile`: runtime/vae_tiling.py's (None: tiles when past the VAE engine's profile)."""
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
        if image_input and self.spec.check_mode is txt2img_only:
            txt2img_only(manifest, True, False, None, 1, "api")        # its one-line refusal
        self.image_input = image_input
        needed = self.spec.needs[:-2] + tuple(c for c in self.spec.optional if c in manifest.components) + \
            self.spec.needs[-2:] + (("vae_encoder",) if image_input else ())
        reqs = self.spec.requests(manifest, 1, height, width)
        if image_input:
            reqs["vae_encoder"] = {"sample": (1, 3, height, width)}
        super().__init__(manifest, needed, reqs, backend, params_backend,
                         sysroot, env, verify, strict, later=("vae_decoder",) if lazy else (), vae_tiling=vae_tiling,
                         vae_tile=vae_tile)
        self.stages = {"manifest": manifest_s, **self.stages}
        self.latent_scale = float(info.latent_scale or self.spec.latent_scale)
        self.latent_shift = float(self.spec.latent_shift if info.latent_shift is None else info.latent_shift)
        self.schedule = FlowSchedule.from_config(info.scheduler or self.default_schedule)
        self.negative = reads_negative(self.spec, manifest.model)     # CFG, else distilled guidance
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

    def guide(self, v: np.ndarray, v_neg: np.ndarray, guidance: float) -> np.ndarray:
        """Classifier-free guidance of the prompt's velocity `v` against the negative prompt's."""
        return v_neg + np.float32(guidance) * (v - v_neg)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """[1, 3, H, W] in [-1, 1] -> latents as the denoiser's are ([1, C, h, w], before `to_transformer`): the
        VAE encoder's mean (BundleModel.vae_mean) less the shift, times the scale."""
        return (self.vae_mean(pixels) - np.float32(self.latent_shift)) * np.float32(self.latent_scale)

    # ---- generation --------------------------------------------------------------------------------
    def __call__(self, prompt: str, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, latents: np.ndarray | None = None, progress: bool = True,
                 scheduler: str = SCHEDULER, seeds: list[int] | None = None, init_image: np.ndarray | None = None,
                 strength: float | None = None, init_latents: np.ndarray | None = None,
                 decode: bool = True) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]; with `seeds`, one image per seed,
        [N, H, W, 3], each from its own seed's noise (image i is the single image of seeds[i]), as many per
        transformer call as its engine's profile takes (`batches`: the images of each call).
        `latents`: starting noise shaped as `noise` makes it, one row per image, instead of the seeds'.
        Guidance above 1 runs the negative prompt too (CFG: a second call of the same batch) in the
        families that read one. `scheduler`: one of runtime/flow.py's SAMPLERS (default flow-euler).
        `init_image` (uint8 [H, W, 3], any size: fitted to the pipeline's by runtime/images.py's rule) makes it
        img2img from that image at `strength` (default 0.6; the pipeline opened with image_input=True).
        `init_latents`: img2img from these latents (as `encode_image` makes them, one row per image or one for
        all) instead of an encoded image (the hires fix's second pass); `decode=False` returns the latents
        [N, C, h, w] undecoded, as `encode_image` makes them."""
        steps = self.defaults["steps"] if steps is None else steps
        guidance = self.defaults["guidance"] if guidance is None else guidance
        check_steps(steps)
        run = self.run_stages = {}
        t0 = time.perf_counter()
        first, image_latents = 0, None
        if init_latents is not None:      # the hires fix's second pass: latents given, no VAE encoder needed
            strength = check_strength(IMG2IMG_STRENGTH if strength is None else strength)
            first, image_latents = first_step(steps, strength), init_latents.astype(np.float32)
        elif init_image is not None or strength is not None:
            _, strength = self.spec.check_mode(self.manifest, init_image is not None, False, strength, steps, "api")
            if not self.image_input:
                raise UserError("init_image=: img2img needs the VAE encoder loaded: open the pipeline with "
                                "image_input=True")
            first = first_step(steps, strength)
            image_latents = self.encode_image(image_tensor(init_image, self.width, self.height))
        cond = self.encode(prompt)
        cfg = self.negative and guidance > 1.0
        uncond = self.encode(negative) if cfg else None
        transformer = self.component("transformer").session
        fixed = self.fixed_feeds(transformer, guidance)
        run["encode"] = round(time.perf_counter() - t0, 3)
        seeds = [seed] if (single := seeds is None) else list(seeds)
        per = self.batch_limit("transformer", "hidden_states", len(seeds))      # images per transformer call
        shapes = [self.spec.requests(self.manifest, b, self.height, self.width)["transformer"] for b in (1, 2)]
        batched = {k for k, s in shapes[1].items() if s[:1] != shapes[0][k][:1]}   # the inputs with a batch axis
        out, self.batches = [], []
        for at in range(0, len(seeds), per):
            n = len(seeds[at:at + per])

            def rows(feeds: dict, n: int = n) -> dict:      # one image's batched inputs repeated for the n images
                return {k: np.repeat(v, n, axis=0) if k in batched and len(v) == 1 else v for k, v in feeds.items()}
            noise = np.concatenate([self.noise(s) for s in seeds[at:at + n]]) if latents is None \
                else latents[at:at + n].astype(np.float32)
            x = self.to_transformer(noise)
            sampler = SAMPLERS[scheduler](self.schedule, steps, self.image_tokens(x))
            if image_latents is not None:        # img2img: the image noised to the first sigma run
                sigma = np.float32(sampler.sigmas[first])
                base = image_latents[at:at + n] if len(image_latents) > 1 else image_latents
                x = self.to_transformer((sigma * noise + (np.float32(1) - sigma) * base).astype(np.float32))
            seen: list = []      # the last velocity call's (x, j, v), for previews

            def velocity(x: np.ndarray, j: int) -> np.ndarray:    # guided, at point j of the sampler's table
                step = rows({"hidden_states": x, "timestep": self.timestep(sampler, j, sampler.timesteps[j]), **fixed})
                v = transformer.run({**step, **rows(cond)})["out_hidden_states"].astype(np.float32)
                if cfg:
                    v_neg = transformer.run({**step, **rows(uncond)})["out_hidden_states"].astype(np.float32)
                    v = self.guide(v, v_neg, guidance)
                seen[:] = x, j, v
                return v

            def x0() -> np.ndarray:      # previews: the clean latents the last velocity points to
                xj, j, v = seen
                return self.from_transformer(xj - np.float32(sampler.sigmas[j]) * v)
            for i, _ in self.denoising(sampler.timesteps[first:], progress, x0):
                x = sampler.step(velocity, first + i, x)
            out.append(self.from_transformer(x))
            self.batches.append(n)
        transformer = None       # one at a time: the VAE decoder may load only once the denoiser is released
        if not decode:
            return np.concatenate(out)
        image = self.decode(np.concatenate(out) / np.float32(self.latent_scale) + np.float32(self.latent_shift))
        image = np.clip(image / 2 + 0.5, 0.0, 1.0)
        return image[0] if single else image
