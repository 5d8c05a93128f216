"""TAESD's decoder (madebyollin's tiny autoencoder: TAESD, TAESDXL, TAESD3, TAEF1), the `preview_decoder`
component that makes step previews.

Owns: the graph and its config from shapes: the decoder's nn.Sequential read index by index (a conv where
`N.weight` is, a Block -- three 3x3 convs with ReLUs, a skip, a ReLU after the sum -- where `N.conv.0.weight` is;
of the indices without weights, the one after the first conv is its ReLU and the others nearest x2 upsamples).
latent_sample [1, C, h, w] -> sample [1, 3, H, W] in [-1, 1], as diffusers' AutoencoderTiny decodes: the
Clamp tanh(x / 3) * 3 first, x * 2 - 1 last. Its input is the denoiser's latents / latent_scale + latent_shift
(diffusers' scaling_factor and shift_factor: 1.0 and 0.0 for every TAESD, which decodes the latents the
denoiser works on, not the VAE's raw ones).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput
from ..sources.config_fields import field, refuse_unbuilt
from .onnx_graph import Graph

# diffusers AutoencoderTiny fields whose other values change the decoder in ways this builder does not write
FIXED_FIELDS = {"act_fn": ("relu",), "upsample_fn": ("nearest",), "upsampling_scaling_factor": (2,),
                "out_channels": (3,)}


@dataclass(frozen=True)
class TaesdConfig:
    latent_channels: int
    layers: tuple[str, ...]        # per Sequential index from 1: conv, block, relu or upsample
    latent_scale: float = 1.0      # decoder input = denoiser latents / latent_scale + latent_shift
    latent_shift: float = 0.0

    def describe(self) -> dict:
        return {"latent_channels": self.latent_channels, "upscale": 2 ** self.layers.count("upsample"),
                "blocks": self.layers.count("block"), "latent_scale": self.latent_scale,
                "latent_shift": self.latent_shift}


def taesd_config(g: Graph, config_json: dict, overrides: dict) -> TaesdConfig:
    where = f"{g.ckpt.path}/config.json"
    if config_json:
        refuse_unbuilt(config_json, where, FIXED_FIELDS, {})
    top = {int(k[len(g.prefix):].split(".")[0]) for k in g.ckpt.refs}
    first = g.shape("1.weight")
    if len(first) != 4:
        raise BadInput(f"{g.ckpt.path}: {g.prefix}1.weight has shape {list(first)}; a TAESD decoder's first layer is a "
                       "conv [64, latent channels, 3, 3]: the file is damaged or not a TAESD decoder")
    layers = []
    for i in range(1, max(top) + 1):
        if g.has(f"{i}.conv.0.weight"):
            layers.append("block")
        elif g.has(f"{i}.weight"):
            layers.append("conv")
        else:
            layers.append("relu" if i == 2 else "upsample")
    last = g.shape(f"{max(top)}.weight")
    if layers[-1] != "conv" or last[0] != 3:
        raise BadInput(f"{g.ckpt.path}: {g.prefix}{max(top)} is not a conv to 3 (RGB) channels (shape {list(last)}); "
                       "a TAESD decoder ends with one: the file is damaged or not a TAESD decoder")
    return TaesdConfig(first[1], tuple(layers), float(field(config_json, "scaling_factor", "positive", 1.0, where)),
                       float(field(config_json, "shift_factor", "finite", 0.0, where)))


def block(g: Graph, x: str, p: str) -> str:
    """madebyollin's Block (diffusers' AutoencoderTinyBlock): relu(conv(relu(conv(relu(conv(x))))) + skip(x))."""
    h = g.op("Relu", g.conv2d(x, f"{p}.conv.0"))
    h = g.conv2d(g.op("Relu", g.conv2d(h, f"{p}.conv.2")), f"{p}.conv.4")
    skip = g.conv2d(x, f"{p}.skip", bias=False) if g.has(f"{p}.skip.weight") else x
    return g.op("Relu", g.op("Add", h, skip))


def build_taesd_decoder(g: Graph, cfg: TaesdConfig) -> None:
    z = g.input("latent_sample", g.dtype, [1, cfg.latent_channels, "latent_height", "latent_width"])
    three = g.scalar(3.0)
    h = g.op("Mul", g.op("Tanh", g.op("Div", z, three)), three)
    for i, kind in enumerate(cfg.layers, start=1):
        if kind == "block":
            h = block(g, h, str(i))
        elif kind == "conv":
            h = g.conv2d(h, str(i), bias=g.has(f"{i}.bias"))
        else:
            h = g.op("Relu", h) if kind == "relu" else g.upsample2x(h)
    g.output(g.op("Sub", g.op("Mul", h, g.scalar(2.0)), g.scalar(1.0)), "sample", g.dtype, [1, 3, "height", "width"])
