"""Flux.1 transformer (dev, schnell) and Chroma: one trunk, two conditioning heads. BFL names.

Owns: the transformer graph and its config from shapes (FAMILIES_DIT.md §1-2). The block tree
mirrors Black Forest Labs' checkpoint (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`,
...), so weights bind by name; diffusers folders are renamed to it at the source.
  trunk:  img_in(hidden_states), txt_in(encoder_hidden_states); double blocks (per-stream
          modulation, qkv, QK RMS norm, joint attention over [txt, img] with RoPE, proj, GELU-tanh
          MLP); single blocks over [txt, img] (linear1 -> qkv | mlp, linear2 over attn | mlp);
          the txt part dropped; final modulated LayerNorm + linear.
  Flux:   vec = time_in(emb(1000 t)) [+ guidance_in(emb(1000 g))] + vector_in(pooled); every
          modulation is Linear(SiLU(vec)) chunked (shift, scale, gate).
  Chroma: no time/vector/guidance MLPs and no modulation Linears: the distilled-guidance
          approximator maps [emb(1000 t) | emb(0) | emb(1000 i)] for i < rows to every block's
          modulation rows (singles, then double img, double txt, final); real text masking.
What the weights cannot say: the RoPE axes split of the head width (`axes_dims_rope`, BFL
(16, 56, 56) for 128-wide heads) and theta (10000) -- from a diffusers config.json or --set.
IO (the names BFL's ONNX, TensorRT's demo, optimum, Olive and OpenVINO GenAI use):
  hidden_states [B, image_tokens, C] (packed 2x2 latents), encoder_hidden_states [B, T, ctx],
  pooled_projections [B, 768] (Flux), timestep [B] float32 (sigma in [0, 1]; x1000 inside),
  img_ids [image_tokens, 3] / txt_ids [T, 3] float32, guidance [B] float32 (dev: the raw scale),
  attention_mask [B, T] int32 (Chroma; 1 = attend) -> out_hidden_states [B, image_tokens, C_out].
Precision: norms, RoPE, scores and softmax in fp32; fp16 exports clip each block's output to
fp16's range (as diffusers does), so an overflow cannot turn into inf/NaN.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from onnx import helper

from ..errors import BadInput
from ..sources.config_fields import field
from .ldm_unet import timestep_embedding
from .onnx_graph import FLOAT, FLOAT16, INT32, Graph

EPS = 1e-6
BFL_AXES = {128: (16, 56, 56)}           # head width -> BFL's RoPE axes split
APPROX = "distilled_guidance_layer"


@dataclass(frozen=True)
class FluxConfig:
    hidden: int
    heads: int
    head_dim: int
    depth: int                      # double-stream blocks
    depth_single: int
    mlp_hidden: int
    in_channels: int
    out_channels: int
    context_dim: int
    vec_dim: int                    # pooled text width (0: Chroma)
    time_dim: int                   # sinusoidal embedding width of time_in / guidance_in
    axes_dim: tuple[int, ...]
    theta: float = 10000.0
    guidance: bool = False          # dev: guidance_in
    chroma: bool = False
    approximator_in: int = 0        # Chroma: in_proj input width (t | guidance | index embeddings)
    approximator_layers: int = 0

    @property
    def mod_rows(self) -> int:
        """Chroma's approximator output rows: 3 per single block, 6 + 6 per double block, 2 final."""
        return 3 * self.depth_single + 12 * self.depth + 2

    def describe(self) -> dict:
        return asdict(self)


def _axes(g: Graph, config_json: dict, overrides: dict, head_dim: int, where: str) -> tuple[int, ...]:
    axes = overrides.get("axes_dims_rope") or config_json.get("axes_dims_rope") or BFL_AXES.get(head_dim)
    if axes is None:
        raise BadInput(f"{g.ckpt.path}: the transformer's heads are {head_dim} wide; how RoPE splits them over the "
                       f"(t, h, w) axes is not in the weights: pass --set transformer.axes_dims_rope=[a,b,c] "
                       f"(even numbers summing to {head_dim}; Flux uses [16,56,56] for 128)")
    ok = isinstance(axes, (list, tuple)) and axes and all(isinstance(a, int) and not isinstance(a, bool)
                                                          and a > 0 and a % 2 == 0 for a in axes)
    if not ok or sum(axes) != head_dim:
        raise BadInput(f"{where}: axes_dims_rope {axes!r} must be even numbers summing to the head width {head_dim}")
    return tuple(int(a) for a in axes)


