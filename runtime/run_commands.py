"""The runtime's own commands, `precast doctor` and `precast generate` (registered on the group in
runtime/cli.py), built on the Python API (runtime/api.py: open_bundle, Bundle.plan, Bundle.pipeline):
every option checked before anything loads, in the options' own words (runtime/checks.py and
runtime/generate.py, the API's checks); and their text and JSON reports.
"""
from __future__ import annotations

import json
import sys
import time

import click

from . import images
from .assign import parse_assignment
from .checks import check_guidance, check_out, check_seed, check_steps, check_text, write_image
from .cli_support import run_cli
from .control import parse_control, plan_controls
from .errors import UserError
from .families import FAMILIES, family_of
from .generate import check_image_mode, check_scheduler, unused_negative
from .image_size import MAX_SIDE, latent_factor, optimal_size, parse_size, size_warning
from .loading import timed
from .report import describe_where

# every family's sampler names, for --scheduler's choices (checked against the bundle's family later)
SCHEDULERS = list(dict.fromkeys(s for f in FAMILIES.values() for s in f.samplers))


BACKEND_HELP = ("Where each module runs: DEVICE, BACKEND or DEVICE:BACKEND, per module or for all, e.g. "
                "te=cpu,unet=gpu0 | all=openvino | unet=onnxruntime | te=cpu:onnxruntime. A device that is not here "
                "falls back with the reason (see --strict).")
STRICT_HELP = ("Run every module where --backend puts it (device and backend) or exit 2: no fallback, not even past "
               "a damaged engine (without --strict: a warning, and the next candidate runs).")
VERIFY_HELP = ("auto: hash each bundle file once per file state (a recorded match is trusted while the file's "
               "device, inode, size, mtime and ctime are unchanged); full: hash every file again (and refresh "
               "the records).")


def _size(size: str | None, manifest) -> tuple[int, int]:
    return parse_size(size, manifest) if size else optimal_size(manifest)


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
                api = open_bundle(bundle, verify=verify.lower(), sysroot=sysroot)
            w, h = _size(size, api.manifest)
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
               "size": None, "components": {}, "missing_for_generate": [], "loaded": None,
               "stages": stages}   # one schema, with or without a bundle
        if report is not None:
            out["size"] = f"{w}x{h}"
            out["components"] = {c: p.record() for c, p in report.components.items()}
            out["missing_for_generate"] = list(report.missing_for_generate)
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
        for i, d in enumerate(devices):
            mem = f"{d.memory / 2**30:.1f} GiB" if d.memory else "? GiB"
            click.echo(f"device {i}  {d.id:<7} {d.kind:<10} {d.arch:<14} {mem:>9}  {d.name}"
                       + (f"  driver {d.driver}" if d.driver else ""))
        click.echo("backends  " + (", ".join(f"{k} {v}" for k, v in sorted(installed.items())) or "none"))
        for m_, p in placements.items():
            click.echo(f"assign    {m_:<10} -> {p.target}" + (f" (weights on {p.params.id})" if p.offload else "")
                       + (f"  (fell back: {p.fallback})" if p.fallback else ""))
        if report is not None:
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


@click.command("generate")
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
@click.option("--scheduler", default=None, type=click.Choice(SCHEDULERS, case_sensitive=False),
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
        from .api import open_bundle              # the CLI's start does not load the API
        t_start = time.perf_counter()
        # Every option is checked here, in its own words, before any engine is verified or loaded.
        if steps is not None:
            check_steps(steps)
        check_seed(seed)
        if guidance is not None:
            check_guidance(guidance)
        parse_assignment(backend, "--backend")
        parse_assignment(params_backend, "--params-backend")
        check_text(prompt, "--prompt")
        check_text(negative, "--negative")
        api = open_bundle(bundle, verify=verify.lower(), sysroot=sysroot)
        manifest, family = api.manifest, family_of(api.manifest)
        mode, used_strength = check_image_mode(manifest, init_image is not None, mask is not None, strength,
                                               family.steps if steps is None else steps)
        if controls and not family.controlnets:
            raise UserError(f"--control: ControlNets run with SD 1.x/2.x/XL bundles; this one is {family.name}")
        plan = plan_controls(manifest, [parse_control(c) for c in controls], list(controlnet_names),
                             list(control_starts), list(control_ends))
        if guess_mode and not plan:
            raise UserError("--guess-mode: give a control image with --control")
        control_px = [images.init_image(c.image, f"--control {c.image}") for c in plan]   # read (and so checked) now
        init_px = mask_px = None
        if mode != "txt2img":       # read (and so check) the images before any engine loads
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
        unused = unused_negative(manifest) if negative else None
        if unused:
            click.echo(f"warning: --negative {unused}", err=True)
        out_path = check_out(out)
        slow = size_warning(manifest, w, h)     # said now, before the run-time compile it warns of
        if slow and not as_json:
            click.echo(f"warning: {slow}", err=True)
        t0 = time.perf_counter()
        pipeline = api.pipeline(backend, params_backend=params_backend, size=(w, h), strict=strict,
                                image_input=mode != "txt2img", controlnets=[c.component[len("controlnet_"):]
                                                                            for c in plan])
        t1 = time.perf_counter()
        image = pipeline(prompt, negative=negative, steps=steps, seed=seed, guidance=guidance, scheduler=sched,
                         show_progress=not as_json, init_image=init_px, mask=mask_px, strength=strength,
                         controls=[(c.component[len("controlnet_"):], px, c.scale, c.start, c.end)
                                   for c, px in zip(plan, control_px)], guess_mode=guess_mode)
        write_image(out_path, image.to_uint8())
        t2 = time.perf_counter()
        pipe = pipeline.pipe
        warnings = pipe.prompt_warnings(prompt, negative)
        report = {"bundle": bundle, "out": out, "prompt": prompt, "negative": negative, "size": f"{w}x{h}",
                  "steps": image.steps, "seed": seed, "scheduler": image.scheduler, "guidance": image.guidance,
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
            click.echo(f"wrote {out} ({how}{w}x{h}, {image.steps} steps, seed {seed}, {image.scheduler}, guidance "
                       f"{image.guidance:g}) in {report['seconds']['load']:.1f} s load + "
                       f"{report['seconds']['generate']:.1f} s")
    run_cli(go, as_json)
