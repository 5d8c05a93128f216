"""SD3 / SD3.5 MMDiT transformer (SD3-medium, SD3.5-large / turbo) and MMDiT-X (SD3.5-medium). SAI names.

Owns: the transformer graph and its config from shapes (FAMILIES_DIT.md §3). The block tree mirrors
Stability's checkpoint (`joint_blocks.N.{context_block,x_block}.attn.qkv`, `x_block.attn2.*`, ...),
relative to `model.diffusion_model.`, so weights bind by name; diffusers folders are renamed to it at
the source (sources/sd3_names.py).
  x = x_embedder.proj(latents) (conv, kernel = stride = patch: a Linear over patches), + the stored sin-cos
      pos_embed cropped to the latent's patch grid (centred: top = (max - h) // 2, left = (max - w) // 2);
  c = t_embedder(emb(timestep)) + y_embedder(pooled); ctx = context_embedder(encoder_hidden_states);
  joint blocks: each stream LayerNorm (no affine, eps 1e-6) modulated by Linear(SiLU(c)) chunks
      (shift, scale, gate for attention, then for the MLP); qkv, optional per-head RMS QK norm; one
      attention over [ctx, x]; proj and GELU-tanh MLP with gated residuals. The last context block is
      "pre-only" (shift, scale; qkv only; its output dropped). MMDiT-X blocks listed in
      `dual_attention_layers` add `attn2`, a self-attention over the same normed x with its own
      (shift, scale, gate): x_block adaLN chunks = shift, scale, gate (attn), shift, scale, gate (mlp),
      shift, scale, gate (attn2);
  final layer: modulated LayerNorm (shift, scale) + linear, unpatchified to [B, C, H, W].
What the weights cannot say: the head count without QK norm (SAI's rule is 64-wide heads; a
diffusers config.json or --set transformer.num_heads=N overrides it).
IO (optimum's / TensorRT demo's SD3.5 names): hidden_states [B, C, H, W] (latents), encoder_hidden_states
[B, 77 + T5 tokens, ctx], pooled_projections [B, pooled] in the export's dtype, timestep [B] float32 (0..1000,
diffusers' convention: sigma * 1000, embedded as is with the 256-wide [cos | sin] sinusoid)
-> out_hidden_states [B, C_out, H, W].
Precision: norms, scores and softmax in fp32; the joint blocks in `fp32_blocks` run wholly in fp32 in
fp16 / bf16 exports (weights stored fp32, activations cast up and back): SD3.5-large's block 35
overflows fp16, and TensorRT's demo runs it in fp32 too.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from ..sources.config_fields import field
from .ldm_unet import timestep_embedding
from .onnx_graph import FLOAT, Graph

EPS = 1e-6
SAI_HEAD_DIM = 64
LARGE_DEPTH, LARGE_FP32_BLOCKS = 38, (35,)     # SD3.5-large: TensorRT demo's fp32 block


@dataclass(frozen=True)
class MMDiTConfig:
    hidden: int
    heads: int
    head_dim: int
    depth: int                      # joint blocks; the last one's context stream is pre-only
    patch: int
    in_channels: int
    out_channels: int
    pos_embed_max: int              # the stored pos_embed covers a pos_embed_max^2 patch grid
    context_dim: int
    pooled_dim: int
    time_dim: int                   # sinusoidal embedding width read by t_embedder (256)
    mlp_hidden: int
    qk_norm: bool
    dual_attention_layers: tuple[int, ...] = ()
    fp32_blocks: tuple[int, ...] = ()

    def describe(self) -> dict:
        return asdict(self)


def _head_dim(g: Graph, config_json: dict, overrides: dict, hidden: int, qk_norm: bool, where: str) -> int:
    """ln_q's width where there is a QK norm; else --set num_heads, a diffusers config, or SAI's 64."""
    heads = overrides.get("num_heads")
    if heads is not None and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1 or hidden % heads):
        raise BadInput(f"--set transformer.num_heads={heads!r}: must be a whole number dividing the width {hidden}")
    cfg_heads = field(config_json, "num_attention_heads", "count", None, where)
    cfg_dim = field(config_json, "attention_head_dim", "count", None, where)
    if cfg_heads is not None and cfg_dim is not None and cfg_heads * cfg_dim != hidden:
        raise BadInput(f"{where}: num_attention_heads {cfg_heads} x attention_head_dim {cfg_dim} != the "
                       f"transformer width {hidden} (x_embedder.proj.weight)")
    if qk_norm:
        d = g.shape("joint_blocks.0.x_block.attn.ln_q.weight")[0]
        if d < 1 or hidden % d:
            raise BadInput(f"{g.ckpt.path}: {g.prefix}joint_blocks.0.x_block.attn.ln_q.weight is {d} wide, which does "
                           f"not divide the transformer width {hidden}; the checkpoint is damaged")
        if heads is not None and hidden // heads != d:
            raise BadInput(f"--set transformer.num_heads={heads}: the QK norm weights say {hidden // d} heads of {d}")
        return d
    if heads is not None:
        return hidden // heads
    if cfg_heads is not None or cfg_dim is not None:
        n = cfg_heads if cfg_heads is not None else cfg_dim
        if hidden % n:
            raise BadInput(f"{where}: {'num_attention_heads' if cfg_heads is not None else 'attention_head_dim'} "
                           f"{n} does not divide the transformer width {hidden}")
        return hidden // cfg_heads if cfg_heads is not None else cfg_dim
    if hidden % SAI_HEAD_DIM:
        raise BadInput(f"{g.ckpt.path}: the transformer is {hidden} wide, not a multiple of SAI's 64-wide heads; "
                       f"pass the head count with --set transformer.num_heads=N")
    return SAI_HEAD_DIM


def _fp32_blocks(overrides: dict, depth: int) -> tuple[int, ...]:
    given = overrides.get("fp32_blocks")
    if given is None:
        return LARGE_FP32_BLOCKS if depth == LARGE_DEPTH else ()
    ok = isinstance(given, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth
                                                  for i in given)
    if not ok:
        raise BadInput(f"--set transformer.fp32_blocks={given!r}: a list of joint block numbers 0..{depth - 1}")
    return tuple(sorted(set(given)))


def mmdit_config(g: Graph, config_json: dict, overrides: dict) -> MMDiTConfig:
    need = ("x_embedder.proj.weight", "pos_embed", "joint_blocks.0.x_block.attn.qkv.weight")
    if not all(g.has(k) for k in need):
        raise BadInput(f"{g.ckpt.path}: no SD3 transformer under {g.prefix or '(no prefix)'} (looked for "
                       f"{', '.join(need)})")
    where = f"{g.ckpt.path} transformer/config.json"
    proj = g.shape("x_embedder.proj.weight")
    if len(proj) != 4 or proj[2] != proj[3]:
        raise BadInput(f"{g.ckpt.path}: {g.prefix}x_embedder.proj.weight has shape {list(proj)}; the patch "
                       "embedder is a square-kernel Conv2d [hidden, channels, patch, patch]: the checkpoint is damaged")
    hidden, in_ch, patch = proj[0], proj[1], proj[2]
    pos = g.shape("pos_embed")
    side = math.isqrt(pos[1]) if len(pos) == 3 else 0
    if len(pos) != 3 or pos[0] != 1 or pos[2] != hidden or side * side != pos[1]:
        raise BadInput(f"{g.ckpt.path}: {g.prefix}pos_embed has shape {list(pos)}; SD3 stores [1, max^2, {hidden}] "
                       "(a square grid of positions): the checkpoint is damaged")
    for name, have in (("patch_size", patch), ("pos_embed_max_size", side)):
        given = field(config_json, name, "count", have, where)
        if given != have:
            raise BadInput(f"{where}: {name} = {given}, but the weights say {have}")
    qk_norm = g.has("joint_blocks.0.x_block.attn.ln_q.weight")
    head_dim = _head_dim(g, config_json, overrides, hidden, qk_norm, where)
    depth = g.count("joint_blocks.{}")
    out = g.shape("final_layer.linear.weight")[0]
    if out % (patch * patch):
        raise BadInput(f"{g.ckpt.path}: {g.prefix}final_layer.linear.weight has {out} rows, not patch^2 "
                       f"({patch * patch}) x channels: the checkpoint is damaged")
    return MMDiTConfig(
        hidden=hidden, heads=hidden // head_dim, head_dim=head_dim, depth=depth, patch=patch, in_channels=in_ch,
        out_channels=out // (patch * patch), pos_embed_max=side, context_dim=g.shape("context_embedder.weight")[1],
        pooled_dim=g.shape("y_embedder.mlp.0.weight")[1], time_dim=g.shape("t_embedder.mlp.0.weight")[1],
        mlp_hidden=g.shape("joint_blocks.0.x_block.mlp.fc1.weight")[0], qk_norm=qk_norm,
        dual_attention_layers=tuple(i for i in range(depth) if g.has(f"joint_blocks.{i}.x_block.attn2.qkv.weight")),
        fp32_blocks=_fp32_blocks(overrides, depth))


# ---- building blocks ---------------------------------------------------------------------------

def modulated(g: Graph, normed: str, shift: str, scale: str) -> str:
    """normed * (1 + scale) + shift (adaLN; `normed` is LayerNorm(x) without affine)."""
    return g.op("Add", g.op("Mul", normed, g.op("Add", g.scalar(1.0), scale)), shift)


def gated(g: Graph, x: str, gate: str, y: str) -> str:
    return g.op("Add", x, g.op("Mul", gate, y))


def mlp(g: Graph, x: str, p: str, cfg: MMDiTConfig) -> str:
    g.expect(f"{p}.fc1.weight", (cfg.mlp_hidden, cfg.hidden), "MLP in [mlp, hidden]")
    g.expect(f"{p}.fc2.weight", (cfg.hidden, cfg.mlp_hidden), "MLP out [hidden, mlp]")
    return g.linear(g.gelu_tanh(g.linear(x, f"{p}.fc1")), f"{p}.fc2")


def heads_of(g: Graph, x: str, p: str, cfg: MMDiTConfig) -> tuple[str, str, str]:
    """attn.qkv of x -> q, k, v [B, heads, L, d]; q and k RMS-normed per head (fp32) where ln_q exists."""
    g.expect(f"{p}.qkv.weight", (3 * cfg.hidden, cfg.hidden), "q | k | v")
    q, k, v = (g.split_heads(t, cfg.heads, cfg.head_dim) for t in g.linear_chunks(x, f"{p}.qkv", 3))
    if cfg.qk_norm:
        for n in ("ln_q", "ln_k"):
            g.expect(f"{p}.{n}.weight", (cfg.head_dim,), "one scale per head channel")
        q, k = g.rms_norm(q, f"{p}.ln_q", EPS), g.rms_norm(k, f"{p}.ln_k", EPS)
    return q, k, v


def attention(g: Graph, q: str, k: str, v: str, cfg: MMDiTConfig) -> str:
    return g.merge_heads(g.sdpa(q, k, v, cfg.head_dim ** -0.5), cfg.hidden)


class Conditioning:
    """SiLU(c) in each dtype a block computes in, and every adaLN's chunks [B, 1, hidden] from it."""

    def __init__(self, g: Graph, c: str, cfg: MMDiTConfig):
        self.g, self.cfg, self.c, self.dtype, self.act = g, cfg, c, g.dtype, {}

    def chunks(self, module: str, n: int) -> list[str]:
        g = self.g
        if g.dtype not in self.act:
            self.act[g.dtype] = g.silu(self.c if g.dtype == self.dtype else g.cast(self.c, g.dtype))
        g.expect(f"{module}.weight", (n * self.cfg.hidden, self.cfg.hidden), f"{n} modulation vectors")
        return [g.op("Unsqueeze", y, g.ints(1)) for y in g.linear_chunks(self.act[g.dtype], module, n)]


