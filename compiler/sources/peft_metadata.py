"""diffusers' `lora_adapter_metadata` in a LoRA file: PEFT's config (lora_alpha, alpha_pattern,
use_rslora), read and checked, and alpha_pattern keys matched as PEFT matches them.

Owns: refusing metadata that is not a JSON object of the known fields (numbers that fit float32,
patterns that are module paths), and `pattern_matches`, which follows PEFT's rule without a
backtracking regex, so no pattern a file brings can hang the export.
"""
from __future__ import annotations

import functools
import json
import reprlib
from pathlib import Path

import numpy as np

from ..errors import BadInput

FLOAT32_MAX = float(np.finfo(np.float32).max)


# ---- alpha_pattern keys: module-name paths, matched without a backtracking regex ------------------

def parse_pattern(pattern: str) -> tuple[bool, tuple[str, ...]] | None:
    """An alpha_pattern key as PEFT writes them -- a module path or its dotted suffix
    (`to_q`, `down_blocks.0.attentions.0.proj_in`), optionally `^`-anchored, `$`-ended, with `.*`
    wildcards -- as (anchored, literal pieces between wildcards); None for anything else (other
    regex syntax). PEFT matches re.match(rf"(.*\\.)?({key})$", module); see pattern_matches."""
    anchored = pattern.startswith("^")
    body = pattern[anchored:]
    body = body[:-1] if body.endswith("$") else body
    if body.count("*") != body.count(".*"):            # a bare `*` repeats one character: regex, not a path
        return None
    body = body.replace(".*", "*")
    if not body or not all(c.isascii() and (c.isalnum() or c in "_.*") for c in body):
        return None
    return anchored, tuple(body.split("*"))


def _glob_full(pieces: tuple[str, ...], text: str) -> bool:
    """text == pieces[0] + ANY + pieces[1] + ... + ANY + pieces[-1]; leftmost search, no backtracking."""
    if len(pieces) == 1:
        return text == pieces[0]
    first, last = pieces[0], pieces[-1]
    if len(text) < len(first) + len(last) or not text.startswith(first) or not text.endswith(last):
        return False
    pos, end = len(first), len(text) - len(last)
    for piece in pieces[1:-1]:
        i = text.find(piece, pos, end)
        if i < 0:
            return False
        pos = i + len(piece)
    return True


@functools.lru_cache(maxsize=65536)
def pattern_matches(pattern: str, module: str) -> bool:
    """PEFT's rule: the pattern matches the whole module path or a suffix that starts after a `.`
    (only the whole path when `^`-anchored). `.` is taken literally (module names have no other)."""
    parsed = parse_pattern(pattern)
    if parsed is None:
        return False
    anchored, pieces = parsed
    starts = [0] if anchored else [0] + [i + 1 for i, c in enumerate(module) if c == "."]
    return any(_glob_full(pieces, module[i:]) for i in starts)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _short(value) -> str:
    """repr of a metadata value, cut short (long strings, deep nesting)."""
    return _REPR.repr(value)


def _is_number(v) -> bool:
    """A JSON number that fits float32 (|v| <= 3.4e38; NaN, infinity, bool, 1e400 refused)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return abs(float(v)) <= FLOAT32_MAX
    except OverflowError:
        return False


def _check_peft_config(p: Path, cfg: dict) -> None:
    """The fields of diffusers' lora_adapter_metadata that alpha() reads: lora_alpha (a finite
    number), alpha_pattern ({module path: finite number}, see parse_pattern), use_rslora
    (true/false); each may be prefixed by its component (`unet.lora_alpha`)."""
    where = f"--lora {p}: metadata lora_adapter_metadata"
    for key, value in cfg.items():
        name = str(key).rsplit(".", 1)[-1]
        if name == "lora_alpha" and value is not None and not _is_number(value):
            raise BadInput(f"{where}: {key} = {_short(value)}; expected a finite number (|x| <= 3.4e38)")
        if name == "use_rslora" and not isinstance(value, bool):
            raise BadInput(f"{where}: {key} = {_short(value)}; expected true or false")
        if name == "alpha_pattern" and value is not None:
            if not isinstance(value, dict):
                raise BadInput(f"{where}: {key} = {_short(value)}; expected {{module path: alpha}}")
            for pattern, alpha in value.items():
                if parse_pattern(pattern) is None:
                    raise BadInput(f"{where}: {key} pattern {_short(pattern)} is not a module path; use the "
                                   "module's dotted name or suffix (letters, digits, _ and ., `.*` as a "
                                   "wildcard, optional leading ^), such as down_blocks.0.attentions.0.proj_in")
                if not _is_number(alpha):
                    raise BadInput(f"{where}: {key}[{_short(pattern)}] = {_short(alpha)}; "
                                   "expected a finite number (|x| <= 3.4e38)")


def peft_config(p: Path, raw: str | None) -> dict:
    """diffusers' lora_adapter_metadata JSON, checked (BadInput when not a JSON object of known fields)."""
    if not raw:
        return {}
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadInput(f"--lora {p}: metadata lora_adapter_metadata is not JSON ({e})") from None
    except RecursionError:
        raise BadInput(f"--lora {p}: metadata lora_adapter_metadata is nested too deeply to be a LoRA config; "
                       "the LoRA file is damaged (re-save it)") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"--lora {p}: metadata lora_adapter_metadata is not a JSON object")
    _check_peft_config(p, cfg)
    return cfg
