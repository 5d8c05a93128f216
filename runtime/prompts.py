"""Prompts as A1111 (stable-diffusion-webui) reads them: weighting syntax, BREAK, 75-token CLIP chunks, emphasis.

Owns: `parse` (A1111's parse_prompt_attention: `(a)` x1.1, `((a))` x1.21, `(a:1.5)`, `[a]` /1.1, `\\(` `\\)` `\\[`
`\\]` `\\\\` literal, unbalanced brackets closed at the end, adjacent equal weights merged; `BREAK` -- a whole
word in capitals -- splits the prompt into parts), the CLIP chunks a prompt is encoded in (A1111's
tokenize_line: each fragment tokenized by itself, 75 tokens a chunk wrapped BOS .. EOS and padded to 77, a
chunk cut after a comma within the last 20 tokens so the words after it move to the next chunk, a
textual-inversion word's vectors kept in one chunk, a new chunk at each BREAK), the weighted ids of encoders
that read the prompt whole (T5, and the CLIPs of the families that read one chunk), and `emphasize`
(A1111's "Original" emphasis: each token's hidden state multiplied by its weight, then the whole tensor
rescaled so its mean is what it was). One deliberate difference: A1111 turns a BREAK inside brackets into
the word "BREAK" with a negative weight; here a BREAK splits wherever it is.
A tokenizer is any object with `encode(text) -> ids` (runtime/tokenizer.py, runtime/t5_tokenizer.py); CLIP
chunks also read its `bos_id`, `eos_id`, `pad_id`, `encoder` and `trigger_words`. Numpy and the standard
library only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .errors import UserError

CHUNK = 75                  # prompt tokens per CLIP chunk; with BOS and EOS, the 77 positions CLIP has
CLIP_TOKENS = CHUNK + 2
COMMA_BACKTRACK = 20        # A1111's default "prompt word wrap length limit" (opts.comma_padding_backtrack)

_ATTENTION = re.compile(r"\\\(|\\\)|\\\[|\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|]|[^\\()\[\]:]+|:")
_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.DOTALL)


def parse(text: str) -> list[list[tuple[str, float]]]:
    """The prompt's parts (split at BREAK), each a list of (text, weight) with adjacent equal weights merged:
    'a (b:1.5) BREAK c' -> [[('a ', 1.0), ('b', 1.5)], [('c', 1.0)]]. Always at least one part."""
    res: list = []               # [text, weight] entries; None stands for a BREAK
    round_open, square_open = [], []

    def multiply(start: int, by: float) -> None:
        for entry in res[start:]:
            if entry is not None:
                entry[1] *= by

    for m in _ATTENTION.finditer(text):
        token, weight = m.group(0), m.group(1)
        if weight is not None:
            try:
                weight = float(weight)
            except ValueError:           # '(a:1.2.3)': A1111 fails; here it stays text
                weight = None
        if token.startswith("\\"):
            res.append([token[1:], 1.0])
        elif token == "(":
            round_open.append(len(res))
        elif token == "[":
            square_open.append(len(res))
        elif weight is not None and round_open:
            multiply(round_open.pop(), weight)
        elif token == ")" and round_open:
            multiply(round_open.pop(), 1.1)
        elif token == "]" and square_open:
            multiply(square_open.pop(), 1 / 1.1)
        else:
            for i, piece in enumerate(_BREAK.split(token)):
                if i:
                    res.append(None)
                res.append([piece, 1.0])
    for start in round_open:
        multiply(start, 1.1)
    for start in square_open:
        multiply(start, 1 / 1.1)
    parts: list[list[tuple[str, float]]] = [[]]
    for entry in res:
        if entry is None:
            parts.append([])
        elif parts[-1] and parts[-1][-1][1] == entry[1]:
            parts[-1][-1] = (parts[-1][-1][0] + entry[0], entry[1])
        else:
            parts[-1].append((entry[0], entry[1]))
    return [part or [("", 1.0)] for part in parts]


def fragments(text: str) -> list[tuple[str, float]]:
    """(text, weight) of the whole prompt for an encoder that reads it in one piece: BREAK parts joined."""
    return [f for part in parse(text) for f in part]


def weighted_ids(tokenizer, prompt: str) -> tuple[list[int], list[float]]:
    """Every fragment's ids (each fragment tokenized by itself, as A1111 and Forge do) and each id's weight,
    without BOS / EOS. A prompt with no weighting syntax gives tokenizer.encode(prompt)."""
    ids, weights = [], []
    for text, weight in fragments(prompt):
        got = tokenizer.encode(text)
        ids += got
        weights += [weight] * len(got)
    return ids, weights


@dataclass(frozen=True)
class Chunk:
    """One CLIP input: ids int32 [77] (BOS, up to 75 prompt tokens, EOS, padding) and each one's weight."""
    ids: np.ndarray
    weights: np.ndarray

    @property
    def weighted(self) -> bool:
        return bool(np.any(self.weights != 1.0))


