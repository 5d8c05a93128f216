"""ONNX folders precast did not write -> the component records `precast compile` builds from.

Owns: recognising a foreign Stable Diffusion ONNX folder (optimum-onnx's `optimum-cli export onnx`
layout, or a diffusers `OnnxStableDiffusionPipeline` folder: model_index.json plus one folder per
component holding model.onnx, no precast_export.json), reading each graph's inputs and outputs
without its weights, translating their axis names (optimum's batch_size / sequence_length /
height_latent / num_channels ..., diffusers' batch / channels / height ...) into precast's profile
dimension names (compiler/profiles.py), resolving symbolic channel axes to numbers, and inferring
the family from the graphs' IO (the family module's evidence: compiler/families/sd.py detect_onnx).
Nothing is written into the user's folder.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import BadInput
from .export_paths import beside
from .exported import ExportedComponent
from .families import detect_onnx_family

COMPONENTS = ("text_encoder", "text_encoder_2", "unet", "vae_encoder", "vae_decoder")
BATCH = {"batch_size", "batch", "unet_sample_batch", "N"}
SEQUENCE = {"sequence_length", "sequence", "seq_len", "sequence_len"}
STEPS = {"steps", "timestep_batch"}
HEIGHT = {"height", "height_latent", "latent_height", "h"}
WIDTH = {"width", "width_latent", "latent_width", "w"}
CHANNELS = {"num_channels", "num_channels_latent", "channels", "latent_channels", "c"}
NUMERIC_DTYPES = {"float32", "float16", "bfloat16", "int32", "int64"}


def is_foreign_folder(folder: str | Path) -> bool:
    """model_index.json and at least one component folder with a model.onnx, no precast_export.json."""
    folder = Path(folder)
    return (folder.is_dir() and not (folder / "precast_export.json").is_file()
            and (folder / "model_index.json").is_file()
            and any((folder / c / "model.onnx").is_file() for c in COMPONENTS))


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _io(values, path: Path) -> list[dict]:
    import onnx
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else "?")
                for d in t.shape.dim]
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        except (KeyError, ValueError, TypeError):
            raise BadInput(f"{path}: {v.name} has element type {t.elem_type}, which ONNX does not define; "
                           "re-export the model") from None
        out.append({"name": v.name, "dtype": dtype, "shape": dims})
    return out


def _conv_channels(model, tensor: str, consumer: bool) -> int | None:
    """The channel count a Conv reading (or writing) `tensor` has in its weight's header."""
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        w = inits[node.input[1]]
        if consumer and node.input[0] == tensor and len(w) == 4:
            return int(w[1])
        if not consumer and tensor in node.output and len(w) == 4:
            return int(w[0])
    return None


def _channels(comp: str, name: str, is_input: bool, cfg: dict, vae_cfg: dict, model) -> int:
    """A 4-D tensor's channel count: from the component's config.json, else the Conv next to it,
    else Stable Diffusion's (3 image, 4 latent channels)."""
    latent = int(vae_cfg.get("latent_channels") or 4)
    if comp == "unet":
        want = cfg.get("in_channels" if is_input else "out_channels")
    elif comp == "vae_decoder":
        want = latent if is_input else vae_cfg.get("out_channels")
    elif is_input:                                   # vae_encoder's image
        want = vae_cfg.get("in_channels")
    else:                                            # its moments (2 x latent) or a sampled latent
        want = 2 * latent if "parameters" in name else latent
    if isinstance(want, int) and want > 0:
        return want
    found = _conv_channels(model, name, consumer=is_input)
    if found:
        return found
    if comp != "unet" and not _latent_side(comp, is_input):
        return 3
    return 2 * latent if "parameters" in name else latent


def _latent_side(comp: str, is_input: bool) -> bool:
    """Whether a 4-D tensor's sides are latents (precast: the UNet's `height`/`width` are latents
    already; the VAE's are `latent_height`/`latent_width`)."""
    return (comp == "vae_decoder" and is_input) or (comp == "vae_encoder" and not is_input)


