"""Choosing, for each component, the artifact that fits the device it is assigned to.

Owns: the candidate order (the assigned device first, then the other devices in rank order,
finally the bundle's ONNX on the CPU through OpenVINO or ONNX Runtime), the checks made before
anything is loaded (backend installed, fingerprint serves the device, shape profile covers the
request, every file's sha256), and the reasons recorded for each refusal, so `precast doctor`
and `precast generate` can say what runs where and why. A mismatched artifact is never loaded.
A backend pinned by --backend (`unet=onnxruntime`, `te=cpu:openvino`) puts its candidates on the
assigned device first (the bundle's ONNX through that backend when it has no engine); the rest
follow as fallbacks, or are left out under --strict. A damaged file (one that fails its sha256 or size
check, or is missing) is passed over like any refusal, and said: one warning on stderr per damaged file
when the component loads from a fallback (`precast bundle verify` named as the check), a UserError under
--strict (no fallback past it). Reasons are `passed` records {artifact,
backend, device, reason}, including engines for devices this machine does not have (a
TensorRT-RTX engine without an NVIDIA GPU); `component_report` is the per-component record
doctor and generate both print. `installed_backends(root)` answers for a recorded machine when its tree
holds installed_backends.json; the bundle's ONNX through the CoreML EP is compiled once per ONNX content
into the user's cache (`coreml_cache_dir`). A pulled bundle whose ONNX a pull left out (runtime/oci/pull.py)
passes over that ONNX with the reason, never as damage.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .assign import COMPONENT_MODULE, Placement
from .budgets import apply_budgets, share_budgets
from .devices import Device
from .errors import UserError
from .fingerprint import Fingerprint, why_not_serves
from .sessions import ONNX_ON_DEVICE, open_candidate
from .manifest import Artifact, Manifest
from .verified import user_records_dir, verify_mode

BACKENDS_FOR = {"nvidia": ("tensorrt-rtx",), "amd": ("migraphx",), "intel": ("openvino",),
                "cpu": ("openvino", "onnxruntime")}
# every ONNX Runtime wheel carries the CPU EP: on Windows onnxruntime-directml replaces (not joins) onnxruntime
DISTRIBUTIONS = {"tensorrt-rtx": ("tensorrt_rtx", "tensorrt-rtx"),
                 "onnxruntime": ("onnxruntime", "onnxruntime-directml", "onnxruntime-gpu"),
                 "openvino": ("openvino",), "onnxruntime-directml": ("onnxruntime-directml",)}
# the bundle's ONNX runs on the device itself through these (the EP compiles it at load time)


RECORDED_BACKENDS = "installed_backends.json"


def installed_backends(root: str = "/") -> dict[str, str]:
    """Backend -> version, for the backends importable here (without importing them, except
    OpenVINO, whose blobs are keyed by the full build string only its module reports).

    `root` as discover_devices': a recorded machine's tree holding installed_backends.json (what
    `precast doctor --json` printed there) answers for that machine -- how tests put onnxruntime-directml
    on a recorded Windows machine and the CoreML EP on a recorded Mac; without one, this machine's."""
    if os.path.realpath(root or ".") != "/":
        recorded = _recorded_backends(os.path.join(root, RECORDED_BACKENDS))
        if recorded is not None:
            return recorded
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
    import platform
    if platform.system() == "Darwin" and "onnxruntime" in out:   # macOS wheels carry the CoreML EP
        out["onnxruntime-coreml"] = out["onnxruntime"]
    if platform.system() != "Windows":           # onnxruntime-directml is a Windows-only wheel
        out.pop("onnxruntime-directml", None)
    return out


def _recorded_backends(path: str) -> dict[str, str] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise UserError(f"{path}: expected a JSON object of backend -> version strings")
    return dict(data)


def device_fingerprint(device: Device, backend: str, version: str) -> Fingerprint:
    arch = f"fl{device.dx12}" if backend == "onnxruntime-directml" else device.arch
    return Fingerprint(backend, version, device.vendor, "cpu" if device.kind == "cpu" else "gpu",
                       (arch,), device.driver)


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
    pending: tuple = ()              # (manifest, file): sha256 checked just before loading
    memory: dict | None = None       # memory_plan(): weights against the device's budget
    weight_budget: int | None = None  # TensorRT-RTX weight streaming: bytes of weights kept on the GPU
    ep_cache: str = ""               # the CoreML EP's ModelCacheDirectory for this ONNX (coreml_cache_dir)

    def describe(self) -> dict:
        return {"component": self.component, "device": self.device.id, "device_name": self.device.name,
                "backend": self.backend, "artifact": self.artifact.id if self.artifact else "onnx",
                "how": "prebuilt engine" if self.artifact else "compile/load the bundle's ONNX at run time",
                "note": self.note, **({"memory": self.memory} if self.memory else {})}


