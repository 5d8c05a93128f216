"""Family detection from names and shapes: full single files and UNet-only files of every
supported family (a UNet alone must still tell SDXL base from the refiner)."""
import numpy as np
import pytest

from precast.compiler.demo_model import TINY, TINY_REFINER, TINY_SD2, TINY_SDXL, SDXL, sd1_layout, write_safetensors
from precast.compiler.sources.checkpoint import UNET, open_checkpoint
from precast.compiler.families import detect_family

CONFIGS = {"sd1": TINY, "sd2": TINY_SD2, "sdxl": TINY_SDXL, "sdxl-refiner": TINY_REFINER}


def _write(path, shapes):
    write_safetensors(str(path), shapes, "fp16", lambda k, s: np.zeros(s, np.float16))
    return path


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("part", ["whole", "unet-only", "unet-without-prefix"])
def test_family_from_names_and_shapes(tmp_path, family, part):
    shapes = sd1_layout(CONFIGS[family])
    if part != "whole":
        shapes = {(k if part == "unet-only" else k[len(UNET):]): s for k, s in shapes.items() if k.startswith(UNET)}
    assert detect_family(open_checkpoint(_write(tmp_path / "m.safetensors", shapes))).name == family


def test_full_size_sdxl_unet_alone_is_the_base(tmp_path):
    label = {k: s for k, s in sd1_layout(SDXL).items() if k.startswith(UNET + "label_emb.") or "attn2.to_k" in k}
    shapes = {**label, UNET + "input_blocks.0.0.weight": (320, 4, 3, 3)}
    found = detect_family(open_checkpoint(_write(tmp_path / "m.safetensors", shapes)))
    assert found.name == "sdxl" and "2816" in found.evidence
