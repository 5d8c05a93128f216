"""What would run where, and why: `precast doctor`'s report as data (the Python API's `Bundle.plan`) and as text.

Owns: `Report` (per component a `ComponentPlan`: the chosen `Option`, a one-line why, what was
`PassedOver`, the options tried next; `memory`, the memory plans), built from select.py's candidates and
component records, and `describe_where`, the text both `precast doctor` and `precast generate` print.
Imports the runtime's selection, assignment and budget types only.
"""
from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .assign import Placement
from .budgets import memory_summary
from .devices import Device
from .families import missing_for_generate
from .select import Candidate, component_report, passed_text


@dataclass(frozen=True)
class Option:
    """One way to run a component: an artifact (an engine's id, or "onnx": the bundle's ONNX compiled
    or loaded at run time) through a backend on a device."""
    artifact: str
    device: str
    device_name: str
    backend: str
    how: str
    note: str = ""
    memory: dict | None = None    # weights against the device's budget: plan resident / stream / ... (doctor's)


@dataclass(frozen=True)
class PassedOver:
    """An artifact, backend or assignment that was not used, and why."""
    artifact: str | None
    backend: str | None
    device: str | None
    reason: str

    def __str__(self) -> str:
        return passed_text(self.as_dict())

    def as_dict(self) -> dict:
        return {"artifact": self.artifact, "backend": self.backend, "device": self.device, "reason": self.reason}


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component runs (or would run) and why: the chosen option (None: nothing in the
    bundle can run here), a one-line reason, what was passed over, and the options tried next if
    the chosen one fails to load."""
    component: str
    module: str                              # te | diffusion | vae | ...: the --backend key
    chosen: Option | None
    why: str
    passed_over: tuple[PassedOver, ...] = ()
    then: tuple[Option, ...] = ()

    @property
    def artifact(self) -> str | None:
        return self.chosen.artifact if self.chosen else None

    @property
    def device(self) -> str | None:
        return self.chosen.device if self.chosen else None

    @property
    def backend(self) -> str | None:
        return self.chosen.backend if self.chosen else None

    def record(self) -> dict:
        """doctor --json's record for the component: generate's (select.component_report) and "then"."""
        return {**component_report(self.component, None, []), "module": self.module,
                **(_option_dict(self.component, self.chosen) if self.chosen else {}),
                "passed_over": [p.as_dict() for p in self.passed_over],
                "then": [_option_dict(self.component, o) for o in self.then]}

    def as_dict(self) -> dict:
        """doctor --json's record for the component, plus "why"."""
        return {**self.record(), "why": self.why}


@dataclass(frozen=True)
class Report:
    """What would run where, and why: `precast doctor BUNDLE --json` as data."""
    bundle: str
    family: str | None
    size: tuple[int, int]                    # (width, height) the engines were checked against
    devices: tuple[Device, ...]              # in rank order, the CPU last
    device_warning: str | None
    installed_backends: dict[str, str]       # backend -> version
    assignment: dict[str, dict]              # module -> {device, backend, params, asked, fallback}
    components: dict[str, ComponentPlan]
    missing_for_generate: tuple[str, ...] = ()
    stages: dict = field(default_factory=dict, compare=False)     # seconds: discover, assign, backends, select, verify
    placements: dict[str, Placement] = field(default_factory=dict, compare=False, repr=False)   # module -> Placement

    @property
    def memory(self) -> dict[str, dict]:
        """Per device, the memory plans of the components generate loads (budgets.memory_summary): each plan's
        expected peak (the CPU's), the plan used, the budget and where it comes from, a warning when none fits."""
        return memory_summary({c: p.chosen.memory for c, p in self.components.items() if p.chosen},
                              list(self.devices))

    def as_dict(self) -> dict:
        return {"bundle": self.bundle, "family": self.family, "size": f"{self.size[0]}x{self.size[1]}",
                "devices": [d.describe() for d in self.devices], "device_warning": self.device_warning,
                "installed_backends": dict(self.installed_backends), "assignment": dict(self.assignment),
                "components": {c: p.as_dict() for c, p in self.components.items()},
                "missing_for_generate": list(self.missing_for_generate), "memory": self.memory}

    def __str__(self) -> str:
        out = io.StringIO()
        describe_where(self.as_dict(), out)
        return out.getvalue().rstrip("\n")


def _option(c: Candidate) -> Option:
    d = c.describe()
    return Option(d["artifact"], d["device"], d["device_name"], d["backend"], d["how"], d["note"], d.get("memory"))


def _option_dict(component: str, o: Option) -> dict:
    return {"component": component, "device": o.device, "device_name": o.device_name, "backend": o.backend,
            "artifact": o.artifact, "how": o.how, "note": o.note, **({"memory": o.memory} if o.memory else {})}


def _why(placement: Placement, chosen: Option | None, passed_over: list[dict]) -> str:
    """One line: where the module was asked to run, and what runs it there."""
    if chosen is None:
        return "nothing in the bundle can run here: " + "; ".join(passed_text(r) for r in passed_over)
    module = placement.module
    if placement.fallback:
        asked = placement.fallback
    elif placement.asked:
        asked = f"{module} assigned to {placement.target} (asked: {placement.asked!r})"
    else:
        asked = f"{module} on the first device in rank order, {placement.device.id} (nothing asked)"
    what = (f"the bundle's ONNX through {chosen.backend}, compiled/loaded at run time" if chosen.artifact == "onnx"
            else f"prebuilt {chosen.backend} engine {chosen.artifact} fits {chosen.device}")
    return f"{asked}; {what}" + (f" ({chosen.note})" if chosen.note else "")


def plan_of(where: dict, placement: Placement, then: list[Candidate] = ()) -> ComponentPlan:
    """A component's plan from its doctor/generate record (select.component_report) and placement."""
    w = where
    option = Option(w["artifact"], w["device"], w["device_name"], w["backend"], w["how"], w["note"], w.get("memory")) \
        if w["device"] is not None else None
    return ComponentPlan(w["component"], w["module"], option, _why(placement, option, w["passed_over"]),
                         tuple(PassedOver(**r) for r in w["passed_over"]), tuple(_option(c) for c in then))


def report_of(path: Path, manifest, size, devices, warning, installed, placements, plans, stages=None) -> Report:
    """The Report of a bundle's plans (plan_of each) on this machine."""
    return Report(str(path), manifest.info.family, tuple(size), tuple(devices), warning, dict(installed),
                  {mod: p.describe() for mod, p in placements.items()}, plans,
                  tuple(missing_for_generate(manifest)), stages or {}, dict(placements))


def describe_where(report: dict, stream=sys.stderr) -> None:
    """The components of a report (generate's or doctor's) as text: where each runs, what was passed over."""
    width = name_width(report["components"])
    for comp, w in report["components"].items():
        if w["device"] is None:
            print(f"{comp:<{width}} -> NOTHING CAN RUN", file=stream)
        else:
            print(f"{comp:<{width}} -> {w['device']} ({w['device_name']}) via {w['backend']}: {w['artifact']}"
                  + (f"  [{w['note']}]" if w.get("note") else ""), file=stream)
        for r in w["passed_over"]:
            print(f"{'':{width + 3}}passed over: {passed_text(r)}", file=stream)


def name_width(names) -> int:
    """The width of a column of component names: the longest one shown (e.g. vae_decoder_tiled), at least 13."""
    return max([13, *map(len, names)])
