"""Random weights for the tiny (and full-size) demo checkpoints, written in the storage dtypes real files use.

Owns: `Component` (one model inside a file: its random stream, key prefix, layout, whether fp8 applies),
`RandomWeights` (seeded weights from one pool of normal values, deterministic per seed, component and key,
streamed in bounded memory), `plan_tensors` / `write_components` (a file's keys, shapes and dtypes --
fp32, fp16, bf16, fp8 e4m3 / e5m2 and ComfyUI's scaled fp8 with its marker and scales -- written temp +
rename) and `parameter_count`. Used by demo_dit.py (Flux, Chroma, T5, CLIP-L, VAE) and demo_sd3.py.
numpy + ml_dtypes only.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator

import ml_dtypes
import numpy as np

from .demo_model import _cast, storage_type, write_safetensors

SCALED_FP8_MARKER = "scaled_fp8"
DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_scaled", "fp8_e5m2_scaled")


@dataclass(frozen=True)
class Component:
    """One model inside a file: `tag` names its random stream (so a component's tensors are the same
    bare or inside an all-in-one file), `quantizable` says whether fp8 dtypes apply to its Linears."""
    tag: str
    prefix: str
    layout: dict
    quantizable: bool


def parameter_count(layout: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in layout.values())


# ------------------------------------------------------------------------------------ random values

POOL_SIZE = 4_194_301   # float32 normals drawn once per seed (16 MB); odd, so tensors tile it unevenly


def _is_embedding(key: str) -> bool:
    return "embedding" in key or key == "shared.weight" or "relative_attention_bias" in key


def log2_scale(key: str, shape: tuple[int, ...]) -> int | None:
    """A tensor's values are pool values times 2**this (None: a norm scale, 1 + 0.1 * pool):
    biases ~0.016, embeddings ~0.125, weights ~1/sqrt(fan-in) (rounded to a power of two)."""
    if key.endswith(".bias"):
        return -6
    if len(shape) == 1:
        return None
    if _is_embedding(key):
        return -3
    return round(-0.5 * math.log2(max(1, math.prod(shape[1:]))))


class RandomWeights:
    """Seeded weights made from one pool of normal values: a tensor is the pool read from a per-key
    offset (wrapping around), times a power of two fitting its fan-in. Deterministic per (seed, tag,
    key), independent of write order; large tensors are streamed straight from pools kept in the storage
    dtype, so the source costs about nothing next to the disk and holds one pool per (dtype, scale)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._pool: np.ndarray | None = None
        self._typed: dict = {}
        self._peak = 0.0

    def pool(self) -> np.ndarray:
        if self._pool is None:
            self._pool = np.random.default_rng(self.seed).standard_normal(POOL_SIZE, dtype=np.float32)
        return self._pool

    @staticmethod
    def offset(tag: str, key: str) -> int:
        return zlib.crc32(f"{tag}/{key}".encode()) % POOL_SIZE

    def _tiles(self, source, start: int, n: int) -> Iterator[np.ndarray]:
        """`source(a, b)` -> values for pool[a:b]; yields n values from `start`, wrapping."""
        while n:
            take = min(n, POOL_SIZE - start)
            yield source(start, start + take)
            n, start = n - take, 0

    def _source(self, dtype: str, factor: float, shift: float, n: int):
        kind, pool = storage_type(dtype), self.pool()
        if n < POOL_SIZE // 8:      # small: convert just the slice (same values as the whole-pool path)
            return lambda a, b: _cast(pool[a:b] * np.float32(factor) + np.float32(shift), kind, dtype)
        key = (dtype, factor, shift)
        if key not in self._typed:
            self._typed[key] = _cast(pool * np.float32(factor) + np.float32(shift), kind, dtype)
        typed = self._typed[key]
        return lambda a, b: typed[a:b]

    def chunks(self, tag: str, key: str, shape: tuple[int, ...], dtype: str) -> Iterator[np.ndarray]:
        """The tensor's values in storage dtype, as consecutive flat pieces."""
        k, n = log2_scale(key, shape), math.prod(shape)
        factor, shift = (0.1, 1.0) if k is None else (2.0 ** k, 0.0)
        return self._tiles(self._source(dtype, factor, shift, n), self.offset(tag, key), n)

    def fp8_scaled(self, tag: str, key: str, shape: tuple[int, ...],
                   dtype: str) -> tuple[Iterator[np.ndarray], np.float32]:
        """(fp8 pieces, float32 scale): stored * scale ~ the tensor `chunks` gives in a wide dtype.
        The stored values span the fp8 range (pool / max|pool| * fp8 max), as ComfyUI's quantizers do."""
        k, n = log2_scale(key, shape), math.prod(shape)
        if not self._peak:
            self._peak = float(np.abs(self.pool()).max())
        top, peak = float(ml_dtypes.finfo(storage_type(dtype)).max), self._peak
        scale = np.float32(2.0 ** k * peak / top)
        return self._tiles(self._source(dtype, top / peak, 0.0, n), self.offset(tag, key), n), scale

    def array(self, tag: str, key: str, shape: tuple[int, ...], dtype: str = "fp32") -> np.ndarray:
        return np.concatenate(list(self.chunks(tag, key, shape, dtype))).reshape(shape)


