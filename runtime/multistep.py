"""Multistep solvers on x = alpha * x0 + sigma * noise, in numpy: DPM-Solver++ 2M (midpoint; and its SDE
variant) and UniPC (bh2, order 2: a predictor, then a corrector once the next point's model output is known),
as diffusers' DPMSolverMultistepScheduler (dpmsolver++ / sde-dpmsolver++, solver_order 2, final sigma 0) and
UniPCMultistepScheduler (predict_x0, bh2, solver_order 2, lower_order_final) compute them.

Owns the updates, written on the log-SNR lambda = log(alpha) - log(sigma) of each point, so one code serves
SD's variance-preserving latents (alpha = 1 / sqrt(1 + s^2), sigma = s * alpha) and flow matching (alpha =
1 - s, sigma = s: at s = 1 lambda is -inf and the formulas take their limit). A solver is made per run: its
first step is first order (img2img starts mid-table the same way) and a step to sigma 0 lands on the x0
estimate. Imports numpy only.
"""
from __future__ import annotations

import math

import numpy as np

Point = tuple[float, float]          # (alpha, sigma)


def lam(point: Point) -> float:
    with np.errstate(divide="ignore"):
        return float(np.log(point[0]) - np.log(point[1]))


class DpmSolver2M:
    """DPM-Solver++ (2M): second order from the previous step's x0 estimate; `sde`: the stochastic variant,
    which adds sigma_next * sqrt(1 - e^-2h) * noise."""

    def __init__(self, sde: bool = False):
        self.sde, self.prev = sde, None       # prev: (x0, lambda) of the last step

    def step(self, x: np.ndarray, x0: np.ndarray, now: Point, nxt: Point, noise: np.ndarray | None = None):
        """x at `now`, the model's x0 estimate there -> x at `nxt`."""
        (_, s_s), (a_t, s_t) = now, nxt
        l_s = lam(now)
        prev, self.prev = self.prev, (x0, l_s)
        if s_t == 0:
            return x0
        h = lam(nxt) - l_s
        d = x0 if prev is None else x0 + 0.5 * (x0 - prev[0]) / ((l_s - prev[1]) / h)
        if not self.sde:
            return (s_t / s_s) * x - (a_t * math.expm1(-h)) * d
        return (s_t / s_s * math.exp(-h)) * x - (a_t * math.expm1(-2 * h)) * d + \
            (s_t * math.sqrt(-math.expm1(-2 * h))) * noise


class UniPC:
    """UniPC, bh2, order 2 (first order on a run's first step and on the last)."""

    def __init__(self):
        self.ms: list[np.ndarray] = []      # x0 estimates of this run's points, in order
        self.last, self.order = None, 0     # the sample the last predictor started from, and its order

    def step(self, x: np.ndarray, x0: np.ndarray, points: list[Point], i: int) -> np.ndarray:
        """x at points[i] (the predictor's result, corrected here once x0 there is known) -> x at points[i + 1]."""
        if self.last is not None:
            x = self._update(self.last, points, i - 1, self.order, x0)
        self.ms.append(x0)
        self.order = min(2, len(points) - 1 - i, len(self.ms))
        self.last = x
        return self._update(x, points, i, self.order)

    def _update(self, x, points: list[Point], s: int, order: int, m_t: np.ndarray | None = None) -> np.ndarray:
        """From x at points[s] to points[s + 1]: the predictor, or with `m_t` (x0 at s + 1) the corrector."""
        (_, s_s), (a_t, s_t) = points[s], points[s + 1]
        m0 = self.ms[-1]
        if s_t == 0:
            return m0
        hh = -(lam(points[s + 1]) - lam(points[s]))
        phi = math.expm1(hh)                           # bh2: B(h) = e^hh - 1, as h * phi_1
        base = (s_t / s_s) * x - (a_t * phi) * m0
        if order == 1:
            return base if m_t is None else base - (a_t * phi * 0.5) * (m_t - m0)
        r = (lam(points[s - 1]) - lam(points[s])) / -hh
        d1 = (self.ms[-2] - m0) / r
        if m_t is None:
            return base - (a_t * phi * 0.5) * d1
        k1 = phi / hh - 1
        rho = np.linalg.solve([[1.0, 1.0], [r, 1.0]], [k1 / phi, (k1 / hh - 0.5) * 2 / phi])
        return base - (a_t * phi) * (float(rho[0]) * d1 + float(rho[1]) * (m_t - m0))
