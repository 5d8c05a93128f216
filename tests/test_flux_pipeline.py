"""Flux.1 dev / schnell and Chroma end to end: the embedded tiny recipes -> bundles (ONNX Runtime,
OpenVINO CPU, TensorRT-RTX built ahead of time) -> `precast generate`, and the runtime's pipeline
against diffusers' FluxPipeline / ChromaPipeline on the same weights, tokenizers, scheduler
settings and starting latents: PSNR >= 40 dB."""
import json

import numpy as np
import pytest
import torch

import reference_dit as ref
from conftest import precast
from precast.compiler.demo_dit import DEMOS, TINY_CLIP_L, TINY_T5, TINY_VAE16, write_demo_dit
from precast.runtime.families.flux import pack

T5_TOKENS = 32


def psnr(a, b):
    return 10 * np.log10(1.0 / float(np.mean((a.astype(np.float64) - b) ** 2)))


def _recipe(tmp, demo, targets, height=64):
    comps = "[text_encoder, transformer, vae_decoder]" if demo == "tiny-chroma" else \
        "[text_encoder, text_encoder_2, transformer, vae_decoder]"
    recipe = tmp / f"{demo}.yaml"
    recipe.write_text(f"model: {{source: 'demo:{demo}'}}\ncomponents: {comps}\nprecision: fp32\n"
                      f"profiles: {{batch: 1, height: {height}, width: {height}, t5_tokens: {T5_TOKENS}}}\n"
                      f"targets: {targets}\n")
    return recipe


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """{demo: (bundle, checkpoint with the same weights)} for dev (every backend), schnell and Chroma."""
    tmp = tmp_path_factory.mktemp("flux-bundles")
    out = {}
    for demo, targets in (("tiny-flux-dev", "[onnxruntime, {openvino: {device: CPU}}, "
                                            "{tensorrt-rtx: {compute_capabilities: [sm_86, sm_120]}}]"),
                          ("tiny-flux-schnell", "[{openvino: {device: CPU}}]"),
                          ("tiny-chroma", "[onnxruntime, {openvino: {device: CPU}}, "
                                          "{tensorrt-rtx: {compute_capabilities: [sm_89]}}]")):
        recipe = _recipe(tmp, demo, targets)
        proc = precast("build", recipe, "--out", tmp / demo, "--json", env={"PRECAST_CACHE": str(tmp / "cache")})
        assert proc.returncode == 0, proc.stderr
        if "onnxruntime" in targets:     # the same model with only its ONNX Runtime artifacts (exports: cache hits)
            only = [a for c in ("text_encoder", "text_encoder_2", "transformer", "vae_decoder")
                    for a in ("--only", f"{c}.onnxruntime") if demo != "tiny-chroma" or c != "text_encoder_2"]
            proc = precast("build", recipe, "--out", tmp / f"{demo}-ort", *only, env={"PRECAST_CACHE": str(tmp / "cache")})
            assert proc.returncode == 0, proc.stderr
        ckpt = tmp / f"{demo}.safetensors"
        write_demo_dit(ckpt, demo)              # the same seeded weights the recipe's demo source names
        out[demo] = (tmp / demo, ckpt)
    return out


