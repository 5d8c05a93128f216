"""Typed fields of diffusers config.json files (unet/, vae/, text_encoder/, scheduler/).

Owns: reading one field with its expected kind, so a wrong type or value is one error naming
the file and the field (never a traceback, never a NaN model). Absent or null fields give the
default.
"""
from __future__ import annotations

import math

from ..errors import BadInput

KINDS = {
    "bool": "true or false",
    "count": "a whole number of at least 1",
    "index": "a whole number of at least 0",
    "positive": "a finite number above 0",
    "finite": "a finite number",
    "counts": "a whole number of at least 1, or a list of them",
}


def _ok(kind: str, v) -> bool:
    is_int = isinstance(v, int) and not isinstance(v, bool)
    is_num = (is_int or isinstance(v, float)) and math.isfinite(v)
    return {"bool": isinstance(v, bool), "count": is_int and v >= 1, "index": is_int and v >= 0,
            "positive": is_num and v > 0, "finite": is_num,
            "counts": (is_int and v >= 1) or (isinstance(v, list) and bool(v) and all(_ok("count", x) for x in v)),
            }[kind]


def field(config: dict, name: str, kind: str, default, where: str, choices: tuple | None = None):
    """config[name] checked as `kind` (see KINDS) and, with `choices`, one of them; else `default`."""
    value = config.get(name) if isinstance(config, dict) else None
    if value is None:
        return default
    if choices is not None:
        if value not in choices:
            raise BadInput(f"{where}: {name} = {_shown(value)}; expected one of {', '.join(map(repr, choices))}")
        return value
    if not _ok(kind, value):
        raise BadInput(f"{where}: {name} = {_shown(value)}; expected {KINDS[kind]}")
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
