"""Z-Image(-Turbo) end to end on tiny random-weight models in the real key layouts: the LLM text encoder graph
against transformers' Qwen3Model / Qwen2Model (the hidden states a family reads, masks, GQA, QK norms, biases),
the transformer against diffusers' ZImageTransformer2DModel (loaded through diffusers' own single-file converter
from the original names; diffusers' folder layout too), the Qwen2 byte-level BPE tokenizer against transformers'
on a generated corpus, the embedded tiny demo built, generated with on ONNX Runtime and OpenVINO and compared with
diffusers' ZImagePipeline (same weights, tokenizer, scheduler and starting latents), and the one-line refusals."""
import json
import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file

import reference_dit as ref
from conftest import precast, rel_err, run_half
from precast.compiler.demo_dit import TINY_VAE16, write_vae16_file
from precast.compiler.demo_zimage import (DEMO_AXES, DIT_PREFIX, LLM_PREFIX, TINY_QWEN3, TINY_ZIMAGE,
                                          tiny_tokenizer_json, write_demo_zimage, write_qwen3_file, zimage_components)
from precast.compiler.demo_weights import write_components
from precast.compiler.graphs.llm_encoder import build_llm_encoder, llm_config
from precast.compiler.graphs.onnx_graph import Graph
from precast.compiler.graphs.onnx_writer import save_model
from precast.compiler.sources.checkpoint import open_checkpoint
from precast.compiler.sources.tensor_refs import LLM

AXES = "transformer.axes_dims_rope=" + json.dumps(DEMO_AXES).replace(" ", "")
# Qwen3's chat template, its user-turn and generation-prompt branches (what ZImagePipeline renders)
QWEN3_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                  "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                  "{%- endif %}{%- endif %}")


def psnr(a, b):
    return 10 * np.log10(1.0 / float(np.mean((a.astype(np.float64) - b) ** 2)))


def _session(folder):
    return ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def _run_ov(folder, feeds):
    from precast.runtime.sessions import OpenVinoSession
    sess = OpenVinoSession(folder / "model.onnx", "CPU", {"INFERENCE_PRECISION_HINT": "f32"}, from_onnx=True)
    return list(sess.run(feeds).values())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The embedded demo's file, its tiny bundle (ONNX Runtime + OpenVINO) and one with ONNX Runtime only."""
    tmp = tmp_path_factory.mktemp("zimage")
    recipe = tmp / "tiny.yaml"
    recipe.write_text("model: {source: 'demo:tiny-z-image'}\ncomponents: [text_encoder, transformer, vae_decoder, "
                      "vae_encoder]\n"
                      "precision: fp32\nprofiles: {batch: 1, height: 64, width: 64,\n"
                      "           t5_tokens: {min: 32, opt: 64, max: 128}}\ntargets: [onnxruntime, {openvino: {device: CPU}}]\n")
    env = {"PRECAST_CACHE": str(tmp / "cache")}
    precast("build", recipe, "--out", tmp / "bundle", env=env, check=True)
    precast("build", recipe, "--out", tmp / "ort", *[a for c in ("text_encoder", "transformer", "vae_decoder", "vae_encoder")
                                                     for a in ("--only", f"{c}.onnxruntime")], env=env, check=True)
    write_demo_zimage(tmp / "demo.safetensors")           # the same seeded weights the demo source names
    return {"tmp": tmp, "file": tmp / "demo.safetensors", "bundle": tmp / "bundle", "ort": tmp / "ort"}


# ---- the LLM text encoder ------------------------------------------------------------------------

def _randomized(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.3) + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


@pytest.mark.parametrize("kind, reads", [("qwen3", (-2,)), ("qwen3", (-1, 1, 0)), ("qwen2.5", (-1,)),
                                         ("qwen2.5 --set head_dim", (-1,)), ("qwen2.5 --set num_heads", (-1,))])
