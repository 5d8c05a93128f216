"""GGUF blocks kept in engines (issue 20: `weights: gguf`): a tiny Flux schnell transformer written as
ComfyUI-GGUF files (Q8_0, Q4_0, and a mix with a K-quant and float tensors), exported bf16, compiled for
ONNX Runtime (MatMulNBits) and OpenVINO (grouped i8 / i4 constants) keeping each Q8_0 / Q4_0 weight's
blocks as they are.

Proof of "as they are": the engines' outputs equal, to float32 accumulation order, the fp32 export of the
same file -- whose weights are gguf's own exact dequantization d * q -- although the compiled export is
bf16 (its weights rounded). Re-quantizing instead (`weights: int8` / `int4` on the same bf16 export)
misses by orders of magnitude more; that contrast is asserted too, so the test fails if blocks are
re-derived. OpenVINO's CPU plugin quantizes activations on the fly by default, so its IR is compiled here
with that off (DYNAMIC_QUANTIZATION_GROUP_SIZE 0) to see the weights alone.
"""
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest

from conftest import precast
from test_gguf import AXES, Q, _flux_feeds, _run, _weights, gguf, write_gguf
from precast.compiler.demo_dit import TINY_FLUX_SCHNELL, flux_layout

FEEDS = _flux_feeds()
SHAPES = ("--height", "64", "--width", "64", "--t5-tokens", str(FEEDS["encoder_hidden_states"].shape[1]))


