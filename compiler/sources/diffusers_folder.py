"""A diffusers pipeline folder (model_index.json, unet/ or transformer/, vae/, text_encoder*/) presented in the
canonical names, and the text-encoder placing a folder and a separate text-encoder file share.

Owns: a component folder's weights (one file, a variant such as .fp16, or shards listed by an index),
its config.json, an SD folder's UNet / VAE / CLIP text encoders renamed (compiler/sources/diffusers_names.py), a DiT
transformer in diffusers names renamed to BFL's (Flux, Chroma) or SAI's (SD3) names (Z-Image's, FLUX.2's and
Qwen-Image's kept: zimage_names.py, flux2_names.py; Qwen-Image's VAE too), and where a T5, CLIP or LLM text encoder
goes in the canonical layout (text_encoder_kind, clip_slot).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import BadInput
from . import diffusers_names, flux2_names, flux_names, sd3_names, zimage_names
from .llm_names import MARKER as LLM_MARKER
from .safetensors_file import SafetensorsFile
from .tensor_refs import (CLIP_G, CLIP_L, CLIP_MARKER, DIT, LLM, PICKLE_SUFFIXES, T5, T5_MARKER, TEXT, UNET, VAE,
                          Checkpoint, TensorRef, _refuse_pickle, fused_ref, is_weight_key, tensor_ref)


def _diffusers_dit_refs(files: dict[str, SafetensorsFile], where: str, prefix: str = "") -> dict[str, TensorRef]:
    """A Flux/Chroma (-> BFL names) or SD3 (-> SAI names) transformer in diffusers names, keys under `prefix`."""
    rel = [k[len(prefix):] for k in files if k.startswith(prefix) and is_weight_key(k)]
    if zimage_names.zimage_prefix(rel) == "":            # Z-Image: diffusers' names are the canonical ones
        return zimage_names.transformer_refs(files, prefix, where)
    if flux2_names.flux2_prefix(rel) == ("", False):     # FLUX.2: so are they
        return flux2_names.transformer_refs(files, prefix, False, where)
    if "txt_norm.weight" in rel and "img_in.weight" in rel:     # Qwen-Image: and so are they
        return {DIT + k: tensor_ref(files[prefix + k], prefix + k, DIT + k) for k in rel}
    shapes = {k: files[prefix + k].tensors[prefix + k].shape for k in rel}
    sd3 = sd3_names.is_diffusers_sd3(rel)
    parts, stray = (sd3_names.sai_parts if sd3 else flux_names.bfl_parts)(rel, shapes)
    if stray:
        raise BadInput(f"{where}: {len(stray)} transformer tensor(s) have no place in a "
                       f"{'SD3' if sd3 else 'Flux/Chroma'} transformer, e.g. "
                       f"{', '.join(stray[:5])}; the file is damaged or a variant precast does not support yet")
    return {DIT + canon: fused_ref(lambda k: files[k], srcs, prefix) for canon, srcs in parts.items()}


WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
# diffusers' names for a component's weights: STEM[.VARIANT].safetensors, or shards listed by
# STEM.safetensors.index[.VARIANT].json (or STEM[.VARIANT].safetensors.index.json)
_WEIGHTS = re.compile(r"(?P<stem>diffusion_pytorch_model|model)(?:\.(?P<v1>[A-Za-z0-9_]+))?\.safetensors"
                      r"(?P<index>\.index(?:\.(?P<v2>[A-Za-z0-9_]+))?\.json)?")
VARIANT_PREFERENCE = ("", "fp16", "fp32", "bf16")   # plain weights first, then the common variants


def _component_weights(folder: Path, name: str) -> dict[str, SafetensorsFile] | None:
    """Each tensor of a diffusers component folder -> the .safetensors file holding it (one
    file, a variant such as .fp16, or shards listed by an index); None when there is no folder."""
    d = folder / name
    if not d.is_dir():
        return None
    found = {}
    for p in sorted(d.iterdir()):
        m = _WEIGHTS.fullmatch(p.name)
        if m and p.is_file():
            found.setdefault(m["v1"] or m["v2"] or "", p)
    if not found:
        pickles = [p for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise _refuse_pickle(pickles[0])
        raise BadInput(f"{d}: no weights found (looked for {' / '.join(WEIGHT_STEMS)}[.VARIANT].safetensors "
                       "and their .index.json)")
    variant = next((v for v in VARIANT_PREFERENCE if v in found), None)
    if variant is None:
        if len(found) > 1:
            raise BadInput(f"{d}: weights in several variants ({', '.join(sorted(found))}) and none of "
                           f"{', '.join(v for v in VARIANT_PREFERENCE if v)}; keep one")
        variant = next(iter(found))
    path = found[variant]
    if not path.name.endswith(".json"):
        f = SafetensorsFile(path)
        return {k: f for k in f.keys()}
    return _shards(path)


def _shards(index: Path) -> dict[str, SafetensorsFile]:
    """The tensors of an index's weight_map, each shard a plain file beside the index."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(f"{index}: no weight_map object; save the component again")
    files: dict[str, SafetensorsFile] = {}
    out = {}
    for key, shard in sorted(weight_map.items()):
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise BadInput(f"{index}: weight_map[{key!r}] = {shard!r} is not a file name beside the index")
        if shard not in files:
            files[shard] = SafetensorsFile(index.parent / shard)
        if key not in files[shard].tensors:
            raise BadInput(f"{index}: {key} is listed in {shard}, which does not hold it")
        out[key] = files[shard]
    for shard, f in files.items():
        unlisted = sorted(set(f.keys()) - set(out))
        if unlisted:
            raise BadInput(f"{index.parent / shard}: holds {unlisted[0]}, which the index does not list")
    return out


