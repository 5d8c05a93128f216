"""Bundles in OCI registries: push, pull for a machine, references opened in place, and the client under them.

Imported only for `oci://` references (its dependencies -- requests, filelock, platformdirs -- are the
`remote` extra: `need_remote` says so in one line). The API others build on (a remote build cache,
`open_bundle("oci://...")`, `doctor oci://...`):

    from precast.runtime.oci.ref import parse_ref
    from precast.runtime.oci.client import Registry
    ref = parse_ref("oci://ghcr.io/acme/sd15:v1")              # UserError naming the bad part
    reg = Registry.for_ref(ref, ca=None, plain_http=False)     # TLS, auth, retries; thread-safe
    body, media, digest = reg.get_manifest(ref)                # digest refs are checked
    reg.blob_exists(ref.repository, "sha256:...")              # size or None (HEAD)
    reg.fetch_blob(ref.repository, "sha256:...", size, dest, "name")   # resumable, sha256-checked, atomic
    reg.push_blob(ref.repository, "sha256:...", size, path_or_bytes, "name")   # HEAD-skipped, chunked
    reg.put_manifest(ref.with_reference(tag="key"), body, media_type)
    reg.parallel(fn, items, workers=4)

    from precast.runtime.oci.artifact import read_oci_manifest  # a bundle's layers by path, annotations
    from precast.runtime.oci.pull import choose, plan_files, pull_bundle   # selection -> files -> bundle
    from precast.runtime.oci.push import push_bundle
    from precast.runtime.oci.store import open_ref              # a ref as a bundle folder in the local store

Modules: ref.py (the reference grammar), auth.py (credential sources and their order), transport.py (the
connection: sessions, TLS, authentication, retries, errors), client.py (the distribution API's verbs on
it), artifact.py (media types, annotations, the OCI manifest of a bundle), stream.py (a download written
and hashed side by side; parallel transfers), push.py, pull.py, store.py (the local content-addressed
store that `oci://` references open from), store_gc.py (its space reclaimed: `precast cache gc`). docs/registries.md documents the format and the commands.
"""
from __future__ import annotations

import importlib.util

from ..errors import UserError


def need_remote() -> None:
    """UserError, one line naming the `remote` extra, when a module it installs is missing."""
    for name in ("requests", "filelock", "platformdirs"):
        if importlib.util.find_spec(name) is None:
            raise UserError(f"registries need the remote extra (no module {name!r}): pip install 'precast[remote]' "
                            "with this environment's pip, or pip install -e '.[remote]' in a checkout")
