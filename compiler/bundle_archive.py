"""Packing a bundle into one file and unpacking it safely.

Owns: deterministic tar archives (sorted names, zero mtimes and owners; gzip, or zstd when the
`zstandard` package is installed) and unpacking that inspects every member before writing
anything: absolute paths, `..`, links and device files are refused; the result is verified
against its manifest before it is renamed into place.
"""
from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from ..runtime.manifest import MANIFEST, read_manifest, verify_bundle
from .errors import BadInput

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise BadInput("zstd archives need the zstandard package (pip install zstandard); "
                       "or use a .tar / .tar.gz name") from None
    return zstandard


def pack_bundle(bundle: str | Path, out: str | Path) -> dict:
    bundle, out = Path(bundle), Path(out)
    problems = verify_bundle(bundle)
    if problems:
        raise BadInput(f"{bundle}: does not verify, not packing it: {problems[0]}")
    names = [MANIFEST] + sorted(read_manifest(bundle).files)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
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
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"archive": str(out), "files": len(names), "size": out.stat().st_size}


def _open_archive(path: Path) -> tarfile.TarFile:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == ZSTD_MAGIC:
        data = _zstd().ZstdDecompressor().stream_reader(open(path, "rb"))
        return tarfile.open(fileobj=data, mode="r|")
    return tarfile.open(path, mode="r:*")


def check_member(m: tarfile.TarInfo) -> str | None:
    """Why this member may not be unpacked, or None."""
    name = m.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if ".." in PurePosixPath(name).parts or ".." in name.replace("\\", "/").split("/"):
        return "path with '..'"
    if m.issym() or m.islnk():
        return "link"
    if m.isdev() or m.isfifo() or m.ischr() or m.isblk():
        return "device or pipe"
    if not (m.isfile() or m.isdir()):
        return "not a regular file or folder"
    return None


def unpack_bundle(archive: str | Path, out: str | Path) -> dict:
    archive, out = Path(archive), Path(out)
    if out.exists():
        raise BadInput(f"--out {out}: already exists; unpack into a new folder")
    try:
        with _open_archive(archive) as tar:                 # first pass: inspect, write nothing
            members = []
            for m in tar:
                why = check_member(m)
                if why:
                    raise BadInput(f"{archive}: refused, member {m.name!r} is a {why}; nothing was written")
                members.append(m.name)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BadInput(f"{archive}: not a readable bundle archive ({e})") from None
    staging = out.parent / f".{out.name}.unpacking-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with _open_archive(archive) as tar:                 # second pass: extract (data filter as well)
            tar.extractall(staging, filter="data")
        problems = verify_bundle(staging)
        if problems:
            raise BadInput(f"{archive}: unpacked bundle does not verify: {problems[0]}")
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"bundle": str(out), "files": len(members)}


