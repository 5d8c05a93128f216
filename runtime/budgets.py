"""Memory budgets: each component's weights held against what its device may hold (`--params-backend
DEVICE:SIZE`, a discrete GPU's memory, half the host's for an integrated GPU, the CPU's available memory).

Owns: `device_budget`, `memory_plan` (resident, stream -- a TensorRT-RTX engine built with weight
streaming --, or too big), `apply_budgets` (a selection's candidates planned; the too-big ones dropped,
with the reason, for select.py to record), `share_budgets` (components that fit one by one but not together
are loaded one at a time), `keep_shared_plan`, and on the CPU the expected peak of each plan (`PEAK_FACTORS`,
`expected_peaks`; `memory_summary`, what doctor and generate say of it). Without a user budget the CPU's is
its available memory (MemAvailable), held against the plans' expected peaks: it may load components one at a
time, never drops one (the CPU is the last resort). Works on select.py's Candidate / Selection values
without importing select.py. Standard library only.
"""
from __future__ import annotations

from .assign import Placement
from .devices import Device
from .manifest import Manifest


AVAILABLE = "available memory (MemAvailable)"     # budget_from of the CPU's automatic budget

# The CPU's expected peak resident memory = factor x the bytes of the files each component loads (its plan's
# "weights": an OpenVINO blob with its Winograd-expanded constants where it has them, an ONNX Runtime artifact,
# the bundle's ONNX), per backend: (resident: x all components' bytes, one at a time: x the largest's).
# Measured by benchmarks/memory.py (2026-11-27, docs/benchmarks.md "Memory, after three changes"): peak RSS of a
# whole generate, full-size SD 1.5 fp32, 512², 4 Euler steps, CFG 7, 2 threads, AMD EPYC; ONNX Runtime's files
# 3.85 GiB (UNet 3.20), OpenVINO's 5.26 GiB (UNet blob 4.09: Winograd from 32x32; VAE decoder blob 0.71).
#   resident:      OpenVINO 5.59 / 5.26 = 1.06 (every component kept, as the Python API keeps them; `precast
#                  generate`'s last run, releasing each after its stage: 4.69 = 0.89); ONNX Runtime 5.33 / 3.85 = 1.38
#   one at a time: OpenVINO without Winograd 3.71 / 3.20 (its blob ~ the ONNX's bytes) = 1.16; ONNX Runtime
#                  (--params-backend cpu:3.5G) 5.13 / 3.20 = 1.60
# The VAE pass at 512² is inside these (the denoising stage holds the peak); a larger image's VAE pass is tiled
# to the memory left (runtime/vae_tiling.py), so there is no per-pixel term. Other backends: ONNX Runtime's.
PEAK_FACTORS = {"openvino": (1.06, 1.16), "onnxruntime": (1.38, 1.60)}


def device_budget(device: Device, budgets: dict[str, int], devices: list[Device],
                  automatic: bool = False) -> tuple[int | None, str]:
    """(bytes, where the number comes from) the weights on `device` may take: the user's budget,
    else a discrete GPU's memory, else for an integrated GPU half the host memory it shares (the
    driver's usual limit); the CPU has none unless given (None), or with `automatic` its available
    memory (when known: Linux's MemAvailable)."""
    if device.id in budgets:
        return budgets[device.id], "--params-backend budget"
    if automatic and device.kind == "cpu" and device.available:
        return device.available, AVAILABLE
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
    one -- usually the CPU -- runs it). Activations are not counted: the budget is for weights. The CPU's
    automatic budget is not one of these (it never makes a component too big): share_budgets holds the
    plans' expected peaks against it."""
    out = {"device": device.id, "weights": weights, "budget": budget, "budget_from": source}
    if budget is None or weights <= budget:
        return {**out, "plan": "resident"}
    if streams:
        return {**out, "plan": "stream", "streamed": weights - budget}
    return {**out, "plan": "too-big"}


def _note(c, text: str) -> None:
    """`text` added to the candidate's note (one line, parts joined by "; ")."""
    c.note = "; ".join(filter(None, [c.note, text]))


def _peaks(peaks: dict[str, int]) -> str:
    """Each plan's expected peak, as doctor and the warnings say them: "resident 5.31 GiB, one at a time ..."."""
    return ", ".join(f"{p.replace('-', ' ')} {_gib(v)}" for p, v in peaks.items())


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
            _note(c, f"OpenVINO GPU plugin given {_gib(budget)} of device memory ({source})")
        if c.memory["plan"] == "stream":
            c.weight_budget = budget
            _note(c, f"streams {_gib(c.memory['streamed'])} of {_gib(weights)} weights from host memory "
                     f"({_gib(budget)} on {c.device.id})")
        keep.append(c)
    sel.viable = keep
    return dropped


def expected_peaks(chosen: list) -> dict[str, int]:
    """The expected peak resident memory (bytes) of each plan for the components `chosen` on the CPU
    (PEAK_FACTORS): resident (never below one at a time's) and, for two or more, one at a time."""
    each = [(PEAK_FACTORS.get(c.backend, PEAK_FACTORS["onnxruntime"]), c.memory["weights"]) for c in chosen]
    res, one = sum(f[0] * w for f, w in each), max(f[1] * w for f, w in each)
    return {"resident": int(max(res, one)), **({"one-at-a-time": int(one)} if len(chosen) > 1 else {})}


