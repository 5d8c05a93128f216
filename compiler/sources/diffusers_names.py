"""Renames a diffusers folder's tensor names to the canonical LDM single-file names.

Owns: the diffusers <-> LDM naming correspondence (MODEL_FORMATS.md §2-3), so every graph
builder binds weights by one set of names. The block numbering is computed from the keys
present (how many resnets each block has, which blocks have attention), not assumed.
"""
from __future__ import annotations

import re

RES_NAMES = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
             "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
VAE_RES_NAMES = {"conv_shortcut": "nin_shortcut", "nin_shortcut": "nin_shortcut"}
VAE_ATTN_NAMES = {"group_norm": "norm", "norm": "norm", "to_q": "q", "query": "q", "to_k": "k", "key": "k",
                  "to_v": "v", "value": "v", "to_out.0": "proj_out", "proj_attn": "proj_out",
                  "q": "q", "k": "k", "v": "v", "proj_out": "proj_out"}
UNET_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
            "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _indices(keys, pattern: str) -> dict[int, set[int]]:
    """{block index: set of child indices} for keys matching pattern with two int groups."""
    found: dict[int, set[int]] = {}
    for k in keys:
        m = re.match(pattern, k)
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return found


def _split_module(rest: str) -> tuple[str, str]:
    module, _, param = rest.rpartition(".")
    return module, param


def unet_names(keys: list[str]) -> dict[str, str]:
    """diffusers UNet2DConditionModel key -> LDM key (without the model.diffusion_model. prefix)."""
    down_res = _indices(keys, r"down_blocks\.(\d+)\.resnets\.(\d+)\.")
    down_attn = _indices(keys, r"down_blocks\.(\d+)\.attentions\.(\d+)\.")
    up_res = _indices(keys, r"up_blocks\.(\d+)\.resnets\.(\d+)\.")
    up_attn = _indices(keys, r"up_blocks\.(\d+)\.attentions\.(\d+)\.")
    has_down = {i for k in keys if (m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.", k)) for i in [int(m.group(1))]}
    block_of: dict[tuple[str, int, int], int] = {}
    n = 1
    for i in sorted(down_res):
        for j in sorted(down_res[i]):
            block_of[("down", i, j)] = n
            n += 1
        if i in has_down:
            block_of[("downsample", i, 0)] = n
            n += 1
    n = 0
    for i in sorted(up_res):
        for j in sorted(up_res[i]):
            block_of[("up", i, j)] = n
            n += 1
    out: dict[str, str] = {}
    for k in keys:
        module, param = _split_module(k)
        if module in UNET_TOP:
            out[k] = f"{UNET_TOP[module]}.{param}"
            continue
        m = re.match(r"(down|up)_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)$", k)
        if m:
            side, i, kind, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
            b = block_of[(side, i, j)]
            blocks = "input_blocks" if side == "down" else "output_blocks"
            if kind == "resnets":
                mod, p = _split_module(rest)
                out[k] = f"{blocks}.{b}.0.{RES_NAMES.get(mod, mod)}.{p}"
            else:
                out[k] = f"{blocks}.{b}.1.{rest}"
            continue
        m = re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)$", k)
        if m:
            out[k] = f"input_blocks.{block_of[('downsample', int(m.group(1)), 0)]}.0.op.{m.group(2)}"
            continue
        m = re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)$", k)
        if m:
            i = int(m.group(1))
            last = block_of[("up", i, max(up_res[i]))]
            slot = 2 if i in up_attn else 1
            out[k] = f"output_blocks.{last}.{slot}.conv.{m.group(2)}"
            continue
        m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)$", k)
        if m:
            kind, j, rest = m.group(1), int(m.group(2)), m.group(3)
            if kind == "resnets":
                mod, p = _split_module(rest)
                out[k] = f"middle_block.{2 * j}.{RES_NAMES.get(mod, mod)}.{p}"
            else:
                out[k] = f"middle_block.{2 * j + 1}.{rest}"
            continue
        out[k] = k  # unknown: kept, and reported by the coverage check if nothing uses it
    del down_attn
    return out


def _vae_res(rest: str) -> str:
    mod, p = _split_module(rest)
    return f"{VAE_RES_NAMES.get(mod, mod)}.{p}"


def vae_names(keys: list[str]) -> dict[str, str]:
    """diffusers AutoencoderKL key -> LDM key (without first_stage_model.); attention Linear
    weights are marked for a reshape to 1x1 conv by the caller (see `vae_needs_conv_shape`)."""
    n_up = len({int(m.group(1)) for k in keys if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))})
    out: dict[str, str] = {}
    for k in keys:
        m = re.match(r"(encoder|decoder)\.(.*)$", k)
        if not m:
            out[k] = k  # quant_conv, post_quant_conv
            continue
        side, rest = m.group(1), m.group(2)
        if rest.startswith("conv_norm_out."):
            rest = "norm_out." + rest[len("conv_norm_out."):]
        elif mm := re.match(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", rest):
            rest = f"down.{mm.group(1)}.block.{mm.group(2)}.{_vae_res(mm.group(3))}"
        elif mm := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)$", rest):
            rest = f"down.{mm.group(1)}.downsample.conv.{mm.group(2)}"
        elif mm := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", rest):
            rest = f"up.{n_up - 1 - int(mm.group(1))}.block.{mm.group(2)}.{_vae_res(mm.group(3))}"
        elif mm := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)$", rest):
            rest = f"up.{n_up - 1 - int(mm.group(1))}.upsample.conv.{mm.group(2)}"
        elif mm := re.match(r"mid_block\.resnets\.(\d+)\.(.*)$", rest):
            rest = f"mid.block_{int(mm.group(1)) + 1}.{_vae_res(mm.group(2))}"
        elif mm := re.match(r"mid_block\.attentions\.0\.(.*)$", rest):
            mod, p = _split_module(mm.group(1))
            rest = f"mid.attn_1.{VAE_ATTN_NAMES.get(mod, mod)}.{p}"
        out[k] = f"{side}.{rest}"
    return out
