"""Bundle manifests: reading them and verifying every file a bundle holds.

Owns: the manifest schema the runtime reads (schema version, model, components with IO and
shape profiles, artifacts with fingerprint spec, files with size, sha256 and -- past 64 MiB --
per-piece sha256s checked on every core), `file_record`, and `verify_bundle`, which names every
changed, missing or unexpected file. Standard library only: the runtime is thin.
"""
from __future__ import annotations

import hashlib
import mmap
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SCHEMA = 1
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """The bundle's manifest is missing, unreadable or from an unknown schema."""


PIECE = 64 << 20     # files over one piece also record each piece's sha256, checked on all cores


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


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    """sha256 of a file, read into one reused buffer (no per-block allocations)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
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

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def components(self) -> dict[str, dict]:
        return self.data["components"]

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]

    def artifacts(self, component: str | None = None) -> list[Artifact]:
        out = []
        for a in self.data["artifacts"]:
            if component is None or a["component"] == component:
                out.append(Artifact(a["id"], a["component"], a["backend"], a["fingerprint"], a["entry"],
                                    tuple(a["files"]), a.get("shapes", {}), a.get("metadata", {})))
        return out


def read_manifest(bundle: str | Path) -> Manifest:
    root = Path(bundle)
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{root}: not a precast bundle (no {MANIFEST})") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ManifestError(f"{path}: schema {data.get('schema') if isinstance(data, dict) else '?'} "
                            f"is not {SCHEMA}; this precast reads schema {SCHEMA}")
    for key in ("model", "components", "artifacts", "files"):
        if key not in data:
            raise ManifestError(f"{path}: missing field {key!r}")
    return Manifest(root, data)


def verify_file(root: Path, rel: str, record: dict, whole: bool = False) -> str | None:
    """None when the file matches its record. Where the record has piece digests they are checked
    (all cores at once); `whole` checks the whole-file sha256 as well (`precast bundle verify`)."""
    p = root / rel
    if not p.is_file() or p.is_symlink():
        return f"{rel}: missing"
    if p.stat().st_size != record["size"]:
        return f"{rel}: size {p.stat().st_size}, manifest says {record['size']}"
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
    """Problems found, one line each naming the file; empty when the bundle is intact."""
    m = read_manifest(bundle)
    problems = [p for rel, rec in sorted(m.files.items()) if (p := verify_file(m.root, rel, rec, whole=True))]
    listed = set(m.files) | {MANIFEST}
    for p in sorted(m.root.rglob("*")):
        rel = p.relative_to(m.root).as_posix()
        if (p.is_file() or p.is_symlink()) and rel not in listed:
            problems.append(f"{rel}: not listed in the manifest")
    for a in m.artifacts():
        for rel in a.files:
            if rel not in m.files:
                problems.append(f"{rel}: artifact {a.id} needs it but the manifest does not list it")
    return problems
