"""Other tools load a precast export and a bundle's onnx/ folder as written (issue 18, items 1-2):
diffusers' OnnxStableDiffusionPipeline, optimum's ORTStableDiffusionPipeline / ORTStableDiffusionXLPipeline /
ORTStableDiffusion3Pipeline / ORTFluxPipeline and optimum-intel's OVStableDiffusionPipeline /
OVStableDiffusionXLPipeline / OVStableDiffusion3Pipeline / OVFluxPipeline (from_onnx=True) run them and
match `precast generate` (same noise passed in as latents; SD 1.x, SDXL: DPM-Solver++ 2M; Flux, SD3: the
folder's FlowMatch schedule): PSNR >= 40 dB in fp32. optimum-onnx 0.1.0 and optimum-intel 1.27 need
transformers < 4.58, so they run in a side environment (`make interop-setup`: .venv-interop) as a real
subprocess (tests/interop_side.py, tests/side_env.py); without it those tests skip and say how to make it.
The text encoder runs from input_ids alone while precast's own sessions still take token_embeddings_extra.

SDXL's and SD3's pipelines call the CLIP encoders with output_hidden_states=True: optimum pops
`hidden_states.0` .. `hidden_states.{N-1}` and takes the first output left (text_embeds, or SDXL CLIP-L's
3-D last_hidden_state, which it does not pool) as the pooled embedding, optimum-intel lists every
`hidden_states.*` output; both read hidden_states[-2]. precast's CLIP graphs for those families output
what transformers returns, in optimum's export order (compiler/graphs/clip_text.py), and precast's runtime
picks its state by name, so its own images did not change."""
import json
from pathlib import Path

import numpy as np
import pytest

import side_env
from precast.compiler.export import export

PROMPT, STEPS, GUIDANCE = "a photo of a cat", 4, 7.5


def run_side(tmp, module: str, cls: str, folder, call: dict, latents=None, load=None) -> np.ndarray:
    """Run `cls.from_pretrained(folder, **load)(**call, latents=latents)` in the side environment (a real
    subprocess, tests/interop_side.py); the image it wrote, [H, W, 3] float32."""
    tmp = Path(tmp)
    spec = {"module": module, "class": cls, "folder": str(folder), "load": load or {}, "call": call,
            "out": str(tmp / "image.npy")}
    if latents is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "latents.npy", latents)
        spec["latents"] = str(tmp / "latents.npy")
    report = side_env.run_side(spec, tmp)
    assert report["class"] == cls, report
    return np.load(tmp / "image.npy")


@pytest.fixture(scope="module")
def folders(tiny_bundle, tmp_path_factory):
    bundle, ckpt = tiny_bundle
    out = tmp_path_factory.mktemp("interop") / "export"
    export(ckpt, out, progress=False)
    return {"export": out, "bundle": bundle / "onnx"}


@pytest.fixture(scope="module")
def noise_and_ours(tiny_bundle):
    from precast.runtime.families.sd import Txt2Img
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ours = Txt2Img(tiny_bundle[0], None, width=64, height=64)(PROMPT, "", STEPS, 0, GUIDANCE, "dpm++2m",
                                                               latents=noise, progress=False)
    return noise, ours


def psnr(a, b):
    mse = float(np.mean((np.asarray(a, np.float64) - b) ** 2))
    return 10 * np.log10(1.0 / mse) if mse else float("inf")


@pytest.mark.parametrize("which", ["export", "bundle"])
def test_folder_is_a_diffusers_pipeline(folders, which):
    from transformers import CLIPTokenizer
    from precast.runtime.tokenizer import ClipTokenizer
    root = folders[which]
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "OnnxStableDiffusionPipeline"
    parts = [p.name for p in root.iterdir() if (p / "model.onnx").is_file()]
    for name in parts:
        assert index[name] == ["diffusers", "OnnxRuntimeModel"]
        assert (root / name / "config.json").is_file()
    assert json.loads((root / "scheduler/scheduler_config.json").read_text())["_class_name"] == \
        "DPMSolverMultistepScheduler"
    te = json.loads((root / "text_encoder/config.json").read_text())
    assert te["model_type"] == "clip_text_model" and te["hidden_size"] == 64
    vae = json.loads((root / "vae_decoder/config.json").read_text())
    assert vae["scaling_factor"] == pytest.approx(0.18215) and 2 ** (len(vae["block_out_channels"]) - 1) == 8
    tok = CLIPTokenizer.from_pretrained(root / "tokenizer")
    assert tok.model_max_length == 77
    ids = tok(PROMPT, padding="max_length", max_length=77).input_ids
    assert ids == ClipTokenizer.from_folder(root / "tokenizer")(PROMPT).tolist()


