"""Component ONNX -> engine artifact for one target, through the content-addressed cache.

Owns: reading an export folder's components (read_export: a `precast export`'s record, or a foreign
ONNX folder's graphs through foreign_onnx.py; the record type is exported.py's), the cache key of an
artifact (sha256 over the graph, the weights, the component's input shapes, target and build options,
the fingerprint class and toolchain versions), the checks made before any build (`preflight`: files
present, dtype and options buildable, backend installed, shapes) and the compile step that reports,
per artifact, cache hit or miss and time, with a heartbeat on stderr while a backend builds
(runtime/progress.py).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..runtime.progress import heartbeat
from .cache import Cache, Entry, cache_key, input_digest, outcome
from .errors import BadInput
from .export_paths import beside, within
from .exported import ExportedComponent
from .foreign_onnx import is_foreign_folder, read_foreign
from .profiles import ShapeProfile
from .targets import BuildJob, TargetSpec, check_buildable, get_target
from .targets.quantize import quantized, quantizer_versions

PRECAST_VERSION = "0.1.0"


def read_export(folder: str | Path) -> dict[str, ExportedComponent]:
    """The components of a `precast export` folder (its precast_export.json)."""
    folder = Path(folder)
    index = folder / "precast_export.json"
    if not folder.exists():
        raise BadInput(f"{folder}: no such folder; give the --out folder of `precast export`")
    if not index.is_file():
        if is_foreign_folder(folder):   # optimum-cli export onnx / diffusers ONNX pipeline folder
            return read_foreign(folder)[0]
        raise BadInput(f"{folder}: not a precast export folder (no precast_export.json); run `precast export` first")
    try:
        report = json.loads(index.read_text())
        gguf = bool(report.get("source_quantization"))
        comps = {}
        for c in report["components"]:
            path = within(folder, c["path"], f"{index}: component {c['name']}")
            for io in (c["inputs"], c["outputs"]):
                if not isinstance(io, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                       and isinstance(t.get("shape"), list) for t in io):
                    raise ValueError(f"component {c['name']}'s inputs / outputs are not a list of name + shape records")
            comps[c["name"]] = ExportedComponent(c["name"], path, c["inputs"], c["outputs"], dict(c.get("files") or {}),
                                                 c.get("dtype"), _positive_int((c.get("config") or {}).get("max_positions")),
                                                 _gguf_blocks(path, c.get("gguf_blocks")), gguf)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise BadInput(f"{index}: damaged ({e}); export again") from None
    return comps


def _gguf_blocks(onnx_path: Path, record) -> Path | None:
    name = record.get("file") if isinstance(record, dict) else None
    return onnx_path.parent / name if isinstance(name, str) and "/" not in name and "\\" not in name else None


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _export_report(folder: str | Path) -> dict:
    try:
        report = json.loads((Path(folder) / "precast_export.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return report if isinstance(report, dict) else {}


def export_t5_tokens(folder: str | Path) -> int | None:
    """The T5 length an export was made for (Flux dev 512, schnell 256), if it has a T5."""
    value = _export_report(folder).get("t5_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def export_latent_factor(folder: str | Path) -> int:
    """Pixels per latent of an export's VAE (2 ** (levels - 1)): as the export recorded it for its
    model, else from an exported VAE's config; 8 when neither says."""
    report = _export_report(folder)
    recorded = report.get("latent_factor")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded in (1, 2, 4, 8, 16, 32, 64, 128):
        return recorded
    for c in report.get("components") or []:
        cfg = c.get("config") if isinstance(c, dict) else None
        levels = (cfg or {}).get("decoder_levels") or (cfg or {}).get("encoder_levels")
        if isinstance(levels, int) and not isinstance(levels, bool) and 1 <= levels <= 8:
            return 2 ** (levels - 1)
    return 8


