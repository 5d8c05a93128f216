"""Packing a bundle into one file and unpacking it safely.

Owns: deterministic tar archives (sorted names, zero mtimes and owners; gzip, or zstd when the
`zstandard` package is installed) and unpacking that checks every member before writing anything:
a first pass reads the headers and the manifest (absolute paths, `..`, links, devices, duplicates,
members the manifest does not list or lists with another size are refused); the second pass
writes each file, never more bytes than its record says, checking its sha256 as it goes, into a
staging folder renamed into place at the end. Also `check_out`, the --out checks the bundle
commands share.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import zlib
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from ..runtime.manifest import MANIFEST, PIECE, check_manifest, path_problem, read_manifest, verify_bundle
from .errors import BadInput

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MANIFEST_LIMIT = 64 << 20      # a manifest member larger than this is not read into memory


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


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise BadInput("zstd archives need the zstandard package (pip install zstandard); "
                       "or use a .tar / .tar.gz name") from None
    return zstandard


def pack_bundle(bundle: str | Path, out: str | Path) -> dict:
    bundle, out = Path(bundle), Path(out)
    check_out(out, "file")
    problems = verify_bundle(bundle)
    if problems:
        raise BadInput(f"{bundle}: does not verify, not packing it: {problems[0]}")
    names = [MANIFEST] + sorted(read_manifest(bundle).files)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        _write_archive(bundle, names, out, tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise BadInput(f"--out {out}: cannot write it ({e.strerror or e})") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"archive": str(out), "files": len(names), "size": out.stat().st_size}


def _write_archive(bundle: Path, names: list[str], out: Path, tmp: Path) -> None:
    """The tar (compressed as out's name says) of these bundle files, written to tmp."""
    with open(tmp, "wb") as raw:
        if out.name.endswith((".zst", ".tzst")):
            stream = _zstd().ZstdCompressor(level=3).stream_writer(raw, closefd=False)
            mode = "w|"
        elif out.name.endswith((".gz", ".tgz")):
            import gzip
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


def _archive_errors() -> tuple:
    """What reading a damaged or foreign archive raises (zstandard's own error when installed)."""
    errors = (tarfile.TarError, OSError, EOFError, ValueError, zlib.error)
    try:
        import zstandard
        return errors + (zstandard.ZstdError,)
    except ImportError:
        return errors


def _open_archive(path: Path) -> tarfile.TarFile:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == ZSTD_MAGIC:
        data = _zstd().ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return tarfile.open(fileobj=data, mode="r|")
    try:
        return tarfile.open(path, mode="r:*")
    except tarfile.ReadError:
        raise BadInput(f"{path}: not a tar, tar.gz or tar.zst archive; nothing was written") from None


def check_member(m: tarfile.TarInfo) -> str | None:
    """Why this member may not be unpacked, or None."""
    name = m.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    if ".." in PurePosixPath(name).parts or ".." in name.replace("\\", "/").split("/"):
        return "a path with '..'"
    if m.issym() or m.islnk():
        return "a link"
    if m.isdev() or m.isfifo() or m.ischr() or m.isblk():
        return "a device or pipe"
    if not (m.isfile() or m.isdir()):
        return "not a regular file or folder"
    if path_problem(name):
        return f"a path a bundle cannot hold ({path_problem(name)})"
    return None


def _scan(archive: Path) -> tuple[bytes, dict[str, tarfile.TarInfo]]:
    """First pass, writing nothing: every member's header checked; (manifest bytes, name -> header)."""
    members, manifest = {}, None
    with _open_archive(archive) as tar:
        for m in tar:
            why = check_member(m)
            if why is None and m.name in members:
                why = "a name that appears twice"
            if why is None and m.name == MANIFEST and not (m.isfile() and m.size <= MANIFEST_LIMIT):
                why = "a manifest that is not a regular file of at most 64 MiB"
            if why:
                raise BadInput(f"{archive}: refused, member {m.name!r} is {why}; nothing was written")
            members[m.name] = m
            if m.name == MANIFEST:
                manifest = tar.extractfile(m).read()
    if manifest is None:
        raise BadInput(f"{archive}: no {MANIFEST} in the archive, so not a precast bundle; nothing was written")
    return manifest, members


def _check_against(archive: Path, files: dict, members: dict[str, tarfile.TarInfo]) -> None:
    """Every member is a listed file of its recorded size, or a folder holding one; none is missing."""
    folders = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    for name, m in members.items():
        rec = files.get(name)
        if name == MANIFEST or (m.isdir() and name in folders):
            continue
        if m.isdir() or rec is None:
            raise BadInput(f"{archive}: refused, member {name!r} is not listed in the manifest; nothing was written")
        if m.size != rec["size"]:
            raise BadInput(f"{archive}: refused, member {name!r} holds {m.size} bytes, the manifest says "
                           f"{rec['size']}; nothing was written")
    missing = sorted(set(files) - set(members))
    if missing:
        raise BadInput(f"{archive}: {missing[0]} is listed in the manifest but not in the archive "
                       f"({len(missing)} missing); nothing was written")


class _WriteFailed(Exception):
    """An OSError from writing the unpacked files (full disk, permissions), not from reading the archive."""


@contextmanager
def _writing():
    try:
        yield
    except OSError as e:
        raise _WriteFailed(e.strerror or str(e)) from None


def _copy_checked(src, dst: Path, rel: str, rec: dict) -> None:
    """Write exactly rec["size"] bytes of src to a new file dst, checking sha256 (and pieces) on the way."""
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
            f.close()
    finally:
        try:
            f.close()
        except OSError:
            pass                                       # the error being raised already says what went wrong
    if whole.hexdigest() != rec["sha256"] or ("pieces" in rec and pieces != rec["pieces"]):
        raise BadInput(f"{rel}: sha256 differs from the manifest (changed or damaged); nothing was kept")


def unpack_bundle(archive: str | Path, out: str | Path) -> dict:
    archive, out = Path(archive), Path(out)
    if not archive.is_file():
        raise BadInput(f"{archive}: no such archive file")
    if os.path.lexists(out):
        raise BadInput(f"--out {out}: already exists; unpack into a new folder")
    check_out(out)
    errors = _archive_errors()
    try:
        raw, members = _scan(archive)
    except BadInput:
        raise
    except errors as e:
        raise BadInput(f"{archive}: not a readable bundle archive ({_one_line(e)}); nothing was written") from None
    try:
        files = check_manifest(json.loads(raw), f"{archive}: {MANIFEST}")["files"]
    except RecursionError:
        raise BadInput(f"{archive}: {MANIFEST} is unreadable (nested too deeply); nothing was written") from None
    except ValueError as e:
        raise BadInput(f"{archive}: {MANIFEST} is unreadable ({_one_line(e)}); nothing was written") from None
    _check_against(archive, files, members)
    need = sum(r["size"] for r in files.values()) + len(raw)
    free = shutil.disk_usage(next(p for p in out.parents if p.is_dir())).free
    if need > free:
        raise BadInput(f"--out {out}: the bundle needs {need / 1e9:.2f} GB, {free / 1e9:.2f} GB are free there; "
                       "nothing was written")
    staging = out.parent / f".{out.name}.unpacking-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise BadInput(f"--out {out}: cannot create it ({e.strerror or e})") from None
    changed = f"{archive}: changed while it was unpacked; nothing was kept"
    try:
        with _writing():
            (staging / MANIFEST).write_bytes(raw)
        seen = set()
        with _open_archive(archive) as tar:            # second pass: the checked members, nothing else
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
                    _copy_checked(tar.extractfile(m), staging / m.name, m.name, files[m.name])
        if seen != set(members):                       # shortened or replaced since the first pass
            raise BadInput(changed)
        with _writing():
            os.rename(staging, out)
    except BadInput:
        raise
    except _WriteFailed as e:
        raise BadInput(f"--out {out}: cannot write ({e}); nothing was kept") from None
    except errors as e:
        raise BadInput(f"{archive}: not a readable bundle archive ({_one_line(e)}); nothing was kept") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"bundle": str(out), "files": len(members)}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
