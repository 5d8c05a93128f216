"""File digests: the records a bundle's (and the cache's) files are checked against, and the check.

Owns: `file_record` ({size, sha256}, plus the sha256 of each PIECE-byte slice for files over one piece,
so a multi-GB artifact is checked on every core at once), `sha256_file`, `piece_digests`, `verify_file`
(one file against its record, skipped when runtime/verified.py holds a record of this very file state)
and `bytes_hashed`, the count of bytes read through the hash functions. Standard library only.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .verified import VerifiedFiles

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