def test_llm_encoder_matches_transformers(tmp_path, kind, reads):
    """Qwen3 (QK norms, GQA; ComfyUI's `model.*` names with an lm_head) and Qwen2.5 (q/k/v biases, no QK norm;
    the head width from config.json, or for a split file without one from `--set text_encoder.head_dim` /
    `num_heads`): the hidden states read, right-padded batches with their masks, fp32 on ONNX Runtime and
    OpenVINO <= 1e-4 of transformers'."""
    kind, _, given = kind.partition(" --set ")
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6 if kind == "qwen3" else 1e4)
    model = _randomized(Qwen3Model(Qwen3Config(head_dim=8, **common)) if kind == "qwen3" else
                        Qwen2Model(Qwen2Config(**common)))
    sd = {"model." + k: v.contiguous() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = torch.zeros(300, 48)
    save_file(sd, tmp_path / "te.safetensors")
    ckpt = open_checkpoint(tmp_path / "te.safetensors")
    assert f"{LLM}layers.0.mlp.gate_proj.weight" in ckpt.refs and not any("lm_head" in k for k in ckpt.refs)
    g = Graph("text_encoder", ckpt, LLM, "fp32")
    config_json = {} if kind == "qwen3" or given else {"num_attention_heads": 6}
    overrides = {"head_dim": 8, "theta": common["rope_theta"]} if given == "head_dim" else \
        {"num_heads": 6} if given else {}
    default_theta = 5e5 if given == "head_dim" else common["rope_theta"]      # --set theta must win over it
    cfg = llm_config(g, config_json, overrides, reads=reads, theta=default_theta)
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == \
        ((6, 2, 8, True, False) if kind == "qwen3" else (6, 2, 8, False, True))
    build_llm_encoder(g, cfg)
    g.check_coverage([LLM])
    save_model(g, str(tmp_path / "onnx"))
    ids = np.random.default_rng(1).integers(0, 300, (2, 21))
    mask = np.ones((2, 21), np.int64)
    mask[1, 13:] = 0
    with torch.no_grad():
        states = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                       output_hidden_states=True).hidden_states
    want = np.concatenate([states[r].numpy() for r in reads], axis=-1)
    feeds = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32)}
    ours = _session(tmp_path / "onnx").run(None, feeds)[0]
    assert ours.shape == want.shape and rel_err(ours, want) <= 1e-4, rel_err(ours, want)
    assert rel_err(_run_ov(tmp_path / "onnx", feeds)[0], want) <= 1e-4
    if reads == (-2,):       # the last layer and the final norm are not in the graph
        assert not any(w.key.startswith(f"{LLM}layers.3.") for w in g.weights.values())
        assert "norm.weight" not in g.weights



@pytest.mark.parametrize("kind", ["qwen3", "qwen2.5", "mistral"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_llm_encoder_half_precision_stays_close(tmp_path, kind, dtype):
    """The encoder exported in fp16 (ONNX Runtime) and bf16 (OpenVINO, f32 compute on the bf16 weights) against
    transformers' fp32 run, held to what transformers itself loses in that precision: no worse than twice the error of
    its own fp16 / bf16 run of the same weights, with a floor of 1e-2 (as the T5's test); padded rows included
    (FLUX.2 dev's Mistral: left-padded, heads wider than width / heads, theta 1e9)."""
    import copy
    from transformers import MistralConfig, MistralModel, Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model
    torch.manual_seed(1)
    theta = {"qwen3": 1e6, "qwen2.5": 1e4, "mistral": 1e9}[kind]
    common = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, rms_norm_eps=1e-5 if kind == "mistral" else 1e-6, rope_theta=theta)
    model = _randomized(Qwen3Model(Qwen3Config(head_dim=8, **common)) if kind == "qwen3" else
                        MistralModel(MistralConfig(head_dim=16, **common)) if kind == "mistral" else
                        Qwen2Model(Qwen2Config(**common)))
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "te.safetensors")
    g = Graph("text_encoder", open_checkpoint(tmp_path / "te.safetensors"), LLM, dtype)
    reads = {"qwen3": (-2,), "qwen2.5": (-1,), "mistral": (1, 2, 3)}[kind]
    config = {"qwen3": {}, "qwen2.5": {"num_attention_heads": 6},
              "mistral": {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}}[kind]
    build_llm_encoder(g, llm_config(g, config, {}, reads=reads, theta=theta, eps=common["rms_norm_eps"]))
    save_model(g, str(tmp_path / "onnx"))
    ids = np.random.default_rng(2).integers(0, 300, (2, 21))
    mask = np.ones((2, 21), np.int64)
    if kind == "mistral":
        mask[1, :8] = 0                     # Flux2Pipeline pads Mistral's prompt on the left
    else:
        mask[1, 13:] = 0

    @torch.no_grad()
    def reference(torch_dtype):
        states = copy.deepcopy(model).to(torch_dtype)(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                                       output_hidden_states=True).hidden_states
        return np.concatenate([states[r].float().numpy() for r in reads], axis=-1)
    want = reference(torch.float32)
    theirs = rel_err(reference(torch.float16 if dtype == "fp16" else torch.bfloat16), want)
    feeds = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32)}
    run = run_half(tmp_path / "onnx", feeds, dtype)[0]
    ours = rel_err(run, want)
    print(f"{kind} {dtype}: ours {ours:.2e}, transformers' own {theirs:.2e}")
    assert np.isfinite(run).all() and ours <= max(2 * theirs, 1e-2), (ours, theirs)

