"""Reference pipeline over an SD 1.x / 2.x / SDXL (base and refiner) bundle: tokenize, encode, denoise
with classifier-free guidance, decode; txt2img, img2img and inpainting (an init image encoded by the VAE
encoder and noised to the strength's first step; inpainting with a 9-channel inpainting UNet, or a plain
UNet by latent blending), ControlNets, as diffusers' StableDiffusion(Img2Img|Inpaint|ControlNet)Pipeline.

Owns: each family's conditioning (SD 2.x v-prediction; SDXL's two encoders, pooled embeds and
micro-conditioning time ids: original size, crop, target size, or the refiner's aesthetic score), the
guidance loop and latent scaling. The loading, selection and reporting are BundleModel's (pipeline.py).
Imports numpy, the runtime's own modules, and lazily the backends in use; never the compiler.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .errors import UserError
from .manifest import Manifest
from .pipeline import (LATENT_SCALE, NEEDED, BundleModel, check_image_mode, check_steps, image_size, latent_factor,
                       open_manifest, requests, text_state_name, unet_in_channels)
from .schedulers import NoiseSchedule, make_sampler, start_index


class Txt2Img(BundleModel):
    """Text-to-image over an SD 1.x/2.x/XL bundle, each component on the device it is assigned to."""

    def __init__(self, bundle: str | Path | Manifest, backend: str | None = None, params_backend: str | None = None,
                 width: int | None = None, height: int | None = None, sysroot: str = "/", env=None,
                 verify: bool | str = True, strict: bool = False, lazy: bool = True, image_input: bool = False,
                 controlnets: tuple[str, ...] = ()):
        """`bundle`: a bundle folder, or its manifest already read (and so checked) by read_manifest.
        `width`/`height` default to the bundle's optimal size (optimal_size). `strict`: every module
        runs where `backend` assigns it, or a UserError (no fallback). `lazy`: the VAE decoder goes
        on loading while the prompt is encoded and denoised (False: everything loaded on return).
        `image_input`: the VAE encoder is loaded too (img2img and inpainting; the bundle must have it).
        `controlnets`: the bundle's ControlNet components (controlnet_<name>) to load for `controls`."""
        env = os.environ if env is None else env
        manifest, manifest_s = open_manifest(bundle)
        family = self.family = manifest.model.get("family")
        if family not in LATENT_SCALE:
            raise UserError(f"{manifest.root}: the SD pipeline runs SD 1.x/2.x/XL bundles; this one is {family}")
        self.width, self.height = width, height = image_size(manifest, width, height, latent_factor(manifest))
        needed = NEEDED[family] + (("vae_encoder",) if image_input else ()) + tuple(controlnets)
        self.image_input = image_input
        super().__init__(manifest, needed, requests(manifest, 1, height, width), backend, params_backend,
                         sysroot, env, verify, strict, later=("vae_decoder",) if lazy else ())
        self.stages = {"manifest": manifest_s, **self.stages}
        self.tokenizer = self.tokenizers.get("text_encoder") or self.tokenizers["text_encoder_2"]
        self.latent_scale = float(manifest.model.get("latent_scale") or LATENT_SCALE[family])
        self.prediction = manifest.model.get("prediction") or "epsilon"
        self.unet_channels = unet_in_channels(manifest)
        self.unet_inputs = manifest.components["unet"]["inputs"]
        ts = next((i.get("shape") for i in self.unet_inputs if i["name"] == "timestep"), None)
        self.timestep_shape = () if ts == [] else (2,)       # optimum's UNet export: one 0-d timestep

    def _encoder(self, comp: str, prompt: str) -> dict[str, np.ndarray]:
        from .embeddings import encoder_feeds
        ids = self.tokenizers[comp](prompt)[None, :].astype(np.int32)
        session = self.component(comp).session
        hidden = int(self.manifest.components[comp].get("config", {}).get("hidden", 768))
        out = session.run(encoder_feeds(session, comp, ids, self.embeddings[comp], hidden))
        return {k: v.astype(np.float32) for k, v in out.items()}

    def _hidden(self, comp: str, out: dict[str, np.ndarray]) -> np.ndarray:
        """The hidden state the UNet reads, by name (runtime/pipeline.py text_state_name): last_hidden_state
        (SD 1.x/2.x) or the penultimate hidden_states.N-1 (SDXL) among every layer's output."""
        config = self.manifest.components[comp].get("config", {})
        return out[text_state_name(out, config, penultimate=self.family.startswith("sdxl"))]

    def encode(self, prompt: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(context [1, 77, C], pooled [1, P] or None)."""
        if self.family in ("sd1", "sd2"):
            return self._hidden("text_encoder", self._encoder("text_encoder", prompt)), None
        g = self._encoder("text_encoder_2", prompt)
        context = self._hidden("text_encoder_2", g)
        if self.family == "sdxl":
            context = np.concatenate([self._hidden("text_encoder", self._encoder("text_encoder", prompt)), context],
                                     axis=-1)
        return context, g["text_embeds"]

    def time_ids(self, aesthetic: float, original: tuple[int, int] | None = None,
                 crop: tuple[int, int] = (0, 0)) -> np.ndarray:
        """SDXL micro-conditioning: original size + crop top-left + target size (base), or
        original size + crop + aesthetic score (refiner)."""
        h, w = original or (self.height, self.width)
        tail = [aesthetic] if self.family == "sdxl-refiner" else [self.height, self.width]
        return np.array([[h, w, crop[0], crop[1], *tail]], np.float32)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """[1, 3, H, W] in [-1, 1] -> scaled latents [1, 4, H/f, W/f]: the VAE encoder's distribution's
        MEAN (diffusers samples it by default; the mean is its mode, deterministic) x latent_scale."""
        params = self.component("vae_encoder").session.run({"sample": pixels.astype(np.float32)})
        params = next(iter(params.values())).astype(np.float32)
        return params[:, :params.shape[1] // 2] * np.float32(self.latent_scale)

    def __call__(self, prompt: str, negative: str = "", steps: int = 20, seed: int = 0, guidance: float = 7.5,
                 scheduler: str = "euler", latents: np.ndarray | None = None, progress: bool = True,
                 original_size: tuple[int, int] | None = None, crop: tuple[int, int] = (0, 0),
                 aesthetic_score: float = 6.0, negative_aesthetic_score: float = 2.5,
                 init_image: np.ndarray | None = None, mask: np.ndarray | None = None,
                 strength: float | None = None, controls: list | None = None, guess_mode: bool = False) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]. `latents`: the initial noise
        [1, 4, h, w] instead of the seed's. `init_image` (uint8 [H, W, 3], any size: fitted to the
        pipeline's by runtime/images.py's rule) makes it img2img; `mask` (uint8 [H, W] luma, the init
        image's size; white = repaint) inpainting; `strength` defaults to 0.8 / 1.0 (check_image_mode).
        `controls`: runtime/control.py Control entries (their nets loaded: `controlnets=` when opened);
        `guess_mode` as diffusers'. A ControlNet bundle's UNet gets zero residuals without controls."""
        check_steps(steps)
        mode, strength = check_image_mode(self.manifest, init_image is not None, mask is not None, strength, steps,
                                          "api")
        if mode != "txt2img" and not self.image_input:
            raise UserError("img2img / inpainting need the VAE encoder loaded: open the pipeline with image_input=True")
        f = latent_factor(self.manifest)
        shape = (1, 4, self.height // f, self.width // f)
        sampler = make_sampler(scheduler, steps, NoiseSchedule(prediction_type=self.prediction))
        noise = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) if latents is None else latents
        noise = noise.astype(np.float32)
        run = self.run_stages = {}
        t0 = time.perf_counter()
        first, image_latents, m_lat, cond = 0, None, None, []
        if mode == "txt2img":
            x = noise * np.float32(sampler.init_noise_sigma)
        else:
            from .images import image_tensor, mask_tensor
            first = start_index(steps, strength)
            pixels = image_tensor(init_image, self.width, self.height)
            m = mask_tensor(mask, self.width, self.height) if mask is not None else None
            if m is not None:       # the mask at latent size: torch's nearest interpolate (every f-th pixel)
                m_lat = np.ascontiguousarray(m[:, :, ::f, ::f])
            from_noise = mode == "inpaint" and strength == 1.0     # as diffusers' is_strength_max
            if not from_noise or self.unet_channels == 4:
                image_latents = self.encode_image(pixels)
            if self.unet_channels == 9:
                cond = [m_lat, self.encode_image(pixels * (m < 0.5))]       # mask | masked image latents
            x = noise * np.float32(sampler.init_noise_sigma) if from_noise else \
                sampler.add_noise(image_latents, noise, first)
        ctx, pooled = self.encode(prompt)
        if self.family == "sdxl" and not negative:  # SDXL base: an empty negative prompt means zeros
            neg_ctx, neg_pooled = np.zeros_like(ctx), (np.zeros_like(pooled) if pooled is not None else None)
        else:
            neg_ctx, neg_pooled = self.encode(negative)
        extra = {}
        if pooled is not None:
            extra["text_embeds"] = np.concatenate([neg_pooled, pooled], axis=0)
            extra["time_ids"] = np.concatenate([self.time_ids(negative_aesthetic_score, original_size, crop),
                                                self.time_ids(aesthetic_score, original_size, crop)], axis=0)
        context = np.concatenate([neg_ctx, ctx], axis=0)
        unet = self.component("unet").session
        from .control import ControlNets, zero_residuals
        nets = ControlNets(self, controls, self.width, self.height, guess_mode) if controls else None
        zeros = zero_residuals(self.unet_inputs, 2, shape[2], shape[3])
        run["encode"] = round(time.perf_counter() - t0, 3)
        last = len(sampler.timesteps) - 1
        for k, t in self.denoising(sampler.timesteps[first:], progress):
            i = first + k
            model_in = np.concatenate([sampler.scale_model_input(x, i), *cond], axis=1) if cond else \
                sampler.scale_model_input(x, i)
            timestep = np.full(self.timestep_shape, t, np.float32)
            residuals = nets.residuals(k, len(sampler.timesteps) - first, np.concatenate(
                [sampler.scale_model_input(x, i)] * 2, axis=0), timestep, context, extra, self.unet_inputs) \
                if nets else zeros
            eps = unet.run({"sample": np.concatenate([model_in] * 2, axis=0), "timestep": timestep,
                            "encoder_hidden_states": context, **extra, **residuals})["out_sample"].astype(np.float32)
            uncond, cond_eps = eps[:1], eps[1:]
            x = sampler.step(uncond + np.float32(guidance) * (cond_eps - uncond), i, x)
            if m_lat is not None and self.unet_channels == 4:   # latent blending: keep the unmasked region
                kept = image_latents if i == last else sampler.add_noise(image_latents, noise, i + 1)
                x = ((1 - m_lat) * kept + m_lat * x).astype(np.float32)
        del unet                 # one at a time: the VAE decoder may load only once the denoiser is released
        image = self.decode(x / np.float32(self.latent_scale))
        return np.clip(image / 2 + 0.5, 0.0, 1.0)
