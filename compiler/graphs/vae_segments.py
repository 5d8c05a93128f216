"""The LDM VAE cut at its GroupNorms: the `vae_decoder_tiled` and `vae_encoder_tiled` components, for exact tiling.

Owns: `build_vae_decoder_tiled` / `build_vae_encoder_tiled` (every segment of the decoder / encoder in one ONNX
graph, side by side and unconnected, plus the program that runs them, recorded in the component's config as
`segments`) and `Segmenter` (how a segment's inputs, outputs and step are written).

Why: a GroupNorm normalizes over the whole image, so a decoder run tile by tile (runtime/vae_tiling.py) gives
each tile its own statistics and the tiled image drifts from the plain one (23.9 dB on image content at 1024²,
docs/benchmarks.md). Cut at each GroupNorm, what is left between two of them is local (3x3 and 1x1
convolutions, SiLU, nearest upsampling, residual adds), so each segment can run tile by tile, exactly, on
tiles widened by its reach (`halo`); the runtime (runtime/vae_segments.py) measures each GroupNorm's
statistics over the whole feature map between segments and feeds them in (`sK_mean`, `sK_rstd`, per channel),
and computes the mid-block's attention (global over positions, no weights) itself.

Segment K reads inputs `sK_<role>` ([batch, C, tileK_height, tileK_width]; roles `x`, `skip`, `a`) and writes
outputs `sK_<role>`. A program step: {"segment": K, "inputs": {role: value}, "outputs": {role: value},
"norm": {"groups": G, "eps": e} (the GroupNorm that opens it, over input `x`) or null, "scale": 1 | 2 (output
pixels per input pixel), "halo": input pixels of reach}; an attention step: {"attention": {"q": value, "k":
value, "v": value}, "outputs": {"y": value}}. A step with scale 0.5 ends in the encoder's downsampler (a zero
row and column padded at the bottom and right, then a 3x3 convolution of stride 2): its halo is even, in input
pixels. Values: the first step's input (decoder "latent", encoder "sample"), the last step's output (decoder
"sample", encoder "latent_parameters"), else "vN".
"""
from __future__ import annotations

from .ldm_vae import EPS, VaeConfig
from .onnx_graph import FLOAT, Graph


