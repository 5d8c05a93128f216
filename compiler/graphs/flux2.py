"""The FLUX.2 transformer (klein 4B / 9B, dev; diffusers `Flux2Transformer2DModel`), diffusers names.

Owns: the transformer graph and its config from shapes: width from x_embedder, head width from norm_q, depth
and single depth from the blocks, the MLP width from ff.linear_in (SwiGLU: two halves), the text width from
context_embedder, dev's guidance embedder by its name; RoPE theta and the axes split of the head width from the
config (released: 2000, (32, 32, 32, 32); --set transformer.axes_dims_rope / theta as for Flux). BFL / ComfyUI
names are renamed to these at the source (compiler/sources/flux2_names.py).
  temb = linear_2(SiLU(linear_1(emb(1000 t)))) [+ the guidance embedder's of 1000 g]; three modulations shared
         by every block of their kind: double_stream_modulation_img / _txt (6 vectors each) and
         single_stream_modulation (3) = Linear(SiLU(temb)) chunks, no biases anywhere.
  double blocks: per stream LayerNorm * (1 + scale) + shift, q/k/v (RMS-normed per head: norm_q / norm_k,
         norm_added_q / norm_added_k for the text), joint attention over [text, image] with RoPE, to_out.0 /
         to_add_out, gated; SwiGLU feed-forwards (linear_in -> silu(first half) * second half -> linear_out),
         gated.
  single blocks over [text, image]: to_qkv_mlp_proj -> q | k | v | gate | up, attention, SwiGLU, to_out over
         [attention | MLP], gated; the text part dropped; norm_out (LayerNorm * (1 + scale) + shift, diffusers'
         (scale, shift) order) and proj_out.
Positions: 4-D ids (t, h, w, l), each axis turning its share of adjacent pairs by id * theta^(-2j / d) (as
Flux, compiler/graphs/flux.py's rope_tables): image token (0, row, col, 0), text token i (0, 0, 0, i).
IO: hidden_states [B, image_tokens, C] (packed 2x2 patches of the VAE's latents, normalised), encoder_hidden_states
float32 [B, llm_sequence, ctx] (the LLM's stacked hidden states), timestep float32 [B] (sigma; x1000 inside),
img_ids [image_tokens, 4] / txt_ids [llm_sequence, 4] float32, guidance float32 [B] (dev only) ->
out_hidden_states [B, image_tokens, C].
Precision: norms, RoPE, scores and softmax in fp32; fp16 exports clip each block's output to fp16's range.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from ..sources.config_fields import field
from .flux import apply_rope, clip_fp16, gated, modulate, rope_tables, seq_slice
from .ldm_unet import timestep_embedding
from .onnx_graph import FLOAT, FLOAT16, Graph

EPS = 1e-6
RELEASED = {"axes_dims_rope": (32, 32, 32, 32), "rope_theta": 2000.0}   # every released FLUX.2 (128-wide heads)
TIME = "time_guidance_embed.timestep_embedder"
GUIDANCE = "time_guidance_embed.guidance_embedder"


@dataclass(frozen=True)
class Flux2Config:
    hidden: int
    heads: int
    head_dim: int
    depth: int                      # double-stream blocks
    depth_single: int
    mlp_hidden: int                 # SwiGLU width (each of linear_in's halves)
    in_channels: int
    out_channels: int
    context_dim: int                # the stacked LLM states' width
    time_dim: int                   # the sinusoidal embedding's width
    axes_dim: tuple[int, ...]
    theta: float = 2000.0
    guidance: bool = False          # dev: a guidance embedder
    eps: float = EPS

    def describe(self) -> dict:
        return asdict(self)


def flux2_config(g: Graph, config_json: dict, overrides: dict) -> Flux2Config:
    if not g.has("x_embedder.weight") or not g.has("single_stream_modulation.linear.weight"):
        raise BadInput(f"{g.ckpt.path}: no FLUX.2 transformer under {g.prefix or '(no prefix)'} (looked for "
                       "x_embedder.weight and single_stream_modulation.linear.weight)")
    where = f"{g.ckpt.path} transformer/config.json"
    if field(config_json, "patch_size", "count", 1, where) != 1:
        raise BadInput(f"{where}: patch_size {config_json['patch_size']} is not supported (FLUX.2 uses 1)")
    hidden, in_ch = g.shape("x_embedder.weight")
    block = "transformer_blocks.0" if g.has("transformer_blocks.0.attn.norm_q.weight") else "single_transformer_blocks.0"
    head_dim = g.shape(f"{block}.attn.norm_q.weight")[0]
    if head_dim < 2 or hidden % head_dim:
        raise BadInput(f"{g.ckpt.path}: QK-norm width {head_dim} does not divide the transformer width {hidden}; "
                       "the checkpoint is damaged")
    axes = overrides.get("axes_dims_rope") or config_json.get("axes_dims_rope") or \
        (RELEASED["axes_dims_rope"] if head_dim == 128 else None)
    if axes is None:
        raise BadInput(f"{g.ckpt.path}: the transformer's heads are {head_dim} wide; how RoPE splits them over the "
                       f"(t, h, w, l) axes is not in the weights: pass --set transformer.axes_dims_rope=[a,b,c,d] "
                       f"(even numbers summing to {head_dim}; FLUX.2 uses [32,32,32,32] for 128)")
    even = isinstance(axes, (list, tuple)) and len(axes) == 4 and \
        all(isinstance(a, int) and not isinstance(a, bool) and a > 0 and a % 2 == 0 for a in axes)
    if not even or sum(axes) != head_dim:
        raise BadInput(f"{where}: axes_dims_rope {axes!r} must be 4 even numbers summing to the head width {head_dim}")
    ff = "transformer_blocks.0.ff.linear_in.weight"
    mlp = (g.shape(ff)[0] if g.has(ff) else
           (g.shape("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight")[0] - 3 * hidden))
    if mlp % 2:
        raise BadInput(f"{g.ckpt.path}: {g.prefix}{ff} has {mlp} rows, not a SwiGLU's two equal halves; the checkpoint "
                       "is damaged")
    return Flux2Config(hidden=hidden, heads=hidden // head_dim, head_dim=head_dim,
                       depth=g.count("transformer_blocks.{}"), depth_single=g.count("single_transformer_blocks.{}"),
                       mlp_hidden=mlp // 2, in_channels=in_ch,
                       out_channels=g.shape("proj_out.weight")[0], context_dim=g.shape("context_embedder.weight")[1],
                       time_dim=g.shape(f"{TIME}.linear_1.weight")[1], axes_dim=tuple(int(a) for a in axes),
                       theta=float(overrides.get("theta") or field(config_json, "rope_theta", "positive",
                                                                   RELEASED["rope_theta"], where)),
                       guidance=g.has(f"{GUIDANCE}.linear_1.weight"),
                       eps=float(field(config_json, "eps", "positive", EPS, where)))


# ---- blocks ------------------------------------------------------------------------------------

def modulation(g: Graph, act: str, module: str, sets: int, cfg: Flux2Config) -> list[str]:
    """Linear(SiLU(temb)) chunked into 3 x `sets` vectors [B, 1, hidden] (shift, scale, gate per set)."""
    g.expect(f"{module}.weight", (3 * sets * cfg.hidden, cfg.hidden), f"{3 * sets} modulation vectors")
    return [g.op("Unsqueeze", c, g.ints(1)) for c in g.linear_rows(act, module, [cfg.hidden] * 3 * sets, bias=False)]


def heads(g: Graph, x: str, module: str, norm: str, cfg: Flux2Config) -> str:
    """Linear -> [B, heads, L, head_dim], RMS-normed per head in fp32 when `norm` names the scale."""
    g.expect(f"{module}.weight", (cfg.hidden, cfg.hidden), "attention projection [heads x head_dim, width]")
    y = g.split_heads(g.linear(x, module, bias=False), cfg.heads, cfg.head_dim)
    if not norm:
        return y
    g.expect(f"{norm}.weight", (cfg.head_dim,), "one scale per head channel")
    return g.rms_norm(y, norm, cfg.eps, fp32_out=True)


def attend(g: Graph, q: str, k: str, v: str, rope: tuple[str, str], cfg: Flux2Config) -> str:
    """RoPE on fp32 q, k; attention over every token; heads merged: [B, L, hidden]."""
    q, k = (g.from_fp32(apply_rope(g, t, *rope, cfg.head_dim)) for t in (q, k))
    return g.merge_heads(g.sdpa(q, k, v, cfg.head_dim ** -0.5), cfg.hidden)


def swiglu(g: Graph, x: str, module: str, cfg: Flux2Config) -> str:
    """linear_out(silu(a) * b) with a | b = linear_in(x)."""
    g.expect(f"{module}.linear_in.weight", (2 * cfg.mlp_hidden, cfg.hidden), "SwiGLU in [2 x mlp, width]")
    g.expect(f"{module}.linear_out.weight", (cfg.hidden, cfg.mlp_hidden), "SwiGLU out [width, mlp]")
    a, b = g.linear_rows(x, f"{module}.linear_in", [cfg.mlp_hidden] * 2, bias=False)
    h = g.op("Mul", g.silu(a), b)
    g.widths[h] = cfg.mlp_hidden
    return g.linear(h, f"{module}.linear_out", bias=False)


def double_block(g: Graph, img: str, txt: str, i: int, mods: dict, rope, txt_len: str,
                 cfg: Flux2Config) -> tuple[str, str]:
    p = f"transformer_blocks.{i}"
    a = f"{p}.attn"
    streams = {"img": (img, mods["img"], ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
               "txt": (txt, mods["txt"], ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"),
                       "to_add_out", "ff_context")}
    qkv = {}
    for s, (x, m, proj, norms, _, _) in streams.items():
        h = modulate(g, x, m[0], m[1], cfg)
        qkv[s] = [heads(g, h, f"{a}.{n}", f"{a}.{norm}" if norm else "", cfg) for n, norm in zip(proj, (*norms, ""))]
    q, k, v = (g.op("Concat", qkv["txt"][j], qkv["img"][j], axis=2) for j in range(3))    # [text, image]
    att = attend(g, q, k, v, rope, cfg)
    parts = {"txt": seq_slice(g, att, g.ints(0), txt_len),
             "img": seq_slice(g, att, txt_len, g.ints(np.iinfo(np.int64).max))}
    out = {}
    for s, (x, m, _, _, proj_out, ff) in streams.items():
        g.widths[parts[s]] = cfg.hidden
        g.expect(f"{a}.{proj_out}.weight", (cfg.hidden, cfg.hidden))
        x = gated(g, x, m[2], g.linear(parts[s], f"{a}.{proj_out}", bias=False))
        out[s] = clip_fp16(g, gated(g, x, m[5], swiglu(g, modulate(g, x, m[3], m[4], cfg), f"{p}.{ff}", cfg)))
    return out["img"], out["txt"]


def single_block(g: Graph, x: str, i: int, mod: list[str], rope, cfg: Flux2Config) -> str:
    a = f"single_transformer_blocks.{i}.attn"
    h, mlp = cfg.hidden, cfg.mlp_hidden
    g.expect(f"{a}.to_qkv_mlp_proj.weight", (3 * h + 2 * mlp, h), "q | k | v | gate | up")
    g.expect(f"{a}.to_out.weight", (h, h + mlp), "attention | MLP -> width")
    q, k, v, gate, up = g.linear_rows(modulate(g, x, mod[0], mod[1], cfg), f"{a}.to_qkv_mlp_proj", [h] * 3 + [mlp] * 2,
                                      bias=False)
    q, k, v = (g.split_heads(t, cfg.heads, cfg.head_dim) for t in (q, k, v))
    for n in ("norm_q", "norm_k"):
        g.expect(f"{a}.{n}.weight", (cfg.head_dim,), "one scale per head channel")
    q, k = (g.rms_norm(t, f"{a}.{n}", cfg.eps, fp32_out=True) for t, n in ((q, "norm_q"), (k, "norm_k")))
    att = attend(g, q, k, v, rope, cfg)
    y = g.op("Add", g.matmul_cols(att, f"{a}.to_out", 0, h),
             g.matmul_cols(g.op("Mul", g.silu(gate), up), f"{a}.to_out", h, h + mlp))
    return clip_fp16(g, gated(g, x, mod[2], y))


# ---- the model ---------------------------------------------------------------------------------

def time_embedding(g: Graph, t: str, cfg: Flux2Config) -> str:
    thousand = g.const(np.array(1000.0, np.float32))

    def embed(x: str, m: str) -> str:      # TimestepEmbedding of emb(1000 x): linear_2(SiLU(linear_1(.)))
        h = g.linear(timestep_embedding(g, g.op("Mul", x, thousand), cfg.time_dim), f"{m}.linear_1", bias=False)
        return g.linear(g.silu(h), f"{m}.linear_2", bias=False)
    temb = embed(t, TIME)
    if cfg.guidance:
        temb = g.op("Add", temb, embed(g.input("guidance", FLOAT, ["batch"]), GUIDANCE))
    g.widths[temb] = cfg.hidden
    return temb


def build_flux2(g: Graph, cfg: Flux2Config) -> None:
    if g.dtype == FLOAT16:
        g.notes.append("block outputs clipped to fp16's range (+-65504), as diffusers does")
    img = g.input("hidden_states", g.dtype, ["batch", "image_tokens", cfg.in_channels])
    txt = g.input("encoder_hidden_states", FLOAT, ["batch", "llm_sequence", cfg.context_dim])
    t = g.input("timestep", FLOAT, ["batch"])
    img_ids = g.input("img_ids", FLOAT, ["image_tokens", 4])
    txt_ids = g.input("txt_ids", FLOAT, ["llm_sequence", 4])
    for key, shape in (("x_embedder.weight", (cfg.hidden, cfg.in_channels)),
                       ("context_embedder.weight", (cfg.hidden, cfg.context_dim)),
                       ("proj_out.weight", (cfg.out_channels, cfg.hidden)),
                       ("norm_out.linear.weight", (2 * cfg.hidden, cfg.hidden))):
        g.expect(key, shape)
    act = g.silu(time_embedding(g, t, cfg))
    g.widths[act] = cfg.hidden
    mods = {"img": modulation(g, act, "double_stream_modulation_img.linear", 2, cfg),
            "txt": modulation(g, act, "double_stream_modulation_txt.linear", 2, cfg)}
    single = modulation(g, act, "single_stream_modulation.linear", 1, cfg)
    rope = rope_tables(g, g.op("Concat", txt_ids, img_ids, axis=0), cfg)
    x = g.linear(img, "x_embedder", bias=False)
    txt = g.from_fp32(txt)
    g.widths[txt] = cfg.context_dim
    c = g.linear(txt, "context_embedder", bias=False)
    txt_len = g.op("Shape", txt, start=1, end=2)
    for i in range(cfg.depth):
        x, c = double_block(g, x, c, i, mods, rope, txt_len, cfg)
    h = g.op("Concat", c, x, axis=1)
    g.widths[h] = cfg.hidden
    for i in range(cfg.depth_single):
        h = single_block(g, h, i, single, rope, cfg)
    x = seq_slice(g, h, txt_len, g.ints(np.iinfo(np.int64).max))
    g.widths[x] = cfg.hidden
    scale, shift = (g.op("Unsqueeze", c, g.ints(1)) for c in g.linear_rows(act, "norm_out.linear", [cfg.hidden] * 2,
                                                                             bias=False))
    out = g.linear(modulate(g, x, shift, scale, cfg), "proj_out", bias=False)
    g.output(out, "out_hidden_states", g.dtype, ["batch", "image_tokens", cfg.out_channels])
