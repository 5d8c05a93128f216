"""Choosing, for each component, the artifact that fits the device it is assigned to.

Owns: the candidate order (the assigned device first, then the other devices in rank order,
finally the bundle's ONNX on the CPU through OpenVINO or ONNX Runtime), the checks made before
anything is loaded (backend installed, fingerprint serves the device, shape profile covers the
request, every file's sha256), and the reasons recorded for each refusal, so `precast doctor`
and `precast generate` can say what runs where and why. A mismatched artifact is never loaded.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from .assign import COMPONENT_MODULE, Placement
from .devices import Device
from .fingerprint import Fingerprint, why_not_serves
from .manifest import Artifact, Manifest, verify_file

BACKENDS_FOR = {"nvidia": ("tensorrt-rtx",), "amd": ("migraphx",), "intel": ("openvino",),
                "cpu": ("openvino", "onnxruntime")}
DISTRIBUTIONS = {"tensorrt-rtx": ("tensorrt_rtx", "tensorrt-rtx"), "onnxruntime": ("onnxruntime",),
                 "openvino": ("openvino",)}


def installed_backends() -> dict[str, str]:
    """Backend -> version, for the backends importable here (without importing them, except
    OpenVINO, whose blobs are keyed by the full build string only its module reports)."""
    out = {}
    for backend, dists in DISTRIBUTIONS.items():
        for d in dists:
            try:
                out[backend] = importlib.metadata.version(d)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if "openvino" in out:
        try:
            import openvino
            out["openvino"] = "-".join(openvino.get_version().split("-")[:2])
        except ImportError:
            del out["openvino"]
    if importlib.util.find_spec("migraphx") is not None:
        out["migraphx"] = "unknown"
    return out


def device_fingerprint(device: Device, backend: str, version: str) -> Fingerprint:
    return Fingerprint(backend, version, device.vendor, "cpu" if device.kind == "cpu" else "gpu",
                       (device.arch,), device.driver)


def covers(artifact: Artifact, request: dict[str, tuple[int, ...]]) -> str | None:
    """None when every requested input shape lies within the artifact's profile."""
    for name, shape in request.items():
        prof = artifact.shapes.get(name)
        if prof is None:
            continue
        lo, _, hi = prof
        if len(lo) != len(shape) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return f"input {name} {list(shape)} is outside the engine's profile {lo}..{hi}"
    return None


@dataclass
class Candidate:
    component: str
    device: Device
    backend: str
    artifact: Artifact | None        # None: the bundle's ONNX, compiled/loaded at run time
    entry: Path
    note: str = ""
    pending: tuple = ()              # (root, file, record): sha256 checked just before loading

    def describe(self) -> dict:
        return {"component": self.component, "device": self.device.id, "device_name": self.device.name,
                "backend": self.backend, "artifact": self.artifact.id if self.artifact else "onnx",
                "how": "prebuilt engine" if self.artifact else "compile/load the bundle's ONNX at run time",
                "note": self.note}


@dataclass
class Selection:
    component: str
    viable: list[Candidate] = field(default_factory=list)    # in the order to try
    refused: list[str] = field(default_factory=list)          # why other artifacts were passed over

    @property
    def choice(self) -> Candidate | None:
        return self.viable[0] if self.viable else None