def _write_blocks(path, kind, seed: int) -> None:
    """Every 2-D weight whose rows are whole blocks in `kind`, the rest F32 (as city96's converter keeps
    1-D tensors) holding bf16 values, so that the bf16 export differs from the fp32 one only in the
    block weights (rounded to bf16 there)."""
    w = gguf.GGUFWriter(str(path), arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, arr in _weights(flux_layout(TINY_FLUX_SCHNELL), seed).items():
        arr = np.ascontiguousarray(arr, np.float32)
        if arr.ndim == 2 and arr.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, arr.astype(ml_dtypes.bfloat16).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _export(src, out, dtype):
    proc = precast("export", src, "--out", out, "--dtype", dtype, "--set", AXES, "--component", "transformer")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf-blocks")
    _write_blocks(tmp / "flux-Q8_0.gguf", Q.Q8_0, 2)
    _write_blocks(tmp / "flux-Q4_0.gguf", Q.Q4_0, 3)
    write_gguf(tmp / "flux-mixed.gguf", "flux", _weights(flux_layout(TINY_FLUX_SCHNELL), 4),
               types=(Q.Q4_0, Q.Q8_0, Q.Q4_K), flatten=True, seed=4)
    out = {}
    for name in ("Q8_0", "Q4_0", "mixed"):
        src = tmp / f"flux-{name}.gguf"
        out[name] = {d: _export(src, tmp / f"{name}-{d}", d) for d in ("fp32", "bf16")}
    return tmp, out


def _compile(export, cache, backend, *options):
    proc = precast("compile", export, "--target", backend, *[x for o in options for x in ("--option", o)],
                   *SHAPES, "--json", env={"PRECAST_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    (a,) = json.loads(proc.stdout)["artifacts"]
    return a, json.loads((Path(a["path"]) / "entry.json").read_text())["metadata"]


def _ort(path):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in FEEDS.items() if k in names})[0].astype(np.float64)


def _openvino(xml, precise=True):
    import openvino as ov
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32", **({"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"} if precise else {})}
    compiled = core.compile_model(core.read_model(str(xml)), "CPU", config)
    names = {i.get_any_name() for i in compiled.inputs}
    return np.asarray(compiled({k: v for k, v in FEEDS.items() if k in names})[0], np.float64)


def _err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_export_records_where_each_kept_weight_lies(made):
    """Every Q8_0 2-D weight is recorded (file, offset, rows); the record is beside model.onnx."""
    tmp, out = made
    report = json.loads((out["Q8_0"]["bf16"] / "precast_export.json").read_text())
    (comp,) = report["components"]
    n = sum(1 for t in gguf.GGUFReader(str(tmp / "flux-Q8_0.gguf")).tensors if t.tensor_type == Q.Q8_0)
    assert comp["gguf_blocks"] == {"file": "gguf_blocks.json", "types": {"Q8_0": n}, "weights": n}
    record = json.loads((out["Q8_0"]["bf16"] / "transformer" / "gguf_blocks.json").read_text())
    assert len(record["tensors"]) == n and list(record["files"]) == [str(tmp / "flux-Q8_0.gguf")]
    mixed = json.loads((out["mixed"]["bf16"] / "precast_export.json").read_text())["components"][0]["gguf_blocks"]
    assert set(mixed["types"]) == {"Q4_0", "Q8_0"}        # the K-quant and F16 / F32 weights are not recorded


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_onnxruntime_keeps_the_blocks_exactly(made, kind):
    tmp, out = made
    exact = _run(out[kind]["fp32"], "transformer", FEEDS)[0].astype(np.float64)   # gguf's d * q in fp32
    a, meta = _compile(out[kind]["bf16"], tmp / "cache", "onnxruntime", "weights=gguf")
    w = meta["weights"]
    assert w["format"] == "gguf" and w["requantized"] == 0 and list(w["gguf_blocks"]) == [kind], w
    assert w["gguf_blocks"][kind] == w["matmuls"]          # every Linear, the parts of fused weights too
    err = _err(_ort(a["artifact"]), exact)
    redone, _ = _compile(out[kind]["bf16"], tmp / "cache", "onnxruntime", "weights=" + ("int8" if kind == "Q8_0" else "int4"))
    err_redone = _err(_ort(redone["artifact"]), exact)
    print(kind, "kept", err, "re-quantized", err_redone)
    assert err < 1e-5 and err_redone > 100 * err, (err, err_redone)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_openvino_keeps_the_blocks_exactly(made, kind):
    tmp, out = made
    exact = _run(out[kind]["fp32"], "transformer", FEEDS)[0].astype(np.float64)
    a, meta = _compile(out[kind]["bf16"], tmp / "cache", "openvino:CPU", "weights=gguf", "store=ir")
    w = meta["weights"]
    constants = {"Q8_0": "i8", "Q4_0": "i4"}[kind]
    assert w["gguf_blocks"] == {kind: w["constants"][constants]} and w["constants"][constants] > 0, w
    assert set(w["constants"]) == {constants}, w          # nothing left for NNCF: every Linear kept
    err = _err(_openvino(a["artifact"]), exact)
    fast = _err(_openvino(a["artifact"], precise=False), exact)   # as the runtime compiles it
    assert err < 1e-5, err
    assert fast < 0.03, fast


def test_a_mixed_file_keeps_q8_0_and_q4_0_and_quantizes_the_rest(made):
    """Q4_K and float weights have no exact MatMulNBits / OpenVINO form: int8 by the target's quantizer,
    counted apart; the output stays within the int8 bound of test_quantized (relative L2 < 0.035)."""
    tmp, out = made
    exact = _run(out["mixed"]["fp32"], "transformer", FEEDS)[0].astype(np.float64)
    a, meta = _compile(out["mixed"]["bf16"], tmp / "cache", "onnxruntime", "weights=gguf")
    w = meta["weights"]
    assert set(w["gguf_blocks"]) == {"Q4_0", "Q8_0"} and w["requantized"] > 0, w
    assert sum(w["gguf_blocks"].values()) + w["requantized"] == w["matmuls"]
    assert _err(_ort(a["artifact"]), exact) < 0.035
    ov, ov_meta = _compile(out["mixed"]["bf16"], tmp / "cache", "openvino:CPU", "weights=gguf", "store=ir")
    assert ov_meta["weights"]["gguf_blocks"] == w["gguf_blocks"], (ov_meta["weights"], w)
    assert ov_meta["weights"]["requantized"] == w["requantized"], (ov_meta["weights"], w)
    assert _err(_openvino(ov["artifact"]), exact) < 0.035


def test_weights_gguf_is_refused_without_its_file(made, tmp_path):
    tmp, out = made
    # not exported from a .gguf file
    from safetensors.numpy import save_file
    save_file(_weights(flux_layout(TINY_FLUX_SCHNELL), 2), str(tmp_path / "flux.safetensors"))
    proc = precast("compile", _export(tmp_path / "flux.safetensors", tmp_path / "st", "bf16"), "--target", "onnxruntime", "--option", "weights=gguf", *SHAPES,
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "not made from a .gguf file" in proc.stderr and "Traceback" not in proc.stderr
    # the file moved away after the export
    src = tmp_path / "flux.gguf"
    _write_blocks(src, Q.Q8_0, 5)
    export = _export(src, tmp_path / "e", "bf16")
    src.rename(tmp_path / "moved.gguf")
    proc = precast("compile", export, "--target", "onnxruntime", "--option", "weights=gguf", *SHAPES,
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and str(src) in proc.stderr and "not there" in proc.stderr, proc.stderr
    # replaced by another file of the same size (other weights): the blocks no longer match the export
    _write_blocks(src, Q.Q8_0, 6)
    assert src.stat().st_size == (tmp_path / "moved.gguf").stat().st_size
    proc = precast("compile", export, "--target", "openvino:CPU", "--option", "weights=gguf", *SHAPES,
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "no longer match" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # put back: builds
    shutil.copyfile(tmp_path / "moved.gguf", src)
    proc = precast("compile", export, "--target", "onnxruntime", "--option", "weights=gguf", *SHAPES,
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr


def test_a_recipe_keeps_the_blocks_and_ships_no_local_paths(made, tmp_path):
    """`precast build` with weights: gguf: the transformer keeps its blocks; the bundle's onnx/ folder has
    no gguf_blocks.json (it names local paths). The file moved to another folder (same name, same bytes):
    the cached export's record is followed to the recipe's file, and an OpenVINO build still keeps them."""
    tmp, _ = made
    first = tmp_path / "a" / "flux-Q8_0.gguf"
    first.parent.mkdir()
    shutil.copyfile(tmp / "flux-Q8_0.gguf", first)
    recipe = ("model: {{source: {src}, set: {{transformer: {{axes_dims_rope: [4, 6, 6]}}}}}}\ncomponents: [transformer]\n"
              "precision: {{default: bf16}}\nprofiles: {{batch: 1, height: 64, width: 64, t5_tokens: 12}}\n"
              "targets:\n  - {target}\n")
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    (tmp_path / "r1.yaml").write_text(recipe.format(src=first, target="{onnxruntime: {weights: gguf}}"))
    proc = precast("build", tmp_path / "r1.yaml", "--out", tmp_path / "b1", env=env)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "b1" / "manifest.json").read_text())
    (art,) = manifest["artifacts"]
    assert art["metadata"]["weights"]["gguf_blocks"] == {"Q8_0": art["metadata"]["weights"]["matmuls"]}
    assert not [f for f in manifest["files"] if f.endswith("gguf_blocks.json")]
    moved = tmp_path / "b" / "flux-Q8_0.gguf"
    moved.parent.mkdir()
    first.rename(moved)
    (tmp_path / "r2.yaml").write_text(recipe.format(src=moved, target="{openvino: {device: CPU, weights: gguf}}"))
    proc = precast("build", tmp_path / "r2.yaml", "--out", tmp_path / "b2", env=env)
    assert proc.returncode == 0, proc.stderr
    (art,) = json.loads((tmp_path / "b2" / "manifest.json").read_text())["artifacts"]
    assert art["metadata"]["weights"]["gguf_blocks"]["Q8_0"] > 0 and art["metadata"]["weights"]["requantized"] == 0


def test_a_component_not_from_gguf_is_quantized_int8_and_says_so(made, tmp_path):
    """A Flux transformer from .safetensors with a T5 from a .gguf: weights: gguf keeps the T5's blocks,
    and the transformer (nothing to keep) is int8, said on stderr and in the metadata."""
    from safetensors.numpy import save_file
    from test_gguf import _llama_name
    from precast.compiler.demo_dit import TINY_T5, t5_layout
    save_file(_weights(flux_layout(TINY_FLUX_SCHNELL), 2), str(tmp_path / "flux.safetensors"))
    write_gguf(tmp_path / "t5.gguf", "t5encoder", {_llama_name(k): v for k, v in _weights(t5_layout(TINY_T5), 5).items()},
               types=(Q.Q8_0,))
    out = tmp_path / "e"
    proc = precast("export", tmp_path / "flux.safetensors", "--out", out, "--dtype", "bf16", "--set", AXES,
                   "--text-encoder", tmp_path / "t5.gguf", "--component", "transformer", "--component", "text_encoder_2")
    assert proc.returncode == 0, proc.stderr
    proc = precast("compile", out, "--target", "onnxruntime", "--option", "weights=gguf", *SHAPES, "--json",
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "note: transformer holds no weights copied from GGUF" in proc.stderr
    metas = {a["component"]: json.loads((Path(a["path"]) / "entry.json").read_text())["metadata"]["weights"]
             for a in json.loads(proc.stdout)["artifacts"]}
    assert metas["transformer"]["gguf_blocks"] == {} and metas["transformer"]["requantized"] > 0
    assert metas["text_encoder_2"]["gguf_blocks"].get("Q8_0", 0) > 0


def test_a_damaged_record_is_one_line(made, tmp_path):
    tmp, out = made
    export = tmp_path / "e"
    shutil.copytree(out["Q8_0"]["bf16"], export)
    record = export / "transformer" / "gguf_blocks.json"
    data = json.loads(record.read_text())
    name = next(iter(data["tensors"]))
    data["tensors"][name]["segments"][0][1] = 10 ** 12          # an offset past the end of the file
    record.write_text(json.dumps(data))
    proc = precast("compile", export, "--target", "onnxruntime", "--option", "weights=gguf", *SHAPES,
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "outside its GGUF file" in proc.stderr and "Traceback" not in proc.stderr
    record.write_text("{not json")
    proc = precast("compile", export, "--target", "onnxruntime", "--option", "weights=gguf", *SHAPES,
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "gguf_blocks.json: unreadable or damaged" in proc.stderr, proc.stderr