def check_exported(comp: ExportedComponent) -> None:
    """The component's files are there with the sizes the export recorded; else one line naming
    the file (a deleted model.onnx_data would otherwise surface as a traceback inside a target)."""
    folder, sizes = comp.onnx_path.parent, comp.sizes or {}
    for name in sorted({comp.onnx_path.name, *sizes}):
        path, want = folder / name, sizes.get(name)
        if not path.is_file():
            raise BadInput(f"{path}: missing; export again")
        if isinstance(want, int) and path.stat().st_size != want:
            raise BadInput(f"{path}: {path.stat().st_size} bytes, the export wrote {want}; export again")


def check_exported_graph(comp: ExportedComponent) -> None:
    """Before a build: the graph parses and every external tensor lies inside its data file
    (a garbage model.onnx would otherwise be an onnx/protobuf traceback inside a target). A cache
    hit needs no parse: its key already covers the files' digests."""
    import onnx
    try:
        model = onnx.load(str(comp.onnx_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: the file is not an ONNX model
        raise BadInput(f"{comp.onnx_path}: not a readable ONNX model ({type(e).__name__}); export again") from None
    if model.ir_version <= 0 or not model.graph.node:
        raise BadInput(f"{comp.onnx_path}: not an ONNX model (no IR version or no nodes); export again")
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL and tensor.raw_data:
            _check_raw_size(comp.onnx_path, tensor)
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in tensor.external_data}
            data = beside(comp.onnx_path, where.get("location"), tensor.name)
            end = sum(int(v) if v.isascii() and v.isdigit() else -1 for k, v in where.items() if k in ("offset", "length"))
            if not data.is_file() or end < 0 or data.stat().st_size < end:
                raise BadInput(f"{data}: missing or shorter than {comp.onnx_path.name} says "
                               f"(tensor {tensor.name}); export again")


def _check_raw_size(graph: Path, tensor) -> None:
    """An inline tensor's bytes are what its dims and type say (a graph claiming 2^40 values in 8 bytes would
    otherwise be an onnxsim / OpenVINO RuntimeError inside a target)."""
    import math

    import onnx
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        raise BadInput(f"{graph}: tensor {tensor.name} has element type {tensor.data_type}, which ONNX does not "
                       "define; export again") from None
    if tensor.data_type == onnx.TensorProto.STRING:
        return
    four_bit = {getattr(onnx.TensorProto, n, None) for n in ("INT4", "UINT4", "FLOAT4E2M1")}
    bits = 4 if tensor.data_type in four_bit else 8 * itemsize
    want = (math.prod(tensor.dims) * bits + 7) // 8
    if want != len(tensor.raw_data):
        raise BadInput(f"{graph}: tensor {tensor.name} holds {len(tensor.raw_data)} bytes, its shape "
                       f"{list(tensor.dims)} says {want}; export again")


def artifact_key(comp: ExportedComponent, spec: TargetSpec, shapes: dict, toolchain: dict, fingerprint: str,
                 memo_dir: Path | None = None) -> str:
    data = comp.onnx_path.with_name(comp.onnx_path.name + "_data")
    # weights in files of other names (a foreign export's per-tensor files): their digests too
    extra = sorted(n for n in (comp.sizes or {}) if n not in (comp.onnx_path.name, data.name))
    return cache_key({
        **({"extra_weights_sha256": {n: input_digest(comp.onnx_path.parent / n, memo_dir) for n in extra}}
           if extra else {}),
        "graph_sha256": input_digest(comp.onnx_path, memo_dir),
        "weights_sha256": input_digest(data, memo_dir) if data.exists() else "",
        "component": comp.name,
        "shapes": {k: [list(s) for s in v] for k, v in sorted(shapes.items())},
        "target": spec.describe(),
        "fingerprint": fingerprint,
        "toolchain": {**toolchain, "precast": PRECAST_VERSION},
        **({"quantizer": quantizer_versions(spec)} if spec.get("weights") else {}),   # weight-only quantization
        **({"gguf_blocks_sha256": input_digest(comp.gguf_blocks, memo_dir)}     # where the kept blocks lie
           if spec.get("weights") == "gguf" and comp.gguf_blocks is not None and comp.gguf_blocks.is_file() else {}),
    })


def preflight(comp: ExportedComponent, spec: TargetSpec, profile: ShapeProfile) -> None:
    """Everything that can be refused before any work, in one line (BadInput): the export's files,
    the dtype and options this target cannot build (fp32 for Turing, bf16 for ONNX Runtime,
    refittable without a driver), a backend not installed, a device not present, the shapes."""
    check_exported(comp)
    check_buildable(spec, comp.export_dtype, comp.name)
    if spec.get("weights") == "gguf" and not comp.from_gguf:
        raise BadInput(f"{comp.name} for {spec.label()}: weights=gguf keeps the quantized blocks of the .gguf file a "
                       "model was exported from; this one was not made from a .gguf file: build with weights: int8 or "
                       "int4")
    get_target(spec.backend).fingerprint(spec)      # a device that is not here; MIGraphX without a gfx name
    profile.input_shapes(comp.name, comp.inputs)
    reads_tokens = any("sequence" in i["shape"] for i in comp.inputs)
    if comp.max_positions and reads_tokens and profile.text_tokens[2] > comp.max_positions:
        raise BadInput(f"{comp.name}: --tokens {':'.join(map(str, profile.tokens))}: this CLIP text encoder has "
                       f"{comp.max_positions} positions; give at most {comp.max_positions} (e.g. --tokens "
                       f"{comp.max_positions})")


def compile_component(comp: ExportedComponent, spec: TargetSpec, profile: ShapeProfile, cache: Cache,
                      progress: bool = True) -> tuple[dict, Entry]:
    """Build (or fetch) one artifact; returns (report record, verified cache entry). The record:
    component, backend, target, cache (hit | remote | miss), seconds, key, fingerprint, path (the cache
    entry folder), artifact (its main file), entry (that file's name), size; remote (with a remote cache,
    on a local miss: hit | pushed | miss)."""
    target = get_target(spec.backend)
    preflight(comp, spec, profile)
    t0 = time.perf_counter()
    toolchain = target.toolchain()
    fingerprint = target.fingerprint(spec).to_string()
    shapes = profile.input_shapes(comp.name, comp.inputs)
    key = artifact_key(comp, spec, shapes, toolchain, fingerprint, cache.root)
    job = BuildJob(comp.onnx_path, comp.name, comp.inputs, shapes, progress,
                   {"gguf_blocks": (comp.gguf_blocks, comp.gguf_sources)} if spec.get("weights") == "gguf" else {})
    if spec.get("weights") == "gguf" and comp.gguf_blocks is None and quantized(comp.name):
        print(f"note: {comp.name} holds no weights copied from GGUF Q8_0 / Q4_0 blocks: weights: gguf quantizes it "
              "int8", file=sys.stderr)

    def build(folder: Path) -> dict:
        b0 = time.perf_counter()
        check_exported_graph(comp)
        # TensorRT-RTX's builder phases show as the beat's note (a spinner on a terminal, lines in a log)
        with heartbeat(f"compile {comp.name} for {spec.label()}", progress) as beat:
            job.extra["heartbeat"] = beat
            meta = target.build(job, spec, folder)
        return {**meta, "component": comp.name, "backend": spec.backend, "target": spec.describe(),
                "fingerprint": fingerprint, "toolchain": {**toolchain, "precast": PRECAST_VERSION},
                "shapes": {k: [list(s) for s in v] for k, v in shapes.items()}, "static": job.static,
                "inputs": comp.inputs, "outputs": comp.outputs, "build_seconds": round(time.perf_counter() - b0, 3)}

    entry, hit, evicted = cache.get_or_build(key, build, progress=progress)
    main = entry.metadata.get("entry")
    record = {"component": comp.name, "backend": spec.backend, "target": spec.label(),
              "cache": outcome(entry, hit), "seconds": round(time.perf_counter() - t0, 3), "key": key,
              "fingerprint": fingerprint, "path": str(entry.path),
              "artifact": str(entry.path / main) if main else None, "entry": main, "size": entry.size}
    if evicted:
        record["evicted"] = evicted
    if entry.remote:
        record["remote"] = entry.remote
    return record, entry
