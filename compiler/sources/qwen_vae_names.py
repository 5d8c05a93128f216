"""The Qwen-Image VAE in Wan's original names (ComfyUI's qwen_image_vae.safetensors: `encoder.downsamples.N.residual.2`,
`decoder.upsamples.N`, `decoder.middle.1.to_qkv`, `decoder.head.2`, top-level `conv1` / `conv2`) renamed to diffusers'
AutoencoderKLQwenImage names, the canonical ones (compiler/graphs/qwenimage_vae.py).

Owns: recognising those names (WAN_MARKER) and the mapping, as diffusers' convert_wan_vae_to_diffusers does it, for
any number of residual blocks per level: the decoder's flat `upsamples` list is read in order, each level's residual
blocks then its upsampler (the last level has none).
"""
from __future__ import annotations

import re

WAN_MARKER = "decoder.middle.1.to_qkv.weight"
QWEN_MARKER = "decoder.mid_block.attentions.0.to_qkv.weight"     # its diffusers names
RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2": "conv1", "residual.3.gamma": "norm2.gamma",
            "residual.6": "conv2", "shortcut": "conv_shortcut"}
PLAIN = {"encoder.conv1": "encoder.conv_in", "decoder.conv1": "decoder.conv_in", "encoder.head.0": "encoder.norm_out",
         "encoder.head.2": "encoder.conv_out", "decoder.head.0": "decoder.norm_out", "decoder.head.2": "decoder.conv_out",
         "conv1": "quant_conv", "conv2": "post_quant_conv"}


def _residual(rest: str) -> str:
    return next((new + rest[len(old):] for old, new in RESIDUAL.items() if rest.startswith(old + ".") or rest == old),
                rest)


def wan_vae_names(keys) -> dict[str, str]:
    """key -> diffusers name, for the Wan-named VAE keys among `keys` (no prefix)."""
    ups = sorted({int(m.group(1)) for k in keys if (m := re.match(r"decoder\.upsamples\.(\d+)\.", k))})
    where, level, j = {}, 0, 0
    for n in ups:
        if any(k.startswith(f"decoder.upsamples.{n}.residual.") for k in keys):
            where[n], j = f"decoder.up_blocks.{level}.resnets.{j}", j + 1
        else:
            where[n], level, j = f"decoder.up_blocks.{level}.upsamplers.0", level + 1, 0
    out = {}
    for k in keys:
        stem, _, leaf = k.rpartition(".")
        if stem in PLAIN:
            out[k] = f"{PLAIN[stem]}.{leaf}"
        elif m := re.match(r"(encoder|decoder)\.middle\.(\d)\.(.+)", k):
            side, i, rest = m.groups()
            out[k] = (f"{side}.mid_block.attentions.0.{rest}" if i == "1" else
                      f"{side}.mid_block.resnets.{int(i) // 2}.{_residual(rest)}")
        elif m := re.match(r"encoder\.downsamples\.(\d+)\.(.+)", k):
            out[k] = f"encoder.down_blocks.{m.group(1)}.{_residual(m.group(2))}"
        elif m := re.match(r"decoder\.upsamples\.(\d+)\.(.+)", k):
            out[k] = f"{where[int(m.group(1))]}.{_residual(m.group(2))}"
    return out
