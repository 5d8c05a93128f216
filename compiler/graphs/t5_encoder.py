"""T5 v1.1 encoder (T5-XXL: the text encoder of Flux, Chroma and SD3), HF `T5EncoderModel` names.

Owns: the encoder graph and its config from shapes (FAMILIES_DIT.md §4): width from the token
table, heads from block 0's relative-attention table [buckets, heads], depth from the blocks,
gated-GELU (`wi_0`, `wi_1`) or ReLU (`wi`) feed-forward from the names. Each block:
x += o(attn(RMS(x))) with no 1/sqrt(d) scaling and block 0's relative position bias shared by
every layer; x += wo(gelu_tanh(wi_0(RMS(x))) * wi_1(RMS(x))); a final RMS norm.
IO: input_ids int32 [batch, t5_sequence] (+ attention_mask int32, 1 = real token, when the family
runs T5 with its mask: Chroma) -> last_hidden_state.

Precision: norms, scores and softmax in fp32; in fp16/bf16 exports the residual stream stays fp32
(activations only) and, in fp16, the FFN output projection `wo` -- whose outputs pass 65504 in
T5-XXL -- reads its input scaled by 1/32 and its output is scaled back in fp32 (the weights stay
fp16), so nothing overflows where diffusers/transformers keep `wo` in fp32.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from ..sources.config_fields import field
from .onnx_graph import FLOAT, FLOAT16, INT32, Graph

WO_SCALE = 32.0          # fp16: wo's input is divided by this and its fp32 output multiplied back


@dataclass(frozen=True)
class T5Config:
    vocab: int
    d_model: int
    heads: int
    d_kv: int
    d_ff: int
    layers: int
    gated: bool = True                 # wi_0/wi_1 (v1.1) or wi (v1.0)
    buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6
    mask_input: bool = False           # attention_mask input (Chroma runs T5 with its mask)
    table: str = "shared.weight"       # where the token table is (shared.weight or encoder.embed_tokens.weight)

    def describe(self) -> dict:
        return {**asdict(self), "hidden": self.d_model}


BLOCK = "encoder.block.{}"


def t5_config(g: Graph, config_json: dict, overrides: dict, mask_input: bool = False) -> T5Config:
    table = next((t for t in ("shared.weight", "encoder.embed_tokens.weight") if g.has(t)), None)
    if table is None or not g.has("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"):
        raise BadInput(f"{g.ckpt.path}: no T5 encoder under {g.prefix} (looked for shared.weight and "
                       "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight); is it a T5 file?")
    vocab, d_model = g.shape(table)
    buckets, heads = g.shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    inner = g.shape("encoder.block.0.layer.0.SelfAttention.q.weight")[0]
    if inner % heads:
        raise BadInput(f"{g.ckpt.path}: T5 query width {inner} does not split into the {heads} heads its "
                       "relative-attention table has; the file is damaged")
    gated = g.has("encoder.block.0.layer.1.DenseReluDense.wi_0.weight")
    wi = "wi_0" if gated else "wi"
    where = f"{g.ckpt.path} {g.name}/config.json"
    act = config_json.get("dense_act_fn") or ("gelu_new" if gated else "relu")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "relu"):
        raise BadInput(f"{where}: dense_act_fn {act!r} is not supported (gelu_new, relu)")
    return T5Config(vocab=vocab, d_model=d_model, heads=heads, d_kv=inner // heads,
                    d_ff=g.shape(f"encoder.block.0.layer.1.DenseReluDense.{wi}.weight")[0],
                    layers=g.count(BLOCK), gated=gated, buckets=buckets,
                    max_distance=int(field(config_json, "relative_attention_max_distance", "count", 128, where)),
                    eps=float(field(config_json, "layer_norm_epsilon", "positive", 1e-6, where)),
                    mask_input=mask_input, table=table)


def relative_buckets(cfg: T5Config) -> np.ndarray:
    """Bucket of each relative position rel = key - query in [-max_distance, max_distance]
    (bidirectional: half the buckets for each sign; exact below max_exact, logarithmic above,
    saturating at max_distance), computed in float32 in the order transformers computes it, so the
    boundaries (|rel| = 16, 32, 64) land where the reference puts them."""
    half = cfg.buckets // 2
    exact = half // 2
    rel = np.arange(-cfg.max_distance, cfg.max_distance + 1, dtype=np.int64)
    n = np.abs(rel)
    with np.errstate(divide="ignore"):
        large = (np.log(n.astype(np.float32) / np.float32(exact)) / np.float32(math.log(cfg.max_distance / exact))
                 * np.float32(half - exact))
    large = exact + np.where(n < exact, 0, large).astype(np.int64)
    large = np.minimum(large, half - 1)
    return ((rel > 0) * half + np.where(n < exact, n, large)).astype(np.int64)


def position_bias(g: Graph, ids: str, cfg: T5Config) -> str:
    """[1, heads, L, L] fp32 bias from block 0's relative-attention table, for the run's length."""
    length = g.op("Squeeze", g.op("Shape", ids, start=1, end=2), g.ints(0))
    pos = g.op("Range", g.const(np.array(0, np.int64)), length, g.const(np.array(1, np.int64)))
    rel = g.op("Sub", g.op("Unsqueeze", pos, g.ints(0)), g.op("Unsqueeze", pos, g.ints(1)))   # [q, k] = k - q
    rel = g.op("Clip", rel, g.const(np.array(-cfg.max_distance, np.int64)), g.const(np.array(cfg.max_distance, np.int64)))
    idx = g.op("Add", rel, g.const(np.array(cfg.max_distance, np.int64)))
    bucket = g.op("Gather", g.const(relative_buckets(cfg), hint="t5_buckets"), idx, axis=0)
    table = g.param("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", fp32=True)
    bias = g.op("Gather", table, bucket, axis=0)                                                 # [L, L, heads]
    return g.op("Unsqueeze", g.op("Transpose", bias, perm=[2, 0, 1]), g.ints(0))


def _ffn(g: Graph, h: str, p: str, cfg: T5Config) -> str:
    """Feed-forward on the normed input; returns the fp32 output to add to the residual."""
    if cfg.gated:
        a = g.gelu_tanh(g.linear(h, f"{p}.wi_0", bias=False))
        inner = g.op("Mul", a, g.linear(h, f"{p}.wi_1", bias=False))
    else:
        inner = g.op("Relu", g.linear(h, f"{p}.wi", bias=False))
        g.widths[inner] = cfg.d_ff
    if g.dtype != FLOAT16:
        return g.to_fp32(g.linear(inner, f"{p}.wo", bias=False))
    scaled = g.op("Mul", inner, g.scalar(1.0 / WO_SCALE))
    return g.op("Mul", g.to_fp32(g.linear(scaled, f"{p}.wo", bias=False)), g.scalar(WO_SCALE, FLOAT))


def build_t5_encoder(g: Graph, cfg: T5Config) -> None:
    inner = cfg.heads * cfg.d_kv
    ids = g.input("input_ids", INT32, ["batch", "t5_sequence"])
    x = g.to_fp32(g.op("Gather", g.param(cfg.table), g.op("Min", ids, g.const(np.array(cfg.vocab - 1, np.int32))),
                       axis=0))
    g.widths[x] = cfg.d_model
    bias = position_bias(g, ids, cfg)
    if cfg.mask_input:
        mask = g.input("attention_mask", INT32, ["batch", "t5_sequence"])
        masked = g.op("Mul", g.op("Sub", g.const(np.array(1.0, np.float32)), g.cast(mask, FLOAT)),
                      g.const(np.array(np.finfo(np.float32).min, np.float32)))
        bias = g.op("Add", bias, g.op("Unsqueeze", masked, g.ints(1, 2)))                  # [B, heads, L, L]
    if g.dtype != FLOAT:
        g.notes.append("residual stream in fp32" + (f"; wo reads its input / {WO_SCALE:g} (fp16 range)"
                                                     if g.dtype == FLOAT16 else ""))
    for i in range(cfg.layers):
        p = BLOCK.format(i)
        a = f"{p}.layer.0.SelfAttention"
        for n in "qkv":
            g.expect(f"{a}.{n}.weight", (inner, cfg.d_model), "T5 attention projection [heads * d_kv, d_model]")
        g.expect(f"{a}.o.weight", (cfg.d_model, inner), "T5 attention output [d_model, heads * d_kv]")
        ff = f"{p}.layer.1.DenseReluDense"
        for n in (("wi_0", "wi_1") if cfg.gated else ("wi",)):
            g.expect(f"{ff}.{n}.weight", (cfg.d_ff, cfg.d_model), "T5 feed-forward input [d_ff, d_model]")
        g.expect(f"{ff}.wo.weight", (cfg.d_model, cfg.d_ff), "T5 feed-forward output [d_model, d_ff]")
        h = g.rms_norm(x, f"{p}.layer.0.layer_norm", cfg.eps)
        q, k, v = (g.split_heads(g.linear(h, f"{a}.{n}", bias=False), cfg.heads, cfg.d_kv) for n in "qkv")
        att = g.merge_heads(g.sdpa(q, k, v, None, bias), inner)
        x = g.op("Add", x, g.to_fp32(g.linear(att, f"{a}.o", bias=False)))
        x = g.op("Add", x, _ffn(g, g.rms_norm(x, f"{p}.layer.1.layer_norm", cfg.eps), f"{p}.layer.1.DenseReluDense", cfg))
    out = g.rms_norm(x, "encoder.final_layer_norm", cfg.eps)
    g.output(out, "last_hidden_state", g.dtype, ["batch", "t5_sequence", cfg.d_model])
    if cfg.table == "shared.weight" and g.has("encoder.embed_tokens.weight"):
        g.skip(["encoder.embed_tokens.weight"])     # the tied copy some saves carry
