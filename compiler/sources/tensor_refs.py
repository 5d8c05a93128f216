"""The canonical layout's names, and where each canonical tensor's bytes lie.

Owns: the canonical key prefix of every architecture's parts (LDM names for SD models, BFL's for Flux /
Chroma, SAI's for SD3 and diffusers' for Z-Image under `model.diffusion_model.`, ComfyUI's `text_encoders.*`
for DiT text encoders, HF `Qwen3Model` names under `text_encoders.llm.` for LLM text encoders), `TensorRef` (a
stored tensor, rows of one, several fused along axis 0, or one with a ComfyUI scaled-fp8 scale; read one at a
time, on demand), `Checkpoint` (canonical name -> TensorRef, plus a folder's configs), and opening one weights
file (.safetensors or .gguf), refusing pickles by name without ever unpickling them. Which layout maps to these
names is compiler/sources/checkpoint.py's and diffusers_folder.py's.
"""
from __future__ import annotations

import hashlib
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..direct_io import Scratch
from ..errors import BadInput
from . import fp8_decode, gguf_file
from .gguf_file import GGUFFile
from .safetensors_file import SafetensorsFile

PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl"}
CONVERT_HINT = ("precast never unpickles checkpoints (a pickle can run arbitrary code). Convert it once, "
                "in an environment you trust, to .safetensors, e.g. python -c \"import torch, safetensors.torch as st; "
                "sd = torch.load('IN.ckpt', weights_only=True); sd = sd.get('state_dict', sd); "
                "st.save_file({k: v.contiguous() for k, v in sd.items() if hasattr(v, 'contiguous')}, 'OUT.safetensors')\"")

UNET = "model.diffusion_model."
DIT = UNET                                   # Flux / Chroma transformer (BFL names)
VAE = "first_stage_model."
TEXT = "cond_stage_model.transformer.text_model."
CLIP_L = "text_encoders.clip_l.transformer.text_model."
CLIP_G = "text_encoders.clip_g.transformer.text_model."        # SD3's OpenCLIP bigG (HF names)
T5 = "text_encoders.t5xxl.transformer."
LLM = "text_encoders.llm."                   # a decoder-only LLM text encoder (Z-Image's Qwen3), HF Qwen3Model names
# A key only T5 / CLIP text encoders have, in HF names: where a file's encoder starts is the part before it.
T5_MARKER = "encoder.block.0.layer.0.SelfAttention.q.weight"
CLIP_MARKER = "encoder.layers.0.self_attn.q_proj.weight"
# ComfyUI scaled fp8: weight = fp8 * `.scale_weight` (newer ComfyUI saves: `.weight_scale`), a float32
# scalar beside each Linear weight; a `scaled_fp8` marker tensor and input scales are not weights.
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
NOT_WEIGHTS = ("scaled_fp8", ".scale_input", ".input_scale") + SCALE_SUFFIXES
# The model a key belongs to inside a file: ComfyUI marks each model of a checkpoint scaled on its own
# (`<model prefix>scaled_fp8`), so an all-in-one file may hold a scaled diffusion model beside a plain fp8 T5.
MODEL_ROOT = re.compile(r"(model\.diffusion_model\.|first_stage_model\.|vae\.|cond_stage_model\.|"
                        r"conditioner\.embedders\.\d+\.|text_encoders\.[^.]+\.)?")
# nn.Embedding tables: ComfyUI's scaled ops scale Linear weights only; a table stored in fp8 is read as stored
EMBEDDING_TABLES = ("token_embedding.weight", "position_embedding.weight", "shared.weight", "embed_tokens.weight",
                    "relative_attention_bias.weight")


