"""GGUF input (issue 20, Build 1): tiny Flux / SDXL / SD1 / T5 files written with the `gguf` package's
GGUFWriter in every tensor type ComfyUI-GGUF files use, laid out as city96's converter lays them out
(1-D and small tensors F32; SD tensors whose rows are not a multiple of 256 flattened to rows of 256
with `comfy.gguf.orig_shape.*`), exported with `precast export` and compared bit for bit with the
`gguf` package's own dequantization (float32, then the export dtype's cast)."""
import json
import struct
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from conftest import precast
from precast.compiler.demo_dit import TINY_FLUX_DEV, TINY_FLUX_SCHNELL, TINY_T5, flux_layout, t5_layout
from precast.compiler.demo_model import TINY, TINY_SDXL, random_tensor, unet_layout
from precast.compiler.demo_sd3 import TINY_SD3, sd3_layout
from precast.compiler.errors import BadInput
from precast.compiler.sources.checkpoint import DIT, T5, UNET, open_checkpoint
from precast.compiler.families import detect_family
from precast.compiler.sources.gguf_file import GGUFFile

gguf = pytest.importorskip("gguf")
ml_dtypes = pytest.importorskip("ml_dtypes")
Q = gguf.GGMLQuantizationType
AXES = "transformer.axes_dims_rope=[4,6,6]"

# gguf.quants quantizes these; the K-quants it only dequantizes, so their blocks are made here: random
# bytes (every bit pattern is a valid quant / sub-scale) with the block's float16 scales set to small values
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_SCALES = {Q.Q2_K: ((80, 82), 45), Q.Q3_K: ((108,), 128), Q.Q4_K: ((0, 2), 945), Q.Q5_K: ((0, 2), 1953),
            Q.Q6_K: ((208,), 4096)}     # type: (byte offsets of its float16 scales, largest |value| / scale)
EXPORT_TYPES = (Q.Q8_0, Q.Q2_K, Q.Q4_0, Q.Q3_K, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q5_1, Q.Q6_K, Q.F16, Q.BF16)
# every type gguf.quants dequantizes (plus F32 / F16): the reader must read each exactly
ALL_TYPES = [Q.F32, Q.F16] + sorted(gguf.quants._type_traits, key=lambda t: t.value)
HF_TO_LLAMA = (("encoder.block.", "enc.blk."), ("layer.0.SelfAttention.relative_attention_bias", "attn_rel_b"),
               ("layer.0.SelfAttention.q", "attn_q"), ("layer.0.SelfAttention.k", "attn_k"),
               ("layer.0.SelfAttention.v", "attn_v"), ("layer.0.SelfAttention.o", "attn_o"),
               ("layer.0.layer_norm", "attn_norm"), ("layer.1.DenseReluDense.wi_0", "ffn_gate"),
               ("layer.1.DenseReluDense.wi_1", "ffn_up"), ("layer.1.DenseReluDense.wo", "ffn_down"),
               ("layer.1.layer_norm", "ffn_norm"), ("encoder.final_layer_norm", "enc.output_norm"),
               ("shared", "token_embd"))


