"""ControlNet (SD 1.x, SD 2.x, SDXL; LDM names under `control_model.`): its own graph, whose outputs
are the residuals a UNet built with residual inputs adds to its skips and middle block.

Owns: the ControlNet config read from shapes (a diffusers config.json where the weights cannot say),
the hint embedding (`input_hint_block.*`), and the graph: the UNet's encoder half built by the same
builders (ldm_unet.time_embedding / encoder_half) plus one 1x1 zero conv per input block
(`zero_convs.N.0`) and one after the middle block (`middle_block_out.0`). Inputs: the UNet's
sample, timestep, encoder_hidden_states (+ text_embeds, time_ids for SDXL) and controlnet_cond,
the conditioning image in [0, 1] (diffusers' ControlNetModel); outputs down_block_{i}_additional_residual
and mid_block_additional_residual (OnnxStack's names), unscaled: the runtime multiplies each net's
residuals by its conditioning scale (or guess mode's) and sums several nets.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Callable

from ..errors import BadInput
from ..sources.config_fields import field
from . import ldm_unet
from .ldm_unet import BLOCK_TYPES, FIXED_FIELDS, MID_RESIDUAL, UNetConfig, down_residual_name, residual_dims
from .onnx_graph import Graph

CONTROL_FIXED = {**FIXED_FIELDS, "conditioning_channels": (3,)}
CONTROL_BLOCKS = {"down_block_types": BLOCK_TYPES["down_block_types"]}
# what a ControlNet must share with the UNet it feeds, in the order they are compared
MATCHED = ("family", "model_channels", "context_dim", "adm_in_channels", "levels", "channels")


@dataclass(frozen=True)
class ControlNetConfig(UNetConfig):
    family: str = ""                   # the family it was made for, from the shapes (the family's controlnet_family)
    hint_channels: tuple[int, ...] = ()  # output channels of each hint conv (the last = model_channels)
    hint_factor: int = 8               # image pixels per latent the hint embedding expects
    bgr: bool = False                  # diffusers controlnet_conditioning_channel_order "bgr": channels flipped first
    global_pool: bool = False          # diffusers global_pool_conditions (shuffle): residuals averaged over H, W

    def describe(self) -> dict:
        d = asdict(self)
        d["hint_channels"] = list(d["hint_channels"])
        for k in ("out_channels", "n_output_blocks"):
            del d[k]
        return d


def _hint_convs(g: Graph) -> list[int]:
    idx = sorted({int(m.group(1)) for k in g.ckpt.refs
                  if (m := re.match(re.escape(g.prefix) + r"input_hint_block\.(\d+)\.weight$", k))})
    if len(idx) < 2:
        raise BadInput(f"{g.ckpt.path}: no ControlNet hint embedding (input_hint_block.N.weight, found {len(idx)} convs)")
    return idx


def controlnet_config(g: Graph, config_json: dict, overrides: dict,
                      family_of: Callable[[dict], str] | None = None) -> ControlNetConfig:
    """`family_of`: the model family's rule naming the family an encoder config was made for
    (compiler/families/: Family.controlnet_family)."""
    fields = ldm_unet.encoder_fields(g, config_json, overrides, CONTROL_FIXED, CONTROL_BLOCKS)
    where = f"{g.ckpt.path} config.json"
    order = field(config_json, "controlnet_conditioning_channel_order", "", "rgb", where, ("rgb", "bgr"))
    convs = _hint_convs(g)
    hint = tuple(g.shape(f"input_hint_block.{i}.weight")[0] for i in convs)
    n_in = g.shape(f"input_hint_block.{convs[0]}.weight")[1]
    if n_in != 3:
        raise BadInput(f"{g.ckpt.path}: input_hint_block.{convs[0]}.weight takes {n_in} channels; precast builds "
                       "ControlNets conditioned on 3-channel images")
    n_res = g.count("zero_convs.{}")
    if n_res != len(fields["channels"]):
        raise BadInput(f"{g.ckpt.path}: {n_res} zero_convs for {len(fields['channels'])} input blocks; the ControlNet is damaged")
    strided = sum(1 for k in range(len(convs) - 2) if k % 2 == 1)     # diffusers: blocks 1, 3, 5 have stride 2
    return ControlNetConfig(**fields, out_channels=0, control_residuals=n_res,
                            family=family_of(fields) if family_of else "",
                            hint_channels=hint, hint_factor=2 ** strided, bgr=order == "bgr",
                            global_pool=field(config_json, "global_pool_conditions", "bool", False, where))


def hint_embedding(g: Graph, cond: str) -> str:
    """conv, SiLU, then (conv, SiLU) pairs at stride 1 and 2, then the zero conv to model_channels."""
    convs = _hint_convs(g)
    h = cond
    for n, i in enumerate(convs):
        last = n == len(convs) - 1
        stride = 2 if 0 < n < len(convs) - 1 and (n - 1) % 2 == 1 else 1
        h = g.conv2d(h, f"input_hint_block.{i}", stride=stride)
        if not last:
            h = g.silu(h)
    return h


def build_controlnet(g: Graph, cfg: ControlNetConfig) -> None:
    sample, t, ctx = ldm_unet.denoiser_inputs(g, cfg)
    cond = g.input("controlnet_cond", g.dtype, ["batch", 3, "image_height", "image_width"])
    emb = ldm_unet.time_embedding(g, cfg, t)
    if cfg.bgr:
        cond = g.op("Gather", cond, g.ints(2, 1, 0), axis=1)
    hint = hint_embedding(g, cond)
    h, skips = ldm_unet.encoder_half(g, cfg, sample, emb, ctx, hint)
    outs = [(g.conv2d(s, f"zero_convs.{i}.0"), down_residual_name(i), cfg.channels[i], cfg.levels[i])
            for i, s in enumerate(skips)]
    outs.append((g.conv2d(h, "middle_block_out.0"), MID_RESIDUAL, cfg.channels[-1], cfg.levels[-1]))
    for value, name, ch, level in outs:
        dims = residual_dims(level)
        if cfg.global_pool:
            value, dims = g.op("ReduceMean", value, g.ints(2, 3), keepdims=1), [1, 1]
        g.output(value, name, g.dtype, ["batch", ch, *dims])


def check_fits(family: str, unet: dict, control: dict, model_path: str, control_path: str) -> None:
    """One line naming both files and the first field where a ControlNet does not fit the model's
    UNet (`family`: the model's detected family)."""
    for name in MATCHED:
        have = family if name == "family" else unet.get(name)
        if have != control.get(name):
            raise BadInput(f"--controlnet {control_path}: its {name} is {control.get(name)}, the model {model_path} "
                           f"has {have}: the ControlNet was trained for another base model")

