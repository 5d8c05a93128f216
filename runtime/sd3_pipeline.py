"""Text-to-image over an SD3 / SD3.5 bundle: CLIP-L | CLIP-G | T5 conditioning, flow-matching Euler
with shift 3.0, classifier-free guidance, the VAE's scale and shift.

Owns: SD3's conditioning as StableDiffusion3Pipeline builds it -- each CLIP's penultimate hidden
states side by side (768 + 1280), zero-padded to the T5 width and followed along the sequence by
T5's `last_hidden_state` (zeros when the bundle has no T5, as diffusers runs without one); the
pooled vector is the two CLIPs' projected `text_embeds` side by side -- the timestep the MMDiT is fed
(sigma x 1000, float32), and the shapes each component is called with (for selection).
Skip-layer guidance (SD3.5-medium's optional extra pass) is not run. Imports numpy and the
runtime's own modules; never the compiler.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .errors import UserError
from .flow import FlowEuler, FlowSchedule
from .manifest import Manifest
from .pipeline import BundleModel, check_steps, image_size, latent_factor, open_manifest, text_state_name

CLIPS = ("text_encoder", "text_encoder_2")
T5 = "text_encoder_3"
NEEDED = CLIPS + ("transformer", "vae_decoder")
LATENT = (1.5305, 0.0609)          # scale, shift (SAI SD3LatentFormat)
CLIP_TOKENS = 77
REQUIRED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")


def t5_length(manifest: Manifest) -> int:
    """The T5 length the transformer was built for: its text sequence less CLIP's 77 tokens."""
    from .dit_pipeline import t5_length as dit_t5_length
    return dit_t5_length(manifest)


def transformer_inputs(manifest: Manifest) -> dict[str, list]:
    """The transformer's input shapes by name, checked: an SD3 MMDiT's IO, else one UserError."""
    inputs = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}
    where = f"{manifest.root}/manifest.json: components.transformer.inputs"
    missing = [n for n in REQUIRED if n not in inputs]
    if missing:
        raise UserError(f"{where} has no {', '.join(missing)}: not an SD3 transformer (was the manifest edited?); "
                        "rebuild or re-download the bundle")
    for name, rank in (("hidden_states", 4), ("encoder_hidden_states", 3), ("pooled_projections", 2)):
        shape = inputs[name]
        if not isinstance(shape, list) or len(shape) != rank or type(shape[-1 if rank < 4 else 1]) is not int:
            raise UserError(f"{where}: {name} has shape {shape!r}, not the SD3 transformer's; rebuild or re-download "
                            "the bundle")
    if "out_hidden_states" not in [o["name"] for o in manifest.components["transformer"]["outputs"]]:
        raise UserError(f"{manifest.root}/manifest.json: components.transformer.outputs has no out_hidden_states; "
                        "rebuild or re-download the bundle")
    return inputs


