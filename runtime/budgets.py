"""Memory budgets: each component's weights held against what its device may hold (`--params-backend
DEVICE:SIZE`, a discrete GPU's memory, half the host's for an integrated GPU).

Owns: `device_budget`, `memory_plan` (resident, stream -- a TensorRT-RTX engine built with weight
streaming --, or too big), `apply_budgets` (a selection's candidates planned; the too-big ones dropped,
with the reason, for select.py to record), `share_budgets` (components that fit one by one but not together
are loaded one at a time) and `keep_shared_plan`. Works on select.py's Candidate / Selection values
without importing select.py. Standard library only.
"""
from __future__ import annotations

from .assign import Placement
from .devices import Device
from .manifest import Manifest


def device_budget(device: Device, budgets: dict[str, int], devices: list[Device]) -> tuple[int | None, str]:
    """(bytes, where the number comes from) the weights on `device` may take: the user's budget,
    else a discrete GPU's memory, else for an integrated GPU half the host memory it shares (the
    driver's usual limit); the CPU has none unless given (None)."""
    if device.id in budgets:
        return budgets[device.id], "--params-backend budget"
    if device.kind == "discrete" and device.memory:
        return device.memory, "device memory"
    if device.kind == "integrated":
        host = next((d.memory for d in devices if d.kind == "cpu"), 0)
        if device.memory:
            return device.memory, "device memory"
        if host:
            return host // 2, "half of the host memory it shares"
    return None, "no budget"


def memory_plan(weights: int, device: Device, budget: int | None, source: str, streams: bool) -> dict:
    """What a component's weights (bytes, from the manifest's file sizes) do on `device` under
    `budget`: `resident` (they fit), `stream` (a TensorRT-RTX engine built with weight_streaming
    keeps `budget` bytes on the GPU and streams the rest from host memory), or `too-big` (nothing
    of the backend's own can make them fit: the selection passes the candidate over, and the next
    one -- usually the CPU -- runs it). Activations are not counted: the budget is for weights."""
    out = {"device": device.id, "weights": weights, "budget": budget, "budget_from": source}
    if budget is None or weights <= budget:
        return {**out, "plan": "resident"}
    if streams:
        return {**out, "plan": "stream", "streamed": weights - budget}
    return {**out, "plan": "too-big"}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def apply_budgets(sel, manifest: Manifest, placement: Placement, devices: list[Device]) -> list[tuple[str, object]]:
    """Each viable candidate of a selection (select.py) held against its device's budget: fits, streams, or
    is dropped from `sel.viable`; returns (why, candidate) for each one dropped."""
    budgets = dict(placement.budgets)
    keep, dropped = [], []
    for c in sel.viable:
        files = c.artifact.files if c.artifact else manifest.components[c.component]["files"]
        weights = sum(manifest.files.get(rel, {}).get("size", 0) for rel in files)
        budget, source = device_budget(c.device, budgets, devices)
        streams = bool(c.artifact and c.artifact.metadata.get("weight_streaming"))
        c.memory = memory_plan(weights, c.device, budget, source, streams)
        if c.memory["plan"] == "too-big":
            why = (f"weights {_gib(weights)} exceed {c.device.id}'s budget {_gib(budget)} ({source})"
                   + ("; the engine was not built with weight_streaming" if c.backend == "tensorrt-rtx" else
                      f"; {c.backend} cannot stream weights"))
            dropped.append((why, c))
            continue
        if c.backend == "openvino" and c.device.kind != "cpu" and budget is not None:
            c.weight_budget = budget        # told to OpenVINO's GPU plugin (sessions.openvino_gpu_memory)
            c.note = "; ".join(filter(None, [c.note, f"OpenVINO GPU plugin given {_gib(budget)} of device memory "
                                                     f"({source})"]))
        if c.memory["plan"] == "stream":
            c.weight_budget = budget
            c.note = "; ".join(filter(None, [c.note, f"streams {_gib(c.memory['streamed'])} of {_gib(weights)} "
                                                     f"weights from host memory ({_gib(budget)} on {c.device.id})"]))
        keep.append(c)
    sel.viable = keep
    return dropped


def share_budgets(sels: dict, placements: dict[str, Placement], devices: list[Device]) -> None:
    """Components that each fit but together exceed a device's budget are loaded one at a time
    (each released before the next is loaded): said on each of them."""
    by_device: dict[str, list] = {}
    for s in sels.values():
        c = s.choice
        if c is not None and c.memory and c.memory["plan"] == "resident" and c.memory["budget"] is not None:
            by_device.setdefault(c.device.id, []).append(c)
    for dev, chosen in by_device.items():
        total = sum(c.memory["weights"] for c in chosen)
        budget = chosen[0].memory["budget"]
        if total > budget and len(chosen) > 1:
            for c in chosen:
                c.memory = {**c.memory, "plan": "one-at-a-time", "together": total}
                c.note = "; ".join(filter(None, [c.note, f"loaded one at a time: {len(chosen)} components need "
                                                         f"{_gib(total)} together, {dev}'s budget is {_gib(budget)}"]))


def keep_shared_plan(before, after) -> None:
    """A component selected again (with its sha256 checks) keeps the plan share_budgets made for it
    over all components, when the same candidate comes first."""
    a, b = before.choice, after.choice
    if a is not None and b is not None and (a.memory or {}).get("plan") == "one-at-a-time" \
            and (a.device.id, a.backend, a.entry) == (b.device.id, b.backend, b.entry):
        b.memory, b.note = a.memory, a.note
