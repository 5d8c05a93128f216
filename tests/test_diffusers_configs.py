"""Diffusers folders whose config.json sets fields the LDM layout fixes: the fields precast
builds (timestep embedding order and shift, ResBlock norm eps, unpadded downsampling, a VAE
without mid attention) match diffusers; the ones it does not build are refused by name."""
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import precast, rel_err
import reference as ref

UNET = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64, 64),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=4, norm_num_groups=32)


def _folder(tmp, unet_fields=None, vae_fields=None):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    torch.manual_seed(0)
    unet = ref.randomize(UNet2DConditionModel(**{**UNET, **(unet_fields or {})}), 1)
    vae = ref.randomize(AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=32, **(vae_fields or {})), 2)
    unet.save_pretrained(tmp / "pipe" / "unet", safe_serialization=True)
    vae.save_pretrained(tmp / "pipe" / "vae", safe_serialization=True)
    (tmp / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    return tmp / "pipe", unet, vae


def test_config_fields_precast_builds_match_diffusers(tmp_path):
    folder, unet, vae = _folder(tmp_path, dict(flip_sin_to_cos=False, freq_shift=1, downsample_padding=0,
                                               norm_eps=1e-2, center_input_sample=True),
                                dict(mid_block_add_attention=False))
    precast("export", folder, "--out", tmp_path / "onnx", check=True)
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "unet" / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for h, w in ((16, 16), (15, 9)):        # odd latent sizes: upsampled to each skip's size, as diffusers does
        sample = rng.standard_normal((2, 4, h, w)).astype(np.float32)
        t = np.array([999.0, 3.0], np.float32)
        ctx = rng.standard_normal((2, 77, 32)).astype(np.float32)
        (got,) = sess.run(None, {"sample": sample, "timestep": t, "encoder_hidden_states": ctx})
        assert rel_err(got, ref.run_unet(unet, sample, t, ctx)) <= 1e-4, (h, w)
    z = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    dec = ort.InferenceSession(str(tmp_path / "onnx" / "vae_decoder" / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = dec.run(None, {"latent_sample": z})
    assert rel_err(got, ref.run_vae_decoder(vae, z)) <= 1e-4


def test_odd_first_width_pads_the_timestep_embedding_as_diffusers_does(tmp_path):
    """A first level 9 channels wide: the sinusoidal embedding is 8 wide plus a zero column."""
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    unet = ref.randomize(UNet2DConditionModel(
        sample_size=8, block_out_channels=(9, 18), layers_per_block=1, norm_num_groups=3, attention_head_dim=3,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=12), 1)
    unet.save_pretrained(tmp_path / "pipe" / "unet", safe_serialization=True)
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    precast("export", tmp_path / "pipe", "--out", tmp_path / "onnx", "--component", "unet", check=True)
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "unet" / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    t, ctx = np.array([500.0, 7.0], np.float32), rng.standard_normal((2, 5, 12)).astype(np.float32)
    (got,) = sess.run(None, {"sample": sample, "timestep": t, "encoder_hidden_states": ctx})
    assert rel_err(got, ref.run_unet(unet, sample, t, ctx)) <= 1e-4


@pytest.mark.parametrize("part, field, value", [
    ("unet", "act_fn", "mish"), ("unet", "only_cross_attention", True), ("unet", "resnet_time_scale_shift", "scale_shift"),
    ("vae", "act_fn", "gelu"), ("vae", "down_block_types", ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"]),
    ("vae", "up_block_types", ["AttnUpDecoderBlock2D", "UpDecoderBlock2D"])])
def test_config_fields_precast_does_not_build_are_refused(tmp_path, part, field, value):
    folder, _, _ = _folder(tmp_path)
    config = folder / part / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), field: value}))
    proc = precast("export", folder, "--out", tmp_path / "onnx")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    shown = f"{field} = {value!r} is not supported" if isinstance(value, (str, bool)) else \
        f"{field} has {value[0] if value[0].startswith('Attn') else value[1]!r}, not supported"
    assert shown in proc.stderr and f"{part}/config.json" in proc.stderr, proc.stderr
    assert not (tmp_path / "onnx").exists()


