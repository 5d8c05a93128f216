"""T5 v1.1 tokenizer files for a bundle's tokenizer_2/ folder (Flux, Chroma; SD3's T5 prompts).

Owns: converting a Hugging Face tokenizer.json of T5's layout (Unigram over 32000 sentencepiece
pieces, `<extra_id_99>`..`<extra_id_0>` after them, the precompiled NFKC character map, Metaspace)
to the sentencepiece model file (`spiece.model`) the runtime's `T5Tokenizer` reads, and writing a
diffusers-style tokenizer folder: spiece.model, tokenizer_config.json, special_tokens_map.json and
tokenizer.json, from the model's own folder where it has them, else from precast's shipped copies
(runtime/data/t5_spiece.model, t5_tokenizer.json.gz). The model file is written by hand in
protobuf's wire format (sentencepiece_model.proto's field numbers), so no protobuf package is
needed; the runtime's `read_model_specs` and sentencepiece read it back before it is used.
"""
from __future__ import annotations

import base64
import binascii
import gzip
import json
import math
import os
import re
import struct
from pathlib import Path

from ...runtime.errors import UserError
from ...runtime.t5_tokenizer import (DATA, EOS, N_EXTRA_IDS, PAD, SHIPPED_MODEL, SPACE, SPIECE, UNK,
                                     T5Tokenizer)
from ..errors import BadInput

SHIPPED_TOKENIZER_JSON = DATA / "t5_tokenizer.json.gz"
TOKENIZER_JSON = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
MODEL_MAX_LENGTH = 512
_EXTRA = re.compile(r"<extra_id_(\d+)>")

# sentencepiece_model.proto: ModelProto.SentencePiece.Type and TrainerSpec.ModelType values
NORMAL, UNKNOWN, CONTROL = 1, 2, 3
UNIGRAM = 1


