"""FLUX.2 klein end to end on tiny random-weight models in the real key layouts: the Qwen3 text encoder's stacked
hidden states (9, 18, 27) against Flux2KleinPipeline's own prompt embedding (transformers' Qwen3Model, the same
tokenizer and chat template), the transformer against diffusers' Flux2Transformer2DModel (loaded through diffusers'
single-file converter from BFL's names; diffusers' folder layout too), the VAE decoder and encoder against
AutoencoderKLFlux2 (BFL's flux2-vae names), the embedded tiny demo built, generated with on ONNX Runtime and
OpenVINO and compared with Flux2KleinPipeline (distilled and base, same weights, tokenizer, scheduler and starting
latents), and the one-line refusals."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import reference_dit as ref
from conftest import precast, rel_err, run_half
from test_zimage import QWEN3_TEMPLATE, _one_line, _run_ov, _session, psnr
from precast.compiler.demo_dit import write_vae16_file
from precast.compiler.demo_flux2 import (DEMO_AXES, TINY_FLUX2, TINY_QWEN3_28, flux2_components, write_demo_flux2,
                                         write_flux2_vae_file)
from precast.compiler.demo_weights import write_components
from precast.compiler.demo_zimage import DIT_PREFIX, LLM_PREFIX, tiny_tokenizer_json, write_qwen3_file

AXES = "transformer.axes_dims_rope=" + json.dumps(DEMO_AXES).replace(" ", "")
VAE_CONFIG = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
                  latent_channels=32, norm_num_groups=32)
SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096, time_shift_type="exponential")    # the klein folders' scheduler config
TEXT = 64           # the tiny bundle's text length (its profile's opt; the released 512 is past its max)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The embedded demo's file, its tiny bundle (ONNX Runtime + OpenVINO) and one with ONNX Runtime only."""
    tmp = tmp_path_factory.mktemp("flux2")
    recipe = tmp / "tiny.yaml"
    recipe.write_text("model: {source: 'demo:tiny-flux2-klein'}\ncomponents: [text_encoder, transformer, vae_decoder]\n"
                      "precision: fp32\nprofiles: {batch: 1, height: 64, width: 64,\n"
                      "           t5_tokens: {min: 32, opt: 64, max: 128}}\n"
                      "targets: [onnxruntime, {openvino: {device: CPU}}]\n")
    env = {"PRECAST_CACHE": str(tmp / "cache")}
    precast("build", recipe, "--out", tmp / "bundle", env=env, check=True)
    precast("build", recipe, "--out", tmp / "ort", *[a for c in ("text_encoder", "transformer", "vae_decoder")
                                                     for a in ("--only", f"{c}.onnxruntime")], env=env, check=True)
    write_demo_flux2(tmp / "demo.safetensors")           # the same seeded weights the demo source names
    return {"tmp": tmp, "file": tmp / "demo.safetensors", "bundle": tmp / "bundle", "ort": tmp / "ort"}


# ---- the references: diffusers' and transformers' models holding the file's weights -------------------------