def passed(reason: str, artifact: str | None = None, backend: str | None = None, device: str | None = None) -> dict:
    """One entry of a component's `passed_over`: what was not used (an artifact id, "onnx" for the
    bundle's ONNX, or null for an assignment), with which backend, on which device, and why."""
    return {"artifact": artifact, "backend": backend, "device": device, "reason": reason}


def passed_text(r: dict) -> str:
    """A `passed_over` entry as one line of text."""
    what = r["artifact"] or (f"{r['backend']} artifacts" if r["backend"] else "")
    where = f" on {r['device']}" if r["device"] else ""
    return f"{what}{where}: {r['reason']}" if what else r["reason"]


@dataclass
class Selection:
    component: str
    viable: list[Candidate] = field(default_factory=list)    # in the order to try
    refused: list[dict] = field(default_factory=list)        # `passed` entries: what was passed over, and why
    target: str = ""                                          # under --strict: where it must run ("cpu:onnxruntime")
    damaged: list[tuple] = field(default_factory=list)        # (bundle root, problem): warned when a fallback loads

    @property
    def choice(self) -> Candidate | None:
        return self.viable[0] if self.viable else None


def component_report(component: str, candidate: Candidate | None, passed_over: list[dict]) -> dict:
    """The per-component record `doctor --json` and `generate --json` share: module, where it runs
    (device, device_name, backend, artifact, how, note; nulls when nothing can run) and passed_over."""
    where = candidate.describe() if candidate else {
        "component": component, "device": None, "device_name": None, "backend": None, "artifact": None,
        "how": "nothing in the bundle can run here", "note": ""}
    return {"module": COMPONENT_MODULE.get(component, "diffusion"), **where, "passed_over": list(passed_over)}


RUNS_ON_WORDS = {"tensorrt-rtx": "an NVIDIA GPU", "migraphx": "an AMD GPU under ROCm (Linux)",
                 "onnxruntime-directml": "a Direct3D 12 GPU (Windows)", "onnxruntime-coreml": "an Apple GPU (macOS)"}


def offers(device: Device) -> tuple[str, ...]:
    """The backends that run on `device` (its own list; the vendor's default for records without one)."""
    return device.backends or BACKENDS_FOR.get(device.vendor if device.kind != "cpu" else "cpu", ())


