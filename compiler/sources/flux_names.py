"""diffusers <-> Black Forest Labs names for the Flux / Chroma transformer.

Owns: the correspondence (FAMILIES_DIT.md §1.4, §2) in one table, used two ways: a diffusers
`transformer/` folder (or a diffusers-named single file) is presented under BFL names -- fused
weights (`img_attn.qkv` = to_q | to_k | to_v, `linear1` = to_q | to_k | to_v | proj_mlp) are
concatenations of the diffusers tensors, the final modulation's halves swapped back to
(shift, scale) -- and a diffusers/PEFT LoRA module name resolves to its BFL weight and rows.
"""
from __future__ import annotations

import re

# diffusers module (one, or several fused in row order) -> BFL module, per block kind.
DOUBLE = [
    (("norm1.linear",), "img_mod.lin"), (("norm1_context.linear",), "txt_mod.lin"),
    (("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn.qkv"),
    (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn.qkv"),
    (("attn.norm_q",), "img_attn.norm.query_norm"), (("attn.norm_k",), "img_attn.norm.key_norm"),
    (("attn.norm_added_q",), "txt_attn.norm.query_norm"), (("attn.norm_added_k",), "txt_attn.norm.key_norm"),
    (("attn.to_out.0",), "img_attn.proj"), (("attn.to_add_out",), "txt_attn.proj"),
    (("ff.net.0.proj",), "img_mlp.0"), (("ff.net.2",), "img_mlp.2"),
    (("ff_context.net.0.proj",), "txt_mlp.0"), (("ff_context.net.2",), "txt_mlp.2"),
]
SINGLE = [
    (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear1"), (("proj_out",), "linear2"),
    (("norm.linear",), "modulation.lin"), (("attn.norm_q",), "norm.query_norm"), (("attn.norm_k",), "norm.key_norm"),
]
TOP = [
    (("x_embedder",), "img_in"), (("context_embedder",), "txt_in"),
    (("time_text_embed.timestep_embedder.linear_1",), "time_in.in_layer"),
    (("time_text_embed.timestep_embedder.linear_2",), "time_in.out_layer"),
    (("time_text_embed.guidance_embedder.linear_1",), "guidance_in.in_layer"),
    (("time_text_embed.guidance_embedder.linear_2",), "guidance_in.out_layer"),
    (("time_text_embed.text_embedder.linear_1",), "vector_in.in_layer"),
    (("time_text_embed.text_embedder.linear_2",), "vector_in.out_layer"),
    (("proj_out",), "final_layer.linear"),
    (("distilled_guidance_layer.in_proj",), "distilled_guidance_layer.in_proj"),
    (("distilled_guidance_layer.out_proj",), "distilled_guidance_layer.out_proj"),
]
SWAPPED = ("norm_out.linear", "final_layer.adaLN_modulation.1")   # (scale, shift) in diffusers, (shift, scale) in BFL
NORMS = ("norm", "norm_q", "norm_k", "norm_added_q", "norm_added_k", "norms")   # .weight in diffusers, .scale in BFL
MARKERS = ("transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.0.attn.to_q.weight")


def is_diffusers_flux(keys) -> bool:
    """A Flux/Chroma transformer in diffusers names (with or without a `transformer.` prefix)."""
    return any(k.endswith(MARKERS) for k in keys) and any(k.endswith("x_embedder.weight") for k in keys)


def _modules(keys: list[str]) -> list[tuple[tuple[str, ...], str]]:
    """(diffusers modules fused in order, BFL module) for every module present in `keys`."""
    out = list(TOP)
    blocks = lambda kind: sorted({int(m.group(1)) for k in keys if (m := re.match(rf"{kind}\.(\d+)\.", k))})  # noqa: E731
    for n in blocks("transformer_blocks"):
        out += [(tuple(f"transformer_blocks.{n}.{d}" for d in ds), f"double_blocks.{n}.{b}") for ds, b in DOUBLE]
    for n in blocks("single_transformer_blocks"):
        out += [(tuple(f"single_transformer_blocks.{n}.{d}" for d in ds), f"single_blocks.{n}.{b}") for ds, b in SINGLE]
    for n in blocks("distilled_guidance_layer.layers"):
        out += [((f"distilled_guidance_layer.layers.{n}.linear_1",), f"distilled_guidance_layer.layers.{n}.in_layer"),
                ((f"distilled_guidance_layer.layers.{n}.linear_2",), f"distilled_guidance_layer.layers.{n}.out_layer")]
    for n in blocks("distilled_guidance_layer.norms"):
        out.append(((f"distilled_guidance_layer.norms.{n}",), f"distilled_guidance_layer.norms.{n}"))
    return out


def _param(module: str, param: str) -> str:
    """diffusers parameter name -> BFL's (norm scales are `.scale` in BFL)."""
    last = module.rsplit(".", 2)
    is_norm = param == "weight" and (last[-1] in NORMS or (len(last) > 1 and last[-2] == "norms"))
    return "scale" if is_norm else param


Part = tuple[str, tuple[int, int] | None]       # (diffusers key, rows of it or None)


def bfl_parts(keys: list[str], shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, list[Part]], list[str]]:
    """({BFL key: the diffusers tensors it is made of, in row order}, diffusers keys not placed).
    `keys` are relative to the transformer (no `transformer.` prefix)."""
    have = set(keys)
    out: dict[str, list[Part]] = {}
    used: set[str] = set()
    for dmods, bmod in _modules(keys):
        for param in ("weight", "bias"):
            src = [f"{d}.{param}" for d in dmods]
            if not all(s in have for s in src):
                continue
            out[f"{bmod}.{_param(dmods[0], param)}"] = [(s, None) for s in src]
            used.update(src)
    for param in ("weight", "bias"):
        src = f"{SWAPPED[0]}.{param}"
        if src in have:
            rows = shapes[src][0]
            out[f"{SWAPPED[1]}.{param}"] = [(src, (rows // 2, rows)), (src, (0, rows // 2))]
            used.add(src)
    return out, sorted(have - used)


def lora_targets(bfl_shapes: dict[str, tuple[int, ...]], prefix: str) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """{diffusers module: (BFL weight key, rows or None)} for a model whose BFL weights under
    `prefix` have these shapes: a LoRA on to_q patches the first third of img_attn.qkv, and so on.
    The swapped final modulation is left out (a delta over it would need its rows permuted)."""
    rel = [k[len(prefix):] for k in bfl_shapes if k.startswith(prefix)]
    fake = []   # the diffusers module names present, recovered from the BFL block numbers
    for k in rel:
        m = re.match(r"(double|single)_blocks\.(\d+)\.", k)
        if m:
            fake.append(f"{'transformer_blocks' if m.group(1) == 'double' else 'single_transformer_blocks'}.{m.group(2)}.x")
        m = re.match(r"distilled_guidance_layer\.(layers|norms)\.(\d+)\.", k)
        if m:
            fake.append(f"distilled_guidance_layer.{m.group(1)}.{m.group(2)}.x")
    out = {}
    for dmods, bmod in _modules(fake):
        key = f"{prefix}{bmod}.weight"
        if key not in bfl_shapes or len(bfl_shapes[key]) != 2:
            continue
        if len(dmods) == 1:
            out[dmods[0]] = (key, None)
            continue
        rows = bfl_shapes[key][0]
        width = bfl_shapes[key][1]
        sizes = [width] * (len(dmods) - 1)
        sizes.append(rows - sum(sizes))                 # the last part takes the rest (proj_mlp, or v)
        start = 0
        for d, n in zip(dmods, sizes):
            out[d] = (key, (start, start + n))
            start += n
    return out