@dataclass(frozen=True)
class TensorRef:
    file: SafetensorsFile | GGUFFile
    key: str                      # the name inside that file (the first part's, for a fused tensor)
    shape: tuple[int, ...]        # the canonical shape (may differ by a reshape, e.g. Linear -> 1x1 conv)
    parts: tuple["TensorRef", ...] = ()   # a fused tensor: these, concatenated along axis 0
    rows: tuple[int, int] | None = None   # only rows [a, b) of the stored tensor
    scale: str | None = None      # key of a scalar this tensor is multiplied by (scaled fp8)

    @property
    def stored(self) -> tuple[tuple[SafetensorsFile, str], ...]:
        """Every (file, key) whose bytes make this tensor."""
        if self.parts:
            return tuple(x for p in self.parts for x in p.stored)
        return ((self.file, self.key),) + (((self.file, self.scale),) if self.scale else ())

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(f.tensors[k].dtype for f, k in self.stored if k != self.scale)

    def read(self, raw: bool = False, target: np.dtype | None = None) -> np.ndarray:
        """The tensor as float32, or (`raw`) in its stored float type where that is exact (BF16,
        F16, F32, F8 as ml_dtypes arrays; a fused or scaled tensor is float32 either way). With
        `target` (an export's dtype), F8 and scaled F8 decode straight into it, through a byte-pair
        table: the same values as float32 dequantization then a cast, several times faster."""
        if self.parts:
            arrs = [p.read(raw, target) for p in self.parts]
            if len({a.dtype for a in arrs}) > 1:
                arrs = [a.astype(np.float32) for a in arrs]
            return np.concatenate(arrs, axis=0).reshape(self.shape)
        stored = self.file.tensors[self.key].dtype
        if target is not None and stored in fp8_decode.KINDS:
            scale = float(self.file.read(self.scale).astype(np.float32).reshape(())) if self.scale else None
            arr = fp8_decode.decode_fp8(self.file.read(self.key, raw=True), stored, target, scale)
        elif isinstance(self.file, GGUFFile):   # GGUF: quantized blocks dequantize (float32) and cast to `target`
            arr = self.file.read(self.key, raw=raw, target=target)
        else:
            arr = self.file.read(self.key, raw=raw and self.scale is None)
            if self.scale is not None:
                arr = arr.astype(np.float32) * self.file.read(self.scale).astype(np.float32).reshape(())
        if self.rows is not None:
            arr = arr[self.rows[0]:self.rows[1]]
        return arr.reshape(self.shape)

    def blocks(self, max_bytes: int) -> list[tuple[int, int]] | None:
        """Row ranges of the stored tensor (within `rows`) that read as at most about `max_bytes` each and,
        written one after another, make the tensor's bytes (row-major: a reshape keeps them): one range for a
        tensor under `max_bytes`; None when it cannot be read by rows (fused, GGUF, a scalar)."""
        if self.parts or not isinstance(self.file, SafetensorsFile):
            return None
        info = self.file.tensors[self.key]
        if not info.shape or info.end == info.start:
            return None
        a, b = self.rows or (0, info.shape[0])
        step = max(1, max_bytes * info.shape[0] // (info.end - info.start))
        return [(i, min(i + step, b)) for i in range(a, b, step)]

    def read_block(self, rows: tuple[int, int], target: np.dtype, scratch: Scratch | None = None) -> np.ndarray:
        """Rows [a, b) of the stored tensor (one of `blocks`), as `read(raw=True, target=target)` gives
        them: fp8 decoded into `target`, a scaled tensor times its scale, else as stored. With `scratch`
        (the calling thread's), read and decoded into its reused buffers: valid until its next block."""
        stored = self.file.tensors[self.key].dtype
        arr = self.file.read(self.key, raw=True, rows=rows, into=scratch)
        scale = float(self.file.read(self.scale).astype(np.float32).reshape(())) if self.scale else None
        if stored in fp8_decode.KINDS:
            out = None if scratch is None else scratch.take("decoded", arr.size * np.dtype(target).itemsize)
            return fp8_decode.decode_fp8(arr, stored, target, scale, out=out)
        return arr if scale is None else arr.astype(np.float32) * np.float32(scale)


def tensor_ref(f: SafetensorsFile, key: str, canon: str) -> TensorRef:
    """Where canonical tensor `canon` lies. The VAE's mid attention is a 1x1 conv in LDM names;
    diffusers files (and some single files) store it as Linear [C, C]: it binds reshaped. A
    ComfyUI scaled-fp8 weight carries its scale; a Linear weight stored in fp8 without one in a
    model that is scaled (`scaled_fp8_models`) is refused: read as stored it would be the fp8 range
    (|w| up to 448), not the weight."""
    shape = f.tensors[key].shape
    if canon.startswith(VAE) and ".mid.attn_1." in canon and canon.endswith(".weight") and len(shape) == 2:
        shape = shape + (1, 1)
    scales = [key[:-len(".weight")] + s for s in SCALE_SUFFIXES] if key.endswith(".weight") else []
    scale = next((s for s in scales if s in f.tensors), None)
    if scale is None and len(shape) == 2 and f.tensors[key].dtype in fp8_decode.KINDS and key.endswith(".weight") \
            and not key.endswith(EMBEDDING_TABLES) and _root(key) in scaled_fp8_models(f):
        raise BadInput(f"{f.path}: {key} is stored in fp8 without its scale ({scales[0]}), while the model "
                       f"{'under ' + _root(key) + ' ' if _root(key) else ''}is scaled fp8 (a scaled_fp8 marker or "
                       "other weights' scales); read as stored its values would be the raw fp8 range (up to 448), not "
                       "the weight. The file is damaged or was converted incompletely: download or convert it again")
    return TensorRef(f, key, shape, scale=scale)


def _root(key: str) -> str:
    return MODEL_ROOT.match(key).group(0)


def scaled_fp8_models(f: SafetensorsFile) -> set[str]:
    """The models (key prefixes, `_root`) of `f` stored as ComfyUI scaled fp8: marked `scaled_fp8`, or
    holding a weight scale. Read from the header once per file."""
    if f not in _SCALED:
        _SCALED[f] = {_root(k) for k in f.tensors if k.endswith(("scaled_fp8",) + SCALE_SUFFIXES)}
    return _SCALED[f]


_SCALED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_ref(f_of: Callable[[str], SafetensorsFile], parts: list[tuple[str, tuple[int, int] | None]],
              prefix: str = "") -> TensorRef:
    """One canonical tensor made of stored ones (rows of them), concatenated along axis 0."""
    refs = []
    for key, rows in parts:
        base = tensor_ref(f_of(prefix + key), prefix + key, prefix + key)
        if rows is not None:
            base = TensorRef(base.file, base.key, (rows[1] - rows[0],) + base.shape[1:], rows=rows, scale=base.scale)
        refs.append(base)
    if len(refs) == 1:
        return refs[0]
    tails = {r.shape[1:] for r in refs}
    if len(tails) > 1:
        raise BadInput(f"{refs[0].file.path}: {', '.join(r.key for r in refs)} are fused into one weight but have "
                       f"shapes {', '.join(str(list(r.shape)) for r in refs)}; the file is damaged")
    return TensorRef(refs[0].file, refs[0].key, (sum(r.shape[0] for r in refs),) + refs[0].shape[1:], parts=tuple(refs))


@dataclass
class Checkpoint:
    """Canonical tensor name -> where its bytes are; plus component configs from a diffusers folder."""
    path: str
    layout: str                                   # "single-file" | "diffusers"
    refs: dict[str, TensorRef]
    configs: dict[str, dict] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    vae_file: str | None = None                   # --vae: where the VAE tensors came from

    def keys(self) -> list[str]:
        return list(self.refs)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.refs[key].shape

    def dtype(self, key: str) -> str:
        return self.refs[key].dtypes[0]

    def read(self, key: str, raw: bool = False, target: np.dtype | None = None) -> np.ndarray:
        return self.refs[key].read(raw, target)

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.refs if k.startswith(prefix)]

    def identity(self) -> str:
        """A digest of the tensor table (names, dtypes, shapes, byte spans) and file sizes.

        Cheap to compute (headers only); stands for the weights in output metadata."""
        h = hashlib.sha256()
        for key in sorted(self.refs):
            ref = self.refs[key]
            stored = ",".join(f"{k}:{f.tensors[k].dtype}:{f.tensors[k].end - f.tensors[k].start}" for f, k in ref.stored)
            h.update(f"{key}|{ref.shape}|{ref.rows}|{stored}\n".encode())
        return h.hexdigest()


