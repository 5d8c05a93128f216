"""The Flux / Chroma / T5 / CLIP-L / 16-channel VAE fixtures (compiler/demo_dit.py) and their reference
models (tests/reference_dit.py): the BFL -> diffusers mapping equals diffusers' own converters at full
width, tiny files load strictly and run, and the writers are deterministic and store every dtype as
real files do (ComfyUI scaled fp8 included)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel
from diffusers.loaders import single_file_utils as sfu
from safetensors import safe_open
from transformers import T5EncoderModel

from precast.compiler.demo_dit import (CHROMA, CLIP_L, CLIP_L_PREFIX, FLUX_DEV, FLUX_PREFIX, FLUX_SCHNELL, FLUX_VAE,
                                       T5_PREFIX, T5_XXL, TINY_CHROMA, TINY_CLIP_L, TINY_FLUX_DEV, TINY_FLUX_SCHNELL,
                                       TINY_T5, TINY_VAE16, VAE_PREFIX, RandomWeights, clip_l_layout, flux_layout,
                                       parameter_count, t5_layout, vae16_layout, write_clip_l_file,
                                       write_flux_checkpoint, write_t5_file, write_vae16_file)
from precast.compiler.sources.safetensors_file import SafetensorsFile
from reference_dit import (chroma_reference, clip_l_reference, dequantize, flux_bfl_to_diffusers,
                           flux_diffusers_config, flux_reference, save_diffusers_folder, t5_reference, vae16_reference)

FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
SUBNORMAL_STEP = {"fp8_e4m3": 2.0 ** -9, "fp8_e5m2": 2.0 ** -16}
ST = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2"}


def header(path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def raw(path, key, kind) -> np.ndarray:
    """A tensor's bytes viewed as `kind` (numpy / ml_dtypes), read without torch or safetensors."""
    h = header(path)
    a, b = h[key]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little") + a)
        return np.frombuffer(f.read(b - a), dtype=kind).reshape(h[key]["shape"])


def row_tagged(layout: dict) -> dict[str, torch.Tensor]:
    """Full-width BFL tensors at no memory: every row holds its own index plus a per-tensor offset
    (int16, expanded along columns), so a mapping that moves rows, halves or whole tensors shows."""
    out = {}
    for i, (key, shape) in enumerate(sorted(layout.items())):
        rows = torch.arange(shape[0], dtype=torch.int32).add_(i * 311).remainder_(32768).to(torch.int16)
        out[key] = rows if len(shape) == 1 else rows[:, None].expand(*shape)
    return out


# ------------------------------------------------------------------------ (1) mapping at width 3072

@pytest.mark.parametrize("cfg, converter, model_cls", [
    (replace(FLUX_DEV, depth=1, depth_single=1), sfu.convert_flux_transformer_checkpoint_to_diffusers,
     FluxTransformer2DModel),
    (replace(FLUX_SCHNELL, depth=1, depth_single=1), sfu.convert_flux_transformer_checkpoint_to_diffusers,
     FluxTransformer2DModel),
    (replace(CHROMA, depth=1, depth_single=1), sfu.convert_chroma_transformer_checkpoint_to_diffusers,
     ChromaTransformer2DModel),
], ids=["flux-dev", "flux-schnell", "chroma"])
def test_mapping_equals_diffusers_converter_at_full_width(cfg, converter, model_cls):
    bfl = row_tagged(flux_layout(cfg))
    ours = flux_bfl_to_diffusers(dict(bfl))
    theirs = converter({FLUX_PREFIX + k: v for k, v in bfl.items()})
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].shape == theirs[key].shape and torch.equal(ours[key], theirs[key]), key
    with torch.device("meta"):
        model = model_cls(**flux_diffusers_config(cfg))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in ours.items()}


def test_mapping_refuses_an_unknown_key():
    bfl = row_tagged(flux_layout(TINY_FLUX_DEV))
    bfl["double_blocks.0.img_attn.extra.weight"] = bfl["img_in.weight"]
    with pytest.raises(KeyError, match="img_attn.extra"):
        flux_bfl_to_diffusers(bfl)


