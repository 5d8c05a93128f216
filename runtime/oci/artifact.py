"""A bundle as an OCI artifact: the media types, the annotations, and the OCI manifest both ways.

Owns: `ARTIFACT_TYPE` and the media types (docs/registries.md is the reference), `oci_manifest` (a
bundle's manifest as one OCI image manifest: schemaVersion 2, `artifactType`, the empty config
descriptor of OCI 1.1's guidance for artifacts, one layer per bundle file -- manifest.json first --
annotated with its bundle path and, for engines and ONNX, what a client needs to choose without
downloading them) and `read_oci_manifest` (an OCI manifest checked to be a precast bundle, its layers
by bundle path). Standard library only.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..manifest import MANIFEST, Manifest
from .client import OCI_MANIFEST, RegistryError
from .ref import Ref

ARTIFACT_TYPE = "application/vnd.precast.bundle.v1"
MANIFEST_MEDIA = "application/vnd.precast.bundle.manifest.v1+json"     # the bundle's manifest.json
FILE_MEDIA = "application/vnd.precast.bundle.file.v1"                   # every other bundle file
EMPTY_MEDIA = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
EMPTY_DIGEST = "sha256:" + hashlib.sha256(EMPTY).hexdigest()
TITLE = "org.opencontainers.image.title"
P = "dev.precast."                  # the prefix of precast's own annotations
ROLES = ("manifest", "artifact", "onnx", "shared")


@dataclass(frozen=True)
class Layer:
    path: str               # bundle path (the title annotation)
    digest: str             # sha256:...
    size: int
    media_type: str
    annotations: dict


def descriptor(media_type: str, digest: str, size: int, annotations: dict | None = None) -> dict:
    return {"mediaType": media_type, "digest": digest, "size": size, **({"annotations": annotations}
                                                                        if annotations else {})}


def oci_manifest(m: Manifest, manifest_bytes: bytes) -> dict:
    """The OCI manifest of bundle `m` (whose manifest.json holds `manifest_bytes`). A file two artifacts
    share is one layer; a component's ONNX files are annotated with the component, engines with their
    artifact's component, backend, fingerprint, profile and size."""
    owner: dict[str, dict] = {}
    for name, comp in m.components.items():
        for rel in comp["files"]:
            owner.setdefault(rel, {P + "role": "onnx", P + "component": name})
    for a in m.data["artifacts"]:
        notes = {P + "role": "artifact", P + "component": a["component"], P + "artifact": a["id"],
                 P + "backend": a["backend"], P + "fingerprint": a["fingerprint"],
                 P + "size": str(a.get("size", sum(m.files[r]["size"] for r in set(a["files"]))))}
        if a.get("profile") or a.get("shapes"):
            notes[P + "profile"] = json.dumps(a.get("profile") or a.get("shapes"), sort_keys=True,
                                              separators=(",", ":"))
        for rel in a["files"]:
            owner[rel] = notes if owner.get(rel, {}).get(P + "role") != "artifact" else owner[rel]
    layers = [descriptor(MANIFEST_MEDIA, "sha256:" + hashlib.sha256(manifest_bytes).hexdigest(), len(manifest_bytes),
                         {TITLE: MANIFEST, P + "role": "manifest"})]
    for rel in sorted(m.files):
        rec = m.files[rel]
        layers.append(descriptor(FILE_MEDIA, "sha256:" + rec["sha256"], rec["size"],
                                 {TITLE: rel, **owner.get(rel, {P + "role": "shared"})}))
    model = m.model
    return {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
            "config": descriptor(EMPTY_MEDIA, EMPTY_DIGEST, len(EMPTY)), "layers": layers,
            "annotations": {P + "name": str(m.data.get("name", "")), P + "family": str(model.get("family")),
                            P + "variant": str(model.get("variant", "")), P + "precast": str(m.data.get("precast", "")),
                            P + "schema": str(m.data.get("schema"))}}


def manifest_body(manifest: dict) -> bytes:
    """The bytes pushed (and so digested) for an OCI manifest: compact, keys sorted."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def read_oci_manifest(ref: Ref, body: bytes, media_type: str) -> dict[str, Layer]:
    """The layers of a precast bundle's OCI manifest, by bundle path; RegistryError when the manifest is
    anything else (an image, an index, another artifact type)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise RegistryError(f"{ref}: the manifest is not JSON; not a precast bundle") from None
    config = data.get("config") if isinstance(data, dict) else None
    kind = data.get("artifactType") or (config.get("mediaType") if isinstance(config, dict) else None) \
        if isinstance(data, dict) else None
    if media_type not in (OCI_MANIFEST, "") or not isinstance(data, dict) or data.get("mediaType", OCI_MANIFEST) != \
            OCI_MANIFEST or kind != ARTIFACT_TYPE:
        what = f"artifactType {kind}" if kind else f"a {data.get('mediaType') or media_type or 'manifest'}" \
            if isinstance(data, dict) else "not an object"
        raise RegistryError(f"{ref}: not a precast bundle ({what}; a bundle pushed by `precast push` has artifactType "
                            f"{ARTIFACT_TYPE}); check the reference")
    layers: dict[str, Layer] = {}
    layers_listed = data.get("layers") or []
    for i, d in enumerate(layers_listed if isinstance(layers_listed, list) else [None]):
        notes = d.get("annotations") or {} if isinstance(d, dict) else {}
        notes = notes if isinstance(notes, dict) else {}
        path, digest, size = notes.get(TITLE), d.get("digest") if isinstance(d, dict) else None, \
            d.get("size") if isinstance(d, dict) else None
        if not isinstance(path, str) or not isinstance(digest, str) or not digest.startswith("sha256:") or \
                type(size) is not int or size < 0:
            raise RegistryError(f"{ref}: layer {i} of the manifest lacks a title, sha256 digest or size; not a "
                                "bundle precast pushed")
        layers[path] = Layer(path, digest, size, d.get("mediaType", ""), notes)
    if MANIFEST not in layers:
        raise RegistryError(f"{ref}: the manifest has no {MANIFEST} layer; not a bundle precast pushed")
    return layers
