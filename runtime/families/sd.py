"""SD 1.x / 2.x / SDXL (base and refiner): the family facts and the reference pipeline over such a bundle --
tokenize, encode, denoise with classifier-free guidance, decode; txt2img, img2img and inpainting (an init
image encoded by the VAE encoder and noised to the strength's first step; inpainting with a 9-channel
inpainting UNet, or a plain UNet by latent blending), ControlNets, as diffusers'
StableDiffusion(Img2Img|Inpaint|ControlNet)Pipeline.

Owns: each SD family's record (FAMILIES: components, latent scale, defaults, samplers), the shapes each
component is called with, the image-mode checks (img2img / inpainting against the UNet's channels), each
family's conditioning (SD 2.x v-prediction; SDXL's two encoders, pooled embeds and micro-conditioning time
ids: original size, crop, target size, or the refiner's aesthetic score; prompts as A1111 encodes them --
75-token chunks, BREAK, weights, runtime/prompts.py --, as many chunks as the denoiser's engines take), the
guidance loop (a batch of images: each one's noise from its own seed, as many per UNet call as its profile
takes, the CFG halves together) and latent scaling. Loading, selection and reporting are BundleModel's
(runtime/loading.py).
Imports numpy, the runtime's own modules, and lazily the backends in use; never the compiler.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from ..checks import check_steps, check_strength, shown
from ..errors import UserError
from ..image_size import image_size, latent_factor
from ..loading import BundleModel, open_manifest
from ..manifest import Manifest
from ..schedulers import SAMPLERS, NoiseSchedule, make_sampler, start_index
from ..text_encoders import text_state_name
from .family import Family, LatentRGB
from ..embeddings import encoder_feeds
from ..prompts import CHUNK, CLIP_TOKENS, Chunk, clip_chunks, emphasize, make_chunk
from ..images import image_tensor, mask_tensor
from ..control import ControlNets, zero_residuals

def unet_in_channels(manifest) -> int:
    """The UNet's input channels: 4 latents, or 9 for an inpainting UNet (latents | mask | masked image)."""
    for i in manifest.components.get("unet", {}).get("inputs", []):
        if i["name"] == "sample" and len(i.get("shape") or []) > 1 and isinstance(i["shape"][1], int):
            return i["shape"][1]
    return 4


DEFAULT_STRENGTH = {"img2img": 0.8, "inpaint": 1.0}      # as precast generate and the Python API default them
OPTION_NAMES = {"cli": {"init": "--init-image", "mask": "--mask", "strength": "--strength", "steps": "--steps"},
                "api": {"init": "init_image=", "mask": "mask=", "strength": "strength=", "steps": "steps="}}


def check_image_mode(manifest, init: bool, mask: bool, strength: float | None, steps: int,
                     names: str = "cli") -> tuple[str, float | None]:
    """(mode, strength) for a run with or without an init image and mask, checked against the bundle
    before anything loads: txt2img | img2img | inpaint, and the strength (default 0.8 img2img, 1.0
    inpainting) in (0, 1] leaving at least one step. One-line UserErrors otherwise."""
    n = OPTION_NAMES[names]
    channels = unet_in_channels(manifest)
    if channels not in (4, 9):      # e.g. 8: InstructPix2Pix, whose image conditioning is not run here
        raise UserError(f"{manifest.root}: its UNet takes {channels} input channels; precast runs 4 (plain) "
                        "and 9 (inpainting) channel UNets")
    inpaint_unet = channels == 9
    if mask and not init:
        raise UserError(f"{n['mask']}: inpainting needs the image the mask applies to: give {n['init']} too")
    if not init:
        if strength is not None:
            raise UserError(f"{n['strength']}: applies to img2img and inpainting; give {n['init']} too")
        if inpaint_unet:
            raise UserError(f"{manifest.root}: has an inpainting UNet (9 input channels: latents, mask, masked "
                            f"image): give {n['init']} and {n['mask']} (white = repaint)")
        return "txt2img", None
    if inpaint_unet and not mask:
        raise UserError(f"{manifest.root}: has an inpainting UNet (9 input channels): give {n['mask']} too "
                        "(white = repaint), or use a bundle with a plain UNet for img2img")
    if "vae_encoder" not in manifest.components:
        raise UserError(f"{manifest.root}: img2img and inpainting encode the image with the VAE encoder, which this "
                        "bundle lacks: rebuild it with vae_encoder in the recipe's components")
    mode = "inpaint" if mask else "img2img"
    strength = check_strength(DEFAULT_STRENGTH[mode] if strength is None else strength, n["strength"])
    if start_index(steps, strength) >= steps:
        raise UserError(f"{shown(n['strength'], strength)} with {steps} steps runs no step (int(steps x strength) = 0): "
                        f"raise {n['strength']} or {n['steps']}")
    return mode, strength




