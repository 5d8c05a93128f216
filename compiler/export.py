"""Checkpoint -> one ONNX folder per component (optimum-onnx layout), written atomically.

Owns: the export itself: open, detect, build every graph from the header alone (the components of the
detected family, compiler/families/, the ControlNets and the TAESD preview decoder given beside it), check
coverage and that the parts fit, and only then stream weights (LoRAs merged on the way) into a staging folder
that is renamed into place; the export's record (precast_export.json: family, variant, prediction type, latent scale,
schedule). A failure leaves nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from ..runtime.fileops import exchange_dirs, replace_file
from ..runtime.previews import PREVIEW_DECODER
from ..runtime.progress import bar
from ..runtime.staging import Staging, recover
from .cache import staging_registry
from .errors import BadInput
from .families import (FAMILIES, Component, Detected, Family, detect_family, flow_defaults, latent_channels_of,
                       latent_factor_of, require_supported, titles)
from .graphs import controlnet as cn
from .graphs import taesd
from .graphs.onnx_graph import DTYPE_NAMES, NP_OF, Graph
from .graphs.onnx_writer import save_model
from .interop import write_pipeline_folder
from .lora_merge import LoraSpec, plan_merge
from .sources.checkpoint import Checkpoint, open_checkpoint
from .sources.config_fields import field
from .sources.controlnet import CONTROL, CONTROLNET_PREFIX, controlnet_name, open_controlnet
from .sources.gguf_file import GGUF_BLOCKS, carried_blocks, source_quantization
from .sources.taesd import TAESD, open_preview_decoder


IGNORED_SUFFIXES = ("position_ids", "attn_mask", "logit_scale")  # buffers some saves carry; not weights


def _dtype_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def _io(values) -> list[dict]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "dtype": _dtype_name(t.elem_type), "shape": dims})
    return out


def present_components(ckpt: Checkpoint, family: Detected) -> list[str]:
    return [n for n, c in FAMILIES[family.name].components.items() if not c.optional and c.prefix_in(ckpt.refs)]


def component_dtype(family: Family, name: str, dtype: str, vae_dtype: str = "auto") -> str:
    """The VAE of SDXL-class models stays fp32 unless asked otherwise (it overflows in fp16)."""
    if not name.startswith("vae_"):
        return dtype
    if vae_dtype != "auto":
        return vae_dtype
    return "fp32" if family.fp32_vae else dtype


def plan_graphs(ckpt: Checkpoint, names: list[str], dtype: str, overrides: dict,
                vae_dtype: str = "auto") -> list[tuple[Component, Graph, dict]]:
    """Build every requested graph (header only) and check each one's coverage."""
    family = detect_family(ckpt)
    fam = require_supported(ckpt, family)
    table = fam.components
    unknown = [n for n in names if n not in table]
    if unknown:
        raise BadInput(f"--component {unknown[0]!r}: {family.name} has {', '.join(table)}")
    planned = []
    for name in names:
        comp = table[name]
        prefix = comp.prefix_in(ckpt.refs)
        if prefix is None:
            raise BadInput(f"{ckpt.path}: has no {name} weights (no tensors under {' or '.join(comp.prefixes)}); "
                           + (comp.missing_hint or "export the components it has with --component"))
        g = Graph(name, ckpt, prefix, component_dtype(fam, name, dtype, vae_dtype))
        try:
            cfg = comp.make_config(g, ckpt.configs.get(comp.config_key, {}), fam.overrides_for(comp, overrides))
            comp.build(g, cfg)
        except (ValueError, IndexError, TypeError, ZeroDivisionError, OverflowError) as e:
            raise BadInput(f"{ckpt.path}: the {name} tensors' shapes do not fit a {family.name} {name} ({e}); "
                           "the checkpoint may be damaged or of another architecture") from None
        g.check_coverage(list(comp.scopes or (prefix,)), ignore=lambda k: k.endswith(IGNORED_SUFFIXES))
        planned.append((comp, g, {**cfg.describe(), **g.config_extra}))
    if fam.check_parts:
        fam.check_parts(fam, {c.name: cfg for c, _, cfg in planned}, ckpt.path, ckpt.vae_file)
    return planned


