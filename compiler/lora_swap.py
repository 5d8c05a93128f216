"""Changing the LoRAs (or their strengths) of an already exported / built engine, without a re-export.

Owns: the base weights of a component (read from its ONNX external data, never from a previously
patched engine: every swap starts from the base, the refit pitfall of TensorRT #3628), the merged
values a LoRA set gives (compiler/lora_merge.py, the same math as the export), and putting them
into an engine:

- OpenVINO, `OpenVinoLoraEngine`, two ways, measured in benchmarks/lora.py:
  "recompile" (the default, chosen): the ov.Model read once from the ONNX keeps its weight
  Constants; a swap puts new Constants for the weights the old and new LoRA sets touch and
  compiles again. Inference runs at full speed (weights are constants the plugin prepacks).
  "state" (experimental, off unless asked for with experimental=True): every LoRA-able weight
  becomes a ReadValue variable initialised from its Constant and a swap writes merged values
  into the infer request's state, with no compile -- ~50x faster swaps on the tiny model, but on
  OpenVINO 2026.4's CPU plugin Linear (MatMul) weights behind a ReadValue give wrong results
  (conv weights are right), even before any swap; so "recompile" is what precast uses.
- TensorRT-RTX, `refit_tensorrt_rtx`: an engine built refittable is refit by initializer name
  (names are checkpoint names) with base + delta for every weight the old or new set touches.
  Written against the TensorRT-RTX 1.7 Python API; NOT VERIFIED ON HARDWARE (needs a GPU driver).

The name table is built from this component's weights only, so LoRA keys naming other components
(a text-encoder part when swapping the UNet) are skipped here; `precast export` checks them all.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx

from .errors import BadInput
from .lora_merge import LoraSpec, MergePlan, plan_merge
from .sources.lora import read_lora
from .sources.lora_names import build_name_table, targets_of

_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


class BaseWeights:
    """A component's initializers as read-only arrays over its external-data file (memory-mapped)."""

    def __init__(self, onnx_path: str | Path):
        self.path = Path(onnx_path)
        model = onnx.load(str(self.path), load_external_data=False)
        meta = {p.key: p.value for p in model.metadata_props}
        self.prefix = meta.get("precast.prefix", "")
        self.component = meta.get("precast.component", self.path.parent.name)
        data = self.path.with_name(self.path.name + "_data")
        self._map = np.memmap(data, dtype=np.uint8, mode="r") if data.exists() else None
        self.info: dict[str, tuple[int, int, type, tuple[int, ...]]] = {}
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type not in _NP:
                continue
            ext = {e.key: e.value for e in t.external_data}
            self.info[t.name] = (int(ext["offset"]), int(ext["length"]), _NP[t.data_type], tuple(t.dims))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical key -> shape, for the LoRA name table."""
        return {self.prefix + n: s for n, (_, _, _, s) in self.info.items()}

    def read(self, name: str) -> np.ndarray:
        off, length, dtype, shape = self.info[name]
        return np.frombuffer(self._map[off:off + length], dtype=dtype).reshape(shape)

    def merged(self, plan: MergePlan, names) -> dict[str, np.ndarray]:
        """Initializer name -> base + the plan's patches, in the initializer's own dtype."""
        out = {}
        for name in names:
            base = self.read(name)
            out[name] = plan.apply(self.prefix + name, base).astype(base.dtype, copy=False)
        return out


def plan_for(base: BaseWeights, loras: list[LoraSpec]) -> MergePlan:
    shapes = base.shapes()
    return plan_merge(shapes, loras, allow_unmatched=True, warn=lambda msg: None, table=build_name_table(shapes),
                      files=[read_lora(s.path) for s in loras])


def _names(base: BaseWeights, plan: MergePlan) -> set[str]:
    return {k[len(base.prefix):] for k in plan.touched()}


class OpenVinoLoraEngine:
    """An OpenVINO model of one exported component whose LoRA set can be changed in place."""

    def __init__(self, onnx_path: str | Path, device: str = "CPU", config: dict | None = None,
                 mode: str = "recompile", shapes: dict | None = None, experimental: bool = False):
        import openvino as ov
        if mode not in ("recompile", "state"):
            raise BadInput(f"lora swap mode {mode!r}: choose recompile or state")
        if mode == "state" and not experimental:
            raise BadInput("lora swap mode 'state' gives wrong results for Linear weights on OpenVINO's CPU "
                           "plugin (see compiler/lora_swap.py); use mode='recompile'")
        self.ov, self.mode, self.device, self.config = ov, mode, device, dict(config or {})
        self.base = BaseWeights(onnx_path)
        self.core = ov.Core()
        self.model = self.core.read_model(str(onnx_path))
        if shapes:
            self.model.reshape({k: ov.PartialShape([ov.Dimension(a, b) for a, b in zip(mn, mx)])
                                for k, (mn, _, mx) in shapes.items()})
        self.constants = {op.get_friendly_name(): op for op in self.model.get_ops()
                          if op.get_type_name() == "Constant" and op.get_friendly_name() in self.base.info}
        self.active: set[str] = set()          # initializer names currently holding merged values
        self.loras: list[LoraSpec] = []
        if mode == "state":
            self._make_variables()
        self.compiled = self.core.compile_model(self.model, device, self.config)
        self.request = self.compiled.create_infer_request()

    def _make_variables(self) -> None:
        """Every weight a LoRA could name becomes a ReadValue variable initialised from its Constant."""
        from openvino import opset13 as ops
        from openvino.op.util import Variable, VariableInfo
        table = build_name_table(self.base.shapes())
        targets = {t.key[len(self.base.prefix):] for found in table.entries.values() for t in targets_of(found)}
        sinks, variables = [], []
        for name in sorted(targets & set(self.constants)):
            const = self.constants[name]
            info = VariableInfo()
            info.data_shape = const.get_output_partial_shape(0)
            info.data_type = const.get_output_element_type(0)
            info.variable_id = name
            var = Variable(info)
            consumers = list(const.output(0).get_target_inputs())
            rv = ops.read_value(const.output(0), var)
            for c in consumers:
                c.replace_source_output(rv.output(0))
            sinks.append(ops.assign(rv, var))
            variables.append(var)
        self.model.add_variables(variables)
        self.model.add_sinks(sinks)
        self.variables = {v.get_info().variable_id for v in variables}

    def set_loras(self, loras: list[LoraSpec] | list[tuple]) -> dict:
        """Switch to this LoRA set (empty: the base model). Returns timings in seconds."""
        t0 = time.perf_counter()
        specs = [s if isinstance(s, LoraSpec) else LoraSpec(str(s[0]), *(float(x) if x is not None else None
                                                                           for x in s[1:])) for s in loras]
        plan = plan_for(self.base, specs) if specs else None
        names = _names(self.base, plan) if plan else set()
        todo = names | self.active                  # weights to set: new ones, and old ones back to base
        values = self.base.merged(plan, todo) if plan else {n: self.base.read(n) for n in todo}
        t1 = time.perf_counter()
        if self.mode == "state":
            missing = sorted(n for n in todo if n not in self.variables)
            if missing:
                raise BadInput(f"state-mode engine has no variable for {missing[0]}; use mode='recompile'")
            for state in self.request.query_state():
                name = state.name
                if name in values:
                    state.state = self.ov.Tensor(np.ascontiguousarray(values[name]))
        else:
            for name, arr in values.items():
                old = self.constants[name]
                new = self.ov.op.Constant(np.ascontiguousarray(arr))
                new.set_friendly_name(name)
                old.output(0).replace(new.output(0))
                self.constants[name] = new
            self.compiled = self.core.compile_model(self.model, self.device, self.config)
            self.request = self.compiled.create_infer_request()
        self.active, self.loras = names, specs
        t2 = time.perf_counter()
        return {"merge_s": round(t1 - t0, 4), "apply_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
                "weights": len(todo)}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        types = {p.get_any_name(): p.get_element_type().to_dtype() for p in self.compiled.inputs}
        res = self.request.infer({k: np.ascontiguousarray(v, dtype=types.get(k, v.dtype)) for k, v in feeds.items()})
        return {sorted(p.get_names())[0]: np.array(res[p]) for p in self.compiled.outputs}


def refit_tensorrt_rtx(engine, onnx_path: str | Path, loras: list[LoraSpec], previous: list[LoraSpec] = (),
                       logger=None) -> dict:
    """Refit a refittable TensorRT-RTX engine (an ICudaEngine) to `loras`, starting from the base
    weights: every weight that `previous` or `loras` touches gets base + the new deltas.
    NOT VERIFIED ON HARDWARE: refitting needs an NVIDIA GPU driver; written against the
    TensorRT-RTX 1.7 Python API (trt.Refitter, set_named_weights, refit_cuda_engine)."""
    try:
        import tensorrt_rtx as trt
    except ImportError:
        raise BadInput("tensorrt-rtx refit: the tensorrt-rtx package is not installed") from None
    if engine is None:
        raise BadInput("tensorrt-rtx refit: no engine (deserialize a refittable engine on a GPU first)")
    base = BaseWeights(onnx_path)
    new = plan_for(base, list(loras)) if loras else None
    old = plan_for(base, list(previous)) if previous else None
    names = (_names(base, new) if new else set()) | (_names(base, old) if old else set())
    values = base.merged(new, names) if new else {n: base.read(n) for n in names}
    refitter = trt.Refitter(engine, logger or trt.Logger(trt.Logger.WARNING))
    refittable = set(refitter.get_all_weights())
    missing = sorted(n for n in names if n not in refittable)
    if missing:
        raise BadInput(f"tensorrt-rtx refit: the engine cannot refit {missing[0]} (built without REFIT, or the "
                       "weight was folded); build with refittable=true")
    keep = []
    for name in sorted(names):
        arr = np.ascontiguousarray(values[name])
        keep.append(arr)  # the refitter reads the host memory at refit time
        if not refitter.set_named_weights(name, trt.Weights(arr)):
            raise RuntimeError(f"tensorrt-rtx refit: set_named_weights({name}) failed")
    if not refitter.refit_cuda_engine():
        raise RuntimeError("tensorrt-rtx refit failed: " + json.dumps(list(refitter.get_missing_weights())))
    return {"weights": len(names)}
