"""Verification records for bundles the compiler writes (`precast build`, `precast bundle merge`).

Owns: which files of a freshly written bundle are recorded as verified (runtime/verified.py's record
store, written through its VerifiedFiles), so that the first open of the bundle hashes nothing.

What is trusted: a file is recorded only when this process itself checked its bytes against the
sha256 the manifest lists: a cache entry's file (the cache re-hashes every file of an entry, its
pieces or its whole, each time it serves the entry: compiler/cache.py `Cache.get`; a miss hashed the
files it had just built) hard-linked into the bundle, a file the build wrote and then hashed
(tokenizers, pipeline JSON, embeddings), or for a merge a shard's file that `verify_bundle` had just
hashed whole, unchanged (ctime) since that hashing began, and hard-linked. A file *copied* (no hard
link possible: another file system) is not recorded: its new bytes were never hashed, so the first
open hashes it. Between that check
and the record the files sit in the build's private staging folder; the build trusts it as the
runtime trusts its own reads.

When: after the bundle is in its final place (`commit_bundle`). Linking a file, or unlinking another
name of it (replacing an older bundle that shared the cache's inodes), moves its ctime, which the
record key holds, so states taken earlier would never match. A file is recorded only when its
(device, inode, size, mtime) are still those `snapshot` saw in the staging folder, and once its
timestamps lie past the racy window (verified.racy: waited for, at most ~0.1 s; on a file system
with whole-second timestamps the newest files go unrecorded and are hashed on first open).
Records never decide a check and never fail a build: any error writing them leaves them out.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..runtime.verified import RACY_COARSE_NS, RACY_NS, VerifiedFiles, file_state


def snapshot(root: Path, files: dict[str, dict], skip=()) -> dict[str, os.stat_result]:
    """The stat data of the listed files in the staging folder, once all are written (before the
    rename into place), less `skip` (files copied, never hashed as they lie here)."""
    states = {}
    for rel in files:
        if rel in skip:
            continue
        try:
            states[rel] = os.stat(root / rel)
        except OSError:
            pass
    return states


def changed_since(path: Path, t_ns: int) -> bool:
    """True unless the file's ctime lies clearly (past the racy margin) before `t_ns`, the moment its
    hashing began: a shard's file changed after `verify_bundle` hashed it is not recorded."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    margin = RACY_COARSE_NS if st.st_ctime_ns % 1_000_000_000 == 0 else RACY_NS
    return st.st_ctime_ns + margin > t_ns


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """The same inode with the same size and mtime (its ctime may have moved: links come and go)."""
    return file_state(a)[:4] == file_state(b)[:4]


def record_written(root: Path, files: dict[str, dict], staged: dict[str, os.stat_result],
                   whole=True) -> int:
    """Record every file of the bundle at `root` that `staged` holds and that is still the file
    staged. `whole` (True, False, or the set of such files): its whole-file sha256 was checked, not
    only its piece digests. Returns how many files were recorded."""
    try:
        final = {}
        for rel, st in staged.items():
            try:
                now = os.stat(root / rel)
            except OSError:
                continue
            if _same_file(now, st):
                final[rel] = now
        if not final:
            return 0
        settled = max(st.st_ctime_ns + (RACY_COARSE_NS if st.st_ctime_ns % 1_000_000_000 == 0 else RACY_NS)
                      for st in final.values())
        wait = (settled - time.time_ns()) / 1e9
        if 0 < wait <= 2 * RACY_NS / 1e9:
            time.sleep(wait + 0.001)
        records = VerifiedFiles(root, known=files)
        count = 0
        for rel, st in final.items():
            try:
                now = os.stat(root / rel)
            except OSError:
                continue
            if file_state(now) == file_state(st):
                checked = whole if isinstance(whole, bool) else rel in whole
                count += records.add(rel, now, now, files[rel], checked, time.time_ns())
        records.save()
        return count
    except OSError:
        return 0
