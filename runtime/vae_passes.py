"""The VAE passes of a bundle opened to generate (runtime/loading.py's BundleModel takes them from `VaePasses`).

Owns: decoding latents and encoding pixels with the bundle's VAE -- in one call, in blended tiles
(runtime/vae_tiling.py plans them: forced, past the engine's profile or the memory budget), or exactly, segment by
segment, through the bundle's `vae_decoder_tiled` / `vae_encoder_tiled` when it has one and its estimate fits the
budget (runtime/vae_segments.py) --, the memory a pass may take on its device, and those components' sessions
(loaded on first use, as the preview decoder is). Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import time

import numpy as np

from .assign import module_of
from .budgets import device_budget
from .errors import UserError
from .image_size import latent_factor
from .select import component_report, load_component, select_component
from .vae_segments import TILED, WORKSPACE, held_bytes, run_program
from .vae_tiling import INPUTS as VAE_INPUTS
from .vae_tiling import plan as tiling_plan
from .vae_tiling import run_tiled


class VaePasses:
    """What BundleModel does with its VAE; reads its manifest, selections, placements, devices, loaded components,
    `vae_tiling` / `vae_tile` (asked), and writes `tiled` (what the last passes did), `exact` (the exact twins'
    sessions and reports, by component) and `run_stages`."""

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """The VAE decoder's images, [N, H, W, 3] in its own range, as many per call as its engine's profile
        takes, in tiles where `vae_run` plans them: `run_stages` gets the seconds waited for its load (if it was
        still loading) and the decodes'."""
        if self.release_after_use:     # the last call's denoising is over: its denoiser goes before the VAE runs
            self.release(("diffusion", "controlnet"))
        t0 = time.perf_counter()
        self.component("vae_decoder")
        t1 = time.perf_counter()
        per = self.batch_limit("vae_decoder", "latent_sample", len(latents))
        decoded = [self.vae_run("vae_decoder", latents[i:i + per]) for i in range(0, len(latents), per)]
        self.run_stages.update(wait_vae=round(t1 - t0, 3), decode=round(time.perf_counter() - t1, 3))
        return np.concatenate(decoded).transpose(0, 2, 3, 1)

    def vae_run(self, comp: str, x: np.ndarray) -> np.ndarray:
        """The VAE decoder's `sample` of latents x, or the VAE encoder's first output of pixels x ([N, C, H, W]),
        float32: in overlapping tiles (runtime/vae_tiling.py) when forced (`vae_tiling`) or when x is past the
        loaded engine's profile or the memory its device has for it, else in one call; `tiled` says which."""
        name, latent = VAE_INPUTS[comp]
        session, f = self.component(comp).session, latent_factor(self.manifest)
        out = "sample" if latent else None

        def run(v: np.ndarray) -> np.ndarray:
            result = session.run({name: v.astype(np.float32)})
            return (result[out] if out else next(iter(result.values()))).astype(np.float32)
        unit = 1 if latent else f
        hw = (x.shape[2] // unit, x.shape[3] // unit)
        ranges = [self.input_range(comp, name, axis) for axis in (2, 3)]
        engine = None if None in ranges else tuple((lo // unit, hi // unit) for lo, hi in ranges)
        budget = self._vae_budget(comp)
        tiling = tiling_plan(hw, engine, self.vae_tiling, self.vae_tile, f, budget,
                             f"the VAE {comp[len('vae_'):]}'s engine")
        record = tiling.record(*hw, f) if tiling else None
        twin = TILED[comp]
        if tiling and twin in self.manifest.components:    # exact: segment by segment (runtime/vae_segments.py)
            exact, why = self._exact_run(twin, x, budget, latent)
            if exact is not None:
                self.tiled[comp[len("vae_"):]] = {"exact": True, "segments": sum(
                    "segment" in s for s in self.manifest.components[twin]["config"]["segments"]), "why": tiling.why}
                return exact
            record["why"] += f"; {why}"
        self.tiled[comp[len("vae_"):]] = record
        return run_tiled(run, x, tiling, f, latent) if tiling else run(x)

    def vae_mean(self, pixels: np.ndarray) -> np.ndarray:
        """The VAE encoder's distribution's MEAN for pixels [N, 3, H, W] in [-1, 1], float32 [N, C, H/f, W/f]
        (diffusers samples the distribution by default; the mean is its mode, deterministic): the first half of
        the encoder's output channels, through `vae_run` (in tiles where planned)."""
        params = self.vae_run("vae_encoder", pixels)
        return params[:, :params.shape[1] // 2]

    def _exact_run(self, twin: str, x: np.ndarray, budget: int | None, latent: bool) -> tuple:
        """(the exact pass's output, None), or (None, why not): its feature maps (host memory) past the host's budget,
        its tile buffers past the VAE device's, or its engine failing to load."""
        spec = self.manifest.components[twin]
        held = held_bytes(spec, len(x), *x.shape[2:])
        device = self._vae_device(TILED_OF[twin])
        on_cpu = device is None or device.kind == "cpu"
        host = budget if on_cpu else self._budget_on(next((d for d in self.devices if d.kind == "cpu"), None),
                                                      TILED_OF[twin])
        what = f"an exact {'decode' if latent else 'encode'}"
        if host is not None and held + WORKSPACE * on_cpu > host:
            return None, f"{what} would hold {_size(held + WORKSPACE * on_cpu)}, past the {_size(host)} " \
                         f"{'its device has for it' if on_cpu else 'host memory has for it'}"
        if not on_cpu and budget is not None and WORKSPACE > budget:
            return None, f"{what} would take {_size(WORKSPACE)} of its device's memory, past the {_size(budget)} left"
        try:
            session = self.exact_session(twin)
        except UserError as e:
            return None, f"{twin} did not load ({str(e).splitlines()[0].rstrip(':')}; `precast doctor` says why)"
        return run_program(session.run, spec, x), None

    def _vae_device(self, comp: str):
        choice = self.selections[comp].choice if comp in self.selections else None
        return None if choice is None else choice.device

    def _vae_budget(self, comp: str) -> int | None:
        """Bytes a VAE pass may take on its device: its budget (--params-backend DEVICE:SIZE, a GPU's memory;
        the CPU's available memory when the run started, else its RAM) less the weights of the components
        selected there."""
        return self._budget_on(self._vae_device(comp), comp)

    def _budget_on(self, device, comp: str) -> int | None:
        """What `_vae_budget` says of `device` (None: not known)."""
        if device is None:
            return None
        placement = self.placements[module_of(comp)]
        budget, _ = device_budget(device, dict(placement.budgets), self.devices, automatic=True)
        budget = budget if budget is not None else (device.memory or None)
        weights = sum((s.choice.memory or {}).get("weights", 0) for s in self.selections.values()
                      if s.choice is not None and s.choice.device.id == device.id)
        return None if budget is None else budget - weights

    def exact_session(self, twin: str):
        """The session of `twin` (`vae_decoder_tiled` / `vae_encoder_tiled`, runtime/vae_segments.py), selected and
        loaded on first use on the VAE's device, as the preview decoder is: no part of `needed`; `exact` keeps it
        with its report."""
        if twin not in self.exact:
            placement = self.placements[module_of(twin)]
            sel = select_component(self.manifest, twin, placement, self.devices, {}, self.installed, self.verify_files)
            outputs = [o["name"] for o in self.manifest.components[twin]["outputs"]]
            session, cand, reasons = load_component(sel, outputs, placement.offload)
            self.exact[twin] = session, component_report(twin, cand, reasons)
        return self.exact[twin][0]


TILED_OF = {twin: comp for comp, twin in TILED.items()}


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{max(n, 0) / 2**20:.0f} MiB"