# ---- the transformer ---------------------------------------------------------------------------

def _diffusers_transformer(sd):
    """diffusers' model holding the file's transformer, renamed by diffusers' own single-file converter."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    c = TINY_ZIMAGE
    model = ZImageTransformer2DModel(in_channels=16, dim=c.dim, n_layers=c.layers, n_refiner_layers=c.refiner_layers,
                                     n_heads=c.heads, n_kv_heads=c.heads, cap_feat_dim=c.cap_dim, axes_dims=DEMO_AXES,
                                     axes_lens=[1024, 512, 512])
    converted = convert_z_image_transformer_checkpoint_to_diffusers(ref.component(sd, DIT_PREFIX))
    model.load_state_dict(converted, strict=True)
    return model.eval()


def test_transformer_matches_diffusers(demo, tmp_path):
    """The demo file's transformer (original names, fused qkv) exported and run on ONNX Runtime and OpenVINO against
    diffusers' on images whose patches do and do not fill multiples of 32 tokens, prompts of 1 to 40 real tokens
    padded or not past them: <= 1e-4."""
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES)
    assert proc.returncode == 0, proc.stderr
    model = _diffusers_transformer({k: v.float() for k, v in load_file(demo["file"]).items()})
    sess, rng = _session(tmp_path / "x" / "transformer"), np.random.default_rng(0)
    for h, w, real, length in ((8, 12, 13, 40), (16, 16, 32, 32), (8, 8, 40, 64), (4, 4, 1, 7)):
        lat = rng.standard_normal((1, 16, h, w)).astype(np.float32)
        cap = rng.standard_normal((1, length, TINY_ZIMAGE.cap_dim)).astype(np.float32)
        mask = (np.arange(length) < real)[None].astype(np.int32)
        t = np.array([0.37], np.float32)
        with torch.no_grad():
            want = -model([torch.from_numpy(lat[0])[:, None]], torch.from_numpy(t), [torch.from_numpy(cap[0, :real])],
                          return_dict=False)[0][0][:, 0].numpy()
        feeds = {"hidden_states": lat, "encoder_hidden_states": cap, "attention_mask": mask, "timestep": t}
        assert rel_err(sess.run(None, feeds)[0][0], want) <= 1e-4, (h, w, real, length)
        if h == 8 and w == 12:
            assert rel_err(_run_ov(tmp_path / "x" / "transformer", feeds)[0][0], want) <= 1e-4



def test_a_text_buffer_past_the_position_table_matches_diffusers(tmp_path):
    """A diffusers folder whose RoPE table has 64 text rows (axes_lens [64, 48, 48]) fed 13 real tokens in a
    40-token buffer: the buffer's masked rows, rounded up to 64, once indexed row 64 (an ONNX Runtime Gather
    error); diffusers positions only the real text. <= 1e-4 of diffusers', 30- and 40-token buffers."""
    from diffusers import ZImageTransformer2DModel
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(in_channels=16, dim=64, n_layers=1, n_refiner_layers=1, n_heads=4, n_kv_heads=4,
                                     cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[64, 48, 48]).eval()
    model.save_pretrained(tmp_path / "src" / "transformer")
    (tmp_path / "src" / "model_index.json").write_text(json.dumps(
        {"_class_name": "ZImagePipeline", "transformer": ["diffusers", "ZImageTransformer2DModel"]}))
    precast("export", tmp_path / "src", "--out", tmp_path / "x", "--component", "transformer", check=True)
    sess, rng = _session(tmp_path / "x" / "transformer"), np.random.default_rng(0)
    lat = rng.standard_normal((1, 16, 8, 12)).astype(np.float32)
    for length in (30, 40):
        cap = rng.standard_normal((1, length, 32)).astype(np.float32)
        mask = (np.arange(length) < 13)[None].astype(np.int32)
        t = np.array([0.37], np.float32)
        with torch.no_grad():
            want = -model([torch.from_numpy(lat[0])[:, None]], torch.from_numpy(t), [torch.from_numpy(cap[0, :13])],
                          return_dict=False)[0][0][:, 0].numpy()
        feeds = {"hidden_states": lat, "encoder_hidden_states": cap, "attention_mask": mask, "timestep": t}
        assert rel_err(sess.run(None, feeds)[0][0], want) <= 1e-4, length


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_transformer_half_precision_stays_close(demo, tmp_path, dtype):
    """The transformer exported in fp16 (ONNX Runtime) and bf16 (OpenVINO, f32 compute on bf16 weights) against
    diffusers' fp32 run: no worse than twice the error of diffusers' own fp16 / bf16 run, floor 1e-2."""
    import copy
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES,
                   "--dtype", dtype)
    assert proc.returncode == 0, proc.stderr
    model = _diffusers_transformer({k: v.float() for k, v in load_file(demo["file"]).items()})
    rng = np.random.default_rng(5)
    lat = rng.standard_normal((1, 16, 8, 12)).astype(np.float32)
    cap = rng.standard_normal((1, 40, TINY_ZIMAGE.cap_dim)).astype(np.float32)
    t = np.array([0.37], np.float32)

    @torch.no_grad()
    def reference(torch_dtype):
        m = copy.deepcopy(model).to(torch_dtype)
        out = m([torch.from_numpy(lat[0]).to(torch_dtype)[:, None]], torch.from_numpy(t).to(torch_dtype),
                [torch.from_numpy(cap[0, :13]).to(torch_dtype)], return_dict=False)[0][0]
        return -out[:, 0].float().numpy()
    want = reference(torch.float32)
    theirs = rel_err(reference(torch.float16 if dtype == "fp16" else torch.bfloat16), want)
    feeds = {"hidden_states": lat, "encoder_hidden_states": cap, "attention_mask": (np.arange(40) < 13)[None].astype(np.int32),
             "timestep": t}
    run = run_half(tmp_path / "x" / "transformer", feeds, dtype)[0][0]
    ours = rel_err(run, want)
    print(f"z-image transformer {dtype}: ours {ours:.2e}, diffusers' own {theirs:.2e}")
    assert np.isfinite(run).all() and ours <= max(2 * theirs, 1e-2), (ours, theirs)

