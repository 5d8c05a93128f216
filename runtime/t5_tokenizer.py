"""T5 v1.1 (T5-XXL) prompt tokenizer for Flux, Chroma and SD3 prompts: numpy + standard library only.

Owns: turning a prompt into the int32 `input_ids` and `attention_mask` [max_length] that a T5
encoder takes, exactly as diffusers' Flux/Chroma/SD3 pipelines get them from
`T5TokenizerFast(prompt, padding="max_length", max_length=N, truncation=True)`: the prompt's ids,
cut to N - 1, then `</s>` (1), then `<pad>` (0); the mask is 1 up to and including `</s>`.
Reads a sentencepiece model file (`spiece.model`): precast's copy in runtime/data/ (see
runtime/data/README.md) or a bundle's / diffusers folder's `tokenizer_2/spiece.model`. The runtime
imports this module only for the families that have a T5 encoder.

What T5TokenizerFast does, and how it is reproduced here. Its tokenizer.json runs, in order:
  1. added tokens: `<pad>`, `</s>`, `<unk>` and `<extra_id_0>`..`<extra_id_99>` are found in the raw
     prompt (leftmost, longest first) and become their ids; the text between them is tokenized
     piece by piece. sentencepiece alone would spell them out as ordinary text, so the prompt is
     split here first (`T5Tokenizer.encode`).
  2. normalizer `Precompiled` (the model's precompiled NFKC character map): reproduced in Python
     (`CharsMap`, runtime/sentencepiece_model.py) rather than run by sentencepiece, because the Hugging Face version differs from
     sentencepiece's: it looks each grapheme cluster shorter than 6 UTF-8 bytes up whole and, when
     the map has any prefix of it, replaces the whole cluster by the *shortest* such prefix's
     mapping (sentencepiece takes the longest match and goes on after it). So "e" + U+0323 +
     U+0302 (a decomposed Vietnamese "ệ") becomes "ẹ" in T5TokenizerFast, "ệ" in sentencepiece,
     and a combining mark after a mapped character (a full-width letter, a no-break space) is
     dropped. Longer clusters are mapped one character at a time (so a conjoining-jamo Hangul
     syllable or a kana + combining voiced mark is not composed, where sentencepiece composes).
     Grapheme clusters are found with the Unicode rules (UAX #29) over Python's `unicodedata`.
  3. `Replace(" {2,}", " ")`, then `Metaspace(▁, add_prefix_space)`: spaces become "▁" and "▁" is
     put in front unless the text starts with one. Unlike sentencepiece's own normalizer, which
     strips whitespace at both ends, a prompt (or a piece of it before an added token) that ends in
     whitespace keeps a final "▁" piece (id 3): "a cat " is [3, 9, 1712, 3, 1], where sentencepiece
     gives [3, 9, 1712, 1]. The same for whitespace-only prompts: " " is [3, 1].
  4. Unigram: the best-scoring segmentation of each "▁"-word under the pieces' scores, an unknown
     character being `<unk>` (2), consecutive ones fused. Done here in Python (`_unigram`), the
     way `tokenizers` does it, not by sentencepiece, for two reasons that change ids where two
     segmentations score the same (runs such as "-------", "!!!!", "...."; 4.5% of a sample of
     prompts with such runs): sentencepiece sums scores in float32, whose rounding breaks those
     ties at random, and `tokenizers` reads the scores from tokenizer.json one unit in the last
     place off for a quarter of the pieces (see `json_score`), which breaks them its own way.
     Every piece takes part, control pieces and `<extra_id_N>` included: normalisation can spell
     one ("＜/s＞" is "</s>", id 1), and `tokenizers` then matches it, as done here.
The model file (a sentencepiece ModelProto) is read and checked here too (`read_pieces`,
`read_model_specs`): neither the sentencepiece library (which tokenizes differently, above) nor the
`tokenizers` library (which runs tokenizer.json exactly but pulls huggingface_hub and hf-xet, ~35 MB,
into a runtime that must stay under 200 MB) is needed at run time.
Which T5TokenizerFast: transformers 5's `T5TokenizerFast.from_pretrained(folder)` does not run the
folder's tokenizer.json as written. It rebuilds the tokenizer from the file's pieces (their scores
read exactly, by Python's json) with its own pipeline: Precompiled, then WhitespaceSplit +
Metaspace, no Replace. There, whitespace at the end of the prompt or before an added token gives
no "▁" ("a cat " is [3, 9, 1712, 1], as in sentencepiece), and tied segmentations break the other
way ("-------" is [3, 14817, 14817, 18, 1] as written, [3, 18, 14817, 14817, 1] rebuilt).
transformers 4.x's `from_pretrained` (what diffusers' Flux/Chroma/SD3 pipelines have run with),
`T5TokenizerFast(tokenizer_file=...)` in 4.x and 5.x, and `tokenizers` itself run the file as
written: the default, `flavour="tokenizers"`. `flavour="transformers5"` matches the rebuilt one
(and transformers 4.x converting a folder that has spiece.model but no tokenizer.json, which
gives the same ids).
Known differences, not reproduced:
  * grapheme clusters: Python's `unicodedata` (Unicode 14 on Python 3.11) against the Rust
    `unicode-segmentation` tables; characters assigned since, and the rules that only join
    characters of 3+ UTF-8 bytes (emoji ZWJ sequences, Indic conjuncts), are not modelled. They can
    only matter for a cluster shorter than 6 bytes that has a prefix in the character map.
  * transformers' slow `T5Tokenizer` (sentencepiece itself: whitespace stripped at both ends, its
    own character-map matching and float32 ties), which BFL's reference Flux code uses.
Lone surrogates (from undecodable command-line bytes) are read as U+FFFD.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from .errors import UserError
from .sentencepiece_model import CharsMap, read_model_specs, read_pieces

DATA = Path(__file__).resolve().parent / "data"
SHIPPED_MODEL = DATA / "t5_spiece.model"
SPIECE = "spiece.model"
# what a bundle's T5 tokenizer folder may hold (only spiece.model is read; the others are for other tools)
FOLDER_FILES = (SPIECE, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2                 # T5's layout; checked on every model read
N_EXTRA_IDS = 100                                # <extra_id_0> .. <extra_id_99>
SPACE = "\u2581"                                 # "▁", sentencepiece's visible space

_SPACE_RUNS = re.compile(" {2,}")
# Unicode White_Space (Rust's char::is_whitespace, which tokenizers' WhitespaceSplit uses)
_WHITESPACE = re.compile("[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
# Whose T5TokenizerFast to match: the tokenizer.json as the `tokenizers` library runs it
# (transformers 4.x from_pretrained, T5TokenizerFast(tokenizer_file=...)), or transformers 5's
# from_pretrained, which rebuilds it (module docstring, "Known differences").
TOKENIZERS, TRANSFORMERS5 = "tokenizers", "transformers5"
FLAVOURS = (TOKENIZERS, TRANSFORMERS5)
_SURROGATES = re.compile("[\ud800-\udfff]")


UNK_PENALTY = 10.0          # an unknown character scores the lowest piece score minus this


class T5Tokenizer:
    """T5 v1.1 tokenizer. `tok(prompt, 512)` gives int32 input_ids and attention_mask [512]."""

    WORD_CACHE = 65536

    def __init__(self, model: bytes, source: str = "spiece.model", flavour: str = TOKENIZERS):
        """`model`: a serialized sentencepiece ModelProto with T5's layout; `source` names it in
        errors. UserError when it is not one. `flavour`: whose T5TokenizerFast to match (FLAVOURS)."""
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {', '.join(FLAVOURS)}, got {flavour!r}")
        self.source = source
        self.flavour = flavour
        self.model = bytes(model)
        try:
            norm, trainer = read_model_specs(self.model)
            self._charsmap = CharsMap(norm["charsmap"])
            read = read_pieces(self.model)
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{source}: not a sentencepiece model ({e}); replace the file "
                            "(a T5 tokenizer_2/spiece.model) or rebuild the bundle") from None
        pieces, scores = [p for p, _, _ in read], [s for _, s, _ in read]
        unknown = [i for i, (_, _, kind) in enumerate(read) if kind == 2]
        problems = []
        if len(set(pieces)) != len(pieces):
            problems.append("some pieces appear twice")
        if pieces[:3] != [PAD, EOS, UNK] or unknown != [UNK_ID]:
            problems.append(f"ids 0-2 are {pieces[:3]}, T5 has {[PAD, EOS, UNK]}")
        if trainer["model_type"] != 1:
            problems.append(f"model type {trainer['model_type']}, T5 is Unigram (1)")
        if trainer["byte_fallback"] or trainer["treat_whitespace_as_suffix"]:
            problems.append("byte fallback / whitespace-as-suffix is on, T5 has neither")
        if not (norm["add_dummy_prefix"] and norm["remove_extra_whitespaces"] and norm["escape_whitespaces"]):
            problems.append("its normalizer does not add a dummy prefix, remove extra whitespace and "
                            "escape spaces as T5's does")
        if not norm["charsmap"]:
            problems.append("it has no precompiled character map (T5's is NFKC)")
        if problems:
            raise UserError(f"{source}: not a T5 sentencepiece model ({'; '.join(problems)}); "
                            "use the T5 v1.1 tokenizer_2/spiece.model")
        self.vocab_size = len(pieces)
        self.pieces = list(zip(pieces, scores))         # (piece, float32 score) in id order
        self.charsmap = norm["charsmap"]
        # Added tokens as T5Tokenizer(Fast) adds them: <extra_id_N> after the pieces, N = 99 first,
        # unless the model already has it as a piece.
        as_read = json_score if flavour == TOKENIZERS else float
        vocab = {p: (i, as_read(s)) for i, (p, s) in enumerate(zip(pieces, scores))}
        added = {PAD: PAD_ID, EOS: EOS_ID, UNK: UNK_ID}
        for n in range(N_EXTRA_IDS):
            name = f"<extra_id_{n}>"
            if name not in vocab:
                vocab[name] = (len(pieces) + N_EXTRA_IDS - 1 - n, 0.0)
            added[name] = vocab[name][0]
        self.added_tokens = added
        self._splitter = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        # The Unigram model sees every piece, control pieces and <extra_id_N> included (as
        # tokenizers' does): normalisation can spell one, e.g. full-width "＜/s＞" is "</s>" (1).
        self._vocab = vocab
        self._unk_score = min(s for _, s in vocab.values()) - UNK_PENALTY
        lengths: dict[str, set[int]] = {}
        for p in vocab:
            lengths.setdefault(p[0], set()).add(len(p))
        self._lengths = {c: tuple(sorted(ls)) for c, ls in lengths.items()}
        self._words: dict[str, tuple[int, ...]] = {}

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def shipped(cls, flavour: str = TOKENIZERS) -> "T5Tokenizer":
        """Google's T5 v1.1 vocabulary (Flux, Chroma, SD3), from runtime/data/t5_spiece.model."""
        return _shipped(flavour)

    @classmethod
    def from_file(cls, path: str | os.PathLike, flavour: str = TOKENIZERS) -> "T5Tokenizer":
        try:
            model = Path(path).read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read the T5 tokenizer model ({e.strerror or e}); "
                            "restore the file or rebuild the bundle") from None
        return cls(model, source=str(path), flavour=flavour)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, flavour: str = TOKENIZERS) -> "T5Tokenizer":
        """folder/spiece.model: a bundle's or a diffusers model's tokenizer_2/ folder."""
        path = Path(folder) / SPIECE
        if not path.is_file():
            raise UserError(f"{path}: missing; a T5 tokenizer folder (tokenizer_2/) needs its sentencepiece "
                            "model: rebuild the bundle, or copy spiece.model from the model's tokenizer_2/")
        return cls.from_file(path, flavour)

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Ids of `prompt`, without the final `</s>`."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        prompt = _SURROGATES.sub("\ufffd", prompt)
        out: list[int] = []
        pos = 0
        for m in self._splitter.finditer(prompt):
            out += self._encode_text(prompt[pos:m.start()])
            out.append(self.added_tokens[m.group()])
            pos = m.end()
        out += self._encode_text(prompt[pos:])
        return out

    def tokens(self, prompt: str) -> int:
        """How many ids `prompt` takes, `</s>` included: more than max_length means truncated."""
        return len(self.encode(prompt)) + 1

    def __call__(self, prompt: str, max_length: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), int32 [max_length] each: the first max_length - 1 ids,
        `</s>`, then `<pad>`; the mask is 1 for the ids and `</s>`, 0 for the padding."""
        return self.padded(self.encode(prompt), max_length)

    @staticmethod
    def padded(ids: list[int], max_length: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) of ids already encoded, as __call__ lays them out."""
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {max_length}")
        ids = list(ids)[:max_length - 1] + [EOS_ID]
        input_ids = np.full(max_length, PAD_ID, dtype=np.int32)
        input_ids[:len(ids)] = ids
        mask = np.zeros(max_length, dtype=np.int32)
        mask[:len(ids)] = 1
        return input_ids, mask

    def _encode_text(self, text: str) -> list[int]:
        """Steps 2-4 of the module docstring for text between added tokens."""
        if not text:
            return []
        text = self._charsmap.normalize(text)
        if self.flavour == TOKENIZERS:
            text = _SPACE_RUNS.sub(" ", text).replace(" ", SPACE)
            if text and not text.startswith(SPACE):
                text = SPACE + text
            words = _WORDS.findall(text)
        else:                   # WhitespaceSplit, then Metaspace: "▁" before each word
            words = [w if w.startswith(SPACE) else SPACE + w for w in _WHITESPACE.split(text) if w]
            words = [part for w in words for part in _WORDS.findall(w.replace(" ", SPACE))]
        out: list[int] = []
        for word in words:
            ids = self._words.get(word)
            if ids is None:
                ids = self._unigram(word)
                if len(self._words) < self.WORD_CACHE:
                    self._words[word] = ids
            out += ids
        return out

    def _unigram(self, word: str) -> tuple[int, ...]:
        """The best-scoring segmentation of one word (tokenizers' Unigram: scores summed in
        float64, ties to the piece that starts first, an unknown character as `<unk>` scored
        lowest piece - 10, consecutive `<unk>` fused into one)."""
        n = len(word)
        score = [0.0] * (n + 1)
        back: list[tuple[int, int] | None] = [None] * (n + 1)     # (start, id) of the best last piece
        vocab, unk_score = self._vocab, self._unk_score
        for start in range(n):
            here = score[start]
            single = False
            for length in self._lengths.get(word[start], ()):
                end = start + length
                if end > n:
                    break
                hit = vocab.get(word[start:end])
                if hit is None:
                    continue
                if length == 1:
                    single = True
                s = here + hit[1]
                if back[end] is None or s > score[end]:
                    score[end], back[end] = s, (start, hit[0])
            if not single:
                s = here + unk_score
                if back[start + 1] is None or s > score[start + 1]:
                    score[start + 1], back[start + 1] = s, (start, UNK_ID)
        ids: list[int] = []
        end = n
        while end > 0:
            start, pid = back[end]
            if not (pid == UNK_ID and ids and ids[-1] == UNK_ID):
                ids.append(pid)
            end = start
        return tuple(reversed(ids))


