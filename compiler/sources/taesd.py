"""Opens a TAESD-style tiny autoencoder's decoder (TAESD, TAESDXL, TAESD3, TAEF1: madebyollin's step-preview
decoders) and presents its tensors in madebyollin's names, the canonical ones: the decoder's nn.Sequential
indices (`1.weight`, `3.conv.0.weight`, ...), with no prefix.

Owns: recognising the layouts -- madebyollin's `taesd_decoder.safetensors` (bare indices from 1: index 0 is
the Clamp), ComfyUI's `taesd_decoder.`-prefixed keys, diffusers' AutoencoderTiny (`decoder.layers.N` is
index N + 1; a folder with config.json, whose scaling_factor / shift_factor and fixed fields are read) -- and
refusing an encoder or anything else by name.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import BadInput
from .diffusers_folder import _component_weights, _read_json
from .tensor_refs import Checkpoint, is_weight_key, open_weights_file, tensor_ref

TAESD = ""                     # the canonical prefix: none
COMFY = "taesd_decoder."       # ComfyUI's merged TAESD files: madebyollin's names under this prefix
DIFFUSERS = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
BARE = re.compile(r"(\d+)\.(.+)")


def _canonical(keys: list[str], where: str) -> dict[str, str]:
    """stored key -> canonical key, for any of the layouts."""
    keys = [k for k in keys if is_weight_key(k)]
    if any(k.startswith(COMFY) for k in keys):
        return {k: k[len(COMFY):] for k in keys if k.startswith(COMFY)}
    if any(DIFFUSERS.fullmatch(k) for k in keys):
        return {k: f"{int(m[1]) + 1}.{m[2]}" for k in keys if (m := DIFFUSERS.fullmatch(k))}
    if keys and all(BARE.fullmatch(k) for k in keys):
        if "0.weight" in keys:      # the encoder starts with a conv; the decoder with its Clamp (no weights)
            raise BadInput(f"{where}: a TAESD encoder (0.weight: a conv taking 3 image channels), not a decoder; "
                           "give the decoder file (taesd_decoder.safetensors, taef1_decoder.safetensors, ...)")
        return {k: k for k in keys}
    found = ", ".join(sorted(keys)[:3]) or "no tensors"
    raise BadInput(f"{where}: not a TAESD decoder (looked for madebyollin's 1.weight, 3.conv.0.weight, ..., "
                   f"{COMFY}*, or diffusers' decoder.layers.*; found e.g. {found})")


def open_preview_decoder(path: str | os.PathLike) -> Checkpoint:
    """The decoder at `path` (a .safetensors file, or a diffusers AutoencoderTiny folder), its tensors in
    madebyollin's names; a folder's config.json is in `configs["preview"]`."""
    p = Path(path)
    where = f"preview: {p}"
    if not p.exists():
        raise BadInput(f"{where}: no such file or folder")
    configs = {}
    if p.is_dir():
        weights = _component_weights(p.parent, p.name) if (p / "config.json").is_file() else None
        if weights is None:
            raise BadInput(f"{where}: a folder without config.json; give a TAESD decoder .safetensors file or a "
                           "diffusers AutoencoderTiny folder (config.json + diffusion_pytorch_model.safetensors)")
        configs["preview"] = _read_json(p / "config.json")
        cls = configs["preview"].get("_class_name")
        if cls not in (None, "AutoencoderTiny"):
            raise BadInput(f"{p / 'config.json'}: a {cls}, not an AutoencoderTiny (a TAESD / TAESDXL / TAESD3 / TAEF1)")
    else:
        f = open_weights_file(p)
        weights = dict.fromkeys(f.keys(), f)
    refs = {canon: tensor_ref(weights[key], key, canon) for key, canon in _canonical(list(weights), where).items()}
    meta = next(iter(weights.values())).metadata if weights else {}
    return Checkpoint(str(p), "diffusers" if configs else "single-file", refs, configs=configs, metadata=meta)
