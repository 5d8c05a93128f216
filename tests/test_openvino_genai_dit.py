"""OpenVINO GenAI runs a precast Flux / SD3 / FLUX.2 klein / Z-Image / Qwen-Image export (issues 18 and 32):
`precast export-openvino-genai` writes the tiny Flux.1 dev / schnell, SD3.5-medium / SD3-medium, FLUX.2 klein
(distilled, and base with CFG), Z-Image (Turbo, and with CFG) and Qwen-Image demos in optimum-intel's OpenVINO
layout, openvino_genai.Text2ImagePipeline loads them as written (FluxPipeline, StableDiffusion3Pipeline,
Flux2KleinPipeline, ZImagePipeline, QwenImagePipeline) and, from the same initial
noise (handed to GenAI through a Generator subclass: GenAI draws the unpacked [1, C, h, w] latents with
randn_tensor, as precast does) with the export's own flow-matching schedule, produces the image precast's
pipeline (`precast generate`) produces from a bundle of the same checkpoint: PSNR >= 40 dB (GenAI returns
uint8, so ~54 dB is the ceiling). Chroma and FLUX.2 dev are refused."""
import json

import numpy as np
import pytest

from precast.compiler.export import export

PROMPT = "a photo of an astronaut riding a horse on the moon"
FLUX = ["text_encoder", "text_encoder_2", "transformer", "vae_decoder"]
SD3 = ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder"]
LLM = ["text_encoder", "transformer", "vae_decoder"]
# case: (demo, components, the bundle's text length, steps, guidance, negative prompt[, the export's variant])
# Without T5, GenAI's StableDiffusion3Pipeline pads the text with 77 zero tokens (CLIP's length) whatever
# max_sequence_length says, where precast (like diffusers) pads with the T5 length: a bundle of 77 matches.
CASES = {"flux-dev": ("tiny-flux-dev", FLUX, 32, 4, 3.5, None),
         "flux-schnell": ("tiny-flux-schnell", FLUX, 32, 3, 0.0, None),
         "sd35-medium": ("tiny-sd35-medium", SD3, 32, 4, 4.5, "blurry"),
         "sd3-no-t5": ("tiny-sd3", SD3[:2] + SD3[3:], 77, 4, 5.0, None),
         # GenAI pads the chat-templated prompt to max_sequence_length, precast to the bundle's text length: 64
         "flux2-klein": ("tiny-flux2-klein", LLM, 64, 4, 1.0, None),
         # klein base (is_distilled false: weights alike, the variant from a diffusers folder's model_index.json):
         # CFG against the empty prompt (GenAI takes no negative prompt for it)
         "flux2-klein-base": ("tiny-flux2-klein", LLM, 64, 3, 4.0, None, "klein-base"),
         # GenAI runs true CFG only with a negative prompt and templates "" as it is; precast reads "" as " " (as
         # QwenImagePipeline does): " " both. Both keep the prompt whole (the bundle's 160 - 34 template tokens)
         "qwen-image": ("tiny-qwen-image", LLM + ["vae_encoder"], 160, 4, 4.0, " "),
         # Turbo without CFG (GenAI's defaults are the base model's: 50 steps, guidance 5), and with CFG as the base
         # model runs it (the same guidance number on both sides)
         "z-image-turbo": ("tiny-z-image", LLM, 128, 8, 1.0, None),
         "z-image-cfg": ("tiny-z-image", LLM, 128, 4, 4.0, "blurry"),
         # a half export (the folder's models in fp16; the reference is the fp32 bundle)
         "qwen-image-fp16": ("tiny-qwen-image", LLM, 160, 4, 4.0, " ")}
DTYPES = {"qwen-image-fp16": "fp16"}
PINS = "openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 (they must match openvino 2026.4.1)"


