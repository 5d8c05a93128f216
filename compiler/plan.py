"""Build plans: a recipe as a matrix of jobs, one per component x target.

Owns: the stable id of each job, what machine it needs (TensorRT-RTX AOT: any; ONNX Runtime and
OpenVINO CPU: any of the ISA level it serves; MIGraphX: that AMD GPU; OpenVINO GPU: that device), selecting jobs (`--only`, `--shard i/n`) and the GitHub
Actions `strategy.matrix` form.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from .errors import BadInput
from .recipe import Recipe
from .targets.base import POSITIONAL, TargetSpec


QUIET_OPTIONS = {("simplify", False)}  # recipe defaults that need not show in an entry's id


@dataclass(frozen=True)
class PlanEntry:
    id: str
    component: str
    target: TargetSpec
    needs: str                 # in words
    runner: tuple[str, ...]    # GitHub Actions runs-on labels

    def describe(self) -> dict:
        return {"id": self.id, "component": self.component, "target": self.target.label(),
                "backend": self.target.backend, "options": self.target.describe(), "needs": self.needs,
                "runs-on": list(self.runner)}


def _slug(spec: TargetSpec) -> str:
    field = POSITIONAL.get(spec.backend)
    arg = spec.get(field) if field else None
    parts = [spec.backend]
    if arg:
        parts += list(arg) if isinstance(arg, (list, tuple)) else [str(arg)]
    rest = {k: v for k, v in spec.options if k != field and (k, v) not in QUIET_OPTIONS}
    if rest:
        parts.append(hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:6])
    return re.sub(r"[^A-Za-z0-9_.+-]", "-", "-".join(parts))


def _needs(spec: TargetSpec) -> tuple[str, tuple[str, ...]]:
    if spec.backend == "migraphx":
        gfx = spec.get("gfx", "?")
        return f"a machine with an AMD {gfx} GPU and ROCm (MIGraphX compiles on the GPU)", ("self-hosted", "rocm", str(gfx).split(":")[0])
    if spec.backend == "openvino" and spec.get("device", "CPU") != "CPU":
        return f"a machine with the Intel {spec.get('device')} device", ("self-hosted", "intel-gpu")
    if spec.backend == "openvino":
        return "any x86-64 machine (the blob is keyed to the build machine's CPU ISA level)", ("ubuntu-latest",)
    if spec.backend == "tensorrt-rtx":
        return "any machine (ahead-of-time build, no GPU needed)", ("ubuntu-latest",)
    if spec.backend == "onnxruntime" and spec.get("optimize", True) is not False:
        return ("any x86-64 machine (the optimized graph is keyed to the build machine's CPU ISA level; "
                "optimize: false runs anywhere)"), ("ubuntu-latest",)
    return "any machine", ("ubuntu-latest",)


def make_plan(recipe: Recipe) -> list[PlanEntry]:
    entries = []
    for spec in recipe.targets:
        needs, runner = _needs(spec)
        for comp in recipe.components:
            entries.append(PlanEntry(f"{comp}.{_slug(spec)}", comp, spec, needs, runner))
    ids = [e.id for e in entries]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise BadInput(f"{recipe.path}: targets repeat ({', '.join(sorted(dup))}); list each target once")
    return sorted(entries, key=lambda e: e.id)


def select(entries: list[PlanEntry], only: tuple[str, ...] = (), shard: str | None = None) -> list[PlanEntry]:
    if only and shard:
        raise BadInput("give --only or --shard, not both")
    if only:
        ids = {e.id for e in entries}
        for o in only:
            if o not in ids:
                raise BadInput(f"--only {o!r}: no such entry; `precast plan` lists: {', '.join(sorted(ids))}")
        return [e for e in entries if e.id in only]
    if shard:
        m = re.fullmatch(r"(\d+)/(\d+)", shard)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise BadInput(f"--shard {shard!r}: expected i/n with 1 <= i <= n, e.g. 2/3")
        i, n = int(m.group(1)), int(m.group(2))
        return entries[i - 1::n]
    return entries


def github_matrix(entries: list[PlanEntry]) -> dict:
    """`strategy.matrix` as is: matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}."""
    return {"include": [{"entry": e.id, "component": e.component, "target": e.target.label(),
                         "runs-on": list(e.runner) if len(e.runner) > 1 else e.runner[0]} for e in entries]}