def joint_block(g: Graph, ctx: str, x: str, i: int, cond: Conditioning, cfg: MMDiTConfig) -> tuple[str | None, str]:
    """One MMDiT(-X) block: (ctx, x) -> (ctx or None after the pre-only last block, x)."""
    p = f"joint_blocks.{i}"
    last = i == cfg.depth - 1
    dual = i in cfg.dual_attention_layers
    xm = cond.chunks(f"{p}.x_block.adaLN_modulation.1", 9 if dual else 6)
    cm = cond.chunks(f"{p}.context_block.adaLN_modulation.1", 2 if last else 6)
    x_norm = g.plain_layer_norm(x, cfg.hidden, EPS)
    c_norm = g.plain_layer_norm(ctx, cfg.hidden, EPS)
    qx, kx, vx = heads_of(g, modulated(g, x_norm, xm[0], xm[1]), f"{p}.x_block.attn", cfg)
    qc, kc, vc = heads_of(g, modulated(g, c_norm, cm[0], cm[1]), f"{p}.context_block.attn", cfg)
    joint = attention(g, *(g.op("Concat", a, b, axis=2) for a, b in ((qc, qx), (kc, kx), (vc, vx))), cfg)
    split = g.op("Shape", ctx, start=1, end=2)                         # [ctx tokens | image tokens]
    x_att = g.op("Slice", joint, split, g.ints(np.iinfo(np.int64).max), g.ints(1))
    g.widths[x_att] = cfg.hidden

    g.expect(f"{p}.x_block.attn.proj.weight", (cfg.hidden, cfg.hidden))
    x_out = gated(g, x, xm[2], g.linear(x_att, f"{p}.x_block.attn.proj"))
    if dual:                                                            # MMDiT-X: attn2 over the same normed x
        q2, k2, v2 = heads_of(g, modulated(g, x_norm, xm[6], xm[7]), f"{p}.x_block.attn2", cfg)
        g.expect(f"{p}.x_block.attn2.proj.weight", (cfg.hidden, cfg.hidden))
        x_out = gated(g, x_out, xm[8], g.linear(attention(g, q2, k2, v2, cfg), f"{p}.x_block.attn2.proj"))
    h = modulated(g, g.plain_layer_norm(x_out, cfg.hidden, EPS), xm[3], xm[4])
    x_out = gated(g, x_out, xm[5], mlp(g, h, f"{p}.x_block.mlp", cfg))
    if last:
        return None, x_out

    c_att = g.op("Slice", joint, g.ints(0), split, g.ints(1))
    g.widths[c_att] = cfg.hidden
    g.expect(f"{p}.context_block.attn.proj.weight", (cfg.hidden, cfg.hidden))
    c_out = gated(g, ctx, cm[2], g.linear(c_att, f"{p}.context_block.attn.proj"))
    h = modulated(g, g.plain_layer_norm(c_out, cfg.hidden, EPS), cm[3], cm[4])
    return gated(g, c_out, cm[5], mlp(g, h, f"{p}.context_block.mlp", cfg)), x_out