_DECIMAL = re.compile(r"(-?)(\d+)(?:\.(\d*))?(?:[eE]([+-]?\d+))?")


def json_score(score: float) -> float:
    """`score` as the `tokenizers` library holds it after reading it from a tokenizer.json.

    The file stores each piece's float32 score as the shortest decimal that reads back as the same
    float64 (Python's repr; tokenizers writes the same digits). Its JSON reader (serde_json without
    the float_roundtrip feature) does not read that decimal back exactly: it turns all the digits
    into one integer, rounds that to float64, then divides by the power of ten, rounding again.
    For about a quarter of T5's pieces that is one unit in the last place off, which decides the
    ties between equally scored segmentations (runs of "-", "!", "." ...)."""
    m = _DECIMAL.fullmatch(repr(float(score)))
    if m is None:                   # inf / nan: not in a valid model, keep as is
        return float(score)
    sign, whole, frac, exp = m.groups()
    frac = frac or ""
    digits = int(whole + frac)
    power = int(exp or 0) - len(frac)
    if digits >= 1 << 64 or abs(power) > 308:
        return float(score)
    value = float(digits) * float(f"1e{power}") if power >= 0 else float(digits) / float(f"1e{-power}")
    return -value if sign else value


_WORDS = re.compile(f"{SPACE}[^{SPACE}]*|[^{SPACE}]+")


@lru_cache(maxsize=len(FLAVOURS))
def _shipped(flavour: str) -> T5Tokenizer:
    return T5Tokenizer.from_file(SHIPPED_MODEL, flavour)
