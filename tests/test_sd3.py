"""SD3 / SD3.5 end to end: tiny random-weight models in Stability's single-file layout (all-in-one, and a
bare transformer with comfyanonymous-style separate CLIP-L / CLIP-G / T5 / VAE files) and as a diffusers
folder -> `precast export` (every component against diffusers / transformers) -> recipes -> bundles on
ONNX Runtime, OpenVINO and TensorRT-RTX (built ahead of time) -> `precast generate`, and the runtime's
pipeline against diffusers' StableDiffusion3Pipeline (with and without T5): PSNR >= 40 dB. LoRAs in
diffusers/PEFT and kohya (SAI) spellings merge to what diffusers' own adapter computes."""
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

import reference_dit as rdit
import reference_sd3 as ref
from conftest import precast, rel_err
from precast.compiler.demo_dit import TINY_VAE16, write_t5_file, write_vae16_file
from precast.compiler.demo_sd3 import (TINY_CLIP_G, TINY_SD3, TINY_SD35_MEDIUM, TINY_SD3_CLIP_L, TINY_SD3_T5,
                                       write_clip_file, write_sd3_checkpoint)

T5_TOKENS = 32
PROMPT = "a photo of an astronaut riding a horse on the moon"


def psnr(a, b):
    return 10 * np.log10(1.0 / float(np.mean((a.astype(np.float64) - b) ** 2)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """medium: SD3.5-medium-shaped all-in-one file (fp16, as SAI ships them); sd3: an SD3-medium-shaped bare
    transformer and its separate CLIP-L, CLIP-G, T5 and VAE files."""
    tmp = tmp_path_factory.mktemp("sd3-files")
    out = {k: tmp / f"{k}.safetensors" for k in ("medium", "sd3", "clip_l", "clip_g", "t5", "vae")}
    write_sd3_checkpoint(out["medium"], TINY_SD35_MEDIUM, TINY_SD3_CLIP_L, TINY_CLIP_G, TINY_SD3_T5, TINY_VAE16,
                         seed=1, dtype="fp16")
    write_sd3_checkpoint(out["sd3"], TINY_SD3, seed=2, dtype="bf16", layout="bare")
    write_clip_file(out["clip_l"], TINY_SD3_CLIP_L, "clip_l", seed=3)
    write_clip_file(out["clip_g"], TINY_CLIP_G, "clip_g", seed=4)
    write_t5_file(out["t5"], TINY_SD3_T5, seed=5)
    write_vae16_file(out["vae"], TINY_VAE16, seed=6)
    return out


def _separate(files):
    return ("--text-encoder", files["clip_l"], "--text-encoder", files["clip_g"], "--text-encoder", files["t5"],
            "--vae", files["vae"])


def _export(src, out, *extra, dtype="fp32"):
    proc = precast("export", src, "--out", out, "--dtype", dtype, *map(str, extra))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def exports(files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3-exports")
    return {"medium": _export(files["medium"], tmp / "medium"),
            "sd3": _export(files["sd3"], tmp / "sd3", *_separate(files))}


def _run(folder, comp, feeds):
    sess = ort.InferenceSession(str(folder / comp / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    from precast.runtime.embeddings import encoder_feeds   # the text encoders' textual-inversion rows
    if "token_embeddings_extra" in [i.name for i in sess.get_inputs()]:
        hidden = next(i.shape[-1] for i in sess.get_inputs() if i.name == "token_embeddings_extra")
        feeds = encoder_feeds(sess, comp, feeds["input_ids"], None, hidden)
    return dict(zip(names, sess.run(None, feeds)))


def _dit_feeds(cfg, seed=0, h=8, w=12):
    rng = np.random.default_rng(seed)
    return {"hidden_states": rng.standard_normal((1, 16, h, w)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, 77 + T5_TOKENS, cfg.context_dim)).astype(np.float32),
            "pooled_projections": rng.standard_normal((1, cfg.pooled_dim)).astype(np.float32),
            "timestep": np.array([637.5], np.float32)}


def _dit_reference(model, feeds):
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).sample.numpy()


def test_export_detects_each_variant_and_writes_the_peers_io(exports):
    for name, variant in (("medium", "3.5-medium"), ("sd3", "3-medium")):
        report = json.loads((exports[name] / "precast_export.json").read_text())
        assert (report["family"], report["variant"], report["prediction"]) == ("sd3", variant, "flow")
        assert report["latent_scale"] == 1.5305 and report["latent_shift"] == 0.0609 and report["t5_tokens"] == 256
        comps = {c["name"]: c for c in report["components"]}
        assert set(comps) == {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_encoder",
                              "vae_decoder"}
        dit = comps["transformer"]
        assert [i["name"] for i in dit["inputs"]] == ["hidden_states", "encoder_hidden_states", "pooled_projections",
                                                     "timestep"]
        assert [o["name"] for o in dit["outputs"]] == ["out_hidden_states"]
        assert {c["name"]: c["dtype"] for c in report["components"]}["vae_decoder"] == "fp32"
        for clip in ("text_encoder", "text_encoder_2"):
            # what transformers returns with output_hidden_states=True, in optimum's ONNX order
            assert [o["name"] for o in comps[clip]["outputs"]] == \
                ["text_embeds", "last_hidden_state", "hidden_states.0", "hidden_states.1", "hidden_states.2"]


@pytest.mark.parametrize("name", ["medium", "sd3"])
def test_every_component_matches_diffusers_and_transformers(files, exports, name):
    cfg = TINY_SD35_MEDIUM if name == "medium" else TINY_SD3
    src = files[name]
    feeds = _dit_feeds(cfg)
    got = _run(exports[name], "transformer", feeds)["out_hidden_states"]
    want = _dit_reference(ref.sd3_reference(src, cfg), feeds)
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)
    ids = np.full((1, 77), 49407, np.int32)
    ids[0, :6] = [49406, 320, 1125, 539, 320, 49407]
    for comp, which, ccfg in (("text_encoder", "l", TINY_SD3_CLIP_L), ("text_encoder_2", "g", TINY_CLIP_G)):
        if comp == "text_encoder_2":
            ids = np.where(np.arange(77) > 5, 0, ids).astype(np.int32)    # CLIP-G pads with "!" (id 0)
        model = ref.clip_reference(files[f"clip_{which}"] if name == "sd3" else src, ccfg, which)
        with torch.no_grad():
            out = model(torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
        got = _run(exports[name], comp, {"input_ids": ids})
        assert rel_err(got["hidden_states.1"], out.hidden_states[-2].numpy()) <= 1e-4, comp
        assert rel_err(got["text_embeds"], out.text_embeds.numpy()) <= 1e-4, comp
        assert rel_err(got["last_hidden_state"], out.last_hidden_state.numpy()) <= 1e-4, comp
        for i, state in enumerate(out.hidden_states):      # the embeddings, then every layer's output
            assert rel_err(got[f"hidden_states.{i}"], state.numpy()) <= 1e-4, (comp, i)
    t5 = rdit.t5_reference(files["t5"] if name == "sd3" else src, TINY_SD3_T5)
    t5_ids = np.zeros((1, T5_TOKENS), np.int32)
    t5_ids[0, :5] = [71, 1712, 13, 8, 1]
    with torch.no_grad():
        t5_want = t5(torch.from_numpy(t5_ids.astype(np.int64))).last_hidden_state.numpy()
    assert rel_err(_run(exports[name], "text_encoder_3", {"input_ids": t5_ids})["last_hidden_state"], t5_want) <= 1e-4
    z = np.random.default_rng(1).standard_normal((1, 16, 8, 8)).astype(np.float32)
    vae = ref.vae_reference(files["vae"] if name == "sd3" else src, TINY_VAE16)
    with torch.no_grad():
        want = vae.decode(torch.from_numpy(z)).sample.numpy()
    assert rel_err(_run(exports[name], "vae_decoder", {"latent_sample": z})["sample"], want) <= 1e-4


def _save_folder(files, folder):
    """A diffusers StableDiffusion3Pipeline folder (fp16 transformer variant, sharded) of the all-in-one file."""
    import diffusers
    src = files["medium"]
    ref.sd3_reference(src, TINY_SD35_MEDIUM).to(torch.float16).save_pretrained(
        folder / "transformer", variant="fp16", max_shard_size="40KB")
    ref.vae_reference(src, TINY_VAE16).save_pretrained(folder / "vae")
    ref.clip_reference(src, TINY_SD3_CLIP_L, "l").save_pretrained(folder / "text_encoder")
    ref.clip_reference(src, TINY_CLIP_G, "g").save_pretrained(folder / "text_encoder_2")
    rdit.t5_reference(src, TINY_SD3_T5).save_pretrained(folder / "text_encoder_3")
    diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))


def test_a_diffusers_folder_exports_the_same_model(files, exports, tmp_path):
    """A diffusers folder (sharded fp16 transformer: fused q|k|v and the swapped modulations land where
    SAI has them) exports the weights of the single file it was made from (the transformer's graph and
    data byte for byte; its text encoders compute the same)."""
    folder = tmp_path / "folder"
    _save_folder(files, folder)
    assert len(list((folder / "transformer").glob("*.safetensors"))) > 1
    out = _export(folder, tmp_path / "exp")
    report = json.loads((out / "precast_export.json").read_text())
    assert (report["layout"], report["variant"]) == ("diffusers", "3.5-medium")
    import onnx
    a = onnx.load(str(out / "transformer" / "model.onnx"), load_external_data=False).graph
    b = onnx.load(str(exports["medium"] / "transformer" / "model.onnx"), load_external_data=False).graph
    assert a == b
    assert (out / "transformer/model.onnx_data").read_bytes() == \
        (exports["medium"] / "transformer/model.onnx_data").read_bytes()
    ids = np.zeros((1, 77), np.int32)
    ids[0, :4] = [49406, 320, 1125, 49407]
    for comp in ("text_encoder", "text_encoder_2"):
        got, want = _run(out, comp, {"input_ids": ids}), _run(exports["medium"], comp, {"input_ids": ids})
        assert rel_err(got["text_embeds"], want["text_embeds"]) <= 1e-6, comp


def _recipe(tmp, source, targets, components, name):
    recipe = tmp / f"{name}.yaml"
    recipe.write_text(f"model: {{source: '{source}'}}\ncomponents: [{', '.join(components)}]\nprecision: fp32\n"
                      f"profiles: {{batch: 1, height: 64, width: 64, t5_tokens: {T5_TOKENS}}}\n"
                      f"targets: {targets}\n")
    return recipe


ALL = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder")


@pytest.fixture(scope="module")
def bundles(files, tmp_path_factory):
    """with T5 on every backend (the embedded demo recipe's model); without T5 on OpenVINO."""
    tmp = tmp_path_factory.mktemp("sd3-bundles")
    env = {"PRECAST_CACHE": str(tmp / "cache")}
    out = {}
    for name, source, targets, comps in (
            ("t5", files["medium"], "[onnxruntime, {openvino: {device: CPU}}, "
                                    "{tensorrt-rtx: {compute_capabilities: [sm_86, sm_120]}}]", ALL),
            ("no-t5", files["medium"], "[{openvino: {device: CPU}}]", tuple(c for c in ALL if c != "text_encoder_3"))):
        proc = precast("build", _recipe(tmp, source, targets, comps, name), "--out", tmp / name, env=env)
        assert proc.returncode == 0, proc.stderr
        out[name] = tmp / name
    return out


@pytest.mark.parametrize("backend", ["cpu:onnxruntime", "cpu:openvino"])
def test_generate_and_doctor_run_on_each_cpu_backend(bundles, tmp_path, backend):
    m = json.loads((bundles["t5"] / "manifest.json").read_text())
    assert {a["backend"] for a in m["artifacts"]} == {"onnxruntime", "openvino", "tensorrt-rtx"}
    assert {a["component"] for a in m["artifacts"] if a["backend"] == "tensorrt-rtx"} == set(ALL)
    assert (m["model"]["family"], m["model"]["scheduler"]["shift"], m["model"]["steps"]) == ("sd3", 3.0, 40)
    png = tmp_path / "out.png"
    proc = precast("generate", bundles["t5"], "--prompt", PROMPT, "--steps", "3", "--backend", backend,
                   "--out", png, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["components"]["transformer"]["backend"] == backend.split(":")[1]
    assert report["scheduler"] == "flow-euler" and report["guidance"] == 4.5 and png.stat().st_size > 100
    doctor = precast("doctor", bundles["t5"], "--backend", backend, "--json")
    assert doctor.returncode == 0, doctor.stderr
    assert set(json.loads(doctor.stdout)["components"]) == set(ALL)


def _diffusers_pipeline(bundle, src, t5: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTokenizer, T5TokenizerFast
    tok = lambda d, pad: CLIPTokenizer(str(bundle / d / "vocab.json"), str(bundle / d / "merges.txt"),  # noqa: E731
                                       model_max_length=77, pad_token=pad)
    return StableDiffusion3Pipeline(
        transformer=ref.sd3_reference(src, TINY_SD35_MEDIUM), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=ref.vae_reference(src, TINY_VAE16),
        text_encoder=ref.clip_reference(src, TINY_SD3_CLIP_L, "l"), tokenizer=tok("tokenizer", "<|endoftext|>"),
        text_encoder_2=ref.clip_reference(src, TINY_CLIP_G, "g"), tokenizer_2=tok("tokenizer_2", "!"),
        text_encoder_3=rdit.t5_reference(src, TINY_SD3_T5) if t5 else None,
        tokenizer_3=T5TokenizerFast(tokenizer_file=str(bundle / "tokenizer_3/tokenizer.json")) if t5 else None)


@pytest.mark.parametrize("name, steps, guidance", [("t5", 5, 4.5), ("no-t5", 4, 7.0)])
def test_pipeline_matches_diffusers(files, bundles, name, steps, guidance):
    from precast.runtime.families.sd3 import SD3Txt2Img
    bundle = bundles[name]
    noise = np.random.default_rng(3).standard_normal((1, 16, 32, 32)).astype(np.float32)
    pipe = SD3Txt2Img(bundle, "cpu", width=64, height=64)
    assert ("text_encoder_3" in pipe.needed) == (name == "t5")
    ours = pipe(PROMPT, "blurry", steps=steps, guidance=guidance, latents=noise, progress=False)
    with torch.no_grad():
        want = _diffusers_pipeline(bundles["t5"], files["medium"], name == "t5")(
            PROMPT, negative_prompt="blurry", height=64, width=64, num_inference_steps=steps, guidance_scale=guidance,
            max_sequence_length=T5_TOKENS, latents=torch.from_numpy(noise), output_type="np").images[0]
    assert np.isfinite(want).all() and want.std() > 0.05
    print(f"PSNR {psnr(ours, want):.1f} dB")
    assert psnr(ours, want) >= 40.0, psnr(ours, want)


def test_img2img_matches_diffusers(files, bundles, tmp_path, monkeypatch):
    """img2img with CFG against StableDiffusion3Img2ImgPipeline (same noise; the VAE's mean, shifted and scaled) on a
    tiny SD3.5-medium bundle with its VAE encoder (ONNX Runtime): PSNR >= 40 dB at strength 0.6 (the default) and 0.9."""
    from PIL import Image
    from diffusers import StableDiffusion3Img2ImgPipeline
    from diffusers.pipelines.stable_diffusion_3 import pipeline_stable_diffusion_3_img2img as m
    from test_img2img import picture, same_start
    from precast.runtime.families.sd3 import SD3Txt2Img
    recipe = _recipe(tmp_path, files["medium"], "[onnxruntime]", ALL + ("vae_encoder",), "i2i")
    proc = precast("build", recipe, "--out", tmp_path / "b", env={"PRECAST_CACHE": str(bundles["t5"].parent / "cache")})
    assert proc.returncode == 0, proc.stderr
    noise = np.random.default_rng(7).standard_normal((1, 16, 32, 32)).astype(np.float32)
    same_start(monkeypatch, m, noise)
    pipe = StableDiffusion3Img2ImgPipeline(**_diffusers_pipeline(bundles["t5"], files["medium"], True).components)
    init = picture(64, 64)
    run = SD3Txt2Img(tmp_path / "b", "onnxruntime", width=64, height=64, strict=True, image_input=True)
    for strength in (None, 0.9):
        with torch.no_grad():
            want = pipe(PROMPT, negative_prompt="blurry", image=Image.fromarray(init), strength=strength or 0.6,
                        height=64, width=64, num_inference_steps=5, guidance_scale=4.5, max_sequence_length=T5_TOKENS,
                        output_type="np").images[0]
        ours = run(PROMPT, "blurry", steps=5, guidance=4.5, latents=noise, progress=False, init_image=init,
                   strength=strength)
        print(f"strength {strength or 0.6}: img2img PSNR vs StableDiffusion3Img2ImgPipeline {psnr(ours, want):.1f} dB")
        assert want.std() > 0.05 and psnr(ours, want) >= 40.0, (strength, psnr(ours, want))


def test_lora_merges_as_diffusers_applies_it_in_peft_and_kohya_spellings(files, tmp_path):
    """A PEFT LoRA over diffusers' module names (to_q / to_k / to_v: row blocks of SAI's fused qkv) and the
    same LoRA in kohya's SAI spelling (lora_unet_joint_blocks_N_x_block_attn_qkv, block-diagonal up) merge
    to what diffusers' own adapter computes."""
    from safetensors.numpy import save_file
    model = ref.sd3_reference(files["medium"], TINY_SD35_MEDIUM)
    from test_flux import _peft_lora, peft_tensors
    rng, rank = np.random.default_rng(12), 4
    mods = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
            "transformer_blocks.1.attn.add_k_proj", "transformer_blocks.1.ff.net.0.proj", "transformer_blocks.0.attn2.to_out.0"]
    lora = _peft_lora(rng, model, mods, rank)
    peft = tmp_path / "peft.safetensors"
    save_file(peft_tensors(lora), str(peft))
    kohya = {}
    down = np.concatenate([lora[m][0] for m in mods[:3]])
    h = lora[mods[0]][1].shape[0]
    up = np.zeros((3 * h, 3 * rank), np.float32)
    for j, m in enumerate(mods[:3]):
        up[j * h:(j + 1) * h, j * rank:(j + 1) * rank] = lora[m][1]
    kohya.update({"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": down,
                  "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": up,
                  "lora_unet_joint_blocks_0_x_block_attn_qkv.alpha": np.array(3.0 * rank, np.float32)})
    k_up = np.zeros((3 * h, rank), np.float32)
    k_up[h:2 * h] = lora[mods[3]][1]                              # add_k_proj: the middle third of context qkv
    kohya.update({"lora_unet_joint_blocks_1_context_block_attn_qkv.lora_down.weight": lora[mods[3]][0],
                  "lora_unet_joint_blocks_1_context_block_attn_qkv.lora_up.weight": k_up})
    for name, m in (("joint_blocks_1_x_block_mlp_fc1", mods[4]), ("joint_blocks_0_x_block_attn2_proj", mods[5])):
        kohya.update({f"lora_unet_{name}.lora_down.weight": lora[m][0], f"lora_unet_{name}.lora_up.weight": lora[m][1]})
    kohya_file = tmp_path / "kohya.safetensors"
    save_file(kohya, str(kohya_file))
    feeds = _dit_feeds(TINY_SD35_MEDIUM, seed=5)
    a = _run(_export(files["medium"], tmp_path / "a", "--lora", f"{peft}:0.7", "--component", "transformer"),
             "transformer", feeds)["out_hidden_states"]
    b = _run(_export(files["medium"], tmp_path / "b", "--lora", f"{kohya_file}:0.7", "--component", "transformer"),
             "transformer", feeds)["out_hidden_states"]
    plain = _dit_reference(model, feeds)
    model.load_lora_adapter(str(peft), prefix="transformer", adapter_name="x")
    model.set_adapters(["x"], weights=[0.7])
    want = _dit_reference(model, feeds)
    assert rel_err(a, want) <= 1e-4 and rel_err(b, want) <= 1e-4, (rel_err(a, want), rel_err(b, want))
    assert rel_err(a, plain) > 1e-2


def test_parts_that_do_not_fit_and_what_is_missing_are_one_line(files, tmp_path):
    from precast.compiler.demo_model import write_demo_model
    sd15 = tmp_path / "sd15.safetensors"
    write_demo_model(str(sd15), seed=0)                       # its VAE has 4 latent channels
    proc = precast("export", files["sd3"], "--out", tmp_path / "a", "--text-encoder", files["clip_l"],
                   "--text-encoder", files["clip_g"], "--vae", sd15)
    assert proc.returncode == 2 and "16 channels" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = precast("export", files["sd3"], "--out", tmp_path / "b", "--component", "text_encoder_2")
    assert proc.returncode == 2 and "clip_g.safetensors" in proc.stderr, proc.stderr
    turbo = tmp_path / "sd3.5_large_turbo.safetensors"
    from precast.compiler.demo_sd3 import TINY_SD35_LARGE
    write_sd3_checkpoint(turbo, TINY_SD35_LARGE, seed=7, layout="bare")
    out = _export(turbo, tmp_path / "turbo", "--component", "transformer")
    assert json.loads((out / "precast_export.json").read_text())["variant"] == "3.5-large-turbo"


def test_fp16_export_records_its_fp32_blocks(files, tmp_path):
    out = _export(files["medium"], tmp_path / "half", "--component", "transformer", "--set",
                  "transformer.fp32_blocks=[1]", dtype="fp16")
    comp = json.loads((out / "precast_export.json").read_text())["components"][0]
    assert comp["dtype"] == "fp16" and any("[1]" in n and "fp32" in n for n in comp["precision_notes"])
    feeds = _dit_feeds(TINY_SD35_MEDIUM, seed=2)
    got = _run(out, "transformer", {k: v.astype(np.float16) if k != "timestep" else v for k, v in feeds.items()})
    want = _dit_reference(ref.sd3_reference(files["medium"], TINY_SD35_MEDIUM), feeds)
    assert np.isfinite(got["out_hidden_states"]).all()
    assert rel_err(got["out_hidden_states"].astype(np.float32), want) <= 2e-2


def test_the_python_api_gives_generates_image(bundles, tmp_path):
    from precast.runtime.api import open_bundle
    png = tmp_path / "cli.png"
    proc = precast("generate", bundles["no-t5"], "--prompt", PROMPT, "--steps", "2", "--seed", "4", "--out", png)
    assert proc.returncode == 0, proc.stderr
    image = open_bundle(bundles["no-t5"]).txt2img(PROMPT, steps=2, seed=4)
    assert image.png() == png.read_bytes() and (image.steps, image.guidance) == (2, 4.5)
