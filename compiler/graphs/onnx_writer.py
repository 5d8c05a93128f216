"""Writing a built graph: model.onnx plus its weights streamed into external data.

Owns: the data file's layout (fixed before anything is written, so the bytes are the same
whatever order tensors are written in), reading (one slice of it where the graph takes one),
transforming (a LoRA merge), casting and checking each weight (NaN/inf, the target dtype's range) as it is written on WRITERS threads; a
stored tensor taken as it is in row blocks of at most about BLOCK_BYTES (an LLM's embedding table: 0.4-0.7 G
values), each read and decoded into the thread's reused buffers and written past the page cache
(compiler/direct_io.py), so the peak memory is a few blocks, not the tensor beside its decoded copy.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

from ..direct_io import OutputFile, Scratch
from ..errors import BadInput
from .onnx_graph import ALIGN_LARGE, ALIGN_SMALL, IR_VERSION, LARGE, NP_OF, OPSET, Graph, Weight

WRITERS = 3          # weight-writer threads: with direct I/O a thread waits on the disk, a third keeps it busy (Qwen-Image
                     # 30 blocks, fp8 -> bf16, cold cache, 2 rounds: 2 threads 29.6 / 20.4 s, 3: 19.0 / 18.8 s, 4: 19.7 / 18.1 s;
                     # the O_DIRECT copy of the same bytes 21.5 / 18.3 s)
BLOCK_BYTES = 64 << 20   # a stored tensor past this is read, decoded and written in row blocks of about this size


def _cast_weight(arr: np.ndarray, elem_type: int) -> np.ndarray:
    target = NP_OF[elem_type]
    if arr.dtype != target:
        arr = arr.astype(target)
    return np.ascontiguousarray(arr)


def _layout(graph: Graph) -> tuple[list[tuple[Weight, int, int]], int]:
    """(weight, offset, size) of each weight in the data file, and the file's size: large tensors
    aligned to 4 KiB, small ones to 64 bytes. Fixed before anything is written, so tensors can be
    written in any order and the file is the same bytes."""
    placed, offset = [], 0
    for w in graph.weights.values():
        size = int(np.prod(w.shape, dtype=np.int64)) * np.dtype(NP_OF[w.elem_type]).itemsize
        offset += (-offset) % (ALIGN_LARGE if size >= LARGE else ALIGN_SMALL)
        placed.append((w, offset, size))
        offset += size
    return placed, offset


def _write_weights(graph: Graph, out: OutputFile, placed: list[tuple[Weight, int, int]], transform,
                   on_weight: Callable[[int], None] | None, exact: frozenset = frozenset()) -> None:
    """Read, transform, cast and pwrite each weight at its offset, on WRITERS threads (numpy casts
    and the kernel's page-cache copies release the GIL, so the threads share the cores); at most
    two tensors per thread are in flight, so memory stays near a handful of tensors."""
    local = threading.local()

    def write_one(w: Weight, offset: int, size: int) -> int:
        ref = getattr(graph.ckpt, "refs", {}).get(w.key)
        blocks = ref.blocks(BLOCK_BYTES) if ref is not None and transform is None and w.take is None else None
        if blocks:      # a stored tensor as it is (or decoded): read, decoded and written through reused buffers
            scratch = local.__dict__.setdefault("scratch", Scratch())
            done = 0
            for rows in blocks:
                done += write_block(w, ref.read_block(rows, NP_OF[w.elem_type], scratch), offset + done)
            if done != size:
                raise RuntimeError(f"{w.key}: {done} bytes, expected {size}")
            return size
        # BF16 -> bf16 (and F16 -> fp16) exports copy the bytes as they are; fp8 decodes straight into the
        # export's dtype, except where a transform (a LoRA) needs the exact float32 values first
        arr = graph.ckpt.read(w.key, raw=True, target=None if w.key in exact else NP_OF[w.elem_type])
        if w.take is not None:
            arr = np.take(arr, w.take[1], axis=w.take[0])
        if transform is not None:
            arr = transform(w, arr)
        if write_block(w, arr, offset) != size:
            raise RuntimeError(f"{w.key}: {arr.nbytes} bytes, expected {size}")
        return size

    def write_block(w: Weight, arr: np.ndarray, offset: int) -> int:
        """Cast, check and pwrite `arr` (a weight, or a block of its rows) at `offset`; its bytes written."""
        cast = _cast_weight(arr, w.elem_type)
        # the narrower of the two is checked: a widening cast (fp16 -> fp32) cannot make inf
        if _has_non_finite(cast if cast.itemsize <= arr.itemsize else arr):
            # read in float32 to say which it is: damaged (NaN/inf) or past the export dtype's range
            _refuse_non_finite(graph, w, arr if arr.dtype != cast.dtype or w.take else graph.ckpt.read(w.key), cast)
        return out.pwrite(cast, offset)

    def finish(future) -> None:
        size = future.result()
        if on_weight is not None:
            on_weight(size)

    with ThreadPoolExecutor(max_workers=WRITERS) as pool:
        pending: deque = deque()
        try:
            for item in placed:
                pending.append(pool.submit(write_one, *item))
                while len(pending) > 2 * WRITERS:
                    finish(pending.popleft())
            while pending:
                finish(pending.popleft())
        except BaseException:
            for f in pending:
                f.cancel()
            raise


_EXPONENT = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000),
             np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80)}


def _has_non_finite(arr: np.ndarray) -> bool:
    """NaN or inf anywhere: all exponent bits set (an integer view: ~4x faster than np.isfinite on fp16)."""
    if arr.size == 0:
        return False
    if arr.dtype in _EXPONENT:
        view, mask = _EXPONENT[arr.dtype]
        bits = np.ascontiguousarray(arr).reshape(-1).view(view)
        step = 1 << 20                      # chunks stay in cache; no tensor-sized temporary
        return any(int(np.bitwise_and(bits[i:i + step], mask).max()) == mask for i in range(0, bits.size, step))
    return not bool(np.isfinite(arr).all())


def _refuse_non_finite(graph: Graph, w: Weight, source: np.ndarray, cast: np.ndarray) -> None:
    values = np.asarray(source, dtype=np.float32)
    if _has_non_finite(values):
        raise BadInput(f"{graph.ckpt.path}: {w.key} holds NaN or infinite values; the checkpoint (or a LoRA merged "
                       "into it) is damaged")
    peak = float(np.abs(values).max())
    raise BadInput(f"{graph.ckpt.path}: {w.key} has values up to {peak:.4g}, beyond the range of "
                   f"{np.dtype(cast.dtype).name}; export with --dtype fp32")


def _allocate(fd: int, size: int) -> None:
    """Size the data file up front, its blocks reserved where the OS can (ext4 here writes into a
    reserved file 1.3-1.6x faster than into a sparse one); the alignment gaps read as zeros."""
    os.ftruncate(fd, size)
    if hasattr(os, "posix_fallocate") and size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:    # a filesystem that cannot reserve: the sparse file is still right
            pass


def save_model(graph: Graph, folder: str, on_weight: Callable[[int], None] | None = None,
               metadata: dict[str, str] | None = None,
               transform: Callable[[Weight, np.ndarray], np.ndarray] | None = None,
               exact: frozenset = frozenset()) -> tuple[str, str]:
    """Write `folder/model.onnx` and `folder/model.onnx_data`, weights streamed tensor by tensor.

    `transform` may change a weight's values (for example a LoRA merge) before the cast; the keys in
    `exact` (those it changes) are read as float32, not decoded into the export's dtype first.
    Returns the two paths."""
    os.makedirs(folder, exist_ok=True)
    model_path = os.path.join(folder, "model.onnx")
    data_name = "model.onnx_data"
    placed, total = _layout(graph)
    with OutputFile(os.path.join(folder, data_name)) as data:
        _allocate(data.fd, total)
        _write_weights(graph, data, placed, transform, on_weight, exact)
        if os.fstat(data.fd).st_size != total:
            raise RuntimeError(f"weights file is {os.fstat(data.fd).st_size} bytes, expected {total}")
    initializers = []
    for w, offset, size in placed:
        t = TensorProto(name=w.name, data_type=w.elem_type, dims=list(w.shape), data_location=TensorProto.EXTERNAL)
        for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(size))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        initializers.append(t)
    proto = graph.to_proto()
    proto.initializer.extend(initializers)
    model = helper.make_model(proto, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="precast", producer_version="0.1.0", ir_version=IR_VERSION)
    for k, v in sorted((metadata or {}).items()):
        model.metadata_props.add(key=k, value=v)
    with open(model_path, "wb") as f:
        f.write(model.SerializeToString(deterministic=True))
    return model_path, os.path.join(folder, data_name)