def _encode(arr: np.ndarray, qtype, rng) -> np.ndarray:
    """`arr` (float32, rows a multiple of the block) as GGUFWriter takes it for `qtype`."""
    if qtype in K_SCALES:
        offsets, factor = K_SCALES[qtype]
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = rng.integers(0, 256, (arr.size // 256, size), dtype=np.uint8)
        for off in offsets:
            scale = (rng.uniform(0.5, 1.0, blocks.shape[0]) * 0.3 / factor).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(gguf.quants.quant_shape_to_byte_shape(arr.shape, qtype))
    return gguf.quants.quantize(arr, qtype)


def write_gguf(path, arch: str, tensors: dict, types=EXPORT_TYPES, flatten: bool = False, seed: int = 0) -> dict:
    """Write `tensors` (name: float32) as city96's converter does: 1-D and <= 1024-value tensors F32,
    the others in `types` round-robin; a tensor whose rows do not fit the type's block is flattened to
    rows of 256 with `comfy.gguf.orig_shape.NAME` where `flatten` (the converter's SD rule) allows,
    else stored F16 (the converter's fallback). Returns {name: GGUF type}."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    chosen, i = {}, 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or arr.size <= 1024:
            qtype = Q.F32
        else:
            qtype, i = types[i % len(types)], i + 1
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if arr.shape[-1] % block:
                if flatten and arr.size % 256 == 0 and arr.size >= 512:
                    w.add_array(f"comfy.gguf.orig_shape.{name}", [int(d) for d in arr.shape])
                    arr = arr.reshape(-1, 256)
                else:
                    qtype = Q.F16
        chosen[name] = qtype
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, _encode(arr, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return chosen


def reference(path) -> dict[str, np.ndarray]:
    """The gguf package's own reading: gguf.quants.dequantize of each whole tensor (float32), in torch
    order (ComfyUI-GGUF's orig_shape where recorded)."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        field = r.get_field(f"comfy.gguf.orig_shape.{t.name}")
        shape = tuple(field.contents()) if field is not None else tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


NP = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}


def _twin(path, ref: dict) -> None:
    """A .safetensors file holding the dequantized float32 values under the same names."""
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()}, str(path))


def _export(src, out, dtype, *extra):
    proc = precast("export", src, "--out", out, "--dtype", dtype, *map(str, extra))
    assert proc.returncode == 0, proc.stderr
    return out


def _initializers(model_path) -> dict[str, np.ndarray]:
    m = onnx.load(str(model_path))          # external data read back from model.onnx_data
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


def _same_export(a, b, comp):
    ga, gb = (onnx.load(str(x / comp / "model.onnx"), load_external_data=False).graph for x in (a, b))
    assert ga == gb, comp                                           # the same graph, byte for byte
    assert (a / comp / "model.onnx_data").read_bytes() == (b / comp / "model.onnx_data").read_bytes(), comp


def _check_weights(folder, comp, ref: dict, dtype: str, rename=lambda k: k) -> int:
    """Every weight of `ref` that the export holds equals gguf's float32 dequantization cast to `dtype`
    (or kept float32 where the graph keeps it), bit for bit; returns how many were compared."""
    inits = _initializers(folder / comp / "model.onnx")
    n = 0
    for key, want in ref.items():
        name = rename(key)
        if name not in inits:
            continue
        got = inits[name]
        assert got.dtype in (NP[dtype], NP["fp32"]), key          # a few (norm scales) stay float32 by design
        want = want.astype(got.dtype)
        assert got.shape == want.shape, key
        assert np.array_equal(_bits(got), _bits(want)), key
        n += 1
    return n


def _flux_feeds(seed=0):
    rng = np.random.default_rng(seed)
    n, t = 16, 12
    ids = np.zeros((n, 3), np.float32)
    ids[:, 1], ids[:, 2] = np.arange(n) // 4, np.arange(n) % 4
    return {"hidden_states": rng.standard_normal((1, n, 64)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, t, 32)).astype(np.float32),
            "timestep": np.array([0.62], np.float32), "img_ids": ids, "txt_ids": np.zeros((t, 3), np.float32),
            "pooled_projections": rng.standard_normal((1, 32)).astype(np.float32), "guidance": np.array([3.5], np.float32)}


def _run(folder, comp, feeds):
    sess = ort.InferenceSession(str(folder / comp / "model.onnx"), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in sess.get_inputs()}
    cast = {k: v.astype(np.float16) if types[k] == "tensor(float16)" else v for k, v in feeds.items() if k in types}
    return [np.asarray(o) for o in sess.run(None, cast)]


def _weights(layout: dict, seed: int, strip: str = "") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k[len(strip):]: random_tensor(rng, k, s) for k, s in sorted(layout.items())}


def _llama_name(hf: str) -> str:
    for a, b in HF_TO_LLAMA:
        hf = hf.replace(a, b)
    return hf


