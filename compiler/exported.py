"""One exported component as the engine builders take it: its ONNX graph, IO and files.

Owns: `ExportedComponent`, made from a `precast export` folder's record (compiler/engines.py read_export),
from a foreign ONNX folder's graphs (compiler/foreign_onnx.py) or from a build's cache entry
(compiler/bundle.py); `beside` / `within`, the checks that a file an export names stays in its folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import BadInput
from .targets import io_dtype


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


@dataclass(frozen=True)
class ExportedComponent:
    name: str
    onnx_path: Path
    inputs: list[dict]
    outputs: list[dict]
    sizes: dict | None = None   # file name -> bytes, as the export recorded them
    dtype: str | None = None    # fp32 / fp16 / bf16 as the export recorded it (else read from the IO)
    max_positions: int | None = None   # a CLIP text encoder's learned positions (77): the most tokens it takes
    gguf_blocks: Path | None = None    # where the weights copied from GGUF Q8_0 / Q4_0 blocks lie (weights: gguf)
    from_gguf: bool = False            # the export's source was a .gguf file
    gguf_sources: tuple = ()           # the GGUF files the build knows now (a recorded one may have moved)

    @property
    def export_dtype(self) -> str:
        return self.dtype if self.dtype in ("fp32", "fp16", "bf16") else io_dtype(self.inputs + self.outputs)
