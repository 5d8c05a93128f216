"""CLIP text encoders: HF layout (`embeddings.*`, `encoder.layers.N.*`) and OpenCLIP layout
(`token_embedding`, `transformer.resblocks.N.*` with fused `attn.in_proj_weight`).

Owns: the text-encoder graph for every family, its config inferred from tensor shapes, and the
hidden state and pooled output each `use` reads (a family's choice, compiler/families/; SD 1.x: last
layer + final LayerNorm; SD 2.x: penultimate + final LayerNorm; SDXL: penultimate without it, plus
bigG's projected pooled output; SD3: the penultimate of CLIP-L and CLIP-G, both with projected pooled
outputs). SDXL's and SD3's encoders
output what transformers' CLIPTextModel(WithProjection) returns with output_hidden_states=True, in
optimum's ONNX order: [text_embeds,] last_hidden_state[, pooler_output], hidden_states.0 .. hidden_states.N
(N + 1 of them: the embeddings, then each layer's output), so optimum's and optimum-intel's SDXL / SD3
pipelines and OpenVINO GenAI index them as they index optimum's own export; precast's runtime reads the
one the config names (`hidden_name`, the penultimate unless clip_skip says otherwise). The fused
OpenCLIP q/k/v projection is bound as one weight and split in the graph, not copied around.
Heads are not in the weights: CLIP uses 64-wide heads; a diffusers folder's config.json or an
override (`text_encoder.num_heads`) says otherwise.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import BadInput
from ..sources.config_fields import field
from onnx import helper

from .onnx_graph import INT32, NP_OF, Graph

# Parameter names per layout: (token table, position table, final norm, layer prefix format).
LAYOUTS = {
    "hf": dict(tok="embeddings.token_embedding.weight", pos="embeddings.position_embedding.weight",
               final="final_layer_norm", layer="encoder.layers.{}", ln1="layer_norm1", ln2="layer_norm2",
               out="self_attn.out_proj", fc1="mlp.fc1", fc2="mlp.fc2", proj="text_projection.weight"),
    "openclip": dict(tok="token_embedding.weight", pos="positional_embedding", final="ln_final",
                     layer="transformer.resblocks.{}", ln1="ln_1", ln2="ln_2", out="attn.out_proj",
                     fc1="mlp.c_fc", fc2="mlp.c_proj", proj="text_projection"),
}


@dataclass(frozen=True)
class ClipTextConfig:
    layout: str                      # hf | openclip
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    activation: str = "quick_gelu"   # quick_gelu (CLIP-L) | gelu (OpenCLIP)
    eps: float = 1e-5
    eos_token_id: int = 49407        # pooled output = hidden state at the first EOS
    hidden_layer: int = 0            # whose output the UNet reads (1-based; layers = last)
    hidden_norm: bool = True         # final LayerNorm on that output
    hidden_name: str = "last_hidden_state"
    pooled: str = "pooler_output"    # pooler_output (from the hidden output) | text_embeds (last layer, projected) | none
    projection: int = 0              # text_embeds width (0: no projected output)
    all_hidden_states: bool = False  # every layer's output too, laid out as optimum's export (SDXL, SD3)

    def describe(self) -> dict:
        return asdict(self)


def detect_layout(g: Graph) -> str:
    if g.has(LAYOUTS["openclip"]["tok"]):
        return "openclip"
    if g.has(LAYOUTS["hf"]["tok"]):
        return "hf"
    raise BadInput(f"{g.ckpt.path}: no text-encoder token embedding under {g.prefix} "
                   "(looked for embeddings.token_embedding.weight and token_embedding.weight)")


def clip_text_config(g: Graph, config_json: dict, overrides: dict, use: str = "last",
                     openai: bool = True) -> ClipTextConfig:
    """`use` (the family's, compiler/families/): "last" -- the last layer + final LayerNorm, pooler_output
    (SD 1.x, Flux); "penultimate" -- the penultimate layer + final LayerNorm (SD 2.x); "states" -- every
    hidden state, the penultimate un-normalised read, no pooled output (SDXL's CLIP-L); "states+pooled" --
    the same plus the projected text_embeds (SDXL's bigG, SD3's CLIP-L and CLIP-G). `openai`: OpenAI's CLIP
    (quick_gelu where the config does not say), else OpenCLIP's (gelu)."""
    layout = detect_layout(g)
    L = LAYOUTS[layout]
    vocab, hidden = g.shape(L["tok"])
    layers = 0
    while g.has(f"{L['layer'].format(layers)}.{L['ln1']}.weight"):
        layers += 1
    if layers == 0:
        raise BadInput(f"{g.ckpt.path}: text encoder under {g.prefix} has no layers")
    where = f"{g.ckpt.path} {g.name}/config.json"
    every = False
    heads = overrides.get("num_heads") or field(config_json, "num_attention_heads", "count", max(1, hidden // 64), where)
    if hidden % int(heads):
        raise BadInput(f"text_encoder.num_heads={heads} does not divide the hidden size {hidden}")
    default_act = "quick_gelu" if layout == "hf" and openai else "gelu"
    # SD 2.x single files hold all 24 OpenCLIP layers and use the penultimate; diffusers folders
    # already dropped the last one. SDXL reads the penultimate of both encoders, un-normalised.
    if use == "penultimate":
        hidden_layer, norm, name, pooled = (layers - 1 if layout == "openclip" else layers), True, \
            "last_hidden_state", "pooler_output"
    elif use in ("states", "states+pooled"):
        hidden_layer, norm, name = layers - 1, False, f"hidden_states.{layers - 1}"
        pooled = "text_embeds" if use == "states+pooled" else "none"
        every = True
    else:
        hidden_layer, norm, name, pooled = layers, True, "last_hidden_state", "pooler_output"
    skip = int(overrides.get("clip_skip", 1)) - 1
    if skip:
        hidden_layer -= skip
        if not 1 <= hidden_layer <= layers:
            raise BadInput(f"text_encoder.clip_skip={skip + 1}: the encoder has {layers} layers")
        if every:
            name = f"hidden_states.{hidden_layer}"
    return ClipTextConfig(
        layout=layout, vocab=vocab, hidden=hidden, layers=layers, heads=int(heads),
        intermediate=g.shape(f"{L['layer'].format(0)}.{L['fc1']}.weight")[0], max_positions=g.shape(L["pos"])[0],
        activation=overrides.get("activation") or config_json.get("hidden_act") or default_act,
        eps=float(field(config_json, "layer_norm_eps", "positive", 1e-5, where)),
        eos_token_id=int(overrides.get("eos_token_id", field(config_json, "eos_token_id", "index", None, where) or 49407)),
        hidden_layer=hidden_layer, hidden_norm=norm, hidden_name=name, pooled=pooled,
        projection=_projection_width(g, L, layout) if pooled == "text_embeds" else 0, all_hidden_states=every)


def _projection_width(g: Graph, L: dict, layout: str) -> int:
    if not g.has(L["proj"]):
        raise BadInput(f"{g.ckpt.path}: no {g.prefix}{L['proj']}: this model reads the text encoder's projected pooled "
                       "output (CLIPTextModelWithProjection); give the encoder with its text_projection")
    shape = g.shape(L["proj"])
    return shape[0] if layout == "hf" else shape[-1]


def _causal_mask(n: int) -> np.ndarray:
    return np.triu(np.full((n, n), np.finfo(np.float32).min, dtype=np.float32), k=1)


def _qkv(g: Graph, h: str, p: str, cfg: ClipTextConfig) -> tuple[str, str, str]:
    if cfg.layout == "hf":
        return tuple(g.linear(h, f"{p}.self_attn.{n}_proj") for n in "qkv")
    # OpenCLIP: one fused [3d, d] projection (rows q | k | v), split after the MatMul
    fused = g.op("Add", g.op("MatMul", h, g.op("Transpose", g.param(f"{p}.attn.in_proj_weight"), perm=[1, 0])),
                 g.param(f"{p}.attn.in_proj_bias"))
    return tuple(g.op("Split", fused, axis=-1, num_outputs=3, outputs=3))


def _layer_keys(g: Graph, p: str) -> list[str]:
    return [k[len(g.prefix):] for k in g.ckpt.refs if k.startswith(f"{g.prefix}{p}.")]


def _eos_position(g: Graph, ids: str, cfg: ClipTextConfig) -> str:
    if cfg.eos_token_id == 2:  # transformers' legacy rule: EOS is the largest id
        return g.op("ArgMax", ids, axis=1, keepdims=1)
    is_eos = g.cast(g.op("Equal", ids, g.const(np.array(cfg.eos_token_id, np.int32))), INT32)
    return g.op("ArgMax", is_eos, axis=1, keepdims=1)


EXTRA_TOKENS_INPUT = "token_embeddings_extra"


def _token_embeddings(g: Graph, ids: str, table: str, cfg: ClipTextConfig) -> str:
    """Token lookup with room for textual-inversion vectors supplied at run time: ids below the
    vocabulary read the table, ids vocab + k read row k of the `token_embeddings_extra` input
    ([rows >= 1, hidden]; the runtime always appends one zero row, so it is never empty; in the
    exported ONNX it defaults to that one zero row, so other tools may leave it out).
    Two Gathers and a Where: the table itself is never copied per call."""
    extra = g.input(EXTRA_TOKENS_INPUT, g.dtype, ["extra_tokens", cfg.hidden])
    # its default, one zero row: tools that feed input_ids alone run it as is (ONNX Runtime reads an
    # input with an initializer as optional). precast's targets strip the default before compiling
    # (compiler/targets/base.py required_inputs), which OpenVINO and TensorRT would fold into a constant.
    g.consts.append(helper.make_tensor(EXTRA_TOKENS_INPUT, g.dtype, [1, cfg.hidden],
                                       b"\0" * (cfg.hidden * np.dtype(NP_OF[g.dtype]).itemsize), raw=True))
    vocab = g.const(np.array(cfg.vocab, np.int32))
    base = g.op("Gather", g.param(table), g.op("Min", ids, g.const(np.array(cfg.vocab - 1, np.int32))), axis=0)
    added = g.op("Gather", extra, g.op("Max", g.op("Sub", ids, vocab), g.const(np.array(0, np.int32))), axis=0)
    is_added = g.op("Unsqueeze", g.op("GreaterOrEqual", ids, vocab), g.ints(2))
    return g.op("Where", is_added, added, base)


def build_clip_text(g: Graph, cfg: ClipTextConfig) -> None:
    if cfg.activation not in ("quick_gelu", "gelu"):
        raise BadInput(f"text encoder activation {cfg.activation!r} is not supported (quick_gelu, gelu)")
    L = LAYOUTS[cfg.layout]
    ids = g.input("input_ids", INT32, ["batch", "sequence"])
    seq = g.op("Shape", ids, start=1, end=2)
    zero = g.ints(0)
    x = _token_embeddings(g, ids, L["tok"], cfg)
    x = g.op("Add", x, g.op("Slice", g.param(L["pos"]), zero, seq, zero))
    mask = g.op("Slice", g.const(_causal_mask(cfg.max_positions), hint="causal_mask"),
                g.ints(0, 0), g.op("Concat", seq, seq, axis=0), g.ints(0, 1))
    act = g.quick_gelu if cfg.activation == "quick_gelu" else g.gelu
    run = cfg.layers if cfg.pooled == "text_embeds" or cfg.all_hidden_states else cfg.hidden_layer
    hidden, states = None, [x]       # states: hidden_states.0 (the embeddings), then each layer's output
    for i in range(cfg.layers):
        p = L["layer"].format(i)
        if i >= run:  # layers after the one the model reads: belong to the checkpoint, not the graph
            have = _layer_keys(g, p)
            first = L["layer"].format(0)
            g.missing += [g.prefix + p + k[len(first):] for k in _layer_keys(g, first)
                          if p + k[len(first):] not in have]  # still checked for completeness
            g.skip(have)
            continue
        h = g.layer_norm(x, f"{p}.{L['ln1']}", cfg.eps)
        q, k, v = _qkv(g, h, p, cfg)
        x = g.op("Add", x, g.linear(g.attention(q, k, v, cfg.heads, cfg.hidden, mask=mask), f"{p}.{L['out']}"))
        h = act(g.linear(g.layer_norm(x, f"{p}.{L['ln2']}", cfg.eps), f"{p}.{L['fc1']}"))
        x = g.op("Add", x, g.linear(h, f"{p}.{L['fc2']}"))
        states.append(x)
        if i + 1 == cfg.hidden_layer:
            hidden = x
    eos = _eos_position(g, ids, cfg)
    if cfg.all_hidden_states:
        _all_hidden_outputs(g, cfg, L, states, eos)
        return
    used_final = cfg.hidden_norm or cfg.pooled == "text_embeds"
    out = g.layer_norm(hidden, L["final"], cfg.eps) if cfg.hidden_norm else hidden
    g.output(out, cfg.hidden_name, g.dtype, ["batch", "sequence", cfg.hidden])
    if cfg.pooled == "pooler_output":
        g.output(g.op("GatherND", out, eos, batch_dims=1), "pooler_output", g.dtype, ["batch", cfg.hidden])
    elif cfg.pooled == "text_embeds":
        g.output(_projected(g, cfg, L, g.layer_norm(x, L["final"], cfg.eps), eos), "text_embeds", g.dtype,
                 ["batch", cfg.projection])
    if not used_final:
        g.skip([k for k in _layer_keys(g, L["final"])])
    if cfg.pooled != "text_embeds" and g.has(L["proj"]):
        g.skip([L["proj"]])


def _projected(g: Graph, cfg: ClipTextConfig, L: dict, last: str, eos: str) -> str:
    """text_embeds: the final-normed last layer at the first EOS, through text_projection."""
    pooled = g.op("GatherND", last, eos, batch_dims=1)
    if cfg.layout == "hf":
        return g.linear(pooled, "text_projection", bias=False)
    return g.op("MatMul", pooled, g.param(L["proj"]))


def _all_hidden_outputs(g: Graph, cfg: ClipTextConfig, L: dict, states: list[str], eos: str) -> None:
    """What transformers' CLIPTextModel(WithProjection)(output_hidden_states=True) returns, in optimum's
    ONNX order: text_embeds, last_hidden_state (projected) or last_hidden_state, pooler_output (plain),
    then hidden_states.0 .. hidden_states.N. optimum's ORTTextEncoder pops hidden_states.0..N-1 and
    appends last_hidden_state, optimum-intel keeps every hidden_states.* output, GenAI reads output
    N + 1 (hidden_states.N-1, the penultimate) and output 0 (the pooled embedding where it pools):
    each finds its tensor where it finds it in optimum's own export."""
    seq = ["batch", "sequence", cfg.hidden]
    last = g.layer_norm(states[-1], L["final"], cfg.eps)
    if cfg.pooled == "text_embeds":
        g.output(_projected(g, cfg, L, last, eos), "text_embeds", g.dtype, ["batch", cfg.projection])
        g.output(last, "last_hidden_state", g.dtype, seq)
    else:
        g.output(last, "last_hidden_state", g.dtype, seq)
        g.output(g.op("GatherND", last, eos, batch_dims=1), "pooler_output", g.dtype, ["batch", cfg.hidden])
        if g.has(L["proj"]):
            g.skip([L["proj"]])
    for i, state in enumerate(states):
        g.output(state, f"hidden_states.{i}", g.dtype, seq)
