"""Checkpoint -> one ONNX folder per component (optimum-onnx layout), written atomically.

Owns: which components a family has, which checkpoint keys each must consume, and the export
itself: open, detect, build every graph from the header alone, check coverage, and only then
stream weights into a staging folder that is renamed into place. A failure leaves nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx

from .errors import BadInput
from .graphs import clip_text, ldm_unet, ldm_vae
from .graphs.onnx_graph import Graph, save_model
from .sources.checkpoint import TEXT, UNET, VAE, Checkpoint, open_checkpoint
from .sources.detect import detect_family, require_supported


@dataclass(frozen=True)
class Component:
    name: str                     # optimum folder name
    prefix: str                   # canonical key prefix of its weights
    scopes: tuple[str, ...]       # every key under these must be used by the graph
    config_name: str              # diffusers subfolder whose config.json applies; override namespace
    make_config: Callable
    build: Callable


SD1_COMPONENTS = {
    "text_encoder": Component("text_encoder", TEXT, (TEXT,), "text_encoder",
                              clip_text.clip_text_config, clip_text.build_clip_text),
    "unet": Component("unet", UNET, (UNET,), "unet", ldm_unet.unet_config, ldm_unet.build_unet),
    "vae_encoder": Component("vae_encoder", VAE, (VAE + "encoder.", VAE + "quant_conv."), "vae",
                             ldm_vae.vae_config, ldm_vae.build_vae_encoder),
    "vae_decoder": Component("vae_decoder", VAE, (VAE + "decoder.", VAE + "post_quant_conv."), "vae",
                             ldm_vae.vae_config, ldm_vae.build_vae_decoder),
}
IGNORED_SUFFIXES = ("position_ids",)  # buffers some saves carry; not weights


def _dtype_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def _io(values) -> list[dict]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "dtype": _dtype_name(t.elem_type), "shape": dims})
    return out


def plan_graphs(ckpt: Checkpoint, names: list[str], dtype: str, overrides: dict) -> list[tuple[Component, Graph, dict]]:
    """Build every requested graph (header only) and check each one's coverage."""
    family = detect_family(ckpt)
    require_supported(ckpt, family)
    unknown = [n for n in names if n not in SD1_COMPONENTS]
    if unknown:
        raise BadInput(f"--component {unknown[0]!r}: {family.name} has {', '.join(SD1_COMPONENTS)}")
    planned = []
    for name in names:
        comp = SD1_COMPONENTS[name]
        if not ckpt.with_prefix(comp.prefix):
            raise BadInput(f"{ckpt.path}: has no {name} weights (no tensors under {comp.prefix}); "
                           f"export the components it has with --component")
        g = Graph(name, ckpt, comp.prefix, dtype)
        cfg = comp.make_config(g, ckpt.configs.get(comp.config_name, {}), overrides.get(comp.config_name, {}))
        comp.build(g, cfg)
        g.check_coverage(list(comp.scopes), ignore=lambda k: k.endswith(IGNORED_SUFFIXES))
        planned.append((comp, g, cfg.describe()))
    return planned


def _progress(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=None if enabled else True,
                leave=False)


def export(source: str | os.PathLike, out: str | os.PathLike, components: list[str] | None = None,
           dtype: str = "fp32", overrides: dict | None = None, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a folder")
    ckpt = open_checkpoint(source)
    family = detect_family(ckpt)
    names = list(components) if components else [n for n, c in SD1_COMPONENTS.items() if ckpt.with_prefix(c.prefix)]
    planned = plan_graphs(ckpt, names, dtype, overrides or {})
    total = sum(ckpt.refs[w.key].file.tensors[ckpt.refs[w.key].key].end - ckpt.refs[w.key].file.tensors[
        ckpt.refs[w.key].key].start for _, g, _ in planned for w in g.weights.values())
    staging = out.parent / f".{out.name}.precast-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    report = {"source": str(source), "layout": ckpt.layout, "family": family.name, "variant": family.variant,
              "dtype": dtype, "source_identity": ckpt.identity(), "components": []}
    try:
        with _progress(total, progress) as bar:
            for comp, g, cfg in planned:
                folder = staging / comp.name
                model_path, data_path = save_model(g, str(folder), on_weight=bar.update, metadata={
                    "precast.family": family.name, "precast.component": comp.name,
                    "precast.source_identity": report["source_identity"]})
                graph = g.to_proto()
                report["components"].append({
                    "name": comp.name, "path": comp.name + "/model.onnx", "config": cfg,
                    "inputs": _io(graph.input), "outputs": _io(graph.output),
                    "files": {os.path.basename(p): os.path.getsize(p) for p in (model_path, data_path)}})
        (staging / "precast_export.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        _commit(staging, out, [c.name for c, _, _ in planned])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report["out"] = str(out)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def _commit(staging: Path, out: Path, names: list[str]) -> None:
    """Move the finished staging folder into place: whole, or component by component into an
    existing output folder (each component swapped by rename, the old one removed after)."""
    if not out.exists():
        os.rename(staging, out)
        return
    for name in names + ["precast_export.json"]:
        target, old = out / name, out / f".{name}.old-{os.getpid()}"
        if target.exists():
            os.rename(target, old)
        os.rename(staging / name, target)
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