def test_bundles_hold_every_backend_and_the_model_settings(bundles):
    bundle, _ = bundles["tiny-flux-dev"]
    m = json.loads((bundle / "manifest.json").read_text())
    model = m["model"]
    assert (model["family"], model["variant"], model["prediction"]) == ("flux", "dev", "flow")
    assert model["latent_scale"] == 0.3611 and model["latent_shift"] == 0.1159
    assert model["scheduler"]["use_dynamic_shifting"] is True and (model["steps"], model["guidance"]) == (28, 3.5)
    backends = {(a["component"], a["backend"]) for a in m["artifacts"]}
    for comp in ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"):
        assert {(comp, b) for b in ("onnxruntime", "openvino", "tensorrt-rtx")} <= backends
    trt = next(a for a in m["artifacts"] if a["component"] == "transformer" and a["backend"] == "tensorrt-rtx")
    tokens = (64 // 4) ** 2     # the tiny VAE's factor 2, 2x2 packing: one token per 4x4 px
    assert trt["shapes"]["hidden_states"] == [[1, tokens, 64]] * 3
    assert trt["shapes"]["encoder_hidden_states"] == [[1, T5_TOKENS, 32]] * 3
    assert m["components"]["vae_decoder"]["dtype"] == "fp32"
    assert {f.split("/")[0] for f in m["files"]} >= {"tokenizer", "tokenizer_2"}
    assert (bundle / "tokenizer_2" / "spiece.model").is_file()
    chroma = json.loads((bundles["tiny-chroma"][0] / "manifest.json").read_text())
    assert chroma["model"]["family"] == "chroma" and "text_encoder_2" not in chroma["components"]
    assert (bundles["tiny-chroma"][0] / "tokenizer" / "spiece.model").is_file()
    assert precast("bundle", "verify", bundle).returncode == 0


@pytest.mark.parametrize("demo, backend", [("tiny-flux-dev", "onnxruntime"), ("tiny-flux-dev", "openvino"),
                                           ("tiny-chroma", "onnxruntime"), ("tiny-chroma", "openvino")])
def test_generate_runs_on_each_cpu_backend(bundles, tmp_path, demo, backend):
    bundle, _ = bundles[demo]
    if backend == "onnxruntime":      # a bundle holding only ONNX Runtime artifacts
        bundle = bundle.with_name(bundle.name + "-ort")
    out = tmp_path / "img.png"
    proc = precast("generate", bundle, "--prompt", "a red fox in the snow", "--steps", "3", "--seed", "5",
                   "--size", "64x64", "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["components"]["transformer"]["backend"] == backend, report["components"]["transformer"]
    assert out.stat().st_size > 1000
    doctor = precast("doctor", bundle, "--size", "64x64", "--json")
    assert doctor.returncode == 0, doctor.stderr
    assert json.loads(doctor.stdout)["components"]["transformer"]["backend"] == backend


def _flux_pipeline(bundle, ckpt, demo):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTokenizer, T5TokenizerFast
    cfg = DEMOS[demo]
    tok = CLIPTokenizer(str(bundle / "tokenizer/vocab.json"), str(bundle / "tokenizer/merges.txt"), model_max_length=77)
    t5_tok = T5TokenizerFast(tokenizer_file=str(bundle / "tokenizer_2/tokenizer.json"))
    sched = ref.SCHEDULERS["flux-dev" if cfg.guidance_embed else "flux-schnell"]
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**sched), vae=ref.vae16_reference(ckpt, TINY_VAE16),
                        text_encoder=ref.clip_l_reference(ckpt, TINY_CLIP_L), tokenizer=tok,
                        text_encoder_2=ref.t5_reference(ckpt, TINY_T5), tokenizer_2=t5_tok,
                        transformer=ref.flux_reference(ckpt, cfg))


@pytest.mark.parametrize("demo, steps, guidance", [("tiny-flux-dev", 6, 3.5), ("tiny-flux-schnell", 4, 0.0)])
def test_flux_pipeline_matches_diffusers(bundles, demo, steps, guidance):
    from precast.runtime.families.flux import FluxTxt2Img
    bundle, ckpt = bundles[demo]
    noise = np.random.default_rng(3).standard_normal((1, 16, 32, 32)).astype(np.float32)
    prompt = "a photo of an astronaut riding a horse on the moon"
    pipe = FluxTxt2Img(bundle, "cpu", width=64, height=64)
    assert pipe.schedule.use_dynamic_shifting == (demo == "tiny-flux-dev")
    ours = pipe(prompt, steps=steps, guidance=guidance, latents=noise, progress=False)
    with torch.no_grad():
        want = _flux_pipeline(bundle, ckpt, demo)(
            prompt, height=64, width=64, num_inference_steps=steps, guidance_scale=guidance,
            max_sequence_length=T5_TOKENS, latents=torch.from_numpy(pack(noise)), output_type="np").images[0]
    assert want.std() > 0.05
    print(f"PSNR {psnr(ours, want):.1f} dB")
    assert psnr(ours, want) >= 40.0, psnr(ours, want)


