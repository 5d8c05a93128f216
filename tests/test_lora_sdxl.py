"""LoRA name resolution for SDXL (kohya's LDM-path names, lora_te1 / lora_te2 with OpenCLIP's fused
q/k/v) and SD 2.x, merged while exporting: every patched weight equals W + strength·alpha/rank·up@down
computed here in numpy from the checkpoint, and nothing else changes."""
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from safetensors.numpy import load_file

from conftest import rel_err
from precast.compiler.demo_lora import write_demo_lora
from precast.compiler.demo_model import TINY_SD2, TINY_SDXL, random_tensor, sd1_layout, write_safetensors
from precast.compiler.export import export
from precast.compiler.sources.safetensors_file import SafetensorsFile

UNET = "model.diffusion_model."


def _initializers(folder):
    """{full checkpoint key: array}: initializer names plus the prefix the export records."""
    m = onnx.load(str(folder / "model.onnx"))
    prefix = {p.key: p.value for p in m.metadata_props}["precast.prefix"]
    return {prefix + t.name: numpy_helper.to_array(t, base_dir=str(folder)) for t in m.graph.initializer}


def _deltas(targets, lora):
    """{checkpoint key: [(rows, alpha / rank * up @ down)]}, computed here in numpy from the LoRA file."""
    want = {}
    for t in targets:
        down, up = lora[f"{t.name}.lora_down.weight"], lora[f"{t.name}.lora_up.weight"]
        want.setdefault(t.key, []).append((t.rows, (float(lora[f"{t.name}.alpha"]) / down.shape[0]) * up @ down))
    return want


@pytest.mark.parametrize("cfg", [TINY_SDXL, TINY_SD2])
def test_kohya_lora_merges_into_sdxl_and_sd2(tmp_path, cfg):
    layout = sd1_layout(cfg)
    rng = np.random.default_rng(5)
    ckpt = tmp_path / "model.safetensors"
    write_safetensors(str(ckpt), layout, "fp32", lambda k, s: random_tensor(rng, k, s))
    targets = write_demo_lora(str(tmp_path / "lora.safetensors"), cfg, seed=6)
    want = _deltas(targets, load_file(str(tmp_path / "lora.safetensors")))
    strength, te_strength = 0.7, 0.4
    out = tmp_path / "onnx"
    report = export(ckpt, out, progress=False, loras=[(str(tmp_path / "lora.safetensors"), strength, te_strength)])
    comps = {c["name"] for c in report["components"]}
    base = SafetensorsFile(ckpt)
    merged = {}
    for comp in comps:
        merged.update(_initializers(out / comp))
    checked = 0
    for key, parts in want.items():
        if key not in merged:  # e.g. the last CLIP layer, which the graph skips
            continue
        expect = base.read(key).astype(np.float64)
        s = strength if key.startswith(UNET) else te_strength
        for rows, delta in parts:
            if rows is None:
                expect += s * delta
            else:
                expect[rows[0]:rows[1]] += s * delta
        assert rel_err(merged[key].reshape(expect.shape), expect) <= 1e-5, key
        checked += 1
    assert checked >= len(want) - 4
    untouched = UNET + "input_blocks.0.0.weight"
    np.testing.assert_array_equal(merged[untouched], base.read(untouched))
