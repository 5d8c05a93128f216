"""Engine bundles: build one from a recipe (through the cache), merge shards, verify.

Owns: the bundle layout -- `manifest.json`, `onnx/<component>/` (the exported graph and its
weights, shared by ONNX Runtime and by OpenVINO's compile-on-load fallback), and
`artifacts/<component>/<target>-<key>/` -- and storing weights once: an artifact whose files
are byte-identical to files already in the bundle points at them instead of copying.
Bundles are written to a staging folder and renamed into place.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ..runtime.fileops import FileBusy
from ..runtime.manifest import MANIFEST, SCHEMA, file_record, read_manifest, sha256_file, verify_bundle
from ..runtime.staging import Staging
from .bundle_archive import MANIFEST_LIMIT, check_out
from .bundle_records import changed_since, record_written, snapshot
from .cache import Cache, Entry, cache_key, staging_registry
from .engines import PRECAST_VERSION, ExportedComponent, compile_component
from .errors import BadInput
from .foreign_onnx import is_foreign_folder
from .interop import write_pipeline_folder
from .plan import _slug, make_plan, select
from .recipe import Recipe
from .sources.gguf_file import GGUF_BLOCKS, is_gguf, source_quantization
from .targets import check_buildable

DEMO_FILE = "tiny-sd15-seed0.safetensors"


def materialize_source(recipe: Recipe, cache: Cache) -> Path:
    """The checkpoint path; an embedded demo is written once into the cache folder."""
    if not recipe.source.startswith("demo:"):
        return Path(recipe.source)
    name = recipe.source[len("demo:"):]
    path = cache.root / "demo" / (DEMO_FILE if name == "tiny-sd15" else f"{name}-seed0.safetensors")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        if name == "tiny-sd15":
            from .demo_model import write_demo_model
            write_demo_model(str(path), seed=0)
        elif name.startswith("tiny-sd3"):
            from .demo_sd3 import write_demo_sd3
            write_demo_sd3(str(path), name, seed=0)
        else:
            from .demo_dit import write_demo_dit
            write_demo_dit(str(path), name, seed=0)
    return path


def demo_overrides(recipe: Recipe) -> dict:
    """What the tiny DiT demos' weights cannot say (their 16-wide heads' RoPE split), unless set."""
    if recipe.source not in ("demo:tiny-flux-dev", "demo:tiny-flux-schnell", "demo:tiny-chroma"):
        return recipe.overrides
    from .demo_dit import DEMO_AXES
    transformer = {"axes_dims_rope": DEMO_AXES, **recipe.overrides.get("transformer", {})}
    return {**recipe.overrides, "transformer": transformer}


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
    for p in sorted([*here.glob("graphs/*.py"), *here.glob("sources/*.py"), here / "export.py",
                     here / "families.py", here / "lora_merge.py"]):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cached_export(cache: Cache, source: Path, digest: str, component: str, dtype: str, overrides: dict,
                  progress: bool, vae: Path | None = None, vae_digest: str = "", loras: list | None = None,
                  lora_ids: list[dict] | None = None, text_encoders: tuple = (),
                  te_digests: tuple = (), controlnet: tuple[str, str] | None = None,
                  controlnet_digest: str = "") -> tuple[Entry, bool]:
    """One component's ONNX export, as a cache entry: (verified entry, hit). `loras` are merged
    ((path, strength, te_strength, allow_unmatched) each); `lora_ids` (digest + strength of each LoRA that touches
    this component) go into the key; so do the digests of separate text-encoder files, and of the
    ControlNet file a `controlnet_<name>` component is made from ((path, name))."""
    from .export import export
    key_parts = {"kind": "export", "source_sha256": digest, "component": component, "dtype": dtype,
                 "overrides": overrides, "vae_sha256": vae_digest, "precast": PRECAST_VERSION,
                 "builder": builder_digest()}
    if te_digests:
        key_parts["text_encoders_sha256"] = list(te_digests)
    if lora_ids:
        key_parts["loras"] = lora_ids
    if controlnet:
        key_parts["controlnet"] = {"sha256": controlnet_digest, "name": controlnet[1]}
    key = cache_key(key_parts)

    def build(folder: Path) -> dict:
        work = folder / "export"
        report = export(source, work, [component], dtype, overrides, progress=progress, vae_dtype=dtype,
                        vae=vae, loras=loras if lora_ids else None, warn=lambda msg: None,  # said by build_bundle
                        text_encoders=text_encoders,
                        controlnets=[controlnet] if controlnet else ())
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


class BundleWriter:
    """Files going into a staging bundle folder, deduplicated by content."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, dict] = {}
        self.linked: set[str] = set()    # hard links to cache files (verified when served; bundle_records.py)
        self.copied: set[str] = set()    # copies: bytes never hashed here, so not recorded as verified

    def _folder_with(self, records: dict[str, dict]) -> str | None:
        """A folder already in the bundle holding every one of these files (same names, same bytes)."""
        folders = {rel.rsplit("/", 1)[0] for rel in self.files}
        for folder in sorted(folders):
            if all(self.files.get(f"{folder}/{n}", {}).get("sha256") == r["sha256"] for n, r in records.items()):
                return folder
        return None

    def add(self, src: Path, records: dict[str, dict], dest: str) -> dict[str, str]:
        """Place the files of `src` (name -> {size, sha256}) under `dest`; returns name -> bundle path."""
        existing = self._folder_with(records)
        if existing is not None:
            return {n: f"{existing}/{n}" for n in records}
        (self.root / dest).mkdir(parents=True, exist_ok=True)
        for name, rec in records.items():
            target = self.root / dest / name
            try:
                os.link(src / name, target)      # cache files are never written in place
                self.linked.add(f"{dest}/{name}")
            except OSError:
                shutil.copyfile(src / name, target)
                self.copied.add(f"{dest}/{name}")
            self.files[f"{dest}/{name}"] = dict(rec)     # size, sha256 and piece digests
        return {n: f"{dest}/{n}" for n in records}