def flux_config(g: Graph, config_json: dict, overrides: dict) -> FluxConfig:
    if not g.has("img_in.weight") or not g.has("double_blocks.0.img_attn.norm.key_norm.scale"):
        raise BadInput(f"{g.ckpt.path}: no Flux transformer under {g.prefix or '(no prefix)'} (looked for img_in.weight "
                       "and double_blocks.0.img_attn.norm.key_norm.scale)")
    where = f"{g.ckpt.path} transformer/config.json"
    if field(config_json, "patch_size", "count", 1, where) != 1:
        raise BadInput(f"{where}: patch_size {config_json['patch_size']} is not supported (Flux uses 1)")
    hidden, in_ch = g.shape("img_in.weight")
    head_dim = g.shape("double_blocks.0.img_attn.norm.key_norm.scale")[0]
    if head_dim < 2 or hidden % head_dim:
        raise BadInput(f"{g.ckpt.path}: QK-norm width {head_dim} does not divide the transformer width {hidden}; "
                       "the checkpoint is damaged")
    chroma = g.has(f"{APPROX}.in_proj.weight")
    depth = g.count("double_blocks.{}")
    mlp = g.shape("double_blocks.0.img_mlp.0.weight")[0]
    return FluxConfig(
        hidden=hidden, heads=hidden // head_dim, head_dim=head_dim, depth=depth,
        depth_single=g.count("single_blocks.{}"), mlp_hidden=mlp, in_channels=in_ch,
        out_channels=g.shape("final_layer.linear.weight")[0], context_dim=g.shape("txt_in.weight")[1],
        vec_dim=0 if chroma else g.shape("vector_in.in_layer.weight")[1],
        time_dim=0 if chroma else g.shape("time_in.in_layer.weight")[1],
        axes_dim=_axes(g, config_json, overrides, head_dim, where),
        theta=float(overrides.get("theta") or field(config_json, "theta", "positive", 10000.0, where)),
        guidance=g.has("guidance_in.in_layer.weight"), chroma=chroma,
        approximator_in=g.shape(f"{APPROX}.in_proj.weight")[1] if chroma else 0,
        approximator_layers=g.count(f"{APPROX}.layers.{{}}") if chroma else 0)


# ---- RoPE ------------------------------------------------------------------------------------

