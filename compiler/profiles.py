"""Shape profiles: the batch, image size and token lengths an engine must accept.

Owns: `ShapeProfile` (min/opt/max per dimension, in pixels and tokens as a user thinks of
them) and its translation into each component's input shapes (latents are 1/8 of the image,
the UNet batch doubles for classifier-free guidance; the UNet and ControlNets read `tokens` -- several
77-token prompt chunks past 77 -- where a CLIP text encoder runs at most 77, one chunk at a time; a
Flux/Chroma transformer sees one token per 16x16 pixels -- 2x2 patches of latents -- and the T5 length,
`t5_tokens`; an SD3 transformer takes the latents and CLIP's 77 tokens followed by the T5 length,
`text_sequence`; Z-Image's LLM text encoder and transformer read `t5_tokens` as their text length,
`llm_sequence`). A text encoder's
textual-inversion rows (`extra_tokens`) take 1..EXTRA_TOKENS rows, except where the profile fixes
every other dimension the component reads: then they are fixed at the maximum, so the engine is
fully static (OpenVINO compiles it with static shapes, ONNX Runtime pins the dims, MIGraphX can build
it) and the runtime pads the rows it feeds with zeros up to that size (runtime/embeddings.py).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ..runtime.manifest import MAX_PROFILE_SIDE
from ..runtime.prompts import CLIP_TOKENS
from ..runtime.vae_segments import SEGMENT_TILE
from .errors import BadInput

Range = tuple[int, int, int]  # min, opt, max
# Rows of the text encoder's `token_embeddings_extra` input: textual-inversion vectors plus the
# one zero row the runtime always appends (so the minimum is 1, never an empty tensor). A static
# build fixes the rows at the maximum (STATIC_EXTRA_TOKENS): zero rows past the vectors are never
# read, and no embedding a dynamic build takes is refused by a static one.
EXTRA_TOKENS: Range = (1, 1, 256)
STATIC_EXTRA_TOKENS: Range = (EXTRA_TOKENS[2],) * 3
MAX_SIDE = MAX_PROFILE_SIDE   # px per side; the runtime's manifest check refuses larger profiles too
MAX_BATCH = 64
MAX_T5_TOKENS = 4096
MAX_TOKENS = 16 * CLIP_TOKENS    # the UNet's text length: up to 16 prompt chunks of 75 tokens (runtime/prompts.py)


def parse_range(text: str | int, what: str) -> Range:
    """'512' -> (512, 512, 512); '256:512:768' -> (256, 512, 768)."""
    parts = [p for p in str(text).split(":")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise BadInput(f"{what} {text!r}: expected N or MIN:OPT:MAX (integers)") from None
    if len(vals) == 1:
        vals = vals * 3
    if len(vals) != 3 or not 0 < vals[0] <= vals[1] <= vals[2]:
        raise BadInput(f"{what} {text!r}: expected N or MIN:OPT:MAX with 0 < MIN <= OPT <= MAX")
    return tuple(vals)  # type: ignore[return-value]


@dataclass(frozen=True)
class ShapeProfile:
    batch: Range = (1, 1, 1)
    height: Range = (512, 512, 512)
    width: Range = (512, 512, 512)
    tokens: Range = (77, 77, 77)
    t5_tokens: Range | None = None     # T5 text length (Flux, Chroma); None: the model's default
    cfg_doubling: bool = True          # the UNet sees 2x batch (unconditional + conditional)
    latent_factor: int = 8

    @property
    def static(self) -> bool:
        return all(r[0] == r[2] for r in (self.batch, self.height, self.width, self.tokens, self.t5_tokens or (0, 0, 0)))

    def describe(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        for name, r, limit in (("batch", self.batch, MAX_BATCH), ("height", self.height, MAX_SIDE),
                               ("width", self.width, MAX_SIDE)):
            if r[2] > limit:
                raise BadInput(f"profile {name} {r}: at most {limit}")
        for name, r in (("height", self.height), ("width", self.width)):
            if any(v % self.latent_factor for v in r):
                raise BadInput(f"profile {name} {r}: must be multiples of {self.latent_factor}")
        if self.t5_tokens is not None and not 1 <= self.t5_tokens[0] <= self.t5_tokens[2] <= MAX_T5_TOKENS:
            raise BadInput(f"profile t5_tokens {self.t5_tokens}: 1 to {MAX_T5_TOKENS}")
        if self.tokens[2] > MAX_TOKENS:
            raise BadInput(f"profile tokens {self.tokens}: at most {MAX_TOKENS} ({MAX_TOKENS // CLIP_TOKENS} prompt chunks "
                           f"of {CLIP_TOKENS})")

    @property
    def text_tokens(self) -> Range:
        """The tokens a CLIP text encoder reads in one run: `tokens` up to CLIP's 77 positions. A longer prompt
        is encoded in 77-token chunks, one run each; only the denoiser reads their concatenation (`tokens`)."""
        return tuple(min(v, CLIP_TOKENS) for v in self.tokens)  # type: ignore[return-value]

    def image_tokens(self) -> Range:
        """Packed latent tokens (one per 2x2 latents = 16x16 px at the usual factor 8) at min/opt/max."""
        px = 2 * self.latent_factor
        for name, r in (("height", self.height), ("width", self.width)):
            if any(v % px for v in r):
                raise BadInput(f"profile {name} {r}: a DiT transformer (Flux, Chroma, SD3) reads 2x2 latent patches: "
                               f"sides must be multiples of {px}")
        return tuple((h // px) * (w // px) for h, w in zip(self.height, self.width))  # type: ignore[return-value]

    def input_shapes(self, component: str, inputs: list[dict]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """{input name: (min, opt, max) shapes} for the component's declared inputs."""
        self.check()
        denoiser = component == "unet" or component.startswith("controlnet_")   # both read the latents
        b = tuple(2 * v for v in self.batch) if denoiser and self.cfg_doubling else self.batch
        lh = tuple(v // self.latent_factor for v in self.height)
        lw = tuple(v // self.latent_factor for v in self.width)
        symbolic = {"batch": b, "steps": b, "sequence": self.tokens if denoiser else self.text_tokens,
                    "height": self.height, "width": self.width, "latent_height": lh, "latent_width": lw,
                    "extra_tokens": EXTRA_TOKENS}
        dims = {d for inp in inputs for d in inp["shape"]}
        if "t5_sequence" in dims:
            if self.t5_tokens is None:
                raise BadInput(f"{component}: the profile gives no T5 length (t5_tokens)")
            symbolic["t5_sequence"] = self.t5_tokens
        if "llm_sequence" in dims:      # an LLM text encoder's tokens (Z-Image), the transformer's text length too
            if self.t5_tokens is None:
                raise BadInput(f"{component}: the profile gives no text length (t5_tokens)")
            symbolic["llm_sequence"] = self.t5_tokens
        if "text_sequence" in dims:     # SD3: CLIP tokens then T5 tokens, one sequence
            if self.t5_tokens is None:
                raise BadInput(f"{component}: the profile gives no T5 length (t5_tokens)")
            symbolic["text_sequence"] = tuple(a + b for a, b in zip(self.text_tokens, self.t5_tokens))
        if "image_tokens" in dims:
            symbolic["image_tokens"] = self.image_tokens()
        if denoiser:
            symbolic.update(height=lh, width=lw, image_height=self.height, image_width=self.width)
        for d in dims:        # ControlNet residuals at level l: the latents' sides after l stride-2 convs
            base, _, k = d.partition("_div") if isinstance(d, str) else ("", "", "")
            if base in ("height", "width") and k.isdigit() and int(k) > 0:
                symbolic[d] = tuple(-(-v // int(k)) for v in symbolic[base])
        for d in dims:        # the tiled VAE decoder's segments (compiler/graphs/vae_segments.py): any tile they are fed
            if isinstance(d, str) and re.fullmatch(r"tile\d+_(height|width)", d):
                symbolic[d] = SEGMENT_TILE
        if "extra_tokens" in dims and all(symbolic[d][0] == symbolic[d][2] for d in dims
                                          if d in symbolic and d != "extra_tokens"):
            symbolic["extra_tokens"] = STATIC_EXTRA_TOKENS     # every other dimension fixed: a static engine
        out = {}
        for inp in inputs:
            dims = []
            for d in inp["shape"]:
                if isinstance(d, int) and d > 0:
                    dims.append((d, d, d))
                elif d in symbolic:
                    dims.append(symbolic[d])
                else:
                    raise BadInput(f"{component} input {inp['name']}: no profile value for dimension {d!r}")
            out[inp["name"]] = tuple(tuple(dim[i] for dim in dims) for i in range(3))
        return out
