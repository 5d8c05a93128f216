"""The per-step hooks of one generation, as the Python API's callbacks reach a family's denoising loop.

Owns: the callbacks' types (`StepCallback`, `PreviewCallback`, `CancelHook`), their checks before anything loads
(`stop_check`, `preview_method`: the preview method against the bundle, runtime/previews.py), and the hook set on
BundleModel.step_hook for one call (`step_hooks`: a cancel check raising `Cancelled` before each step and before
decoding, a progress callback after each step, then a preview of the image so far). runtime/generate.py's
`Pipeline` sets them; runtime/loading.py's denoising loop calls them.
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Union

import numpy as np

from .errors import Cancelled, UserError
from .families import family_of
from .loading import BundleModel
from .previews import check_preview

StepCallback = Callable[[int, int], None]             # (steps done, total steps)
PreviewCallback = Callable[[int, int, np.ndarray], None]   # (steps done, total steps, uint8 [H, W, 3] preview)
CancelHook = Union[Callable[[], bool], threading.Event, None]


def stop_check(cancel: CancelHook) -> Callable[[], bool] | None:
    if cancel is None:
        return None
    if isinstance(cancel, threading.Event) or hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise UserError(f"cancel={cancel!r}: expected a callable returning True to stop, or a threading.Event")


def preview_method(manifest, on_preview, preview="auto") -> str:
    """`on_preview` (a callable or None) and `preview` (runtime/previews.py METHODS) checked before anything
    loads; the method a run with previews uses, "taesd" or "latent2rgb"."""
    if on_preview is not None and not callable(on_preview):
        raise UserError(f"on_preview={on_preview!r}: expected a callable taking (steps done, total steps, uint8 "
                        "image [H, W, 3]), or None")
    if on_preview is None and preview == "auto":
        return "auto"            # no previews asked for: none to check against the bundle
    return check_preview(preview, manifest.components, family_of(manifest).latent_rgb, "preview=")


@dataclass
class _StepHook:
    """BundleModel.step_hook for one call: `stop` asked before each step and before decoding
    (Cancelled if it says stop), `on_step(done, total)` called after each step, then `on_preview(done,
    total, image)` with the step's preview (`preview`: latents -> image) where the loop gives its estimate."""
    stop: Callable[[], bool] | None
    on_step: StepCallback | None
    on_preview: PreviewCallback | None = None
    preview: Callable[[np.ndarray], np.ndarray] | None = None

    def before(self, i: int, total: int) -> None:
        if self.stop is not None and self.stop():
            raise Cancelled(i, total)

    def after(self, done: int, total: int, latents: Callable[[], np.ndarray] | None = None) -> None:
        if self.on_step is not None:
            self.on_step(done, total)
        if self.on_preview is not None and latents is not None:
            self.on_preview(done, total, self.preview(latents()))


@contextmanager
def step_hooks(pipe: BundleModel, on_step: StepCallback | None, cancel: CancelHook,
                on_preview: PreviewCallback | None = None, method: str = "latent2rgb") -> Iterator[None]:
    """The pipeline's step_hook set for one call (none when there is nothing to call)."""
    stop = stop_check(cancel)
    rgb = family_of(pipe.manifest).latent_rgb
    make = (lambda x0: pipe.preview(x0, method, rgb)) if on_preview is not None else None    # noqa: E731
    pipe.step_hook = _StepHook(stop, on_step, on_preview, make) \
        if on_step is not None or stop is not None or on_preview is not None else None
    try:
        yield
    finally:
        pipe.step_hook = None