T5_HF = {_llama_name(k): k for k in t5_layout(TINY_T5)}     # llama.cpp name -> HF name


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    out = {"dev": tmp / "flux1-dev-mixed.gguf", "schnell": tmp / "flux1-schnell-Q8_0.gguf",
           "sdxl": tmp / "sdxl-unet-mixed.gguf", "sd1": tmp / "sd15-unet-mixed.gguf", "t5": tmp / "t5-v1_1-xxl-encoder.gguf"}
    # Flux: BFL names, no prefix. Its real rows (3072, 12288, ...) are multiples of 256; the tiny ones are
    # not, so its K-quant tensors are flattened as the converter flattens SD's (ComfyUI-GGUF reads either)
    types = {"dev": write_gguf(out["dev"], "flux", _weights(flux_layout(TINY_FLUX_DEV), 1), flatten=True, seed=1),
             "schnell": write_gguf(out["schnell"], "flux", _weights(flux_layout(TINY_FLUX_SCHNELL), 2), types=(Q.Q8_0,)),
             "sdxl": write_gguf(out["sdxl"], "sdxl", _weights(unet_layout(TINY_SDXL), 3, UNET), flatten=True, seed=3),
             "sd1": write_gguf(out["sd1"], "sd1", _weights(unet_layout(TINY), 4, UNET), flatten=True, seed=4),
             # llama.cpp's T5 names, as city96's t5-v1_1-xxl-encoder-gguf files have them
             "t5": write_gguf(out["t5"], "t5encoder", {_llama_name(k): v for k, v in _weights(t5_layout(TINY_T5), 5).items()},
                              types=(Q.Q8_0, Q.Q5_K, Q.F16), flatten=True, seed=5)}
    for name in ("dev", "sdxl"):
        _twin(tmp / f"{name}-twin.safetensors", reference(out[name]))
    _twin(tmp / "t5-twin.safetensors", {T5_HF[k]: v for k, v in reference(out["t5"]).items()})   # HF names
    return out, types, tmp