def share_budgets(sels: dict, placements: dict[str, Placement], devices: list[Device]) -> None:
    """Components that each fit but together exceed a device's budget are loaded one at a time
    (each released before the next is loaded): said on each of them. On the CPU each gets the expected
    peak of each plan (`peaks`); under its automatic budget those peaks, not the weights, decide, and when
    even the plan chosen does not fit, each component says so (`fits`: false) and stays."""
    by_device: dict[str, list] = {}
    for s in sels.values():
        c = s.choice
        if c is not None and c.memory and c.memory["plan"] == "resident" \
                and (c.memory["budget"] is not None or c.device.kind == "cpu"):
            by_device.setdefault(c.device.id, []).append(c)
    for dev, chosen in by_device.items():
        total = sum(c.memory["weights"] for c in chosen)
        budget, source = chosen[0].memory["budget"], chosen[0].memory["budget_from"]
        if budget is None:
            # the CPU without a user budget: its available memory, when known (not recorded on the components:
            # it moves from run to run; memory_summary reads it from the same device)
            budget, source = device_budget(chosen[0].device, {}, devices, automatic=True)
        peaks = expected_peaks(chosen) if chosen[0].device.kind == "cpu" else {}
        auto = source == AVAILABLE
        for c in chosen:
            c.memory = {**c.memory, **({"peaks": peaks} if peaks else {})}
        if budget is not None and (peaks["resident"] if auto else total) > budget and len(chosen) > 1:
            why = (f"their expected peak together is {_gib(peaks['resident'])}, {_gib(peaks['one-at-a-time'])} one "
                   f"at a time; {dev} has {_gib(budget)} of {source}" if auto else
                   f"{len(chosen)} components need {_gib(total)} together, {dev}'s budget is {_gib(budget)}")
            for c in chosen:
                c.memory = {**c.memory, "plan": "one-at-a-time", "together": total}
                _note(c, f"loaded one at a time: {why}")
        if auto:
            peak = peaks[chosen[0].memory["plan"]]
            for c in chosen:
                c.memory = {**c.memory, "fits": peak <= budget}
                if peak > budget:
                    _note(c, f"expected peak {_gib(peak)} exceeds the {_gib(budget)} of {source}; kept on {dev}, "
                             "the last resort")


def memory_summary(memories: dict[str, dict], devices: list[Device]) -> dict[str, dict]:
    """Per device with expected peaks, from its components' memory records (share_budgets'; component ->
    record): the peak of each plan, the plan generate uses, the budget and where it comes from (the CPU's
    available memory when the user gave none), whether the plan fits (an automatic budget only), and
    `warning`, the one line to say when it does not."""
    out: dict[str, dict] = {}
    for comp, m in memories.items():
        if m and "peaks" in m:
            budget, source = m["budget"], m["budget_from"]
            if budget is None:
                budget, source = next((device_budget(d, {}, devices, automatic=True) for d in devices
                                       if d.id == m["device"]), (None, source))
            d = out.setdefault(m["device"], {"components": [], "peaks": m["peaks"], "plan": m["plan"],
                                             "budget": budget, "budget_from": source,
                                             "fits": m.get("fits"), "warning": None})
            d["components"].append(comp)
    for dev, d in out.items():
        if d["fits"] is False:
            d["warning"] = (f"no memory plan fits {dev}: expected peak {_peaks(d['peaks'])}; {dev} has {_gib(d['budget'])} of "
                            f"{d['budget_from']}. generate still tries (the estimate may be pessimistic); to fit: "
                            f"free memory, build the bundle at a smaller precision (precision: fp16, or weights: "
                            f"int8 / int4), with a low-memory target option (openvino winograd: false), or use a "
                            f"machine with more memory")
    return out


def plan_line(dev: str, plan: dict) -> str:
    """One of memory_summary's records as doctor says it: each plan's expected peak, the budget, the plan used."""
    have = f"; {_gib(plan['budget'])} {plan['budget_from']}" if plan["budget"] is not None else ""
    used = "them one at a time" if plan["plan"] == "one-at-a-time" else "them resident"
    return f"{dev}: expected peak {_peaks(plan['peaks'])}{have} -> generate loads {used}" + " (does not fit)" * (plan["fits"] is False)


def keep_shared_plan(before, after) -> None:
    """A component selected again (with its sha256 checks) keeps the plan share_budgets made for it
    over all components (one at a time, the CPU's expected peaks), when the same candidate comes first."""
    a, b = before.choice, after.choice
    m = (a.memory or {}) if a is not None else {}
    if (m.get("plan") == "one-at-a-time" or "peaks" in m) and b is not None \
            and (a.device.id, a.backend, a.entry) == (b.device.id, b.backend, b.entry):
        b.memory, b.note = a.memory, a.note