def test_text_encoder_needs_only_input_ids(folders):
    """Other tools feed input_ids alone (the extra rows default to one zero row); precast's ONNX Runtime
    and OpenVINO (compile-on-load) sessions still list and apply token_embeddings_extra."""
    import onnxruntime as ort
    from precast.runtime.sessions import OnnxRuntimeSession, OpenVinoSession
    path = folders["export"] / "text_encoder/model.onnx"
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in plain.get_inputs()] == ["input_ids"]
    ids = np.array([[49406, 320, 49408] + [49407] * 74], np.int32)
    alone = plain.run(None, {"input_ids": ids})[0]
    extra = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    feeds = {"input_ids": ids, "token_embeddings_extra": extra}
    ours = OnnxRuntimeSession(path)
    assert "token_embeddings_extra" in ours.input_names
    with_extra = ours.run(feeds)["last_hidden_state"]
    assert np.abs(with_extra - alone).max() > 1e-3        # the extra row reached the graph
    zero_row = ours.run({**feeds, "token_embeddings_extra": np.zeros((1, 64), np.float32)})["last_hidden_state"]
    np.testing.assert_allclose(zero_row, alone, atol=1e-6)
    ov = OpenVinoSession(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}, from_onnx=True)
    assert "token_embeddings_extra" in ov.input_names
    np.testing.assert_allclose(ov.run(feeds)["last_hidden_state"], with_extra, atol=1e-4)


def test_targets_compile_the_input_required(folders, tmp_path):
    import onnx
    from precast.compiler.targets.base import BuildJob, required_inputs
    path = folders["export"] / "text_encoder/model.onnx"
    with required_inputs(BuildJob(path, "text_encoder", [], {}), tmp_path) as job:
        model = onnx.load(str(job.onnx_path), load_external_data=False)
        assert "token_embeddings_extra" in [i.name for i in model.graph.input]
        assert "token_embeddings_extra" not in [t.name for t in model.graph.initializer]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("which", ["export", "bundle"])
def test_diffusers_onnx_pipeline_matches(folders, noise_and_ours, which):
    from diffusers import OnnxStableDiffusionPipeline
    root = folders[which]
    # a bundle built without vae_encoder (txt2img only): diffusers wants every part named
    kw = {} if (root / "vae_encoder").is_dir() else {"vae_encoder": None}
    pipe = OnnxStableDiffusionPipeline.from_pretrained(root, provider="CPUExecutionProvider", **kw)
    noise, ours = noise_and_ours
    image = pipe(PROMPT, height=64, width=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                 latents=noise, output_type="np").images[0]
    print(f"PSNR {psnr(image, ours):.1f} dB")
    assert psnr(image, ours) >= 40


@pytest.mark.parametrize("which", ["export", "bundle"])
def test_optimum_ort_pipeline_matches(folders, noise_and_ours, which, tmp_path):
    noise, ours = noise_and_ours
    image = run_side(tmp_path, "optimum.onnxruntime", "ORTStableDiffusionPipeline", folders[which],
                     {"prompt": PROMPT, "height": 64, "width": 64, "num_inference_steps": STEPS,
                      "guidance_scale": GUIDANCE}, noise)
    assert image.shape == ours.shape and image.std() > 0.01
    print(f"PSNR {psnr(image, ours):.1f} dB")
    assert psnr(image, ours) >= 40