def test_the_files_hold_every_type(files):
    _, types, _ = files
    used = set(types["dev"].values()) | set(types["sdxl"].values())
    assert used == set(EXPORT_TYPES) | {Q.F32}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_each_type_reads_as_gguf_dequantizes_it(tmp_path, qtype):
    """Any bytes, any type gguf.quants dequantizes: float32, fp16 and bf16 reads are gguf's float32
    dequantization (then the cast), bit for bit, in torch order; rows of blocks chunk as one tensor."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(qtype.value)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), arch="flux")
    shapes = {"a.weight": (6, 2 * max(block, 256)), "b.weight": (3, 2, max(block, 256))}
    for name, shape in shapes.items():
        raw = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
        if qtype in (Q.F32, Q.F16):
            raw = raw.view(np.float32 if qtype == Q.F32 else np.float16)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    warnings.simplefilter("ignore", RuntimeWarning)      # random bytes: inf/NaN scales
    ref = reference(path)
    f = GGUFFile(path)
    import precast.compiler.sources.gguf_file as gf
    gf.CHUNK_VALUES, keep = 512, gf.CHUNK_VALUES       # several chunks per tensor
    try:
        for name, shape in shapes.items():
            assert f.tensors[name].shape == shape and f.tensors[name].dtype == qtype.name
            assert np.array_equal(_bits(f.read(name)), _bits(ref[name]))
            for target in (np.float16, ml_dtypes.bfloat16):
                got, want = f.read(name, raw=True, target=np.dtype(target)).astype(target), ref[name].astype(target)
                if qtype in (Q.F32, Q.F16, Q.BF16):     # read as stored, cast by the writer: NaN payloads may differ
                    nan = np.isnan(want)                # (a NaN weight is refused anyway)
                    assert np.array_equal(nan, np.isnan(got)) and np.array_equal(_bits(got)[~nan], _bits(want)[~nan])
                else:
                    assert np.array_equal(_bits(got), _bits(want)), (name, target)
    finally:
        gf.CHUNK_VALUES = keep


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flux_gguf_exports_gguf_dequantization_exactly(files, dtype):
    """A Flux dev GGUF (every type) with a llama.cpp-named T5 GGUF: the transformer and the T5 export to
    the same graph and weight bytes as .safetensors files holding gguf's dequantized values, each
    weight equal to gguf's dequantization cast to the export dtype; the transformer runs the same."""
    (paths, types, tmp) = files
    a = _export(paths["dev"], tmp / f"dev-{dtype}", dtype, "--set", AXES, "--text-encoder", paths["t5"],
                "--component", "transformer", "--component", "text_encoder_2")
    b = _export(tmp / "dev-twin.safetensors", tmp / f"dev-twin-{dtype}", dtype, "--set", AXES, "--text-encoder",
                tmp / "t5-twin.safetensors", "--component", "transformer", "--component", "text_encoder_2")
    for comp in ("transformer", "text_encoder_2"):
        _same_export(a, b, comp)
    ref = reference(paths["dev"])
    assert _check_weights(a, "transformer", ref, dtype) == len(ref)
    t5_ref = reference(paths["t5"])
    assert sorted(GGUFFile(paths["t5"]).keys()) == sorted(T5_HF[k] for k in t5_ref)     # read under HF names
    assert _check_weights(a, "text_encoder_2", t5_ref, dtype, rename=T5_HF.get) == len(t5_ref)
    report = json.loads((a / "precast_export.json").read_text())
    want = {}
    for t in list(types["dev"].values()) + list(types["t5"].values()):
        want[t.name] = want.get(t.name, 0) + 1
    assert report["source_quantization"] == dict(sorted(want.items()))
    if dtype == "fp32":
        feeds = _flux_feeds()
        out_a, out_b = _run(a, "transformer", feeds), _run(b, "transformer", feeds)
        assert np.isfinite(out_a[0]).all() and np.array_equal(out_a[0], out_b[0])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sdxl_unet_gguf_exports_gguf_dequantization_exactly(files, dtype):
    """An SDXL UNet GGUF (LDM names, conv weights flattened with orig_shape, every type) exports as the
    .safetensors file of its dequantized values does; each weight is gguf's dequantization, cast."""
    (paths, _, tmp) = files
    a = _export(paths["sdxl"], tmp / f"sdxl-{dtype}", dtype, "--component", "unet")
    b = _export(tmp / "sdxl-twin.safetensors", tmp / f"sdxl-twin-{dtype}", dtype, "--component", "unet")
    _same_export(a, b, "unet")
    ref = reference(paths["sdxl"])
    assert _check_weights(a, "unet", ref, dtype) == len(ref)
    if dtype == "fp32":
        rng = np.random.default_rng(0)
        feeds = {"sample": rng.standard_normal((1, 4, 8, 8)).astype(np.float32), "timestep": np.array([500.0], np.float32),
                 "encoder_hidden_states": rng.standard_normal((1, 77, 96)).astype(np.float32),
                 "text_embeds": rng.standard_normal((1, 48)).astype(np.float32),
                 "time_ids": np.array([[64, 64, 0, 0, 64, 64]], np.float32)}
        out_a, out_b = _run(a, "unet", feeds), _run(b, "unet", feeds)
        assert np.isfinite(out_a[0]).all() and np.array_equal(out_a[0], out_b[0])


def test_detection_reads_names_and_shapes_only(files, tmp_path, monkeypatch):
    """Flux dev / schnell, SDXL and SD1 GGUFs are detected from the header; no tensor is read. A
    `model.diffusion_model.` prefix maps to the same canonical tensors."""
    (paths, _, _) = files
    monkeypatch.setattr(GGUFFile, "read", lambda *a, **k: pytest.fail("detection read a tensor"))
    got = {name: detect_family(open_checkpoint(paths[name])) for name in ("dev", "schnell", "sdxl", "sd1")}
    assert [(f.name, f.variant) for f in got.values()] == [("flux", "dev"), ("flux", "schnell"), ("sdxl", ""), ("sd1", "")]
    bare = open_checkpoint(paths["schnell"])
    assert all(k.startswith(DIT) for k in bare.refs)
    assert bare.shape(DIT + "double_blocks.0.img_attn.qkv.weight") == (96, 32)
    sdxl = open_checkpoint(paths["sdxl"])
    assert sdxl.shape(UNET + "input_blocks.0.0.weight") == (64, 4, 3, 3)     # restored from orig_shape
    prefixed = tmp_path / "prefixed.gguf"
    write_gguf(prefixed, "flux", {DIT + k: v for k, v in _weights(flux_layout(TINY_FLUX_SCHNELL), 2).items()}, types=(Q.Q8_0,))
    again = open_checkpoint(prefixed)
    assert {k: r.shape for k, r in again.refs.items()} == {k: r.shape for k, r in bare.refs.items()}
    sd3 = tmp_path / "sd3.gguf"         # SAI names (joint_blocks.*), as ComfyUI-GGUF's sd3 files
    write_gguf(sd3, "sd3", _weights(sd3_layout(TINY_SD3), 6), types=(Q.Q8_0, Q.Q5_1))
    assert detect_family(open_checkpoint(sd3)).name == "sd3"
    t5 = open_checkpoint(paths["schnell"], text_encoders=[paths["t5"]])
    assert {k[len(T5):]: r.shape for k, r in t5.refs.items() if k.startswith(T5)} == t5_layout(TINY_T5)


