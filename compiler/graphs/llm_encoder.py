"""A decoder-only LLM read as a text encoder (Qwen3 for Z-Image and FLUX.2 klein, Qwen2.5-VL's text model for
Qwen-Image, Mistral's), HF `Qwen3Model` / `LlamaModel`-style names (`embed_tokens`, `layers.N.self_attn.q_proj`, ...).

Owns: the encoder graph and its config from shapes: width and vocabulary from the token table, depth from the
layers, KV heads from k_proj's rows, the head width from q_norm (Qwen3) or the config (head_dim, else
hidden / heads, else 128), q/k/v biases (Qwen2.5) and QK norms (Qwen3) from the names, the MLP width from
gate_proj; RoPE theta from the config (rope_theta, or rope_parameters.rope_theta) else the family's; a VL model's
config (Qwen2.5-VL's) is read through its text_config.
Each layer: x += o(attn(RMS(x))), attention over q, k (RMS-normed per head where the model has q_norm /
k_norm) turned by RoPE (rotate-half, positions 0..S-1), K/V heads shared by heads / kv_heads queries
each (GQA), a causal mask and a key mask from attention_mask (1 = real token); a query that may see no key (a
left-padded prompt's padding: FLUX.2 dev's Mistral) attends to nothing, its attention output 0, as torch's SDPA
gives it (transformers' default; the FLUX.2 transformer reads those rows too); x += down(silu(gate(h)) *
up(h)) with h = RMS(x). Only the hidden states a family reads are computed (transformers' `hidden_states`
indices: 0 = the embeddings, i = the output of layer i - 1, `layers` = the final norm's output, negative
counted from the end): layers past the deepest one read are not in the graph (their weights are skipped).
IO: input_ids int32 [batch, llm_sequence], attention_mask int32 [batch, llm_sequence] -> hidden_states
float32 [batch, llm_sequence, reads x width] (the states read, concatenated on the last axis in the order read).
Precision: the residual stream, norms, RoPE, scores and softmax in fp32; the output always fp32 (LLM residual
streams carry activations past fp16's range).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from onnx import TensorProto

from ..errors import BadInput
from ..sources.config_fields import field
from .onnx_graph import FLOAT, INT32, Graph

LAYER = "layers.{}"
DEFAULT_HEAD_DIM = 128      # every released Qwen / Mistral text model's


@dataclass(frozen=True)
class LLMConfig:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int                     # layers in the checkpoint
    reads: tuple[int, ...]          # transformers' hidden_states indices read, each in 0..layers
    theta: float
    eps: float = 1e-6
    qk_norm: bool = False           # Qwen3
    qkv_bias: bool = False          # Qwen2.5

    @property
    def run(self) -> int:
        """Layers the graph runs: up to the deepest hidden state read."""
        return min(max(self.reads), self.layers)

    def describe(self) -> dict:
        return {**asdict(self), "hidden_name": "hidden_states"}


def _theta(config_json: dict, default: float, where: str) -> float:
    params = config_json.get("rope_parameters") if isinstance(config_json.get("rope_parameters"), dict) else {}
    kind = params.get("rope_type") or (config_json.get("rope_scaling") or {}).get("rope_type") or "default"
    if kind not in ("default", "mrope"):     # mrope with one position per token (text only) is plain RoPE
        raise BadInput(f"{where}: rope_type {kind!r} is not supported yet (default RoPE)")
    return float(field(params, "rope_theta", "positive", None, where) or
                 field(config_json, "rope_theta", "positive", default, where))


def llm_config(g: Graph, config_json: dict, overrides: dict, reads: tuple[int, ...] = (-1,),
               theta: float = 1e6, eps: float = 1e-6) -> LLMConfig:
    """`reads`: the family's hidden_states indices (e.g. Z-Image's (-2,)); `theta`, `eps`: its encoder's defaults
    (a split file carries no config)."""
    if not g.has("embed_tokens.weight") or not g.has("layers.0.self_attn.q_proj.weight"):
        raise BadInput(f"{g.ckpt.path}: no LLM text encoder under {g.prefix} (looked for embed_tokens.weight and "
                       "layers.0.self_attn.q_proj.weight); is it the model's text encoder?")
    where = f"{g.ckpt.path} {g.name}/config.json"
    if isinstance(config_json.get("text_config"), dict):     # a VL model's config (Qwen2.5-VL): its text model's
        config_json = {**config_json, **config_json["text_config"]}
    vocab, hidden = g.shape("embed_tokens.weight")
    q_rows = g.shape("layers.0.self_attn.q_proj.weight")[0]
    k_rows = g.shape("layers.0.self_attn.k_proj.weight")[0]
    qk_norm = g.has("layers.0.self_attn.q_norm.weight")
    if qk_norm:
        head_dim = g.shape("layers.0.self_attn.q_norm.weight")[0]
    elif overrides.get("head_dim") or overrides.get("num_heads"):     # --set: what a split file cannot say
        head_dim = int(overrides.get("head_dim") or q_rows // overrides["num_heads"])
    elif field(config_json, "head_dim", "count", None, where):
        head_dim = config_json["head_dim"]
    elif field(config_json, "num_attention_heads", "count", None, where):
        head_dim = hidden // config_json["num_attention_heads"]
    else:
        head_dim = DEFAULT_HEAD_DIM
    if head_dim < 1 or q_rows % head_dim or k_rows % head_dim or (q_rows // head_dim) % max(k_rows // head_dim, 1):
        raise BadInput(f"{g.ckpt.path}: {g.prefix}layers.0.self_attn q_proj / k_proj have {q_rows} / {k_rows} rows, "
                       f"which do not split into {head_dim}-wide query heads sharing key heads; the file is damaged "
                       f"or its heads are not {head_dim} wide (pass --set {g.name}.head_dim=N)")
    layers = g.count(LAYER)
    want = tuple(overrides.get("reads") or reads)
    resolved = tuple(r % (layers + 1) if -(layers + 1) <= r <= layers else None for r in want)
    if None in resolved or not resolved:
        raise BadInput(f"{g.ckpt.path}: the {g.name} has {layers} layers; hidden states {list(want)} are not among "
                       f"its {layers + 1} (0..{layers}, or negative from the end)")
    return LLMConfig(vocab=vocab, hidden=hidden, heads=q_rows // head_dim, kv_heads=k_rows // head_dim,
                     head_dim=head_dim, intermediate=g.shape("layers.0.mlp.gate_proj.weight")[0], layers=layers,
                     reads=resolved, theta=float(overrides.get("theta") or _theta(config_json, theta, where)),
                     eps=float(field(config_json, "rms_norm_eps", "positive", eps, where)), qk_norm=qk_norm,
                     qkv_bias=g.has("layers.0.self_attn.q_proj.bias"))


def inverse_frequencies(theta: float, d: int) -> np.ndarray:
    """transformers' default RoPE frequencies in fp32, 1 / theta ** (2i / d), the power taken in float64 and
    rounded once: numpy's float32 power differs in the last bit between its AVX2 and AVX-512 code, which made
    the exported constants (and an export's bytes) depend on the CPU that ran the export."""
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    return np.float32(1.0) / (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)


def rope_tables(g: Graph, ids: str, cfg: LLMConfig) -> tuple[str, str]:
    """cos and sin [S, head_dim] fp32 for positions 0..S-1 (transformers' default RoPE: inverse frequencies
    in fp32, angles = position * frequency in fp32, each repeated for both halves)."""
    inv = inverse_frequencies(cfg.theta, cfg.head_dim)
    length = g.op("Squeeze", g.op("Shape", ids, start=1, end=2), g.ints(0))
    pos = g.op("Cast", g.op("Range", g.const(np.array(0, np.int64)), length, g.const(np.array(1, np.int64))), to=FLOAT)
    angles = g.op("Mul", g.op("Unsqueeze", pos, g.ints(1)), g.const(inv.astype(np.float32)[None, :], hint="rope_freqs"))
    angles = g.op("Concat", angles, angles, axis=-1)
    return g.op("Cos", angles), g.op("Sin", angles)


def rotate(g: Graph, x: str, cos: str, sin: str, d: int) -> str:
    """x * cos + rotate_half(x) * sin on fp32 x [B, heads, S, d] (rotate_half: [-x2, x1])."""
    x1, x2 = g.op("Split", x, axis=-1, num_outputs=2, outputs=2)
    half = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", half, sin))


def attention_bias(g: Graph, ids: str, mask: str) -> tuple[str, str]:
    """[B, 1, S, S] fp32: 0 where query i may see key j (j <= i and key j real), else fp32's lowest; and
    [B, S, 1] in the graph's precision: 1 where query i sees some key, else 0 (its attention output is 0: torch
    SDPA's)."""
    length = g.op("Squeeze", g.op("Shape", ids, start=1, end=2), g.ints(0))
    pos = g.op("Range", g.const(np.array(0, np.int64)), length, g.const(np.array(1, np.int64)))
    causal = g.op("LessOrEqual", g.op("Unsqueeze", pos, g.ints(0)), g.op("Unsqueeze", pos, g.ints(1)))   # [q, k]: k <= q
    real = g.op("Unsqueeze", g.op("Cast", mask, to=TensorProto.BOOL), g.ints(1, 2))                 # [B, 1, 1, S]
    allowed = g.op("And", g.op("Unsqueeze", causal, g.ints(0, 1)), real)
    sees = g.op("Squeeze", g.op("ReduceMax", g.op("Cast", allowed, to=FLOAT), g.ints(-1), keepdims=1), g.ints(1))
    return g.op("Where", allowed, g.const(np.array(0.0, np.float32)),
                g.const(np.array(np.finfo(np.float32).min, np.float32))), g.from_fp32(sees)


def _heads(g: Graph, x: str, module: str, heads: int, cfg: LLMConfig, norm: str | None) -> str:
    """Linear -> [B, heads, S, head_dim], RMS-normed per head (fp32) where the model has the norm."""
    y = g.op("Reshape", g.linear(x, module, bias=None), g.ints(0, 0, heads, cfg.head_dim))
    if norm is not None:
        g.expect(f"{norm}.weight", (cfg.head_dim,), "one scale per head channel")
        y = g.rms_norm(y, norm, cfg.eps, fp32_out=True)
    return g.op("Transpose", g.to_fp32(y), perm=[0, 2, 1, 3])


def _repeat_kv(g: Graph, x: str, cfg: LLMConfig) -> str:
    """[B, kv_heads, S, d] -> [B, heads, S, d]: each KV head serves heads / kv_heads query heads in turn."""
    rep = cfg.heads // cfg.kv_heads
    if rep == 1:
        return x
    y = g.op("Unsqueeze", x, g.ints(2))
    shape = g.op("Shape", y)
    target = g.op("Concat", g.op("Slice", shape, g.ints(0), g.ints(2)), g.ints(rep),
                  g.op("Slice", shape, g.ints(3), g.ints(5)), axis=0)
    return g.op("Reshape", g.op("Expand", y, target), g.ints(0, cfg.heads, -1, cfg.head_dim))


def layer(g: Graph, x: str, i: int, rope: tuple[str, str], bias: tuple[str, str], cfg: LLMConfig) -> str:
    p = LAYER.format(i)
    a = f"{p}.self_attn"
    inner, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for n, rows in (("q_proj", inner), ("k_proj", kv), ("v_proj", kv)):
        g.expect(f"{a}.{n}.weight", (rows, cfg.hidden), "attention projection [heads x head_dim, width]")
    g.expect(f"{a}.o_proj.weight", (cfg.hidden, inner), "attention output [width, heads x head_dim]")
    for n in ("gate_proj", "up_proj"):
        g.expect(f"{p}.mlp.{n}.weight", (cfg.intermediate, cfg.hidden), "MLP input [intermediate, width]")
    g.expect(f"{p}.mlp.down_proj.weight", (cfg.hidden, cfg.intermediate), "MLP output [width, intermediate]")
    h = g.rms_norm(x, f"{p}.input_layernorm", cfg.eps)
    q = _heads(g, h, f"{a}.q_proj", cfg.heads, cfg, f"{a}.q_norm" if cfg.qk_norm else None)
    k = _heads(g, h, f"{a}.k_proj", cfg.kv_heads, cfg, f"{a}.k_norm" if cfg.qk_norm else None)
    v = g.op("Transpose", g.op("Reshape", g.linear(h, f"{a}.v_proj", bias=None), g.ints(0, 0, cfg.kv_heads, cfg.head_dim)),
             perm=[0, 2, 1, 3])
    q, k = (g.from_fp32(rotate(g, t, *rope, cfg.head_dim)) for t in (q, k))
    att = g.merge_heads(g.sdpa(q, _repeat_kv(g, k, cfg), _repeat_kv(g, v, cfg), cfg.head_dim ** -0.5, bias[0]), inner)
    att = g.op("Mul", att, bias[1])
    x = g.op("Add", x, g.to_fp32(g.linear(att, f"{a}.o_proj", bias=None)))
    h = g.rms_norm(x, f"{p}.post_attention_layernorm", cfg.eps)
    mlp = g.op("Mul", g.silu(g.linear(h, f"{p}.mlp.gate_proj", bias=False)), g.linear(h, f"{p}.mlp.up_proj", bias=False))
    g.widths[mlp] = cfg.intermediate
    return g.op("Add", x, g.to_fp32(g.linear(mlp, f"{p}.mlp.down_proj", bias=False)))


def build_llm_encoder(g: Graph, cfg: LLMConfig) -> None:
    ids = g.input("input_ids", INT32, ["batch", "llm_sequence"])
    mask = g.input("attention_mask", INT32, ["batch", "llm_sequence"])
    x = g.to_fp32(g.op("Gather", g.param("embed_tokens.weight"),
                       g.op("Min", ids, g.const(np.array(cfg.vocab - 1, np.int32))), axis=0))
    g.widths[x] = cfg.hidden
    if g.dtype != FLOAT:
        g.notes.append("residual stream and output in fp32")
    rope, bias = rope_tables(g, ids, cfg), attention_bias(g, ids, mask)
    states = {0: x}
    for i in range(cfg.run):
        x = states[i + 1] = layer(g, x, i, rope, bias, cfg)
    if cfg.layers in cfg.reads:
        states[cfg.layers] = g.rms_norm(x, "norm", cfg.eps, fp32_out=True)
    else:
        g.skip(["norm.weight"])
    g.skip([k[len(g.prefix):] for i in range(cfg.run, cfg.layers)
            for k in g.ckpt.with_prefix(g.prefix + LAYER.format(i) + ".")])
    read = [states[r] for r in cfg.reads]
    out = read[0] if len(read) == 1 else g.op("Concat", *read, axis=-1)
    g.output(out, "hidden_states", FLOAT, ["batch", "llm_sequence", cfg.hidden * len(read)])