@pytest.mark.parametrize("which", ["export", "bundle"])
def test_optimum_intel_pipeline_matches(folders, noise_and_ours, which, tmp_path):
    noise, ours = noise_and_ours
    image = run_side(tmp_path, "optimum.intel", "OVStableDiffusionPipeline", folders[which],
                     {"prompt": PROMPT, "height": 64, "width": 64, "num_inference_steps": STEPS,
                      "guidance_scale": GUIDANCE}, noise,
                     load={"from_onnx": True, "compile": True, "ov_config": {"INFERENCE_PRECISION_HINT": "f32"}})
    assert image.shape == ours.shape and image.std() > 0.01
    print(f"PSNR {psnr(image, ours):.1f} dB")
    assert psnr(image, ours) >= 40


FLUX_PROMPT, FLUX_COMPONENTS = "a photo of an astronaut riding a horse on the moon", \
    ["text_encoder", "text_encoder_2", "transformer", "vae_decoder"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """The tiny Flux.1 dev demo: a bundle (`precast build`, ONNX Runtime, 64x64, T5 length 32), an export of
    the checkpoint that build wrote, and precast's image from the bundle (FluxTxt2Img is `precast generate`)
    from fixed unpacked noise [1, 16, 32, 32] (the tiny VAE's factor is 2)."""
    from conftest import precast
    from precast.compiler.demo_dit import DEMO_AXES
    from precast.runtime.families.flux import FluxTxt2Img
    tmp = tmp_path_factory.mktemp("interop-flux")
    recipe = tmp / "flux.yaml"
    recipe.write_text("model: {source: 'demo:tiny-flux-dev'}\ncomponents: [" + ", ".join(FLUX_COMPONENTS) + "]\n"
                      "precision: fp32\nprofiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\n"
                      "targets: [onnxruntime]\n")
    precast("build", recipe, "--out", tmp / "bundle", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    export(tmp / "cache" / "demo" / "tiny-flux-dev-seed0.safetensors", tmp / "export", FLUX_COMPONENTS,
           overrides={"transformer": {"axes_dims_rope": DEMO_AXES}}, progress=False)
    noise = np.random.default_rng(7).standard_normal((1, 16, 32, 32)).astype(np.float32)
    ours = FluxTxt2Img(tmp / "bundle", "cpu", width=64, height=64)(FLUX_PROMPT, "", steps=4, guidance=3.5,
                                                                   latents=noise, progress=False)
    return {"export": tmp / "export", "bundle": tmp / "bundle" / "onnx", "noise": noise, "ours": ours}


def pack(latents: np.ndarray) -> np.ndarray:
    """diffusers' FluxPipeline takes given latents packed: [1, 16, h, w] -> [1, h/2 * w/2, 64]."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


@pytest.mark.parametrize("tool", ["optimum.onnxruntime:ORTFluxPipeline", "optimum.intel:OVFluxPipeline"])
@pytest.mark.parametrize("which", ["export", "bundle"])
def test_optimum_flux_pipeline_matches(flux, tool, which, tmp_path):
    """optimum's ORTFluxPipeline and optimum-intel's OVFluxPipeline(from_onnx=True) load the Flux folder as
    written (the T5 config.json carries num_decoder_layers, which optimum's text encoder reads) and match
    precast's image from the same noise (guidance 3.5, 4 steps, the folder's FlowMatch schedule)."""
    module, cls = tool.split(":")
    load = {"from_onnx": True, "compile": True, "ov_config": {"INFERENCE_PRECISION_HINT": "f32"}} \
        if module == "optimum.intel" else {}
    image = run_side(tmp_path, module, cls, flux[which],
                     {"prompt": FLUX_PROMPT, "height": 64, "width": 64, "num_inference_steps": 4,
                      "guidance_scale": 3.5, "max_sequence_length": 32}, pack(flux["noise"]), load=load)
    ours = flux["ours"]
    assert image.shape == ours.shape == (64, 64, 3) and image.std() > 0.05
    print(f"PSNR {psnr(image, ours):.1f} dB")
    assert psnr(image, ours) >= 40


OV_F32 = {"from_onnx": True, "compile": True, "ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}
XL_COMPONENTS = ["text_encoder", "text_encoder_2", "unet", "vae_decoder"]


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """A tiny SDXL base checkpoint: a bundle (`precast build`, ONNX Runtime, fp32, 64x64), its export, and
    precast's image from the bundle (Txt2Img is `precast generate`; DPM-Solver++ 2M, the folder's scheduler;
    an empty negative prompt is zeros, as the folder's force_zeros_for_empty_prompt says)."""
    from conftest import precast
    from precast.compiler.demo_model import TINY_SDXL, write_demo_model
    from precast.runtime.families.sd import Txt2Img
    tmp = tmp_path_factory.mktemp("interop-sdxl")
    ckpt = tmp / "xl.safetensors"
    write_demo_model(str(ckpt), TINY_SDXL)
    export(ckpt, tmp / "export", XL_COMPONENTS, progress=False)
    recipe = tmp / "xl.yaml"
    recipe.write_text(f"model: {{source: {ckpt}}}\ncomponents: [{', '.join(XL_COMPONENTS)}]\nprecision: fp32\n"
                      "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")
    precast("build", recipe, "--out", tmp / "bundle", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ours = Txt2Img(tmp / "bundle", None, width=64, height=64)(PROMPT, "", STEPS, 0, GUIDANCE, "dpm++2m",
                                                              latents=noise, progress=False)
    return {"export": tmp / "export", "bundle": tmp / "bundle" / "onnx", "noise": noise, "ours": ours}


@pytest.mark.parametrize("tool", ["optimum.onnxruntime:ORTStableDiffusionXLPipeline",
                                  "optimum.intel:OVStableDiffusionXLPipeline"])
@pytest.mark.parametrize("which", ["export", "bundle"])
def test_optimum_sdxl_pipeline_matches(sdxl, tool, which, tmp_path):
    """optimum's ORTStableDiffusionXLPipeline and optimum-intel's OVStableDiffusionXLPipeline(from_onnx=True)
    load the SDXL folder as written: both CLIP encoders give every hidden state (hidden_states[-2], the
    penultimate, is what they read), text_encoder_2 its text_embeds first (the pooled embedding)."""
    module, cls = tool.split(":")
    image = run_side(tmp_path, module, cls, sdxl[which],
                     {"prompt": PROMPT, "height": 64, "width": 64, "num_inference_steps": STEPS,
                      "guidance_scale": GUIDANCE}, sdxl["noise"], load=OV_F32 if module == "optimum.intel" else {})
    ours = sdxl["ours"]
    assert image.shape == ours.shape == (64, 64, 3) and image.std() > 0.01
    print(f"PSNR {psnr(image, ours):.1f} dB")
    assert psnr(image, ours) >= 40


SD3_COMPONENTS = ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder"]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """The tiny SD3.5 medium demo: a bundle (`precast build`, ONNX Runtime, fp32, 64x64, T5 length 32), an
    export of the checkpoint that build wrote, and precast's image from the bundle (SD3Txt2Img is `precast
    generate`) from fixed noise [1, 16, 32, 32] with a negative prompt (CFG 4.5, 4 steps)."""
    from conftest import precast
    from precast.runtime.families.sd3 import SD3Txt2Img
    tmp = tmp_path_factory.mktemp("interop-sd3")
    recipe = tmp / "sd3.yaml"
    recipe.write_text("model: {source: 'demo:tiny-sd35-medium'}\ncomponents: [" + ", ".join(SD3_COMPONENTS) + "]\n"
                      "precision: fp32\nprofiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\n"
                      "targets: [onnxruntime]\n")
    precast("build", recipe, "--out", tmp / "bundle", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    export(tmp / "cache" / "demo" / "tiny-sd35-medium-seed0.safetensors", tmp / "export", SD3_COMPONENTS,
           progress=False)
    noise = np.random.default_rng(7).standard_normal((1, 16, 32, 32)).astype(np.float32)
    ours = SD3Txt2Img(tmp / "bundle", "cpu", width=64, height=64)(FLUX_PROMPT, "blurry", steps=4, guidance=4.5,
                                                                  latents=noise, progress=False)
    return {"export": tmp / "export", "bundle": tmp / "bundle" / "onnx", "noise": noise, "ours": ours}


@pytest.mark.parametrize("tool", ["optimum.onnxruntime:ORTStableDiffusion3Pipeline",
                                  "optimum.intel:OVStableDiffusion3Pipeline"])
@pytest.mark.parametrize("which", ["export", "bundle"])
def test_optimum_sd3_pipeline_matches(sd3, tool, which, tmp_path):
    """optimum's ORTStableDiffusion3Pipeline and optimum-intel's OVStableDiffusion3Pipeline(from_onnx=True)
    load the SD3.5 folder as written (both CLIPs: text_embeds first, then every hidden state; T5 padded to
    the folder's length, 32) and match precast's image from the same noise."""
    module, cls = tool.split(":")
    image = run_side(tmp_path, module, cls, sd3[which],
                     {"prompt": FLUX_PROMPT, "negative_prompt": "blurry", "height": 64, "width": 64,
                      "num_inference_steps": 4, "guidance_scale": 4.5, "max_sequence_length": 32}, sd3["noise"],
                     load=OV_F32 if module == "optimum.intel" else {})
    ours = sd3["ours"]
    assert image.shape == ours.shape == (64, 64, 3) and image.std() > 0.05
    print(f"PSNR {psnr(image, ours):.1f} dB")
    assert psnr(image, ours) >= 40


def test_precast_reads_its_state_by_name_not_position(tmp_path):
    """With every hidden state an output, precast's runtime picks the one the export recorded
    (runtime/text_encoders.py text_state_name), never the first hidden_states.* output: the penultimate by
    default, the clip_skip layer when asked (SDXL CLIP-G, 3 layers: clip_skip 2 reads hidden_states.1);
    an export without the record (an older precast one, a foreign optimum one) falls back to the only
    hidden state, or hidden_states.{layers - 1}."""
    import onnxruntime as ort
    from precast.compiler.demo_model import TINY_SDXL, write_demo_model
    from precast.runtime.text_encoders import text_state_name
    ckpt = tmp_path / "xl.safetensors"
    write_demo_model(str(ckpt), TINY_SDXL)
    comps = ["text_encoder", "text_encoder_2"]
    for out, overrides in (("plain", None), ("skip", {"text_encoder_2": {"clip_skip": 2}})):
        export(ckpt, tmp_path / out, comps, overrides=overrides, progress=False)
    ids = np.array([[49406, 320, 1125, 539, 49407] + [0] * 72], np.int32)
    got = {}
    for out in ("plain", "skip"):
        report = json.loads((tmp_path / out / "precast_export.json").read_text())
        cfg = next(c["config"] for c in report["components"] if c["name"] == "text_encoder_2")
        s = ort.InferenceSession(str(tmp_path / out / "text_encoder_2/model.onnx"), providers=["CPUExecutionProvider"])
        got[out] = dict(zip([o.name for o in s.get_outputs()], s.run(None, {"input_ids": ids})))
        assert list(got[out])[:3] == ["text_embeds", "last_hidden_state", "hidden_states.0"]
        name = text_state_name(got[out], cfg, penultimate=True)
        assert name == cfg["hidden_name"] == ("hidden_states.2" if out == "plain" else "hidden_states.1")
    # the same weights: clip_skip only changes which output is read
    np.testing.assert_allclose(got["skip"]["hidden_states.1"], got["plain"]["hidden_states.1"], atol=1e-6)
    assert np.abs(got["plain"]["hidden_states.2"] - got["plain"]["hidden_states.1"]).max() > 1e-3
    layers = {"num_hidden_layers": 3}      # a foreign optimum export's config.json: no hidden_name
    assert text_state_name(got["plain"], layers, penultimate=True) == "hidden_states.2"
    assert text_state_name(got["plain"], layers, penultimate=False) == "last_hidden_state"
    assert text_state_name({"hidden_states.2": 0, "text_embeds": 0}, {}, penultimate=True) == "hidden_states.2"
