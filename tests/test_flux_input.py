"""Bad input for Flux / Chroma exports: one line naming the file, key or field and the fix (exit 2), and
nothing written: transposed same-size weights (Linear layers too), files of the wrong kind, parts that
do not fit (a 4-channel VAE, a missing T5), variants not supported yet."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import precast
from precast.compiler.demo_dit import (DEMO_AXES, TINY_FLUX_SCHNELL, TINY_T5, TINY_VAE16, write_clip_l_file,
                                       write_flux_checkpoint, write_t5_file, write_vae16_file)
from precast.compiler.demo_model import write_demo_model

AXES = "transformer.axes_dims_rope=" + json.dumps(DEMO_AXES).replace(" ", "")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux-input")
    out = {"flux": tmp / "flux.safetensors", "t5": tmp / "t5.safetensors", "clip": tmp / "clip.safetensors",
           "vae": tmp / "vae.safetensors", "sd": tmp / "sd.safetensors"}
    write_flux_checkpoint(out["flux"], TINY_FLUX_SCHNELL, seed=1, layout="bare", dtype="fp32")
    write_t5_file(out["t5"], TINY_T5, seed=2, dtype="fp32")
    write_clip_l_file(out["clip"], seed=3, dtype="fp32")
    write_vae16_file(out["vae"], TINY_VAE16, seed=4)
    write_demo_model(str(out["sd"]))
    return out


def _changed(src, dst, change):
    tensors = load_file(str(src))
    change(tensors)
    save_file(tensors, str(dst))
    return dst


def _refused(tmp_path, *args):
    out = tmp_path / "out"
    proc = precast("export", *map(str, args), "--out", out)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.precast-*")), "something was left behind"
    return lines[0]


@pytest.mark.parametrize("key", ["double_blocks.0.img_mlp.0.weight", "single_blocks.1.linear2.weight",
                                 "time_in.in_layer.weight", "double_blocks.1.txt_attn.qkv.weight"])
def test_a_transposed_flux_weight_is_named(parts, tmp_path, key):
    def transpose(t):
        t[key] = np.ascontiguousarray(t[key].T)      # same byte count, wrong shape
    bad = _changed(parts["flux"], tmp_path / "bad.safetensors", transpose)
    line = _refused(tmp_path, bad, "--set", AXES, "--component", "transformer")
    assert key in line and "shape" in line, line


def test_a_transposed_linear_in_an_sd_attention_block_is_named(parts, tmp_path):
    """An SD 1.x cross-attention to_k [inner, context] stored as [context, inner]: it exported and
    failed inside the backend; now it is named."""
    key = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"

    def transpose(t):
        assert t[key].shape[0] != t[key].shape[1]
        t[key] = np.ascontiguousarray(t[key].T)
    bad = _changed(parts["sd"], tmp_path / "sd-bad.safetensors", transpose)
    line = _refused(tmp_path, bad, "--component", "unet")
    assert key in line, line


def test_files_of_the_wrong_kind_are_named(parts, tmp_path):
    line = _refused(tmp_path, parts["flux"], "--set", AXES, "--text-encoder", parts["vae"])
    assert str(parts["vae"]) in line and "neither a T5 nor a CLIP" in line, line
    line = _refused(tmp_path, parts["t5"])
    assert "text encoder only" in line and "--text-encoder" in line, line


def test_a_missing_t5_is_named_with_the_fix(parts, tmp_path):
    line = _refused(tmp_path, parts["flux"], "--set", AXES, "--component", "text_encoder_2")
    assert "T5" in line and "--text-encoder" in line, line
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {parts['flux']}, set: {{transformer: {{axes_dims_rope: {DEMO_AXES}}}}}}}\n"
                      "profiles: {height: 64, width: 64, t5_tokens: 16}\ntargets: [{openvino: {device: CPU}}]\n")
    proc = precast("build", recipe, "--out", tmp_path / "bundle")
    assert proc.returncode == 2 and "--text-encoder" in proc.stderr and not (tmp_path / "bundle").exists(), proc.stderr


def test_a_vae_with_4_channels_is_refused_for_flux(parts, tmp_path):
    sd_vae = _changed(parts["sd"], tmp_path / "sd-vae.safetensors",
                      lambda t: [t.pop(k) for k in list(t) if not k.startswith("first_stage_model.")])
    line = _refused(tmp_path, parts["flux"], "--set", AXES, "--vae", sd_vae, "--text-encoder", parts["t5"],
                    "--text-encoder", parts["clip"])
    assert "4 latent channels" in line and "--vae" in line, line


def test_unsupported_flux_variants_and_missing_rope_axes_are_named(parts, tmp_path):
    fill = _changed(parts["flux"], tmp_path / "fill.safetensors",
                    lambda t: t.update({"img_in.weight": np.zeros((32, 384), np.float32)}))
    line = _refused(tmp_path, fill)
    assert "Fill" in line and "not supported yet" in line, line
    line = _refused(tmp_path, parts["flux"], "--component", "transformer")
    assert "axes_dims_rope" in line and "16" in line, line
    line = _refused(tmp_path, parts["flux"], "--set", "transformer.axes_dims_rope=[4,4,4]", "--component", "transformer")
    assert "summing to the head width 16" in line, line


@pytest.mark.parametrize("key, shape", [("encoder.block.1.layer.1.DenseReluDense.wo.weight", (33, 64)),
                                        ("encoder.block.0.layer.0.SelfAttention.o.weight", (32, 33)),
                                        ("encoder.block.1.layer.1.layer_norm.weight", (31,))])
def test_a_damaged_t5_is_named(parts, tmp_path, key, shape):
    """A T5 weight of the wrong shape (it exported and failed inside the backend) is one line naming it."""
    bad = _changed(parts["t5"], tmp_path / "t5-bad.safetensors",
                   lambda t: t.update({key: np.zeros(shape, np.float32)}))
    line = _refused(tmp_path, parts["flux"], "--set", AXES, "--text-encoder", bad, "--component", "text_encoder_2")
    assert key in line and str(list(shape)) in line, line


def test_a_chroma_approximator_of_odd_width_is_named(tmp_path):
    from precast.compiler.demo_dit import TINY_CHROMA
    src = tmp_path / "chroma.safetensors"
    write_flux_checkpoint(src, TINY_CHROMA, seed=5, layout="bare", dtype="fp32")
    bad = _changed(src, tmp_path / "bad.safetensors",
                   lambda t: t.update({"distilled_guidance_layer.in_proj.weight": np.zeros((48, 66), np.float32)}))
    line = _refused(tmp_path, bad, "--set", AXES, "--component", "transformer")
    assert "in_proj" in line and "multiple of 4" in line, line


def test_recipe_mistakes_are_named_before_anything_is_exported(parts, tmp_path):
    """A DiT profile whose sides do not pack 2x2 latents, and a scheduler that cannot be sampled, are
    refused before any component is exported (nothing in the cache, no bundle)."""
    from precast.compiler.demo_dit import Vae16Config
    cache, vae8 = tmp_path / "cache", tmp_path / "vae8.safetensors"
    write_vae16_file(vae8, Vae16Config(ch=32, ch_mult=(1, 1, 2, 2), res_blocks=1))    # 4 levels: 8 px per latent
    common = (f"model: {{source: {parts['flux']}, family: flux, text_encoders: [{parts['t5']}, {parts['clip']}], "
              f"vae: {vae8}, set: {{transformer: {{axes_dims_rope: {DEMO_AXES}}}}}}}\n"
              "targets: [{openvino: {device: CPU}}]\n")
    recipe = tmp_path / "odd.yaml"      # 40 px: 5 latents, which do not pack 2x2
    recipe.write_text(common + "profiles: {height: 40, width: 32, t5_tokens: 16}\n")
    proc = precast("build", recipe, "--out", tmp_path / "b", env={"PRECAST_CACHE": str(cache)})
    assert proc.returncode == 2 and "odd.yaml" in proc.stderr and "multiples of 16" in proc.stderr, proc.stderr
    assert not (tmp_path / "b").exists() and not list(cache.rglob("*.onnx_data"))
    sched = tmp_path / "scheduler_config.json"
    sched.write_text(json.dumps({"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 256}))
    from precast.compiler.families import flow_defaults
    from precast.compiler.errors import BadInput
    with pytest.raises(BadInput, match="base_image_seq_len must be below max_image_seq_len"):
        flow_defaults("flux", "dev", json.loads(sched.read_text()), str(sched))
    with pytest.raises(BadInput, match="use_karras_sigmas"):
        flow_defaults("flux", "dev", {"use_karras_sigmas": True}, str(sched))


def test_plan_warns_when_it_must_assume_the_components(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: not-downloaded-yet.safetensors}\ntargets: [onnxruntime]\n")
    proc = precast("plan", recipe)
    assert proc.returncode == 0 and "warning" in proc.stderr and "model.family" in proc.stderr, proc.stderr
