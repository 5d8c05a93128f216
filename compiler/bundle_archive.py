"""Packing a bundle into one file and unpacking it safely.

Owns: deterministic tar archives (sorted names, zero mtimes and owners; gzip, or zstd when the
`zstandard` package is installed; --out must end in one of SUFFIXES and lie outside the bundle) and
unpacking that checks every member before writing anything: a first pass reads the headers and the
manifest (absolute paths, `..`, links, devices, sparse files, duplicates, names Windows or macOS
cannot hold -- device names such as CON, names differing only in case --, members the manifest does
not list or lists with another size are refused, each as soon as both its header and the manifest
have been read, before its data is; and the sizes declared -- the manifest's files, or before it the
members' headers -- held against the free space at --out and EXPANSION_LIMIT times the archive's own
size, so a compression bomb is refused on its headers, before tarfile decompresses any of its data to
skip it); the second pass writes each file, never more bytes than its
record says, checking its sha256 as it goes, into a staging folder put in place at the end (runtime/staging.py:
locked while this process lives, onto an empty --out, retried while Windows holds a file open; paths over
Windows' MAX_PATH refused up front where long paths are off),
with a record of each file it hashed (runtime/verified.py), so the first open hashes nothing again.
Archives are read through tar_reader.py (bounded headers, member types). Also `check_out`, the
--out checks the bundle commands share.
"""
from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from ..runtime.fileops import case_collision, hold_path, long_path_problem, replace_file, windows_name_problem
from ..runtime.manifest import MANIFEST, PIECE, check_manifest, read_manifest, verify_bundle
from ..runtime.verified import RACY_COARSE_NS, RACY_NS, VerifiedFiles, file_state
from ..runtime.staging import Staging, recover, remove
from .cache import staging_registry
from .errors import BadInput
from .tar_reader import Refused, archive_errors, check_member, open_archive, zstd_module

MANIFEST_LIMIT = 64 << 20      # a manifest member larger than this is not read into memory
SUFFIXES = {".tar": "", ".tar.gz": "gz", ".tgz": "gz", ".tar.zst": "zst", ".tzst": "zst"}
MEMBERS_BEFORE_MANIFEST = 10_000   # `bundle pack` puts only folders before the manifest
# A bundle is mostly weights, which barely compress (the tiny demo bundle: 1.75x with zstd); sizes declared
# past this many times the archive's own size (and past EXPANSION_FLOOR) are a compression bomb or a lie.
EXPANSION_LIMIT = 20
EXPANSION_FLOOR = 256 << 20


def bundle_counts(listed) -> dict:
    """How `bundle pack`, `unpack` and `inspect` all count a bundle: its files (manifest.json and every
    file the manifest lists) and, apart, the folders they lie in (an archive holds both as entries)."""
    names = [MANIFEST, *listed]
    folders = {str(p) for n in names for p in PurePosixPath(n).parents if str(p) != "."}
    return {"files": len(names), "folders": len(folders)}


def count_words(counts: dict) -> str:
    """The words every bundle command prints for bundle_counts: `21 files (+18 folders)`."""
    return f"{counts['files']} files (+{counts['folders']} folders)"


def check_out(out: Path, kind: str = "folder") -> None:
    """One-line refusals for an --out path that cannot be written: a file where a folder must be,
    a missing parent folder for an archive, an existing folder where an archive file goes."""
    parent = out.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        if kind == "file":
            raise BadInput(f"--out {out}: folder {out.parent} does not exist; create it first")
        parent = parent.parent
    if not parent.is_dir():
        raise BadInput(f"--out {out}: {parent} is a file, not a folder; choose another --out")
    if kind == "file" and out.is_dir():
        raise BadInput(f"--out {out}: is a folder; name the archive file, e.g. {out / 'bundle.tar.gz'}")


def _compression(out: Path) -> str:
    """'' (a plain tar), 'gz' or 'zst', as the archive's name says; one line for any other name."""
    for suffix, kind in SUFFIXES.items():
        if out.name.lower().endswith(suffix):
            return kind
    raise BadInput(f"--out {out}: not a name precast writes archives under; end it in {', '.join(SUFFIXES)}")


def _check_pack_out(bundle: Path, out: Path) -> str:
    """The compression out's name asks for, after refusing an out inside the bundle (the archive
    would overwrite a bundle file, or be written into the folder being packed) and other names."""
    home, target = Path(os.path.realpath(bundle)), Path(os.path.realpath(out))
    if target == home or home in target.parents:
        where = "is the bundle being packed" if target == home else f"is inside the bundle {bundle} being packed"
        raise BadInput(f"--out {out}: {where}; write the archive outside it, "
                       f"e.g. {home.parent / (home.name + '.tar.gz')}")
    check_out(out, "file")
    return _compression(out)


