"""OpenVINO GenAI runs a precast build (issue 18, item 3): `precast export-openvino-genai` writes a
precast export in the layout `optimum-cli export openvino` writes, openvino_genai.Text2ImagePipeline
loads it as written and, from the same initial noise (handed to GenAI through a Generator subclass) with
the Euler scheduler the folder names, produces the image `precast generate --scheduler euler` produces
from the bundle of the same checkpoint (PSNR >= 40 dB; GenAI returns uint8, so ~50 dB is the ceiling)."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from precast.compiler.export import export

PROMPT, STEPS, GUIDANCE = "a photo of a cat", 4, 7.5
PIPES = {}
PINS = "openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 (they must match openvino 2026.4.1)"


def _need(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install {PINS}")


@pytest.fixture(scope="module")
def genai_folder(tiny_bundle, tmp_path_factory):
    _need("openvino_tokenizers")
    tmp = tmp_path_factory.mktemp("ov-genai")
    export(tiny_bundle[1], tmp / "export", progress=False)
    # the command through its click entry point (compiler/cli.py)
    proc = subprocess.run([sys.executable, "-m", "precast.compiler.cli", "export-openvino-genai", tmp / "export",
                           "--out", tmp / "genai", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["family"] == "sd1" and report["scheduler"] == "EulerDiscreteScheduler"
    return tmp / "genai", tmp / "export"


def test_layout_is_optimum_intels(genai_folder):
    import openvino as ov
    _need("openvino_tokenizers")   # registers the tokenizer ops for read_model
    root, _ = genai_folder
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and index["vae"] == ["diffusers", "AutoencoderKL"]
    sched = json.loads((root / "scheduler/scheduler_config.json").read_text())
    assert sched["_class_name"] == "EulerDiscreteScheduler" and sched["timestep_spacing"] == "leading"
    core = ov.Core()
    io = {}
    for part in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        assert (root / part / "config.json").is_file() and (root / part / "openvino_model.bin").is_file()
        m = core.read_model(root / part / "openvino_model.xml")
        io[part] = {p.get_any_name(): p.get_element_type().get_type_name() for p in m.inputs}
    # what GenAI feeds: int64 token ids (one input), int64 timestep, float32 latents and text states
    assert io["text_encoder"] == {"input_ids": "i64"}
    assert io["unet"] == {"sample": "f32", "timestep": "i64", "encoder_hidden_states": "f32"}
    assert io["vae_decoder"] == {"latent_sample": "f32"}
    for name in ("openvino_tokenizer.xml", "openvino_detokenizer.xml", "vocab.json", "merges.txt"):
        assert (root / "tokenizer" / name).is_file()
    tok = core.compile_model(root / "tokenizer/openvino_tokenizer.xml", "CPU")
    from precast.runtime.tokenizer import ClipTokenizer
    ids = tok([PROMPT])["input_ids"][0].tolist()
    assert ids == ClipTokenizer.from_folder(root / "tokenizer")(PROMPT).tolist()[:len(ids)]   # ours pads to 77


def _genai_and_ours(folder, bundle, negative):
    """GenAI's image and precast's (Txt2Img is `precast generate`) from the same noise, Euler, 64x64."""
    ov_genai = _need("openvino_genai")
    import openvino as ov
    from precast.runtime.families.sd import Txt2Img
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)

    class FixedNoise(ov_genai.Generator):
        """GenAI draws the initial latents with generator.randn_tensor: hand it precast's noise."""
        def __init__(self, x):
            super().__init__()
            self.x = x

        def next(self):
            raise AssertionError("the Euler scheduler draws no noise")

        def randn_tensor(self, shape):
            assert list(shape) == list(self.x.shape), shape
            return ov.Tensor(self.x.copy())

        def seed(self, new_seed):
            pass

    if folder not in PIPES:   # compiled once per folder: the SDXL cases share one
        PIPES[folder] = ov_genai.Text2ImagePipeline(str(folder), "CPU", INFERENCE_PRECISION_HINT="f32")
    pipe = PIPES[folder]
    # negative None: GenAI's SDXL then zeroes the unconditional states (force_zeros_for_empty_prompt), as
    # precast does for an empty negative prompt
    kw = {} if negative is None else {"negative_prompt": negative}
    out = pipe.generate(PROMPT, width=64, height=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                        generator=FixedNoise(noise), **kw)
    image = out.data[0].astype(np.float64) / 255          # [64, 64, 3] uint8 -> [0, 1]
    ours = Txt2Img(bundle, None, width=64, height=64)(PROMPT, negative or "", STEPS, 0, GUIDANCE, "euler",
                                                      latents=noise, progress=False)
    return image, ours


def _assert_same_image(image, ours):
    assert image.shape == ours.shape == (64, 64, 3)
    assert image.std() > 0.01                                # a picture, not a flat fill
    mse = float(np.mean((image - ours) ** 2))
    assert 10 * np.log10(1.0 / max(mse, 1e-12)) >= 40
    assert np.abs(image - ours).max() <= 2 / 255             # uint8 rounding, nothing more


def test_text2image_pipeline_matches_precast_generate(genai_folder, tiny_bundle):
    _assert_same_image(*_genai_and_ours(genai_folder[0], tiny_bundle[0], ""))


