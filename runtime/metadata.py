"""What a generated PNG says about how it was made, and reading it back: A1111's `parameters` text (the
infotext civitai and the web UIs read) and precast's own record (JSON in a `precast` text chunk: the bundle,
what ran where, the exact settings) that `precast generate --from-png` reruns.

Owns: the chunks' keywords, A1111's sampler names for precast's (`a1111_sampler`) and its hires upscalers'
(`A1111_UPSCALERS`), `parameters_text` (A1111's infotext: the prompt, "Negative prompt: ...", then "Key: value,
..." quoted as A1111 quotes; a hires fix's "Hires upscale" / "Hires resize", "Hires steps", "Hires upscaler" and
"Denoising strength"; VAE tiling only in precast's record, A1111 writes none), `manifest_sha256`,
`made_with`
(the bundle -- name, path, manifest sha256, family, source checkpoint sha256 -- the components' artifact,
backend and device, the precast version), `record_text`, `pixels_digest` (what an input image is recorded
by) and `png_record` (precast's record of a PNG file, checked; one UserError line when it has none).
Nothing time- or machine-random is written: the same image and settings give the same bytes. Standard
library and the runtime's PNG reader and sampler names only.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json

from .errors import UserError
from .png import read_png_text
from .sampler_names import SAMPLERS, SCHEDULES, parse_sampler, parse_schedule

PARAMETERS = "parameters"      # A1111's text chunk
RECORD = "precast"             # precast's JSON record
RECORD_VERSION = 1
# the hires fix's upscalers (runtime/hires.py), precast's name -> A1111's "Hires upscaler"
A1111_UPSCALERS = {"latent": "Latent", "latent-nearest-exact": "Latent (nearest-exact)", "bilinear": "Bilinear"}


def a1111_sampler(name: str, schedule: str | None = None) -> tuple[str, str | None]:
    """(A1111's "Sampler", its "Schedule type" or None) for a precast sampler and sigma schedule, by
    runtime/sampler_names.py's table ("dpm++2m" -> "DPM++ 2M"; flow-matching Euler is "Euler", as Forge
    names it for Flux); a name the table lacks is kept as precast spells it."""
    parsed = parse_sampler(name)
    if parsed is None:
        return name, None
    kind = parse_schedule(schedule) if schedule else parsed[1]
    return SAMPLERS[parsed[0]][0], SCHEDULES[kind][0] if kind else None


def _quote(value) -> str:
    """A1111's infotext quoting: JSON-quoted when the value holds a comma, a colon or a newline."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def parameters_text(settings: dict, made: dict) -> str:
    """A1111's infotext for one image: "PROMPT\\nNegative prompt: NEG\\nSteps: 20, Sampler: Euler, CFG
    scale: 7.5, Seed: 1, Size: 512x512, Model hash: ..., Model: ..., ...". Distilled guidance (Flux) is
    "CFG scale: 1, Distilled CFG Scale: G", as Forge writes it."""
    model = made.get("bundle", {})
    cfg = model.get("guidance") != "distilled"
    sampler, schedule = a1111_sampler(settings["scheduler"], settings.get("schedule"))
    hires = settings.get("hires") or {}
    fields = {"Steps": settings["steps"], "Sampler": sampler, "Schedule type": schedule,
              "CFG scale": float(settings["guidance"]) if cfg else 1.0,
              "Distilled CFG Scale": None if cfg else float(settings["guidance"]),
              "Seed": settings["seed"], "Size": settings["size"],
              "Model hash": (model.get("source_sha256") or "")[:10] or None, "Model": model.get("name"),
              "Denoising strength": settings.get("strength") or hires.get("denoise"),
              "Hires upscale": hires.get("scale"), "Hires resize": None if hires.get("scale") else hires.get("size"),
              "Hires steps": hires.get("steps"),
              "Hires upscaler": A1111_UPSCALERS.get(hires.get("upscaler"), hires.get("upscaler")),
              "Version": f"precast {made.get('precast', '')}".strip()}
    negative = f"\nNegative prompt: {settings['negative']}" if settings.get("negative") else ""
    params = ", ".join(f"{k}: {_quote(v)}" for k, v in fields.items() if v is not None)
    return f"{settings['prompt']}{negative}\n{params}".strip()


def precast_version() -> str:
    try:
        return importlib.metadata.version("precast")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def manifest_sha256(manifest) -> str | None:
    """sha256 of the bundle's manifest.json (which names every file's sha256: the bundle's identity)."""
    try:
        return hashlib.sha256((manifest.root / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


def made_with(manifest, components: dict, distilled: bool) -> dict:
    """The bundle and what ran where, for the record: `components` as the pipeline's report gives them
    ({component: {artifact, backend, device, device_name, ...}}); `distilled`: the family's guidance is
    distilled (no negative prompt), which A1111's text names differently."""
    model = manifest.model
    return {"precast": precast_version(),
            "bundle": {"name": manifest.data.get("name"), "path": str(manifest.root),
                       "manifest_sha256": manifest_sha256(manifest),
                       "family": model.get("family"), "variant": model.get("variant") or "",
                       "source_sha256": model.get("source_sha256"),
                       "guidance": "distilled" if distilled else "classifier-free"},
            "components": {c: {k: w.get(k) for k in ("artifact", "backend", "device", "device_name")}
                           for c, w in components.items()}}


def record_text(record: dict) -> str:
    """The `precast` chunk's text: the record as JSON, keys sorted (deterministic bytes)."""
    return json.dumps({"record": RECORD_VERSION, **record}, sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))


def pixels_digest(pixels) -> str:
    """sha256 of an input image's uint8 pixels and shape (how the record names an init image, mask or
    control image, whatever file it came from)."""
    h = hashlib.sha256(repr(tuple(pixels.shape)).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()


def png_record(path, what: str = "--from-png") -> dict:
    """precast's record of the PNG at `path` (the `precast` chunk, parsed and checked), else one UserError
    naming the file and what it lacks."""
    text = read_png_text(path, what)
    if RECORD not in text:
        other = " (it has A1111 parameters, which do not name the bundle, backends and exact settings)" \
            if PARAMETERS in text else ""
        raise UserError(f"{what} {path}: has no precast record (a '{RECORD}' text chunk){other}; only PNGs that "
                        "precast generate or the Python API's Image.save / png() wrote can be rerun")
    try:
        record = json.loads(text[RECORD])
    except (ValueError, RecursionError) as e:
        raise UserError(f"{what} {path}: its precast record is not JSON ({e}); the file was edited or damaged") \
            from None
    settings = record.get("settings") if isinstance(record, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("prompt"), str) or \
            not isinstance(record.get("bundle"), dict):
        raise UserError(f"{what} {path}: its precast record has no settings or bundle; the file was edited or "
                        "damaged")
    if not isinstance(record.get("record"), int) or record["record"] > RECORD_VERSION:
        raise UserError(f"{what} {path}: its precast record is version {record.get('record')!r}; this precast reads "
                        f"version {RECORD_VERSION} (a newer record needs a newer precast: upgrade)")
    return record
