"""Content-addressed artifact cache.

Owns: where artifacts live (platformdirs user cache, or the folder $PRECAST_CACHE names), the key
(sha256 over what decides an artifact's bytes), gc (damaged entries, abandoned temp folders and
what killed bundle builds left beside their --out -- found through the records under `staging/` --
always; least recently used entries only down to a size the user gives), and the guarantees: an entry is complete and verified or
absent. Builds go to a private temp folder renamed into place; a file lock makes two builders
of one key build once; every read re-checks each file's sha256, and a damaged entry is evicted
and rebuilt, never returned. With a remote cache (`Cache(remote=...)`, compiler/remote_cache.py) a
local miss is looked up in the registry first, pulled into that same temp folder under the same lock,
and what is built here is pushed after.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import platformdirs
from filelock import FileLock, Timeout

from ..runtime.fileops import path_held, hold_path, rename_dir, replace_file
from ..runtime.manifest import file_record, sha256_file, verify_file
from ..runtime.progress import heartbeat
from ..runtime.staging import gc_registry
from .errors import BadInput

ENTRY_FILE = "entry.json"
STAGING = "staging"     # records of bundles being written anywhere (runtime/staging.py), for gc


def cache_root() -> Path:
    env = os.environ.get("PRECAST_CACHE")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("precast"))


def staging_registry() -> Path | None:
    """Where live bundle writers record their staging folders (runtime/staging.py), so that `cache gc`
    finds what killed ones left; None where the cache folder cannot be named (no platformdirs: a
    runtime-only install unpacking a bundle)."""
    try:
        return cache_root() / STAGING
    except ImportError:
        return None


def _root_name(root: Path) -> str:
    """How the user named the cache folder, for error messages."""
    env = os.environ.get("PRECAST_CACHE")
    return f"PRECAST_CACHE={env}" if env and Path(env) == root else f"cache folder {root}"


def check_root(root: Path) -> None:
    """The cache folder, or the nearest existing folder above it, must be a folder."""
    probe = root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is" if probe == root else f"lies under {probe}, which is"
        raise BadInput(f"{_root_name(root)}: {where} a file, not a folder; "
                       "point PRECAST_CACHE at a folder (or unset it)")


def input_digest(path: Path, memo_dir: Path | None = None) -> str:
    """sha256 of an input file, remembered by (path, size, mtime, inode) the way git's index does,
    so a cache hit does not re-read gigabytes to compute its key. Cache entries themselves are
    always verified in full."""
    st = os.stat(path)
    stamp = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = (memo_dir or cache_root()) / "digests" / (hashlib.sha256(stamp.encode()).hexdigest() + ".txt")
    try:
        value = memo.read_text().strip()
        if len(value) == 64:
            return value
    except OSError:
        pass
    with heartbeat(f"sha256 {path} ({st.st_size / 1e6:.0f} MB)"):
        value = sha256_file(path)
    tmp = memo.with_suffix(f".tmp-{os.getpid()}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(value)
        replace_file(tmp, memo, delays=(0.05,))
    except OSError:
        try:
            tmp.unlink(missing_ok=True)   # e.g. a memo another process reads (Windows): it stays as it was
        except OSError:
            pass
    return value


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Entry:
    key: str
    path: Path
    files: dict[str, dict]      # name -> {size, sha256}
    metadata: dict
    damaged: str | None = None  # why entry.json cannot be trusted (then files and metadata are empty)
    remote: str | None = None   # a local miss with a remote cache: "hit" (pulled), "pushed", "miss" (not pushed)

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def last_used(self) -> float:
        try:
            return os.path.getmtime(self.path / ENTRY_FILE)
        except OSError:
            return os.path.getmtime(self.path) if self.path.exists() else 0.0

    def summary(self) -> dict:
        return {"key": self.key, "path": str(self.path), "size": self.size, "files": self.files,
                "metadata": self.metadata, "last_used": self.last_used(), "damaged": self.damaged}


def outcome(entry: Entry, hit: bool) -> str:
    """A build report's `cache` word: hit (the local cache), remote (pulled from the remote cache), miss (built)."""
    return "hit" if hit else "remote" if entry.remote == "hit" else "miss"


class DamagedEntry(ValueError):
    """entry.json is missing, unreadable or not the structure `get_or_build` writes."""


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _file_record_problem(name, rec) -> str | None:
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..", ENTRY_FILE):
        return f"file name {name!r} is not a plain file name"
    if not isinstance(rec, dict):
        return f"record of {name} is not an object"
    size, digest, pieces = rec.get("size"), rec.get("sha256"), rec.get("pieces", [])
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"size of {name} is not a non-negative integer"
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        return f"sha256 of {name} is not 64 hex digits"
    if not isinstance(pieces, list) or not all(isinstance(p, str) and _SHA256.fullmatch(p) for p in pieces):
        return f"pieces of {name} are not a list of sha256s"
    return None