def _type_field_offset(path, name: str) -> int:
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    return t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:4])


@pytest.mark.parametrize("code, says", [(99, "GGML type 99"), (int(Q.Q8_1), "Q8_1, a GGUF type precast cannot dequantize")])
def test_unknown_type_is_refused_by_name(files, tmp_path, code, says):
    (paths, types, _) = files
    name = next(k for k, t in types["schnell"].items() if t == Q.Q8_0)
    bad = tmp_path / "bad.gguf"
    data = bytearray(paths["schnell"].read_bytes())
    struct.pack_into("<I", data, _type_field_offset(paths["schnell"], name), code)
    bad.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=f"tensor {name} is stored as {says}"):
        open_checkpoint(bad)
    proc = precast("export", bad, "--out", tmp_path / "out", "--set", AXES)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and name in proc.stderr, proc.stderr


@pytest.mark.parametrize("keep", [0.6, 100])
def test_truncated_gguf_is_one_line(files, tmp_path, keep):
    (paths, _, _) = files
    data = paths["schnell"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    proc = precast("export", cut, "--out", tmp_path / "out", "--set", AXES)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a valid .gguf file" in lines[0] and str(cut) in lines[0], proc.stderr


def test_zimage_and_its_qwen3_encoder_as_gguf_export_their_dequantization(tmp_path):
    """ComfyUI-GGUF's split Z-Image files: the transformer in its original names and the Qwen3 text encoder in
    llama.cpp's names (as its converter writes them: gguf's own TensorNameMap gives the names here), several
    types, beside the FLUX.1 VAE and the tokenizer: both export to the graphs and weight bytes of .safetensors
    twins holding gguf's dequantized values (the encoder's under HF names); a llama-arch file is one line."""
    from precast.compiler.demo_dit import write_vae16_file
    from precast.compiler.demo_zimage import TINY_QWEN3, TINY_ZIMAGE, qwen3_layout, tiny_tokenizer_json, zimage_layout
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3, TINY_QWEN3.layers)
    hf = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in qwen3_layout(TINY_QWEN3)}
    assert None not in hf and len(hf) == len(qwen3_layout(TINY_QWEN3))
    write_gguf(tmp_path / "z_image_turbo-Q8_0.gguf", "lumina2", _weights(zimage_layout(TINY_ZIMAGE), 7),
               types=(Q.Q8_0, Q.Q4_K, Q.BF16))
    write_gguf(tmp_path / "Qwen3-4B-Q8_0.gguf", "qwen3",
               {g: v for k, v in _weights(qwen3_layout(TINY_QWEN3), 8).items() for g in [next(a for a, b in hf.items()
                                                                                              if b == k)]},
               types=(Q.Q8_0, Q.Q5_K, Q.F16))
    z_ref, te_ref = reference(tmp_path / "z_image_turbo-Q8_0.gguf"), reference(tmp_path / "Qwen3-4B-Q8_0.gguf")
    assert sorted(GGUFFile(tmp_path / "Qwen3-4B-Q8_0.gguf").keys()) == sorted(hf.values())     # read under HF names
    _twin(tmp_path / "z_twin.safetensors", z_ref)
    _twin(tmp_path / "qwen_twin.safetensors", {"model." + hf[k]: v for k, v in te_ref.items()})   # ComfyUI's names
    write_vae16_file(tmp_path / "ae.safetensors")
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    axes = "transformer.axes_dims_rope=[4,6,6]"
    common = ("--vae", tmp_path / "ae.safetensors", "--set", axes, "--component", "transformer",
              "--component", "text_encoder")
    a = _export(tmp_path / "z_image_turbo-Q8_0.gguf", tmp_path / "a", "fp32", "--text-encoder",
                tmp_path / "Qwen3-4B-Q8_0.gguf", *common)
    b = _export(tmp_path / "z_twin.safetensors", tmp_path / "b", "fp32", "--text-encoder",
                tmp_path / "qwen_twin.safetensors", *common)
    for comp in ("transformer", "text_encoder"):
        _same_export(a, b, comp)
    # each weight the graphs hold under its file's name is gguf's dequantization, bit for bit (the transformer's
    # others are sliced or fused in the graph, the encoder's last layer unread: the twins' exports are identical)
    assert _check_weights(a, "transformer", z_ref, "fp32") >= 0.6 * len(z_ref)
    assert _check_weights(a, "text_encoder", te_ref, "fp32", rename=hf.get) >= 0.6 * len(te_ref)
    assert {t.dtype for t in GGUFFile(tmp_path / "Qwen3-4B-Q8_0.gguf").tensors.values()} >= {"Q8_0", "F32"}
    report = json.loads((a / "precast_export.json").read_text())
    assert report["family"] == "zimage" and "Q8_0" in report["source_quantization"]
    # a llama-arch file (q / k rows permuted by llama.cpp) without the head counts that put them back
    llama = tmp_path / "llama.gguf"
    write_gguf(llama, "llama", {g: v for g, v in reference(tmp_path / "Qwen3-4B-Q8_0.gguf").items()
                                if g.startswith("blk.0.attn_")})
    proc = precast("export", tmp_path / "z_twin.safetensors", "--out", tmp_path / "c", "--text-encoder", llama,
                   *map(str, common))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "llama.attention.head_count" in lines[0] and str(llama) in lines[0]


