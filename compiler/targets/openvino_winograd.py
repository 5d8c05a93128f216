"""Winograd F(4x4, 3x3) convolutions for OpenVINO on CPUs: a rewrite of an OpenVINO model.

Owns: replacing each 3x3, stride-1, pad-1 convolution whose shapes make it pay (measured on an
AVX-512 CPU without AMX: 1.6-2.7x faster per convolution at 256-2560 channels and 16x16 to
256x256 pixels; slower at 8x8 or 128 channels) by the Winograd algorithm written in plain
OpenVINO ops, because OpenVINO's CPU plugin runs every convolution directly on x86-64:

    P = ExtractImagePatches(x, 6x6, stride 4)      [N, 36*C, H/4, W/4]   (tile pixels, c)
    V = (B^T (x) B^T) @ P                          [N, 36, C*T]          input transform
    M = U @ V, U = (G g G^T) per (p,q)             [N, 36, K, T]         36 GEMMs, 4x fewer MACs
    Y = (A^T (x) A^T) @ M                          [N, 16, K*T]          output transform
    y = DepthToSpace(Y, 4)                         [N, K, H, W]

2.25x fewer multiply-adds than the direct convolution (36 per 16 outputs instead of 144). The
transformed weights U are 4x the size of the 3x3 kernels (they become the blob's constants).
Numerics: max|winograd - direct| / max|direct| ~ 1e-5 per convolution in fp32 (points 0, +-1,
+-2), so the pass runs only when the inference precision is f32.
"""
from __future__ import annotations

import numpy as np

TILE = 4                                    # outputs per tile side, F(4x4, 3x3)
BT = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
               [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], np.float64)
G = np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
              [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], np.float64)
AT = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], np.float64)
MIN_CHANNELS = 256                          # below this the transforms cost more than they save
MIN_SIZE = 16                               # output height and width: below it, never
# the default smallest side (target option `winograd: true`): full-size SD 1.5 at 512x512, batch 2, 2 threads, AMD
# EPYC AVX-512 (benchmarks/suite.py --precast-variant, 2026-11-27): rewriting the 16x16 convolutions too saves 2% of
# a UNet call (6.33 vs 6.48 s) for 3.07 GB more transformed weights (4.34 vs 1.27 GB), most of the engine's memory
DEFAULT_MIN_SIZE = 32


def pays(channels_in: int, channels_out: int, height: int, width: int, min_size: int = MIN_SIZE) -> bool:
    return min(channels_in, channels_out) >= MIN_CHANNELS and min(height, width) >= max(min_size, MIN_SIZE)


def transformed_weights(w: np.ndarray, chunk: int = 128) -> np.ndarray:
    """U[p*6+q, k, c] = (G w[k, c] G^T)[p, q], computed in float64, returned as float32 [36, K, C]."""
    k_out, c_in = w.shape[:2]
    u = np.empty((36, k_out, c_in), np.float32)
    for k0 in range(0, k_out, chunk):
        g = w[k0:k0 + chunk].astype(np.float64)                            # [k, C, 3, 3]
        t = np.einsum("pi,kcij,qj->pqkc", G, g, G, optimize=True)          # [6, 6, k, C]
        u[:, k0:k0 + chunk] = t.reshape(36, -1, c_in)
    return u


def _weights(node) -> np.ndarray | None:
    """The constant behind a convolution's weight input (through a Convert), else None."""
    kind = node.get_type_name()
    if kind == "Convert":
        node = node.input_value(0).get_node()
        kind = node.get_type_name()
    if kind != "Constant":
        return None
    return np.asarray(node.get_data(), dtype=np.float32)


def _candidate(op, min_size: int = MIN_SIZE):
    """(x, weights, (N, C, H, W)) when `op` is a convolution this pass rewrites, else None."""
    if op.get_type_name() != "Convolution":
        return None
    a = op.get_attributes()
    if list(a["strides"]) != [1, 1] or list(a["dilations"]) != [1, 1]:
        return None
    if a.get("auto_pad", "explicit").lower() not in ("explicit", "notset") or \
            list(a["pads_begin"]) != [1, 1] or list(a["pads_end"]) != [1, 1]:
        return None
    x = op.input_value(0)
    shape = x.get_partial_shape()
    if str(x.get_element_type()) not in ("<Type: 'float32'>", "f32") or not shape.is_static or len(shape) != 4:
        return None
    w = _weights(op.input_value(1).get_node())
    if w is None or w.ndim != 4 or w.shape[2:] != (3, 3):
        return None
    n, c, h, wd = (int(d) for d in shape.to_shape())
    if w.shape[1] != c or not pays(c, w.shape[0], h, wd, min_size):
        return None
    return x, w, (n, c, h, wd)


def winograd_conv(ops, x, w: np.ndarray, n: int, c: int, h: int, wd: int):
    """The F(4x4, 3x3) subgraph computing Convolution(x, w, stride 1, pad 1), as an op output."""
    k = w.shape[0]
    m, a = TILE, TILE + 2
    th, tw = -(-h // m), -(-wd // m)
    t = th * tw
    if h % m == 0 and wd % m == 0:    # SAME_LOWER pads one row/column before and one after, as pad=1 does
        patches = ops.extract_image_patches(x, [a, a], [m, m], [1, 1], "same_lower")
    else:
        xp = ops.pad(x, [0, 0, 1, 1], [0, 0, m * th + 1 - h, m * tw + 1 - wd], "constant")
        patches = ops.extract_image_patches(xp, [a, a], [m, m], [1, 1], "valid")
    bb = np.einsum("pi,qj->pqij", BT, BT).reshape(a * a, a * a).astype(np.float32)
    v = ops.matmul(ops.constant(bb), ops.reshape(patches, [n, a * a, c * t], False), False, False)
    mm = ops.matmul(ops.constant(transformed_weights(w)), ops.reshape(v, [n, a * a, c, t], False), False, False)
    aa = np.einsum("rp,sq->rspq", AT, AT).reshape(m * m, a * a).astype(np.float32)
    y = ops.matmul(ops.constant(aa), ops.reshape(mm, [n, a * a, k * t], False), False, False)
    y = ops.depth_to_space(ops.reshape(y, [n, m * m * k, th, tw], False), "blocks_first", m)
    if m * th != h or m * tw != wd:
        y = ops.slice(y, np.array([0, 0], np.int64), np.array([h, wd], np.int64), np.array([1, 1], np.int64),
                      np.array([2, 3], np.int64))
    return y.output(0)


def rewrite_convolutions(model, min_size: int = DEFAULT_MIN_SIZE) -> dict:
    """Rewrite every convolution of a static-shaped f32 OpenVINO model where Winograd pays and whose output
    is at least `min_size` on each side (by default 32: a 512x512 SD UNet's 16x16 convolutions stay direct, their
    transformed weights being most of the memory for 2% of the time; target option `winograd: 16` rewrites them
    too); returns what was done (count, weight bytes before and after)."""
    import openvino.opset13 as ops
    count, before, after = 0, 0, 0
    for op in list(model.get_ordered_ops()):
        found = _candidate(op, min_size)
        if found is None:
            continue
        x, w, (n, c, h, wd) = found
        op.output(0).replace(winograd_conv(ops, x, w, n, c, h, wd))
        count += 1
        before += w.nbytes
        after += 4 * w.nbytes
    if count:
        model.validate_nodes_and_infer_types()
    return {"convolutions": count, "weight_bytes_before": before, "weight_bytes_after": after}