def pack_bundle(bundle: str | Path, out: str | Path) -> dict:
    bundle, out = Path(bundle), Path(out)
    kind = _check_pack_out(bundle, out)
    problems = verify_bundle(bundle)
    if problems:
        raise BadInput(f"{bundle}: does not verify, not packing it: {problems[0]}")
    names = [MANIFEST] + sorted(read_manifest(bundle).files)
    recover(out)                          # archives half-written by killed packs, beside this one
    tmp, held = out.with_name(f".{out.name}.packing-{os.getpid()}"), None
    try:
        with open(tmp, "wb"):
            held = hold_path(tmp)         # while this process lives, no other pack's recover() takes it
        _write_archive(bundle, names, kind, tmp)
        replace_file(tmp, out)            # an earlier archive held open (Windows): retried, then said
    except OSError as e:
        raise BadInput(f"--out {out}: cannot write it ({e.strerror or e})") from None
    finally:
        remove(tmp)
        if held is not None:
            os.close(held)
    return {"archive": str(out), **bundle_counts(names[1:]), "size": out.stat().st_size}


def _write_archive(bundle: Path, names: list[str], kind: str, tmp: Path) -> None:
    """The tar (compressed as kind says: '', 'gz' or 'zst') of these bundle files, written to tmp."""
    with open(tmp, "wb") as raw:
        if kind == "zst":
            stream = zstd_module().ZstdCompressor(level=3).stream_writer(raw, closefd=False)
            mode = "w|"
        elif kind == "gz":
            stream = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=1)
            mode = "w|"
        else:
            stream, mode = raw, "w|"
        with tarfile.open(fileobj=stream, mode=mode, format=tarfile.PAX_FORMAT) as tar:
            dirs = sorted({str(PurePosixPath(n).parent) for n in names} - {"."},
                          key=lambda d: (d.count("/"), d))
            for d in sorted(set(dirs) | {str(p) for d in dirs for p in PurePosixPath(d).parents if str(p) != "."}):
                info = tarfile.TarInfo(d)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                tar.addfile(info)
            for n in names:
                info = tarfile.TarInfo(n)
                info.size, info.mode, info.mtime = (bundle / n).stat().st_size, 0o644, 0
                with open(bundle / n, "rb") as f:
                    tar.addfile(info, f)
        if stream is not raw:
            stream.close()


class _Room:
    """What an archive may unpack to: the free space at --out, and EXPANSION_LIMIT times the archive's
    own size (above EXPANSION_FLOOR); `check` refuses a declared total past either, in one line."""

    def __init__(self, archive: Path, out: Path):
        self.archive, self.out, self.size = archive, out, archive.stat().st_size
        self.free = shutil.disk_usage(next(p for p in out.parents if p.is_dir())).free

    def check(self, total: int, what: str) -> None:
        said = f"{self.archive}: refused, {what} {_amount(total)}"
        if total > max(EXPANSION_LIMIT * self.size, EXPANSION_FLOOR):
            raise BadInput(f"{said}, more than {EXPANSION_LIMIT} times the archive's {_amount(self.size)} (weights "
                           "barely compress): a compression bomb or a damaged manifest; nothing was written")
        if total > self.free:
            raise BadInput(f"{said}, {_amount(self.free)} are free at --out {self.out}; free space there or unpack "
                           "elsewhere; nothing was written")


