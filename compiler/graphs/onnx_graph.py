"""The ONNX graph under construction and its primitives.

Owns: turning builder calls (`g.op("MatMul", x, w)`, and the layers of layers.py such as
`g.conv2d(x, "input_blocks.0.0")`) into ONNX nodes; binding weights by their checkpoint name (the
initializer keeps that name and shape, so a refit or a LoRA patch can find it); the dtype a graph and a
block compute in (casts to and from fp32); the checks a header allows (weight dtypes and shapes, channel
counts, coverage of the checkpoint's tensors).

Building a graph reads only the checkpoint header; tensor bytes are read when the model is
written (onnx_writer.py).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import BadInput
from ..sources.safetensors_file import FLOAT_DTYPES
from .layers import Layers

OPSET = 21
IR_VERSION = 10
FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
INT64, INT32 = TensorProto.INT64, TensorProto.INT32
NP_OF = {FLOAT: np.float32, FLOAT16: np.float16, BFLOAT16: np.dtype(ml_dtypes.bfloat16)}
DTYPES = {"fp32": FLOAT, "fp16": FLOAT16, "bf16": BFLOAT16}     # --dtype -> ONNX element type
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ALIGN_SMALL, ALIGN_LARGE, LARGE = 64, 4096, 1 << 20
# unused checkpoint tensors that mean a known layout this builder does not write: (pattern, why)
UNBUILT = [(r"(^|\.)(encoder\.down|decoder\.up)\.\d+\.attn\.", "Attention inside the VAE's down/up blocks "
            "(attn_resolutions; diffusers AttnDownEncoderBlock2D / AttnUpDecoderBlock2D) is not supported yet")]
CHANNELS_KEPT = {"Add", "Sub", "Mul", "Div", "Sigmoid", "Cast", "Pad", "Resize", "GroupNormalization", "Identity", "Relu",
                 "Tanh"}
# ops whose output has the last-axis width of their first input of known width (Linear input checks)
WIDTH_KEPT = {"Add", "Sub", "Mul", "Div", "Sigmoid", "Cast", "Gelu", "Tanh", "LayerNormalization", "Identity", "Clip",
              "Where"}


@dataclass(frozen=True)
class Weight:
    name: str                 # initializer name = component-relative checkpoint key
    key: str                  # full canonical checkpoint key
    shape: tuple[int, ...]
    elem_type: int
    take: tuple[int, int] | None = None     # (axis, index): the one slice of the stored tensor the graph reads


class Graph(Layers):
    """Nodes, inputs, outputs and weight requests of one component graph (its layers: layers.py)."""

    def __init__(self, name: str, ckpt, prefix: str, dtype: str):
        if dtype not in DTYPES:
            raise BadInput(f"--dtype {dtype!r}: choose {', '.join(DTYPES)}")
        self.name, self.ckpt, self.prefix = name, ckpt, prefix
        self.dtype = DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.consts: list[onnx.TensorProto] = []
        self.weights: dict[str, Weight] = {}
        self.missing: list[str] = []
        self.renames: dict[str, str] = {}
        self.skipped: set[str] = set()   # checkpoint keys known to be unused by this graph
        self.channels: dict[str, int] = {}   # NCHW tensor -> its channel count, where known (checks conv weights)
        self.widths: dict[str, int] = {}     # tensor -> its last axis, where known (checks Linear weights)
        self.notes: list[str] = []           # precision choices made while building, for the manifest
        self.config_extra: dict = {}         # what the builder adds to the component's config record
        self._n = 0

    # ---- names, weights, constants -------------------------------------------------
    def _fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def has(self, key: str) -> bool:
        return self.prefix + key in self.ckpt.refs

    def count(self, fmt: str) -> int:
        """How many consecutive indexed blocks exist, e.g. count("input_blocks.{}")."""
        n = 0
        while any(k.startswith(self.prefix + fmt.format(n) + ".") for k in self.ckpt.refs):
            n += 1
        return n

    def shape(self, key: str) -> tuple[int, ...]:
        if self.prefix + key not in self.ckpt.refs:
            raise BadInput(f"{self.ckpt.path}: missing tensor {self.prefix + key} needed by the {self.name}; "
                           "the checkpoint is incomplete or damaged (or of another layout)")
        return self.ckpt.shape(self.prefix + key)

    def param(self, key: str, fp32: bool = False, take: tuple[int, int] | None = None) -> str:
        """Bind a checkpoint tensor (name relative to this component's prefix); `take` (axis, index): only that
        slice of it is written (e.g. the last time slice of a causal 3-D kernel run on one frame)."""
        full = self.prefix + key
        if full not in self.ckpt.refs:
            self.missing.append(full)
            return key
        if key not in self.weights:
            ref = self.ckpt.refs[full]
            for f, k in ref.stored:
                stored = f.tensors[k].dtype
                if stored not in getattr(f, "float_dtypes", FLOAT_DTYPES):   # a GGUF file: its (de)quantized types
                    raise BadInput(f"{f.path}: {k} is stored as {stored}; a weight must be a float tensor "
                                   f"({', '.join(FLOAT_DTYPES)}): the file is damaged or not a model checkpoint")
            if ref.scale is not None and ref.file.tensors[ref.scale].shape not in ((), (1,)):
                raise BadInput(f"{ref.file.path}: {ref.scale} has shape {list(ref.file.tensors[ref.scale].shape)}; a "
                               "scaled-fp8 weight scale is one number: the file is damaged")
            elem = FLOAT if fp32 else self.dtype
            shape = tuple(self.ckpt.shape(full))
            if take is not None:
                shape = shape[:take[0]] + shape[take[0] + 1:]
            self.weights[key] = Weight(key, full, shape, elem, take)
        return key

    def skip(self, keys: list[str]) -> None:
        """Mark tensors of this component that the graph deliberately does not use (e.g. the
        last CLIP layer when the model reads the penultimate one): not written, not reported."""
        self.skipped.update(self.prefix + k for k in keys)

    def const(self, value, elem_type: int | None = None, hint: str = "const") -> str:
        arr = np.asarray(value)
        if elem_type is not None:
            arr = arr.astype(NP_OF.get(elem_type, {INT64: np.int64, INT32: np.int32}.get(elem_type)))
        return self._add_const(arr, hint)

    def _add_const(self, arr: np.ndarray, hint: str) -> str:
        name = self._fresh(hint)
        self.consts.append(numpy_helper.from_array(arr, name))
        return name

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64), hint="shape")

    # ---- nodes ---------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        outs = [self._fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=outs[0], **attrs))
        known = [self.channels[i] for i in inputs if i in self.channels]
        if op_type in CHANNELS_KEPT and known:
            self.channels[outs[0]] = known[0]
        elif op_type == "Concat" and attrs.get("axis") == 1 and inputs and len(known) == len(inputs):
            self.channels[outs[0]] = sum(known)
        widths = [self.widths[i] for i in inputs if i in self.widths]
        if op_type in WIDTH_KEPT and widths:
            self.widths[outs[0]] = widths[0]
        return outs[0] if outputs == 1 else outs

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        if len(shape) == 4 and isinstance(shape[1], int):
            self.channels[name] = shape[1]
        if len(shape) in (2, 3) and isinstance(shape[-1], int):
            self.widths[name] = shape[-1]
        return name

    def expect(self, key: str, shape: tuple[int, ...], why: str = "") -> None:
        """The tensor `key` must have exactly `shape` (a damaged or transposed weight is caught here
        by name, not as a failure inside a backend)."""
        have = tuple(self.shape(key))
        if have != tuple(shape):
            raise BadInput(f"{self.ckpt.path}: {self.prefix}{key} has shape {list(have)}, the {self.name} needs "
                           f"{list(shape)}{' (' + why + ')' if why else ''}; the checkpoint is damaged or of "
                           "another architecture")

    def _check_channels(self, x: str, module: str, want: int, what: str) -> None:
        """A weight whose size fits its bytes but not the tensor it meets (a damaged header)."""
        have = self.channels.get(x)
        if have is not None and have != want:
            raise BadInput(f"{self.ckpt.path}: {self.prefix}{module}.weight has shape "
                           f"{list(self.shape(module + '.weight'))}: it {what} {want} channels where the graph has "
                           f"{have}; the checkpoint is damaged or of another architecture")

    def output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        """Declare a graph output: the producing tensor is renamed to `name` (no Identity node,
        so every backend sees exactly one name for it)."""
        if value in self.renames or any(v.name == value for v in self.inputs):
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"output_{name}"))
        else:
            self.renames[value] = name
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def cast(self, x: str, elem_type: int) -> str:
        return self.op("Cast", x, to=elem_type)

    def to_fp32(self, x: str) -> str:
        return x if self.dtype == FLOAT else self.cast(x, FLOAT)

    def from_fp32(self, x: str) -> str:
        return x if self.dtype == FLOAT else self.cast(x, self.dtype)

    @contextmanager
    def computing_in(self, elem_type: int) -> Iterator[None]:
        """Build the nodes inside the `with` as if the graph's dtype were `elem_type` (e.g. FLOAT for
        a block that overflows fp16): weights first bound inside are stored in it, constants and the
        fp32 policy follow it. The caller casts the tensors that cross the boundary."""
        saved, self.dtype = self.dtype, elem_type
        try:
            yield
        finally:
            self.dtype = saved

    def scalar(self, value: float, elem_type: int | None = None) -> str:
        """A 0-d constant in the graph's dtype (or `elem_type`)."""
        return self.const(np.array(value, np.float32), self.dtype if elem_type is None else elem_type, hint="scalar")

    # ---- checks and output ---------------------------------------------------------
    def check_coverage(self, scopes: list[str], ignore: Callable[[str], bool] = lambda k: False) -> None:
        """Every requested key found, every key under `scopes` consumed, else one error listing them."""
        used = {w.key for w in self.weights.values()} | self.skipped
        unused = sorted(k for k in self.ckpt.refs
                        if any(k.startswith(s) for s in scopes) and k not in used and not ignore(k))
        if self.missing or unused:
            parts = []
            if self.missing:
                parts.append(f"missing {len(self.missing)} tensor(s): {', '.join(sorted(set(self.missing))[:12])}")
            if unused:
                parts.append(f"{len(unused)} tensor(s) not used by the graph: {', '.join(unused[:5])}"
                             + (", ..." if len(unused) > 5 else ""))
            known = [why for pattern, why in UNBUILT if any(re.search(pattern, k) for k in unused)]
            raise BadInput(f"{self.ckpt.path}: the {self.name} weights do not match the detected architecture "
                           f"({'; '.join(parts)}). " + (f"{known[0]}." if known else
                           "The checkpoint may be damaged, merged from different models, "
                           "or of a family precast detected wrongly."))

    def to_proto(self) -> onnx.GraphProto:
        r = self.renames
        nodes = []
        for n in self.nodes:
            n2 = onnx.NodeProto()
            n2.CopyFrom(n)
            n2.input[:] = [r.get(i, i) for i in n.input]
            n2.output[:] = [r.get(o, o) for o in n.output]
            nodes.append(n2)
        return helper.make_graph(nodes, self.name, self.inputs, self.outputs, initializer=list(self.consts))
