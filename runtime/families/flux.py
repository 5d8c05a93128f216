"""Flux.1 (dev, schnell) and Chroma: the family facts and text-to-image over such a bundle -- T5 (+ CLIP-L)
conditioning, 2x2 latent packing with position ids, on the shared flow-matching loop (flow_matching.py).

Owns: the Flux and Chroma records (FAMILIES: components, latent scale and shift, the released models'
schedules, steps, guidance and T5 lengths), each one's conditioning -- Flux: T5 `last_hidden_state` (run without a mask, padding
to the bundle's T5 length) + CLIP-L `pooler_output`, dev's distilled guidance fed as its raw scale;
Chroma: T5 run with its mask, the transformer attending to the real tokens plus one padding token,
real classifier-free guidance with a negative prompt; A1111 weights on the T5 states as Forge applies them
(runtime/prompts.py) -- the packing (b c (h 2) (w 2) -> b (h w) (c 2 2)) and ids ((0, row, col) per packed
latent, zeros for text), and the shapes each component is called with (for selection). Imports numpy and the
runtime's own modules; never the compiler.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..image_size import latent_factor
from ..manifest import Manifest
from .family import Family, Flow, LatentRGB
from .flow_matching import FLOW_SAMPLERS, FlowPipeline, img2img_mode, t5_length
from ..embeddings import encoder_feeds
from ..prompts import clip_truncated, emphasize, t5_input

T5_OF = {"flux": "text_encoder_2", "chroma": "text_encoder"}


def packed_grid(manifest: Manifest, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of packed tokens: one per 2x2 latents."""
    f = latent_factor(manifest)
    return height // (2 * f), width // (2 * f)


REQUIRED = {"flux": ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "pooled_projections"),
            "chroma": ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "attention_mask")}


def check_transformer_io(manifest: Manifest, family: str) -> None:
    """The manifest's transformer IO as a `family` transformer has it (names, and the widths the
    runtime reads from it), else one UserError naming the field."""
    inputs = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}
    where = f"{manifest.root}/manifest.json: components.transformer.inputs"
    missing = [n for n in REQUIRED[family] if n not in inputs]
    if missing:
        raise UserError(f"{where} has no {', '.join(missing)}: not a {family} transformer (was the manifest edited?); "
                        "rebuild or re-download the bundle")
    for name in ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids") + \
            (("pooled_projections",) if family == "flux" else ()):
        shape = inputs[name]
        if not isinstance(shape, list) or not shape or type(shape[-1]) is not int or shape[-1] < 1 or \
                (name == "hidden_states" and (len(shape) != 3 or shape[-1] % 4)):
            raise UserError(f"{where}: {name} has shape {shape!r}, not the transformer's; rebuild or re-download "
                            "the bundle")
    outputs = [o["name"] for o in manifest.components["transformer"]["outputs"]]
    if "out_hidden_states" not in outputs:
        raise UserError(f"{manifest.root}/manifest.json: components.transformer.outputs has no out_hidden_states; "
                        "rebuild or re-download the bundle")