def test_chroma_pipeline_matches_diffusers(bundles):
    """ChromaPipeline with its masks made boolean: diffusers 0.42 turns them into float 0/1 and adds
    them to the attention scores (huggingface/diffusers#12116), which masks nothing; precast masks as
    lodestones' reference does (the real text tokens and one padding token are attended)."""
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import T5TokenizerFast
    from precast.runtime.families.flux import FluxTxt2Img
    bundle, ckpt = bundles["tiny-chroma"]
    noise = np.random.default_rng(4).standard_normal((1, 16, 32, 32)).astype(np.float32)
    prompt, negative, steps, guidance = "a lighthouse at dusk, oil painting", "blurry, low quality", 5, 4.0
    ours = FluxTxt2Img(bundle, "cpu", width=64, height=64)(prompt, negative, steps=steps, guidance=guidance,
                                                          latents=noise, progress=False)
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ref.SCHEDULERS["chroma"]),
                          vae=ref.vae16_reference(ckpt, TINY_VAE16), text_encoder=ref.t5_reference(ckpt, TINY_T5),
                          tokenizer=T5TokenizerFast(tokenizer_file=str(bundle / "tokenizer/tokenizer.json")),
                          transformer=ref.chroma_reference(ckpt, DEMOS["tiny-chroma"]))
    with torch.no_grad():
        pe, pm = pipe._get_t5_prompt_embeds(prompt, max_sequence_length=T5_TOKENS)
        ne, nm = pipe._get_t5_prompt_embeds(negative, max_sequence_length=T5_TOKENS)
        want = pipe(prompt_embeds=pe, prompt_attention_mask=pm.bool(), negative_prompt_embeds=ne,
                    negative_prompt_attention_mask=nm.bool(), height=64, width=64, num_inference_steps=steps,
                    guidance_scale=guidance, latents=torch.from_numpy(pack(noise)), output_type="np").images[0]
    assert np.isfinite(want).all() and want.std() > 0.05
    print(f"PSNR {psnr(ours, want):.1f} dB")
    assert psnr(ours, want) >= 40.0, psnr(ours, want)


