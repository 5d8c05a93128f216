"""Writing a bundle folder: the files of a staging bundle, deduplicated by content, and putting it in place.

Owns: the bundle layout -- `manifest.json`, `onnx/<component>/` (the exported graph and its weights, shared
by ONNX Runtime and by OpenVINO's compile-on-load fallback), `tokenizer*/`, and
`artifacts/<component>/<target>-<key>/` -- and storing weights once: an artifact whose files are
byte-identical to files already in the bundle points at them instead of copying (BundleWriter); each plan
entry's engines placed into it (add_engines, compiled through the cache); writing the manifest; and
committing the staging folder over --out, which may replace an earlier bundle but no other folder.
Orchestrating a build is compiler/bundle.py's; joining shards compiler/bundle_merge.py's.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..runtime.fileops import FileBusy
from ..runtime.manifest import MANIFEST, SCHEMA, file_record
from ..runtime.staging import Staging
from ..runtime.tokenizer import ClipTokenizer
from .bundle_archive import MANIFEST_LIMIT
from .cache import Cache
from .engines import compile_component
from .errors import BadInput
from .plan import _slug
from .sources.llm_tokenizer_files import llm_tokenizer_files, write_llm_tokenizer_folder
from .sources.t5_tokenizer_files import write_t5_tokenizer_folder


class BundleWriter:
    """Files going into a staging bundle folder, deduplicated by content."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, dict] = {}
        self.linked: set[str] = set()    # hard links to cache files (verified when served; bundle_records.py)
        self.copied: set[str] = set()    # copies: bytes never hashed here, so not recorded as verified

    def _folder_with(self, records: dict[str, dict]) -> str | None:
        """A folder already in the bundle holding every one of these files (same names, same bytes)."""
        folders = {rel.rsplit("/", 1)[0] for rel in self.files}
        for folder in sorted(folders):
            if all(self.files.get(f"{folder}/{n}", {}).get("sha256") == r["sha256"] for n, r in records.items()):
                return folder
        return None

    def add(self, src: Path, records: dict[str, dict], dest: str) -> dict[str, str]:
        """Place the files of `src` (name -> {size, sha256}) under `dest`; returns name -> bundle path."""
        existing = self._folder_with(records)
        if existing is not None:
            return {n: f"{existing}/{n}" for n in records}
        (self.root / dest).mkdir(parents=True, exist_ok=True)
        for name, rec in records.items():
            target = self.root / dest / name
            try:
                os.link(src / name, target)      # cache files are never written in place
                self.linked.add(f"{dest}/{name}")
            except OSError:
                shutil.copyfile(src / name, target)
                self.copied.add(f"{dest}/{name}")
            self.files[f"{dest}/{name}"] = dict(rec)     # size, sha256 and piece digests
        return {n: f"{dest}/{n}" for n in records}


def write_manifest(root: Path, manifest: dict) -> None:
    manifest["artifacts"] = sorted(manifest["artifacts"], key=lambda a: a["id"])
    manifest["files"] = dict(sorted(manifest["files"].items()))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _is_bundle(folder: Path) -> bool:
    """A precast bundle's manifest is there (JSON, schema 1, a file table): replacing it is allowed."""
    try:
        path = folder / MANIFEST
        data = json.loads(path.read_bytes()) if path.stat().st_size <= MANIFEST_LIMIT else None
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA and isinstance(data.get("files"), dict)


