"""Opens what a user points precast at and presents it as one set of canonical tensor names.

Owns: recognising the input (single-file .safetensors or .gguf, diffusers folder, a precast export given
by mistake) and mapping every layout to one canonical layout per architecture: the LDM single-file names
(`model.diffusion_model.*`, `first_stage_model.*`, `cond_stage_model.transformer.text_model.*`) for SD
models, Black Forest Labs' names under `model.diffusion_model.` for Flux / Chroma and Stability's
(SAI/ComfyUI) for SD3, diffusers' for Z-Image and FLUX.2, with ComfyUI's
`text_encoders.clip_l.transformer.text_model.*`, `text_encoders.clip_g.transformer.text_model.*` (a CLIP's
`text_projection` kept under `text_model.`), `text_encoders.t5xxl.transformer.*` and HF Qwen3Model names under
`text_encoders.llm.` for their text encoders. Single files are normalised here (bare diffusion models, ComfyUI's
`vae.`, old SD 1.x text encoders, a diffusers-named DiT, Z-Image's original names: zimage_names.py, FLUX.2's BFL
names and VAE: flux2_names.py, a bare Qwen-Image transformer in diffusers names, LLM encoders: llm_names.py);
diffusers folders in diffusers_folder.py; the names, TensorRef (fused q|k|v, scaled fp8) and pickle refusal in
tensor_refs.py.
Separate text-encoder and VAE files are added by content. Tensors are read one at a time, on demand.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadInput
from . import diffusers_names, flux2_names, flux_names, qwen_vae_names, sd3_names, zimage_names
from .diffusers_folder import (_component_weights, _diffusers_dit_refs, _encoder_mapping, _read_config, clip_slot,
                               open_diffusers_folder, text_encoder_kind)
from .llm_names import MARKER as LLM_MARKER, llm_names, llm_prefix
from .tensor_refs import (CLIP_G, CLIP_L, CLIP_MARKER, DIT, LLM, T5, T5_MARKER, TEXT, UNET, VAE, Checkpoint,
                          TensorRef, is_weight_key, open_weights_file, tensor_ref)

BFL_TOP = {"double_blocks", "single_blocks", "img_in", "txt_in", "time_in", "vector_in", "guidance_in",
           "final_layer", "distilled_guidance_layer"}
SAI_TOP = {"joint_blocks", "x_embedder", "pos_embed", "t_embedder", "y_embedder", "context_embedder", "final_layer"}
# An all-in-one SD3 file keeps each CLIP's projection beside text_model.: canonical names put it inside.
PROJECTIONS = {p[:-len("text_model.")] + "text_projection.weight": p + "text_projection.weight" for p in (CLIP_L, CLIP_G)}


def _normalise_single_file(keys: list[str]) -> dict[str, str]:
    """Single-file variants -> canonical names: diffusion-only files without a prefix (LDM UNets,
    BFL Flux/Chroma transformers), ComfyUI's `vae.` prefix, and old SD1 files whose text encoder
    lacks `text_model.`."""
    bare_unet = any(k.startswith("input_blocks.") for k in keys) and not any(k.startswith(UNET) for k in keys)
    bare_dit = any(k.startswith(("double_blocks.", "joint_blocks.")) for k in keys) and \
        not any(k.startswith(DIT) for k in keys)
    comfy_vae = any(k.startswith("vae.") for k in keys) and not any(k.startswith(VAE) for k in keys)
    out = {}
    for k in keys:
        c = k
        top = k.split(".")[0]
        if bare_unet and top in {"input_blocks", "middle_block", "output_blocks", "time_embed", "out", "label_emb"}:
            c = UNET + k
        elif bare_dit and top in BFL_TOP | SAI_TOP:
            c = DIT + k
        elif k in PROJECTIONS:
            c = PROJECTIONS[k]
        elif comfy_vae and top == "vae":
            c = VAE + k[len("vae."):]
        elif k.startswith("cond_stage_model.transformer.") and not k.startswith(TEXT) and \
                k.split(".")[2] in {"embeddings", "encoder", "final_layer_norm"}:
            c = TEXT + k[len("cond_stage_model.transformer."):]
        out[k] = c
    return out


def open_single_file(path: Path) -> Checkpoint:
    f = open_weights_file(path)
    keys = [k for k in f.keys() if is_weight_key(k)]
    refs: dict[str, TensorRef] = {}
    if (found := flux2_names.flux2_prefix(keys)) is not None:        # FLUX.2 (BFL or diffusers names), before Flux.1
        refs.update(flux2_names.transformer_refs({k: f for k in keys}, *found, str(path)))
        keys = [k for k in keys if not flux2_names.owns(k, *found)]
    if flux_names.is_diffusers_flux(keys) or sd3_names.is_diffusers_sd3(keys):   # a diffusers-named DiT as one file
        end = "pos_embed.proj.weight" if sd3_names.is_diffusers_sd3(keys) else "x_embedder.weight"
        prefix = next(k for k in keys if k.endswith(end))[:-len(end)]
        refs.update(_diffusers_dit_refs({k: f for k in f.keys()}, str(path), prefix))
        keys = [k for k in keys if not k.startswith(prefix)]
    if (prefix := zimage_names.zimage_prefix(keys)) is not None:    # Z-Image: original or diffusers names
        refs.update(zimage_names.transformer_refs({k: f for k in keys}, prefix, str(path)))
        keys = [k for k in keys if not (k.startswith(prefix) and k[len(prefix):].split(".")[0] in zimage_names.TOP)]
    if "txt_norm.weight" in keys and "img_in.weight" in keys:         # a bare Qwen-Image transformer (diffusers names)
        top = ("img_in.", "txt_in.", "txt_norm.", "time_text_embed.", "transformer_blocks.", "norm_out.", "proj_out.")
        refs.update({DIT + k: tensor_ref(f, k, DIT + k) for k in keys if k.startswith(top)})
        keys = [k for k in keys if not k.startswith(top)]
    if (prefix := llm_prefix(keys)) is not None:                     # an LLM text encoder (ComfyUI's names)
        mapped = llm_names(keys, prefix)
        refs.update({canon: tensor_ref(f, key, canon) for key, canon in mapped.items()})
        keys = [k for k in keys if not k.startswith(prefix) and not k.endswith("lm_head.weight")]   # a CausalLM's head
    names = _normalise_single_file(keys)
    refs.update({canon: tensor_ref(f, key, canon) for key, canon in names.items()})
    return Checkpoint(str(path), "single-file", refs, metadata=f.metadata)


def open_checkpoint(path: str | os.PathLike, vae: str | os.PathLike | None = None,
                    text_encoders: tuple | list = ()) -> Checkpoint:
    """The checkpoint at `path`; with `vae`, its VAE tensors are replaced by that file's or folder's
    (e.g. the SDXL fp16-fix VAE, Flux's ae.safetensors); each of `text_encoders` (a T5 or CLIP-L
    file, recognised by its tensors) is added in place of the checkpoint's own."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such file or folder")
    if p.is_dir() and (p / "precast_export.json").is_file():
        raise BadInput(f"{p}: is a precast export (ONNX), not a checkpoint; build engines from it with "
                       f"`precast compile {p} --target ...`")
    if p.is_dir():
        ckpt = open_diffusers_folder(p)
    else:
        ckpt = open_single_file(p)
    if vae is not None:
        replace_vae(ckpt, Path(vae))
    for te in text_encoders:
        add_text_encoder(ckpt, Path(te))
    return ckpt