def test_full_size_layouts_have_the_released_parameter_counts():
    assert parameter_count(flux_layout(FLUX_DEV)) == 11_901_408_320
    assert parameter_count(flux_layout(FLUX_SCHNELL)) == 11_891_178_560      # no guidance_in
    assert parameter_count(flux_layout(CHROMA)) == 8_899_983_424
    assert parameter_count(t5_layout(T5_XXL)) == 4_762_310_656
    assert parameter_count(clip_l_layout(CLIP_L)) == 123_060_480
    assert parameter_count(vae16_layout(FLUX_VAE)) == 83_819_683
    chroma = flux_layout(CHROMA)
    assert chroma["distilled_guidance_layer.in_proj.weight"] == (5120, 64)
    assert chroma["distilled_guidance_layer.layers.4.out_layer.weight"] == (5120, 5120)
    assert chroma["distilled_guidance_layer.norms.4.scale"] == (5120,)
    assert chroma["distilled_guidance_layer.out_proj.weight"] == (3072, 5120)
    assert not [k for k in chroma if "mod" in k or k.startswith(("time_in", "vector_in", "guidance_in"))]


# ------------------------------------------------------------- (2) tiny files load strictly and run

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dit")
    files = {"dev": d / "dev.safetensors", "schnell": d / "schnell.safetensors", "chroma": d / "chroma.safetensors"}
    write_flux_checkpoint(files["dev"], TINY_FLUX_DEV, t5=TINY_T5, clip=TINY_CLIP_L, vae=TINY_VAE16)
    write_flux_checkpoint(files["schnell"], TINY_FLUX_SCHNELL, t5=TINY_T5, clip=TINY_CLIP_L, vae=TINY_VAE16)
    write_flux_checkpoint(files["chroma"], TINY_CHROMA, t5=TINY_T5, vae=TINY_VAE16, dtype="fp8_e4m3_scaled")
    return files


def _grid_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h * w, 3)
    ids[:, 1], ids[:, 2] = torch.arange(h * w) // w, torch.arange(h * w) % w
    return ids


@torch.no_grad()
def test_tiny_files_load_strictly_and_run(tiny_files):
    torch.manual_seed(0)
    t5 = t5_reference(tiny_files["dev"], TINY_T5)
    clip = clip_l_reference(tiny_files["dev"], TINY_CLIP_L)
    vae = vae16_reference(tiny_files["dev"], TINY_VAE16)
    ids = torch.randint(0, TINY_T5.vocab, (1, 8))
    txt = t5(ids).last_hidden_state
    pooled = clip(torch.randint(0, TINY_CLIP_L.vocab, (1, 77))).pooler_output
    img = torch.randn(1, 16, 64)                      # a 4x4 grid of packed 2x2x16 latents
    dev = flux_reference(tiny_files["dev"], TINY_FLUX_DEV)
    a = dev(img, txt, pooled, torch.tensor([0.5]), _grid_ids(4, 4), torch.zeros(8, 3), torch.tensor([3.5])).sample
    b = dev(img, txt, pooled, torch.tensor([0.5]), _grid_ids(4, 4), torch.zeros(8, 3), torch.tensor([1.0])).sample
    schnell = flux_reference(tiny_files["schnell"], TINY_FLUX_SCHNELL)
    c = schnell(img, txt, pooled, torch.tensor([0.5]), _grid_ids(4, 4), torch.zeros(8, 3)).sample
    chroma_t5 = t5_reference(tiny_files["chroma"], TINY_T5)
    chroma = chroma_reference(tiny_files["chroma"], TINY_CHROMA)
    d = chroma(img, chroma_t5(ids).last_hidden_state, torch.tensor([0.5]), _grid_ids(4, 4), torch.zeros(8, 3)).sample
    latent = vae.encode(torch.rand(1, 3, 16, 16) * 2 - 1).latent_dist.mean
    image = vae.decode(latent).sample
    for out, shape in ((a, (1, 16, 64)), (c, (1, 16, 64)), (d, (1, 16, 64)), (latent, (1, 16, 8, 8)),
                       (image, (1, 3, 16, 16)), (txt, (1, 8, 32)), (pooled, (1, 32))):
        assert out.shape == shape and torch.isfinite(out).all() and out.abs().max() > 1e-3
    assert not torch.allclose(a, b)                   # the guidance embedder is wired in
    # the dev and schnell files share every tensor but guidance_in: same trunk, so the outputs differ
    assert not torch.allclose(a, c)


