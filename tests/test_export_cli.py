"""`precast export` as a user runs it: deterministic output, one clear error (exit 2) for every
kind of bad input with nothing left behind, no torch needed, components replaced atomically."""
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import precast
from precast.compiler.sources.safetensors_file import SafetensorsFile


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_two_exports_are_byte_identical(demo_ckpt, tmp_path, dtype):
    for name in ("a", "b"):
        precast("export", demo_ckpt, "--out", tmp_path / name, "--dtype", dtype, check=True)
    a, b = _digests(tmp_path / "a"), _digests(tmp_path / "b")
    # 4 x (model.onnx + model.onnx_data) + precast_export.json, then the diffusers-style files
    # (compiler/interop.py): model_index.json, scheduler config, 4 x config.json, tokenizer (4 files)
    assert len(a) == 19 and a == b


def test_export_runs_without_torch(demo_ckpt, tmp_path):
    code = ("import sys; sys.modules['torch'] = None; sys.modules['diffusers'] = None; "
            "sys.modules['transformers'] = None; from precast.compiler.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "export", str(demo_ckpt), "--out", str(tmp_path / "o"),
                           "--component", "unet", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [c["name"] for c in report["components"]] == ["unet"]
    assert report["components"][0]["files"]["model.onnx_data"] == (tmp_path / "o/unet/model.onnx_data").stat().st_size


def test_reexport_replaces_components_and_keeps_other_files(demo_ckpt, tmp_path):
    out = tmp_path / "o"
    precast("export", demo_ckpt, "--out", out, check=True)
    (out / "notes.txt").write_text("mine")
    precast("export", demo_ckpt, "--out", out, "--component", "unet", "--dtype", "fp16", check=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "precast_export.json").read_text())["dtype"] == "fp16"
    assert (out / "text_encoder/model.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no staging folders left


def _zeros_file(path, shapes):
    """A .safetensors file with these F16 tensors, all zeros."""
    header, offset = {}, 0
    for k, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        header[k] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return _write_raw(path, header, b"\0" * offset)


def _write_raw(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def _bad_inputs(tmp, demo):
    raw = demo.read_bytes()
    cases = {}
    cases["truncated"] = tmp / "truncated.safetensors"
    cases["truncated"].write_bytes(raw[: len(raw) // 2])
    cases["header-past-end"] = tmp / "hdr.safetensors"
    cases["header-past-end"].write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:100])
    cases["overlap"] = _write_raw(tmp / "overlap.safetensors", {
        "model.diffusion_model.input_blocks.0.0.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "model.diffusion_model.out.2.weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16)
    cases["unknown-dtype"] = _write_raw(tmp / "dtype.safetensors", {
        "w": {"dtype": "I4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    cases["pickle"] = tmp / "model.ckpt"
    cases["pickle"].write_bytes(pickle.dumps({"state_dict": {}}))
    cases["pickle-named-safetensors"] = tmp / "disguised.safetensors"
    cases["pickle-named-safetensors"].write_bytes(pickle.dumps({"a": 1}))
    cases["not-sd"] = _write_raw(tmp / "bert.safetensors", {
        "encoder.layer.0.attention.self.query.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
        b"\0" * 16)
    return cases


def test_bad_input_gives_one_clear_error_and_writes_nothing(demo_ckpt, tmp_path):
    src = tmp_path / "inputs"
    src.mkdir()
    expect = {"truncated": "not a valid .safetensors", "header-past-end": "past the end",
              "overlap": "overlap", "unknown-dtype": "unknown dtype", "pickle": "pickled checkpoint refused",
              "pickle-named-safetensors": "pickled checkpoint refused", "not-sd": "not a recognised"}
    for name, path in _bad_inputs(src, demo_ckpt).items():
        out = tmp_path / f"out-{name}"
        proc = precast("export", path, "--out", out)
        assert proc.returncode == 2, (name, proc.stderr)
        assert expect[name] in proc.stderr and str(path) in proc.stderr, (name, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, (name, proc.stderr)
        assert not out.exists(), name
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps(Evil()))
    proc = precast("export", path, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "safetensors" in proc.stderr  # the hint says how to convert
    assert not marker.exists()


def test_safetensors_whose_header_length_starts_like_a_pickle_loads(demo_ckpt, tmp_path):
    """A header length of 128 mod 256 makes the file's first byte 0x80, a pickle's first byte too."""
    raw = demo_ckpt.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    tensors = {k: {"dtype": i.dtype, "shape": list(i.shape), "data_offsets": [i.start - data_start, i.end - data_start]}
               for k, i in SafetensorsFile(demo_ckpt).tensors.items()}
    pad = next(n for n in range(256) if len(json.dumps({"__metadata__": {"pad": " " * n}, **tensors})) % 256 == 128)
    path = _write_raw(tmp_path / "model.safetensors", {"__metadata__": {"pad": " " * pad}, **tensors}, raw[data_start:])
    assert path.read_bytes()[:1] == b"\x80"
    precast("export", path, "--out", tmp_path / "o", "--component", "unet", check=True)
    assert (tmp_path / "o" / "unet" / "model.onnx").is_file()


def test_vae_attention_stored_as_linear_in_a_single_file_binds(demo_ckpt, tmp_path):
    """Some single files keep the VAE mid attention as Linear [C, C] (diffusers' layout); the same
    weights must give the same decoder as the LDM 1x1-conv layout."""
    import onnxruntime as ort
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(demo_ckpt))
    linear = {k: np.ascontiguousarray(v[:, :, 0, 0]) if ".mid.attn_1." in k and v.ndim == 4 else v
              for k, v in tensors.items()}
    assert sum(v.ndim == 2 and ".mid.attn_1." in k for k, v in linear.items()) == 8
    save_file(linear, str(tmp_path / "linear.safetensors"))
    latent = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    outs = []
    for src in (demo_ckpt, tmp_path / "linear.safetensors"):
        out = tmp_path / src.stem
        precast("export", src, "--out", out, "--component", "vae_decoder", check=True)
        session = ort.InferenceSession(str(out / "vae_decoder" / "model.onnx"), providers=["CPUExecutionProvider"])
        outs.append(session.run(None, {"latent_sample": latent})[0])
    np.testing.assert_array_equal(outs[0], outs[1])


def test_separate_vae_replaces_the_checkpoints(demo_ckpt, tmp_path):
    import onnxruntime as ort
    from precast.compiler.demo_model import write_demo_model
    other = tmp_path / "other.safetensors"
    write_demo_model(str(other), seed=1)
    latent = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)

    def decode(name, *args):
        proc = precast("export", *args, "--out", tmp_path / name, "--component", "vae_decoder", "--json", check=True)
        session = ort.InferenceSession(str(tmp_path / name / "vae_decoder" / "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        return session.run(None, {"latent_sample": latent})[0], json.loads(proc.stdout)
    own, _ = decode("own", demo_ckpt)
    swapped, report = decode("swapped", demo_ckpt, "--vae", other)
    reference, _ = decode("reference", other)
    np.testing.assert_array_equal(swapped, reference)
    assert not np.array_equal(own, swapped) and report["vae"] == str(other)
    proc = precast("export", demo_ckpt, "--out", tmp_path / "bad", "--vae", tmp_path / "nope.safetensors")
    assert proc.returncode == 2 and "--vae" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()


def _retyped(demo, tmp, name, drop=(), add=None):
    """A copy of the demo checkpoint with some tensors removed or added (header only)."""
    f = SafetensorsFile(demo)
    header, chunks, offset = {}, [], 0
    tensors = {k: (info.dtype, info.shape, f.read(k)) for k, info in f.tensors.items() if k not in drop}
    for k, (dt, shape, arr) in {**tensors, **(add or {})}.items():
        data = (arr.astype(np.float16) if dt == "F16" else arr).tobytes()
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    return _write_raw(tmp / name, header, b"".join(chunks))


def test_missing_and_unexpected_tensors_are_listed(demo_ckpt, tmp_path):
    gone = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
    path = _retyped(demo_ckpt, tmp_path, "missing.safetensors", drop=[gone])
    proc = precast("export", path, "--out", tmp_path / "o1", "--component", "unet")
    assert proc.returncode == 2 and gone in proc.stderr and "missing 1 tensor" in proc.stderr
    extra = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.extra.weight"
    path = _retyped(demo_ckpt, tmp_path, "extra.safetensors", add={extra: ("F16", (2,), np.ones(2))})
    proc = precast("export", path, "--out", tmp_path / "o2", "--component", "unet")
    assert proc.returncode == 2 and extra in proc.stderr and "not used" in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    attn = {f"first_stage_model.encoder.down.0.attn.{i}.{n}.weight": ("F16", (2,), np.ones(2))
            for i in range(4) for n in ("q", "k", "v", "proj_out")}    # an LDM VAE with attn_resolutions
    path = _retyped(demo_ckpt, tmp_path, "vae-attn.safetensors", add=attn)
    proc = precast("export", path, "--out", tmp_path / "o3", "--component", "vae_encoder")
    assert proc.returncode == 2 and "16 tensor(s) not used" in proc.stderr and len(proc.stderr) < 700, proc.stderr
    assert "Attention inside the VAE's down/up blocks" in proc.stderr and "not supported yet" in proc.stderr


@pytest.mark.parametrize("keys, family", [
    ({"control_model.zero_convs.0.0.weight": [320, 320, 1, 1], "control_model.input_hint_block.0.weight": [16, 3, 3, 3]},
     "controlnet"),
])
def test_other_families_are_detected_and_refused(tmp_path, keys, family):
    path = _zeros_file(tmp_path / "m.safetensors", keys)
    proc = precast("export", path, "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert f"detected {family}" in proc.stderr and "not supported yet" in proc.stderr, proc.stderr


def test_a_damaged_sd3_file_is_one_line_naming_what_is_missing(tmp_path):
    path = _zeros_file(tmp_path / "m.safetensors", {"joint_blocks.0.context_block.attn.qkv.weight": [4, 4]})
    proc = precast("export", path, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "no SD3 transformer" in proc.stderr and "x_embedder.proj.weight" in proc.stderr, proc.stderr


def test_a_vae_alone_or_one_diffusers_component_is_pointed_to_the_right_input(tmp_path):
    vae = _zeros_file(tmp_path / "vae.safetensors", {"first_stage_model.decoder.conv_in.weight": [8, 4, 3, 3]})
    proc = precast("export", vae, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "holds a VAE only" in proc.stderr and "--vae FILE" in proc.stderr, proc.stderr
    bare = _zeros_file(tmp_path / "diffusion_pytorch_model.safetensors",
                       {"conv_in.weight": [8, 4, 3, 3], "down_blocks.0.resnets.0.conv1.weight": [8, 8, 3, 3]})
    proc = precast("export", bare, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "not a recognised" in proc.stderr and "model_index.json" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_bad_options_are_named(demo_ckpt, tmp_path):
    proc = precast("export", demo_ckpt, "--out", tmp_path / "o", "--component", "controlnet")
    assert proc.returncode == 2 and "'controlnet'" in proc.stderr
    proc = precast("export", demo_ckpt, "--out", tmp_path / "o", "--set", "unet.num_heads=3")
    assert proc.returncode == 2 and "num_heads" in proc.stderr
    proc = precast("export", tmp_path / "nothing.safetensors", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "no such file" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("keys, family", [
    ({"model.diffusion_model.input_blocks.0.0.weight": [320, 4, 3, 3],
      "model.diffusion_model.label_emb.0.0.weight": [1280, 2816],
      "conditioner.embedders.1.model.ln_final.weight": [1280]}, "sdxl"),
    ({"model.diffusion_model.input_blocks.0.0.weight": [384, 4, 3, 3],
      "model.diffusion_model.label_emb.0.0.weight": [1536, 2560]}, "sdxl-refiner"),
])
def test_damaged_supported_families_name_what_is_missing(tmp_path, keys, family):
    path = _zeros_file(tmp_path / "m.safetensors", keys)
    proc = precast("export", path, "--out", tmp_path / "o", "--component", "unet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "missing" in proc.stderr or "no " in proc.stderr
    assert not (tmp_path / "o").exists()


def test_any_missing_tensor_is_bad_input_not_a_crash(tmp_path):
    """Drop one tensor at a time (60 seeded picks across SD 1.x and SDXL layouts): always BadInput."""
    from precast.compiler.demo_model import TINY, TINY_SDXL, sd1_layout, write_safetensors
    from precast.compiler.errors import BadInput
    from precast.compiler.export import export
    rng = np.random.default_rng(11)
    for cfg in (TINY, TINY_SDXL):
        layout = sd1_layout(cfg)
        keys = sorted(layout)
        for i in rng.choice(len(keys), 30, replace=False):
            shapes = {k: v for k, v in layout.items() if k != keys[i]}
            path = tmp_path / f"{cfg.family}.safetensors"
            write_safetensors(str(path), shapes, "fp16", lambda k, s: np.zeros(s, np.float32))
            with pytest.raises(BadInput):
                export(path, tmp_path / "out", dtype="fp32", progress=False)
            assert not (tmp_path / "out").exists(), keys[i]


def test_out_that_is_the_source_folder_or_any_other_folder_is_kept(tmp_path):
    """Before: `export pipe --out pipe` replaced the diffusers folder's unet/ with the ONNX one."""
    from diffusers import UNet2DConditionModel
    pipe = tmp_path / "pipe"
    UNet2DConditionModel(sample_size=8, block_out_channels=(32, 32), layers_per_block=1, cross_attention_dim=32,
                         down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=4,
                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")).save_pretrained(pipe / "unet")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    before = _digests(pipe)
    proc = precast("export", pipe, "--out", pipe)
    assert proc.returncode == 2 and "is not a precast export" in proc.stderr, proc.stderr
    assert _digests(pipe) == before
    precast("export", pipe, "--out", tmp_path / "onnx", check=True)     # an earlier export may be updated
    precast("export", pipe, "--out", tmp_path / "onnx", check=True)


def test_a_pipe_as_checkpoint_does_not_block(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", "export", str(fifo), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a file" in proc.stderr and "Traceback" not in proc.stderr


def test_damaged_weights_are_named_not_exported(demo_ckpt, tmp_path):
    """NaN/inf weights, weights past fp16's range in an fp16 export, integer weights: before, exit 0."""
    key = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"
    arr = SafetensorsFile(demo_ckpt).read(key).astype(np.float32)
    nan, big = arr.copy(), arr.copy()
    nan.flat[7] = np.nan
    big.flat[3] = 1e6
    cases = {"nan": (("F32", arr.shape, nan), [], "holds NaN or infinite values"),
             "big": (("F32", arr.shape, big), ["--dtype", "fp16"], "beyond the range of float16; export with --dtype fp32"),
             "int": (("I16", arr.shape, arr.astype(np.int16)), [], "is stored as I16"),
             "flat": (("F32", (arr.size,), arr.ravel()), [], "shapes do not fit a sd1 unet"),
             "reshaped": (("F32", (arr.shape[0], arr.shape[1] * 9, 1, 1), arr), [],   # same bytes, other shape
                          f"takes {arr.shape[1] * 9} channels where the graph has {arr.shape[1]}")}
    for name, (tensor, args, words) in cases.items():
        path = _retyped(demo_ckpt, tmp_path, f"{name}.safetensors", drop=[key], add={key: tensor})
        proc = precast("export", path, "--out", tmp_path / name, "--component", "unet", *args)
        assert proc.returncode == 2 and words in proc.stderr, (name, proc.stderr)
        assert key in proc.stderr or name == "flat", (name, proc.stderr)
        assert "Traceback" not in proc.stderr and not (tmp_path / name).exists(), name
    path = _retyped(demo_ckpt, tmp_path, "big-fp32.safetensors", drop=[key], add={key: cases["big"][0]})
    precast("export", path, "--out", tmp_path / "fp32", "--component", "unet", check=True)   # fp32 holds 1e6


def test_an_out_path_the_os_refuses_is_one_line(demo_ckpt, tmp_path):
    for out in (tmp_path / ("a" * 300), "/proc/precast-out"):
        proc = precast("export", demo_ckpt, "--out", out, "--component", "unet")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "check the path" in proc.stderr