def _progress(total: int, enabled: bool):
    """Bytes of weights written, on stderr (runtime/progress.py: a bar on a terminal, else a plain
    `export: 1.2/3.4 GB (35%)` line every PRECAST_PROGRESS_INTERVAL seconds)."""
    return bar(total, "export", unit="B", enabled=enabled)


def export(source: str | os.PathLike, out: str | os.PathLike, components: list[str] | None = None,
           dtype: str = "fp32", overrides: dict | None = None, progress: bool = True,
           vae_dtype: str = "auto", loras: list | None = None, allow_unmatched: bool = False,
           warn: Callable[[str], None] | None = None, vae: str | os.PathLike | None = None,
           text_encoders: tuple | list = (), controlnets: tuple | list = (),
           preview: str | os.PathLike | None = None) -> dict:
    """`loras`: (path, strength[, te_strength[, allow_unmatched]]) tuples or objects with those fields, merged into
    the weights while they stream (compiler/lora_merge.py); checked before anything is written.
    `controlnets`: (path, name or None) pairs (or paths): each becomes a `controlnet_<name>`
    component, and the UNet is built with their residuals as inputs. `preview`: a TAESD decoder file or folder,
    the `preview_decoder` component (plan_preview)."""
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "precast_export.json").is_file():
        raise BadInput(f"--out {out}: exists, is not empty and is not a precast export (no precast_export.json); "
                       "its folders would be replaced: choose a new or empty folder")
    earlier = _earlier(out)
    ckpt = open_checkpoint(source, vae=vae, text_encoders=text_encoders)
    family = detect_family(ckpt)
    fam = require_supported(ckpt, family)
    if text_encoders and not fam.text_encoder_files:
        raise BadInput(f"--text-encoder {text_encoders[0]}: separate text-encoder files are read for "
                       f"{titles(n for n, f in FAMILIES.items() if f.text_encoder_files)}; "
                       f"a {family.name} export takes its text encoders from {ckpt.path}: drop the flag")
    nets = plan_controlnets(ckpt, family, controlnets, dtype, overrides or {})
    previews = plan_preview(ckpt, family, preview, dtype)
    wanted = list(components) if components else None
    names = [n for n in wanted if not n.startswith(CONTROLNET_PREFIX) and n != PREVIEW_DECODER] if wanted else \
        present_components(ckpt, family)
    if wanted and PREVIEW_DECODER in wanted and not previews:
        raise BadInput(f"--component {PREVIEW_DECODER}: no TAESD decoder is given "
                       "(a recipe's `preview: {path: FILE}`)")
    unknown = [n for n in wanted or () if n.startswith(CONTROLNET_PREFIX) and n not in [c.name for c, _, _ in nets]]
    if unknown:
        raise BadInput(f"--component {unknown[0]}: no ControlNet of that name is given "
                       f"({', '.join(c.name for c, _, _ in nets) or 'none'}); add it with --controlnet FILE[:NAME]")
    # every ControlNet given, unless --component names some of them
    picked = wanted is not None and any(n.startswith(CONTROLNET_PREFIX) for n in wanted)
    planned = plan_graphs(ckpt, names, dtype, _with_residuals(overrides or {}, nets), vae_dtype) + \
        [n for n in nets if not picked or n[0].name in wanted] + \
        [p for p in previews if wanted is None or PREVIEW_DECODER in wanted]
    merge = _lora_plan(ckpt, loras, allow_unmatched, warn) if loras else None
    total = sum(int(np.prod(w.shape, dtype=np.int64)) * np.dtype(NP_OF[w.elem_type]).itemsize
                for _, g, _ in planned for w in g.weights.values())
    report = {"source": str(source), "layout": ckpt.layout, "family": family.name, "variant": family.variant,
              "dtype": dtype, "source_identity": ckpt.identity(), "components": [],
              "latent_scale": float(field(ckpt.configs.get("vae", {}), "scaling_factor", "positive",
                                          fam.runtime.latent_scale, f"{ckpt.path} vae/config.json")),
              "prediction": prediction_type(ckpt, family, overrides or {})}
    if fam.runtime.latent_shift:
        report["latent_shift"] = float(field(ckpt.configs.get("vae", {}), "shift_factor", "finite",
                                             fam.runtime.latent_shift, f"{ckpt.path} vae/config.json"))
    if fam.t5:
        released = fam.flow(family.variant)
        report["t5_tokens"] = released.t5_tokens if released else 512
        report["latent_factor"] = latent_factor_of(ckpt.refs)   # for `precast compile` of a transformer alone
    flow = flow_defaults(family.name, family.variant, ckpt.configs.get("scheduler", {}),
                         f"{ckpt.path} scheduler/scheduler_config.json")
    if flow is not None:             # the source folder's own schedule, as bundles record it (interop, GenAI)
        report.update(flow)
    if quantization := source_quantization(ckpt.refs):    # a GGUF source: tensors per GGUF type
        report["source_quantization"] = quantization
    if vae is not None:
        report["vae"] = str(vae)
    if text_encoders:
        report["text_encoders"] = [str(t) for t in text_encoders]
    if merge is not None:
        report["loras"] = merge.describe()
    if nets:
        report["controlnets"] = [{"name": c.name, "source": cfg["source"], "layout": g.ckpt.layout,
                                  "source_identity": g.ckpt.identity(), "residuals": cfg["control_residuals"]}
                                 for c, g, cfg in nets]
    if previews:
        report["preview"] = {"source": str(preview), "layout": previews[0][1].ckpt.layout,
                             "source_identity": previews[0][1].ckpt.identity()}
    with Staging(out, "exporting", staging_registry()) as stage:
        staging = stage.path
        with _progress(total, progress) as bar:
            for comp, g, cfg in planned:
                folder = staging / comp.name
                merged = merge if g.ckpt is ckpt else None       # LoRAs merge into the model's own components
                model_path, data_path = save_model(g, str(folder), on_weight=bar.update, metadata={
                    "precast.family": family.name, "precast.component": comp.name, "precast.prefix": g.prefix,
                    "precast.source_identity": report["source_identity"] if g.ckpt is ckpt else g.ckpt.identity(),
                    **({"precast.loras": json.dumps(_lora_identity(report["loras"]))} if merged else {})},
                    transform=merged.transform if merged else None,
                    exact=frozenset(merged.touched()) if merged else frozenset())
                graph = g.to_proto()
                blocks = _record_gguf_blocks(g, folder, merged.touched() if merged else set())
                report["components"].append({
                    "name": comp.name, "path": comp.name + "/model.onnx", "config": cfg,
                    "dtype": DTYPE_NAMES[g.dtype], **({"precision_notes": g.notes} if g.notes else {}),
                    **({"gguf_blocks": blocks} if blocks else {}),
                    "inputs": _io(graph.input), "outputs": _io(graph.output),
                    "files": {os.path.basename(p): os.path.getsize(p) for p in (model_path, data_path)}})
        written = [c.name for c, _, _ in planned]
        report["components"] += _keep_earlier(report, earlier)
        (staging / "precast_export.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        _commit(stage, written)
        _remove_stale(out, report, earlier)
        write_pipeline_folder(out, report, {c["name"]: c["config"] for c in report["components"]}, Path(source))
    report["out"] = str(out)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def _record_gguf_blocks(g, folder: Path, touched: set[str]) -> dict | None:
    """`folder/gguf_blocks.json`: for each weight the export copied unchanged from GGUF Q8_0 / Q4_0 blocks
    (no LoRA merged into it), where those blocks lie, so that a target built with `weights: gguf` keeps
    them as they are (compiler/targets/gguf_blocks.py). Returns the component's record of it, or None."""
    tensors = {w.name: b for w in g.weights.values() if w.key not in touched and w.take is None
               and (b := carried_blocks(g.ckpt.refs[w.key])) is not None}
    if not tensors:
        return None
    files = {f: os.path.getsize(f) for b in tensors.values() for f, _, _ in b["segments"]}
    (folder / GGUF_BLOCKS).write_text(json.dumps({"files": files, "tensors": tensors}, sort_keys=True) + "\n")
    types: dict[str, int] = {}
    for b in tensors.values():
        types[b["type"]] = types.get(b["type"], 0) + 1
    return {"file": GGUF_BLOCKS, "weights": len(tensors), "types": dict(sorted(types.items()))}


def plan_controlnets(ckpt: Checkpoint, family: Detected, controlnets, dtype: str,
                     overrides: dict) -> list[tuple[Component, Graph, dict]]:
    """Open each ControlNet, check that it fits the model's UNet (one line naming both files and the
    field; fitting ones share the UNet's input blocks, so all give the same residual count) and
    build its graph (header only), as `controlnet_<name>` components."""
    if not controlnets:
        return []
    fam = FAMILIES[family.name]
    unet = fam.components.get("unet")
    prefix = unet.prefix_in(ckpt.refs) if unet else None
    if prefix is None:
        raise BadInput(f"--controlnet: {ckpt.path} has no SD UNet ({family.name}); ControlNets are built for SD 1.x, "
                       "SD 2.x and SDXL models")
    unet_overrides = fam.overrides_for(unet, overrides)
    unet_cfg = unet.make_config(Graph("unet", ckpt, prefix, dtype), ckpt.configs.get(unet.config_key, {}),
                                unet_overrides).describe()
    planned = []
    for item in controlnets:
        path, name = (item[0], item[1] if len(item) > 1 else None) if isinstance(item, (tuple, list)) else (item, None)
        comp_name = CONTROLNET_PREFIX + controlnet_name(path, name)
        if any(c.name == comp_name for c, _, _ in planned):
            raise BadInput(f"--controlnet {path}: a second ControlNet named {comp_name[len(CONTROLNET_PREFIX):]!r}; "
                           "name one of them with FILE:NAME")
        net = open_controlnet(path)
        g = Graph(comp_name, net, CONTROL, dtype)
        try:
            cfg = cn.controlnet_config(g, net.configs.get("controlnet", {}), unet_overrides, fam.controlnet_family)
            cn.check_fits(family.name, unet_cfg, cfg.describe(), ckpt.path, str(path))
            cn.build_controlnet(g, cfg)
        except (ValueError, IndexError, TypeError, ZeroDivisionError, OverflowError) as e:
            raise BadInput(f"--controlnet {path}: the tensors' shapes do not fit a ControlNet ({e}); the file may be "
                           "damaged or of another architecture") from None
        g.check_coverage([CONTROL], ignore=lambda k: k.endswith(IGNORED_SUFFIXES))
        comp = Component(comp_name, (CONTROL,), "controlnet", cn.controlnet_config, cn.build_controlnet)
        planned.append((comp, g, {**cfg.describe(), "source": str(path)}))
    return planned


def plan_preview(ckpt: Checkpoint, family: Detected, path, dtype: str) -> list[tuple[Component, Graph, dict]]:
    """The `preview_decoder` component made from a TAESD decoder (compiler/sources/taesd.py, graphs/taesd.py),
    built from its header and checked against the model's latents (one line naming the file and the key);
    [] without one."""
    if not path:
        return []
    dec = open_preview_decoder(path)
    g = Graph(PREVIEW_DECODER, dec, TAESD, dtype)
    try:
        cfg = taesd.taesd_config(g, dec.configs.get("preview", {}), {})
        taesd.build_taesd_decoder(g, cfg)
    except (ValueError, IndexError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise BadInput(f"preview: {path}: the tensors' shapes do not fit a TAESD decoder ({e}); the file may be "
                       "damaged or of another architecture") from None
    g.check_coverage([TAESD], ignore=lambda k: k.endswith(IGNORED_SUFFIXES))
    channels, factor = latent_channels_of(ckpt.refs), latent_factor_of(ckpt.refs)
    title, upscale = FAMILIES[family.name].runtime.title, cfg.describe()["upscale"]
    if channels is not None and channels != cfg.latent_channels:
        raise BadInput(f"preview: {path}: {dec.refs[TAESD + '1.weight'].key} takes {cfg.latent_channels}-channel "
                       f"latents, but {ckpt.path} ({title}) makes {channels}-channel ones; give the TAESD decoder "
                       f"made for {title}")
    if channels is not None and upscale != factor:
        raise BadInput(f"preview: {path}: decodes latents to {upscale}x their size, but {ckpt.path} ({title})'s VAE "
                       f"to {factor}x; give the TAESD decoder made for {title}")
    comp = Component(PREVIEW_DECODER, (TAESD,), "preview", taesd.taesd_config, taesd.build_taesd_decoder)
    return [(comp, g, cfg.describe())]


def _with_residuals(overrides: dict, nets: list) -> dict:
    """The overrides that build the UNet with one residual input per input block (+ the middle
    block's) when ControlNets are exported beside it; unchanged without."""
    if not nets:
        return overrides
    n = nets[0][2]["control_residuals"]
    return {**overrides, "unet": {**overrides.get("unet", {}), "control_residuals": n}}


def _lora_plan(ckpt: Checkpoint, loras: list, allow_unmatched: bool, warn):
    specs = []
    for item in loras:
        if isinstance(item, (tuple, list)):     # (path[, strength[, te_strength[, allow_unmatched]]])
            specs.append(LoraSpec(str(item[0]), float(item[1]) if len(item) > 1 else 1.0,
                                  None if len(item) < 3 or item[2] is None else float(item[2]),
                                  len(item) > 3 and bool(item[3])))
        else:
            specs.append(LoraSpec(str(item.path), float(item.strength), item.te_strength,
                                  bool(getattr(item, "allow_unmatched", False))))
    return plan_merge({k: tuple(ref.shape) for k, ref in ckpt.refs.items()}, specs, allow_unmatched, warn)


def _lora_identity(described: list[dict]) -> list[dict]:
    return [{k: d[k] for k in ("name", "sha256", "strength", "te_strength")} for d in described]


def prediction_type(ckpt: Checkpoint, family: Detected, overrides: dict) -> str:
    """epsilon or v_prediction: an override, a diffusers scheduler config, a marker key, or the family's
    rule from the weights (SD 2.x: compiler/families/sd.py v_prediction); "flow" for flow-matching families."""
    fam = FAMILIES[family.name]
    if fam.runtime.variants:
        return "flow"          # rectified flow: the transformer predicts the velocity (noise - data)
    if overrides.get("model", {}).get("prediction"):
        return str(overrides["model"]["prediction"])
    scheduler = field(ckpt.configs.get("scheduler", {}), "prediction_type", "", None,
                      f"{ckpt.path} scheduler/scheduler_config.json", ("epsilon", "v_prediction"))
    if scheduler:
        return scheduler
    if "v_pred" in ckpt.refs:
        return "v_prediction"
    if fam.guess_prediction:
        return fam.guess_prediction(ckpt) or "epsilon"
    return "epsilon"


def _earlier(out: Path) -> dict:
    """The report of an earlier export in `out` ({} if none or unreadable)."""
    try:
        report = json.loads((out / "precast_export.json").read_text())
        return report if isinstance(report, dict) and isinstance(report.get("components"), list) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _keep_earlier(report: dict, earlier: dict) -> list[dict]:
    """An export into an earlier one of the same source (same file, weights, LoRAs, VAE and text
    encoders) keeps that export's other components, so `--component vae_decoder --dtype fp32`
    re-exports one part; an earlier export of anything else goes whole."""
    same = ("source", "source_identity", "loras", "vae", "text_encoders", "family", "controlnets", "preview")
    if not earlier or any(earlier.get(k) != report.get(k) for k in same):
        return []
    names = {c["name"] for c in report["components"]}
    return [c for c in earlier["components"] if isinstance(c, dict) and c.get("name") not in names]


def _remove_stale(out: Path, report: dict, earlier: dict) -> None:
    """Earlier component folders the new report does not list go, so `compile` never meets them."""
    listed = {c["name"] for c in report["components"]}
    for c in earlier.get("components", []):
        name = c.get("name") if isinstance(c, dict) else None
        if isinstance(name, str) and name not in listed and name.isidentifier() and (out / name).is_dir():
            shutil.rmtree(out / name)


def _commit(stage: Staging, names: list[str]) -> None:
    """Move the finished staging folder into place: whole, or component by component into an
    existing output folder (each component folder exchanged with the old one in one step where the
    system can, else swapped by two renames), precast_export.json last."""
    out = stage.out
    if not out.exists():
        stage.commit()
        return
    for name in names + ["precast_export.json"]:
        target, new = out / name, stage.path / name
        recover(target)                    # a component an earlier, killed export left mid-swap
        if not target.is_dir():
            replace_file(new, target)      # a file, or a new folder: one rename (retried while Windows holds it)
        elif not exchange_dirs(new, target):   # else the old folder is in staging now, removed with it
            old = out / f".{name}.old-{os.getpid()}"
            replace_file(target, old)
            replace_file(new, target)
            shutil.rmtree(old, ignore_errors=True)
