"""`precast bundle`: merge, pack, unpack, verify and inspect engine bundles.

Owns: the bundle subcommands' output (a line, a table, or JSON with --json), and merge's registry
references (shards in --out's registry merged there, others pulled whole, the merged bundle pushed:
runtime/oci/); the work is
compiler/bundle_merge.py's, bundle_archive.py's and runtime/manifest.py's, imported when a command runs.
"""
from __future__ import annotations

import json
import sys

import click

from ..runtime.cli_support import run_cli as _run
from ..runtime.manifest import read_manifest, verify_bundle
from .cache_cli import _count


def _profile_words(p: dict) -> str:
    """'512x512 (min 256x256, max 768x768), batch 1, 77 tokens' from a component's shape profile."""
    def size(i):
        return f"{p['width'][i]}x{p['height'][i]}"
    def span(key):
        lo, opt, hi = p[key]
        return str(opt) if lo == hi else f"{lo}..{hi} (opt {opt})"
    fixed = size(0) == size(2)
    words = [size(1) if fixed else f"{size(1)} (min {size(0)}, max {size(2)})", f"batch {span('batch')}",
             f"{span('tokens')} tokens"]
    if p.get("t5_tokens"):
        words.append(f"{span('t5_tokens')} T5 tokens")
    return ", ".join(words)


@click.group("bundle")
def bundle_group():
    """Merge, pack, unpack, verify and inspect engine bundles."""


@bundle_group.command("merge")
@click.argument("bundles", nargs=-1, required=True)
@click.option("--out", required=True, help="Folder for the merged bundle, or oci://HOST/REPO:TAG to push it to.")
@click.option("--ca", default=None, type=click.Path(), help="CA certificate (PEM) for registries (also PRECAST_REGISTRY_CA).")
@click.option("--plain-http", is_flag=True, help="Talk plain HTTP to the registries.")
@click.option("--json", "as_json", is_flag=True)
def bundle_merge(bundles, out, ca, plain_http, as_json):
    """Join shard bundles of one recipe into one bundle. Shards and --out may be folders or registry
    references (oci://...). Shards pushed by `precast push` to the registry --out names are merged there:
    only their manifests are read and their blobs mounted into --out's repository (nothing downloaded).
    Otherwise a shard in a registry is pulled whole first (into a temporary folder), and a merged bundle for
    a registry is pushed (blobs the registry has are skipped)."""
    def go():
        from .bundle_merge import merge_bundles
        from ..runtime.oci.ref import is_ref
        if not any(map(is_ref, (*bundles, out))):
            r = merge_bundles(list(bundles), out)
        else:
            r = _merge_refs(merge_bundles, list(bundles), out, ca, plain_http, as_json)
        there = (f"; merged in the registry: {_count(r['mounted'], 'blob')} mounted, {_count(r['copied'], 'blob')} "
                 f"copied through here, {r['bytes_downloaded'] / 1e6:.1f} MB downloaded") if r.get("in_registry") else ""
        click.echo(json.dumps(r) if as_json else f"merged {_count(len(bundles), 'bundle')} -> {out} "
                                                 f"({_count(r['artifacts'], 'artifact')}{there})")
    _run(go)


def _merge_refs(merge_bundles, bundles: list[str], out: str, ca, plain_http, as_json) -> dict:
    """Shards and --out all in one registry: merged there (bundle_merge.merge_in_registry: nothing downloaded).
    Else merge_bundles with the shards that are references pulled (--all) and the result pushed when --out is one."""
    import tempfile
    from pathlib import Path
    from ..runtime.oci.client import Registry
    from ..runtime.oci.pull import pull_bundle
    from ..runtime.oci.push import push_bundle
    from ..runtime.oci.ref import is_ref, parse_ref
    if is_ref(out) and all(map(is_ref, bundles)) and {parse_ref(b).registry for b in bundles} == {parse_ref(out).registry}:
        from .bundle_merge import merge_in_registry
        ref = parse_ref(out)
        return merge_in_registry([parse_ref(b) for b in bundles], ref, Registry.for_ref(ref, ca=ca, plain_http=plain_http))
    with tempfile.TemporaryDirectory(prefix="precast-merge-") as tmp:
        local = []
        for i, b in enumerate(bundles):
            if is_ref(b):
                ref = parse_ref(b)
                pull_bundle(ref, Path(tmp) / f"shard-{i}", Registry.for_ref(ref, ca=ca, plain_http=plain_http),
                            everything=True, progress=not as_json)
                b = Path(tmp) / f"shard-{i}"
            local.append(b)
        if not is_ref(out):
            return merge_bundles(local, out)
        ref = parse_ref(out)
        r = merge_bundles(local, Path(tmp) / "merged")
        pushed = push_bundle(Path(tmp) / "merged", ref, Registry.for_ref(ref, ca=ca, plain_http=plain_http),
                             progress=not as_json)
        return {**r, "bundle": out, "digest": pushed.digest, "bytes_uploaded": pushed.bytes_uploaded}


