"""The FLUX.2 transformer's names: diffusers' (`Flux2Transformer2DModel`, the canonical ones, under
tensor_refs.DIT) and Black Forest Labs' (their flux-2-klein-*.safetensors, ComfyUI's diffusion_models files,
with or without `model.diffusion_model.`); and where a FLUX.2 VAE file nests its quant convs.

Owns: recognising a FLUX.2 transformer by its shared modulations (`single_stream_modulation.lin` in BFL names,
`.linear` in diffusers'), so that neither Flux.1's BFL detection nor its diffusers renaming claims it, and
presenting BFL names under diffusers' as diffusers' convert_flux2_transformer_checkpoint_to_diffusers does:
`img_attn.qkv` / `txt_attn.qkv` -> rows of to_q | to_k | to_v / add_q_proj | add_k_proj | add_v_proj, norm
`.scale` -> `.weight`, `final_layer.adaLN_modulation.1` -> norm_out.linear with its halves swapped to
(scale, shift). VAE_NESTED: BFL's (and ComfyUI's flux2-vae) `encoder.quant_conv` / `decoder.post_quant_conv`
-> the LDM names' top-level `quant_conv` / `post_quant_conv`.
"""
from __future__ import annotations

import re

from ..errors import BadInput
from .tensor_refs import DIT, TensorRef, fused_ref, is_weight_key

MARKERS = ("single_stream_modulation.lin.weight", "single_stream_modulation.linear.weight")   # BFL, diffusers
TOP = {"img_in": "x_embedder", "txt_in": "context_embedder",
       "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
       "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
       "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
       "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
       "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
       "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
       "single_stream_modulation.lin": "single_stream_modulation.linear", "final_layer.linear": "proj_out"}
DOUBLE = {"img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
          "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
          "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.linear_in",
          "img_mlp.2": "ff.linear_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out"}
QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
       "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out", "norm.query_norm": "attn.norm_q",
          "norm.key_norm": "attn.norm_k"}
SWAPPED = "final_layer.adaLN_modulation.1"      # (shift, scale) in BFL, (scale, shift) in diffusers' norm_out.linear
BFL_TOP = {"img_in", "txt_in", "time_in", "guidance_in", "double_stream_modulation_img", "double_stream_modulation_txt",
           "single_stream_modulation", "double_blocks", "single_blocks", "final_layer"}
DIFFUSERS_TOP = {"x_embedder", "context_embedder", "time_guidance_embed", "double_stream_modulation_img",
                 "double_stream_modulation_txt", "single_stream_modulation", "transformer_blocks",
                 "single_transformer_blocks", "norm_out", "proj_out"}
VAE_NESTED = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}


def flux2_prefix(keys) -> tuple[str, bool] | None:
    """(where a FLUX.2 transformer's names start in these keys, whether they are BFL's), or None."""
    for bfl, marker in zip((True, False), MARKERS):
        hit = next((k for k in keys if k.endswith(marker) and (k == marker or k[-len(marker) - 1] == ".")), None)
        if hit is not None:
            return hit[:-len(marker)], bfl
    return None


def owns(key: str, prefix: str, bfl: bool) -> bool:
    """Whether `key` is one of the transformer's (under `prefix`, a top-level module of its naming)."""
    return key.startswith(prefix) and key[len(prefix):].split(".")[0] in (BFL_TOP if bfl else DIFFUSERS_TOP)


def _diffusers_name(rest: str) -> str | None:
    """A BFL module path (no parameter) -> diffusers', or None when it has no place."""
    if rest in TOP:
        return TOP[rest]
    if m := re.fullmatch(r"double_blocks\.(\d+)\.(.+)", rest):
        return f"transformer_blocks.{m[1]}.{DOUBLE[m[2]]}" if m[2] in DOUBLE else None
    if m := re.fullmatch(r"single_blocks\.(\d+)\.(.+)", rest):
        return f"single_transformer_blocks.{m[1]}.{SINGLE[m[2]]}" if m[2] in SINGLE else None
    return None


