"""FLUX.2 dev end to end on tiny random-weight models in the real key layouts: a Mistral text model (no QK norms,
128-wide heads wider than width / heads, as Mistral-Small-3.2's) against transformers' MistralModel with left-padded
prompts (the padding rows attend to nothing, as torch's SDPA has them), the runtime's conditioning (Mistral's chat
template with BFL's system message, left padding, hidden states 10, 20 and 30 stacked) against Flux2Pipeline's own
prompt embedding (Mistral3ForConditionalGeneration, Mistral's tokenizer), the transformer's guidance embedder against
diffusers' Flux2Transformer2DModel, the embedded tiny demo generated with on ONNX Runtime and OpenVINO and compared
with Flux2Pipeline (same weights, tokenizer, scheduler and starting latents), and the split files and refusals."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import reference_dit as ref
from conftest import precast, rel_err
from test_flux2 import AXES, SCHEDULER, _transformer, _vae, conditioning_matches
from test_zimage import _one_line, _randomized, _run_ov, _session, psnr
from precast.compiler.demo_flux2 import (MISTRAL_PREFIX, TINY_FLUX2_DEV, TINY_MISTRAL_30, TINY_QWEN3_28,
                                         flux2_components, mistral_tokenizer_json, write_demo_flux2,
                                         write_flux2_vae_file, write_mistral_file)
from precast.compiler.demo_weights import write_components
from precast.compiler.demo_zimage import write_qwen3_file
from precast.compiler.sources.llm_tokenizer_files import MISTRAL_CONFIG
from precast.runtime.families.flux2 import SYSTEM

TEXT = 128          # the tiny bundle's text length (its profile's opt)
# Mistral-Small-3.x's chat template for what Flux2Pipeline sends: a system turn and a user turn, their contents as
# text blocks, no generation prompt (the real template's other branches -- tools, images, assistant turns -- unused)
MISTRAL_TEMPLATE = ("{{- bos_token }}{%- for m in messages %}{%- set text = m['content'] if m['content'] is string "
                    "else m['content'][0]['text'] %}{%- if m['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + "
                    "'[/SYSTEM_PROMPT]' }}{%- elif m['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}"
                    "{%- endfor %}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The embedded dev demo's file and its tiny bundles (ONNX Runtime + OpenVINO; ONNX Runtime only)."""
    tmp = tmp_path_factory.mktemp("flux2dev")
    recipe = tmp / "tiny.yaml"
    recipe.write_text("model: {source: 'demo:tiny-flux2-dev'}\ncomponents: [text_encoder, transformer, vae_decoder]\n"
                      "precision: fp32\nprofiles: {batch: 1, height: 64, width: 64,\n"
                      f"           t5_tokens: {{min: 32, opt: {TEXT}, max: 256}}}}\n"
                      "targets: [onnxruntime, {openvino: {device: CPU}}]\n")
    env = {"PRECAST_CACHE": str(tmp / "cache")}
    precast("build", recipe, "--out", tmp / "bundle", env=env, check=True)
    precast("build", recipe, "--out", tmp / "ort", *[a for c in ("text_encoder", "transformer", "vae_decoder")
                                                     for a in ("--only", f"{c}.onnxruntime")], env=env, check=True)
    write_demo_flux2(tmp / "demo.safetensors", "tiny-flux2-dev")      # the same seeded weights the demo source names
    return {"tmp": tmp, "file": tmp / "demo.safetensors", "bundle": tmp / "bundle", "ort": tmp / "ort"}


def _mistral_config(m=TINY_MISTRAL_30):
    from transformers import MistralConfig
    return MistralConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
                         num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                         head_dim=m.head_dim, rope_theta=1e9, rms_norm_eps=1e-5, sliding_window=None)


def _text_encoder(sd):
    """Mistral3ForConditionalGeneration (a tiny Pixtral vision tower, unused by text prompts) holding the file's
    text model."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, image_size=32, patch_size=16)
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=_mistral_config(), vision_config=vision,
                                                            image_token_index=10))
    model.model.language_model.load_state_dict(ref.component(sd, MISTRAL_PREFIX), strict=True)
    return model.eval()


def _tokenizer(folder):
    """The bundle's tokenizer.json as transformers loads FLUX.2-dev's (LlamaTokenizerFast, left padding) with the
    chat template: the text path of its PixtralProcessor (whose image processor needs torchvision)."""
    from transformers import LlamaTokenizerFast
    return LlamaTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=MISTRAL_TEMPLATE,
                              **{k: v for k, v in MISTRAL_CONFIG.items() if k != "tokenizer_class"})


@pytest.fixture(scope="module")
def reference(demo):
    """Flux2Pipeline over the demo file's weights, with the bundle's tokenizer and Mistral's template."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    sd = {k: v.float() for k, v in load_file(demo["file"]).items()}
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=_vae(sd),
                         text_encoder=_text_encoder(sd), tokenizer=_tokenizer(demo["bundle"] / "tokenizer"),
                         transformer=_transformer(sd, TINY_FLUX2_DEV))


