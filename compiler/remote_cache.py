"""The remote build cache: exports and engines shared through an OCI registry, found by their cache keys.

Owns: `remote_cache` (the settings: --remote-cache / PRECAST_REMOTE_CACHE = oci://HOST[:PORT]/REPO; pushing,
on unless --no-remote-cache-push / PRECAST_REMOTE_CACHE_PUSH=0; --remote-cache-strict /
PRECAST_REMOTE_CACHE_STRICT=1) and `RemoteCache`, which compiler/cache.py's `get_or_build` asks on a local
miss (`fetch`) and tells what it built (`push`). A cache entry is one OCI artifact in REPO tagged with its
cache key (64 hex digits: a valid tag): artifactType application/vnd.precast.cache.v1, the entry's
entry.json as its config blob, each file one layer titled with its name (docs/registries.md). A fetch
checks the manifest, entry.json (its key, and that its file records are exactly the layers) and every
file's sha256 while it streams (runtime/oci/client.py), into the cache's private temp folder, which
get_or_build renames into place under the key's lock. A push sends each file as a blob (skipped when a
HEAD finds it), entry.json, then the tag, last.

A cache never fails a build: a registry that cannot be reached, refuses the credentials or keeps failing
is one warning line, and the remote cache is off for the rest of the command (all is built here); a push
refused is one warning and pushing is off; an entry that does not check (a blob whose bytes do not match
its digest, a tag holding something else) is one warning naming it, and it is built here. Strict makes
each of these an error. The registry client (the `remote` extra) is imported only when a remote cache is set.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from ..runtime.errors import UserError
from .cache import ENTRY_FILE, DamagedEntry, Entry, check_entry_info
from .errors import BadInput

ENV, ENV_PUSH, ENV_STRICT = "PRECAST_REMOTE_CACHE", "PRECAST_REMOTE_CACHE_PUSH", "PRECAST_REMOTE_CACHE_STRICT"
ARTIFACT_TYPE = "application/vnd.precast.cache.v1"
ENTRY_MEDIA = "application/vnd.precast.cache.entry.v1+json"     # the config blob: the entry's entry.json
FILE_MEDIA = "application/vnd.precast.cache.file.v1"             # each file of the entry


class RemoteCacheError(UserError):
    """Strict mode: what would otherwise have been a warning."""


class Unusable(Exception):
    """A remote entry that does not check: said, then built here."""


def _flag(name: str, value: bool | None, env) -> bool | None:
    if value is not None:
        return value
    text = (env.get(name) or "").strip().lower()
    if not text:
        return None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise BadInput(f"{name}={env[name]!r}: expected 1 or 0 (true / false)")


def remote_cache(ref: str | None = None, push: bool | None = None, strict: bool | None = None,
                 env=os.environ) -> "RemoteCache | None":
    """The remote cache the options set, else the environment; None when neither names one. A reference that
    does not parse or that names a tag is BadInput: a mistake in the settings, not a registry that is away."""
    text = (ref if ref is not None else env.get(ENV) or "").strip()
    if not text:
        return None
    from ..runtime.oci.ref import parse_ref          # standard library only
    where = "--remote-cache" if ref is not None else ENV
    try:
        r = parse_ref(text, need_reference=False, what="reference for a remote cache")
    except UserError as e:
        raise BadInput(f"{where}: {e}") from None
    if r.tag or r.digest:
        raise BadInput(f"{where} {text}: a remote cache is a repository (oci://HOST/REPO), not a tag or digest: each "
                       "entry is tagged with its cache key; drop the :TAG")
    return RemoteCache(r, push=_flag(ENV_PUSH, push, env) is not False, strict=bool(_flag(ENV_STRICT, strict, env)),
                       env=env)


def _text(e: Exception) -> str:
    text = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())


class RemoteCache:
    """One repository of cache entries (`ref`: a Ref without tag), for one command."""

    def __init__(self, ref, push: bool = True, strict: bool = False, env=os.environ, workers: int = 4):
        self.ref, self.push_on, self.strict, self.env, self.workers = ref, push, strict, env, workers
        self.off: str | None = None        # why the remote cache is off for the rest of this command
        self.refused: set[str] = set()     # keys whose remote entry did not check: built here, not pushed over it
        self._registry = None
        self.pulled = self.pushed = self.bytes_downloaded = self.bytes_uploaded = 0
        self.warnings: list[str] = []

    def summary(self) -> dict:
        """For a build's report: what came from the registry and what went to it."""
        return {"ref": str(self.ref), "push": self.push_on, "pulled": self.pulled, "pushed": self.pushed,
                "bytes_downloaded": self.bytes_downloaded, "bytes_uploaded": self.bytes_uploaded,
                "warnings": list(self.warnings)}

    def _client(self):
        if self._registry is None:
            try:
                from ..runtime.oci.client import Registry
            except ModuleNotFoundError as e:
                raise UserError(f"needs the remote extra (no module {e.name!r}): pip install -e '.[remote]' in the "
                                "checkout") from None
            self._registry = Registry.for_ref(self.ref, env=self.env)
        return self._registry

    def _warn(self, text: str) -> None:
        if self.strict:
            raise RemoteCacheError(f"remote cache {self.ref}: {text} (strict: PRECAST_REMOTE_CACHE_STRICT / "
                                   "--remote-cache-strict)")
        line = f"warning: remote cache {self.ref}: {text}"
        self.warnings.append(line)
        print(line, file=sys.stderr, flush=True)

    # ---- pulling ---------------------------------------------------------------------------------
    def fetch(self, key: str, folder: Path) -> bytes | None:
        """On a hit, the entry's files are in `folder` (each sha256-checked) and its entry.json's bytes are
        returned; on a miss (or a warning) None, and `folder` is left empty."""
        if self.off is not None:
            return None
        repo = self.ref.repository
        try:
            from ..runtime.oci.client import MAX_MANIFEST, OCI_MANIFEST
            reg = self._client()
            r = reg.request("GET", f"/v2/{repo}/manifests/{key}", repo, ok=(200, 404), stream=True,
                            headers={"Accept": OCI_MANIFEST}, what=f"cache entry {key[:12]}")
            with r:
                body = r.raw.read(MAX_MANIFEST + 1, decode_content=True) if r.status_code == 200 else None
        except Exception as e:
            self.off = _text(e)
            self._warn(f"{self.off}; the remote cache is off for this command: everything is built here")
            return None
        if body is None:
            return None
        try:
            raw, layers = self._check(reg, key, body)
            got = reg.parallel(lambda d: reg.fetch_blob(repo, d["digest"], d["size"], folder / d["name"],
                                                        f"{d['name']} of cache entry {key[:12]}"), layers, self.workers)
        except Exception as e:
            for p in folder.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            self.refused.add(key)
            self._warn(f"cache entry {key[:12]} not used ({_text(e)}); building it here")
            return None
        self.pulled += 1
        self.bytes_downloaded += sum(got) + len(raw)
        return raw

    def _check(self, reg, key: str, body: bytes) -> tuple[bytes, list[dict]]:
        """(entry.json's bytes, the layers to fetch, largest first) of a tag's manifest, or Unusable."""
        from ..runtime.oci.artifact import TITLE
        try:
            m = json.loads(body)
        except (ValueError, RecursionError):
            raise Unusable("its manifest is not JSON") from None
        config = m.get("config") if isinstance(m, dict) else None
        if not isinstance(config, dict) or m.get("artifactType") != ARTIFACT_TYPE or \
                config.get("mediaType") != ENTRY_MEDIA or not isinstance(config.get("digest"), str) or \
                type(config.get("size")) is not int:
            raise Unusable(f"the tag holds something else than a precast cache entry (artifactType "
                           f"{m.get('artifactType') if isinstance(m, dict) else None!r}, expected {ARTIFACT_TYPE})")
        raw = reg.blob_bytes(self.ref.repository, config["digest"], config["size"], f"{ENTRY_FILE} of {key[:12]}")
        try:
            files, _ = check_entry_info(json.loads(raw), key)
        except (ValueError, DamagedEntry, RecursionError) as e:
            raise Unusable(f"its {ENTRY_FILE}: {e}") from None
        have = {(d.get("annotations") or {}).get(TITLE): (d.get("digest"), d.get("size"))
                for d in m.get("layers") or [] if isinstance(d, dict)}
        want = {name: ("sha256:" + rec["sha256"], rec["size"]) for name, rec in files.items()}
        if have != want:
            raise Unusable(f"its layers are not the files its {ENTRY_FILE} records")
        largest = sorted(want.items(), key=lambda kv: -kv[1][1])
        return raw, [{"name": n, "digest": d, "size": s} for n, (d, s) in largest]

    # ---- pushing ---------------------------------------------------------------------------------
    def push(self, entry: Entry) -> str:
        """'pushed', or 'miss': not pushed (pushing is off, the remote cache is off, the push failed: warned; or
        the tag is there and its entry did not check: its blobs would be skipped, the registry's copy stays)."""
        if not self.push_on or self.off is not None or entry.key in self.refused:
            return "miss"
        repo = self.ref.repository
        try:
            from ..runtime.oci.artifact import manifest_body
            reg = self._client()
            raw = (entry.path / ENTRY_FILE).read_bytes()
            items = sorted(entry.files.items(), key=lambda kv: -kv[1]["size"])
            what = f"of cache entry {entry.key[:12]}"
            sent = reg.parallel(lambda kv: (reg.push_blob(repo, "sha256:" + kv[1]["sha256"], kv[1]["size"],
                                                          entry.path / kv[0], f"{kv[0]} {what}"), kv[1]["size"]),
                                items, self.workers)
            sent.append((reg.push_blob(repo, _digest(raw), len(raw), raw, f"{ENTRY_FILE} {what}"), len(raw)))
            reg.put_manifest(self.ref.with_reference(tag=entry.key), manifest_body(cache_manifest(entry, raw)))
        except Exception as e:
            self.push_on = False
            self._warn(f"pushing cache entry {entry.key[:12]} failed ({_text(e)}); pushing is off for this command")
            return "miss"
        self.pushed += 1
        self.bytes_uploaded += sum(size for how, size in sent if how != "exists")
        return "pushed"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def cache_manifest(entry: Entry, raw: bytes) -> dict:
    """The OCI manifest of a cache entry whose entry.json holds `raw`: annotated with what it is, for people
    browsing the registry (a fetch reads only the layers and entry.json)."""
    from ..runtime.oci.artifact import P, TITLE, descriptor
    from ..runtime.oci.client import OCI_MANIFEST
    meta = entry.metadata
    notes = {P + "cache.key": entry.key, P + "kind": "export" if meta.get("kind") == "export" else "engine",
             **{P + k: meta[k] for k in ("component", "backend", "fingerprint", "dtype")
                if isinstance(meta.get(k), str)}}
    return {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
            "config": descriptor(ENTRY_MEDIA, _digest(raw), len(raw)),
            "layers": [descriptor(FILE_MEDIA, "sha256:" + rec["sha256"], rec["size"], {TITLE: name})
                       for name, rec in sorted(entry.files.items())],
            "annotations": notes}
