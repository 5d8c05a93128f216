"""Weight-only quantization's graph rewrites on small hand-made graphs (compiler/targets/quantize.py,
onnx_weights.py): the cases the tiny models do not reach -- scalar constants, a weight read both directly
and transposed, a small column slice of a half-precision weight, a weights file that cannot be hard-linked."""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from precast.compiler.targets import quantize

rng = np.random.default_rng(0)


def _save(graph, folder, name="model.onnx"):
    folder.mkdir(parents=True, exist_ok=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = folder / name
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=name + "_data", size_threshold=1024)
    return path


def _run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_scalar_constants_and_a_weight_read_both_ways(tmp_path):
    """A 0-d initializer keeps its shape (Range refuses a [1] tensor); a weight two MatMuls read, one
    through a Transpose, is quantized once per orientation."""
    w = rng.standard_normal((64, 64)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["a"]),
         helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "Wt"], ["b"]),
         helper.make_node("Range", ["zero", "n", "one"], ["r"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("a", "b")]
        + [helper.make_tensor_value_info("r", TensorProto.INT64, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array(5, np.int64), "n"), numpy_helper.from_array(np.array(1, np.int64), "one")])
    src = _save(g, tmp_path / "src")
    out = tmp_path / "q" / "model.onnx"
    out.parent.mkdir()
    info = quantize.quantize_onnxruntime(src, out, "int8")
    assert info["matmuls"] == 2
    x = rng.standard_normal((4, 64)).astype(np.float32)
    a, b, r = _run(out, {"x": x})
    assert _rel(a, x @ w) < 0.02 and _rel(b, x @ w.T) < 0.02
    assert r.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("links", [True, False])
def test_weights_as_parts_small_column_slice_and_no_hard_links(tmp_path, monkeypatch, links):
    """An fp16 weight cut by columns into a part under 1 MiB (copied, then widened), read back while the
    parts file is still being written; where the export's weights file cannot be hard-linked, a copy."""
    ov = pytest.importorskip("openvino")
    if not links:
        def refuse(*a, **k):
            raise OSError("cross-device link")
        monkeypatch.setattr(os, "link", refuse)
    w = rng.standard_normal((96, 64)).astype(np.float16)
    g = helper.make_graph(
        [helper.make_node("Slice", ["W", "s", "e", "ax"], ["Ws"]),
         helper.make_node("MatMul", ["x", "Ws"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([0], np.int64), "s"),
         numpy_helper.from_array(np.array([16], np.int64), "e"), numpy_helper.from_array(np.array([1], np.int64), "ax")])
    src = _save(g, tmp_path / "src")
    parts = tmp_path / "parts"
    parts.mkdir()
    path = quantize.weights_as_parts(src, parts)
    assert (parts / "model.onnx_data").stat().st_nlink == (2 if links else 1)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    got = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request().infer({"x": x})
    want = x @ w.astype(np.float32)[:, :16]
    assert _rel(np.asarray(next(iter(got.values()))), want) < 1e-5