def _amount(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _scan(archive: Path, room: _Room) -> tuple[bytes, dict, dict[str, tarfile.TarInfo]]:
    """First pass, writing nothing: every header checked, and against the manifest as soon as both
    have been read, before tarfile reads on; the sizes declared (the manifest's, or before it the
    headers') held against `room` before tarfile reads (decompresses) any data they declare;
    (manifest bytes, its files, name -> header)."""
    members, raw, listing, folded, before = {}, None, None, {}, 0
    try:
        with open_archive(archive) as tar:
            for m in tar:
                _check_header(archive, m, members, listing)
                _check_portable(archive, m, folded)
                if listing is None and m.isfile():     # no manifest yet: the headers are all there is
                    before += m.size
                    room.check(before, f"member {m.name!r} brings the data before {MANIFEST} to")
                members[m.name] = m
                if m.name == MANIFEST:
                    raw = tar.extractfile(m).read()
                    listing = _listing(archive, raw)
                    if not isinstance(listing, BadInput):
                        room.check(sum(r["size"] for r in listing[0].values()) + len(raw),
                                   f"its {MANIFEST} lists")
                    for seen in members.values():
                        _check_listed(archive, seen, listing)
    except Refused as e:
        raise BadInput(f"{archive}: refused, {e}; nothing was written") from None
    if raw is None:
        raise BadInput(f"{archive}: no {MANIFEST} in the archive, so not a precast bundle; nothing was written")
    if isinstance(listing, BadInput):
        raise listing
    missing = sorted(set(listing[0]) - set(members))
    if missing:
        raise BadInput(f"{archive}: {missing[0]} is listed in the manifest but not in the archive "
                       f"({len(missing)} missing); nothing was written")
    return raw, listing[0], members


def _check_header(archive: Path, m: tarfile.TarInfo, members: dict, listing) -> None:
    """One line for a member that may not be unpacked or (once the manifest is read) is not what it lists."""
    why = check_member(m)
    if why is None and m.name in members:
        why = "a name that appears twice"
    if why is None and m.name == MANIFEST and not (m.isfile() and m.size <= MANIFEST_LIMIT):
        why = "a manifest that is not a regular file of at most 64 MiB"
    if why is None and listing is None and len(members) >= MEMBERS_BEFORE_MANIFEST:
        why = f"more than {MEMBERS_BEFORE_MANIFEST} members before {MANIFEST} (`precast bundle pack` puts it first)"
    if why:
        raise BadInput(f"{archive}: refused, member {m.name!r} is {why}; nothing was written")
    if listing is not None:
        _check_listed(archive, m, listing)


def _check_portable(archive: Path, m: tarfile.TarInfo, folded: dict[str, str]) -> None:
    """A member must unpack to its own file on Windows and macOS too: no device name (CON, nul.txt), no
    character Windows refuses, no name (or folder) that differs from another only in case."""
    why = windows_name_problem(m.name)
    other = None if why else case_collision(m.name.rstrip("/"), folded)
    if other is not None:
        why = f"differs only in case from {other!r} (Windows and macOS would keep one file for both)"
    if why:
        raise BadInput(f"{archive}: refused, member {m.name!r}: {why}; nothing was written")


def _listing(archive: Path, raw: bytes) -> tuple[dict, list[str]] | BadInput:
    """The manifest's files and their sorted names (for _check_listed), or the one line saying why it
    is unreadable, raised at the next member that passes its own header checks (or at the end)."""
    try:
        files = check_manifest(json.loads(raw), f"{archive}: {MANIFEST}")["files"]
    except RecursionError:
        return BadInput(f"{archive}: {MANIFEST} is unreadable (nested too deeply); nothing was written")
    except ValueError as e:
        return BadInput(f"{archive}: {MANIFEST} is unreadable ({_one_line(e)}); nothing was written")
    return files, sorted(files)


def _check_listed(archive: Path, m: tarfile.TarInfo, listing: tuple[dict, list[str]] | BadInput) -> None:
    """A member is the manifest, a listed file of its recorded size, or a folder holding one."""
    if m.name == MANIFEST:
        return
    if isinstance(listing, BadInput):
        raise listing
    files, names = listing
    inside = bisect.bisect_left(names, m.name + "/")
    if m.isdir() and inside < len(names) and names[inside].startswith(m.name + "/"):
        return
    rec = files.get(m.name)
    if m.isdir() or rec is None:
        raise BadInput(f"{archive}: refused, member {m.name!r} is not listed in the manifest; nothing was written")
    if m.size != rec["size"]:
        raise BadInput(f"{archive}: refused, member {m.name!r} holds {m.size} bytes, the manifest says "
                       f"{rec['size']}; nothing was written")


class _WriteFailed(Exception):
    """An OSError from writing the unpacked files (full disk, permissions), not from reading the archive."""


@contextmanager
def _writing():
    try:
        yield
    except OSError as e:
        raise _WriteFailed(e.strerror or str(e)) from None


def _copy_checked(src, dst: Path, rel: str, rec: dict) -> os.stat_result:
    """Write exactly rec["size"] bytes of src to a new file dst, checking sha256 (and pieces) on the way;
    the file's stat data right after its last byte was written."""
    whole, piece, pieces, left, in_piece = hashlib.sha256(), hashlib.sha256(), [], rec["size"], 0
    with _writing():
        f = open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb")
    try:
        while left:
            chunk = src.read(min(left, 16 << 20, PIECE - in_piece))
            if not chunk:
                raise BadInput(f"{rel}: the archive ends inside this member (truncated); nothing was kept")
            with _writing():
                f.write(chunk)
            whole.update(chunk)
            piece.update(chunk)
            left, in_piece = left - len(chunk), in_piece + len(chunk)
            if in_piece == PIECE or not left:
                pieces.append(piece.hexdigest())
                piece, in_piece = hashlib.sha256(), 0
        with _writing():
            f.flush()
            written = os.fstat(f.fileno())
            f.close()
    finally:
        try:
            f.close()
        except OSError:
            pass                                       # the error being raised already says what went wrong
    if whole.hexdigest() != rec["sha256"] or ("pieces" in rec and pieces != rec["pieces"]):
        raise BadInput(f"{rel}: sha256 differs from the manifest (changed or damaged); nothing was kept")
    return written


def _record_verified(staging: Path, files: dict, written: dict[str, os.stat_result]) -> None:
    """Record every file unpacked (hashed as it was written) whose stat data are still those seen
    right after writing it, once the timestamps have moved past them (verified.racy)."""
    if not written:
        return
    settled = max(st.st_ctime_ns + (RACY_COARSE_NS if st.st_ctime_ns % 1_000_000_000 == 0 else RACY_NS)
                  for st in written.values())
    wait = (settled - time.time_ns()) / 1e9
    if 0 < wait <= 2 * RACY_NS / 1e9:   # at most ~0.1 s; on coarse-timestamp disks the newest files go unrecorded
        time.sleep(wait + 0.001)
    records = VerifiedFiles(staging, known=files)
    for rel, st in written.items():
        try:
            now = os.stat(staging / rel)
        except OSError:
            continue
        if file_state(now) == file_state(st):
            records.add(rel, now, now, files[rel], True, time.time_ns())
    records.save()


def unpack_bundle(archive: str | Path, out: str | Path) -> dict:
    archive, out = Path(archive), Path(out)
    if archive.is_dir():
        raise BadInput(f"{archive}: is a folder (an unpacked bundle?); give an archive file (.tar, .tar.gz, .tar.zst)")
    if not archive.is_file():
        raise BadInput(f"{archive}: no such archive file")
    if os.path.lexists(out) and not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        raise BadInput(f"--out {out}: already exists and is not an empty folder; unpack into a new or empty folder")
    check_out(out)
    errors = archive_errors()
    try:
        raw, files, members = _scan(archive, _Room(archive, out))
    except BadInput:
        raise
    except errors as e:
        raise BadInput(f"{archive}: not a readable bundle archive ({_one_line(e)}); nothing was written") from None
    stage = Staging(out, "unpacking", staging_registry())
    too_long = long_path_problem([stage.path / rel for rel in files] + [out / rel for rel in files])
    if too_long:
        raise BadInput(f"--out {out}: {too_long}; unpack into a shorter folder (e.g. C:\\b\\{out.name}) or enable "
                       "long paths; nothing was written")
    try:
        stage.__enter__()
    except OSError as e:
        raise BadInput(f"--out {out}: cannot create it ({e.strerror or e})") from None
    try:
        with _writing():
            (stage.path / MANIFEST).write_bytes(raw)
        written = _write_members(archive, stage.path, files, members)
        _record_verified(stage.path, files, written)
        with _writing():
            stage.commit()            # onto an empty --out too, which Windows' rename refuses
    except BadInput:
        raise
    except _WriteFailed as e:
        raise BadInput(f"--out {out}: cannot write ({e}); nothing was kept") from None
    except errors as e:
        raise BadInput(f"{archive}: not a readable bundle archive ({_one_line(e)}); nothing was kept") from None
    finally:
        stage.__exit__(None, None, None)
    return {"bundle": str(out), **bundle_counts(files)}


def _write_members(archive: Path, staging: Path, files: dict,
                   members: dict[str, tarfile.TarInfo]) -> dict[str, os.stat_result]:
    """Second pass: the first pass's members, each as checked then, into staging; nothing else.
    The stat data of each file written, right after writing it."""
    changed = f"{archive}: changed while it was unpacked; nothing was kept"
    seen, written = set(), {}
    with open_archive(archive) as tar:
        for m in tar:
            if (m.name in seen or members.get(m.name) is None or members[m.name].size != m.size
                    or m.type != members[m.name].type):
                raise BadInput(changed)
            seen.add(m.name)
            if m.isdir():
                with _writing():
                    (staging / m.name).mkdir(parents=True, exist_ok=True)
            elif m.name != MANIFEST:
                with _writing():
                    (staging / m.name).parent.mkdir(parents=True, exist_ok=True)
                written[m.name] = _copy_checked(tar.extractfile(m), staging / m.name, m.name, files[m.name])
    if seen != set(members):                       # shortened or replaced since the first pass
        raise BadInput(changed)
    return written


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