def test_the_dit_runtime_stays_thin(bundles):
    """Generating with a Flux bundle loads none of the compiler, onnx, ml_dtypes, torch or the HF /
    sentencepiece tokenizer libraries (the T5 tokenizer is numpy + the standard library)."""
    import subprocess
    import sys
    bundle, _ = bundles["tiny-flux-dev"]
    code = ("import sys\nfrom precast.runtime.families.flux import FluxTxt2Img\n"
            f"FluxTxt2Img({str(bundle)!r}, width=64, height=64)('a cat', steps=1, progress=False)\n"
            "print(sorted(m for m in ('precast.compiler', 'onnx', 'ml_dtypes', 'torch', 'transformers', 'tokenizers',"
            " 'sentencepiece', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["components"]["transformer"]["inputs"].__delitem__(
        [i["name"] for i in m["components"]["transformer"]["inputs"]].index("pooled_projections")), "pooled_projections"),
    (lambda m: m["components"]["transformer"]["inputs"][0].update(name="latents"), "hidden_states"),
    (lambda m: m["components"]["transformer"]["inputs"][0].update(shape=["batch", "image_tokens"]), "hidden_states"),
    (lambda m: m["model"].update(family="chroma"), "attention_mask"),
    (lambda m: m["model"].update(scheduler={"use_dynamic_shifting": True, "base_image_seq_len": 9,
                                           "max_image_seq_len": 9}), "model.scheduler"),
])
def test_a_hand_edited_manifest_is_one_line(bundles, tmp_path, edit, words):
    import shutil
    bundle = tmp_path / "b"
    shutil.copytree(bundles["tiny-flux-dev"][0], bundle)
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "1", "--size", "64x64", "--out", tmp_path / "x.png")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_a_bundle_built_for_several_t5_lengths_runs_its_engines(tmp_path):
    """Static profiles for 16 and 32 T5 tokens (neither the model's 512): the runtime runs the longest
    one its engines were built for instead of falling back to compiling the ONNX."""
    from precast.runtime.families.flux import FluxTxt2Img
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: 'demo:tiny-flux-dev'}\nprecision: fp32\n"
                      "profiles: {static: [{height: 64, width: 64, t5_tokens: 16}, {height: 64, width: 64, t5_tokens: 32}]}\n"
                      "targets: [{openvino: {device: CPU}}]\n")
    proc = precast("build", recipe, "--out", tmp_path / "b", env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    pipe = FluxTxt2Img(tmp_path / "b", width=64, height=64)
    assert pipe.t5_tokens == 32
    for comp in ("text_encoder_2", "transformer"):
        assert pipe.report()["components"][comp]["artifact"] != "onnx", pipe.report()["components"][comp]


def test_flux_img2img_matches_diffusers(bundles, tmp_path, monkeypatch):
    """img2img on Flux dev (ONNX Runtime, the bundle with its VAE encoder) against FluxImg2ImgPipeline with the same
    noise and the VAE's mean: PSNR >= 40 dB at strength 0.6 (the default) and 0.8."""
    from PIL import Image
    from diffusers import FluxImg2ImgPipeline
    from diffusers.pipelines.flux import pipeline_flux_img2img as m
    from test_img2img import picture, same_start
    from precast.runtime.families.flux import FluxTxt2Img
    bundle, ckpt = bundles["tiny-flux-dev"]
    recipe = _recipe(tmp_path, "tiny-flux-dev", "[onnxruntime]").read_text()
    (tmp_path / "i2i.yaml").write_text(recipe.replace("transformer, vae_decoder]", "transformer, vae_decoder, vae_encoder]"))
    proc = precast("build", tmp_path / "i2i.yaml", "--out", tmp_path / "b", env={"PRECAST_CACHE": str(bundle.parent / "cache")})
    assert proc.returncode == 0, proc.stderr
    noise = np.random.default_rng(6).standard_normal((1, 16, 32, 32)).astype(np.float32)
    same_start(monkeypatch, m, noise)
    pipe = FluxImg2ImgPipeline(**_flux_pipeline(bundle, ckpt, "tiny-flux-dev").components)
    init, prompt = picture(64, 64), "a photo of an astronaut riding a horse on the moon"
    run = FluxTxt2Img(tmp_path / "b", "onnxruntime", width=64, height=64, strict=True, image_input=True)
    for strength in (None, 0.8):
        with torch.no_grad():
            want = pipe(prompt, image=Image.fromarray(init), strength=strength or 0.6, height=64, width=64,
                        num_inference_steps=6, guidance_scale=3.5, max_sequence_length=T5_TOKENS,
                        output_type="np").images[0]
        ours = run(prompt, steps=6, guidance=3.5, latents=noise, progress=False, init_image=init, strength=strength)
        print(f"strength {strength or 0.6}: img2img PSNR vs FluxImg2ImgPipeline {psnr(ours, want):.1f} dB")
        assert want.std() > 0.05 and psnr(ours, want) >= 40.0, (strength, psnr(ours, want))


def _chroma_dynamic(bundles, tmp, encoder: bool):
    """The tiny Chroma, ONNX Runtime, 64x64 to 128x128 px, with or without its VAE encoder."""
    bundle, _ = bundles["tiny-chroma"]
    recipe = _recipe(tmp, "tiny-chroma", "[onnxruntime]").read_text().replace(
        "height: 64, width: 64", "height: {min: 64, opt: 64, max: 128}, width: {min: 64, opt: 64, max: 128}")
    if encoder:
        recipe = recipe.replace("transformer, vae_decoder]", "transformer, vae_decoder, vae_encoder]")
    (tmp / "r.yaml").write_text(recipe)
    proc = precast("build", tmp / "r.yaml", "--out", tmp / "b", env={"PRECAST_CACHE": str(bundle.parent / "cache")})
    assert proc.returncode == 0, proc.stderr
    return tmp / "b"


@pytest.fixture(scope="module")
def chroma_i2i(bundles, tmp_path_factory):
    """The tiny Chroma with its VAE encoder, 64x64 to 128x128 px (img2img and the hires fix)."""
    return _chroma_dynamic(bundles, tmp_path_factory.mktemp("chroma-i2i"), True)


def test_chroma_img2img_matches_diffusers(bundles, chroma_i2i, tmp_path, monkeypatch):
    """img2img on Chroma (true CFG with a negative prompt) against ChromaImg2ImgPipeline, its masks made boolean as
    ChromaPipeline's are (its float 0/1 mask is added to the attention scores: huggingface/diffusers#12116):
    PSNR >= 40 dB at strength 0.6 (the default) and 0.85; `generate --init-image` runs it from the CLI."""
    from PIL import Image
    from diffusers import ChromaImg2ImgPipeline, ChromaPipeline, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.chroma import pipeline_chroma_img2img as m
    from transformers import T5TokenizerFast
    from test_img2img import picture, same_start
    from precast.runtime.families.flux import FluxTxt2Img
    bundle, ckpt = bundles["tiny-chroma"]
    noise = np.random.default_rng(8).standard_normal((1, 16, 32, 32)).astype(np.float32)
    same_start(monkeypatch, m, noise)
    monkeypatch.setattr(ChromaImg2ImgPipeline, "_prepare_attention_mask", ChromaPipeline._prepare_attention_mask)
    pipe = ChromaImg2ImgPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ref.SCHEDULERS["chroma"]),
                                 vae=ref.vae16_reference(ckpt, TINY_VAE16), text_encoder=ref.t5_reference(ckpt, TINY_T5),
                                 tokenizer=T5TokenizerFast(tokenizer_file=str(bundle / "tokenizer/tokenizer.json")),
                                 transformer=ref.chroma_reference(ckpt, DEMOS["tiny-chroma"]))
    init, prompt, negative = picture(64, 64), "a lighthouse at dusk, oil painting", "blurry, low quality"
    run = FluxTxt2Img(chroma_i2i, "onnxruntime", width=64, height=64, strict=True, image_input=True)
    with torch.no_grad():
        pe, pm = pipe._get_t5_prompt_embeds(prompt, max_sequence_length=T5_TOKENS)
        ne, nm = pipe._get_t5_prompt_embeds(negative, max_sequence_length=T5_TOKENS)
    for strength in (None, 0.85):
        with torch.no_grad():
            want = pipe(image=Image.fromarray(init), strength=strength or 0.6, prompt_embeds=pe,
                        prompt_attention_mask=pm.bool(), negative_prompt_embeds=ne, negative_prompt_attention_mask=nm.bool(),
                        height=64, width=64, num_inference_steps=6, guidance_scale=4.0, output_type="np").images[0]
        ours = run(prompt, negative, steps=6, guidance=4.0, latents=noise, progress=False, init_image=init,
                   strength=strength)
        print(f"strength {strength or 0.6}: img2img PSNR vs ChromaImg2ImgPipeline {psnr(ours, want):.1f} dB")
        assert want.std() > 0.05 and psnr(ours, want) >= 40.0, (strength, psnr(ours, want))
    Image.fromarray(init).save(tmp_path / "init.png")
    proc = precast("generate", chroma_i2i, "--prompt", prompt, "--init-image", tmp_path / "init.png", "--steps", "4",
                   "--out", tmp_path / "c.png", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["mode"] == "img2img" and (tmp_path / "c.png").stat().st_size > 1000


def test_flow_hires_is_the_first_pass_then_img2img_by_hand(bundles, chroma_i2i, tmp_path):
    """The hires fix on a flow family (Chroma, true CFG): the first pass at 64x64, then img2img at 128x128 from its
    upscaled latents (A1111's "Latent": torch's bilinear interpolate) or from its decoded image resized and encoded
    again ("bilinear"), each image's noise from its own seed there -- the same pixels as those two calls by hand; the
    latent upscaler on a bundle without the VAE encoder."""
    from test_hires_tiling import pixel_hires_is_img2img_by_hand
    from precast.runtime.api import open_bundle
    from precast.runtime.hires import upscale_latents
    bundle = open_bundle(str(chroma_i2i))
    settings = {"negative": "blurry", "seed": 5, "backend": "onnxruntime", "guidance": 4.0}
    hires = pixel_hires_is_img2img_by_hand(bundle, settings)
    bundle = open_bundle(str(_chroma_dynamic(bundles, tmp_path, False)))    # the latent upscaler needs no VAE encoder
    assert "vae_encoder" not in bundle.manifest.components
    pipe = bundle.pipeline("onnxruntime").pipe
    kwargs = {"negative": "blurry", "guidance": 4.0, "progress": False}
    latents = pipe("a red fox", seeds=[5, 6], steps=3, decode=False, **kwargs)
    assert latents.shape == (2, 16, 32, 32)
    second = pipe.at_size(128, 128, pipe.spec.requests(bundle.manifest, 1, 128, 128))   # the same engines
    assert second is not None and second.loaded is pipe.loaded
    by_hand = second("a red fox", seeds=[5, 6], steps=4, init_latents=upscale_latents(latents, 64, 64, "latent"),
                     strength=0.6, **kwargs)
    latent = bundle.pipeline("onnxruntime").images("a red fox", steps=3, hires_scale=2, hires_steps=4, hires_denoise=0.6,
                                                   batch=2, **{k: v for k, v in settings.items() if k != "backend"})
    for made, want in zip(latent, by_hand):
        assert made.to_uint8().tobytes() == (np.clip(want, 0, 1) * 255).round().astype(np.uint8).tobytes()
    assert latent[1].settings["hires"] == {"scale": 2.0, "size": "128x128", "steps": 4, "denoise": 0.6,
                                           "upscaler": "latent"} and latent[1].seed == 6
    assert not np.array_equal(latent[0].to_uint8(), hires.to_uint8())     # the upscalers differ
