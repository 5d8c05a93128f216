"""The manifest's schema as the runtime reads it, checked when a manifest is read.

Owns: `check_manifest` (the type of every field the runtime uses -- schema version, model, components
with IO and shape profiles, artifacts with fingerprint spec, files with size, sha256 and piece digests --
so a damaged manifest is one ManifestError naming the field; an artifact's `sha256` and `size` must agree
with its files' records; a pulled bundle's `pulled` record -- the ref and digest it came from, the files
`precast pull` left out with their records (which a component's file list may name without the bundle
holding them), the artifacts it left out, whether the store laid it out), `path_problem` (a bundle-relative path that is safe to
join), and the limits (SCHEMA, PREDICTIONS, MAX_PROFILE_SIDE). Standard library only.
"""
from __future__ import annotations

import math

from .digests import PIECE
from .errors import UserError
from .fingerprint import Fingerprint
from .flow import schedule_problem

SCHEMA = 1
PREDICTIONS = ("epsilon", "v_prediction", "flow")
MAX_PROFILE_SIDE = 16384      # px: a profile past this is a damaged manifest, not a model
_HEX = frozenset("0123456789abcdef")


class ManifestError(UserError, ValueError):
    """The bundle's manifest is missing, unreadable, from an unknown schema or malformed (a user
    error: the CLI reports it as one line, exit 2)."""


def check_manifest(data, where: str) -> dict:
    """`data` when it has the structure the runtime reads; else ManifestError naming the field."""
    if not isinstance(data, dict) or type(data.get("schema")) is not int or data.get("schema") != SCHEMA:
        raise ManifestError(f"{where}: schema {data.get('schema') if isinstance(data, dict) else '?'} "
                            f"is not {SCHEMA}; this precast reads schema {SCHEMA}")
    for key in ("model", "components", "artifacts", "files"):
        if key not in data:
            raise ManifestError(f"{where}: missing field {key!r}")
    check = _Checker(where)
    files = check.of(data, "files", dict)
    for rel, rec in files.items():
        check.path(rel, "files")
        check_record(check, rec, f"files[{rel!r}]")
    model = check.of(data, "model", dict)
    for key in ("family", "variant", "source", "source_sha256"):
        check.of(model, key, str, "model")
    if check.of(model, "prediction", (str, type(None)), "model", optional=True) not in (None, *PREDICTIONS):
        check.fail("model.prediction", f"is {_shown(model['prediction'])}, expected one of {', '.join(PREDICTIONS)}")
    scale = check.of(model, "latent_scale", (int, float, type(None)), "model", optional=True)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        check.fail("model.latent_scale", f"is {_shown(scale)}, expected a finite number above 0")
    shift = check.of(model, "latent_shift", (int, float), "model", optional=True)
    if shift is not None and not math.isfinite(shift):
        check.fail("model.latent_shift", f"is {_shown(shift)}, expected a finite number")
    for key, low, high in (("t5_tokens", 1, 4096), ("steps", 1, 1000)):
        value = check.of(model, key, int, "model", optional=True)
        if value is not None and not low <= value <= high:
            check.fail(f"model.{key}", f"is {value}, expected {low} to {high}")
    guidance = check.of(model, "guidance", (int, float), "model", optional=True)
    if guidance is not None and not math.isfinite(guidance):
        check.fail("model.guidance", f"is {_shown(guidance)}, expected a finite number")
    problem = schedule_problem(check.of(model, "scheduler", dict, "model", optional=True) or {})
    if problem:
        check.fail("model.scheduler", f"is unusable ({problem})")
    names = set()
    for i, emb in enumerate(check.of(model, "embeddings", (list, type(None)), "model", optional=True) or []):
        field = f"model.embeddings[{i}]"
        name = check.of(emb, "name", str, field)
        if not name or any(c.isspace() for c in name) or name in names:
            check.fail(f"{field}.name", f"is {_shown(name)}: a trigger word must be one word, used once")
        names.add(name)
        check.listed(check.of(emb, "file", str, field), files, f"{field}.file")
    left_out = _check_pulled(check, data, files)
    components = check.of(data, "components", dict)
    if not components:
        check.fail("components", "is empty")
    for name, comp in components.items():
        _check_component(check, comp, f"components.{name}", {**left_out, **files})
    for i, art in enumerate(check.of(data, "artifacts", list)):
        _check_artifact(check, art, f"artifacts[{i}]", files)
    return data


