"""CLIP's byte-level BPE text tokenizer (SD 1.x / 2.x / XL prompts), numpy + standard library only.

Owns: turning a prompt into the int32 ids the text encoders take: text cleaning, CLIP's
pre-tokenisation, byte-level BPE over CLIP's merges, BOS/EOS/padding to 77, and textual-inversion
trigger words. The merges ship in runtime/data/ (see runtime/data/README.md); a diffusers folder's
tokenizer/vocab.json + merges.txt is read when a bundle carries one.

What CLIP does and what this does instead (no ftfy, no `regex` at run time):
  * CLIP cleans text with ftfy.fix_text, then html.unescape twice, collapses whitespace, strips
    and lower-cases. ftfy is not used here; its NFC normalisation (its default) is kept, via
    unicodedata, so composed and decomposed accents give the same ids (as transformers does
    too). ftfy's other repairs (mojibake, curly quotes, ligatures, full-width forms, ...) are
    not done; transformers' CLIPTokenizer does not do them either.
  * CLIP splits with `regex` and \\p{L} / \\p{N}; `re` has no \\p{..}, see _PRE below.
"""
from __future__ import annotations

import gzip
import html
import json
import os
import re
import unicodedata
from functools import lru_cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
SHIPPED_MERGES = DATA / "bpe_simple_vocab_16e6.txt.gz"
# CLIP keeps the first 49152 - 256 - 2 merges of the file (after its header line).
N_MERGES = 49152 - 256 - 2
SOT, EOT = "<|startoftext|>", "<|endoftext|>"
EOW = "</w>"
TRIGGERS_JSON = "trigger_words.json"    # precast's own side file for textual-inversion words
FOLDER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json", TRIGGERS_JSON)

# Pre-tokenisation. CLIP's pattern (for the `regex` module, IGNORECASE) is:
#   <|startoftext|> | <|endoftext|> | 's|'t|'re|'ve|'m|'ll|'d | [\p{L}]+ | [\p{N}] | [^\s\p{L}\p{N}]+
# Emulated with `re`:
#   * letters: [^\W\d_] is "word character, not a decimal digit, not '_'", i.e. categories L*
#     plus the non-decimal numbers Nl/No (Roman numerals, superscripts, fractions, circled
#     digits, ...). Those are \p{N} for CLIP, each one a token by itself, so a letter run that
#     is not all isalpha() (isalpha() is exactly category L*) is split afterwards (_split_run).
#   * numbers: \d (Nd) plus those Nl/No split out of letter runs: together exactly \p{N}.
#   * whitespace: `re`'s \s also matches U+001C..U+001F, which `regex`'s \s does not: for CLIP
#     they are "other" characters, so they are excluded from whitespace and added to "other".
#   * both modules take L/N from their own Unicode database (Python 3.11: Unicode 14), so a
#     character assigned in a later Unicode version than Python's can still split differently.
#   * IGNORECASE is kept as CLIP has it: after lower-casing it only matters for the
#     contractions, e.g. "'\u017f" (long s) matches 's in both modules, and for U+0345
#     (combining ypogegrammeni, Mn): it case-folds to a letter (iota), so under IGNORECASE
#     `regex` keeps it out of the negated "other" class and CLIP drops it; `re` would not, so
#     it is excluded from "other" by hand.
_PRE = re.compile(
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d"
    r"|([^\W\d_]+)"
    r"|\d"
    r"|(?:[^\s\w\u0345]|[_\x1c-\x1f])+",
    re.IGNORECASE,
)
_WS = re.compile(r"[^\S\x1c-\x1f]+")    # `regex`'s \s: `re`'s \s less U+001C..U+001F