def map_dims(comp: str, tensor: dict, is_input: bool, channels) -> list:
    """Optimum / diffusers axis names -> precast's (compiler/profiles.py input_shapes)."""
    shape, out = tensor["shape"], []
    for i, d in enumerate(shape):
        if isinstance(d, int) and d > 0:
            out.append(d)
            continue
        spatial = len(shape) == 4 and i in (2, 3)
        if spatial and (d in HEIGHT | WIDTH or d == "?" or isinstance(d, str)):
            side = "height" if i == 2 else "width"
            out.append(f"latent_{side}" if _latent_side(comp, is_input) else side)
        elif len(shape) == 4 and i == 1:
            out.append(channels())
        elif d in BATCH or (i == 0 and d == "?"):
            out.append("batch")
        elif d in STEPS:
            out.append("steps")
        elif d in SEQUENCE or (comp.startswith("text_encoder") and i == 1 and len(shape) in (2, 3) and d == "?"):
            out.append("sequence")
        elif comp == "unet" and tensor["name"] == "encoder_hidden_states" and i == 1:
            out.append("sequence")
        elif not is_input:   # an exporter's generated name (no dynamic axis given): by position
            out.append("batch" if i == 0 else "sequence" if comp.startswith("text_encoder") and i == 1 else d)
        else:
            raise BadInput(f"{comp} {'input' if is_input else 'output'} {tensor['name']}: axis {i} is named {d!r}, "
                           "which precast cannot map to a profile dimension (batch, sequence, height, width); "
                           "re-export it with optimum's axis names or with `precast export`")
    return out


def read_component(folder: Path, comp: str, vae_cfg: dict):
    import onnx
    path = folder / comp / "model.onnx"
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise BadInput(f"{path}: not a readable ONNX model ({type(e).__name__})") from None
    cfg = _json(folder / comp / "config.json")
    inputs, outputs = _io(model.graph.input, path), _io(model.graph.output, path)
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in inputs if i["name"] not in inits]       # IR < 4 lists initializers as inputs
    for t in inputs:
        if t["dtype"] not in NUMERIC_DTYPES:
            raise BadInput(f"{path}: input {t['name']} is {t['dtype']}; precast builds float32/float16/bfloat16 "
                           "graphs with int32/int64 token ids")
    for group, is_input in ((inputs, True), (outputs, False)):
        for t in group:
            t["shape"] = map_dims(comp, t, is_input,
                                  lambda t=t, is_input=is_input: _channels(comp, t["name"], is_input, cfg, vae_cfg, model))
    files = {path.name: path.stat().st_size}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in tensor.external_data}.get("location", "")
            data = beside(path, loc, tensor.name)
            if not data.is_file():
                raise BadInput(f"{data}: missing (tensor {tensor.name} of {path} lies there)")
            files[loc] = data.stat().st_size
    floats = {t["dtype"] for t in inputs + outputs} & {"float32", "float16", "bfloat16"}
    dtype = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[floats.pop()] if len(floats) == 1 else None
    max_pos = cfg.get("max_position_embeddings") if comp.startswith("text_encoder") else None
    return ExportedComponent(comp, path, inputs, outputs, files, dtype,
                             max_pos if isinstance(max_pos, int) and max_pos > 0 else None), cfg


def _hidden(comp) -> int | None:
    for t in comp.inputs + comp.outputs:
        if t["name"] in ("last_hidden_state", "encoder_hidden_states") and len(t["shape"]) == 3 \
                and isinstance(t["shape"][2], int):
            return t["shape"][2]
    return None


def read_foreign(folder: str | Path) -> tuple[dict, dict]:
    """({name: ExportedComponent}, a precast_export.json-like report: family, components, source)."""
    folder = Path(folder)
    index = _json(folder / "model_index.json")
    vae_cfg = _json(folder / "vae_decoder" / "config.json") or _json(folder / "vae_encoder" / "config.json")
    comps, configs = {}, {}
    for name in COMPONENTS:
        if (folder / name / "model.onnx").is_file():
            comps[name], configs[name] = read_component(folder, name, vae_cfg)
    if not comps:
        raise BadInput(f"{folder}: has model_index.json but no component folder with a model.onnx "
                       f"({', '.join(COMPONENTS)})")
    family = detect_onnx_family(comps, index, _hidden)
    report = {"source": str(folder), "layout": "foreign-onnx", "family": family,
              "pipeline": index.get("_class_name"), "components": [
                  {"name": c.name, "path": f"{c.name}/model.onnx", "dtype": c.dtype, "inputs": c.inputs,
                   "outputs": c.outputs, "files": c.sizes, "config": configs[c.name]} for c in comps.values()]}
    return comps, report
