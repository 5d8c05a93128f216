"""The `precast` command: runtime commands here, build commands loaded from the compiler on demand.

Owns: the top-level command group (`doctor`, `generate` need only the runtime's dependencies;
`export`, `build`, `bundle`, ... are imported from precast.compiler.cli only when invoked) and
the exit codes: 0 ok, 1 failure, 2 bad input (one line, no traceback).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
import traceback
from pathlib import Path

import click

from .errors import UserError

BUILD_COMMANDS = ("bundle", "build", "cache", "compile", "demo-model", "export", "plan")


def run_cli(fn):
    """Run a command body: user mistakes and paths the OS refuses -> one line + exit 2; bugs ->
    trace + exit 1; a closed stdout -> exit 141, silently."""
    try:
        return fn()
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`precast cache ls | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        sys.exit(141)  # 128 + SIGPIPE, as other tools in a pipe report it
    except OSError as e:     # the file system refused a path the user chose (permissions, space, name, /proc)
        where = f"{e.filename}: " if e.filename else ""
        click.echo(f"error: {where}{e.strerror or e}; check the path, its permissions and the free space", err=True)
        sys.exit(2)
    except Exception:
        traceback.print_exc()
        click.echo("error: internal failure (a bug in precast); please report it with the trace above", err=True)
        sys.exit(1)


class PrecastGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(BUILD_COMMANDS))

    def get_command(self, ctx, name):
        if name in self.commands or name not in BUILD_COMMANDS:
            return super().get_command(ctx, name)
        try:
            compiler_cli = importlib.import_module("precast.compiler.cli")
        except ImportError as e:
            why = str(e)

            @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
            def missing():
                click.echo(f"error: `precast {name}` is a build command and needs the compiler's dependencies "
                           f"(pip install 'precast[compiler]'): {why}", err=True)
                sys.exit(2)
            return missing
        return compiler_cli.main.get_command(ctx, name)


@click.group(cls=PrecastGroup)
@click.version_option(package_name="precast")
def main() -> None:
    """precast: compile diffusion models ahead of time; run them with a thin runtime."""


MAX_SIDE = 4096  # px per side, unless the bundle's shape profiles declare more
_SIZE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")


def parse_size(size: str, manifest) -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height), checked against the bundle: ASCII digits, multiples of
    its VAE's factor, at most MAX_SIDE px per side or the largest side its profiles declare."""
    from .pipeline import latent_factor
    m = _SIZE.fullmatch(size.strip())
    if not m:
        raise UserError(f"--size {size!r}: expected WIDTHxHEIGHT in pixels, e.g. 512x512")
    w, h = int(m.group(1)), int(m.group(2))
    f = latent_factor(manifest)
    declared = [p[dim][2] for c in manifest.components.values() for p in c["profiles"] for dim in ("width", "height")]
    limit = max([MAX_SIDE, *declared])
    if not (f <= w <= limit and f <= h <= limit):
        raise UserError(f"--size {size}: each side must be {f} to {limit} px "
                        f"(the larger of {MAX_SIDE} and this bundle's largest profile)")
    if w % f or h % f:
        raise UserError(f"--size {size}: width and height must be multiples of {f}")
    return w, h


