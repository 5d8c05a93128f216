"""The OCI distribution API's verbs, on runtime/oci/transport.py: what push, pull and a remote cache need.

Owns: `Registry` (a Transport -- one registry's session, TLS, authentication and retries -- with the
verbs): `get_manifest` / `put_manifest`, `blob_exists` (HEAD), `fetch_blob` (a blob into a file:
resumed from its `.partial` with HTTP Range, sha256 checked while it streams, renamed into place only
when it matches), `blob_bytes` (a small blob in memory, checked), `push_blob` (HEAD first; one PUT for
a small blob, else a chunked, resumable upload: POST, PATCH with Content-Range following each
Location, PUT ?digest=) and `parallel` (a few transfers at once; the first error stops the rest); the
manifest media types and size limits. Errors are transport.py's `RegistryError`, a UserError: one line
naming the registry, the repository or blob, and the fix.

Why requests and not the `oras` SDK (0.2.43): oras does HEAD checks, chunked uploads and Basic /
Bearer auth with Docker's credential files, but its downloads start over every time (no Range), it
checks no digest while (or after) a blob streams, its chunked upload cannot resume from the registry's
offset, it transfers one blob at a time through one shared session, and it reports errors as
exceptions with HTTP text; wrapping it would leave most of this module to write anyway, so this module
speaks the protocol itself over requests (already in most environments, well kept).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import urlencode, urljoin

import requests

from .ref import Ref
from .stream import Download, parallel
from .transport import (_TRANSIENT, Interrupted, RegistryError, Transport, Unreachable, _asked, _error_text, read_body,
                        _transient_status)

__all__ = ["Registry", "RegistryError", "Interrupted", "Unreachable", "OCI_MANIFEST", "MANIFEST_TYPES", "MAX_MANIFEST",
           "CHUNK"]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST)
MAX_MANIFEST = 4 << 20          # bytes: the spec's recommended limit for a manifest
CHUNK = 64 << 20                # bytes: blobs above this are uploaded in chunks of this size


class Registry(Transport):
    """One registry's distribution API (transport.py's Transport: sessions, TLS, auth, retries); thread-safe."""

    @classmethod
    def for_ref(cls, ref: Ref, **kw) -> "Registry":
        return cls(ref.registry, loopback=ref.loopback, **kw)

    # ---- manifests -------------------------------------------------------------------------------
    def get_manifest(self, ref: Ref) -> tuple[bytes, str, str]:
        """(body, media type, digest) of the manifest `ref` names; a digest reference is checked."""
        r = self.request("GET", f"/v2/{ref.repository}/manifests/{ref.reference}", ref.repository, stream=True,
                         headers={"Accept": ", ".join(MANIFEST_TYPES)},
                         missing=f"{ref}: no such {'manifest' if ref.digest else 'tag'} in the registry (or no "
                                 f"repository {ref.repository}); check the reference (`precast push` creates it)",
                         what=f"the manifest of {ref}")
        with r:
            body = read_body(r, MAX_MANIFEST + 1, f"the manifest of {ref}")
        if len(body) > MAX_MANIFEST:
            raise RegistryError(f"{ref}: the manifest is over {MAX_MANIFEST >> 20} MiB; not a precast bundle")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if ref.digest and digest != ref.digest:
            raise RegistryError(f"{ref}: the registry sent a manifest whose digest is {digest}, not the one asked "
                                "for; refused")
        return body, r.headers.get("Content-Type", "").split(";")[0].strip(), digest

    def put_manifest(self, ref: Ref, body: bytes, media_type: str = OCI_MANIFEST) -> str:
        r = self.request("PUT", f"/v2/{ref.repository}/manifests/{ref.reference}", ref.repository, ok=(201, 200),
                         headers={"Content-Type": media_type}, data=body, what=f"the manifest of {ref}")
        r.close()
        return "sha256:" + hashlib.sha256(body).hexdigest()

    # ---- blobs -----------------------------------------------------------------------------------
    def blob_exists(self, repo: str, digest: str) -> int | None:
        """The blob's size when the repository has it, else None."""
        r = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", repo, ok=(200, 404), what=f"blob {digest[:19]}")
        r.close()
        return int(r.headers.get("Content-Length") or 0) if r.status_code == 200 else None

    def mount_blob(self, repo: str, digest: str, source_repo: str, name: str) -> bool:
        """Whether `repo` has blob `digest` now: already, or mounted from `source_repo` of the same registry
        (the distribution API's cross-repository mount: no byte sent). False where the registry would not
        mount it (the upload session it opened instead is cancelled): the caller sends the bytes."""
        if self.blob_exists(repo, digest) is not None:
            return True
        if repo == source_repo:
            return False
        r = self.request("POST", f"/v2/{repo}/blobs/uploads/?{urlencode({'mount': digest, 'from': source_repo})}",
                         repo, ok=(201, 202), headers={"Content-Length": "0"}, what=f"mount of {name}")
        r.close()
        if r.status_code == 202 and r.headers.get("Location"):
            try:
                self.request("DELETE", urljoin(r.url, r.headers["Location"]), repo, ok=(204, 200, 404, 405),
                             what=f"upload of {name}").close()
            except RegistryError:
                pass
        return r.status_code == 201

    def blob_bytes(self, repo: str, digest: str, size: int, name: str, limit: int = 64 << 20) -> bytes:
        if size > limit:
            raise RegistryError(f"{name}: {size} bytes, over the {limit >> 20} MiB read into memory; refused")
        r = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo, stream=True, what=name,
                         missing=f"{self.registry}/{repo}: blob {digest} ({name}) is missing; push the bundle again")
        with r:
            body = read_body(r, size + 1, name)
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise RegistryError(f"{name}: the registry sent bytes whose sha256 is not the manifest's {digest}: "
                                "refused (the blob in the registry is damaged or was replaced)")
        return body

    def fetch_blob(self, repo: str, digest: str, size: int, dest: Path, name: str, on_bytes=None) -> int:
        """The blob into `dest`, through `dest.partial`: bytes already there are kept and the rest asked for
        with a Range request; the sha256 runs over the stream (stream.py's Download: received into reused
        buffers, written by this thread, hashed by another beside it) and `dest` appears only when it
        matches (a mismatch removes the partial file). Returns the bytes received over the network."""
        partial = dest.with_name(dest.name + ".partial")
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            partial.unlink()
            have = 0
        received, attempt = 0, 0
        with Download(partial, have) as sink:
            while have < size:
                ranged = {"Range": f"bytes={have}-"} if have else {}
                r = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo, ok=(200, 206), headers=ranged,
                                 stream=True, what=name, missing=f"{self.registry}/{repo}: blob {digest} ({name}) is "
                                 "missing from the registry; the push was incomplete: push the bundle again")
                with r:
                    if r.status_code == 200 and have:          # the registry ignored the Range: start over
                        sink.restart()
                        have = 0
                    body = _body(r)
                    try:
                        while have < size:
                            if self.stop.is_set():
                                raise Interrupted(f"{name}: stopped (another transfer failed)")
                            n = sink.fill(body, size - have)
                            if not n:
                                raise ConnectionError("the connection closed before the blob's end")
                            have += n
                            received += n
                            if on_bytes:
                                on_bytes(n)
                    except _TRANSIENT as e:
                        self._wait(attempt, name, e)
                        attempt += 1
            got = sink.digest()
        if got != digest:
            partial.unlink(missing_ok=True)
            raise RegistryError(f"{name}: the registry sent bytes whose sha256 is {got[:23]}..., not "
                                f"{digest[:23]}... as the bundle's manifest says: refused, the partial file removed "
                                "(the blob in the registry is damaged or was replaced: push the bundle again)")
        os.replace(partial, dest)
        return received

    def push_blob(self, repo: str, digest: str, size: int, source: Path | bytes, name: str, chunk: int = CHUNK,
                  on_bytes=None) -> str:
        """Upload `source` (a file, or bytes) as blob `digest` unless the repository has it: 'exists', 'uploaded'
        (one PUT) or 'chunked' (PATCHes of `chunk` bytes from a file; a lost connection resumes from the
        registry's offset; a token that expired on the way is fetched again). The registry checks the digest when the upload closes."""
        if self.blob_exists(repo, digest) is not None:
            return "exists"
        start = self.request("POST", f"/v2/{repo}/blobs/uploads/", repo, ok=(202,), what=f"upload of {name}",
                             headers={"Content-Length": "0"})
        start.close()
        location = urljoin(start.url, start.headers["Location"])
        if size <= chunk:
            body = source if isinstance(source, bytes) else Path(source).read_bytes()
            self._finish(repo, location, digest, name, body)
            if on_bytes:
                on_bytes(size)
            return "uploaded"
        offset, attempt, answered = 0, 0, set()
        with open(source, "rb") as f:
            while offset < size:
                f.seek(offset)
                block = f.read(min(chunk, size - offset))
                try:
                    r = self.session.request("PATCH", location, data=block, timeout=(10, 300), verify=self.verify, headers={
                        "Content-Type": "application/octet-stream", "Content-Length": str(len(block)),
                        "Content-Range": f"{offset}-{offset + len(block) - 1}", **self._authorization(repo)})
                except _TRANSIENT as e:
                    self._wait(attempt, name, e)
                    attempt += 1
                    offset, location = self._upload_offset(repo, location, name)
                    continue
                with r:
                    challenge = r.headers.get("WWW-Authenticate") if r.status_code == 401 else None
                    if challenge and _asked(challenge) not in answered:    # a token that expired or fell short
                        answered.add(_asked(challenge))
                        self._answer(challenge, repo)
                        continue
                    if r.status_code == 416 or _transient_status(r.status_code):
                        self._wait(attempt, name, f"HTTP {r.status_code}")
                        attempt += 1
                        offset, location = self._upload_offset(repo, location, name)
                        continue
                    if r.status_code != 202:
                        raise RegistryError(f"{self.registry}/{repo}: the chunk of {name} at byte {offset} was refused "
                                            f"(HTTP {r.status_code}{_error_text(r)})")
                    location = urljoin(r.url, r.headers.get("Location") or location)
                    offset = _range_end(r, offset + len(block))
                    if on_bytes:
                        on_bytes(len(block))
        self._finish(repo, location, digest, name, b"")
        return "chunked"

    def _upload_offset(self, repo: str, location: str, name: str) -> tuple[int, str]:
        """Where an upload stands by the registry's account (GET on its Location): (next byte, Location)."""
        r = self.request("GET", location, repo, ok=(204,), what=f"the upload of {name}",
                         missing=f"{self.registry}/{repo}: the upload of {name} expired; run the push again")
        r.close()
        return _range_end(r, 0), urljoin(r.url, r.headers.get("Location") or location)

    def _finish(self, repo: str, location: str, digest: str, name: str, body: bytes) -> None:
        sep = "&" if "?" in location else "?"
        r = self.request("PUT", f"{location}{sep}{urlencode({'digest': digest})}", repo, ok=(201,), data=body,
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(body))},
                         what=f"upload of {name}")
        r.close()

    def parallel(self, fn, items, workers: int = 4) -> list:
        """fn(item) for every item on `workers` threads, results in order; the first error stops the
        transfers still running (they give up at their next read) and is raised."""
        return parallel(fn, items, workers, self.stop)


def _body(r: requests.Response):
    """What a blob's bytes are read from, as sent (no decoding): the http.client response under urllib3's, whose
    readinto receives straight into the buffer given (urllib3's own copies through a bytes object)."""
    fp = getattr(r.raw, "_fp", None)
    return fp if hasattr(fp, "readinto") else r.raw


def _range_end(r: requests.Response, default: int) -> int:
    """The next byte after a registry's `Range: 0-N` header."""
    text = r.headers.get("Range", "")
    try:
        return int(text.rpartition("-")[2]) + 1 if text else default
    except ValueError:
        return default
