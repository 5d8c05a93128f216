"""One exported component as the engine builders take it: its ONNX graph, IO and files.

Owns: `ExportedComponent`, made from a `precast export` folder's record (compiler/engines.py read_export),
from a foreign ONNX folder's graphs (compiler/foreign_onnx.py) or from a build's cache entry
(compiler/bundle.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .targets import io_dtype


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
