"""Reference SD 1.x txt2img pipeline over a bundle: tokenize, encode, denoise with classifier-free
guidance, decode, PNG.

Owns: the request shapes each component sees, the guidance loop, latent scaling and the image
conversion, and a record of what ran where (device, backend, artifact, reasons for fallbacks).
Imports numpy, the runtime's own modules, and lazily the backends in use; never the compiler.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .assign import COMPONENT_MODULE, assign_modules
from .devices import apply_device_override, discover_devices
from .errors import UserError
from .manifest import ManifestError, read_manifest
from .schedulers import NoiseSchedule, make_sampler
from .select import installed_backends, load_component, select_all

LATENT_SCALE = {"sd1": 0.18215, "sd2": 0.18215}
NEEDED = ("text_encoder", "unet", "vae_decoder")


def latent_factor(manifest) -> int:
    cfg = manifest.components.get("vae_decoder", {}).get("config", {})
    return 2 ** (int(cfg.get("decoder_levels", 4)) - 1)


def requests(manifest, batch: int, height: int, width: int, tokens: int = 77, cfg: bool = True) -> dict:
    """The input shapes each component will be called with."""
    f = latent_factor(manifest)
    lat = (batch, 4, height // f, width // f)
    ctx = manifest.components.get("unet", {}).get("inputs", [{}, {}, {"shape": [0, 0, 768]}])[2]["shape"][-1]
    ub = 2 * batch if cfg else batch
    return {"text_encoder": {"input_ids": (batch, tokens)},
            "unet": {"sample": (ub,) + lat[1:], "timestep": (ub,), "encoder_hidden_states": (ub, tokens, ctx)},
            "vae_decoder": {"latent_sample": lat},
            "vae_encoder": {"sample": (batch, 3, height, width)}}


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="denoise", unit="step", disable=None if enabled else True, leave=False)
    except ImportError:  # tqdm is optional for the runtime
        class _Plain:
            def update(self, n=1):
                pass

            def close(self):
                pass
        return _Plain()


@dataclass
class Loaded:
    session: object
    where: dict
    reasons: list[str] = field(default_factory=list)


class Txt2Img:
    """SD 1.x text-to-image over a bundle, each component on the device it is assigned to."""

    def __init__(self, bundle: str | Path, backend: str | None = None, params_backend: str | None = None,
                 width: int = 512, height: int = 512, sysroot: str = "/", env=None, verify: bool = True):
        env = os.environ if env is None else env
        try:
            self.manifest = read_manifest(bundle)
        except ManifestError as e:
            raise UserError(str(e)) from None
        family = self.manifest.model.get("family")
        if family not in LATENT_SCALE:
            raise UserError(f"{bundle}: the reference pipeline runs SD 1.x/2.x bundles; this one is {family}")
        missing = [c for c in NEEDED if c not in self.manifest.components]
        if missing:
            raise UserError(f"{bundle}: txt2img needs {', '.join(NEEDED)}; the bundle lacks {', '.join(missing)}")
        f = latent_factor(self.manifest)
        if width % f or height % f:
            raise UserError(f"--size {width}x{height}: width and height must be multiples of {f}")
        self.width, self.height = width, height
        devices = discover_devices(sysroot, env)
        self.devices, self.device_warning = apply_device_override(devices, env)
        self.placements = assign_modules(self.devices, backend, params_backend)
        self.installed = installed_backends()
        self.selections = select_all(self.manifest, self.placements, self.devices,
                                     requests(self.manifest, 1, height, width), self.installed, verify)
        self.loaded: dict[str, Loaded] = {}
        for comp in NEEDED:
            outputs = [o["name"] for o in self.manifest.components[comp]["outputs"]]
            placement = self.placements[COMPONENT_MODULE[comp]]
            session, cand, reasons = load_component(self.selections[comp], outputs, placement.offload)
            self.loaded[comp] = Loaded(session, cand.describe(), reasons)
        from .tokenizer import ClipTokenizer
        self.tokenizer = ClipTokenizer.from_folder(Path(bundle) / "tokenizer")
        self.latent_scale = LATENT_SCALE[family]

    def encode(self, prompt: str) -> np.ndarray:
        ids = self.tokenizer(prompt)[None, :].astype(np.int32)
        return self.loaded["text_encoder"].session.run({"input_ids": ids})["last_hidden_state"].astype(np.float32)

    def __call__(self, prompt: str, negative: str = "", steps: int = 20, seed: int = 0, guidance: float = 7.5,
                 scheduler: str = "euler", latents: np.ndarray | None = None, progress: bool = True) -> np.ndarray:
        """Returns the decoded image as float32 [H, W, 3] in [0, 1]."""
        if steps < 1:
            raise UserError(f"--steps {steps}: must be at least 1")
        f = latent_factor(self.manifest)
        shape = (1, 4, self.height // f, self.width // f)
        sampler = make_sampler(scheduler, steps, NoiseSchedule())
        noise = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) if latents is None else latents
        x = noise.astype(np.float32) * np.float32(sampler.init_noise_sigma)
        context = np.concatenate([self.encode(negative), self.encode(prompt)], axis=0)
        unet = self.loaded["unet"].session
        bar = _progress(steps, progress)
        for i, t in enumerate(sampler.timesteps):
            model_in = np.concatenate([sampler.scale_model_input(x, i)] * 2, axis=0)
            eps = unet.run({"sample": model_in, "timestep": np.full((2,), t, np.float32),
                            "encoder_hidden_states": context})["out_sample"].astype(np.float32)
            uncond, cond = eps[:1], eps[1:]
            x = sampler.step(uncond + np.float32(guidance) * (cond - uncond), i, x)
            bar.update(1)
        bar.close()
        decoded = self.loaded["vae_decoder"].session.run({"latent_sample": x / np.float32(self.latent_scale)})
        image = decoded["sample"].astype(np.float32)[0].transpose(1, 2, 0)
        return np.clip(image / 2 + 0.5, 0.0, 1.0)

    def report(self) -> dict:
        return {"devices": [d.describe() for d in self.devices], "device_warning": self.device_warning,
                "components": {c: {**l.where, "reasons": l.reasons} for c, l in self.loaded.items()}}


def to_uint8(image: np.ndarray) -> np.ndarray:
    return (image * 255).round().astype(np.uint8)


def describe_where(report: dict, stream=sys.stderr) -> None:
    for comp, w in report["components"].items():
        print(f"{comp:<13} -> {w['device']} ({w['device_name']}) via {w['backend']}: {w['artifact']}"
              + (f"  [{w['note']}]" if w.get("note") else ""), file=stream)
        for r in w["reasons"]:
            print(f"{'':16}passed over: {r.split(': ', 1)[1]}", file=stream)
