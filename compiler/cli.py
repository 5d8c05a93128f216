"""The build commands of `precast` (export, compile, cache, plan, build, bundle, demo-model).

Owns: their argument parsing, progress and `--json` output. The top-level `precast` command
(precast.runtime.cli) loads this module only when one of these commands runs, so the
runtime's commands work without the compiler's dependencies.
"""
from __future__ import annotations

import json
import os
import sys

import click

from ..runtime.cli import run_cli
from .cache_cli import _count, cache_group
from .demo_families import FAMILIES as DEMO_FAMILIES
from .errors import BadInput


_run = run_cli  # user mistakes -> one line + exit 2; bugs -> trace + exit 1


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


@click.group()
@click.version_option(package_name="precast")
def main() -> None:
    """precast: compile diffusion models ahead of time."""


@main.command("export")
@click.argument("checkpoint", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(), help="Output folder (optimum-onnx layout).")
@click.option("--component", "components", multiple=True,
              help="Component to export (repeatable): text_encoder, text_encoder_2, text_encoder_3 (SD3's T5), unet (SD) "
                   "or transformer (Flux, Chroma, SD3), vae_encoder, vae_decoder. Default: all present.")
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
                click.echo(f"{c['name']:<13} {size / 1e6:9.1f} MB  "
                           f"{', '.join(i['name'] for i in c['inputs'])} -> {', '.join(o['name'] for o in c['outputs'])}")
            click.echo(f"{report['family']} {report['dtype']} -> {report['out']} in {report['seconds']:.1f} s")
    _run(go, as_json=as_json)


@main.command("demo-model")
@click.option("--out", "out", required=True, type=click.Path(), help="Where to write the .safetensors file.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1), help="0 or more.")
@click.option("--family", default="sd15", show_default=True, type=click.Choice(list(DEMO_FAMILIES)),
              help="Which tiny model: a checkpoint of that family, or a ControlNet / LoRA for the tiny SD 1.x.")
def demo_model_cmd(out, seed, family):
    """Write a tiny model with seeded random weights in the real key layout (the embedded default: a tiny
    SD 1.x checkpoint), and print a recipe that builds it."""
    def go():
        from .demo_families import write_demo_file
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
                     "backend, target, cache (hit|miss), seconds, key, fingerprint, path (cache entry folder), "
                     "artifact (its main file), entry, size], \"cache\": FOLDER}. Progress stays on stderr.")


@main.command("compile")
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
@click.option("--json", "as_json", is_flag=True, help=COMPILE_JSON_HELP)
def compile_cmd(export_dir, targets, components, batch, height, width, tokens, t5_tokens, options, as_json):
    """Build engines for an export folder, through the cache.

    Every target x component is checked first (files, dtype, options, backend installed, device
    present, shapes): a combination that cannot be built stops the command in one line before
    anything is built."""
    def go():
        from .cache import Cache
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
            if not any(d in i["shape"] for n in names for i in comps[n].inputs for d in ("t5_sequence", "text_sequence")):
                raise BadInput(f"--t5-tokens {t5_tokens}: none of {', '.join(names)} reads T5 tokens "
                               "(only Flux / Chroma / SD3's T5 and transformer do): drop it")
        profile = ShapeProfile(parse_range(batch, "--batch"), parse_range(height, "--height"),
                               parse_range(width, "--width"), parse_range(tokens, "--tokens"), t5_range,
                               latent_factor=export_latent_factor(export_dir))
        specs = [parse_target(t, _options(options)) for t in targets]
        cache = Cache()
        for spec in specs:          # every combination refused now, before the first build
            for n in names:
                preflight(comps[n], spec, profile)
        records = []
        for spec in specs:
            for n in names:
                rec, _ = compile_component(comps[n], spec, profile, cache, progress=True)
                records.append(rec)
                if not as_json:
                    click.echo(f"{rec['cache']:<4} {rec['component']:<13} {rec['target']:<28} "
                               f"{rec['size'] / 1e6:8.1f} MB {rec['seconds']:7.2f} s  {rec['key'][:12]}")
                    _note_evicted(rec)
        if as_json:
            click.echo(json.dumps({"artifacts": records, "cache": str(cache.root)}, indent=2))
    _run(go, as_json=as_json)


