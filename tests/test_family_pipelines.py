"""SD 2.x (v-prediction) and SDXL base/refiner end to end: recipe -> bundle (OpenVINO CPU,
TensorRT-RTX, ONNX Runtime) -> the runtime's pipeline, compared with diffusers' pipelines on the
same tiny weights, scheduler, seed latents and token ids: PSNR >= 40 dB."""
import json

import numpy as np
import pytest
import torch

from conftest import precast
from precast.compiler.demo_model import TINY_REFINER, TINY_SD2, TINY_SDXL, random_tensor, sd1_layout, write_safetensors
import reference as ref

SCHED = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
             timestep_spacing="leading", steps_offset=1)


def _bundle(tmp, cfg, targets, extra=""):
    ckpt = tmp / f"{cfg.family}.safetensors"
    rng = np.random.default_rng(21)
    write_safetensors(str(ckpt), sd1_layout(cfg), "fp32", lambda k, s: random_tensor(rng, k, s))
    comps = {"sd2": "[text_encoder, unet, vae_decoder]", "sdxl": "[text_encoder, text_encoder_2, unet, vae_decoder]",
             "sdxl-refiner": "[text_encoder_2, unet, vae_decoder]"}[cfg.family]
    recipe = tmp / f"{cfg.family}.yaml"
    recipe.write_text(f"model: {{source: {ckpt.name}{extra}}}\ncomponents: {comps}\nprecision: fp16\n"
                      f"profiles: {{batch: 1, height: 64, width: 64}}\ntargets: {targets}\n")
    proc = precast("build", recipe, "--out", tmp / "bundle", "--json", env={"PRECAST_CACHE": str(tmp / "cache")})
    assert proc.returncode == 0, proc.stderr
    return ckpt, tmp / "bundle"


def psnr(a, b):
    return 10 * np.log10(1.0 / float(np.mean((a.astype(np.float64) - b) ** 2)))


def _tokenizers(bundle, folder="tokenizer_2"):
    """The OpenCLIP tokenizer as diffusers configures it (pad '!' = id 0)."""
    from transformers import CLIPTokenizer
    return CLIPTokenizer(str(bundle / folder / "vocab.json"), str(bundle / folder / "merges.txt"),
                         model_max_length=77, pad_token="!")


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdxl-e2e")
    return _bundle(tmp, TINY_SDXL, "[onnxruntime, {openvino: {device: CPU}}, {tensorrt-rtx: {compute_capabilities: [sm_89]}}]")


def test_sdxl_bundle_holds_every_backend_and_keeps_the_vae_fp32(sdxl):
    _, bundle = sdxl
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["model"]["family"] == "sdxl" and m["model"]["latent_scale"] == 0.13025
    backends = {(a["component"], a["backend"]) for a in m["artifacts"]}
    for comp in ("text_encoder", "text_encoder_2", "unet", "vae_decoder"):
        assert {(comp, b) for b in ("onnxruntime", "openvino", "tensorrt-rtx")} <= backends
    assert m["components"]["unet"]["dtype"] == "fp16"
    assert m["components"]["vae_decoder"]["dtype"] == "fp32" and "overflows" in m["components"]["vae_decoder"]["dtype_reason"]
    assert precast("bundle", "verify", bundle).returncode == 0


def test_sdxl_pipeline_matches_diffusers(sdxl):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer
    from precast.runtime.families.sd import Txt2Img
    ckpt, bundle = sdxl
    noise = np.random.default_rng(3).standard_normal((1, 4, 8, 8)).astype(np.float32)
    prompt, steps, guidance = "a photo of an astronaut riding a horse", 6, 5.0
    ours = Txt2Img(bundle, "cpu", width=64, height=64)(prompt, "", steps, 0, guidance, "euler", latents=noise,
                                                       progress=False)
    models = ref.family_models(ckpt, TINY_SDXL)
    models["vae"].register_to_config(scaling_factor=0.13025)
    tok = CLIPTokenizer(str(bundle / "tokenizer/vocab.json"), str(bundle / "tokenizer/merges.txt"), model_max_length=77)
    pipe = StableDiffusionXLPipeline(vae=models["vae"], text_encoder=models["text_encoder"],
                                     text_encoder_2=models["text_encoder_2"], tokenizer=tok, tokenizer_2=_tokenizers(bundle),
                                     unet=models["unet"], scheduler=EulerDiscreteScheduler(**SCHED),
                                     force_zeros_for_empty_prompt=True)
    with torch.no_grad():
        want = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, height=64, width=64,
                    latents=torch.from_numpy(noise), output_type="np").images[0]
    assert want.std() > 0.05
    # fp16 UNet and text encoders in the bundle vs the fp32 reference
    assert psnr(ours, want) >= 40.0, psnr(ours, want)


def test_sd2_v_prediction_pipeline_matches_diffusers(tmp_path):
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline
    from precast.runtime.families.sd import Txt2Img
    ckpt, bundle = _bundle(tmp_path, TINY_SD2, "[{openvino: {device: CPU}}]", ", prediction: v_prediction")
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["model"]["prediction"] == "v_prediction"
    noise = np.random.default_rng(4).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ours = Txt2Img(bundle, width=64, height=64)("a red car", "blurry", 6, 0, 7.0, "dpm++2m", latents=noise,
                                               progress=False)
    models = ref.family_models(ckpt, TINY_SD2)
    pipe = StableDiffusionPipeline(vae=models["vae"], text_encoder=models["text_encoder"],
                                   tokenizer=_tokenizers(bundle, "tokenizer"),
                                   unet=models["unet"], safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False,
                                   scheduler=DPMSolverMultistepScheduler(**SCHED, prediction_type="v_prediction",
                                                                         algorithm_type="dpmsolver++", solver_order=2))
    # diffusers' SD 2.x text encoder is the OpenCLIP tower minus its last layer
    pipe.text_encoder = _drop_last_layer(models["text_encoder"])
    with torch.no_grad():
        want = pipe("a red car", negative_prompt="blurry", num_inference_steps=6, guidance_scale=7.0, height=64,
                    width=64, latents=torch.from_numpy(noise), output_type="np").images[0]
    assert want.std() > 0.05 and psnr(ours, want) >= 40.0, psnr(ours, want)


def _drop_last_layer(te):
    model = getattr(te, "text_model", te)
    model.encoder.layers = model.encoder.layers[:-1]
    return te


def test_refiner_pipeline_runs_with_aesthetic_conditioning(tmp_path):
    from precast.runtime.families.sd import Txt2Img
    _, bundle = _bundle(tmp_path, TINY_REFINER, "[{openvino: {device: CPU}}]")
    pipe = Txt2Img(bundle, width=64, height=64)
    a = pipe("a castle", "", 3, 0, 5.0, aesthetic_score=6.0, progress=False)
    b = pipe("a castle", "", 3, 0, 5.0, aesthetic_score=2.0, progress=False)
    assert a.shape == (64, 64, 3) and np.isfinite(a).all() and np.abs(a - b).max() > 1e-3
