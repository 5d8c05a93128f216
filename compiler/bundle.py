"""`precast build`: a recipe's bundle, built through the cache.

Owns: the build's orchestration -- the recipe's source made real (a demo written once into the cache),
everything checked before any work (family, components, every graph from the headers, ControlNets, the
TAESD preview decoder, LoRAs, profiles, what each target can build), each component's export as a cache entry
keyed by what decides its bytes (cached_export, builder_digest), then the engines, tokenizers and diffusers-style
files into a staging bundle (compiler/bundle_writer.py writes it and puts it in place). An ONNX pipeline folder
as the source goes to compiler/bundle_foreign.py.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
import time
from pathlib import Path

from ..runtime.manifest import SCHEMA, sha256_file
from ..runtime.previews import PREVIEW_DECODER
from ..runtime.staging import Staging
from .bundle_archive import check_out
from .bundle_foreign import build_foreign
from .bundle_records import record_written, snapshot
from .bundle_writer import (BundleWriter, add_engines, add_llm_tokenizer, add_t5_tokenizer, add_tokenizer,
                            check_replaceable, commit_bundle, write_manifest)
from .cache import Cache, Entry, cache_key, outcome
from .demo_families import write_demo_file
from .engines import PRECAST_VERSION, ExportedComponent
from .errors import BadInput
from .export import _with_residuals, export, plan_controlnets, plan_graphs, plan_preview
from .families import FAMILIES, detect_family, flow_defaults, latent_factor_of, require_supported
from .foreign_onnx import is_foreign_folder
from .interop import write_pipeline_folder
from .lora_merge import LoraSpec, component_loras, plan_merge
from .plan import make_plan, select
from .recipe import Recipe
from .sources.checkpoint import open_checkpoint
from .sources.controlnet import CONTROLNET_PREFIX
from .sources.embeddings import encoder_widths, write_bundle_embeddings
from .sources.gguf_file import GGUF_BLOCKS, is_gguf, source_quantization
from .targets import check_buildable


def materialize_source(recipe: Recipe, cache: Cache) -> Path:
    """The checkpoint path; an embedded demo is written once into the cache folder."""
    if not recipe.source.startswith("demo:"):
        return Path(recipe.source)
    name = recipe.source[len("demo:"):]        # tiny-NAME: the file `precast demo-model --family NAME` writes
    path = cache.root / "demo" / f"{name}-seed0.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_demo_file(name[len("tiny-"):], str(path), seed=0)
    return path


def demo_overrides(recipe: Recipe) -> dict:
    """What a demo's weights cannot say (the tiny DiTs' 16-wide heads' RoPE split: Family.demos), unless set."""
    fixed = next((f.demos[recipe.source] for f in FAMILIES.values() if recipe.source in f.demos), {})
    return {**recipe.overrides, **{comp: {**values, **recipe.overrides.get(comp, {})} for comp, values in fixed.items()}}


def source_digest(path: Path) -> str:
    if path.is_file():
        return sha256_file(path)
    parts = {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*"))
             if p.is_file() and p.suffix in (".safetensors", ".json")}
    return cache_key(parts)