# ---- components ----------------------------------------------------------------------------------------------

def test_tokenizer_ids_and_left_padding_match_transformers(demo, tmp_path):
    """The runtime's input_ids and attention_mask (Mistral's template with BFL's system message, `[IMG]` taken out,
    cut at the length, padded on the left with `<pad>`) are exactly what Flux2Pipeline's apply_chat_template(
    padding="max_length", truncation=True) gives, on 300 generated prompts (scripts, emojis, whitespace runs, the
    model's control tokens, prompts past the length)."""
    from test_zimage import _corpus
    from precast.runtime.families.flux2 import DEV_CHAT
    from precast.runtime.llm_tokenizer import LLMTokenizer
    ours = LLMTokenizer.from_folder(demo["bundle"] / "tokenizer")
    theirs = _tokenizer(demo["bundle"] / "tokenizer")
    assert ours.pad_left and ours.pad_id == theirs.pad_token_id
    long = 0
    for prompt in _corpus() + ["[IMG] a cat [IMG]", "[INST] nested [/INST]"]:
        cleaned = prompt.replace("[IMG]", "")
        ids, mask = ours.padded(ours.chat(cleaned, DEV_CHAT, TEXT), TEXT)
        want = theirs.apply_chat_template([[{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                                            {"role": "user", "content": [{"type": "text", "text": cleaned}]}]],
                                          add_generation_prompt=False, tokenize=True, return_dict=True,
                                          padding="max_length", truncation=True, max_length=TEXT)
        assert ids[0].tolist() == want["input_ids"][0], prompt[:40]
        assert mask[0].tolist() == want["attention_mask"][0], prompt[:40]
        long += mask.all()
    assert long > 10      # the corpus reaches past the length: the cut is checked too
    # a config that names no padding side nor a Llama class: Mistral's tokens say left; Qwen2's stay right
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                                "pad_token": "<pad>"}))
    (tmp_path / "tokenizer.json").write_bytes((demo["bundle"] / "tokenizer" / "tokenizer.json").read_bytes())
    assert LLMTokenizer.from_folder(tmp_path).pad_left
    from precast.compiler.demo_zimage import tiny_tokenizer_json
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    assert not LLMTokenizer.from_folder(tmp_path).pad_left


def test_mistral_encoder_with_left_padding_matches_transformers(tmp_path):
    """A Mistral text model (no QK norms; heads 128 wide, wider than width / heads; its config's theta and eps) read
    at hidden states 10, 20, 30 of 30 with left-padded rows: fp32 on ONNX Runtime and OpenVINO <= 1e-4 of
    transformers' MistralModel (SDPA), the padding rows' states included."""
    from transformers import MistralModel
    from precast.compiler.graphs.llm_encoder import build_llm_encoder, llm_config
    from precast.compiler.graphs.onnx_graph import Graph
    from precast.compiler.graphs.onnx_writer import save_model
    from precast.compiler.sources.checkpoint import open_checkpoint
    from precast.compiler.sources.tensor_refs import LLM
    torch.manual_seed(0)
    model = _randomized(MistralModel(_mistral_config()))
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "te.safetensors")
    g = Graph("text_encoder", open_checkpoint(tmp_path / "te.safetensors"), LLM, "fp32")
    cfg = llm_config(g, {"text_config": {"head_dim": 128, "rope_theta": 1e9, "rms_norm_eps": 1e-5}}, {},
                     reads=(10, 20, 30))
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.qk_norm, cfg.theta, cfg.eps) == (2, 1, 128, False, 1e9, 1e-5)
    build_llm_encoder(g, cfg)
    save_model(g, str(tmp_path / "onnx"))
    ids = np.random.default_rng(1).integers(0, 512, (2, 21))
    mask = np.ones((2, 21), np.int64)
    mask[1, :8] = 0
    with torch.no_grad():
        states = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                       output_hidden_states=True).hidden_states
    want = np.concatenate([states[r].numpy() for r in (10, 20, 30)], axis=-1)
    feeds = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32)}
    ours = _session(tmp_path / "onnx").run(None, feeds)[0]
    assert ours.shape == want.shape and rel_err(ours, want) <= 1e-4, rel_err(ours, want)
    assert rel_err(ours[1, :8], want[1, :8]) <= 1e-4          # the rows that see no key
    assert rel_err(_run_ov(tmp_path / "onnx", feeds)[0], want) <= 1e-4