def _transformer(sd, c=TINY_FLUX2):
    """Flux2Transformer2DModel of config `c` (dev's: with the guidance embedder) from the file's BFL names."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    model = Flux2Transformer2DModel(in_channels=c.in_channels, num_layers=c.depth, num_single_layers=c.depth_single,
                                    attention_head_dim=c.hidden // c.heads, num_attention_heads=c.heads,
                                    joint_attention_dim=c.context, axes_dims_rope=DEMO_AXES, guidance_embeds=c.guidance)
    model.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(ref.component(sd, DIT_PREFIX)), strict=True)
    return model.eval()


def _vae(sd):
    """AutoencoderKLFlux2 from LDM names (top-level or BFL's nested quant convs) and the bn statistics."""
    from diffusers import AutoencoderKLFlux2
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    sd = {k.replace("encoder.quant_conv", "quant_conv").replace("decoder.post_quant_conv", "post_quant_conv"): v
          for k, v in ref.component(sd, "vae.").items()}
    stats = {k: sd.pop(k) for k in ("bn.running_mean", "bn.running_var")}
    model = AutoencoderKLFlux2(**VAE_CONFIG)
    model.load_state_dict({**convert_ldm_vae_checkpoint(sd, VAE_CONFIG), **stats,
                           "bn.num_batches_tracked": torch.tensor(0)}, strict=True)
    return model.eval()


def _text_encoder(sd):
    from transformers import Qwen3Config, Qwen3Model
    q = TINY_QWEN3_28
    model = Qwen3Model(Qwen3Config(vocab_size=q.vocab, hidden_size=q.hidden, intermediate_size=q.intermediate,
                                   num_hidden_layers=q.layers, num_attention_heads=q.heads, num_key_value_heads=q.kv_heads,
                                   head_dim=q.head_dim, rope_theta=1e6, rms_norm_eps=1e-6))
    model.load_state_dict(ref.component(sd, LLM_PREFIX), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def reference(demo):
    """Flux2KleinPipeline (distilled) over the demo file's weights, with the bundle's tokenizer and Qwen3's template."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import AutoTokenizer
    sd = {k: v.float() for k, v in load_file(demo["file"]).items()}
    tok_dir = demo["tmp"] / "reference_tokenizer"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((demo["bundle"] / "tokenizer" / "tokenizer.json").read_bytes())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}))
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=_vae(sd),
                              text_encoder=_text_encoder(sd), tokenizer=AutoTokenizer.from_pretrained(tok_dir),
                              transformer=_transformer(sd), is_distilled=True)


# ---- components ----------------------------------------------------------------------------------------------

def test_text_encoder_matches_flux2_klein_prompt_embeds(demo, reference):
    """The runtime's conditioning (chat template, tokenizer, padding to the text length, the encoder's hidden states
    9, 18 and 27 stacked) equals Flux2KleinPipeline._get_qwen3_prompt_embeds <= 1e-4, padding rows included, on ONNX
    Runtime and OpenVINO; the layers past 27 are not in the graph."""
    prompts = ("a photo of a cat", "一只猫坐在红色沙发上 " * 3, "word " * 100)    # the last one cut at 64 tokens
    with torch.no_grad():
        want = [type(reference)._get_qwen3_prompt_embeds(reference.text_encoder, reference.tokenizer, p,
                                                         max_sequence_length=TEXT).numpy() for p in prompts]
    config = conditioning_matches(demo, prompts, want, TEXT)
    assert (config["layers"], config["reads"]) == (28, [9, 18, 27])


def conditioning_matches(demo, prompts, want: list, text: int) -> dict:
    """The runtime's encode() of each prompt equals the reference's embeds <= 1e-4 on both bundles (text ids
    (0, 0, 0, i) over the text length); the bundle's text encoder config."""
    from precast.runtime.families.flux2 import Flux2Txt2Img
    for bundle, backend in ((demo["ort"], "onnxruntime"), (demo["bundle"], "openvino")):
        run = Flux2Txt2Img(bundle, backend, width=64, height=64, strict=True)
        for prompt, embeds in zip(prompts, want):
            ours = run.encode(prompt)
            assert rel_err(ours["encoder_hidden_states"], embeds) <= 1e-4, (backend, prompt[:10])
            assert ours["txt_ids"].tolist() == [[0, 0, 0, i] for i in range(text)]
    return json.loads((demo["bundle"] / "manifest.json").read_text())["components"]["text_encoder"]["config"]


def test_transformer_matches_diffusers(demo, reference, tmp_path):
    """The demo file's transformer (BFL names: fused qkv, linear1 = q | k | v | gate | up, (shift, scale) final
    modulation) exported and run on ONNX Runtime and OpenVINO against diffusers' on several image and text lengths
    with 4-D ids: <= 1e-4."""
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES)
    assert proc.returncode == 0, proc.stderr
    sess, rng = _session(tmp_path / "x" / "transformer"), np.random.default_rng(0)
    from precast.runtime.families.flux2 import latent_ids, text_ids
    for rows, cols, length in ((6, 8, 40), (4, 4, 7), (16, 16, 64)):
        x = rng.standard_normal((1, rows * cols, 128)).astype(np.float32)
        txt = rng.standard_normal((1, length, TINY_FLUX2.context)).astype(np.float32)
        feeds = {"hidden_states": x, "encoder_hidden_states": txt, "timestep": np.array([0.63], np.float32),
                 "img_ids": latent_ids(rows, cols), "txt_ids": text_ids(length)}
        with torch.no_grad():
            want = reference.transformer(**{k: torch.from_numpy(v) for k, v in feeds.items()},
                                         return_dict=False)[0].numpy()
        assert rel_err(sess.run(None, feeds)[0], want) <= 1e-4, (rows, cols, length)
        if length == 40:
            assert rel_err(_run_ov(tmp_path / "x" / "transformer", feeds)[0], want) <= 1e-4