def _need(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install {PINS}")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """case -> (GenAI folder, bundle, export), each made on first use: the bundle (ONNX Runtime, 64x64)
    by `precast build` of the demo recipe, the export from the checkpoint that build wrote."""
    _need("openvino_tokenizers")
    tmp, done = tmp_path_factory.mktemp("ov-genai-dit"), {}

    def get(case):
        if case not in done:
            done[case] = _make(tmp, case)
        return done[case]
    return get


def _make(tmp, case):
    from conftest import precast
    from precast.compiler.families import FAMILIES
    from precast.compiler.openvino_genai import export_openvino_genai
    demo, comps, t5, *rest = CASES[case]
    recipe = tmp / f"{case}.yaml"
    recipe.write_text(f"model: {{source: 'demo:{demo}'}}\ncomponents: [{', '.join(comps)}]\nprecision: fp32\n"
                      f"profiles: {{batch: 1, height: 64, width: 64, t5_tokens: {t5}}}\ntargets: [onnxruntime]\n")
    precast("build", recipe, "--out", tmp / case, env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    overrides = next(f.demos[f"demo:{demo}"] for f in FAMILIES.values() if f"demo:{demo}" in f.demos) or None
    export(tmp / "cache" / "demo" / f"{demo}-seed0.safetensors", tmp / f"{case}-export", comps, overrides=overrides,
           dtype=DTYPES.get(case, "fp32"), progress=False)
    if rest[3:]:                            # the variant a diffusers folder would have said
        report = tmp / f"{case}-export" / "precast_export.json"
        report.write_text(json.dumps({**json.loads(report.read_text()), "variant": rest[3]}))
    report = export_openvino_genai(tmp / f"{case}-export", tmp / f"{case}-genai")
    assert report["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    return tmp / f"{case}-genai", tmp / case, tmp / f"{case}-export"


def _io(path):
    import openvino as ov
    m = ov.Core().read_model(path)
    return ({p.get_any_name(): p.get_element_type().get_type_name() for p in m.inputs},
            [p.get_any_name() for p in m.outputs])


def test_flux_layout_is_optimum_intels(made):
    import openvino as ov
    from precast.runtime.t5_tokenizer import T5Tokenizer
    root, _, src = made("flux-dev")
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline" and index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert (index["text_encoder"], index["text_encoder_2"]) == (["transformers", "CLIPTextModel"],
                                                                ["transformers", "T5EncoderModel"])
    sched = json.loads((root / "scheduler/scheduler_config.json").read_text())
    assert sched == json.loads((src / "scheduler/scheduler_config.json").read_text())   # the export's own
    assert sched["_class_name"] == "FlowMatchEulerDiscreteScheduler" and sched["use_dynamic_shifting"] is True
    cfg = json.loads((root / "transformer/config.json").read_text())
    assert (cfg["in_channels"], cfg["guidance_embeds"], cfg["joint_attention_dim"]) == (64, True, 32)
    vae = json.loads((root / "vae_decoder/config.json").read_text())
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 0.3611, 0.1159)
    assert len(vae["block_out_channels"]) == 2          # GenAI's VAE factor 2 ** (levels - 1): the tiny VAE's 2
    # what GenAI feeds: int64 ids, float32 everything else (Flux's timestep is sigma, as precast's graph takes)
    clip = ({"input_ids": "i64"}, ["last_hidden_state", "pooler_output"])    # GenAI pools output 1
    assert _io(root / "text_encoder/openvino_model.xml") == clip
    assert _io(root / "text_encoder_2/openvino_model.xml") == ({"input_ids": "i64"}, ["last_hidden_state"])
    inputs, outputs = _io(root / "transformer/openvino_model.xml")
    assert set(inputs.values()) == {"f32"} and outputs == ["out_hidden_states"]
    assert set(inputs) == {"hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "guidance",
                           "pooled_projections"}
    for name in ("openvino_tokenizer.xml", "openvino_detokenizer.xml", "spiece.model", "tokenizer.json"):
        assert (root / "tokenizer_2" / name).is_file()
    tok = ov.Core().compile_model(root / "tokenizer_2/openvino_tokenizer.xml", "CPU")
    ids = tok([PROMPT])["input_ids"][0].tolist()
    ours, _ = T5Tokenizer.from_folder(root / "tokenizer_2")(PROMPT, 32)
    assert ids == ours.tolist()[:len(ids)]                  # ours pads to the T5 length


@pytest.mark.parametrize("case", ["sd35-medium", "sd3-no-t5"])
def test_sd3_layout_is_optimum_intels(made, case):
    root, _, _ = made(case)
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder"] == index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    with_t5 = case == "sd35-medium"
    assert index["text_encoder_3"] == (["transformers", "T5EncoderModel"] if with_t5 else [None, None])
    assert (root / "text_encoder_3").is_dir() == (root / "tokenizer_3").is_dir() == with_t5
    sched = json.loads((root / "scheduler/scheduler_config.json").read_text())
    assert (sched["_class_name"], sched["shift"], sched["use_dynamic_shifting"]) == \
        ("FlowMatchEulerDiscreteScheduler", 3.0, False)
    cfg = json.loads((root / "transformer/config.json").read_text())
    assert (cfg["_class_name"], cfg["in_channels"], cfg["patch_size"], cfg["joint_attention_dim"]) == \
        ("SD3Transformer2DModel", 16, 2, 128)
    assert cfg["sample_size"] <= cfg["patch_size"] * cfg["pos_embed_max_size"]
    for comp in ("text_encoder", "text_encoder_2"):
        layers = json.loads((root / comp / "config.json").read_text())["num_hidden_layers"]
        inputs, outputs = _io(root / comp / "openvino_model.xml")
        # GenAI: pooled = output 0, penultimate states = output num_hidden_layers + 1 (optimum's order,
        # which is the export's: every hidden state, as transformers returns them)
        assert inputs == {"input_ids": "i64"} and outputs[0] == "text_embeds"
        assert outputs == ["text_embeds", "last_hidden_state"] + [f"hidden_states.{i}" for i in range(layers + 1)]
        assert outputs[layers + 1] == f"hidden_states.{layers - 1}"
    inputs, _ = _io(root / "transformer/openvino_model.xml")
    assert inputs == {"hidden_states": "f32", "encoder_hidden_states": "f32", "pooled_projections": "f32",
                      "timestep": "f32"}


def test_flux2_klein_layout_is_optimum_intels(made):
    """What Flux2KleinPipeline reads: the stacked layers one output each, batched position ids, the latents'
    batch-norm statistics, the empirical mu, and a tokenizer whose chat template renders precast's prompt."""
    import openvino as ov
    from precast.runtime.families.flux2 import CHAT
    from precast.runtime.llm_tokenizer import LLMTokenizer
    root, bundle, src = made("flux2-klein")
    index = json.loads((root / "model_index.json").read_text())
    assert (index["_class_name"], index["text_encoder"], index["is_distilled"]) == \
        ("Flux2KleinPipeline", ["transformers", "Qwen3ForCausalLM"], True)
    te = json.loads((root / "text_encoder/config.json").read_text())
    assert te["hidden_states_layers"] == [9, 18, 27] and te["hidden_size"] == 32
    # one output per hidden state up to the deepest read, in index order: GenAI reads hidden_states.N by name,
    # optimum-intel's pipeline indexes the list of them by N; each is transformers' hidden_states[N]
    assert _io(root / "text_encoder/openvino_model.xml") == (
        {"input_ids": "i64", "attention_mask": "i64"}, [f"hidden_states.{i}" for i in range(28)])
    from test_flux2 import _text_encoder
    import torch
    from safetensors.torch import load_file
    sd = {k: v.float() for k, v in load_file(next((src.parent / "cache" / "demo").glob("tiny-flux2-klein-*"))).items()}
    ids, mask = np.random.default_rng(3).integers(0, 500, (2, 11)), np.ones((2, 11), np.int64)
    mask[1, 7:] = 0
    with torch.no_grad():
        want = _text_encoder(sd)(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                 output_hidden_states=True).hidden_states
    got = ov.Core().compile_model(root / "text_encoder/openvino_model.xml", "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(
        {"input_ids": ids, "attention_mask": mask})
    for i in range(28):
        np.testing.assert_allclose(got[f"hidden_states.{i}"], want[i].numpy(), atol=1e-4, rtol=1e-4)
    inputs, outputs = _io(root / "transformer/openvino_model.xml")
    assert set(inputs) == {"hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"}
    model = ov.Core().read_model(root / "transformer/openvino_model.xml")
    assert {p.get_any_name(): p.get_partial_shape().rank.get_length() for p in model.inputs
            if p.get_any_name().endswith("_ids")} == {"img_ids": 3, "txt_ids": 3}     # [B, S, 4]
    vae = json.loads((root / "vae_decoder/config.json").read_text())
    stats = json.loads((src / "precast_export.json").read_text())["components"]
    std = np.asarray(next(c["config"] for c in stats if c["name"] == "vae_decoder")["latents_bn_std"])
    assert len(vae["bn_running_mean_data"]) == 128 and vae["batch_norm_eps"] == 0.0
    np.testing.assert_allclose(np.sqrt(vae["bn_running_var_data"]), std, rtol=1e-6)
    sched = json.loads((root / "scheduler/scheduler_config.json").read_text())
    assert sched["time_shift_type"] == "exponential" and sched["use_dynamic_shifting"] is True
    config = json.loads((root / "tokenizer/tokenizer_config.json").read_text())
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(root / "tokenizer")
    assert config["chat_template"] == hf.chat_template
    text = hf.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert text == CHAT.format(prompt=PROMPT)
    tok = ov.Core().compile_model(root / "tokenizer/openvino_tokenizer.xml", "CPU")
    ids = tok([text])["input_ids"][0].tolist()
    assert ids == LLMTokenizer.from_folder(root / "tokenizer").chat(PROMPT, CHAT, 512)


def test_qwen_image_layout_is_optimum_intels(made):
    """What QwenImagePipeline feeds: the packed grid's height / width (int64 scalars; precast's graph takes
    position ids, now computed in the model: equal to the runtime's on odd, non-square grids), an int64 text mask,
    a 5-D single-frame VAE; the schedule's shift_terminal."""
    import openvino as ov
    from precast.runtime.families.qwenimage import latent_ids, text_ids
    import onnxruntime as ort
    root, _, src = made("qwen-image")
    index = json.loads((root / "model_index.json").read_text())
    assert (index["_class_name"], index["vae"], index["text_encoder"][1]) == \
        ("QwenImagePipeline", ["diffusers", "AutoencoderKLQwenImage"], "Qwen2_5_VLForConditionalGeneration")
    inputs, _ = _io(root / "transformer/openvino_model.xml")
    assert inputs == {"hidden_states": "f32", "encoder_hidden_states": "f32", "encoder_hidden_states_mask": "i64",
                      "timestep": "f32", "height": "i64", "width": "i64"}
    for comp, name in (("vae_decoder", "latent_sample"), ("vae_encoder", "sample")):
        model = ov.Core().read_model(root / comp / "openvino_model.xml")
        assert model.input(name).get_partial_shape().rank.get_length() == 5
        assert model.output(0).get_partial_shape().rank.get_length() == 5
    vae = json.loads((root / "vae_decoder/config.json").read_text())
    assert 2 ** len(vae["temperal_downsample"]) == 8 and vae["z_dim"] == 16
    assert json.loads((root / "scheduler/scheduler_config.json").read_text())["shift_terminal"] == 0.02
    genai = ov.Core().compile_model(root / "transformer/openvino_model.xml", "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ours = ort.InferenceSession(str(src / "transformer/model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for rows, cols, length in ((3, 5, 7), (4, 4, 2), (6, 1, 3)):
        feed = {"hidden_states": rng.standard_normal((1, rows * cols, 64), np.float32),
                "encoder_hidden_states": rng.standard_normal((1, length, 256), np.float32),
                "timestep": np.array([0.6], np.float32)}
        mask = np.ones((1, length), np.int64)
        got = genai({**feed, "encoder_hidden_states_mask": mask, "height": np.int64(rows), "width": np.int64(cols)})
        want = ours.run(None, {**feed, "encoder_hidden_states_mask": mask.astype(np.int32),
                               "img_ids": latent_ids(rows, cols), "txt_ids": text_ids(length, rows, cols)})[0]
        np.testing.assert_allclose(got[0], want, atol=1e-5)


def test_z_image_layout_is_optimum_intels(made):
    """What ZImagePipeline feeds: an additive float text mask and int32 position ids (precast's graph derives the
    positions from the mask), the text encoder's last_hidden_state; its tokenizer renders ZImagePipeline's chat
    text even as GenAI asks, thinking off."""
    from transformers import AutoTokenizer
    from precast.runtime.families.zimage import CHAT
    root, _, _ = made("z-image-turbo")
    index = json.loads((root / "model_index.json").read_text())
    assert (index["_class_name"], index["vae"], index["transformer"][1]) == \
        ("ZImagePipeline", ["diffusers", "AutoencoderKL"], "ZImageTransformer2DModel")
    assert _io(root / "text_encoder/openvino_model.xml") == (
        {"input_ids": "i64", "attention_mask": "i64"}, ["last_hidden_state"])
    assert _io(root / "transformer/openvino_model.xml")[0] == {
        "hidden_states": "f32", "encoder_hidden_states": "f32", "timestep": "f32", "encoder_attention_mask": "f32",
        "txt_ids": "i32", "img_ids": "i32"}
    hf = AutoTokenizer.from_pretrained(root / "tokenizer")
    for thinking in (False, True):
        assert hf.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking) == CHAT.format(prompt=PROMPT)


class _Noise:
    """An openvino_genai.Generator handing GenAI precast's initial noise (the flow schedules draw no more)."""

    def __new__(cls, x):
        ov_genai = _need("openvino_genai")
        import openvino as ov

        class FixedNoise(ov_genai.Generator):
            def next(self):
                raise AssertionError("the flow-matching Euler scheduler draws no noise")

            def randn_tensor(self, shape):
                assert list(shape) == list(x.shape), shape        # unpacked [1, 16, h, w], as precast draws
                return ov.Tensor(x.copy())

            def seed(self, new_seed):
                pass
        return FixedNoise()


@pytest.mark.parametrize("case", list(CASES))
def test_text2image_pipeline_matches_precast_generate(made, case):
    ov_genai = _need("openvino_genai")
    from precast.runtime.families import FAMILIES
    from precast.runtime.manifest import read_manifest
    folder, bundle, _ = made(case)
    demo, _, t5, steps, guidance, negative, *_ = CASES[case]
    manifest = read_manifest(bundle)
    family = FAMILIES[manifest.model["family"]]
    shape = family.requests(manifest, 1, 64, 64)["vae_decoder"]["latent_sample"]     # what precast draws
    noise = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    pipe = ov_genai.Text2ImagePipeline(str(folder), "CPU", INFERENCE_PRECISION_HINT="f32")
    kw = {} if negative is None else {"negative_prompt": negative}
    out = pipe.generate(PROMPT, width=64, height=64, num_inference_steps=steps, guidance_scale=guidance,
                        max_sequence_length=t5, generator=_Noise(noise), **kw)
    image = out.data[0].astype(np.float64) / 255          # [64, 64, 3] uint8 -> [0, 1]
    ours = family.pipeline(bundle, "cpu", width=64, height=64)(PROMPT, negative or "", steps=steps, guidance=guidance,
                                                              latents=noise, progress=False)
    assert image.shape == ours.shape == (64, 64, 3) and image.std() > 0.05   # a picture, not a flat fill
    psnr = 10 * np.log10(1.0 / max(float(np.mean((image - ours) ** 2)), 1e-12))
    print(f"{case}: PSNR {psnr:.1f} dB")
    assert psnr >= 40, psnr
    if case not in DTYPES:
        assert np.abs(image - ours).max() <= 2 / 255        # uint8 rounding, nothing more


# optimum-intel 2.2's pipelines on the same folders (diffusers' pipelines over the OpenVINO models): the call that
# is precast's case -- diffusers' guidance_scale for Z-Image is precast's guidance - 1, Qwen-Image's CFG is
# true_cfg_scale -- and the form the pipeline takes latents in (tests/interop_side.py packed)
OPTIMUM = {"flux2-klein": ({"guidance_scale": 1.0}, "patchify"),
           "z-image-turbo": ({"guidance_scale": 0.0}, None),
           "z-image-cfg": ({"guidance_scale": 3.0, "negative_prompt": "blurry"}, None),
           "qwen-image": ({"true_cfg_scale": 4.0, "negative_prompt": " "}, "pack")}


@pytest.mark.parametrize("case", list(OPTIMUM))
def test_optimum_intel_runs_the_folder(made, case, tmp_path):
    """optimum-intel 2.2's OVDiffusionPipeline (in its side environment: optimum 2.3, transformers 5.5) loads the
    folder GenAI loads and, from precast's noise, gives precast's image."""
    from side_env import run_side
    from precast.runtime.families import FAMILIES
    from precast.runtime.manifest import read_manifest
    folder, bundle, _ = made(case)
    _, _, t5, steps, guidance, negative, *_ = CASES[case]
    manifest = read_manifest(bundle)
    family = FAMILIES[manifest.model["family"]]
    noise = np.random.default_rng(7).standard_normal(
        family.requests(manifest, 1, 64, 64)["vae_decoder"]["latent_sample"]).astype(np.float32)
    np.save(tmp_path / "noise.npy", noise)
    call, form = OPTIMUM[case]
    ran = run_side({"module": "optimum.intel", "class": "OVDiffusionPipeline", "folder": str(folder),
                    "load": {"device": "CPU", "ov_config": {"INFERENCE_PRECISION_HINT": "f32"}},
                    "call": {"prompt": PROMPT, "height": 64, "width": 64, "num_inference_steps": steps,
                             "max_sequence_length": t5, **call},
                    "latents": str(tmp_path / "noise.npy"), "latents_form": form, "out": str(tmp_path / "image.npy")},
                   tmp_path, ov22=True)
    assert ran["optimum-intel"].startswith("2.2")
    image = np.load(tmp_path / "image.npy")
    ours = family.pipeline(bundle, "cpu", width=64, height=64)(PROMPT, negative or "", steps=steps, guidance=guidance,
                                                              latents=noise, progress=False)
    psnr = 10 * np.log10(1.0 / max(float(np.mean((image - ours) ** 2)), 1e-12))
    print(f"{case}: optimum-intel {ran['class']} PSNR {psnr:.1f} dB")
    assert image.shape == ours.shape and psnr >= 40, psnr


def _fake_export(src, dest, **changes):
    dest.mkdir()
    report = json.loads((src / "precast_export.json").read_text())
    (dest / "precast_export.json").write_text(json.dumps({**report, **changes}))
    return dest


def test_refusals_are_one_clear_error(made, tmp_path):
    from precast.compiler.errors import BadInput
    from precast.compiler.openvino_genai import export_openvino_genai
    _, _, flux = made("flux-dev")
    with pytest.raises(BadInput, match="OpenVINO GenAI has no Chroma pipeline"):
        export_openvino_genai(_fake_export(flux, tmp_path / "chroma", family="chroma"), tmp_path / "out")
    with pytest.raises(BadInput, match="no FLUX.2 dev pipeline"):
        export_openvino_genai(_fake_export(flux, tmp_path / "dev", family="flux2", variant="dev"), tmp_path / "out")
    with pytest.raises(BadInput, match="SDXL refiner is not written yet"):
        export_openvino_genai(_fake_export(flux, tmp_path / "refiner", family="sdxl-refiner"), tmp_path / "out")
    # a schedule GenAI's FluxPipeline does not sample (its sigmas are linspace(1, 1/steps))
    fake = _fake_export(flux, tmp_path / "spacing", scheduler={"use_dynamic_shifting": False, "shift": 3.0,
                                                             "spacing": "training"})
    with pytest.raises(BadInput, match="samples '1/steps' only"):
        export_openvino_genai(fake, tmp_path / "out")
    report = json.loads((flux / "precast_export.json").read_text())
    fake = _fake_export(flux, tmp_path / "no-t5", components=[c for c in report["components"]
                                                             if c["name"] != "text_encoder_2"])
    with pytest.raises(BadInput, match="has no text_encoder_2"):
        export_openvino_genai(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()