def test_text_encoder_matches_flux2_prompt_embeds(demo, reference):
    """The runtime's conditioning (Mistral's template with BFL's system message, `[IMG]` taken out, left padding to
    the text length, hidden states 10, 20 and 30 stacked) equals Flux2Pipeline._get_mistral_3_small_prompt_embeds
    <= 1e-4, padding rows included, on ONNX Runtime and OpenVINO."""
    prompts = ("a photo of a cat", "一只猫坐在红色沙发上 [IMG]", "word " * 200)    # the last one cut at the length
    with torch.no_grad():
        want = [type(reference)._get_mistral_3_small_prompt_embeds(reference.text_encoder, reference.tokenizer, p,
                                                                   max_sequence_length=TEXT).numpy() for p in prompts]
    config = conditioning_matches(demo, prompts, want, TEXT)
    assert (config["layers"], config["reads"], config["theta"], config["eps"]) == (30, [10, 20, 30], 1e9, 1e-5)


def test_transformer_guidance_matches_diffusers(demo, reference, tmp_path):
    """The dev transformer (BFL names with guidance_in) exported and run on ONNX Runtime against diffusers' with two
    guidance scales: <= 1e-4 each; the guidance changes the output."""
    from precast.runtime.families.flux2 import latent_ids, text_ids
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES)
    assert proc.returncode == 0, proc.stderr
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 16, 128)).astype(np.float32)
    ctx = rng.standard_normal((1, 24, 96)).astype(np.float32)
    outs = []
    for g in (1.0, 4.0):
        feeds = {"hidden_states": x, "encoder_hidden_states": ctx, "timestep": np.array([0.7], np.float32),
                 "img_ids": latent_ids(4, 4), "txt_ids": text_ids(24), "guidance": np.array([g], np.float32)}
        with torch.no_grad():
            want = reference.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(ctx),
                                         timestep=torch.tensor([0.7]), guidance=torch.tensor([g]),
                                         img_ids=torch.from_numpy(feeds["img_ids"]),
                                         txt_ids=torch.from_numpy(feeds["txt_ids"]), return_dict=False)[0].numpy()
        outs.append(_session(tmp_path / "x" / "transformer").run(None, feeds)[0])
        assert rel_err(outs[-1], want) <= 1e-4, (g, rel_err(outs[-1], want))
    assert rel_err(outs[0], outs[1]) > 1e-3


# ---- the pipeline --------------------------------------------------------------------------------------------

def test_pipeline_matches_diffusers(demo, reference):
    """dev's defaults (50 steps, guidance 4 fed to the transformer, no negative prompt) on ONNX Runtime and OpenVINO
    against Flux2Pipeline with the same starting latents, at 4 steps and guidance 4 and 2.5: PSNR >= 40 dB each; the
    guidance changes the image, and so does the prompt (by far more than the runtimes differ: the tiny random model
    reads its text weakly)."""
    from diffusers import Flux2Pipeline
    from precast.runtime.families.flux2 import Flux2Txt2Img
    noise = np.random.default_rng(3).standard_normal((1, 128, 16, 16)).astype(np.float32)
    ours_noise = Flux2Pipeline._unpatchify_latents(torch.from_numpy(noise)).numpy()      # [1, 32, 32, 32]
    prompt = "a photo of an astronaut riding a horse on the moon"
    with torch.no_grad():
        want = {g: reference(prompt=prompt, height=64, width=64, num_inference_steps=4, guidance_scale=g,
                             latents=torch.from_numpy(noise), output_type="np", max_sequence_length=TEXT).images[0]
                for g in (4.0, 2.5)}
    assert want[4.0].std() > 0.05 and psnr(want[4.0], want[2.5]) < 40
    for bundle, backend in ((demo["ort"], "onnxruntime"), (demo["bundle"], "openvino")):
        run = Flux2Txt2Img(bundle, backend, width=64, height=64, strict=True)
        assert (run.defaults["steps"], run.defaults["guidance"], run.t5_tokens, run.negative) == (50, 4.0, TEXT, False)
        for g, image in want.items():
            ours = run(prompt, steps=4, guidance=g, latents=ours_noise, progress=False)
            close = psnr(ours, image)
            assert close >= 40.0, (backend, g, close)
    # no negative prompt is read: one given changes nothing
    assert np.array_equal(run(prompt, negative="blurry", steps=2, latents=ours_noise, progress=False),
                          run(prompt, steps=2, latents=ours_noise, progress=False))
    other = psnr(run("a lighthouse at dusk", steps=4, guidance=2.5, latents=ours_noise, progress=False), want[2.5])
    assert other < close - 10, (other, close)