def fp32_block(g: Graph, ctx: str, x: str, i: int, cond: Conditioning, cfg: MMDiTConfig) -> tuple[str | None, str]:
    """joint_block computed wholly in fp32 (weights bound fp32); inputs cast up, outputs back."""
    dtype = g.dtype
    with g.computing_in(FLOAT):
        c32, x32 = joint_block(g, g.cast(ctx, FLOAT), g.cast(x, FLOAT), i, cond, cfg)
    return (None if c32 is None else g.cast(c32, dtype)), g.cast(x32, dtype)


# ---- patches -----------------------------------------------------------------------------------

def patch_embed(g: Graph, latents: str, grid: str, cfg: MMDiTConfig) -> str:
    """x_embedder.proj (Conv2d, kernel = stride = patch) as a Linear over flattened patches (valid in
    every dtype, bf16 included) -> [B, h*w, hidden], plus the centred crop of pos_embed for the (h, w)
    grid. H and W are multiples of the patch size (the pipelines' latents always are)."""
    p, c, hidden = cfg.patch, cfg.in_channels, cfg.hidden
    g.expect("x_embedder.proj.weight", (hidden, c, p, p))
    g.expect("x_embedder.proj.bias", (hidden,))
    rows = g.op("Slice", grid, g.ints(0), g.ints(1), g.ints(0))
    y = g.op("Reshape", latents, g.op("Concat", g.ints(0, 0), rows, g.ints(p, -1, p), axis=0))   # [B, C, h, p, w, p]
    y = g.op("Reshape", g.op("Transpose", y, perm=[0, 2, 4, 1, 3, 5]), g.ints(0, -1, c * p * p))   # [B, h*w, C*p*p]
    w = g.op("Transpose", g.op("Reshape", g.param("x_embedder.proj.weight"), g.ints(hidden, c * p * p)), perm=[1, 0])
    tokens = g.op("Add", g.op("MatMul", y, w), g.param("x_embedder.proj.bias"))
    m = cfg.pos_embed_max
    table = g.op("Reshape", g.param("pos_embed"), g.ints(m, m, hidden))
    start = g.op("Div", g.op("Sub", g.ints(m, m), grid), g.ints(2, 2))                # (top, left), floored
    crop = g.op("Slice", table, start, g.op("Add", start, grid), g.ints(0, 1))
    x = g.op("Add", tokens, g.op("Reshape", crop, g.ints(1, -1, hidden)))
    g.widths[x] = hidden
    return x


