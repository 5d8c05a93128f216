"""Bundle manifests: reading them and verifying every file a bundle holds.

Owns: the manifest schema the runtime reads (schema version, model, components with IO and
shape profiles, artifacts with fingerprint spec, files with size, sha256 and -- past 64 MiB --
per-piece sha256s checked on every core), its validation when read (`check_manifest`: the type
of every field the runtime uses, so a damaged manifest is one ManifestError naming the field),
`file_record`, `verify_file` (one file against its record, skipped when runtime/verified.py holds a
record of this very file state), `verify_bundle`, which re-hashes every file and names every changed,
missing or unexpected file, and `bytes_hashed`, the count of bytes read through the hash functions.
Standard library only: the runtime is thin.

Which digest protects what: `files[rel].sha256` (and its `pieces`) is the one that protects bytes: each
file is checked against it before it is read, by `bundle verify`, and as it is unpacked. An artifact's
`sha256` and `size` repeat its entry file's sha256 and its files' total size for readers of one record;
check_manifest refuses a manifest where they disagree with `files` (one line naming the artifact and the
field). The model's `source_sha256` and the `sha256` of its vae, text_encoders, controlnets, loras and
embeddings are provenance, not integrity: they name the inputs the bundle was built from (files that are
not in it; `bundle merge` joins only shards whose model records are equal), and nothing here can check
them. manifest.json itself carries no digest of its own; its structure is what check_manifest checks.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError
from .fingerprint import Fingerprint
from .verified import RECORD_FILE, VerifiedFiles, verify_mode

SCHEMA = 1
PREDICTIONS = ("epsilon", "v_prediction", "flow")
MAX_PROFILE_SIDE = 16384      # px: a profile past this is a damaged manifest, not a model
MANIFEST = "manifest.json"
_HEX = frozenset("0123456789abcdef")


class ManifestError(UserError, ValueError):
    """The bundle's manifest is missing, unreadable, from an unknown schema or malformed (a user
    error: the CLI reports it as one line, exit 2)."""


PIECE = 64 << 20     # files over one piece also record each piece's sha256, checked on all cores

_hashed = 0
_hashed_lock = threading.Lock()


def bytes_hashed() -> int:
    """Bytes read through sha256_file and piece_digests by this process so far (what a second open
    of an unchanged bundle should add nothing to)."""
    return _hashed


def _count(n: int) -> None:
    global _hashed
    with _hashed_lock:
        _hashed += n


def file_record(path: Path) -> dict:
    """{"size", "sha256"} of a file, plus "pieces" (sha256 of each PIECE-byte slice, in order) for
    files over one piece, so that loading can check a multi-GB artifact on every core at once.
    The whole-file digest and the piece digests are computed side by side."""
    size = Path(path).stat().st_size
    if size <= PIECE:
        return {"size": size, "sha256": sha256_file(path)}
    with ThreadPoolExecutor(max_workers=1) as one:
        whole = one.submit(sha256_file, path)
        pieces = piece_digests(path, size)
        return {"size": size, "sha256": whole.result(), "pieces": pieces}


def piece_digests(path: Path, size: int | None = None, workers: int | None = None) -> list[str]:
    """sha256 of each PIECE-byte slice of the file, hashed on `workers` threads straight from a
    read-only mapping (hashlib releases the GIL; no copy out of the page cache: SD 1.5 UNet's
    3.4 GB on 2 cores, 1.8 s with reads -> 1.3 s)."""
    size = Path(path).stat().st_size if size is None else size
    if size == 0:
        return []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            def one(i: int) -> str:
                return hashlib.sha256(view[i * PIECE:(i + 1) * PIECE]).hexdigest()
            count = -(-size // PIECE)
            with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
                return list(pool.map(one, range(count)))
        finally:
            view.release()
            _count(size)


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    """sha256 of a file, read into one reused buffer (no per-block allocations)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                total += n
    finally:
        _count(total)
    return h.hexdigest()


