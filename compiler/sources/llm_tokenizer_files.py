"""An LLM text encoder's tokenizer for a bundle or an export (Z-Image's Qwen3: Qwen2's byte-level BPE; FLUX.2
dev's Mistral: tekken, as its tokenizer.json has it).

Owns: where it comes from -- a diffusers folder's `tokenizer/` (tokenizer.json, tokenizer_config.json), else a
`tokenizer.json` beside the checkpoint file (ComfyUI's split files ship none: put the model's beside them),
else a precast demo file's own (its metadata `precast.tokenizer.json`) -- checked to parse before anything is
built, a tokenizer_config.json added where none came with it (Mistral's when the vocabulary has `[INST]`: `<pad>`,
padded on the left as transformers pads Llama-class tokenizers; else Qwen2's), and the folder written from it (the runtime reads runtime/llm_tokenizer.py's FOLDER_FILES). A `tokenizer/`
with no tokenizer.json but a slow tokenizer's files (Qwen/Qwen-Image's: vocab.json, merges.txt, the added tokens
in tokenizer_config.json or added_tokens.json) gets the tokenizer.json transformers' Qwen2Tokenizer builds from
them; Qwen2's pipeline around a BPE model (qwen2_tokenizer) is the demo tokenizer's too.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import BadInput
from .safetensors_file import SafetensorsFile

TOKENIZER_JSON, CONFIG = "tokenizer.json", "tokenizer_config.json"
VOCAB, MERGES, ADDED, SPECIAL_MAP = "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json"
DEMO_KEY = "precast.tokenizer.json"       # a demo file's own tokenizer, in its safetensors metadata
DEFAULT_CONFIG = {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                  "model_max_length": 131072}
MISTRAL_CONFIG = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                  "unk_token": "<unk>", "pad_token": "<pad>", "padding_side": "left", "model_max_length": 131072}
# Qwen2's pre-tokenizer split (tokenizer.json of every Qwen2 / Qwen2.5 / Qwen3 model)
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")     # an added token's, beside its content
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
         "additional_special_tokens", "extra_special_tokens")     # where a config names its special tokens


def llm_tokenizer_files(source: Path, folder: str = "tokenizer") -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer for the model at `source`, or one BadInput saying where to put it."""
    source = Path(source)
    files: dict[str, bytes] = {}
    if source.is_dir():
        where = source / folder
        if (where / TOKENIZER_JSON).is_file():
            files = {n: (where / n).read_bytes() for n in (TOKENIZER_JSON, CONFIG) if (where / n).is_file()}
        elif (where / VOCAB).is_file() or (where / MERGES).is_file():
            files = {TOKENIZER_JSON: qwen2_tokenizer_json(where).encode()}
            if (where / CONFIG).is_file():
                files[CONFIG] = (where / CONFIG).read_bytes()
    elif (source.parent / TOKENIZER_JSON).is_file():
        where = source.parent
        files = {TOKENIZER_JSON: (where / TOKENIZER_JSON).read_bytes()}
    elif source.suffix == ".safetensors" and DEMO_KEY in (meta := SafetensorsFile(source).metadata or {}):
        where = source
        files = {TOKENIZER_JSON: meta[DEMO_KEY].encode()}
    if not files:
        beside = source / folder if source.is_dir() else source.parent
        need = f"{TOKENIZER_JSON} (nor {VOCAB} + {MERGES})" if source.is_dir() else TOKENIZER_JSON
        raise BadInput(f"{source}: its LLM text encoder needs the model's tokenizer: no {need} in {beside}; copy the "
                       f"model's {folder}/ files there (Z-Image: Tongyi-MAI/Z-Image-Turbo's, which is Qwen3's; "
                       "Qwen-Image: Qwen/Qwen-Image's; FLUX.2 dev: black-forest-labs/FLUX.2-dev's)")
    try:
        tok = _tokenizers().Tokenizer.from_str(files[TOKENIZER_JSON].decode())
    except Exception as e:      # the Rust parser's errors are plain Exceptions
        raise BadInput(f"{where}: {TOKENIZER_JSON} is not a readable tokenizer ({str(e).splitlines()[0]}); "
                       "download it again") from None
    default = MISTRAL_CONFIG if tok.token_to_id("[INST]") is not None else DEFAULT_CONFIG
    files.setdefault(CONFIG, (json.dumps(default, indent=2) + "\n").encode())
    return files


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise BadInput("an LLM text encoder's tokenizer is read with the `tokenizers` package: pip install tokenizers "
                       "(or precast[llm])") from None
    return tokenizers


def qwen2_tokenizer(model):
    """A `tokenizers` Tokenizer of the byte-level BPE `model` in Qwen2's pipeline, as every Qwen2 / Qwen2.5 / Qwen3
    tokenizer.json has it: NFC, Qwen2's split then ByteLevel without prefix space; ByteLevel decoder and
    post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadInput(f"{path}: not valid JSON ({e}); download it again") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: holds {type(data).__name__}, not a JSON object; download it again")
    return data


def _named(config: dict) -> set[str]:
    """The special tokens a tokenizer_config.json or special_tokens_map.json names."""
    out = set()
    for key in NAMED:
        value = config.get(key)
        for v in value if isinstance(value, list) else [value]:
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                out.add(v)
    return out


def qwen2_tokenizer_json(where: Path) -> str:
    """The tokenizer.json transformers' Qwen2Tokenizer builds from the slow tokenizer's files in `where`: vocab.json
    + merges.txt, and the added tokens of tokenizer_config.json's added_tokens_decoder, else of added_tokens.json
    (special where tokenizer_config.json or special_tokens_map.json names them), each at its id."""
    AddedToken, models = _tokenizers().AddedToken, _tokenizers().models
    if missing := [n for n in (VOCAB, MERGES) if not (where / n).is_file()]:
        raise BadInput(f"{where}: has no {TOKENIZER_JSON}, and of the slow tokenizer's {VOCAB} + {MERGES} no "
                       f"{missing[0]}; copy the model's {where.name}/{missing[0]} (or its {TOKENIZER_JSON}) there")
    try:
        vocab, merges = models.BPE.read_file(str(where / VOCAB), str(where / MERGES))
    except Exception as e:      # the Rust reader's errors are plain Exceptions
        raise BadInput(f"{where}: {VOCAB} + {MERGES} are not a readable BPE tokenizer ({str(e).splitlines()[0]}); "
                       "download them again") from None
    config = _json(where / CONFIG)
    decoder, source = config.get("added_tokens_decoder"), CONFIG
    try:
        if decoder:
            added = {int(i): AddedToken(t["content"], **{k: t[k] for k in FLAGS if k in t}) for i, t in decoder.items()}
        else:
            specials, source = _named(config) | _named(_json(where / SPECIAL_MAP)), ADDED
            added = {int(i): AddedToken(c, normalized=c not in specials, special=c in specials)
                     for c, i in _json(where / ADDED).items()}
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        raise BadInput(f"{where / source}: its added tokens are not readable ({type(e).__name__}: {e}); download it again") from None
    tok = qwen2_tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    for i, token in sorted(added.items()):
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])
        if tok.token_to_id(token.content) != i:
            raise BadInput(f"{where / source}: added token {token.content!r} has id {i}, but after {VOCAB}'s "
                           f"{len(vocab)} ids it gets {tok.token_to_id(token.content)}; the files are from different "
                           f"models: download the model's {where.name}/ again")
    return tok.to_str()


def write_llm_tokenizer_folder(out: Path, files: dict[str, bytes]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in sorted(files.items()):
        (out / name).write_bytes(data)
        written.append(out / name)
    return written
