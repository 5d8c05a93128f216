"""The runtime's `precast generate` (registered on the group in runtime/cli.py; `precast doctor` is
runtime/doctor_command.py's), built on the Python API (runtime/api.py: open_bundle, Bundle.pipeline): every
option checked before anything loads, in the options' own words (runtime/checks.py and runtime/generate.py, the
API's checks); its text and JSON reports; its images written one PNG each (OUT-0001.png ... for several) with
their metadata, and `--from-png` (a PNG's precast record as the options: runtime/rerun.py); the hires fix's and
VAE tiling's options (runtime/hires.py, runtime/vae_tiling.py); the help texts and size default doctor shares.
"""
from __future__ import annotations

import json
import os
import sys
import time

import click
from click.core import ParameterSource

from . import images
from .assign import parse_assignment
from .checks import (check_batch, check_count, check_guidance, check_out, check_seed, check_steps, check_text,
                     check_vae_tiling, write_image)
from .cli_support import registry_options, run_cli
from .control import parse_control, plan_controls
from .errors import UserError
from .families import FAMILIES, family_of
from .generate import check_image_mode, check_scheduler, unused_negative
from .hires import DEFAULTS as HIRES_DEFAULTS, UPSCALERS, check_hires
from .sampler_names import SCHEDULES, parse_sampler, parse_schedule
from .image_size import MAX_SIDE, latent_factor, optimal_size, parse_size, size_warning
from .metadata import manifest_sha256, png_record
from .previews import METHODS, check_preview
from .report import describe_where
from .rerun import RERUN, rerun_options, rerun_warnings

# every family's sampler names, for --scheduler's choices (checked against the bundle's family later)
SCHEDULERS = list(dict.fromkeys(s for f in FAMILIES.values() for s in f.samplers))


class NameOf(click.ParamType):
    """A sampler or sigma schedule as runtime/sampler_names.py reads it (precast's, A1111's or ComfyUI's
    name), refused as click refuses a choice; kept as typed (the family's check maps it)."""
    name = "name"

    def __init__(self, parse, names: list[str], example: str):
        self.parse, self.names, self.example = parse, names, example

    def convert(self, value, param, ctx):
        if value is None or self.parse(value) is not None:
            return value
        self.fail(f"{value!r} is not one of {', '.join(map(repr, self.names))}; A1111's and ComfyUI's names work "
                  f"too, e.g. {self.example}", param, ctx)


BACKEND_HELP = ("Where each module runs: DEVICE, BACKEND or DEVICE:BACKEND, per module or for all, e.g. "
                "te=cpu,unet=gpu0 | all=openvino | unet=onnxruntime | te=cpu:onnxruntime. A device that is not here "
                "falls back with the reason (see --strict).")
STRICT_HELP = ("Run every module where --backend puts it (device and backend) or exit 2: no fallback, not even past "
               "a damaged engine (without --strict: a warning, and the next candidate runs).")
VERIFY_HELP = ("auto: hash each bundle file once per file state (a recorded match is trusted while the file's "
               "device, inode, size, mtime and ctime are unchanged); full: hash every file again (and refresh "
               "the records).")


def size_of(size: str | None, manifest) -> tuple[int, int]:
    return parse_size(size, manifest) if size else optimal_size(manifest)


def out_paths(out, n: int) -> list:
    """Where generate writes n images: --out itself for one, else OUT-0001.png, OUT-0002.png, ... beside it
    (numbered in seed order), each checked as --out is."""
    path = check_out(out)
    if n == 1:
        return [path]
    return [check_out(str(path.with_name(f"{path.stem}-{i:04d}{path.suffix}"))) for i in range(1, n + 1)]


@click.command("generate")
@click.argument("bundle", required=False, type=click.Path())
@click.option("--prompt", default=None, help="What to generate (required, unless --from-png gives it).")
@click.option("--negative", default="", show_default=True)
@click.option("--steps", default=None, type=int, help="Denoising steps (default: SD 20; Flux dev 28, schnell 4; Chroma 35; "
                   "SD3 28, SD3.5 40, 3.5-large-turbo 4).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Noise seed: 0 or more (negative seeds are refused, not wrapped). Several images take SEED, "
                   "SEED+1, ... in order, as A1111 numbers them.")
