"""An LLM text encoder's tokenizer for a bundle or an export (Z-Image's Qwen3: Qwen2's byte-level BPE).

Owns: where it comes from -- a diffusers folder's `tokenizer/` (tokenizer.json, tokenizer_config.json), else a
`tokenizer.json` beside the checkpoint file (ComfyUI's split files ship none: put the model's beside them),
else a precast demo file's own (its metadata `precast.tokenizer.json`) -- checked to parse before anything is
built, and the folder written from it (the runtime reads runtime/llm_tokenizer.py's FOLDER_FILES).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import BadInput
from .safetensors_file import SafetensorsFile

TOKENIZER_JSON, CONFIG = "tokenizer.json", "tokenizer_config.json"
DEMO_KEY = "precast.tokenizer.json"       # a demo file's own tokenizer, in its safetensors metadata
DEFAULT_CONFIG = {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                  "model_max_length": 131072}


def llm_tokenizer_files(source: Path, folder: str = "tokenizer") -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer for the model at `source`, or one BadInput saying where to put it."""
    source = Path(source)
    files: dict[str, bytes] = {}
    if source.is_dir():
        where = source / folder
        if (where / TOKENIZER_JSON).is_file():
            files = {n: (where / n).read_bytes() for n in (TOKENIZER_JSON, CONFIG) if (where / n).is_file()}
    elif (source.parent / TOKENIZER_JSON).is_file():
        where = source.parent
        files = {TOKENIZER_JSON: (where / TOKENIZER_JSON).read_bytes()}
    elif source.suffix == ".safetensors" and DEMO_KEY in (meta := SafetensorsFile(source).metadata or {}):
        where = source
        files = {TOKENIZER_JSON: meta[DEMO_KEY].encode()}
    if not files:
        beside = source / folder if source.is_dir() else source.parent
        raise BadInput(f"{source}: its LLM text encoder needs the model's tokenizer: no {TOKENIZER_JSON} in {beside}; "
                       f"copy the model's {folder}/{TOKENIZER_JSON} there (Z-Image: Tongyi-MAI/Z-Image-Turbo's, which is "
                       "Qwen3's)")
    try:
        from tokenizers import Tokenizer
        Tokenizer.from_str(files[TOKENIZER_JSON].decode())
    except ImportError:
        raise BadInput("an LLM text encoder's tokenizer is read with the `tokenizers` package: pip install tokenizers "
                       "(or precast[llm])") from None
    except Exception as e:      # the Rust parser's errors are plain Exceptions
        raise BadInput(f"{where}: {TOKENIZER_JSON} is not a readable tokenizer ({str(e).splitlines()[0]}); "
                       "download it again") from None
    files.setdefault(CONFIG, (json.dumps(DEFAULT_CONFIG, indent=2) + "\n").encode())
    return files


def write_llm_tokenizer_folder(out: Path, files: dict[str, bytes]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in sorted(files.items()):
        (out / name).write_bytes(data)
        written.append(out / name)
    return written
