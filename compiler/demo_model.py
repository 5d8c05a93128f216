"""Writes SD 1.x single-file checkpoints with seeded random weights in the real LDM key layout.

Owns: the LDM key/shape layout of an SD 1.x checkpoint for a given config (UNet, VAE, CLIP-L
text encoder), and a streaming .safetensors writer (one tensor in memory at a time). Used for
the embedded default (`precast demo-model`: tiny, a few MB, every block kind; its --family sd2,
sdxl and inpaint configs too) and by the benchmarks (full-size SD 1.5 shapes).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .sources.checkpoint import TEXT, UNET, VAE


@dataclass(frozen=True)
class SD1Config:
    """An LDM checkpoint's shape. The defaults are the tiny SD 1.x demo; SD 2.x and SDXL set
    family-specific fields (linear projections, per-level depth, OpenCLIP / two text encoders)."""
    family: str = "sd1"                             # sd1 | sd2 | sdxl | sdxl-refiner
    model_channels: int = 32
    channel_mult: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 2
    attention_levels: tuple[int, ...] = (0, 1)     # levels with a SpatialTransformer
    transformer_depth: int = 1
    context_dim: int = 64                           # = text encoder width
    vae_ch: int = 32
    vae_mult: tuple[int, ...] = (1, 1, 2, 2)        # 4 levels: 8x downsampling, as in SD
    vae_res_blocks: int = 1
    latent_channels: int = 4
    text_layers: int = 2
    text_intermediate: int = 256
    vocab: int = 49408
    max_positions: int = 77
    use_linear: bool = False                        # SD 2.x / SDXL: Linear proj_in/proj_out
    depth_per_level: tuple[int, ...] | None = None  # SDXL: transformer depth per level
    text2_width: int = 0                            # OpenCLIP encoder (SD 2.x: the only one; SDXL: bigG)
    text2_layers: int = 0
    text2_intermediate: int = 0
    text2_projection: int = 0                       # SDXL bigG text_projection width
    adm_in_channels: int = 0                        # SDXL label_emb input (pooled + 256 x time ids)
    in_channels: int = 4                            # UNet input: 4 latents, 9 for an inpainting UNet


TINY = SD1Config()
TINY_SD2 = SD1Config(family="sd2", model_channels=64, channel_mult=(1, 2, 2), attention_levels=(0, 1),
                     context_dim=64, use_linear=True, text2_width=64, text2_layers=3, text2_intermediate=128)
TINY_SDXL = SD1Config(family="sdxl", model_channels=64, channel_mult=(1, 2, 2), attention_levels=(1, 2),
                      depth_per_level=(0, 1, 2), context_dim=96, use_linear=True, text_layers=2,
                      text_intermediate=128, text2_width=64, text2_layers=3, text2_intermediate=128,
                      text2_projection=48, adm_in_channels=48 + 6 * 256)
TINY_REFINER = SD1Config(family="sdxl-refiner", model_channels=64, channel_mult=(1, 2, 2), attention_levels=(1, 2),
                         depth_per_level=(0, 1, 1), context_dim=64, use_linear=True, text2_width=64, text2_layers=2,
                         text2_intermediate=128, text2_projection=64, adm_in_channels=64 + 5 * 256)
SDXL = SD1Config(family="sdxl", model_channels=320, channel_mult=(1, 2, 4), attention_levels=(1, 2),
                 depth_per_level=(0, 2, 10), context_dim=2048, use_linear=True, vae_ch=128, vae_mult=(1, 2, 4, 4),
                 vae_res_blocks=2, text_layers=12, text_intermediate=3072, text2_width=1280, text2_layers=32,
                 text2_intermediate=5120, text2_projection=1280, adm_in_channels=2816)
SD15 = SD1Config(model_channels=320, channel_mult=(1, 2, 4, 4), num_res_blocks=2, attention_levels=(0, 1, 2),
                 context_dim=768, vae_ch=128, vae_mult=(1, 2, 4, 4), vae_res_blocks=2, text_layers=12,
                 text_intermediate=3072)
TINY_INPAINT = SD1Config(in_channels=9)   # the tiny SD 1.x demo with an inpainting UNet (latents | mask | masked image)


def _conv(d: dict, name: str, cout: int, cin: int, k: int) -> None:
    d[f"{name}.weight"] = (cout, cin, k, k)
    d[f"{name}.bias"] = (cout,)


def _lin(d: dict, name: str, cout: int, cin: int, bias: bool = True) -> None:
    d[f"{name}.weight"] = (cout, cin)
    if bias:
        d[f"{name}.bias"] = (cout,)


def _norm(d: dict, name: str, c: int) -> None:
    d[f"{name}.weight"] = (c,)
    d[f"{name}.bias"] = (c,)


def _unet_res(d, p, cin, cout, temb):
    _norm(d, f"{p}.in_layers.0", cin)
    _conv(d, f"{p}.in_layers.2", cout, cin, 3)
    _lin(d, f"{p}.emb_layers.1", cout, temb)
    _norm(d, f"{p}.out_layers.0", cout)
    _conv(d, f"{p}.out_layers.3", cout, cout, 3)
    if cin != cout:
        _conv(d, f"{p}.skip_connection", cout, cin, 1)


def _unet_attn(d, p, c, ctx, depth, linear=False):
    _norm(d, f"{p}.norm", c)
    (_lin if linear else lambda d, n, a, b: _conv(d, n, a, b, 1))(d, f"{p}.proj_in", c, c)
    for j in range(depth):
        b = f"{p}.transformer_blocks.{j}"
        for a, kv in (("attn1", c), ("attn2", ctx)):
            _lin(d, f"{b}.{a}.to_q", c, c, bias=False)
            _lin(d, f"{b}.{a}.to_k", c, kv, bias=False)
            _lin(d, f"{b}.{a}.to_v", c, kv, bias=False)
            _lin(d, f"{b}.{a}.to_out.0", c, c)
        for n in ("norm1", "norm2", "norm3"):
            _norm(d, f"{b}.{n}", c)
        _lin(d, f"{b}.ff.net.0.proj", 8 * c, c)
        _lin(d, f"{b}.ff.net.2", c, 4 * c)
    (_lin if linear else lambda d, n, a, b: _conv(d, n, a, b, 1))(d, f"{p}.proj_out", c, c)


def unet_layout(cfg: SD1Config) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {}
    mc, temb = cfg.model_channels, 4 * cfg.model_channels
    _lin(d, "time_embed.0", temb, mc)
    _lin(d, "time_embed.2", temb, temb)
    if cfg.adm_in_channels:
        _lin(d, "label_emb.0.0", temb, cfg.adm_in_channels)
        _lin(d, "label_emb.0.2", temb, temb)
    depth = cfg.depth_per_level or tuple(cfg.transformer_depth for _ in cfg.channel_mult)
    attn = lambda p, c, level: _unet_attn(d, p, c, cfg.context_dim, depth[level], cfg.use_linear)
    _conv(d, "input_blocks.0.0", mc, cfg.in_channels, 3)
    chans, ch, i = [mc], mc, 1
    for level, mult in enumerate(cfg.channel_mult):
        for _ in range(cfg.num_res_blocks):
            _unet_res(d, f"input_blocks.{i}.0", ch, mult * mc, temb)
            ch = mult * mc
            if level in cfg.attention_levels:
                attn(f"input_blocks.{i}.1", ch, level)
            chans.append(ch)
            i += 1
        if level != len(cfg.channel_mult) - 1:
            _conv(d, f"input_blocks.{i}.0.op", ch, ch, 3)
            chans.append(ch)
            i += 1
    _unet_res(d, "middle_block.0", ch, ch, temb)
    attn("middle_block.1", ch, len(cfg.channel_mult) - 1)
    _unet_res(d, "middle_block.2", ch, ch, temb)
    i = 0
    for level in reversed(range(len(cfg.channel_mult))):
        out = cfg.channel_mult[level] * mc
        for r in range(cfg.num_res_blocks + 1):
            _unet_res(d, f"output_blocks.{i}.0", ch + chans.pop(), out, temb)
            ch = out
            slot = 1
            if level in cfg.attention_levels:
                attn(f"output_blocks.{i}.1", ch, level)
                slot = 2
            if level and r == cfg.num_res_blocks:
                _conv(d, f"output_blocks.{i}.{slot}.conv", ch, ch, 3)
            i += 1
    _norm(d, "out.0", ch)
    _conv(d, "out.2", 4, ch, 3)
    return {UNET + k: v for k, v in d.items()}


def _vae_res(d, p, cin, cout):
    _norm(d, f"{p}.norm1", cin)
    _conv(d, f"{p}.conv1", cout, cin, 3)
    _norm(d, f"{p}.norm2", cout)
    _conv(d, f"{p}.conv2", cout, cout, 3)
    if cin != cout:
        _conv(d, f"{p}.nin_shortcut", cout, cin, 1)


def _vae_mid(d, p, c):
    _vae_res(d, f"{p}.mid.block_1", c, c)
    _norm(d, f"{p}.mid.attn_1.norm", c)
    for n in ("q", "k", "v", "proj_out"):
        _conv(d, f"{p}.mid.attn_1.{n}", c, c, 1)
    _vae_res(d, f"{p}.mid.block_2", c, c)


def vae_layout(cfg: SD1Config) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {}
    z, chs = cfg.latent_channels, [cfg.vae_ch * m for m in cfg.vae_mult]
    _conv(d, "encoder.conv_in", chs[0], 3, 3)
    ch = chs[0]
    for i, out in enumerate(chs):
        for j in range(cfg.vae_res_blocks):
            _vae_res(d, f"encoder.down.{i}.block.{j}", ch, out)
            ch = out
        if i != len(chs) - 1:
            _conv(d, f"encoder.down.{i}.downsample.conv", ch, ch, 3)
    _vae_mid(d, "encoder", ch)
    _norm(d, "encoder.norm_out", ch)
    _conv(d, "encoder.conv_out", 2 * z, ch, 3)
    _conv(d, "quant_conv", 2 * z, 2 * z, 1)
    _conv(d, "post_quant_conv", z, z, 1)
    ch = chs[-1]
    _conv(d, "decoder.conv_in", ch, z, 3)
    _vae_mid(d, "decoder", ch)
    for i in reversed(range(len(chs))):
        for j in range(cfg.vae_res_blocks + 1):
            _vae_res(d, f"decoder.up.{i}.block.{j}", ch, chs[i])
            ch = chs[i]
        if i:
            _conv(d, f"decoder.up.{i}.upsample.conv", ch, ch, 3)
    _norm(d, "decoder.norm_out", ch)
    _conv(d, "decoder.conv_out", 3, ch, 3)
    return {VAE + k: v for k, v in d.items()}


def clip_layout(cfg: SD1Config, prefix: str = TEXT, width: int | None = None) -> dict[str, tuple[int, ...]]:
    """CLIP-L in the HF layout."""
    d: dict[str, tuple[int, ...]] = {}
    w = width or cfg.context_dim
    d["embeddings.token_embedding.weight"] = (cfg.vocab, w)
    d["embeddings.position_embedding.weight"] = (cfg.max_positions, w)
    for i in range(cfg.text_layers):
        p = f"encoder.layers.{i}"
        _norm(d, f"{p}.layer_norm1", w)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            _lin(d, f"{p}.self_attn.{n}", w, w)
        _norm(d, f"{p}.layer_norm2", w)
        _lin(d, f"{p}.mlp.fc1", cfg.text_intermediate, w)
        _lin(d, f"{p}.mlp.fc2", w, cfg.text_intermediate)
    _norm(d, "final_layer_norm", w)
    return {prefix + k: v for k, v in d.items()}


def openclip_layout(cfg: SD1Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """An OpenCLIP text tower (SD 2.x's H, SDXL's bigG): fused in_proj, ln_final, text_projection."""
    d: dict[str, tuple[int, ...]] = {}
    w = cfg.text2_width
    d["token_embedding.weight"] = (cfg.vocab, w)
    d["positional_embedding"] = (cfg.max_positions, w)
    for i in range(cfg.text2_layers):
        p = f"transformer.resblocks.{i}"
        _norm(d, f"{p}.ln_1", w)
        d[f"{p}.attn.in_proj_weight"] = (3 * w, w)
        d[f"{p}.attn.in_proj_bias"] = (3 * w,)
        _lin(d, f"{p}.attn.out_proj", w, w)
        _norm(d, f"{p}.ln_2", w)
        _lin(d, f"{p}.mlp.c_fc", cfg.text2_intermediate, w)
        _lin(d, f"{p}.mlp.c_proj", w, cfg.text2_intermediate)
    _norm(d, "ln_final", w)
    d["text_projection"] = (w, cfg.text2_projection or w)
    return {prefix + k: v for k, v in d.items()}


SDXL_TE1 = "conditioner.embedders.0.transformer.text_model."


def sd1_layout(cfg: SD1Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a single-file checkpoint of cfg.family, by name."""
    text = {"sd1": lambda: clip_layout(cfg),
            "sd2": lambda: openclip_layout(cfg, "cond_stage_model.model."),
            "sdxl": lambda: {**clip_layout(cfg, SDXL_TE1, cfg.context_dim - cfg.text2_width),
                             **openclip_layout(cfg, "conditioner.embedders.1.model.")},
            "sdxl-refiner": lambda: openclip_layout(cfg, "conditioner.embedders.0.model.")}[cfg.family]()
    return {**unet_layout(cfg), **vae_layout(cfg), **text}


