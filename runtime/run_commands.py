"""The runtime's own commands, `precast doctor` and `precast generate` (registered on the group in
runtime/cli.py), with the checks of every option before anything loads: sizes against the bundle,
assignments, ControlNets, and (through runtime/checks.py, shared with the Python API) steps, seed,
guidance, prompt text, scheduler per family and --out; and their text and JSON reports.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import click

from .checks import check_guidance, check_out as _check_out, check_scheduler, check_seed, check_text, shown
from .checks import write_image as _write_image  # noqa: F401 (tests call it here)
from .cli import main, run_cli
from .errors import UserError


MAX_SIDE = 4096  # px per side, unless the bundle's shape profiles declare more
_SIZE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")


def parse_size(size: str | tuple[int, int], manifest, name: str = "--size") -> tuple[int, int]:
    """'WIDTHxHEIGHT' (or the API's (width, height) ints) -> (width, height), checked against the bundle:
    ASCII digits, multiples of its VAE's factor, at most MAX_SIDE px per side or the largest side its
    profiles declare. `name`: the option or keyword the errors name (runtime/checks.py's `shown`)."""
    from .pipeline import latent_factor
    if isinstance(size, str):
        m = _SIZE.fullmatch(size.strip())
        if not m:
            raise UserError(f"{shown(name, size, quote=True)}: expected WIDTHxHEIGHT in pixels, e.g. 512x512")
        w, h = int(m.group(1)), int(m.group(2))
    else:
        w, h = size
    f = latent_factor(manifest)
    declared = [p[dim][2] for c in manifest.components.values() for p in c["profiles"] for dim in ("width", "height")]
    limit = max([MAX_SIDE, *declared])
    if not (f <= w <= limit and f <= h <= limit):
        raise UserError(f"{shown(name, size)}: each side must be {f} to {limit} px "
                        f"(the larger of {MAX_SIDE} and this bundle's largest profile)")
    if w % f or h % f:
        raise UserError(f"{shown(name, size)}: width and height must be multiples of {f}")
    return w, h


def _scheduler_names() -> list[str]:
    from .dit_pipeline import SCHEDULER
    from .schedulers import SAMPLERS
    return [*SAMPLERS, SCHEDULER]


BACKEND_HELP = ("Where each module runs: DEVICE, BACKEND or DEVICE:BACKEND, per module or for all, e.g. "
                "te=cpu,unet=gpu0 | all=openvino | unet=onnxruntime | te=cpu:onnxruntime. A device that is not here "
                "falls back with the reason (see --strict).")
STRICT_HELP = ("Run every module where --backend puts it (device and backend) or exit 2: no fallback, not even past "
               "a damaged engine (without --strict: a warning, and the next candidate runs).")
VERIFY_HELP = ("auto: hash each bundle file once per file state (a recorded match is trusted while the file's "
               "device, inode, size, mtime and ctime are unchanged); full: hash every file again (and refresh "
               "the records).")


def _size(size: str | None, manifest) -> tuple[int, int]:
    from .pipeline import optimal_size
    return parse_size(size, manifest) if size else optimal_size(manifest)


@main.command("doctor")
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
def doctor_cmd(bundle, backend, params_backend, size, strict, sysroot, as_json, verify, load):
    """Show devices, installed backends, and what in BUNDLE would load where, and why."""
    def go():
        from .assign import assign_modules
        from .devices import apply_device_override, discover_devices
        from .pipeline import describe_where, timed
        from .select import component_report, installed_backends, nothing_runs, select_all
        m = None
        stages = {"manifest": None, "discover": None, "assign": None, "backends": None, "select": None,
                  "verify": None, "load": None, "open": None, "total": None}
        t_start = time.perf_counter()
        if bundle:
            from .manifest import read_manifest
            stages["manifest"] = 0.0
            with timed(stages, "manifest"):
                m = read_manifest(bundle)
            w, h = _size(size, m)
        elif size:
            raise UserError("--size: checks a bundle's engines; give the BUNDLE too")
        if load and not bundle:
            raise UserError("--load: loads a bundle's engines; give the BUNDLE too")
        for k in ("discover", "assign", "backends"):
            stages[k] = 0.0
        with timed(stages, "discover"):
            devices, warning = apply_device_override(discover_devices(sysroot, os.environ), os.environ)
        with timed(stages, "assign"):
            placements = assign_modules(devices, backend, params_backend, strict=strict)
        with timed(stages, "backends"):
            installed = installed_backends(sysroot)
        out = {"bundle": bundle, "devices": [d.describe() for d in devices], "device_warning": warning,
               "installed_backends": installed, "strict": strict,
               "assignment": {mod: p.describe() for mod, p in placements.items()},
               "size": None, "components": {}, "missing_for_generate": [], "loaded": None,
               "stages": stages}   # one schema, with or without a bundle
        if m is not None:
            from .pipeline import requests
            out["size"] = f"{w}x{h}"
            reqs = requests(m, 1, h, w)
            stages["select"] = stages["verify"] = 0.0
            with timed(stages, "select"):    # headers and manifests only
                select_all(m, placements, devices, reqs, installed, False)
            with timed(stages, "verify"):    # the same selection with the sha256 checks (every component)
                sels = select_all(m, placements, devices, reqs, installed, verify.lower())
            if strict:
                stuck = next((s for s in sels.values() if s.choice is None), None)
                if stuck:
                    raise UserError(nothing_runs(stuck.component, stuck.target, stuck.refused))
            out["components"] = {c: {**component_report(c, s.choice, s.refused),
                                     "then": [v.describe() for v in s.viable[1:]]} for c, s in sels.items()}
            out["missing_for_generate"] = _missing_for_generate(m)
            if load and not out["missing_for_generate"]:
                pipe = _open_pipeline(m, backend, params_backend, w, h, sysroot, strict, verify.lower(), lazy=False)
                stages["load"], stages["open"] = pipe.stages["load"], pipe.stages["open"]
                out["loaded"] = {c: {k: r[k] for k in ("device", "backend", "artifact", "passed_over")}
                                 for c, r in pipe.report()["components"].items()}
        stages["total"] = round(time.perf_counter() - t_start, 3)
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
            click.echo(f"assign    {m_:<10} -> {p.target}" + (f" (weights on {p.params.id})" if p.offload else "")
                       + (f"  (fell back: {p.fallback})" if p.fallback else ""))
        if m is not None:
            click.echo(f"size      {out['size']}")
            describe_where(out, sys.stdout)
            if out["loaded"] is not None:
                for c, r in out["loaded"].items():
                    click.echo(f"loaded    {c:<13} {r['artifact']} via {r['backend']} in {stages['load'][c]:.2f} s")
                click.echo(f"opened in {stages['open']:.2f} s (components loaded side by side)")
            if out["missing_for_generate"]:
                click.echo(f"warning: `precast generate` needs {', '.join(out['missing_for_generate'])}, which this "
                           "bundle lacks (built with --only / --shard?): build them too, or merge the shards' bundles "
                           "with `precast bundle merge`", err=True)
    run_cli(go, as_json)


def pipeline_class(manifest):
    """The family's txt2img pipeline (SD 1.x/2.x/XL: Txt2Img, Flux / Chroma: FluxTxt2Img, SD3: SD3Txt2Img)."""
    if manifest.model.get("family") == "sd3":
        from .sd3_pipeline import SD3Txt2Img
        return SD3Txt2Img
    if "transformer" in manifest.components:
        from .dit_pipeline import FluxTxt2Img
        return FluxTxt2Img
    from .sd_pipeline import Txt2Img
    return Txt2Img


def _open_pipeline(manifest, backend, params_backend, w, h, sysroot, strict, verify, lazy=True):
    return pipeline_class(manifest)(manifest, backend, params_backend, width=w, height=h, sysroot=sysroot,
                                    strict=strict, verify=verify, lazy=lazy)


def _missing_for_generate(manifest) -> list[str]:
    """Components `generate` needs for this bundle's family that the bundle does not have."""
    from .dit_pipeline import FAMILIES as DIT_NEEDS
    from .pipeline import NEEDED
    from .sd3_pipeline import NEEDED as SD3_NEEDS
    family = manifest.model.get("family")
    needed = NEEDED.get(family) or DIT_NEEDS.get(family) or (SD3_NEEDS if family == "sd3" else ())
    return [c for c in needed if c not in manifest.components]


@main.command("generate")
@click.argument("bundle", type=click.Path())
@click.option("--prompt", required=True)
@click.option("--negative", default="", show_default=True)
@click.option("--steps", default=None, type=int, help="Denoising steps (default: SD 20; Flux dev 28, schnell 4; Chroma 35; "
                   "SD3 28, SD3.5 40, 3.5-large-turbo 4).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Noise seed: 0 or more (negative seeds are refused, not wrapped).")
@click.option("--size", default=None,
              help=f"WIDTHxHEIGHT in pixels (default: the bundle's optimal size, its denoiser profile's opt): "
                   f"multiples of the bundle's pixels per latent (8 for SD; 16 for Flux / Chroma / SD3, which read 2x2 latent patches), "
                   f"at most {MAX_SIDE} per side (or the bundle's largest profile).")
@click.option("--guidance", default=None, type=float,
              help="Guidance scale (finite): classifier-free for SD (default 7.5), Chroma (5.0) and SD3 (7.0; SD3.5 "
                   "4.5; turbo 1.0 = none); Flux dev's "
                   "distilled guidance (3.5); unused by schnell.")
@click.option("--scheduler", default=None, type=click.Choice(_scheduler_names(), case_sensitive=False),
              help="SD: euler (default) or dpm++2m. Flux / Chroma / SD3: flow-euler (the only one; euler means it too).")
@click.option("--init-image", "init_image", default=None, type=click.Path(),
              help="img2img (SD 1.x/2.x/XL): start from this PNG, encoded by the bundle's VAE encoder. Without "
                   "--size the output has the image's size (multiples of 8); with --size the image is "
                   "centre-cropped to that aspect ratio and resized (bilinear, antialiased).")
@click.option("--mask", default=None, type=click.Path(),
              help="Inpainting: a PNG the init image's size, white = repaint, black = keep (luma >= 128 "
                   "repaints; alpha ignored). Works with inpainting UNets (9 channels) and plain ones.")
@click.option("--strength", default=None, type=float,
              help="img2img / inpainting: share of the schedule run from the noised image, more than 0 and at "
                   "most 1 (default 0.8 img2img, 1.0 inpainting; steps run = int(steps x strength)).")
@click.option("--control", "controls", multiple=True, metavar="IMAGE[:SCALE]",
              help="ControlNet (SD 1.x/2.x/XL bundles built with `controlnets:`): a control image (PNG, e.g. canny "
                   "edges) and its conditioning scale (default 1.0); repeatable, one per ControlNet.")
@click.option("--controlnet", "controlnet_names", multiple=True, metavar="NAME",
              help="Which of the bundle's ControlNets each --control feeds, in order (not needed with one).")
@click.option("--control-start", "control_starts", multiple=True, type=float,
              help="Fraction of the steps before a ControlNet starts (per --control, default 0).")
@click.option("--control-end", "control_ends", multiple=True, type=float,
              help="Fraction of the steps after which a ControlNet stops (per --control, default 1).")
@click.option("--guess-mode", is_flag=True, help="ControlNet guess mode (diffusers'): control on the conditional "
                                                 "half only, residuals scaled from 0.1 (shallow) to 1.0 (mid).")
@click.option("--out", required=True, type=click.Path(), help="PNG file to write.")
@click.option("--backend", default=None, help=BACKEND_HELP)
@click.option("--params-backend", default=None, help="Where weights live, e.g. cpu (offload); memory budgets as DEVICE:SIZE, e.g. cuda0:8G,cpu:16G.")
@click.option("--strict", is_flag=True, help=STRICT_HELP)
@click.option("--verify", "verify", default="auto", show_default=True,
              type=click.Choice(["auto", "full"], case_sensitive=False), help=VERIFY_HELP)
@click.option("--sysroot", default="/", hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print what ran where, and the settings, as JSON (errors too).")
def generate_cmd(bundle, prompt, negative, steps, seed, size, guidance, scheduler, init_image, mask, strength,
                 controls, controlnet_names, control_starts, control_ends, guess_mode, out,
                 backend, params_backend, strict, sysroot, as_json, verify):
    """Text to image with BUNDLE (or img2img with --init-image, inpainting with --mask), each module on
    its device; prints what ran where."""
    def go():
        import time
        from .assign import parse_assignment
        from .dit_pipeline import SCHEDULER
        from .manifest import read_manifest
        from .pipeline import check_image_mode, check_steps, describe_where, latent_factor, size_warning, to_uint8
        from .sd_pipeline import Txt2Img
        t_start = time.perf_counter()
        # Every option is checked here, before any engine is verified or loaded.
        if steps is not None:
            check_steps(steps)
        check_seed(seed)
        if guidance is not None:
            check_guidance(guidance)
        parse_assignment(backend, "--backend")
        parse_assignment(params_backend, "--params-backend")
        check_text(prompt, "--prompt")
        check_text(negative, "--negative")
        manifest = read_manifest(bundle)
        dit = "transformer" in manifest.components
        mode, used_strength = check_image_mode(manifest, init_image is not None, mask is not None, strength,
                                               20 if steps is None else steps)
        from .control import parse_control, plan_controls
        if controls and dit:
            raise UserError(f"--control: ControlNets run with SD 1.x/2.x/XL bundles; this one is {manifest.model.get('family')}")
        plan = plan_controls(manifest, [parse_control(c) for c in controls], list(controlnet_names),
                             list(control_starts), list(control_ends))
        if guess_mode and not plan:
            raise UserError("--guess-mode: give a control image with --control")
        from .images import init_image as read_control
        for c in plan:              # read (and so check) the control images now too
            read_control(c.image, f"--control {c.image}")
        init_px = mask_px = None
        if mode != "txt2img":       # read (and so check) the images before any engine loads
            from . import images
            init_px = images.init_image(init_image)
            mask_px = images.mask_image(mask, init_px) if mask is not None else None
        if size or init_px is None:
            w, h = _size(size, manifest)
        else:                       # the init image's own size
            iw, ih = images.output_size(init_px, "--init-image", init_image, latent_factor(manifest))
            try:
                w, h = parse_size(f"{iw}x{ih}", manifest)
            except UserError as e:
                raise UserError(f"--init-image {init_image} sets the output size: {e}; give --size") from None
        sched = check_scheduler(scheduler, manifest)
        family = manifest.model.get("family")
        if dit and negative and family == "flux":
            click.echo("warning: --negative is not used by Flux (distilled guidance, no negative prompt)", err=True)
        out_path = _check_out(out)
        slow = size_warning(manifest, w, h)     # said now, before the run-time compile it warns of
        if slow and not as_json:
            click.echo(f"warning: {slow}", err=True)
        t0 = time.perf_counter()
        if dit:
            pipe = pipeline_class(manifest)(manifest, backend, params_backend, width=w, height=h, sysroot=sysroot,
                                            strict=strict, verify=verify.lower())
            n_steps = pipe.defaults["steps"] if steps is None else steps
            used_guidance = pipe.defaults["guidance"] if guidance is None else guidance
            used_scheduler = SCHEDULER
            t1 = time.perf_counter()
            image = pipe(prompt, negative, n_steps, seed, used_guidance, progress=not as_json)
        else:
            n_steps = 20 if steps is None else steps
            used_guidance = 7.5 if guidance is None else guidance
            used_scheduler = sched or "euler"
            pipe = Txt2Img(manifest, backend, params_backend, width=w, height=h, sysroot=sysroot, strict=strict,
                           verify=verify.lower(), image_input=mode != "txt2img",
                           controlnets=tuple(dict.fromkeys(c.component for c in plan)))
            t1 = time.perf_counter()
            image = pipe(prompt, negative, n_steps, seed, used_guidance, used_scheduler, progress=not as_json,
                         init_image=init_px, mask=mask_px, strength=used_strength, controls=plan,
                         guess_mode=guess_mode)
        _write_image(out_path, to_uint8(image))
        t2 = time.perf_counter()
        warnings = pipe.prompt_warnings(prompt, negative)
        report = {"bundle": bundle, "out": out, "prompt": prompt, "negative": negative, "size": f"{w}x{h}",
                  "steps": n_steps, "seed": seed, "scheduler": used_scheduler, "guidance": used_guidance,
                  "mode": mode, "init_image": init_image, "mask": mask, "strength": used_strength,
                  "controls": [{"controlnet": c.component[len("controlnet_"):], "image": str(c.image), "scale": c.scale,
                                "start": c.start, "end": c.end} for c in plan], "guess_mode": guess_mode,
                  "strict": strict, "warnings": [slow] * bool(slow) + warnings, **pipe.report(),
                  "seconds": {"check": round(t0 - t_start, 3), "load": round(t1 - t0, 3),
                              "generate": round(t2 - t1, 3), "total": round(t2 - t_start, 3),
                              "stages": pipe.stages, "run": pipe.run_stages}}
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            for line in ([pipe.device_warning] if pipe.device_warning else []) + warnings:
                click.echo(f"warning: {line}", err=True)
            describe_where(report, sys.stdout)
            how = "" if mode == "txt2img" else f"{mode} from {init_image}, strength {used_strength:g}, "
            click.echo(f"wrote {out} ({how}{w}x{h}, {n_steps} steps, seed {seed}, {used_scheduler}, guidance "
                       f"{used_guidance:g}) in {report['seconds']['load']:.1f} s load + "
                       f"{report['seconds']['generate']:.1f} s")
    run_cli(go, as_json)