def _note_evicted(record: dict) -> None:
    """A cache entry found damaged is rebuilt: said on stderr, with why."""
    if record.get("evicted"):
        click.echo(f"note: cache entry {record['key'][:12]} ({record['component']}) was damaged "
                   f"({record['evicted']}); rebuilt", err=True)


main.add_command(cache_group)   # `precast cache ...`: compiler/cache_cli.py


@main.command("plan")
@click.argument("recipe", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["table", "json", "github"]), default="table", show_default=True)
def plan_cmd(recipe, fmt):
    """Print RECIPE's build matrix: one entry per component x target, with what each job needs.
    With --format json or github an error is also printed as {"error", "exit"} on stdout."""
    def go():
        from .families import FAMILIES
        from .plan import github_matrix, make_plan
        from .recipe import load_recipe
        loaded = load_recipe(recipe, check_files=False)    # a source that is there but damaged: refused here
        if loaded.assumed_components:
            click.echo(f"warning: {recipe}: no model.family or components, and {loaded.source} is not there to read: "
                       f"SD 1.x's components assumed; give model.family ({', '.join(FAMILIES)})", err=True)
        entries = make_plan(loaded)
        if fmt == "github":
            click.echo(json.dumps(github_matrix(entries), separators=(",", ":")))
        elif fmt == "json":
            click.echo(json.dumps({"recipe": recipe, "entries": [e.describe() for e in entries]}, indent=2))
        else:
            for e in entries:
                click.echo(f"{e.id:<44} {e.needs}")
    _run(go, as_json=fmt in ("json", "github"))   # a CI step reading the JSON gets the error as JSON too