@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_transformer_half_precision_stays_close(demo, reference, tmp_path, dtype):
    """fp16 (ONNX Runtime) and bf16 (OpenVINO, f32 compute on bf16 weights) against diffusers' fp32 run: no worse
    than twice the error of diffusers' own fp16 / bf16 run, floor 1e-2."""
    import copy
    from precast.runtime.families.flux2 import latent_ids, text_ids
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES,
                   "--dtype", dtype)
    assert proc.returncode == 0, proc.stderr
    rng = np.random.default_rng(6)
    feeds = {"hidden_states": rng.standard_normal((1, 48, 128)).astype(np.float32),
             "encoder_hidden_states": rng.standard_normal((1, 20, TINY_FLUX2.context)).astype(np.float32),
             "timestep": np.array([0.63], np.float32), "img_ids": latent_ids(6, 8), "txt_ids": text_ids(20)}

    @torch.no_grad()
    def run_reference(torch_dtype):
        m = copy.deepcopy(reference.transformer).to(torch_dtype)
        return m(**{k: torch.from_numpy(v).to(torch_dtype) if k in ("hidden_states", "encoder_hidden_states", "timestep")
                    else torch.from_numpy(v) for k, v in feeds.items()}, return_dict=False)[0].float().numpy()
    want = run_reference(torch.float32)
    theirs = rel_err(run_reference(torch.float16 if dtype == "fp16" else torch.bfloat16), want)
    run = run_half(tmp_path / "x" / "transformer", feeds, dtype)[0]
    ours = rel_err(run, want)
    print(f"flux.2 transformer {dtype}: ours {ours:.2e}, diffusers' own {theirs:.2e}")
    assert np.isfinite(run).all() and ours <= max(2 * theirs, 1e-2), (ours, theirs)
    assert ours <= 5e-2, ours          # diffusers' own bf16 run is ~0.4 off here (its timestep in bf16): our own bound


