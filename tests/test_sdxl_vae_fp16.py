"""The SDXL VAE overflows in fp16: with decoder activations scaled to the real model's range
(beyond fp16's 65504), an fp16 VAE export produces inf/NaN, while the default SDXL export keeps the
VAE in fp32 and matches diffusers; the choice is visible in the export report."""
import json

import numpy as np
import onnxruntime as ort
import pytest

from conftest import precast, rel_err
from precast.compiler.demo_model import TINY_SDXL, random_tensor, sd1_layout, write_safetensors
import reference as ref

HOT = "first_stage_model.decoder.mid.block_1.conv2."  # its output feeds the residual stream before a GroupNorm


@pytest.fixture(scope="module")
def hot_sdxl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdxl-vae")
    path = tmp / "sdxl.safetensors"
    rng = np.random.default_rng(9)

    def make(key, shape):
        arr = random_tensor(rng, key, shape)
        return arr * 3e5 if key.startswith(HOT) else arr  # activations of order 1e5, as in the real SDXL VAE
    write_safetensors(str(path), sd1_layout(TINY_SDXL), "fp32", make)
    return tmp, path


def _decode(folder, z):
    s = ort.InferenceSession(str(folder / "vae_decoder/model.onnx"), providers=["CPUExecutionProvider"])
    dtype = np.float16 if s.get_inputs()[0].type == "tensor(float16)" else np.float32
    return s.run(None, {"latent_sample": z.astype(dtype)})[0].astype(np.float32)


def test_fp16_vae_overflows_and_the_default_does_not(hot_sdxl):
    import torch
    tmp, path = hot_sdxl
    z = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
    vae = ref.family_models(path, TINY_SDXL)["vae"]
    peak = []
    hook = vae.decoder.mid_block.resnets[0].register_forward_hook(lambda m, i, o: peak.append(float(o.abs().max())))
    want = ref.run_vae_decoder(vae, z)
    hook.remove()
    assert np.isfinite(want).all() and peak[0] > 65504              # past fp16's largest finite value
    with torch.no_grad():                                            # the same VAE computed in fp16 breaks
        half = vae.half().decode(torch.from_numpy(z).half()).sample.float().numpy()
    vae.float()
    assert not np.isfinite(half).all()
    proc = precast("export", path, "--out", tmp / "forced", "--component", "vae_decoder", "--dtype", "fp16",
                   "--vae-dtype", "fp16", "--json", check=True)
    assert json.loads(proc.stdout)["components"][0]["dtype"] == "fp16"  # asking for fp16 explicitly is allowed
    proc = precast("export", path, "--out", tmp / "default", "--component", "vae_decoder", "--dtype", "fp16",
                   "--json", check=True)
    report = json.loads(proc.stdout)
    assert report["components"][0]["dtype"] == "fp32"              # the default avoided it, visibly
    got = _decode(tmp / "default", z)
    assert np.isfinite(got).all() and rel_err(got, want) <= 1e-4