def rope_tables(g: Graph, ids: str, cfg: FluxConfig) -> tuple[str, str]:
    """cos and sin [L, head_dim / 2, 1] fp32 for position ids [L, axes]: pair j of axis i turns by
    id_i * theta^(-2j / d_i). One MatMul against a [axes, head_dim / 2] table that holds each
    pair's frequency in its axis' row and zeros elsewhere (the zero terms add exactly nothing)."""
    table = np.zeros((len(cfg.axes_dim), cfg.head_dim // 2), np.float64)
    col = 0
    for i, d in enumerate(cfg.axes_dim):
        table[i, col:col + d // 2] = 1.0 / cfg.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        col += d // 2
    angles = g.op("MatMul", ids, g.const(table.astype(np.float32), hint="rope_freqs"))
    angles = g.op("Unsqueeze", angles, g.ints(-1))
    return g.op("Cos", angles), g.op("Sin", angles)


def apply_rope(g: Graph, x: str, cos: str, sin: str, d: int) -> str:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of fp32 x [B, heads, L, d] (BFL `apply_rope`)."""
    pairs = g.op("Reshape", x, g.ints(0, 0, 0, d // 2, 2))
    x0, x1 = g.op("Split", pairs, axis=-1, num_outputs=2, outputs=2)
    y0 = g.op("Sub", g.op("Mul", x0, cos), g.op("Mul", x1, sin))
    y1 = g.op("Add", g.op("Mul", x1, cos), g.op("Mul", x0, sin))
    return g.op("Reshape", g.op("Concat", y0, y1, axis=-1), g.ints(0, 0, 0, d))


# ---- building blocks ---------------------------------------------------------------------------

def mlp_embedder(g: Graph, x: str, p: str) -> str:
    """BFL MLPEmbedder: in_layer -> SiLU -> out_layer."""
    return g.linear(g.silu(g.linear(x, f"{p}.in_layer")), f"{p}.out_layer")


def modulate(g: Graph, x: str, shift: str, scale: str, cfg: FluxConfig) -> str:
    """(1 + scale) * LayerNorm(x) + shift, LayerNorm without affine (eps 1e-6)."""
    one = g.scalar(1.0)
    return g.op("Add", g.op("Mul", g.plain_layer_norm(x, cfg.hidden, EPS), g.op("Add", one, scale)), shift)


def qkv_heads(g: Graph, q: str, k: str, v: str, norm: str, cfg: FluxConfig) -> tuple[str, str, str]:
    """[B, L, hidden] x3 -> [B, heads, L, d]: q and k RMS-normed per head (fp32), v as is."""
    q, k, v = (g.split_heads(t, cfg.heads, cfg.head_dim) for t in (q, k, v))
    for n in ("query_norm", "key_norm"):
        g.expect(f"{norm}.{n}.scale", (cfg.head_dim,), "one scale per head channel")
    q = g.rms_norm(q, f"{norm}.query_norm", EPS, "scale", fp32_out=True)
    k = g.rms_norm(k, f"{norm}.key_norm", EPS, "scale", fp32_out=True)
    return q, k, v


def attend(g: Graph, q: str, k: str, v: str, rope: tuple[str, str], mask: str | None, cfg: FluxConfig) -> str:
    """RoPE on fp32 q, k; attention; heads merged: [B, L, hidden]."""
    q = g.from_fp32(apply_rope(g, q, *rope, cfg.head_dim))
    k = g.from_fp32(apply_rope(g, k, *rope, cfg.head_dim))
    return g.merge_heads(g.sdpa(q, k, v, cfg.head_dim ** -0.5, mask), cfg.hidden)


def gated(g: Graph, x: str, gate: str, y: str) -> str:
    return g.op("Add", x, g.op("Mul", gate, y))


def clip_fp16(g: Graph, x: str) -> str:
    if g.dtype != FLOAT16:
        return x
    limit = float(np.finfo(np.float16).max)
    return g.op("Clip", x, g.scalar(-limit), g.scalar(limit))


def seq_slice(g: Graph, x: str, start: str, end: str) -> str:
    return g.op("Slice", x, start, end, g.ints(1))


class Modulations:
    """Every block's (shift, scale, gate) vectors, [B, 1, hidden] each: Linear(SiLU(vec)) chunks
    (Flux) or rows of the approximator's output (Chroma)."""

    def __init__(self, g: Graph, cfg: FluxConfig, vec: str | None = None, rows: str | None = None):
        self.g, self.cfg, self.rows = g, cfg, rows
        self.act = g.silu(vec) if vec is not None else None

    def _row(self, i: int) -> str:
        return self.g.op("Slice", self.rows, self.g.ints(i), self.g.ints(i + 1), self.g.ints(1))

    def _lin(self, module: str, n: int) -> list[str]:
        g = self.g
        g.expect(f"{module}.weight", (n * self.cfg.hidden, self.cfg.hidden), f"{n} modulation vectors")
        return [g.op("Unsqueeze", c, g.ints(1)) for c in g.linear_chunks(self.act, module, n)]

    def double(self, i: int, stream: str) -> list[str]:
        if self.rows is None:
            return self._lin(f"double_blocks.{i}.{stream}_mod.lin", 6)
        cfg = self.cfg
        start = 3 * cfg.depth_single + 6 * i + (6 * cfg.depth if stream == "txt" else 0)
        return [self._row(start + j) for j in range(6)]

    def single(self, i: int) -> list[str]:
        if self.rows is None:
            return self._lin(f"single_blocks.{i}.modulation.lin", 3)
        return [self._row(3 * i + j) for j in range(3)]

    def final(self) -> list[str]:
        if self.rows is None:
            return self._lin("final_layer.adaLN_modulation.1", 2)
        n = self.cfg.mod_rows
        return [self._row(n - 2), self._row(n - 1)]


def double_block(g: Graph, img: str, txt: str, i: int, mods: Modulations, rope, mask, txt_len: str,
                 cfg: FluxConfig) -> tuple[str, str]:
    p = f"double_blocks.{i}"
    streams = {"img": img, "txt": txt}
    m = {s: mods.double(i, s) for s in streams}
    heads = {}
    for s, x in streams.items():
        g.expect(f"{p}.{s}_attn.qkv.weight", (3 * cfg.hidden, cfg.hidden), "q | k | v")
        q, k, v = g.linear_chunks(modulate(g, x, m[s][0], m[s][1], cfg), f"{p}.{s}_attn.qkv", 3)
        heads[s] = qkv_heads(g, q, k, v, f"{p}.{s}_attn.norm", cfg)
    q, k, v = (g.op("Concat", heads["txt"][j], heads["img"][j], axis=2) for j in range(3))
    att = attend(g, q, k, v, rope, mask, cfg)
    end = g.ints(np.iinfo(np.int64).max)
    parts = {"txt": seq_slice(g, att, g.ints(0), txt_len), "img": seq_slice(g, att, txt_len, end)}
    out = {}
    for s, x in streams.items():
        shift1, scale1, gate1, shift2, scale2, gate2 = m[s]
        g.expect(f"{p}.{s}_attn.proj.weight", (cfg.hidden, cfg.hidden))
        g.expect(f"{p}.{s}_mlp.0.weight", (cfg.mlp_hidden, cfg.hidden), "MLP in [mlp, hidden]")
        g.expect(f"{p}.{s}_mlp.2.weight", (cfg.hidden, cfg.mlp_hidden), "MLP out [hidden, mlp]")
        g.widths[parts[s]] = cfg.hidden
        x = gated(g, x, gate1, g.linear(parts[s], f"{p}.{s}_attn.proj"))
        h = g.gelu_tanh(g.linear(modulate(g, x, shift2, scale2, cfg), f"{p}.{s}_mlp.0"))
        out[s] = clip_fp16(g, gated(g, x, gate2, g.linear(h, f"{p}.{s}_mlp.2")))
    return out["img"], out["txt"]


def single_block(g: Graph, x: str, i: int, mods: Modulations, rope, mask, cfg: FluxConfig) -> str:
    p = f"single_blocks.{i}"
    shift, scale, gate = mods.single(i)
    g.expect(f"{p}.linear2.weight", (cfg.hidden, cfg.hidden + cfg.mlp_hidden), "attn | mlp -> hidden")
    q, k, v, mlp = g.linear_rows(modulate(g, x, shift, scale, cfg), f"{p}.linear1", [cfg.hidden] * 3 + [cfg.mlp_hidden])
    att = attend(g, *qkv_heads(g, q, k, v, f"{p}.norm", cfg), rope, mask, cfg)
    h = cfg.hidden
    y = g.op("Add", g.op("Add", g.matmul_cols(att, f"{p}.linear2", 0, h),
                         g.matmul_cols(g.gelu_tanh(mlp), f"{p}.linear2", h, h + cfg.mlp_hidden)),
             g.param(f"{p}.linear2.bias"))
    g.expect(f"{p}.linear2.bias", (cfg.hidden,))
    return clip_fp16(g, gated(g, x, gate, y))


# ---- conditioning heads ------------------------------------------------------------------------

def flux_vector(g: Graph, t: str, cfg: FluxConfig) -> str:
    """vec = time_in(emb(1000 t)) [+ guidance_in(emb(1000 g))] + vector_in(pooled)."""
    thousand = g.const(np.array(1000.0, np.float32))
    emb = lambda x: timestep_embedding(g, g.op("Mul", x, thousand), cfg.time_dim)  # noqa: E731
    vec = mlp_embedder(g, emb(t), "time_in")
    if cfg.guidance:
        guidance = g.input("guidance", FLOAT, ["batch"])
        vec = g.op("Add", vec, mlp_embedder(g, emb(guidance), "guidance_in"))
    pooled = g.input("pooled_projections", g.dtype, ["batch", cfg.vec_dim])
    return g.op("Add", vec, mlp_embedder(g, pooled, "vector_in"))


def sinusoid(values: np.ndarray, dim: int) -> np.ndarray:
    """[cos | sin] embedding of `values` as diffusers' get_timestep_embedding computes it (fp32)."""
    half = dim // 2
    exponent = -math.log(10000.0) * np.arange(half, dtype=np.float32) / np.float32(half)
    freqs = np.exp(exponent.astype(np.float64)).astype(np.float32)
    args = (values.astype(np.float32)[:, None] * freqs[None, :]).astype(np.float64)   # fp32 products, as torch
    return np.concatenate([np.cos(args), np.sin(args)], axis=-1).astype(np.float32)


def chroma_rows(g: Graph, t: str, cfg: FluxConfig) -> str:
    """The approximator's [B, mod_rows, hidden] modulation rows for timestep t."""
    if cfg.approximator_in % 4:
        raise BadInput(f"{g.ckpt.path}: {g.prefix}{APPROX}.in_proj.weight reads {cfg.approximator_in} values; Chroma's "
                       "approximator reads a multiple of 4 (timestep | guidance | 2 x index embeddings, 64 released)")
    quarter = cfg.approximator_in // 4
    n = cfg.mod_rows
    t_emb = timestep_embedding(g, g.op("Mul", t, g.const(np.array(1000.0, np.float32))), quarter)   # [B, q]
    guidance = sinusoid(np.zeros(1), quarter)                                                      # emb(0)
    index = sinusoid(np.arange(n) * 1000.0, 2 * quarter)                                           # [n, 2q]
    batch = g.op("Shape", t)
    t_rows = g.op("Expand", g.op("Unsqueeze", g.to_fp32(t_emb), g.ints(1)),
                  g.op("Concat", batch, g.ints(n, quarter), axis=0))
    const = np.concatenate([np.repeat(guidance, n, axis=0), index], axis=-1)[None]                 # [1, n, 3q]
    const_rows = g.op("Expand", g.const(const, hint="chroma_rows"), g.op("Concat", batch, g.ints(n, 3 * quarter), axis=0))
    x = g.from_fp32(g.op("Concat", t_rows, const_rows, axis=-1))
    g.widths[x] = cfg.approximator_in
    x = g.linear(x, f"{APPROX}.in_proj")
    for i in range(cfg.approximator_layers):
        h = g.rms_norm(x, f"{APPROX}.norms.{i}", EPS, "scale")
        x = g.op("Add", x, mlp_embedder(g, h, f"{APPROX}.layers.{i}"))
    rows = g.linear(x, f"{APPROX}.out_proj")
    g.expect(f"{APPROX}.out_proj.weight", (cfg.hidden, g.shape(f"{APPROX}.in_proj.weight")[0]))
    return rows


def chroma_mask(g: Graph, image: str, cfg: FluxConfig) -> str:
    """Additive key mask [B, 1, 1, T + L] (fp32): text tokens with mask 0 are never attended to;
    image tokens always are. (Rows of masked text queries are computed but never read.)"""
    mask = g.input("attention_mask", INT32, ["batch", "t5_sequence"])
    text = g.op("Mul", g.op("Sub", g.const(np.array(1.0, np.float32)), g.cast(mask, FLOAT)),
                g.const(np.array(np.finfo(np.float32).min, np.float32)))
    shape = g.op("Shape", image, start=0, end=2)                                                   # [B, L]
    zeros = g.op("ConstantOfShape", shape, value=helper.make_tensor("zero", FLOAT, [1], [0.0]))
    return g.op("Unsqueeze", g.op("Concat", text, zeros, axis=1), g.ints(1, 2))


# ---- the model ---------------------------------------------------------------------------------

def build_flux(g: Graph, cfg: FluxConfig) -> None:
    if g.dtype == FLOAT16:
        g.notes.append("block outputs clipped to fp16's range (+-65504), as diffusers does")
    img = g.input("hidden_states", g.dtype, ["batch", "image_tokens", cfg.in_channels])
    txt = g.input("encoder_hidden_states", g.dtype, ["batch", "t5_sequence", cfg.context_dim])
    t = g.input("timestep", FLOAT, ["batch"])
    axes = len(cfg.axes_dim)
    img_ids = g.input("img_ids", FLOAT, ["image_tokens", axes])
    txt_ids = g.input("txt_ids", FLOAT, ["t5_sequence", axes])
    if cfg.chroma:
        mods = Modulations(g, cfg, rows=chroma_rows(g, t, cfg))
        mask = chroma_mask(g, img, cfg)
    else:
        mods = Modulations(g, cfg, vec=flux_vector(g, t, cfg))
        mask = None
    rope = rope_tables(g, g.op("Concat", txt_ids, img_ids, axis=0), cfg)
    for key, shape in (("img_in.weight", (cfg.hidden, cfg.in_channels)), ("txt_in.weight", (cfg.hidden, cfg.context_dim)),
                       ("final_layer.linear.weight", (cfg.out_channels, cfg.hidden))):
        g.expect(key, shape)
    x, c = g.linear(img, "img_in"), g.linear(txt, "txt_in")
    txt_len = g.op("Shape", txt, start=1, end=2)
    for i in range(cfg.depth):
        x, c = double_block(g, x, c, i, mods, rope, mask, txt_len, cfg)
    h = g.op("Concat", c, x, axis=1)
    g.widths[h] = cfg.hidden
    for i in range(cfg.depth_single):
        h = single_block(g, h, i, mods, rope, mask, cfg)
    x = seq_slice(g, h, txt_len, g.ints(np.iinfo(np.int64).max))
    g.widths[x] = cfg.hidden
    shift, scale = mods.final()
    out = g.linear(modulate(g, x, shift, scale, cfg), "final_layer.linear")
    g.output(out, "out_hidden_states", g.dtype, ["batch", "image_tokens", cfg.out_channels])