@dataclass(frozen=True)
class Artifact:
    id: str
    component: str
    backend: str
    fingerprint: str
    entry: str                  # path of the file a session opens, relative to the bundle
    files: tuple[str, ...]      # every file it needs, relative to the bundle
    shapes: dict                # input -> [min, opt, max]
    metadata: dict              # backend details (compile config, CCs, ...)


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict
    verified: VerifiedFiles | None = field(default=None, compare=False, repr=False)   # None: records off

    def with_verify(self, verify) -> "Manifest":
        """This manifest with the verification `verify` asks for (runtime/verified.py's verify_mode):
        True/"auto" trusts records of unchanged file states, "full" hashes every file again and
        refreshes the records, False checks no engine or ONNX file at all (callers skip them)."""
        mode = verify_mode(verify)
        return Manifest(self.root, self.data, VerifiedFiles(self.root, full=mode == "full", known=self.files))

    def verify_file(self, rel: str, whole: bool = False) -> str | None:
        """verify_file for a listed file, through (and recording into) this manifest's records."""
        return verify_file(self.root, rel, self.files[rel], whole, self.verified)

    def save_records(self) -> None:
        if self.verified is not None:
            self.verified.save()

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def components(self) -> dict[str, dict]:
        return self.data["components"]

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]

    def check_file(self, rel: str, required: bool = True) -> None:
        """Raise a UserError naming `rel` unless it matches its record (size, sha256). A file the
        manifest does not list is an error when required or when it is present anyway."""
        where = f"{self.root}/{rel}"
        if rel not in self.files:
            if required or os.path.lexists(self.root / rel):
                raise UserError(f"{where}: not listed in the bundle's manifest, so it cannot be checked; "
                                "the bundle was changed after it was built: rebuild or re-download it")
            return
        problem = self.verify_file(rel)
        self.save_records()
        if problem:
            raise UserError(f"{self.root}/{problem}; refusing to read it: rebuild or re-download the bundle")

    def artifacts(self, component: str | None = None) -> list[Artifact]:
        out = []
        for a in self.data["artifacts"]:
            if component is None or a["component"] == component:
                out.append(Artifact(a["id"], a["component"], a["backend"], a["fingerprint"], a["entry"],
                                    tuple(a["files"]), a.get("shapes", {}), a.get("metadata", {})))
        return out


_NOT_A_FOLDER = ("{root}: not a precast bundle: it is a file, not a folder (a bundle is a folder holding "
                 f"{MANIFEST}; unpack an archive with `precast bundle unpack`)")


def read_manifest(bundle: str | Path) -> Manifest:
    root = Path(bundle)
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if not os.path.lexists(root):
            raise ManifestError(f"{root}: not a precast bundle: the path does not exist (check it; a bundle is "
                                "the folder `precast build` or `precast bundle unpack` wrote)") from None
        if not root.is_dir():
            raise ManifestError(_NOT_A_FOLDER.format(root=root)) from None
        if (root / "precast_export.json").is_file():
            raise ManifestError(f"{root}: not a precast bundle but an export (ONNX, no {MANIFEST}); make a bundle "
                                "with `precast build RECIPE --out DIR`, or engines with `precast compile`") from None
        raise ManifestError(f"{root}: not a precast bundle (no {MANIFEST})") from None
    except NotADirectoryError:
        raise ManifestError(_NOT_A_FOLDER.format(root=root)) from None
    except RecursionError:
        raise ManifestError(f"{path}: unreadable (nested too deeply)") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable ({e})") from None
    data = check_manifest(data, str(path))
    return Manifest(root, data, VerifiedFiles(root, known=data["files"]))


