"""Attention in one precision for OpenVINO: a rewrite of an OpenVINO model.

Owns: moving the fp32 casts of a half-precision export's attention from around its softmax to its
inputs and output. precast's graphs compute q k^T in the export's dtype, cast the scores to fp32
for the scale, mask and softmax, and cast the probabilities back before the product with v (the
portable way: every backend keeps the softmax exact). OpenVINO's CPU plugin fuses attention into
one kernel only when MatMul -> [Multiply] [Add] -> Softmax -> MatMul has no Convert inside, so
there a bf16 export ran two MatMuls and a Softmax per attention, materialising the fp32 scores
(2 GB per layer for Flux at 1024x1024). Rewritten, the chain reads fp32 q, k, v and is fused; the
arithmetic is the same the plugin does for an fp32 export (same error against the reference).
Used by the compiler's OpenVINO target and by the runtime's compile-on-load fallback (openvino only).
"""
from __future__ import annotations

HALF = ("bf16", "f16")
PASS = ("Multiply", "Add")          # ops allowed between the scores' Convert and the Softmax


def _type(output) -> str:
    return output.get_element_type().get_type_name()


def _only_consumer(output):
    targets = list(output.get_target_inputs())
    return targets[0].get_node() if len(targets) == 1 else None


def _scores_convert(softmax):
    """The Convert(half -> f32) of a MatMul's output that feeds `softmax` through Multiply/Add, else None."""
    node = softmax.input_value(0).get_node()
    while node.get_type_name() in PASS:
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Convert" or _type(node.output(0)) != "f32":
        return None
    matmul = node.input_value(0).get_node()
    if matmul.get_type_name() != "MatMul" or _type(matmul.output(0)) not in HALF:
        return None
    return node


def rewrite_attention(model) -> int:
    """Rewrite every half-precision attention of the model; returns how many."""
    import openvino.opset13 as ops
    count = 0
    for op in list(model.get_ordered_ops()):
        if op.get_type_name() != "Softmax":
            continue
        convert = _scores_convert(op)
        back = _only_consumer(op.output(0))
        if convert is None or back is None or back.get_type_name() != "Convert":
            continue
        half = _type(back.output(0))
        product = _only_consumer(back.output(0))
        if half not in HALF or product is None or product.get_type_name() != "MatMul" or \
                product.input_value(0).get_node() is not back:
            continue
        scores = convert.input_value(0).get_node()
        a, b = scores.get_attributes()["transpose_a"], scores.get_attributes()["transpose_b"]
        exact = ops.matmul(ops.convert(scores.input_value(0), "f32"), ops.convert(scores.input_value(1), "f32"), a, b)
        convert.output(0).replace(exact.output(0))
        pa, pb = product.get_attributes()["transpose_a"], product.get_attributes()["transpose_b"]
        out = ops.matmul(op.output(0), ops.convert(product.input_value(1), "f32"), pa, pb)
        product.output(0).replace(ops.convert(out, half).output(0))
        count += 1
    if count:
        model.validate_nodes_and_infer_types()
    return count