@pytest.fixture(scope="module")
def xl_folders(tmp_path_factory):
    """A tiny SDXL checkpoint: its OpenVINO GenAI folder and a precast bundle (ONNX Runtime, 64x64)."""
    _need("openvino_tokenizers")
    from conftest import precast
    from precast.compiler.demo_model import TINY_SDXL, write_demo_model
    from precast.compiler.openvino_genai import export_openvino_genai
    tmp = tmp_path_factory.mktemp("ov-genai-xl")
    ckpt = tmp / "xl.safetensors"
    write_demo_model(str(ckpt), TINY_SDXL)
    export(ckpt, tmp / "export", ["text_encoder", "text_encoder_2", "unet", "vae_decoder"], progress=False)
    export_openvino_genai(tmp / "export", tmp / "genai")
    recipe = tmp / "xl.yaml"
    recipe.write_text(f"model: {{source: {ckpt}}}\ncomponents: [text_encoder, text_encoder_2, unet, vae_decoder]\n"
                      "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")
    precast("build", recipe, "--out", tmp / "bundle", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    return tmp / "genai", tmp / "bundle"


def test_sdxl_clip_outputs_are_optimums(xl_folders):
    """GenAI reads output num_hidden_layers + 1 of each CLIP (the penultimate state) and text_embeds as
    text_encoder_2's output 0: the export's own layout, which is optimum's (compiler/graphs/clip_text.py)."""
    import openvino as ov
    for comp, heads in (("text_encoder", ["last_hidden_state", "pooler_output"]),
                        ("text_encoder_2", ["text_embeds", "last_hidden_state"])):
        layers = json.loads((xl_folders[0] / comp / "config.json").read_text())["num_hidden_layers"]
        names = [p.get_any_name() for p in ov.Core().read_model(xl_folders[0] / comp / "openvino_model.xml").outputs]
        assert names == heads + [f"hidden_states.{i}" for i in range(layers + 1)]


def test_genai_slot_holds_the_recorded_state(tmp_path):
    """hidden_state_outputs: GenAI's slot (output num_hidden_layers + 1) holds the state the export recorded
    (clip_skip 2 on a 3-layer CLIP-G: hidden_states.1, not the penultimate); an export from before the
    full layout (one hidden_states output and text_embeds) has that one state repeated; anything else is
    one clear error."""
    import openvino as ov
    import onnx
    from precast.compiler.demo_model import TINY_SDXL, write_demo_model
    from precast.compiler.errors import BadInput
    from precast.compiler.openvino_genai import convert_component, hidden_state_outputs
    ckpt = tmp_path / "xl.safetensors"
    write_demo_model(str(ckpt), TINY_SDXL)
    export(ckpt, tmp_path / "export", ["text_encoder_2"], overrides={"text_encoder_2": {"clip_skip": 2}},
           progress=False)
    path = tmp_path / "export/text_encoder_2/model.onnx"
    model = convert_component(ov, path, "text_encoder_2", "fp32")
    laid = hidden_state_outputs(ov, model, "text_encoder_2", 3, True, "hidden_states.1")
    names = [p.get_any_name() for p in laid.outputs]
    assert names[0] == "text_embeds" and names[4] == "hidden_states.1" and len(names) == 6
    ids = np.array([[49406, 320, 1125, 539, 49407] + [0] * 72], np.int64)
    got = ov.Core().compile_model(laid, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({"input_ids": ids})
    full = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({"input_ids": ids})
    np.testing.assert_allclose(got[4], full["hidden_states.1"], atol=1e-6)         # by index, as GenAI reads
    assert np.abs(got[4] - full["hidden_states.2"]).max() > 1e-3
    # the layout before every hidden state was an output: [hidden_states.2, text_embeds]
    old = onnx.load(str(path))
    keep = [o for o in old.graph.output if o.name in ("hidden_states.2", "text_embeds")]
    del old.graph.output[:]
    old.graph.output.extend(sorted(keep, key=lambda o: o.name != "hidden_states.2"))
    onnx.save(old, str(tmp_path / "old.onnx"))
    legacy = hidden_state_outputs(ov, convert_component(ov, tmp_path / "old.onnx", "text_encoder_2", "fp32"),
                                  "text_encoder_2", 3, True, "hidden_states.2")
    assert [p.get_any_name() for p in legacy.outputs] == ["text_embeds"] + ["hidden_states.2"] * 4
    del old.graph.output[1]                     # no text_embeds: refused
    onnx.save(old, str(tmp_path / "bad.onnx"))
    with pytest.raises(BadInput, match="optimum's layout"):
        hidden_state_outputs(ov, convert_component(ov, tmp_path / "bad.onnx", "text_encoder_2", "fp32"),
                             "text_encoder_2", 3, True)


@pytest.mark.parametrize("negative", [None, "blurry"])
def test_sdxl_text2image_pipeline_matches(xl_folders, negative):
    index = json.loads((xl_folders[0] / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is True
    _assert_same_image(*_genai_and_ours(*xl_folders, negative))


def test_refuses_families_not_written_yet(genai_folder, tmp_path):
    from precast.compiler.errors import BadInput
    from precast.compiler.openvino_genai import export_openvino_genai
    _, src = genai_folder
    fake = tmp_path / "export"
    fake.mkdir()
    report = json.loads((src / "precast_export.json").read_text())
    (fake / "precast_export.json").write_text(json.dumps({**report, "family": "sdxl-refiner"}))
    with pytest.raises(BadInput, match="SD 1.x / 2.x, SDXL, SD3 / SD3.5, Flux, FLUX.2 klein"):
        export_openvino_genai(fake, tmp_path / "out")
    (fake / "precast_export.json").write_text(json.dumps({**report, "family": "flux"}))
    with pytest.raises(BadInput, match="has no text_encoder_2, transformer"):   # an SD export relabelled
        export_openvino_genai(fake, tmp_path / "out")
    shutil.rmtree(fake)
    fake.mkdir()
    (fake / "precast_export.json").write_text(json.dumps(
        {**report, "components": [c for c in report["components"] if c["name"] != "unet"]}))
    with pytest.raises(BadInput, match="has no unet"):
        export_openvino_genai(fake, tmp_path / "out")
    with pytest.raises(BadInput, match="is the export folder"):
        export_openvino_genai(src, src)