def add_text_encoder(ckpt: Checkpoint, path: Path) -> None:
    """A separate text-encoder file (T5-XXL, CLIP-L, SD3's CLIP-G or an LLM such as Z-Image's Qwen3, HF names with
    or without a prefix, e.g. comfyanonymous' t5xxl_fp16.safetensors / clip_l.safetensors / clip_g.safetensors /
    qwen_3_4b.safetensors), or a diffusers text_encoder*/
    folder, in place of the checkpoint's own encoder of that kind."""
    flag = f"--text-encoder {path}"
    if not path.exists():
        raise BadInput(f"{flag}: no such file or folder")
    if path.is_dir():
        weights = _component_weights(path.parent, path.name)
        if weights is None:
            raise BadInput(f"{flag}: a folder without .safetensors weights; give the encoder's folder or file")
    else:
        f = open_weights_file(path)
        weights = {k: f for k in f.keys()}
    kind = text_encoder_kind(list(weights))
    if kind is None:
        raise BadInput(f"{flag}: neither a T5 nor a CLIP text encoder, nor an LLM one (looked for {T5_MARKER} / "
                       f"{CLIP_MARKER} / {LLM_MARKER}; found e.g. {', '.join(sorted(weights)[:3]) or 'no tensors'}); give the T5-XXL, "
                       "CLIP-L, CLIP-G or Qwen3 file")
    canon = {"t5": T5, "llm": LLM}.get(kind[0]) or clip_slot(ckpt.refs, weights)
    for k in [k for k in ckpt.refs if k.startswith(canon)]:
        del ckpt.refs[k]
    for key, name in _encoder_mapping(list(weights), *kind, canon).items():
        ckpt.refs[name] = tensor_ref(weights[key], key, name)


