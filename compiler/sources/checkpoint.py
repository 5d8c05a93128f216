"""Opens what a user points precast at and presents it as one set of canonical tensor names.

Owns: recognising the input (single-file .safetensors or .gguf, diffusers folder, pickled checkpoint),
refusing pickles without ever unpickling them, and mapping every layout to one canonical
layout per architecture: the LDM single-file names (`model.diffusion_model.*`,
`first_stage_model.*`, `cond_stage_model.transformer.text_model.*`) for SD models, Black Forest
Labs' names under `model.diffusion_model.` for Flux / Chroma and Stability's (SAI/ComfyUI) for SD3,
with ComfyUI's `text_encoders.clip_l.transformer.text_model.*`, `text_encoders.clip_g.transformer.text_model.*`
(a CLIP's `text_projection` kept under `text_model.`) and `text_encoders.t5xxl.transformer.*` for their
text encoders. A canonical tensor may be made of stored ones (`TensorRef.parts`: a fused q|k|v
from diffusers' separate to_q, to_k, to_v) or carry a dequantization scale (ComfyUI's scaled
fp8; a scaled model's fp8 Linear weight without its scale is refused by name, not read as raw fp8).
Separate text-encoder and VAE files are added by content. Tensors are read one at a time, on demand.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import weakref
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import numpy as np

from ..errors import BadInput
from . import diffusers_names, flux_names, fp8_decode, gguf_file, sd3_names
from .gguf_file import GGUFFile
from .safetensors_file import SafetensorsFile

PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl"}
CONVERT_HINT = ("precast never unpickles checkpoints (a pickle can run arbitrary code). Convert it once, "
                "in an environment you trust, to .safetensors, e.g. python -c \"import torch, safetensors.torch as st; "
                "sd = torch.load('IN.ckpt', weights_only=True); sd = sd.get('state_dict', sd); "
                "st.save_file({k: v.contiguous() for k, v in sd.items() if hasattr(v, 'contiguous')}, 'OUT.safetensors')\"")

UNET = "model.diffusion_model."
DIT = UNET                                   # Flux / Chroma transformer (BFL names)
VAE = "first_stage_model."
TEXT = "cond_stage_model.transformer.text_model."
CLIP_L = "text_encoders.clip_l.transformer.text_model."
CLIP_G = "text_encoders.clip_g.transformer.text_model."        # SD3's OpenCLIP bigG (HF names)
T5 = "text_encoders.t5xxl.transformer."
# A key only T5 / CLIP text encoders have, in HF names: where a file's encoder starts is the part before it.
T5_MARKER = "encoder.block.0.layer.0.SelfAttention.q.weight"
CLIP_MARKER = "encoder.layers.0.self_attn.q_proj.weight"
# ComfyUI scaled fp8: weight = fp8 * `.scale_weight` (newer ComfyUI saves: `.weight_scale`), a float32
# scalar beside each Linear weight; a `scaled_fp8` marker tensor and input scales are not weights.
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
NOT_WEIGHTS = ("scaled_fp8", ".scale_input", ".input_scale") + SCALE_SUFFIXES
# The model a key belongs to inside a file: ComfyUI marks each model of a checkpoint scaled on its own
# (`<model prefix>scaled_fp8`), so an all-in-one file may hold a scaled diffusion model beside a plain fp8 T5.
MODEL_ROOT = re.compile(r"(model\.diffusion_model\.|first_stage_model\.|vae\.|cond_stage_model\.|"
                        r"conditioner\.embedders\.\d+\.|text_encoders\.[^.]+\.)?")
# nn.Embedding tables: ComfyUI's scaled ops scale Linear weights only; a table stored in fp8 is read as stored
EMBEDDING_TABLES = ("token_embedding.weight", "position_embedding.weight", "shared.weight", "embed_tokens.weight",
                    "relative_attention_bias.weight")


@dataclass(frozen=True)
class TensorRef:
    file: SafetensorsFile | GGUFFile
    key: str                      # the name inside that file (the first part's, for a fused tensor)
    shape: tuple[int, ...]        # the canonical shape (may differ by a reshape, e.g. Linear -> 1x1 conv)
    parts: tuple["TensorRef", ...] = ()   # a fused tensor: these, concatenated along axis 0
    rows: tuple[int, int] | None = None   # only rows [a, b) of the stored tensor
    scale: str | None = None      # key of a scalar this tensor is multiplied by (scaled fp8)

    @property
    def stored(self) -> tuple[tuple[SafetensorsFile, str], ...]:
        """Every (file, key) whose bytes make this tensor."""
        if self.parts:
            return tuple(x for p in self.parts for x in p.stored)
        return ((self.file, self.key),) + (((self.file, self.scale),) if self.scale else ())

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(f.tensors[k].dtype for f, k in self.stored if k != self.scale)

    def read(self, raw: bool = False, target: np.dtype | None = None) -> np.ndarray:
        """The tensor as float32, or (`raw`) in its stored float type where that is exact (BF16,
        F16, F32, F8 as ml_dtypes arrays; a fused or scaled tensor is float32 either way). With
        `target` (an export's dtype), F8 and scaled F8 decode straight into it, through a byte-pair
        table: the same values as float32 dequantization then a cast, several times faster."""
        if self.parts:
            arrs = [p.read(raw, target) for p in self.parts]
            if len({a.dtype for a in arrs}) > 1:
                arrs = [a.astype(np.float32) for a in arrs]
            return np.concatenate(arrs, axis=0).reshape(self.shape)
        stored = self.file.tensors[self.key].dtype
        if target is not None and stored in fp8_decode.KINDS:
            scale = float(self.file.read(self.scale).astype(np.float32).reshape(())) if self.scale else None
            arr = fp8_decode.decode_fp8(self.file.read(self.key, raw=True), stored, target, scale)
        elif isinstance(self.file, GGUFFile):   # GGUF: quantized blocks dequantize (float32) and cast to `target`
            arr = self.file.read(self.key, raw=raw, target=target)
        else:
            arr = self.file.read(self.key, raw=raw and self.scale is None)
            if self.scale is not None:
                arr = arr.astype(np.float32) * self.file.read(self.scale).astype(np.float32).reshape(())
        if self.rows is not None:
            arr = arr[self.rows[0]:self.rows[1]]
        return arr.reshape(self.shape)


def tensor_ref(f: SafetensorsFile, key: str, canon: str) -> TensorRef:
    """Where canonical tensor `canon` lies. The VAE's mid attention is a 1x1 conv in LDM names;
    diffusers files (and some single files) store it as Linear [C, C]: it binds reshaped. A
    ComfyUI scaled-fp8 weight carries its scale; a Linear weight stored in fp8 without one in a
    model that is scaled (`scaled_fp8_models`) is refused: read as stored it would be the fp8 range
    (|w| up to 448), not the weight."""
    shape = f.tensors[key].shape
    if canon.startswith(VAE) and ".mid.attn_1." in canon and canon.endswith(".weight") and len(shape) == 2:
        shape = shape + (1, 1)
    scales = [key[:-len(".weight")] + s for s in SCALE_SUFFIXES] if key.endswith(".weight") else []
    scale = next((s for s in scales if s in f.tensors), None)
    if scale is None and len(shape) == 2 and f.tensors[key].dtype in fp8_decode.KINDS and key.endswith(".weight") \
            and not key.endswith(EMBEDDING_TABLES) and _root(key) in scaled_fp8_models(f):
        raise BadInput(f"{f.path}: {key} is stored in fp8 without its scale ({scales[0]}), while the model "
                       f"{'under ' + _root(key) + ' ' if _root(key) else ''}is scaled fp8 (a scaled_fp8 marker or "
                       "other weights' scales); read as stored its values would be the raw fp8 range (up to 448), not "
                       "the weight. The file is damaged or was converted incompletely: download or convert it again")
    return TensorRef(f, key, shape, scale=scale)


def _root(key: str) -> str:
    return MODEL_ROOT.match(key).group(0)


def scaled_fp8_models(f: SafetensorsFile) -> set[str]:
    """The models (key prefixes, `_root`) of `f` stored as ComfyUI scaled fp8: marked `scaled_fp8`, or
    holding a weight scale. Read from the header once per file."""
    if f not in _SCALED:
        _SCALED[f] = {_root(k) for k in f.tensors if k.endswith(("scaled_fp8",) + SCALE_SUFFIXES)}
    return _SCALED[f]


_SCALED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_ref(f_of: Callable[[str], SafetensorsFile], parts: list[tuple[str, tuple[int, int] | None]],
              prefix: str = "") -> TensorRef:
    """One canonical tensor made of stored ones (rows of them), concatenated along axis 0."""
    refs = []
    for key, rows in parts:
        base = tensor_ref(f_of(prefix + key), prefix + key, prefix + key)
        if rows is not None:
            base = TensorRef(base.file, base.key, (rows[1] - rows[0],) + base.shape[1:], rows=rows, scale=base.scale)
        refs.append(base)
    if len(refs) == 1:
        return refs[0]
    tails = {r.shape[1:] for r in refs}
    if len(tails) > 1:
        raise BadInput(f"{refs[0].file.path}: {', '.join(r.key for r in refs)} are fused into one weight but have "
                       f"shapes {', '.join(str(list(r.shape)) for r in refs)}; the file is damaged")
    return TensorRef(refs[0].file, refs[0].key, (sum(r.shape[0] for r in refs),) + refs[0].shape[1:], parts=tuple(refs))


@dataclass
class Checkpoint:
    """Canonical tensor name -> where its bytes are; plus component configs from a diffusers folder."""
    path: str
    layout: str                                   # "single-file" | "diffusers"
    refs: dict[str, TensorRef]
    configs: dict[str, dict] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    vae_file: str | None = None                   # --vae: where the VAE tensors came from

    def keys(self) -> list[str]:
        return list(self.refs)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.refs[key].shape

    def dtype(self, key: str) -> str:
        return self.refs[key].dtypes[0]

    def read(self, key: str, raw: bool = False, target: np.dtype | None = None) -> np.ndarray:
        return self.refs[key].read(raw, target)

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.refs if k.startswith(prefix)]

    def identity(self) -> str:
        """A digest of the tensor table (names, dtypes, shapes, byte spans) and file sizes.

        Cheap to compute (headers only); stands for the weights in output metadata."""
        h = hashlib.sha256()
        for key in sorted(self.refs):
            ref = self.refs[key]
            stored = ",".join(f"{k}:{f.tensors[k].dtype}:{f.tensors[k].end - f.tensors[k].start}" for f, k in ref.stored)
            h.update(f"{key}|{ref.shape}|{ref.rows}|{stored}\n".encode())
        return h.hexdigest()


def _looks_like_pickle(path: Path) -> bool:
    if not path.is_file():      # a pipe or device: opening it could block or read forever
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head[:1] == b"\x80" or head[:2] == b"PK"  # raw pickle protocol 2+ or torch's zip container


def _refuse_pickle(path: Path) -> BadInput:
    return BadInput(f"{path}: pickled checkpoint refused. {CONVERT_HINT}")


def open_weights_file(path: Path, refusal: Callable[[Path], BadInput] = _refuse_pickle) -> SafetensorsFile | GGUFFile:
    """A .safetensors file, a .gguf file (by its suffix or magic; its names are the model's own,
    mapped below as a .safetensors file's are), or `refusal(path)` for a pickle: by its suffix, or
    by its first bytes when it does not parse as safetensors (a safetensors header length may start
    with 0x80 too, so the sniff only explains a failure, it never decides)."""
    if gguf_file.is_gguf(path):
        return GGUFFile(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise refusal(path)
    try:
        return SafetensorsFile(path)
    except BadInput:
        if _looks_like_pickle(path):
            raise refusal(path) from None
        raise


BFL_TOP = {"double_blocks", "single_blocks", "img_in", "txt_in", "time_in", "vector_in", "guidance_in",
           "final_layer", "distilled_guidance_layer"}
SAI_TOP = {"joint_blocks", "x_embedder", "pos_embed", "t_embedder", "y_embedder", "context_embedder", "final_layer"}
# An all-in-one SD3 file keeps each CLIP's projection beside text_model.: canonical names put it inside.
PROJECTIONS = {p[:-len("text_model.")] + "text_projection.weight": p + "text_projection.weight" for p in (CLIP_L, CLIP_G)}


def is_weight_key(key: str) -> bool:
    """False for the scaled-fp8 side tensors (markers, input scales, weight scales): they belong
    to a weight, not to the model's graph."""
    return not key.endswith(NOT_WEIGHTS)


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


def _diffusers_dit_refs(files: dict[str, SafetensorsFile], where: str, prefix: str = "") -> dict[str, TensorRef]:
    """A Flux/Chroma (-> BFL names) or SD3 (-> SAI names) transformer in diffusers names, keys under `prefix`."""
    rel = [k[len(prefix):] for k in files if k.startswith(prefix) and is_weight_key(k)]
    shapes = {k: files[prefix + k].tensors[prefix + k].shape for k in rel}
    sd3 = sd3_names.is_diffusers_sd3(rel)
    parts, stray = (sd3_names.sai_parts if sd3 else flux_names.bfl_parts)(rel, shapes)
    if stray:
        raise BadInput(f"{where}: {len(stray)} transformer tensor(s) have no place in a "
                       f"{'SD3' if sd3 else 'Flux/Chroma'} transformer, e.g. "
                       f"{', '.join(stray[:5])}; the file is damaged or a variant precast does not support yet")
    return {DIT + canon: fused_ref(lambda k: files[k], srcs, prefix) for canon, srcs in parts.items()}


def open_single_file(path: Path) -> Checkpoint:
    f = open_weights_file(path)
    keys = [k for k in f.keys() if is_weight_key(k)]
    refs: dict[str, TensorRef] = {}
    if flux_names.is_diffusers_flux(keys) or sd3_names.is_diffusers_sd3(keys):   # a diffusers-named DiT as one file
        end = "pos_embed.proj.weight" if sd3_names.is_diffusers_sd3(keys) else "x_embedder.weight"
        prefix = next(k for k in keys if k.endswith(end))[:-len(end)]
        refs.update(_diffusers_dit_refs({k: f for k in f.keys()}, str(path), prefix))
        keys = [k for k in keys if not k.startswith(prefix)]
    names = _normalise_single_file(keys)
    refs.update({canon: tensor_ref(f, key, canon) for key, canon in names.items()})
    return Checkpoint(str(path), "single-file", refs, metadata=f.metadata)


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
    except (OSError, ValueError) as e:
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
    """("t5" | "clip", the key prefix the encoder's HF names start after), from its tensor names."""
    for kind, marker in (("t5", T5_MARKER), ("clip", CLIP_MARKER)):
        hit = next((k for k in keys if k.endswith(marker)), None)
        if hit is not None:
            return kind, hit[:-len(marker)]
    return None


def _encoder_mapping(keys: list[str], kind: str, prefix: str, canon: str | None = None) -> dict[str, str]:
    """A text encoder's keys (under `prefix`) -> canonical names (under `canon`: T5, or a CLIP's slot).
    A CLIP's `text_projection` (CLIPTextModelWithProjection) sits beside `text_model.`: it goes inside."""
    canon = canon or (T5 if kind == "t5" else CLIP_L)
    out = {k: canon + k[len(prefix):] for k in keys if k.startswith(prefix) and is_weight_key(k)}
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


CONFIG_OF = {T5: "t5", CLIP_L: "clip_l", CLIP_G: "clip_g"}     # Checkpoint.configs key of each encoder slot
DIT_CLASSES = ("FluxTransformer2DModel", "ChromaTransformer2DModel", "SD3Transformer2DModel")


def _dit_folder_refs(folder: Path, refs: dict, configs: dict, found: list) -> None:
    """A DiT pipeline folder (Flux, Chroma: BFL names; SD3: SAI names): text encoders by kind, CLIPs by folder."""
    weights = _component_weights(folder, "transformer")
    configs["transformer"] = _read_config(folder, "transformer")
    cls = configs["transformer"].get("_class_name")
    if cls not in DIT_CLASSES and not flux_names.is_diffusers_flux(list(weights)) and \
            not sd3_names.is_diffusers_sd3(list(weights)):
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
            raise BadInput(f"{folder}/{name}: neither a T5 nor a CLIP text encoder (looked for {T5_MARKER} and "
                           f"{CLIP_MARKER})")
        slot = T5 if kind[0] == "t5" else clip_slot(refs, weights, name)
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
        if rename is not None:
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
    """A separate text-encoder file (T5-XXL, CLIP-L or SD3's CLIP-G, HF names with or without a prefix,
    e.g. comfyanonymous' t5xxl_fp16.safetensors / clip_l.safetensors / clip_g.safetensors), or a diffusers text_encoder*/
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
        raise BadInput(f"{flag}: neither a T5 nor a CLIP text encoder (looked for {T5_MARKER} / {CLIP_MARKER}; "
                       f"found e.g. {', '.join(sorted(weights)[:3]) or 'no tensors'}); give the T5-XXL, CLIP-L or CLIP-G file")
    canon = T5 if kind[0] == "t5" else clip_slot(ckpt.refs, weights)
    for k in [k for k in ckpt.refs if k.startswith(canon)]:
        del ckpt.refs[k]
    for key, name in _encoder_mapping(list(weights), *kind, canon).items():
        ckpt.refs[name] = tensor_ref(weights[key], key, name)


def replace_vae(ckpt: Checkpoint, vae: Path) -> None:
    """Swap in a separate VAE: a diffusers `vae/` folder (or its parent), or a .safetensors file
    in LDM names (with or without first_stage_model.) or diffusers names."""
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
    elif any(".down_blocks." in k or ".up_blocks." in k for k in keys):
        mapping = {k: VAE + v for k, v in diffusers_names.vae_names(keys).items()}
    else:
        mapping = {k: VAE + k for k in keys if k.split(".")[0] in ("encoder", "decoder", "quant_conv", "post_quant_conv")}
    if not any(v.startswith(VAE + "decoder.") for v in mapping.values()):
        raise BadInput(f"--vae {vae}: no VAE decoder tensors found (looked for decoder.* / first_stage_model.decoder.*)")
    for k in [k for k in ckpt.refs if k.startswith(VAE)]:
        del ckpt.refs[k]
    ckpt.vae_file = str(vae)
    for key, canon in mapping.items():
        ckpt.refs[canon] = tensor_ref(weights[key], key, canon)
