"""Textual-inversion embeddings applied at run time, with no engine rebuilt.

Owns: the text encoder's second input, `token_embeddings_extra` [rows, hidden] (see
compiler/graphs/clip_text.py): ids below the vocabulary read the built-in table, id vocab + k
reads row k of this input. The runtime registers each embedding's name (its file stem) as a
trigger word with the tokenizer, which hands out ids vocab, vocab + 1, ..., and feeds the
vectors in the same order plus one trailing zero row (so the input is never empty: engines
are built for 1..256 rows, or, static, for exactly 256: the rows are then padded with zeros up
to the size the session declares, and an engine fixed at fewer rows than the embeddings need
is refused in one line). Embeddings in a bundle live in `embeddings/<name>.safetensors`,
one tensor per text-encoder component (`text_encoder`, `text_encoder_2`), written by the
compiler (compiler/sources/embeddings.py reads the many user formats). numpy only.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import UserError

EXTRA_TOKENS_INPUT = "token_embeddings_extra"
MAX_EXTRA_ROWS = 256              # the engines' profile maximum (compiler/profiles.py EXTRA_TOKENS)
_DTYPES = {"F32": np.float32, "F16": np.float16}


def read_vectors(path: str | Path) -> dict[str, np.ndarray]:
    """A small safetensors file of F32/F16 tensors (what the compiler writes) -> {name: array}."""
    path = Path(path)
    data = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            arr = np.frombuffer(data[8 + n + start:8 + n + end], dtype=_DTYPES[info["dtype"]])
            out[key] = arr.reshape(info["shape"]).astype(np.float32)
        return out
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a readable embedding file ({type(e).__name__}: {e})") from None


@dataclass
class Embeddings:
    """Registered embeddings, in id order: name -> {text-encoder component: [n, hidden]}."""
    vocab: int | None = None                               # the text encoder's table rows
    items: list[tuple[str, dict[str, np.ndarray]]] = field(default_factory=list)

    def add(self, tokenizer, name: str, vectors: dict[str, np.ndarray]) -> list[int]:
        """Register `name` with the tokenizer and keep its vectors; returns its ids."""
        counts = {v.shape[0] for v in vectors.values()}
        if len(counts) != 1:
            raise UserError(f"embedding {name}: its encoders disagree on the vector count ({sorted(counts)})")
        n = counts.pop()
        if n < 1:
            raise UserError(f"embedding {name}: has no vectors; rebuild the bundle without it")
        if self.rows + n + 1 > MAX_EXTRA_ROWS:
            raise UserError(f"embedding {name}: {self.rows + n} vectors in all exceed the engines' limit "
                            f"of {MAX_EXTRA_ROWS - 1}; use fewer embeddings")
        if self.vocab is not None and tokenizer.vocab_size != self.vocab + self.rows:
            raise UserError(f"embedding {name}: the tokenizer has {tokenizer.vocab_size} ids but the text encoder "
                            f"reads {self.vocab} + {self.rows}; the bundle's tokenizer does not fit its text encoder")
        ids = tokenizer.add_tokens(name, n)
        self.items.append((name, {k: np.asarray(v, np.float32) for k, v in vectors.items()}))
        return ids

    @property
    def rows(self) -> int:
        return sum(next(iter(v.values())).shape[0] for _, v in self.items)

    def extra(self, component: str, hidden: int, dtype=np.float32, rows: int | None = None) -> np.ndarray:
        """[rows + 1, hidden]: every embedding's vectors for this encoder in id order, then a zero row
        (`rows`: zero rows up to that many, for an engine with a fixed row count).
        An embedding without vectors for this encoder contributes zeros (its ids still exist)."""
        out = np.zeros((max(self.rows + 1, rows or 0), hidden), dtype=np.float32)
        row = 0
        for name, vecs in self.items:
            n = next(iter(vecs.values())).shape[0]
            v = vecs.get(component)
            if v is not None:
                if v.shape[1] != hidden:
                    raise UserError(f"embedding {name}: {component} vectors are {v.shape[1]} wide, "
                                    f"the encoder is {hidden}")
                out[row:row + n] = v
            row += n
        return out.astype(dtype)

    def feeds(self, component: str, ids: np.ndarray, hidden: int, dtype=np.float32,
              rows: int | None = None) -> dict[str, np.ndarray]:
        """The text encoder's feeds for these ids (`rows`: the engine's fixed row count, if any)."""
        return {"input_ids": np.ascontiguousarray(ids, dtype=np.int32),
                EXTRA_TOKENS_INPUT: self.extra(component, hidden, dtype, rows)}


def text_encoder_feeds(ids: np.ndarray, hidden: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Feeds for a text encoder with no embeddings: the ids and the one zero row."""
    return Embeddings().feeds("", ids, hidden, dtype)


def encoder_feeds(session, component: str, ids: np.ndarray, embeddings: "Embeddings | None", hidden: int,
                  dtype=np.float32) -> dict[str, np.ndarray]:
    """Feeds for a loaded text-encoder session; engines exported before the extra input get ids only.
    A static engine (its session declares a fixed row count) gets the rows padded with zeros to it."""
    if EXTRA_TOKENS_INPUT not in getattr(session, "input_names", [EXTRA_TOKENS_INPUT]):
        if embeddings is not None and embeddings.items:
            raise UserError(f"{component}: this engine has no {EXTRA_TOKENS_INPUT} input, so it cannot apply "
                            "textual-inversion embeddings; rebuild the bundle with this precast version")
        return {"input_ids": np.ascontiguousarray(ids, dtype=np.int32)}
    emb = embeddings or Embeddings()
    rows = fixed_extra_rows(session)
    if rows is not None and emb.rows + 1 > rows:
        raise UserError(f"{component}: the embeddings bring {emb.rows} vectors but this engine was built for at most "
                        f"{rows - 1} ({EXTRA_TOKENS_INPUT} fixed at {rows} rows); use fewer embeddings, or rebuild "
                        f"the bundle with this precast version (static text encoders take {MAX_EXTRA_ROWS - 1})")
    return emb.feeds(component, ids, hidden, dtype, rows)


def fixed_extra_rows(session) -> int | None:
    """The row count a session's `token_embeddings_extra` input is fixed at (a static engine), else None."""
    shape = (getattr(session, "input_shapes", None) or {}).get(EXTRA_TOKENS_INPUT)
    return shape[0] if shape and isinstance(shape[0], int) and shape[0] > 0 else None


def read_bundle_embeddings(manifest) -> list[tuple[str, dict[str, np.ndarray]]]:
    """The embeddings a bundle's manifest lists (model.embeddings), in order, each file checked
    against its record (size, sha256) before it is read: [(name, {component: vectors})]."""
    out = []
    for item in manifest.model.get("embeddings") or []:
        manifest.check_file(item["file"])
        out.append((item["name"], read_vectors(manifest.root / item["file"])))
    return out


def register_embeddings(items: list[tuple[str, dict[str, np.ndarray]]], tokenizer, vocab: int | None) -> Embeddings:
    """Embeddings read by read_bundle_embeddings, registered with `tokenizer` (one text encoder's)."""
    emb = Embeddings(vocab=vocab)
    for name, vectors in items:
        emb.add(tokenizer, name, vectors)
    return emb


def load_bundle_embeddings(manifest, tokenizer, vocab: int | None) -> Embeddings:
    """The embeddings a bundle's manifest lists, checked, read and registered with `tokenizer`."""
    return register_embeddings(read_bundle_embeddings(manifest), tokenizer, vocab)
