"""Records of bundle files already verified, so an unchanged file is hashed once per file state.

Owns: the record store (where records live, their format, how they are read, merged and written),
the key a record is trusted under, and the verification modes (`auto`, `full`, off).

A record says: the file `rel` of this bundle, in the state (st_dev, st_ino, st_size, st_mtime_ns,
st_ctime_ns), was hashed and matched the manifest's sha256 (and piece digests). It is trusted only
when every one of those five numbers and the manifest's expected digests are the same now; any
other record is ignored and the file is hashed again. ctime is in the key because ordinary tools
cannot set it: a byte flipped with the mtime put back by `os.utime` still moves the ctime. A file
whose ctime is less than RACY_NS before the moment it was examined is hashed but not recorded
(git's "racily clean" problem: a second change within the same timestamp tick would leave the
stat data as they were).

Records live in one JSON file per bundle, `<bundle>/.precast-verified.json`, or, when the bundle
folder is not writable, in `$PRECAST_CACHE/verified/` (else `$XDG_CACHE_HOME/precast/verified/`, else
`~/.cache/precast/verified/`), named by the sha256 of the bundle folder's real path; both are read.
Writers take an exclusive flock on the bundle's manifest.json, re-read the file, merge their
entries in and replace it (temp file, fsync, rename), so concurrent writers never lose each
other's entries or leave a torn file; where no lock can be had the last writer wins, still whole.
A record file that is missing, unreadable or damaged means no records (everything is hashed).
Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

from .fileops import replace_file

RECORD_FILE = ".precast-verified.json"
SCHEMA = 1
RACY_NS = 50_000_000            # 50 ms: past the kernel's coarse timestamp tick (1-10 ms)
RACY_COARSE_NS = 3_000_000_000  # timestamps in whole seconds: a file system with 1-2 s granularity
LOCK_WAIT_S = 10.0
MODES = ("auto", "full")


def verify_mode(verify) -> str:
    """The verification mode a `verify` argument asks for: "auto" (True: trust records whose file
    state still matches), "full" (hash every file again, then refresh the records) or "off" (False:
    no hashing of engines and ONNX at all, for callers that verified the bundle themselves)."""
    if verify is True or verify == "auto":
        return "auto"
    if verify is False or verify == "off":
        return "off"
    if verify == "full":
        return "full"
    raise ValueError(f"verify={verify!r}: expected True/'auto', 'full' or False")


def user_records_dir() -> Path:
    """Where records go when a bundle folder is read-only: the user's precast cache folder."""
    env = os.environ.get("PRECAST_CACHE")
    if env:
        return Path(env) / "verified"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "precast" / "verified"


def file_state(st: os.stat_result) -> list[int]:
    """What identifies one state of a file: device, inode, size, mtime and ctime in nanoseconds."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def expected(record: dict) -> tuple[str, str | None]:
    """The manifest's expected digests of a file: its sha256 and one sha256 over its piece digests."""
    pieces = record.get("pieces")
    return record["sha256"], (hashlib.sha256("".join(pieces).encode()).hexdigest() if pieces is not None else None)


def racy(st: os.stat_result, started_ns: int) -> bool:
    """True when the file changed too shortly before `started_ns` (the clock read just before its
    stat) for a later change in the same timestamp tick to be told apart by stat data."""
    margin = RACY_COARSE_NS if st.st_ctime_ns % 1_000_000_000 == 0 else RACY_NS
    return st.st_ctime_ns > started_ns - margin


def _entry_ok(e) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("state"), list) and len(e["state"]) == 5
            and all(type(n) is int for n in e["state"]) and isinstance(e.get("sha256"), str)
            and (e.get("pieces") is None or isinstance(e.get("pieces"), str)) and e.get("checked") in ("whole", "pieces"))


