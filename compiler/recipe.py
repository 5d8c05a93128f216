"""Build recipes: YAML that says what to build, validated with errors that name file:line and field.

Owns: the recipe schema (model source, family, components, precision per component, LoRAs and
embeddings, ControlNets, the preview decoder, shape profiles, targets), its validation, a family's default
components (all of the family's, compiler/families/) and the shipped recipes. Reading the YAML with its lines is
compiler/recipe_doc.py's. Paths are relative to the recipe's folder; `demo:tiny-NAME` names an embedded
checkpoint, the file `precast demo-model --family NAME` writes (written on demand, no download).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.previews import PREVIEW_DECODER
from ..runtime.prompts import CLIP_TOKENS
from ..runtime.vae_segments import TILED
from .errors import BadInput
from .families import ASSUMED, FAMILIES, SET_FIELDS, detect_family, require_supported, set_problem
from .foreign_onnx import is_foreign_folder, read_foreign
from .profiles import MAX_TOKENS, ShapeProfile, parse_range
from .recipe_doc import Doc, check_keys, flag, listed, number, string
from .sources.checkpoint import open_checkpoint
from .sources.controlnet import controlnet_name
from .targets import TargetSpec, dtype_problem, get_target, parse_target, shape_problem

COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "unet", "transformer", "vae_encoder", "vae_decoder",
              "vae_encoder_tiled", "vae_decoder_tiled")
# a recipe's default components: all of its family's (the one table of families, compiler/families/) but those
# asked for by name only (the tiled VAE decoder and encoder)
DEFAULT_COMPONENTS = {name: tuple(n for n, c in f.components.items() if not c.optional) for name, f in FAMILIES.items()}
PRECISIONS = ("fp32", "fp16", "bf16")
TOP_FIELDS = {"name", "model", "components", "precision", "loras", "embeddings", "controlnets", "preview", "profiles",
              "targets"}
MODEL_FIELDS = {"source", "family", "set", "vae", "prediction", "text_encoders"}
PROFILE_FIELDS = {"batch", "height", "width", "tokens", "t5_tokens", "static"}
# embedded tiny models (written on demand, no download): demo name -> family (each family's Family.demos)
DEMO_SOURCES = {demo: f.name for f in FAMILIES.values() for demo in f.demos}


@dataclass(frozen=True)
class Lora:
    path: str
    strength: float = 1.0
    te_strength: float | None = None
    allow_unmatched: bool = False       # its tensors that name no model weight are skipped (listed), not an error


@dataclass(frozen=True)
class Recipe:
    path: str
    name: str
    source: str                         # absolute path, or demo:<name>
    family: str | None
    overrides: dict
    components: tuple[str, ...]
    precision: dict[str, str]           # component -> fp32 | fp16
    precision_explicit: frozenset       # components whose precision the recipe names itself
    vae: str | None                     # a separate VAE file/folder (e.g. the SDXL fp16-fix VAE)
    text_encoders: tuple[str, ...]      # separate text-encoder files (Flux's T5-XXL / CLIP-L), by content
    loras: tuple[Lora, ...]
    embeddings: tuple[str, ...]
    profiles: tuple[ShapeProfile, ...]
    targets: tuple[TargetSpec, ...]
    lines: dict = field(default_factory=dict, compare=False)
    assumed_components: bool = False   # no family, no components, no checkpoint to read: SD 1.x's assumed
    controlnets: tuple[tuple[str, str], ...] = ()   # (file or folder, name): components controlnet_<name>
    preview: str | None = None          # a TAESD decoder file or folder: the component preview_decoder


def _overrides(doc: Doc, value) -> dict:
    """`model.set`: {component: {field: value}}, each field one precast reads (families.SET_FIELDS)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise doc.error("model.set", "expected {component: {field: value}}, e.g. {unet: {num_heads: 8}}")
    for comp, fields in value.items():
        where = f"model.set.{comp}"
        if comp not in SET_FIELDS:
            raise doc.error(where, set_problem(comp, "", None))
        if not isinstance(fields, dict):
            raise doc.error(where, f"expected {{field: value}} with fields {', '.join(sorted(SET_FIELDS[comp]))}")
        for f, v in fields.items():
            problem = set_problem(comp, f, v)
            if problem:
                raise doc.error(f"{where}.{f}", problem)
    return {comp: dict(fields) for comp, fields in value.items()}


