"""The tiny demo files `precast demo-model --family NAME` writes, one per family, and how to use each.

Owns: which writer and config make each family's file (compiler/demo_model.py: SD 1.x / 2.x / XL and
the inpainting UNet; demo_sd3.py; demo_dit.py: Flux, Chroma; demo_zimage.py: Z-Image; demo_flux2.py: FLUX.2 klein and dev;
demo_qwenimage.py: Qwen-Image; demo_controlnet.py; demo_lora.py) and the recipe that builds it (for a LoRA or
ControlNet: into the base it fits).
The files are the ones the `demo:` recipe sources and the tests use, so an example or a bug report needs no
private function. Imports nothing heavy at module level (the CLI lists the names).
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

SD_PROFILE = "profiles: {batch: 1, height: 64, width: 64}"
DIT_PROFILE = "profiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}"
TARGETS = "targets: [onnxruntime, {openvino: {device: CPU}}]"
DIT_AXES = "set: {transformer: {axes_dims_rope: [4, 6, 6]}}"   # the tiny DiTs' 16-wide heads: demo_dit.DEMO_AXES
FLUX2_AXES = "set: {transformer: {axes_dims_rope: [4, 4, 4, 4]}}"   # the tiny FLUX.2's: demo_flux2.DEMO_AXES
LLM_PROFILE = "profiles: {batch: 1, height: 64, width: 64, t5_tokens: {min: 32, opt: 64, max: 128}}"   # text length


@dataclass(frozen=True)
class DemoFamily:
    label: str              # what the file is, for the "wrote" line
    write: str              # "module:function:arg"; arg: an SD1Config of demo_model (capitals) or a demo name
    recipe: str             # a recipe building it; {path} is the file (a JSON string, which YAML reads)


def _checkpoint(model: str = "", profile: str = SD_PROFILE, note: str = "") -> str:
    return "\n".join(["model: {source: {path}" + (f", {model}" if model else "") + "}" + note, profile, TARGETS])


def _onto_sd15(extra: str) -> str:
    return "\n".join(["model: {source: demo:tiny-sd15}   # the embedded tiny SD 1.x (precast demo-model --family sd15)",
                      extra, SD_PROFILE, TARGETS])


FAMILIES = {
    "sd15": DemoFamily("tiny SD 1.x", "demo_model:write_demo_model:TINY", _checkpoint()),
    "sd2": DemoFamily("tiny SD 2.x (OpenCLIP-H layout)", "demo_model:write_demo_model:TINY_SD2", _checkpoint()),
    "sdxl": DemoFamily("tiny SDXL base", "demo_model:write_demo_model:TINY_SDXL", _checkpoint()),
    "inpaint": DemoFamily("tiny SD 1.x inpainting (9-channel UNet)", "demo_model:write_demo_model:TINY_INPAINT",
                          _checkpoint(note="   # generate --init-image IMAGE.png --mask MASK.png")),
    "sd3": DemoFamily("tiny SD3-medium", "demo_sd3:write_demo_sd3:tiny-sd3", _checkpoint(profile=DIT_PROFILE)),
    "sd35-medium": DemoFamily("tiny SD3.5-medium (MMDiT-X)", "demo_sd3:write_demo_sd3:tiny-sd35-medium",
                              _checkpoint(profile=DIT_PROFILE)),
    "sd35-large": DemoFamily("tiny SD3.5-large", "demo_sd3:write_demo_sd3:tiny-sd35-large",
                             _checkpoint(profile=DIT_PROFILE)),
    "flux-dev": DemoFamily("tiny Flux.1 [dev]", "demo_dit:write_demo_dit:tiny-flux-dev",
                           _checkpoint(DIT_AXES, DIT_PROFILE)),
    "flux-schnell": DemoFamily("tiny Flux.1 [schnell]", "demo_dit:write_demo_dit:tiny-flux-schnell",
                               _checkpoint(DIT_AXES, DIT_PROFILE)),
    "chroma": DemoFamily("tiny Chroma", "demo_dit:write_demo_dit:tiny-chroma", _checkpoint(DIT_AXES, DIT_PROFILE)),
    "z-image": DemoFamily("tiny Z-Image-Turbo (with its tokenizer)", "demo_zimage:write_demo_zimage:tiny-z-image",
                          _checkpoint(DIT_AXES, LLM_PROFILE)),
    "flux2-klein": DemoFamily("tiny FLUX.2 klein (with its tokenizer)", "demo_flux2:write_demo_flux2:tiny-flux2-klein",
                              _checkpoint(FLUX2_AXES, LLM_PROFILE)),
    "flux2-dev": DemoFamily("tiny FLUX.2 dev (with its tokenizer)", "demo_flux2:write_demo_flux2:tiny-flux2-dev",
                            _checkpoint(FLUX2_AXES, LLM_PROFILE)),
    "qwen-image": DemoFamily("tiny Qwen-Image (with its tokenizer)",
                             "demo_qwenimage:write_demo_qwenimage:tiny-qwen-image", _checkpoint(DIT_AXES, LLM_PROFILE)),
    "controlnet": DemoFamily("tiny ControlNet for the tiny SD 1.x", "demo_controlnet:write_demo_controlnet:TINY",
                             _onto_sd15("controlnets: [{path: {path}, name: demo}]   "
                                        "# generate --control IMAGE.png:0.8 --controlnet demo")),
    "lora": DemoFamily("tiny kohya LoRA for the tiny SD 1.x", "demo_lora:write_demo_lora:TINY",
                       _onto_sd15("loras: [{path: {path}, strength: 0.8}]")),
}


DEFAULT = "sd15"      # the embedded default (demo:tiny-sd15)


def write_demo_file(family: str, path: str, seed: int = 0) -> str:
    """Write `family`'s tiny file at `path` (temp file + rename); the recipe that builds it."""
    module, function, arg = FAMILIES[family].write.split(":")
    write = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    write(path, getattr(importlib.import_module(f"{__package__}.demo_model"), arg) if arg.isupper() else arg, seed=seed)
    return FAMILIES[family].recipe.replace("{path}", json.dumps(path))
