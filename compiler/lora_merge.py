"""Merging LoRAs into a model's weights: the plan (what patches which weight), its checks, and the math.

Owns: resolving every module of every LoRA through the forward name table
(compiler/sources/lora_names.py) and checking coverage before anything is written -- each LoRA key
must name exactly one model weight (unmatched keys are an error listing them, or a warning
listing them with `allow_unmatched`, for every LoRA or one), and each delta's shape must fit its weight (an error
naming both shapes and the weight); and the per-weight update, applied while weights stream
into the ONNX file: W += strength * scale * delta, accumulated in fp32 (the writer casts after),
with a separate strength for text-encoder weights. Formulas (MODEL_FORMATS.md §5):

  LoRA   delta = up @ down (conv: flattened, reshaped to W), with Tucker `mid`:
         delta[o,c,k,l] = sum_ab up[o,a] mid[a,b,k,l] down[b,c]; scale = alpha / rank (1 without alpha)
  LoHa   delta = (w1a @ w1b) * (w2a @ w2b); scale = alpha / w1b.shape[0]
  LoKr   delta = kron(w1, w2), w1 = lokr_w1 or w1_a @ w1_b (same for w2); scale = alpha / rank of
         the factored side (1 when both are full)
  full   delta = diff (and diff_b for the bias); scale = 1
  DoRA   Wc = W + scale * delta; Wd = Wc * m / ||Wc|| (norm per output row when m has one value a
         row, else per input column; eps added); W' = W + strength * (Wd - W). The norm is taken of
         Wc as DoRA and PEFT define it (W' = m * (W + BA) / ||W + BA||); the axis is the one
         whose length m's first dimension has ([out, 1, ..] rows, [1, in, ..] columns).

LoRAs apply in the order given; each DoRA step sees the weight as the earlier LoRAs left it.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import BadInput
from .sources.checkpoint import UNET, VAE
from .sources.lora import LoraFile, LoraModule, read_lora
from .sources.lora_names import NameTable, Target, build_name_table, flat, targets_of
from .sources.peft_metadata import FLOAT32_MAX

MAX_LISTED = 20


@dataclass(frozen=True)
class LoraSpec:
    path: str
    strength: float = 1.0
    te_strength: float | None = None      # None: the same as strength
    allow_unmatched: bool = False         # its tensors that name no weight are skipped (listed), not an error

    def __post_init__(self):
        for what, value in (("strength", self.strength), ("te_strength", self.te_strength)):
            if value is None:
                continue
            flag = "--lora-te-strength" if what == "te_strength" else f"--lora {self.path}"
            if not np.isfinite(value):
                raise BadInput(f"{flag}: {what} {value} is not a finite number; give one such as 0.8")
            if abs(value) > FLOAT32_MAX:
                raise BadInput(f"{flag}: {what} {value} is beyond float32's range (|x| <= 3.4e38) and would "
                               "overflow every merged weight; give one such as 0.8")

    @property
    def text_strength(self) -> float:
        return self.strength if self.te_strength is None else self.te_strength


@dataclass(frozen=True)
class Patch:
    lora: int                  # index into MergePlan.loras
    module: LoraModule
    target: Target
    bias: bool = False         # a `diff_b`: patches the bias beside the weight


def is_text_weight(key: str) -> bool:
    return not key.startswith(UNET) and not key.startswith(VAE)


def _numel(shape) -> int:
    return math.prod(shape)  # Python ints: a header may claim [10**30, 0]


def delta_shape(lf: LoraFile, m: LoraModule) -> tuple[int, ...]:
    """The shape of a module's delta, from the file header alone (BadInput when inconsistent)."""
    s = lambda role: lf.shape(m, role)  # noqa: E731
    have = m.tensors
    where = f"{lf.path}: {m.name}"
    for role, key in have.items():
        if role != "alpha" and 0 in s(role):
            raise BadInput(f"{lf.path}: tensor {key} has shape {list(s(role))} (no values; rank 0?); "
                           "the LoRA file is damaged")
    kind = m.kind
    if kind == "lora":
        if "down" not in have or "up" not in have:
            raise BadInput(f"{where}: has {'up' if 'up' in have else 'down'} but no "
                           f"{'down' if 'up' in have else 'up'} tensor; the LoRA file is damaged")
        down, up = s("down"), s("up")
        if len(up) < 2 or len(down) < 2:
            raise BadInput(f"{where}: up {list(up)} / down {list(down)} are not matrices")
        if "mid" in have:
            mid = s("mid")
            if len(mid) != 4 or mid[0] != up[1] or mid[1] != down[0]:
                raise BadInput(f"{where}: lora_mid {list(mid)} does not fit up {list(up)} and down {list(down)}")
            return (up[0], down[1], *mid[2:])
        if up[1] != down[0]:
            raise BadInput(f"{where}: up {list(up)} and down {list(down)} disagree on the rank")
        return (up[0], down[1], *down[2:])
    if kind == "loha":
        if "hada_t1" in have or "hada_t2" in have:
            raise BadInput(f"{where}: LoHa with Tucker tensors (hada_t1/t2) is not supported yet")
        missing = [r for r in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") if r not in have]
        if missing:
            raise BadInput(f"{where}: LoHa module lacks {', '.join(missing)}")
        a1, b1, a2, b2 = (s(r) for r in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        if min(len(a1), len(b1), len(a2), len(b2)) < 2:
            raise BadInput(f"{where}: LoHa factors {list(a1)}, {list(b1)}, {list(a2)}, {list(b2)} are not all matrices")
        if a1[1] != b1[0] or a2[1] != b2[0] or (a1[0], _numel(b1[1:])) != (a2[0], _numel(b2[1:])):
            raise BadInput(f"{where}: LoHa factors {list(a1)}, {list(b1)}, {list(a2)}, {list(b2)} do not fit")
        return (a1[0], *b1[1:])
    if kind == "lokr":
        if "lokr_t2" in have:
            raise BadInput(f"{where}: LoKr with a Tucker tensor (lokr_t2) is not supported yet")
        sides = []
        for w in ("w1", "w2"):
            if f"lokr_{w}" in have:
                sides.append(s(f"lokr_{w}"))
            elif f"lokr_{w}_a" in have and f"lokr_{w}_b" in have:
                a, b = s(f"lokr_{w}_a"), s(f"lokr_{w}_b")
                if len(a) < 2 or len(b) < 2:
                    raise BadInput(f"{where}: lokr_{w}_a {list(a)} / lokr_{w}_b {list(b)} are not matrices")
                if a[1] != b[0]:
                    raise BadInput(f"{where}: lokr_{w}_a {list(a)} and lokr_{w}_b {list(b)} disagree on the rank")
                sides.append((a[0], *b[1:]))
            else:
                raise BadInput(f"{where}: LoKr module lacks lokr_{w} (or lokr_{w}_a + lokr_{w}_b)")
        w1, w2 = sides
        if len(w1) != 2:
            raise BadInput(f"{where}: lokr_w1 {list(w1)} is not a matrix")
        if len(w2) < 2:
            raise BadInput(f"{where}: lokr_w2 {list(w2)} is not a matrix")
        return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])
    if kind == "full":
        if "diff" not in have:
            raise BadInput(f"{where}: has diff_b but no diff")
        return s("diff")
    raise BadInput(f"{where}: holds only {', '.join(sorted(have))}; no up/down, hada_*, lokr_* or diff tensors")


