"""Other tools load a precast export and a bundle's onnx/ folder as written (issue 18, items 1-2):
diffusers' OnnxStableDiffusionPipeline and optimum's ORTStableDiffusionPipeline run them and match
`precast generate` (same seed, DPM-Solver++ 2M, latents passed in); the text encoder runs from
input_ids alone while precast's own sessions still take token_embeddings_extra."""
import json

import numpy as np
import pytest

from precast.compiler.export import export

PROMPT, STEPS, GUIDANCE = "a photo of a cat", 4, 7.5
# optimum-onnx 0.1.0 (via optimum 2.1) needs transformers<4.58 and optimum-intel 1.27-2.2 transformers<=5.5.4;
# the test extra pins transformers>=4.45,<5.24 (5.23 here), so neither is installed into the venv.
CONFLICT = "cannot be installed beside transformers 5.23 (the test extra's >=4.45,<5.24): {} requires {}"


@pytest.fixture(scope="module")
def folders(tiny_bundle, tmp_path_factory):
    bundle, ckpt = tiny_bundle
    out = tmp_path_factory.mktemp("interop") / "export"
    export(ckpt, out, progress=False)
    return {"export": out, "bundle": bundle / "onnx"}


@pytest.fixture(scope="module")
def noise_and_ours(tiny_bundle):
    from precast.runtime.sd_pipeline import Txt2Img
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
    assert psnr(image, ours) >= 40


@pytest.mark.parametrize("which", ["export", "bundle"])
def test_optimum_ort_pipeline_matches(folders, noise_and_ours, which):
    try:
        from optimum.onnxruntime import ORTStableDiffusionPipeline
    except ImportError:
        pytest.skip("optimum-onnx: " + CONFLICT.format("optimum-onnx 0.1.0", "transformers<4.58"))
    import torch
    pipe = ORTStableDiffusionPipeline.from_pretrained(folders[which])
    noise, ours = noise_and_ours
    image = pipe(PROMPT, height=64, width=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                 latents=torch.from_numpy(noise), output_type="np").images[0]
    assert psnr(image, ours) >= 40


def test_optimum_intel_pipeline_matches(folders, noise_and_ours):
    try:
        from optimum.intel import OVStableDiffusionPipeline
    except ImportError:
        pytest.skip("optimum-intel: " + CONFLICT.format("optimum-intel 1.27-2.2", "transformers<=5.5.4"))
    import torch
    pipe = OVStableDiffusionPipeline.from_pretrained(folders["export"], from_onnx=True, compile=True)
    noise, ours = noise_and_ours
    image = pipe(PROMPT, height=64, width=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                 latents=torch.from_numpy(noise), output_type="np").images[0]
    assert psnr(image, ours) >= 40