def test_qwen_image_and_its_qwen25_encoder_as_gguf_export_their_dequantization(tmp_path):
    """Qwen-Image as GGUF split files: the transformer in diffusers' names (city96's) and the Qwen2.5-VL text model in
    llama.cpp's qwen2vl names (q/k/v biases included), beside the model's VAE and tokenizer: both export to the
    graphs and weight bytes of .safetensors twins of gguf's dequantization."""
    from precast.compiler.demo_qwenimage import (TINY_QWEN25, TINY_QWEN_IMAGE, qwen25_layout, qwen_vae_layout,
                                                 qwenimage_layout)
    from precast.compiler.demo_weights import Component, write_components
    from precast.compiler.demo_zimage import tiny_tokenizer_json
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2VL, TINY_QWEN25.layers)
    hf = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in qwen25_layout(TINY_QWEN25)}
    assert None not in hf and len(hf) == len(qwen25_layout(TINY_QWEN25))
    llama = {v: k for k, v in hf.items()}
    write_gguf(tmp_path / "qwen-image-Q8_0.gguf", "qwen_image", _weights(qwenimage_layout(TINY_QWEN_IMAGE), 9),
               types=(Q.Q8_0, Q.Q4_K, Q.F16))
    write_gguf(tmp_path / "Qwen2.5-VL-7B-Q8_0.gguf", "qwen2vl",
               {llama[k]: v for k, v in _weights(qwen25_layout(TINY_QWEN25), 10).items()}, types=(Q.Q8_0, Q.Q6_K, Q.F16))
    q_ref, te_ref = reference(tmp_path / "qwen-image-Q8_0.gguf"), reference(tmp_path / "Qwen2.5-VL-7B-Q8_0.gguf")
    _twin(tmp_path / "q_twin.safetensors", q_ref)
    _twin(tmp_path / "te_twin.safetensors", {"model." + hf[k]: v for k, v in te_ref.items()})
    write_components(tmp_path / "qwen_image_vae.safetensors", [Component("vae", "vae.", qwen_vae_layout(), False)], 0,
                     "bf16")
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    common = ("--vae", tmp_path / "qwen_image_vae.safetensors", "--set", "transformer.axes_dims_rope=[4,6,6]",
              "--component", "transformer", "--component", "text_encoder")
    a = _export(tmp_path / "qwen-image-Q8_0.gguf", tmp_path / "a", "fp32", "--text-encoder",
                tmp_path / "Qwen2.5-VL-7B-Q8_0.gguf", *common)
    b = _export(tmp_path / "q_twin.safetensors", tmp_path / "b", "fp32", "--text-encoder", tmp_path / "te_twin.safetensors",
                *common)
    for comp in ("transformer", "text_encoder"):
        _same_export(a, b, comp)
    assert _check_weights(a, "text_encoder", te_ref, "fp32", rename=hf.get) >= 0.6 * len(te_ref)
    assert json.loads((a / "precast_export.json").read_text())["family"] == "qwenimage"