def check_manifest(data, where: str) -> dict:
    """`data` when it has the structure the runtime reads; else ManifestError naming the field."""
    if not isinstance(data, dict) or type(data.get("schema")) is not int or data.get("schema") != SCHEMA:
        raise ManifestError(f"{where}: schema {data.get('schema') if isinstance(data, dict) else '?'} "
                            f"is not {SCHEMA}; this precast reads schema {SCHEMA}")
    for key in ("model", "components", "artifacts", "files"):
        if key not in data:
            raise ManifestError(f"{where}: missing field {key!r}")
    check = _Checker(where)
    files = check.of(data, "files", dict)
    for rel, rec in files.items():
        check.path(rel, "files")
        check_record(check, rec, f"files[{rel!r}]")
    model = check.of(data, "model", dict)
    for key in ("family", "variant", "source", "source_sha256"):
        check.of(model, key, str, "model")
    if check.of(model, "prediction", (str, type(None)), "model", optional=True) not in (None, *PREDICTIONS):
        check.fail("model.prediction", f"is {_shown(model['prediction'])}, expected one of {', '.join(PREDICTIONS)}")
    scale = check.of(model, "latent_scale", (int, float, type(None)), "model", optional=True)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        check.fail("model.latent_scale", f"is {_shown(scale)}, expected a finite number above 0")
    shift = check.of(model, "latent_shift", (int, float), "model", optional=True)
    if shift is not None and not math.isfinite(shift):
        check.fail("model.latent_shift", f"is {_shown(shift)}, expected a finite number")
    for key, low, high in (("t5_tokens", 1, 4096), ("steps", 1, 1000)):
        value = check.of(model, key, int, "model", optional=True)
        if value is not None and not low <= value <= high:
            check.fail(f"model.{key}", f"is {value}, expected {low} to {high}")
    guidance = check.of(model, "guidance", (int, float), "model", optional=True)
    if guidance is not None and not math.isfinite(guidance):
        check.fail("model.guidance", f"is {_shown(guidance)}, expected a finite number")
    from .flow import schedule_problem
    problem = schedule_problem(check.of(model, "scheduler", dict, "model", optional=True) or {})
    if problem:
        check.fail("model.scheduler", f"is unusable ({problem})")
    names = set()
    for i, emb in enumerate(check.of(model, "embeddings", (list, type(None)), "model", optional=True) or []):
        field = f"model.embeddings[{i}]"
        name = check.of(emb, "name", str, field)
        if not name or any(c.isspace() for c in name) or name in names:
            check.fail(f"{field}.name", f"is {_shown(name)}: a trigger word must be one word, used once")
        names.add(name)
        check.listed(check.of(emb, "file", str, field), files, f"{field}.file")
    components = check.of(data, "components", dict)
    if not components:
        check.fail("components", "is empty")
    for name, comp in components.items():
        _check_component(check, comp, f"components.{name}", files)
    for i, art in enumerate(check.of(data, "artifacts", list)):
        _check_artifact(check, art, f"artifacts[{i}]", files)
    return data


def path_problem(rel) -> str | None:
    """Why `rel` cannot name a file inside a bundle, or None. Bundle paths are relative and
    '/'-separated, with no empty, '.' or '..' component and no backslash, so they never leave it."""
    if not isinstance(rel, str) or not rel:
        return f"is {_shown(rel)}, not a path"
    if rel.startswith("/"):
        return f"{rel!r} is an absolute path"
    if "\\" in rel or "\0" in rel:
        return f"{rel!r} holds a backslash or NUL"
    parts = rel.split("/")
    if ".." in parts:
        return f"{rel!r} has a '..' component"
    if "" in parts or "." in parts:
        return f"{rel!r} has an empty or '.' component"
    return None


