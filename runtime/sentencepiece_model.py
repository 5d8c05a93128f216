"""The sentencepiece model file a T5 tokenizer reads (a ModelProto, `spiece.model`) and its `Precompiled`
normalizer, as Hugging Face's tokenizers applies it (runtime/t5_tokenizer.py says why and how it differs
from sentencepiece's own).

Owns: `read_model_specs` (the normalizer and trainer specs, with the proto's defaults), `read_pieces`
(piece, score, type), `CharsMap` (the precompiled character map: a darts-clone double-array trie and its
replacement strings, applied per grapheme cluster) and `graphemes` (UAX #29 clusters over Python's
`unicodedata`, as far as they matter to the map). Standard library only.
"""
from __future__ import annotations

import struct
import unicodedata
from functools import lru_cache

from .protobuf import proto_fields


def read_model_specs(model: bytes) -> tuple[dict, dict]:
    """(normalizer spec, trainer spec) of a serialized sentencepiece ModelProto.
    The specs hold only the fields this module checks, with the proto's defaults, and later
    copies of a field override earlier ones as protobuf does. ValueError when it does not parse."""
    norm = {"charsmap": b"", "add_dummy_prefix": 1, "remove_extra_whitespaces": 1, "escape_whitespaces": 1}
    trainer = {"model_type": 1, "byte_fallback": 0, "treat_whitespace_as_suffix": 0}
    norm_fields = {2: "charsmap", 3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
    trainer_fields = {3: "model_type", 35: "byte_fallback", 24: "treat_whitespace_as_suffix"}
    for number, wire, value in proto_fields(model):
        if number in (2, 3) and wire == 2:
            spec, names = (trainer, trainer_fields) if number == 2 else (norm, norm_fields)
            for n, _, v in proto_fields(value):
                if n in names:
                    spec[names[n]] = v
    return norm, trainer


class CharsMap:
    """sentencepiece's precompiled character map (NFKC plus T5's extras) as the Hugging Face
    `Precompiled` normalizer applies it. Layout: little-endian uint32 size of a darts-clone
    double-array trie, the trie (uint32 units), then NUL-terminated replacement strings; a key's
    trie leaf holds the offset of its replacement."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise ValueError("character map shorter than its header")
        size = struct.unpack_from("<I", blob)[0]
        if size % 4 or size == 0 or 4 + size > len(blob):
            raise ValueError(f"character map trie of {size} bytes does not fit its {len(blob)}-byte blob")
        self.units = struct.unpack_from(f"<{size // 4}I", blob, 4)
        self.strings = blob[4 + size:]
        self._one: dict[str, str] = {}           # one character -> its mapping (or itself)

    def shortest(self, key: bytes) -> str | None:
        """The replacement of the shortest key in the map that `key` starts with, or None."""
        units = self.units
        unit = units[0]
        pos = (unit >> 10) << ((unit & 0x200) >> 6)
        for b in key:
            pos ^= b
            if pos >= len(units):
                return None
            unit = units[pos]
            if unit & 0x800000FF != b:          # the unit's label is not this byte
                return None
            pos ^= (unit >> 10) << ((unit & 0x200) >> 6)
            if (unit >> 8) & 1:                 # a key ends here: its value sits at pos
                if pos >= len(units):
                    raise ValueError("character map leaf outside the trie")
                start = units[pos] & 0x7FFFFFFF
                end = self.strings.find(b"\0", start)
                if start >= len(self.strings) or end < 0:
                    raise ValueError("character map value outside its strings")
                return self.strings[start:end].decode("utf-8", "replace")
        return None

    def char(self, c: str) -> str:
        out = self._one.get(c)
        if out is None:
            found = self.shortest(c.encode("utf-8"))
            out = self._one[c] = c if found is None else found
        return out

    def normalize(self, text: str) -> str:
        out = []
        for cluster in graphemes(text):
            if len(cluster) > 1:
                raw = cluster.encode("utf-8")
                if len(raw) < 6:
                    found = self.shortest(raw)
                    if found is not None:
                        out.append(found)
                        continue
            out.extend(self.char(c) for c in cluster)
        return "".join(out)


# -- grapheme clusters (UAX #29), as far as they matter to _CharsMap -----------------------------

_PREPEND = {*range(0x600, 0x606), 0x6DD, 0x70F, 0x890, 0x891, 0x8E2, 0xD4E, 0x110BD, 0x110CD,
            0x111C2, 0x111C3, 0x1193F, 0x11941, 0x11A3A, *range(0x11A84, 0x11A8A), 0x11D46, 0x11F02}
# Mc characters that are not SpacingMark (they start a cluster), and two Lo that are.
_NOT_SPACING = {0x102B, 0x102C, 0x1038, 0x1062, 0x1063, 0x1064, *range(0x1067, 0x106E), 0x1083,
                *range(0x1087, 0x108D), 0x108F, 0x109A, 0x109B, 0x109C, 0x1A61, 0x1A63, 0x1A64,
                0xAA7B, 0xAA7D, 0x11720, 0x11721}
_SPACING_LO = {0xE33, 0xEB3}
_EXTEND_EXTRA = {0x200C, 0xFF9E, 0xFF9F, *range(0x1F3FB, 0x1F400), *range(0xE0020, 0xE0080)}


@lru_cache(maxsize=8192)
def _break_class(c: str) -> str:
    """The grapheme-break property of one character: CR, LF, Control, Extend (incl. ZWJ and
    SpacingMark, which both join the cluster before them), Prepend, L, V, T, LV, LVT, RI, Other."""
    cp = ord(c)
    if cp == 0x0D:
        return "CR"
    if cp == 0x0A:
        return "LF"
    if cp in _EXTEND_EXTRA or cp == 0x200D or cp in _SPACING_LO:
        return "Extend"
    if cp in _PREPEND:
        return "Prepend"
    cat = unicodedata.category(c)
    if cat in ("Mn", "Me") or (cat == "Mc" and cp not in _NOT_SPACING):
        return "Extend"
    if cat in ("Cc", "Zl", "Zp", "Cf"):
        return "Control"
    if 0x1F1E6 <= cp <= 0x1F1FF:
        return "RI"
    if 0x1100 <= cp <= 0x115F or 0xA960 <= cp <= 0xA97C:
        return "L"
    if 0x1160 <= cp <= 0x11A7 or 0xD7B0 <= cp <= 0xD7C6:
        return "V"
    if 0x11A8 <= cp <= 0x11FF or 0xD7CB <= cp <= 0xD7FB:
        return "T"
    if 0xAC00 <= cp <= 0xD7A3:
        return "LV" if (cp - 0xAC00) % 28 == 0 else "LVT"
    return "Other"


_HANGUL_JOINS = {("L", "L"), ("L", "V"), ("L", "LV"), ("L", "LVT"), ("LV", "V"), ("V", "V"),
                 ("LV", "T"), ("V", "T"), ("LVT", "T"), ("T", "T")}


def graphemes(text: str) -> list[str]:
    """Extended grapheme clusters of `text` (UAX #29 rules GB3-GB9b, GB6-8 Hangul, GB12-13
    regional-indicator pairs; not GB9c and GB11, which join only 3- and 4-byte characters)."""
    out: list[str] = []
    start, prev, ri_run = 0, None, 0
    for i, c in enumerate(text):
        cls = _break_class(c)
        if prev is None:
            join = False
        elif prev == "CR":
            join = cls == "LF"
        elif prev in ("LF", "Control") or cls in ("CR", "LF", "Control"):
            join = False
        elif cls == "Extend" or prev == "Prepend":
            join = True
        elif (prev, cls) in _HANGUL_JOINS:
            join = True
        elif prev == "RI" and cls == "RI":
            join = ri_run % 2 == 1
        else:
            join = False
        ri_run = ri_run + 1 if cls == "RI" else 0
        if not join and i > start:
            out.append(text[start:i])
            start = i
        prev = cls
    if start < len(text):
        out.append(text[start:])
    return out


# -- the tokenizer ------------------------------------------------------------------------------

def read_pieces(model: bytes) -> list[tuple[str, float, int]]:
    """(piece, float32 score, type) of each SentencePiece of a serialized ModelProto, in id order
    (type 1 normal, 2 unknown, 3 control, 4 user-defined, 6 unused; absent = 1)."""
    out = []
    for number, wire, value in proto_fields(model):
        if number != 1 or wire != 2:
            continue
        piece, score, kind = None, 0.0, 1
        for n, w, v in proto_fields(value):
            if n == 1 and w == 2:
                piece = v.decode("utf-8")
            elif n == 2 and w == 5:
                score = struct.unpack("<f", v)[0]
            elif n == 3 and w == 0:
                kind = v
        if piece is None:
            raise ValueError(f"piece {len(out)} has no text")
        out.append((piece, score, kind))
    return out
