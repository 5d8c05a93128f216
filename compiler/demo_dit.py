"""Writes Flux.1 (dev, schnell), Chroma, T5-XXL, CLIP-L and 16-channel VAE checkpoints with seeded
random weights in the real key layouts.

Owns: the key/shape layouts of a BFL Flux / Chroma transformer, an HF T5 encoder, an HF CLIP-L text
model and a BFL 16-channel autoencoder for a given config; the file layouts they ship in (ComfyUI
all-in-one single files with their prefixes, or bare files such as BFL's `flux1-dev.safetensors`,
`ae.safetensors` and comfyanonymous' `t5xxl_fp16.safetensors` / `clip_l.safetensors`); the storage
dtypes real files use (fp32, fp16, bf16, fp8 e4m3 / e5m2 and ComfyUI's "scaled fp8"), written through
demo_weights.py's random weight source, fast enough to write full-size files (an 11.9 B-parameter Flux
transformer) in bounded memory. Used for the embedded tiny demo recipes, tests and benchmarks. numpy +
ml_dtypes only.

ComfyUI scaled fp8 (legacy format, as ComfyUI's `model_base.state_dict_for_saving` and
`sd1_clip.SDClipModel` write it and `model_detection.model_config_from_unet` / `ops.scaled_fp8_ops`
read it): a zero-element marker tensor `<component prefix>scaled_fp8` whose dtype is the fp8 storage
type; each Linear's `.weight` stored in fp8 with a float32 scalar (shape []) `.scale_weight`, the weight
being `weight.to(float) * scale_weight`; optionally a float32 scalar `.scale_input`. Only Linear
weights are scaled; norms, embeddings and convolutions stay in the model's dtype (biases too, or
unscaled fp8 as in comfyanonymous' reference Flux export: `fp8_bias=True`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .demo_model import SD1Config, _lin, clip_layout, vae_layout
from .demo_weights import (DTYPES, SCALED_FP8_MARKER, Component, RandomWeights,  # noqa: F401 (re-exported:
                           parameter_count, write_components)                    # the demos' one import)

# ComfyUI all-in-one prefixes (comfy/supported_models.py Flux: unet, text_encoder and vae key prefixes)
FLUX_PREFIX = "model.diffusion_model."
CLIP_L_PREFIX = "text_encoders.clip_l.transformer."      # + "text_model." (HF CLIPTextModel names)
T5_PREFIX = "text_encoders.t5xxl.transformer."          # + HF T5EncoderModel names
VAE_PREFIX = "vae."                                     # + BFL autoencoder names (encoder.*, decoder.*)



@dataclass(frozen=True, kw_only=True)
class FluxConfig:
    """A BFL Flux.1 transformer's shape (`src/flux/model.py FluxParams`); `chroma` drops the modulation
    layers and the time/vector/guidance embedders and adds Chroma's distilled guidance approximator."""
    hidden: int
    heads: int
    depth: int
    depth_single: int
    mlp_ratio: float = 4.0
    in_channels: int = 64                  # 16 latent channels packed 2x2
    out_channels: int = 64
    context_in_dim: int                    # T5 width
    vec_in_dim: int                        # CLIP-L pooled width (unused by Chroma)
    axes_dim: tuple[int, ...]              # RoPE axes; sum = head_dim
    guidance_embed: bool                   # dev: True, schnell: False
    qkv_bias: bool = True
    chroma: bool = False
    approximator_in: int = 64              # 16 timestep + 16 guidance + 32 index dims
    approximator_hidden: int = 5120
    approximator_layers: int = 5

    def __post_init__(self):
        if self.hidden % self.heads or sum(self.axes_dim) != self.hidden // self.heads:
            raise ValueError(f"FluxConfig: heads {self.heads} and axes_dim {self.axes_dim} "
                             f"do not fit hidden {self.hidden}")
        if self.chroma and self.guidance_embed:
            raise ValueError("FluxConfig: Chroma has no guidance embedder")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def family(self) -> str:
        return "chroma" if self.chroma else ("flux-dev" if self.guidance_embed else "flux-schnell")


@dataclass(frozen=True)
class T5Config:
    """A T5 v1.1 encoder (gated-GELU FFN, no biases, relative position buckets in block 0)."""
    d_model: int
    d_ff: int
    heads: int
    d_kv: int
    layers: int
    vocab: int = 32128
    buckets: int = 32


@dataclass(frozen=True)
class Vae16Config:
    """The BFL autoencoder (`modules/autoencoder.py`): no quant_conv / post_quant_conv."""
    ch: int
    ch_mult: tuple[int, ...]
    res_blocks: int
    latent_channels: int = 16


TINY_FLUX_DEV = FluxConfig(hidden=32, heads=2, depth=2, depth_single=2, context_in_dim=32, vec_in_dim=32,
                           axes_dim=(4, 6, 6), guidance_embed=True)