def fits(delta: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """A delta fits when shapes are equal or differ only by trailing 1x1 / flattening (Linear vs
    1x1 conv, LoHa's flattened conv factors): same output rows, same element count."""
    return tuple(delta) == tuple(target) or (delta[0] == target[0] and _numel(delta) == _numel(target))


def module_delta(lf: LoraFile, m: LoraModule, part: tuple[int, int] | None = None) -> tuple[np.ndarray, float]:
    """(delta in fp32, scale) of one module -- only its rows `part` when given --; the delta is unscaled and not yet
    reshaped."""
    r = lambda role: lf.read(m, role)  # noqa: E731
    kind = m.kind
    if part is not None and not (kind == "lora" and "mid" not in m.tensors):
        delta, scale = module_delta(lf, m)
        return delta[part[0]:part[1]], scale
    if kind == "lora":
        down, up = r("down"), r("up")
        rank = down.shape[0]
        up = up[part[0]:part[1]] if part is not None else up        # the rows asked for, before the product
        up2 = up.reshape(up.shape[0], -1)
        if "mid" in m.tensors:
            mid = r("mid")
            delta = np.einsum("oa,abkl,bc->ockl", up2, mid, down.reshape(down.shape[0], -1), optimize=True)
        else:
            delta = (up2 @ down.reshape(rank, -1)).reshape((up.shape[0], *down.shape[1:]))
        alpha = lf.alpha(m, rank)
        return delta, 1.0 if alpha is None else alpha / rank
    if kind == "loha":
        a1, b1, a2, b2 = (r(x) for x in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        delta = (a1 @ b1.reshape(b1.shape[0], -1)) * (a2 @ b2.reshape(b2.shape[0], -1))
        alpha = lf.alpha(m, b1.shape[0])
        return delta.reshape((a1.shape[0], *b1.shape[1:])), 1.0 if alpha is None else alpha / b1.shape[0]
    if kind == "lokr":
        rank = None
        sides = []
        for w in ("w1", "w2"):
            if f"lokr_{w}" in m.tensors:
                sides.append(r(f"lokr_{w}"))
            else:
                a, b = r(f"lokr_{w}_a"), r(f"lokr_{w}_b")
                rank = b.shape[0]
                sides.append((a @ b.reshape(b.shape[0], -1)).reshape((a.shape[0], *b.shape[1:])))
        w1, w2 = sides
        w1 = w1.reshape(w1.shape + (1,) * (w2.ndim - w1.ndim))
        delta = np.kron(w1, w2)
        alpha = lf.alpha(m, rank or 1) if rank else None
        return delta, 1.0 if alpha is None or rank is None else alpha / rank
    return r("diff"), 1.0


def dora(weight: np.ndarray, delta: np.ndarray, magnitude: np.ndarray, strength: float) -> np.ndarray:
    """DoRA step (see the module doc); weight and delta already scaled by alpha / rank."""
    wc = weight + delta
    flat_c = wc.reshape(wc.shape[0], -1)
    if magnitude.shape[0] == wc.shape[0]:               # one magnitude per output row ([out, 1, ...] or [out])
        norm = np.linalg.norm(flat_c, axis=1).reshape((wc.shape[0],) + (1,) * (wc.ndim - 1))
        m = magnitude.reshape(norm.shape)
    else:                                               # one per input column (wd_on_output = False)
        norm = np.linalg.norm(np.swapaxes(wc, 0, 1).reshape(wc.shape[1], -1), axis=1)
        norm = norm.reshape((1, wc.shape[1]) + (1,) * (wc.ndim - 2))
        m = magnitude.reshape(norm.shape)
    wd = wc * (m / (norm + np.finfo(np.float32).eps))
    return weight + np.float32(strength) * (wd - weight)


@dataclass
class MergePlan:
    loras: list[tuple[LoraSpec, LoraFile]]
    patches: dict[str, list[Patch]] = field(default_factory=dict)   # canonical key -> patches, in LoRA order
    unmatched: dict[int, list[str]] = field(default_factory=dict)   # LoRA index -> its unmatched tensor keys

    def strength(self, patch: Patch) -> float:
        spec = self.loras[patch.lora][0]
        return spec.text_strength if is_text_weight(patch.target.key) else spec.strength

    def apply(self, key: str, arr: np.ndarray) -> np.ndarray:
        """The weight `key` with every patch on it applied (fp32); `arr` itself is not changed."""
        patches = self.patches.get(key)
        if not patches:
            return arr
        out = np.array(arr, dtype=np.float32, copy=True)
        for p in patches:
            strength = self.strength(p)
            if strength == 0.0:
                continue
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # checked just below
                self._apply_one(p, out, strength)
            self._check_finite(p, key, out, arr)
        return out

    def _apply_one(self, p: Patch, out: np.ndarray, strength: float) -> None:
        lf = self.loras[p.lora][1]
        if p.bias:
            bias = lf.read(p.module, "diff_b").reshape(-1)
            bias = bias[p.target.part[0]:p.target.part[1]] if p.target.part else bias
            out += np.float32(strength) * bias.reshape(out.shape)
            return
        view = out[p.target.rows[0]:p.target.rows[1]] if p.target.rows else out
        delta, scale = module_delta(lf, p.module, p.target.part)
        delta = (delta * np.float32(scale)).reshape(view.shape)
        mag_role = next((r for r in ("dora_scale", "magnitude") if r in p.module.tensors), None)
        if mag_role is not None:
            view[...] = dora(view, delta, lf.read(p.module, mag_role), strength)
        else:
            view += np.float32(strength) * delta

    def _check_finite(self, p: Patch, key: str, out: np.ndarray, base: np.ndarray) -> None:
        """After one patch: a value that is NaN or infinite where the base weight was finite came
        from this LoRA (values too large for float32) -- an error naming the file and the weight."""
        if np.isfinite(out).all():
            return
        if not (~np.isfinite(out) & np.isfinite(np.asarray(base, dtype=np.float32))).any():
            return  # the base weight itself holds them; the writer reports the checkpoint
        spec, lf = self.loras[p.lora]
        raise BadInput(f"--lora {lf.path}: merging {p.module.name} into {key} (strength {self.strength(p)}) "
                       "gives values beyond float32's range (infinity or NaN); the LoRA's tensors or alpha are "
                       "far too large -- lower the strength or re-save the LoRA")

    def transform(self, weight, arr: np.ndarray) -> np.ndarray:
        """`save_model`'s transform hook (weight.key is the canonical key)."""
        return self.apply(weight.key, arr)

    def touched(self) -> set[str]:
        return set(self.patches)

    def describe(self) -> list[dict]:
        out = []
        for i, (spec, lf) in enumerate(self.loras):
            out.append({"name": lf.name, "path": spec.path, "sha256": lf.sha256, "strength": spec.strength,
                        "te_strength": spec.text_strength, "modules": len(lf.modules),
                        "weights": sum(1 for ps in self.patches.values() for p in ps if p.lora == i),
                        "unmatched": self.unmatched.get(i, [])})
        return out


def _listing(keys: list[str]) -> str:
    more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return ", ".join(keys[:MAX_LISTED]) + more


def plan_merge(shapes: dict[str, tuple[int, ...]], loras: list[LoraSpec], allow_unmatched: bool = False,
               warn: Callable[[str], None] | None = None, table: NameTable | None = None,
               files: list[LoraFile] | None = None, allow_hint: Callable[[int], str] | None = None) -> MergePlan:
    """Resolve and check every LoRA against a model's weights (name -> shape); nothing is read but
    headers. Raises BadInput on unmatched keys (unless allow_unmatched, or the LoRA's own) and on
    shape mismatches. `allow_hint(i)`: how the command that asked allows the unmatched keys of LoRA i
    (default: export's flag)."""
    allow_hint = allow_hint or (lambda i: "pass --allow-unmatched")
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    table = table or build_name_table(shapes)
    opened = files or [read_lora(spec.path) for spec in loras]
    plan = MergePlan(list(zip(loras, opened)))
    problems = []
    for i, (spec, lf) in enumerate(plan.loras):
        unmatched = list(lf.stray)
        seen: dict[tuple[str, tuple | None], str] = {}
        for m in lf.modules.values():
            found = table.lookup(m.name)
            if found is None:
                amb = table.ambiguous.get(flat(m.name))
                unmatched += [k + (f" (names more than one weight: {', '.join(sorted(amb))})" if amb else "")
                              for k in sorted(m.tensors.values())]
                continue
            targets = targets_of(found)
            if targets[0].part and (problem := split_problem(lf, m, targets)):
                problems.append(problem)
                continue
            for target in targets:
                plan_target(plan, problems, unmatched, seen, shapes, i, lf, m, target)
        if unmatched:
            plan.unmatched[i] = sorted(set(unmatched))
    if problems:
        raise BadInput(f"LoRA does not fit the model ({len(problems)} problem(s)): " + "; ".join(problems[:MAX_LISTED]))
    for i, keys in plan.unmatched.items():
        lf = plan.loras[i][1]
        msg = (f"{lf.path}: {len(keys)} of its tensors name no weight of this model: {_listing(keys)}")
        if not (allow_unmatched or plan.loras[i][0].allow_unmatched):
            raise BadInput(f"{msg}. Is the LoRA for another model family? To merge the rest, {allow_hint(i)}.")
        warn(msg + " (skipped: unmatched tensors allowed)")
    return plan


def split_problem(lf: LoraFile, m: LoraModule, targets: tuple[Target, ...]) -> str | None:
    """Why a module fused over several of the model's weights (each taking rows `part` of its delta) cannot be
    split over them, or None."""
    keys = " + ".join(dict.fromkeys(t.key for t in targets))
    if any(r in m.tensors for r in ("dora_scale", "magnitude")):
        return f"{lf.path}: {m.name}: DoRA on a module this model holds as separate weights ({keys}) is not " \
               "supported; use a plain LoRA, or one saved in diffusers' names"
    rows = max(t.part[1] for t in targets)
    if not (m.kind == "full" and "diff" not in m.tensors) and delta_shape(lf, m)[0] != rows:
        return f"{lf.path}: {m.name} gives a delta of {delta_shape(lf, m)[0]} rows but the model's {keys} take {rows}"
    if "diff_b" in m.tensors and _numel(lf.shape(m, "diff_b")) != rows:
        return f"{lf.path}: {m.tensors['diff_b']} has {_numel(lf.shape(m, 'diff_b'))} values but the biases of {keys} " \
               f"take {rows}"
    return None


def plan_target(plan: MergePlan, problems: list, unmatched: list, seen: dict, shapes: dict, i: int, lf: LoraFile,
                m: LoraModule, target: Target) -> None:
    """One LoRA module's patch on one weight (its delta's rows `target.part` when the module is fused over
    several), checked against the weight's shape; a problem or an unmatched tensor recorded instead."""
    span = target.rows or (0, shapes[target.key][0])
    other = next((name for (key, (a, b)), name in seen.items() if key == target.key and a < span[1] and span[0] < b
                  and name != m.name), None)
    if other is not None:
        problems.append(f"{lf.path}: {m.name} and {other} both name {target.describe()}")
        return
    seen[(target.key, span)] = m.name
    want = shapes[target.key]
    if target.rows:
        want = (target.rows[1] - target.rows[0], *want[1:])
    if m.kind == "full" and "diff" not in m.tensors:
        got = None
    else:
        got = delta_shape(lf, m)
        if target.part:
            got = (target.part[1] - target.part[0], *got[1:])
        if not fits(got, want):
            problems.append(f"{lf.path}: {m.name} gives a delta of shape {list(got)} but the model's "
                            f"{target.describe()} has shape {list(want)}")
            return
    mag = next((r for r in ("dora_scale", "magnitude") if r in m.tensors), None)
    if mag is not None and _numel(lf.shape(m, mag)) not in (want[0], want[1] if len(want) > 1 else -1):
        problems.append(f"{lf.path}: {m.tensors[mag]} has shape {list(lf.shape(m, mag))}; "
                        f"{target.describe()} {list(want)} needs {want[0]} (rows) or {want[1]} (columns) values")
        return
    if got is not None:
        if m.kind in ("lora", "loha", "lokr"):
            lf.alpha(m, 1)  # refuses a bad alpha (values, shape, metadata) before anything is written
        plan.patches.setdefault(target.key, []).append(Patch(i, m, target))
    if "diff_b" in m.tensors:
        bias_key = target.key[:-len("weight")] + "bias" if target.key.endswith(".weight") else None
        if bias_key not in shapes or target.rows:
            unmatched.append(m.tensors["diff_b"])
        elif target.part:           # the bias rows of a fused module's part
            plan.patches.setdefault(bias_key, []).append(Patch(i, m, Target(bias_key, None, target.part), bias=True))
        elif _numel(lf.shape(m, "diff_b")) != _numel(shapes[bias_key]):
            problems.append(f"{lf.path}: {m.tensors['diff_b']} has shape {list(lf.shape(m, 'diff_b'))} "
                            f"but the model's {bias_key} has shape {list(shapes[bias_key])}")
        else:
            plan.patches.setdefault(bias_key, []).append(Patch(i, m, Target(bias_key), bias=True))


def component_loras(plan: MergePlan, prefix: str) -> list[dict]:
    """What decides one component's merged weights: each LoRA that patches a weight under `prefix`,
    by content digest, with the strength that applies there (cache keys use this, so a component a
    LoRA does not touch -- the VAE -- keeps one export for every LoRA set)."""
    out = []
    for i, (spec, lf) in enumerate(plan.loras):
        if any(k.startswith(prefix) and any(p.lora == i for p in ps) for k, ps in plan.patches.items()):
            out.append({"sha256": lf.sha256, "strength": spec.text_strength if is_text_weight(prefix) else spec.strength})
    return out
