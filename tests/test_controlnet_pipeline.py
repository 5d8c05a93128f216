"""ControlNets end to end (issue 17): recipes with `controlnets:` -> bundles (one UNet with residual
inputs, each ControlNet its own engine) -> `precast generate --control`, against diffusers'
StableDiffusionControlNetPipeline (one and two nets, scales, step ranges, guess mode) and
StableDiffusionXLControlNetPipeline on tiny models: PSNR >= 40 dB. A bundle without ControlNets is
what it was; adding a ControlNet builds no second UNet."""
import json

import numpy as np
import pytest
import torch

import reference as ref
from conftest import precast
from precast.compiler.demo_controlnet import write_demo_controlnet
from precast.compiler.demo_model import TINY, TINY_SDXL, write_demo_model
from precast.runtime.control import Control

SIZE = 64
PROMPT, NEGATIVE = "a photo of a cat", "blurry"


def psnr(a, b):
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return 10 * np.log10(1.0 / mse) if mse else float("inf")


def edges(seed: int) -> np.ndarray:
    """A uint8 RGB control picture: thin random lines on black, as a canny map looks."""
    img = np.zeros((SIZE, SIZE, 3), np.uint8)
    rng = np.random.default_rng(seed)
    for _ in range(12):
        if rng.random() < 0.5:
            img[rng.integers(0, SIZE), :] = 255
        else:
            img[:, rng.integers(0, SIZE)] = 255
    return img


def _build(tmp, name, model, nets, components, targets="[onnxruntime]"):
    recipe = tmp / f"{name}.yaml"
    listed = "" if not nets else "controlnets: [" + ", ".join(
        f"{{path: {p.name}, name: {n}}}" for p, n in nets) + "]\n"
    recipe.write_text(f"model: {{source: {model.name}}}\ncomponents: [{components}]\n{listed}"
                      f"profiles: {{batch: 1, height: {SIZE}, width: {SIZE}}}\ntargets: {targets}\n")
    proc = precast("build", recipe, "--out", tmp / name, "--json", env={"PRECAST_CACHE": str(tmp / "cache")})
    assert proc.returncode == 0, proc.stderr
    return tmp / name, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cn-sd1")
    model = tmp / "model.safetensors"
    write_demo_model(str(model), TINY, seed=3, dtype="fp32")
    nets = [(tmp / "canny.safetensors", "canny"), (tmp / "depth.safetensors", "depth")]
    for i, (p, _) in enumerate(nets):
        write_demo_controlnet(str(p), TINY, seed=10 + i, dtype="fp32")
    comps = "text_encoder, unet, vae_decoder"
    plain, _ = _build(tmp, "plain", model, [], comps)
    one, one_report = _build(tmp, "one", model, nets[:1], comps)
    two, two_report = _build(tmp, "two", model, nets, comps, "[onnxruntime, {openvino: {device: CPU}}]")
    return dict(tmp=tmp, model=model, nets=nets, plain=plain, one=one, two=two, one_report=one_report,
                two_report=two_report)


def _diffusers_sd1(sd1, nets):
    from diffusers import EulerDiscreteScheduler, StableDiffusionControlNetPipeline
    from transformers import CLIPTokenizer
    unet, vae, te = ref.models_from_single_file(sd1["model"], TINY)
    tok = CLIPTokenizer(str(sd1["two"] / "tokenizer/vocab.json"), str(sd1["two"] / "tokenizer/merges.txt"),
                        model_max_length=77)
    controlnets = [ref.controlnet_from_ldm(p, ref.unet_diffusers_config(TINY)) for p, _ in nets]
    sched = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                   beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1)
    return StableDiffusionControlNetPipeline(
        vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=sched, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
        controlnet=controlnets[0] if len(controlnets) == 1 else controlnets)