def test_flux2_klein_and_its_qwen3_encoder_as_gguf_export_their_dequantization(tmp_path):
    """FLUX.2 klein as GGUF split files: the transformer in BFL's names (fused qkv, linear1 = q | k | v | gate | up,
    as city96-style converters keep them) and the 28-layer Qwen3 in llama.cpp's names, beside BFL's VAE and the
    tokenizer: both export to the graphs and weight bytes of .safetensors twins of gguf's dequantization."""
    from precast.compiler.demo_flux2 import TINY_FLUX2, TINY_QWEN3_28, flux2_layout, write_flux2_vae_file
    from precast.compiler.demo_zimage import qwen3_layout, tiny_tokenizer_json
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3, TINY_QWEN3_28.layers)
    hf = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in qwen3_layout(TINY_QWEN3_28)}
    assert None not in hf and len(hf) == len(qwen3_layout(TINY_QWEN3_28))
    llama = {v: k for k, v in hf.items()}
    write_gguf(tmp_path / "flux-2-klein-4b-Q8_0.gguf", "flux", _weights(flux2_layout(TINY_FLUX2), 11),
               types=(Q.Q8_0, Q.Q5_K, Q.BF16))
    write_gguf(tmp_path / "Qwen3-4B-Q8_0.gguf", "qwen3",
               {llama[k]: v for k, v in _weights(qwen3_layout(TINY_QWEN3_28), 12).items()}, types=(Q.Q8_0, Q.Q4_K, Q.F16))
    f_ref, te_ref = reference(tmp_path / "flux-2-klein-4b-Q8_0.gguf"), reference(tmp_path / "Qwen3-4B-Q8_0.gguf")
    _twin(tmp_path / "f_twin.safetensors", f_ref)
    _twin(tmp_path / "qwen_twin.safetensors", {"model." + hf[k]: v for k, v in te_ref.items()})
    write_flux2_vae_file(tmp_path / "flux2-vae.safetensors")
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json())
    common = ("--vae", tmp_path / "flux2-vae.safetensors", "--set", "transformer.axes_dims_rope=[4,4,4,4]",
              "--component", "transformer", "--component", "text_encoder")
    a = _export(tmp_path / "flux-2-klein-4b-Q8_0.gguf", tmp_path / "a", "fp32", "--text-encoder",
                tmp_path / "Qwen3-4B-Q8_0.gguf", *common)
    b = _export(tmp_path / "f_twin.safetensors", tmp_path / "b", "fp32", "--text-encoder",
                tmp_path / "qwen_twin.safetensors", *common)
    for comp in ("transformer", "text_encoder"):
        _same_export(a, b, comp)
    assert _check_weights(a, "text_encoder", te_ref, "fp32", rename=hf.get) >= 0.6 * len(te_ref)
    report = json.loads((a / "precast_export.json").read_text())
    assert report["family"] == "flux2" and "Q8_0" in report["source_quantization"]