def select_component(manifest: Manifest, component: str, placement: Placement, devices: list[Device],
                     request: dict[str, tuple[int, ...]], installed: dict[str, str],
                     verify: bool | str = True) -> Selection:
    """The candidates for one component, in order, and what was passed over. `verify` as select_all's."""
    mode = verify_mode(verify)
    if mode == "full" and not (manifest.verified is not None and manifest.verified.full):
        manifest = manifest.with_verify("full")
    verify = mode != "off"
    sel = Selection(component)
    pin = placement.backend
    if placement.fallback:
        sel.refused.append(passed(placement.fallback, None, pin, None))
    if placement.device.kind == "cpu" or placement.strict:  # pinned to the CPU (or --strict): stay there
        order = [placement.device]
    else:  # the assigned GPU, the other devices in rank order (CPU last), then the ONNX on the CPU
        order = [placement.device] + [d for d in devices if d.id != placement.device.id]
    artifacts = manifest.artifacts(component)
    checked: dict[str, str | None] = {}
    examined: set[str] = set()

    def files_ok(a: Artifact) -> str | None:
        if not verify:
            return None
        if a.id not in checked:
            checked[a.id] = next((p for rel in a.files if (p := manifest.verify_file(rel))), None)
            if checked[a.id]:       # under --strict only the pinned backend's artifacts (or all, unpinned) matter
                damaged(sel, manifest.root, checked[a.id], placement.strict and pin in (None, a.backend))
        return checked[a.id]

    if pin and pin not in installed:
        how = "install ROCm, which ships it" if pin == "migraphx" else f"pip install 'precast[{pin}]'"
        sel.refused.append(passed(f"{pin} is not installed ({how})", None, pin, placement.device.id))
    for dev in order:
        for backend in offers(dev):
            mine = [a for a in artifacts if a.backend == backend]
            onnx_here = (backend in ONNX_ON_DEVICE and backend in installed and component in manifest.components
                         and (pin == backend or not any(a.backend == backend for a in artifacts))
                         and not manifest.onnx_left_out(component))
            if onnx_here and not mine:   # no prepared artifact: the bundle's ONNX through the EP on this GPU
                comp = manifest.components[component]
                sel.viable.append(Candidate(component, dev, backend, None, manifest.root / comp["onnx"],
                                            f"the bundle's ONNX through {backend} (compiled by the EP at load time)",
                                            tuple((manifest, rel) for rel in comp["files"]) if verify else (),
                                            ep_cache=coreml_cache_dir(manifest, comp, installed[backend])
                                            if backend == "onnxruntime-coreml" else ""))
                continue
            if not mine:
                continue
            examined.update(a.id for a in mine)
            if backend not in installed:
                if backend != pin:
                    sel.refused.append(passed(f"{backend} is not installed", None, backend, dev.id))
                continue
            fp = device_fingerprint(dev, backend, installed[backend])
            for a in mine:
                why = why_not_serves(Fingerprint.from_string(a.fingerprint), fp) or covers(a, request) or files_ok(a)
                if why:
                    sel.refused.append(passed(why, a.id, backend, dev.id))
                    continue
                note = ""
                if placement.offload and dev.id == placement.device.id:
                    note = ("weights streamed from host memory" if a.metadata.get("weight_streaming")
                            else "params offload asked, but this engine was not built with weight_streaming")
                sel.viable.append(Candidate(component, dev, backend, a, manifest.root / a.entry, note))
    for a in artifacts:          # engines for devices this machine lacks, or that the assignment left out
        if a.id in examined:
            continue
        words = RUNS_ON_WORDS.get(a.backend, f"a device {a.backend} runs on")
        if not any(a.backend in offers(d) for d in devices):
            why = f"needs {words}; none here (devices: {', '.join(d.id for d in devices)})"
        else:
            why = f"not tried: {COMPONENT_MODULE.get(component, 'diffusion')} is assigned to {placement.target}"
            why += " (--strict)" if placement.strict else " (--backend)"
        sel.refused.append(passed(why, a.id, a.backend, None))
    cpu = next(d for d in devices if d.kind == "cpu")
    comp = manifest.components.get(component)
    if comp is not None and manifest.onnx_left_out(component):       # a pulled bundle without it, by design
        module = COMPONENT_MODULE.get(component, "diffusion")
        sel.refused.append(passed(manifest.onnx_left_out(component, module), "onnx", None, cpu.id))
    elif comp is not None and (not placement.strict or placement.device.kind == "cpu"):
        onnx_files = [f for f in comp["files"]]
        # With an engine ahead of it, the fallback ONNX (GBs for a UNet) is hashed only if it gets loaded.
        lazy = verify and bool(sel.viable)
        problem = next((p for rel in onnx_files if (p := manifest.verify_file(rel))),
                       None) if verify and not lazy else None
        if problem:
            damaged(sel, manifest.root, problem, placement.strict)
            sel.refused.append(passed(f"the bundle's ONNX is damaged: {problem}", "onnx", None, cpu.id))
        else:
            pending = tuple((manifest, rel) for rel in onnx_files) if lazy else ()
            cpu_backends = ("openvino", "onnxruntime")
            if pin in cpu_backends and placement.device.kind == "cpu":
                cpu_backends = (pin,) + tuple(b for b in cpu_backends if b != pin)
            usable = [b for b in cpu_backends if b in installed]
            for backend in usable[:2 if pin in cpu_backends else 1]:
                sel.viable.append(Candidate(component, cpu, backend, None, manifest.root / comp["onnx"],
                                            "fallback: no prebuilt engine fits", pending))
            if not usable:
                sel.refused.append(passed("no CPU fallback: neither openvino nor onnxruntime is installed",
                                          "onnx", None, cpu.id))
    for why, c in apply_budgets(sel, manifest, placement, devices):
        sel.refused.append(passed(why, c.artifact.id if c.artifact else "onnx", c.backend, c.device.id))
    if pin or placement.strict:
        def asked(c: Candidate) -> bool:
            return c.device.id == placement.device.id and (pin is None or c.backend == pin)
        first = [c for c in sel.viable if asked(c)]
        rest = [c for c in sel.viable if not asked(c)]
        if placement.strict:
            sel.target = placement.target
            for c in rest:
                sel.refused.append(passed(f"not used: --strict keeps {COMPONENT_MODULE.get(component, 'diffusion')} "
                                          f"on {placement.target}", c.artifact.id if c.artifact else "onnx",
                                          c.backend, c.device.id))
            rest = []
        for c in rest:
            c.note = f"fallback: nothing for {placement.target} fits" + (f"; {c.note}" if c.note else "")
        sel.viable = first + rest
    manifest.save_records()          # what was hashed here is recorded (runtime/verified.py)
    return sel