class VerifiedFiles:
    """The verification records of one bundle folder. `full`: trust none (hash everything) but
    still record what matched. `known`: the manifest's file names (records of others are dropped)."""

    def __init__(self, root: str | Path, full: bool = False, known=None):
        self.root = Path(root)
        self.full = full
        self.known = set(known) if known is not None else None
        self._entries: dict[str, list[dict]] | None = None     # rel -> records read (both places)
        self._new: dict[str, dict] = {}                         # recorded here, not yet saved
        self._forget: set[str] = set()
        self._mutex = threading.Lock()                          # loader threads verify side by side

    # ---- where -------------------------------------------------------------------------------
    @property
    def beside(self) -> Path:
        return self.root / RECORD_FILE

    @property
    def elsewhere(self) -> Path:
        real = os.path.realpath(self.root)
        return user_records_dir() / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")

    # ---- reading -----------------------------------------------------------------------------
    @staticmethod
    def _read(path: Path) -> dict[str, dict]:
        """The entries of one record file; {} when it is missing, unreadable or damaged."""
        try:
            with open(path, "rb") as f:
                raw = f.read(16 << 20)
            data = json.loads(raw)
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("files"), dict):
            return {}
        return {rel: e for rel, e in data["files"].items() if isinstance(rel, str) and _entry_ok(e)}

    def _load(self) -> dict[str, list[dict]]:
        if self._entries is None:
            entries: dict[str, list[dict]] = {}
            for path in (self.beside, self.elsewhere):
                for rel, e in self._read(path).items():
                    entries.setdefault(rel, []).append(e)
            self._entries = entries
        return self._entries

    def trusted(self, rel: str, st: os.stat_result, record: dict, whole: bool = False) -> bool:
        """True when a record says this very file state matched these expected digests (and, for
        `whole`, that the whole-file sha256 was checked). Never under `full`."""
        if self.full:
            return False
        state, (sha, pieces) = file_state(st), expected(record)
        with self._mutex:
            mine = self._new.get(rel)
            known = ([mine] if mine else []) + list(self._load().get(rel, []))
        for e in known:
            if (e["state"] == state and e["sha256"] == sha and e.get("pieces") == pieces
                    and (e["checked"] == "whole" or not whole)):
                return True
        return False

    # ---- recording ---------------------------------------------------------------------------
    def add(self, rel: str, before: os.stat_result, after: os.stat_result, record: dict, whole: bool,
            started_ns: int) -> bool:
        """Record that `rel` matched `record`, when its stat data did not move while it was hashed
        (`before` / `after`) and it had not changed just before (`racy`). True when recorded."""
        if file_state(before) != file_state(after) or racy(before, started_ns):
            return False
        sha, pieces = expected(record)
        with self._mutex:
            self._new[rel] = {"state": file_state(before), "sha256": sha, "pieces": pieces,
                              "checked": "whole" if whole or pieces is None else "pieces"}
            self._forget.discard(rel)
        return True

    def forget(self, rel: str) -> None:
        """`rel` failed its check: drop its records (a record that matched a changed file was wrong)."""
        with self._mutex:
            self._new.pop(rel, None)
            self._forget.add(rel)
            if self._entries is not None:
                self._entries.pop(rel, None)

    def save(self) -> None:
        """Write what was recorded: beside the bundle, else in the user cache; nothing (silently)
        when neither can be written -- records only save time, they never decide a check."""
        with self._mutex:
            new, forget = dict(self._new), set(self._forget)
        if not new and not forget:
            return
        with self._lock():
            written = False
            for path in (self.beside, self.elsewhere):
                if written and not (forget and os.path.lexists(path)):
                    continue                    # the other place is rewritten only to drop forgotten records
                merged = self._read(path)       # re-read under the lock: other writers' entries are kept
                if not written:
                    merged.update(new)
                for rel in forget:
                    merged.pop(rel, None)
                if self.known is not None:
                    merged = {rel: e for rel, e in merged.items() if rel in self.known}
                written = self._write(path, merged) or written
        with self._mutex:
            for rel, e in new.items():
                self._load().setdefault(rel, []).insert(0, e)
                if self._new.get(rel) is e:
                    del self._new[rel]
            self._forget -= forget

    @staticmethod
    def _write(path: Path, files: dict) -> bool:
        """Replace `path` by a complete record file (temp + fsync + rename); False when it cannot."""
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            if path.name != RECORD_FILE:
                path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, json.dumps({"schema": SCHEMA, "files": files}, sort_keys=True).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            replace_file(tmp, path, delays=(0.01, 0.05))   # a reader holding it open (Windows): briefly retried
            return True
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def _lock(self):
        """An exclusive flock on the bundle's manifest.json (held while merging), or none."""
        return _ManifestLock(self.root / "manifest.json")


class _ManifestLock:
    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
            self.fd = os.open(self.path, os.O_RDONLY)
        except (ImportError, OSError):
            return self
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            except OSError:
                break
        os.close(self.fd)           # no lock to be had (a file system without flock): last writer wins
        self.fd = None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)       # closing releases the flock
            self.fd = None