TINY_FLUX_SCHNELL = replace(TINY_FLUX_DEV, guidance_embed=False)
TINY_CHROMA = replace(TINY_FLUX_SCHNELL, vec_in_dim=0, chroma=True, approximator_hidden=48, approximator_layers=2)
TINY_T5 = T5Config(d_model=32, d_ff=64, heads=4, d_kv=8, layers=2)
TINY_CLIP_L = SD1Config(context_dim=32, text_layers=2, text_intermediate=64)   # width 32, vocab 49408, 77 positions
TINY_VAE16 = Vae16Config(ch=32, ch_mult=(1, 2), res_blocks=1)

FLUX_DEV = FluxConfig(hidden=3072, heads=24, depth=19, depth_single=38, context_in_dim=4096, vec_in_dim=768,
                      axes_dim=(16, 56, 56), guidance_embed=True)
FLUX_SCHNELL = replace(FLUX_DEV, guidance_embed=False)
CHROMA = replace(FLUX_SCHNELL, vec_in_dim=0, chroma=True, approximator_hidden=5120, approximator_layers=5)
T5_XXL = T5Config(d_model=4096, d_ff=10240, heads=64, d_kv=64, layers=24)
CLIP_L = SD1Config(context_dim=768, text_layers=12, text_intermediate=3072)
FLUX_VAE = Vae16Config(ch=128, ch_mult=(1, 2, 4, 4), res_blocks=2)


# ------------------------------------------------------------------------------------------ layouts

def flux_layout(cfg: FluxConfig) -> dict[str, tuple[int, ...]]:
    """The BFL transformer's keys (no prefix), as in `flux1-dev.safetensors` or a Chroma file."""
    d: dict[str, tuple[int, ...]] = {}
    h, mlp, hd = cfg.hidden, cfg.mlp_hidden, cfg.head_dim
    _lin(d, "img_in", h, cfg.in_channels)
    _lin(d, "txt_in", h, cfg.context_in_dim)
    if cfg.chroma:
        a = cfg.approximator_hidden
        _lin(d, "distilled_guidance_layer.in_proj", a, cfg.approximator_in)
        for i in range(cfg.approximator_layers):
            _lin(d, f"distilled_guidance_layer.layers.{i}.in_layer", a, a)
            _lin(d, f"distilled_guidance_layer.layers.{i}.out_layer", a, a)
            d[f"distilled_guidance_layer.norms.{i}.scale"] = (a,)
        _lin(d, "distilled_guidance_layer.out_proj", h, a)
    else:
        embedders = ["time_in", "vector_in"] + (["guidance_in"] if cfg.guidance_embed else [])
        for name in embedders:                      # MLPEmbedder: Linear -> SiLU -> Linear
            _lin(d, f"{name}.in_layer", h, cfg.vec_in_dim if name == "vector_in" else 256)
            _lin(d, f"{name}.out_layer", h, h)
    for n in range(cfg.depth):
        for s in ("img", "txt"):
            p = f"double_blocks.{n}.{s}"
            if not cfg.chroma:
                _lin(d, f"{p}_mod.lin", 6 * h, h)
            _lin(d, f"{p}_attn.qkv", 3 * h, h, bias=cfg.qkv_bias)
            d[f"{p}_attn.norm.query_norm.scale"] = (hd,)
            d[f"{p}_attn.norm.key_norm.scale"] = (hd,)
            _lin(d, f"{p}_attn.proj", h, h)
            _lin(d, f"{p}_mlp.0", mlp, h)
            _lin(d, f"{p}_mlp.2", h, mlp)
    for n in range(cfg.depth_single):
        p = f"single_blocks.{n}"
        _lin(d, f"{p}.linear1", 3 * h + mlp, h)    # qkv || mlp in
        _lin(d, f"{p}.linear2", h, h + mlp)        # attn out || mlp out
        d[f"{p}.norm.query_norm.scale"] = (hd,)
        d[f"{p}.norm.key_norm.scale"] = (hd,)
        if not cfg.chroma:
            _lin(d, f"{p}.modulation.lin", 3 * h, h)
    if not cfg.chroma:
        _lin(d, "final_layer.adaLN_modulation.1", 2 * h, h)    # chunks: shift, scale
    _lin(d, "final_layer.linear", cfg.out_channels, h)
    return d


def t5_layout(cfg: T5Config) -> dict[str, tuple[int, ...]]:
    """A T5 encoder in HF `T5EncoderModel` names (relative_attention_bias in block 0 only)."""
    d: dict[str, tuple[int, ...]] = {"shared.weight": (cfg.vocab, cfg.d_model)}
    inner = cfg.heads * cfg.d_kv
    for i in range(cfg.layers):
        p = f"encoder.block.{i}.layer"
        for n in ("q", "k", "v"):
            d[f"{p}.0.SelfAttention.{n}.weight"] = (inner, cfg.d_model)
        d[f"{p}.0.SelfAttention.o.weight"] = (cfg.d_model, inner)
        if i == 0:
            d[f"{p}.0.SelfAttention.relative_attention_bias.weight"] = (cfg.buckets, cfg.heads)
        d[f"{p}.0.layer_norm.weight"] = (cfg.d_model,)
        d[f"{p}.1.DenseReluDense.wi_0.weight"] = (cfg.d_ff, cfg.d_model)
        d[f"{p}.1.DenseReluDense.wi_1.weight"] = (cfg.d_ff, cfg.d_model)
        d[f"{p}.1.DenseReluDense.wo.weight"] = (cfg.d_model, cfg.d_ff)
        d[f"{p}.1.layer_norm.weight"] = (cfg.d_model,)
    d["encoder.final_layer_norm.weight"] = (cfg.d_model,)
    return d


