"""OpenVINO target: ONNX -> (optional IR) -> a compiled blob for one device via export_model, or
(option `store: ir`, and `auto` for exports over 4 GiB) the rewritten / compressed model saved as IR
(model.xml/.bin), compiled when the runtime loads it: a blob is made from a compiled model held in
memory and handed out as one bytes object, two copies of the weights beside the source's, which a
12 B transformer does not fit; the IR is written weight by weight and read back memory-mapped.

Owns: the compile config (performance hint, inference precision chosen from what the CPU
does fast: f32 unless AMX makes bf16 faster; static shapes when the profile is static), the
model rewrites applied before compiling (Winograd 3x3 convolutions on CPU in f32 with static
shapes, on outputs of 32x32 and more by default: openvino_winograd.py; option `winograd: false` turns it off,
`winograd: N` sets the smallest side; a half-precision export's
attention made fusable on CPU: runtime/openvino_attention.py, which the runtime's compile-on-load
fallback applies too; option `compress_to_fp16`: every float weight, the Winograd-transformed ones
included, stored in fp16 in the engine and widened to the inference precision by OpenVINO -- half the
engine file, the arithmetic unchanged: exactly f32 on fp16-rounded weights; the CPU plugin widens them
when it loads the engine, so the memory is not halved there) and recording that config,
because an imported blob does not remember it: the runtime must pass the same config to
import_model.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from ...runtime.cpu import cpu_flags, default_precision, isa_level
from ...runtime.fingerprint import Fingerprint
from ...runtime.openvino_attention import rewrite_attention
from ...runtime.sessions import restore_input_defaults
from ..errors import BadInput
from .base import BuildJob, TargetSpec
from . import gguf_blocks
from .openvino_winograd import DEFAULT_MIN_SIZE, rewrite_convolutions
from .quantize import quantized, weights_as_parts
from .quantize_openvino import compress_openvino, transposes_into_matmuls

IR_OVER = 4 << 30      # store: auto keeps exports over 4 GiB as IR (see the module docstring)
REWRITES = "winograd-f4x4-2,attention-f32-1,fp16-weights-1,cpu-convs-float-1"   # bump when a model rewrite changes: it is part of the cache key


class OpenVinoTarget:
    name = "openvino"

    def _ov(self):
        try:
            import openvino
        except ImportError:
            raise BadInput("target openvino: the openvino package is not installed (pip install 'precast[openvino]')") from None
        return openvino

    def toolchain(self) -> dict[str, str]:
        return {"openvino": "-".join(self._ov().get_version().split("-")[:2]),  # e.g. 2026.4.1-22982
                "precast_openvino_rewrites": REWRITES}

    def device_arch(self, device: str) -> str:
        if device == "CPU":
            return isa_level(cpu_flags())
        if device.split(".")[0].upper() == "CPU":
            raise BadInput(f"target openvino device {device}: the CPU takes no index or other spelling; use CPU")
        core = self._ov().Core()
        if device.split(".")[0] not in {d.split(".")[0] for d in core.available_devices}:
            raise BadInput(f"target openvino device {device}: not present on this machine "
                           f"(available: {', '.join(core.available_devices)}); build it on a machine with that device")
        return str(core.get_property(device, "DEVICE_ARCHITECTURE"))

    def fingerprint(self, spec: TargetSpec) -> Fingerprint:
        device = spec.get("device", "CPU")
        vendor = "any" if device == "CPU" else "intel"
        return Fingerprint("openvino", self.toolchain()["openvino"], vendor, "cpu" if device == "CPU" else "gpu",
                           (self.device_arch(device),))

    def compile_config(self, spec: TargetSpec, component: str | None = None) -> dict[str, str]:
        device = spec.get("device", "CPU")
        cfg = {"PERFORMANCE_HINT": spec.get("performance_hint", "LATENCY"),
               "INFERENCE_PRECISION_HINT": spec.get("precision") or default_precision(device, self.device_arch(device),
                                                                                      component)}
        if spec.get("num_streams") is not None:
            cfg["NUM_STREAMS"] = str(spec.get("num_streams"))
        if spec.get("threads") is not None:
            cfg["INFERENCE_NUM_THREADS"] = str(spec.get("threads"))
        return cfg

    @staticmethod
    def stores_ir(spec: TargetSpec, onnx_path: Path) -> bool:
        """IR instead of a blob: asked for, or (`auto`, the default) an export over IR_OVER bytes."""
        store = spec.get("store", "auto")
        if store != "auto":
            return store == "ir"
        data = onnx_path.with_name(onnx_path.name + "_data")
        return onnx_path.stat().st_size + (data.stat().st_size if data.exists() else 0) > IR_OVER

    def build(self, job: BuildJob, spec: TargetSpec, folder: Path) -> dict:
        if not (spec.get("weights") and quantized(job.component)):
            return self._build(job, spec, folder, job.onnx_path)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".weights-") as tmp:   # quantize.py: parts, fp32 graph
            _note(job, "weights as parts")
            parts: dict = {}
            return self._build(job, spec, folder, weights_as_parts(job.onnx_path, Path(tmp), parts), parts)

    def _build(self, job: BuildJob, spec: TargetSpec, folder: Path, source: Path, parts: dict | None = None) -> dict:
        ov = self._ov()
        device = spec.get("device", "CPU")
        core = ov.Core()
        _note(job, "read_model")
        model = core.read_model(str(source))
        weights = spec.get("weights") if quantized(job.component) else None
        folded = transposes_into_matmuls(model) if weights else 0     # before reshape could fold a copy
        carried = gguf_blocks.of(job.extra.get("gguf_blocks")) if weights == "gguf" else None
        kept = gguf_blocks.into_openvino(model, carried, parts or {}, job.onnx_path) if carried else {}
        restore_input_defaults(model, ov)    # token_embeddings_extra: read as a constant, made an input again
        if job.static:
            model.reshape({name: ov.PartialShape(list(opt)) for name, (_, opt, _) in job.shapes.items()})
        else:
            model.reshape({name: ov.PartialShape([ov.Dimension(a, b) for a, b in zip(mn, mx)])
                           for name, (mn, _, mx) in job.shapes.items()})
        if spec.get("ir", False) and not self.stores_ir(spec, job.onnx_path):
            _note(job, "save_model")
            ov.save_model(model, str(folder / "model.xml"), compress_to_fp16=bool(spec.get("compress_to_fp16", False)))
        config = self.compile_config(spec, job.component)
        rewrites = {}
        if device == "CPU":    # a half export's attention fused (openvino_attention.py)
            if count := rewrite_attention(model):
                rewrites["attention_f32"] = count
        if device == "CPU" and job.static and config["INFERENCE_PRECISION_HINT"] == "f32" \
                and spec.get("winograd", True) and weights is None:    # quantized weights: convolutions as NNCF left them
            winograd = spec.get("winograd", True)     # true, or the smallest output side rewritten
            rewrites["winograd"] = rewrite_convolutions(model, DEFAULT_MIN_SIZE if winograd is True else winograd)
        if spec.get("compress_to_fp16"):     # after the rewrites, so their constants are stored in fp16 too
            _note(job, "compress_to_fp16")
            rewrites["weights_fp16"] = compress_weights_fp16(model, ov)
        compression = None
        if weights:        # weight-only int8 / int4 (quantize.py): NNCF on the ov.Model, before compiling
            _note(job, f"compress_weights {weights}")
            model, compression = compress_openvino(model, weights, spec.get("group_size"),
                                                   f"{job.component} openvino", device)
            compression["transposes_folded"] = folded
            if weights == "gguf":      # NNCF's int8 (asymmetric) writes two u8 constants per weight: values, zero points
                compression.update(gguf_blocks=kept, requantized=compression["constants"].get("u8", 0) // 2)
        if self.stores_ir(spec, job.onnx_path):
            _note(job, "save_model")
            ov.save_model(model, str(folder / "model.xml"), compress_to_fp16=False)
            return {"entry": "model.xml", "device": device, "compile_config": config, "static": job.static,
                    "precision": config["INFERENCE_PRECISION_HINT"], "rewrites": rewrites,
                    "store": "ir", "weights": {"format": weights, **compression} if weights else None}
        _note(job, "compile_model")
        compiled = core.compile_model(model, device, config)
        del model
        _note(job, "export_model")
        blob = compiled.export_model()
        (folder / "model.blob").write_bytes(blob.getvalue() if hasattr(blob, "getvalue") else bytes(blob))
        del blob
        return {"entry": "model.blob", "device": device, "compile_config": config, "static": job.static,
                "precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
                "rewrites": rewrites, "weights": {"format": weights, **compression} if weights else None}


FP16_LEAST = 4096      # elements: a float constant this large is a weight, stored in fp16 by compress_to_fp16


def compress_weights_fp16(model, ov) -> int:
    """Every f32 constant of FP16_LEAST elements or more stored in fp16, widened where it is used (OpenVINO's
    own compression, as ovc --compress_to_fp16 runs it); the smaller ones -- epsilons, scales, the timestep
    embedding's frequencies, most biases and norms -- put back as they were (compressed too, they cost the tiny
    UNet 4e-3 relative), so only the weights are rounded. Returns how many are stored in fp16."""
    from openvino._offline_transformations import compress_model_transformation
    consts = [op for op in model.get_ops() if op.get_type_name() == "Constant" and op.get_element_type() == ov.Type.f32]
    seen = Counter(op.get_friendly_name() for op in consts)
    small = {op.get_friendly_name(): op.get_data().copy() for op in consts       # a name seen twice: left compressed
             if 0 < op.get_data().size < FP16_LEAST and seen[op.get_friendly_name()] == 1}
    compress_model_transformation(model)
    stored = 0
    for op in model.get_ops():
        source = op.input_value(0).get_node() if op.get_type_name() == "Convert" else None
        if source is None or source.get_type_name() != "Constant" or source.get_element_type() != ov.Type.f16:
            continue
        original = small.get(source.get_friendly_name().removesuffix("_compressed"))
        if original is None:
            stored += 1
        else:
            op.output(0).replace(ov.opset13.constant(original).output(0))
    return stored


def _note(job: BuildJob, phase: str) -> None:
    """The phase in the compile step's heartbeat lines (runtime/progress.py)."""
    beat = job.extra.get("heartbeat")
    if beat is not None:
        beat.note = phase
