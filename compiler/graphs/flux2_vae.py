"""The FLUX.2 VAE (diffusers `AutoencoderKLFlux2`, BFL's / ComfyUI's flux2-vae): the LDM encoder and decoder of
ldm_vae.py (32 latent channels, quant convs) plus the batch-norm statistics of its latents.

Owns: its config -- ldm_vae's, with the statistics FLUX.2's pipelines normalise the latents by (`bn.running_mean`
and sqrt(`bn.running_var` + batch_norm_eps), one per channel of the 2x2-patchified latents: 4 x 32 = 128) read
from the weights into the config, so the manifest carries them to the runtime. The graphs are ldm_vae's
(vae_decoder latent_sample [B, 32, h, w] -> sample; vae_encoder sample -> latent_parameters [B, 64, h, w]): the
normalisation and the 2x2 patching stay in the runtime (runtime/families/flux2.py), where the latents are
whole -- a VAE tile may begin at an odd latent, which would shift a folded normalisation's patch grid.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BadInput
from ..sources.config_fields import field
from .ldm_vae import VaeConfig, vae_config

BN_EPS = 1e-4       # AutoencoderKLFlux2's batch_norm_eps


@dataclass(frozen=True)
class Flux2VaeConfig(VaeConfig):
    latents_bn_mean: tuple[float, ...] = ()
    latents_bn_std: tuple[float, ...] = ()


def flux2_vae_config(g, config_json: dict, overrides: dict) -> Flux2VaeConfig:
    base = vae_config(g, config_json, overrides)
    if not g.has("bn.running_mean") or not g.has("bn.running_var"):
        raise BadInput(f"{g.ckpt.path}: the VAE has no bn.running_mean / bn.running_var (its latents' batch-norm "
                       "statistics): not a FLUX.2 VAE; give the model's own VAE (flux2-vae.safetensors, or the "
                       "folder's vae/) with --vae")
    n = 4 * base.latent_channels
    for key in ("bn.running_mean", "bn.running_var"):
        g.expect(key, (n,), f"one per channel of the 2x2-patchified {base.latent_channels}-channel latents")
    eps = np.float32(field(config_json, "batch_norm_eps", "positive", BN_EPS, f"{g.ckpt.path} vae/config.json"))
    mean = g.ckpt.read(g.prefix + "bn.running_mean").astype(np.float32)
    var = g.ckpt.read(g.prefix + "bn.running_var").astype(np.float32)
    if not (np.isfinite(mean).all() and np.isfinite(var).all() and (var + eps > 0).all()):
        raise BadInput(f"{g.ckpt.path}: {g.prefix}bn.running_var / running_mean hold non-finite or negative "
                       "values; the file is damaged")
    std = np.sqrt(var + eps).astype(np.float32)
    return Flux2VaeConfig(**vars(base), latents_bn_mean=tuple(float(v) for v in mean),
                          latents_bn_std=tuple(float(v) for v in std))