def parse_entry(path: Path) -> Entry:
    """An entry folder's entry.json, checked for the structure `get_or_build` writes."""
    try:
        info = json.loads((path / ENTRY_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DamagedEntry(f"{ENTRY_FILE} unreadable ({type(e).__name__}: {e})") from None
    files, metadata = check_entry_info(info, path.name)
    return Entry(path.name, path, files, metadata)


def check_entry_info(info, key: str) -> tuple[dict, dict]:
    """(files, metadata) of entry.json's content `info` for `key`; DamagedEntry naming what is wrong."""
    if not isinstance(info, dict):
        raise DamagedEntry(f"{ENTRY_FILE} is not a JSON object")
    if info.get("key") != key:
        raise DamagedEntry(f"{ENTRY_FILE} key does not match the folder name")
    files, metadata = info.get("files"), info.get("metadata")
    if not isinstance(files, dict):
        raise DamagedEntry(f"{ENTRY_FILE} files is not an object")
    if not isinstance(metadata, dict):
        raise DamagedEntry(f"{ENTRY_FILE} metadata is not an object")
    for name, rec in files.items():
        problem = _file_record_problem(name, rec)
        if problem:
            raise DamagedEntry(f"{ENTRY_FILE}: {problem}")
    return files, metadata


class Cache:
    def __init__(self, root: str | os.PathLike | None = None, remote=None):
        self.root = Path(root) if root else cache_root()
        check_root(self.root)
        self.remote = remote        # compiler/remote_cache.py's RemoteCache, or None
        self.entries, self.tmp, self.locks = self.root / "entries", self.root / "tmp", self.root / "locks"
        self.staging = self.root / STAGING

    def _dir(self, key: str) -> Path:
        return self.entries / key[:2] / key

    def _mkdir(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(f"{_root_name(self.root)}: cannot create {folder} ({e.strerror}); "
                           "point PRECAST_CACHE at a writable folder") from None

    def _lock(self, key: str):
        self._mkdir(self.locks)
        return FileLock(str(self.locks / f"{key}.lock"))

    # ---- reading ------------------------------------------------------------------
    def verify(self, entry: Entry) -> str | None:
        """None when every file is present with its recorded size and sha256; else what is wrong."""
        if entry.damaged:
            return entry.damaged
        present = {p.name for p in entry.path.iterdir()} - {ENTRY_FILE}
        if present != set(entry.files):
            return f"files {sorted(present ^ set(entry.files))} missing or unexpected"
        for name, rec in entry.files.items():
            if verify_file(entry.path, name, rec):
                return f"{name} does not match its sha256"
        return None

    def get(self, key: str, progress: bool = False) -> tuple[Entry | None, str | None]:
        """(verified entry, None) or (None, why it was evicted / None when absent). `progress`: a
        heartbeat on stderr while a big entry's sha256s are checked."""
        path = self._dir(key)
        if not path.exists():
            return None, None
        try:
            entry = parse_entry(path)
            with heartbeat(f"verify cache entry {key[:12]} ({entry.size / 1e6:.0f} MB)", progress):
                problem = self.verify(entry)
        except DamagedEntry as e:
            problem = str(e)
        except OSError as e:
            problem = f"unreadable entry ({e})"
        if problem:
            shutil.rmtree(path, ignore_errors=True)
            return None, problem
        os.utime(path / ENTRY_FILE)  # last use, for gc
        return entry, None

    # ---- writing ------------------------------------------------------------------
    def get_or_build(self, key: str, build: Callable[[Path], dict],
                     progress: bool = True) -> tuple[Entry, bool, str | None]:
        """(entry, hit, eviction reason). `build(folder)` writes the artifact files and returns metadata.
        A remote cache is asked on a local miss (`entry.remote` says what it did; hit stays False)."""
        with self._lock(key):
            entry, evicted = self.get(key, progress)
            if entry is not None:
                return entry, True, None
            if self._dir(key).exists():      # evicted only in part: Windows keeps files another process holds open
                raise BadInput(f"cache entry {key[:12]} ({evicted}) could not be removed: a file in it is held open "
                               f"by another process (a running precast?); close it, or remove {self._dir(key)}")
            self._mkdir(self.tmp)
            work = self.tmp / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            work.mkdir()
            held = hold_path(work)     # while this process lives: gc leaves the folder alone
            try:
                pulled = self.remote.fetch(key, work) if self.remote is not None else None   # entry.json's bytes
                text = pulled
                if pulled is None:
                    metadata = build(work)
                    files = {p.name: file_record(p) for p in sorted(work.iterdir()) if p.is_file()}
                    info = {"key": key, "files": files, "metadata": metadata, "created": time.time()}
                    text = json.dumps(info, indent=2, sort_keys=True).encode()
                tmp_entry = work / (ENTRY_FILE + ".tmp")
                tmp_entry.write_bytes(text)
                with open(tmp_entry) as f:
                    os.fsync(f.fileno())
                replace_file(tmp_entry, work / ENTRY_FILE)   # a scanner may still hold the new files (Windows)
                target = self._dir(key)
                self._mkdir(target.parent)
                rename_dir(work, target)
            finally:
                shutil.rmtree(work, ignore_errors=True)
                if held is not None:
                    os.close(held)
            entry = parse_entry(target)
        if self.remote is not None:           # pushed outside the lock: the entry is complete and never rewritten
            entry.remote = "hit" if pulled is not None else self.remote.push(entry)
        return entry, False, evicted

    # ---- management ---------------------------------------------------------------
    def list(self) -> list[Entry]:
        """Every entry folder; one whose entry.json is damaged comes back with `damaged` set."""
        out = []
        for path in sorted(self.entries.glob("*/*")):
            if not path.is_dir():
                continue
            try:
                out.append(parse_entry(path))
            except DamagedEntry as e:
                out.append(Entry(path.name, path, {}, {}, damaged=str(e)))
        return out

    def find(self, prefix: str) -> Entry:
        matches = [e for e in self.list() if e.key.startswith(prefix)]
        if len(matches) != 1:
            raise BadInput(f"cache key {prefix!r}: {'no entry' if not matches else f'{len(matches)} entries'} "
                           "match; `precast cache ls` lists the keys")
        return matches[0]

    def remove(self, entry: Entry) -> None:
        with self._lock(entry.key):
            shutil.rmtree(entry.path, ignore_errors=True)

    def gc(self, max_size: int | None = None) -> dict:
        """Drop damaged entries, abandoned temp folders and dead bundle builds' leftovers; then, only when `max_size` is given
        (no size limit by default), least recently used entries until the cache holds at most
        `max_size` bytes."""
        removed, reasons = [], {}
        for e in self.list():
            entry, why = self.get(e.key)
            if entry is None and why:
                removed.append(e.key)
                reasons[e.key] = why
        stale = 0
        if self.tmp.exists():
            for work in self.tmp.iterdir():
                pid = work.name.split("-")[1] if work.name.count("-") >= 2 else ""
                if not (pid.isdigit() and path_held(work, int(pid))):
                    shutil.rmtree(work, ignore_errors=True)
                    stale += 1
        if max_size is not None:
            entries = sorted(self.list(), key=Entry.last_used)
            total = sum(e.size for e in entries)
            for e in entries:
                if total <= max_size:
                    break
                self.remove(e)
                total -= e.size
                removed.append(e.key)
                reasons[e.key] = "least recently used"
        left = self.list()
        return {"removed": removed, "reasons": reasons, "stale_temp_folders": stale, "max_size": max_size,
                "bundle_leftovers": gc_registry(self.staging),
                "stale_locks": self._drop_stale_locks({e.key for e in left}),
                "entries": len(left), "size": sum(e.size for e in left)}

    def _drop_stale_locks(self, keys: set[str], min_age_s: float = 60.0) -> int:
        """Lock files of entries that are gone (removed, or a build that failed), idle for a minute
        and free now: each is taken without waiting, then unlinked while held."""
        if not self.locks.is_dir():
            return 0
        dropped = 0
        for path in self.locks.glob("*.lock"):
            try:
                if path.stem in keys or time.time() - path.stat().st_mtime < min_age_s:
                    continue
                lock = FileLock(str(path))
                lock.acquire(timeout=0)
            except (Timeout, OSError):
                continue
            try:
                path.unlink(missing_ok=True)
            except PermissionError:     # Windows: a file held open cannot be unlinked; filelock's release does it
                pass
            finally:
                lock.release()
            dropped += not path.exists()
        return dropped



_SIZE = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([KMGT]?)B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'500M', '20G', '1.5T', '0' -> bytes; only finite, non-negative sizes in plain digits."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise BadInput(f"--max-size {text!r}: expected a non-negative size like 0, 500M, 20G or 1.5T")
    scale = 1 << (10 * " KMGT".index(m.group(2).upper() or " "))
    return int(Fraction(m.group(1)) * scale)