def clip_l_layout(cfg: SD1Config) -> dict[str, tuple[int, ...]]:
    """CLIP-L in HF `CLIPTextModel` names under `text_model.` (width = cfg.context_dim)."""
    return clip_layout(cfg, prefix="text_model.")


def vae16_layout(cfg: Vae16Config) -> dict[str, tuple[int, ...]]:
    """The BFL autoencoder (`ae.safetensors`): bare encoder.* / decoder.*, no quant convs."""
    ldm = vae_layout(SD1Config(vae_ch=cfg.ch, vae_mult=tuple(cfg.ch_mult), vae_res_blocks=cfg.res_blocks,
                               latent_channels=cfg.latent_channels))
    cut = len("first_stage_model.")
    return {k[cut:]: v for k, v in ldm.items() if k[cut:].startswith(("encoder.", "decoder."))}


def flux_components(cfg: FluxConfig, t5: T5Config | None = None, clip: SD1Config | None = None,
                    vae: Vae16Config | None = None, layout: str = "all-in-one") -> list[Component]:
    if layout == "bare":
        if t5 or clip or vae:
            raise ValueError("a bare transformer file holds the transformer only; write the others on their own")
        return [Component("transformer", "", flux_layout(cfg), True)]
    if layout != "all-in-one":
        raise ValueError(f"layout must be 'all-in-one' or 'bare', not {layout!r}")
    if clip and cfg.chroma:
        raise ValueError("Chroma has no CLIP text encoder")
    comps = [Component("transformer", FLUX_PREFIX, flux_layout(cfg), True)]
    if clip:
        comps.append(Component("clip_l", CLIP_L_PREFIX, clip_l_layout(clip), False))
    if t5:
        comps.append(Component("t5", T5_PREFIX, t5_layout(t5), True))
    if vae:
        comps.append(Component("vae", VAE_PREFIX, vae16_layout(vae), False))
    return comps


def write_flux_checkpoint(path, cfg: FluxConfig, t5: T5Config | None = None, clip: SD1Config | None = None,
                          vae: Vae16Config | None = None, seed: int = 0, dtype: str = "bf16",
                          layout: str = "all-in-one", **options) -> dict[str, tuple[tuple[int, ...], str]]:
    """A Flux / Chroma checkpoint: "all-in-one" (ComfyUI prefixes; the transformer plus whichever of
    t5 / clip / vae are given) or "bare" (the transformer alone, BFL names, no prefix). `options`:
    rest_dtype, scale_input, fp8_bias (see plan_tensors). Returns {key: (shape, dtype name)}."""
    return write_components(path, flux_components(cfg, t5, clip, vae, layout), seed, dtype, **options)


def write_t5_file(path, cfg: T5Config = TINY_T5, seed: int = 0, dtype: str = "fp16", **options):
    """A T5 encoder alone in HF names, as comfyanonymous' `t5xxl_fp16.safetensors`."""
    return write_components(path, [Component("t5", "", t5_layout(cfg), True)], seed, dtype, **options)


def write_clip_l_file(path, cfg: SD1Config = TINY_CLIP_L, seed: int = 0, dtype: str = "fp16"):
    """CLIP-L alone (`text_model.*` keys), as comfyanonymous' `clip_l.safetensors`."""
    return write_components(path, [Component("clip_l", "", clip_l_layout(cfg), False)], seed, dtype)


def write_vae16_file(path, cfg: Vae16Config = TINY_VAE16, seed: int = 0, dtype: str = "fp32"):
    """The 16-channel VAE alone (bare encoder.* / decoder.*), as BFL's `ae.safetensors`."""
    return write_components(path, [Component("vae", "", vae16_layout(cfg), False)], seed, dtype)


# The embedded tiny DiT demos (`demo:<name>` recipe sources): transformer + T5 (+ CLIP-L) + VAE in one
# ComfyUI-layout file. Their 16-wide heads need RoPE axes the weights cannot say: DEMO_AXES.
DEMOS = {"tiny-flux-dev": TINY_FLUX_DEV, "tiny-flux-schnell": TINY_FLUX_SCHNELL, "tiny-chroma": TINY_CHROMA}
DEMO_AXES = list(TINY_FLUX_DEV.axes_dim)


def write_demo_dit(path, name: str, seed: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    cfg = DEMOS[name]
    return write_flux_checkpoint(path, cfg, t5=TINY_T5, clip=None if cfg.chroma else TINY_CLIP_L, vae=TINY_VAE16,
                                 seed=seed, dtype="bf16", rest_dtype="bf16")
