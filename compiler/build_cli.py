"""The build commands of `precast`: plan (a recipe's build matrix) and build (its bundle, through the cache).

Owns: their output (a table, JSON, or GitHub Actions' matrix; a plan's error as JSON too where CI reads
JSON); the work is compiler/recipe.py's, plan.py's and bundle.py's, imported when a command runs.
"""
from __future__ import annotations

import json
from dataclasses import replace

import click

from ..runtime.cli_support import run_cli as _run
from .export_cli import note_evicted, open_cache, remote_cache_options, say_remote


@click.command("plan")
@click.argument("recipe", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["table", "json", "github"]), default="table", show_default=True)
def plan_cmd(recipe, fmt):
    """Print RECIPE's build matrix: one entry per component x target, with what each job needs.
    With --format json or github an error is also printed as {"error", "exit"} on stdout."""
    def go():
        from .families import ASSUMED, FAMILIES
        from .plan import github_matrix, make_plan
        from .recipe import load_recipe
        loaded = load_recipe(recipe, check_files=False)    # a source that is there but damaged: refused here
        if loaded.assumed_components:
            click.echo(f"warning: {recipe}: no model.family or components, and {loaded.source} is not there to read: "
                       f"{FAMILIES[ASSUMED].title}'s components assumed; give model.family ({', '.join(FAMILIES)})",
                       err=True)
        entries = make_plan(loaded)
        if fmt == "github":
            click.echo(json.dumps(github_matrix(entries), separators=(",", ":")))
        elif fmt == "json":
            click.echo(json.dumps({"recipe": recipe, "entries": [e.describe() for e in entries]}, indent=2))
        else:
            for e in entries:
                click.echo(f"{e.id:<44} {e.needs}")
    _run(go, as_json=fmt in ("json", "github"))   # a CI step reading the JSON gets the error as JSON too


@click.command("build")
@click.argument("recipe", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Bundle folder to write.")
@click.option("--only", multiple=True, help="Build only this plan entry (repeatable).")
@click.option("--shard", default=None, help="Build shard i of n of the plan, e.g. 2/3.")
@click.option("--allow-unmatched", is_flag=True,
              help="Merge the recipe's LoRAs even when some of their tensors name no weight of the model (they are "
                   "listed); the same as `allow_unmatched: true` on every `loras:` entry.")
@click.option("--exports-only", is_flag=True,
              help="Export the components of the selected entries (through the cache and the remote cache) into a "
                   "bundle of their ONNX, and build no engine: run once in CI before the jobs that build engines, so "
                   "that each of them pulls the exports from the remote cache.")
@remote_cache_options
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout: {\"bundle\": FOLDER, \"seconds\": S, \"artifacts\": [one record "
                   "per artifact: component, backend (onnx for the export), target, cache (hit|remote|miss), seconds, "
                   "key, fingerprint (null for exports), entry (the plan entry; COMPONENT.onnx for an export); remote "
                   "(hit|pushed|miss) with a remote cache][, \"remote_cache\": {ref, pulled, pushed, bytes, "
                   "warnings}]}. Progress stays on stderr.")
def build_cmd(recipe, out, only, shard, allow_unmatched, exports_only, remote_ref, remote_push, remote_strict, as_json):
    """Build RECIPE's engines through the cache into a bundle."""
    def go():
        from .bundle import build_bundle
        from .recipe import load_recipe
        loaded = load_recipe(recipe)
        if allow_unmatched:
            loaded = replace(loaded, loras=tuple(replace(lora, allow_unmatched=True) for lora in loaded.loras))
        cache = open_cache(remote_ref, remote_push, remote_strict)
        report = build_bundle(loaded, out, tuple(only), shard, progress=True, cache=cache, exports_only=exports_only)
        if cache.remote is not None:
            report["remote_cache"] = cache.remote.summary()
        if as_json:
            click.echo(json.dumps(report, indent=2))
            return
        for r in report["artifacts"]:
            click.echo(f"{r['cache']:<6} {r['component']:<13} {r.get('target', r['backend']):<30} {r['seconds']:7.2f} s")
            note_evicted(r)
        say_remote(cache)
        click.echo(f"bundle {report['bundle']} in {report['seconds']:.1f} s")
    _run(go, as_json=as_json)