@click.option("--batch", default=1, show_default=True, type=int,
              help="Images per run, each from its own seed (image i equals the single image of SEED+i): one "
                   "denoiser call where the bundle's engines take the batch (recipe profiles.batch), else in as "
                   "many calls as they need.")
@click.option("--count", default=1, show_default=True, type=int,
              help="Runs, one after another: BATCH x COUNT images, the seeds continuing from run to run.")
@click.option("--from-png", "from_png", default=None, type=click.Path(),
              help="Rerun the generation recorded in a PNG that precast wrote (its 'precast' text chunk: the "
                   "bundle, the settings, where each module ran); options given here override the record, BUNDLE "
                   "defaults to the recorded bundle's path. The same bundle on the same kind of machine makes the "
                   "same PNG. img2img, inpainting and ControlNet PNGs need --init-image, --mask, --control again "
                   "(the record names images by their pixels only).")
@click.option("--size", default=None,
              help=f"WIDTHxHEIGHT in pixels (default: the bundle's optimal size, its denoiser profile's opt): "
                   f"multiples of the bundle's pixels per latent (8 for SD; 16 for Flux / Chroma / SD3, which read 2x2 latent patches), "
                   f"at most {MAX_SIDE} per side (or the bundle's largest profile).")
@click.option("--guidance", default=None, type=float,
              help="Guidance scale (finite): classifier-free for SD (default 7.5), Chroma (5.0) and SD3 (7.0; SD3.5 "
                   "4.5; turbo 1.0 = none); Flux dev's "
                   "distilled guidance (3.5); unused by schnell.")
@click.option("--scheduler", default=None,
              type=NameOf(parse_sampler, SCHEDULERS, "'Euler a', 'DPM++ 2M Karras', 'dpmpp_2m_sde'"),
              help="Sampler. SD: euler (default), euler-a, heun, dpm2, dpm2-a, dpm++2m, dpm++2m-sde, dpm++sde, "
                   "ddim, unipc, lcm; Flux / Chroma / SD3: flow-euler (default), flow-heun, flow-dpm++2m (euler, "
                   "heun, dpm++2m name them there). A1111's and ComfyUI's names work too, A1111's with the "
                   "schedule in it ('DPM++ 2M Karras'). Samplers that add noise draw it from the seed.")
@click.option("--schedule", default=None,
              type=NameOf(parse_schedule, list(SCHEDULES), "'Karras', 'SGM Uniform', 'sgm_uniform'"),
              help="SD's sigma schedule: normal (default: the model's own spacing), karras, exponential, "
                   "sgm-uniform (DDIM: normal or sgm-uniform; LCM: its own). Flow-matching models keep theirs.")
