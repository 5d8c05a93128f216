"""`precast doctor` (registered on the group in runtime/cli.py), built on the Python API (runtime/api.py:
open_bundle, Bundle.plan, Bundle.pipeline, machine): devices, installed backends and what in a bundle would load
where, and why, with the CPU's memory plans (Report.memory: each plan's expected peak, the one generate
uses, a warning up front when none fits); with --load, what generate loads and the seconds each load took;
its text and JSON reports. The options it shares with generate (their help texts, the size default) are
runtime/run_commands.py's.
"""
from __future__ import annotations

import json
import sys
import time

import click

from .budgets import plan_line
from .cli_support import registry_options, run_cli
from .errors import UserError
from .loading import timed
from .report import describe_where, name_width
from .run_commands import BACKEND_HELP, STRICT_HELP, VERIFY_HELP, size_of


@click.command("doctor")
@click.argument("bundle", required=False, type=click.Path())
@click.option("--backend", default=None, help=BACKEND_HELP)
@click.option("--params-backend", default=None, help="Where weights live, e.g. cpu (offload); memory budgets as DEVICE:SIZE, e.g. cuda0:8G,cpu:16G.")
@click.option("--size", default=None, help="WIDTHxHEIGHT to check engines against (default: the bundle's optimal "
                                           "size, its denoiser profile's opt).")
@click.option("--strict", is_flag=True, help=STRICT_HELP)
@click.option("--verify", "verify", default="auto", show_default=True,
              type=click.Choice(["auto", "full"], case_sensitive=False), help=VERIFY_HELP)
@click.option("--load", "load", is_flag=True, help="Also load what generate needs (as generate does: each component "
                                                   "in its own thread) and report the seconds each load took.")
@click.option("--sysroot", default="/", hidden=True, help="Read devices from a recorded tree (tests).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (errors too).")
@registry_options
def doctor_cmd(bundle, backend, params_backend, size, strict, sysroot, as_json, verify, load):
    """Show devices, installed backends, and what in BUNDLE would load where, and why."""
    def go():
        from .api import machine, open_bundle     # the CLI's start does not load the API
        stages = dict.fromkeys(["manifest", "discover", "assign", "backends", "select", "verify", "load", "open",
                                "total"])
        t_start = time.perf_counter()
        api = None
        if bundle:
            stages["manifest"] = 0.0
            with timed(stages, "manifest"):
                api = open_bundle(bundle, verify=verify.lower(), sysroot=sysroot, backend=backend, pull=load)
            w, h = size_of(size, api.manifest)
        elif size:
            raise UserError("--size: checks a bundle's engines; give the BUNDLE too")
        if load and not bundle:
            raise UserError("--load: loads a bundle's engines; give the BUNDLE too")
        if api is not None:
            report = api.plan(backend, params_backend=params_backend, size=(w, h), strict=strict)
            here = report.devices, report.device_warning, report.installed_backends, report.placements
            stages.update(report.stages)
        else:
            m = machine(sysroot, backend, params_backend, strict)
            here, report = (m.devices, m.warning, m.installed, m.placements), None
            stages.update(m.stages)
        devices, warning, installed, placements = here
        out = {"bundle": bundle, "devices": [d.describe() for d in devices], "device_warning": warning,
               "installed_backends": installed, "strict": strict,
               "assignment": {mod: p.describe() for mod, p in placements.items()},
               "size": None, "components": {}, "missing_for_generate": [], "memory": {}, "loaded": None,
               "remote": api.remote.as_dict() if api is not None and api.remote else None,   # oci://: runtime/oci/store.py
               "stages": stages}   # one schema, with or without a bundle
        if report is not None:
            out["size"] = f"{w}x{h}"
            out["components"] = {c: p.record() for c, p in report.components.items()}
            out["missing_for_generate"] = list(report.missing_for_generate)
            out["memory"] = report.memory
            if load and not out["missing_for_generate"]:
                pipe = api.pipeline(backend, params_backend=params_backend, size=(w, h), strict=strict).pipe
                pipe.wait_loaded()
                stages["load"], stages["open"] = pipe.stages["load"], pipe.stages["open"]
                out["loaded"] = {c: {k: r[k] for k in ("device", "backend", "artifact", "passed_over")}
                                 for c, r in pipe.report()["components"].items()}
        stages["total"] = round(time.perf_counter() - t_start, 3)
        if as_json:
            click.echo(json.dumps(out, indent=2))
            return
        if warning:
            click.echo(f"warning: {warning}", err=True)
        for plan in out["memory"].values():     # up front: the machine may not fit the bundle
            if plan["warning"]:
                click.echo(f"warning: {plan['warning']}", err=True)
        for i, d in enumerate(devices):
            mem = f"{d.memory / 2**30:.1f} GiB" if d.memory else "? GiB"
            click.echo(f"device {i}  {d.id:<7} {d.kind:<10} {d.arch:<14} {mem:>9}  {d.name}"
                       + (f"  driver {d.driver}" if d.driver else "")
                       + (f"  ({d.available / 2**30:.1f} GiB available)" if d.available else ""))
        click.echo("backends  " + (", ".join(f"{k} {v}" for k, v in sorted(installed.items())) or "none"))
        for m_, p in placements.items():
            click.echo(f"assign    {m_:<10} -> {p.target}" + (f" (weights on {p.params.id})" if p.offload else "")
                       + (f"  (fell back: {p.fallback})" if p.fallback else ""))
        if report is not None:
            click.echo(f"size      {out['size']}")
            describe_where(out, sys.stdout)
            for dev, plan in out["memory"].items():
                click.echo(f"memory    {plan_line(dev, plan)}")
            for line in api.remote.lines() if api.remote else ():
                click.echo(line)
            if out["loaded"] is not None:
                width = name_width(out["loaded"])
                for c, r in out["loaded"].items():
                    click.echo(f"loaded    {c:<{width}} {r['artifact']} via {r['backend']} in {stages['load'][c]:.2f} s")
                click.echo(f"opened in {stages['open']:.2f} s (components loaded side by side)")
            if out["missing_for_generate"]:
                click.echo(f"warning: `precast generate` needs {', '.join(out['missing_for_generate'])}, which this "
                           "bundle lacks (built with --only / --shard?): build them too, or merge the shards' bundles "
                           "with `precast bundle merge`", err=True)
    run_cli(go, as_json)
