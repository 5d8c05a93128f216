"""The files an export names stay in its folder: an ONNX graph's external-data locations (`beside`) and an export
record's component paths (`within`), each refused in one line when it climbs out.

Owns only these checks (no imports but the error type): the export readers (compiler/engines.py,
compiler/foreign_onnx.py) and the targets that copy an export's weight files (compiler/targets/base.py,
quantize.py) share them.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import BadInput


def beside(graph: Path, location, tensor: str) -> Path:
    """The file an external tensor's `location` names: a plain file name in the graph's own folder (what precast,
    optimum and torch write). A path that climbs out (`../`), an absolute one or a subfolder is refused: a build
    copies these files, so a hostile export could otherwise read or overwrite files anywhere."""
    if _parts(location) is None or len(_parts(location)) != 1:
        raise BadInput(f"{graph}: tensor {tensor}'s external data location {location!r} is not a file name beside "
                       "the graph (a damaged or hostile export); export again")
    return graph.parent / location


def within(folder: Path, relative, where: str) -> Path:
    """`folder / relative` for a path an export's record names, refused unless it stays inside `folder`."""
    if _parts(relative) is None:
        raise BadInput(f"{where}: the path {relative!r} leaves the export's folder (a damaged or hostile export); "
                       "export again")
    return folder / relative


def _parts(relative) -> tuple[str, ...] | None:
    """The names of a relative path that stays where it starts (split at / and \\), or None: not a string,
    empty, absolute, a drive, a NUL byte, or a `..` / `.` step."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        return None
    win = PureWindowsPath(relative)
    if win.drive or win.root or PurePosixPath(relative).is_absolute():
        return None
    parts = tuple(relative.replace("\\", "/").split("/"))
    return None if any(p in ("", ".", "..") for p in parts) else parts
