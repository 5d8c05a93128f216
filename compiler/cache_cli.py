"""`precast cache`: list, show, remove and collect the content-addressed cache's entries.

Owns: the cache subcommands' output (a table, or one JSON document with --json); the cache itself
is compiler/cache.py. Registered on the build command group by compiler/cli.py.
"""
from __future__ import annotations

import json

import click

from ..runtime.cli_support import run_cli as _run


def _count(n: int, noun: str) -> str:
    """'1 entry', '2 entries', '1 stale temp folder', '0 stale temp folders'."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}s"


def _stage(metadata: dict) -> str:
    """What made a cache entry: its backend, or `export` for a component's ONNX export."""
    return metadata.get("backend") or metadata.get("kind") or "?"


@click.group("cache")
def cache_group():
    """Inspect and manage the engine cache: the folder $PRECAST_CACHE names, else the user cache
    folder (e.g. ~/.cache/precast). Entries are exports (ONNX) and engines, each verified by sha256."""


@cache_group.command("ls")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document: {\"root\": FOLDER, \"entries\": [key, stage, component, backend, "
                   "path, size, files, metadata, last_used, damaged]}.")
def cache_ls(as_json):
    """List the cache's entries: key, component, stage (export or the backend), size, fingerprint."""
    def go():
        from .cache import Cache
        cache = Cache()
        entries = [{**e.summary(), "stage": _stage(e.metadata), "component": e.metadata.get("component"),
                    "backend": e.metadata.get("backend")} for e in cache.list()]
        if as_json:
            click.echo(json.dumps({"root": str(cache.root), "entries": entries}, indent=2))
            return
        for e in entries:
            m = e["metadata"]
            if e["damaged"]:
                click.echo(f"{e['key'][:12]}  DAMAGED: {e['damaged']}; `precast cache gc` removes it")
                continue
            detail = m.get("fingerprint") or (f"{m.get('family', '')} {m.get('dtype', '')}".strip()
                                              if e["stage"] == "export" else "")
            click.echo(f"{e['key'][:12]}  {m.get('component', '?'):<13} {e['stage']:<13} "
                       f"{e['size'] / 1e6:8.1f} MB  {detail}")
        click.echo(f"{_count(len(entries), 'entry')}, {sum(e['size'] for e in entries) / 1e6:.1f} MB in {cache.root}")
    _run(go, as_json=as_json)


@cache_group.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print the entry as one JSON object.")
def cache_show(key, as_json):
    """Show one entry (KEY or a unique prefix of it): its files, metadata and whether every sha256 still matches."""
    def go():
        from .cache import Cache
        cache = Cache()
        entry = cache.find(key)
        problem = cache.verify(entry)
        info = {**entry.summary(), "stage": _stage(entry.metadata), "verified": problem is None, "problem": problem}
        click.echo(json.dumps(info, indent=2) if as_json else "\n".join(
            [f"key       {entry.key}", f"path      {entry.path}", f"stage     {info['stage']}",
             f"verified  {problem or 'ok'}"] +
            [f"{k:<9} {v}" for k, v in sorted(entry.metadata.items()) if not isinstance(v, (dict, list))] +
            [f"file      {n}  {f['size']} B  sha256 {f['sha256'][:16]}" for n, f in entry.files.items()]))
    _run(go, as_json=as_json)


@cache_group.command("rm")
@click.argument("keys", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print {\"removed\": [keys]}.")
def cache_rm(keys, as_json):
    """Remove the entries named by KEYS (each a key or a unique prefix)."""
    def go():
        from .cache import Cache
        cache = Cache()
        removed = []
        for k in keys:
            entry = cache.find(k)
            cache.remove(entry)
            removed.append(entry.key)
        click.echo(json.dumps({"removed": removed}) if as_json else f"removed {_count(len(removed), 'entry')}")
    _run(go, as_json=as_json)


@cache_group.command("gc")
@click.option("--max-size", default=None,
              help="Also remove least recently used entries until the cache holds at most this much "
                   "(e.g. 500M, 20G; K, M, G, T are powers of 1024, so 100M = 104.9 MB as sizes are shown). "
                   "Default: no size limit.")
@click.option("--store-max-size", default=None,
              help="Also remove the references opened least recently (oci://, in the store under the cache) until "
                   "the store holds at most this much (sizes as --max-size). Default: every reference stays.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {removed, reasons, stale_temp_folders, stale_locks, bundle_leftovers, max_size, entries, size, "
                   "store: {store, blobs_removed, bytes_freed, references_removed, partial_removed, skipped, size}}.")
def cache_gc(max_size, store_max_size, as_json):
    """Remove damaged entries, temp folders abandoned by killed builds and what killed bundle builds left beside
    their --out (a bundle a kill caught mid-swap is put back); with --max-size, also least
    recently used entries down to that size. Without --max-size no size limit applies: verified entries stay.
    In the store of oci:// references opened in place: blobs no reference holds any more and partial
    downloads; with --store-max-size, also the references opened least recently."""
    def go():
        from .cache import Cache, parse_size
        from ..runtime.oci.store_gc import collect
        cache = Cache()
        result = cache.gc(parse_size(max_size) if max_size else None)
        result["store"] = collect(cache.root / "oci", parse_size(store_max_size) if store_max_size else None)
        if as_json:
            click.echo(json.dumps(result, indent=2))
            return
        for line in result["bundle_leftovers"]:
            click.echo(line)
        damaged = sum(1 for why in result["reasons"].values() if why != "least recently used")
        lru = len(result["removed"]) - damaged
        limit = (f"{lru} least recently used to stay under --max-size {max_size}" if max_size else
                 "no size limit (the default; --max-size 20G also removes least recently used entries)")
        click.echo(f"removed {_count(damaged, 'damaged entry')}, {_count(result['stale_temp_folders'], 'stale temp folder')}"
                   f", {_count(result['stale_locks'], 'stale lock file')}; {limit}; "
                   f"{_count(result['entries'], 'entry')}, {result['size'] / 1e6:.1f} MB left")
        st = result["store"]
        if st["size"] or st["bytes_freed"]:
            click.echo(f"store {st['store']}: removed {_count(st['blobs_removed'], 'blob')} no reference holds, "
                       f"{_count(len(st['references_removed']), 'reference')}, "
                       f"{_count(st['partial_removed'], 'partial download')} ({st['bytes_freed'] / 1e6:.1f} MB); "
                       f"{st['size'] / 1e6:.1f} MB left" + (f"; {st['skipped']}" if st["skipped"] else ""))
    _run(go, as_json=as_json)