def _range(doc: Doc, where: str, value, default: int):
    if value is None:
        return (default,) * 3
    if isinstance(value, dict):
        check_keys(doc, where, value, {"min", "opt", "max"})
        value = f"{value.get('min')}:{value.get('opt', value.get('min'))}:{value.get('max', value.get('opt'))}"
    elif isinstance(value, list):
        value = ":".join(str(v) for v in value)
    try:
        return parse_range(value, where)
    except BadInput as e:
        raise doc.error(where, str(e).split(": ", 1)[-1]) from None


def _profiles(doc: Doc, value) -> tuple[ShapeProfile, ...]:
    if value is None:
        return (ShapeProfile(),)
    value = check_keys(doc, "profiles", value, PROFILE_FIELDS)
    if "static" in value:
        if set(value) != {"static"}:
            raise doc.error("profiles", "give either min/opt/max ranges or a `static:` list, not both")
        if not isinstance(value["static"], list) or not value["static"]:
            raise doc.error("profiles.static", "expected a list of {batch, height, width[, tokens]}")
        out = []
        for i, shape in enumerate(value["static"]):
            w = f"profiles.static[{i}]"
            check_keys(doc, w, shape, {"batch", "height", "width", "tokens", "t5_tokens"})
            out.append(_one_profile(doc, w, shape, static=True))
        return tuple(out)
    return (_one_profile(doc, "profiles", value),)


def _one_profile(doc, where, value, static=False) -> ShapeProfile:
    p = ShapeProfile(batch=_range(doc, f"{where}.batch", value.get("batch"), 1),
                     height=_range(doc, f"{where}.height", value.get("height"), 512),
                     width=_range(doc, f"{where}.width", value.get("width"), 512),
                     tokens=_range(doc, f"{where}.tokens", value.get("tokens"), 77),
                     t5_tokens=None if value.get("t5_tokens") is None else
                     _range(doc, f"{where}.t5_tokens", value.get("t5_tokens"), 512))
    if static and not p.static:
        raise doc.error(where, "static shapes take single values, not ranges")
    try:
        p.check()
    except BadInput as e:
        raise doc.error(where, str(e)) from None
    odd = [t for t in p.tokens if t > CLIP_TOKENS and t % CLIP_TOKENS]
    if odd:
        raise doc.error(f"{where}.tokens", f"{odd[0]} tokens: past {CLIP_TOKENS}, the UNet reads whole prompt chunks of "
                        f"{CLIP_TOKENS}: give {2 * CLIP_TOKENS}, {3 * CLIP_TOKENS}, ... up to {MAX_TOKENS}")
    return p


def _targets(doc: Doc, value) -> tuple[TargetSpec, ...]:
    if not isinstance(value, list) or not value:
        raise doc.error("targets", "expected a non-empty list, e.g. [onnxruntime, {openvino: {device: CPU}}, "
                                   "{tensorrt-rtx: {compute_capabilities: [sm_86]}}]")
    out = []
    for i, item in enumerate(value):
        where = f"targets[{i}]"
        if isinstance(item, str):
            name, opts = item, {}
        elif isinstance(item, dict) and len(item) == 1:
            name, opts = next(iter(item.items()))
            opts = opts or {}
            if not isinstance(opts, dict):
                raise doc.error(f"{where}.{name}", "expected a mapping of target options")
        else:
            raise doc.error(where, "expected a backend name or {backend: {options}}")
        try:
            if get_target(str(name)).name == "onnxruntime":
                opts = {"simplify": False, **opts}  # in a bundle the artifact is the shared ONNX: weights once
            out.append(parse_target(str(name), opts))
        except BadInput as e:
            raise doc.error(where, str(e)) from None
    return tuple(out)


