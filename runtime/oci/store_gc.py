"""The store's space reclaimed (runtime/oci/store.py's layout), and the lock that keeps that safe beside opens.

Owns: `store_root` (where the store is), `store_lock` (`.lock` in the store, flock: shared by each open, exclusive for collecting), `references`
(the pulled references' folders, least recently opened first), `store_size` and `collect`, run by `precast
cache gc`: blobs no reference's folder links any more (a tag that moved, a manifest.json only doctor read),
downloads left partial, lock files; with a size limit, also the references opened least recently (their
folders, and what only they held). Collect waits for no one: with an open running it removes nothing an
open could be using (partial downloads no pull holds excepted) and says so. Where flock is missing (Windows)
it does the same. Standard library, and filelock for the per-blob locks.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..manifest import MANIFEST


def store_root(env=os.environ) -> Path:
    """The store's folder: `oci/` in $PRECAST_CACHE, else in the user cache folder platformdirs names for precast."""
    if env.get("PRECAST_CACHE"):
        return Path(env["PRECAST_CACHE"]) / "oci"
    import platformdirs
    return Path(platformdirs.user_cache_dir("precast")) / "oci"


@contextmanager
def store_lock(root: Path, exclusive: bool, wait: bool = True):
    """The store's lock, `root/.lock`: shared by opens, exclusive for collect. Yields whether it is held (False:
    `wait=False` and someone else holds it; None: no flock here, Windows)."""
    try:
        import fcntl
    except ImportError:
        yield None
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def references(root: Path) -> list[Path]:
    """The store's pulled references (folders holding a manifest.json under refs/), least recently opened first."""
    refs, found = root / "refs", []
    for p in sorted(refs.rglob(MANIFEST), key=lambda p: len(p.parts)) if refs.is_dir() else ():
        rel = p.parent.relative_to(refs)
        if not any(part.startswith(".") for part in rel.parts) and not any(f in p.parents for f in found):
            found.append(p.parent)          # a bundle's own files are not references, nor a pull's staging
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _blob_files(blobs: Path) -> list[Path]:
    return [p for p in blobs.iterdir() if p.is_file() and len(p.name) == 64] if blobs.is_dir() else []


def store_size(root: Path) -> int:
    """Bytes the store holds: each blob once (the references' folders are hard links to them) and their own
    manifests."""
    return sum(p.stat().st_size for p in _blob_files(root / "blobs" / "sha256")) + sum(
        (f / MANIFEST).stat().st_size for f in references(root))


def collect(root: Path | None = None, max_size: int | None = None, env=os.environ) -> dict:
    """Reclaim the store's space (see the module's words); `max_size`: also remove the least recently opened
    references until the store holds at most that many bytes. Returns what it did."""
    root = root or store_root(env)
    out = {"store": str(root), "blobs_removed": 0, "bytes_freed": 0, "references_removed": [], "partial_removed": 0,
           "skipped": None, "size": 0}
    if not root.is_dir():
        return out
    blobs = root / "blobs" / "sha256"
    with store_lock(root, exclusive=True, wait=False) as held:
        if held is False:
            out["skipped"] = "another precast process has the store open (a pull or a generate): run gc again later"
        elif held is None:
            out["skipped"] = "without flock (Windows) blobs are kept: delete the folder to reclaim its space"
        for part in blobs.glob("*.partial") if blobs.is_dir() else ():
            lock = blobs / ".locks" / (part.name[:64] + ".lock")
            if held or not _locked(lock):
                out["bytes_freed"] += part.stat().st_size
                part.unlink(missing_ok=True)
                out["partial_removed"] += 1
        if held:
            _drop_orphans(blobs, out)
            for ref in references(root) if max_size is not None else ():
                if store_size(root) <= max_size:
                    break
                shutil.rmtree(ref)
                out["references_removed"].append(str(ref.relative_to(root / "refs")))
                _drop_orphans(blobs, out)
            shutil.rmtree(blobs / ".locks", ignore_errors=True)
        out["size"] = store_size(root)
    return out


def _drop_orphans(blobs: Path, out: dict) -> None:
    """Blobs no reference's folder links (one link: the blob's own name)."""
    for blob in _blob_files(blobs):
        st = blob.stat()
        if st.st_nlink == 1:
            blob.unlink()
            out["blobs_removed"] += 1
            out["bytes_freed"] += st.st_size


def _locked(lock: Path) -> bool:
    from filelock import FileLock, Timeout
    if not lock.exists():
        return False
    held = FileLock(str(lock))
    try:
        held.acquire(timeout=0)
    except Timeout:
        return True
    held.release()
    return False