def test_bare_files_hold_the_all_in_one_tensors(tiny_files, tmp_path):
    write_flux_checkpoint(tmp_path / "flux1-dev.safetensors", TINY_FLUX_DEV, layout="bare")
    write_t5_file(tmp_path / "t5.safetensors", TINY_T5, dtype="bf16")
    write_clip_l_file(tmp_path / "clip_l.safetensors", TINY_CLIP_L, dtype="bf16")
    write_vae16_file(tmp_path / "ae.safetensors", TINY_VAE16, dtype="bf16")
    with safe_open(tiny_files["dev"], "pt") as whole:
        keys = set(whole.keys())
        for name, prefix in (("flux1-dev", FLUX_PREFIX), ("t5", T5_PREFIX), ("clip_l", CLIP_L_PREFIX),
                             ("ae", VAE_PREFIX)):
            with safe_open(tmp_path / f"{name}.safetensors", "pt") as bare:
                assert {prefix + k for k in bare.keys()} == {k for k in keys if k.startswith(prefix)}
                for k in bare.keys():
                    assert torch.equal(bare.get_tensor(k), whole.get_tensor(prefix + k)), k
    assert any(k.startswith("text_model.encoder.layers.1.") for k in header(tmp_path / "clip_l.safetensors"))
    t5_keys = header(tmp_path / "t5.safetensors")
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in t5_keys
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in t5_keys
    ae = header(tmp_path / "ae.safetensors")
    assert "decoder.conv_in.weight" in ae and not [k for k in ae if "quant_conv" in k]
    flux_reference(tmp_path / "flux1-dev.safetensors", TINY_FLUX_DEV)     # bare: loads strictly too
    with pytest.raises(ValueError, match="bare"):
        write_flux_checkpoint(tmp_path / "x.safetensors", TINY_FLUX_DEV, t5=TINY_T5, layout="bare")
    with pytest.raises(ValueError, match="CLIP"):
        write_flux_checkpoint(tmp_path / "x.safetensors", TINY_CHROMA, clip=TINY_CLIP_L)
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_diffusers_folder_round_trips_sharded(tiny_files, tmp_path):
    dev = flux_reference(tiny_files["dev"], TINY_FLUX_DEV)
    t5 = t5_reference(tiny_files["dev"], TINY_T5)
    clip = clip_l_reference(tiny_files["dev"], TINY_CLIP_L)
    vae = vae16_reference(tiny_files["dev"], TINY_VAE16)
    folder = save_diffusers_folder(tmp_path / "flux", dev, vae, t5, clip, variant="bf16", max_shard_size="200KB")
    index = json.load(open(os.path.join(folder, "model_index.json")))
    assert index["_class_name"] == "FluxPipeline" and index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    sched = json.load(open(os.path.join(folder, "scheduler", "scheduler_config.json")))
    assert (sched["shift"], sched["use_dynamic_shifting"], sched["max_shift"]) == (3.0, True, 1.15)
    for sub in ("transformer", "text_encoder_2"):     # variant shards: <name>.bf16-0000i-of-0000n + index.bf16.json
        names = os.listdir(os.path.join(folder, sub))
        assert [f for f in names if ".safetensors.index.bf16" in f and f.endswith(".json")], sub
        assert len([f for f in names if "-of-" in f]) >= 2, sub
    back = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", variant="bf16")
    t5_back = T5EncoderModel.from_pretrained(os.path.join(folder, "text_encoder_2"), variant="bf16")
    for ref, got in ((dev, back), (t5, t5_back)):
        want = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
        assert want.keys() == got.state_dict().keys()
        assert all(torch.equal(want[k], v) for k, v in got.state_dict().items())
    chroma = chroma_reference(tiny_files["chroma"], TINY_CHROMA)
    folder = save_diffusers_folder(tmp_path / "chroma", chroma, vae, t5)
    index = json.load(open(os.path.join(folder, "model_index.json")))
    assert index["_class_name"] == "ChromaPipeline" and index["text_encoder"] == ["transformers", "T5EncoderModel"]
    schnell = flux_reference(tiny_files["schnell"], TINY_FLUX_SCHNELL)
    folder = save_diffusers_folder(tmp_path / "schnell", schnell, vae, t5, clip)
    sched = json.load(open(os.path.join(folder, "scheduler", "scheduler_config.json")))
    assert (sched["shift"], sched["use_dynamic_shifting"]) == (1.0, False)


