"""`precast bundle merge`: shard bundles of one recipe joined into one bundle.

Owns: the checks that the shards are of one model and agree (every shard verifies; a component, file or
artifact present in two shards is the same in both) and the merged folder: the shards' files linked (or
copied) once, onnx/'s pipeline files written again for the components the merged bundle has, through the
same staging and commit as a build (compiler/bundle_writer.py).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from ..runtime.manifest import SCHEMA, file_record, read_manifest, verify_bundle
from ..runtime.staging import Staging
from .bundle_archive import check_out
from .bundle_records import changed_since, record_written, snapshot
from .bundle_writer import check_replaceable, commit_bundle, write_manifest
from .cache import staging_registry
from .errors import BadInput
from .interop import pipeline_files, write_json


def merge_bundles(inputs: list[str | Path], out: str | Path) -> dict:
    """Join shard bundles of one model into one; the same artifact in two shards must agree."""
    out = Path(out)
    check_out(out)
    check_replaceable(out)
    manifests, hashed_from = [], time.time_ns()     # hashed_from: for bundle_records.changed_since
    for b in inputs:
        problems = verify_bundle(b)
        if problems:
            raise BadInput(f"{b}: does not verify ({problems[0]}); rebuild that shard")
        manifests.append(read_manifest(b))
    first = manifests[0].data
    for m in manifests[1:]:
        if m.model != first["model"]:
            raise BadInput(f"{m.root}: built from another model or LoRA set than {manifests[0].root}; "
                           "merge shards of one recipe only")
    with Staging(out, "merging", staging_registry()) as stage:
        staging = stage.path
        merged = {"schema": SCHEMA, "precast": first["precast"], "name": first["name"], "model": first["model"],
                  "components": {}, "artifacts": [], "files": {}}
        seen, unproven = {}, set()  # shard files copied, or changed since hashed: not recorded as verified
        for m in manifests:
            for name, comp in m.components.items():
                if merged["components"].setdefault(name, comp) != comp:
                    raise BadInput(f"{m.root}: component {name} differs from another shard's; rebuild the shards "
                                   "from one recipe with one precast version")
        # onnx/'s pipeline files (model_index.json, configs) list the components a shard has: written again
        derived = {f"onnx/{rel}": data for rel, data in pipeline_files(
            first["model"], {c: v.get("config") or {} for c, v in merged["components"].items()}).items()}
        for rel, data in derived.items():
            merged["files"][rel] = file_record(write_json(staging / rel, data))
        for m in manifests:
            for rel, rec in m.files.items():
                if rel in derived:
                    continue
                if rel in merged["files"]:
                    if merged["files"][rel] != rec:
                        raise BadInput(f"{m.root}: {rel} differs from the same file in another shard")
                    continue
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                if changed_since(m.root / rel, hashed_from):
                    unproven.add(rel)
                try:
                    os.link(m.root / rel, staging / rel)
                except OSError:
                    shutil.copyfile(m.root / rel, staging / rel)
                    unproven.add(rel)
                merged["files"][rel] = rec
            for a in m.data["artifacts"]:
                if a["id"] in seen and seen[a["id"]] != a:
                    raise BadInput(f"{m.root}: artifact {a['id']} differs from another shard's")
                if a["id"] not in seen:
                    seen[a["id"]] = a
                    merged["artifacts"].append(a)
        write_manifest(staging, merged)
        staged = snapshot(staging, merged["files"], skip=unproven)  # verify_bundle hashed each whole above
        commit_bundle(stage)
        record_written(out, merged["files"], staged, whole=True)
    return {"bundle": str(out), "artifacts": len(merged["artifacts"]), "files": len(merged["files"])}