def path_problem(rel) -> str | None:
    """Why `rel` cannot name a file inside a bundle, or None. Bundle paths are relative and
    '/'-separated, with no empty, '.' or '..' component and no backslash, so they never leave it."""
    if not isinstance(rel, str) or not rel:
        return f"is {_shown(rel)}, not a path"
    if rel.startswith("/"):
        return f"{rel!r} is an absolute path"
    if "\\" in rel or "\0" in rel:
        return f"{rel!r} holds a backslash or NUL"
    parts = rel.split("/")
    if ".." in parts:
        return f"{rel!r} has a '..' component"
    if "" in parts or "." in parts:
        return f"{rel!r} has an empty or '.' component"
    return None


def check_record(check: "_Checker", rec, field: str) -> None:
    """A file record: {size, sha256[, pieces]}."""
    size = check.of(rec, "size", int, field)
    if size < 0:
        check.fail(f"{field}.size", f"is {size}, expected a size in bytes")
    for digest in [check.of(rec, "sha256", str, field), *(check.of(rec, "pieces", list, field, optional=True) or [])]:
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
            check.fail(f"{field}.sha256", f"holds {_shown(digest)}, not a sha256 hex digest")
    pieces = rec.get("pieces")
    if pieces is not None and len(pieces) != -(-size // PIECE):
        check.fail(f"{field}.pieces", f"has {len(pieces)} digests; a {size}-byte file has {-(-size // PIECE)}")


def _check_pulled(check: "_Checker", data: dict, files: dict) -> dict:
    """A pulled bundle's record (runtime/oci/pull.py): {ref, digest, left_out: {path: file record},
    artifacts_left_out: [id], in_store: true (optional)}; the files left out, which only a component's file
    list may name."""
    pulled = check.of(data, "pulled", dict, optional=True)
    if pulled is None:
        return {}
    check.of(pulled, "ref", str, "pulled")
    check.of(pulled, "digest", str, "pulled")
    left_out = check.of(pulled, "left_out", dict, "pulled")
    for rel, rec in left_out.items():
        check.path(rel, "pulled.left_out")
        if rel in files:
            check.fail(f"pulled.left_out[{rel!r}]", "is also listed in files")
        check_record(check, rec, f"pulled.left_out[{rel!r}]")
    if not all(isinstance(a, str) for a in check.of(pulled, "artifacts_left_out", list, "pulled")):
        check.fail("pulled.artifacts_left_out", "holds a non-string; expected artifact ids")
    check.of(pulled, "in_store", bool, "pulled", optional=True)
    return left_out


def _check_component(check: "_Checker", comp, field: str, files: dict) -> None:
    check.of(comp, "dtype", str, field)
    listed = check.of(comp, "files", list, field)
    for i, rel in enumerate(listed):
        check.listed(rel, files, f"{field}.files[{i}]")
    onnx = check.of(comp, "onnx", str, field)
    if onnx not in listed:
        check.fail(f"{field}.onnx", f"{onnx!r} is not one of the component's files")
    for io in ("inputs", "outputs"):
        for i, item in enumerate(check.of(comp, io, list, field)):
            check.of(item, "name", str, f"{field}.{io}[{i}]")
            check.of(item, "shape", list, f"{field}.{io}[{i}]", optional=True)
    config = check.of(comp, "config", dict, field, optional=True) or {}
    for key in ("vocab", "hidden"):
        value = check.of(config, key, int, f"{field}.config", optional=True)
        if value is not None and value < 1:
            check.fail(f"{field}.config.{key}", f"is {value}, expected 1 or more")
    levels = check.of(config, "decoder_levels", int, f"{field}.config", optional=True)
    if levels is not None and not 1 <= levels <= 8:      # the latent factor is 2 ** (levels - 1)
        check.fail(f"{field}.config.decoder_levels", f"is {levels}, expected 1 to 8")
    profiles = check.of(comp, "profiles", list, field)
    if not profiles:
        check.fail(f"{field}.profiles", "is empty")
    for i, prof in enumerate(profiles):
        for dim in ("width", "height"):
            check.triple(check.of(prof, dim, list, f"{field}.profiles[{i}]"), f"{field}.profiles[{i}].{dim}", int,
                         MAX_PROFILE_SIDE)
        t5 = check.of(prof, "t5_tokens", (list, type(None)), f"{field}.profiles[{i}]", optional=True)
        if t5 is not None:
            check.triple(t5, f"{field}.profiles[{i}].t5_tokens", int, 4096)


def _check_artifact(check: "_Checker", art, field: str, files: dict) -> None:
    for key in ("id", "component", "backend"):
        check.of(art, key, str, field)
    try:
        Fingerprint.from_string(check.of(art, "fingerprint", str, field))
    except ValueError as e:
        check.fail(f"{field}.fingerprint", f"is invalid ({e})")
    listed = check.of(art, "files", list, field)
    for i, rel in enumerate(listed):
        check.listed(rel, files, f"{field}.files[{i}]")
    entry = check.of(art, "entry", str, field)
    if entry not in listed:
        check.fail(f"{field}.entry", f"{entry!r} is not one of the artifact's files")
    who = f"(artifact {art['id']!r})"
    sha = check.of(art, "sha256", str, field, optional=True)
    if sha is not None and sha != files[entry]["sha256"]:
        check.fail(f"{field}.sha256", f"{who} is {sha[:16]}..., but its entry's record files[{entry!r}].sha256 "
                                      f"is {files[entry]['sha256'][:16]}...")
    size, total = check.of(art, "size", int, field, optional=True), sum(files[rel]["size"] for rel in set(listed))
    if size is not None and size != total:
        check.fail(f"{field}.size", f"{who} is {size}, but the records of its files in files add up to {total}")
    for name, prof in (check.of(art, "shapes", dict, field, optional=True) or {}).items():
        check.triple(prof, f"{field}.shapes.{name}", list)
        for shape in prof:
            if not all(type(n) is int for n in shape):
                check.fail(f"{field}.shapes.{name}", f"holds {_shown(shape)}, not a shape of integers")
    check.of(art, "metadata", dict, field, optional=True)


def _shown(value) -> str:
    if isinstance(value, (dict, list)):
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Checker:
    """Type checks that raise one ManifestError naming the manifest file and the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str):
        raise ManifestError(f"{self.where}: field {field} {problem}; the manifest is damaged or was edited "
                            "by hand: rebuild or re-download the bundle")

    def of(self, obj, key: str, kind, parent: str = "", optional: bool = False):
        """obj[key], which must be a `kind` (absent allowed when optional; null only where kind has NoneType)."""
        field = f"{parent}.{key}" if parent else key
        if not isinstance(obj, dict):
            self.fail(parent or "(top level)", f"is {_shown(obj)}, expected an object")
        value = obj.get(key)
        if key not in obj and optional:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if key not in obj or not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = "a number" if float in kinds else {dict: "an object", list: "a list", str: "a string",
                                                       int: "an integer"}[kinds[0]]
            self.fail(field, f"is missing, expected {names}" if key not in obj else
                      f"is {_shown(value)}, expected {names}")
        return value

    def triple(self, value, field: str, kind, limit: int | None = None) -> None:
        if not isinstance(value, list) or len(value) != 3 or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in value):
            self.fail(field, f"is {_shown(value)}, expected [min, opt, max]")
        if limit is not None and not 1 <= value[0] <= value[1] <= value[2] <= limit:
            self.fail(field, f"is {_shown(value)}, expected 1 <= min <= opt <= max <= {limit}")

    def path(self, rel, field: str) -> None:
        why = path_problem(rel)
        if why:
            raise ManifestError(f"{self.where}: field {field}: {why}: a bundle's files are named relative to its "
                                "folder, '/'-separated, without '..'; refusing this bundle (rebuild or re-download it)")

    def listed(self, rel, files: dict, field: str) -> None:
        self.path(rel, field)
        if rel not in files:
            self.fail(field, f"names {rel!r}, which the manifest's files do not list")