def check_record(check: "_Checker", rec, field: str) -> None:
    """A file record: {size, sha256[, pieces]}."""
    size = check.of(rec, "size", int, field)
    if size < 0:
        check.fail(f"{field}.size", f"is {size}, expected a size in bytes")
    for digest in [check.of(rec, "sha256", str, field), *(check.of(rec, "pieces", list, field, optional=True) or [])]:
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
            check.fail(f"{field}.sha256", f"holds {_shown(digest)}, not a sha256 hex digest")
    pieces = rec.get("pieces")
    if pieces is not None and len(pieces) != -(-size // PIECE):
        check.fail(f"{field}.pieces", f"has {len(pieces)} digests; a {size}-byte file has {-(-size // PIECE)}")


def _check_component(check: "_Checker", comp, field: str, files: dict) -> None:
    check.of(comp, "dtype", str, field)
    listed = check.of(comp, "files", list, field)
    for i, rel in enumerate(listed):
        check.listed(rel, files, f"{field}.files[{i}]")
    onnx = check.of(comp, "onnx", str, field)
    if onnx not in listed:
        check.fail(f"{field}.onnx", f"{onnx!r} is not one of the component's files")
    for io in ("inputs", "outputs"):
        for i, item in enumerate(check.of(comp, io, list, field)):
            check.of(item, "name", str, f"{field}.{io}[{i}]")
            check.of(item, "shape", list, f"{field}.{io}[{i}]", optional=True)
    config = check.of(comp, "config", dict, field, optional=True) or {}
    for key in ("vocab", "hidden"):
        value = check.of(config, key, int, f"{field}.config", optional=True)
        if value is not None and value < 1:
            check.fail(f"{field}.config.{key}", f"is {value}, expected 1 or more")
    levels = check.of(config, "decoder_levels", int, f"{field}.config", optional=True)
    if levels is not None and not 1 <= levels <= 8:      # the latent factor is 2 ** (levels - 1)
        check.fail(f"{field}.config.decoder_levels", f"is {levels}, expected 1 to 8")
    profiles = check.of(comp, "profiles", list, field)
    if not profiles:
        check.fail(f"{field}.profiles", "is empty")
    for i, prof in enumerate(profiles):
        for dim in ("width", "height"):
            check.triple(check.of(prof, dim, list, f"{field}.profiles[{i}]"), f"{field}.profiles[{i}].{dim}", int,
                         MAX_PROFILE_SIDE)
        t5 = check.of(prof, "t5_tokens", (list, type(None)), f"{field}.profiles[{i}]", optional=True)
        if t5 is not None:
            check.triple(t5, f"{field}.profiles[{i}].t5_tokens", int, 4096)


def _check_artifact(check: "_Checker", art, field: str, files: dict) -> None:
    for key in ("id", "component", "backend"):
        check.of(art, key, str, field)
    try:
        Fingerprint.from_string(check.of(art, "fingerprint", str, field))
    except ValueError as e:
        check.fail(f"{field}.fingerprint", f"is invalid ({e})")
    listed = check.of(art, "files", list, field)
    for i, rel in enumerate(listed):
        check.listed(rel, files, f"{field}.files[{i}]")
    entry = check.of(art, "entry", str, field)
    if entry not in listed:
        check.fail(f"{field}.entry", f"{entry!r} is not one of the artifact's files")
    who = f"(artifact {art['id']!r})"
    sha = check.of(art, "sha256", str, field, optional=True)
    if sha is not None and sha != files[entry]["sha256"]:
        check.fail(f"{field}.sha256", f"{who} is {sha[:16]}..., but its entry's record files[{entry!r}].sha256 "
                                      f"is {files[entry]['sha256'][:16]}...")
    size, total = check.of(art, "size", int, field, optional=True), sum(files[rel]["size"] for rel in set(listed))
    if size is not None and size != total:
        check.fail(f"{field}.size", f"{who} is {size}, but the records of its files in files add up to {total}")
    for name, prof in (check.of(art, "shapes", dict, field, optional=True) or {}).items():
        check.triple(prof, f"{field}.shapes.{name}", list)
        for shape in prof:
            if not all(type(n) is int for n in shape):
                check.fail(f"{field}.shapes.{name}", f"holds {_shown(shape)}, not a shape of integers")
    check.of(art, "metadata", dict, field, optional=True)


def _shown(value) -> str:
    if isinstance(value, (dict, list)):
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Checker:
    """Type checks that raise one ManifestError naming the manifest file and the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str):
        raise ManifestError(f"{self.where}: field {field} {problem}; the manifest is damaged or was edited "
                            "by hand: rebuild or re-download the bundle")

    def of(self, obj, key: str, kind, parent: str = "", optional: bool = False):
        """obj[key], which must be a `kind` (absent allowed when optional; null only where kind has NoneType)."""
        field = f"{parent}.{key}" if parent else key
        if not isinstance(obj, dict):
            self.fail(parent or "(top level)", f"is {_shown(obj)}, expected an object")
        value = obj.get(key)
        if key not in obj and optional:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if key not in obj or not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = "a number" if float in kinds else {dict: "an object", list: "a list", str: "a string",
                                                       int: "an integer"}[kinds[0]]
            self.fail(field, f"is missing, expected {names}" if key not in obj else
                      f"is {_shown(value)}, expected {names}")
        return value

    def triple(self, value, field: str, kind, limit: int | None = None) -> None:
        if not isinstance(value, list) or len(value) != 3 or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in value):
            self.fail(field, f"is {_shown(value)}, expected [min, opt, max]")
        if limit is not None and not 1 <= value[0] <= value[1] <= value[2] <= limit:
            self.fail(field, f"is {_shown(value)}, expected 1 <= min <= opt <= max <= {limit}")

    def path(self, rel, field: str) -> None:
        why = path_problem(rel)
        if why:
            raise ManifestError(f"{self.where}: field {field}: {why}: a bundle's files are named relative to its "
                                "folder, '/'-separated, without '..'; refusing this bundle (rebuild or re-download it)")

    def listed(self, rel, files: dict, field: str) -> None:
        self.path(rel, field)
        if rel not in files:
            self.fail(field, f"names {rel!r}, which the manifest's files do not list")


def verify_file(root: Path, rel: str, record: dict, whole: bool = False,
                records: VerifiedFiles | None = None) -> str | None:
    """None when the file matches its record. Where the record has piece digests they are checked
    (all cores at once); `whole` checks the whole-file sha256 as well (`precast bundle verify`).
    With `records`, a record of this exact file state (device, inode, size, mtime, ctime) and these
    expected digests stands for the hash; a file hashed and found matching is recorded, one found
    changed has its records dropped (saving them is the caller's: `records.save()`)."""
    p = root / rel
    if not p.is_file() or p.is_symlink():
        return f"{rel}: missing"
    if os.path.realpath(p) != os.path.join(os.path.realpath(root), *rel.split("/")):
        return f"{rel}: reached through a link that leaves the bundle folder (bundle files must be plain files in it)"
    started = time.time_ns()
    before = p.stat()
    if records is not None and records.trusted(rel, before, record, whole):
        return None
    problem = _hash_problem(p, rel, record, before.st_size, whole)
    if records is not None:
        if problem:
            records.forget(rel)
        else:
            records.add(rel, before, p.stat(), record, whole, started)
    return problem


def _hash_problem(p: Path, rel: str, record: dict, size: int, whole: bool) -> str | None:
    if size != record["size"]:
        return f"{rel}: size {size}, manifest says {record['size']}"
    pieces = record.get("pieces")
    if pieces is not None:
        got = piece_digests(p, record["size"])
        bad = next((i for i, (a, b) in enumerate(zip(got, pieces)) if a != b), None)
        if bad is not None or len(got) != len(pieces):
            where = f" (bytes from {bad * PIECE})" if bad is not None else ""
            return f"{rel}: sha256 differs from the manifest (changed or damaged){where}"
    if (pieces is None or whole) and sha256_file(p) != record["sha256"]:
        return f"{rel}: sha256 differs from the manifest (changed or damaged)"
    return None


def verify_bundle(bundle: str | Path) -> list[str]:
    """Problems found, one line each naming the file; empty when the bundle is intact. Every file
    is hashed again (records are not trusted here) and the records are refreshed; the record file
    (verified.RECORD_FILE) is the one file a bundle may hold besides those its manifest lists."""
    m = read_manifest(bundle).with_verify("full")
    problems = [p for rel in sorted(m.files) if (p := m.verify_file(rel, whole=True))]
    m.save_records()
    listed = set(m.files) | {MANIFEST, RECORD_FILE}
    for p in sorted(m.root.rglob("*")):
        rel = p.relative_to(m.root).as_posix()
        if (p.is_file() or p.is_symlink()) and rel not in listed:
            problems.append(f"{rel}: not listed in the manifest")
    return problems
