"""The Z-Image transformer's names: diffusers' (`ZImageTransformer2DModel`, the canonical ones, under
tensor_refs.DIT) and the original release's, as ComfyUI's single files and Tongyi-MAI's own checkpoints carry
them (with or without `model.diffusion_model.`).

Owns: recognising a Z-Image transformer by its names (cap_embedder beside noise_refiner blocks) and presenting
either naming under diffusers' names: `x_embedder` / `final_layer` -> `all_x_embedder.2-1` /
`all_final_layer.2-1`, `attention.qkv` -> rows of to_q | to_k | to_v, `attention.out` -> `to_out.0`,
`q_norm` / `k_norm` -> `norm_q` / `norm_k` (diffusers' convert_z_image_transformer_checkpoint_to_diffusers);
the unused `norm_final.weight` some files carry is left out, as diffusers leaves it.
"""
from __future__ import annotations

from ..errors import BadInput
from .tensor_refs import DIT, TensorRef, fused_ref, is_weight_key

MARKER = "cap_embedder.1.weight"
TOP = {"all_x_embedder", "all_final_layer", "x_embedder", "final_layer", "cap_embedder", "t_embedder", "layers",
       "noise_refiner", "context_refiner", "x_pad_token", "cap_pad_token", "norm_final"}
RENAMED = ((".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
           (".attention.k_norm.", ".attention.norm_k."))


def zimage_prefix(keys) -> str | None:
    """Where a Z-Image transformer's names start in these keys, or None when they hold none."""
    hit = next((k for k in keys if k.endswith(MARKER)), None)
    if hit is None:
        return None
    prefix = hit[:-len(MARKER)]
    return prefix if any(k.startswith(prefix + "noise_refiner.") for k in keys) else None


def _canonical(rest: str) -> str:
    for old, new in (("x_embedder.", "all_x_embedder.2-1."), ("final_layer.", "all_final_layer.2-1.")):
        if rest.startswith(old):
            return new + rest[len(old):]
    for old, new in RENAMED:
        rest = rest.replace(old, new)
    return rest


def transformer_refs(files: dict, prefix: str, where: str) -> dict[str, TensorRef]:
    """{DIT + diffusers name: TensorRef} for the transformer's keys under `prefix` (files: key -> its file)."""
    out = {}
    for key in files:
        rest = key[len(prefix):]
        if not key.startswith(prefix) or rest.split(".")[0] not in TOP or not is_weight_key(key) or \
                rest == "norm_final.weight":
            continue
        if rest.endswith(".attention.qkv.weight"):
            rows = files[key].tensors[key].shape[0]
            if rows % 3:
                raise BadInput(f"{where}: {key} has {rows} rows, not q | k | v of equal height; the file is damaged")
            base = DIT + rest[:-len("qkv.weight")]
            for i, n in enumerate(("to_q", "to_k", "to_v")):
                out[f"{base}{n}.weight"] = fused_ref(lambda k: files[k], [(key, (i * rows // 3, (i + 1) * rows // 3))])
            continue
        out[DIT + _canonical(rest)] = fused_ref(lambda k: files[k], [(key, None)])
    return out