def make_chunk(tokenizer, ids: list[int], weights: list[float]) -> Chunk:
    """BOS + ids + EOS, padded with the tokenizer's pad id to 77; weight 1 outside the prompt's tokens."""
    out = np.full(CLIP_TOKENS, tokenizer.pad_id, np.int32)
    out[:len(ids) + 2] = [tokenizer.bos_id, *ids, tokenizer.eos_id]
    w = np.ones(CLIP_TOKENS, np.float32)
    w[1:len(ids) + 1] = weights
    return Chunk(out, w)


def clip_chunks(tokenizer, prompt: str, backtrack: int = COMMA_BACKTRACK) -> list[Chunk]:
    """The chunks A1111 encodes `prompt` in (its tokenize_line with the default settings): at least one."""
    comma = tokenizer.encoder.get(",</w>")
    vectors = {ids[0]: (name, len(ids)) for name, ids in tokenizer.trigger_words.items()}
    chunks: list[Chunk] = []
    ids: list[int] = []
    weights: list[float] = []
    last_comma = -1

    def close() -> None:
        nonlocal ids, weights, last_comma
        chunks.append(make_chunk(tokenizer, ids, weights))
        ids, weights, last_comma = [], [], -1

    for i, part in enumerate(parse(prompt)):
        if i:
            close()                                   # BREAK: the next part starts a chunk
        for text, weight in part:
            tokens = tokenizer.encode(text)
            pos = 0
            while pos < len(tokens):
                token = tokens[pos]
                if token == comma:
                    last_comma = len(ids)
                elif backtrack and len(ids) == CHUNK and last_comma != -1 and len(ids) - last_comma <= backtrack:
                    cut = last_comma + 1              # the words after the comma move to the next chunk
                    rest = ids[cut:], weights[cut:]
                    ids, weights = ids[:cut], weights[:cut]
                    close()
                    ids, weights = list(rest[0]), list(rest[1])
                if len(ids) == CHUNK:
                    close()
                name, n = vectors.get(token, ("", 1))
                if n > CHUNK:
                    raise UserError(f"embedding {name}: {n} vectors do not fit in one prompt chunk of {CHUNK} tokens")
                if len(ids) + n > CHUNK:              # an embedding's vectors stay together
                    close()
                ids += tokens[pos:pos + n]
                weights += [weight] * n
                pos += n
    if ids or not chunks:
        close()
    return chunks


def clip_truncated(tokenizer, prompt: str) -> Chunk:
    """One chunk of the prompt's first 75 weighted tokens (BREAK ignored): for the CLIP encoders of families
    whose denoiser reads a fixed 77 (SD3, Flux's pooled CLIP)."""
    ids, weights = weighted_ids(tokenizer, prompt)
    return make_chunk(tokenizer, ids[:CHUNK], weights[:CHUNK])


def t5_input(tokenizer, prompt: str, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) [length] of the prompt's weighted ids as the T5 tokenizer pads them
    (`padded`: cut to length - 1, `</s>`, `<pad>`), and each position's weight (1 past the prompt's ids)."""
    ids, weights = weighted_ids(tokenizer, prompt)
    input_ids, mask = tokenizer.padded(ids, length)
    w = np.ones(length, np.float32)
    kept = min(len(weights), length - 1)
    w[:kept] = weights[:kept]
    return input_ids, mask, w


def emphasize(states: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """A1111's "Original" emphasis on hidden states [1, tokens, width]: each token's state times its weight,
    then all of it rescaled to the mean it had. Unweighted states come back as they are."""
    weights = np.asarray(weights, np.float32)
    if not np.any(weights != 1.0):
        return states
    mean = states.mean(dtype=np.float64)
    z = states * weights.reshape(1, -1, 1)
    return (z * np.float32(mean / z.mean(dtype=np.float64))).astype(np.float32)