def transformer_refs(files: dict, prefix: str, bfl: bool, where: str) -> dict[str, TensorRef]:
    """{DIT + diffusers name: TensorRef} for the transformer's keys under `prefix` (files: key -> its file)."""
    out, stray = {}, []

    def ref(parts):
        return fused_ref(lambda k: files[k], parts)
    for key in files:
        if not owns(key, prefix, bfl) or not is_weight_key(key):
            continue
        rest = key[len(prefix):]
        if not bfl:
            out[DIT + rest] = ref([(key, None)])
            continue
        module, param = rest.rsplit(".", 1)
        param = "weight" if param == "scale" else param
        if module == SWAPPED:
            rows = files[key].tensors[key].shape[0]
            out[f"{DIT}norm_out.linear.{param}"] = ref([(key, (rows // 2, rows)), (key, (0, rows // 2))])
            continue
        m = re.fullmatch(r"double_blocks\.(\d+)\.(img_attn\.qkv|txt_attn\.qkv)", module)
        if m:
            rows = files[key].tensors[key].shape[0]
            if rows % 3:
                raise BadInput(f"{where}: {key} has {rows} rows, not q | k | v of equal height; the file is damaged")
            for i, name in enumerate(QKV[m[2]]):
                third = (i * rows // 3, (i + 1) * rows // 3)
                out[f"{DIT}transformer_blocks.{m[1]}.{name}.{param}"] = ref([(key, third)])
            continue
        name = _diffusers_name(module)
        if name is None:
            stray.append(key)
        else:
            out[f"{DIT}{name}.{param}"] = ref([(key, None)])
    if stray:
        raise BadInput(f"{where}: {len(stray)} tensor(s) have no place in a FLUX.2 transformer, e.g. "
                       f"{', '.join(stray[:5])}; the file is damaged or a variant precast does not support yet")
    return out


def bfl_lora_targets(shapes: dict, prefix: str) -> dict[str, tuple[tuple[str, tuple | None, tuple | None], ...]]:
    """A LoRA in BFL's names over the canonical (diffusers) weights under `prefix`: BFL module -> the weights its
    delta lands on, each (key, rows of that weight or None, rows of the delta or None): `img_attn.qkv`'s delta in
    thirds over to_q | to_k | to_v (each third as tall as its weight), `final_layer.adaLN_modulation.1`'s halves
    swapped into norm_out.linear, every other module one weight."""
    back = {**{v: k for k, v in TOP.items()}, **{f"transformer_blocks.{{}}.{v}": f"double_blocks.{{}}.{k}"
                                                for k, v in DOUBLE.items()},
            **{f"single_transformer_blocks.{{}}.{v}": f"single_blocks.{{}}.{k}" for k, v in SINGLE.items()}}
    out: dict[str, tuple] = {}
    for key, shape in shapes.items():
        if not key.startswith(prefix) or not key.endswith(".weight") or len(shape) != 2:
            continue
        module = key[len(prefix):-len(".weight")]
        block = re.fullmatch(r"(single_transformer_blocks|transformer_blocks)\.(\d+)\.(.+)", module)
        pattern = f"{block[1]}.{{}}.{block[3]}" if block else module
        if pattern in back:
            out[back[pattern].format(block[2] if block else "")] = ((key, None, None),)
        elif module == "norm_out.linear":
            half = shape[0] // 2
            out[SWAPPED] = ((key, (half, 2 * half), (0, half)), (key, (0, half), (half, 2 * half)))
        elif block and block[1] == "transformer_blocks":
            for fused, parts in QKV.items():
                keys = [f"{prefix}transformer_blocks.{block[2]}.{p}.weight" for p in parts]
                if block[3] == parts[0] and all(k in shapes for k in keys):
                    starts = [sum(shapes[k][0] for k in keys[:i]) for i in range(4)]
                    out[f"double_blocks.{block[2]}.{fused}"] = tuple((k, None, (starts[i], starts[i + 1]))
                                                                    for i, k in enumerate(keys))
    return out