def _read_json(p: Path) -> dict:
    """A JSON object from a folder's config file; {} when the file is absent."""
    if not p.is_file():
        return {}
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise BadInput(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"{p}: expected a JSON object")
    return cfg


def _read_config(folder: Path, name: str) -> dict:
    return _read_json(folder / name / "config.json")


def _text_prefixes(folder: Path) -> dict[str, str]:
    """Where an SD folder's text encoders go in the canonical layout: SD 1.x/2.x have one; SDXL
    base has CLIP-L + bigG (text_encoder_2); the refiner has bigG only."""
    if (folder / "text_encoder_2").is_dir():
        if (folder / "text_encoder").is_dir():
            return {"text_encoder": "conditioner.embedders.0.transformer.text_model.",
                    "text_encoder_2": "conditioner.embedders.1.transformer.text_model."}
        return {"text_encoder_2": "conditioner.embedders.0.transformer.text_model."}
    return {"text_encoder": TEXT}


def text_encoder_kind(keys) -> tuple[str, str] | None:
    """("t5" | "clip" | "llm", the key prefix the encoder's HF names start after), from its tensor names."""
    for kind, marker in (("t5", T5_MARKER), ("clip", CLIP_MARKER), ("llm", LLM_MARKER)):
        hit = next((k for k in keys if k.endswith(marker)), None)
        if hit is not None:
            return kind, hit[:-len(marker)]
    return None


def _encoder_mapping(keys: list[str], kind: str, prefix: str, canon: str | None = None) -> dict[str, str]:
    """A text encoder's keys (under `prefix`) -> canonical names (under `canon`: T5, or a CLIP's slot).
    A CLIP's `text_projection` (CLIPTextModelWithProjection) sits beside `text_model.`: it goes inside."""
    canon = canon or {"t5": T5, "llm": LLM}.get(kind, CLIP_L)
    out = {k: canon + k[len(prefix):] for k in keys if k.startswith(prefix) and is_weight_key(k)
           and not (kind == "llm" and k[len(prefix):] == "lm_head.weight")}
    projection = prefix[:-len("text_model.")] + "text_projection.weight" if prefix.endswith("text_model.") else None
    if kind == "clip" and projection in keys:
        out[projection] = canon + "text_projection.weight"
    return out


