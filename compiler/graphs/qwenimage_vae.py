"""The Qwen-Image VAE (diffusers `AutoencoderKLQwenImage`, a causal 3-D conv VAE of the Wan family) on single
images, diffusers names (`decoder.up_blocks.N.resnets.M.conv1.weight`, ...).

Owns: its config from shapes (latent channels from decoder.conv_in, the blocks from the names) and the decoder
and encoder graphs of one frame. On one frame every causal Conv3d (time padding 2k on the front only) reduces to
a Conv2d with the last time slice of its kernel (the zero padding meets the other slices; only that slice is
written: Graph.param's `take`); the temporal
up/downsamplers' time_conv is not run on the first frame (diffusers marks it 'Rep' / caches it), so it is skipped
here. RMS_norm is F.normalize over channels (x / max(||x||, 1e-12)) * sqrt(C) * gamma; the attention is one head
over the pixels (to_qkv / proj 1x1 convs); upsamplers are nearest 2x + a 3x3 conv halving the channels,
downsamplers a zero pad (right, bottom) + a stride-2 3x3 conv.
IO: vae_decoder latent_sample [B, z, h, w] (denormalised: x * latents_std + latents_mean, done by the runtime)
-> sample [B, 3, 8h, 8w] clamped to [-1, 1] (as diffusers' decode); vae_encoder sample [B, 3, H, W] ->
latent_parameters [B, 2z, H/8, W/8] (mean | logvar, unnormalised). The config carries latents_mean / latents_std
from config.json (AutoencoderKLQwenImage's defaults where it has none).
Precision: norms and attention scores in fp32.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from .onnx_graph import Graph

# AutoencoderKLQwenImage's defaults (Qwen/Qwen-Image's vae/config.json carries the same)
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
               1.6382, 1.1253, 2.8251, 1.9160)


@dataclass(frozen=True)
class QwenVaeConfig:
    latent_channels: int
    decoder_levels: int                 # resolution levels: pixels per latent = 2 ** (levels - 1)
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]



    def describe(self) -> dict:
        return asdict(self)


def qwen_vae_config(g: Graph, config_json: dict, overrides: dict) -> QwenVaeConfig:
    side = "decoder" if g.has("decoder.conv_in.weight") else "encoder"
    if not g.has(f"{side}.conv_in.weight") or len(g.shape(f"{side}.conv_in.weight")) != 5 or \
            not g.has(f"{side}.mid_block.attentions.0.to_qkv.weight"):
        raise BadInput(f"{g.ckpt.path}: no Qwen-Image VAE under {g.prefix or '(no prefix)'} (looked for "
                       "decoder.conv_in.weight, a 3-D conv, and decoder.mid_block.attentions.0.to_qkv.weight); give "
                       "the model's own VAE (qwen_image_vae.safetensors, or the folder's vae/) with --vae")
    z = g.shape("post_quant_conv.weight")[0] if g.has("post_quant_conv.weight") else \
        g.shape("quant_conv.weight")[0] // 2
    where = f"{g.ckpt.path} vae/config.json"
    mean = tuple(float(v) for v in config_json.get("latents_mean") or LATENTS_MEAN)
    std = tuple(float(v) for v in config_json.get("latents_std") or LATENTS_STD)
    if len(mean) != z or len(std) != z or min(std) <= 0 or not np.isfinite(mean + std).all():
        raise BadInput(f"{where}: latents_mean / latents_std must be {z} finite numbers each (std > 0), one per "
                       "latent channel")
    steps = (sum(g.has(f"decoder.up_blocks.{i}.upsamplers.0.resample.1.weight")
                 for i in range(g.count("decoder.up_blocks.{}"))) if side == "decoder" else
             sum(g.has(f"encoder.down_blocks.{i}.resample.1.weight") for i in range(g.count("encoder.down_blocks.{}"))))
    return QwenVaeConfig(latent_channels=z, decoder_levels=steps + 1, latents_mean=mean, latents_std=std)


# ---- layers --------------------------------------------------------------------------------------

def conv(g: Graph, x: str, module: str, stride: int = 1, pads: tuple[int, ...] | None = None) -> str:
    """A causal Conv3d (or Conv2d) on one frame: the kernel's last time slice as a Conv2d."""
    shape = g.shape(f"{module}.weight")
    if len(shape) == 5:      # only the last time slice is written (taken at the source: a third of the bytes)
        out_ch, in_ch, _, kh, kw = shape
        w = g.param(f"{module}.weight", take=(2, shape[2] - 1))
    else:
        out_ch, in_ch, kh, kw = shape
        w = g.param(f"{module}.weight")
    g._check_channels(x, module, in_ch, "takes")
    g.expect(f"{module}.bias", (out_ch,), "one bias per output channel")
    y = g.op("Conv", x, w, g.param(f"{module}.bias"), strides=[stride, stride],
             pads=list(pads) if pads else [kh // 2] * 4, kernel_shape=[kh, kw])
    g.channels[y] = out_ch
    return y


def rms(g: Graph, x: str, module: str, channels: int) -> str:
    g.expect(f"{module}.gamma", (channels, 1, 1, 1) if len(g.shape(f"{module}.gamma")) == 4 else (channels, 1, 1),
             "one scale per channel")
    x32 = g.to_fp32(x)
    norm = g.op("Sqrt", g.op("ReduceSumSquare", x32, g.ints(1), keepdims=1))
    y = g.op("Div", x32, g.op("Max", norm, g.const(np.array(1e-12, np.float32))))
    gamma = g.op("Reshape", g.param(f"{module}.gamma", fp32=True), g.ints(channels, 1, 1))
    y = g.from_fp32(g.op("Mul", y, g.op("Mul", gamma, g.const(np.array(channels ** 0.5, np.float32)))))
    g.channels[y] = channels
    return y


def resblock(g: Graph, x: str, p: str) -> str:
    in_ch, out_ch = g.shape(f"{p}.conv1.weight")[1], g.shape(f"{p}.conv1.weight")[0]
    h = conv(g, x, f"{p}.conv_shortcut") if g.has(f"{p}.conv_shortcut.weight") else x
    y = conv(g, g.silu(rms(g, x, f"{p}.norm1", in_ch)), f"{p}.conv1")
    y = conv(g, g.silu(rms(g, y, f"{p}.norm2", out_ch)), f"{p}.conv2")
    out = g.op("Add", y, h)
    g.channels[out] = out_ch
    return out


def attention(g: Graph, x: str, p: str) -> str:
    c = g.shape(f"{p}.proj.weight")[0]
    h = conv(g, rms(g, x, f"{p}.norm", c), f"{p}.to_qkv")
    shape = g.op("Shape", x)
    flat = g.op("Transpose", g.op("Reshape", h, g.ints(0, 3 * c, -1)), perm=[0, 2, 1])      # [B, HW, 3c]
    q, k, v = g.op("Split", flat, axis=-1, num_outputs=3, outputs=3)
    att = g.sdpa(*(g.op("Unsqueeze", t, g.ints(1)) for t in (q, k, v)), c ** -0.5)          # [B, 1, HW, c]
    y = g.op("Reshape", g.op("Transpose", g.op("Squeeze", att, g.ints(1)), perm=[0, 2, 1]), shape)
    g.channels[y] = c
    out = g.op("Add", conv(g, y, f"{p}.proj"), x)
    g.channels[out] = c
    return out


def mid_block(g: Graph, x: str, p: str) -> str:
    x = resblock(g, x, f"{p}.resnets.0")
    for i in range(g.count(f"{p}.attentions.{{}}")):
        x = resblock(g, attention(g, x, f"{p}.attentions.{i}"), f"{p}.resnets.{i + 1}")
    return x


def _skip_time_convs(g: Graph, side: str) -> None:
    g.skip([k[len(g.prefix):] for k in g.ckpt.with_prefix(g.prefix + side + ".") if ".time_conv." in k])


# ---- graphs --------------------------------------------------------------------------------------

def build_qwen_vae_decoder(g: Graph, cfg: QwenVaeConfig) -> None:
    z = g.input("latent_sample", g.dtype, ["batch", cfg.latent_channels, "latent_height", "latent_width"])
    g.channels[z] = cfg.latent_channels
    x = mid_block(g, conv(g, conv(g, z, "post_quant_conv"), "decoder.conv_in"), "decoder.mid_block")
    for i in range(g.count("decoder.up_blocks.{}")):
        p = f"decoder.up_blocks.{i}"
        for j in range(g.count(f"{p}.resnets.{{}}")):
            x = resblock(g, x, f"{p}.resnets.{j}")
        if g.has(f"{p}.upsamplers.0.resample.1.weight"):
            x = conv(g, g.upsample2x(x), f"{p}.upsamplers.0.resample.1")
    c = g.channels[x]
    x = conv(g, g.silu(rms(g, x, "decoder.norm_out", c)), "decoder.conv_out")
    _skip_time_convs(g, "decoder")
    out = g.op("Clip", x, g.scalar(-1.0), g.scalar(1.0))
    g.output(out, "sample", g.dtype, ["batch", 3, "height", "width"])


def build_qwen_vae_encoder(g: Graph, cfg: QwenVaeConfig) -> None:
    x = g.input("sample", g.dtype, ["batch", 3, "height", "width"])
    g.channels[x] = 3
    x = conv(g, x, "encoder.conv_in")
    for i in range(g.count("encoder.down_blocks.{}")):
        p = f"encoder.down_blocks.{i}"
        if g.has(f"{p}.conv1.weight"):
            x = resblock(g, x, p)
        elif g.has(f"{p}.resample.1.weight"):
            x = conv(g, x, f"{p}.resample.1", stride=2, pads=(0, 0, 1, 1))
        else:
            raise BadInput(f"{g.ckpt.path}: {g.prefix}{p} is neither a residual block nor a downsampler (attention "
                           "in the encoder's blocks is not supported: Qwen-Image's VAE has none)")
    x = mid_block(g, x, "encoder.mid_block")
    c = g.channels[x]
    x = conv(g, conv(g, g.silu(rms(g, x, "encoder.norm_out", c)), "encoder.conv_out"), "quant_conv")
    _skip_time_convs(g, "encoder")
    g.output(x, "latent_parameters", g.dtype, ["batch", 2 * cfg.latent_channels, "latent_height", "latent_width"])
