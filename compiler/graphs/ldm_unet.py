"""LDM UNet (SD 1.x layout: `input_blocks`, `middle_block`, `output_blocks`, `time_embed`, `out`).

Owns: the UNet graph and its config inferred from tensor names and shapes (MODEL_FORMATS.md
§1-2). The block tree mirrors the checkpoint: a block at `input_blocks.1.` reads
`input_blocks.1.0.in_layers.0.weight`, so weights bind by name. Optimum names:
sample, timestep, encoder_hidden_states -> out_sample; batch, height, width dynamic.
Heads are not in the weights: SD 1.x uses 8 per attention (head_dim = channels / 8).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from ..sources.config_fields import field, refuse_unbuilt
from .onnx_graph import FLOAT, Graph

RES_EPS, ATTN_GN_EPS, LN_EPS = 1e-5, 1e-6, 1e-5


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int
    out_channels: int
    model_channels: int
    context_dim: int
    channels: list[int]              # output channels of each input block
    levels: list[int]                # resolution level of each input block
    num_heads: list[int]             # attention heads per level
    groups: int = 32
    use_linear_projection: bool = False
    n_output_blocks: int = 0
    adm_in_channels: int = 0         # SDXL: label_emb input = pooled text embeds + time ids embedded
    time_ids: int = 0                # SDXL 6 (sizes, crop, target), refiner 5 (sizes, crop, aesthetic)
    time_id_dim: int = 256
    flip_sin_to_cos: bool = True     # diffusers config fields the LDM layout fixes; a folder may set them
    freq_shift: float = 0.0
    norm_eps: float = RES_EPS        # ResBlocks' and the output's GroupNorm
    downsample_padding: int = 1      # 0: pad right/bottom by one, then a stride-2 conv without padding
    center_input_sample: bool = False  # diffusers: the sample is mapped to 2 * sample - 1 first
    control_residuals: int = 0       # > 0: the UNet takes ControlNet residuals as inputs (one per input block + mid)

    def describe(self) -> dict:
        d = asdict(self)
        if not d["control_residuals"]:      # a UNet without ControlNet inputs describes itself as before
            del d["control_residuals"]
        return d


# diffusers UNet2DConditionModel fields whose other values change the computation in ways this
# builder does not write: field -> the values it builds (absent = the default).
FIXED_FIELDS = {
    "act_fn": ("silu", "swish"), "resnet_time_scale_shift": ("default",), "time_embedding_type": ("positional",),
    "class_embed_type": (None,), "num_class_embeds": (None,), "addition_embed_type": (None, "text_time"),
    "encoder_hid_dim": (None,), "encoder_hid_dim_type": (None,), "time_cond_proj_dim": (None,),
    "timestep_post_act": (None,), "time_embedding_act_fn": (None,), "dual_cross_attention": (False,),
    "only_cross_attention": (False,), "attention_type": ("default",), "cross_attention_norm": (None,),
    "resnet_skip_time_act": (False,), "resnet_out_scale_factor": (1, 1.0), "mid_block_scale_factor": (1, 1.0),
    "mid_block_type": ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D", None),
}
BLOCK_TYPES = {"down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
               "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}


def _context_width(g: Graph) -> list[int]:
    """The text width every cross-attention's to_k / to_v reads ([width] or [] when there are none);
    a weight that reads another width (a transposed or foreign tensor) is named."""
    keys = sorted(k for k in g.ckpt.refs if k.startswith(g.prefix) and k.endswith(("attn2.to_k.weight", "attn2.to_v.weight")))
    widths = {k: g.ckpt.shape(k)[-1] if len(g.ckpt.shape(k)) == 2 else -1 for k in keys}
    if not widths:
        return []
    common = max(set(widths.values()), key=list(widths.values()).count)
    odd = [k for k, w in widths.items() if w != common]
    if odd:
        raise BadInput(f"{g.ckpt.path}: {odd[0]} has shape {list(g.ckpt.shape(odd[0]))} where the other "
                       f"cross-attention projections read {common}-wide text; the checkpoint is damaged, "
                       "transposed or merged from different models")
    return [common]


def unet_config(g: Graph, config_json: dict, overrides: dict) -> UNetConfig:
    fields = encoder_fields(g, config_json, overrides)
    return UNetConfig(**fields, out_channels=g.shape("out.2.weight")[0], n_output_blocks=g.count("output_blocks.{}"),
                      control_residuals=int(overrides.get("control_residuals", 0)))


def encoder_fields(g: Graph, config_json: dict, overrides: dict, fixed: dict = FIXED_FIELDS,
                   blocks: dict = BLOCK_TYPES) -> dict:
    """The config fields the encoder half (time embedding, input blocks, middle block) reads from the
    shapes and a diffusers config: shared by the UNet and its ControlNets."""
    if not g.has("input_blocks.0.0.weight"):
        raise BadInput(f"{g.ckpt.path}: no {g.prefix}input_blocks.0.0.weight")
    mc, in_ch = g.shape("input_blocks.0.0.weight")[:2]
    n_in = g.count("input_blocks.{}")
    channels, levels, level = [mc], [0], 0
    for i in range(1, n_in):
        if g.has(f"input_blocks.{i}.0.op.weight"):
            level += 1
            channels.append(g.shape(f"input_blocks.{i}.0.op.weight")[0])
        elif g.has(f"input_blocks.{i}.0.out_layers.3.weight"):
            channels.append(g.shape(f"input_blocks.{i}.0.out_layers.3.weight")[0])
        else:
            raise BadInput(f"{g.ckpt.path}: input_blocks.{i} is neither a ResBlock nor a downsample")
        levels.append(level)
    ctx = _context_width(g)
    proj = [g.shape(k[len(g.prefix):]) for k in g.ckpt.refs if k.startswith(g.prefix) and k.endswith("proj_in.weight")]
    n_levels = level + 1
    where = f"{g.ckpt.path} unet/config.json"
    if not ctx:
        raise BadInput(f"{g.ckpt.path}: the UNet has no cross-attention (no attn2.to_k weights), so it takes no "
                       "text conditioning; unconditional UNets are not supported")
    if config_json:
        refuse_unbuilt(config_json, where, fixed, blocks, ("only_cross_attention",))
    # heads: --set num_heads, else --set head_dim, else the folder's config (diffusers'
    # attention_head_dim holds the number of heads), else the family's convention
    heads, head_dim = overrides.get("num_heads"), overrides.get("head_dim")
    if heads is None and head_dim is None and config_json:
        heads = field(config_json, "num_attention_heads", "counts", None, where) or \
            field(config_json, "attention_head_dim", "counts", None, where)
    if heads is None and head_dim is None:
        head_dim = overrides.get("head_dim_default")
    if heads is None and head_dim:
        level_ch = [max(c for c, lv in zip(channels, levels) if lv == level) for level in range(n_levels)]
        heads = [max(1, c // int(head_dim)) for c in level_ch]
    heads = heads if heads is not None else overrides.get("num_heads_default", 8)
    heads = [int(heads)] * n_levels if isinstance(heads, (int, float)) else [int(h) for h in heads]
    if len(heads) != n_levels:
        raise BadInput(f"unet.num_heads lists {len(heads)} values but the UNet has {n_levels} levels")
    adm = g.shape("label_emb.0.0.weight")[1] if g.has("label_emb.0.0.weight") else 0
    n_ids = int(overrides.get("time_ids", 6 if adm else 0))
    id_dim = int(overrides.get("addition_time_embed_dim") or field(config_json, "addition_time_embed_dim", "count", 256, where))
    if adm and adm <= n_ids * id_dim:
        raise BadInput(f"{g.ckpt.path}: label_emb takes {adm} inputs, not more than {n_ids} time ids x {id_dim}; "
                       "set unet.time_ids / unet.addition_time_embed_dim")
    return dict(in_channels=in_ch, model_channels=mc,
                context_dim=ctx[0] if ctx else 0, channels=channels, levels=levels, num_heads=heads,
                groups=int(overrides.get("groups") or field(config_json, "norm_num_groups", "count", 32, where)),
                use_linear_projection=bool(proj) and len(proj[0]) == 2,
                adm_in_channels=adm, time_ids=n_ids,
                time_id_dim=id_dim, flip_sin_to_cos=field(config_json, "flip_sin_to_cos", "bool", True, where),
                freq_shift=float(field(config_json, "freq_shift", "finite", 0, where)),
                norm_eps=float(field(config_json, "norm_eps", "positive", RES_EPS, where)),
                downsample_padding=int(field(config_json, "downsample_padding", "index", 1, where, (0, 1))),
                center_input_sample=field(config_json, "center_input_sample", "bool", False, where))


def timestep_embedding(g: Graph, t: str, dim: int, cos_first: bool = True, shift: float = 0.0) -> str:
    """Sinusoidal embedding of a 1-D tensor, computed in fp32: f_i = exp(-ln(10000) i / (half - shift)),
    [cos, sin] (LDM; diffusers' flip_sin_to_cos) or [sin, cos]; an odd `dim` ends with a zero column."""
    half = dim // 2
    exponent = -math.log(10000.0) * np.arange(half, dtype=np.float32) / np.float32(half - shift)   # fp32, as torch
    freqs = np.exp(exponent.astype(np.float64)).astype(np.float32)      # correctly rounded (numpy's fp32 exp is not)
    args = g.op("Mul", g.op("Unsqueeze", t, g.ints(1)), g.const(freqs[None, :], hint="freqs"))
    parts = (g.op("Cos", args), g.op("Sin", args))
    emb = g.op("Concat", *(parts if cos_first else parts[::-1]), axis=-1)
    if dim % 2:
        emb = g.op("Pad", emb, g.ints(0, 0, 0, 1), mode="constant")
    return g.from_fp32(emb)


def resblock(g: Graph, x: str, emb: str, p: str, cfg: UNetConfig) -> str:
    h = g.conv2d(g.silu(g.group_norm(x, f"{p}.in_layers.0", cfg.groups, cfg.norm_eps)), f"{p}.in_layers.2")
    e = g.linear(g.silu(emb), f"{p}.emb_layers.1")
    h = g.op("Add", h, g.op("Unsqueeze", e, g.ints(2, 3)))
    h = g.conv2d(g.silu(g.group_norm(h, f"{p}.out_layers.0", cfg.groups, cfg.norm_eps)), f"{p}.out_layers.3")
    skip = g.conv2d(x, f"{p}.skip_connection") if g.has(f"{p}.skip_connection.weight") else x
    return g.op("Add", skip, h)


def cross_attention(g: Graph, x: str, ctx: str, p: str, heads: int) -> str:
    dim = g.shape(f"{p}.to_q.weight")[0]
    q, k, v = (g.linear(x, f"{p}.to_q", bias=None), g.linear(ctx, f"{p}.to_k", bias=None),
               g.linear(ctx, f"{p}.to_v", bias=None))  # no bias in SD; bound if a checkpoint has one
    return g.linear(g.attention(q, k, v, heads, dim), f"{p}.to_out.0")


def geglu_ff(g: Graph, x: str, p: str) -> str:
    value, gate = g.linear_chunks(x, f"{p}.net.0.proj", 2)   # two GEMMs: no Split, Gelu fuses into one
    return g.linear(g.op("Mul", value, g.gelu(gate)), f"{p}.net.2")


def spatial_transformer(g: Graph, x: str, ctx: str, p: str, heads: int, cfg: UNetConfig) -> str:
    inner = g.shape(f"{p}.proj_in.weight")[0]
    h = g.group_norm(x, f"{p}.norm", cfg.groups, ATTN_GN_EPS)
    linear = len(g.shape(f"{p}.proj_in.weight")) == 2
    if not linear:
        h = g.conv2d(h, f"{p}.proj_in")
    h = g.op("Transpose", g.op("Reshape", h, g.ints(0, inner, -1)), perm=[0, 2, 1])  # [B, HW, C]
    if linear:
        h = g.linear(h, f"{p}.proj_in")
    j = 0
    while g.has(f"{p}.transformer_blocks.{j}.norm1.weight"):
        b = f"{p}.transformer_blocks.{j}"
        h = g.op("Add", h, cross_attention(g, n := g.layer_norm(h, f"{b}.norm1", LN_EPS), n, f"{b}.attn1", heads))
        h = g.op("Add", h, cross_attention(g, g.layer_norm(h, f"{b}.norm2", LN_EPS), ctx, f"{b}.attn2", heads))
        h = g.op("Add", h, geglu_ff(g, g.layer_norm(h, f"{b}.norm3", LN_EPS), f"{b}.ff"))
        j += 1
    if linear:
        h = g.linear(h, f"{p}.proj_out")
    shape = g.op("Shape", x)
    out_ch = g.shape(f"{p}.proj_out.weight")[0] if linear else inner
    hw = g.op("Concat", g.op("Slice", shape, g.ints(0), g.ints(1)), g.ints(out_ch),
              g.op("Slice", shape, g.ints(2), g.ints(4)), axis=0)
    h = g.op("Reshape", g.op("Transpose", h, perm=[0, 2, 1]), hw)
    if not linear:
        h = g.conv2d(h, f"{p}.proj_out")
    return g.op("Add", h, x)


def denoiser_inputs(g: Graph, cfg: UNetConfig) -> tuple[str, str, str]:
    """sample, timestep, encoder_hidden_states: the inputs a UNet and its ControlNets share."""
    sample = g.input("sample", g.dtype, ["batch", cfg.in_channels, "height", "width"])
    t = g.input("timestep", FLOAT, ["steps"])
    ctx = g.input("encoder_hidden_states", g.dtype, ["batch", "sequence", cfg.context_dim])
    return sample, t, ctx


def time_embedding(g: Graph, cfg: UNetConfig, t: str) -> str:
    """The embedding every ResBlock reads: the timestep's, plus (SDXL) the embedded pooled text and
    micro-conditioning ids, whose inputs text_embeds and time_ids are declared here."""
    t_emb = timestep_embedding(g, t, cfg.model_channels, cfg.flip_sin_to_cos, cfg.freq_shift)
    emb = g.linear(g.silu(g.linear(t_emb, "time_embed.0")), "time_embed.2")
    if cfg.adm_in_channels:  # SDXL micro-conditioning: pooled text embeds + embedded sizes/crops
        pooled = cfg.adm_in_channels - cfg.time_ids * cfg.time_id_dim
        text_embeds = g.input("text_embeds", g.dtype, ["batch", pooled])
        time_ids = g.input("time_ids", FLOAT, ["batch", cfg.time_ids])
        ids = timestep_embedding(g, g.op("Reshape", time_ids, g.ints(-1)), cfg.time_id_dim,
                                 cfg.flip_sin_to_cos, cfg.freq_shift)
        ids = g.op("Reshape", ids, g.ints(-1, cfg.time_ids * cfg.time_id_dim))
        y = g.op("Concat", text_embeds, ids, axis=1)
        emb = g.op("Add", emb, g.linear(g.silu(g.linear(y, "label_emb.0.0")), "label_emb.0.2"))
    return emb


def encoder_half(g: Graph, cfg: UNetConfig, sample: str, emb: str, ctx: str,
                 hint: str | None = None) -> tuple[str, list[str]]:
    """Input blocks and middle block: (the middle block's output, each input block's output). A
    ControlNet's embedded hint is added after the first conv (`input_blocks.0.0`)."""
    h, skips = sample, []
    if cfg.center_input_sample:
        h = g.op("Sub", g.op("Mul", h, g.const(np.array(2.0), g.dtype)), g.const(np.array(1.0), g.dtype))
    for i in range(len(cfg.channels)):
        p = f"input_blocks.{i}"
        if i == 0:
            h = g.conv2d(h, f"{p}.0")
            if hint is not None:
                h = g.op("Add", h, hint)
        elif g.has(f"{p}.0.op.weight"):
            pads = (1, 1, 1, 1) if cfg.downsample_padding else (0, 0, 1, 1)   # ONNX order: top, left, bottom, right
            h = g.conv2d(h, f"{p}.0.op", stride=2, pad=pads)
        else:
            h = resblock(g, h, emb, f"{p}.0", cfg)
            if g.has(f"{p}.1.norm.weight"):
                h = spatial_transformer(g, h, ctx, f"{p}.1", cfg.num_heads[cfg.levels[i]], cfg)
        skips.append(h)
    level = cfg.levels[-1]
    j = 0
    while g.has(f"middle_block.{j}.norm.weight") or g.has(f"middle_block.{j}.in_layers.0.weight"):
        if g.has(f"middle_block.{j}.in_layers.0.weight"):
            h = resblock(g, h, emb, f"middle_block.{j}", cfg)
        else:
            h = spatial_transformer(g, h, ctx, f"middle_block.{j}", cfg.num_heads[level], cfg)
        j += 1
    return h, skips


def residual_dims(level: int) -> list[str]:
    """Height and width names of a tensor at a resolution level (level 0: the latents' own)."""
    return ["height", "width"] if level == 0 else [f"height_div{2 ** level}", f"width_div{2 ** level}"]


def down_residual_name(i: int) -> str:
    return f"down_block_{i}_additional_residual"


MID_RESIDUAL = "mid_block_additional_residual"


def build_unet(g: Graph, cfg: UNetConfig) -> None:
    sample, t, ctx = denoiser_inputs(g, cfg)
    emb = time_embedding(g, cfg, t)
    h, skips = encoder_half(g, cfg, sample, emb, ctx)
    level = cfg.levels[-1]
    if cfg.control_residuals:   # diffusers: residuals added to the skips and to the middle block's output
        if cfg.control_residuals != len(skips):
            raise BadInput(f"{g.ckpt.path}: the ControlNets give {cfg.control_residuals} down residuals; the UNet has "
                           f"{len(skips)} input blocks")
        skips = [g.op("Add", s, g.input(down_residual_name(i), g.dtype,
                                        ["batch", cfg.channels[i], *residual_dims(cfg.levels[i])]))
                 for i, s in enumerate(skips)]
        h = g.op("Add", h, g.input(MID_RESIDUAL, g.dtype, ["batch", cfg.channels[-1], *residual_dims(level)]))
    for i in range(cfg.n_output_blocks):
        if not skips:
            raise BadInput(f"{g.ckpt.path}: more output_blocks than input_blocks (output_blocks.{i})")
        p = f"output_blocks.{i}"
        h = resblock(g, g.op("Concat", h, skips.pop(), axis=1), emb, f"{p}.0", cfg)
        slot = 1
        if g.has(f"{p}.1.norm.weight"):
            h = spatial_transformer(g, h, ctx, f"{p}.1", cfg.num_heads[level], cfg)
            slot = 2
        if g.has(f"{p}.{slot}.conv.weight"):   # x2, or to the next skip's size when a level had odd sizes
            h = g.conv2d(g.upsample2x(h, like=skips[-1] if skips else None), f"{p}.{slot}.conv")
            level -= 1
    out = g.conv2d(g.silu(g.group_norm(h, "out.0", cfg.groups, cfg.norm_eps)), "out.2")
    g.output(out, "out_sample", g.dtype, ["batch", cfg.out_channels, "height", "width"])