def dit_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of a Flux/Chroma bundle is called with."""
    family = manifest.info.family
    check_transformer_io(manifest, family if family in REQUIRED else "flux")
    rows, cols = packed_grid(manifest, height, width)
    tokens, t5 = rows * cols, t5_length(manifest)
    inputs = {i["name"]: i["shape"] for i in manifest.components["transformer"]["inputs"]}
    width_of = lambda name: inputs[name][-1]  # noqa: E731
    f = latent_factor(manifest)
    out = {"transformer": {"hidden_states": (batch, tokens, width_of("hidden_states")),
                           "encoder_hidden_states": (batch, t5, width_of("encoder_hidden_states")),
                           "timestep": (batch,), "img_ids": (tokens, width_of("img_ids")),
                           "txt_ids": (t5, width_of("txt_ids"))},
           "vae_decoder": {"latent_sample": (batch, width_of("hidden_states") // 4, height // f, width // f)}}
    for name in ("pooled_projections", "guidance", "attention_mask"):
        if name in inputs:
            out["transformer"][name] = (batch, width_of(name)) if name == "pooled_projections" else \
                (batch,) if name == "guidance" else (batch, t5)
    for comp in ("text_encoder", "text_encoder_2"):
        if comp in manifest.components:
            is_t5 = any("t5_sequence" in (i.get("shape") or []) for i in manifest.components[comp]["inputs"])
            out[comp] = {"input_ids": (batch, t5 if is_t5 else 77)}
            if is_t5 and any(i["name"] == "attention_mask" for i in manifest.components[comp]["inputs"]):
                out[comp]["attention_mask"] = (batch, t5)
    return out


def pack(latents: np.ndarray) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2x2 patch flattened channel-major."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: np.ndarray, rows: int, cols: int) -> np.ndarray:
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.reshape(b, rows, cols, c, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, rows * 2, cols * 2)


def image_ids(rows: int, cols: int) -> np.ndarray:
    ids = np.zeros((rows, cols, 3), np.float32)
    ids[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
    return ids.reshape(rows * cols, 3)


class PackedFlowPipeline(FlowPipeline):
    """A flow-matching pipeline whose transformer reads 2x2 patches of latents as tokens (Flux, Chroma, FLUX.2,
    Qwen-Image): `channels` (the latents', a quarter of the transformer's hidden_states width) and the packed
    grid `rows` x `cols` of the pipeline's size (at_size's copy has its own); noise drawn at the latents' shape,
    packed on the way in and unpacked on the way out."""
    size_why = "{family} packs 2x2 latents of the VAE's 1/{f} scale"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inputs = {i["name"]: i["shape"] for i in self.manifest.components["transformer"]["inputs"]}
        self.channels = int(inputs["hidden_states"][-1]) // 4

    @property
    def rows(self) -> int:
        return packed_grid(self.manifest, self.height, self.width)[0]

    @property
    def cols(self) -> int:
        return packed_grid(self.manifest, self.height, self.width)[1]

    def noise(self, seed: int) -> np.ndarray:
        shape = (1, self.channels, 2 * self.rows, 2 * self.cols)
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    def to_transformer(self, latents: np.ndarray) -> np.ndarray:
        return pack(latents)

    def from_transformer(self, x: np.ndarray) -> np.ndarray:
        return unpack(x, self.rows, self.cols)

    def image_tokens(self, x: np.ndarray) -> int:
        return x.shape[1]


class FluxTxt2Img(PackedFlowPipeline):
    """Text-to-image over a Flux or Chroma bundle."""
    refusal = "the DiT pipeline runs Flux and Chroma bundles"

    def check_io(self, manifest: Manifest) -> None:
        check_transformer_io(manifest, self.family)

    def text_limits(self) -> dict[str, int]:
        return {**super().text_limits(), T5_OF[self.family]: self.t5_tokens - 1}   # T5: less `</s>`

    # ---- conditioning ---------------------------------------------------------------------------
    def _t5(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """T5's states, weighted as Forge weights them (runtime/prompts.py emphasize), and its mask."""
        comp = T5_OF[self.family]
        ids, mask, weights = t5_input(self.tokenizers[comp], prompt, self.t5_tokens)
        feeds = {"input_ids": ids[None, :].astype(np.int32)}
        session = self.component(comp).session
        if "attention_mask" in session.input_names:
            feeds["attention_mask"] = mask[None, :].astype(np.int32)
        states = session.run(feeds)["last_hidden_state"].astype(np.float32)
        return emphasize(states, weights), mask.astype(np.int32)

    def _clip_pooled(self, prompt: str) -> np.ndarray:
        """CLIP-L's pooled vector of the prompt's first 75 tokens (weights read nothing from it)."""
        ids = clip_truncated(self.tokenizers["text_encoder"], prompt).ids[None, :]
        session = self.component("text_encoder").session
        hidden = int(self.manifest.components["text_encoder"].get("config", {}).get("hidden", 768))
        out = session.run(encoder_feeds(session, "text_encoder", ids, self.embeddings["text_encoder"], hidden))
        return out["pooler_output"].astype(np.float32)

    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The transformer's text inputs for one prompt."""
        states, mask = self._t5(prompt)
        feeds = {"encoder_hidden_states": states, "txt_ids": np.zeros((self.t5_tokens, 3), np.float32)}
        if self.family == "chroma":
            # Chroma attends to the real tokens and the first padding token (lodestones' masking)
            keep = np.arange(self.t5_tokens) <= int(mask.sum())
            feeds["attention_mask"] = keep[None, :].astype(np.int32)
        else:
            feeds["pooled_projections"] = self._clip_pooled(prompt)
        return feeds

    # ---- how the transformer is fed --------------------------------------------------------------
    def fixed_feeds(self, transformer, guidance: float) -> dict[str, np.ndarray]:
        fixed = {"img_ids": image_ids(self.rows, self.cols)}
        if "guidance" in transformer.input_names:     # dev's distilled guidance, fed as its raw scale
            fixed["guidance"] = np.full((1,), guidance, np.float32)
        return fixed


DYNAMIC = {"use_dynamic_shifting": True, "shift": 3.0, "base_shift": 0.5, "max_shift": 1.15,
           "base_image_seq_len": 256, "max_image_seq_len": 4096}
# BFL AutoEncoderParams: latent = 0.3611 * (z - 0.1159); dev 28 steps / 3.5 (distilled guidance), schnell 4 /
# none, Chroma 35 / 5.0 (real classifier-free guidance with a negative prompt)
# previews' latent -> RGB projection of Flux's 16-channel latents (ComfyUI latent_formats.py Flux)
FLUX_RGB = LatentRGB(((-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433),
                      (-0.0174, 0.0160, 0.0617), (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115),
                      (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259), (-0.0245, 0.0250, 0.1180),
                      (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
                      (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499),
                      (-0.1262, -0.0982, -0.0778)), (-0.0329, -0.0718, -0.0851))
FAMILIES = (
    Family("flux", "Flux", ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"), "transformer", 0.3611,
           FluxTxt2Img, dit_requests, latent_shift=0.1159, patch=2, steps=28, guidance=3.5, samplers=FLOW_SAMPLERS,
           negative=False, check_mode=img2img_mode, img2img=True,
           variants={"dev": Flow(DYNAMIC, 28, 3.5, 512),
                     "schnell": Flow({"use_dynamic_shifting": False, "shift": 1.0}, 4, 0.0, 256)}, latent_rgb=FLUX_RGB),
    Family("chroma", "Chroma", ("text_encoder", "transformer", "vae_decoder"), "transformer", 0.3611, FluxTxt2Img,
           dit_requests, latent_shift=0.1159, patch=2, steps=28, guidance=3.5, samplers=FLOW_SAMPLERS,
           check_mode=img2img_mode, img2img=True, variants={"": Flow(DYNAMIC, 35, 5.0, 512)}, latent_rgb=FLUX_RGB),
)
FluxTxt2Img.families = {f.name: f for f in FAMILIES}