# --------------------------------------------------------------- (3) determinism and stored dtypes

def test_writers_are_deterministic(tmp_path):
    paths = [tmp_path / f"{n}.safetensors" for n in ("a", "b", "c")]
    for path, seed in zip(paths, (0, 0, 1)):
        write_flux_checkpoint(path, TINY_CHROMA, t5=TINY_T5, vae=TINY_VAE16, seed=seed, dtype="fp8_e4m3_scaled")
    data = [p.read_bytes() for p in paths]
    assert data[0] == data[1] and data[0] != data[2]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_every_dtype_round_trips(tmp_path, dtype):
    path = tmp_path / f"{dtype}.safetensors"
    wrote = write_t5_file(path, TINY_T5, seed=3, dtype=dtype)
    h, source, fp8 = header(path), RandomWeights(3), dtype.startswith("fp8")
    for key, (shape, name) in wrote.items():
        linear = key.endswith(".weight") and len(shape) == 2 and key != "shared.weight" and "relative" not in key
        assert name == (dtype if linear or not fp8 else "bf16"), key     # fp8 files keep the rest in bf16
        assert h[key]["dtype"] == ST[name] and tuple(h[key]["shape"]) == shape
        kind = FP8.get(name) or {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[name]
        stored, want = raw(path, key, kind), source.array("t5", key, shape, name)
        assert stored.tobytes() == want.tobytes(), key
        exact = source.array("t5", key, shape, "fp32")                  # the same values, narrowed once
        assert np.array_equal(stored.astype(np.float32), exact.astype(kind).astype(np.float32)), key
        assert np.isfinite(stored.astype(np.float32)).all()
    with safe_open(path, "pt") as f:                                    # an independent reader agrees
        got = f.get_tensor("encoder.block.0.layer.1.DenseReluDense.wo.weight")
        want = source.array("t5", "encoder.block.0.layer.1.DenseReluDense.wo.weight", got.shape, wrote[
            "encoder.block.0.layer.1.DenseReluDense.wo.weight"][1]).astype(np.float32)
        assert np.array_equal(got.float().numpy(), want)


@pytest.mark.parametrize("dtype, mantissa", [("fp8_e4m3_scaled", 3), ("fp8_e5m2_scaled", 2)])
def test_scaled_fp8_is_written_as_comfyui_writes_it(tmp_path, dtype, mantissa):
    path = tmp_path / "scaled.safetensors"
    write_flux_checkpoint(path, TINY_FLUX_DEV, t5=TINY_T5, clip=TINY_CLIP_L, vae=TINY_VAE16, dtype=dtype,
                          scale_input=True)
    wide = tmp_path / "fp32.safetensors"
    write_flux_checkpoint(wide, TINY_FLUX_DEV, t5=TINY_T5, clip=TINY_CLIP_L, vae=TINY_VAE16, dtype="fp32")
    h, ref, fp8 = header(path), header(wide), dtype.removesuffix("_scaled")
    st = ST[fp8]
    for prefix in (FLUX_PREFIX, T5_PREFIX):                             # one marker per quantized component
        assert h[prefix + "scaled_fp8"]["dtype"] == st and h[prefix + "scaled_fp8"]["shape"] == [0]
    assert not [k for k in h if k.endswith("scaled_fp8") and not k.startswith((FLUX_PREFIX, T5_PREFIX))]
    deq = dequantize({k: v for k, v in _torch_load(path).items()})
    scaled = [k for k in h if k.endswith(".scale_weight")]
    assert len(scaled) == len([k for k in ref if k.startswith((FLUX_PREFIX, T5_PREFIX)) and k.endswith(".weight")
                               and len(ref[k]["shape"]) == 2 and "shared" not in k and "relative" not in k])
    for s in scaled:
        w = s.removesuffix("scale_weight") + "weight"
        assert h[s]["dtype"] == "F32" and h[s]["shape"] == [] and h[w]["dtype"] == st
        assert h[s.removesuffix("weight") + "input"]["dtype"] == "F32"
        scale = raw(path, s, np.float32)
        stored = raw(path, w, FP8[fp8]).astype(np.float32)
        assert np.abs(stored).max() > 0.5 * float(ml_dtypes.finfo(FP8[fp8]).max)   # the fp8 range is used
        assert np.array_equal(deq[w].numpy(), stored * scale), w                  # dequantized = fp8 * scale
        exact = raw(wide, w, np.float32)
        tol = np.abs(exact) * 2.0 ** -(mantissa + 1) + scale * SUBNORMAL_STEP[fp8]     # half an ulp, or a step
        assert (np.abs(deq[w].numpy() - exact) <= tol * 1.01).all(), w
    for k, v in h.items():
        if k == "__metadata__" or k.endswith(("scale_weight", "scale_input", "scaled_fp8")) or k in (
                s.removesuffix("scale_weight") + "weight" for s in scaled):
            continue
        assert v["dtype"] == "BF16", k                                  # norms, biases, embeddings, CLIP, VAE
    assert SafetensorsFile(path).read(FLUX_PREFIX + "scaled_fp8").shape == (0,)   # the strict reader takes it
    with pytest.raises(ValueError, match="dtype"):
        write_flux_checkpoint(tmp_path / "x.safetensors", TINY_FLUX_DEV, dtype="int8")


def test_fp8_bias_option_stores_biases_unscaled_in_fp8(tmp_path):
    path = tmp_path / "bias.safetensors"
    write_flux_checkpoint(path, TINY_FLUX_DEV, layout="bare", dtype="fp8_e4m3_scaled", fp8_bias=True)
    h = header(path)
    assert h["img_in.bias"]["dtype"] == "F8_E4M3" and "img_in.bias_scale" not in h and "scaled_fp8" in h
    assert h["double_blocks.0.img_attn.norm.query_norm.scale"]["dtype"] == "BF16"
    bias = raw(path, "img_in.bias", ml_dtypes.float8_e4m3fn)
    assert np.array_equal(bias.astype(np.float32), RandomWeights(0).array("transformer", "img_in.bias", bias.shape,
                                                                          "fp8_e4m3").astype(np.float32))


def _torch_load(path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_random_weights_are_fan_in_scaled_and_finite():
    source = RandomWeights(0)
    big = source.array("transformer", "single_blocks.0.linear1.weight", (3 * 3072 + 12288, 3072), "bf16")
    assert np.isfinite(big.astype(np.float32)).all()
    assert 0.5 < float(big.astype(np.float32).std()) * np.sqrt(3072) < 2.0
    norm = source.array("t5", "encoder.final_layer_norm.weight", (4096,))
    assert 0.5 < norm.min() and norm.max() < 1.5
    small = source.array("transformer", "img_in.weight", (32, 64), "bf16")
    again = source.array("transformer", "img_in.weight", (9000, 64), "bf16")     # the pooled path agrees
    assert np.array_equal(small.reshape(-1), again.reshape(-1)[: small.size])