# -- protobuf wire format, the few field kinds a ModelProto needs --------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1                    # negative int32 values: ten bytes, two's complement
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _float_field(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _piece(text: str, score: float, kind: int) -> bytes:
    body = _bytes_field(1, text.encode("utf-8")) + _float_field(2, score)
    if kind != NORMAL:                    # NORMAL is the default: sentencepiece leaves it out
        body += _int_field(3, kind)
    return _bytes_field(1, body)


def build_spiece_model(pieces: list[tuple[str, float]], charsmap: bytes) -> bytes:
    """A T5 sentencepiece ModelProto: `pieces` in id order (<pad>, </s>, <unk> first), a Unigram
    model with pad 0, eos 1, unk 2 and no bos, and T5's normalizer (name nmt_nfkc, `charsmap`,
    dummy prefix, extra whitespace removed, spaces escaped as "▁")."""
    kinds = {0: CONTROL, 1: CONTROL, 2: UNKNOWN}
    out = bytearray()
    for i, (text, score) in enumerate(pieces):
        out += _piece(text, score, kinds.get(i, NORMAL))
    trainer = (_int_field(3, UNIGRAM) + _int_field(4, len(pieces)) + _int_field(40, 2) + _int_field(41, -1)
               + _int_field(42, 1) + _int_field(43, 0) + _bytes_field(45, UNK.encode())
               + _bytes_field(47, EOS.encode()) + _bytes_field(48, PAD.encode()))
    normalizer = (_bytes_field(1, b"nmt_nfkc") + _bytes_field(2, charsmap) + _int_field(3, 1)
                  + _int_field(4, 1) + _int_field(5, 1))
    out += _bytes_field(2, trainer) + _bytes_field(3, normalizer)
    return bytes(out)


# -- tokenizer.json -> spiece.model -------------------------------------------------------------

def spiece_model_from_tokenizer_json(json_bytes: bytes, source: str = TOKENIZER_JSON) -> bytes:
    """The sentencepiece model equivalent to a T5 tokenizer.json (its 32000 pieces, scores and
    character map; the `<extra_id_N>` entries after them are left to the tokenizer, which adds
    them as T5Tokenizer does). `source` names the file in errors. BadInput, naming the file and
    the fix, when it is damaged or not T5's layout."""
    return _convert(json_bytes, source)[0]


def _convert(json_bytes: bytes, source: str) -> tuple[bytes, T5Tokenizer]:
    fix = "use the T5 v1.1 tokenizer_2/tokenizer.json of the model (or its spiece.model)"

    def bad(why: str) -> BadInput:
        return BadInput(f"{source}: {why}; {fix}")

    try:
        doc = json.loads(json_bytes)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not a readable tokenizer.json ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise bad("not a tokenizer.json (no model section)")
    model = doc["model"]
    if model.get("type") != "Unigram":
        raise bad(f"a {model.get('type')!r} tokenizer, T5's is Unigram")
    if model.get("unk_id") != 2 or model.get("byte_fallback"):
        raise bad(f"unk_id {model.get('unk_id')}, byte_fallback {model.get('byte_fallback')}; T5 has 2 and none")
    vocab = model.get("vocab")
    if not isinstance(vocab, list) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0]
            and isinstance(v[1], (int, float)) and not isinstance(v[1], bool) and math.isfinite(v[1])
            for v in vocab):
        raise bad("its vocab is not a list of [piece, finite score] pairs")
    if [v[0] for v in vocab[:3]] != [PAD, EOS, UNK]:
        raise bad(f"ids 0-2 are {[v[0] for v in vocab[:3]]}, T5 has {[PAD, EOS, UNK]}")
    # <extra_id_N> entries close the vocabulary, N counting down to 0: they are not pieces.
    base = len(vocab)
    while base > 3 and _EXTRA.fullmatch(vocab[base - 1][0]):
        base -= 1
    extra = [v[0] for v in vocab[base:]]
    if extra and extra != [f"<extra_id_{n}>" for n in range(len(extra) - 1, -1, -1)]:
        raise bad(f"its {len(extra)} <extra_id_N> entries are not <extra_id_{len(extra) - 1}>..<extra_id_0> in order")
    if len(extra) not in (0, N_EXTRA_IDS):
        raise bad(f"{len(extra)} <extra_id_N> tokens, T5 has {N_EXTRA_IDS}")
    pieces = [(v[0], float(v[1])) for v in vocab[:base]]
    if len({p for p, _ in pieces}) != len(pieces):
        raise bad("a piece appears twice in its vocab")
    if any(struct.unpack("<f", struct.pack("<f", s))[0] != s for _, s in pieces):
        raise bad("its scores are not float32 values (not converted from a sentencepiece model)")
    for tok in doc.get("added_tokens") or []:
        if not isinstance(tok, dict):
            raise bad(f"added token {tok!r} is not an object")
        content, tid = tok.get("content"), tok.get("id")
        expected = {PAD: 0, EOS: 1, UNK: 2}.get(content)
        m = _EXTRA.fullmatch(content or "")
        if m:
            expected = base + N_EXTRA_IDS - 1 - int(m.group(1)) if extra else None
        if expected is None or tid != expected:
            raise bad(f"added token {content!r} (id {tid}) is not one of T5's")
    charsmap = _charsmap_of(doc.get("normalizer"), bad)
    _check_pre_tokenizer(doc.get("pre_tokenizer"), bad)
    spiece = build_spiece_model(pieces, charsmap)
    try:
        tok = T5Tokenizer(spiece, source=source)        # sentencepiece and the runtime read it back
    except UserError as e:
        raise bad(f"does not convert to a working sentencepiece model ({e})") from None
    return spiece, tok