def test_group_count_that_does_not_divide_the_channels_is_named(tmp_path):
    folder, _, _ = _folder(tmp_path)
    for part, groups in (("unet", 5), ("vae", 7)):
        proc = precast("export", folder, "--out", tmp_path / "onnx", "--set", f"{part}.groups={groups}")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"do not split into {groups} groups" in proc.stderr and f"--set {part}.groups=N" in proc.stderr
        assert not (tmp_path / "onnx").exists()


def test_unet_without_cross_attention_is_refused(tmp_path):
    folder, _, _ = _folder(tmp_path, dict(down_block_types=("DownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3,
                                          mid_block_type="UNetMidBlock2D"))
    proc = precast("export", folder, "--out", tmp_path / "onnx", "--component", "unet")
    assert proc.returncode == 2 and "no cross-attention" in proc.stderr and "Traceback" not in proc.stderr


def test_set_head_dim_wins_over_the_folders_config(tmp_path):
    folder, _, _ = _folder(tmp_path)              # config: attention_head_dim 4 (diffusers: 4 heads)
    heads = {}
    for name, sets in (("config", []), ("head_dim", ["--set", "unet.head_dim=16"]),
                       ("num_heads", ["--set", "unet.num_heads=2"])):
        proc = precast("export", folder, "--out", tmp_path / name, "--component", "unet", *sets, "--json", check=True)
        (unet,) = json.loads(proc.stdout)["components"]
        heads[name] = unet["config"]["num_heads"]
    assert heads == {"config": [4, 4, 4], "head_dim": [2, 4, 4], "num_heads": [2, 2, 2]}


def test_sharded_and_variant_weights_export_like_one_file(tmp_path):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    folder, unet, vae = _folder(tmp_path / "plain")
    other = tmp_path / "other" / "pipe"
    unet.save_pretrained(other / "unet", safe_serialization=True, max_shard_size="200KB")   # shards + index
    vae.save_pretrained(other / "vae", safe_serialization=True, variant="bf16")            # a variant name
    (other / "model_index.json").write_text((folder / "model_index.json").read_text())
    assert len(list((other / "unet").glob("*.safetensors"))) > 1
    for src, out in ((folder, "a"), (other, "b")):
        precast("export", src, "--out", tmp_path / out, check=True)
    for comp in ("unet", "vae_decoder", "vae_encoder"):
        a, b = (tmp_path / o / comp / "model.onnx_data" for o in "ab")
        assert a.read_bytes() == b.read_bytes(), comp
    weights = other / "vae" / "diffusion_pytorch_model.bf16.safetensors"
    (other / "vae" / "diffusion_pytorch_model.ema.safetensors").write_bytes(weights.read_bytes())
    weights.rename(other / "vae" / "diffusion_pytorch_model.non_ema.safetensors")
    proc = precast("export", other, "--out", tmp_path / "c")     # which one? the user must say
    assert proc.returncode == 2 and "several variants (ema, non_ema)" in proc.stderr


@pytest.mark.parametrize("part, file, field, value", [
    ("unet", "config.json", "norm_eps", "x"), ("unet", "config.json", "norm_eps", -1),
    ("unet", "config.json", "freq_shift", float("nan")), ("unet", "config.json", "attention_head_dim", ["a", "b", "c"]),
    ("unet", "config.json", "flip_sin_to_cos", "yes"), ("unet", "config.json", "norm_num_groups", 0),
    ("vae", "config.json", "scaling_factor", "abc"), ("vae", "config.json", "scaling_factor", -1),
    ("vae", "config.json", "norm_num_groups", "x"),
    ("scheduler", "scheduler_config.json", "prediction_type", ["v_prediction"]),
    ("scheduler", "scheduler_config.json", "prediction_type", "sample")])
def test_config_values_of_the_wrong_type_or_range_are_named(tmp_path, part, file, field, value):
    """Before: tracebacks (exit 1), NaN models or bundles their own reader rejected."""
    folder, _, _ = _folder(tmp_path)
    config = folder / part / file
    config.parent.mkdir(exist_ok=True)
    old = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**old, field: value}))
    proc = precast("export", folder, "--out", tmp_path / "onnx")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{part}/{file}: {field} = " in proc.stderr and "expected" in proc.stderr, proc.stderr
    assert not (tmp_path / "onnx").exists()
