"""The Qwen-Image transformer (Alibaba's 20 B double-stream MMDiT; diffusers `QwenImageTransformer2DModel`),
diffusers names.

Owns: the transformer graph and its config from shapes: width from img_in, head width from norm_q, depth from the
blocks, the MLP width from img_mlp.net.0.proj, the text width from txt_in (and txt_norm); the RoPE split of the
head width over (frame, row, column) from the config (released: (16, 56, 56), theta 10000). The edit / layered
variants (zero_cond_t, additional_t_cond) are refused by name.
  temb = timestep_embedder.linear_2(SiLU(linear_1(emb(1000 t)))) (emb: 256 wide, cos first); per block and stream
         img_mod.1 / txt_mod.1 = Linear(SiLU(temb)) -> (shift, scale, gate) x 2.
  text in: txt_in(RMSNorm(encoder_hidden_states)) (txt_norm, eps 1e-6); image in: img_in(hidden_states).
  each block, per stream: LayerNorm * (1 + scale) + shift (no affine, eps 1e-6), q/k/v with biases, q and k
         RMS-normed per head (norm_q / norm_k, norm_added_q / norm_added_k for the text), RoPE, joint attention
         over [text, image] (padding text keys masked by encoder_hidden_states_mask), to_out.0 / to_add_out,
         gated; GELU(tanh) feed-forwards img_mlp / txt_mlp (net.0.proj, net.2), gated.
  out: norm_out (LayerNorm * (1 + scale) + shift, diffusers' (scale, shift) order) and proj_out on the image.
Positions (QwenEmbedRope, scale_rope): 3-D ids fed by the runtime -- image token (0, row - (rows - rows // 2),
col - (cols - cols // 2)) (centred), text token i (m + i, m + i, m + i) with m = max(rows // 2, cols // 2); axis a
turns adjacent pairs by id * 10000^(-2j / d_a) (compiler/graphs/flux.py's rope_tables / apply_rope).
IO: hidden_states [B, image_tokens, C] (packed 2x2 patches of the VAE's normalised latents), encoder_hidden_states
float32 [B, llm_sequence, ctx] (the LLM's last hidden state), encoder_hidden_states_mask int32 [B, llm_sequence]
(1 = real token), timestep float32 [B] (sigma; x1000 inside), img_ids [image_tokens, 3] / txt_ids [llm_sequence, 3]
float32 -> out_hidden_states [B, image_tokens, C_out].
Precision: norms, RoPE, scores and softmax in fp32; fp16 exports clip each block's output to fp16's range.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from onnx import TensorProto, helper

from ..errors import BadInput
from ..sources.config_fields import field
from .flux import apply_rope, clip_fp16, gated, modulate, rope_tables, seq_slice
from .ldm_unet import timestep_embedding
from .onnx_graph import FLOAT, FLOAT16, INT32, Graph

EPS = 1e-6
THETA = 10000.0                 # QwenEmbedRope's, fixed in diffusers
RELEASED_AXES = (16, 56, 56)    # Qwen-Image's (128-wide heads)
TIME = "time_text_embed.timestep_embedder"
BLOCK = "transformer_blocks.{}"


@dataclass(frozen=True)
class QwenImageConfig:
    hidden: int
    heads: int
    head_dim: int
    depth: int
    mlp_hidden: int
    in_channels: int
    out_channels: int
    context_dim: int
    time_dim: int
    axes_dim: tuple[int, ...]
    theta: float = THETA
    eps: float = EPS

    def describe(self) -> dict:
        return asdict(self)


def qwenimage_config(g: Graph, config_json: dict, overrides: dict) -> QwenImageConfig:
    if not g.has("img_in.weight") or not g.has("txt_norm.weight"):
        raise BadInput(f"{g.ckpt.path}: no Qwen-Image transformer under {g.prefix or '(no prefix)'} (looked for "
                       "img_in.weight and txt_norm.weight)")
    where = f"{g.ckpt.path} transformer/config.json"
    if g.has(f"{TIME.rsplit('.', 1)[0]}.addition_t_embedding.weight") or config_json.get("zero_cond_t") or \
            config_json.get("use_layer3d_rope"):
        raise BadInput(f"{where}: a Qwen-Image edit / layered transformer (zero_cond_t, additional_t_cond or "
                       "layer-3D RoPE): not supported yet; Qwen-Image text-to-image is")
    hidden, in_ch = g.shape("img_in.weight")
    head_dim = g.shape("transformer_blocks.0.attn.norm_q.weight")[0]
    if head_dim < 2 or hidden % head_dim:
        raise BadInput(f"{g.ckpt.path}: QK-norm width {head_dim} does not divide the transformer width {hidden}; "
                       "the checkpoint is damaged")
    axes = overrides.get("axes_dims_rope") or config_json.get("axes_dims_rope") or \
        (RELEASED_AXES if head_dim == 128 else None)
    if axes is None:
        raise BadInput(f"{g.ckpt.path}: the transformer's heads are {head_dim} wide; how RoPE splits them over the "
                       "(frame, row, column) axes is not in the weights: pass --set "
                       "transformer.axes_dims_rope=[a,b,c] "
                       f"(even numbers summing to {head_dim}; Qwen-Image uses [16,56,56] for 128)")
    even = isinstance(axes, (list, tuple)) and len(axes) == 3 and \
        all(isinstance(a, int) and not isinstance(a, bool) and a > 0 and a % 2 == 0 for a in axes)
    if not even or sum(axes) != head_dim:
        raise BadInput(f"{where}: axes_dims_rope {axes!r} must be 3 even numbers summing to the head width {head_dim}")
    if field(config_json, "patch_size", "count", 2, where) != 2:
        raise BadInput(f"{where}: patch_size {config_json['patch_size']} is not supported (Qwen-Image packs 2x2)")
    return QwenImageConfig(hidden=hidden, heads=hidden // head_dim, head_dim=head_dim,
                           depth=g.count(BLOCK),
                           mlp_hidden=g.shape("transformer_blocks.0.img_mlp.net.0.proj.weight")[0],
                           in_channels=in_ch, out_channels=g.shape("proj_out.weight")[0],
                           context_dim=g.shape("txt_in.weight")[1], time_dim=g.shape(f"{TIME}.linear_1.weight")[1],
                           axes_dim=tuple(int(a) for a in axes))


# ---- blocks ------------------------------------------------------------------------------------

def _heads(g: Graph, x: str, module: str, norm: str | None, cfg: QwenImageConfig) -> str:
    g.expect(f"{module}.weight", (cfg.hidden, cfg.hidden), "attention projection [heads x head_dim, width]")
    y = g.split_heads(g.linear(x, module), cfg.heads, cfg.head_dim)
    if norm is None:
        return y
    g.expect(f"{norm}.weight", (cfg.head_dim,), "one scale per head channel")
    return g.rms_norm(y, norm, cfg.eps, fp32_out=True)


def _mlp(g: Graph, x: str, module: str, cfg: QwenImageConfig) -> str:
    g.expect(f"{module}.net.0.proj.weight", (cfg.mlp_hidden, cfg.hidden), "feed-forward in [mlp, width]")
    g.expect(f"{module}.net.2.weight", (cfg.hidden, cfg.mlp_hidden), "feed-forward out [width, mlp]")
    h = g.gelu_tanh(g.linear(x, f"{module}.net.0.proj"))
    g.widths[h] = cfg.mlp_hidden
    return g.linear(h, f"{module}.net.2")


def block(g: Graph, img: str, txt: str, i: int, act: str, rope, bias: str, txt_len: str,
          cfg: QwenImageConfig) -> tuple[str, str]:
    p = BLOCK.format(i)
    a = f"{p}.attn"
    streams = {"img": (img, "img_mod.1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "img_mlp"),
               "txt": (txt, "txt_mod.1", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"),
                       "to_add_out", "txt_mlp")}
    mods, qkv = {}, {}
    for s, (x, mod, proj, norms, _, _) in streams.items():
        g.expect(f"{p}.{mod}.weight", (6 * cfg.hidden, cfg.hidden), "6 modulation vectors")
        mods[s] = [g.op("Unsqueeze", c, g.ints(1)) for c in g.linear_rows(act, f"{p}.{mod}", [cfg.hidden] * 6)]
        h = modulate(g, x, mods[s][0], mods[s][1], cfg)
        qkv[s] = [_heads(g, h, f"{a}.{n}", f"{a}.{norm}" if norm else None, cfg)
                  for n, norm in zip(proj, (*norms, None))]
    q, k, v = (g.op("Concat", qkv["txt"][j], qkv["img"][j], axis=2) for j in range(3))    # [text, image]
    q, k = (g.from_fp32(apply_rope(g, t, *rope, cfg.head_dim)) for t in (q, k))
    att = g.merge_heads(g.sdpa(q, k, v, cfg.head_dim ** -0.5, bias), cfg.hidden)
    parts = {"txt": seq_slice(g, att, g.ints(0), txt_len),
             "img": seq_slice(g, att, txt_len, g.ints(np.iinfo(np.int64).max))}
    out = {}
    for s, (x, _, _, _, proj_out, mlp) in streams.items():
        m = mods[s]
        g.widths[parts[s]] = cfg.hidden
        g.expect(f"{a}.{proj_out}.weight", (cfg.hidden, cfg.hidden))
        x = gated(g, x, m[2], g.linear(parts[s], f"{a}.{proj_out}"))
        out[s] = clip_fp16(g, gated(g, x, m[5], _mlp(g, modulate(g, x, m[3], m[4], cfg), f"{p}.{mlp}", cfg)))
    return out["img"], out["txt"]


def joint_bias(g: Graph, mask: str, img: str) -> str:
    """[B, 1, 1, text + image] fp32: 0 for real text tokens and every image token, fp32's lowest for padding."""
    image = g.op("ConstantOfShape", g.op("Shape", img, start=0, end=2),
                 value=helper.make_tensor("one", TensorProto.INT32, [1], [1]))
    real = g.op("Cast", g.op("Concat", mask, image, axis=1), to=TensorProto.BOOL)
    bias = g.op("Where", real, g.const(np.array(0.0, np.float32)), g.const(np.array(np.finfo(np.float32).min,
                                                                                     np.float32)))
    return g.op("Unsqueeze", bias, g.ints(1, 2))


