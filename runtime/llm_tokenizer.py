"""Byte-level BPE tokenizers of LLM text encoders (Qwen2's, which Qwen3 and Qwen2.5 share; Mistral's tekken, as
its tokenizer.json has it), read from the `tokenizer.json` a bundle carries and run by the `tokenizers` library
(the `llm` extra; imported only when such a bundle is opened, so other bundles never need it).

Owns: LLMTokenizer -- a folder's tokenizer.json (its own padding and truncation settings off), pad token
(tokenizer_config.json's, else `<|endoftext|>`) and the side padding goes on (tokenizer_config.json's
`padding_side`, else transformers' default for its `tokenizer_class`: left for Llama's, which Mistral's
tokenizer.json is loaded as -- and for any tokenizer with Mistral's `[INST]`, as FLUX.2 dev's pipelines pad it --,
right for others), and the ids of a prompt put into a family's chat template as its
pipeline puts it (ZImagePipeline, Flux2Pipeline: the template rendered -- it holds its own BOS --, then tokenized
with special tokens recognised and none added, cut at the maximum length), the same ids transformers' tokenizer
gives for the same file.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .errors import UserError

FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json")
PAD = "<|endoftext|>"          # Qwen2's pad (and end-of-text) token
LEFT_PADDED = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
               "GemmaTokenizer", "GemmaTokenizerFast")      # transformers' classes whose padding_side is "left"


class LLMTokenizer:
    def __init__(self, tokenizer, pad_id: int, pad_left: bool = False):
        self.tokenizer, self.pad_id, self.pad_left = tokenizer, pad_id, pad_left

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
        config = config if isinstance(config, dict) else {}
        side = config.get("padding_side") or ("left" if config.get("tokenizer_class") in LEFT_PADDED
                                              or tok.token_to_id("[INST]") is not None else "right")
        return cls(tok, 0 if pad_id is None else pad_id, side == "left")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def chat(self, prompt: str, template: str, limit: int) -> list[int]:
        """The ids of `prompt` put in `template` (its `{prompt}` replaced; special tokens the template spells are
        read as such, none added), at most `limit` of them."""
        return self.tokenizer.encode(template.replace("{prompt}", prompt), add_special_tokens=False).ids[:limit]

    def padded(self, ids: list[int], length: int, left: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """input_ids and attention_mask int32 [1, length]: `ids` padded on the tokenizer's side, or on the left /
        right as `left` says (a pipeline that reads the real rows first pads on the right whatever the tokenizer)."""
        at = length - len(ids) if (self.pad_left if left is None else left) else 0
        out = np.full((1, length), self.pad_id, np.int32)
        out[0, at:at + len(ids)] = ids
        mask = np.zeros((1, length), np.int32)
        mask[0, at:at + len(ids)] = 1
        return out, mask
