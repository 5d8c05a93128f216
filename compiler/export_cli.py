"""The export commands of `precast`: export (a checkpoint to ONNX), compile (an export folder's engines),
demo-model (a tiny checkpoint of a family) and export-openvino-genai.

Owns: their argument parsing (--set, --lora PATH:STRENGTH, --controlnet PATH:NAME, --option KEY=VALUE),
progress and `--json` output, and the remote-cache options compile shares with build (remote_cache_options,
open_cache: compiler/remote_cache.py); the work is compiler/export.py's, engines.py's, demo_families.py's and
openvino_genai.py's, imported when a command runs so that `precast --help` stays fast.
"""
from __future__ import annotations

import json
import os

import click

from ..runtime.cli_support import registry_options, run_cli as _run  # user mistakes -> one line + exit 2; bugs -> trace + exit 1
from .demo_families import DEFAULT as DEMO_DEFAULT
from .demo_families import FAMILIES as DEMO_FAMILIES
from .demo_families import write_demo_file
from .errors import BadInput


def _parse_sets(values: tuple[str, ...]) -> dict:
    import yaml
    from .families import set_problem
    out: dict = {}
    for item in values:
        key, eq, raw = item.partition("=")
        if not eq or "." not in key:
            raise BadInput(f"--set {item!r}: expected COMPONENT.FIELD=VALUE, e.g. unet.num_heads=8")
        comp, field = key.split(".", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw  # not a YAML value: judged as the string it is
        problem = set_problem(comp, field, value)
        if problem:
            raise BadInput(f"--set {item}: {problem}")
        out.setdefault(comp, {})[field] = value
    return out


def _parse_controlnet(item: str) -> tuple[str, str | None]:
    """'PATH' or 'PATH:NAME' (a path may itself hold ':'; the tail is a name only when PATH exists and ITEM does not)."""
    path, colon, tail = item.rpartition(":")
    if colon and path and not os.path.lexists(item) and os.path.exists(path):
        return path, tail
    return item, None


def _parse_lora(item: str) -> tuple[str, float]:
    """'PATH' or 'PATH:STRENGTH' (a path may itself hold ':'; only a trailing number is a strength)."""
    path, colon, tail = item.rpartition(":")
    if colon and path:
        try:
            return path, float(tail)
        except ValueError:
            if not os.path.lexists(item) and os.path.isfile(path):
                raise BadInput(f"--lora {item}: strength {tail!r} is not a number; write PATH:0.8") from None
    return item, 1.0


def _names(io: list[dict], most: int = 6) -> str:
    """A component's input or output names, the first `most` of them and how many more (a tiled VAE has dozens)."""
    names = [i["name"] for i in io]
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


@click.command("export")
@click.argument("checkpoint", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(), help="Output folder (optimum-onnx layout).")
@click.option("--component", "components", multiple=True,
              help="Component to export (repeatable): text_encoder, text_encoder_2, text_encoder_3 (SD3's T5), unet (SD) "
                   "or transformer (Flux, Chroma, SD3), vae_encoder, vae_decoder, vae_encoder_tiled, "
                   "vae_decoder_tiled (exact tiling; only when named). Default: all present.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Weights and activations; norms, softmax and RoPE stay fp32 inside the graph.")
@click.option("--set", "sets", multiple=True, metavar="COMPONENT.FIELD=VALUE",
              help="Override what the weights cannot say, e.g. unet.num_heads=8, text_encoder.num_heads=12.")
@click.option("--vae-dtype", type=click.Choice(["auto", "fp32", "fp16", "bf16"]), default="auto", show_default=True,
              help="VAE precision; auto = --dtype, except fp32 for SDXL, Flux/Chroma and SD3 (their VAEs overflow in fp16).")
@click.option("--vae", type=click.Path(), default=None,
              help="A separate VAE replacing the checkpoint's: .safetensors (LDM or diffusers names) or a vae/ folder.")
@click.option("--text-encoder", "--text-encoder-2", "text_encoders", multiple=True, type=click.Path(),
              help="A separate text encoder (T5-XXL, CLIP-L or CLIP-G .safetensors, recognised by its tensors; "
                   "repeatable), e.g. Flux's t5xxl_fp16.safetensors, SD3's clip_g.safetensors.")
@click.option("--lora", "loras", multiple=True, metavar="PATH[:STRENGTH]",
              help="Merge a LoRA / LyCORIS file into the weights (repeatable; strength default 1.0).")
@click.option("--lora-te-strength", type=float, default=None,
              help="Strength for the text-encoder part of every --lora (default: each LoRA's own strength).")
@click.option("--allow-unmatched", is_flag=True,
              help="Merge a LoRA even when some of its tensors name no weight of the model (they are listed).")
@click.option("--controlnet", "controlnets", multiple=True, metavar="PATH[:NAME]",
              help="A ControlNet (LDM .safetensors or diffusers folder/file) exported beside the model as "
                   "controlnet_NAME (default: the file's name); the UNet then takes its residuals. Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def export_cmd(checkpoint, out, components, dtype, sets, vae_dtype, vae, text_encoders, loras, lora_te_strength,
               allow_unmatched, controlnets, as_json):
    """Export CHECKPOINT (.safetensors file or diffusers folder) to ONNX, without torch."""
    def go():
        from .export import export
        specs = [(*_parse_lora(item), lora_te_strength) for item in loras]
        report = export(checkpoint, out, list(components) or None, dtype, _parse_sets(sets), progress=True,
                        vae_dtype=vae_dtype, loras=specs, allow_unmatched=allow_unmatched,
                        warn=lambda msg: click.echo(f"warning: {msg}", err=True), vae=vae,
                        text_encoders=text_encoders, controlnets=[_parse_controlnet(c) for c in controlnets])
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            for c in report["components"]:
                size = sum(c["files"].values())
                click.echo(f"{c['name']:<13} {size / 1e6:9.1f} MB  {_names(c['inputs'])} -> {_names(c['outputs'])}")
            click.echo(f"{report['family']} {report['dtype']} -> {report['out']} in {report['seconds']:.1f} s")
    _run(go, as_json=as_json)


@click.command("demo-model")
@click.option("--out", "out", required=True, type=click.Path(), help="Where to write the .safetensors file.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1), help="0 or more.")
@click.option("--family", default=DEMO_DEFAULT, show_default=True, type=click.Choice(list(DEMO_FAMILIES)),
              help="Which tiny model: a checkpoint of that family, or a ControlNet / LoRA for the tiny SD 1.x.")
def demo_model_cmd(out, seed, family):
    """Write a tiny model with seeded random weights in the real key layout (the embedded default: a tiny
    SD 1.x checkpoint), and print a recipe that builds it."""
    def go():
        if os.path.isdir(out):
            raise BadInput(f"--out {out}: is a folder; give a file path such as {os.path.join(out, 'tiny.safetensors')}")
        if not out.endswith(".safetensors"):
            raise BadInput(f"--out {out}: the demo model is a .safetensors file; give a name ending in .safetensors")
        recipe = write_demo_file(family, os.path.abspath(out), seed=seed)
        click.echo(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB, {DEMO_FAMILIES[family].label}, seed {seed}); "
                   "a recipe that builds it (save it as FILE.yaml, then `precast build FILE.yaml --out BUNDLE`):")
        click.echo(recipe)
    _run(go)


def _options(values: tuple[str, ...]) -> dict:
    import yaml
    out = {}
    for item in values:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise BadInput(f"--option {item!r}: expected KEY=VALUE, e.g. weight_streaming=true")
        try:
            out[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            out[key] = raw  # not a YAML value: the target judges it as the string it is
    return out


COMPILE_JSON_HELP = ("Print one JSON document on stdout: {\"artifacts\": [one record per artifact: component, "
                     "backend, target, cache (hit|remote|miss), seconds, key, fingerprint, path (cache entry folder), "
                     "artifact (its main file), entry, size; remote (hit|pushed|miss) with a remote cache], "
                     "\"cache\": FOLDER[, \"remote_cache\": {ref, pulled, pushed, bytes, warnings}]}. Progress "
                     "stays on stderr.")


def remote_cache_options(fn):
    """--remote-cache REF, --[no-]remote-cache-push, --remote-cache-strict (compiler/remote_cache.py), and the
    registry's --ca / --plain-http."""
    fn = registry_options(fn)
    fn = click.option("--remote-cache-strict", "remote_strict", is_flag=True,
                      help="Make the remote cache's warnings (registry unreachable, credentials refused, a damaged "
                           "entry) errors; also PRECAST_REMOTE_CACHE_STRICT=1.")(fn)
    fn = click.option("--remote-cache-push/--no-remote-cache-push", "remote_push", default=None,
                      help="Push what is built here to the remote cache (default: on, unless "
                           "PRECAST_REMOTE_CACHE_PUSH=0): off makes it read-only, e.g. for pull-request builds.")(fn)
    return click.option("--remote-cache", "remote_ref", default=None, metavar="REF",
                        help="oci://HOST/REPO: look each export and engine up there by its cache key before building "
                             "it, and push what is built (default: PRECAST_REMOTE_CACHE). A registry that cannot be "
                             "reached is a warning and everything is built here.")(fn)


def open_cache(remote_ref, remote_push, remote_strict):
    """The local cache, with the remote cache the options or the environment name."""
    from .cache import Cache
    from .remote_cache import remote_cache
    return Cache(remote=remote_cache(remote_ref, remote_push, remote_strict or None))


def say_remote(cache) -> None:
    """One line on stdout: what the remote cache gave and took."""
    if cache.remote is not None:
        s = cache.remote.summary()
        click.echo(f"remote cache {s['ref']}: {s['pulled']} pulled ({s['bytes_downloaded'] / 1e6:.1f} MB), "
                   f"{s['pushed']} pushed ({s['bytes_uploaded'] / 1e6:.1f} MB)"
                   + ("" if s["push"] else ", pushing off") + (f", {len(s['warnings'])} warnings" if s["warnings"] else ""))


@click.command("compile")
@click.argument("export_dir", type=click.Path())
@click.option("--target", "targets", multiple=True, required=True, metavar="BACKEND[:ARG]",
              help="onnxruntime | openvino[:CPU|GPU] | tensorrt-rtx[:sm_86,sm_89] | migraphx:GFX (repeatable). "
                   "Compute capabilities may be spelled sm_86, sm86, 86 or 8.6 (one cache entry).")
@click.option("--component", "components", multiple=True, help="Components to compile (default: all exported).")
@click.option("--batch", default="1", show_default=True, help="N or MIN:OPT:MAX (images per prompt).")
@click.option("--height", default="512", show_default=True, help="Pixels: N or MIN:OPT:MAX.")
@click.option("--width", default="512", show_default=True, help="Pixels: N or MIN:OPT:MAX.")
@click.option("--tokens", default="77", show_default=True, help="CLIP text length: N or MIN:OPT:MAX.")
@click.option("--t5-tokens", default=None, help="T5 text length (Flux, Chroma): N or MIN:OPT:MAX "
              "(default: the export's, e.g. 512 for Flux dev, 256 for schnell).")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Target option, e.g. precision=f32, weight_streaming=true, ir=true.")
@remote_cache_options
@click.option("--json", "as_json", is_flag=True, help=COMPILE_JSON_HELP)
def compile_cmd(export_dir, targets, components, batch, height, width, tokens, t5_tokens, options, remote_ref,
                remote_push, remote_strict, as_json):
    """Build engines for an export folder, through the cache.

    Every target x component is checked first (files, dtype, options, backend installed, device
    present, shapes): a combination that cannot be built stops the command in one line before
    anything is built."""
    def go():
        from .engines import compile_component, export_latent_factor, export_t5_tokens, preflight, read_export
        from .profiles import ShapeProfile, parse_range
        from .targets import parse_target
        comps = read_export(export_dir)
        names = list(components) or list(comps)
        for n in names:
            if n not in comps:
                raise BadInput(f"--component {n!r}: {export_dir} has {', '.join(comps)}")
        if t5_tokens is None:
            t5 = export_t5_tokens(export_dir)
            t5_range = (t5, t5, t5) if t5 else None
        else:
            t5_range = parse_range(t5_tokens, "--t5-tokens")
            if not any(d in i["shape"] for n in names for i in comps[n].inputs
                       for d in ("t5_sequence", "text_sequence", "llm_sequence")):
                raise BadInput(f"--t5-tokens {t5_tokens}: none of {', '.join(names)} reads T5 tokens "
                               "(only Flux / Chroma / SD3's T5 and transformer do): drop it")
        profile = ShapeProfile(parse_range(batch, "--batch"), parse_range(height, "--height"),
                               parse_range(width, "--width"), parse_range(tokens, "--tokens"), t5_range,
                               latent_factor=export_latent_factor(export_dir))
        specs = [parse_target(t, _options(options)) for t in targets]
        cache = open_cache(remote_ref, remote_push, remote_strict)
        for spec in specs:          # every combination refused now, before the first build
            for n in names:
                preflight(comps[n], spec, profile)
        records = []
        for spec in specs:
            for n in names:
                rec, _ = compile_component(comps[n], spec, profile, cache, progress=True)
                records.append(rec)
                if not as_json:
                    click.echo(f"{rec['cache']:<6} {rec['component']:<13} {rec['target']:<28} "
                               f"{rec['size'] / 1e6:8.1f} MB {rec['seconds']:7.2f} s  {rec['key'][:12]}")
                    note_evicted(rec)
        if as_json:
            click.echo(json.dumps({"artifacts": records, "cache": str(cache.root),
                                   **({"remote_cache": cache.remote.summary()} if cache.remote else {})}, indent=2))
        else:
            say_remote(cache)
    _run(go, as_json=as_json)


def note_evicted(record: dict) -> None:
    """A cache entry found damaged is rebuilt: said on stderr, with why."""
    if record.get("evicted"):
        click.echo(f"note: cache entry {record['key'][:12]} ({record['component']}) was damaged "
                   f"({record['evicted']}); rebuilt", err=True)


@click.command("export-openvino-genai")
@click.argument("export_dir", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="OpenVINO GenAI model folder to write.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def export_openvino_genai_cmd(export_dir, out, as_json):
    """Write EXPORT_DIR (a `precast export`) as an OpenVINO GenAI folder (optimum-cli's OpenVINO layout)
    that openvino_genai.Text2ImagePipeline(OUT, device) runs: SD 1.x / 2.x and SDXL with the Euler scheduler,
    SD3 / SD3.5, Flux, FLUX.2 klein, Z-Image and Qwen-Image with the export's flow-matching schedule; Chroma
    and FLUX.2 dev are refused (GenAI has no pipeline for them)."""
    def go():
        from .openvino_genai import export_openvino_genai
        report = export_openvino_genai(export_dir, out, progress=None if as_json else
                                       (lambda msg: click.echo(msg, err=True)))
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            click.echo(f"{report['family']} -> {report['out']} (OpenVINO GenAI, {report['scheduler']}) "
                       f"in {report['seconds']:.1f} s")
    _run(go, as_json=as_json)
