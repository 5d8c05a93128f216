"""CLIP text encoder (HF layout: `embeddings.*`, `encoder.layers.N.*`, `final_layer_norm`).

Owns: the text-encoder graph and its config inferred from tensor shapes. Inputs/outputs follow
optimum: input_ids -> last_hidden_state, pooler_output. Heads are not in the weights: CLIP
uses 64-wide heads (CLIP-L 12, OpenCLIP-H 16, bigG 20); a diffusers folder's config.json or an
override (`text_encoder.num_heads`) says otherwise.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from .onnx_graph import INT32, Graph


@dataclass(frozen=True)
class ClipTextConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    activation: str = "quick_gelu"   # quick_gelu (CLIP-L) | gelu (OpenCLIP)
    eps: float = 1e-5
    eos_token_id: int = 49407        # pooled output = hidden state at the first EOS
    skip_layers: int = 0             # clip skip: 0 = last layer
    final_norm: bool = True

    def describe(self) -> dict:
        return asdict(self)


def clip_text_config(g: Graph, config_json: dict, overrides: dict) -> ClipTextConfig:
    vocab, hidden = g.shape("embeddings.token_embedding.weight")
    layers = 0
    while g.has(f"encoder.layers.{layers}.layer_norm1.weight"):
        layers += 1
    if layers == 0:
        raise BadInput(f"{g.ckpt.path}: text encoder has no encoder.layers.0.* tensors")
    heads = overrides.get("num_heads") or config_json.get("num_attention_heads") or max(1, hidden // 64)
    if hidden % int(heads):
        raise BadInput(f"text_encoder.num_heads={heads} does not divide the hidden size {hidden}")
    eos = config_json.get("eos_token_id", 49407)
    return ClipTextConfig(
        vocab=vocab, hidden=hidden, layers=layers, heads=int(heads),
        intermediate=g.shape("encoder.layers.0.mlp.fc1.weight")[0],
        max_positions=g.shape("embeddings.position_embedding.weight")[0],
        activation=overrides.get("activation") or config_json.get("hidden_act", "quick_gelu"),
        eps=float(config_json.get("layer_norm_eps", 1e-5)),
        eos_token_id=int(overrides.get("eos_token_id", eos)),
        skip_layers=int(overrides.get("clip_skip", 1)) - 1)


def _causal_mask(n: int) -> np.ndarray:
    return np.triu(np.full((n, n), np.finfo(np.float32).min, dtype=np.float32), k=1)


def build_clip_text(g: Graph, cfg: ClipTextConfig) -> None:
    ids = g.input("input_ids", INT32, ["batch", "sequence"])
    seq = g.op("Shape", ids, start=1, end=2)
    zero = g.ints(0)
    x = g.op("Gather", g.param("embeddings.token_embedding.weight"), ids, axis=0)
    pos = g.op("Slice", g.param("embeddings.position_embedding.weight"), zero, seq, zero)
    x = g.op("Add", x, pos)
    mask = g.op("Slice", g.const(_causal_mask(cfg.max_positions), hint="causal_mask"),
                g.ints(0, 0), g.op("Concat", seq, seq, axis=0), g.ints(0, 1))
    act = g.quick_gelu if cfg.activation == "quick_gelu" else g.gelu
    if cfg.activation not in ("quick_gelu", "gelu"):
        raise BadInput(f"text encoder activation {cfg.activation!r} is not supported (quick_gelu, gelu)")
    for i in range(cfg.layers):
        p = f"encoder.layers.{i}"
        if i >= cfg.layers - cfg.skip_layers:
            for name in ("layer_norm1", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.out_proj", "layer_norm2", "mlp.fc1", "mlp.fc2"):
                g.param(f"{p}.{name}.weight"), g.param(f"{p}.{name}.bias")  # skipped layers still belong here
            continue
        h = g.layer_norm(x, f"{p}.layer_norm1", cfg.eps)
        q, k, v = (g.linear(h, f"{p}.self_attn.{n}_proj") for n in "qkv")
        a = g.attention(q, k, v, cfg.heads, cfg.hidden, mask=mask)
        x = g.op("Add", x, g.linear(a, f"{p}.self_attn.out_proj"))
        h = act(g.linear(g.layer_norm(x, f"{p}.layer_norm2", cfg.eps), f"{p}.mlp.fc1"))
        x = g.op("Add", x, g.linear(h, f"{p}.mlp.fc2"))
    last = g.layer_norm(x, "final_layer_norm", cfg.eps) if cfg.final_norm else x
    if not cfg.final_norm:
        g.param("final_layer_norm.weight", fp32=True), g.param("final_layer_norm.bias", fp32=True)
    if cfg.eos_token_id == 2:  # transformers' legacy rule: EOS is the largest id
        eos_pos = g.op("ArgMax", ids, axis=1, keepdims=1)
    else:
        is_eos = g.cast(g.op("Equal", ids, g.const(np.array(cfg.eos_token_id, np.int32))), INT32)
        eos_pos = g.op("ArgMax", is_eos, axis=1, keepdims=1)
    pooled = g.op("GatherND", last, eos_pos, batch_dims=1)
    g.output(last, "last_hidden_state", g.dtype, ["batch", "sequence", cfg.hidden])
    g.output(pooled, "pooler_output", g.dtype, ["batch", cfg.hidden])