def test_lora_in_diffusers_names_matches_diffusers(demo, tmp_path):
    """A PEFT LoRA in diffusers' names (transformer_blocks.N.attn.to_q / add_k_proj: rows of the BFL file's fused
    qkv; a single block's fused to_qkv_mlp_proj (linear1) and to_out; the feed-forwards; the embedders) merged into
    the export of the BFL-named demo file at strength 0.7 computes what diffusers' own adapter does (<= 1e-4);
    ai-toolkit / ComfyUI's `diffusion_model.` spelling."""
    from safetensors.numpy import save_file as save_np
    from test_flux import _peft_lora, peft_tensors
    from precast.runtime.families.flux2 import latent_ids, text_ids
    model = _transformer({k: v.float() for k, v in load_file(demo["file"]).items()})
    rng = np.random.default_rng(11)
    mods = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v", "transformer_blocks.1.attn.add_k_proj",
            "transformer_blocks.0.attn.to_out.0", "transformer_blocks.1.ff.linear_in", "transformer_blocks.0.ff_context.linear_out",
            "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.1.attn.to_out", "x_embedder"]
    lora = _peft_lora(rng, model, mods, 4)
    save_np(peft_tensors(lora, "diffusion_model"), str(tmp_path / "lora.safetensors"))
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES,
                   "--lora", f"{tmp_path / 'lora.safetensors'}:0.7")
    assert proc.returncode == 0, proc.stderr
    feeds = {"hidden_states": rng.standard_normal((1, 24, 128)).astype(np.float32),
             "encoder_hidden_states": rng.standard_normal((1, 12, TINY_FLUX2.context)).astype(np.float32),
             "timestep": np.array([0.41], np.float32), "img_ids": latent_ids(4, 6), "txt_ids": text_ids(12)}

    def reference():
        with torch.no_grad():
            return model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, return_dict=False)[0].numpy()
    plain = reference()
    model.load_lora_adapter({k: torch.from_numpy(v) for k, v in peft_tensors(lora).items()}, prefix="transformer",
                            adapter_name="x")
    model.set_adapters(["x"], weights=[0.7])
    want = reference()
    got = _session(tmp_path / "x" / "transformer").run(None, feeds)[0]
    assert rel_err(want, plain) > 1e-2            # the LoRA changes the output
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)

