"""A recipe's YAML read as plain data that remembers the line of every value, and the readers of its fields.

Owns: reading the file safely (at most MAX_RECIPE_BYTES, UTF-8, no aliases, no tags, no repeated or
non-scalar keys) into `Doc` (data + {field path: line}), and the field readers (check_keys, string,
listed, number, flag) whose errors name file:line and the field. What the fields mean is
compiler/recipe.py's.
"""
from __future__ import annotations

import math
from pathlib import Path

import yaml

from .errors import BadInput

MAX_RECIPE_BYTES = 1 << 20


class _Loader(yaml.SafeLoader):
    """Safe YAML without aliases: `*name` could repeat a subtree exponentially or refer to itself."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not accepted in recipes; "
                                              "write the value out", self.peek_event().start_mark)
        return super().compose_node(parent, index)


class Doc:
    """A YAML document as plain data, remembering the line of every value by its field path."""

    def __init__(self, path: Path):
        self.path = path
        if path.exists() and not path.is_file():
            raise BadInput(f"{path}: not a file; give the path of a recipe .yaml file")
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_RECIPE_BYTES + 1)
        except OSError as e:
            raise BadInput(f"{path}: cannot read recipe ({e.strerror})") from None
        if len(raw) > MAX_RECIPE_BYTES:
            raise BadInput(f"{path}: more than {MAX_RECIPE_BYTES} bytes; a recipe is at most that")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise BadInput(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the recipe as UTF-8") from None
        self.lines: dict[str, int] = {}
        try:
            node = yaml.compose(text, Loader=_Loader)
            self.data = self._plain(node, "") if node is not None else {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise BadInput(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        except RecursionError:
            raise BadInput(f"{path}: nested too deeply to be a recipe") from None

    def _plain(self, node, where: str):
        self.lines[where] = node.start_mark.line + 1
        if not isinstance(node, yaml.ScalarNode) and node.tag not in ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"):
            raise self.error(where, f"YAML tag {node.tag} is not accepted; write a plain value")
        if isinstance(node, yaml.MappingNode):
            out = {}
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode):
                    self.lines[where] = k.start_mark.line + 1
                    raise self.error(where, "has a key that is a list or a map; keys are plain words")
                key = str(k.value)
                sub = f"{where}.{key}" if where else key
                if key in out:
                    first, self.lines[sub] = self.lines[sub], k.start_mark.line + 1
                    raise self.error(sub, f"given twice (lines {first} and {self.lines[sub]}); keep one")
                self.lines[sub] = k.start_mark.line + 1
                out[key] = self._plain(v, sub)
                self.lines[sub] = k.start_mark.line + 1
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self._plain(v, f"{where}[{i}]") for i, v in enumerate(node.value)]
        try:
            return yaml.SafeLoader("").construct_object(node)
        except yaml.YAMLError:
            raise self.error(where, f"YAML tag {node.tag} is not accepted; write a plain value") from None

    def error(self, where: str, message: str) -> BadInput:
        line = self.lines.get(where) or self.lines.get(where.rsplit(".", 1)[0]) or 1
        return BadInput(f"{self.path}:{line}: {where or 'recipe'}: {message}")


def check_keys(doc: Doc, where: str, value, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise doc.error(where, f"expected a mapping with {', '.join(sorted(allowed))}")
    for k in value:
        if k not in allowed:
            sub = f"{where}.{k}" if where else k
            raise doc.error(sub, f"unknown field {k!r}; allowed: {', '.join(sorted(allowed))}")
    return value


def string(doc: Doc, where: str, value, what: str = "a string") -> str:
    if not isinstance(value, str) or not value:
        raise doc.error(where, f"expected {what}, got {value!r}")
    return value


def listed(doc: Doc, where: str, value, what: str) -> list:
    """A YAML list (absent: empty). A string is refused, never iterated character by character."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise doc.error(where, f"expected a list of {what}, got {value!r}")
    return value


def number(doc: Doc, where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise doc.error(where, f"expected a finite number, got {value!r}")
    return float(value)


def flag(doc: Doc, where: str, value) -> bool:
    if not isinstance(value, bool):
        raise doc.error(where, f"expected true or false, got {value!r}")
    return value
