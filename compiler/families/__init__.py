"""The model families precast builds, one module each: sd.py (SD 1.x, 2.x, XL and the XL refiner), flux.py (Flux.1
dev / schnell and Chroma), sd3.py (SD3 and SD3.5), zimage.py (Z-Image), flux2.py (FLUX.2 klein), qwenimage.py
(Qwen-Image). Each holds everything the compiler knows about its families (family.py's records: detection evidence,
components and the graph builders that make them, conventions the weights cannot say, how the parts must fit,
default recipe components and demos, the diffusers and OpenVINO GenAI folder layouts); what the runtime needs too is
the runtime family's (runtime/families/, read through Family.runtime). Nothing else in the compiler branches on a
family's name: it asks the registry.

Owns: the registry (FAMILIES, keyed by the manifest's model.family, in MODULES order) and detection, which
tries each module's evidence in the order DETECTION states and reads only the header (names and shapes).
A new family is a module here, listed in MODULES and DETECTION.
"""
from __future__ import annotations

from ..errors import BadInput
from ..sources.tensor_refs import CLIP_MARKER, T5_MARKER, VAE, Checkpoint
from . import flux, flux2, qwenimage, sd, sd3, zimage
from .family import Component, Detected, Family
from .overrides import SET_FIELDS, set_problem
from .schedule import flow_defaults
from .shared import latent_channels_of, latent_factor_of

MODULES = (sd, flux, sd3, zimage, flux2, qwenimage)
FAMILIES: dict[str, Family] = {f.name: f for m in MODULES for f in m.FAMILIES}
ASSUMED = "sd1"      # whose components a recipe builds when nothing names a family and no checkpoint is there to read
TEXT_POSITIONS = 77  # every supported CLIP text encoder (CLIP-L, OpenCLIP-H, bigG) has 77 positions

__all__ = ["ASSUMED", "FAMILIES", "SET_FIELDS", "TEXT_POSITIONS", "Component", "Detected", "Family", "detect_family",
           "detect_onnx_family", "flow_defaults", "latent_channels_of", "latent_factor_of", "require_supported",
           "set_problem", "titles"]


def _controlnet(ckpt: Checkpoint) -> Detected | None:
    """A ControlNet is no family: it is recognised to be refused by name (compiler/sources/controlnet.py reads it)."""
    if all(any(k.endswith(s) for k in ckpt.refs) for s in ("zero_convs.0.0.weight", "input_hint_block.0.weight")):
        return Detected("controlnet", "", "zero_convs.0.0.weight + input_hint_block.0.weight")
    return None


# The DiTs' blocks are unmistakable, so they go first; a ControlNet goes before the SD UNet, since the
# original ControlNet files carry a whole SD model beside the control model.
DETECTION = (sd3.detect, qwenimage.detect, flux.detect, zimage.detect, flux2.detect, _controlnet, sd.detect)
LOOKED_FOR = ", ".join([sd.LOOKED_FOR, sd3.LOOKED_FOR, flux.LOOKED_FOR, zimage.LOOKED_FOR, flux2.LOOKED_FOR,
                        qwenimage.LOOKED_FOR,
                        "zero_convs.* (ControlNet)", f"{VAE}decoder.conv_in.weight (VAE)"])
# names a single file holds when it is one component of a diffusers folder saved on its own
DIFFUSERS_COMPONENT_NAMES = ("down_blocks.", "up_blocks.", "mid_block.", "conv_in.", "time_embedding.",
                             "text_model.", "encoder.down_blocks.", "decoder.up_blocks.")


def detect_family(ckpt: Checkpoint) -> Detected:
    """The family (and variant) of a checkpoint from its tensor names and shapes, or one BadInput saying
    what was looked for and what the file looks like instead."""
    for evidence in DETECTION:
        found = evidence(ckpt)
        if found is not None:
            return found
    keys = ckpt.refs
    if VAE + "decoder.conv_in.weight" in keys or "decoder.conv_in.weight" in keys:
        return Detected("vae", "", "decoder.conv_in.weight without a UNet")
    hint = ""
    if any(k.endswith((T5_MARKER, CLIP_MARKER)) for k in keys):
        hint = (" It holds a text encoder only (T5 or CLIP): give the model's checkpoint and this file with "
                "--text-encoder FILE (recipe: model.text_encoders).")
    elif any(k.startswith(DIFFUSERS_COMPONENT_NAMES) for k in keys):
        hint = (" These look like the tensors of one component of a diffusers folder (unet/, vae/, "
                "text_encoder/): pass the folder that holds model_index.json instead of the file.")
    raise BadInput(f"{ckpt.path}: not a recognised diffusion model checkpoint. Looked for: {LOOKED_FOR}. "
                   f"Found {len(keys)} tensors, e.g. {', '.join(sorted(keys)[:3]) or 'none'}.{hint}")


# An optimum / diffusers ONNX folder's family from its graphs' IO (compiler/foreign_onnx.py): the modules
# whose families `precast compile` / `precast build` read from such folders
ONNX_DETECTION = (sd.detect_onnx,)


def detect_onnx_family(comps: dict, index: dict, hidden) -> str:
    """The family of an ONNX pipeline folder's graphs ({component: ExportedComponent}, its model_index.json;
    `hidden(component)`: a component's text-state width)."""
    for evidence in ONNX_DETECTION:
        found = evidence(comps, index, hidden)
        if found:
            return found
    raise BadInput(f"no model family precast builds has these ONNX graphs ({', '.join(comps)})")


def require_supported(ckpt: Checkpoint, family: Detected) -> Family:
    """The family record of what detection found, or one BadInput (a VAE alone, a ControlNet given as the model)."""
    if family.name == "vae":
        raise BadInput(f"{ckpt.path}: holds a VAE only ({family.evidence}); give the whole model as the "
                       "checkpoint and this file as its VAE: --vae FILE (recipe: model.vae)")
    if family.name not in FAMILIES:
        raise BadInput(f"{ckpt.path}: detected {family.name}{' (' + family.variant + ')' if family.variant else ''} "
                       f"from {family.evidence}; {family.name} is not supported yet "
                       f"(supported: {', '.join(sorted(FAMILIES))}).")
    return FAMILIES[family.name]


def titles(names) -> str:
    """'Flux, Chroma and SD3': the families' titles as a sentence lists them."""
    words = [FAMILIES[n].title for n in names]
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)