def _detected_family(doc: Doc, source: str) -> str:
    """The family of the checkpoint at `source` (a file or folder there) from its header (names and
    shapes). A damaged file or a model precast does not build is refused now, as `build` would."""
    try:
        if is_foreign_folder(source):        # its graphs' IO, read without their weights
            return read_foreign(source)[1]["family"]
        ckpt = open_checkpoint(source)
        family = detect_family(ckpt)
        require_supported(ckpt, family)
        return family.name
    except BadInput as e:
        raise doc.error("model.source", str(e)) from None


SHIPPED = Path(__file__).parent / "recipes"   # package data; the repository's recipes/ links here


def shipped_recipes() -> list[str]:
    """The names of the recipes that come with precast (`precast build tiny-sd15`)."""
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def find_recipe(spec: str | Path) -> tuple[Path, Path]:
    """(the recipe file, the folder its relative paths start from) for a path or a shipped name.
    A path that exists is read as it is, relative to its own folder; otherwise a name such as
    `tiny-sd15` (or `tiny-sd15.yaml`) is a shipped recipe, whose relative paths (your checkpoint for
    `sd15`) start from the current folder, since the recipe itself lies inside the installed package."""
    path = Path(spec)
    if os.path.lexists(path):
        return path, path.parent
    text = str(spec)
    stem = text[:-5] if text.endswith(".yaml") else text
    if stem and "/" not in text and os.sep not in text and (SHIPPED / f"{stem}.yaml").is_file():
        return SHIPPED / f"{stem}.yaml", Path.cwd()
    raise BadInput(f"{spec}: no such recipe file, and not the name of a recipe precast ships "
                   f"({', '.join(shipped_recipes())}); give a recipe .yaml path or one of those names")