def random_tensor(rng: np.random.Generator, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """Weights scaled by fan-in so activations stay O(1) through deep stacks; norms near 1."""
    if key.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    is_norm = len(shape) == 1 and any(n in key for n in ("norm", "in_layers.0", "out_layers.0", "out.0.",
                                                         "layer_norm", "ln_"))
    if is_norm:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "embedding" in key:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


# dtype name -> safetensors dtype; numpy storage types come from `storage_type` (bf16 and fp8 through ml_dtypes)
SAFETENSORS_DTYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2"}


def storage_type(dtype: str) -> np.dtype:
    """The numpy dtype whose bytes are what a .safetensors file of this dtype name holds."""
    if dtype in ("fp32", "fp16"):
        return np.dtype(np.float32 if dtype == "fp32" else np.float16)
    return np.dtype({"bf16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
                     "fp8_e5m2": ml_dtypes.float8_e5m2}[dtype])


def _cast(arr: np.ndarray, kind: np.dtype, dtype: str) -> np.ndarray:
    if dtype.startswith("fp8") and arr.dtype != kind:   # fp8 casts overflow to NaN: saturate at the format's max
        top = float(ml_dtypes.finfo(kind).max)
        arr = np.clip(np.asarray(arr, dtype=np.float32), -top, top)
    return np.ascontiguousarray(arr, dtype=kind)


def write_safetensors(path: str, shapes: dict[str, tuple[int, ...]], dtype, make, metadata: dict | None = None) -> None:
    """Stream tensors into a .safetensors file (temp file + rename).

    `dtype`: one name of SAFETENSORS_DTYPES for every tensor, or {key: name}. `make(key, shape)` returns
    an array (cast to the dtype; fp8 saturates) or an iterable of arrays already in the storage dtype,
    written one after another (their sizes must add up to the shape), so a tensor need never be whole
    in memory."""
    names = dtype if isinstance(dtype, dict) else dict.fromkeys(shapes, dtype)
    header, offset = {}, 0
    for key in sorted(shapes):
        n = int(np.prod(shapes[key])) * storage_type(names[key]).itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[names[key]], "shape": list(shapes[key]),
                       "data_offsets": [offset, offset + n]}
        offset += n
    extra = {k: v for k, v in EXTRA_TENSORS.items() if any(s.startswith(TEXT) for s in shapes)}
    for key, arr in extra.items():
        n = arr.nbytes
        header[key] = {"dtype": "I64", "shape": list(arr.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = metadata or {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for key in sorted(shapes):
                kind, want = storage_type(names[key]), header[key]["data_offsets"]
                got = make(key, shapes[key])
                if isinstance(got, np.ndarray) or np.isscalar(got):
                    got = (_cast(np.asarray(got), kind, names[key]).reshape(shapes[key]),)
                written = 0
                for chunk in got:
                    if chunk.dtype != kind:
                        raise ValueError(f"{key}: a streamed chunk is {chunk.dtype}, the file stores {kind}")
                    f.write(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
                    written += chunk.nbytes
                if written != want[1] - want[0]:
                    raise ValueError(f"{key}: {written} bytes made for a {shapes[key]} {names[key]} tensor")
            for arr in extra.values():
                f.write(arr.tobytes())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# Buffers that real SD 1.x files carry beside the weights (not weights; exporters must skip them).
EXTRA_TENSORS = {TEXT + "embeddings.position_ids": np.arange(77, dtype=np.int64)[None, :]}
LAYOUT_OF = sd1_layout  # a clearer name for callers outside SD 1.x


def write_demo_model(path: str, cfg: SD1Config = TINY, seed: int = 0, dtype: str = "fp16") -> dict:
    """Write a deterministic SD 1.x checkpoint; returns {key: shape}."""
    shapes = sd1_layout(cfg)
    rng = np.random.default_rng(seed)
    write_safetensors(str(path), shapes, dtype, lambda key, shape: random_tensor(rng, key, shape))
    return shapes