# ----------------------------------------------------------------------------------------- writing

def _is_linear_weight(key: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and key.endswith(".weight") and not _is_embedding(key)


def plan_tensors(components: list[Component], dtype: str, rest_dtype: str = "bf16", scale_input: bool = False,
                 fp8_bias: bool = False) -> dict[str, tuple[tuple[int, ...], str, tuple]]:
    """{file key: (shape, dtype name, what)} for a file holding `components`; `what` is ("tensor", tag,
    key), ("scaled", tag, key), ("scale_weight", tag, weight key, weight shape, fp8 dtype),
    ("scale_input",) or ("marker",).

    fp8 dtypes apply to the Linear weights of quantizable components (transformer, T5); every other
    tensor (norms, embeddings, biases unless `fp8_bias`, CLIP-L, VAE) is stored in `rest_dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if rest_dtype not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"rest_dtype must be fp32, fp16 or bf16, not {rest_dtype!r}")
    fp8, scaled = dtype.startswith("fp8"), dtype.endswith("_scaled")
    store = dtype.removesuffix("_scaled")
    plan: dict[str, tuple[tuple[int, ...], str, tuple]] = {}
    for c in components:
        for key, shape in c.layout.items():
            full, quant = c.prefix + key, fp8 and c.quantizable
            if quant and _is_linear_weight(key, shape):
                if scaled:
                    plan[full] = (shape, store, ("scaled", c.tag, key))
                    layer = full[: -len(".weight")]
                    plan[f"{layer}.scale_weight"] = ((), "fp32", ("scale_weight", c.tag, key, shape, store))
                    if scale_input:
                        plan[f"{layer}.scale_input"] = ((), "fp32", ("scale_input",))
                else:
                    plan[full] = (shape, store, ("tensor", c.tag, key))
            elif quant and fp8_bias and key.endswith(".bias"):
                plan[full] = (shape, store, ("tensor", c.tag, key))    # unscaled fp8, as ComfyUI's own export
            else:
                plan[full] = (shape, rest_dtype if fp8 else dtype, ("tensor", c.tag, key))
        if scaled and c.quantizable:
            plan[c.prefix + SCALED_FP8_MARKER] = ((0,), store, ("marker",))
    return plan


def write_components(path, components: list[Component], seed: int = 0, dtype: str = "bf16", *,
                     rest_dtype: str = "bf16", scale_input: bool = False, fp8_bias: bool = False,
                     metadata: dict | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Write one .safetensors file (temp file + rename, tensors streamed); {key: (shape, dtype name)}."""
    plan = plan_tensors(components, dtype, rest_dtype, scale_input, fp8_bias)
    source = RandomWeights(seed)

    def make(full, shape):
        _, name, what = plan[full]
        if what[0] == "tensor":
            return source.chunks(what[1], what[2], shape, name)
        if what[0] == "scaled":
            return source.fp8_scaled(what[1], what[2], shape, name)[0]
        if what[0] == "scale_weight":
            return np.array(source.fp8_scaled(*what[1:])[1])
        if what[0] == "scale_input":
            return np.array(1.0, np.float32)        # ComfyUI's uncalibrated placeholder
        return np.zeros((0,), storage_type(name))   # the scaled_fp8 marker: no values, its dtype is the message

    write_safetensors(str(path), {k: v[0] for k, v in plan.items()}, {k: v[1] for k, v in plan.items()}, make,
                      metadata)
    return {k: (v[0], v[1]) for k, v in plan.items()}
