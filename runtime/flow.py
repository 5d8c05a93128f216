"""Flow-matching samplers (Flux, Chroma, SD3), in numpy: Euler, Heun and DPM++ 2M on the model's own schedule.

Owns: the sigma schedule -- linspace(1, 1/steps, steps) (FluxPipeline's own sigmas; spacing
"1/steps") or linspace(1, the training schedule's last sigma, steps) (the scheduler's default
spacing, which StableDiffusion3Pipeline uses: "training"), then either a static shift
sigma' = s*sigma / (1 + (s - 1)*sigma) or the resolution-dependent ("dynamic") exponential time
shift sigma' = e^mu / (e^mu + 1/sigma - 1), with mu linear in the number of image tokens between
(base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), or (dynamic_mu "empirical") FLUX.2's fit to the
image tokens and the steps -- optionally stretched so the last sigma is shift_terminal (diffusers'
stretch_shift_to_terminal: 1 - sigma scaled so its last value is 1 - shift_terminal; Qwen-Image's 0.02) -- and the
Euler update on the predicted velocity, x <- x + (sigma_next - sigma) * v, ending at sigma 0. Arithmetic follows
diffusers' FlowMatchEulerDiscreteScheduler (float32 sigmas; the transformer is fed
(sigma * 1000) / 1000 in float32, as FluxPipeline does) so results compare with diffusers. On the same
sigmas: Heun (FlowMatchHeunDiscreteScheduler's update: the mean of the velocities at both ends, Euler on
the last step) and DPM++ 2M (DPMSolverMultistepScheduler with flow_prediction: alpha = 1 - sigma;
runtime/multistep.py). `step(model, i, x)` calls `model(x, j)`, the velocity at point j of the table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .multistep import DpmSolver2M


SPACINGS = ("1/steps", "training")
MUS = ("linear", "empirical")   # the dynamic shift's mu: linear in the image tokens, or FLUX.2's fit to them and steps
TRAIN_STEPS = 1000        # num_train_timesteps of every released flow-matching model
LIMITS = {"shift": (1e-3, 1e3), "base_shift": (-10.0, 10.0), "max_shift": (-10.0, 10.0),
          "base_image_seq_len": (1, 1 << 24), "max_image_seq_len": (1, 1 << 24), "shift_terminal": (1e-6, 0.999)}


def schedule_problem(sched: dict) -> str | None:
    """Why a scheduler config (diffusers FlowMatchEulerDiscreteScheduler fields) cannot be sampled
    here, naming the field; None when it can."""
    for name, value in sched.items():
        if name == "use_dynamic_shifting":
            if not isinstance(value, bool):
                return f"use_dynamic_shifting = {value!r}: expected true or false"
        elif name == "spacing":
            if value not in SPACINGS:
                return f"spacing = {value!r}: expected {' or '.join(SPACINGS)}"
        elif name == "time_shift_type":
            if value != "exponential":
                return f"time_shift_type = {value!r}: only exponential (Flux's) is supported"
        elif name == "dynamic_mu":
            if value not in MUS:
                return f"dynamic_mu = {value!r}: expected {' or '.join(MUS)}"
        elif name in LIMITS:
            low, high = LIMITS[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                return f"{name} = {value!r}: expected a number from {low:g} to {high:g}"
        else:
            return f"unknown scheduler field {name!r}"
    if sched.get("use_dynamic_shifting") and \
            sched.get("base_image_seq_len", 256) >= sched.get("max_image_seq_len", 4096):
        return "base_image_seq_len must be below max_image_seq_len (the shift is interpolated between them)"
    return None


@dataclass(frozen=True)
class FlowSchedule:
    use_dynamic_shifting: bool = False
    shift: float = 1.0
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    spacing: str = "1/steps"
    dynamic_mu: str = "linear"
    shift_terminal: float | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> "FlowSchedule":
        known = {k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg}
        return cls(**known)

    def mu(self, image_tokens: int, steps: int) -> float:
        if self.dynamic_mu == "empirical":     # Flux2Pipeline's compute_empirical_mu
            if image_tokens > 4300:
                return 0.00016927 * image_tokens + 0.45666666
            m_200, m_10 = 0.00016927 * image_tokens + 0.45666666, 8.73809524e-05 * image_tokens + 1.89833333
            a = (m_200 - m_10) / 190.0
            return a * steps + (m_200 - 200.0 * a)
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return image_tokens * m + (self.base_shift - m * self.base_image_seq_len)


class FlowEuler:
    """Euler on the flow ODE: `timesteps[i]` is what the transformer is fed at step i."""

    def __init__(self, schedule: FlowSchedule, steps: int, image_tokens: int):
        if schedule.spacing == "training":     # down to the training schedule's last sigma (shifted if static)
            last = 1.0 / TRAIN_STEPS
            if not schedule.use_dynamic_shifting:
                last = schedule.shift * last / (1 + (schedule.shift - 1) * last)
            sigmas = np.linspace(1.0, np.float32(last), steps).astype(np.float32)
        else:
            sigmas = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
        if schedule.use_dynamic_shifting:
            e = math.exp(schedule.mu(image_tokens, steps))
            sigmas = (e / (e + (1 / sigmas - 1) ** 1.0)).astype(np.float32)
        else:
            s = schedule.shift
            sigmas = (s * sigmas / (1 + (s - 1) * sigmas)).astype(np.float32)
        if schedule.shift_terminal:
            rest = (np.float32(1) - sigmas).astype(np.float32)
            scale = np.float32(rest[-1] / np.float32(1 - schedule.shift_terminal))
            sigmas = (np.float32(1) - rest / scale).astype(np.float32)
        self.sigmas = np.concatenate([sigmas, np.zeros(1, np.float32)])
        self.timesteps = ((sigmas * np.float32(1000)).astype(np.float32) / np.float32(1000)).astype(np.float32)

    def step(self, model, i: int, x: np.ndarray) -> np.ndarray:
        dt = np.float32(self.sigmas[i + 1] - self.sigmas[i])
        return (x.astype(np.float32) + dt * model(x, i).astype(np.float32)).astype(np.float32)


class FlowHeun(FlowEuler):
    """Heun on the flow ODE: Euler to the next point, then the mean of both velocities; Euler on the last step."""

    def step(self, model, i: int, x: np.ndarray) -> np.ndarray:
        v = model(x, i).astype(np.float32)
        dt = np.float32(self.sigmas[i + 1] - self.sigmas[i])
        if self.sigmas[i + 1] == 0:
            return (x + dt * v).astype(np.float32)
        v2 = model((x + dt * v).astype(np.float32), i + 1).astype(np.float32)
        return (x + dt * (np.float32(0.5) * (v + v2))).astype(np.float32)


class FlowDpmPP2M(FlowEuler):
    """DPM++ 2M on the flow ODE: x0 = x - sigma * v, multistep on alpha = 1 - sigma."""

    def __init__(self, schedule: FlowSchedule, steps: int, image_tokens: int):
        super().__init__(schedule, steps, image_tokens)
        self.solver = DpmSolver2M()

    def step(self, model, i: int, x: np.ndarray) -> np.ndarray:
        s, n = float(self.sigmas[i]), float(self.sigmas[i + 1])
        x0 = x - np.float32(s) * model(x, i).astype(np.float32)
        return np.asarray(self.solver.step(x, x0, (1 - s, s), (1 - n, n)), dtype=np.float32)


SAMPLERS = {"flow-euler": FlowEuler, "flow-heun": FlowHeun, "flow-dpm++2m": FlowDpmPP2M}
