"""diffusers <-> Stability (SAI / ComfyUI) names for the SD3 / SD3.5 MMDiT transformer.

Owns: the correspondence (FAMILIES_DIT.md §3.3; diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`)
in one table, used two ways: a diffusers `SD3Transformer2DModel` (a `transformer/` folder or a
diffusers-named single file) is presented under SAI names -- fused weights (`attn.qkv` = to_q | to_k |
to_v, the context stream's = add_q_proj | add_k_proj | add_v_proj, MMDiT-X's `attn2.qkv`) are
concatenations of the diffusers tensors, and the two modulations diffusers stores as (scale, shift)
(the last block's context adaLN, `AdaLayerNormContinuous`, and the final layer's) get their halves
swapped back to SAI's (shift, scale) -- and a diffusers/PEFT LoRA module name resolves to its SAI
weight and rows.
"""
from __future__ import annotations

import re

# diffusers module (one, or several fused in row order) -> SAI module, inside transformer_blocks.N / joint_blocks.N
BLOCK = [
    (("norm1.linear",), "x_block.adaLN_modulation.1"),
    (("norm1_context.linear",), "context_block.adaLN_modulation.1"),     # swapped in the last (pre-only) block
    (("attn.to_q", "attn.to_k", "attn.to_v"), "x_block.attn.qkv"),
    (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "context_block.attn.qkv"),
    (("attn.norm_q",), "x_block.attn.ln_q"), (("attn.norm_k",), "x_block.attn.ln_k"),
    (("attn.norm_added_q",), "context_block.attn.ln_q"), (("attn.norm_added_k",), "context_block.attn.ln_k"),
    (("attn.to_out.0",), "x_block.attn.proj"), (("attn.to_add_out",), "context_block.attn.proj"),
    (("attn2.to_q", "attn2.to_k", "attn2.to_v"), "x_block.attn2.qkv"),
    (("attn2.norm_q",), "x_block.attn2.ln_q"), (("attn2.norm_k",), "x_block.attn2.ln_k"),
    (("attn2.to_out.0",), "x_block.attn2.proj"),
    (("ff.net.0.proj",), "x_block.mlp.fc1"), (("ff.net.2",), "x_block.mlp.fc2"),
    (("ff_context.net.0.proj",), "context_block.mlp.fc1"), (("ff_context.net.2",), "context_block.mlp.fc2"),
]
TOP = [
    (("pos_embed.proj",), "x_embedder.proj"),
    (("time_text_embed.timestep_embedder.linear_1",), "t_embedder.mlp.0"),
    (("time_text_embed.timestep_embedder.linear_2",), "t_embedder.mlp.2"),
    (("time_text_embed.text_embedder.linear_1",), "y_embedder.mlp.0"),
    (("time_text_embed.text_embedder.linear_2",), "y_embedder.mlp.2"),
    (("context_embedder",), "context_embedder"),
    (("proj_out",), "final_layer.linear"),
]
TENSORS = [("pos_embed.pos_embed", "pos_embed")]          # parameters that are no module's weight/bias
FINAL_SWAPPED = ("norm_out.linear", "final_layer.adaLN_modulation.1")
CONTEXT_ADALN = "norm1_context.linear"
MARKERS = ("transformer_blocks.0.attn.to_q.weight",)


def is_diffusers_sd3(keys) -> bool:
    """An SD3 transformer in diffusers names (with or without a `transformer.` prefix): block 0's
    to_q beside a `pos_embed.proj` patch embedder (Flux has `x_embedder`)."""
    keys = list(keys)
    return any(k.endswith(MARKERS) for k in keys) and any(k.endswith("pos_embed.proj.weight") for k in keys)


def _blocks(keys) -> list[int]:
    return sorted({int(m.group(1)) for k in keys if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})


def _modules(blocks: list[int]) -> list[tuple[tuple[str, ...], str]]:
    """(diffusers modules fused in order, SAI module) for the top level and every block."""
    out = list(TOP)
    for n in blocks:
        out += [(tuple(f"transformer_blocks.{n}.{d}" for d in ds), f"joint_blocks.{n}.{s}") for ds, s in BLOCK]
    return out


def _swapped(keys) -> set[str]:
    """diffusers modules holding (scale, shift) where SAI holds (shift, scale): the final layer's and
    the last block's context adaLN (the pre-only block, which has no ff_context)."""
    blocks = _blocks(keys)
    out = {FINAL_SWAPPED[0]}
    if blocks:
        out.add(f"transformer_blocks.{blocks[-1]}.{CONTEXT_ADALN}")
    return out


Part = tuple[str, tuple[int, int] | None]       # (diffusers key, rows of it or None)


def sai_parts(keys: list[str], shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, list[Part]], list[str]]:
    """({SAI key: the diffusers tensors it is made of, in row order}, diffusers keys not placed).
    `keys` are relative to the transformer (no `transformer.` prefix)."""
    have = set(keys)
    swapped = _swapped(keys)
    out: dict[str, list[Part]] = {}
    used: set[str] = set()
    for d, s in TENSORS:
        if d in have:
            out[s] = [(d, None)]
            used.add(d)
    for dmods, smod in _modules(_blocks(keys)) + [((FINAL_SWAPPED[0],), FINAL_SWAPPED[1])]:
        for param in ("weight", "bias"):
            src = [f"{d}.{param}" for d in dmods]
            if not all(k in have for k in src):
                continue
            if dmods[0] in swapped:           # (scale, shift) -> (shift, scale)
                rows = shapes[src[0]][0]
                out[f"{smod}.{param}"] = [(src[0], (rows // 2, rows)), (src[0], (0, rows // 2))]
            else:
                out[f"{smod}.{param}"] = [(k, None) for k in src]
            used.update(src)
    return out, sorted(have - used)


def lora_targets(sai_shapes: dict[str, tuple[int, ...]], prefix: str) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """{diffusers module: (SAI weight key, rows or None)} for a model whose SAI weights under `prefix`
    have these shapes: a LoRA on `transformer_blocks.N.attn.to_q` patches the first third of
    `joint_blocks.N.x_block.attn.qkv`, and so on. The swapped modulations (the final layer's and the
    last block's context adaLN) are left out: a delta over them would need its rows permuted."""
    rel = [k[len(prefix):] for k in sai_shapes if k.startswith(prefix)]
    blocks = sorted({int(m.group(1)) for k in rel if (m := re.match(r"joint_blocks\.(\d+)\.", k))})
    swapped = _swapped([f"transformer_blocks.{n}.x" for n in blocks])
    out = {}
    for dmods, smod in _modules(blocks):
        key = f"{prefix}{smod}.weight"
        if key not in sai_shapes or len(sai_shapes[key]) != 2 or dmods[0] in swapped:
            continue
        if len(dmods) == 1:
            out[dmods[0]] = (key, None)
            continue
        third = sai_shapes[key][0] // len(dmods)
        for j, d in enumerate(dmods):
            out[d] = (key, (j * third, (j + 1) * third))
    return out