def _looks_like_pickle(path: Path) -> bool:
    if not path.is_file():      # a pipe or device: opening it could block or read forever
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head[:1] == b"\x80" or head[:2] == b"PK"  # raw pickle protocol 2+ or torch's zip container


def _refuse_pickle(path: Path) -> BadInput:
    return BadInput(f"{path}: pickled checkpoint refused. {CONVERT_HINT}")


def open_weights_file(path: Path, refusal: Callable[[Path], BadInput] = _refuse_pickle) -> SafetensorsFile | GGUFFile:
    """A .safetensors file, a .gguf file (by its suffix or magic; its names are the model's own,
    mapped below as a .safetensors file's are), or `refusal(path)` for a pickle: by its suffix, or
    by its first bytes when it does not parse as safetensors (a safetensors header length may start
    with 0x80 too, so the sniff only explains a failure, it never decides)."""
    if gguf_file.is_gguf(path):
        return GGUFFile(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise refusal(path)
    try:
        return SafetensorsFile(path)
    except BadInput:
        if _looks_like_pickle(path):
            raise refusal(path) from None
        raise


def is_weight_key(key: str) -> bool:
    """False for the scaled-fp8 side tensors (markers, input scales, weight scales): they belong
    to a weight, not to the model's graph."""
    return not key.endswith(NOT_WEIGHTS)