def check_replaceable(out: Path) -> None:
    """--out may be new, empty, or an earlier bundle; any other folder is the user's and is kept."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not _is_bundle(out))):
        raise BadInput(f"--out {out}: exists and is not a precast bundle (no readable schema-{SCHEMA} "
                       f"{MANIFEST}); its contents would be replaced: choose a new or empty folder")


def _model_of(folder: Path) -> tuple[str, str] | None:
    """(source digest, 'recipe (family, source)') of the bundle in `folder`."""
    try:
        data = json.loads((folder / MANIFEST).read_bytes())
        model = data["model"]
        return str(model.get("source_sha256")), f"{data.get('name')} ({model.get('family')}, {model.get('source')})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _note_replaced(out: Path, staging: Path) -> None:
    """Replacing a bundle of another model is allowed (--out names it) but said, on stderr."""
    before, after = _model_of(out), _model_of(staging)
    if before and after and before[0] != after[0]:
        print(f"note: {out} held a bundle of {before[1]}; replaced by {after[1]}", file=sys.stderr)


def commit_bundle(stage: Staging) -> None:
    """Put the finished staging folder at its --out, replacing an existing bundle there in one step."""
    out = stage.out
    if out.exists():
        check_replaceable(out)
        _note_replaced(out, stage.path)
    try:
        stage.commit()
    except FileBusy:
        raise BadInput(f"--out {out}: a file in it is held open by another process (a running precast generate, "
                       "an editor, an antivirus scan?), so Windows will not move it; close that and build again") from None


def _artifact_metadata(meta: dict) -> dict:
    keep = ("compile_config", "device", "precision", "static", "compute_capabilities", "header", "weight_streaming",
            "refittable", "simplified", "gfx", "input_dims", "fp16", "rewrites",
            "weights",   # weight-only quantization: format and how (compiler/targets/quantize.py)
            "store")     # OpenVINO: "ir" when the artifact is model.xml/.bin rather than a blob
    return {k: meta[k] for k in keep if k in meta}


def add_engines(writer: BundleWriter, manifest: dict, report: list, entries, profiles, exported: dict,
                cache: Cache, progress: bool) -> None:
    """Each plan entry's engine for each profile (compile_component, through the cache), into the bundle."""
    for e in entries:
        for profile in profiles:
            rec, entry = compile_component(exported[e.component], e.target, profile, cache, progress)
            meta = entry.metadata
            placed = writer.add(entry.path, entry.files,
                                f"artifacts/{e.component}/{_slug(e.target)}-{rec['key'][:12]}")
            manifest["artifacts"].append({
                "id": f"{e.id}/{rec['key'][:12]}", "plan_entry": e.id, "component": e.component,
                "backend": e.target.backend, "fingerprint": rec["fingerprint"], "target": e.target.describe(),
                "profile": profile.describe(), "shapes": meta["shapes"], "entry": placed[meta["entry"]],
                "files": sorted(placed.values()), "size": sum(f["size"] for f in entry.files.values()),
                "sha256": entry.files[meta["entry"]]["sha256"], "build_options": e.target.describe(),
                "toolchain": meta["toolchain"], "metadata": _artifact_metadata(meta)})
            report.append({**{k: rec[k] for k in ("component", "backend", "target", "cache", "seconds", "key",
                                                  "fingerprint")}, "entry": e.id,
                           **{k: rec[k] for k in ("evicted", "remote") if rec.get(k)}})


def add_tokenizer(writer: BundleWriter, source: Path, name: str = "tokenizer", pad_zero: bool = False,
                  source_folder: str | None = None) -> None:
    """<name>/{vocab.json, merges.txt[, tokenizer_config.json]}: the diffusers folder's own, else the
    CLIP BPE precast ships. OpenCLIP encoders (SD 2.x, SDXL's bigG) pad with id 0 ('!')."""
    folder = writer.root / name
    folder.mkdir(parents=True, exist_ok=True)
    theirs = source / (source_folder or name) if source.is_dir() else None
    if theirs is not None and (theirs / "vocab.json").is_file() and (theirs / "merges.txt").is_file():
        for f in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
            if (theirs / f).is_file():
                shutil.copyfile(theirs / f, folder / f)
    else:
        ClipTokenizer.shipped().write_files(folder)
        if pad_zero:
            (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": "!"}) + "\n")
    for p in sorted(folder.iterdir()):
        writer.files[f"{name}/{p.name}"] = file_record(p)


def add_llm_tokenizer(writer: BundleWriter, source: Path, name: str, source_folder: str | None = None) -> None:
    """<name>/{tokenizer.json, tokenizer_config.json}: an LLM text encoder's tokenizer (the diffusers folder's
    own, else one beside the checkpoint: compiler/sources/llm_tokenizer_files.py)."""
    write_llm_tokenizer_folder(writer.root / name, llm_tokenizer_files(source, source_folder or name))
    for p in sorted((writer.root / name).iterdir()):
        writer.files[f"{name}/{p.name}"] = file_record(p)


def add_t5_tokenizer(writer: BundleWriter, source: Path, name: str, source_folder: str | None = None) -> None:
    """<name>/: the T5 tokenizer (sentencepiece `spiece.model` + transformers' files): the diffusers
    folder's own, else the one precast ships."""
    mine = source_folder or name
    theirs = source / mine if source.is_dir() and (source / mine).is_dir() else None
    folder = writer.root / name
    write_t5_tokenizer_folder(folder, theirs)
    for p in sorted(folder.iterdir()):
        writer.files[f"{name}/{p.name}"] = file_record(p)
