"""The ONNX Runtime target's group-norm rewrite: same outputs as a numpy group norm, for any
input rank; nodes it cannot rewrite exactly are left as they are."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from precast.compiler.targets.onnxruntime_groupnorm import rewrite_group_norms


def _model(shape, groups, scale_as_input=False, opset=21):
    rng = np.random.default_rng(len(shape))
    c = shape[1]
    scale, bias = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    dims = ["n", c, *["d%d" % i for i in range(len(shape) - 2)]]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)]
    inits = [numpy_helper.from_array(bias, "bias")]
    if scale_as_input:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, [c]))
    else:
        inits.append(numpy_helper.from_array(scale, "scale"))
    node = helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["y"], num_groups=groups, epsilon=1e-5)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10), scale, bias


def _group_norm(x, groups, scale, bias, eps=1e-5):
    g = x.reshape(x.shape[0], groups, -1).astype(np.float64)
    g = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)
    bcast = (1, -1) + (1,) * (x.ndim - 2)
    return g.reshape(x.shape) * scale.reshape(bcast) + bias.reshape(bcast)


@pytest.mark.parametrize("shape, groups", [((2, 6, 5), 3), ((1, 8, 4, 6), 4), ((2, 4, 3, 2, 5), 2)])
def test_rewritten_group_norm_equals_numpy(shape, groups):
    model, scale, bias = _model(shape, groups)
    assert rewrite_group_norms(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "GroupNormalization" not in ops and "InstanceNormalization" in ops
    onnx.checker.check_model(model)
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, _group_norm(x, groups, scale, bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs", [{"scale_as_input": True}, {"opset": 18}])
def test_group_norms_it_cannot_rewrite_exactly_are_kept(kwargs):
    model, *_ = _model((1, 4, 3, 3), 2, **kwargs)
    assert rewrite_group_norms(model) == 0
    assert [n.op_type for n in model.graph.node] == ["GroupNormalization"]
