"""OpenVINO target option `compress_to_fp16`: the engine stores its weights in fp16, the arithmetic unchanged. On the
tiny SD UNet exported in fp32: the blob is smaller by at least 40 % of the weights' fp32 bytes (half of them, less
the few constants OpenVINO keeps wide); its output equals, to float32 rounding, an f32 engine compiled from the same
export with its weights rounded to fp16 beforehand; it is within fp16 rounding of the f32 engine, not equal to it;
with Winograd (static shapes) the transformed weights are stored in fp16 too."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import precast
from precast.compiler.targets.openvino import FP16_LEAST

ov = pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def export_pair(tmp_path_factory):
    """The tiny UNet exported in fp32 with its weights nudged off the fp16 grid (the demo's are fp16 values), and a
    copy whose weights are rounded to fp16 (still fp32; both changed in place: the files and sizes the export
    recorded, so each is compiled into a cache of its own)."""
    import onnx
    from onnx import TensorProto
    from precast.compiler.demo_model import write_demo_model
    from precast.compiler.export import export
    tmp = tmp_path_factory.mktemp("fp16w")
    write_demo_model(str(tmp / "tiny.safetensors"))
    out = Path(export(tmp / "tiny.safetensors", tmp / "exp", ["unet"], "fp32", progress=False)["out"])
    model = onnx.load(str(out / "unet" / "model.onnx"), load_external_data=False)
    rng, rounded = np.random.default_rng(3), tmp / "rounded"

    def change(folder, how):
        data = np.memmap(folder / "unet" / "model.onnx_data", np.uint8, "r+")
        for t in model.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL and t.data_type == TensorProto.FLOAT:
                e = {x.key: int(x.value) for x in t.external_data if x.key in ("offset", "length")}
                how(t, data[e["offset"]:e["offset"] + e["length"]].view(np.float32))
        data.flush()

    def nudge(t, w):
        w *= 1 + np.float32(2 ** -12) * rng.standard_normal(w.size).astype(np.float32)

    def round_weights(t, w):
        if np.prod(t.dims) >= FP16_LEAST:        # the weights; smaller constants stay as they are
            w[:] = w.astype(np.float16).astype(np.float32)
    change(out, nudge)
    shutil.copytree(out, rounded)
    change(rounded, round_weights)
    return out, rounded


def _compile(folder, tmp, *options, size=(64, 64)):
    cache = tmp / f"cache-{len(list(tmp.glob('cache-*')))}"
    proc = precast("compile", folder, "--target", "openvino", *[a for o in options for a in ("--option", o)],
                   "--height", str(size[0]), "--width", str(size[1]), "--json", env={"PRECAST_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    (record,) = json.loads(proc.stdout)["artifacts"]
    meta = json.loads((Path(record["path"]) / "entry.json").read_text())["metadata"]
    compiled = ov.Core().import_model(Path(record["artifact"]).read_bytes(), "CPU", meta["compile_config"])
    return record["size"], meta, compiled


def _feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"sample": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
            "timestep": np.array([500.0, 500.0], np.float32),
            "encoder_hidden_states": rng.standard_normal((2, 77, 64)).astype(np.float32)}


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_fp16_weights_are_f32_arithmetic_on_rounded_weights(export_pair, tmp_path):
    out, rounded = export_pair
    plain_size, _, plain = _compile(out, tmp_path, "winograd=false")
    half_size, meta, half = _compile(out, tmp_path, "winograd=false", "compress_to_fp16=true")
    _, _, reference = _compile(rounded, tmp_path, "winograd=false")
    assert meta["rewrites"]["weights_fp16"] > 0
    weights = (out / "unet" / "model.onnx_data").stat().st_size          # the export's fp32 weights
    assert plain_size - half_size >= 0.4 * weights, (plain_size, half_size, weights)   # 0.5: every weight halved
    feeds = _feeds()
    got, want, full = (m(feeds)[0] for m in (half, reference, plain))
    assert rel(got, want) <= 1e-5, rel(got, want)               # the same arithmetic on the same (rounded) weights
    assert 1e-6 < rel(got, full) <= 5e-3, rel(got, full)         # fp16 rounding of the weights, nothing more


def test_winograd_weights_are_stored_in_fp16_too():
    """Winograd's transformed weights (static shapes, channels where it pays: not the tiny UNet's) compressed
    after the rewrite: every large constant fp16, the bias and small ones f32, the output within fp16 rounding."""
    import openvino.opset13 as ops
    from precast.compiler.targets.openvino import compress_weights_fp16
    from precast.compiler.targets.openvino_winograd import rewrite_convolutions
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((256, 256, 3, 3)) / 48).astype(np.float32)
    b, x = rng.standard_normal(256).astype(np.float32), rng.standard_normal((1, 256, 32, 32)).astype(np.float32)

    def model():
        p = ops.parameter([1, 256, 32, 32], np.float32, name="x")
        y = ops.convolution(p, ops.constant(w), [1, 1], [1, 1], [1, 1], [1, 1])
        return ov.Model([ops.add(y, ops.constant(b.reshape(1, -1, 1, 1)))], [p])
    plain, half = model(), model()
    assert rewrite_convolutions(plain)["convolutions"] == rewrite_convolutions(half)["convolutions"] == 1
    assert compress_weights_fp16(half, ov) >= 1
    consts = [(op.get_element_type().get_type_name(), op.get_data().size) for op in half.get_ops()
              if op.get_type_name() == "Constant" and op.get_element_type().is_real()]
    assert all(t == "f16" for t, n in consts if n >= 4 * w.size) and ("f32", 256) in consts, consts
    run = lambda m: ov.Core().compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({"x": x})[0]  # noqa: E731
    assert 1e-6 < rel(run(half), run(plain)) <= 5e-3