def build_qwenimage(g: Graph, cfg: QwenImageConfig) -> None:
    if g.dtype == FLOAT16:
        g.notes.append("block outputs clipped to fp16's range (+-65504), as diffusers does")
    img = g.input("hidden_states", g.dtype, ["batch", "image_tokens", cfg.in_channels])
    txt = g.input("encoder_hidden_states", FLOAT, ["batch", "llm_sequence", cfg.context_dim])
    mask = g.input("encoder_hidden_states_mask", INT32, ["batch", "llm_sequence"])
    t = g.input("timestep", FLOAT, ["batch"])
    img_ids = g.input("img_ids", FLOAT, ["image_tokens", 3])
    txt_ids = g.input("txt_ids", FLOAT, ["llm_sequence", 3])
    for key, shape in (("img_in.weight", (cfg.hidden, cfg.in_channels)),
                       ("txt_in.weight", (cfg.hidden, cfg.context_dim)),
                       ("txt_norm.weight", (cfg.context_dim,)),
                       ("proj_out.weight", (cfg.out_channels, cfg.hidden)),
                       ("norm_out.linear.weight", (2 * cfg.hidden, cfg.hidden)),
                       (f"{TIME}.linear_1.weight", (cfg.hidden, cfg.time_dim)),
                       (f"{TIME}.linear_2.weight", (cfg.hidden, cfg.hidden))):
        g.expect(key, shape)
    emb = timestep_embedding(g, g.op("Mul", t, g.const(np.array(1000.0, np.float32))), cfg.time_dim)
    temb = g.linear(g.silu(g.linear(emb, f"{TIME}.linear_1")), f"{TIME}.linear_2")
    act = g.silu(temb)
    g.widths[act] = cfg.hidden
    rope = rope_tables(g, g.op("Concat", txt_ids, img_ids, axis=0), cfg)
    x = g.linear(img, "img_in")
    c = g.rms_norm(txt, "txt_norm", cfg.eps)
    g.widths[c] = cfg.context_dim
    c = g.linear(c, "txt_in")
    bias = joint_bias(g, mask, img)
    txt_len = g.op("Shape", txt, start=1, end=2)
    for i in range(cfg.depth):
        x, c = block(g, x, c, i, act, rope, bias, txt_len, cfg)
    scale, shift = (g.op("Unsqueeze", v, g.ints(1)) for v in g.linear_rows(act, "norm_out.linear", [cfg.hidden] * 2))
    out = g.linear(modulate(g, x, shift, scale, cfg), "proj_out")
    g.output(out, "out_hidden_states", g.dtype, ["batch", "image_tokens", cfg.out_channels])
