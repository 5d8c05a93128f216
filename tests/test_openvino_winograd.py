"""The OpenVINO target's Winograd rewrite computes the same convolution as OpenVINO's direct one."""
from __future__ import annotations

import numpy as np
import pytest

ov = pytest.importorskip("openvino")
import openvino.opset13 as ops  # noqa: E402

from precast.compiler.targets.openvino_winograd import pays, rewrite_convolutions, transformed_weights  # noqa: E402


def _model(x_shape, w, b, stride=1, pad=1):
    x = ops.parameter(list(x_shape), np.float32, name="x")
    y = ops.convolution(x, ops.constant(w), [stride, stride], [pad, pad], [pad, pad], [1, 1])
    y = ops.add(y, ops.constant(b.reshape(1, -1, 1, 1)))
    return ov.Model([ops.relu(y)], [x])


def _run(model, x):
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled({"x": x})[0]


@pytest.mark.parametrize("shape", [(2, 256, 16, 16), (1, 256, 18, 22), (1, 320, 17, 16)])
def test_winograd_matches_direct_convolution(shape):
    n, c, h, w = shape
    rng = np.random.default_rng(0)
    k = 288
    weights = (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    bias = rng.standard_normal(k).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    rewritten = _model(shape, weights, bias)
    info = rewrite_convolutions(rewritten, min_size=16)
    assert info["convolutions"] == 1 and info["weight_bytes_after"] == 4 * weights.nbytes
    assert "ExtractImagePatches" in {op.get_type_name() for op in rewritten.get_ordered_ops()}
    want = _run(_model(shape, weights, bias), x)
    got = _run(rewritten, x)
    assert got.shape == want.shape == (n, k, h, w)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_only_convolutions_where_winograd_pays_are_rewritten():
    rng = np.random.default_rng(1)
    small = (rng.standard_normal((64, 64, 3, 3)) * 0.1).astype(np.float32)        # too few channels
    strided = (rng.standard_normal((256, 256, 3, 3)) * 0.1).astype(np.float32)
    assert rewrite_convolutions(_model((1, 64, 32, 32), small, np.zeros(64, np.float32)))["convolutions"] == 0
    assert rewrite_convolutions(_model((1, 256, 32, 32), strided, np.zeros(256, np.float32), stride=2))[
        "convolutions"] == 0
    assert not pays(1280, 1280, 8, 8) and pays(320, 320, 64, 64)


def test_winograd_starts_at_32_unless_told():
    """By default (and with target option `winograd: 32`) the 16x16 convolutions, whose transformed weights are most
    of a UNet's memory, stay direct and the 32x32 ones are rewritten; `winograd: 16` rewrites the 16x16 ones too;
    the option takes true, false or a side >= 1, else one line."""
    from precast.compiler.errors import BadInput
    from precast.compiler.targets import parse_target
    w = (np.random.default_rng(2).standard_normal((256, 256, 3, 3)) * 0.05).astype(np.float32)
    b = np.zeros(256, np.float32)
    assert rewrite_convolutions(_model((1, 256, 16, 16), w, b))["convolutions"] == 0
    assert rewrite_convolutions(_model((1, 256, 32, 32), w, b))["convolutions"] == 1
    assert rewrite_convolutions(_model((1, 256, 16, 16), w, b), min_size=16)["convolutions"] == 1
    assert dict(parse_target("openvino", {"winograd": 32}).options)["winograd"] == 32
    for bad in (0, "32", 1.5):
        with pytest.raises(BadInput, match="winograd="):
            parse_target("openvino", {"winograd": bad})


def test_transformed_weights_are_g_w_gt():
    from precast.compiler.targets.openvino_winograd import G
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    u = transformed_weights(w, chunk=2)
    k, c = 4, 2
    assert np.allclose(u[:, k, c].reshape(6, 6), G @ w[k, c].astype(np.float64) @ G.T, atol=1e-6)