def replace_vae(ckpt: Checkpoint, vae: Path) -> None:
    """Swap in a separate VAE: a diffusers `vae/` folder (or its parent), or a .safetensors file
    in LDM names (with or without first_stage_model.) or diffusers names (Qwen-Image's: also Wan's)."""
    if not vae.exists():
        raise BadInput(f"--vae {vae}: no such file or folder")
    if vae.is_dir():
        folder = vae if (vae / "config.json").is_file() else vae / "vae"
        weights = _component_weights(folder.parent, folder.name)
        if weights is None:
            raise BadInput(f"--vae {vae}: a folder without a vae/ folder or a config.json; give the VAE's folder")
        ckpt.configs["vae"] = _read_config(folder.parent, folder.name)
    else:
        f = open_weights_file(vae)
        weights = {k: f for k in f.keys()}
    keys = list(weights)
    if any(k.startswith(VAE) for k in keys):
        mapping = {k: k for k in keys if k.startswith(VAE)}
    elif any(k.startswith("vae.") for k in keys):
        mapping = {k: VAE + k[len("vae."):] for k in keys if k.startswith("vae.")}
    elif qwen_vae_names.QWEN_MARKER in keys:      # Qwen-Image's VAE in diffusers names: the canonical ones
        mapping = {k: VAE + k for k in keys}
    elif qwen_vae_names.WAN_MARKER in keys:       # ... in Wan's original names (ComfyUI's qwen_image_vae)
        mapping = {k: VAE + v for k, v in qwen_vae_names.wan_vae_names(keys).items()}
    elif any(".down_blocks." in k or ".up_blocks." in k for k in keys):
        mapping = {k: VAE + v for k, v in diffusers_names.vae_names(keys).items()}
    else:   # LDM names; FLUX.2's nest the quant convs and carry the latents' batch-norm statistics (bn.*)
        nested = lambda k: next((new + k[len(old):] for old, new in flux2_names.VAE_NESTED.items()  # noqa: E731
                                 if k.startswith(old)), k)
        mapping = {k: VAE + nested(k) for k in keys
                   if k.split(".")[0] in ("encoder", "decoder", "quant_conv", "post_quant_conv", "bn")}
    if not any(v.startswith(VAE + "decoder.") for v in mapping.values()):
        raise BadInput(f"--vae {vae}: no VAE decoder tensors found (looked for decoder.* / first_stage_model.decoder.*)")
    for k in [k for k in ckpt.refs if k.startswith(VAE)]:
        del ckpt.refs[k]
    ckpt.vae_file = str(vae)
    for key, canon in mapping.items():
        ckpt.refs[canon] = tensor_ref(weights[key], key, canon)
