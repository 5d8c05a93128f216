"""Text-to-image over a Flux (dev, schnell) or Chroma bundle: T5 (+ CLIP-L) conditioning, 2x2 latent
packing with position ids, flow-matching Euler, the VAE's scale and shift, PNG-ready pixels.

Owns: each DiT family's conditioning -- Flux: T5 `last_hidden_state` (run without a mask, padding
to the bundle's T5 length) + CLIP-L `pooler_output`, dev's distilled guidance fed as its raw scale;
Chroma: T5 run with its mask, the transformer attending to the real tokens plus one padding token,
real classifier-free guidance with a negative prompt -- the packing (b c (h 2) (w 2) -> b (h w)
(c 2 2)) and ids ((0, row, col) per packed latent, zeros for text), and the shapes each component
is called with (for selection). Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .errors import UserError
from .flow import FlowEuler, FlowSchedule
from .manifest import Manifest
from .pipeline import BundleModel, check_steps, image_size, latent_factor, open_manifest

FAMILIES = {"flux": ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"),
            "chroma": ("text_encoder", "transformer", "vae_decoder")}
T5_OF = {"flux": "text_encoder_2", "chroma": "text_encoder"}
SCHEDULER = "flow-euler"      # the only sampler Flux / Chroma run (flow-matching Euler, flow.py)
LATENT = {"flux": (0.3611, 0.1159), "chroma": (0.3611, 0.1159)}   # scale, shift (BFL AutoEncoderParams)


def t5_length(manifest: Manifest) -> int:
    """The T5 length to run with: the model's own (dev 512, schnell 256) where a profile of the
    transformer covers it, else the longest its profiles were built for (padding to more tokens
    never loses any; a shorter length cuts the prompt)."""
    default = int(manifest.model.get("t5_tokens") or 512)
    ranges = [p["t5_tokens"] for p in manifest.components["transformer"].get("profiles") or []
              if isinstance(p.get("t5_tokens"), list)]
    if not ranges or any(lo <= default <= hi for lo, _, hi in ranges):
        return default
    return int(max(opt for _, opt, _ in ranges))


def packed_grid(manifest: Manifest, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of packed tokens: one per 2x2 latents."""
    f = latent_factor(manifest)
    return height // (2 * f), width // (2 * f)


REQUIRED = {"flux": ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "pooled_projections"),
            "chroma": ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "attention_mask")}


def check_transformer_io(manifest: Manifest, family: str) -> None:
    """The manifest's transformer IO as a `family` transformer has it (names, and the widths the
    runtime reads from it), else one UserError naming the field."""
    inputs = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}
    where = f"{manifest.root}/manifest.json: components.transformer.inputs"
    missing = [n for n in REQUIRED[family] if n not in inputs]
    if missing:
        raise UserError(f"{where} has no {', '.join(missing)}: not a {family} transformer (was the manifest edited?); "
                        "rebuild or re-download the bundle")
    for name in ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids") + \
            (("pooled_projections",) if family == "flux" else ()):
        shape = inputs[name]
        if not isinstance(shape, list) or not shape or type(shape[-1]) is not int or shape[-1] < 1 or \
                (name == "hidden_states" and (len(shape) != 3 or shape[-1] % 4)):
            raise UserError(f"{where}: {name} has shape {shape!r}, not the transformer's; rebuild or re-download "
                            "the bundle")
    outputs = [o["name"] for o in manifest.components["transformer"]["outputs"]]
    if "out_hidden_states" not in outputs:
        raise UserError(f"{manifest.root}/manifest.json: components.transformer.outputs has no out_hidden_states; "
                        "rebuild or re-download the bundle")