def sd3_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of an SD3 bundle is called with."""
    inputs = transformer_inputs(manifest)
    f, t5 = latent_factor(manifest), t5_length(manifest)
    latents = (batch, inputs["hidden_states"][1], height // f, width // f)
    out = {"transformer": {"hidden_states": latents, "timestep": (batch,),
                           "encoder_hidden_states": (batch, CLIP_TOKENS + t5, inputs["encoder_hidden_states"][-1]),
                           "pooled_projections": (batch, inputs["pooled_projections"][-1])},
           "vae_decoder": {"latent_sample": latents}}
    for comp in CLIPS:
        out[comp] = {"input_ids": (batch, CLIP_TOKENS)}
    if T5 in manifest.components:
        out[T5] = {"input_ids": (batch, t5)}
    return out


class SD3Txt2Img(BundleModel):
    """Text-to-image over an SD3 / SD3.5 bundle (with or without its T5)."""

    def __init__(self, bundle: str | Path | Manifest, backend: str | None = None, params_backend: str | None = None,
                 width: int | None = None, height: int | None = None, sysroot: str = "/", env=None,
                 verify: bool | str = True, strict: bool = False, lazy: bool = True):
        """As FluxTxt2Img: `width`/`height` default to the bundle's optimal size; `strict`: no fallback;
        `lazy`: the VAE decoder goes on loading while the prompt is encoded and denoised."""
        env = os.environ if env is None else env
        manifest, manifest_s = open_manifest(bundle)
        self.family = manifest.model.get("family")
        if self.family != "sd3":
            raise UserError(f"{manifest.root}: the SD3 pipeline runs SD3 / SD3.5 bundles; this one is {self.family}")
        f = 2 * latent_factor(manifest)
        width, height = image_size(manifest, width, height, f,
                                   f"SD3 reads 2x2 patches of the VAE's 1/{f // 2} scale latents")
        inputs = transformer_inputs(manifest)
        self.width, self.height = width, height
        self.t5_tokens = t5_length(manifest)
        needed = NEEDED[:2] + ((T5,) if T5 in manifest.components else ()) + NEEDED[2:]
        super().__init__(manifest, needed, sd3_requests(manifest, 1, height, width), backend, params_backend,
                         sysroot, env, verify, strict, later=("vae_decoder",) if lazy else ())
        self.stages = {"manifest": manifest_s, **self.stages}
        self.channels = int(inputs["hidden_states"][1])
        self.context_width = int(inputs["encoder_hidden_states"][-1])
        self.latent_scale = float(manifest.model.get("latent_scale") or LATENT[0])
        self.latent_shift = float(manifest.model.get("latent_shift", LATENT[1]))
        self.schedule = FlowSchedule.from_config(manifest.model.get("scheduler") or {"shift": 3.0, "spacing": "training"})
        self.defaults = {"steps": int(manifest.model.get("steps") or 28),
                         "guidance": float(manifest.model.get("guidance", 7.0))}

    def text_limits(self) -> dict[str, int]:
        limits = super().text_limits()
        if T5 in limits:
            limits[T5] = self.t5_tokens - 1      # T5: less `</s>`
        return limits

    # ---- conditioning ---------------------------------------------------------------------------
    def _clip(self, comp: str, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """(penultimate hidden states [1, 77, width], projected pooled [1, projection])."""
        from .embeddings import encoder_feeds
        ids = self.tokenizers[comp](prompt)[None, :].astype(np.int32)
        session = self.component(comp).session
        config = self.manifest.components[comp].get("config", {})
        out = session.run(encoder_feeds(session, comp, ids, self.embeddings[comp], int(config.get("hidden", 768))))
        states = out[text_state_name(out, config, penultimate=True)]    # by name: every layer is an output
        return states.astype(np.float32), out["text_embeds"].astype(np.float32)

    def _t5(self, prompt: str) -> np.ndarray:
        if T5 not in self.needed:
            return np.zeros((1, self.t5_tokens, self.context_width), np.float32)
        ids, _ = self.tokenizers[T5](prompt, self.t5_tokens)
        out = self.component(T5).session.run({"input_ids": ids[None, :].astype(np.int32)})
        return out["last_hidden_state"].astype(np.float32)

    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The transformer's text inputs for one prompt: encoder_hidden_states and pooled_projections."""
        (l_states, l_pooled), (g_states, g_pooled) = (self._clip(c, prompt) for c in CLIPS)
        clip = np.concatenate([l_states, g_states], axis=-1)
        if clip.shape[-1] > self.context_width:
            raise UserError(f"{self.manifest.root}: the CLIP encoders give {clip.shape[-1]} values per token, more than "
                            f"the transformer's context width {self.context_width}; rebuild the bundle")
        clip = np.pad(clip, ((0, 0), (0, 0), (0, self.context_width - clip.shape[-1])))
        return {"encoder_hidden_states": np.concatenate([clip, self._t5(prompt)], axis=1),
                "pooled_projections": np.concatenate([l_pooled, g_pooled], axis=-1)}

    # ---- generation --------------------------------------------------------------------------------
    def noise(self, seed: int) -> np.ndarray:
        f = latent_factor(self.manifest)
        shape = (1, self.channels, self.height // f, self.width // f)
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    def __call__(self, prompt: str, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, latents: np.ndarray | None = None, progress: bool = True) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]. `latents`: [1, C, h, w] starting
        noise instead of the seed's. Guidance above 1 runs the negative prompt too (CFG)."""
        steps = self.defaults["steps"] if steps is None else steps
        guidance = self.defaults["guidance"] if guidance is None else guidance
        check_steps(steps)
        x = (self.noise(seed) if latents is None else latents).astype(np.float32)
        sampler = FlowEuler(self.schedule, steps, (x.shape[2] // 2) * (x.shape[3] // 2))
        run = self.run_stages = {}
        t0 = time.perf_counter()
        cond = self.encode(prompt)
        cfg = guidance > 1.0
        uncond = self.encode(negative) if cfg else None
        transformer = self.component("transformer").session
        run["encode"] = round(time.perf_counter() - t0, 3)
        for i, _ in self.denoising(sampler.timesteps, progress):
            step = {"hidden_states": x, "timestep": np.full((1,), np.float32(sampler.sigmas[i]) * np.float32(1000),
                                                            np.float32)}
            v = transformer.run({**step, **cond})["out_hidden_states"].astype(np.float32)
            if cfg:
                v_neg = transformer.run({**step, **uncond})["out_hidden_states"].astype(np.float32)
                v = v_neg + np.float32(guidance) * (v - v_neg)
            x = sampler.step(v, i, x)
        del transformer          # one at a time: the VAE decoder may load only once the denoiser is released
        image = self.decode(x / np.float32(self.latent_scale) + np.float32(self.latent_shift))
        return np.clip(image / 2 + 0.5, 0.0, 1.0)
