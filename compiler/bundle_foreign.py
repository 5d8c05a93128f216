"""`precast build` from an ONNX pipeline folder precast did not write (optimum's `optimum-cli export onnx`
layout, or a diffusers OnnxStableDiffusionPipeline folder): a normal bundle without re-exporting.

Owns: what a checkpoint build gets from its export and the folder gives here instead -- the graphs
(compiler/foreign_onnx.py read_foreign: their IO in precast's dimension names), the family (one whose
record says `precast build` takes its ONNX folders: SD 1.x / 2.x),
the prediction type (scheduler/scheduler_config.json, unless the recipe's model.prediction says), the
latent scale and factor (the VAE's config.json: scaling_factor, block_out_channels), the tokenizer, and
the bundle's onnx/ (the folder's own component files, configs, scheduler and model_index.json, copied:
the user's folder is never linked to nor written). Engines come from the same compile path as any
bundle's (bundle_writer.add_engines). What a foreign graph cannot take (LoRAs merged into weights, textual
inversion, ControlNet residuals, a separate VAE or text encoder) is refused in one line.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from ..runtime.manifest import SCHEMA, file_record, sha256_file
from ..runtime.staging import Staging
from .bundle_records import record_written, snapshot
from .bundle_writer import BundleWriter, add_engines, add_tokenizer, commit_bundle, write_manifest
from .cache import Cache, cache_key
from .engines import PRECAST_VERSION
from .errors import BadInput
from .families import FAMILIES
from .foreign_onnx import COMPONENTS, _json, read_foreign
from .interop import write_json
from .recipe import Recipe
from .targets import check_buildable


def folder_digest(folder: Path) -> str:
    """sha256 over every file of the folder (graphs, weight files, configs, tokenizer), by relative path."""
    return cache_key({p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
                      if p.is_file()})


def _refuse_extras(recipe: Recipe) -> None:
    extras = [name for name, v in (("loras", recipe.loras), ("embeddings", recipe.embeddings),
                                   ("controlnets", recipe.controlnets), ("preview", recipe.preview),
                                   ("model.vae", recipe.vae),
                                   ("model.text_encoders", recipe.text_encoders),
                                   ("model.set", {k: v for k, v in recipe.overrides.items() if k != "model"})) if v]
    if extras:
        raise BadInput(f"{recipe.path}: {', '.join(extras)}: not with an ONNX pipeline folder as model.source "
                       f"({recipe.source}); its graphs are built already: export the checkpoint with precast instead")


def _config(comp: str, cfg: dict, vae_cfg: dict) -> dict:
    """The config fields precast's runtime reads (runtime/loading.py, runtime/text_encoders.py,
    runtime/families/sd.py), from diffusers' / transformers' config.json."""
    if comp.startswith("text_encoder"):
        keys = {"hidden": "hidden_size", "vocab": "vocab_size", "layers": "num_hidden_layers",
                "max_positions": "max_position_embeddings"}
        return {k: cfg[v] for k, v in keys.items() if isinstance(cfg.get(v), int)}
    if comp.startswith("vae_"):
        blocks = vae_cfg.get("block_out_channels")
        out = {k: vae_cfg[k] for k in ("latent_channels", "scaling_factor") if k in vae_cfg}
        if isinstance(blocks, list) and 1 <= len(blocks) <= 8:
            out["decoder_levels"] = len(blocks)
        return out
    return {k: cfg[k] for k in ("in_channels", "out_channels", "cross_attention_dim", "sample_size") if k in cfg}


def _copy_into(writer, folder: Path, comp: str, names) -> list[str]:
    """The component's files copied (never linked: the user's folder may change) to onnx/<comp>/."""
    dest = writer.root / "onnx" / comp
    dest.mkdir(parents=True, exist_ok=True)
    placed = []
    for name in sorted(names):
        shutil.copyfile(folder / comp / name, dest / name)
        rel = f"onnx/{comp}/{name}"
        writer.files[rel] = file_record(dest / name)
        placed.append(rel)
    return placed


def _pipeline_files(writer, folder: Path, comps, index: dict) -> None:
    """onnx/model_index.json (the folder's, listing the components the bundle has) and scheduler/."""
    kept = {k: v for k, v in index.items() if k not in COMPONENTS or k in comps}
    paths = [write_json(writer.root / "onnx" / "model_index.json", kept)]
    sched = folder / "scheduler" / "scheduler_config.json"
    if sched.is_file():
        paths.append(write_json(writer.root / "onnx" / "scheduler" / "scheduler_config.json", _json(sched)))
    for p in paths:
        writer.files[p.relative_to(writer.root).as_posix()] = file_record(p)


def build_foreign(recipe: Recipe, out: Path, entries, cache: Cache, progress: bool, t0: float) -> dict:
    folder = Path(recipe.source)
    _refuse_extras(recipe)
    comps, found = read_foreign(folder)
    family, index = found["family"], _json(folder / "model_index.json")
    if recipe.family and recipe.family != family:
        raise BadInput(f"{recipe.path}: family {recipe.family!r} but {folder} is {family} (its graphs' IO)")
    fam = FAMILIES[family]
    if not fam.foreign_onnx:       # what the foreign reader's IO mapping and Txt2Img are proven on
        raise BadInput(f"{recipe.path}: {folder} is a {family} ONNX folder; `precast build` takes SD 1.x / 2.x ONNX "
                       f"folders (build {family} engines with `precast compile {folder} --target ...`)")
    wanted = sorted({e.component for e in entries})
    absent = [c for c in wanted if c not in comps]
    if absent:
        raise BadInput(f"{recipe.path}: components: {folder} has no {', '.join(absent)} (it has "
                       f"{', '.join(comps)}); list the components it has")
    vae_cfg = _json(folder / "vae_decoder" / "config.json") or _json(folder / "vae_encoder" / "config.json")
    configs = {c: _config(c, _json(folder / c / "config.json"), vae_cfg) for c in wanted}
    levels = next((c["decoder_levels"] for c in configs.values() if "decoder_levels" in c), 4)
    profiles = [dataclasses.replace(p, latent_factor=2 ** (levels - 1)) for p in recipe.profiles]
    for p in profiles:
        try:
            p.check()
        except BadInput as e:
            raise BadInput(f"{recipe.path}: profiles: {e}") from None
    dtypes = {}
    for c in wanted:
        dtypes[c] = comps[c].export_dtype
        named = c in recipe.precision_explicit or recipe.precision[c] != "fp32"     # fp32: the recipe default
        if named and recipe.precision[c] != dtypes[c]:
            raise BadInput(f"{recipe.path}: precision.{c} is {recipe.precision[c]} but {folder / c / 'model.onnx'} "
                           f"is {dtypes[c]}; an ONNX folder's graphs are built at their own precision")
    for e in entries:
        try:
            check_buildable(e.target, dtypes[e.component], e.component)
        except BadInput as err:
            raise BadInput(f"{recipe.path}: {err}") from None
    sched = _json(folder / "scheduler" / "scheduler_config.json")
    prediction = (recipe.overrides.get("model") or {}).get("prediction") or sched.get("prediction_type") or "epsilon"
    scale = vae_cfg.get("scaling_factor")
    layout = "diffusers" if str(index.get("_class_name", "")).startswith("Onnx") else "optimum"
    with Staging(out, "building", cache.staging) as stage:
        staging = stage.path
        writer = BundleWriter(staging)
        manifest = {"schema": SCHEMA, "precast": PRECAST_VERSION, "name": recipe.name,
                    "model": {"family": family, "variant": "", "source": folder.name,
                              "source_sha256": folder_digest(folder), "loras": [], "embeddings": [], "vae": None,
                              "prediction": prediction,
                              "latent_scale": float(scale) if isinstance(scale, (int, float)) else fam.runtime.latent_scale,
                              "onnx_source": {"layout": layout, "pipeline": index.get("_class_name")}},
                    "components": {}, "artifacts": [], "files": writer.files}
        report = []
        for c in wanted:
            c0 = time.perf_counter()
            names = set(comps[c].sizes) | ({"config.json"} if (folder / c / "config.json").is_file() else set())
            placed = _copy_into(writer, folder, c, names)
            manifest["components"][c] = {
                "onnx": f"onnx/{c}/model.onnx", "files": placed, "dtype": dtypes[c],
                "dtype_reason": f"the ONNX folder's ({layout})", "inputs": comps[c].inputs,
                "outputs": comps[c].outputs, "config": configs[c], "profiles": [p.describe() for p in profiles]}
            report.append({"entry": f"{c}.onnx", "component": c, "backend": "onnx", "target": "onnx",
                           "cache": "copy", "seconds": round(time.perf_counter() - c0, 3), "key": None,
                           "fingerprint": None})
        add_engines(writer, manifest, report, entries, profiles, comps, cache, progress)
        if "text_encoder" in wanted:
            add_tokenizer(writer, folder, "tokenizer", pad_zero=fam.pad_zero("text_encoder"))
            add_tokenizer(writer, folder, "onnx/tokenizer", pad_zero=fam.pad_zero("text_encoder"), source_folder="tokenizer")
        _pipeline_files(writer, folder, wanted, index)
        write_manifest(staging, manifest)
        staged = snapshot(staging, writer.files, skip=writer.copied)
        commit_bundle(stage)
        record_written(out, writer.files, staged, whole=set(staged) - writer.linked)
    return {"bundle": str(out), "artifacts": report, "seconds": round(time.perf_counter() - t0, 3)}
