"""Textual-inversion embedding files, read without ever running a pickle's code.

Owns: the user formats (MODEL_FORMATS.md §6) -- safetensors `emb_params` [n, dim] (SD 1.x/2.x),
SDXL `clip_l` [n, 768] + `clip_g` [n, 1280], diffusers' one-key `{token: tensor}`, and the
A1111 `.pt` / diffusers `.bin` torch files (`string_to_param: {"*": tensor}`) -- and which text
encoder each set of vectors belongs to (by name for SDXL, else by width). Torch files are read
by `load_torch_restricted`: the zip container is opened by hand and its pickle is run through an
Unpickler whose find_class admits only torch's tensor-rebuild functions, its storage types and
OrderedDict; anything else (a function to call, an object to build) is refused with a hint,
before it runs. Sizes are checked before anything is inflated: each zip member's (from the zip's
directory; stored or deflated only, and never inflated past that size), each storage's declared
element count, and all storages' bytes and all tensors' elements together. Legacy (non-zip) torch
files are refused.
"""
from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ...runtime.embeddings import MAX_EXTRA_ROWS
from ...runtime.manifest import sha256_file
from ..errors import BadInput
from .safetensors_file import SafetensorsFile

SDXL_KEYS = {"clip_l": 768, "clip_g": 1280}
PT_HINT = ("convert it once, in an environment you trust, to .safetensors: python -c \"import torch, "
           "safetensors.torch as st; d = torch.load('IN.pt', weights_only=True); "
           "st.save_file({'emb_params': d['string_to_param']['*'].contiguous()}, 'OUT.safetensors')\"")

_STORAGE_DTYPES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
                   "BFloat16Storage": "bf16", "LongStorage": np.int64, "IntStorage": np.int32,
                   "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
                   "BoolStorage": np.bool_}


class _StorageType:
    def __init__(self, name: str):
        self.name = name


class _Malformed(Exception):
    """A tensor record that does not fit its storage; load_torch_restricted names the file."""


MAX_TENSOR_ELEMENTS = 1 << 26    # 64 Mi elements: far above any embedding, far below a memory blow-up
MAX_STORAGE_BYTES = 256 << 20    # a file's storages together (64 Mi float32 values)
MAX_PICKLE_BYTES = 16 << 20      # data.pkl: an embedding's is a few hundred bytes


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise _Malformed(f"tensor {what} {value!r:.80} is not a list of integers")
    if any(v < 0 for v in value):
        raise _Malformed(f"tensor {what} {value!r:.80} has a negative entry")
    return tuple(value)


def _rebuild_tensor(storage, offset, size, stride, *_rest, room=MAX_TENSOR_ELEMENTS):
    """A tensor as a numpy copy of its storage's elements, after checking that every element the
    (offset, size, stride) record addresses lies inside the storage (a pickle's numbers are data,
    and numpy's as_strided would read whatever memory they point at) and that it has at most
    `room` elements (what the file's earlier tensors left of MAX_TENSOR_ELEMENTS)."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise _Malformed(f"tensor storage is a {type(storage).__name__}, not a torch storage")
    if type(offset) is not int or offset < 0:
        raise _Malformed(f"tensor storage offset {offset!r:.80} is not a non-negative integer")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise _Malformed(f"tensor size {list(size)} and stride {list(stride)} differ in length")
    count = int(np.prod(size, dtype=object))
    if count > room:
        raise _Malformed(f"tensor size {list(size)} has {count} elements, which brings the file's tensors over "
                         f"the limit of {MAX_TENSOR_ELEMENTS}")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if count else offset - 1
    if last >= storage.size:
        raise _Malformed(f"storage too small for size/stride: size {list(size)}, stride {list(stride)} and "
                         f"offset {offset} reach element {last}, the storage holds {storage.size}")
    if not size:
        return np.array(storage[offset], copy=True)
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=tuple(s * itemsize for s in stride), writeable=False)
    return np.array(view, copy=True)


def _rebuild_parameter(data, *_rest):
    return data


def _read_member(archive: zipfile.ZipFile, name: str, limit: int, path: str) -> bytes | None:
    """A zip member's bytes (None when absent), refused before anything is inflated when the zip's
    directory says it is bigger than limit or compressed otherwise than stored or deflated (torch
    stores; bzip2 and lzma inflate without a bound); never inflated past the size it says."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        return None
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise BadInput(f"{path}: refused: {name} is compressed with zip method {info.compress_type}; torch files "
                       "store their members (or deflate them)")
    if info.file_size > limit:
        raise BadInput(f"{path}: refused: {name} inflates to {info.file_size} bytes, over the limit of {limit} "
                       "for an embedding file; the file is damaged or crafted")
    with archive.open(info) as f:
        return f.read(info.file_size)


