"""Bundles in OCI registries: push, pull for a machine, and the client both are built on.

Imported only for `oci://` references (its HTTP dependency, requests, is the `remote` extra). The API
others build on (a remote build cache, `open_bundle("oci://...")`, `doctor oci://...`):

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

Modules: ref.py (the reference grammar), auth.py (credential sources and their order), client.py (the
distribution API over requests), artifact.py (media types, annotations, the OCI manifest of a bundle),
stream.py (a download written and hashed side by side; parallel transfers), push.py, pull.py.
docs/registries.md documents the format and the commands.
"""
