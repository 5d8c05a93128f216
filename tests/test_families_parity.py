"""SD 2.x, SDXL base and SDXL refiner: every exported component matches diffusers/transformers
built from the same single file (converted with diffusers' own LDM/OpenCLIP converters):
fp32 within 1e-4 of max|ref|, fp16 within 2e-2."""
import json

import numpy as np
import onnxruntime as ort
import pytest

from conftest import precast, rel_err
from precast.compiler.demo_model import TINY_REFINER, TINY_SD2, TINY_SDXL, random_tensor, sd1_layout, write_safetensors
import reference as ref

TOL = {"fp32": 1e-4, "fp16": 2e-2}
CONFIGS = {"sd2": TINY_SD2, "sdxl": TINY_SDXL, "sdxl-refiner": TINY_REFINER}


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    path = tmp / "model.safetensors"
    rng = np.random.default_rng(3)
    write_safetensors(str(path), sd1_layout(cfg), "fp32", lambda k, s: random_tensor(rng, k, s))
    outs = {}
    for dtype in ("fp32", "fp16"):
        proc = precast("export", path, "--out", tmp / dtype, "--dtype", dtype, "--vae-dtype", dtype, "--json",
                       check=True)
        outs[dtype] = (tmp / dtype, json.loads(proc.stdout))
    return cfg, ref.family_models(path, cfg), outs


def _run(out, comp, feeds):
    s = ort.InferenceSession(str(out / comp / "model.onnx"), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in s.get_inputs()}
    extra = next((i for i in s.get_inputs() if i.name == "token_embeddings_extra"), None)
    if extra is not None:  # no textual-inversion vectors: the one zero row
        feeds = {**feeds, extra.name: np.zeros((1, extra.shape[1]), np.float32)}
    feeds = {k: v.astype(np.float16) if types[k] == "tensor(float16)" else v for k, v in feeds.items()}
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def _ids(pad):
    ids = np.full((2, 77), pad, np.int32)
    ids[:, 0] = 49406
    ids[0, 1:5], ids[0, 5] = [320, 1125, 539, 2368], 49407
    ids[1, 1:9], ids[1, 9] = [1929, 267, 320, 1615, 539, 3306, 1002, 256], 49407
    return ids


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_text_encoders(family, dtype):
    cfg, models, outs = family
    out, _ = outs[dtype]
    ids = _ids(0)  # OpenCLIP pads with 0
    if cfg.family == "sd2":
        want, full = ref.run_hidden(models["text_encoder"], ids, 2, final_norm=True)
        got = _run(out, "text_encoder", {"input_ids": ids})
        assert rel_err(got["last_hidden_state"], want) <= TOL[dtype]
        return
    if cfg.family == "sdxl":
        want, full = ref.run_hidden(models["text_encoder"], _ids(49407), 2)
        got = _run(out, "text_encoder", {"input_ids": _ids(49407)})
        assert rel_err(got[f"hidden_states.{cfg.text_layers - 1}"], want) <= TOL[dtype]
        _all_hidden_states(got, full, cfg.text_layers, ["last_hidden_state", "pooler_output"], dtype)
    want, full = ref.run_hidden(models["text_encoder_2"], ids, 2)
    got = _run(out, "text_encoder_2", {"input_ids": ids})
    assert rel_err(got[f"hidden_states.{cfg.text2_layers - 1}"], want) <= TOL[dtype]
    assert rel_err(got["text_embeds"], full.text_embeds.numpy()) <= TOL[dtype]
    _all_hidden_states(got, full, cfg.text2_layers, ["text_embeds", "last_hidden_state"], dtype)


def _all_hidden_states(got: dict, full, layers: int, heads: list[str], dtype: str) -> None:
    """SDXL's encoders output what transformers returns with output_hidden_states=True, in optimum's ONNX
    order (the layout optimum's SDXL pipelines and OpenVINO GenAI index): `heads`, then hidden_states.0..N
    (the embeddings, then every layer; the last one before the final LayerNorm)."""
    assert list(got) == heads + [f"hidden_states.{i}" for i in range(layers + 1)]
    assert len(full.hidden_states) == layers + 1
    for i, state in enumerate(full.hidden_states):
        assert rel_err(got[f"hidden_states.{i}"], state.numpy()) <= TOL[dtype], i
    for name in heads:
        assert rel_err(got[name], getattr(full, name).numpy()) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_unet(family, dtype):
    cfg, models, outs = family
    out, _ = outs[dtype]
    rng = np.random.default_rng(4)
    sample = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)
    t = np.array([999.0, 10.0], np.float32)
    ctx = rng.standard_normal((2, 77, cfg.context_dim)).astype(np.float32)
    feeds = {"sample": sample, "timestep": t, "encoder_hidden_states": ctx}
    if cfg.adm_in_channels:
        n_ids = 6 if cfg.family == "sdxl" else 5
        pooled = rng.standard_normal((2, cfg.adm_in_channels - 256 * n_ids)).astype(np.float32)
        time_ids = np.array([[1024, 1024, 0, 0, 1024, 1024][:n_ids], [768, 512, 16, 32, 768, 512][:n_ids]],
                            np.float32)
        if n_ids == 5:
            time_ids[:, 4] = [6.0, 2.5]  # aesthetic score
        want = ref.run_unet_xl(models["unet"], sample, t, ctx, pooled, time_ids)
        feeds.update(text_embeds=pooled, time_ids=time_ids)
    else:
        want = ref.run_unet(models["unet"], sample, t, ctx)
    assert rel_err(_run(out, "unet", feeds)["out_sample"], want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_vae(family, dtype):
    cfg, models, outs = family
    out, _ = outs[dtype]
    rng = np.random.default_rng(5)
    z = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    assert rel_err(_run(out, "vae_decoder", {"latent_sample": z})["sample"], ref.run_vae_decoder(models["vae"], z)) \
        <= TOL[dtype]
    x = rng.uniform(-1, 1, (1, 3, 64, 64)).astype(np.float32)
    assert rel_err(_run(out, "vae_encoder", {"sample": x})["latent_parameters"],
                   ref.run_vae_encoder(models["vae"], x)) <= TOL[dtype]


def test_report(family):
    cfg, _, outs = family
    report = outs["fp32"][1]
    assert report["family"] == cfg.family
    assert report["latent_scale"] == (0.18215 if cfg.family == "sd2" else 0.13025)
    names = [c["name"] for c in report["components"]]
    assert names == {"sd2": ["text_encoder", "unet", "vae_encoder", "vae_decoder"],
                     "sdxl": ["text_encoder", "text_encoder_2", "unet", "vae_encoder", "vae_decoder"],
                     "sdxl-refiner": ["text_encoder_2", "unet", "vae_encoder", "vae_decoder"]}[cfg.family]
