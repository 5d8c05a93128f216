"""`precast generate --from-png`: a PNG's precast record (runtime/metadata.py png_record) as generate's options.

Owns: which options a record sets (its settings, its bundle's path, where each module ran), each unless given on
the command line (a hires or ControlNet option given replaces the recorded ones), the input images it names only
by their pixels asked for again, and the lines saying what differs from the recorded run. Used by
runtime/run_commands.py's generate.
Imports the runtime's own modules only; never the compiler.
"""
from __future__ import annotations

from .assign import module_of
from .errors import UserError

RERUN = ("bundle", "prompt", "negative", "steps", "seed", "size", "guidance", "scheduler", "schedule", "strength",
         "controlnet_names", "control_starts", "control_ends", "guess_mode", "backend", "hires_scale", "hires_size",
         "hires_steps", "hires_denoise", "hires_upscaler", "vae_tiling", "vae_tile")
HIRES_OPTIONS = {"hires_scale", "hires_size", "hires_steps", "hires_denoise", "hires_upscaler"}
CONTROL_OPTIONS = {"controls", "controlnet_names", "control_starts", "control_ends", "guess_mode"}


def _size(value):
    """A recorded size: "WxH" as the record writes it, or none; anything else is a damaged record."""
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"size {value!r} is not \"WIDTHxHEIGHT\"")


def rerun_options(record: dict, given: set[str], png: str) -> dict:
    """The options a --from-png record sets (runtime/metadata.py png_record): its settings, its bundle's path
    and where each module ran (--backend MODULE=DEVICE:BACKEND), each unless given on the command line (a hires
    option given replaces the recorded hires fix: its others keep their defaults). The record names input images by their pixels only: an img2img / inpainting / ControlNet run needs
    --init-image, --mask, --control given again (one UserError otherwise; check_recorded compares them)."""
    s = record["settings"]
    try:
        nets = s.get("controls") or []
        where: dict[str, str] = {}
        for comp, w in (record.get("components") or {}).items():
            if w.get("device") and w.get("backend"):
                where.setdefault(module_of(comp), f"{w['device']}:{w['backend']}")
        out = {"bundle": record["bundle"].get("path"), "prompt": s["prompt"], "negative": s.get("negative", ""),
               "steps": s.get("steps"), "seed": s.get("seed", 0), "size": _size(s.get("size")),
               "guidance": s.get("guidance"), "scheduler": s.get("scheduler"), "schedule": s.get("schedule"),
               "strength": s.get("strength"), "controlnet_names": tuple(c["controlnet"] for c in nets),
               "control_starts": tuple(c["start"] for c in nets), "control_ends": tuple(c["end"] for c in nets),
               "guess_mode": bool(s.get("guess_mode")),
               "backend": ",".join(f"{m}={v}" for m, v in where.items()) or None}
        hires, tiling = s.get("hires") or {}, s.get("vae_tiling") or {}
        out.update(hires_scale=hires.get("scale"), hires_size=None if hires.get("scale") else _size(hires.get("size")),
                   hires_steps=hires.get("steps"), hires_denoise=hires.get("denoise"),
                   hires_upscaler=hires.get("upscaler"), vae_tiling=tiling.get("forced"), vae_tile=tiling.get("tile"))
        scales = ", ".join(f"{c['controlnet']} at scale {c['scale']:g}" for c in nets)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"--from-png {png}: its precast record is damaged ({type(e).__name__}: {e})") from None
    if "scheduler" in given:        # a sampler given anew takes its own default schedule (or the one it names)
        given = given | {"schedule"}
    if given & CONTROL_OPTIONS:
        given = given | CONTROL_OPTIONS
    if given & HIRES_OPTIONS:
        given = given | HIRES_OPTIONS
    missing = [option for option, key in (("--init-image", "init_image"), ("--mask", "mask"))
               if s.get(key) and key not in given]
    if missing:
        raise UserError(f"--from-png {png}: was made by {s.get('mode')} from images its record names only by their "
                        f"pixels' sha256; give {' '.join(f'{o} FILE' for o in missing)} again")
    if nets and "controls" not in given:
        raise UserError(f"--from-png {png}: was made with ControlNets ({scales}), whose control images its record "
                        "names by their pixels only; give --control IMAGE:SCALE (and --controlnet, --control-start, "
                        "--control-end, --guess-mode as then) again")
    return {k: v for k, v in out.items() if k not in given}


def rerun_warnings(record: dict, image, png: str) -> list[str]:
    """What differs from the run a --from-png record names, one line each: a component that ran elsewhere
    (another artifact, backend or device), an input image with other pixels; the image may differ."""
    now = image.made_with.get("components", {})
    out = []
    for comp, then in (record.get("components") or {}).items():
        if comp in now and now[comp] != then:
            out.append(f"--from-png {png}: {comp} ran {now[comp].get('artifact')} via {now[comp].get('backend')} on "
                       f"{now[comp].get('device')}, not {then.get('artifact')} via {then.get('backend')} on "
                       f"{then.get('device')} as recorded: the image may differ")
    then, given = record["settings"], image.inputs
    pairs = [("--init-image", then.get("init_image"), given.get("init_image")), ("--mask", then.get("mask"),
             given.get("mask"))] + [("--control", (a or {}).get("image"), (b or {}).get("image")) for a, b in
                                    zip(then.get("controls") or [], given.get("controls") or [])]
    out += [f"--from-png {png}: {option} has other pixels than the image it was made from: the image will differ"
            for option, a, b in pairs if a and b and a.get("sha256") != b.get("sha256")]
    return out
