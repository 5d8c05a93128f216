"""Edits to the inputs and outputs of a converted OpenVINO model, so that another runtime's host code can feed it.

Owns: the few IO rewrites `precast export-openvino-genai` needs where OpenVINO GenAI's pipelines feed a model in
another form than precast's runtime does (compiler/families/*.py compose them per family): an input's element
type, position ids fed batched, inputs replaced by values computed in the graph from new ones, outputs mapped by
an op, a single-frame 5-D image fed to a 4-D model. Each takes and returns an `ov.Model`; the `openvino` package is imported by the
caller (an optional dependency).
"""
from __future__ import annotations


def _ops():
    from openvino import opset13
    return opset13


def parameter(ov, name: str, element_type, shape):
    """A new named Parameter (name on the node and its tensor, as converted models have them)."""
    param = _ops().parameter(ov.PartialShape(shape), element_type, name)
    param.set_friendly_name(name)
    param.output(0).get_tensor().set_names({name})
    return param


def retype(ov, model, types: dict):
    """Inputs `types` (name -> ov.Type) taken in that element type, converted inside the model."""
    ppp, changed = ov.preprocess.PrePostProcessor(model), False
    for name, want in types.items():
        if model.input(name).get_element_type() != want:
            ppp.input(name).tensor().set_element_type(want)
            changed = True
    return ppp.build() if changed else model


def computed_inputs(model, new: list, values: dict):
    """The model with the inputs named in `values` (name -> an output computed from the Parameters `new`)
    replaced by those values and `new` added as its inputs."""
    for name, value in values.items():
        old = model.input(name).get_node()      # a tensor may carry several names (a folded Convert's too)
        old.output(0).get_tensor().set_names(set())
        for target in list(old.output(0).get_target_inputs()):
            target.replace_source_output(value)
        model.remove_parameter(old)
    model.add_parameters(new)
    model.validate_nodes_and_infer_types()
    return model


def batched_inputs(ov, model, names: tuple[str, ...]):
    """Inputs `names` ([S, k]: one set of rows for the whole batch, as precast's graphs take position ids) fed
    batched, [B, S, k], as GenAI feeds them: the first batch row is read."""
    ops, new, values = _ops(), [], {}
    for name in names:
        param = model.input(name).get_node()
        batched = parameter(ov, name, param.get_element_type(), [-1, *param.get_partial_shape()])
        new.append(batched)
        values[name] = ops.gather(batched, ops.constant(0), ops.constant(0)).output(0)
    return computed_inputs(model, new, values)


def single_frame(ov, model):
    """A 4-D image model ([B, C, H, W] in and out) as the 5-D one-frame model a video VAE's host feeds:
    [B, C, 1, H, W] in and out, names kept."""
    ops = _ops()
    (old,) = model.get_parameters()
    names, shape = old.output(0).get_names(), old.get_output_partial_shape(0)
    old.output(0).get_tensor().set_names(set())
    new = parameter(ov, old.get_friendly_name(), old.get_element_type(), [shape[0], shape[1], 1, shape[2], shape[3]])
    new.output(0).get_tensor().set_names(names)
    frame = ops.squeeze(new, ops.constant([2]))
    for target in list(old.output(0).get_target_inputs()):
        target.replace_source_output(frame.output(0))
    model = ov.Model([ops.result(r.input_value(0)) for r in model.get_results()], [new], model.get_friendly_name())
    return mapped_outputs(ov, model, lambda x: ops.unsqueeze(x, ops.constant([2])))


def mapped_outputs(ov, model, fn):
    """The model with each output x replaced by fn(x) (an op on it), under x's names."""
    ops, results = _ops(), []
    for port in model.outputs:
        names, source = port.get_names(), port.get_node().input_value(0)
        source.get_tensor().set_names(set())
        out = fn(source)
        out.output(0).get_tensor().set_names(names)
        results.append(ops.result(out))
    return ov.Model(results, model.get_parameters(), model.get_friendly_name())
