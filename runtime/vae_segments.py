"""Exact tiled VAE passes: the `vae_decoder_tiled` / `vae_encoder_tiled` components' segments run tile by tile.

Owns: `run_program` (a component's program run over latents or pixels: each segment tile by tile on tiles widened by its
reach, each GroupNorm's statistics measured over the whole feature map between segments, the mid-block's
attention computed here), `held_bytes` (the host memory it takes, estimated), `group_stats`, `attention`, and the tile sides
the component's engines take (`SEGMENT_TILE`, which the compiler's profiles read). The program and the graph are
compiler/graphs/vae_segments.py's: a segment is local (convolutions, SiLU, nearest upsampling, stride-2
downsampling, adds), so a tile widened by the segment's `halo` input pixels on each side gives the exact output
over its own part, and the result equals the plain pass's to float rounding, at any size, whatever the tile. The price: the feature
maps between segments live here whole (SD's VAE at 1024²: 2 GiB at most, a 256-channel map at 1024² and two
128-channel ones; `held_bytes`), where runtime/vae_tiling.py's blended tiles hold one tile's. Standard library and numpy only.
"""
from __future__ import annotations

import math

import numpy as np

TILED_DECODER = "vae_decoder_tiled"
TILED = {"vae_decoder": TILED_DECODER, "vae_encoder": "vae_encoder_tiled"}   # a VAE component -> its exact twin
SEGMENT_TILE = (1, 128, 1024)    # a segment input's side in its own pixels, halo included: min, opt, max built
TILE_VALUES = 1 << 20            # channels x pixels of a segment's widest input per call, at most (4 MiB f32; past
# that OpenVINO's dynamic-shape buffers, kept per node at the largest tile seen, grow: SD's VAE at 512², 1.5 GiB
# at 2^20, 4.0 GiB at 2^24, for 20-23 s either way; ONNX Runtime 1.0 GiB)
WORKSPACE = 192 * 4 * TILE_VALUES   # bytes on the VAE's device beside the weights: the engine's buffers for tiles
# (OpenVINO keeps 0.6-0.8 GiB for SD's VAE at 2^20 values a tile; ONNX Runtime less)
QUERY_CHUNK = 1024               # attention queries per product (its scores: QUERY_CHUNK x positions floats)


def run_program(run, spec: dict, x: np.ndarray, tile_values: int = TILE_VALUES,
                max_side: int = SEGMENT_TILE[2]) -> np.ndarray:
    """The program's last output (float32) over x [N, C, h, w] (the decoder's latents, the encoder's pixels):
    `run(feeds) -> outputs` calls the component's session; `spec` is its manifest record (config.segments, inputs,
    outputs), each segment not running fed a 2x2 placeholder (the least a downsampler takes)."""
    program, n = spec["config"]["segments"], len(x)
    idle = {i["name"]: np.zeros([n if d == "batch" else d if isinstance(d, int) else 2 for d in i["shape"]],
                                np.float32) for i in spec["inputs"]}
    widths = {o["name"]: o["shape"][1] for o in spec["outputs"]}
    values = {program[0]["inputs"]["x"]: np.asarray(x, np.float32)}
    last = last_uses(program)
    for i, step in enumerate(program):
        if "attention" in step:
            a = step["attention"]
            values[step["outputs"]["y"]] = attention(values[a["q"]], values[a["k"]], values[a["v"]])
        else:
            values.update(run_segment(run, step, values, idle, widths, tile_values, max_side))
        for v in [v for v, j in last.items() if j == i]:
            del values[v]
    return values[program[-1]["outputs"]["y"]]


def last_uses(program: list[dict]) -> dict[str, int]:
    """value -> the index of the last step that reads it."""
    return {v: i for i, step in enumerate(program) for v in (step.get("inputs") or step["attention"]).values()}


def held_bytes(spec: dict, n: int, h: int, w: int) -> int:
    """The most host memory `run_program` holds at once over an input of n x h x w (float32, the input left out): the
    feature maps between segments and the attention's scores, from the program and the component's output records
    (their channels). The engine's buffers for a tile are WORKSPACE, on the VAE's device."""
    program, out_channels = spec["config"]["segments"], {o["name"]: o["shape"][1] for o in spec["outputs"]}
    last = last_uses(program)
    scale, channels, live, most = {program[0]["inputs"]["x"]: 1}, {}, {}, 0
    for i, step in enumerate(program):
        ins = step.get("inputs") or step["attention"]
        r = scale[next(iter(ins.values()))] * step.get("scale", 1)
        for role, value in step["outputs"].items():
            c = out_channels[f"s{step['segment']}_{role}"] if "segment" in step else channels[ins["v"]]
            scale[value], channels[value], live[value] = r, c, int(4 * n * c * h * w * r * r)
        scores = 4 * n * QUERY_CHUNK * int(h * w * r * r) if "attention" in step else 0
        most = max(most, sum(live.values()) + scores)
        for v in [v for v, j in last.items() if j == i]:
            live.pop(v, None)
    return most