def test_lora_in_diffusers_names_matches_diffusers(demo, tmp_path):
    """A LoRA in diffusers' names (diffusion_model.layers.N.attention.to_q ...: rows of the original file's fused
    qkv; to_out.0, the feed-forward, the refiners) merged into the export of the original-named demo file at strength
    0.8 computes what diffusers' own adapter does; ComfyUI / ai-toolkit's `diffusion_model.` spelling."""
    from safetensors.numpy import save_file as save_np
    model = _diffusers_transformer({k: v.float() for k, v in load_file(demo["file"]).items()})
    from test_flux import _peft_lora, peft_tensors
    rng, rank = np.random.default_rng(9), 4
    mods = ["layers.0.attention.to_q", "layers.0.attention.to_v", "layers.1.attention.to_out.0",
            "layers.1.feed_forward.w1", "noise_refiner.0.attention.to_k", "context_refiner.0.feed_forward.w2"]
    lora = _peft_lora(rng, model, mods, rank)
    save_np(peft_tensors(lora, "diffusion_model"), str(tmp_path / "lora.safetensors"))
    proc = precast("export", demo["file"], "--out", tmp_path / "x", "--component", "transformer", "--set", AXES,
                   "--lora", f"{tmp_path / 'lora.safetensors'}:0.8")
    assert proc.returncode == 0, proc.stderr
    lat = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    cap = rng.standard_normal((1, 16, TINY_ZIMAGE.cap_dim)).astype(np.float32)
    t = np.array([0.6], np.float32)

    def reference():
        with torch.no_grad():
            return -model([torch.from_numpy(lat[0])[:, None]], torch.from_numpy(t), [torch.from_numpy(cap[0])],
                          return_dict=False)[0][0][:, 0].numpy()
    plain = reference()
    model.load_lora_adapter({k: torch.from_numpy(v) for k, v in peft_tensors(lora).items()}, prefix="transformer",
                            adapter_name="x")
    model.set_adapters(["x"], weights=[0.8])
    want = reference()
    feeds = {"hidden_states": lat, "encoder_hidden_states": cap, "attention_mask": np.ones((1, 16), np.int32),
             "timestep": t}
    got = _session(tmp_path / "x" / "transformer").run(None, feeds)[0][0]
    assert rel_err(want, plain) > 1e-2            # the LoRA changes the output
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)


# ---- the tokenizer ----------------------------------------------------------------------------

