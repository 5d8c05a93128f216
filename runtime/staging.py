"""Folders written beside their destination and put in place whole: a kill at any instant loses nothing.

Owns: the staging folder (`.NAME.KIND-PID` beside `NAME`; KIND says who writes it: building, merging,
unpacking, exporting, genai, pulling; or a file: packing), locked on the folder itself while its writer lives (fileops.hold_path: the
kernel drops the lock when the writer dies, kill -9 included); the swap that puts a finished folder at
`out` -- an atomic exchange where the system has one, so `out` is at every instant the old or the new
whole folder; elsewhere two renames with the old folder parked as `.NAME.old-PID` between them --; and
`recover(out)`, which removes what dead writers left beside `out` and puts back an old folder a kill
caught between the two renames. A registry folder (the build cache's `staging/`) can list live staging
folders, so `precast cache gc` finds leftovers wherever they are.

Standard library only (the runtime may write bundles too).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from .fileops import path_held, exchange_dirs, hold_path, rename_dir

KINDS = ("building", "merging", "unpacking", "exporting", "genai", "pulling", "packing", "old")   # packing: a file
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>" + "|".join(KINDS) + r")-(?P<pid>[0-9]+)")


def leftovers(out: Path) -> list[tuple[Path, str, int]]:
    """(folder, kind, pid) of every staging folder of `out` no live writer holds."""
    out = Path(out)
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    found = []
    for n in sorted(names):
        m = _LEFTOVER.fullmatch(n)
        if m and m["name"] == out.name and not path_held(out.parent / n, int(m["pid"])):
            found.append((out.parent / n, m["kind"], int(m["pid"])))
    return found


def recover(out: Path) -> list[str]:
    """Clean up after dead writers of `out`: an old folder parked by an interrupted swap goes back to
    `out` when `out` is missing (rolled back), every other leftover is removed. What was done, in words."""
    out, done = Path(out), []
    found = leftovers(out)
    for folder, kind, pid in sorted(found, key=lambda f: f[1] != "old"):     # roll back before removing
        if kind == "old" and not os.path.lexists(out):
            rename_dir(folder, out)
            done.append(f"{out}: put back the bundle an interrupted swap had moved to {folder.name} (process {pid})")
            continue
        remove(folder)
        if not os.path.lexists(folder):
            done.append(f"{out}: removed {folder.name}, left by process {pid} which is gone")
    return done


def remove(path: Path) -> None:
    """A leftover folder or file gone, as far as the system lets it (Windows keeps files held open)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


class Staging:
    """`with Staging(out, "building") as s:` -- write into `s.path`, then `s.commit()`; on any exit the
    staging folder (and, after a swap, the old one) is removed and the lock released."""

    def __init__(self, out: Path, kind: str, registry: Path | None = None):
        assert kind in KINDS and kind != "old", kind
        self.out = Path(out)
        self.path = self.out.parent / f".{self.out.name}.{kind}-{os.getpid()}"
        self.registry = registry
        self._fds: list[int] = []
        self._record: Path | None = None
        self.recovered: list[str] = []

    def __enter__(self) -> "Staging":
        self.recovered = recover(self.out)
        shutil.rmtree(self.path, ignore_errors=True)      # named by our pid: an earlier process's, dead
        self.path.mkdir(parents=True)
        self._hold(self.path)
        if self.registry is not None:
            self._record = _register(self.registry, self.out, self.path)
        return self

    def __exit__(self, *exc) -> None:
        try:
            shutil.rmtree(self.path, ignore_errors=True)  # unfinished work, or the old folder after an exchange
        finally:
            self._release()
            if self._record is not None:
                self._record.unlink(missing_ok=True)

    def _hold(self, folder: Path) -> None:
        fd = hold_path(folder)
        if fd is not None:
            self._fds.append(fd)

    def _release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def commit(self) -> None:
        """Put the finished staging folder at `out` (replacing what is there; the caller decided it may)."""
        if not os.path.lexists(self.out):
            rename_dir(self.path, self.out)
        elif exchange_dirs(self.path, self.out):
            shutil.rmtree(self.path, ignore_errors=True)   # the old folder: gone now, before records are taken
        else:                                              # of the new one (unlinking shared inodes moves ctimes)
            self._two_renames()
        self._release()

    def _two_renames(self) -> None:
        old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        self._hold(self.out)          # held while parked, so no other process's recover() moves it back
        rename_dir(self.out, old)
        try:
            rename_dir(self.path, self.out)
        except BaseException:
            rename_dir(old, self.out)     # the earlier folder goes back where it was
            raise
        shutil.rmtree(old, ignore_errors=True)   # a file still held open (Windows) leaves the rest; recovered later


def _register(registry: Path, out: Path, staging: Path) -> Path | None:
    """A record of a live staging folder under `registry`, for gc_registry; None if it cannot be written."""
    record = registry / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    try:
        registry.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"out": str(out.absolute()), "staging": str(staging.absolute()),
                                      "pid": os.getpid()}))
        return record
    except OSError:
        return None


def gc_registry(registry: Path) -> list[str]:
    """For each recorded staging folder no live writer holds: recover its `out`, drop the record."""
    done = []
    if not registry.is_dir():
        return done
    for record in sorted(registry.glob("*.json")):
        try:
            info = json.loads(record.read_text())
            staging, out, pid = Path(info["staging"]), Path(info["out"]), int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            record.unlink(missing_ok=True)          # damaged: nothing to follow
            continue
        if path_held(staging, pid):
            continue
        done += recover(out)
        record.unlink(missing_ok=True)
    return done
