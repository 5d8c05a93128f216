"""Writes tiny ControlNets with seeded random weights in the LDM layout (`control_model.` keys) for
the demo configs of compiler/demo_model.py (tiny SD 1.x, SD 2.x, SDXL), for tests and
`precast demo-model --family controlnet`.

Owns: the LDM ControlNet key/shape layout for an SD1Config: the UNet's encoder half (taken from
demo_model's UNet layout), the hint embedding and the zero convs.
"""
from __future__ import annotations

import numpy as np

from .demo_model import SD1Config, _conv, random_tensor, unet_layout, write_safetensors
from .sources.checkpoint import UNET

CONTROL = "control_model."
ENCODER_TOP = ("time_embed.", "label_emb.", "input_blocks.", "middle_block.")
TINY_HINT = (8, 8, 16, 16)       # diffusers' conditioning_embedding_out_channels: 3 stride-2 convs = x8, as the VAE


def controlnet_layout(cfg: SD1Config, hint_channels: tuple[int, ...] = TINY_HINT) -> dict[str, tuple[int, ...]]:
    unet = {k[len(UNET):]: v for k, v in unet_layout(cfg).items()}
    d = {k: v for k, v in unet.items() if k.startswith(ENCODER_TOP)}
    d["input_blocks.0.0.weight"] = (cfg.model_channels, 4, 3, 3)     # a ControlNet reads the 4 latents
    n_in = 1 + max(int(k.split(".")[1]) for k in d if k.startswith("input_blocks."))
    for i in range(n_in):
        ch = next(unet[f"input_blocks.{i}.{m}.weight"][0] for m in ("0", "0.op", "0.out_layers.3")
                  if f"input_blocks.{i}.{m}.weight" in unet)
        _conv(d, f"zero_convs.{i}.0", ch, ch, 1)
    mid = unet["middle_block.2.out_layers.3.weight"][0]
    _conv(d, "middle_block_out.0", mid, mid, 1)
    _conv(d, "input_hint_block.0", hint_channels[0], 3, 3)
    n = 2
    for a, b in zip(hint_channels, hint_channels[1:]):
        _conv(d, f"input_hint_block.{n}", a, a, 3)
        _conv(d, f"input_hint_block.{n + 2}", b, a, 3)
        n += 4
    _conv(d, f"input_hint_block.{n}", cfg.model_channels, hint_channels[-1], 3)
    return {CONTROL + k: v for k, v in d.items()}


def write_demo_controlnet(path: str, cfg: SD1Config, seed: int = 0, dtype: str = "fp32",
                          hint_channels: tuple[int, ...] = TINY_HINT) -> dict:
    """A deterministic ControlNet for `cfg` (zero convs random, not zero, so every residual is
    non-trivial); returns {key: shape}."""
    shapes = controlnet_layout(cfg, hint_channels)
    rng = np.random.default_rng(seed)
    write_safetensors(str(path), shapes, dtype, lambda key, shape: random_tensor(rng, key, shape))
    return shapes