@click.option("--init-image", "init_image", default=None, type=click.Path(),
              help="img2img (SD 1.x/2.x/XL, Flux, SD3, Z-Image, Qwen-Image): start from this PNG, encoded by the bundle's VAE encoder. Without "
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
@click.option("--hires-scale", "hires_scale", default=None, type=float,
              help="Hires fix (A1111's 'Hires upscale'; SD 1.x/2.x/XL): make the image at --size, upscale it by this "
                   "factor (floored to multiples of 8), then run img2img at that size. The bundle's denoiser "
                   "profiles must cover it (refused otherwise).")
@click.option("--hires-size", "hires_size", default=None, metavar="WIDTHxHEIGHT",
              help="Hires fix to this size instead of a scale ('Hires resize'; another aspect ratio is "
                   "centre-cropped).")
@click.option("--hires-steps", "hires_steps", default=None, type=int,
              help="The hires pass's steps, of which it runs int(steps x denoise) as img2img does (default: --steps).")
@click.option("--hires-denoise", "hires_denoise", default=None, type=float,
              help="The hires pass's denoising strength, more than 0 and at most 1 "
                   f"(default {HIRES_DEFAULTS['denoise']}).")
@click.option("--hires-upscaler", "hires_upscaler", default=None, metavar="NAME",
              help=f"{', '.join(UPSCALERS)} (default {HIRES_DEFAULTS['upscaler']}): latent upscales the latents "
                   "(bilinear, A1111's 'Latent'; nearest-exact: 'Latent (nearest-exact)'); bilinear decodes the image, "
                   "resizes it (PIL's BILINEAR) and encodes it again (needs the VAE encoder). A1111's names work too.")
@click.option("--vae-tiling/--no-vae-tiling", "vae_tiling", default=None,
              help="Decode (and encode) with the VAE in overlapping, blended tiles -- exactly, segment by segment, "
                   "where the bundle has a vae_decoder_tiled / vae_encoder_tiled. Default: only when the image is past the VAE engine's "
                   "profile (its engine then decodes it in tiles, no rebuild) or its device's memory; --no-vae-tiling "
                   "never.")
@click.option("--vae-tile", "vae_tile", default=None, type=int, metavar="PIXELS",
              help="The VAE tiles' side in pixels when tiling (default 512, within the engine's profile); they overlap "
                   "by a quarter.")
@click.option("--out", required=True, type=click.Path(),
              help="PNG file to write, with the generation's parameters (A1111's 'parameters' text chunk) and "
                   "precast's record ('precast', JSON); several images: OUT-0001.png, OUT-0002.png, ... (OUT "
                   "less .png), in seed order.")
@click.option("--preview", default=None, type=click.Path(),
              help="PNG file rewritten after every denoising step with a preview of the image so far (a temp file "
                   "renamed into place, for a UI that polls it), at the output's size; with --batch, the first "
                   "image of each denoiser call.")
@click.option("--preview-method", default="auto", show_default=True, type=click.Choice(METHODS),
              help="latent2rgb: the family's linear latent -> RGB projection (ComfyUI's factors; upscaled, nearest); "
                   "taesd: the bundle's preview decoder (recipe `preview:`, a TAESD file); auto: taesd where the "
                   "bundle has one, else latent2rgb.")
@click.option("--backend", default=None, help=BACKEND_HELP)
@click.option("--params-backend", default=None, help="Where weights live, e.g. cpu (offload); memory budgets as DEVICE:SIZE, e.g. cuda0:8G,cpu:16G.")
@click.option("--strict", is_flag=True, help=STRICT_HELP)
@click.option("--verify", "verify", default="auto", show_default=True,
              type=click.Choice(["auto", "full"], case_sensitive=False), help=VERIFY_HELP)
@click.option("--sysroot", default="/", hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print what ran where, and the settings, as JSON (errors too).")
@registry_options
def generate_cmd(bundle, prompt, negative, steps, seed, batch, count, from_png, size, guidance, scheduler, schedule,
                 init_image,
                 mask, strength, controls, controlnet_names, control_starts, control_ends, guess_mode, out,
                 backend, params_backend, strict, sysroot, as_json, verify, preview, preview_method, hires_scale,
                 hires_size, hires_steps, hires_denoise, hires_upscaler, vae_tiling, vae_tile):
    """Text to image with BUNDLE (or img2img with --init-image, inpainting with --mask), each module on
    its device; prints what ran where."""
    ctx = click.get_current_context()
    given = {k for k in ctx.params if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}

    def go():
        nonlocal bundle, prompt, negative, steps, seed, size, guidance, scheduler, schedule, strength, \
            controlnet_names, control_starts, control_ends, guess_mode, backend, hires_scale, hires_size, \
            hires_steps, hires_denoise, hires_upscaler, vae_tiling, vae_tile
        from .api import open_bundle              # the CLI's start does not load the API
        t_start = time.perf_counter()
        record = png_record(from_png) if from_png else None
        if record is not None:      # the recorded settings, each unless given on the command line
            rerun = rerun_options(record, given, from_png)
            bundle, prompt, negative, steps, seed, size, guidance, scheduler, schedule, strength, controlnet_names, \
                control_starts, control_ends, guess_mode, backend, hires_scale, hires_size, hires_steps, \
                hires_denoise, hires_upscaler, vae_tiling, vae_tile = (rerun.get(k, ctx.params[k]) for k in RERUN)
            if "bundle" in rerun and not os.path.isdir(bundle or ""):
                raise UserError(f"--from-png {from_png}: was made with bundle {record['bundle'].get('name')!r} at "
                                f"{bundle}, which is not here; give the BUNDLE")
        if not bundle:
            raise UserError("BUNDLE: give the bundle folder (or --from-png FILE, whose record names it)")
        if prompt is None:
            raise UserError("--prompt: say what to generate (or give --from-png FILE, whose record has it)")
        # Every option is checked here, in its own words, before any engine is verified or loaded.
        if steps is not None:
            check_steps(steps)
        check_seed(seed)
        check_batch(batch)
        check_count(count)
        if guidance is not None:
            check_guidance(guidance)
        parse_assignment(backend, "--backend")
        parse_assignment(params_backend, "--params-backend")
        check_text(prompt, "--prompt")
        check_text(negative, "--negative")
        api = open_bundle(bundle, verify=verify.lower(), sysroot=sysroot, backend=backend)
        manifest, family = api.manifest, family_of(api.manifest)
        other = [(f"--from-png {from_png} was made with another bundle ({record['bundle'].get('name')!r}, another "
                  "manifest.json): the image will differ")] \
            if record is not None and manifest_sha256(manifest) != record["bundle"].get("manifest_sha256") else []
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
            w, h = size_of(size, manifest)
        else:                       # the init image's own size
            iw, ih = images.output_size(init_px, "--init-image", init_image, latent_factor(manifest))
            try:
                w, h = parse_size(f"{iw}x{ih}", manifest)
            except UserError as e:
                raise UserError(f"--init-image {init_image} sets the output size: {e}; give --size") from None
        sched, kind = check_scheduler(scheduler, manifest, schedule=schedule)
        vae_tiling, vae_tile = check_vae_tiling(vae_tiling, vae_tile, latent_factor(manifest))
        hires = check_hires(manifest, family, (w, h), hires_scale, hires_size, hires_steps, hires_denoise,
                            hires_upscaler, family.steps if steps is None else steps)
        if hires and (mode != "txt2img" or plan):
            raise UserError(f"{'--hires-scale' if hires.scale else '--hires-size'}: the hires fix is a txt2img option "
                            "(A1111's): leave out --init-image, --mask and --control")
        unused = unused_negative(manifest) if negative else None
        if unused:
            click.echo(f"warning: --negative {unused}", err=True)
        outs = out_paths(out, batch * count)
        on_preview, method = None, "auto"
        if preview:
            path, method = check_out(preview, "--preview"), check_preview(
                preview_method, manifest.components, family.latent_rgb, "--preview-method ")
            on_preview = lambda done, total, px: write_image(path, px, "--preview")   # noqa: E731
        elif "preview_method" in given:
            raise UserError("--preview-method: says how --preview FILE is made; give --preview too")
        slow = size_warning(manifest, w, h)     # said now, before the run-time compile it warns of
        if slow and not as_json:
            click.echo(f"warning: {slow}", err=True)
        t0 = time.perf_counter()
        pipeline = api.pipeline(backend, params_backend=params_backend, size=(w, h), strict=strict,
                                image_input=mode != "txt2img" or bool(hires and not hires.latent),
                                controlnets=[c.component[len("controlnet_"):] for c in plan], vae_tiling=vae_tiling,
                                vae_tile=vae_tile)
        t1 = time.perf_counter()
        made, batches = [], []
        for run in range(count):    # each run's images written as soon as they are made
            # the last run lets each component go once its stage is over (the hires fix's passes share them)
            pipeline.pipe.release_after_use = run == count - 1 and not hires
            shots = pipeline.images(prompt, batch=batch, negative=negative, steps=steps, seed=seed + run * batch,
                                    guidance=guidance, scheduler=sched, schedule=kind, show_progress=not as_json,
                                    init_image=init_px, mask=mask_px, strength=strength,
                                    controls=[(c.component[len("controlnet_"):], px, c.scale, c.start, c.end)
                                              for c, px in zip(plan, control_px)], guess_mode=guess_mode,
                                    on_preview=on_preview, preview=method, hires_scale=hires_scale,
                                    hires_size=hires_size, hires_steps=hires_steps, hires_denoise=hires_denoise,
                                    hires_upscaler=hires_upscaler)
            for shot in shots:
                write_image(outs[len(made)], shot.to_uint8(), text=shot.text_chunks())
                made.append(shot)
            batches += pipeline.pipe.batches
        image = made[0]
        t2 = time.perf_counter()
        pipe = pipeline.pipe
        warnings = pipe.prompt_warnings(prompt, negative) + other + \
            (rerun_warnings(record, image, from_png) if record else [])
        report = {"bundle": bundle, "out": out, "prompt": prompt, "negative": negative, "size": f"{w}x{h}",
                  "steps": image.steps, "seed": seed, "scheduler": image.scheduler, "schedule": image.schedule,
                  "guidance": image.guidance,
                  "batch": batch, "count": count, "from_png": from_png,
                  "images": [{"out": str(p), "seed": m.seed} for p, m in zip(outs, made)], "batches": batches,
                  "mode": mode, "init_image": init_image, "mask": mask, "strength": used_strength,
                  "controls": [{"controlnet": c.component[len("controlnet_"):], "image": str(c.image), "scale": c.scale,
                                "start": c.start, "end": c.end} for c in plan], "guess_mode": guess_mode,
                  "hires": image.settings.get("hires"), "vae_tiling": image.vae_tiling,
                  "strict": strict, "warnings": [slow] * bool(slow) + warnings, **pipe.report(),
                  "seconds": {"check": round(t0 - t_start, 3), "load": round(t1 - t0, 3),
                              "generate": round(t2 - t1, 3), "total": round(t2 - t_start, 3),
                              "stages": pipe.stages, "run": pipe.run_stages}}
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            for line in ([pipe.device_warning] if pipe.device_warning else []) + warnings:
                click.echo(f"warning: {line}", err=True)
            for part, t in ((k, v) for k, v in (image.vae_tiling or {}).items() if isinstance(v, dict)):
                if t.get("exact"):
                    click.echo(f"note: VAE {part} ran exactly, tile by tile through its {t['segments']} segments "
                               f"({t['why']})", err=True)
                    continue
                click.echo(f"note: VAE {part} ran in {t['tiles']} tiles of {t['tile']} px, overlapping by "
                           f"{t['overlap']} px ({t['why']})", err=True)
            describe_where(report, sys.stdout)
            how = "" if mode == "txt2img" else f"{mode} from {init_image}, strength {used_strength:g}, "
            if hires:
                how = (f"hires fix from {w}x{h}: {hires.upscaler}, {hires.steps or image.steps} steps at denoise "
                       f"{hires.denoise:g}, ")
            wrote, seeds = (out, f"seed {seed}") if len(made) == 1 else (
                f"{outs[0]} ... {outs[-1].name}",
                f"{len(made)} images: batch {batch} x count {count}, seeds {seed}..{made[-1].seed}")
            sampler = " ".join(x for x in (image.scheduler, image.schedule) if x and x != "normal")
            click.echo(f"wrote {wrote} ({how}{image.size[0]}x{image.size[1]}, {image.steps} steps, {seeds}, {sampler}, guidance "
                       f"{image.guidance:g}) in {report['seconds']['load']:.1f} s load + "
                       f"{report['seconds']['generate']:.1f} s")
    run_cli(go, as_json)
