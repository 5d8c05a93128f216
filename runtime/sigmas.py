"""Noise levels for SD's samplers, in numpy: the training schedule and the tables a sampler steps through.

Owns: `NoiseSchedule` (scaled-linear betas, timestep spacing leading / linspace / trailing with steps_offset,
prediction type), the sigma schedules users name -- normal (the model's own spacing: SD's leading, offset
1), karras (Karras et al. 2022, rho 7), exponential (log-linear in sigma), sgm_uniform (trailing spacing) --
and `sigma_to_t`. Each diffusers scheduler derives its table with details of its own, and `table` keeps
them so each sampler matches its diffusers scheduler: a "k" table (Euler, Heun, KDPM2, DPMSolverSDE: one
timestep per step; Karras and exponential between the spaced table's ends) or a "multistep" one
(DPMSolverMultistep, UniPC: leading / linspace take steps + 1 timesteps and drop the last; Karras and
exponential between the training schedule's ends; integer timesteps). Imports numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEDULES = ("normal", "karras", "exponential", "sgm-uniform")


@dataclass(frozen=True)
class NoiseSchedule:
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    timestep_spacing: str = "leading"
    steps_offset: int = 1
    prediction_type: str = "epsilon"       # epsilon | v_prediction

    def alphas_cumprod(self) -> np.ndarray:
        betas = np.linspace(self.beta_start ** 0.5, self.beta_end ** 0.5, self.num_train_timesteps,
                            dtype=np.float32) ** 2
        return np.cumprod(1.0 - betas, dtype=np.float32)

    def train_sigmas(self) -> np.ndarray:
        ac = self.alphas_cumprod()
        return ((1 - ac) / ac) ** 0.5


def spaced(schedule: NoiseSchedule, steps: int, spacing: str, points: int) -> np.ndarray:
    """`points` timesteps of `steps`, high to low, as diffusers spaces them (float64 values; points is steps,
    or steps + 1 for the multistep schedulers, whose linspace / leading tables then drop the last)."""
    T = schedule.num_train_timesteps
    if spacing == "linspace":     # one per step: float32 values, as EulerDiscreteScheduler makes them
        t = np.linspace(0, T - 1, points, dtype=np.float32 if points == steps else np.float64)
        return (t if points == steps else t.round())[::-1][:steps].astype(np.float64)
    if spacing == "leading":
        return (np.arange(0, points) * (T // points)).round()[::-1][:steps] + schedule.steps_offset
    if spacing == "trailing":
        return np.arange(T, 0, -T / steps).round() - 1
    raise ValueError(f"timestep spacing {spacing!r}: linspace, leading or trailing")


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Timesteps of noise levels: log-sigma interpolated in the training table (diffusers' _sigma_to_t)."""
    log_sigma = np.log(np.maximum(np.asarray(sigmas, np.float64), 1e-10))
    dists = log_sigma - log_sigmas[:, None]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_sigmas) - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return ((1 - w) * low + w * (low + 1)).reshape(np.shape(sigmas))


def karras(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    ramp = np.linspace(0, 1, n)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def exponential(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    return np.exp(np.linspace(np.log(sigma_max), np.log(sigma_min), n))


def table(schedule: NoiseSchedule, steps: int, kind: str = "normal", style: str = "k",
          round_karras: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(sigmas [steps + 1] float32 ending in 0, timesteps [steps] float64: what the UNet is fed at each step).
    `kind`: one of SCHEDULES; `style`: "k" or "multistep" (module docstring); `round_karras`: Karras
    timesteps rounded to integers (KDPM2 and KDPM2Ancestral do; Euler, Heun and DPMSolverSDE do not)."""
    train = schedule.train_sigmas()
    log_train = np.log(train)
    spacing = "trailing" if kind == "sgm-uniform" else schedule.timestep_spacing
    t = spaced(schedule, steps, spacing, steps + (style == "multistep" and spacing != "trailing"))
    if style == "multistep":
        t = t.astype(np.int64)
    sigmas = np.interp(t, np.arange(len(train)), train)
    if kind in ("karras", "exponential"):
        lo, hi = (float(train[0]), float(train[-1])) if style == "multistep" else (sigmas[-1], sigmas[0])
        sigmas = (karras if kind == "karras" else exponential)(lo, hi, steps)
        t = sigma_to_t(sigmas, log_train)
        if kind == "karras" and (round_karras or style == "multistep"):
            t = t.round()
        if style == "multistep":
            t = t.astype(np.int64)           # diffusers' multistep timesteps are integers (exponential: truncated)
    elif kind not in SCHEDULES:
        raise ValueError(f"schedule {kind!r}: one of {', '.join(SCHEDULES)}")
    return np.concatenate([sigmas, [0.0]]).astype(np.float32), t.astype(np.float64)