def test_generate_says_the_negative_prompt_is_unused(demo, tmp_path):
    proc = precast("generate", demo["ort"], "--prompt", "a red fox", "--negative", "blurry", "--steps", "2",
                   "--out", tmp_path / "fox.png", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "--negative is not used by FLUX.2 dev (distilled guidance" in proc.stderr
    assert json.loads(proc.stdout)["steps"] == 2 and (tmp_path / "fox.png").stat().st_size > 1000


def test_diffusers_folder_exports_as_the_file(demo, reference, tmp_path):
    """Flux2Pipeline saved as a diffusers folder (text_encoder/ = Mistral3ForConditionalGeneration: its text model
    under model.language_model., a vision tower and lm_head beside it; its config's text_config) exports as variant
    dev, its text encoder computing what the demo file's export computes, bit for bit."""
    reference.save_pretrained(tmp_path / "folder")
    (tmp_path / "folder" / "transformer" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "folder" / "transformer" / "config.json").read_text()), "axes_dims_rope": [4, 4, 4, 4]}))
    proc = precast("export", tmp_path / "folder", "--out", tmp_path / "fx", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["family"], report["variant"], report["layout"], report["steps"], report["guidance"]) == \
        ("flux2", "dev", "diffusers", 50, 4.0)
    te = next(c for c in report["components"] if c["name"] == "text_encoder")["config"]
    assert (te["reads"], te["head_dim"], te["theta"], te["eps"]) == ([10, 20, 30], 128, 1e9, 1e-5)
    proc = precast("export", demo["file"], "--out", tmp_path / "sx", "--component", "text_encoder", "--set", AXES)
    assert proc.returncode == 0, proc.stderr
    ids = np.random.default_rng(6).integers(0, 512, (1, 40)).astype(np.int32)
    feeds = {"input_ids": ids, "attention_mask": (np.arange(40) >= 9).astype(np.int32)[None]}
    assert np.array_equal(_session(tmp_path / "fx" / "text_encoder").run(None, feeds)[0],
                          _session(tmp_path / "sx" / "text_encoder").run(None, feeds)[0])


# ---- split files and refusals --------------------------------------------------------------------------------

def test_split_files_export_and_mismatches_are_one_line(tmp_path):
    """BFL's dev transformer alone + ComfyUI's Mistral file + the tokenizer.json beside them + BFL's VAE export
    whole (variant dev; the text encoder read at 10, 20, 30 with Mistral's defaults; the tokenizer padded on the
    left); klein's Qwen3 given to the dev transformer is one line naming both widths; a Mistral too shallow for
    hidden state 30 is one line naming them."""
    bare = tmp_path / "flux2-dev.safetensors"
    write_components(bare, flux2_components(TINY_FLUX2_DEV, layout="bare"), 0, "bf16")
    mistral = tmp_path / "mistral_3_small_flux2_bf16.safetensors"
    write_mistral_file(mistral)
    write_flux2_vae_file(tmp_path / "flux2-vae.safetensors")
    _one_line(precast("export", bare, "--out", tmp_path / "a", "--text-encoder", mistral, "--set", AXES),
              "tokenizer.json", "FLUX.2-dev")
    (tmp_path / "tokenizer.json").write_text(mistral_tokenizer_json())
    proc = precast("export", bare, "--out", tmp_path / "ok", "--text-encoder", mistral, "--vae",
                   tmp_path / "flux2-vae.safetensors", "--set", AXES, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["family"], report["variant"], report["steps"], report["guidance"]) == ("flux2", "dev", 50, 4.0)
    te = next(c for c in report["components"] if c["name"] == "text_encoder")["config"]
    assert (te["reads"], te["theta"], te["eps"], te["head_dim"]) == ([10, 20, 30], 1e9, 1e-5, 128)
    assert json.loads((tmp_path / "ok" / "tokenizer" / "tokenizer_config.json").read_text())["padding_side"] == "left"
    index = json.loads((tmp_path / "ok" / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline"
    assert json.loads((tmp_path / "ok" / "text_encoder" / "config.json").read_text())["model_type"] == "mistral"
    # klein's Qwen3 for the dev transformer: the widths say it is not the model's
    qwen = tmp_path / "q" / "qwen_3_4b.safetensors"
    qwen.parent.mkdir()
    write_qwen3_file(qwen, replace(TINY_QWEN3_28, hidden=16))
    (qwen.parent / "tokenizer.json").write_text(mistral_tokenizer_json())
    _one_line(precast("export", bare, "--out", tmp_path / "b", "--text-encoder", qwen, "--set", AXES),
              "16 wide", "dev: Mistral-Small-3.2, 3 x 5120")
    # a Mistral too shallow for the hidden states dev reads
    shallow = tmp_path / "s" / "mistral_small.safetensors"
    shallow.parent.mkdir()
    write_mistral_file(shallow, replace(TINY_MISTRAL_30, layers=12))
    (shallow.parent / "tokenizer.json").write_text(mistral_tokenizer_json())
    _one_line(precast("export", bare, "--out", tmp_path / "c", "--text-encoder", shallow, "--component",
                      "text_encoder"), "[10, 20, 30]")