def _charsmap_of(normalizer, bad) -> bytes:
    """The character map of T5's normalizer: Precompiled(charsmap), alone or followed by what
    transformers' T5 converters have written after it (Strip right, Replace(" {2,}", " " or "▁"))."""
    steps = normalizer.get("normalizers") if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" \
        else [normalizer]
    if not isinstance(steps, list) or not steps or not isinstance(steps[0], dict) \
            or steps[0].get("type") != "Precompiled":
        raise bad("its normalizer is not sentencepiece's Precompiled character map")
    for step in steps[1:]:
        replace = (isinstance(step, dict) and step.get("type") == "Replace"
                   and step.get("pattern") == {"Regex": " {2,}"} and step.get("content") in (" ", SPACE))
        strip = isinstance(step, dict) and step.get("type") == "Strip" and not step.get("strip_left")
        if not (replace or strip):
            raise bad(f"normalizer step {step!r} is not T5's")
    try:
        charsmap = base64.b64decode(steps[0].get("precompiled_charsmap") or "", validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise bad(f"its precompiled_charsmap is not base64 ({e})") from None
    if not charsmap:
        raise bad("its precompiled_charsmap is empty")
    return charsmap


def _check_pre_tokenizer(pre, bad) -> None:
    """Metaspace("▁") that prepends "▁" (old `add_prefix_space: true` or `prepend_scheme:
    always`), alone or after WhitespaceSplit (as transformers 5 saves it)."""
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if isinstance(steps, list) and len(steps) == 2 and isinstance(steps[0], dict) \
            and steps[0].get("type") == "WhitespaceSplit":
        steps = steps[1:]
    ok = (isinstance(steps, list) and len(steps) == 1 and isinstance(steps[0], dict)
          and steps[0].get("type") == "Metaspace" and steps[0].get("replacement") == SPACE
          and (steps[0].get("add_prefix_space") is True or steps[0].get("prepend_scheme") == "always")
          and steps[0].get("split", True) is True)
    if not ok:
        raise bad(f"its pre_tokenizer {pre!r} is not T5's Metaspace(\"▁\", prepend always)")


# -- the folder --------------------------------------------------------------------------------

def shipped_tokenizer_json() -> bytes:
    """precast's copy of the T5 v1.1 tokenizer.json (runtime/data/README.md says where from)."""
    return gzip.decompress(SHIPPED_TOKENIZER_JSON.read_bytes())


def default_config_files() -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json as transformers' T5Tokenizer (slow or
    fast, 4.x or 5.x) needs them: 512 tokens, </s> / <unk> / <pad>, 100 extra ids."""
    extra = [f"<extra_id_{n}>" for n in range(N_EXTRA_IDS)]
    specials = {"eos_token": EOS, "unk_token": UNK, "pad_token": PAD, "additional_special_tokens": extra}
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": MODEL_MAX_LENGTH, "extra_ids": N_EXTRA_IDS,
              "legacy": True, "clean_up_tokenization_spaces": True, **specials}
    return {"tokenizer_config.json": config, "special_tokens_map.json": specials}


def write_t5_tokenizer_folder(out_folder: str | os.PathLike,
                              source_tokenizer_folder: str | os.PathLike | None = None) -> list[str]:
    """Write a diffusers-style T5 tokenizer folder (tokenizer_2/) to `out_folder`; returns the
    names of the files written, sorted.

    spiece.model: the source folder's, else converted from its tokenizer.json, else precast's
    shipped one. tokenizer.json: the source folder's, else precast's shipped one when the
    spiece.model written has the shipped one's pieces, scores and character map (transformers
    would otherwise rebuild it from spiece.model, which tokenizes some prompts differently: see
    runtime/t5_tokenizer.py), else none. When the source has both, they must agree.
    tokenizer_config.json, special_tokens_map.json: the source folder's (JSON objects), else
    `default_config_files`. A source folder without any of these files counts as none.
    BadInput, naming the file and the fix, for a damaged or non-T5 file."""
    src = Path(source_tokenizer_folder) if source_tokenizer_folder is not None else None
    if src is not None and not src.is_dir():
        raise BadInput(f"{src}: not a folder; pass the model's tokenizer_2/ folder (or none for precast's T5 tokenizer)")
    files: dict[str, bytes] = {}
    from_json = None
    if src is not None and (src / TOKENIZER_JSON).is_file():
        files[TOKENIZER_JSON] = _read(src / TOKENIZER_JSON)
        files[SPIECE], from_json = _convert(files[TOKENIZER_JSON], str(src / TOKENIZER_JSON))
    if src is not None and (src / SPIECE).is_file():
        files[SPIECE] = _read(src / SPIECE)
        try:
            tok = T5Tokenizer(files[SPIECE], source=str(src / SPIECE))
        except UserError as e:
            raise BadInput(str(e)) from None
        if from_json is not None and not _same_tokenizer(tok, from_json):
            raise BadInput(f"{src / SPIECE}: its pieces, scores or character map differ from those of "
                           f"{src / TOKENIZER_JSON}; the folder mixes two tokenizers: restore the model's own pair")
        if from_json is None and _same_tokenizer(tok, T5Tokenizer.shipped()):
            files[TOKENIZER_JSON] = shipped_tokenizer_json()
    if SPIECE not in files:
        files[SPIECE] = SHIPPED_MODEL.read_bytes()
        files[TOKENIZER_JSON] = shipped_tokenizer_json()
    for name, default in default_config_files().items():
        theirs = src / name if src is not None else None
        if theirs is not None and theirs.is_file():
            data = _read(theirs)
            try:
                if not isinstance(json.loads(data), dict):
                    raise ValueError("not a JSON object")
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise BadInput(f"{theirs}: not a readable JSON object ({e}); fix or delete it "
                               "(precast then writes a default one)") from None
            files[name] = data
        else:
            files[name] = (json.dumps(default, indent=2) + "\n").encode()
    out = Path(out_folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, out / name)
    return sorted(files)


def _same_tokenizer(a: T5Tokenizer, b: T5Tokenizer) -> bool:
    return a.vocab_size == b.vocab_size and a.pieces == b.pieces and a.charsmap == b.charsmap


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read it ({e.strerror or e}); check the file's permissions") from None