def _check_text(option: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{option}: not valid UTF-8 text; pass it in UTF-8 (check the terminal's locale)") from None


def _check_out(out: str) -> Path:
    """Refuse an --out that cannot become a PNG file before any work is done."""
    path = Path(out)
    if path.is_dir() or out.endswith(os.sep):
        raise UserError(f"--out {out}: is a folder; give a file path such as {path / 'image.png'}")
    if os.path.lexists(path) and not path.is_file():
        raise UserError(f"--out {out}: exists and is not a regular file (a device, pipe or broken link); "
                        "choose another path")
    if not path.parent.is_dir():
        raise UserError(f"--out {out}: folder {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"--out {out}: folder {path.parent} is not writable; choose another path")
    return path


def _write_image(path: Path, image) -> None:
    """The PNG is written to a temp file beside `path` and renamed into place (write_png removes
    the temp file on any failure, so a failed write leaves nothing behind)."""
    from .png import write_png
    try:
        write_png(path, image)
    except OSError as e:
        raise UserError(f"--out {path}: cannot write ({e.strerror or e})") from None


@main.command("doctor")
@click.argument("bundle", required=False, type=click.Path())
@click.option("--backend", default=None, help="Module assignment, e.g. te=cpu,vae=gpu0,unet=gpu0.")
@click.option("--params-backend", default=None, help="Where weights live, e.g. cpu (offload).")
@click.option("--size", default=None, help="WIDTHxHEIGHT to check engines against (default: the bundle's profile).")
@click.option("--sysroot", default="/", hidden=True, help="Read devices from a recorded tree (tests).")
@click.option("--json", "as_json", is_flag=True)
def doctor_cmd(bundle, backend, params_backend, size, sysroot, as_json):
    """Show devices, installed backends, and what in BUNDLE would load where, and why."""
    def go():
        import os
        from .assign import COMPONENT_MODULE, assign_modules
        from .devices import apply_device_override, discover_devices
        from .select import installed_backends, select_all
        devices, warning = apply_device_override(discover_devices(sysroot, os.environ), os.environ)
        placements = assign_modules(devices, backend, params_backend)
        installed = installed_backends()
        out = {"devices": [d.describe() for d in devices], "installed_backends": installed,
               "device_warning": warning,
               "assignment": {m: {"device": p.device.id, "params": p.params.id} for m, p in placements.items()}}
        if bundle:
            from .manifest import read_manifest
            from .pipeline import requests
            m = read_manifest(bundle)
            if size:
                w, h = parse_size(size, m)
            else:
                prof = next(iter(m.components.values()))["profiles"][0]
                w, h = prof["width"][1], prof["height"][1]
            sels = select_all(m, placements, devices, requests(m, 1, h, w), installed)
            out["components"] = {c: {"module": COMPONENT_MODULE.get(c, "diffusion"),
                                     "choice": s.choice.describe() if s.choice else None,
                                     "then": [v.describe() for v in s.viable[1:]], "passed_over": s.refused}
                                 for c, s in sels.items()}
        if as_json:
            click.echo(json.dumps(out, indent=2))
            return
        if warning:
            click.echo(f"warning: {warning}", err=True)
        for i, d in enumerate(devices):
            mem = f"{d.memory / 2**30:.1f} GiB" if d.memory else "? GiB"
            click.echo(f"device {i}  {d.id:<7} {d.kind:<10} {d.arch:<14} {mem:>9}  {d.name}"
                       + (f"  driver {d.driver}" if d.driver else ""))
        click.echo("backends  " + (", ".join(f"{k} {v}" for k, v in sorted(installed.items())) or "none"))
        for m_, p in placements.items():
            click.echo(f"assign    {m_:<10} -> {p.device.id}" + (f" (weights on {p.params.id})" if p.offload else ""))
        for c, info in out.get("components", {}).items():
            ch = info["choice"]
            click.echo(f"{c:<13} -> " + (f"{ch['device']} via {ch['backend']}: {ch['artifact']}"
                                         + (f"  [{ch['note']}]" if ch['note'] else "") if ch else "NOTHING CAN RUN"))
            for r in info["passed_over"]:
                click.echo(f"{'':16}passed over: {r.split(': ', 1)[1]}")
    run_cli(go)


@main.command("generate")
@click.argument("bundle", type=click.Path())
@click.option("--prompt", required=True)
@click.option("--negative", default="", show_default=True)
@click.option("--steps", default=None, type=int, help="Denoising steps (default: SD 20; Flux dev 28, schnell 4; Chroma 35).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Noise seed: 0 or more (negative seeds are refused, not wrapped).")
@click.option("--size", default="512x512", show_default=True,
              help=f"WIDTHxHEIGHT in pixels: multiples of the VAE factor (8), at most {MAX_SIDE} per side "
                   "(or the bundle's largest profile).")
@click.option("--guidance", default=None, type=float,
              help="Guidance scale (finite): classifier-free for SD (default 7.5) and Chroma (5.0); Flux dev's "
                   "distilled guidance (3.5); unused by schnell.")
@click.option("--scheduler", default=None, help="euler | dpm++2m (SD; default euler). Flux/Chroma: flow-matching Euler.")
@click.option("--out", required=True, type=click.Path(), help="PNG file to write.")
@click.option("--backend", default=None, help="Module assignment, e.g. te=cpu,vae=gpu0,unet=gpu0.")
@click.option("--params-backend", default=None, help="Where weights live, e.g. cpu (offload).")
@click.option("--sysroot", default="/", hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print what ran where as JSON.")
def generate_cmd(bundle, prompt, negative, steps, seed, size, guidance, scheduler, out, backend, params_backend,
                 sysroot, as_json):
    """Text to image with BUNDLE, each module on its device; prints what ran where."""
    def go():
        import time
        from .manifest import read_manifest
        from .pipeline import Txt2Img, check_steps, describe_where, to_uint8
        if steps is not None:
            check_steps(steps)
        manifest = read_manifest(bundle)
        dit = "transformer" in manifest.components
        w, h = parse_size(size, manifest)
        if seed < 0:
            raise UserError(f"--seed {seed}: must be 0 or more (negative seeds are refused)")
        if guidance is not None and not math.isfinite(guidance):
            raise UserError(f"--guidance {guidance}: must be a finite number, e.g. 7.5")
        if dit and scheduler not in (None, "euler", "flow-euler"):
            raise UserError(f"--scheduler {scheduler}: {manifest.model.get('family')} samples with flow-matching Euler "
                            "(the scheduler it was trained for); leave --scheduler out")
        _check_text("--prompt", prompt)
        _check_text("--negative", negative)
        if dit and negative and manifest.model.get("family") == "flux":
            click.echo("warning: --negative is not used by Flux (distilled guidance, no negative prompt)", err=True)
        out_path = _check_out(out)
        t0 = time.perf_counter()
        if dit:
            from .dit_pipeline import FluxTxt2Img
            pipe = FluxTxt2Img(manifest, backend, params_backend, width=w, height=h, sysroot=sysroot)
            n_steps = pipe.defaults["steps"] if steps is None else steps
            t1 = time.perf_counter()
            image = pipe(prompt, negative, n_steps, seed, guidance, progress=not as_json)
        else:
            n_steps = 20 if steps is None else steps
            pipe = Txt2Img(manifest, backend, params_backend, width=w, height=h, sysroot=sysroot)
            t1 = time.perf_counter()
            image = pipe(prompt, negative, n_steps, seed, 7.5 if guidance is None else guidance, scheduler or "euler",
                         progress=not as_json)
        _write_image(out_path, to_uint8(image))
        report = {**pipe.report(), "out": out, "load_seconds": round(t1 - t0, 3),
                  "generate_seconds": round(time.perf_counter() - t1, 3)}
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            if pipe.device_warning:
                click.echo(f"warning: {pipe.device_warning}", err=True)
            describe_where(report, sys.stdout)
            click.echo(f"wrote {out} ({w}x{h}, {n_steps} steps, seed {seed}) in "
                       f"{report['load_seconds']:.1f} s load + {report['generate_seconds']:.1f} s")
    run_cli(go)


if __name__ == "__main__":
    main()