def run_segment(run, step: dict, values: dict, idle: dict, widths: dict, tile_values: int, max_side: int) -> dict:
    """One segment over its whole input, tile by tile: {value: output} for its outputs. A tile holds at most
    `tile_values` values of its widest input or output (`widths`: output channels by name; an upsampling segment's
    outputs counted at 4x the pixels, a downsampling one's at a quarter)."""
    k, halo, scale = step["segment"], step["halo"], step["scale"]
    ins = {role: values[v] for role, v in step["inputs"].items()}
    n, _, h, w = next(iter(ins.values())).shape
    feeds = dict(idle)
    if step["norm"]:
        feeds[f"s{k}_mean"], feeds[f"s{k}_rstd"] = group_stats(ins["x"], step["norm"]["groups"], step["norm"]["eps"])
    widest = max([v.shape[1] for v in ins.values()] +
                 [int(widths[f"s{k}_{role}"] * scale * scale) for role in step["outputs"]])
    side = max(1, max(8, min(max_side, math.isqrt(max(1, tile_values // (n * widest))))) - 2 * halo)
    outs: dict[str, np.ndarray] = {}
    for oy0, oy1, ey0, ey1, ly in windows(h, side, halo, scale):
        for ox0, ox1, ex0, ex1, lx in windows(w, side, halo, scale):
            for role, v in ins.items():
                feeds[f"s{k}_{role}"] = np.ascontiguousarray(v[:, :, ey0:ey1, ex0:ex1])
            result = run(feeds)
            for role, value in step["outputs"].items():
                r = np.asarray(result[f"s{k}_{role}"], np.float32)
                if value not in outs:
                    outs[value] = np.empty((n, r.shape[1], int(h * scale), int(w * scale)), np.float32)
                outs[value][:, :, oy0:oy1, ox0:ox1] = r[:, :, ly:ly + oy1 - oy0, lx:lx + ox1 - ox0]
    return outs


def windows(length: int, side: int, halo: int, scale: float) -> list[tuple[int, int, int, int, int]]:
    """Along one side of a segment's input: (output start, output end, input start, input end, where the output's
    rows start in the tile's output) for each tile, the input widened by `halo`. Scale 1 or 2: tiles of at most
    `side` input pixels; 0.5 (a stride-2 downsampler, its halo even): tiles of at most side / 2 output pixels, each
    input window starting on the stride's grid."""
    if scale < 1:
        out = []
        for o0, o1 in spans(length // 2, max(1, side // 2)):
            e0 = max(0, 2 * o0 - halo)
            out.append((o0, o1, e0, min(length, 2 * o1 + halo), o0 - e0 // 2))
        return out
    f = int(scale)
    return [(i0 * f, i1 * f, max(0, i0 - halo), min(length, i1 + halo), (i0 - max(0, i0 - halo)) * f)
            for i0, i1 in spans(length, side)]


def spans(length: int, side: int) -> list[tuple[int, int]]:
    """[start, end) of as few tiles of at most `side` as cover `length`, evenly sized."""
    count = -(-length // max(1, side))
    return [(i * length // count, (i + 1) * length // count) for i in range(count)]


def group_stats(x: np.ndarray, groups: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """A GroupNorm's mean and 1 / sqrt(variance + eps) over x [N, C, H, W], per channel ([N, C, 1, 1] float32),
    each group's accumulated in float64 one group at a time (no whole-map temporary)."""
    n, c = x.shape[:2]
    by_group = x.reshape(n, groups, -1)
    mean, rstd = np.empty((n, groups)), np.empty((n, groups))
    for i in range(n):
        for j in range(groups):
            mean[i, j] = m = by_group[i, j].mean(dtype=np.float64)
            rstd[i, j] = 1.0 / math.sqrt(np.square(np.subtract(by_group[i, j], m, dtype=np.float64)).mean() + eps)
    return tuple(np.repeat(s, c // groups, axis=1).astype(np.float32)[:, :, None, None] for s in (mean, rstd))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Single-head attention over positions, softmax(q k^T / sqrt(C)) v, on [N, C, H, W] maps (the VAE mid-block's),
    QUERY_CHUNK queries at a time."""
    n, c, h, w = q.shape
    q2, k2, v2 = (np.asarray(t, np.float32).reshape(n, c, h * w) for t in (q, k, v))
    out = np.empty((n, c, h * w), np.float32)
    for i in range(0, h * w, QUERY_CHUNK):
        s = np.matmul(q2[:, :, i:i + QUERY_CHUNK].transpose(0, 2, 1), k2) * np.float32(c ** -0.5)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[:, :, i:i + QUERY_CHUNK] = np.matmul(v2, s.transpose(0, 2, 1))
    return out.reshape(n, c, h, w)
