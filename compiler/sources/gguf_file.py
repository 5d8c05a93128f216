"""Reading a .gguf file (ComfyUI-GGUF's diffusion models, llama.cpp's T5 and Qwen text encoders) as the same
lazy tensor table a .safetensors file gives.

Owns: recognising a GGUF file (by its `.gguf` suffix or its `GGUF` magic), parsing it with the `gguf`
package's own reader (no parser here: at open it reads the header, the metadata and the tensor table;
the tensor data stays memory-mapped and untouched), refusing by name a tensor whose type precast cannot
dequantize, presenting each tensor under its name and in torch order (GGUF stores dims innermost
first; ComfyUI-GGUF's `comfy.gguf.orig_shape.NAME` metadata restores a tensor its converter flattened
to rows of 256), and dequantizing one tensor at a time with `gguf.quants.dequantize`.

Exactness: a quantized tensor is dequantized to float32 by gguf's own code and then cast to the
export's dtype (`astype`), block group by block group -- every GGUF type is block-local, so this is
bit for bit the float32 dequantization of the whole tensor followed by one cast, without the whole
float32 tensor ever in memory. F32 / F16 / BF16 tensors read as they are stored (like safetensors).
Memory: per tensor, the output (in the export's dtype) plus one chunk's float32 temporaries
(CHUNK_VALUES values); the mapped pages of a tensor are released once it is read.

Names: ComfyUI-GGUF keeps the model's own state-dict names (BFL for Flux, LDM for SD/SDXL UNets, SAI
for SD3; with or without `model.diffusion_model.`), so checkpoint.py maps them as it maps a bare
.safetensors file. llama.cpp's T5 encoder names (`enc.blk.N.attn_q`, `token_embd`, ...) are given HF
names here, as ComfyUI-GGUF does when it loads them; so are its Qwen2 / Qwen2-VL / Qwen3 LLM names (`blk.N.attn_q`,
`blk.N.ffn_gate`, `token_embd`, `output_norm`, ...: the text encoders of Z-Image, FLUX.2 klein and Qwen-Image as
llama.cpp's converter writes them, which keeps these architectures' q/k rows in HF order). Its llama / Mistral
files (FLUX.2 dev's Mistral-Small-3.2 text model as sd.cpp runs it) store q and k rows permuted for its own RoPE
kernel (each head's rotate-half pairs interleaved): those two are put back in HF order as they are read, by the
head counts the file's metadata names (`ARCH.attention.head_count` / `head_count_kv`), and never carried as raw
blocks (a row permutation of whole rows: dequantizing commutes with it, so the values are gguf's, reordered).
"""
from __future__ import annotations

import math
import mmap
import os
import stat
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import BadInput
from .safetensors_file import TensorInfo

MAGIC = b"GGUF"
SUFFIX = ".gguf"
ORIG_SHAPE = "comfy.gguf.orig_shape."        # ComfyUI-GGUF: the shape a flattened tensor had
CHUNK_VALUES = 1 << 20                       # values dequantized at a time (4 MB of float32)
STORED_FLOATS = ("F32", "F16", "BF16", "F64")   # read as stored, like a .safetensors tensor
INT_TYPES = ("I8", "I16", "I32", "I64")      # read as stored; refused if bound as a weight
# llama.cpp's T5 names -> HF T5EncoderModel names, replaced in this order (as ComfyUI-GGUF loads them)
T5_NAMES = (("enc.", "encoder."), (".blk.", ".block."), ("token_embd", "shared"), ("output_norm", "final_layer_norm"),
            ("attn_q", "layer.0.SelfAttention.q"), ("attn_k", "layer.0.SelfAttention.k"),
            ("attn_v", "layer.0.SelfAttention.v"), ("attn_o", "layer.0.SelfAttention.o"),
            ("attn_norm", "layer.0.layer_norm"), ("attn_rel_b", "layer.0.SelfAttention.relative_attention_bias"),
            ("ffn_up", "layer.1.DenseReluDense.wi_1"), ("ffn_down", "layer.1.DenseReluDense.wo"),
            ("ffn_gate", "layer.1.DenseReluDense.wi_0"), ("ffn_norm", "layer.1.layer_norm"))
