"""Reading tar archives without trusting them: the readers the bundle commands unpack with.

Owns: opening a tar, tar.gz or tar.zst for reading with `CheckedHeader`, which bounds pax and GNU
long-name headers before tarfile reads them (tarfile holds each whole in memory, and Python
< 3.11.10 parses pax headers in time quadratic in their size, CVE-2024-6232) and refuses sparse
members, and refuses bytes where a member header should be that are none (tarfile takes them for the
archive's end: a member whose data runs on past the size its header says, or damage); `check_member`,
which member types and names may be unpacked at all; and the errors a damaged or foreign archive raises
while read.
"""
from __future__ import annotations

import tarfile
import zlib
from pathlib import Path, PurePosixPath

from ..runtime.manifest import path_problem
from .errors import BadInput

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
HEADER_LIMIT = 4 << 10         # one pax or GNU long-name header; a bundle's member names are far shorter
HEADER_CHAIN = 8               # such headers in a row before one member (tarfile recurses once for each)
PAX_WORK = 64 * HEADER_LIMIT ** 2  # the sum of an archive's squared pax-header sizes: ~2 s of parsing at worst


def zstd_module():
    try:
        import zstandard
    except ImportError:
        raise BadInput("zstd archives need the zstandard package (pip install 'precast[zstd]'); "
                       "or use a .tar / .tar.gz name") from None
    return zstandard


def archive_errors() -> tuple:
    """What reading a damaged or foreign archive raises (zstandard's own error when installed)."""
    errors = (tarfile.TarError, OSError, EOFError, ValueError, zlib.error)
    try:
        import zstandard
        return errors + (zstandard.ZstdError,)
    except ImportError:
        return errors


_PAX = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_EXTENDED = _PAX + (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class Refused(tarfile.TarError):
    """A header refused before tarfile read what follows it; _scan names the archive."""


class CheckedHeader(tarfile.TarInfo):
    """A member header whose processing hook refuses, before tarfile reads them, the headers tarfile
    would hold whole in memory or parse in time quadratic in their size (Python < 3.11.10): pax and
    GNU long-name/link headers over HEADER_LIMIT bytes, more than HEADER_CHAIN of them in a row,
    global pax headers over HEADER_LIMIT in all (they accumulate), pax headers past PAX_WORK in all,
    and sparse members (whose maps tarfile reads block after block)."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except tarfile.InvalidHeaderError as e:   # at offset 0 it is no tar at all: tarfile.open says so
            if not tar.offset:
                raise
            last = f" {tar.members[-1].name!r}" if tar.members else ""
            raise Refused(f"the bytes at offset {tar.offset} of the tar stream are no member header ({e}): the member "
                          f"before them{last} holds more data than its header says, or the archive is damaged") from None

    def _proc_member(self, tar):
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise Refused(f"member {self.name!r} is a sparse file")
        if self.type not in _EXTENDED:
            return super()._proc_member(tar)
        used = _charge(tar, self)
        used["chain"] += 1
        try:
            member = super()._proc_member(tar)
        finally:
            used["chain"] -= 1
        member.pax_headers = {}        # never read here; so no member keeps a copy of them
        return member

    def _proc_gnusparse_10(self, member, pax_headers, tar):
        raise Refused(f"member {member.name!r} is a sparse file")


def _charge(tar: tarfile.TarFile, header: tarfile.TarInfo) -> dict:
    """The archive's running totals, with this pax or GNU long-name header counted; Refused when
    the header or the totals are over their limits."""
    used = vars(tar).setdefault("precast_headers", {"chain": 0, "work": 0, "global": 0})
    kind = "pax" if header.type in _PAX else "GNU long-name"
    if header.size > HEADER_LIMIT:
        raise Refused(f"member header {header.name!r} is a {kind} header of {header.size} bytes, over the limit "
                       f"of {HEADER_LIMIT} (a bundle's member names are far shorter)")
    used["work"] += header.size ** 2 if header.type in _PAX else 0
    used["global"] += header.size if header.type == tarfile.XGLTYPE else 0
    over = (f"more than {HEADER_CHAIN} in a row" if used["chain"] >= HEADER_CHAIN else
            f"global pax headers over {HEADER_LIMIT} bytes in all" if used["global"] > HEADER_LIMIT else
            f"pax headers over {PAX_WORK} in the sum of their squared sizes" if used["work"] > PAX_WORK else None)
    if over:
        raise Refused(f"member header {header.name!r} is one {kind} header too many ({over})")
    return used


def open_archive(path: Path) -> tarfile.TarFile:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == ZSTD_MAGIC:
        data = zstd_module().ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        try:
            return tarfile.open(fileobj=data, mode="r|", tarinfo=CheckedHeader)
        except BaseException:
            data.close()
            raise
    try:
        return tarfile.open(path, mode="r:*", tarinfo=CheckedHeader)
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
    if m.issparse():
        return "a sparse file"
    if not (m.isfile() or m.isdir()):
        return "not a regular file or folder"
    if path_problem(name):
        return f"a path a bundle cannot hold ({path_problem(name)})"
    return None
