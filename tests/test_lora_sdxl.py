"""LoRA name resolution for SDXL (kohya's LDM-path names, lora_te1 / lora_te2 with OpenCLIP's fused
q/k/v) and SD 2.x, merged while exporting: every patched weight equals W + strength·alpha/rank·up@down
computed here in numpy from the checkpoint, and nothing else changes."""
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from safetensors.numpy import save_file

from conftest import rel_err
from precast.compiler.demo_model import TINY_SD2, TINY_SDXL, random_tensor, sd1_layout, write_safetensors
from precast.compiler.export import export
from precast.compiler.sources.safetensors_file import SafetensorsFile

UNET = "model.diffusion_model."


def _initializers(folder):
    """{full checkpoint key: array}: initializer names plus the prefix the export records."""
    m = onnx.load(str(folder / "model.onnx"))
    prefix = {p.key: p.value for p in m.metadata_props}["precast.prefix"]
    return {prefix + t.name: numpy_helper.to_array(t, base_dir=str(folder)) for t in m.graph.initializer}


def _kohya(layout, rng, te_prefixes, rank=4, alpha=2.0):
    """kohya LoRA over LDM paths for the UNet's attention projections and the text encoders' MLPs
    and q/k/v (OpenCLIP's fused in_proj addressed as HF q_proj/k_proj/v_proj, as kohya names them)."""
    sd, want = {}, {}

    def add(name, out_dim, in_dim, target, rows=None):
        down = rng.standard_normal((rank, in_dim)).astype(np.float32) * 0.2
        up = rng.standard_normal((out_dim, rank)).astype(np.float32) * 0.2
        sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"] = down, up
        sd[f"{name}.alpha"] = np.array(alpha, np.float32)
        want.setdefault(target, []).append((rows, (alpha / rank) * up @ down))

    for key, shape in layout.items():
        if key.startswith(UNET) and ".transformer_blocks." in key and key.endswith(("to_q.weight", "to_v.weight",
                                                                                    "to_out.0.weight")):
            module = key[len(UNET):-len(".weight")]
            add("lora_unet_" + module.replace(".", "_"), shape[0], shape[1], key)
    for tag, prefix in te_prefixes.items():
        for key, shape in layout.items():
            if not key.startswith(prefix):
                continue
            rel = key[len(prefix):]
            if rel.endswith("mlp.fc1.weight"):  # HF layout (CLIP-L)
                layer = rel.split(".")[2]
                add(f"lora_{tag}_text_model_encoder_layers_{layer}_mlp_fc1", shape[0], shape[1], key)
            elif rel.endswith("attn.in_proj_weight"):  # OpenCLIP: rows q | k | v
                layer, d = rel.split(".")[2], shape[1]
                for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
                    add(f"lora_{tag}_text_model_encoder_layers_{layer}_self_attn_{name}", d, d, key, (i * d, (i + 1) * d))
            elif rel.endswith("mlp.c_fc.weight"):
                layer = rel.split(".")[2]
                add(f"lora_{tag}_text_model_encoder_layers_{layer}_mlp_fc1", shape[0], shape[1], key)
    return sd, want


@pytest.mark.parametrize("cfg, te", [
    (TINY_SDXL, {"te1": "conditioner.embedders.0.transformer.text_model.", "te2": "conditioner.embedders.1.model."}),
    (TINY_SD2, {"te": "cond_stage_model.model."}),
])
def test_kohya_lora_merges_into_sdxl_and_sd2(tmp_path, cfg, te):
    layout = sd1_layout(cfg)
    rng = np.random.default_rng(5)
    ckpt = tmp_path / "model.safetensors"
    write_safetensors(str(ckpt), layout, "fp32", lambda k, s: random_tensor(rng, k, s))
    lora, want = _kohya(layout, np.random.default_rng(6), te)
    save_file(lora, str(tmp_path / "lora.safetensors"))
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