def test_lora_in_bfl_and_kohya_names_merges_as_diffusers_names(demo, tmp_path):
    """The same LoRA in BFL's names -- kohya's `lora_unet_double_blocks_0_img_attn_qkv` (q | k | v as one module of
    rank 3r, up block-diagonal, alpha keeping alpha / rank = 1) and ComfyUI's PEFT spelling
    `diffusion_model.double_blocks.0.img_attn.qkv.lora_A` -- merges into the export as it does in diffusers' names,
    whose merge equals diffusers' own adapter: BFL's fused qkv lands in thirds on diffusers' separate to_q / to_k / to_v,
    txt_attn.qkv with only its v part, final_layer.adaLN_modulation.1's halves swapped into norm_out.linear."""
    from safetensors.numpy import save_file as save_np
    from test_flux import _peft_lora, peft_tensors
    from precast.runtime.families.flux2 import latent_ids, text_ids
    model = _transformer({k: v.float() for k, v in load_file(demo["file"]).items()})
    rng, rank = np.random.default_rng(13), 4
    qkv = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"]
    mods = qkv + ["transformer_blocks.1.attn.add_v_proj", "transformer_blocks.0.ff.linear_in",
                  "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.1.attn.to_out",
                  "x_embedder", "norm_out.linear"]
    lora = _peft_lora(rng, model, mods, rank)
    save_np(peft_tensors(lora), str(tmp_path / "diffusers.safetensors"))
    bfl = {"double_blocks.0.img_attn.qkv": None, "double_blocks.1.txt_attn.qkv": None,
           "double_blocks.0.img_mlp.0": lora[mods[4]], "single_blocks.0.linear1": lora[mods[5]],
           "single_blocks.1.linear2": lora[mods[6]], "img_in": lora[mods[7]]}
    up = np.zeros((sum(lora[m][1].shape[0] for m in qkv), 3 * rank), np.float32)
    for i, m in enumerate(qkv):
        h = lora[m][1].shape[0]
        up[i * h:(i + 1) * h, i * rank:(i + 1) * rank] = lora[m][1]
    bfl["double_blocks.0.img_attn.qkv"] = (np.concatenate([lora[m][0] for m in qkv]), up)
    down, b = lora[mods[3]]
    bfl["double_blocks.1.txt_attn.qkv"] = (down, np.concatenate([np.zeros((2 * len(b), rank), np.float32), b]))
    down, b = lora["norm_out.linear"]           # diffusers (scale, shift) rows -> BFL (shift, scale)
    bfl["final_layer.adaLN_modulation.1"] = (down, np.concatenate([b[len(b) // 2:], b[:len(b) // 2]]))
    kohya, comfy = {}, {}
    for module, (a, b) in bfl.items():
        flat = "lora_unet_" + module.replace(".", "_")
        kohya.update({f"{flat}.lora_down.weight": a, f"{flat}.lora_up.weight": b,
                      f"{flat}.alpha": np.array(float(a.shape[0]), np.float32)})
        comfy.update({f"diffusion_model.{module}.lora_A.weight": a, f"diffusion_model.{module}.lora_B.weight": b})
    save_np(kohya, str(tmp_path / "kohya.safetensors"))
    save_np(comfy, str(tmp_path / "comfy.safetensors"))
    feeds = {"hidden_states": rng.standard_normal((1, 24, 128)).astype(np.float32),
             "encoder_hidden_states": rng.standard_normal((1, 12, TINY_FLUX2.context)).astype(np.float32),
             "timestep": np.array([0.41], np.float32), "img_ids": latent_ids(4, 6), "txt_ids": text_ids(12)}
    outs = {}
    for name in ("diffusers", "kohya", "comfy"):
        proc = precast("export", demo["file"], "--out", tmp_path / name, "--component", "transformer", "--set", AXES,
                       "--lora", f"{tmp_path / name}.safetensors:0.7")
        assert proc.returncode == 0, proc.stderr
        outs[name] = _session(tmp_path / name / "transformer").run(None, feeds)[0]
    model.load_lora_adapter({k: torch.from_numpy(v) for k, v in peft_tensors(lora).items()}, prefix="transformer",
                            adapter_name="x")
    model.set_adapters(["x"], weights=[0.7])
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, return_dict=False)[0].numpy()
    assert rel_err(outs["diffusers"], want) <= 1e-4, rel_err(outs["diffusers"], want)
    for name in ("kohya", "comfy"):
        assert rel_err(outs[name], outs["diffusers"]) <= 1e-5, (name, rel_err(outs[name], outs["diffusers"]))
    bad = tmp_path / "bad.safetensors"       # a delta as tall as two thirds of the fused qkv: one error naming it
    save_np({k: v[:2 * len(v) // 3] if k.endswith("img_attn_qkv.lora_up.weight") else v for k, v in kohya.items()},
            str(bad))
    proc = precast("export", demo["file"], "--out", tmp_path / "bad", "--component", "transformer", "--set", AXES,
                   "--lora", bad)
    assert proc.returncode == 2 and "double_blocks_0_img_attn_qkv" in proc.stderr and "rows" in proc.stderr and \
        "Traceback" not in proc.stderr, proc.stderr
    a, b = lora["norm_out.linear"]           # the final modulation twice, in both names: one error naming both
    save_np({**kohya, "transformer.norm_out.linear.lora_A.weight": a, "transformer.norm_out.linear.lora_B.weight": b},
            str(bad))
    proc = precast("export", demo["file"], "--out", tmp_path / "bad", "--component", "transformer", "--set", AXES,
                   "--lora", bad)
    assert proc.returncode == 2 and "both name" in proc.stderr and "norm_out.linear" in proc.stderr, proc.stderr
    qkv_down = kohya["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"]       # DoRA over the split: refused once
    save_np({**kohya, "lora_unet_double_blocks_0_img_attn_qkv.dora_scale": np.ones((1, qkv_down.shape[1]), np.float32)},
            str(bad))
    proc = precast("export", demo["file"], "--out", tmp_path / "bad", "--component", "transformer", "--set", AXES,
                   "--lora", bad)
    assert proc.returncode == 2 and proc.stderr.count("DoRA on a module this model holds as separate weights") == 1, \
        proc.stderr


def test_vae_matches_diffusers(demo, reference, tmp_path):
    """BFL's flux2-vae layout (quant convs nested under encoder. / decoder.) given with --vae: decoder and encoder
    against AutoencoderKLFlux2 <= 1e-4 (ONNX Runtime; the decoder on OpenVINO too), and its batch-norm statistics
    in the manifest config as the pipeline computes them."""
    write_flux2_vae_file(tmp_path / "flux2-vae.safetensors", seed=4)
    proc = precast("export", demo["file"], "--vae", tmp_path / "flux2-vae.safetensors", "--out", tmp_path / "x",
                   "--component", "vae_decoder", "--component", "vae_encoder", "--json")
    assert proc.returncode == 0, proc.stderr
    vae = _vae(load_file(tmp_path / "flux2-vae.safetensors"))
    rng = np.random.default_rng(1)
    z = rng.standard_normal((1, 32, 12, 10)).astype(np.float32)
    image = rng.uniform(-1, 1, (1, 3, 24, 20)).astype(np.float32)
    with torch.no_grad():
        decoded = vae.decode(torch.from_numpy(z)).sample.numpy()
        params = vae.encode(torch.from_numpy(image)).latent_dist.parameters.numpy()
    assert rel_err(_session(tmp_path / "x" / "vae_decoder").run(None, {"latent_sample": z})[0], decoded) <= 1e-4
    assert rel_err(_run_ov(tmp_path / "x" / "vae_decoder", {"latent_sample": z})[0], decoded) <= 1e-4
    assert rel_err(_session(tmp_path / "x" / "vae_encoder").run(None, {"sample": image})[0], params) <= 1e-4
    config = next(c for c in json.loads(proc.stdout)["components"] if c["name"] == "vae_decoder")["config"]
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).numpy()
    assert np.allclose(config["latents_bn_std"], std, rtol=1e-6, atol=0)
    assert np.array_equal(np.float32(config["latents_bn_mean"]), vae.bn.running_mean.numpy())


# ---- the pipeline --------------------------------------------------------------------------------------------

def test_pipeline_matches_diffusers(demo, reference, tmp_path):
    """The distilled defaults (4 steps, no CFG) and a base model's CFG run (guidance 4 against the empty negative
    prompt) on ONNX Runtime and OpenVINO against Flux2KleinPipeline with the same starting latents: PSNR >= 40 dB;
    another prompt changes the image. The pipeline saved as a diffusers folder exports to the same transformer, and
    its model_index.json is_distilled false makes it the base variant (50 steps, CFG 4)."""
    from diffusers import Flux2KleinPipeline
    from precast.runtime.families.flux2 import Flux2Txt2Img
    noise = np.random.default_rng(3).standard_normal((1, 128, 16, 16)).astype(np.float32)
    ours_noise = Flux2KleinPipeline._unpatchify_latents(torch.from_numpy(noise)).numpy()   # [1, 32, 32, 32]
    prompt = "a photo of an astronaut riding a horse on the moon"
    base = Flux2KleinPipeline(**{k: getattr(reference, k) for k in
                                 ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}, is_distilled=False)
    with torch.no_grad():
        want = reference(prompt=prompt, height=64, width=64, num_inference_steps=4, latents=torch.from_numpy(noise),
                         output_type="np", max_sequence_length=TEXT).images[0]
        want_cfg = base(prompt=prompt, height=64, width=64, num_inference_steps=3, guidance_scale=4.0,
                        latents=torch.from_numpy(noise), output_type="np", max_sequence_length=TEXT).images[0]
    assert want.std() > 0.05 and psnr(want, want_cfg) < 40
    for bundle, backend in ((demo["ort"], "onnxruntime"), (demo["bundle"], "openvino")):
        run = Flux2Txt2Img(bundle, backend, width=64, height=64, strict=True)
        assert (run.defaults["steps"], run.defaults["guidance"], run.t5_tokens) == (4, 1.0, TEXT)
        ours = run(prompt, latents=ours_noise, progress=False)
        assert psnr(ours, want) >= 40.0, (backend, psnr(ours, want))
        ours_cfg = run(prompt, steps=3, guidance=4.0, latents=ours_noise, progress=False)
        assert psnr(ours_cfg, want_cfg) >= 40.0, (backend, psnr(ours_cfg, want_cfg))
    assert psnr(run("a lighthouse at dusk", latents=ours_noise, progress=False), want) < 40
    assert "reads the first 64;" in run.prompt_warnings("word " * 400)[0]
    base.save_pretrained(tmp_path / "folder")
    (tmp_path / "folder" / "transformer" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "folder" / "transformer" / "config.json").read_text()), "axes_dims_rope": DEMO_AXES}))
    proc = precast("export", tmp_path / "folder", "--out", tmp_path / "fx", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["family"], report["variant"], report["layout"], report["steps"], report["guidance"]) == \
        ("flux2", "klein-base", "diffusers", 50, 4.0)
    assert {c["name"] for c in report["components"]} == {"text_encoder", "transformer", "vae_decoder", "vae_encoder"}
    proc = precast("export", demo["file"], "--out", tmp_path / "sx", "--component", "transformer", "--set", AXES)
    assert proc.returncode == 0, proc.stderr
    from precast.runtime.families.flux2 import latent_ids, text_ids
    feeds = {"hidden_states": noise.reshape(1, 128, -1).transpose(0, 2, 1)[:, :16].copy(), "img_ids": latent_ids(4, 4),
             "encoder_hidden_states": np.random.default_rng(5).standard_normal((1, 32, 96)).astype(np.float32),
             "txt_ids": text_ids(32), "timestep": np.array([0.5], np.float32)}
    assert np.array_equal(_session(tmp_path / "fx" / "transformer").run(None, feeds)[0],
                          _session(tmp_path / "sx" / "transformer").run(None, feeds)[0])