def select_all(manifest: Manifest, placements: dict[str, Placement], devices: list[Device],
               requests: dict[str, dict[str, tuple[int, ...]]], installed: dict[str, str] | None = None,
               verify: bool | str = True, together: tuple[str, ...] | None = None) -> dict[str, Selection]:
    """`verify`: True/"auto" (files hashed once per file state, runtime/verified.py), "full" (every
    file hashed again) or False (no sha256 checks). `together`: the components that will be loaded
    (default all), whose weights are weighed together against each device's budget."""
    installed = installed_backends() if installed is None else installed
    if verify_mode(verify) == "full" and not (manifest.verified is not None and manifest.verified.full):
        manifest = manifest.with_verify("full")      # one record store for every component
    out = {}
    for component in manifest.components:
        module = COMPONENT_MODULE.get(component, "diffusion")
        out[component] = select_component(manifest, component, placements[module], devices,
                                          requests.get(component, {}), installed, verify)
    share_budgets({c: s for c, s in out.items() if together is None or c in together}, placements, devices)
    return out


def coreml_cache_dir(manifest: Manifest, comp: dict, version: str) -> str:
    """Where the CoreML EP keeps what it compiled from a component's ONNX: the user's precast cache,
    coreml/<digest of the ONNX files' sha256s>-ort<version>, so a changed model or onnxruntime never
    meets a stale compile (the EP does not check that itself)."""
    sums = {rel: manifest.files.get(rel, {}).get("sha256") for rel in comp["files"]}
    digest = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]
    return str(user_records_dir().parent / "coreml" / f"{digest}-ort{version}")


def damaged(sel: Selection, root: Path, problem: str, strict: bool) -> None:
    """A damaged bundle file (verify_file's `problem`) passed over: a UserError under --strict, else
    kept in `sel.damaged` for load_component's warning."""
    if strict:
        raise UserError(f"{root}/{problem}; --strict: no fallback past a damaged file; {_damage_fix(root)}")
    sel.damaged.append((root, problem))


def _damage_fix(root: Path) -> str:
    return f"check the bundle with `precast bundle verify {root}`, then rebuild or re-download it"


def load_component(sel: Selection, output_names: list[str], offload: bool = False):
    """(session, candidate, passed_over): the first viable candidate that loads; load failures
    are recorded (as `passed` entries) and the next candidate is tried. Each damaged file passed
    over on the way is one warning on stderr once a candidate has loaded."""
    reasons = list(sel.refused)
    for c in sel.viable:
        problem = next((p for m, rel in c.pending if (p := m.verify_file(rel))), None)
        for m in {id(m): m for m, _ in c.pending}.values():
            m.save_records()
        if problem:
            damaged(sel, c.pending[0][0].root, problem, bool(sel.target))
            reasons.append(passed(f"the bundle's ONNX is damaged: {problem}", "onnx", None, c.device.id))
            continue
        try:
            session = open_candidate(c, output_names, offload)
        except Exception as e:  # a backend refusing this machine is a reason to fall back, not a crash
            reasons.append(passed(f"failed to load: {type(e).__name__}: {e}", c.artifact.id if c.artifact else "onnx",
                                  c.backend, c.device.id))
            continue
        for root, problem in sel.damaged:
            _warn(f"{root}/{problem}; passed over, so {sel.component} runs "
                  f"{c.artifact.id if c.artifact else 'the bundle ONNX'} via {c.backend} on {c.device.id}; {_damage_fix(root)}")
        return session, c, reasons
    raise UserError(nothing_runs(sel.component, sel.target, reasons))


def _warn(line: str) -> None:
    try:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):     # stderr closed: a warning is not worth failing for
        pass


def nothing_runs(component: str, target: str, reasons: list[dict]) -> str:
    where = f"on {target} (--strict)" if target else "here"
    return f"{component}: nothing in the bundle can run {where}:\n  " + "\n  ".join(passed_text(r) for r in reasons)
