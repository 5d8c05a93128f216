"""ControlNets at run time: which nets a generation uses, their images and scales, and the residuals
the UNet adds at each step.

Owns: the `--control IMAGE[:SCALE]` / `--controlnet NAME` pairing (the i-th image goes to the i-th
named net; a bundle with one ControlNet needs no name), each net's step range (diffusers'
control_guidance_start / _end: a net runs at step i unless i/steps < start or (i+1)/steps > end),
guess mode (only the conditional half of the CFG batch gets the net's residuals, scaled by
logspace(-1, 0, N + 1) x scale; the unconditional half gets none), summing several nets' residuals,
and the zero residuals a ControlNet bundle's UNet is fed when no control is given; the checks of a net's name
and step range (check_net, check_range), which the Python API's `controls=` uses too. The control image
goes through runtime/images.py's sizing rules, then to [0, 1] (diffusers' control_image_processor:
no normalization). Each net is its own engine (`controlnet_<name>` components, unscaled residual
outputs `down_block_{i}_additional_residual`, `mid_block_additional_residual`); the UNet takes them as
inputs of the same names. Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .checks import shown
from .errors import UserError
from .images import fit, init_image

PREFIX = "controlnet_"
MID = "mid_block_additional_residual"


def residual_names(inputs: list[dict]) -> list[str]:
    """The UNet's residual inputs, in order (down 0..N-1, then mid): [] for a UNet without them."""
    downs = sorted((int(m.group(1)), i["name"]) for i in inputs
                   if (m := re.fullmatch(r"down_block_(\d+)_additional_residual", i["name"])))
    return [n for _, n in downs] + ([MID] if any(i["name"] == MID for i in inputs) else [])


def _side(dim, latent: int) -> int:
    """A residual's side from its symbolic dimension: `height` (the latent's), `height_divK` (ceil)."""
    if isinstance(dim, int):
        return dim
    m = re.fullmatch(r"(?:height|width)(?:_div(\d+))?", str(dim))
    return latent if m is None or m.group(1) is None else -(-latent // int(m.group(1)))


def zero_residuals(inputs: list[dict], batch: int, h: int, w: int) -> dict[str, np.ndarray]:
    """Zeros for every residual input of a ControlNet bundle's UNet at latent size h x w."""
    shapes = {i["name"]: i["shape"] for i in inputs}
    return {n: np.zeros((batch, int(shapes[n][1]), _side(shapes[n][2], h), _side(shapes[n][3], w)), np.float32)
            for n in residual_names(inputs)}


@dataclass(frozen=True)
class Control:
    """One ControlNet's part in a generation."""
    component: str                 # controlnet_<name>
    image: object                  # a PNG path or a uint8 array
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0


def parse_control(text: str) -> tuple[str, float]:
    """`IMAGE[:SCALE]` -> (image path, scale); a path with colons keeps them unless the last part is a number."""
    path, sep, tail = text.rpartition(":")
    if sep:
        try:
            scale = float(tail)
        except ValueError:
            return text, 1.0
        if not math.isfinite(scale):
            raise UserError(f"--control {text}: the scale must be a finite number, e.g. canny.png:0.8")
        return path, scale
    return text, 1.0


def bundle_nets(manifest) -> list[str]:
    """The bundle's ControlNet components, by name (without the controlnet_ prefix)."""
    return [c[len(PREFIX):] for c in manifest.components if c.startswith(PREFIX)]


def plan_controls(manifest, controls: list[tuple[object, float]], names: list[str] = (),
                  starts: list[float] = (), ends: list[float] = ()) -> list[Control]:
    """Pair images with nets, checked against the bundle: one UserError line for each mistake."""
    nets = bundle_nets(manifest)
    if not controls:
        if names:
            raise UserError(f"--controlnet {names[0]}: give its image with --control IMAGE[:SCALE]")
        return []
    if not nets:
        raise UserError(f"{manifest.root}: the bundle has no ControlNet; rebuild it with `controlnets:` in the recipe "
                        "(or merge in a bundle that has one)")
    if not names:
        if len(nets) != 1 or len(controls) != 1:
            raise UserError(f"--control: the bundle has ControlNets {', '.join(nets)}; say which with --controlnet NAME "
                            "(one per --control, in the same order)")
        names = [nets[0]]
    if len(names) != len(controls):
        raise UserError(f"--controlnet given {len(names)} times but --control {len(controls)} times: one name per image")
    for name in names:
        check_net(manifest, name)
    out = []
    for i, ((image, scale), name) in enumerate(zip(controls, names)):
        start = float(starts[i]) if i < len(starts) else 0.0
        end = float(ends[i]) if i < len(ends) else 1.0
        check_range(start, end, f"--control-start {start} / --control-end {end} for {name}")
        out.append(Control(PREFIX + name, image, float(scale), start, end))
    return out


def check_net(manifest, name: str, option: str = "--controlnet") -> None:
    """A ControlNet name (`option`: how the caller spells it, runtime/checks.py's `shown`) is the bundle's."""
    nets = bundle_nets(manifest)
    if name not in nets:
        fix = f"it has {', '.join(nets)}" if nets else "it has no ControlNet; rebuild it with `controlnets:` in the recipe"
        raise UserError(f"{shown(option, name)}: not in the bundle ({fix})")


def check_range(start: float, end: float, what: str) -> None:
    """A net's step range, as fractions of the steps (`what` names the values as the caller gave them)."""
    if not 0.0 <= start < end <= 1.0:
        raise UserError(f"{what}: need 0 <= start < end <= 1")


class ControlNets:
    """The nets of one generation, loaded from a BundleModel, and the residuals at each step."""

    def __init__(self, model, controls: list[Control], width: int, height: int, guess_mode: bool = False):
        self.model, self.controls, self.guess_mode = model, controls, guess_mode
        self.images = []
        for c in controls:
            rgb = init_image(c.image, f"--control {c.image}" if isinstance(c.image, str) else "--control")
            x = fit(rgb, width, height) / np.float32(255.0)
            self.images.append(x.transpose(2, 0, 1)[None].astype(np.float32))

    def residuals(self, i: int, steps: int, sample: np.ndarray, timestep: np.ndarray, context: np.ndarray,
                  extra: dict, unet_inputs: list[dict]) -> dict[str, np.ndarray]:
        """The summed residuals for step i (batch = the CFG batch [uncond, cond]); zeros where no net runs."""
        b, _, h, w = sample.shape
        total = zero_residuals(unet_inputs, b, h, w)
        names = list(total)                       # the UNet's residual inputs, down 0..N-1 then mid
        for c, image in zip(self.controls, self.images):
            if i / steps < c.start or (i + 1) / steps > c.end:
                continue
            # the whole CFG batch (an engine's profile has it); in guess mode the unconditional half's
            # residuals are dropped (each batch row is computed on its own: the same as running the
            # conditional half alone, as diffusers does)
            feeds = {"sample": sample, "timestep": timestep, "encoder_hidden_states": context,
                     "controlnet_cond": np.repeat(image, b, axis=0), **extra}
            out = self.model.component(c.component).session.run(feeds)
            scales = (np.logspace(-1, 0, len(names), dtype=np.float32) * np.float32(c.scale) if self.guess_mode
                      else np.full(len(names), c.scale, np.float32))
            for name, s in zip(names, scales):
                r = out[name].astype(np.float32) * s
                if self.guess_mode:
                    total[name][b // 2:] += r[b // 2:]
                else:
                    total[name] += r
        return total