CASES = {   # id: (bundle, [(net, scale, start, end)], guess mode)
    "one": ("one", [("canny", 0.8, 0.0, 1.0)], False),
    "two-ranges": ("two", [("canny", 0.7, 0.0, 0.6), ("depth", 1.2, 0.25, 1.0)], False),
    "two-guess": ("two", [("canny", 1.0, 0.0, 1.0), ("depth", 0.5, 0.0, 1.0)], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sd1_matches_diffusers(sd1, case):
    from PIL import Image
    from precast.runtime.families.sd import Txt2Img
    bundle, uses, guess = CASES[case]
    noise = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    images = [edges(i) for i in range(len(uses))]
    controls = [Control(f"controlnet_{n}", img, s, a, b) for (n, s, a, b), img in zip(uses, images)]
    pipe = Txt2Img(sd1[bundle], "cpu:onnxruntime", width=SIZE, height=SIZE,
                   controlnets=tuple(c.component for c in controls))
    ours = pipe(PROMPT, NEGATIVE, 4, 0, 6.0, "euler", latents=noise, progress=False, controls=controls,
                guess_mode=guess)
    nets = [next(x for x in sd1["nets"] if x[1] == n) for n, *_ in uses]
    theirs = _diffusers_sd1(sd1, nets)
    one = len(uses) == 1
    pick = (lambda v: v[0]) if one else list   # noqa: E731 - a single net takes scalars, several take lists
    with torch.no_grad():
        want = theirs(PROMPT, negative_prompt=NEGATIVE, image=pick([Image.fromarray(i) for i in images]),
                      num_inference_steps=4, guidance_scale=6.0, latents=torch.from_numpy(noise), height=SIZE,
                      width=SIZE, controlnet_conditioning_scale=pick([u[1] for u in uses]),
                      control_guidance_start=pick([u[2] for u in uses]), control_guidance_end=pick([u[3] for u in uses]),
                      guess_mode=guess, output_type="np").images[0]
    plain = Txt2Img(sd1["plain"], "cpu:onnxruntime", width=SIZE, height=SIZE)(
        PROMPT, NEGATIVE, 4, 0, 6.0, "euler", latents=noise, progress=False)
    assert want.std() > 0.05
    score = psnr(ours, want)
    print(f"{case}: PSNR {score:.1f} dB (vs the plain bundle {psnr(ours, plain):.1f} dB)")
    assert score >= 40.0, score
    assert psnr(ours, plain) < 35          # the control changed the image


def test_a_controlnet_bundle_without_control_is_the_plain_bundle(sd1):
    """No --control: the UNet's residual inputs are fed zeros, giving the plain bundle's image."""
    from precast.runtime.families.sd import Txt2Img
    noise = np.random.default_rng(6).standard_normal((1, 4, 8, 8)).astype(np.float32)
    a = Txt2Img(sd1["two"], "cpu:onnxruntime", width=SIZE, height=SIZE)(PROMPT, "", 3, 0, 7.0, latents=noise,
                                                                         progress=False)
    b = Txt2Img(sd1["plain"], "cpu:onnxruntime", width=SIZE, height=SIZE)(PROMPT, "", 3, 0, 7.0, latents=noise,
                                                                           progress=False)
    assert psnr(a, b) >= 60


def test_bundles_pay_only_for_what_they_use(sd1):
    plain = json.loads((sd1["plain"] / "manifest.json").read_text())
    assert not any(c.startswith("controlnet_") for c in plain["components"]) and "controlnets" not in plain["model"]
    assert not any("residual" in i["name"] for i in plain["components"]["unet"]["inputs"])
    two = json.loads((sd1["two"] / "manifest.json").read_text())
    assert [c["name"] for c in two["model"]["controlnets"]] == ["canny", "depth"]
    assert sum("residual" in i["name"] for i in two["components"]["unet"]["inputs"]) == 10   # 9 down + mid
    for comp in ("text_encoder", "vae_decoder"):     # the other components are the plain bundle's
        assert two["components"][comp]["onnx"] and \
            two["files"][two["components"][comp]["onnx"]] == plain["files"][plain["components"][comp]["onnx"]]
    # the one-net bundle built the residual UNet; adding the second net found it in the cache
    unet = lambda r: [a["cache"] for a in r["artifacts"] if a["component"] == "unet"]  # noqa: E731
    assert "miss" in unet(sd1["one_report"])
    assert [c for c in unet(sd1["two_report"])[:2]] == ["hit", "hit"]     # the ONNX and the onnxruntime engine


def test_generate_with_control_and_its_mistakes(sd1, tmp_path):
    from precast.runtime.png import write_png
    edge = tmp_path / "edge.png"
    write_png(edge, edges(0))
    out = tmp_path / "out.png"
    proc = precast("generate", sd1["two"], "--prompt", PROMPT, "--steps", "2", "--control", f"{edge}:0.8",
                   "--controlnet", "canny", "--control", str(edge), "--controlnet", "depth", "--control-end", "1",
                   "--control-end", "0.5", "--backend", "cpu:openvino", "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [(c["controlnet"], c["scale"], c["end"]) for c in report["controls"]] == [("canny", 0.8, 1.0),
                                                                                     ("depth", 1.0, 0.5)]
    assert report["components"]["controlnet_depth"]["backend"] == "openvino" and out.stat().st_size > 100
    for args, words in ((["--control", str(edge)], "say which with --controlnet"),
                        (["--control", str(edge), "--controlnet", "pose"], "not in the bundle"),
                        (["--control", str(tmp_path / "none.png"), "--controlnet", "canny"], "no such file"),
                        (["--control", f"{edge}:0.5", "--controlnet", "canny", "--control-start", "0.9",
                          "--control-end", "0.2"], "0 <= start < end <= 1"),
                        (["--guess-mode"], "--guess-mode")):
        proc = precast("generate", sd1["two"], "--prompt", PROMPT, "--out", tmp_path / "x.png", *args)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    proc = precast("generate", sd1["plain"], "--prompt", PROMPT, "--out", tmp_path / "x.png", "--control", str(edge))
    assert proc.returncode == 2 and "has no ControlNet" in proc.stderr, proc.stderr


def test_sdxl_matches_diffusers(tmp_path):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLControlNetPipeline
    from PIL import Image
    from transformers import CLIPTokenizer
    from precast.runtime.families.sd import Txt2Img
    model, net = tmp_path / "xl.safetensors", tmp_path / "xlnet.safetensors"
    write_demo_model(str(model), TINY_SDXL, seed=3, dtype="fp32")
    write_demo_controlnet(str(net), TINY_SDXL, seed=7, dtype="fp32")
    bundle, _ = _build(tmp_path, "xl", model, [(net, "edges")], "text_encoder, text_encoder_2, unet, vae_decoder")
    noise = np.random.default_rng(8).standard_normal((1, 4, 8, 8)).astype(np.float32)
    image = edges(3)
    ours = Txt2Img(bundle, "cpu", width=SIZE, height=SIZE, controlnets=("controlnet_edges",))(
        PROMPT, NEGATIVE, 4, 0, 5.0, "euler", latents=noise, progress=False,
        controls=[Control("controlnet_edges", image, 0.9)])
    models = ref.family_models(model, TINY_SDXL)
    models["vae"].register_to_config(scaling_factor=0.13025)
    toks = [CLIPTokenizer(str(bundle / f / "vocab.json"), str(bundle / f / "merges.txt"), model_max_length=77, **kw)
            for f, kw in (("tokenizer", {}), ("tokenizer_2", {"pad_token": "!"}))]
    pipe = StableDiffusionXLControlNetPipeline(
        vae=models["vae"], text_encoder=models["text_encoder"], text_encoder_2=models["text_encoder_2"],
        tokenizer=toks[0], tokenizer_2=toks[1], unet=models["unet"],
        controlnet=ref.controlnet_from_ldm(net, ref.unet_config_for(TINY_SDXL)),
        scheduler=EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                         beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1))
    with torch.no_grad():
        want = pipe(PROMPT, negative_prompt=NEGATIVE, image=Image.fromarray(image), num_inference_steps=4,
                    guidance_scale=5.0, latents=torch.from_numpy(noise), height=SIZE, width=SIZE,
                    controlnet_conditioning_scale=0.9, output_type="np").images[0]
    assert want.std() > 0.05
    score = psnr(ours, want)
    print(f"sdxl: PSNR {score:.1f} dB")
    assert score >= 40.0, score


def test_a_controlnet_built_in_another_job_merges_in(sd1, tmp_path):
    """CI shards: one job builds the model's engines, another a ControlNet's; `bundle merge` joins them and
    the merged bundle's pipeline files list the model's components."""
    recipe, env = sd1["tmp"] / "two.yaml", {"PRECAST_CACHE": str(sd1["tmp"] / "cache")}
    precast("build", recipe, "--out", tmp_path / "a", "--only", "controlnet_depth.openvino-CPU", env=env, check=True)
    precast("build", recipe, "--out", tmp_path / "b", *[x for c in ("text_encoder", "unet", "vae_decoder")
                                                         for x in ("--only", f"{c}.openvino-CPU")], env=env, check=True)
    precast("bundle", "merge", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "m", check=True)
    assert precast("bundle", "verify", tmp_path / "m").returncode == 0
    index = json.loads((tmp_path / "m/onnx/model_index.json").read_text())
    assert index["unet"] == ["diffusers", "OnnxRuntimeModel"] and "controlnet_depth" not in index
    from precast.runtime.png import write_png
    write_png(tmp_path / "e.png", edges(1))
    proc = precast("generate", tmp_path / "m", "--prompt", PROMPT, "--steps", "2", "--control", tmp_path / "e.png",
                   "--controlnet", "depth", "--out", tmp_path / "o.png")
    assert proc.returncode == 0, proc.stderr


def test_the_python_api_runs_controlnets_as_generate_does(sd1, tmp_path):
    from precast.runtime.api import UserError, open_bundle
    from precast.runtime.png import write_png
    edge = tmp_path / "edge.png"
    write_png(edge, edges(2))
    out = tmp_path / "cli.png"
    precast("generate", sd1["two"], "--prompt", PROMPT, "--steps", "3", "--seed", "2", "--control", f"{edge}:0.6",
            "--controlnet", "depth", "--guess-mode", "--backend", "cpu:onnxruntime", "--out", out, check=True)
    bundle = open_bundle(sd1["two"])
    image = bundle.txt2img(PROMPT, steps=3, seed=2, controls=[("depth", edge, 0.6)], guess_mode=True,
                           backend="cpu:onnxruntime")
    assert image.png() == out.read_bytes()
    with pytest.raises(UserError, match="not in the bundle"):
        bundle.txt2img(PROMPT, steps=2, controls=[("pose", edge)])
