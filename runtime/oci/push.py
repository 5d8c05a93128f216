"""`precast push`: a verified bundle uploaded to a registry as one OCI artifact.

Owns: `push_bundle` -- the bundle verified as `precast bundle verify` does (every file hashed whole),
each distinct file uploaded as a blob under its manifest sha256 on a few threads (a blob the repository
already has is skipped after a HEAD; a large one goes up in resumable chunks: runtime/oci/client.py), the
empty config blob, then the OCI manifest (runtime/oci/artifact.py) under the tag. A push that stops
midway leaves blobs and no tag: the next push skips what arrived and the tag appears only at the end.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError
from ..manifest import MANIFEST, read_manifest, verify_bundle
from ..progress import bar
from .artifact import EMPTY, EMPTY_DIGEST, manifest_body, oci_manifest
from .client import CHUNK, Registry
from .ref import Ref


@dataclass
class PushResult:
    ref: str
    digest: str                 # the OCI manifest's: `REF@DIGEST` pins what was pushed
    blobs: int                  # distinct blobs in the artifact (config included)
    uploaded: int               # blobs sent now (the rest the registry had)
    chunked: int                # of those, sent in chunks
    bytes_uploaded: int
    bytes_total: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def push_bundle(bundle: str | Path, ref: Ref, registry: Registry, *, chunk: int = CHUNK, workers: int = 4,
                progress: bool = True) -> PushResult:
    t0 = time.perf_counter()
    problems = verify_bundle(bundle)
    if problems:
        raise UserError(f"{bundle}: does not verify ({problems[0]}{f'; {len(problems) - 1} more' if len(problems) > 1 else ''}"
                        f"); `precast bundle verify {bundle}` lists them: rebuild it before pushing")
    m = read_manifest(bundle)
    body = (m.root / MANIFEST).read_bytes()
    manifest = oci_manifest(m, body)
    blobs = {}                                          # digest -> (path, size, name), one upload each
    for layer in manifest["layers"]:
        rel = layer["annotations"]["org.opencontainers.image.title"]
        blobs.setdefault(layer["digest"], (m.root / rel, layer["size"], rel))
    total = sum(size for _, size, _ in blobs.values())
    with bar(total, f"push {ref}", enabled=progress) as b:
        def one(item):
            digest, (path, size, name) = item
            how = registry.push_blob(ref.repository, digest, size, path, name, chunk, on_bytes=b.update)
            if how == "exists":
                b.update(size)
            return how, size
        done = registry.parallel(one, sorted(blobs.items(), key=lambda kv: -kv[1][1]), workers)
        done.append((registry.push_blob(ref.repository, EMPTY_DIGEST, len(EMPTY), EMPTY, "the config"), len(EMPTY)))
        digest = registry.put_manifest(ref, manifest_body(manifest))
    sent = [(how, size) for how, size in done if how != "exists"]
    return PushResult(str(ref), digest, len(blobs) + 1, len(sent), sum(how == "chunked" for how, _ in sent),
                      sum(size for _, size in sent), total, round(time.perf_counter() - t0, 3))

