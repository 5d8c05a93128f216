"""Samplers for SD 1.x / 2.x / XL, in numpy: Euler, Euler a, Heun, DPM2, DPM2 a, DPM++ SDE, DPM++ 2M,
DPM++ 2M SDE, UniPC, DDIM and LCM, each on the sigma schedules it runs (runtime/sigmas.py: normal, karras,
exponential, sgm-uniform).

Owns each sampler's step, following the published algorithms as the diffusers scheduler named in its class
configures them (epsilon and v-prediction), so results compare with diffusers; `make_sampler`;
`start_index`; `step_noise`, the noise rule. A sampler has `timesteps` (what the UNet is fed at each
step's first call), `sigmas`, `init_noise_sigma`, `add_noise(x0, noise, i)` (clean latents noised to step
i's level, in the sampler's own space: x0 + sigma * noise for the k-samplers, alpha * x0 + sigma * noise for
the multistep ones, DDIM and LCM) and `step(model, i, x)`: one step, calling `model(x_in, t)` -- the
guided UNet output for an input already scaled and a timestep -- once, or twice (Heun, DPM2, DPM2 a,
DPM++ SDE; not on the last step), keeping its latest estimate of the clean latents in `last_x0` (what step
previews show). Starting mid-table (img2img, inpainting): `start_index` is diffusers'
get_timesteps (the steps a strength keeps), `add_noise(x0, noise, i)` noises the image to step i's level
and the loop runs steps i.. of the same table (a multistep solver's first step is first order).

The noise rule (Euler a, DPM2 a, DPM++ SDE, DPM++ 2M SDE, LCM): step i of the image made with seed S draws
from numpy.random.default_rng(numpy.random.SeedSequence(S, spawn_key=(i,))) -- SeedSequence(S).spawn(n)[i]
-- standard_normal(latent shape) cast to float32, once per noise the step adds; DPM++ SDE's second half uses
the second draw z2 with the first z1 as a Brownian bridge in sigma: (sqrt(s - m) z1 + sqrt(m - n) z2) /
sqrt(s - n) from s to n through midpoint m. Numpy's generators give the same numbers on every platform,
so a seed gives the same image on every backend and run.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import UserError
from .multistep import DpmSolver2M, UniPC as UniPCSolver
from .sampler_names import parse_sampler
from .sigmas import SCHEDULES, NoiseSchedule, sigma_to_t, spaced, table


def step_noise(seeds, i: int, shape: tuple, draws: int = 1) -> np.ndarray:
    """[draws, *shape] float32: step i's noise for a batch whose rows were made with `seeds` (module docstring)."""
    rows = [np.random.default_rng(np.random.SeedSequence(int(s), spawn_key=(i,))) for s in seeds]
    return np.stack([np.concatenate([r.standard_normal((1, *shape[1:])) for r in rows]) for _ in range(draws)]
                    ).astype(np.float32)


def start_index(steps: int, strength: float) -> int:
    """The first step an img2img/inpainting run takes of a `steps`-step schedule: diffusers'
    get_timesteps (init_timestep = min(int(steps * strength), steps); t_start = steps - init_timestep)."""
    return max(steps - min(int(steps * strength), steps), 0)