@functools.lru_cache(maxsize=1)
def builder_digest() -> str:
    """sha256 of the code that decides an export's bytes (graph builders, sources, export, LoRA
    merge): an export cache entry made by other builder code is not reused."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for p in sorted([*here.glob("graphs/*.py"), *here.glob("sources/*.py"), *here.glob("families/*.py"),
                     here / "export.py", here / "lora_merge.py"]):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cached_export(cache: Cache, source: Path, digest: str, component: str, dtype: str, overrides: dict,
                  progress: bool, vae: Path | None = None, vae_digest: str = "", loras: list | None = None,
                  lora_ids: list[dict] | None = None, text_encoders: tuple = (),
                  te_digests: tuple = (), controlnet: tuple[str, str] | None = None,
                  controlnet_digest: str = "", preview: str | None = None,
                  preview_digest: str = "") -> tuple[Entry, bool]:
    """One component's ONNX export, as a cache entry: (verified entry, hit). `loras` are merged
    ((path, strength, te_strength, allow_unmatched) each); `lora_ids` (digest + strength of each LoRA that touches
    this component) go into the key; so do the digests of separate text-encoder files, and of the
    ControlNet file a `controlnet_<name>` component is made from ((path, name)), and of the TAESD file the
    `preview_decoder` is (`preview`)."""
    key_parts = {"kind": "export", "source_sha256": digest, "component": component, "dtype": dtype,
                 "overrides": overrides, "vae_sha256": vae_digest, "precast": PRECAST_VERSION,
                 "builder": builder_digest()}
    if te_digests:
        key_parts["text_encoders_sha256"] = list(te_digests)
    if lora_ids:
        key_parts["loras"] = lora_ids
    if controlnet:
        key_parts["controlnet"] = {"sha256": controlnet_digest, "name": controlnet[1]}
    if preview:
        key_parts["preview_sha256"] = preview_digest
    key = cache_key(key_parts)

    def build(folder: Path) -> dict:
        work = folder / "export"
        report = export(source, work, [component], dtype, overrides, progress=progress, vae_dtype=dtype,
                        vae=vae, loras=loras if lora_ids else None, warn=lambda msg: None,  # said by build_bundle
                        text_encoders=text_encoders,
                        controlnets=[controlnet] if controlnet else (), preview=preview)
        for f in (work / component).iterdir():
            os.rename(f, folder / f.name)
        shutil.rmtree(work)
        comp = report["components"][0]
        return {"kind": "export", "component": component, "dtype": dtype, "family": report["family"],
                "variant": report["variant"], "inputs": comp["inputs"], "outputs": comp["outputs"],
                "config": comp["config"], "entry": "model.onnx", "prediction": report["prediction"],
                "latent_scale": report["latent_scale"],
                **{k: report[k] for k in ("latent_shift", "t5_tokens") if k in report},
                **({"precision_notes": comp["precision_notes"]} if comp.get("precision_notes") else {})}

    entry, hit, _ = cache.get_or_build(key, build)
    return entry, hit


def build_bundle(recipe: Recipe, out: str | Path, only: tuple[str, ...] = (), shard: str | None = None,
                 progress: bool = True, cache: Cache | None = None, exports_only: bool = False) -> dict:
    """`exports_only`: the selected entries' components exported (through the cache, so a remote cache gets
    them) into a bundle of their ONNX, no engines: CI runs it once, before the shards that compile engines."""
    t0 = time.perf_counter()
    out = Path(out)
    check_out(out)
    check_replaceable(out)
    cache = cache or Cache()
    entries = select(make_plan(recipe), only, shard)
    if not recipe.source.startswith("demo:") and is_foreign_folder(recipe.source):   # optimum / diffusers ONNX
        if exports_only:
            raise BadInput(f"--exports-only: {recipe.path}'s source {recipe.source} is an ONNX folder, whose graphs are "
                           "copied, not exported: drop --exports-only")
        return build_foreign(recipe, out, entries, cache, progress, t0)
    source = materialize_source(recipe, cache)
    ckpt = open_checkpoint(source, vae=recipe.vae, text_encoders=recipe.text_encoders)
    family = detect_family(ckpt)
    fam = require_supported(ckpt, family)
    if recipe.family and recipe.family != family.name:
        raise BadInput(f"{recipe.path}: family {recipe.family!r} but {source} is {family.name} ({family.evidence})")
    model_comps = [c for c in recipe.components if not c.startswith(CONTROLNET_PREFIX) and c != PREVIEW_DECODER]
    absent = [c for c in model_comps if c not in fam.components]
    if absent:
        raise BadInput(f"{recipe.path}: components: {family.name} has no {', '.join(absent)} "
                       f"(it has {', '.join(fam.components)})")
    overrides = demo_overrides(recipe)
    # every graph built from the headers once: a missing part (T5), a mismatched one (a 4-channel VAE
    # for Flux), a ControlNet of another model or a damaged tensor is one error now, before anything is
    # written. With ControlNets the UNet takes their residuals as inputs (one UNet for any number of them).
    nets = {f"{CONTROLNET_PREFIX}{name}": (path, name) for path, name in recipe.controlnets}
    planned_nets = plan_controlnets(ckpt, family, recipe.controlnets, "fp32", overrides)
    unet_overrides = _with_residuals(overrides, planned_nets)
    plan_graphs(ckpt, model_comps, "fp32", unet_overrides)
    plan_preview(ckpt, family, recipe.preview, "fp32")       # a TAESD file that is no decoder, or for other latents
    released = fam.flow(family.variant)
    t5 = released.t5_tokens if released else None
    factor = latent_factor_of(ckpt.refs)
    profiles = [dataclasses.replace(p, t5_tokens=p.t5_tokens or ((t5, t5, t5) if t5 else None), latent_factor=factor)
                for p in recipe.profiles]
    for p in profiles:
        try:
            p.check()
            if fam.runtime.patch > 1:      # a DiT transformer reads 2x2 latent patches: refused now, not after exporting
                p.image_tokens()
        except BadInput as e:
            raise BadInput(f"{recipe.path}: profiles: {e}") from None
    digest = source_digest(source)
    te_digests = tuple(source_digest(Path(t)) for t in recipe.text_encoders)
    gguf_sources = tuple(str(p) for p in (source, *recipe.text_encoders) if is_gguf(p))
    from_gguf = bool(source_quantization(ckpt.refs))
    lora_plan = None
    if recipe.loras:  # checked against the model now (unmatched keys, shapes), before anything is built
        lora_plan = plan_merge({k: tuple(r.shape) for k, r in ckpt.refs.items()},
                               [LoraSpec(l.path, l.strength, l.te_strength, l.allow_unmatched) for l in recipe.loras],
                               allow_hint=lambda i: f"set `allow_unmatched: true` in loras[{i}] of {recipe.path} "
                                                    f"(line {recipe.lines.get(f'loras[{i}]', 1)}) or pass "
                                                    "--allow-unmatched to `precast build`")
    lora_args = [(l.path, l.strength, l.te_strength, l.allow_unmatched) for l in recipe.loras]
    net_digests = {comp: source_digest(Path(path)) for comp, (path, _) in nets.items()}
    preview_digest = source_digest(Path(recipe.preview)) if recipe.preview else ""
    vae_path = Path(recipe.vae) if recipe.vae else None
    vae_digest = source_digest(vae_path) if vae_path else ""

    def precision_of(comp: str) -> tuple[str, str]:
        if comp.startswith("vae_") and comp not in recipe.precision_explicit and fam.fp32_vae:
            return "fp32", f"{family.name} VAE overflows in fp16; kept fp32 (set precision.{comp} to override)"
        return recipe.precision[comp], "recipe"
    for e in [] if exports_only else entries:   # what a target cannot build here (dtype, options, backend, device)
        try:
            check_buildable(e.target, precision_of(e.component)[0], e.component)
        except BadInput as err:
            raise BadInput(f"{recipe.path}: {err}") from None
    with Staging(out, "building", cache.staging) as stage:
        staging = stage.path
        writer = BundleWriter(staging)
        manifest = {"schema": SCHEMA, "precast": PRECAST_VERSION, "name": recipe.name,
                    "model": {"family": family.name, "variant": family.variant,
                              "source": recipe.source if recipe.source.startswith("demo:") else Path(recipe.source).name,
                              "source_sha256": digest, "loras": [], "embeddings": [],
                              "vae": {"source": vae_path.name, "sha256": vae_digest} if vae_path else None},
                    "components": {}, "artifacts": [], "files": writer.files}
        if recipe.text_encoders:
            manifest["model"]["text_encoders"] = [{"source": Path(t).name, "sha256": d}
                                                  for t, d in zip(recipe.text_encoders, te_digests)]
        flow = flow_defaults(family.name, family.variant, ckpt.configs.get("scheduler", {}),
                             f"{ckpt.path} scheduler/scheduler_config.json")
        if flow is not None:
            manifest["model"].update(flow)
        if planned_nets:
            manifest["model"]["controlnets"] = [{"name": name, "component": comp, "source": Path(path).name,
                                                 "sha256": net_digests[comp], "residuals": cfg["control_residuals"]}
                                                for (comp, (path, name)), (_, _, cfg) in zip(nets.items(), planned_nets)]
        if recipe.preview:
            manifest["model"]["preview"] = {"component": PREVIEW_DECODER, "source": Path(recipe.preview).name,
                                            "sha256": preview_digest}
        if lora_plan is not None:
            manifest["model"]["loras"] = [{**{k: d[k] for k in ("name", "sha256", "strength", "te_strength")},
                                           **({"unmatched": len(d["unmatched"])} if d["unmatched"] else {})}
                                          for d in lora_plan.describe()]
        report = []
        if recipe.embeddings:  # textual inversion: applied by the runtime, no engine depends on it
            manifest["model"]["embeddings"], emb_files = write_bundle_embeddings(
                recipe.embeddings, encoder_widths(ckpt, fam.components), staging)
            writer.files.update(emb_files)
        exported = {}
        for comp in sorted({e.component for e in entries}):
            c0 = time.perf_counter()
            dtype, why = precision_of(comp)
            is_text = comp.startswith("text_encoder")
            entry, hit = cached_export(cache, source, digest, comp, dtype,
                                       unet_overrides if comp == "unet" else overrides, progress,
                                       vae_path if comp.startswith("vae_") else None,
                                       vae_digest if comp.startswith("vae_") else "", lora_args,
                                       component_loras(lora_plan, fam.components[comp].prefix_in(ckpt.refs))
                                       if lora_plan is not None and comp in fam.components else None,
                                       recipe.text_encoders if is_text else (), te_digests if is_text else (),
                                       nets.get(comp), net_digests.get(comp, ""),
                                       recipe.preview if comp == PREVIEW_DECODER else None, preview_digest)
            meta = entry.metadata
            manifest["model"]["prediction"] = meta.get("prediction", "epsilon")
            manifest["model"]["latent_scale"] = meta.get("latent_scale")
            for k in ("latent_shift", "t5_tokens"):
                if k in meta:
                    manifest["model"][k] = meta[k]
            # gguf_blocks.json names local paths: read by weights: gguf builds from the cache, never shipped
            placed = writer.add(entry.path, {n: r for n, r in entry.files.items() if n != GGUF_BLOCKS}, f"onnx/{comp}")
            blocks = entry.path / GGUF_BLOCKS
            exported[comp] = ExportedComponent(comp, entry.path / "model.onnx", meta["inputs"], meta["outputs"],
                                               gguf_blocks=blocks if blocks.is_file() else None, from_gguf=from_gguf,
                                               gguf_sources=gguf_sources)
            manifest["components"][comp] = {
                "onnx": placed["model.onnx"], "files": sorted(placed.values()), "dtype": meta["dtype"],
                "dtype_reason": why,
                "inputs": meta["inputs"], "outputs": meta["outputs"], "config": meta["config"],
                "profiles": [p.describe() for p in profiles],
                **({"precision_notes": meta["precision_notes"]} if meta.get("precision_notes") else {})}
            report.append({"entry": f"{comp}.onnx", "component": comp, "backend": "onnx", "target": "onnx",
                           "cache": outcome(entry, hit), "seconds": round(time.perf_counter() - c0, 3),
                           "key": entry.key, "fingerprint": None, **({"remote": entry.remote} if entry.remote else {})})
        add_engines(writer, manifest, report, [] if exports_only else entries, profiles, exported, cache, progress)
        for comp, folder in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"),
                             ("text_encoder_3", "tokenizer_3")):
            if comp not in manifest["components"]:
                continue
            if "t5_sequence" in str(manifest["components"][comp]["inputs"]):
                add_t5_tokenizer(writer, source, folder)
            elif "llm_sequence" in str(manifest["components"][comp]["inputs"]):
                add_llm_tokenizer(writer, source, folder)
            else:
                add_tokenizer(writer, source, folder, pad_zero=fam.pad_zero(comp))
        write_pipeline_folder(staging / "onnx", manifest["model"],  # diffusers-style folder (compiler/interop.py)
                              {c: v["config"] for c, v in manifest["components"].items()}, source, writer)
        write_manifest(staging, manifest)
        staged = snapshot(staging, writer.files, skip=writer.copied)       # verification records: bundle_records.py
        commit_bundle(stage)
        record_written(out, writer.files, staged, whole=set(staged) - writer.linked)
    return {"bundle": str(out), "artifacts": report, "seconds": round(time.perf_counter() - t0, 3)}