class _Restricted(pickle.Unpickler):
    """Admits tensors and plain containers only; everything else raises before it is called."""
    ALLOWED = {("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
               ("collections", "OrderedDict"): dict}
    REBUILDS = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")}

    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str, path: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.root, self.path = archive, root, path
        self.storages, self.bytes_left, self.elements_left = {}, MAX_STORAGE_BYTES, MAX_TENSOR_ELEMENTS

    def find_class(self, module, name):
        if (module, name) in self.REBUILDS:
            return self._rebuild
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise BadInput(f"{self.path}: refused: the pickle asks for {module}.{name}, which is not a tensor or a "
                       f"plain container (a pickle can run code; precast loads only tensors). If you trust the "
                       f"file, {PT_HINT}")

    def _rebuild(self, storage, offset, size, stride, *_rest):
        tensor = _rebuild_tensor(storage, offset, size, stride, room=self.elements_left)
        self.elements_left -= tensor.size
        return tensor

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise BadInput(f"{self.path}: refused: unexpected persistent id {pid!r:.80}")
        key = (pid[1].name, str(pid[2]))
        if key not in self.storages:              # each storage read once, however many tensors use it
            self.storages[key] = self._load_storage(pid)
        return self.storages[key]

    def _load_storage(self, pid):
        dtype = _STORAGE_DTYPES[pid[1].name]
        itemsize = 2 if dtype == "bf16" else np.dtype(dtype).itemsize
        numel = pid[4] if len(pid) > 4 else 0
        if type(numel) is not int or not 0 <= numel * itemsize <= self.bytes_left:
            raise BadInput(f"{self.path}: refused: storage {pid[2]} declares {numel!r:.40} elements, more than the "
                           f"limit of {MAX_STORAGE_BYTES} bytes for an embedding file's storages leaves; "
                           "the file is damaged or crafted")
        raw = _read_member(self.archive, f"{self.root}/data/{pid[2]}", self.bytes_left, self.path)
        if raw is None:
            raise BadInput(f"{self.path}: damaged: storage {pid[2]} is missing from the archive")
        self.bytes_left -= len(raw)
        if len(raw) % itemsize:
            raise BadInput(f"{self.path}: damaged: storage {pid[2]} holds {len(raw)} bytes, "
                           f"not a whole number of {itemsize}-byte elements")
        if dtype == "bf16":
            return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))


def load_torch_restricted(path: str | Path):
    """A torch.save zip file's object, with tensors as numpy arrays; refuses anything else."""
    path = str(path)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise BadInput(f"{path}: a legacy (non-zip) torch file or a raw pickle; precast does not unpickle those. "
                       f"If you trust it, {PT_HINT}") from None
    with archive:
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise BadInput(f"{path}: not a torch.save archive (no single */data.pkl)")
        root = pkl[0].split("/")[0]
        try:
            return _Restricted(_read_member(archive, pkl[0], MAX_PICKLE_BYTES, path), archive, root, path).load()
        except BadInput:
            raise
        except _Malformed as e:
            raise BadInput(f"{path}: refused: {e}; the file is damaged or crafted") from None
        except Exception as e:  # a malformed pickle: say so, never a traceback
            raise BadInput(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None


def _as_matrix(path: str, key: str, arr) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.floating):
        raise BadInput(f"{path}: {key} is not a float vector or [n, dim] matrix")
    if arr.size == 0:
        raise BadInput(f"{path}: {key} has shape {list(arr.shape)}, no vectors; an embedding needs at least one")
    out = np.asarray(arr, np.float32).reshape(-1, arr.shape[-1])
    if not np.isfinite(out).all():
        raise BadInput(f"{path}: {key} holds NaN or infinite values (or values past float32's range); "
                       "the embedding is damaged: re-train or re-download it")
    return out