def _corpus(n: int = 300) -> list[str]:
    """Prompts mixing scripts, emojis (ZWJ sequences, skin tones, flags), combining marks (NFC), whitespace runs,
    contractions, digits, the model's special tokens and chat markup, and long ones past 512 tokens."""
    rng = random.Random(7)
    pieces = ["a", "cat", "Photo", "of", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ", "it's", "WE'LL", "I'm", "'d",
              "12345", "3.14", "1024x1024", "一只猫", "红色的沙发", "東京", "こんにちは", "한국어", "Ünïcödé", "e\u0301",
              "A\u030a", "ﬁ", "مرحبا", "Привет", "😀", "👩🏽‍🚀", "🏳️‍🌈", "🇯🇵", "❤️", "(", ")", "--", "...", "!?", "#", "@",
              "<|im_end|>", "<|endoftext|>", "<think>", "{prompt}", "\\n", "\u00a0", "\u200b", "\u3000", "\x00"]
    out = ["", " ", "a photo of a cat", "一幅为名为“造相「Z-IMAGE-TURBO」”的项目设计的创意海报。"]
    for i in range(n):
        size = rng.randint(1, 40) if i % 10 else rng.randint(400, 900)
        out.append("".join(rng.choice(pieces) + (" " if rng.random() < 0.4 else "") for _ in range(size)))
    return out


def test_tokenizer_matches_transformers(demo, tmp_path):
    """The runtime's ids of the chat-templated prompt (runtime/llm_tokenizer.py on the bundle's tokenizer.json) are
    transformers' -- ZImagePipeline's apply_chat_template + tokenizer(max_length=512, truncation) -- on the same file
    and on a Qwen2Tokenizer transformers builds from its vocab and merges with its own Qwen2 pre-tokenizer."""
    from transformers import AutoTokenizer, Qwen2Tokenizer
    from precast.runtime.families.zimage import CHAT, MAX_TOKENS
    from precast.runtime.llm_tokenizer import LLMTokenizer
    folder = demo["bundle"] / "tokenizer"
    ours = LLMTokenizer.from_folder(folder)
    theirs_dir = tmp_path / "tok"
    theirs_dir.mkdir()
    (theirs_dir / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = {**json.loads((folder / "tokenizer_config.json").read_text()), "chat_template": QWEN3_TEMPLATE}
    (theirs_dir / "tokenizer_config.json").write_text(json.dumps(config))
    from_file = AutoTokenizer.from_pretrained(theirs_dir)
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    rebuilt = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                                           for m in model["merges"]])
    rebuilt.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    rebuilt.chat_template = QWEN3_TEMPLATE
    assert ours.pad_id == from_file.pad_token_id
    mismatched, long = [], 0
    for prompt in _corpus():
        mine = ours.chat(prompt, CHAT, MAX_TOKENS)
        long += len(ours.chat(prompt, CHAT, 1 << 20)) > MAX_TOKENS
        for hf in (from_file, rebuilt):
            text = hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=True)
            want = hf(text, max_length=MAX_TOKENS, truncation=True)["input_ids"]
            if mine != want:
                mismatched.append((prompt[:40], type(hf).__name__))
    assert not mismatched, mismatched[:5]
    assert long >= 10       # the long prompts were cut where transformers cuts them


# ---- the pipeline ------------------------------------------------------------------------------

def _zimage_pipeline(demo, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model
    sd = {k: v.float() for k, v in load_file(demo["file"]).items()}
    q = TINY_QWEN3
    te = Qwen3Model(Qwen3Config(vocab_size=q.vocab, hidden_size=q.hidden, intermediate_size=q.intermediate,
                                num_hidden_layers=q.layers, num_attention_heads=q.heads, num_key_value_heads=q.kv_heads,
                                head_dim=q.head_dim, rope_theta=1e6, rms_norm_eps=1e-6))
    te.load_state_dict(ref.component(sd, LLM_PREFIX), strict=True)
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((demo["bundle"] / "tokenizer" / "tokenizer.json").read_bytes())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}))
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
                          vae=ref.vae16_reference(sd, TINY_VAE16), text_encoder=te.eval(),
                          tokenizer=AutoTokenizer.from_pretrained(tok_dir), transformer=_diffusers_transformer(sd))