class Sampler:
    """The k-samplers' frame (diffusers' Euler family): latents x = x0 + sigma * noise, the UNet fed
    x / sqrt(sigma^2 + 1). A subclass gives `step`."""
    schedules = SCHEDULES                  # the schedules it runs; the first is the default
    style, round_karras = "k", False
    last_x0 = None                         # the latest estimate of the clean latents (previews read it)

    def __init__(self, schedule: NoiseSchedule, steps: int, kind: str = "normal", seeds=(0,)):
        self.s, self.steps, self.kind, self.seeds = schedule, steps, kind, tuple(seeds)
        self.log_train = np.log(schedule.train_sigmas())
        self.sigmas, t = table(schedule, steps, kind, self.style, self.round_karras)
        self.timesteps = t.astype(np.float32)
        top = float(self.sigmas.max())
        own = "trailing" if kind == "sgm-uniform" else schedule.timestep_spacing
        self.init_noise_sigma = top if own in ("linspace", "trailing") else (top ** 2 + 1) ** 0.5

    def noise(self, i: int, shape: tuple, draws: int = 1) -> np.ndarray:
        return step_noise(self.seeds, i, shape, draws)

    def scale(self, x: np.ndarray, sigma) -> np.ndarray:
        return x / np.float32((sigma ** 2 + 1) ** 0.5)

    def add_noise(self, x0: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        """x0 noised to step i's level: x0 + sigma_i * noise (the sampler's own scale, not unit variance)."""
        return (x0 + noise * self.sigmas[i]).astype(np.float32)

    def denoised(self, model, x: np.ndarray, sigma, t) -> np.ndarray:
        """The UNet's estimate of x0 from x at noise level `sigma`, fed timestep `t`."""
        out = model(self.scale(x, sigma), t)
        if self.s.prediction_type == "v_prediction":
            x0 = out * (-sigma / (sigma ** 2 + 1) ** 0.5) + x / (sigma ** 2 + 1)
        else:
            x0 = x - sigma * out
        self.last_x0 = x0
        return x0

    def t_of(self, sigma) -> float:
        return float(sigma_to_t(np.float32(sigma), self.log_train))

    def step(self, model, i: int, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Euler(Sampler):
    """Euler (EulerDiscreteScheduler, no churn)."""

    def step(self, model, i, x):
        sigma = self.sigmas[i]
        x0 = self.denoised(model, x, sigma, self.timesteps[i])
        return (x + (x - x0) / sigma * (self.sigmas[i + 1] - sigma)).astype(np.float32)


class EulerAncestral(Sampler):
    """Euler a (EulerAncestralDiscreteScheduler): Euler down to sigma_down, then noise up to the next level."""

    def step(self, model, i, x):
        sigma, nxt = self.sigmas[i], self.sigmas[i + 1]
        x0 = self.denoised(model, x, sigma, self.timesteps[i])
        up = (nxt ** 2 * (sigma ** 2 - nxt ** 2) / sigma ** 2) ** 0.5
        down = (nxt ** 2 - up ** 2) ** 0.5
        x = x + (x - x0) / sigma * (down - sigma)
        return (x + self.noise(i, x.shape)[0] * up).astype(np.float32)


class Heun(Sampler):
    """Heun (HeunDiscreteScheduler): Euler, then the mean of the slopes at both ends; Euler on the last step."""

    def step(self, model, i, x):
        sigma, nxt = self.sigmas[i], self.sigmas[i + 1]
        d = (x - self.denoised(model, x, sigma, self.timesteps[i])) / sigma
        if nxt == 0:
            return (x + d * (nxt - sigma)).astype(np.float32)
        x2 = x + d * (nxt - sigma)
        d2 = (x2 - self.denoised(model, x2, nxt, self.timesteps[i + 1])) / nxt
        return (x + (d + d2) / 2 * (nxt - sigma)).astype(np.float32)


def _log_midpoint(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """exp(lerp(log b, log a, 0.5)) in float32, as torch computes KDPM2's interpolated sigmas."""
    la, lb = np.log(a.astype(np.float32)), np.log(b.astype(np.float32))
    return np.exp(la - (la - lb) * np.float32(0.5)).astype(np.float32)


class DPM2(Sampler):
    """DPM2 (KDPM2DiscreteScheduler): the slope at the log-midpoint sigma; Euler on the last step."""
    round_karras = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.mids = _log_midpoint(self.sigmas[:-2], self.sigmas[1:-1])

    def step(self, model, i, x):
        sigma, nxt = self.sigmas[i], self.sigmas[i + 1]
        d = (x - self.denoised(model, x, sigma, self.timesteps[i])) / sigma
        if nxt == 0:
            return (x + d * (nxt - sigma)).astype(np.float32)
        mid = self.mids[i]
        x2 = x + d * (mid - sigma)
        d2 = (x2 - self.denoised(model, x2, mid, self.t_of(mid))) / mid
        return (x + d2 * (nxt - sigma)).astype(np.float32)


class DPM2Ancestral(Sampler):
    """DPM2 a (KDPM2AncestralDiscreteScheduler): DPM2 down to sigma_down, then noise up; Euler on the last step."""
    round_karras = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        s, n = self.sigmas[:-1], self.sigmas[1:]
        self.up = (n ** 2 * (s ** 2 - n ** 2) / s ** 2) ** 0.5
        self.down = (n ** 2 - self.up ** 2) ** 0.5
        self.mids = _log_midpoint(self.down[:-1], s[:-1])

    def step(self, model, i, x):
        sigma = self.sigmas[i]
        d = (x - self.denoised(model, x, sigma, self.timesteps[i])) / sigma
        if i == self.steps - 1:
            return (x + d * (0 - sigma)).astype(np.float32)
        mid = self.mids[i]
        x2 = x + d * (mid - sigma)
        d2 = (x2 - self.denoised(model, x2, mid, self.t_of(mid))) / mid
        return (x + d2 * (self.down[i] - sigma) + self.noise(i, x.shape)[0] * self.up[i]).astype(np.float32)


class DpmPPSDE(Sampler):
    """DPM++ SDE (DPMSolverSDEScheduler, k-diffusion's sample_dpmpp_sde with r = 1/2, eta = 1): an ancestral
    DPM-Solver++ step to the log-midpoint, then from the start to the next level with the midpoint's x0."""

    def _ancestral(self, x, x0, sigma: float, to: float, noise: np.ndarray) -> np.ndarray:
        up = min(to, (to ** 2 * (sigma ** 2 - to ** 2) / sigma ** 2) ** 0.5)
        down = (to ** 2 - up ** 2) ** 0.5
        return (down / sigma) * x - math.expm1(math.log(down) - math.log(sigma)) * x0 + noise * up

    def step(self, model, i, x):
        sigma, nxt = float(self.sigmas[i]), float(self.sigmas[i + 1])
        x0 = self.denoised(model, x, self.sigmas[i], self.timesteps[i])
        if nxt == 0:
            return (x + (x - x0) / sigma * (nxt - sigma)).astype(np.float32)
        mid = math.exp(-(-math.log(sigma) + (math.log(sigma) - math.log(nxt)) * 0.5))
        z1, z2 = self.noise(i, x.shape, 2)
        x2 = self._ancestral(x, x0, sigma, mid, z1).astype(np.float32)
        x0_mid = self.denoised(model, x2, np.float32(mid), self.t_of(mid))
        bridge = (math.sqrt(sigma - mid) * z1 + math.sqrt(mid - nxt) * z2) / math.sqrt(sigma - nxt)
        return self._ancestral(x, x0_mid, sigma, nxt, bridge).astype(np.float32)


class Multistep(Sampler):
    """The multistep frame (diffusers' DPMSolverMultistep family): variance-preserving latents x = alpha * x0 +
    sigma * noise (alpha = 1 / sqrt(1 + s^2)), the UNet fed x as it is, integer timesteps."""
    style = "multistep"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.init_noise_sigma = 1.0
        self.points = [self.alpha_sigma(float(s)) for s in self.sigmas]

    @staticmethod
    def alpha_sigma(sigma: float) -> tuple[float, float]:
        alpha = 1.0 / (sigma ** 2 + 1) ** 0.5
        return alpha, sigma * alpha

    def scale(self, x, sigma):
        return x

    def add_noise(self, x0, noise, i):
        """x0 noised to step i's level: alpha_i * x0 + sigma_i * noise (variance preserving)."""
        alpha, sigma = self.points[i]
        return (np.float32(alpha) * x0 + np.float32(sigma) * noise).astype(np.float32)

    def x0(self, model, x, i) -> np.ndarray:
        alpha, sigma = self.points[i]
        out = model(x, self.timesteps[i])
        x0 = alpha * x - sigma * out if self.s.prediction_type == "v_prediction" else (x - sigma * out) / alpha
        self.last_x0 = x0
        return x0


class DpmPP2M(Multistep):
    """DPM++ 2M (DPMSolverMultistepScheduler, dpmsolver++, order 2, midpoint): first order on the first step
    and on the last."""
    sde = False

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.solver = DpmSolver2M(self.sde)

    def step(self, model, i, x):
        noise = self.noise(i, x.shape)[0] if self.sde else None
        out = self.solver.step(x, self.x0(model, x, i), self.points[i], self.points[i + 1], noise)
        return np.asarray(out, dtype=np.float32)


class DpmPP2MSDE(DpmPP2M):
    """DPM++ 2M SDE (DPMSolverMultistepScheduler, sde-dpmsolver++, order 2, midpoint)."""
    sde = True


class UniPC(Multistep):
    """UniPC (UniPCMultistepScheduler: bh2, order 2, predictor-corrector)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.solver = UniPCSolver()

    def step(self, model, i, x):
        return np.asarray(self.solver.step(x, self.x0(model, x, i), self.points, i), dtype=np.float32)


class DDIM(Multistep):
    """DDIM, eta 0 (DDIMScheduler as SD's scheduler configs set it: no clipping, set_alpha_to_one false -- the
    last step goes to alphas_cumprod[0]): defined on timesteps alone, so it runs the normal and sgm-uniform
    schedules."""
    schedules = ("normal", "sgm-uniform")

    def __init__(self, schedule: NoiseSchedule, steps: int, kind: str = "normal", seeds=(0,)):
        self.s, self.steps, self.kind, self.seeds = schedule, steps, kind, tuple(seeds)
        spacing = "trailing" if kind == "sgm-uniform" else schedule.timestep_spacing
        t = spaced(schedule, steps, spacing, steps).round().astype(np.int64)
        self._table(schedule, t, t - schedule.num_train_timesteps // steps)

    def _table(self, schedule: NoiseSchedule, t: np.ndarray, prev: np.ndarray) -> None:
        ac = schedule.alphas_cumprod()
        self.timesteps = t.astype(np.float32)
        self.alphas = np.concatenate([ac[t], [ac[prev[-1]] if prev[-1] >= 0 else ac[0]]])
        self.prev_alphas = np.where(prev >= 0, ac[np.maximum(prev, 0)], ac[0])
        self.sigmas = ((1 - self.alphas) / self.alphas) ** 0.5
        self.points = [(float(a) ** 0.5, float(1 - a) ** 0.5) for a in self.alphas]
        self.init_noise_sigma = 1.0

    def step(self, model, i, x):
        a, a_prev = float(self.alphas[i]), float(self.prev_alphas[i])
        out = model(x, self.timesteps[i])
        if self.s.prediction_type == "v_prediction":
            x0, eps = a ** 0.5 * x - (1 - a) ** 0.5 * out, a ** 0.5 * out + (1 - a) ** 0.5 * x
        else:
            x0, eps = (x - (1 - a) ** 0.5 * out) / a ** 0.5, out
        self.last_x0 = x0
        return (a_prev ** 0.5 * x0 + (1 - a_prev) ** 0.5 * eps).astype(np.float32)


class LCM(DDIM):
    """LCM (LCMScheduler: 50 original steps, timestep_scaling 10): the consistency model's x0, noised again to
    the next timestep's level. Only for LCM-distilled UNets (e.g. an LCM-LoRA merged)."""
    schedules = ("normal",)
    ORIGINAL_STEPS = 50

    def __init__(self, schedule: NoiseSchedule, steps: int, kind: str = "normal", seeds=(0,)):
        self.s, self.steps, self.kind, self.seeds = schedule, steps, kind, tuple(seeds)
        if steps > self.ORIGINAL_STEPS:
            raise UserError(f"--steps {steps}: LCM samples at most {self.ORIGINAL_STEPS} steps (its distillation "
                            f"schedule's); 4 to 8 is usual")
        k = schedule.num_train_timesteps // self.ORIGINAL_STEPS
        origin = (np.arange(1, self.ORIGINAL_STEPS + 1) * k - 1)[::-1]
        t = origin[np.floor(np.linspace(0, len(origin), steps, endpoint=False)).astype(np.int64)]
        self._table(schedule, t, np.concatenate([t[1:], t[-1:]]))

    def step(self, model, i, x):
        a, a_prev = float(self.alphas[i]), float(self.prev_alphas[i])
        out = model(x, self.timesteps[i])
        x0 = a ** 0.5 * x - (1 - a) ** 0.5 * out if self.s.prediction_type == "v_prediction" else \
            (x - (1 - a) ** 0.5 * out) / a ** 0.5
        scaled = float(self.timesteps[i]) * 10.0
        c_skip, c_out = 0.25 / (scaled ** 2 + 0.25), scaled / (scaled ** 2 + 0.25) ** 0.5
        denoised = self.last_x0 = c_out * x0 + c_skip * x
        if i == self.steps - 1:
            return denoised.astype(np.float32)
        return (a_prev ** 0.5 * denoised + (1 - a_prev) ** 0.5 * self.noise(i, x.shape)[0]).astype(np.float32)


SAMPLERS = {"euler": Euler, "euler-a": EulerAncestral, "heun": Heun, "dpm2": DPM2, "dpm2-a": DPM2Ancestral,
            "dpm++2m": DpmPP2M, "dpm++2m-sde": DpmPP2MSDE, "dpm++sde": DpmPPSDE, "ddim": DDIM, "unipc": UniPC,
            "lcm": LCM}


def make_sampler(name: str, steps: int, schedule: NoiseSchedule | None = None, kind: str | None = None,
                 seeds=(0,)):
    """The sampler `name` (any spelling runtime/sampler_names.py reads) for `steps` steps on sigma schedule
    `kind` (default: the one the name carries, else the sampler's first); `seeds`: each batch row's seed,
    for the samplers that add noise."""
    parsed = parse_sampler(name)
    if parsed is None or parsed[0] not in SAMPLERS:
        raise UserError(f"--scheduler {name!r}: choose one of {', '.join(SAMPLERS)}")
    cls = SAMPLERS[parsed[0]]
    kind = kind or parsed[1] or cls.schedules[0]
    if kind not in cls.schedules:
        raise UserError(f"--schedule {kind}: {parsed[0]} runs {' or '.join(cls.schedules)}")
    return cls(schedule or NoiseSchedule(), steps, kind, seeds)