@main.command("build")
@click.argument("recipe", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Bundle folder to write.")
@click.option("--only", multiple=True, help="Build only this plan entry (repeatable).")
@click.option("--shard", default=None, help="Build shard i of n of the plan, e.g. 2/3.")
@click.option("--allow-unmatched", is_flag=True,
              help="Merge the recipe's LoRAs even when some of their tensors name no weight of the model (they are "
                   "listed); the same as `allow_unmatched: true` on every `loras:` entry.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout: {\"bundle\": FOLDER, \"seconds\": S, \"artifacts\": [one record "
                   "per artifact: component, backend (onnx for the export), target, cache (hit|miss), seconds, key, "
                   "fingerprint (null for exports), entry (the plan entry; COMPONENT.onnx for an export)]}. Progress "
                   "stays on stderr.")
def build_cmd(recipe, out, only, shard, allow_unmatched, as_json):
    """Build RECIPE's engines through the cache into a bundle."""
    def go():
        from dataclasses import replace
        from .bundle import build_bundle
        from .recipe import load_recipe
        loaded = load_recipe(recipe)
        if allow_unmatched:
            loaded = replace(loaded, loras=tuple(replace(lora, allow_unmatched=True) for lora in loaded.loras))
        report = build_bundle(loaded, out, tuple(only), shard, progress=True)
        if as_json:
            click.echo(json.dumps(report, indent=2))
            return
        for r in report["artifacts"]:
            click.echo(f"{r['cache']:<4} {r['component']:<13} {r.get('target', r['backend']):<30} {r['seconds']:7.2f} s")
            _note_evicted(r)
        click.echo(f"bundle {report['bundle']} in {report['seconds']:.1f} s")
    _run(go, as_json=as_json)


def _profile_words(p: dict) -> str:
    """'512x512 (min 256x256, max 768x768), batch 1, 77 tokens' from a component's shape profile."""
    def size(i):
        return f"{p['width'][i]}x{p['height'][i]}"
    def span(key):
        lo, opt, hi = p[key]
        return str(opt) if lo == hi else f"{lo}..{hi} (opt {opt})"
    fixed = size(0) == size(2)
    words = [size(1) if fixed else f"{size(1)} (min {size(0)}, max {size(2)})", f"batch {span('batch')}",
             f"{span('tokens')} tokens"]
    if p.get("t5_tokens"):
        words.append(f"{span('t5_tokens')} T5 tokens")
    return ", ".join(words)


@main.group("bundle")
def bundle_group():
    """Merge, pack, unpack, verify and inspect engine bundles."""


@bundle_group.command("merge")
@click.argument("bundles", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_merge(bundles, out, as_json):
    """Join shard bundles of one recipe into one bundle."""
    def go():
        from .bundle import merge_bundles
        r = merge_bundles(list(bundles), out)
        click.echo(json.dumps(r) if as_json else f"merged {_count(len(bundles), 'bundle')} -> {out} ({_count(r['artifacts'], 'artifact')})")
    _run(go)


@bundle_group.command("pack")
@click.argument("bundle", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="FILE.tar, FILE.tar.gz or FILE.tar.zst")
@click.option("--json", "as_json", is_flag=True)
def bundle_pack(bundle, out, as_json):
    """Verify BUNDLE and pack it into one archive."""
    def go():
        from .bundle_archive import count_words, pack_bundle
        r = pack_bundle(bundle, out)
        click.echo(json.dumps(r) if as_json else f"packed {count_words(r)} -> {out} ({r['size'] / 1e6:.1f} MB)")
    _run(go)


@bundle_group.command("unpack")
@click.argument("archive", type=click.Path())
@click.option("--out", required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_unpack(archive, out, as_json):
    """Unpack ARCHIVE safely (no absolute paths, '..', links or devices) and verify it."""
    def go():
        from .bundle_archive import count_words, unpack_bundle
        r = unpack_bundle(archive, out)
        click.echo(json.dumps(r) if as_json else f"unpacked {count_words(r)} -> {out}; verified")
    _run(go)


@bundle_group.command("verify")
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_verify(bundle, as_json):
    """Check every file of BUNDLE against its manifest (size and sha256). Exit 1 when any differs."""
    def go():
        from ..runtime.manifest import verify_bundle
        problems = verify_bundle(bundle)          # a ManifestError is a UserError: one line, exit 2
        if as_json:
            click.echo(json.dumps({"bundle": bundle, "ok": not problems, "problems": problems}, indent=2))
        else:
            for p in problems:
                click.echo(f"FAIL {p}", err=True)
            click.echo(f"{bundle}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        if problems:
            sys.exit(1)
    _run(go)


@bundle_group.command("inspect")
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def bundle_inspect(bundle, as_json):
    """Show what BUNDLE holds: model, components, artifacts with their fingerprints."""
    def go():
        from ..runtime.manifest import read_manifest
        m = read_manifest(bundle)
        if as_json:
            click.echo(json.dumps(m.data, indent=2))
            return
        model = m.model
        click.echo(f"model      {model['family']} {model['variant']}  source {model['source']}  "
                   f"sha256 {model['source_sha256'][:16]}")
        for lora in model.get("loras") or []:
            click.echo(f"lora       {lora.get('name')}  strength {lora.get('strength')}  sha256 {str(lora.get('sha256'))[:16]}")
        for emb in model.get("embeddings") or []:
            click.echo(f"embedding  {emb.get('name') or emb.get('token')}")
        for name, c in sorted(m.components.items()):
            click.echo(f"component  {name:<13} {c['dtype']}  " +
                       ", ".join(i['name'] for i in c['inputs']) + " -> " + ", ".join(o['name'] for o in c['outputs']))
            for p in c.get("profiles") or []:
                click.echo(f"  profile  {_profile_words(p)}")
        for a in m.artifacts():
            size = sum(m.files[f]["size"] for f in a.files) / 1e6
            click.echo(f"artifact   {a.component:<13} {a.backend:<13} {size:8.1f} MB  {a.fingerprint}")
        from .bundle_archive import bundle_counts, count_words
        click.echo(f"total      {count_words(bundle_counts(m.files))}, "
                   f"{sum(f['size'] for f in m.files.values()) / 1e6:.1f} MB")
    _run(go)


# --- export-openvino-genai (issue 18 item 3; the work is in compiler/openvino_genai.py) -----------------
@main.command("export-openvino-genai")
@click.argument("export_dir", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="OpenVINO GenAI model folder to write.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def export_openvino_genai_cmd(export_dir, out, as_json):
    """Write EXPORT_DIR (a `precast export`) as an OpenVINO GenAI folder (optimum-cli's OpenVINO layout)
    that openvino_genai.Text2ImagePipeline(OUT, device) runs: SD 1.x / 2.x and SDXL with the Euler scheduler,
    SD3 / SD3.5 and Flux with the export's flow-matching schedule; Chroma is refused (GenAI has no Chroma
    pipeline)."""
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
# --- end export-openvino-genai -------------------------------------------------------------------------


if __name__ == "__main__":
    main()