def read_embedding(path: str | Path) -> dict[str, np.ndarray]:
    """{'clip_l' | 'clip_g' | 'any': [n, dim] float32} from any supported embedding file."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"embedding {p}: no such file")
    with open(p, "rb") as f:
        head = f.read(4)
    if p.suffix.lower() in (".pt", ".bin", ".ckpt", ".pth") or head[:2] == b"PK" or head[:1] == b"\x80":
        obj = load_torch_restricted(p)
        if not isinstance(obj, dict):
            raise BadInput(f"{p}: expected a dict of tensors, found {type(obj).__name__}")
        tensors = obj.get("string_to_param")
        if isinstance(tensors, dict) and tensors:
            return {"any": _as_matrix(str(p), "string_to_param", next(iter(tensors.values())))}
        obj = {k: v for k, v in obj.items() if isinstance(v, np.ndarray)}
    else:
        f = SafetensorsFile(p)
        try:
            obj = {k: f.read(k) for k in f.keys()}
        finally:
            f.close()
    if set(SDXL_KEYS) & set(obj):
        return {k: _as_matrix(str(p), k, obj[k]) for k in SDXL_KEYS if k in obj}
    if "emb_params" in obj:
        return {"any": _as_matrix(str(p), "emb_params", obj["emb_params"])}
    if len(obj) == 1:  # diffusers: {token: tensor}
        key, arr = next(iter(obj.items()))
        return {"any": _as_matrix(str(p), key, arr)}
    raise BadInput(f"{p}: not a textual-inversion embedding (expected emb_params, clip_l/clip_g, "
                   f"string_to_param or one tensor; found {', '.join(sorted(obj)[:5]) or 'nothing'})")


def assign_encoders(path: str | Path, vectors: dict[str, np.ndarray], encoders: dict[str, int]) -> dict[str, np.ndarray]:
    """{text-encoder component: vectors} given the model's encoders {component: hidden width}.
    clip_l / clip_g go to the encoder of width 768 / 1280; other vectors to the encoder of their width."""
    out = {}
    for key, vec in vectors.items():
        width = vec.shape[1]
        want = SDXL_KEYS.get(key, width)
        if want != width:
            raise BadInput(f"{path}: {key} vectors are {width} wide; expected {want}")
        comps = [c for c, h in encoders.items() if h == width]
        if not comps:
            raise BadInput(f"embedding {path}: its vectors are {width} wide but this model's text encoders are "
                           f"{', '.join(f'{c} {h}' for c, h in encoders.items()) or 'absent'}; "
                           "it was trained for another model family")
        out[comps[0]] = vec
    return out


def encoder_widths(ckpt, components: dict) -> dict[str, int]:
    """{text-encoder component: hidden width} of a checkpoint, from its token-embedding tables
    (`components`: its family's, compiler/families/)."""
    out = {}
    for name, comp in components.items():
        if not name.startswith("text_encoder"):
            continue
        prefix = comp.prefix_in(ckpt.refs)
        for key in ("embeddings.token_embedding.weight", "token_embedding.weight"):
            if prefix is not None and prefix + key in ckpt.refs:
                out[name] = int(ckpt.shape(prefix + key)[1])
                break
    return out


def write_bundle_embeddings(paths, encoders: dict[str, int], root: Path) -> tuple[list[dict], dict[str, dict]]:
    """Each embedding file -> `embeddings/<stem>.safetensors` under root, one tensor per text-encoder
    component; returns (manifest entries, {bundle path: {size, sha256}})."""

    entries, files, seen, rows = [], {}, {}, 0
    for path in paths:
        p = Path(path)
        name = p.stem
        if not name or any(c.isspace() for c in name):
            raise BadInput(f"embedding {p}: its name (the file stem) is the trigger word and must be one word")
        if name.lower() in seen:
            raise BadInput(f"embedding {p}: {seen[name.lower()]} has the same trigger word {name!r}; rename one")
        seen[name.lower()] = str(p)
        vectors = assign_encoders(p, read_embedding(p), encoders)
        rows += next(iter(vectors.values())).shape[0]
        if rows > MAX_EXTRA_ROWS - 1:
            raise BadInput(f"embedding {p}: brings the embeddings to {rows} vectors in all, over the runtime's limit "
                           f"of {MAX_EXTRA_ROWS - 1} (the text encoders' extra-token input); use fewer embeddings")
        rel = f"embeddings/{name}.safetensors"
        (root / "embeddings").mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in sorted(vectors.items())}, str(root / rel))
        files[rel] = {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
        entries.append({"name": name, "sha256": sha256_file(p), "file": rel,
                        "vectors": int(next(iter(vectors.values())).shape[0]), "encoders": sorted(vectors)})
    return entries, files