def write_manifest(root: Path, manifest: dict) -> None:
    manifest["artifacts"] = sorted(manifest["artifacts"], key=lambda a: a["id"])
    manifest["files"] = dict(sorted(manifest["files"].items()))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _is_bundle(folder: Path) -> bool:
    """A precast bundle's manifest is there (JSON, schema 1, a file table): replacing it is allowed."""
    try:
        path = folder / MANIFEST
        data = json.loads(path.read_bytes()) if path.stat().st_size <= MANIFEST_LIMIT else None
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA and isinstance(data.get("files"), dict)


def check_replaceable(out: Path) -> None:
    """--out may be new, empty, or an earlier bundle; any other folder is the user's and is kept."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not _is_bundle(out))):
        raise BadInput(f"--out {out}: exists and is not a precast bundle (no readable schema-{SCHEMA} "
                       f"{MANIFEST}); its contents would be replaced: choose a new or empty folder")


def _model_of(folder: Path) -> tuple[str, str] | None:
    """(source digest, 'recipe (family, source)') of the bundle in `folder`."""
    try:
        data = json.loads((folder / MANIFEST).read_bytes())
        model = data["model"]
        return str(model.get("source_sha256")), f"{data.get('name')} ({model.get('family')}, {model.get('source')})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _note_replaced(out: Path, staging: Path) -> None:
    """Replacing a bundle of another model is allowed (--out names it) but said, on stderr."""
    before, after = _model_of(out), _model_of(staging)
    if before and after and before[0] != after[0]:
        print(f"note: {out} held a bundle of {before[1]}; replaced by {after[1]}", file=sys.stderr)


def commit_bundle(stage: Staging) -> None:
    """Put the finished staging folder at its --out, replacing an existing bundle there in one step."""
    out = stage.out
    if out.exists():
        check_replaceable(out)
        _note_replaced(out, stage.path)
    try:
        stage.commit()
    except FileBusy:
        raise BadInput(f"--out {out}: a file in it is held open by another process (a running precast generate, "
                       "an editor, an antivirus scan?), so Windows will not move it; close that and build again") from None


def _artifact_metadata(meta: dict) -> dict:
    keep = ("compile_config", "device", "precision", "static", "compute_capabilities", "header", "weight_streaming",
            "refittable", "simplified", "gfx", "input_dims", "fp16", "rewrites",
            "weights",   # weight-only quantization: format and how (compiler/targets/quantize.py)
            "store")     # OpenVINO: "ir" when the artifact is model.xml/.bin rather than a blob
    return {k: meta[k] for k in keep if k in meta}


def build_bundle(recipe: Recipe, out: str | Path, only: tuple[str, ...] = (), shard: str | None = None,
                 progress: bool = True, cache: Cache | None = None) -> dict:
    from .sources.checkpoint import open_checkpoint
    from .sources.detect import detect_family, require_supported
    t0 = time.perf_counter()
    out = Path(out)
    check_out(out)
    check_replaceable(out)
    cache = cache or Cache()
    entries = select(make_plan(recipe), only, shard)
    if not recipe.source.startswith("demo:") and is_foreign_folder(recipe.source):   # optimum / diffusers ONNX
        from .bundle_foreign import build_foreign
        return build_foreign(recipe, out, entries, cache, progress, t0)
    source = materialize_source(recipe, cache)
    ckpt = open_checkpoint(source, vae=recipe.vae, text_encoders=recipe.text_encoders)
    family = detect_family(ckpt)
    require_supported(ckpt, family)
    if recipe.family and recipe.family != family.name:
        raise BadInput(f"{recipe.path}: family {recipe.family!r} but {source} is {family.name} ({family.evidence})")
    from .export import plan_graphs
    from .families import FAMILIES, FP32_VAE_FAMILIES, T5_TOKENS, flow_defaults, latent_factor_of
    from .export import CONTROLNET_PREFIX, _with_residuals, plan_controlnets
    model_comps = [c for c in recipe.components if not c.startswith(CONTROLNET_PREFIX)]
    absent = [c for c in model_comps if c not in FAMILIES[family.name]]
    if absent:
        raise BadInput(f"{recipe.path}: components: {family.name} has no {', '.join(absent)} "
                       f"(it has {', '.join(FAMILIES[family.name])})")
    overrides = demo_overrides(recipe)
    # every graph built from the headers once: a missing part (T5), a mismatched one (a 4-channel VAE
    # for Flux), a ControlNet of another model or a damaged tensor is one error now, before anything is
    # written. With ControlNets the UNet takes their residuals as inputs (one UNet for any number of them).
    nets = {f"{CONTROLNET_PREFIX}{name}": (path, name) for path, name in recipe.controlnets}
    planned_nets = plan_controlnets(ckpt, family, recipe.controlnets, "fp32", overrides)
    unet_overrides = _with_residuals(overrides, planned_nets)
    plan_graphs(ckpt, model_comps, "fp32", unet_overrides)
    t5 = T5_TOKENS.get(family.name, {}).get(family.variant)
    factor = latent_factor_of(ckpt.refs)
    profiles = [dataclasses.replace(p, t5_tokens=p.t5_tokens or ((t5, t5, t5) if t5 else None), latent_factor=factor)
                for p in recipe.profiles]
    for p in profiles:
        try:
            p.check()
            if family.name in T5_TOKENS:      # a DiT transformer reads 2x2 latent patches: refused now, not after exporting
                p.image_tokens()
        except BadInput as e:
            raise BadInput(f"{recipe.path}: profiles: {e}") from None
    digest = source_digest(source)
    te_digests = tuple(source_digest(Path(t)) for t in recipe.text_encoders)
    gguf_sources = tuple(str(p) for p in (source, *recipe.text_encoders) if is_gguf(p))
    from_gguf = bool(source_quantization(ckpt.refs))
    lora_plan = None
    if recipe.loras:  # checked against the model now (unmatched keys, shapes), before anything is built
        from .lora_merge import LoraSpec, component_loras, plan_merge
        lora_plan = plan_merge({k: tuple(r.shape) for k, r in ckpt.refs.items()},
                               [LoraSpec(l.path, l.strength, l.te_strength, l.allow_unmatched) for l in recipe.loras],
                               allow_hint=lambda i: f"set `allow_unmatched: true` in loras[{i}] of {recipe.path} "
                                                    f"(line {recipe.lines.get(f'loras[{i}]', 1)}) or pass "
                                                    "--allow-unmatched to `precast build`")
    lora_args = [(l.path, l.strength, l.te_strength, l.allow_unmatched) for l in recipe.loras]
    net_digests = {comp: source_digest(Path(path)) for comp, (path, _) in nets.items()}
    vae_path = Path(recipe.vae) if recipe.vae else None
    vae_digest = source_digest(vae_path) if vae_path else ""

    def precision_of(comp: str) -> tuple[str, str]:
        if comp.startswith("vae_") and comp not in recipe.precision_explicit and family.name in FP32_VAE_FAMILIES:
            return "fp32", f"{family.name} VAE overflows in fp16; kept fp32 (set precision.{comp} to override)"
        return recipe.precision[comp], "recipe"
    for e in entries:   # what a target cannot build here (dtype, options, backend, device) before any export
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
        if lora_plan is not None:
            manifest["model"]["loras"] = [{**{k: d[k] for k in ("name", "sha256", "strength", "te_strength")},
                                           **({"unmatched": len(d["unmatched"])} if d["unmatched"] else {})}
                                          for d in lora_plan.describe()]
        report = []
        if recipe.embeddings:  # textual inversion: applied by the runtime, no engine depends on it
            from .sources.embeddings import encoder_widths, write_bundle_embeddings
            manifest["model"]["embeddings"], emb_files = write_bundle_embeddings(
                recipe.embeddings, encoder_widths(ckpt, family.name), staging)
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
                                       component_loras(lora_plan, FAMILIES[family.name][comp].prefix_in(ckpt.refs))
                                       if lora_plan is not None and comp not in nets else None,
                                       recipe.text_encoders if is_text else (), te_digests if is_text else (),
                                       nets.get(comp), net_digests.get(comp, ""))
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
                           "cache": "hit" if hit else "miss", "seconds": round(time.perf_counter() - c0, 3),
                           "key": entry.key, "fingerprint": None})
        add_engines(writer, manifest, report, entries, profiles, exported, cache, progress)
        for comp, folder in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"),
                             ("text_encoder_3", "tokenizer_3")):
            if comp not in manifest["components"]:
                continue
            if "t5_sequence" in str(manifest["components"][comp]["inputs"]):
                add_t5_tokenizer(writer, source, folder)
            else:
                add_tokenizer(writer, source, folder, pad_zero=family.name == "sd2" or comp == "text_encoder_2")
        write_pipeline_folder(staging / "onnx", manifest["model"],  # diffusers-style folder (compiler/interop.py)
                              {c: v["config"] for c, v in manifest["components"].items()}, source, writer)
        write_manifest(staging, manifest)
        staged = snapshot(staging, writer.files, skip=writer.copied)       # verification records: bundle_records.py
        commit_bundle(stage)
        record_written(out, writer.files, staged, whole=set(staged) - writer.linked)
    return {"bundle": str(out), "artifacts": report, "seconds": round(time.perf_counter() - t0, 3)}


def add_engines(writer: BundleWriter, manifest: dict, report: list, entries, profiles, exported: dict,
                cache: Cache, progress: bool) -> None:
    """Each plan entry's engine for each profile (compile_component, through the cache), into the bundle."""
    for e in entries:
        for profile in profiles:
            rec, entry = compile_component(exported[e.component], e.target, profile, cache, progress)
            meta = entry.metadata
            placed = writer.add(entry.path, entry.files,
                                f"artifacts/{e.component}/{_slug(e.target)}-{rec['key'][:12]}")
            manifest["artifacts"].append({
                "id": f"{e.id}/{rec['key'][:12]}", "plan_entry": e.id, "component": e.component,
                "backend": e.target.backend, "fingerprint": rec["fingerprint"], "target": e.target.describe(),
                "profile": profile.describe(), "shapes": meta["shapes"], "entry": placed[meta["entry"]],
                "files": sorted(placed.values()), "size": sum(f["size"] for f in entry.files.values()),
                "sha256": entry.files[meta["entry"]]["sha256"], "build_options": e.target.describe(),
                "toolchain": meta["toolchain"], "metadata": _artifact_metadata(meta)})
            report.append({**{k: rec[k] for k in ("component", "backend", "target", "cache", "seconds", "key",
                                                  "fingerprint")}, "entry": e.id,
                           **({"evicted": rec["evicted"]} if rec.get("evicted") else {})})