def test_pipeline_matches_diffusers(demo, tmp_path):
    """Turbo's defaults (8 steps, no CFG) and a CFG run with a negative prompt (precast's guidance g is diffusers'
    g - 1) on ONNX Runtime and OpenVINO against ZImagePipeline: PSNR >= 40 dB; another prompt changes the image.
    The pipeline saved as a diffusers folder exports to the same transformer."""
    from precast.runtime.families.zimage import ZImageTxt2Img
    pipe = _zimage_pipeline(demo, tmp_path)
    noise = np.random.default_rng(3).standard_normal((1, 16, 32, 32)).astype(np.float32)
    prompt, negative = "a photo of an astronaut riding a horse on the moon", "blurry, low quality"
    with torch.no_grad():
        want = pipe(prompt, height=64, width=64, num_inference_steps=8, guidance_scale=0.0,
                    latents=torch.from_numpy(noise), output_type="np").images[0]
        want_cfg = pipe(prompt, negative_prompt=negative, height=64, width=64, num_inference_steps=5, guidance_scale=2.0,
                        latents=torch.from_numpy(noise), output_type="np").images[0]
    assert want.std() > 0.05 and psnr(want, want_cfg) < 40
    for bundle, backend in ((demo["ort"], "onnxruntime"), (demo["bundle"], "openvino")):
        run = ZImageTxt2Img(bundle, backend, width=64, height=64, strict=True)
        assert (run.defaults["steps"], run.defaults["guidance"]) == (8, 1.0)
        ours = run(prompt, latents=noise, progress=False)
        assert psnr(ours, want) >= 40.0, (backend, psnr(ours, want))
        ours_cfg = run(prompt, negative, steps=5, guidance=3.0, latents=noise, progress=False)
        assert psnr(ours_cfg, want_cfg) >= 40.0, (backend, psnr(ours_cfg, want_cfg))
    assert psnr(run("a lighthouse at dusk", latents=noise, progress=False), want) < 40
    assert "reads the first 128;" in run.prompt_warnings("word " * 400)[0]      # the engines' longest text
    pipe.save_pretrained(tmp_path / "folder")
    (tmp_path / "folder" / "transformer" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "folder" / "transformer" / "config.json").read_text()), "axes_dims": DEMO_AXES}))
    proc = precast("export", tmp_path / "folder", "--out", tmp_path / "fx", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["family"], report["layout"]) == ("zimage", "diffusers")
    assert {c["name"] for c in report["components"]} == {"text_encoder", "transformer", "vae_decoder", "vae_encoder"}
    lat = noise[:, :, :8, :8]
    cap = np.random.default_rng(5).standard_normal((1, 32, TINY_ZIMAGE.cap_dim)).astype(np.float32)
    feeds = {"hidden_states": lat, "encoder_hidden_states": cap, "attention_mask": np.ones((1, 32), np.int32),
             "timestep": np.array([0.5], np.float32)}
    a = _session(tmp_path / "fx" / "transformer").run(None, feeds)[0]
    proc = precast("export", demo["file"], "--out", tmp_path / "sx", "--component", "transformer", "--set", AXES)
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(a, _session(tmp_path / "sx" / "transformer").run(None, feeds)[0])


def test_img2img_matches_diffusers(demo, tmp_path, monkeypatch):
    """img2img (strength 0.6, the default, and 0.75 with CFG) on ONNX Runtime against ZImageImg2ImgPipeline with the
    same noise and the VAE's mean (diffusers samples the encoder's distribution; precast takes its mode): PSNR >= 40
    dB; another init image gives another image; `precast generate --init-image` runs it, and --mask is refused."""
    from PIL import Image
    from diffusers import ZImageImg2ImgPipeline
    from diffusers.pipelines.z_image import pipeline_z_image_img2img as m
    from test_img2img import picture, same_start
    from precast.runtime.families.zimage import ZImageTxt2Img
    noise = np.random.default_rng(4).standard_normal((1, 16, 32, 32)).astype(np.float32)
    same_start(monkeypatch, m, noise)
    pipe = ZImageImg2ImgPipeline(**_zimage_pipeline(demo, tmp_path).components)
    init, prompt = picture(64, 64), "a photo of an astronaut riding a horse on the moon"
    run = ZImageTxt2Img(demo["ort"], "onnxruntime", width=64, height=64, strict=True, image_input=True)
    for strength, guidance, negative in ((None, 1.0, ""), (0.75, 3.0, "blurry")):
        with torch.no_grad():
            want = pipe(prompt, image=Image.fromarray(init), strength=strength or 0.6, negative_prompt=negative or None,
                        height=64, width=64, num_inference_steps=8, guidance_scale=guidance - 1,
                        output_type="np").images[0]
        ours = run(prompt, negative, steps=8, guidance=guidance, latents=noise, progress=False, init_image=init,
                   strength=strength)
        assert want.std() > 0.05 and psnr(ours, want) >= 40.0, (strength, psnr(ours, want))
        print(f"img2img strength {strength or 0.6}, guidance {guidance}: PSNR vs ZImageImg2ImgPipeline {psnr(ours, want):.1f} dB")
    a, b = (run(prompt, steps=8, latents=noise, progress=False, init_image=x, strength=0.3) for x in (init, 255 - init))
    assert psnr(a, b) < 30, psnr(a, b)
    Image.fromarray(init).save(tmp_path / "init.png")
    proc = precast("generate", demo["ort"], "--prompt", "a red fox", "--init-image", tmp_path / "init.png",
                   "--strength", "0.5", "--out", tmp_path / "i2i.png", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["mode"] == "img2img" and report["strength"] == 0.5, report
    assert report["components"]["vae_encoder"]["backend"] == "onnxruntime"
    proc = precast("generate", demo["ort"], "--prompt", "a red fox", "--init-image", tmp_path / "init.png",
                   "--mask", tmp_path / "init.png", "--out", tmp_path / "m.png")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --mask: inpainting is for SD 1.x/2.x/XL bundles "
                                                           "now; this one is zimage"), proc.stderr