def load_recipe(path: str | Path, check_files: bool = True) -> Recipe:
    """Parse and validate a recipe, given as a path or a shipped recipe's name (see find_recipe).
    `check_files=False` (for `precast plan`, which CI runs before the checkpoint is downloaded)
    skips checking that the model files exist."""
    path, base = find_recipe(path)
    doc = Doc(path)
    data = check_keys(doc, "", doc.data, TOP_FIELDS)
    model = check_keys(doc, "model", data.get("model"), MODEL_FIELDS)
    source = model.get("source")
    if not isinstance(source, str) or not source:
        raise doc.error("model.source", "expected a checkpoint path (.safetensors file or diffusers folder) "
                                        f"or one of {', '.join(sorted(DEMO_SOURCES))}")
    if source.startswith("demo:"):
        if source not in DEMO_SOURCES:
            raise doc.error("model.source", f"unknown demo model {source!r}; known: {', '.join(sorted(DEMO_SOURCES))}")
    else:
        resolved = (base / source).resolve()
        if check_files and not resolved.exists():
            raise doc.error("model.source", f"{resolved} does not exist")
        if check_files and not (resolved.is_file() or resolved.is_dir()):
            raise doc.error("model.source", f"{resolved} is not a file or folder")
        source = str(resolved)     # an ONNX pipeline folder (optimum / diffusers) too: compiler/bundle_foreign.py
    family = model.get("family")
    if family is not None and (not isinstance(family, str) or family not in DEFAULT_COMPONENTS):
        raise doc.error("model.family", f"{family!r}: allowed: {', '.join(DEFAULT_COMPONENTS)}")
    comps = data.get("components")
    assumed = False
    if comps is None:   # the family's components: named, a demo's, or detected from the checkpoint's header
        default = family or DEMO_SOURCES.get(source) or (_detected_family(doc, source) if Path(source).is_file()
                                                         or Path(source).is_dir() else None)
        assumed = default is None
        comps = list(DEFAULT_COMPONENTS.get(default or ASSUMED, DEFAULT_COMPONENTS[ASSUMED]))
    if not isinstance(comps, list) or not comps:
        raise doc.error("components", f"expected a list drawn from {', '.join(COMPONENTS)}")
    for i, c in enumerate(comps):
        if c not in COMPONENTS:
            raise doc.error(f"components[{i}]", f"unknown component {c!r}; allowed: {', '.join(COMPONENTS)}")
    precision = data.get("precision", "fp32")
    if isinstance(precision, str):
        precision = {"default": precision}
    check_keys(doc, "precision", precision, {"default", *COMPONENTS})
    for k, v in precision.items():
        if v not in PRECISIONS:
            raise doc.error(f"precision.{k}" if len(precision) > 1 or k != "default" else "precision",
                            f"{v!r} is not a precision; allowed: {', '.join(PRECISIONS)}")
    # a tiled VAE twin takes its plain component's precision unless named itself (exact to that one's rounding)
    named = {**{twin: precision[plain] for plain, twin in TILED.items() if plain in precision}, **precision}
    per_comp = {c: named.get(c, precision.get("default", "fp32")) for c in comps}
    explicit = frozenset(c for c in comps if c in named)
    vae = model.get("vae")
    if vae is not None:
        vae_path = (base / string(doc, "model.vae", vae, "a VAE file or folder")).resolve()
        if check_files and not vae_path.exists():
            raise doc.error("model.vae", f"{vae_path} does not exist")
        if check_files and not (vae_path.is_file() or vae_path.is_dir()):
            raise doc.error("model.vae", f"{vae_path} is not a file or folder")
        vae = str(vae_path)
    text_encoders = []
    for i, te in enumerate(listed(doc, "model.text_encoders", model.get("text_encoders"), "text-encoder files")):
        te_path = (base / string(doc, f"model.text_encoders[{i}]", te, "a T5 / CLIP file")).resolve()
        if check_files and not te_path.exists():
            raise doc.error(f"model.text_encoders[{i}]", f"{te_path} does not exist")
        text_encoders.append(str(te_path))
    prediction = model.get("prediction")
    if prediction is not None and prediction not in ("epsilon", "v_prediction"):
        raise doc.error("model.prediction", f"{prediction!r}: allowed: epsilon, v_prediction")
    loras = []
    for i, item in enumerate(listed(doc, "loras", data.get("loras"), "LoRA files or {path, strength, te_strength}")):
        w = f"loras[{i}]"
        item = {"path": item} if isinstance(item, str) else \
            check_keys(doc, w, item, {"path", "strength", "te_strength", "allow_unmatched"})
        lora_path = string(doc, f"{w}.path" if "path" in item else w, item.get("path"), "{path: FILE, strength: S}")
        strength = number(doc, f"{w}.strength", item["strength"]) if "strength" in item else 1.0
        te = None if item.get("te_strength") is None else number(doc, f"{w}.te_strength", item["te_strength"])
        allow = flag(doc, f"{w}.allow_unmatched", item["allow_unmatched"]) if "allow_unmatched" in item else False
        loras.append(Lora(str((base / lora_path).resolve()), strength, te, allow))
    embeddings = tuple(str((base / string(doc, f"embeddings[{i}]", e, "an embedding file")).resolve())
                       for i, e in enumerate(listed(doc, "embeddings", data.get("embeddings"), "embedding files")))
    controlnets = _controlnets(doc, data.get("controlnets"), base, check_files)
    for _, net in controlnets:       # each its own component, built at the UNet's precision
        comps.append(f"controlnet_{net}")
        per_comp[f"controlnet_{net}"] = per_comp.get("unet", precision.get("default", "fp32"))
    preview = _preview(doc, data.get("preview"), base, check_files)
    if preview:                      # the step previews' tiny decoder, at the recipe's default precision
        comps.append(PREVIEW_DECODER)
        per_comp[PREVIEW_DECODER] = precision.get("default", "fp32")
    overrides = _overrides(doc, model.get("set"))
    if prediction:
        overrides["model"] = {**overrides.get("model", {}), "prediction": prediction}
    name = path.stem if data.get("name") is None else string(doc, "name", data["name"], "a name (a string)")
    targets = _targets(doc, data.get("targets"))
    _check_target_dtypes(doc, targets, per_comp, explicit, family or DEMO_SOURCES.get(source))
    return Recipe(str(path), str(name), source, family, overrides, tuple(comps), per_comp, explicit, vae,
                  tuple(text_encoders), tuple(loras), embeddings, _profiles(doc, data.get("profiles")), targets,
                  lines=doc.lines, assumed_components=assumed, controlnets=controlnets, preview=preview)