@bundle_group.command("pack")
@click.argument("bundle", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="FILE.tar, FILE.tar.gz or FILE.tar.zst")
@click.option("--json", "as_json", is_flag=True)
def bundle_pack(bundle, out, as_json):
    """Verify BUNDLE and pack it into one archive."""
    def go():
        from .bundle_archive import count_words, pack_bundle
        r = pack_bundle(bundle, out)
        click.echo(json.dumps(r) if as_json else f"packed {count_words(r)} -> {out} ({r['size'] / 1e6:.1f} MB)")
    _run(go)


@bundle_group.command("unpack")
@click.argument("archive", type=click.Path())
@click.option("--out", required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_unpack(archive, out, as_json):
    """Unpack ARCHIVE safely (no absolute paths, '..', links or devices) and verify it."""
    def go():
        from .bundle_archive import count_words, unpack_bundle
        r = unpack_bundle(archive, out)
        click.echo(json.dumps(r) if as_json else f"unpacked {count_words(r)} -> {out}; verified")
    _run(go)


@bundle_group.command("verify")
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_verify(bundle, as_json):
    """Check every file of BUNDLE against its manifest (size and sha256). Exit 1 when any differs."""
    def go():
        problems = verify_bundle(bundle)          # a ManifestError is a UserError: one line, exit 2
        if as_json:
            click.echo(json.dumps({"bundle": bundle, "ok": not problems, "problems": problems}, indent=2))
        else:
            for p in problems:
                click.echo(f"FAIL {p}", err=True)
            click.echo(f"{bundle}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        if problems:
            sys.exit(1)
    _run(go)


@bundle_group.command("inspect")
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_inspect(bundle, as_json):
    """Show what BUNDLE holds: model, components, artifacts with their fingerprints."""
    def go():
        m = read_manifest(bundle)
        if as_json:
            click.echo(json.dumps(m.data, indent=2))
            return
        model = m.model
        click.echo(f"model      {model['family']} {model['variant']}  source {model['source']}  "
                   f"sha256 {model['source_sha256'][:16]}")
        for lora in model.get("loras") or []:
            click.echo(f"lora       {lora.get('name')}  strength {lora.get('strength')}  sha256 {str(lora.get('sha256'))[:16]}")
        for emb in model.get("embeddings") or []:
            click.echo(f"embedding  {emb.get('name') or emb.get('token')}")
        for name, c in sorted(m.components.items()):
            click.echo(f"component  {name:<13} {c['dtype']}  " +
                       ", ".join(i['name'] for i in c['inputs']) + " -> " + ", ".join(o['name'] for o in c['outputs']))
            for p in c.get("profiles") or []:
                click.echo(f"  profile  {_profile_words(p)}")
        for a in m.artifacts():
            size = sum(m.files[f]["size"] for f in a.files) / 1e6
            click.echo(f"artifact   {a.component:<13} {a.backend:<13} {size:8.1f} MB  {a.fingerprint}")
        from .bundle_archive import bundle_counts, count_words
        click.echo(f"total      {count_words(bundle_counts(m.files))}, "
                   f"{sum(f['size'] for f in m.files.values()) / 1e6:.1f} MB")
    _run(go)