def add_tokenizer(writer: BundleWriter, source: Path, name: str = "tokenizer", pad_zero: bool = False,
                  source_folder: str | None = None) -> None:
    """<name>/{vocab.json, merges.txt[, tokenizer_config.json]}: the diffusers folder's own, else the
    CLIP BPE precast ships. OpenCLIP encoders (SD 2.x, SDXL's bigG) pad with id 0 ('!')."""
    from ..runtime.tokenizer import ClipTokenizer
    folder = writer.root / name
    folder.mkdir(parents=True, exist_ok=True)
    theirs = source / (source_folder or name) if source.is_dir() else None
    if theirs is not None and (theirs / "vocab.json").is_file() and (theirs / "merges.txt").is_file():
        for f in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
            if (theirs / f).is_file():
                shutil.copyfile(theirs / f, folder / f)
    else:
        ClipTokenizer.shipped().write_files(folder)
        if pad_zero:
            (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": "!"}) + "\n")
    for p in sorted(folder.iterdir()):
        writer.files[f"{name}/{p.name}"] = file_record(p)


def add_t5_tokenizer(writer: BundleWriter, source: Path, name: str, source_folder: str | None = None) -> None:
    """<name>/: the T5 tokenizer (sentencepiece `spiece.model` + transformers' files): the diffusers
    folder's own, else the one precast ships."""
    from .sources.t5_tokenizer_files import write_t5_tokenizer_folder
    mine = source_folder or name
    theirs = source / mine if source.is_dir() and (source / mine).is_dir() else None
    folder = writer.root / name
    write_t5_tokenizer_folder(folder, theirs)
    for p in sorted(folder.iterdir()):
        writer.files[f"{name}/{p.name}"] = file_record(p)


def merge_bundles(inputs: list[str | Path], out: str | Path) -> dict:
    """Join shard bundles of one model into one; the same artifact in two shards must agree."""
    out = Path(out)
    check_out(out)
    check_replaceable(out)
    manifests, hashed_from = [], time.time_ns()     # hashed_from: for bundle_records.changed_since
    for b in inputs:
        problems = verify_bundle(b)
        if problems:
            raise BadInput(f"{b}: does not verify ({problems[0]}); rebuild that shard")
        manifests.append(read_manifest(b))
    first = manifests[0].data
    for m in manifests[1:]:
        if m.model != first["model"]:
            raise BadInput(f"{m.root}: built from another model or LoRA set than {manifests[0].root}; "
                           "merge shards of one recipe only")
    with Staging(out, "merging", staging_registry()) as stage:
        staging = stage.path
        merged = {"schema": SCHEMA, "precast": first["precast"], "name": first["name"], "model": first["model"],
                  "components": {}, "artifacts": [], "files": {}}
        seen, unproven = {}, set()  # shard files copied, or changed since hashed: not recorded as verified
        for m in manifests:
            for name, comp in m.components.items():
                if merged["components"].setdefault(name, comp) != comp:
                    raise BadInput(f"{m.root}: component {name} differs from another shard's; rebuild the shards "
                                   "from one recipe with one precast version")
        # onnx/'s pipeline files (model_index.json, configs) list the components a shard has: written again
        from .interop import pipeline_files, write_json
        derived = {f"onnx/{rel}": data for rel, data in pipeline_files(
            first["model"], {c: v.get("config") or {} for c, v in merged["components"].items()}).items()}
        for rel, data in derived.items():
            merged["files"][rel] = file_record(write_json(staging / rel, data))
        for m in manifests:
            for rel, rec in m.files.items():
                if rel in derived:
                    continue
                if rel in merged["files"]:
                    if merged["files"][rel] != rec:
                        raise BadInput(f"{m.root}: {rel} differs from the same file in another shard")
                    continue
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                if changed_since(m.root / rel, hashed_from):
                    unproven.add(rel)
                try:
                    os.link(m.root / rel, staging / rel)
                except OSError:
                    shutil.copyfile(m.root / rel, staging / rel)
                    unproven.add(rel)
                merged["files"][rel] = rec
            for a in m.data["artifacts"]:
                if a["id"] in seen and seen[a["id"]] != a:
                    raise BadInput(f"{m.root}: artifact {a['id']} differs from another shard's")
                if a["id"] not in seen:
                    seen[a["id"]] = a
                    merged["artifacts"].append(a)
        write_manifest(staging, merged)
        staged = snapshot(staging, merged["files"], skip=unproven)  # verify_bundle hashed each whole above
        commit_bundle(stage)
        record_written(out, merged["files"], staged, whole=True)
    return {"bundle": str(out), "artifacts": len(merged["artifacts"]), "files": len(merged["files"])}
