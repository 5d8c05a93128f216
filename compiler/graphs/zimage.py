"""The Z-Image transformer (Tongyi-MAI's single-stream DiT; diffusers `ZImageTransformer2DModel`), diffusers names.

Owns: the transformer graph and its config from shapes: width from the patch embedder
(`all_x_embedder.2-1`: 2x2 patches, one frame), head width from norm_q, depth and refiner depths from the
blocks, caption width from cap_embedder, FFN width from w1; RoPE theta, axes split and t_scale from the
config (released: 256, (32, 48, 48), 1000; --set transformer.axes_dims_rope / theta as for Flux). As diffusers
runs it for one image per prompt:
  image: 2x2 latent patches -> all_x_embedder, padded to a multiple of 32 tokens with x_pad_token; the
         noise refiner (modulated blocks) over them;
  text:  the caption states (the LLM's, real tokens first) -> cap_embedder (RMSNorm, Linear), the tokens from
         the real length up to its multiple of 32 replaced by cap_pad_token; the context refiner (plain blocks)
         attending to those; tokens past that length masked out (so any padding the runtime adds is inert);
  joint: [image, text] through the main blocks; the final layer (LayerNorm * (1 + Linear(SiLU(t))), Linear)
         on the image tokens; unpatchified.
Positions (3-D RoPE on adjacent pairs, each axis' cos/sin table looked up by integer position, as diffusers'
RopeEmbedder): text token i (1 + i, 0, 0), image patch (row, col) (L + 1, row, col) with L the text's padded
length, padding patches (0, 0, 0). Modulated block: scale_msa, gate_msa, scale_mlp, gate_mlp = chunks of
adaLN_modulation(t_emb); x += tanh(gate_msa) * RMS2(attn(RMS1(x) * (1 + scale_msa))); likewise the SwiGLU
FFN (w2(silu(w1 h) * w3 h)); plain blocks without the modulation. t_emb = t_embedder(sinusoid(t * t_scale)).
IO: hidden_states [B, C, H, W] (latents), encoder_hidden_states float32 [B, llm_sequence, cap_width] with
attention_mask int32 [B, llm_sequence] (1 = real token, real tokens first), timestep float32 [B] (diffusers'
t = 1 - sigma, as ZImagePipeline feeds it) -> out_hidden_states [B, C, H, W]: the flow velocity, i.e. the
model's output negated as ZImagePipeline negates it.
Precision: norms, RoPE, scores and softmax in fp32; fp16 exports clip each block's output to fp16's range.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from onnx import TensorProto, helper

from ..errors import BadInput
from ..sources.config_fields import field
from .flux import clip_fp16
from .ldm_unet import timestep_embedding
from .onnx_graph import FLOAT, FLOAT16, INT32, Graph

PATCH = "2-1"               # the released patching: 2x2 latents, one frame
SEQ_MULTI_OF = 32           # diffusers pads the image and the text to multiples of this
EMBEDDER, FINAL = f"all_x_embedder.{PATCH}", f"all_final_layer.{PATCH}"
RELEASED = {"rope_theta": 256.0, "axes_dims": (32, 48, 48), "axes_lens": (1024, 512, 512), "t_scale": 1000.0}


@dataclass(frozen=True)
class ZImageConfig:
    dim: int
    heads: int
    head_dim: int
    layers: int
    refiner_layers: int
    ffn: int
    in_channels: int
    cap_dim: int
    adaln_dim: int
    axes_dims: tuple[int, ...]
    axes_lens: tuple[int, ...]
    theta: float = 256.0
    t_scale: float = 1000.0
    eps: float = 1e-5

    def describe(self) -> dict:
        return asdict(self)


def _ints(value, name: str, n: int, where: str) -> tuple[int, ...]:
    ok = isinstance(value, (list, tuple)) and len(value) == n and \
        all(isinstance(a, int) and not isinstance(a, bool) and a > 0 for a in value)
    if not ok:
        raise BadInput(f"{where}: {name} {value!r} must be {n} positive whole numbers")
    return tuple(value)


def zimage_config(g: Graph, config_json: dict, overrides: dict) -> ZImageConfig:
    if g.has(f"{EMBEDDER}.weight") and not g.has("layers.0.attention.norm_q.weight"):
        raise BadInput(f"{g.ckpt.path}: a Z-Image transformer without QK norms (no {g.prefix}layers.0.attention."
                       "norm_q.weight): not supported (every released Z-Image has them; its head width is read there)")
    if not g.has(f"{EMBEDDER}.weight") or not g.has("layers.0.attention.norm_q.weight"):
        others = sorted({k[len(g.prefix):].split(".")[0] + "." + k[len(g.prefix):].split(".")[1]
                         for k in g.ckpt.with_prefix(g.prefix + "all_x_embedder.")})
        raise BadInput(f"{g.ckpt.path}: no Z-Image transformer with 2x2 patches under {g.prefix or '(no prefix)'} "
                       f"(looked for {EMBEDDER}.weight and layers.0.attention.norm_q.weight"
                       + (f"; found {', '.join(others)}: other patchings are not supported yet)" if others else ")"))
    where = f"{g.ckpt.path} transformer/config.json"
    conf = {**config_json, **{k: overrides[v] for k, v in (("axes_dims", "axes_dims_rope"), ("rope_theta", "theta"))
                              if overrides.get(v) is not None}}
    dim, patch_in = g.shape(f"{EMBEDDER}.weight")
    head_dim = g.shape("layers.0.attention.norm_q.weight")[0]
    if head_dim < 2 or dim % head_dim or patch_in % 4:
        raise BadInput(f"{g.ckpt.path}: norm_q width {head_dim} and the patch embedder {[dim, patch_in]} do not fit a "
                       "Z-Image transformer (heads dividing the width, 2x2 patches); the checkpoint is damaged")
    axes = _ints(conf.get("axes_dims") or RELEASED["axes_dims"], "axes_dims", 3, where)
    if sum(axes) != head_dim or any(a % 2 for a in axes):
        raise BadInput(f"{where}: axes_dims {list(axes)} must be even numbers summing to the head width {head_dim} "
                       f"(pass --set transformer.axes_dims_rope=[a,b,c]; Z-Image uses [32,48,48] for 128)")
    refiners = g.count("noise_refiner.{}")
    if refiners != g.count("context_refiner.{}"):
        raise BadInput(f"{g.ckpt.path}: {refiners} noise_refiner and {g.count('context_refiner.{}')} context_refiner "
                       "blocks; Z-Image has as many of each: the checkpoint is damaged")
    return ZImageConfig(dim=dim, heads=dim // head_dim, head_dim=head_dim, layers=g.count("layers.{}"),
                        refiner_layers=refiners, ffn=g.shape("layers.0.feed_forward.w1.weight")[0],
                        in_channels=patch_in // 4, cap_dim=g.shape("cap_embedder.1.weight")[1],
                        adaln_dim=g.shape("t_embedder.mlp.2.weight")[0], axes_dims=axes,
                        axes_lens=_ints(conf.get("axes_lens") or RELEASED["axes_lens"], "axes_lens", 3, where),
                        theta=float(field(conf, "rope_theta", "positive", RELEASED["rope_theta"], where)),
                        t_scale=float(field(conf, "t_scale", "positive", RELEASED["t_scale"], where)),
                        eps=float(field(conf, "norm_eps", "positive", 1e-5, where)))


# ---- positions ---------------------------------------------------------------------------------

def _tables(cfg: ZImageConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per axis, cos and sin [len, d / 2] of position * theta^(-2j / d): angles in float64 rounded to fp32, as
    diffusers' RopeEmbedder.precompute_freqs_cis."""
    out = []
    for d, n in zip(cfg.axes_dims, cfg.axes_lens):
        freqs = 1.0 / cfg.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        angles = np.outer(np.arange(n, dtype=np.float64), freqs).astype(np.float32).astype(np.float64)
        out.append((np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)))
    return out