def requests(manifest, batch: int, height: int, width: int, tokens: int = 77, cfg: bool = True) -> dict:
    """The input shapes each component of an SD bundle will be called with."""
    f = latent_factor(manifest)
    lat = (batch, 4, height // f, width // f)
    sample = (batch, unet_in_channels(manifest), height // f, width // f)
    unet_inputs = {i["name"]: i["shape"] for i in manifest.components.get("unet", {}).get("inputs", [])}
    ctx = (unet_inputs.get("encoder_hidden_states") or [0, 0, 768])[-1]
    ub = 2 * batch if cfg else batch
    steps = () if unet_inputs.get("timestep") == [] else (ub,)     # an optimum export's 0-d timestep
    unet = {"sample": (ub,) + sample[1:], "timestep": steps, "encoder_hidden_states": (ub, tokens, ctx)}
    for name in ("text_embeds", "time_ids"):
        if name in unet_inputs:
            unet[name] = (ub, unet_inputs[name][-1])
    out = {"text_encoder": {"input_ids": (batch, tokens)}, "text_encoder_2": {"input_ids": (batch, tokens)},
           "unet": unet, "vae_decoder": {"latent_sample": lat}, "vae_encoder": {"sample": (batch, 3, height, width)}}
    for comp in (c for c in manifest.components if c.startswith("controlnet_")):   # the UNet's batch and inputs
        out[comp] = {**{k: v for k, v in unet.items() if k != "sample"}, "sample": (ub,) + lat[1:],
                     "controlnet_cond": (ub, 3, height, width)}
    return out


def halves(pair: np.ndarray, n: int) -> np.ndarray:
    """[uncond, cond] rows -> n unconditional rows then n conditional ones (the CFG batch of n images)."""
    return np.concatenate([pair[:1]] * n + [pair[1:]] * n, axis=0)


class Txt2Img(BundleModel):
    """Text-to-image over an SD 1.x/2.x/XL bundle, each component on the device it is assigned to."""

    def __init__(self, bundle: str | Path | Manifest, backend: str | None = None, params_backend: str | None = None,
                 width: int | None = None, height: int | None = None, sysroot: str = "/", env=None,
                 verify: bool | str = True, strict: bool = False, lazy: bool = True, image_input: bool = False,
                 controlnets: tuple[str, ...] = (), vae_tiling: bool | None = None, vae_tile: int | None = None):
        """`bundle`: a bundle folder, or its manifest already read (and so checked) by read_manifest.
        `width`/`height` default to the bundle's optimal size (optimal_size). `strict`: every module
        runs where `backend` assigns it, or a UserError (no fallback). `lazy`: the VAE decoder goes
        on loading while the prompt is encoded and denoised (False: everything loaded on return).
        `image_input`: the VAE encoder is loaded too (img2img and inpainting; the bundle must have it).
        `controlnets`: the bundle's ControlNet components (controlnet_<name>) to load for `controls`.
        `vae_tiling` / `vae_tile`: runtime/vae_tiling.py's (None: tiles when past the VAE engine's profile)."""
        env = os.environ if env is None else env
        manifest, manifest_s = open_manifest(bundle)
        family = self.family = manifest.info.family
        if family not in NEEDED:
            raise UserError(f"{manifest.root}: the SD pipeline runs SD 1.x/2.x/XL bundles; this one is {family}")
        self.width, self.height = width, height = image_size(manifest, width, height, latent_factor(manifest))
        needed = NEEDED[family] + (("vae_encoder",) if image_input else ()) + tuple(controlnets)
        self.image_input = image_input
        super().__init__(manifest, needed, requests(manifest, 1, height, width), backend, params_backend,
                         sysroot, env, verify, strict, later=("vae_decoder",) if lazy else (), vae_tiling=vae_tiling,
                         vae_tile=vae_tile)
        self.stages = {"manifest": manifest_s, **self.stages}
        self.tokenizer = self.tokenizers.get("text_encoder") or self.tokenizers["text_encoder_2"]
        spec = BY_NAME[family]
        self.latent_scale = float(manifest.info.latent_scale or spec.latent_scale)
        self.defaults = {"steps": spec.steps, "guidance": spec.guidance}
        self.prediction = manifest.info.prediction
        self.unet_channels = unet_in_channels(manifest)
        self.unet_inputs = manifest.components["unet"]["inputs"]
        ts = next((i.get("shape") for i in self.unet_inputs if i["name"] == "timestep"), None)
        self.timestep_shape = () if ts == [] else (2,)       # optimum's UNet export: one 0-d timestep

    def _encoder(self, comp: str, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Every output of text encoder `comp` for one chunk's ids [77], as float32."""
        session = self.component(comp).session
        hidden = int(self.manifest.components[comp].get("config", {}).get("hidden", 768))
        out = session.run(encoder_feeds(session, comp, ids[None, :].astype(np.int32), self.embeddings[comp], hidden))
        return {k: v.astype(np.float32) for k, v in out.items()}

    def _hidden(self, comp: str, out: dict[str, np.ndarray]) -> np.ndarray:
        """The hidden state the UNet reads, by name (runtime/text_encoders.py text_state_name): last_hidden_state
        (SD 1.x/2.x) or the penultimate hidden_states.N-1 (SDXL) among every layer's output."""
        config = self.manifest.components[comp].get("config", {})
        return out[text_state_name(out, config, penultimate=self.family.startswith("sdxl"))]

    def chunks(self, prompt: str) -> dict[str, list[Chunk]]:
        """Each text encoder's CLIP chunks of `prompt` (runtime/prompts.py), in the order the UNet reads their
        states side by side: SD 1.x/2.x text_encoder, SDXL text_encoder | text_encoder_2, the refiner's
        text_encoder_2."""
        return {c: clip_chunks(self.tokenizers[c], prompt) for c in ("text_encoder", "text_encoder_2")
                if c in self.needed}

    def chunk_limit(self) -> tuple[int | None, str]:
        """(the most prompt chunks the denoiser's engines take -- their profiles' longest encoder_hidden_states
        over 77 --, the engine that limits it); None: any (the ONNX, compiled at run time)."""
        ranges = {c: self.input_range(c, "encoder_hidden_states", 1) for c in self.needed
                  if c == "unet" or c.startswith("controlnet_")}
        ranges = {c: r for c, r in ranges.items() if r is not None}
        if not ranges:
            return None, "unet"
        comp = min(ranges, key=lambda c: ranges[c][1])
        return max(1, ranges[comp][1] // CLIP_TOKENS), comp

    def encode(self, prompt: str, chunks: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """(context [1, 77 x chunks, C], pooled [1, P] or None), as A1111 conditions SD 1.x/2.x/XL: each
        encoder's chunks encoded one at a time, weighted (emphasize: times each token's weight, the chunk's
        mean restored) and concatenated along the sequence; SDXL's two encoders side by side. `chunks`: the
        prompt's cut to that many, or padded with the empty prompt's chunk (default: as many as it needs, up
        to chunk_limit). pooled: text_encoder_2's of the first chunk, unweighted (as A1111 and ComfyUI)."""
        per = self.chunks(prompt)
        limit = self.chunk_limit()[0]
        need = max(map(len, per.values()))
        n = chunks or (min(need, limit) if limit else need)
        states, pooled = [], None
        for comp, have in per.items():
            have = (have + [make_chunk(self.tokenizers[comp], [], [])] * n)[:n]
            outs = [self._encoder(comp, c.ids) for c in have]
            states.append(np.concatenate([emphasize(self._hidden(comp, o), c.weights) for o, c in zip(outs, have)],
                                         axis=1))
            if comp == "text_encoder_2":
                pooled = outs[0]["text_embeds"]
        return np.concatenate(states, axis=-1), pooled

    def encode_pair(self, prompt: str, negative: str) -> tuple[tuple, tuple]:
        """((context, pooled) of the prompt, of the negative prompt) with the same number of chunks: as many as
        the longer needs, the other padded with the empty prompt's chunk (A1111's pad_cond_uncond rule), cut
        to what the denoiser's engines take (prompt_warnings says what a prompt needs). SDXL base: an empty
        negative prompt is zeros, as diffusers (force_zeros_for_empty_prompt) and A1111 make it."""
        limit = self.chunk_limit()[0]
        n = max(max(map(len, self.chunks(p).values())) for p in (prompt, negative))
        n = min(n, limit) if limit else n
        cond = self.encode(prompt, n)
        if self.family == "sdxl" and not negative:
            ctx, pooled = cond
            return cond, (np.zeros_like(ctx), np.zeros_like(pooled) if pooled is not None else None)
        return cond, self.encode(negative, n)

    def prompt_warnings(self, *prompts: str | None) -> list[str]:
        """One line per prompt that needs more chunks than the denoiser's engines take (it was cut to the
        first ones), naming the profile that would take all of it."""
        limit, comp = self.chunk_limit()
        out = []
        for which, prompt in zip(("prompt", "negative prompt"), prompts):
            need = max(map(len, self.chunks(prompt).values())) if prompt else 1
            if limit and need > limit:
                tokens = need * CLIP_TOKENS
                out.append(f"the {which} needs {tokens} tokens ({need} chunks of {CHUNK} + BOS/EOS); this bundle's "
                           f"{comp} engine takes {limit * CLIP_TOKENS}, so it reads only the first "
                           f"{'chunk' if limit == 1 else f'{limit} chunks'}; to read all of it, rebuild with profiles: "
                           f"{{tokens: {{min: {CLIP_TOKENS}, opt: {CLIP_TOKENS}, max: {tokens}}}}}")
        return out

    def time_ids(self, aesthetic: float, original: tuple[int, int] | None = None,
                 crop: tuple[int, int] = (0, 0)) -> np.ndarray:
        """SDXL micro-conditioning: original size + crop top-left + target size (base), or
        original size + crop + aesthetic score (refiner)."""
        h, w = original or (self.height, self.width)
        tail = [aesthetic] if self.family == "sdxl-refiner" else [self.height, self.width]
        return np.array([[h, w, crop[0], crop[1], *tail]], np.float32)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """[1, 3, H, W] in [-1, 1] -> scaled latents [1, 4, H/f, W/f]: the VAE encoder's mean (BundleModel.vae_mean)
        x latent_scale."""
        return self.vae_mean(pixels) * np.float32(self.latent_scale)

    def __call__(self, prompt: str, negative: str = "", steps: int = 20, seed: int = 0, guidance: float = 7.5,
                 scheduler: str = "euler", latents: np.ndarray | None = None, progress: bool = True,
                 original_size: tuple[int, int] | None = None, crop: tuple[int, int] = (0, 0),
                 aesthetic_score: float = 6.0, negative_aesthetic_score: float = 2.5,
                 init_image: np.ndarray | None = None, mask: np.ndarray | None = None,
                 strength: float | None = None, controls: list | None = None, guess_mode: bool = False,
                 seeds: list[int] | None = None, schedule: str | None = None, init_latents: np.ndarray | None = None,
                 decode: bool = True) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]; with `seeds`, one image per seed,
        [N, H, W, 3], each from its own seed's noise (image i is the single image of seeds[i]), as many per
        UNet call as its engine's profile takes (the CFG halves in one call: 2 rows per image; `batches`:
        the images of each call). `latents`: the initial noise, one [4, h, w] row per image,
        instead of the seeds'. `init_image` (uint8 [H, W, 3], any size: fitted to the
        pipeline's by runtime/images.py's rule) makes it img2img; `mask` (uint8 [H, W] luma, the init
        image's size; white = repaint) inpainting; `strength` defaults to 0.8 / 1.0 (check_image_mode).
        `controls`: runtime/control.py Control entries (their nets loaded: `controlnets=` when opened);
        `guess_mode` as diffusers'. A ControlNet bundle's UNet gets zero residuals without controls.
        `scheduler` / `schedule`: the sampler and sigma schedule (runtime/schedulers.py make_sampler; the
        samplers that add noise draw it from each image's seed). `init_latents`: img2img from these scaled
        latents, one [4, h, w] row per image (or one for all), instead of an encoded init image (the hires fix's
        second pass); `decode=False` returns the scaled latents [N, 4, h, w] undecoded."""
        check_steps(steps)
        if init_latents is not None:
            mode, strength = "img2img", check_strength(strength)
        else:
            mode, strength = check_image_mode(self.manifest, init_image is not None, mask is not None, strength,
                                              steps, "api")
        if mode != "txt2img" and init_latents is None and not self.image_input:
            raise UserError("img2img / inpainting need the VAE encoder loaded: open the pipeline with image_input=True")
        f = latent_factor(self.manifest)
        shape = (1, 4, self.height // f, self.width // f)
        run = self.run_stages = {}
        t0 = time.perf_counter()
        first, image_latents, m_lat, cond, from_noise = 0, None, None, [], mode == "txt2img"
        if mode != "txt2img":
            first = start_index(steps, strength)
        if init_latents is not None:
            image_latents = init_latents.astype(np.float32)
        elif mode != "txt2img":
            pixels = image_tensor(init_image, self.width, self.height)
            m = mask_tensor(mask, self.width, self.height) if mask is not None else None
            if m is not None:       # the mask at latent size: torch's nearest interpolate (every f-th pixel)
                m_lat = np.ascontiguousarray(m[:, :, ::f, ::f])
            from_noise = mode == "inpaint" and strength == 1.0     # as diffusers' is_strength_max
            if not from_noise or self.unet_channels == 4:
                image_latents = self.encode_image(pixels)
            if self.unet_channels == 9:
                cond = [m_lat, self.encode_image(pixels * (m < 0.5))]       # mask | masked image latents
        (ctx, pooled), (neg_ctx, neg_pooled) = self.encode_pair(prompt, negative)
        extra = {}
        if pooled is not None:
            extra["text_embeds"] = np.concatenate([neg_pooled, pooled], axis=0)
            extra["time_ids"] = np.concatenate([self.time_ids(negative_aesthetic_score, original_size, crop),
                                                self.time_ids(aesthetic_score, original_size, crop)], axis=0)
        context = np.concatenate([neg_ctx, ctx], axis=0)
        unet = self.component("unet").session
        nets = ControlNets(self, controls, self.width, self.height, guess_mode) if controls else None
        run["encode"] = round(time.perf_counter() - t0, 3)
        seeds = [seed] if (single := seeds is None) else list(seeds)
        per = min(self.batch_limit(c, "sample", len(seeds), 2)                # images per UNet call
                  for c in ("unet", *(net.component for net in controls or ())))
        out, self.batches = [], []
        for at in range(0, len(seeds), per):
            n = len(seeds[at:at + per])
            noise = np.concatenate([np.random.default_rng(s).standard_normal(shape).astype(np.float32)
                                    for s in seeds[at:at + n]]) if latents is None else latents[at:at + n]
            noise = noise.astype(np.float32)
            sampler = make_sampler(scheduler, steps, NoiseSchedule(prediction_type=self.prediction), schedule,
                                   seeds[at:at + n])
            x = noise * np.float32(sampler.init_noise_sigma) if from_noise else \
                sampler.add_noise(image_latents if len(image_latents) == 1 else image_latents[at:at + n], noise, first)
            context_n, extra_n = halves(context, n), {k: halves(v, n) for k, v in extra.items()}
            cond_n = [np.repeat(c, n, axis=0) for c in cond]
            zeros = zero_residuals(self.unet_inputs, 2 * n, shape[2], shape[3])
            last = len(sampler.timesteps) - 1

            def guided(x_in: np.ndarray, t, k: int) -> np.ndarray:     # the UNet at a scaled input, CFG applied
                model_in = np.concatenate([x_in, *cond_n], axis=1) if cond else x_in
                timestep = np.full((2 * n,) if self.timestep_shape else (), t, np.float32)
                residuals = nets.residuals(k, len(sampler.timesteps) - first, np.concatenate([x_in] * 2, axis=0),
                                           timestep, context_n, extra_n, self.unet_inputs) if nets else zeros
                eps = unet.run({"sample": np.concatenate([model_in] * 2, axis=0), "timestep": timestep,
                                "encoder_hidden_states": context_n, **extra_n, **residuals})["out_sample"]
                eps = eps.astype(np.float32)
                uncond, cond_eps = eps[:n], eps[n:]
                return uncond + np.float32(guidance) * (cond_eps - uncond)
            x0 = lambda: x if sampler.last_x0 is None else sampler.last_x0     # noqa: E731 (previews: the estimate now)
            for k, _ in self.denoising(sampler.timesteps[first:], progress, x0):
                i = first + k
                x = sampler.step(lambda x_in, t, k=k: guided(x_in, t, k), i, x)    # one UNet call or two
                if m_lat is not None and self.unet_channels == 4:   # latent blending: keep the unmasked region
                    kept = image_latents if i == last else sampler.add_noise(image_latents, noise, i + 1)
                    x = ((1 - m_lat) * kept + m_lat * x).astype(np.float32)
            out.append(x)
            self.batches.append(n)
        unet = None              # one at a time: the VAE decoder may load only once the denoiser is released
        if not decode:
            return np.concatenate(out)
        image = np.clip(self.decode(np.concatenate(out) / np.float32(self.latent_scale)) / 2 + 0.5, 0.0, 1.0)
        return image[0] if single else image


def _family(name: str, title: str, needs: tuple[str, ...], latent_scale: float, rgb: LatentRGB) -> Family:
    return Family(name, title, needs, "unet", latent_scale, Txt2Img, requests, steps=20, guidance=7.5,
                  samplers=tuple(SAMPLERS), schedules={k: c.schedules for k, c in SAMPLERS.items()},
                  image_modes=True, controlnets=True, check_mode=check_image_mode, latent_rgb=rgb)


# previews' latent -> RGB projections (ComfyUI latent_formats.py SD15 and SDXL)
SD15_RGB = LatentRGB(((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721),
                      (-0.2120, -0.2616, -0.7177)))
SDXL_RGB = LatentRGB(((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362),
                      (-0.3165, -0.2492, -0.2188)), (0.1084, -0.0175, -0.0011))
FAMILIES = (_family("sd1", "SD 1.x", ("text_encoder", "unet", "vae_decoder"), 0.18215, SD15_RGB),
            _family("sd2", "SD 2.x", ("text_encoder", "unet", "vae_decoder"), 0.18215, SD15_RGB),
            _family("sdxl", "SDXL", ("text_encoder", "text_encoder_2", "unet", "vae_decoder"), 0.13025, SDXL_RGB),
            _family("sdxl-refiner", "SDXL refiner", ("text_encoder_2", "unet", "vae_decoder"), 0.13025, SDXL_RGB))
BY_NAME = {f.name: f for f in FAMILIES}
NEEDED = {f.name: f.needs for f in FAMILIES}