def unpatchify(g: Graph, x: str, batch: str, grid: str, cfg: MMDiTConfig) -> str:
    """[B, h*w, p*p*C] -> [B, C, h*p, w*p] (row-major patches, channels last inside a patch)."""
    p, c = cfg.patch, cfg.out_channels
    y = g.op("Reshape", x, g.op("Concat", batch, grid, g.ints(p, p, c), axis=0))   # [B, h, w, p, p, C]
    y = g.op("Transpose", y, perm=[0, 5, 1, 3, 2, 4])                                  # [B, C, h, p, w, p]
    size = g.op("Mul", grid, g.ints(p, p))
    return g.op("Reshape", y, g.op("Concat", batch, g.ints(c), size, axis=0))


# ---- the model ---------------------------------------------------------------------------------

def build_mmdit(g: Graph, cfg: MMDiTConfig) -> None:
    if cfg.fp32_blocks and g.dtype != FLOAT:
        g.notes.append(f"joint blocks {list(cfg.fp32_blocks)} computed in fp32 (weights stored fp32): "
                       "SD3.5-large's block 35 overflows fp16 (TensorRT's demo runs it in fp32 too)")
    latents = g.input("hidden_states", g.dtype, ["batch", cfg.in_channels, "latent_height", "latent_width"])
    text = g.input("encoder_hidden_states", g.dtype, ["batch", "text_sequence", cfg.context_dim])   # CLIP 77 + T5
    pooled = g.input("pooled_projections", g.dtype, ["batch", cfg.pooled_dim])
    t = g.input("timestep", FLOAT, ["batch"])
    for key, shape in (("context_embedder.weight", (cfg.hidden, cfg.context_dim)),
                       ("t_embedder.mlp.0.weight", (cfg.hidden, cfg.time_dim)),
                       ("y_embedder.mlp.0.weight", (cfg.hidden, cfg.pooled_dim)),
                       ("final_layer.linear.weight", (cfg.patch * cfg.patch * cfg.out_channels, cfg.hidden))):
        g.expect(key, shape)

    emb = timestep_embedding(g, t, cfg.time_dim)                       # [cos | sin], fp32 inside
    g.widths[emb] = cfg.time_dim
    t_emb = g.linear(g.silu(g.linear(emb, "t_embedder.mlp.0")), "t_embedder.mlp.2")
    y_emb = g.linear(g.silu(g.linear(pooled, "y_embedder.mlp.0")), "y_embedder.mlp.2")
    cond = Conditioning(g, g.op("Add", t_emb, y_emb), cfg)

    batch = g.op("Shape", latents, start=0, end=1)
    grid = g.op("Div", g.op("Shape", latents, start=2, end=4), g.ints(cfg.patch, cfg.patch))   # (h, w) patches
    x = patch_embed(g, latents, grid, cfg)
    ctx = g.linear(text, "context_embedder")
    for i in range(cfg.depth):
        block = fp32_block if i in cfg.fp32_blocks and g.dtype != FLOAT else joint_block
        ctx, x = block(g, ctx, x, i, cond, cfg)

    shift, scale = cond.chunks("final_layer.adaLN_modulation.1", 2)
    out = g.linear(modulated(g, g.plain_layer_norm(x, cfg.hidden, EPS), shift, scale), "final_layer.linear")
    g.output(unpatchify(g, out, batch, grid, cfg), "out_hidden_states", g.dtype,
             ["batch", cfg.out_channels, "latent_height", "latent_width"])
