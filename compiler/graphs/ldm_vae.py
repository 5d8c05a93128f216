"""LDM AutoencoderKL: encoder (`encoder.*`, `quant_conv`) and decoder (`post_quant_conv`, `decoder.*`).

Owns: both VAE graphs and their config from shapes (MODEL_FORMATS.md §3). Optimum names:
vae_encoder sample -> latent_parameters (mean and log-variance, before scaling);
vae_decoder latent_sample -> sample (raw decoder output, before clamping).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import BadInput
from ..sources.config_fields import field, refuse_unbuilt
from .onnx_graph import Graph

EPS = 1e-6


@dataclass(frozen=True)
class VaeConfig:
    image_channels: int
    latent_channels: int
    encoder_levels: int
    decoder_levels: int
    groups: int = 32

    def describe(self) -> dict:
        return asdict(self)


# diffusers AutoencoderKL fields whose other values change the computation in ways this builder
# does not write: field -> the values it builds (absent = the default)
FIXED_FIELDS = {"act_fn": ("silu", "swish")}
BLOCK_TYPES = {"down_block_types": ("DownEncoderBlock2D",), "up_block_types": ("UpDecoderBlock2D",)}


def vae_config(g: Graph, config_json: dict, overrides: dict) -> VaeConfig:
    if not g.has("decoder.conv_in.weight") and not g.has("encoder.conv_in.weight"):
        raise BadInput(f"{g.ckpt.path}: no VAE tensors under {g.prefix} (looked for decoder.conv_in.weight)")
    where = f"{g.ckpt.path} vae/config.json"
    if config_json:
        refuse_unbuilt(config_json, where, FIXED_FIELDS, BLOCK_TYPES)
    img = g.shape("decoder.conv_out.weight")[0] if g.has("decoder.conv_out.weight") else \
        g.shape("encoder.conv_in.weight")[1]
    z = g.shape("decoder.conv_in.weight")[1] if g.has("decoder.conv_in.weight") else \
        g.shape("encoder.conv_out.weight")[0] // 2
    return VaeConfig(image_channels=img, latent_channels=z, encoder_levels=g.count("encoder.down.{}"),
                     decoder_levels=g.count("decoder.up.{}"),
                     groups=int(overrides.get("groups") or field(config_json, "norm_num_groups", "count", 32, where)))


def resnet(g: Graph, x: str, p: str, groups: int) -> str:
    h = g.conv2d(g.silu(g.group_norm(x, f"{p}.norm1", groups, EPS)), f"{p}.conv1")
    h = g.conv2d(g.silu(g.group_norm(h, f"{p}.norm2", groups, EPS)), f"{p}.conv2")
    skip = g.conv2d(x, f"{p}.nin_shortcut") if g.has(f"{p}.nin_shortcut.weight") else x
    return g.op("Add", skip, h)


def attn_block(g: Graph, x: str, p: str, groups: int) -> str:
    """Single-head self-attention over the H*W positions; q/k/v/proj_out are 1x1 convs."""
    c = g.shape(f"{p}.q.weight")[0]
    h = g.group_norm(x, f"{p}.norm", groups, EPS)
    q, k, v = (g.op("Transpose", g.op("Reshape", g.conv2d(h, f"{p}.{n}"), g.ints(0, c, -1)), perm=[0, 2, 1])
               for n in "qkv")
    a = g.attention(q, k, v, 1, c)
    a = g.op("Reshape", g.op("Transpose", a, perm=[0, 2, 1]), g.op("Shape", x))
    return g.op("Add", x, g.conv2d(a, f"{p}.proj_out"))


def mid(g: Graph, h: str, p: str, groups: int) -> str:
    h = resnet(g, h, f"{p}.mid.block_1", groups)
    if g.has(f"{p}.mid.attn_1.q.weight"):   # absent in VAEs built with mid_block_add_attention=False
        h = attn_block(g, h, f"{p}.mid.attn_1", groups)
    return resnet(g, h, f"{p}.mid.block_2", groups)


def build_vae_encoder(g: Graph, cfg: VaeConfig) -> None:
    x = g.input("sample", g.dtype, ["batch", cfg.image_channels, "height", "width"])
    h = g.conv2d(x, "encoder.conv_in")
    for i in range(cfg.encoder_levels):
        j = 0
        while g.has(f"encoder.down.{i}.block.{j}.norm1.weight"):
            h = resnet(g, h, f"encoder.down.{i}.block.{j}", cfg.groups)
            j += 1
        if g.has(f"encoder.down.{i}.downsample.conv.weight"):
            h = g.op("Pad", h, g.ints(0, 0, 0, 0, 0, 0, 1, 1), mode="constant")
            h = g.conv2d(h, f"encoder.down.{i}.downsample.conv", stride=2, pad=0)
    h = mid(g, h, "encoder", cfg.groups)
    h = g.conv2d(g.silu(g.group_norm(h, "encoder.norm_out", cfg.groups, EPS)), "encoder.conv_out")
    if g.has("quant_conv.weight"):
        h = g.conv2d(h, "quant_conv")
    g.output(h, "latent_parameters", g.dtype, ["batch", 2 * cfg.latent_channels, "latent_height", "latent_width"])


def build_vae_decoder(g: Graph, cfg: VaeConfig) -> None:
    z = g.input("latent_sample", g.dtype, ["batch", cfg.latent_channels, "latent_height", "latent_width"])
    h = g.conv2d(z, "post_quant_conv") if g.has("post_quant_conv.weight") else z
    h = g.conv2d(h, "decoder.conv_in")
    h = mid(g, h, "decoder", cfg.groups)
    for i in reversed(range(cfg.decoder_levels)):
        j = 0
        while g.has(f"decoder.up.{i}.block.{j}.norm1.weight"):
            h = resnet(g, h, f"decoder.up.{i}.block.{j}", cfg.groups)
            j += 1
        if g.has(f"decoder.up.{i}.upsample.conv.weight"):
            h = g.conv2d(g.upsample2x(h), f"decoder.up.{i}.upsample.conv")
    h = g.conv2d(g.silu(g.group_norm(h, "decoder.norm_out", cfg.groups, EPS)), "decoder.conv_out")
    g.output(h, "sample", g.dtype, ["batch", cfg.image_channels, "height", "width"])