def select_component(manifest: Manifest, component: str, placement: Placement, devices: list[Device],
                     request: dict[str, tuple[int, ...]], installed: dict[str, str],
                     verify: bool = True) -> Selection:
    sel = Selection(component)
    if placement.device.kind == "cpu":  # pinned to the CPU: stay there (engines, then the ONNX)
        order = [placement.device]
    else:  # the assigned GPU, the other devices in rank order (CPU last), then the ONNX on the CPU
        order = [placement.device] + [d for d in devices if d.id != placement.device.id]
    artifacts = manifest.artifacts(component)
    checked: dict[str, str | None] = {}

    def files_ok(a: Artifact) -> str | None:
        if not verify:
            return None
        if a.id not in checked:
            checked[a.id] = next((p for rel in a.files if (p := verify_file(manifest.root, rel, manifest.files[rel]))),
                                 None)
        return checked[a.id]

    for dev in order:
        for backend in BACKENDS_FOR[dev.vendor if dev.kind != "cpu" else "cpu"]:
            mine = [a for a in artifacts if a.backend == backend]
            if not mine:
                continue
            if backend not in installed:
                sel.refused.append(f"{component}: {backend} artifacts skipped on {dev.id}: {backend} is not installed")
                continue
            fp = device_fingerprint(dev, backend, installed[backend])
            for a in mine:
                why = why_not_serves(Fingerprint.from_string(a.fingerprint), fp) or covers(a, request) or files_ok(a)
                if why:
                    sel.refused.append(f"{component}: {a.id} not used on {dev.id}: {why}")
                    continue
                note = ""
                if placement.offload and dev.id == placement.device.id:
                    note = ("weights streamed from host memory" if a.metadata.get("weight_streaming")
                            else "params offload asked, but this engine was not built with weight_streaming")
                sel.viable.append(Candidate(component, dev, backend, a, manifest.root / a.entry, note))
    cpu = next(d for d in devices if d.kind == "cpu")
    comp = manifest.components.get(component)
    if comp is not None:
        onnx_files = [f for f in comp["files"]]
        # With an engine ahead of it, the fallback ONNX (GBs for a UNet) is hashed only if it gets loaded.
        lazy = verify and bool(sel.viable)
        problem = next((p for rel in onnx_files if (p := verify_file(manifest.root, rel, manifest.files[rel]))),
                       None) if verify and not lazy else None
        if problem:
            sel.refused.append(f"{component}: the bundle's ONNX is damaged: {problem}")
        else:
            pending = tuple((manifest.root, rel, manifest.files[rel]) for rel in onnx_files) if lazy else ()
            for backend in ("openvino", "onnxruntime"):
                if backend in installed:
                    sel.viable.append(Candidate(component, cpu, backend, None, manifest.root / comp["onnx"],
                                                "fallback: no prebuilt engine fits", pending))
                    break
            else:
                sel.refused.append(f"{component}: no CPU fallback: neither openvino nor onnxruntime is installed")
    return sel


def select_all(manifest: Manifest, placements: dict[str, Placement], devices: list[Device],
               requests: dict[str, dict[str, tuple[int, ...]]], installed: dict[str, str] | None = None,
               verify: bool = True) -> dict[str, Selection]:
    installed = installed_backends() if installed is None else installed
    out = {}
    for component in manifest.components:
        module = COMPONENT_MODULE.get(component, "diffusion")
        out[component] = select_component(manifest, component, placements[module], devices,
                                          requests.get(component, {}), installed, verify)
    return out


def open_candidate(c: Candidate, output_names: list[str], offload: bool = False):
    """Load one candidate (checks already passed)."""
    from . import sessions
    from .cpu import default_precision
    if c.artifact is None:
        if c.backend == "openvino":
            config = {"PERFORMANCE_HINT": "LATENCY",
                      "INFERENCE_PRECISION_HINT": default_precision("CPU", c.device.arch, c.component)}
            return sessions.OpenVinoSession(c.entry, "CPU", config, from_onnx=True)
        return sessions.OnnxRuntimeSession(c.entry)
    meta = {"backend": c.backend, "entry": c.artifact.entry, **c.artifact.metadata}
    index = int("".join(ch for ch in c.device.id if ch.isdigit()) or 0)
    budget = 0 if offload and c.artifact.metadata.get("weight_streaming") else None
    device = "CPU" if c.device.kind == "cpu" else f"GPU.{index}"
    return sessions.open_artifact(_bundle_root(c), meta,
                                  device=device if c.backend == "openvino" else None,
                                  output_names=output_names, device_index=index, weight_budget=budget)


def _bundle_root(c: Candidate) -> Path:
    entry = Path(c.entry)
    return Path(str(entry)[: -len(c.artifact.entry)]) if c.artifact else entry.parent


def load_component(sel: Selection, output_names: list[str], offload: bool = False):
    """(session, candidate, reasons): the first viable candidate that loads; load failures
    are recorded and the next candidate is tried."""
    reasons = list(sel.refused)
    for c in sel.viable:
        problem = next((p for root, rel, rec in c.pending if (p := verify_file(root, rel, rec))), None)
        if problem:
            reasons.append(f"{sel.component}: the bundle's ONNX is damaged: {problem}")
            continue
        try:
            return open_candidate(c, output_names, offload), c, reasons
        except Exception as e:  # a backend refusing this machine is a reason to fall back, not a crash
            reasons.append(f"{sel.component}: {c.artifact.id if c.artifact else 'onnx'} via {c.backend} on "
                           f"{c.device.id} failed to load: {type(e).__name__}: {e}")
    from .errors import UserError
    raise UserError(f"{sel.component}: nothing in the bundle can run here:\n  " + "\n  ".join(reasons))