def bytes_to_unicode() -> dict[int, str]:
    """CLIP/GPT-2's reversible byte -> printable character map, in vocabulary order: the
    printable Latin-1 bytes stand for themselves, the other 68 bytes take U+0100 onwards."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


_BYTE_CHARS = bytes_to_unicode()
# latin-1 decoding turns byte b into chr(b); this table then maps chr(b) to CLIP's symbol.
_BYTE_TABLE = str.maketrans({chr(b): c for b, c in _BYTE_CHARS.items()})
_BYTE_OF = {**{c: b for b, c in _BYTE_CHARS.items()}, " ": 0x20}   # for decode; " " is not a symbol


def clean(text: str) -> str:
    """CLIP's text cleaning, less ftfy (see the module docstring): NFC, HTML entities
    unescaped twice, whitespace runs to one space, stripped, lower-cased."""
    text = unicodedata.normalize("NFC", text)
    text = html.unescape(html.unescape(text)).strip()
    return _WS.sub(" ", text).strip().lower()


def pretokenize(text: str) -> list[str]:
    """CLIP's pre-tokens of already cleaned text."""
    out = []
    for m in _PRE.finditer(text):
        tok = m.group()
        if m.group(1) is not None and not tok.isalpha():
            out.extend(_split_run(tok))
        else:
            out.append(tok)
    return out


def _split_run(run: str) -> list[str]:
    """A run of [^\\W\\d_] into letter runs, each Nl/No character alone (CLIP's [\\p{N}])."""
    out, start = [], 0
    for i, ch in enumerate(run):
        if not ch.isalpha():
            if i > start:
                out.append(run[start:i])
            out.append(ch)
            start = i + 1
    if start < len(run):
        out.append(run[start:])
    return out


def read_clip_merges(path: str | os.PathLike = SHIPPED_MERGES) -> list[tuple[str, str]]:
    """The merges CLIP uses from a bpe_simple_vocab_16e6.txt(.gz): lines 1..48894 after the header."""
    raw = gzip.decompress(Path(path).read_bytes()) if str(path).endswith(".gz") else Path(path).read_bytes()
    lines = raw.decode("utf-8").split("\n")[1:N_MERGES + 1]
    merges = [tuple(line.split(" ")) for line in lines]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None or len(merges) != N_MERGES:
        raise ValueError(f"{path}: not a CLIP merges file (line {bad!r}, {len(merges)} merges)")
    return merges


def clip_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """CLIP's vocabulary from its merges: 256 byte symbols, the same with </w>, one token per
    merge, then <|startoftext|> and <|endoftext|>."""
    symbols = list(_BYTE_CHARS.values())
    tokens = [*symbols, *(s + EOW for s in symbols), *(a + b for a, b in merges), SOT, EOT]
    return {t: i for i, t in enumerate(tokens)}


@lru_cache(maxsize=1)
def _shipped_tables() -> tuple[dict[str, int], list[tuple[str, str]]]:
    merges = read_clip_merges(SHIPPED_MERGES)
    return clip_vocab(merges), merges