def dit_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of a Flux/Chroma bundle is called with."""
    family = manifest.model.get("family")
    check_transformer_io(manifest, family if family in REQUIRED else "flux")
    rows, cols = packed_grid(manifest, height, width)
    tokens, t5 = rows * cols, t5_length(manifest)
    inputs = {i["name"]: i["shape"] for i in manifest.components["transformer"]["inputs"]}
    width_of = lambda name: inputs[name][-1]  # noqa: E731
    f = latent_factor(manifest)
    out = {"transformer": {"hidden_states": (batch, tokens, width_of("hidden_states")),
                           "encoder_hidden_states": (batch, t5, width_of("encoder_hidden_states")),
                           "timestep": (batch,), "img_ids": (tokens, width_of("img_ids")),
                           "txt_ids": (t5, width_of("txt_ids"))},
           "vae_decoder": {"latent_sample": (batch, width_of("hidden_states") // 4, height // f, width // f)}}
    for name in ("pooled_projections", "guidance", "attention_mask"):
        if name in inputs:
            out["transformer"][name] = (batch, width_of(name)) if name == "pooled_projections" else \
                (batch,) if name == "guidance" else (batch, t5)
    for comp in ("text_encoder", "text_encoder_2"):
        if comp in manifest.components:
            is_t5 = any("t5_sequence" in (i.get("shape") or []) for i in manifest.components[comp]["inputs"])
            out[comp] = {"input_ids": (batch, t5 if is_t5 else 77)}
            if is_t5 and any(i["name"] == "attention_mask" for i in manifest.components[comp]["inputs"]):
                out[comp]["attention_mask"] = (batch, t5)
    return out


def pack(latents: np.ndarray) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2x2 patch flattened channel-major."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: np.ndarray, rows: int, cols: int) -> np.ndarray:
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.reshape(b, rows, cols, c, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, rows * 2, cols * 2)


def image_ids(rows: int, cols: int) -> np.ndarray:
    ids = np.zeros((rows, cols, 3), np.float32)
    ids[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
    return ids.reshape(rows * cols, 3)


class FluxTxt2Img(BundleModel):
    """Text-to-image over a Flux or Chroma bundle."""

    def __init__(self, bundle: str | Path | Manifest, backend: str | None = None, params_backend: str | None = None,
                 width: int | None = None, height: int | None = None, sysroot: str = "/", env=None,
                 verify: bool | str = True, strict: bool = False, lazy: bool = True):
        """`width`/`height` default to the bundle's optimal size (its transformer profile's opt);
        `strict`: every module runs where `backend` assigns it, or a UserError (no fallback);
        `lazy`: the VAE decoder goes on loading while the prompt is encoded and denoised."""
        env = os.environ if env is None else env
        manifest, manifest_s = open_manifest(bundle)
        family = self.family = manifest.model.get("family")
        if family not in FAMILIES:
            raise UserError(f"{manifest.root}: the DiT pipeline runs Flux and Chroma bundles; this one is {family}")
        f = 2 * latent_factor(manifest)
        width, height = image_size(manifest, width, height, f,
                                   f"{family} packs 2x2 latents of the VAE's 1/{f // 2} scale")
        check_transformer_io(manifest, family)
        self.width, self.height = width, height
        self.rows, self.cols = packed_grid(manifest, height, width)
        self.t5_tokens = t5_length(manifest)
        super().__init__(manifest, FAMILIES[family], dit_requests(manifest, 1, height, width), backend,
                         params_backend, sysroot, env, verify, strict, later=("vae_decoder",) if lazy else ())
        self.stages = {"manifest": manifest_s, **self.stages}
        inputs = {i["name"]: i["shape"] for i in manifest.components["transformer"]["inputs"]}
        self.channels = int(inputs["hidden_states"][-1]) // 4
        scale, shift = LATENT[family]
        self.latent_scale = float(manifest.model.get("latent_scale") or scale)
        self.latent_shift = float(manifest.model.get("latent_shift", shift))
        self.schedule = FlowSchedule.from_config(manifest.model.get("scheduler") or {})
        self.defaults = {"steps": int(manifest.model.get("steps") or 28),
                         "guidance": float(manifest.model.get("guidance", 3.5))}

    def text_limits(self) -> dict[str, int]:
        return {**super().text_limits(), T5_OF[self.family]: self.t5_tokens - 1}   # T5: less `</s>`

    # ---- conditioning ---------------------------------------------------------------------------
    def _t5(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        comp = T5_OF[self.family]
        ids, mask = self.tokenizers[comp](prompt, self.t5_tokens)
        feeds = {"input_ids": ids[None, :].astype(np.int32)}
        session = self.component(comp).session
        if "attention_mask" in session.input_names:
            feeds["attention_mask"] = mask[None, :].astype(np.int32)
        states = session.run(feeds)["last_hidden_state"].astype(np.float32)
        return states, mask.astype(np.int32)

    def _clip_pooled(self, prompt: str) -> np.ndarray:
        from .embeddings import encoder_feeds
        ids = self.tokenizers["text_encoder"](prompt)[None, :].astype(np.int32)
        session = self.component("text_encoder").session
        hidden = int(self.manifest.components["text_encoder"].get("config", {}).get("hidden", 768))
        out = session.run(encoder_feeds(session, "text_encoder", ids, self.embeddings["text_encoder"], hidden))
        return out["pooler_output"].astype(np.float32)

    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The transformer's text inputs for one prompt."""
        states, mask = self._t5(prompt)
        feeds = {"encoder_hidden_states": states, "txt_ids": np.zeros((self.t5_tokens, 3), np.float32)}
        if self.family == "chroma":
            # Chroma attends to the real tokens and the first padding token (lodestones' masking)
            keep = np.arange(self.t5_tokens) <= int(mask.sum())
            feeds["attention_mask"] = keep[None, :].astype(np.int32)
        else:
            feeds["pooled_projections"] = self._clip_pooled(prompt)
        return feeds

    # ---- generation --------------------------------------------------------------------------------
    def noise(self, seed: int) -> np.ndarray:
        shape = (1, self.channels, 2 * self.rows, 2 * self.cols)
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    def __call__(self, prompt: str, negative: str = "", steps: int | None = None, seed: int = 0,
                 guidance: float | None = None, latents: np.ndarray | None = None, progress: bool = True) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]. `latents`: [1, 16, h, w] noise
        (unpacked), instead of the seed's."""
        steps = self.defaults["steps"] if steps is None else steps
        guidance = self.defaults["guidance"] if guidance is None else guidance
        check_steps(steps)
        x = pack(self.noise(seed) if latents is None else latents.astype(np.float32))
        sampler = FlowEuler(self.schedule, steps, x.shape[1])
        run = self.run_stages = {}
        t0 = time.perf_counter()
        cond = self.encode(prompt)
        cfg = self.family == "chroma" and guidance > 1.0
        uncond = self.encode(negative) if cfg else None
        fixed = {"img_ids": image_ids(self.rows, self.cols)}
        transformer = self.component("transformer").session
        if "guidance" in transformer.input_names:
            fixed["guidance"] = np.full((1,), guidance, np.float32)
        run["encode"] = round(time.perf_counter() - t0, 3)
        for i, t in self.denoising(sampler.timesteps, progress):
            step = {"hidden_states": x, "timestep": np.full((1,), t, np.float32), **fixed}
            v = transformer.run({**step, **cond})["out_hidden_states"].astype(np.float32)
            if cfg:
                v_neg = transformer.run({**step, **uncond})["out_hidden_states"].astype(np.float32)
                v = v_neg + np.float32(guidance) * (v - v_neg)
            x = sampler.step(v, i, x)
        del transformer          # one at a time: the VAE decoder may load only once the denoiser is released
        z = unpack(x, self.rows, self.cols) / np.float32(self.latent_scale) + np.float32(self.latent_shift)
        image = self.decode(z)
        return np.clip(image / 2 + 0.5, 0.0, 1.0)
