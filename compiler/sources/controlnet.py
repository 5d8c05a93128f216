"""Opens a ControlNet file or folder and presents its tensors under one canonical prefix,
`control_model.`, in LDM names.

Owns: recognising the ControlNet layouts (LDM single files with `control_model.` or bare keys,
diffusers folders with config.json + diffusion_pytorch_model.safetensors or a parent holding
`controlnet/`, diffusers-named single files) and refusing what is not a ControlNet by name; and the
name of the `controlnet_<name>` component a ControlNet becomes (controlnet_name).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import BadInput
from .diffusers_folder import _component_weights, _read_json
from .tensor_refs import Checkpoint, is_weight_key, open_weights_file, tensor_ref
from .controlnet_names import LDM_TOP, MARKER, controlnet_names, is_diffusers_controlnet

CONTROL = "control_model."
CONTROLNET_PREFIX = "controlnet_"      # a ControlNet's component is controlnet_<name>


def controlnet_name(path, name: str | None = None) -> str:
    """`name` if given (letters, digits, _), else the file's stem (a diffusers folder's name)
    lower-cased with every other character run replaced by _."""
    if name:
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise BadInput(f"--controlnet {path}:{name}: a name is letters, digits and _")
        return name
    p = Path(path)
    stem = p.parent.name if p.name == "controlnet" and p.is_dir() else (p.stem if p.is_file() else p.name)
    return re.sub(r"[^a-z0-9_]+", "_", stem.lower()).strip("_") or "net"


def _canonical(keys: list[str], where: str) -> dict[str, str]:
    """stored key -> canonical key (under CONTROL), for any of the layouts."""
    keys = [k for k in keys if is_weight_key(k)]
    if any(k.startswith(CONTROL) for k in keys):
        return {k: k for k in keys if k.startswith(CONTROL)}
    if is_diffusers_controlnet(keys):
        prefix = next(k for k in keys if k.endswith(MARKER))[:-len(MARKER)]
        rel = [k[len(prefix):] for k in keys if k.startswith(prefix)]
        return {prefix + k: CONTROL + v for k, v in controlnet_names(rel).items()}
    if any(k.startswith("zero_convs.") for k in keys) and any(k.startswith("input_hint_block.") for k in keys):
        return {k: CONTROL + k for k in keys if k.split(".")[0] in LDM_TOP}
    if any("lora_controlnet" in k for k in keys):
        raise BadInput(f"{where}: a Control-LoRA (lora_controlnet), not a ControlNet; not supported yet")
    raise BadInput(f"{where}: not a ControlNet (looked for control_model.*, zero_convs.* with input_hint_block.*, "
                   f"or {MARKER}; found e.g. {', '.join(sorted(keys)[:3]) or 'no tensors'})")


def open_controlnet(path: str | os.PathLike) -> Checkpoint:
    """The ControlNet at `path` (a .safetensors file or a diffusers folder), its tensors under
    `control_model.` in LDM names; a folder's config.json is in `configs["controlnet"]`."""
    p = Path(path)
    where = f"--controlnet {p}"
    if not p.exists():
        raise BadInput(f"{where}: no such file or folder")
    configs = {}
    if p.is_dir():
        folder = p if (p / "config.json").is_file() else p / "controlnet"
        weights = _component_weights(folder.parent, folder.name)
        if weights is None:
            raise BadInput(f"{where}: a folder without config.json or controlnet/; give the ControlNet's folder "
                           "(config.json + diffusion_pytorch_model.safetensors) or its .safetensors file")
        configs["controlnet"] = _read_json(folder / "config.json")
        cls = configs["controlnet"].get("_class_name")
        if cls not in (None, "ControlNetModel"):
            raise BadInput(f"{folder / 'config.json'}: a {cls}, not a ControlNetModel (SD 1.x/2.x/XL ControlNets are supported)")
        layout = "diffusers"
    else:
        f = open_weights_file(p)
        weights = {k: f for k in f.keys()}
        layout = "single-file"
    mapping = _canonical(list(weights), where)
    refs = {canon: tensor_ref(weights[key], key, canon) for key, canon in mapping.items()}
    meta = next(iter(weights.values())).metadata if weights else {}
    return Checkpoint(str(p), layout, refs, configs=configs, metadata=meta)
