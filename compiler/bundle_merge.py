"""`precast bundle merge`: shard bundles of one recipe joined into one bundle.

Owns: the checks that the shards are of one model and agree (`merge_records`: a component, file or artifact
present in two shards is the same in both), the merged folder (`merge_bundles`: every shard verifies; the
shards' files linked, or copied, once, onnx/'s pipeline files written again for the components the merged
bundle has, through the same staging and commit as a build: compiler/bundle_writer.py) and the merge of
shards pushed to one registry done there (`merge_in_registry`: manifests read, blobs mounted, nothing
downloaded).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from ..runtime.manifest import MANIFEST, SCHEMA, read_manifest, verify_bundle
from ..runtime.staging import Staging
from .bundle_archive import check_out
from .bundle_records import changed_since, record_written, snapshot
from .bundle_writer import check_replaceable, commit_bundle, write_manifest
from .cache import staging_registry
from .errors import BadInput
from .interop import pipeline_files


def json_bytes(data: dict) -> bytes:
    """A JSON file's bytes as precast writes them (interop.write_json, bundle_writer.write_manifest)."""
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def merge_records(shards: list[tuple[str, dict]]) -> tuple[dict, dict[str, bytes], dict[str, int]]:
    """Shards' manifest.json data (each with the name errors give it) joined: (the merged manifest's data,
    onnx/'s pipeline files written anew as bytes -- their records are in the data --, which shard each other
    file comes from). BadInput where the shards are of different models or disagree about a component, a
    file or an artifact."""
    (first_name, first), merged = shards[0], None
    for name, data in shards[1:]:
        if data["model"] != first["model"]:
            raise BadInput(f"{name}: built from another model or LoRA set than {first_name}; "
                           "merge shards of one recipe only")
    merged = {"schema": SCHEMA, "precast": first["precast"], "name": first["name"], "model": first["model"],
              "components": {}, "artifacts": [], "files": {}}
    for name, data in shards:
        for comp_name, comp in data["components"].items():
            if merged["components"].setdefault(comp_name, comp) != comp:
                raise BadInput(f"{name}: component {comp_name} differs from another shard's; rebuild the shards "
                               "from one recipe with one precast version")
    # onnx/'s pipeline files (model_index.json, configs) list the components a shard has: written again
    derived = {f"onnx/{rel}": json_bytes(data) for rel, data in pipeline_files(
        first["model"], {c: v.get("config") or {} for c, v in merged["components"].items()}).items()}
    for rel, body in derived.items():
        merged["files"][rel] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    source, seen = {}, {}
    for i, (name, data) in enumerate(shards):
        for rel, rec in data["files"].items():
            if rel in derived:
                continue
            if rel in merged["files"]:
                if merged["files"][rel] != rec:
                    raise BadInput(f"{name}: {rel} differs from the same file in another shard")
                continue
            merged["files"][rel], source[rel] = rec, i
        for a in data["artifacts"]:
            if a["id"] in seen and seen[a["id"]] != a:
                raise BadInput(f"{name}: artifact {a['id']} differs from another shard's")
            if a["id"] not in seen:
                seen[a["id"]] = a
                merged["artifacts"].append(a)
    merged["artifacts"] = sorted(merged["artifacts"], key=lambda a: a["id"])
    merged["files"] = dict(sorted(merged["files"].items()))
    return merged, derived, source


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
    merged, derived, source = merge_records([(str(m.root), m.data) for m in manifests])
    with Staging(out, "merging", staging_registry()) as stage:
        staging = stage.path
        unproven = set()            # shard files copied, or changed since hashed: not recorded as verified
        for rel, body in derived.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(body)
        for rel, i in source.items():
            root = manifests[i].root
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            if changed_since(root / rel, hashed_from):
                unproven.add(rel)
            try:
                os.link(root / rel, staging / rel)
            except OSError:
                shutil.copyfile(root / rel, staging / rel)
                unproven.add(rel)
        write_manifest(staging, merged)
        staged = snapshot(staging, merged["files"], skip=unproven)  # verify_bundle hashed each whole above
        commit_bundle(stage)
        record_written(out, merged["files"], staged, whole=True)
    return {"bundle": str(out), "artifacts": len(merged["artifacts"]), "files": len(merged["files"])}


def merge_in_registry(refs: list, out, registry) -> dict:
    """Shards pushed to one registry (refs: runtime/oci/ref.py's Ref, as `out`) merged there: only their OCI
    manifests and manifest.json files are read; each file's blob is mounted from its shard's repository into
    out's (the distribution API's cross-repository mount: no byte sent; where the registry will not, it is
    copied through here), the merged manifest.json and onnx/'s pipeline files are uploaded, then the manifest
    under out's tag. The merged manifest.json is the one `merge_bundles` writes for the same shards."""
    import tempfile
    from ..runtime.manifest import Manifest
    from ..runtime.oci.artifact import EMPTY, EMPTY_DIGEST, TITLE, manifest_body, oci_manifest
    from ..runtime.oci.pull import read_remote
    remotes = [read_remote(ref, registry) for ref in refs]
    merged, derived, source = merge_records([(str(r.ref), r.data) for r in remotes])
    blobs: dict[str, tuple[int, str]] = {}               # digest -> (shard, path): each blob mounted once
    for rel, i in source.items():
        layer = remotes[i].layers.get(rel)
        if layer is None or layer.digest != "sha256:" + merged["files"][rel]["sha256"]:
            raise BadInput(f"{refs[i]}: its OCI manifest and its manifest.json disagree about {rel}; push that "
                           "shard again")
        blobs.setdefault(layer.digest, (i, rel))
    body = json_bytes(merged)
    manifest = oci_manifest(Manifest(Path(str(out)), merged), body)
    sizes = {layer["digest"]: layer["size"] for layer in manifest["layers"]}
    inline = {layer["digest"]: (derived[rel] if rel in derived else body) for layer in manifest["layers"]
              if (rel := layer["annotations"][TITLE]) in derived or rel == MANIFEST}
    copied = []

    def one(item):
        digest, (i, rel) = item
        if registry.mount_blob(out.repository, digest, refs[i].repository, rel):
            return 0
        with tempfile.TemporaryDirectory(prefix="precast-merge-") as tmp:      # the registry would not mount it
            registry.fetch_blob(refs[i].repository, digest, sizes[digest], Path(tmp) / "blob", rel)
            registry.push_blob(out.repository, digest, sizes[digest], Path(tmp) / "blob", rel)
        copied.append(rel)
        return sizes[digest]
    moved = sum(registry.parallel(one, sorted(blobs.items()), 4))
    sent = 0
    for digest, data in [*inline.items(), (EMPTY_DIGEST, EMPTY)]:
        if registry.push_blob(out.repository, digest, len(data), data, "the merged bundle's " +
                              ("config" if data is EMPTY else "files")) != "exists":
            sent += len(data)
    digest = registry.put_manifest(out, manifest_body(manifest))
    return {"bundle": str(out), "artifacts": len(merged["artifacts"]), "files": len(merged["files"]),
            "digest": digest, "in_registry": True, "mounted": len(blobs) - len(copied), "copied": len(copied),
            "bytes_uploaded": sent + moved, "bytes_downloaded": moved}