class ClipTokenizer:
    """CLIP BPE tokenizer. `tok(prompt)` gives the int32 [77] ids a CLIP text encoder takes."""

    BOS = 49406
    EOS = 49407
    CACHE_LIMIT = 65536

    def __init__(self, encoder: dict[str, int], merges: list[tuple[str, str]], pad_id: int = 49407):
        self.encoder = encoder                  # not mutated: shipped() instances share it
        self.merges = merges
        self.ranks = {tuple(m): i for i, m in enumerate(merges)}
        self.pad_id = int(pad_id)
        self.bos_id = encoder.get(SOT, self.BOS)
        self.eos_id = encoder.get(EOT, self.EOS)
        self._base_size = max(encoder.values()) + 1 if encoder else 0
        self._triggers: dict[str, list[int]] = {}      # cleaned trigger word -> its ids
        self._trigger_re: re.Pattern | None = None
        self._decoder: dict[int, str] | None = None
        self._cache: dict[str, tuple[int, ...]] = {}
        self._seed_cache()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def shipped(cls, pad_id: int = 49407) -> "ClipTokenizer":
        """CLIP's own vocabulary (identical for SD 1.x, 2.x and XL), from runtime/data/."""
        encoder, merges = _shipped_tables()
        return cls(encoder, merges, pad_id=pad_id)

    @classmethod
    def from_files(cls, vocab_json: str | os.PathLike, merges_txt: str | os.PathLike,
                   pad_id: int = 49407) -> "ClipTokenizer":
        """Hugging Face layout: vocab.json (token -> id) and merges.txt ("#version" header, then
        one "a b" merge a line, in rank order)."""
        with open(vocab_json, encoding="utf-8") as f:
            encoder = json.load(f)
        if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
            raise ValueError(f"{vocab_json}: not a token -> id mapping")
        merges = []
        with open(merges_txt, encoding="utf-8") as f:
            for n, line in enumerate(f):
                line = line.rstrip("\r\n")
                if (n == 0 and line.startswith("#version")) or not line:
                    continue
                pair = tuple(line.split(" "))
                if len(pair) != 2:
                    raise ValueError(f"{merges_txt}:{n + 1}: not a merge: {line!r}")
                merges.append(pair)
        return cls(encoder, merges, pad_id=pad_id)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, pad_id: int | None = None) -> "ClipTokenizer":
        """folder/vocab.json + folder/merges.txt when both exist (a diffusers tokenizer/ folder,
        or what write_files wrote), else shipped(). pad_id defaults to the folder's
        tokenizer_config.json / special_tokens_map.json pad_token (SD2/XL's OpenCLIP one pads
        with "!" = 0), else 49407. Trigger words that write_files saved are registered again."""
        folder = Path(folder)     # reads FOLDER_FILES only (a bundle checks them against its manifest first)
        vocab, merges = folder / "vocab.json", folder / "merges.txt"
        if vocab.is_file() and merges.is_file():
            tok = cls.from_files(vocab, merges)
        else:
            tok = cls.shipped()
        tok.pad_id = int(pad_id) if pad_id is not None else _folder_pad_id(folder, tok)
        triggers = folder / TRIGGERS_JSON
        if triggers.is_file():
            for name, ids in json.loads(triggers.read_text(encoding="utf-8")).items():
                tok._register(name, [int(i) for i in ids])
        return tok

    # -- encoding -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._base_size + sum(len(ids) for ids in self._triggers.values())

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without BOS/EOS."""
        text = clean(text)
        if self._trigger_re is None:
            return self._encode_clean(text)
        out, pos = [], 0
        for m in self._trigger_re.finditer(text):
            out += self._encode_clean(text[pos:m.start()])
            out += self._triggers[m.group()]
            pos = m.end()
        out += self._encode_clean(text[pos:])
        return out

    def __call__(self, text: str | list[str], max_length: int = 77) -> np.ndarray:
        """int32 [max_length]: BOS, the first max_length - 2 ids, EOS, then pad_id. A list of
        prompts gives [len(text), max_length]."""
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        if not isinstance(text, str):
            return np.stack([self(t, max_length) for t in text]) if len(text) else \
                np.zeros((0, max_length), np.int32)
        ids = [self.bos_id, *self.encode(text)[:max_length - 2], self.eos_id]
        out = np.full(max_length, self.pad_id, dtype=np.int32)
        out[:len(ids)] = ids
        return out

    def decode(self, ids) -> str:
        """Approximate inverse of encode, for logs and debugging: a leading BOS is dropped and
        decoding stops at the first EOS (padding follows it); trigger words come back by name."""
        if self._decoder is None:
            self._decoder = {i: t for t, i in self.encoder.items()}
        names = {tids[0]: name for name, tids in self._triggers.items()}
        trigger_ids = {i for tids in self._triggers.values() for i in tids}
        buf = bytearray()
        for n, i in enumerate(int(i) for i in ids):
            if i == self.bos_id and n == 0:
                continue
            if i == self.eos_id:
                break
            if i in trigger_ids:
                buf += f" {names[i]} ".encode() if i in names else b""
                continue
            tok = self._decoder.get(i, "")
            buf += bytes(_BYTE_OF.get(c, 0x3F) for c in tok.replace(EOW, " "))
        return re.sub(" +", " ", buf.decode("utf-8", "replace")).strip()

    # -- textual inversion --------------------------------------------------------------------

    def add_tokens(self, name: str, n: int) -> list[int]:
        """Register a textual-inversion trigger word: `name` (a whole word, any case, in the
        cleaned prompt) becomes n new ids vocab_size, vocab_size + 1, ...; returns them. The
        text encoder's embedding table must be extended with the n learned vectors in order."""
        if int(n) < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        start = self.vocab_size
        return self._register(name, list(range(start, start + int(n))))

    def _register(self, name: str, ids: list[int]) -> list[int]:
        key = clean(name)
        if not key or " " in key:
            raise ValueError(f"trigger word must be one non-empty word, got {name!r}")
        if key in self._triggers:
            raise ValueError(f"trigger word {name!r} is already registered")
        self._triggers[key] = ids
        # Longest first so "<style-2>" wins over "<style>"; a word character at either end of
        # the name must not continue into the text around it ("cat" does not match "cats").
        alts = []
        for k in sorted(self._triggers, key=len, reverse=True):
            pre = r"(?<!\w)" if re.match(r"\w", k[0]) else ""
            post = r"(?!\w)" if re.match(r"\w", k[-1]) else ""
            alts.append(pre + re.escape(k) + post)
        self._trigger_re = re.compile("|".join(alts))
        return list(ids)

    @property
    def trigger_words(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self._triggers.items()}

    # -- files ----------------------------------------------------------------------------------

    def write_files(self, folder: str | os.PathLike) -> None:
        """vocab.json + merges.txt in the Hugging Face layout (transformers' CLIPTokenizer reads
        them), plus trigger_words.json when trigger words are registered (from_folder reads it)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vocab.json").write_text(json.dumps(self.encoder, ensure_ascii=False), encoding="utf-8")
        with open(folder / "merges.txt", "w", encoding="utf-8", newline="\n") as f:
            f.write("#version: 0.2\n")
            f.writelines(f"{a} {b}\n" for a, b in self.merges)
        triggers = folder / TRIGGERS_JSON
        if self._triggers:
            triggers.write_text(json.dumps(self._triggers, ensure_ascii=False), encoding="utf-8")
        elif triggers.exists():
            triggers.unlink()

    # -- BPE ------------------------------------------------------------------------------------

    def _seed_cache(self) -> None:
        self._cache.clear()
        for special in (SOT, EOT):
            if special in self.encoder:
                self._cache[special] = (self.encoder[special],)

    def _encode_clean(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for tok in pretokenize(text):
            symbols = tok.encode("utf-8").decode("latin-1").translate(_BYTE_TABLE)
            ids = cache.get(symbols)
            if ids is None:
                if len(cache) >= self.CACHE_LIMIT:
                    self._seed_cache()
                ids = cache[symbols] = self._bpe(symbols)
            out += ids
        return out

    def _bpe(self, symbols: str) -> tuple[int, ...]:
        """Byte-pair merges of one pre-token (already mapped to byte symbols): repeatedly merge
        every occurrence, left to right, of the adjacent pair with the lowest rank."""
        word = [*symbols[:-1], symbols[-1] + EOW]
        ranks = self.ranks
        while len(word) > 1:
            best, best_rank = None, len(ranks)
            for pair in zip(word, word[1:]):
                r = ranks.get(pair)
                if r is not None and r < best_rank:
                    best, best_rank = pair, r
            if best is None:
                break
            a, b = best
            merged, i, n = [], 0, len(word)
            while i < n:
                if i + 1 < n and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        try:
            return tuple(self.encoder[w] for w in word)
        except KeyError as e:
            raise ValueError(f"BPE symbol {e.args[0]!r} is not in the vocabulary") from None


def _folder_pad_id(folder: Path, tok: ClipTokenizer) -> int:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            pad = json.loads(path.read_text(encoding="utf-8")).get("pad_token")
        except (ValueError, AttributeError, RecursionError):
            continue
        if isinstance(pad, dict):
            pad = pad.get("content")
        if isinstance(pad, str) and pad in tok.encoder:
            return tok.encoder[pad]
    return 49407
