"""Exported components, run in ONNX Runtime, match diffusers / transformers with the same weights.

Three sources: the embedded demo checkpoint (single file, fp16 storage), a second tiny config
as a single file (other channels, depth, heads; attention only on the deeper level), and a
diffusers folder written by save_pretrained. fp32 within 1e-4 of max|ref|; fp16 within 2e-2.
"""
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import precast, rel_err
from precast.compiler.demo_model import SD1Config, TINY, random_tensor, write_safetensors, sd1_layout
import reference as ref

CONFIG_B = SD1Config(model_channels=64, channel_mult=(1, 2), num_res_blocks=1, attention_levels=(1,),
                     transformer_depth=2, context_dim=32, vae_ch=32, vae_mult=(1, 2), vae_res_blocks=2,
                     text_layers=3, text_intermediate=37)
TOL = {"fp32": 1e-4, "fp16": 2e-2}


def _single_file_case(tmp, cfg, dtype, heads_unet, heads_text, seed):
    path = tmp / "model.safetensors"
    rng = np.random.default_rng(seed)
    write_safetensors(str(path), sd1_layout(cfg), dtype, lambda k, s: random_tensor(rng, k, s))
    unet, vae, te = ref.models_from_single_file(path, cfg, heads_unet, heads_text)
    sets = []
    if heads_unet != 8:
        sets += ["--set", f"unet.num_heads={heads_unet}"]
    if heads_text:
        sets += ["--set", f"text_encoder.num_heads={heads_text}"]
    return path, (unet, vae, te), sets, cfg.vocab, cfg.context_dim


def _folder_case(tmp):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(0)
    unet = ref.randomize(UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32), 1)
    vae = ref.randomize(AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=32), 2)
    te = ref.randomize(CLIPTextModel(CLIPTextConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", eos_token_id=2)), 3)
    folder = tmp / "pipe"
    unet.save_pretrained(folder / "unet", safe_serialization=True)
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    te.save_pretrained(folder / "text_encoder", safe_serialization=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    return folder, (unet, vae, te), [], 1000, 32


CASES = {
    "demo-single-file": lambda tmp: _single_file_case(tmp, TINY, "fp16", 8, None, 0),
    "config-b-single-file": lambda tmp: _single_file_case(tmp, CONFIG_B, "fp32", 4, 4, 1),
    "diffusers-folder": _folder_case,
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    source, models, sets, vocab, ctx = CASES[request.param](tmp)
    return dict(name=request.param, tmp=tmp, source=source, models=models, sets=sets, vocab=vocab, ctx=ctx)


@pytest.fixture(scope="module")
def exported(case):
    outs = {}
    for dtype in ("fp32", "fp16"):
        out = case["tmp"] / f"onnx-{dtype}"
        proc = precast("export", case["source"], "--out", out, "--dtype", dtype, *case["sets"], "--json", check=True)
        outs[dtype] = (out, json.loads(proc.stdout))
    return outs


def _session(out, component):
    return ort.InferenceSession(str(out / component / "model.onnx"), providers=["CPUExecutionProvider"])


def _feed(sess, **arrays):
    """Cast each input to the dtype the graph declares (fp16 graphs take fp16 tensors)."""
    types = {i.name: i.type for i in [*sess.get_inputs(), *sess.get_overridable_initializers()]}  # + inputs with defaults
    return {k: v.astype(np.float16) if types[k] == "tensor(float16)" else v for k, v in arrays.items()}


def _ids(vocab, batch=2, seq=77, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.full((batch, seq), vocab - 1, np.int32)
    for b in range(batch):
        n = 5 + 7 * b
        ids[b, 0] = min(49406, vocab - 2)
        ids[b, 1:n] = rng.integers(1, vocab - 2, n - 1)
    return ids


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_text_encoder(case, exported, dtype):
    out, _ = exported[dtype]
    ids = _ids(case["vocab"])
    want_h, want_p = ref.run_text_encoder(case["models"][2], ids)
    sess = _session(out, "text_encoder")
    extra = np.zeros((1, case["ctx"]), np.float32)  # no textual-inversion vectors: the one zero row
    got_h, got_p = sess.run(None, {"input_ids": ids, **_feed(sess, token_embeddings_extra=extra)})
    assert rel_err(got_h, want_h) <= TOL[dtype]
    assert rel_err(got_p, want_p) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_unet(case, exported, dtype):
    out, _ = exported[dtype]
    sess = _session(out, "unet")
    rng = np.random.default_rng(1)
    for batch, h, w in ((2, 16, 16), (1, 8, 24), (1, 9, 13)):  # dynamic batch, height, width; odd sizes
        sample = rng.standard_normal((batch, 4, h, w)).astype(np.float32)
        t = np.array([999.0, 1.5][:batch], np.float32)
        ctx = rng.standard_normal((batch, 77, case["ctx"])).astype(np.float32)
        want = ref.run_unet(case["models"][0], sample, t, ctx)
        (got,) = sess.run(None, {**_feed(sess, sample=sample, encoder_hidden_states=ctx), "timestep": t})
        assert rel_err(got, want) <= TOL[dtype], (batch, h, w)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_vae(case, exported, dtype):
    out, _ = exported[dtype]
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (1, 3, 32, 48)).astype(np.float32)
    enc = _session(out, "vae_encoder")
    (got,) = enc.run(None, _feed(enc, sample=x))
    assert rel_err(got, ref.run_vae_encoder(case["models"][1], x)) <= TOL[dtype]
    factor = 2 ** (len([k for k in case["models"][1].config.block_out_channels]) - 1)
    z = rng.standard_normal((2, 4, 32 // factor, 48 // factor)).astype(np.float32)
    dec = _session(out, "vae_decoder")
    (got,) = dec.run(None, _feed(dec, latent_sample=z))
    assert rel_err(got, ref.run_vae_decoder(case["models"][1], z)) <= TOL[dtype]


def test_report_names_optimum_io(case, exported):
    _, report = exported["fp32"]
    io = {c["name"]: ([i["name"] for i in c["inputs"]], [o["name"] for o in c["outputs"]])
          for c in report["components"]}
    assert io == {"text_encoder": (["input_ids", "token_embeddings_extra"], ["last_hidden_state", "pooler_output"]),
                  "unet": (["sample", "timestep", "encoder_hidden_states"], ["out_sample"]),
                  "vae_encoder": (["sample"], ["latent_parameters"]),
                  "vae_decoder": (["latent_sample"], ["sample"])}
    unet = next(c for c in report["components"] if c["name"] == "unet")
    assert unet["inputs"][0]["shape"] == ["batch", 4, "height", "width"]