def test_generate_on_each_cpu_backend(demo, tmp_path):
    for bundle, backend in ((demo["ort"], "onnxruntime"), (demo["bundle"], "openvino")):
        out = tmp_path / f"{backend}.png"
        proc = precast("generate", bundle, "--prompt", "a red fox in the snow", "--seed", "5", "--out", out, "--json",
                       "--backend", backend)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["components"]["transformer"]["backend"] == backend
        assert out.stat().st_size > 1000


def test_the_runtime_stays_thin(demo):
    """Generating loads the `tokenizers` package (the LLM's tokenizer) and none of the compiler, onnx, torch,
    transformers or huggingface_hub."""
    import subprocess
    import sys
    code = ("import sys\nfrom precast.runtime.families.zimage import ZImageTxt2Img\n"
            f"ZImageTxt2Img({str(demo['bundle'])!r}, width=64, height=64)('a cat', steps=1, progress=False)\n"
            "print(sorted(m for m in ('precast.compiler', 'onnx', 'ml_dtypes', 'torch', 'transformers', 'tokenizers',"
            " 'safetensors', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['tokenizers']", out.stdout


def test_demo_model_writes_the_file_and_its_recipe(tmp_path):
    proc = precast("demo-model", "--family", "z-image", "--out", tmp_path / "z.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "axes_dims_rope" in proc.stdout and "t5_tokens" in proc.stdout
    keys = load_file(tmp_path / "z.safetensors").keys()
    assert f"{DIT_PREFIX}layers.0.attention.qkv.weight" in keys and f"{LLM_PREFIX}embed_tokens.weight" in keys


def test_scaled_fp8_split_files_export_their_dequantized_weights(tmp_path):
    """ComfyUI's scaled fp8 split files (z_image_turbo_fp8_scaled and an fp8-scaled Qwen3 beside it): the
    transformer and the text encoder export to the same graphs and weight bytes as files of the float32 values
    they dequantize to (weight x scale_weight), as Flux's fp8 files do."""
    fp8, te = tmp_path / "z_image_turbo_fp8_scaled.safetensors", tmp_path / "qwen_3_4b_fp8_scaled.safetensors"
    write_components(fp8, zimage_components(layout="bare"), 3, "fp8_e4m3_scaled")
    write_qwen3_file(te, seed=4, dtype="fp8_e4m3_scaled")
    write_vae16_file(tmp_path / "ae.safetensors")
    fp8_exports_equal_their_twins(fp8, te, tmp_path / "ae.safetensors", AXES, tmp_path)


def fp8_exports_equal_their_twins(fp8, te, vae, axes: str, tmp_path) -> None:
    """Scaled fp8 split files (transformer `fp8`, text encoder `te`: fp8 weights with float32 scales) export, with
    `vae` and a tokenizer.json beside them, to the graphs and weight bytes of twins holding their float32
    dequantization (weight x scale_weight)."""
    from safetensors.numpy import save_file as save_np
    for src in (fp8, te):                   # fp8 weights, each with its float32 scale
        sd = load_file(src)
        assert sum(k.endswith(".scale_weight") for k in sd) >= 10 and torch.float8_e4m3fn in {v.dtype for v in sd.values()}
        save_np({k: v.numpy() for k, v in ref.dequantize(ref.load_tensors(src)).items()},
                str(tmp_path / ("twin_" + src.name)))
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    outs = []
    for name, (a, b) in {"fp8": (fp8, te), "twin": (tmp_path / ("twin_" + fp8.name), tmp_path / ("twin_" + te.name))}.items():
        proc = precast("export", a, "--out", tmp_path / name, "--text-encoder", b, "--vae", vae,
                       "--set", axes, "--component", "transformer", "--component", "text_encoder")
        assert proc.returncode == 0, proc.stderr
        outs.append(tmp_path / name)
    for comp in ("transformer", "text_encoder"):
        ga, gb = (onnx.load(str(x / comp / "model.onnx"), load_external_data=False).graph for x in outs)
        assert ga == gb, comp
        assert (outs[0] / comp / "model.onnx_data").read_bytes() == (outs[1] / comp / "model.onnx_data").read_bytes()


# ---- refusals ----------------------------------------------------------------------------------

def _one_line(proc, *words):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_damaged_or_incomplete_files_are_one_line(tmp_path):
    bare = tmp_path / "z_image_turbo_bf16.safetensors"
    write_components(bare, zimage_components(layout="bare"), 0, "bf16")
    # the transformer alone: its text encoder is named, with the flag that adds it
    _one_line(precast("export", bare, "--out", tmp_path / "a", "--component", "text_encoder"), "--text-encoder")
    # the Qwen3 file beside it, but no tokenizer.json: where to put it
    write_qwen3_file(tmp_path / "qwen_3_4b.safetensors")
    _one_line(precast("export", bare, "--out", tmp_path / "b", "--text-encoder", tmp_path / "qwen_3_4b.safetensors",
                      "--set", AXES), "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    _one_line(precast("export", bare, "--out", tmp_path / "c", "--text-encoder", tmp_path / "qwen_3_4b.safetensors",
                      "--set", AXES), "tokenizer.json", "not a readable tokenizer")
    # with the model's tokenizer beside it and the FLUX.1 VAE, ComfyUI's split files export whole
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    write_vae16_file(tmp_path / "ae.safetensors")
    proc = precast("export", bare, "--out", tmp_path / "ok", "--text-encoder", tmp_path / "qwen_3_4b.safetensors",
                   "--vae", tmp_path / "ae.safetensors", "--set", AXES, "--json")
    assert proc.returncode == 0, proc.stderr
    assert {c["name"] for c in json.loads(proc.stdout)["components"]} == {"text_encoder", "transformer", "vae_decoder",
                                                                           "vae_encoder"}
    assert (tmp_path / "ok" / "tokenizer" / "tokenizer.json").read_text() == tiny_tokenizer_json()
    # a damaged transformer: q | k | v rows that do not split in three
    sd = load_file(bare)
    sd["layers.1.attention.qkv.weight"] = sd["layers.1.attention.qkv.weight"][:-1]
    save_file(sd, tmp_path / "cut.safetensors")
    _one_line(precast("export", tmp_path / "cut.safetensors", "--out", tmp_path / "d", "--set", AXES),
              "layers.1.attention.qkv.weight")
    # heads that the RoPE split does not fit
    _one_line(precast("export", bare, "--out", tmp_path / "e", "--component", "transformer"), "axes_dims")
    # no QK norms (qk_norm=False): said as that, not as an unsupported patching
    save_file({k: v for k, v in load_file(bare).items() if not any(n in k for n in ("norm_q", "norm_k", "q_norm", "k_norm"))},
              tmp_path / "noqk.safetensors")
    _one_line(precast("export", tmp_path / "noqk.safetensors", "--out", tmp_path / "f", "--set", AXES),
              "without QK norms")


@pytest.mark.parametrize("theta", [1e4, 1e6, 1e9, 5e5])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_llm_rope_frequencies_are_correctly_rounded(theta, head_dim):
    """The LLM encoders' RoPE frequencies are baked into the export as constants: theta ** (2i / d) is the
    correctly rounded float32 of the exact power (checked in 50-digit decimal arithmetic), so an export's bytes
    do not depend on the CPU (numpy's float32 power gave other last bits on AVX-512 than on AVX2, and the
    recorded digests of FLUX.2 dev's and Qwen-Image's text encoders failed on the other machine)."""
    from decimal import Decimal, getcontext
    from precast.compiler.graphs.llm_encoder import inverse_frequencies
    getcontext().prec = 50
    got = inverse_frequencies(theta, head_dim)
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    for i, e in enumerate(exponent):
        exact = (Decimal(theta).ln() * Decimal(float(e))).exp()
        nearest = np.float32(float(exact))
        for other in (np.nextafter(nearest, np.float32(np.inf)), np.nextafter(nearest, np.float32(0))):
            assert abs(Decimal(float(nearest)) - exact) <= abs(Decimal(float(other)) - exact), (i, e)
        assert got[i] == np.float32(1.0) / nearest, (i, got[i])
