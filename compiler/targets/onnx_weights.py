"""An ONNX graph's weights read and written one tensor at a time, for rewrites of full-size models.

Owns: reading an initializer (inline ones decoded, external ones memory-mapped: `Initializers`,
`tensor_array`), appending tensors to one external-data file at aligned offsets (`DataWriter`), a
slice of whole rows of a stored weight as a tensor naming the same bytes (`row_part`), a Slice node's
constant bounds as a numpy index (`slice_index`), and widening every element type a graph names
(`retype`: IO, value infos, Cast targets, dtype attributes, tensors in attributes). Nothing here loads
a model's weights at once: quantize.py's rewrites of a 12 B transformer run in a few hundred MB.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np


def row_part(w, index, name: str):
    """A slice of whole rows of external weight `w` as a TensorProto naming the same bytes; None when
    the slice is not whole rows of a stored tensor (then it is copied)."""
    import onnx
    rows, cols = index
    if w.data_location != onnx.TensorProto.EXTERNAL or cols != slice(None):
        return None
    start, stop, _ = rows.indices(w.dims[0])
    where = {e.key: e.value for e in w.external_data}
    row_bytes = nbytes(w) // w.dims[0]
    t = onnx.TensorProto(name=name, data_type=w.data_type, dims=[max(stop - start, 0), w.dims[1]],
                         data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", where["location"]), ("offset", str(int(where.get("offset", 0)) + start * row_bytes)),
                       ("length", str(max(stop - start, 0) * row_bytes))):
        t.external_data.add(key=key, value=value)
    return t


def nbytes(t) -> int:
    import onnx
    size = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return int(np.prod(t.dims)) * size if t.dims else size


def link(src: Path, dst: Path) -> None:
    """`dst` with `src`'s bytes: a hard link, else (another volume, a filesystem without hard links) a
    copy -- not a symbolic link, which OpenVINO refuses when it points out of the model's folder."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def slice_index(node, inits):
    """A Slice with constant starts / ends (/ axes, steps 1) as a numpy index; None otherwise."""
    from onnx import numpy_helper
    vals = []
    for name in list(node.input[1:5]) + [""] * (5 - len(node.input)):
        if not name:
            vals.append(None)
        elif name in inits and inits[name].data_location != 1:
            vals.append([int(v) for v in numpy_helper.to_array(inits[name]).reshape(-1)])
        else:
            return None
    starts, ends, axes, steps = vals
    if starts is None or ends is None or (steps is not None and any(v != 1 for v in steps)):
        return None
    index = [slice(None), slice(None)]
    for start, end, axis in zip(starts, ends, axes if axes is not None else range(len(starts))):
        if axis not in (0, 1, -1, -2):
            return None
        index[axis % 2] = slice(start, end)
    return tuple(index)


def retype(graph, widen: dict) -> None:
    """Every place a graph names an element type, widened (bf16 -> fp32): IO, value infos, Cast
    targets, dtype attributes, tensors held in attributes (Constant, ConstantOfShape)."""
    import onnx
    from onnx import numpy_helper
    for v in [*graph.input, *graph.output, *graph.value_info]:
        tt = v.type.tensor_type
        if tt.elem_type in widen:
            tt.elem_type = widen[tt.elem_type]
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i in widen:
                a.i = widen[a.i]
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in widen:
                arr = numpy_helper.to_array(a.t).astype("float32")
                a.t.CopyFrom(numpy_helper.from_array(arr, a.t.name))
            elif a.type == onnx.AttributeProto.GRAPH:
                retype(a.g, widen)


class Initializers:
    """A graph's initializers read one at a time: inline ones decoded, external ones memory-mapped."""

    def __init__(self, model, folder: Path):
        self._folder = folder
        self._by_name = {t.name: t for t in model.graph.initializer}
        self._types = {t.data_type for t in model.graph.initializer}

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def dtype(self, name: str) -> int:
        return self._by_name[name].data_type

    def had(self, dtype: int) -> bool:
        return dtype in self._types

    def array(self, name: str):
        return tensor_array(self._by_name[name], self._folder)


def tensor_array(t, folder: Path):
    """An initializer's values: inline ones decoded, external ones memory-mapped from `folder`."""
    import onnx
    from onnx import numpy_helper
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    where = {e.key: e.value for e in t.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    count = int(np.prod(t.dims)) if t.dims else 1
    if count == 0:
        return np.zeros(tuple(t.dims), dtype)
    return np.memmap(folder / where["location"], dtype=dtype, mode="r",
                     offset=int(where.get("offset", 0)), shape=(count,)).reshape(tuple(t.dims))


class DataWriter:
    """Appends tensors to one external-data file, each at an aligned offset (4 KiB for large tensors,
    so ONNX Runtime can map them), returning TensorProtos that point at them."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self._f = open(self.path, "wb")
        return self

    def __exit__(self, *exc):
        self._f.close()

    def tensor(self, name: str, dtype: int, arr):
        import onnx
        shape = np.shape(arr)                 # ascontiguousarray makes a 0-d array 1-d
        arr = np.ascontiguousarray(arr)
        raw = memoryview(arr.view(np.uint8).reshape(-1)) if arr.size else b""
        if len(raw) < 1024:     # small ones inline, as onnx.save_model's size_threshold would
            t = onnx.helper.make_tensor(name, dtype, shape, bytes(raw), raw=True)
            return t
        align = 4096 if len(raw) >= (1 << 20) else 64
        offset = -(-self._f.tell() // align) * align
        self._f.seek(offset)
        self._f.write(raw)
        self._f.flush()                       # readable (memory-mapped) before the file is closed
        t = onnx.TensorProto(name=name, data_type=dtype, dims=shape, data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(len(raw)))):
            t.external_data.add(key=key, value=value)
        return t