def _llama_permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows as llama.cpp's converter stores a llama / Mistral model's (each head's rotate-half halves
    interleaved: convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def test_flux2_dev_mistral_encoder_as_llama_gguf_exports_its_dequantization(tmp_path):
    """FLUX.2 dev's Mistral text model as llama.cpp writes it (arch llama, its q / k rows permuted per head, the head
    counts in its metadata), given with --text-encoder to BFL's dev transformer: the same graph and weight bytes as a
    .safetensors twin holding gguf's dequantized values in HF order; no raw blocks carried for the permuted rows
    (`weights: gguf` keeps the others)."""
    from precast.compiler.demo_flux2 import (TINY_FLUX2_DEV, TINY_MISTRAL_30, flux2_layout, mistral_layout,
                                             mistral_tokenizer_json, write_flux2_vae_file)
    from precast.compiler.demo_weights import Component, write_components
    from precast.compiler.sources.gguf_file import carried_blocks
    m = TINY_MISTRAL_30
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, m.layers)
    hf = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in mistral_layout(m)}
    assert None not in hf and len(hf) == len(mistral_layout(m))
    values = _weights(mistral_layout(m), 14)
    heads = {"q_proj": m.heads, "k_proj": m.kv_heads}
    stored = {g: _llama_permuted(values[k], heads[k.split(".")[-2]]) if k.split(".")[-2] in heads else values[k]
              for g, k in hf.items()}
    path = tmp_path / "Mistral-Small-3.2-24B-Instruct-2506-Q8_0.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_head_count(m.heads)
    w.add_head_count_kv(m.kv_heads)
    for i, (name, arr) in enumerate(stored.items()):
        arr = np.ascontiguousarray(arr, np.float32)
        if arr.ndim == 1:
            w.add_tensor(name, arr)
        else:
            qtype = (Q.Q8_0, Q.F16)[i % 2]
            w.add_tensor(name, _encode(arr, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = reference(path)
    unpermuted = {hf[g]: _llama_unpermute(v, heads[hf[g].split(".")[-2]]) if hf[g].split(".")[-2] in heads else v
                  for g, v in ref.items()}
    assert any(not np.array_equal(unpermuted[k], ref[g]) for g, k in hf.items() if "q_proj" in k)
    _twin(tmp_path / "mistral_twin.safetensors", {"model." + k: v for k, v in unpermuted.items()})
    write_components(tmp_path / "flux2-dev.safetensors",
                     [Component("transformer", "", flux2_layout(TINY_FLUX2_DEV), True)], 0, "bf16")
    write_flux2_vae_file(tmp_path / "flux2-vae.safetensors")
    (tmp_path / "tokenizer.json").write_text(mistral_tokenizer_json())
    common = ("--vae", tmp_path / "flux2-vae.safetensors", "--set", "transformer.axes_dims_rope=[4,4,4,4]",
              "--component", "text_encoder")
    a = _export(tmp_path / "flux2-dev.safetensors", tmp_path / "a", "fp32", "--text-encoder", path, *common)
    b = _export(tmp_path / "flux2-dev.safetensors", tmp_path / "b", "fp32", "--text-encoder",
                tmp_path / "mistral_twin.safetensors", *common)
    _same_export(a, b, "text_encoder")
    refs = open_checkpoint(path).refs
    q = next(r for k, r in refs.items() if k.endswith("layers.0.self_attn.q_proj.weight"))
    o = next(r for k, r in refs.items() if k.endswith("layers.0.self_attn.o_proj.weight"))
    assert carried_blocks(q) is None and (carried_blocks(o) is not None) == (o.file.tensors[o.key].dtype == "Q8_0")


def _llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)



def _kv_gguf(value: bytes) -> bytes:
    """A GGUF v3 file with no tensors and one metadata key `x` whose typed value is `value`."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + value


@pytest.mark.parametrize("value, says", [
    (struct.pack("<IIQ", 9, 0, 1 << 62) + b"\x01", "claims 4611686018427387904 entries"),     # u8 array: a hang
    (struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000)) + struct.pack("<IQ", 0, 1) + b"\x01",
     "nested more than 4 deep"),                                                            # a RecursionError
])
def test_hostile_gguf_metadata_is_one_line_at_once(tmp_path, value, says):
    """Metadata arrays that would make gguf's reader loop over 2^62 entries or recurse 5,000 deep: refused
    before it walks them."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_kv_gguf(value))
    proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", "export", str(bad), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0] and str(bad) in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
