"""Writes SD3 / SD3.5 checkpoints (MMDiT, MMDiT-X) with seeded random weights in the real key layouts.

Owns: the key/shape layouts of a Stability (SAI / ComfyUI) SD3 transformer for a given config
(FAMILIES_DIT.md §3.1: qkv with biases, `ln_q`/`ln_k` weights only, the last context block pre-only,
MMDiT-X's `x_block.attn2.*` and 9-chunk x adaLN), of CLIP-L / CLIP-G as HF `CLIPTextModelWithProjection`
(`text_model.*` plus `text_projection.weight` [projection, width], no bias), and the file layouts
they ship in: SAI's / ComfyUI's all-in-one single files (`model.diffusion_model.`,
`text_encoders.{clip_l,clip_g,t5xxl}.transformer.`, `first_stage_model.` for the 16-channel VAE without
quant convs), a bare transformer file, and comfyanonymous' bare `clip_g.safetensors`. The random
weights, the storage dtypes and the writing are compiler/demo_dit.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .demo_dit import TINY_VAE16, T5Config, Vae16Config, t5_layout, vae16_layout
from .demo_weights import Component, write_components
from .demo_model import SD1Config, _lin, clip_layout

# SAI / ComfyUI all-in-one prefixes (comfy/supported_models.py SD3: unet, text encoder and vae prefixes)
SD3_PREFIX = "model.diffusion_model."
CLIP_L_PREFIX = "text_encoders.clip_l.transformer."     # + text_model.* and text_projection.weight
CLIP_G_PREFIX = "text_encoders.clip_g.transformer."
T5_PREFIX = "text_encoders.t5xxl.transformer."
VAE_PREFIX = "first_stage_model."


@dataclass(frozen=True, kw_only=True)
class SD3Config:
    """An SD3 MMDiT's shape (SAI `mmditx.py MMDiTX`): depth joint blocks of width hidden."""
    hidden: int
    heads: int
    depth: int
    patch: int = 2
    in_channels: int = 16
    out_channels: int = 16
    pos_embed_max: int                     # pos_embed holds pos_embed_max^2 positions
    context_dim: int = 4096                # T5 width (CLIP-L | CLIP-G zero-padded to it)
    pooled_dim: int = 2048                 # CLIP-L | CLIP-G projections
    qk_norm: bool = False                  # SD3.5: RMS ln_q / ln_k per head
    dual_attention_layers: tuple[int, ...] = ()    # SD3.5-medium (MMDiT-X): blocks with x_block.attn2
    mlp_ratio: int = 4

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"SD3Config: {self.heads} heads do not divide hidden {self.hidden}")
        if any(not 0 <= i < self.depth for i in self.dual_attention_layers):
            raise ValueError(f"SD3Config: dual attention layers {self.dual_attention_layers} "
                             f"outside 0..{self.depth - 1}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        return self.hidden * self.mlp_ratio

    @property
    def family(self) -> str:
        if self.dual_attention_layers:
            return "sd3.5-medium"
        return "sd3.5-large" if self.qk_norm else "sd3-medium"


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    """A CLIP text encoder with its projection (HF CLIPTextModelWithProjection)."""
    width: int
    layers: int
    intermediate: int
    projection: int
    vocab: int = 49408
    positions: int = 77


SD3_MEDIUM = SD3Config(hidden=1536, heads=24, depth=24, pos_embed_max=192)
SD35_LARGE = SD3Config(hidden=2432, heads=38, depth=38, pos_embed_max=192, qk_norm=True)
SD35_MEDIUM = SD3Config(hidden=1536, heads=24, depth=24, pos_embed_max=384, qk_norm=True,
                        dual_attention_layers=tuple(range(13)))
CLIP_L = ClipConfig(width=768, layers=12, intermediate=3072, projection=768)
CLIP_G = ClipConfig(width=1280, layers=32, intermediate=5120, projection=1280)
T5_XXL = T5Config(d_model=4096, d_ff=10240, heads=64, d_kv=64, layers=24)

# Tiny: CLIP-L 32 + CLIP-G 64 wide (96 <= the 128-wide T5 / context), pooled = 32 + 32 projections.
# TINY_SD3 has no QK norm, so its heads follow SAI's 64-wide rule (128 = 2 x 64); the SD3.5 ones read
# their 32-wide heads from ln_q.
TINY_SD3_CLIP_L = ClipConfig(width=32, layers=2, intermediate=64, projection=32)
TINY_CLIP_G = ClipConfig(width=64, layers=2, intermediate=128, projection=32)
TINY_SD3_T5 = T5Config(d_model=128, d_ff=256, heads=2, d_kv=64, layers=2)
TINY_SD3 = SD3Config(hidden=128, heads=2, depth=3, pos_embed_max=16, context_dim=128, pooled_dim=64)
TINY_SD35_LARGE = SD3Config(hidden=64, heads=2, depth=3, pos_embed_max=16, context_dim=128, pooled_dim=64,
                            qk_norm=True)
TINY_SD35_MEDIUM = replace(TINY_SD35_LARGE, pos_embed_max=24, dual_attention_layers=(0, 1))
TINY_VAE = TINY_VAE16


def sd3_layout(cfg: SD3Config) -> dict[str, tuple[int, ...]]:
    """The transformer in SAI names, no prefix."""
    d: dict[str, tuple[int, ...]] = {}
    h, hd, p = cfg.hidden, cfg.head_dim, cfg.patch
    d["x_embedder.proj.weight"] = (h, cfg.in_channels, p, p)
    d["x_embedder.proj.bias"] = (h,)
    d["pos_embed"] = (1, cfg.pos_embed_max ** 2, h)
    _lin(d, "t_embedder.mlp.0", h, 256)
    _lin(d, "t_embedder.mlp.2", h, h)
    _lin(d, "y_embedder.mlp.0", h, cfg.pooled_dim)
    _lin(d, "y_embedder.mlp.2", h, h)
    _lin(d, "context_embedder", h, cfg.context_dim)

    def attn(name: str) -> None:
        _lin(d, f"{name}.qkv", 3 * h, h)
        if cfg.qk_norm:
            d[f"{name}.ln_q.weight"] = (hd,)
            d[f"{name}.ln_k.weight"] = (hd,)

    for n in range(cfg.depth):
        last = n == cfg.depth - 1
        for stream in ("x_block", "context_block"):
            pre_only = last and stream == "context_block"
            b = f"joint_blocks.{n}.{stream}"
            chunks = 2 if pre_only else (9 if stream == "x_block" and n in cfg.dual_attention_layers else 6)
            _lin(d, f"{b}.adaLN_modulation.1", chunks * h, h)
            attn(f"{b}.attn")
            if pre_only:
                continue
            _lin(d, f"{b}.attn.proj", h, h)
            _lin(d, f"{b}.mlp.fc1", cfg.mlp_hidden, h)
            _lin(d, f"{b}.mlp.fc2", h, cfg.mlp_hidden)
            if stream == "x_block" and n in cfg.dual_attention_layers:
                attn(f"{b}.attn2")
                _lin(d, f"{b}.attn2.proj", h, h)
    _lin(d, "final_layer.adaLN_modulation.1", 2 * h, h)        # chunks: shift, scale
    _lin(d, "final_layer.linear", p * p * cfg.out_channels, h)
    return d


def clip_projection_layout(cfg: ClipConfig) -> dict[str, tuple[int, ...]]:
    """CLIP-L or CLIP-G in HF CLIPTextModelWithProjection names: text_model.* + text_projection.weight."""
    shape = SD1Config(context_dim=cfg.width, text_layers=cfg.layers, text_intermediate=cfg.intermediate,
                      vocab=cfg.vocab, max_positions=cfg.positions)
    d = clip_layout(shape, prefix="text_model.")
    d["text_projection.weight"] = (cfg.projection, cfg.width)
    return d


clip_g_layout = clip_projection_layout


def sd3_components(cfg: SD3Config, clip_l: ClipConfig | None = None, clip_g: ClipConfig | None = None,
                   t5: T5Config | None = None, vae: Vae16Config | None = None,
                   layout: str = "all-in-one") -> list[Component]:
    if layout == "bare":
        if clip_l or clip_g or t5 or vae:
            raise ValueError("a bare transformer file holds the transformer only; write the others on their own")
        return [Component("transformer", "", sd3_layout(cfg), True)]
    if layout != "all-in-one":
        raise ValueError(f"layout must be 'all-in-one' or 'bare', not {layout!r}")
    comps = [Component("transformer", SD3_PREFIX, sd3_layout(cfg), True)]
    if clip_l:
        comps.append(Component("clip_l", CLIP_L_PREFIX, clip_projection_layout(clip_l), False))
    if clip_g:
        comps.append(Component("clip_g", CLIP_G_PREFIX, clip_projection_layout(clip_g), False))
    if t5:
        comps.append(Component("t5", T5_PREFIX, t5_layout(t5), True))
    if vae:
        comps.append(Component("vae", VAE_PREFIX, vae16_layout(vae), False))
    return comps


def write_sd3_checkpoint(path, cfg: SD3Config, clip_l: ClipConfig | None = None, clip_g: ClipConfig | None = None,
                         t5: T5Config | None = None, vae: Vae16Config | None = None, seed: int = 0,
                         dtype: str = "fp16", layout: str = "all-in-one",
                         **options) -> dict[str, tuple[tuple[int, ...], str]]:
    """An SD3 checkpoint: "all-in-one" (SAI / ComfyUI prefixes; the transformer plus whichever of
    clip_l / clip_g / t5 / vae are given) or "bare" (the transformer alone, SAI names, no prefix).
    `options`: rest_dtype, scale_input, fp8_bias (demo_dit.plan_tensors). Returns {key: (shape, dtype)}."""
    return write_components(path, sd3_components(cfg, clip_l, clip_g, t5, vae, layout), seed, dtype, **options)


def write_clip_file(path, cfg: ClipConfig, tag: str, seed: int = 0, dtype: str = "fp16"):
    """A CLIP with projection alone (text_model.* + text_projection.weight), as comfyanonymous ships SD3's."""
    return write_components(path, [Component(tag, "", clip_projection_layout(cfg), False)], seed, dtype)


def write_clip_g_file(path, cfg: ClipConfig = TINY_CLIP_G, seed: int = 0, dtype: str = "fp16"):
    """comfyanonymous' `clip_g.safetensors`: text_model.* + text_projection.weight, no prefix."""
    return write_clip_file(path, cfg, "clip_g", seed, dtype)


# The embedded tiny SD3 demos (`demo:<name>` recipe sources): transformer + CLIP-L + CLIP-G + T5 + VAE in
# one SAI / ComfyUI all-in-one file, fp16 as SAI ships them. Their heads need no override (TINY_SD3's are
# 64 wide, SAI's rule; the SD3.5 ones are read from ln_q).
DEMOS = {"tiny-sd3": TINY_SD3, "tiny-sd35-large": TINY_SD35_LARGE, "tiny-sd35-medium": TINY_SD35_MEDIUM}


def write_demo_sd3(path, name: str, seed: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    return write_sd3_checkpoint(path, DEMOS[name], clip_l=TINY_SD3_CLIP_L, clip_g=TINY_CLIP_G, t5=TINY_SD3_T5,
                                vae=TINY_VAE, seed=seed, dtype="fp16")