class Segmenter:
    """Writes one segment at a time into `g` and records the program."""

    def __init__(self, g: Graph, groups: int, source: str, channels: int):
        self.g, self.groups, self.steps, self.values = g, groups, [], 0
        self.channels: dict[str, int] = {source: channels}
        self.step: dict | None = None

    def begin(self, inputs: dict[str, str], norm: str | None = None) -> dict[str, str]:
        """A new segment reading `inputs` (role -> value); its input tensors by role, input `x` normalized by
        the GroupNorm `norm` (module name; its statistics fed in) when given."""
        g, k = self.g, len(self.steps)
        self.step = {"segment": k, "inputs": dict(inputs), "outputs": {}, "norm": None, "scale": 1, "halo": 0}
        tensors = {role: g.input(f"s{k}_{role}", g.dtype, ["batch", self.channels[value], f"tile{k}_height",
                                                            f"tile{k}_width"])
                   for role, value in inputs.items()}
        if norm is not None:
            c = self.channels[inputs["x"]]
            mean, rstd = (g.input(f"s{k}_{n}", FLOAT, ["batch", c, 1, 1]) for n in ("mean", "rstd"))
            y = g.op("Mul", g.op("Sub", g.to_fp32(tensors["x"]), mean), rstd)
            y = g.op("Mul", y, g.op("Reshape", g.param(f"{norm}.weight", fp32=True), g.ints(-1, 1, 1)))
            y = g.op("Add", y, g.op("Reshape", g.param(f"{norm}.bias", fp32=True), g.ints(-1, 1, 1)))
            g.channels[y] = c
            tensors["x"] = g.from_fp32(y)
            self.step["norm"] = {"groups": self.groups, "eps": EPS}
        return tensors

    def reach(self, module: str, scale: int = 1) -> None:
        """Count a convolution `module` run at `scale` x the segment's input resolution into its halo."""
        k = self.g.shape(f"{module}.weight")[2] // 2
        self.step["halo"] += -(-k // scale)

    def end(self, outputs: dict[str, str], scale: float = 1, name: str | None = None) -> dict[str, str]:
        """Close the segment with `outputs` (role -> tensor): their values by role (`name` for a single one)."""
        g, k, step = self.g, len(self.steps), self.step
        step["scale"] = scale
        values = {}
        for role, tensor in outputs.items():
            value = name or self._fresh()
            c = g.channels[tensor]
            g.output(tensor, f"s{k}_{role}", g.dtype, ["batch", c, f"tile{k}_{role}_height", f"tile{k}_{role}_width"])
            self.channels[value] = c
            values[role] = value
        step["outputs"] = values
        self.steps.append(step)
        self.step = None
        return values

    def attention(self, q: str, k: str, v: str) -> str:
        """A step the runtime computes: single-head attention over positions, softmax(q k^T / sqrt(C)) v."""
        value = self._fresh()
        self.channels[value] = self.channels[v]
        self.steps.append({"attention": {"q": q, "k": k, "v": v}, "outputs": {"y": value}})
        return value

    def _fresh(self) -> str:
        self.values += 1
        return f"v{self.values}"


def resnet(s: Segmenter, x: str, p: str, upsample: str | None = None, downsample: str | None = None) -> str:
    """A ResNet block as two segments (norm1 ... conv1; norm2 ... conv2 + shortcut), the level's upsampler
    (nearest x2 then `upsample`'s conv) or downsampler (`downsample`) closing the second when given."""
    g = s.g
    t = s.begin({"x": x}, f"{p}.norm1")
    h = g.conv2d(g.silu(t["x"]), f"{p}.conv1")
    s.reach(f"{p}.conv1")
    h = s.end({"y": h})["y"]
    t = s.begin({"x": h, "skip": x}, f"{p}.norm2")
    out = g.conv2d(g.silu(t["x"]), f"{p}.conv2")
    s.reach(f"{p}.conv2")
    skip = g.conv2d(t["skip"], f"{p}.nin_shortcut") if g.has(f"{p}.nin_shortcut.weight") else t["skip"]
    out = g.op("Add", skip, out)
    g.channels[out] = g.channels[skip]
    if downsample is not None:
        return down(s, out, downsample)
    if upsample is None:
        return s.end({"y": out})["y"]
    out = g.conv2d(g.upsample2x(out), upsample)
    s.reach(upsample, 2)
    return s.end({"y": out}, scale=2)["y"]


def down(s: Segmenter, x: str, module: str) -> str:
    """Close the segment with the encoder's downsampler on x: padded at the bottom and right, a 3x3 convolution of
    stride 2 (ldm_vae.build_vae_encoder's). Its halo: what came before, plus the stride's window, rounded up to
    even so that tiles start on the stride's grid."""
    g = s.g
    y = g.conv2d(g.op("Pad", x, g.ints(0, 0, 0, 0, 0, 0, 1, 1), mode="constant"), module, stride=2, pad=0)
    s.step["halo"] = 2 * -(-(s.step["halo"] + 1) // 2)
    return s.end({"y": y}, scale=0.5)["y"]


def attn_block(s: Segmenter, x: str, p: str) -> str:
    """Norm and q / k / v (1x1 convs, tileable); the attention (the runtime's); proj_out + x (tileable)."""
    g = s.g
    t = s.begin({"x": x}, f"{p}.norm")
    qkv = s.end({n: g.conv2d(t["x"], f"{p}.{n}") for n in "qkv"})
    a = s.attention(qkv["q"], qkv["k"], qkv["v"])
    t = s.begin({"a": a, "skip": x})
    out = g.op("Add", t["skip"], g.conv2d(t["a"], f"{p}.proj_out"))
    g.channels[out] = g.channels[t["skip"]]
    return s.end({"y": out})["y"]


def build_vae_decoder_tiled(g: Graph, cfg: VaeConfig) -> None:
    """The decoder of ldm_vae.build_vae_decoder, same weights and arithmetic, as segments."""
    s = Segmenter(g, cfg.groups, "latent", cfg.latent_channels)
    t = s.begin({"x": "latent"})
    h = t["x"]
    if g.has("post_quant_conv.weight"):
        h = g.conv2d(h, "post_quant_conv")
        s.reach("post_quant_conv")
    h = g.conv2d(h, "decoder.conv_in")
    s.reach("decoder.conv_in")
    v = s.end({"y": h})["y"]
    v = resnet(s, v, "decoder.mid.block_1")
    if g.has("decoder.mid.attn_1.q.weight"):
        v = attn_block(s, v, "decoder.mid.attn_1")
    v = resnet(s, v, "decoder.mid.block_2")
    for i in reversed(range(cfg.decoder_levels)):
        blocks = []
        while g.has(f"decoder.up.{i}.block.{len(blocks)}.norm1.weight"):
            blocks.append(f"decoder.up.{i}.block.{len(blocks)}")
        up = f"decoder.up.{i}.upsample.conv" if g.has(f"decoder.up.{i}.upsample.conv.weight") else None
        for j, p in enumerate(blocks):
            v = resnet(s, v, p, up if j == len(blocks) - 1 else None)
        if up is not None and not blocks:       # an upsampler alone on its level
            t = s.begin({"x": v})
            s.reach(up, 2)
            v = s.end({"y": g.conv2d(g.upsample2x(t["x"]), up)}, scale=2)["y"]
    t = s.begin({"x": v}, "decoder.norm_out")
    h = g.conv2d(g.silu(t["x"]), "decoder.conv_out")
    s.reach("decoder.conv_out")
    s.end({"y": h}, name="sample")
    g.config_extra["segments"] = s.steps


def build_vae_encoder_tiled(g: Graph, cfg: VaeConfig) -> None:
    """The encoder of ldm_vae.build_vae_encoder, same weights and arithmetic, as segments."""
    s = Segmenter(g, cfg.groups, "sample", cfg.image_channels)
    t = s.begin({"x": "sample"})
    s.reach("encoder.conv_in")
    v = s.end({"y": g.conv2d(t["x"], "encoder.conv_in")})["y"]
    for i in range(cfg.encoder_levels):
        blocks = []
        while g.has(f"encoder.down.{i}.block.{len(blocks)}.norm1.weight"):
            blocks.append(f"encoder.down.{i}.block.{len(blocks)}")
        sampler = f"encoder.down.{i}.downsample.conv" if g.has(f"encoder.down.{i}.downsample.conv.weight") else None
        for j, p in enumerate(blocks):
            v = resnet(s, v, p, downsample=sampler if j == len(blocks) - 1 else None)
        if sampler is not None and not blocks:       # a downsampler alone on its level
            v = down(s, s.begin({"x": v})["x"], sampler)
    v = resnet(s, v, "encoder.mid.block_1")
    if g.has("encoder.mid.attn_1.q.weight"):
        v = attn_block(s, v, "encoder.mid.attn_1")
    v = resnet(s, v, "encoder.mid.block_2")
    t = s.begin({"x": v}, "encoder.norm_out")
    h = g.conv2d(g.silu(t["x"]), "encoder.conv_out")
    s.reach("encoder.conv_out")
    if g.has("quant_conv.weight"):
        h = g.conv2d(h, "quant_conv")
        s.reach("quant_conv")
    s.end({"y": h}, name="latent_parameters")
    g.config_extra["segments"] = s.steps
