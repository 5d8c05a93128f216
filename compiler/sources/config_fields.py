"""Typed fields of diffusers config.json files (unet/, vae/, text_encoder/, scheduler/).

Owns: reading one field with its expected kind, so a wrong type or value is one error naming
the file and the field (never a traceback, never a NaN model; absent or null fields give the
default), and refusing the fields whose other values ask for a computation a builder does not write.
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


def refuse_unbuilt(config: dict, where: str, fixed: dict, blocks: dict, listed: tuple = ()) -> None:
    """`fixed`: field -> the values the builder writes (absent = the first); `blocks`: a block-type
    list field -> the types it writes; `listed`: fixed fields that may also be given per block."""
    for name, allowed in fixed.items():
        value = config.get(name, allowed[0])
        values = value if isinstance(value, list) and name in listed else [value]
        if any(v not in allowed for v in values):
            raise BadInput(f"{where}: {name} = {value!r} is not supported yet (precast builds "
                           f"{' / '.join(repr(a) for a in allowed)}); convert the model or leave the field out")
    for name, allowed in blocks.items():
        given = config.get(name) or ()
        odd = [b for b in (given if isinstance(given, list) else [given]) if b not in allowed]
        if odd:
            raise BadInput(f"{where}: {name} has {odd[0]!r}, not supported yet (supported: {', '.join(allowed)})")