T5_ARCHS = ("t5", "t5encoder")
# llama.cpp's names of a decoder-only LLM's tensors -> HF Qwen2Model / Qwen3Model names (gguf's TensorNameMap),
# replaced in this order; the LM head (`output`) keeps its name and is never bound
LLM_NAMES = (("token_embd.", "embed_tokens."), ("output_norm.", "norm."), ("blk.", "layers."),
             (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
             (".attn_q_norm.", ".self_attn.q_norm."), (".attn_k_norm.", ".self_attn.k_norm."),
             (".attn_q.", ".self_attn.q_proj."), (".attn_k.", ".self_attn.k_proj."), (".attn_v.", ".self_attn.v_proj."),
             (".attn_output.", ".self_attn.o_proj."), (".ffn_gate.", ".mlp.gate_proj."), (".ffn_up.", ".mlp.up_proj."),
             (".ffn_down.", ".mlp.down_proj."), ("output.weight", "lm_head.weight"))
PERMUTED_ARCHS = ("llama", "mistral3", "mistral4")     # llama.cpp permutes their q / k rows for its RoPE
LLM_ARCHS = ("qwen2", "qwen2vl", "qwen3") + PERMUTED_ARCHS
PERMUTED = {".self_attn.q_proj.weight": "head_count", ".self_attn.k_proj.weight": "head_count_kv"}


def is_gguf(path: str | os.PathLike) -> bool:
    """A .gguf name, or a regular file that starts with the GGUF magic."""
    p = Path(path)
    if p.suffix.lower() == SUFFIX:
        return True
    try:
        if not p.is_file():
            return False
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _gguf(path: str):
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError:
        raise BadInput(f"{path}: a GGUF file; reading it needs the `gguf` package: pip install 'precast[gguf]'") from None
    return gguf


def _bad(path: str, what: str) -> BadInput:
    return BadInput(f"{path}: not a valid .gguf file: {what}. "
                    "Re-download or re-convert the file (a truncated download is the usual cause).")


def dequantizable(gguf) -> set[str]:
    """GGUF tensor types precast reads as float weights: stored floats and whatever gguf.quants dequantizes."""
    from gguf.quants import _type_traits    # the package's table of types it (de)quantizes
    return set(STORED_FLOATS) | {t.name for t in _type_traits}


def _check_tensor_table(gguf, path: str, size: int, data_start: int, fields) -> None:
    """The tensor table as the reader found it, before it builds views: each type known and
    readable, each row a whole number of blocks, each tensor inside the file and none overlapping;
    a failure names the tensor."""
    known = {int(t.value): t for t in gguf.GGMLQuantizationType}
    readable = dequantizable(gguf) | set(INT_TYPES)
    spans = []
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(path, f"a tensor name at byte {field.offset} is not UTF-8") from None
        code = int(raw_type[0])
        if code not in known:
            raise BadInput(f"{path}: tensor {name} is stored as GGML type {code}, which neither precast nor the "
                           f"installed gguf package knows; re-convert the file with a common type (F16, BF16, Q8_0, "
                           "Q4_K, ...) or update the gguf package")
        qtype = known[code]
        if qtype.name not in readable:
            raise BadInput(f"{path}: tensor {name} is stored as {qtype.name}, a GGUF type precast cannot dequantize "
                           f"(it reads {', '.join(sorted(readable - set(INT_TYPES)))}); re-convert the file with one of those")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = [int(d) for d in dims]
        if shape and shape[0] % block:
            raise _bad(path, f"tensor {name} ({qtype.name}) has rows of {shape[0]} values, not a whole number "
                             f"of {block}-value blocks")
        n_bytes = math.prod(shape) // block * type_size
        begin = data_start + int(offset[0])
        if begin + n_bytes > size:
            raise _bad(path, f"tensor {name}'s data [{begin}, {begin + n_bytes}) runs past the end of the "
                             f"{size}-byte file")
        spans.append((begin, begin + n_bytes, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise _bad(path, f"tensors {a} and {b} overlap in the data area")


_READER = None
MAX_NESTING = 4       # arrays of arrays in GGUF metadata: llama.cpp writes none nested (tokenizer merges are strings)


def _reader_class(gguf):
    """gguf.GGUFReader with the tensor table checked (by name) before the reader builds its views."""
    global _READER
    if _READER is None:
        class CheckedReader(gguf.GGUFReader):
            def _build_tensors(self, start_offs, fields):
                _check_tensor_table(gguf, self._path, int(self.data.size), start_offs, fields)
                super()._build_tensors(start_offs, fields)

            def _get_field_parts(self, orig_offs, raw_type):
                # a metadata value, checked before gguf walks it: an array cannot hold more entries than the
                # file has bytes left (gguf would loop over 2^62 empty views), nor nest past MAX_NESTING
                # (gguf recurses: a 60 kB file of nested arrays is a RecursionError)
                size = int(self.data.size)
                if orig_offs >= size:
                    raise ValueError(f"a metadata value at byte {orig_offs} lies past the end of the {size}-byte file")
                if raw_type == gguf.GGUFValueType.ARRAY and orig_offs + 12 <= size:
                    count = int(self._get(orig_offs + 4, np.uint64)[0])
                    if count > size - orig_offs - 12:
                        raise ValueError(f"a metadata array at byte {orig_offs} claims {count} entries, more than "
                                         "the file has bytes left")
                    self._nesting = getattr(self, "_nesting", 0) + 1
                    try:
                        if self._nesting > MAX_NESTING:
                            raise ValueError(f"metadata arrays nested more than {MAX_NESTING} deep")
                        return super()._get_field_parts(orig_offs, raw_type)
                    finally:
                        self._nesting -= 1
                return super()._get_field_parts(orig_offs, raw_type)

            def __init__(self, path):
                self._path = path
                super().__init__(path, "r")
        _READER = CheckedReader
    return _READER


class GGUFFile:
    """An open .gguf file: header and tensor table read and checked; tensors dequantized on demand.
    The same surface as SafetensorsFile (path, tensors, metadata, keys, read), plus `architecture`,
    `types` (tensor name -> GGUF type name) and `float_dtypes` (the types that bind as weights)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        gguf = _gguf(self.path)
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise BadInput(f"{self.path}: cannot open ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{self.path}: not a file; give the path of a .gguf file")
        if st.st_size < 24:
            raise _bad(self.path, f"file is {st.st_size} bytes, shorter than a GGUF header")
        try:
            reader = _reader_class(gguf)(self.path)
        except BadInput:
            raise
        except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError, OSError) as e:
            raise _bad(self.path, f"its header could not be read (gguf: {e or type(e).__name__})") from None
        if reader.byte_order != "I":
            raise BadInput(f"{self.path}: a big-endian GGUF file; precast reads little-endian ones (the usual kind)")
        self._map = reader.data
        self.metadata = _metadata(reader)
        self.architecture = self.metadata.get("general.architecture", "")
        self.heads: dict[str, int] = {}          # permuted tensor -> its heads, where llama.cpp permuted the rows
        self.float_dtypes = frozenset(dequantizable(gguf))
        self.tensors: dict[str, TensorInfo] = {}
        self._data: dict[str, tuple[np.ndarray, object]] = {}
        for t in reader.tensors:
            name = _rename(t.name, self.architecture)
            if name in self.tensors:
                raise _bad(self.path, f"tensors {t.name} and another both read as {name}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            orig = reader.get_field(ORIG_SHAPE + t.name)
            if orig is not None:
                shape = _orig_shape(self.path, t, orig)
            self.tensors[name] = TensorInfo(t.tensor_type.name, shape, int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
            self._data[name] = (t.data, t.tensor_type)
            if self.architecture in PERMUTED_ARCHS and name.endswith(tuple(PERMUTED)):
                self.heads[name] = self._head_count(name, shape)
        self._quants = gguf.quants
        for _, qtype in self._data.values():    # build lookup grids once, before writer threads read
            trait = gguf.quants._type_traits.get(qtype)
            if trait is not None:
                trait.init_grid()

    def _head_count(self, name: str, shape: tuple[int, ...]) -> int:
        """The heads a permuted q / k weight holds, from the file's metadata; one BadInput where it is missing or
        does not split the rows into heads of an even width."""
        key = f"{self.architecture}.attention.{next(v for k, v in PERMUTED.items() if name.endswith(k))}"
        try:
            heads = int(self.metadata[key])
        except (KeyError, ValueError):
            raise _bad(self.path, f"no {key} in its metadata: llama.cpp stores {name}'s rows permuted per head, "
                                  "and without the head count they cannot be put back") from None
        if heads < 1 or len(shape) != 2 or shape[0] % (2 * heads):
            raise _bad(self.path, f"{key} = {heads} does not split {name}'s {shape[0]} rows into heads of an even "
                                  "width")
        return heads

    def close(self) -> None:
        self._data = {}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, key: str, raw: bool = False, target: np.dtype | None = None) -> np.ndarray:
        """One tensor: F32 / F16 / BF16 / F64 (and integers) as stored when `raw`, else float32; a
        quantized tensor dequantized by gguf to float32, then cast to `target` where given."""
        info = self.tensors[key]
        data, qtype = self._data[key]
        try:
            if info.dtype in STORED_FLOATS or info.dtype in INT_TYPES:
                arr = np.array(data)                # copied out of the mapping
                if info.dtype == "BF16":
                    arr = arr.view(ml_dtypes.bfloat16)
                if not raw and info.dtype in STORED_FLOATS:
                    arr = arr.astype(np.float32)
                return self._unpermuted(key, arr.reshape(info.shape))
            out = np.dtype(np.float32 if target is None else target)
            return self._unpermuted(key, self._dequantize(data, qtype, out).reshape(info.shape))
        finally:
            self._release(info)

    def _unpermuted(self, key: str, w: np.ndarray) -> np.ndarray:
        """llama.cpp's q / k rows back in HF order: its converter stored each head's rows as (pair, 2) of HF's
        (2, pair) -- rotate-half's halves interleaved; other tensors as they are."""
        heads = self.heads.get(key)
        if heads is None:
            return w
        rows, cols = w.shape
        return np.ascontiguousarray(w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))

    def _dequantize(self, data: np.ndarray, qtype, out_dtype: np.dtype) -> np.ndarray:
        """gguf.quants.dequantize over groups of whole blocks, each cast to `out_dtype` into one output array."""
        block, type_size = _sizes(qtype)
        n_blocks = data.size // type_size
        per_row = math.gcd(n_blocks, 1024)      # blocks per pseudo-row: gguf works a group of rows at a time
        rows = np.asarray(data).reshape(-1).reshape(n_blocks // per_row, per_row * type_size)
        out = np.empty((rows.shape[0], per_row * block), dtype=out_dtype)
        step = max(1, CHUNK_VALUES // (per_row * block))
        for a in range(0, rows.shape[0], step):
            values = self._quants.dequantize(rows[a:a + step], qtype)
            out[a:a + step] = values if values.dtype == out_dtype else values.astype(out_dtype)
        return out

    def _release(self, info: TensorInfo) -> None:
        """Drop a read tensor's pages from this process (they stay in the page cache), so a big file's
        mapping does not add up in the resident set."""
        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.start - info.start % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, info.end - start)
        except (OSError, ValueError):
            pass

    def quantization(self) -> dict[str, int]:
        """GGUF type name -> how many tensors the file stores in it."""
        out: dict[str, int] = {}
        for info in self.tensors.values():
            out[info.dtype] = out.get(info.dtype, 0) + 1
        return out


def _sizes(qtype) -> tuple[int, int]:
    from gguf.constants import GGML_QUANT_SIZES
    return GGML_QUANT_SIZES[qtype]


def _rename(name: str, architecture: str) -> str:
    table = T5_NAMES if architecture in T5_ARCHS else LLM_NAMES if architecture in LLM_ARCHS else ()
    for a, b in table:
        name = name.replace(a, b)
    return name


def _orig_shape(path: str, tensor, field) -> tuple[int, ...]:
    """ComfyUI-GGUF's record of a tensor's shape before its converter flattened it to rows of 256."""
    try:
        dims = tuple(int(d) for d in field.contents())
    except (TypeError, ValueError):
        dims = None
    if not dims or any(d < 0 for d in dims) or math.prod(dims) != int(tensor.n_elements):
        raise _bad(path, f"{ORIG_SHAPE}{tensor.name} = {dims} does not hold the tensor's "
                         f"{int(tensor.n_elements)} values")
    return dims


def _metadata(reader) -> dict[str, str]:
    """The file's scalar and string metadata as strings (arrays, e.g. vocabularies, left out)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or len(field.types) != 1:
            continue
        try:
            out[key] = str(field.contents())
        except (ValueError, TypeError, UnicodeDecodeError, IndexError):
            continue
    return out


def source_quantization(refs) -> dict[str, int]:
    """GGUF type name -> how many of a checkpoint's GGUF tensors are stored in it ({} with no GGUF file)."""
    seen: set[tuple[int, str]] = set()
    out: dict[str, int] = {}
    for ref in refs.values():
        for f, key in ref.stored:
            if isinstance(f, GGUFFile) and (id(f), key) not in seen:
                seen.add((id(f), key))
                out[f.tensors[key].dtype] = out.get(f.tensors[key].dtype, 0) + 1
    return dict(sorted(out.items()))


CARRIED = ("Q8_0", "Q4_0")     # block formats a target can keep as they are (compiler/targets/gguf_blocks.py)
GGUF_BLOCKS = "gguf_blocks.json"   # beside a component's model.onnx: where its carried weights' blocks lie


def carried_blocks(ref) -> dict | None:
    """Where the blocks of a 2-D weight lie when every byte of it is one GGUF block format a target
    can keep (CARRIED): {"type", "shape" [N, K], "segments": [[file, offset, rows]]}, the weight's rows
    being those segments' rows in order (a fused weight: one segment per part). Blocks run along the
    last axis, so a row of K values is K / 32 whole blocks wherever the file's converter flattened the
    tensor; None for anything else (float or K-quant storage, a scale, a width the block does not divide)."""
    parts = ref.parts or (ref,)
    if len(ref.shape) != 2 or any(not isinstance(p.file, GGUFFile) or p.scale or p.parts or p.key in p.file.heads
                                  for p in parts):
        return None
    kinds = {p.file.tensors[p.key].dtype for p in parts}
    if len(kinds) != 1 or (kind := kinds.pop()) not in CARRIED:
        return None
    n, k = ref.shape
    block, size = _sizes(_gguf(parts[0].file.path).GGMLQuantizationType[kind])
    if k % block:
        return None
    row_bytes = k // block * size
    segments = []
    for p in parts:
        info = p.file.tensors[p.key]
        rows = (info.end - info.start) // row_bytes
        if rows * row_bytes != info.end - info.start:
            return None
        a, b = p.rows or (0, rows)
        segments.append([os.path.abspath(p.file.path), info.start + a * row_bytes, b - a])
    if sum(r for _, _, r in segments) != n:
        return None
    return {"type": kind, "shape": [n, k], "segments": segments}