def test_generate_on_each_cpu_backend(demo, tmp_path):
    for bundle, backend in ((demo["ort"], "onnxruntime"), (demo["bundle"], "openvino")):
        out = tmp_path / f"{backend}.png"
        proc = precast("generate", bundle, "--prompt", "a red fox in the snow", "--seed", "5", "--out", out, "--json",
                       "--backend", backend, "--preview", tmp_path / "preview.png")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["components"]["transformer"]["backend"] == backend
        assert out.stat().st_size > 1000
        # step previews by the latent -> RGB projection (ComfyUI's Flux2 factors over the unpacked latents)
        from precast.runtime.png import read_png
        preview = read_png(tmp_path / "preview.png")
        assert preview.shape == read_png(out).shape and len(np.unique(preview)) > 20


def test_demo_model_writes_the_file_and_its_recipe(tmp_path):
    proc = precast("demo-model", "--family", "flux2-klein", "--out", tmp_path / "k.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "axes_dims_rope: [4, 4, 4, 4]" in proc.stdout and "t5_tokens" in proc.stdout
    keys = load_file(tmp_path / "k.safetensors").keys()
    assert f"{DIT_PREFIX}single_blocks.0.linear1.weight" in keys and f"{LLM_PREFIX}layers.27.mlp.up_proj.weight" in keys
    assert "vae.bn.running_var" in keys



def test_scaled_fp8_split_files_export_their_dequantized_weights(tmp_path):
    """ComfyUI's scaled fp8 split files for FLUX.2 klein (the transformer in BFL names and the 28-layer Qwen3, each
    Linear weight fp8 with its float32 scale_weight): both export to the graphs and weight bytes of files holding the
    float32 values they dequantize to (weight x scale_weight), as Z-Image's and Flux's fp8 files do."""
    from test_zimage import fp8_exports_equal_their_twins
    fp8, te = tmp_path / "flux-2-klein-4b-fp8_scaled.safetensors", tmp_path / "qwen_3_4b_fp8_scaled.safetensors"
    write_components(fp8, flux2_components(layout="bare"), 3, "fp8_e4m3_scaled")
    write_qwen3_file(te, TINY_QWEN3_28, seed=4, dtype="fp8_e4m3_scaled")
    write_flux2_vae_file(tmp_path / "flux2-vae.safetensors")
    fp8_exports_equal_their_twins(fp8, te, tmp_path / "flux2-vae.safetensors", AXES, tmp_path)


# ---- refusals ------------------------------------------------------------------------------------------------

def test_damaged_or_incomplete_files_are_one_line(tmp_path):
    bare = tmp_path / "flux-2-klein-4b.safetensors"
    write_components(bare, flux2_components(layout="bare"), 0, "bf16")
    # the transformer alone: its text encoder is named, with the flag that adds it
    _one_line(precast("export", bare, "--out", tmp_path / "a", "--component", "text_encoder"), "--text-encoder")
    # the Qwen3 file beside it, but no tokenizer.json: where to put it
    qwen = tmp_path / "qwen_3_4b.safetensors"
    write_qwen3_file(qwen, TINY_QWEN3_28)
    _one_line(precast("export", bare, "--out", tmp_path / "b", "--text-encoder", qwen, "--set", AXES), "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    # FLUX.1's VAE (16 channels, no batch-norm statistics) is not the model's
    write_vae16_file(tmp_path / "ae.safetensors")
    _one_line(precast("export", bare, "--out", tmp_path / "c", "--text-encoder", qwen, "--vae",
                      tmp_path / "ae.safetensors", "--set", AXES), "bn.running_mean", "flux2-vae.safetensors")
    # a Qwen3 too shallow for the hidden states klein reads
    write_qwen3_file(tmp_path / "qwen_small.safetensors")
    _one_line(precast("export", bare, "--out", tmp_path / "d", "--text-encoder", tmp_path / "qwen_small.safetensors",
                      "--component", "text_encoder"), "[9, 18, 27]")
    # with the model's tokenizer beside it and BFL's VAE file, the split files export whole
    write_flux2_vae_file(tmp_path / "flux2-vae.safetensors")
    proc = precast("export", bare, "--out", tmp_path / "ok", "--text-encoder", qwen, "--vae",
                   tmp_path / "flux2-vae.safetensors", "--set", AXES, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["family"], report["variant"]) == ("flux2", "klein")
    assert {c["name"] for c in report["components"]} == {"text_encoder", "transformer", "vae_decoder", "vae_encoder"}
    # a damaged transformer: q | k | v rows that do not split in three; a tensor with no place in FLUX.2
    sd = load_file(bare)
    cut = dict(sd, **{"double_blocks.1.img_attn.qkv.weight": sd["double_blocks.1.img_attn.qkv.weight"][:-1]})
    save_file(cut, tmp_path / "cut.safetensors")
    _one_line(precast("export", tmp_path / "cut.safetensors", "--out", tmp_path / "e", "--set", AXES),
              "double_blocks.1.img_attn.qkv.weight")
    save_file(dict(sd, **{"double_blocks.0.img_mod.lin.weight": torch.zeros(8, 8)}), tmp_path / "odd.safetensors")
    _one_line(precast("export", tmp_path / "odd.safetensors", "--out", tmp_path / "f", "--set", AXES),
              "double_blocks.0.img_mod.lin.weight", "FLUX.2")
    # half a guidance embedder (FLUX.2 dev's): the missing half named
    save_file(dict(sd, **{"guidance_in.in_layer.weight": torch.zeros(64, 256)}), tmp_path / "dev.safetensors")
    _one_line(precast("export", tmp_path / "dev.safetensors", "--out", tmp_path / "g", "--set", AXES,
                      "--component", "transformer"), "guidance_embedder.linear_2")
    # heads that the RoPE split does not fit
    _one_line(precast("export", bare, "--out", tmp_path / "h", "--component", "transformer"), "axes_dims_rope")
