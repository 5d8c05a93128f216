"""A small client for the OCI distribution API, on `requests`: what push, pull and a remote cache need.

Owns: `Registry` (one registry: its scheme, TLS, authentication and retries) with `get_manifest` /
`put_manifest`, `blob_exists` (HEAD), `fetch_blob` (a blob into a file: resumed from its `.partial` with
HTTP Range, sha256 checked while it streams, renamed into place only when it matches), `blob_bytes`
(a small blob in memory, checked), `push_blob` (HEAD first; one PUT for a small blob, else a chunked,
resumable upload: POST, PATCH with Content-Range following each Location, PUT ?digest=) and
`parallel` (a few transfers at once; the first error stops the rest). Errors are `RegistryError`, a
UserError: one line naming the registry, the repository or blob, and the fix.

Why requests and not the `oras` SDK (0.2.43): oras does HEAD checks, chunked uploads and Basic /
Bearer auth with Docker's credential files, but its downloads start over every time (no Range), it
checks no digest while (or after) a blob streams, its chunked upload cannot resume from the registry's
offset, it transfers one blob at a time through one shared session, and it reports errors as
exceptions with HTTP text; wrapping it would leave most of this module to write anyway, so this module
speaks the protocol itself over requests (already in most environments, well kept).

Transport: https with the system store (requests' certifi bundle, or REQUESTS_CA_BUNDLE), or a CA file
(`ca=`: --ca / PRECAST_REGISTRY_CA). Plain http only when asked (`plain_http=True`) or for a loopback
host (localhost, 127.0.0.1, [::1]) whose https handshake fails while http answers, as docker does.
Authentication: the registry's challenge decides -- Basic with the credentials runtime/oci/auth.py
finds, or Bearer: a token from the challenge's realm for its service and scope (anonymous when no
credentials are found; an identity token is exchanged as an OAuth2 refresh token), cached per
repository and fetched again when a request asks for another scope. Retries: a connection lost, a
timeout, 429 or 5xx is retried RETRIES times with doubling waits (PRECAST_REGISTRY_RETRIES; a transfer
goes on from the bytes it has), then one line saying that running the command again resumes. A host
never reached is not retried: unknown host and connection refused are said at once.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlencode, urljoin

import requests
import urllib3

from ..errors import UserError
from .auth import ENV_CA, Credentials, find_credentials, login_hint, parse_challenge
from .ref import Ref
from .stream import Download, parallel

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST)
MAX_MANIFEST = 4 << 20          # bytes: the spec's recommended limit for a manifest
CHUNK = 64 << 20                # bytes: blobs above this are uploaded in chunks of this size
READ = 1 << 20                  # bytes per read while a blob streams
RETRIES = 4
_TRANSIENT = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
              urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


class RegistryError(UserError):
    """A registry refused, lost or damaged something: one line naming it and the fix."""


class Interrupted(RegistryError):
    """The registry went away (after the retries): running the command again resumes."""


def _transient_status(code: int) -> bool:
    return code == 429 or 500 <= code < 600


class Registry:
    """One registry, `HOST[:PORT]`; safe to share between threads (each thread has its own session)."""

    def __init__(self, registry: str, *, loopback: bool = False, plain_http: bool = False, ca: str | None = None,
                 env=os.environ, retries: int | None = None):
        self.registry, self.loopback, self.env = registry, loopback, env
        self.ca = ca or env.get(ENV_CA) or None
        if self.ca and not os.path.isfile(self.ca):
            raise RegistryError(f"--ca / {ENV_CA} {self.ca}: no such file (give the CA certificate in PEM form "
                                "that signed the registry's certificate)")
        self.verify = self.ca or True     # per request too: requests lets REQUESTS_CA_BUNDLE override a session's
        self.scheme = "http" if plain_http else None
        self.retries = retries if retries is not None else int(env.get("PRECAST_REGISTRY_RETRIES") or RETRIES)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._reached = False
        self._basic: tuple[str, str] | None = None
        self._tokens: dict[str, tuple[str, str]] = {}     # repository -> (scope, token)
        self._found: tuple[Credentials | None, list[str]] | None = None
        self.stop = threading.Event()                      # set: transfers in flight give up (parallel)

    @classmethod
    def for_ref(cls, ref: Ref, **kw) -> "Registry":
        return cls(ref.registry, loopback=ref.loopback, **kw)

    # ---- transport -------------------------------------------------------------------------------
    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.verify = self.verify
            s.headers["User-Agent"] = "precast"
        return s

    def url(self, path: str) -> str:
        if self.scheme is None:
            with self._lock:
                if self.scheme is None:
                    self.scheme = self._probe()
        return f"{self.scheme}://{self.registry}{path}"

    def _probe(self) -> str:
        """'https', or 'http' for a loopback registry that speaks only plain HTTP."""
        try:
            self.session.get(f"https://{self.registry}/v2/", timeout=(10, 30), verify=self.verify)
            return "https"
        except requests.RequestException as e:
            if not self.loopback:
                raise self._connection_error(e, "https") from None
            try:
                r = self.session.get(f"http://{self.registry}/v2/", timeout=(10, 30), verify=self.verify)
            except requests.RequestException:
                raise self._connection_error(e, "https") from None
            if r.status_code == 400 and "https" in r.text.lower():      # a TLS server: the https error stands
                raise self._connection_error(e, "https") from None
            return "http"

    def _connection_error(self, e: Exception, scheme: str | None = None) -> RegistryError:
        text = str(e)
        if isinstance(e, requests.exceptions.SSLError):
            why = "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in text else text.split("(")[-1][:120]
            return RegistryError(f"{self.registry}: TLS failed ({why}): give the CA that signed the registry's "
                                 f"certificate with --ca FILE or {ENV_CA}" + ("" if self.ca else
                                 "; a registry that speaks plain HTTP needs --plain-http"))
        if any(s in text for s in ("NameResolution", "Name or service not known", "getaddrinfo", "nodename nor "
                                   "servname", "No address associated", "Temporary failure in name resolution")):
            return RegistryError(f"{self.registry}: unknown host (its name does not resolve): check the host in the "
                                 "reference")
        if "refused" in text.lower():
            return RegistryError(f"{self.registry}: connection refused: no registry listens there; check the host "
                                 "and port, and that the registry runs")
        return RegistryError(f"{self.registry}: cannot connect ({type(e).__name__}: {text[:160]})")

    def request(self, method: str, path_or_url: str, repo: str, *, ok=(200,), headers=None, data=None,
                stream: bool = False, missing: str | None = None, what: str = "") -> requests.Response:
        """One request with authentication (a 401 answered once per challenge) and retries; a status
        outside `ok` raises RegistryError (`missing`: the words for a 404). `data`: bytes, or a
        callable giving a fresh body for each try."""
        url = path_or_url if "://" in path_or_url else self.url(path_or_url)
        answered = set()
        for attempt in range(self.retries + 1):
            if self.stop.is_set():
                raise Interrupted(f"{self.registry}: stopped (another transfer failed)")
            try:
                r = self.session.request(method, url, headers={**(headers or {}), **self._authorization(repo)},
                                         data=data() if callable(data) else data, stream=stream,
                                         timeout=(10, 120), verify=self.verify, allow_redirects=True)
            except requests.exceptions.SSLError as e:
                raise self._connection_error(e) from None
            except _TRANSIENT as e:
                if not self._reached:
                    raise self._connection_error(e) from None
                self._wait(attempt, what or path_or_url, e)
                continue
            self._reached = True
            if r.status_code == 401 and r.headers.get("WWW-Authenticate"):
                challenge = r.headers["WWW-Authenticate"]
                if challenge in answered:
                    raise self._denied(r, repo)
                answered.add(challenge)
                r.close()
                self._answer(challenge, repo)
                continue
            if _transient_status(r.status_code) and attempt < self.retries:
                r.close()
                self._wait(attempt, what or path_or_url, f"HTTP {r.status_code}")
                continue
            if r.status_code in ok:
                return r
            r.close()
            if r.status_code in (401, 403):
                raise self._denied(r, repo)
            if r.status_code == 404 and missing:
                raise RegistryError(missing)
            raise RegistryError(f"{self.registry}/{repo}: {method} {what or path_or_url} answered HTTP {r.status_code}"
                                f"{_error_text(r)}")
        raise Interrupted(f"{self.registry}: {what or path_or_url}: the registry kept failing ({self.retries + 1} "
                          "tries); run the same command again: it resumes where it stopped")

    def _wait(self, attempt: int, what: str, e) -> None:
        if attempt >= self.retries:
            raise Interrupted(f"{self.registry} went away during {what} ({type(e).__name__ if not isinstance(e, str) else e}; "
                              f"{self.retries + 1} tries): run the same command again: it resumes where it stopped")
        time.sleep(0.5 * 2 ** attempt)

    # ---- authentication --------------------------------------------------------------------------
    def _credentials(self) -> tuple[Credentials | None, list[str]]:
        with self._lock:
            if self._found is None:
                self._found = find_credentials(self.registry, self.env)
            return self._found

    def _authorization(self, repo: str) -> dict:
        if repo in self._tokens:
            return {"Authorization": f"Bearer {self._tokens[repo][1]}"}
        if self._basic:
            return {"Authorization": requests.auth._basic_auth_str(*self._basic)}
        return {}

    def _answer(self, challenge: str, repo: str) -> None:
        scheme, params = parse_challenge(challenge)
        creds, tried = self._credentials()
        if scheme == "basic":
            if creds is None or creds.identity_token:
                raise RegistryError(f"{self.registry} asks for a user name and password and none were found (looked "
                                    f"in {', '.join(tried)}): {login_hint(self.registry)}")
            self._basic = (creds.username, creds.secret)
            return
        if scheme != "bearer" or not params.get("realm"):
            raise RegistryError(f"{self.registry}: unsupported authentication challenge {challenge[:80]!r}")
        scope = params.get("scope") or f"repository:{repo}:pull"
        query = {k: v for k, v in (("service", params.get("service")), ("scope", scope)) if v}
        try:
            if creds is not None and creds.identity_token:
                r = self.session.post(params["realm"], data={**query, "grant_type": "refresh_token",
                                                             "refresh_token": creds.secret, "client_id": "precast"},
                                      timeout=(10, 60), verify=self.verify)
            else:
                r = self.session.get(params["realm"], params=query, timeout=(10, 60), verify=self.verify,
                                     auth=(creds.username, creds.secret) if creds else None)
        except requests.RequestException as e:
            raise RegistryError(f"{self.registry}: the token service {params['realm']} cannot be reached "
                                f"({type(e).__name__})") from None
        if r.status_code in (401, 403):
            raise self._denied(r, repo, token_service=params["realm"])
        token = (r.json() if r.ok and r.headers.get("Content-Type", "").startswith("application/json") else {})
        token = token.get("token") or token.get("access_token")
        if not token:
            raise RegistryError(f"{self.registry}: the token service {params['realm']} answered HTTP {r.status_code} "
                                "without a token")
        self._tokens[repo] = (scope, token)

    def _denied(self, r: requests.Response, repo: str, token_service: str | None = None) -> RegistryError:
        creds, tried = self._credentials()
        if creds is None:
            what = f"asks for credentials and none were found (looked in {', '.join(tried)})"
        elif r.status_code == 403:
            what = f"denied access with the credentials from {creds.source}"
        else:
            what = f"refused the credentials from {creds.source}"
        return RegistryError(f"{self.registry}/{repo}: {what} (HTTP {r.status_code}"
                             f"{' from ' + token_service if token_service else ''}): "
                             + ("check that the account may push/pull this repository, or " if creds else "")
                             + login_hint(self.registry))

    # ---- manifests -------------------------------------------------------------------------------
    def get_manifest(self, ref: Ref) -> tuple[bytes, str, str]:
        """(body, media type, digest) of the manifest `ref` names; a digest reference is checked."""
        r = self.request("GET", f"/v2/{ref.repository}/manifests/{ref.reference}", ref.repository, stream=True,
                         headers={"Accept": ", ".join(MANIFEST_TYPES)},
                         missing=f"{ref}: no such {'manifest' if ref.digest else 'tag'} in the registry (or no "
                                 f"repository {ref.repository}); check the reference (`precast push` creates it)",
                         what=f"the manifest of {ref}")
        with r:
            body = r.raw.read(MAX_MANIFEST + 1, decode_content=True)
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

    def blob_bytes(self, repo: str, digest: str, size: int, name: str, limit: int = 64 << 20) -> bytes:
        if size > limit:
            raise RegistryError(f"{name}: {size} bytes, over the {limit >> 20} MiB read into memory; refused")
        r = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo, stream=True, what=name,
                         missing=f"{self.registry}/{repo}: blob {digest} ({name}) is missing; push the bundle again")
        with r:
            body = r.raw.read(size + 1, decode_content=True)
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise RegistryError(f"{name}: the registry sent bytes whose sha256 is not the manifest's {digest}: "
                                "refused (the blob in the registry is damaged or was replaced)")
        return body

    def fetch_blob(self, repo: str, digest: str, size: int, dest: Path, name: str, on_bytes=None) -> int:
        """The blob into `dest`, through `dest.partial`: bytes already there are kept and the rest asked for
        with a Range request; the sha256 runs over the stream (in a second thread that also writes, so the
        hash and the disk keep pace with the socket) and `dest` appears only when it matches (a mismatch
        removes the partial file). Returns the bytes received over the network."""
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
                    try:
                        while have < size:
                            if self.stop.is_set():
                                raise Interrupted(f"{name}: stopped (another transfer failed)")
                            block = r.raw.read(min(READ, size - have), decode_content=False)
                            if not block:
                                raise ConnectionError("the connection closed before the blob's end")
                            sink.put(block)
                            have += len(block)
                            received += len(block)
                            if on_bytes:
                                on_bytes(len(block))
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
        registry's offset). The registry checks the digest when the upload closes."""
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
        offset, attempt = 0, 0
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


def _range_end(r: requests.Response, default: int) -> int:
    """The next byte after a registry's `Range: 0-N` header."""
    text = r.headers.get("Range", "")
    try:
        return int(text.rpartition("-")[2]) + 1 if text else default
    except ValueError:
        return default


def _error_text(r: requests.Response) -> str:
    try:
        errors = r.json().get("errors") or []
        return ": " + "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors[:2]) if errors else ""
    except (ValueError, AttributeError):
        return ""