def rope(g: Graph, ids: list[str], shape: str, cfg: ZImageConfig) -> tuple[str, str]:
    """cos and sin [B, L, 1, head_dim / 2, 1] fp32 for int64 positions per axis (each broadcastable to [B, L])."""
    parts = {"cos": [], "sin": []}
    for axis, (cos, sin) in enumerate(_tables(cfg)):
        for name, table in (("cos", cos), ("sin", sin)):
            rows = g.op("Gather", g.const(table, hint=f"rope_{name}{axis}"), ids[axis], axis=0)
            half = cfg.axes_dims[axis] // 2
            parts[name].append(g.op("Expand", rows, g.op("Concat", shape, g.ints(half), axis=0)))
    return tuple(g.op("Unsqueeze", g.op("Concat", *parts[n], axis=-1), g.ints(2, 4)) for n in ("cos", "sin"))


def apply_rope(g: Graph, x: str, cos: str, sin: str, d: int) -> str:
    """Turn adjacent pairs (x[2j], x[2j+1]) of fp32 x [B, L, heads, d] by the angles cos / sin [B, L, 1, d/2, 1]."""
    pairs = g.op("Reshape", x, g.ints(0, 0, 0, d // 2, 2))
    x0, x1 = g.op("Split", pairs, axis=-1, num_outputs=2, outputs=2)
    y0 = g.op("Sub", g.op("Mul", x0, cos), g.op("Mul", x1, sin))
    y1 = g.op("Add", g.op("Mul", x1, cos), g.op("Mul", x0, sin))
    return g.op("Reshape", g.op("Concat", y0, y1, axis=-1), g.ints(0, 0, 0, d))


def key_bias(g: Graph, keep: str) -> str:
    """[B, 1, 1, L] fp32 additive key mask from bool keep [B, L]."""
    return g.op("Unsqueeze", g.op("Where", keep, g.const(np.array(0.0, np.float32)),
                                  g.const(np.array(np.finfo(np.float32).min, np.float32))), g.ints(1, 2))


# ---- blocks ------------------------------------------------------------------------------------

def attention(g: Graph, x: str, p: str, rot: tuple[str, str], bias: str | None, cfg: ZImageConfig) -> str:
    a = f"{p}.attention"
    for n in ("to_q", "to_k", "to_v", "to_out.0"):
        g.expect(f"{a}.{n}.weight", (cfg.dim, cfg.dim))
    heads = []
    for n, norm in (("to_q", "norm_q"), ("to_k", "norm_k"), ("to_v", None)):
        y = g.op("Reshape", g.linear(x, f"{a}.{n}", bias=False), g.ints(0, 0, cfg.heads, cfg.head_dim))
        if norm is not None:
            g.expect(f"{a}.{norm}.weight", (cfg.head_dim,), "one scale per head channel")
            y = g.from_fp32(apply_rope(g, g.rms_norm(y, f"{a}.{norm}", 1e-5, fp32_out=True), *rot, cfg.head_dim))
        heads.append(g.op("Transpose", y, perm=[0, 2, 1, 3]))
    out = g.merge_heads(g.sdpa(*heads, cfg.head_dim ** -0.5, bias), cfg.dim)
    return g.linear(out, f"{a}.to_out.0", bias=False)


def feed_forward(g: Graph, x: str, p: str, cfg: ZImageConfig) -> str:
    for n in ("w1", "w3"):
        g.expect(f"{p}.feed_forward.{n}.weight", (cfg.ffn, cfg.dim), "FFN input [ffn, width]")
    g.expect(f"{p}.feed_forward.w2.weight", (cfg.dim, cfg.ffn), "FFN output [width, ffn]")
    h = g.op("Mul", g.silu(g.linear(x, f"{p}.feed_forward.w1", bias=False)),
             g.linear(x, f"{p}.feed_forward.w3", bias=False))
    g.widths[h] = cfg.ffn
    return g.linear(h, f"{p}.feed_forward.w2", bias=False)


def block(g: Graph, x: str, p: str, rot, bias, t_emb: str | None, cfg: ZImageConfig) -> str:
    """One ZImageTransformerBlock; `t_emb` None: a block without modulation (the context refiner)."""
    norm = lambda y, n: g.rms_norm(y, f"{p}.{n}", cfg.eps)  # noqa: E731
    if t_emb is None:
        x = g.op("Add", x, norm(attention(g, norm(x, "attention_norm1"), p, rot, bias, cfg), "attention_norm2"))
        return clip_fp16(g, g.op("Add", x, norm(feed_forward(g, norm(x, "ffn_norm1"), p, cfg), "ffn_norm2")))
    g.expect(f"{p}.adaLN_modulation.0.weight", (4 * cfg.dim, cfg.adaln_dim), "4 modulation vectors")
    one = g.scalar(1.0)
    scale_msa, gate_msa, scale_mlp, gate_mlp = (g.op("Unsqueeze", c, g.ints(1))
                                                for c in g.linear_chunks(t_emb, f"{p}.adaLN_modulation.0", 4))
    att = attention(g, g.op("Mul", norm(x, "attention_norm1"), g.op("Add", one, scale_msa)), p, rot, bias, cfg)
    x = g.op("Add", x, g.op("Mul", g.op("Tanh", gate_msa), norm(att, "attention_norm2")))
    ff = feed_forward(g, g.op("Mul", norm(x, "ffn_norm1"), g.op("Add", one, scale_mlp)), p, cfg)
    return clip_fp16(g, g.op("Add", x, g.op("Mul", g.op("Tanh", gate_mlp), norm(ff, "ffn_norm2"))))


# ---- the model ---------------------------------------------------------------------------------

def _i64(g: Graph, value: int) -> str:
    return g.const(np.array(value, np.int64))


def _padded(g: Graph, n: str) -> str:
    """n rounded up to a multiple of SEQ_MULTI_OF (int64, any shape)."""
    m = _i64(g, SEQ_MULTI_OF)
    return g.op("Mul", g.op("Div", g.op("Add", n, _i64(g, SEQ_MULTI_OF - 1)), m), m)


def _pad_count(g: Graph, n: str) -> str:
    """(-n) mod SEQ_MULTI_OF, written so that shape inference's bounds stay non-negative (OpenVINO's do not
    follow a difference of two dynamic dimensions)."""
    m = _i64(g, SEQ_MULTI_OF)
    return g.op("Mod", g.op("Sub", m, g.op("Mod", n, m)), m)


def _with_pad_rows(g: Graph, x: str, token: str, rows: str, batch: str, cfg: ZImageConfig) -> str:
    """x [B, n, dim] followed by `rows` (int64 [1]) copies of the learned pad `token` [1, dim]."""
    pad = g.op("Expand", g.op("Unsqueeze", g.param(token), g.ints(0)), g.op("Concat", batch, rows, g.ints(cfg.dim), axis=0))
    y = g.op("Concat", x, pad, axis=1)
    g.widths[y] = cfg.dim
    return y


def build_zimage(g: Graph, cfg: ZImageConfig) -> None:
    if g.dtype == FLOAT16:
        g.notes.append("block outputs clipped to fp16's range (+-65504)")
    c_in = cfg.in_channels
    lat = g.input("hidden_states", g.dtype, ["batch", c_in, "latent_height", "latent_width"])
    cap = g.input("encoder_hidden_states", FLOAT, ["batch", "llm_sequence", cfg.cap_dim])
    mask = g.input("attention_mask", INT32, ["batch", "llm_sequence"])
    t = g.input("timestep", FLOAT, ["batch"])
    for key, shape in ((f"{EMBEDDER}.weight", (cfg.dim, 4 * c_in)), (f"{FINAL}.linear.weight", (4 * c_in, cfg.dim)),
                       ("cap_embedder.1.weight", (cfg.dim, cfg.cap_dim)), ("x_pad_token", (1, cfg.dim)),
                       ("cap_pad_token", (1, cfg.dim)), (f"{FINAL}.adaLN_modulation.1.weight", (cfg.dim, cfg.adaln_dim))):
        g.expect(key, shape)
    # timestep embedding
    t_emb = g.linear(g.silu(g.linear(timestep_embedding(g, g.op("Mul", t, g.const(np.array(cfg.t_scale, np.float32))),
                                                           g.shape("t_embedder.mlp.0.weight")[1]), "t_embedder.mlp.0")),
                     "t_embedder.mlp.2")
    # image tokens: 2x2 patches (row-major), padded to a multiple of 32
    shape = g.op("Shape", lat)
    batch = g.op("Slice", shape, g.ints(0), g.ints(1))
    rows, cols = (g.op("Div", g.op("Slice", shape, g.ints(i), g.ints(i + 1)), g.ints(2)) for i in (2, 3))
    n = g.op("Mul", rows, cols)
    patches = g.op("Reshape", lat, g.op("Concat", batch, g.ints(c_in), rows, g.ints(2), cols, g.ints(2), axis=0))
    patches = g.op("Reshape", g.op("Transpose", patches, perm=[0, 2, 4, 3, 5, 1]),        # [B, n, (ph pw c)]
                   g.op("Concat", batch, n, g.ints(4 * c_in), axis=0))
    g.widths[patches] = 4 * c_in
    x_rows = _pad_count(g, n)
    n_pad = g.op("Add", n, x_rows)
    x = _with_pad_rows(g, g.linear(patches, EMBEDDER), "x_pad_token", x_rows, batch, cfg)
    # text tokens: real ones embedded, then cap_pad_token up to the real length's multiple of 32; past it masked
    length = g.op("ReduceSum", g.op("Cast", mask, to=TensorProto.INT64), g.ints(1), keepdims=1)     # [B, 1]
    l_pad = _padded(g, length)
    t_len = g.op("Shape", cap, start=1, end=2)
    c_rows = _pad_count(g, t_len)
    t_pad = g.op("Add", t_len, c_rows)
    c = g.linear(g.rms_norm(cap, "cap_embedder.0", cfg.eps), "cap_embedder.1")
    c = _with_pad_rows(g, c, "cap_pad_token", c_rows, batch, cfg)
    pos = g.op("Range", _i64(g, 0), g.op("Squeeze", t_pad, g.ints(0)), _i64(g, 1))                   # [T']
    real = g.op("Less", g.op("Unsqueeze", pos, g.ints(0)), length)                                     # [B, T']
    c = g.op("Where", g.op("Unsqueeze", real, g.ints(2)), c, g.param("cap_pad_token"))
    keep = g.op("Less", g.op("Unsqueeze", pos, g.ints(0)), l_pad)                                      # [B, T']
    # positions
    zero_t = g.op("Mul", pos, _i64(g, 0))
    # masked rows past the real text may reach past the table (a profile longer than axes_lens[0] - 32): their
    # position is clamped to its last row, what they compute is never read
    text_pos = g.op("Min", g.op("Add", pos, _i64(g, 1)), _i64(g, cfg.axes_lens[0] - 1))
    cap_rot = rope(g, [text_pos, zero_t, zero_t], g.op("Concat", batch, t_pad, axis=0), cfg)
    tok = g.op("Range", _i64(g, 0), g.op("Squeeze", n_pad, g.ints(0)), _i64(g, 1))                   # [N']
    is_img = g.op("Less", tok, n)
    zero_n = g.op("Mul", tok, _i64(g, 0))
    img_ids = [g.op("Where", g.op("Unsqueeze", is_img, g.ints(0)), g.op("Add", l_pad, _i64(g, 1)), zero_n),  # [B, N']
               g.op("Where", is_img, g.op("Div", tok, cols), zero_n), g.op("Where", is_img, g.op("Mod", tok, cols), zero_n)]
    img_rot = rope(g, img_ids, g.op("Concat", batch, n_pad, axis=0), cfg)
    # refiners, joint blocks, final layer on the image tokens
    for i in range(cfg.refiner_layers):
        x = block(g, x, f"noise_refiner.{i}", img_rot, None, t_emb, cfg)
    cap_bias = key_bias(g, keep)
    for i in range(cfg.refiner_layers):
        c = block(g, c, f"context_refiner.{i}", cap_rot, cap_bias, None, cfg)
    h = g.op("Concat", x, c, axis=1)
    g.widths[h] = cfg.dim
    rot = tuple(g.op("Concat", a, b, axis=1) for a, b in zip(img_rot, cap_rot))
    every = g.op("ConstantOfShape", g.op("Concat", batch, n_pad, axis=0),
                 value=helper.make_tensor("true", TensorProto.BOOL, [1], [True]))          # image tokens: all seen
    bias = key_bias(g, g.op("Concat", every, keep, axis=1))
    for i in range(cfg.layers):
        h = block(g, h, f"layers.{i}", rot, bias, t_emb, cfg)
    h = g.op("Slice", h, g.ints(0), n, g.ints(1))
    g.widths[h] = cfg.dim
    scale = g.op("Unsqueeze", g.linear(g.silu(t_emb), f"{FINAL}.adaLN_modulation.1"), g.ints(1))
    y = g.linear(g.op("Mul", g.plain_layer_norm(h, cfg.dim, 1e-6), g.op("Add", g.scalar(1.0), scale)), f"{FINAL}.linear")
    y = g.op("Reshape", y, g.op("Concat", batch, rows, cols, g.ints(2, 2, c_in), axis=0))
    y = g.op("Reshape", g.op("Transpose", y, perm=[0, 5, 1, 3, 2, 4]),
             g.op("Concat", batch, g.ints(c_in), g.op("Mul", rows, g.ints(2)), g.op("Mul", cols, g.ints(2)), axis=0))
    g.output(g.op("Neg", y), "out_hidden_states", g.dtype, ["batch", c_in, "latent_height", "latent_width"])
