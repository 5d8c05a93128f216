"""Samplers for latent diffusion, in numpy: Euler (discrete) and DPM++ 2M.

Owns: the SD noise schedule (scaled-linear betas), timestep spacing (leading / linspace /
trailing, with steps_offset), and each sampler's update, following the published algorithms
as diffusers' EulerDiscreteScheduler and DPMSolverMultistepScheduler (dpmsolver++, order 2,
midpoint, final sigma zero) configure them, so results can be compared with diffusers.
epsilon and v-prediction. Starting mid-schedule (img2img, inpainting): `start_index` is diffusers'
get_timesteps (the steps a strength keeps), `add_noise(x0, noise, i)` noises clean latents to step i's
level as the schedulers' add_noise does with begin_index set; the loop then runs steps i.. of the
same schedule (a multistep solver's first step is first order, as diffusers' lower_order_nums makes it).
"""
from __future__ import annotations

from .errors import UserError

from dataclasses import dataclass

import numpy as np


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


class Euler:
    """Euler discrete sampler (no churn)."""

    def __init__(self, schedule: NoiseSchedule, steps: int):
        self.s = schedule
        T = schedule.num_train_timesteps
        if schedule.timestep_spacing == "linspace":
            t = np.linspace(0, T - 1, steps, dtype=np.float32)[::-1].copy()
        elif schedule.timestep_spacing == "leading":
            t = (np.arange(0, steps) * (T // steps)).round()[::-1].astype(np.float32) + schedule.steps_offset
        elif schedule.timestep_spacing == "trailing":
            t = np.arange(T, 0, -T / steps).round().astype(np.float32) - 1
        else:
            raise ValueError(f"timestep spacing {schedule.timestep_spacing!r}: linspace, leading or trailing")
        train = schedule.train_sigmas()
        self.timesteps = t
        self.sigmas = np.concatenate([np.interp(t, np.arange(T), train), [0.0]]).astype(np.float32)
        top = float(self.sigmas.max())
        self.init_noise_sigma = top if schedule.timestep_spacing in ("linspace", "trailing") else (top ** 2 + 1) ** 0.5

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x / np.float32((self.sigmas[i] ** 2 + 1) ** 0.5)

    def add_noise(self, x0: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        """x0 noised to step i's level: x0 + sigma_i * noise (the sampler's own scale, not unit variance)."""
        return (x0 + noise * self.sigmas[i]).astype(np.float32)

    def step(self, model_output: np.ndarray, i: int, x: np.ndarray) -> np.ndarray:
        sigma = self.sigmas[i]
        if self.s.prediction_type == "v_prediction":
            x0 = model_output * (-sigma / (sigma ** 2 + 1) ** 0.5) + x / (sigma ** 2 + 1)
        else:
            x0 = x - sigma * model_output
        derivative = (x - x0) / sigma
        return (x + derivative * (self.sigmas[i + 1] - sigma)).astype(np.float32)


class DpmPP2M:
    """DPM-Solver++ (2M): second-order multistep, first order on the first and the last step."""

    def __init__(self, schedule: NoiseSchedule, steps: int):
        self.s = schedule
        T = schedule.num_train_timesteps
        if schedule.timestep_spacing == "linspace":
            t = np.linspace(0, T - 1, steps + 1).round()[::-1][:-1].astype(np.int64)
        elif schedule.timestep_spacing == "leading":
            t = (np.arange(0, steps + 1) * (T // (steps + 1))).round()[::-1][:-1].astype(np.int64) + schedule.steps_offset
        elif schedule.timestep_spacing == "trailing":
            t = np.arange(T, 0, -T / steps).round().astype(np.int64) - 1
        else:
            raise ValueError(f"timestep spacing {schedule.timestep_spacing!r}: linspace, leading or trailing")
        train = schedule.train_sigmas()
        self.timesteps = t.astype(np.float32)
        self.sigmas = np.concatenate([np.interp(t, np.arange(T), train), [0.0]]).astype(np.float32)
        self.init_noise_sigma = 1.0
        self._previous_x0: np.ndarray | None = None

    @staticmethod
    def _alpha_sigma(sigma: float) -> tuple[float, float]:
        alpha = 1.0 / (sigma ** 2 + 1) ** 0.5
        return alpha, sigma * alpha

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, x0: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        """x0 noised to step i's level: alpha_i * x0 + sigma_i * noise (variance preserving)."""
        alpha, sigma = self._alpha_sigma(float(self.sigmas[i]))
        return (np.float32(alpha) * x0 + np.float32(sigma) * noise).astype(np.float32)

    def step(self, model_output: np.ndarray, i: int, x: np.ndarray) -> np.ndarray:
        alpha_s, sigma_s = self._alpha_sigma(float(self.sigmas[i]))
        if self.s.prediction_type == "v_prediction":
            x0 = alpha_s * x - sigma_s * model_output
        else:
            x0 = (x - sigma_s * model_output) / alpha_s
        last = i == len(self.timesteps) - 1
        if last:  # final sigma is zero: the update lands exactly on the denoised estimate
            out = x0
        else:
            alpha_t, sigma_t = self._alpha_sigma(float(self.sigmas[i + 1]))
            lam = lambda a, s: np.log(a) - np.log(s)
            h = lam(alpha_t, sigma_t) - lam(alpha_s, sigma_s)
            out = (sigma_t / sigma_s) * x - alpha_t * np.expm1(-h) * x0
            if self._previous_x0 is not None:
                alpha_p, sigma_p = self._alpha_sigma(float(self.sigmas[i - 1]))
                r0 = (lam(alpha_s, sigma_s) - lam(alpha_p, sigma_p)) / h
                d1 = (x0 - self._previous_x0) / r0
                out = out - 0.5 * alpha_t * np.expm1(-h) * d1
        self._previous_x0 = x0
        return np.asarray(out, dtype=np.float32)


def start_index(steps: int, strength: float) -> int:
    """The first step an img2img/inpainting run takes of a `steps`-step schedule: diffusers'
    get_timesteps (init_timestep = min(int(steps * strength), steps); t_start = steps - init_timestep)."""
    return max(steps - min(int(steps * strength), steps), 0)


SAMPLERS = {"euler": Euler, "dpm++2m": DpmPP2M}


def make_sampler(name: str, steps: int, schedule: NoiseSchedule | None = None):
    key = name.lower().replace("_", "").replace(" ", "")
    key = {"dpmpp2m": "dpm++2m", "dpm2m": "dpm++2m", "dpmsolver++": "dpm++2m"}.get(key, key)
    if key not in SAMPLERS:
        raise UserError(f"--scheduler {name!r}: choose one of {', '.join(SAMPLERS)}")
    return SAMPLERS[key](schedule or NoiseSchedule(), steps)
