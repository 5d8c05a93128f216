"""One component of a bundle, loaded (runtime/api.py's `Bundle.load`): `Component.run` with numpy feeds.

Owns: `Component` -- the feeds checked against the manifest's IO and the loaded artifact's fixed dimensions
(rank, dims, a numeric dtype) before they run, each one line naming the input; a text encoder's
textual-inversion input filled in when only `input_ids` is fed. Imports numpy and the runtime's own modules.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .embeddings import EXTRA_TOKENS_INPUT, encoder_feeds
from .errors import UserError
from .report import ComponentPlan


class Component:
    """One loaded component: `run({input: array}) -> {output: array}` on its backend and device."""

    def __init__(self, bundle, name: str, session, plan: ComponentPlan):
        self.bundle, self.name, self.session, self.plan = bundle, name, session, plan
        spec = bundle.manifest.components[name]
        self.inputs: dict[str, list] = {i["name"]: i.get("shape") for i in spec["inputs"]}     # manifest IO
        self.outputs: dict[str, list] = {o["name"]: o.get("shape") for o in spec["outputs"]}

    @property
    def input_names(self) -> list[str]:
        return list(self.session.input_names)

    @property
    def output_names(self) -> list[str]:
        return list(self.session.output_names)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs the component; each feed is cast to the dtype the artifact declares. A text encoder's
        textual-inversion input (`token_embeddings_extra`) is filled in when only `input_ids` is fed. Each
        feed is checked against the manifest's IO first (rank, fixed dimensions, a numeric dtype)."""
        if not isinstance(feeds, Mapping):
            raise UserError(f"{self.name}: feeds={type(feeds).__name__}: expected a dict of input name -> numpy "
                            f"array (it takes {', '.join(self.input_names)})")
        feeds = self._with_defaults({k: self._feed(k, v) for k, v in feeds.items()})
        names = self.input_names
        missing = [n for n in names if n not in feeds]
        unknown = sorted(set(feeds) - set(names))
        if missing or unknown:
            what = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                           unknown and f"no input named {', '.join(unknown)}"]))
            raise UserError(f"{self.name}: {what} (it takes {', '.join(names)})")
        return dict(self.session.run(feeds))

    __call__ = run

    def _feed(self, name: str, value) -> np.ndarray:
        label = f"{self.name}: feeds[{name!r}]"
        try:
            arr = np.asarray(value)
        except ValueError as e:       # ragged nested lists
            raise UserError(f"{label}: not an array ({e})") from None
        if arr.dtype.kind not in "biuf":
            raise UserError(f"{label}: expected a numeric numpy array, got {type(value).__name__} of {arr.dtype}")
        fixed = (getattr(self.session, "input_shapes", None) or {}).get(name)   # the loaded artifact's dims
        named = self.inputs.get(name) or []                                     # the manifest's, by name
        want = fixed or named
        if want and (arr.ndim != len(want) or any(isinstance(d, int) and d != n for d, n in zip(want, arr.shape))):
            dims = [d if isinstance(d, int) else (named[i] if i < len(named) else "?") for i, d in enumerate(want)]
            raise UserError(f"{label} has shape {list(arr.shape)}; the loaded {self.name} takes "
                            f"[{', '.join(map(str, dims))}] (named dimensions vary; the image size is set when it loads: "
                            f"bundle.load({self.name!r}, size=...))")
        return arr

    def _with_defaults(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if EXTRA_TOKENS_INPUT in self.input_names and EXTRA_TOKENS_INPUT not in feeds and "input_ids" in feeds:
            hidden = int(self.bundle.manifest.components[self.name].get("config", {}).get("hidden", 768))
            feeds = {**encoder_feeds(self.session, self.name, feeds["input_ids"], None, hidden), **feeds}
        return feeds

    def __repr__(self) -> str:
        return f"<Component {self.name}: {self.plan.artifact} via {self.plan.backend} on {self.plan.device}>"