def clip_slot(refs: dict, weights: dict, folder_name: str = "") -> str:
    """Where a CLIP text encoder goes: a diffusers text_encoder_2/ (SD3's bigG) or a 1280-wide one is
    CLIP-G, text_encoder/ or a 768-wide one CLIP-L; another width replaces the slot holding one that
    wide, else fills the first empty slot (CLIP-L, then CLIP-G for an SD3 checkpoint)."""
    if folder_name in ("text_encoder", "text_encoder_2"):
        return CLIP_G if folder_name == "text_encoder_2" else CLIP_L
    width = next((weights[k].tensors[k].shape[-1] for k in weights if k.endswith("token_embedding.weight")), None)
    if width in (768, 1280):
        return CLIP_L if width == 768 else CLIP_G
    slots = (CLIP_L, CLIP_G) if any(k.startswith(DIT + "joint_blocks.") for k in refs) else (CLIP_L,)
    table = "embeddings.token_embedding.weight"
    same = [s for s in slots if s + table in refs and refs[s + table].shape[-1] == width]
    empty = [s for s in slots if not any(k.startswith(s) for k in refs)]
    return (same or empty or [CLIP_L])[0]


CONFIG_OF = {T5: "t5", CLIP_L: "clip_l", CLIP_G: "clip_g", LLM: "llm"}     # Checkpoint.configs key of each encoder slot
DIT_CLASSES = ("FluxTransformer2DModel", "ChromaTransformer2DModel", "SD3Transformer2DModel",
               "ZImageTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel")


def _dit_folder_refs(folder: Path, refs: dict, configs: dict, found: list) -> None:
    """A DiT pipeline folder (Flux, Chroma: BFL names; SD3: SAI names): text encoders by kind, CLIPs by folder."""
    weights = _component_weights(folder, "transformer")
    configs["transformer"] = _read_config(folder, "transformer")
    cls = configs["transformer"].get("_class_name")
    if cls not in DIT_CLASSES and not flux_names.is_diffusers_flux(list(weights)) and \
            not sd3_names.is_diffusers_sd3(list(weights)) and zimage_names.zimage_prefix(list(weights)) is None:
        raise BadInput(f"{folder}/transformer: a {cls or 'transformer'} precast does not support yet "
                       f"(supported: {', '.join(DIT_CLASSES)})")
    refs.update(_diffusers_dit_refs(weights, f"{folder}/transformer"))
    found.append("transformer")
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        weights = _component_weights(folder, name)
        if weights is None:
            continue
        kind = text_encoder_kind(list(weights))
        if kind is None:
            raise BadInput(f"{folder}/{name}: neither a T5 nor a CLIP text encoder, nor an LLM one (looked for "
                           f"{T5_MARKER}, {CLIP_MARKER} and {LLM_MARKER})")
        slot = {"t5": T5, "llm": LLM}.get(kind[0]) or clip_slot(refs, weights, name)
        configs[CONFIG_OF[slot]] = _read_config(folder, name)
        for key, canon in _encoder_mapping(list(weights), *kind, slot).items():
            refs[canon] = tensor_ref(weights[key], key, canon)
        found.append(name)


def open_diffusers_folder(folder: Path) -> Checkpoint:
    refs: dict[str, TensorRef] = {}
    configs: dict[str, dict] = {}
    found: list[str] = []
    dit = (folder / "transformer").is_dir()
    if dit:
        _dit_folder_refs(folder, refs, configs, found)
    texts = [] if dit else [(name, prefix, None) for name, prefix in _text_prefixes(folder).items()]
    for name, prefix, rename in [("unet", UNET, diffusers_names.unet_names),
                                 ("vae", VAE, diffusers_names.vae_names), *texts]:
        weights = _component_weights(folder, name)
        if weights is None:
            continue
        found.append(name)
        configs[name] = _read_config(folder, name)
        keys = [k for k in weights if is_weight_key(k)]
        if name == "vae" and configs[name].get("_class_name") == "AutoencoderKLQwenImage":   # canonical names
            mapping = {k: k for k in keys}
        elif rename is not None:
            mapping = rename(keys)
        else:  # HF CLIPTextModel: text_model.* (some saves drop the text_model. prefix)
            mapping = {k: (k[len("text_model."):] if k.startswith("text_model.") else k) for k in keys}
        for key, canon in mapping.items():
            refs[prefix + canon] = tensor_ref(weights[key], key, prefix + canon)
    for name, path in (("model_index", folder / "model_index.json"),
                       ("scheduler", folder / "scheduler" / "scheduler_config.json")):
        if cfg := _read_json(path):
            configs[name] = cfg
    if not found:
        raise BadInput(f"{folder}: a folder, but not a diffusers model (no unet/, transformer/, vae/ or text_encoder/ "
                       "with .safetensors weights)")
    return Checkpoint(str(folder), "diffusers", refs, configs=configs)
