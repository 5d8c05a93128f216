"""Opens what a user points precast at and presents it as one set of canonical tensor names.

Owns: recognising the input (single-file .safetensors, diffusers folder, pickled checkpoint),
refusing pickles without ever unpickling them, and mapping every layout to the LDM
single-file names (`model.diffusion_model.*`, `first_stage_model.*`,
`cond_stage_model.transformer.text_model.*`) so that detection and graph builders see one
layout. Tensors are read one at a time, on demand.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import numpy as np

from ..errors import BadInput
from . import diffusers_names
from .safetensors_file import SafetensorsFile

PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl"}
CONVERT_HINT = ("precast never unpickles checkpoints (a pickle can run arbitrary code). Convert it once, "
                "in an environment you trust, to .safetensors, e.g. python -c \"import torch, safetensors.torch as st; "
                "sd = torch.load('IN.ckpt', weights_only=True); sd = sd.get('state_dict', sd); "
                "st.save_file({k: v.contiguous() for k, v in sd.items() if hasattr(v, 'contiguous')}, 'OUT.safetensors')\"")

UNET = "model.diffusion_model."
VAE = "first_stage_model."
TEXT = "cond_stage_model.transformer.text_model."


@dataclass(frozen=True)
class TensorRef:
    file: SafetensorsFile
    key: str                      # the name inside that file
    shape: tuple[int, ...]        # the canonical shape (may differ by a reshape, e.g. Linear -> 1x1 conv)


def tensor_ref(f: SafetensorsFile, key: str, canon: str) -> TensorRef:
    """Where canonical tensor `canon` lies. The VAE's mid attention is a 1x1 conv in LDM names;
    diffusers files (and some single files) store it as Linear [C, C]: it binds reshaped."""
    shape = f.tensors[key].shape
    if canon.startswith(VAE) and ".mid.attn_1." in canon and canon.endswith(".weight") and len(shape) == 2:
        shape = shape + (1, 1)
    return TensorRef(f, key, shape)


@dataclass
class Checkpoint:
    """Canonical tensor name -> where its bytes are; plus component configs from a diffusers folder."""
    path: str
    layout: str                                   # "single-file" | "diffusers"
    refs: dict[str, TensorRef]
    configs: dict[str, dict] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def keys(self) -> list[str]:
        return list(self.refs)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.refs[key].shape

    def dtype(self, key: str) -> str:
        ref = self.refs[key]
        return ref.file.tensors[ref.key].dtype

    def read(self, key: str) -> np.ndarray:
        ref = self.refs[key]
        return ref.file.read(ref.key).reshape(ref.shape)

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.refs if k.startswith(prefix)]

    def identity(self) -> str:
        """A digest of the tensor table (names, dtypes, shapes, byte spans) and file sizes.

        Cheap to compute (headers only); stands for the weights in output metadata."""
        h = hashlib.sha256()
        for key in sorted(self.refs):
            ref = self.refs[key]
            info = ref.file.tensors[ref.key]
            h.update(f"{key}|{info.dtype}|{ref.shape}|{info.end - info.start}\n".encode())
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


def open_weights_file(path: Path, refusal: Callable[[Path], BadInput] = _refuse_pickle) -> SafetensorsFile:
    """A .safetensors file, or `refusal(path)` for a pickle: by its suffix, or by its first bytes
    when it does not parse as safetensors (a safetensors header length may start with 0x80 too,
    so the sniff only explains a failure, it never decides)."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise refusal(path)
    try:
        return SafetensorsFile(path)
    except BadInput:
        if _looks_like_pickle(path):
            raise refusal(path) from None
        raise


def _normalise_single_file(keys: list[str]) -> dict[str, str]:
    """Single-file variants -> canonical names: diffusion-only files without a prefix, and old
    SD1 files whose text encoder lacks `text_model.`."""
    bare_unet = any(k.startswith("input_blocks.") for k in keys) and not any(k.startswith(UNET) for k in keys)
    out = {}
    for k in keys:
        c = k
        if bare_unet and k.split(".")[0] in {"input_blocks", "middle_block", "output_blocks", "time_embed",
                                             "out", "label_emb"}:
            c = UNET + k
        elif k.startswith("cond_stage_model.transformer.") and not k.startswith(TEXT) and \
                k.split(".")[2] in {"embeddings", "encoder", "final_layer_norm"}:
            c = TEXT + k[len("cond_stage_model.transformer."):]
        out[k] = c
    return out


def open_single_file(path: Path) -> Checkpoint:
    f = open_weights_file(path)
    names = _normalise_single_file(f.keys())
    refs = {canon: tensor_ref(f, key, canon) for key, canon in names.items()}
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
    """Where a folder's text encoders go in the canonical layout: SD 1.x/2.x have one; SDXL base
    has CLIP-L + bigG (text_encoder_2); the refiner has bigG only."""
    if (folder / "text_encoder_2").is_dir():
        if (folder / "text_encoder").is_dir():
            return {"text_encoder": "conditioner.embedders.0.transformer.text_model.",
                    "text_encoder_2": "conditioner.embedders.1.transformer.text_model."}
        return {"text_encoder_2": "conditioner.embedders.0.transformer.text_model."}
    return {"text_encoder": TEXT}


def open_diffusers_folder(folder: Path) -> Checkpoint:
    refs: dict[str, TensorRef] = {}
    configs: dict[str, dict] = {}
    found = []
    texts = [(name, prefix, None) for name, prefix in _text_prefixes(folder).items()]
    for name, prefix, rename in [("unet", UNET, diffusers_names.unet_names),
                                 ("vae", VAE, diffusers_names.vae_names), *texts]:
        weights = _component_weights(folder, name)
        if weights is None:
            continue
        found.append(name)
        configs[name] = _read_config(folder, name)
        keys = list(weights)
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
        raise BadInput(f"{folder}: a folder, but not a diffusers model (no unet/, vae/ or text_encoder/ "
                       "with .safetensors weights)")
    return Checkpoint(str(folder), "diffusers", refs, configs=configs)


def open_checkpoint(path: str | os.PathLike, vae: str | os.PathLike | None = None) -> Checkpoint:
    """The checkpoint at `path`; with `vae`, its VAE tensors are replaced by that file's or folder's
    (e.g. the SDXL fp16-fix VAE)."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such file or folder")
    if p.is_dir():
        ckpt = open_diffusers_folder(p)
    else:
        ckpt = open_single_file(p)
    if vae is not None:
        replace_vae(ckpt, Path(vae))
    return ckpt


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
    elif any(".down_blocks." in k or ".up_blocks." in k for k in keys):
        mapping = {k: VAE + v for k, v in diffusers_names.vae_names(keys).items()}
    else:
        mapping = {k: VAE + k for k in keys if k.split(".")[0] in ("encoder", "decoder", "quant_conv", "post_quant_conv")}
    if not any(v.startswith(VAE + "decoder.") for v in mapping.values()):
        raise BadInput(f"--vae {vae}: no VAE decoder tensors found (looked for decoder.* / first_stage_model.decoder.*)")
    for k in [k for k in ckpt.refs if k.startswith(VAE)]:
        del ckpt.refs[k]
    for key, canon in mapping.items():
        ckpt.refs[canon] = tensor_ref(weights[key], key, canon)
