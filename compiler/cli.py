"""The `precast` command line.

Owns: argument parsing, progress and `--json` output, and the exit codes: 0 ok, 1 internal
failure, 2 bad input (one line naming the file, key or field and the fix; no traceback).
"""
from __future__ import annotations

import json
import sys
import traceback

import click

from .errors import BadInput


def _run(fn):
    try:
        return fn()
    except BadInput as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception:  # a bug in precast, not the user's input
        traceback.print_exc()
        click.echo("error: internal failure (a bug in precast); please report it with the trace above", err=True)
        sys.exit(1)


def _parse_sets(values: tuple[str, ...]) -> dict:
    import yaml
    out: dict = {}
    for item in values:
        key, eq, raw = item.partition("=")
        if not eq or "." not in key:
            raise BadInput(f"--set {item!r}: expected COMPONENT.FIELD=VALUE, e.g. unet.num_heads=8")
        comp, field = key.split(".", 1)
        out.setdefault(comp, {})[field] = yaml.safe_load(raw)
    return out


@click.group()
@click.version_option(package_name="precast")
def main() -> None:
    """precast: compile diffusion models ahead of time."""


@main.command("export")
@click.argument("checkpoint", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(), help="Output folder (optimum-onnx layout).")
@click.option("--component", "components", multiple=True,
              help="Component to export (repeatable): text_encoder, unet, vae_encoder, vae_decoder. Default: all present.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--set", "sets", multiple=True, metavar="COMPONENT.FIELD=VALUE",
              help="Override what the weights cannot say, e.g. unet.num_heads=8, text_encoder.num_heads=12.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def export_cmd(checkpoint, out, components, dtype, sets, as_json):
    """Export CHECKPOINT (.safetensors file or diffusers folder) to ONNX, without torch."""
    def go():
        from .export import export
        report = export(checkpoint, out, list(components) or None, dtype, _parse_sets(sets), progress=not as_json)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            for c in report["components"]:
                size = sum(c["files"].values())
                click.echo(f"{c['name']:<13} {size / 1e6:9.1f} MB  "
                           f"{', '.join(i['name'] for i in c['inputs'])} -> {', '.join(o['name'] for o in c['outputs'])}")
            click.echo(f"{report['family']} {report['dtype']} -> {report['out']} in {report['seconds']:.1f} s")
    _run(go)


@main.command("demo-model")
@click.option("--out", "out", required=True, type=click.Path(), help="Where to write the .safetensors file.")
@click.option("--seed", default=0, show_default=True)
def demo_model_cmd(out, seed):
    """Write the embedded default: a tiny SD 1.x checkpoint with seeded random weights."""
    def go():
        import os
        from .demo_model import write_demo_model
        write_demo_model(out, seed=seed)
        click.echo(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB, tiny SD 1.x, seed {seed})")
    _run(go)


if __name__ == "__main__":
    main()
