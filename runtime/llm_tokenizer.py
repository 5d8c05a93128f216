"""Byte-level BPE tokenizers of LLM text encoders (Qwen2's, which Qwen3 and Qwen2.5 share), read from the
`tokenizer.json` a bundle carries and run by the `tokenizers` library (the `llm` extra; imported only when such a
bundle is opened, so other bundles never need it).

Owns: LLMTokenizer -- a folder's tokenizer.json (its own padding and truncation settings off) and pad token
(tokenizer_config.json's, else `<|endoftext|>`), and the ids of a prompt put into a family's chat template as its
pipeline puts it (ZImagePipeline: the template rendered, then tokenized with special tokens recognised, cut at
the maximum length), the same ids transformers' tokenizer gives for the same file.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError

FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json")
PAD = "<|endoftext|>"          # Qwen2's pad (and end-of-text) token


class LLMTokenizer:
    def __init__(self, tokenizer, pad_id: int):
        self.tokenizer, self.pad_id = tokenizer, pad_id

    @classmethod
    def from_folder(cls, folder: str | Path) -> "LLMTokenizer":
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"{folder}: this bundle's text encoder is an LLM, whose tokenizer runs on the `tokenizers` "
                            "package: pip install tokenizers (or precast[llm])") from None
        folder = Path(folder)
        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_text()) \
                if (folder / "tokenizer_config.json").is_file() else {}
        except Exception as e:      # the Rust parser's errors are plain Exceptions
            raise UserError(f"{folder}/tokenizer.json: not a readable tokenizer ({str(e).splitlines()[0]})") from None
        tok.no_truncation()
        tok.no_padding()
        pad = config.get("pad_token") if isinstance(config, dict) else None
        pad = pad.get("content") if isinstance(pad, dict) else pad
        pad_id = tok.token_to_id(pad or PAD)
        return cls(tok, 0 if pad_id is None else pad_id)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def chat(self, prompt: str, template: str, limit: int) -> list[int]:
        """The ids of `prompt` put in `template` (its `{prompt}` replaced), at most `limit` of them."""
        return self.encode(template.replace("{prompt}", prompt))[:limit]
