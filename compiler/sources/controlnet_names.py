"""Renames a diffusers ControlNetModel's tensor names to the LDM ControlNet names (without the
`control_model.` prefix).

Owns: the ControlNet-only part of the correspondence (SFU `convert_controlnet_checkpoint`):
`controlnet_cond_embedding.conv_in` -> `input_hint_block.0`, `.blocks.k` -> `input_hint_block.{2k+2}`,
`.conv_out` -> the last hint conv, `controlnet_down_blocks.i` -> `zero_convs.i.0`,
`controlnet_mid_block` -> `middle_block_out.0`; the encoder half (conv_in, time_embedding,
add_embedding, down_blocks, mid_block) goes through diffusers_names' UNet tables.
"""
from __future__ import annotations

import re

from .diffusers_names import unet_names

MARKER = "controlnet_cond_embedding.conv_in.weight"   # a diffusers-named ControlNet
LDM_MARKERS = ("input_hint_block.0.weight", "zero_convs.0.0.weight")
LDM_TOP = {"input_hint_block", "zero_convs", "input_blocks", "middle_block", "middle_block_out", "time_embed",
           "label_emb"}


def is_diffusers_controlnet(keys) -> bool:
    return any(k.endswith(MARKER) for k in keys)


def controlnet_names(keys: list[str]) -> dict[str, str]:
    """diffusers ControlNetModel key -> LDM ControlNet key."""
    blocks = {int(m.group(1)) for k in keys if (m := re.match(r"controlnet_cond_embedding\.blocks\.(\d+)\.", k))}
    last = 2 * (max(blocks, default=-1) + 2)
    out = {}
    rest = []
    for k in keys:
        module, _, param = k.rpartition(".")
        if module == "controlnet_cond_embedding.conv_in":
            out[k] = f"input_hint_block.0.{param}"
        elif m := re.fullmatch(r"controlnet_cond_embedding\.blocks\.(\d+)", module):
            out[k] = f"input_hint_block.{2 * int(m.group(1)) + 2}.{param}"
        elif module == "controlnet_cond_embedding.conv_out":
            out[k] = f"input_hint_block.{last}.{param}"
        elif m := re.fullmatch(r"controlnet_down_blocks\.(\d+)", module):
            out[k] = f"zero_convs.{m.group(1)}.0.{param}"
        elif module == "controlnet_mid_block":
            out[k] = f"middle_block_out.0.{param}"
        else:
            rest.append(k)
    out.update(unet_names(rest))
    return out