def _controlnets(doc: Doc, value, base: Path, check_files: bool) -> tuple[tuple[str, str], ...]:
    """`controlnets:` -- files / folders or {path, name}: (absolute path, component name suffix)."""
    out: list[tuple[str, str]] = []
    for i, item in enumerate(listed(doc, "controlnets", value, "ControlNet files or {path, name}")):
        w = f"controlnets[{i}]"
        item = {"path": item} if isinstance(item, str) else check_keys(doc, w, item, {"path", "name"})
        path = (base / string(doc, f"{w}.path" if "path" in item else w, item.get("path"),
                               "{path: FILE, name: NAME}")).resolve()
        if check_files and not path.exists():
            raise doc.error(w, f"{path} does not exist")
        try:
            name = controlnet_name(path, None if item.get("name") is None else
                                   string(doc, f"{w}.name", item["name"], "a name: letters, digits and _"))
        except BadInput as e:
            raise doc.error(w, str(e)) from None
        if any(name == n for _, n in out):
            raise doc.error(w, f"a second ControlNet named {name!r}: give each one its own name")
        out.append((str(path), name))
    return tuple(out)


def _preview(doc: Doc, value, base: Path, check_files: bool) -> str | None:
    """`preview:` -- a TAESD decoder file or folder, or {path}: its absolute path (read at build: compiler/export.py
    plan_preview)."""
    if value is None:
        return None
    if not isinstance(value, (str, dict)):
        raise doc.error("preview", f"expected a TAESD decoder file or {{path: FILE}}, got {value!r}")
    item = {"path": value} if isinstance(value, str) else check_keys(doc, "preview", value, {"path"})
    path = (base / string(doc, "preview.path" if "path" in item else "preview", item.get("path"),
                          "{path: FILE}, a TAESD / TAESDXL / TAESD3 / TAEF1 decoder")).resolve()
    if check_files and not path.exists():
        raise doc.error("preview", f"{path} does not exist")
    return str(path)


def _check_target_dtypes(doc: Doc, targets, precision: dict, explicit: frozenset, family: str | None) -> None:
    """A precision a target cannot build (fp32 / bf16 for TensorRT-RTX sm_75, bf16 for ONNX Runtime)
    is refused when the recipe is read, so `plan` and `build` stop before any work."""
    fp32_vae = family in FAMILIES and FAMILIES[family].fp32_vae
    for i, spec in enumerate(targets):
        for comp, dtype in precision.items():
            if why := shape_problem(spec, comp):
                raise doc.error(f"targets[{i}]", why)
            source = "precision"
            if comp.startswith("vae_") and comp not in explicit and fp32_vae:
                dtype, source = "fp32", f"{family}'s VAE is kept fp32 unless precision.{comp} says otherwise"
            why = dtype_problem(spec, dtype, comp)
            if why:
                raise doc.error(f"targets[{i}]", f"{comp} is {dtype} ({source}), which {spec.label()} cannot "
                                                 f"build: {why}")
