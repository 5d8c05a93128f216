"""SD3 and SD3.5: the family facts and text-to-image over such a bundle -- CLIP-L | CLIP-G | T5 conditioning
on the shared flow-matching loop (flow_matching.py: Euler with shift 3.0, classifier-free guidance).

Owns: the SD3 record (FAMILIES: components, latent scale and shift, each released variant's schedule,
steps, guidance and T5 length), SD3's conditioning as StableDiffusion3Pipeline builds it -- each CLIP's penultimate hidden
states side by side (768 + 1280), zero-padded to the T5 width and followed along the sequence by
T5's `last_hidden_state` (zeros when the bundle has no T5, as diffusers runs without one); the
pooled vector is the two CLIPs' projected `text_embeds` side by side; A1111 weights on the CLIP and T5
states (runtime/prompts.py; one 77-token CLIP chunk, the transformer's sequence being fixed) -- the
timestep the MMDiT is fed (sigma x 1000, float32), and the shapes each component is called with.
Skip-layer guidance (SD3.5-medium's optional extra pass) is not run. Imports numpy and the
runtime's own modules; never the compiler.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..image_size import latent_factor
from ..manifest import Manifest
from ..text_encoders import text_state_name
from .family import Family, Flow, LatentRGB
from .flow_matching import FLOW_SAMPLERS, FlowPipeline, img2img_mode, t5_length
from ..embeddings import encoder_feeds
from ..prompts import clip_truncated, emphasize, t5_input

CLIPS = ("text_encoder", "text_encoder_2")
T5 = "text_encoder_3"
NEEDED = CLIPS + ("transformer", "vae_decoder")
CLIP_TOKENS = 77
REQUIRED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")


def transformer_inputs(manifest: Manifest) -> dict[str, list]:
    """The transformer's input shapes by name, checked: an SD3 MMDiT's IO, else one UserError."""
    inputs = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}
    where = f"{manifest.root}/manifest.json: components.transformer.inputs"
    missing = [n for n in REQUIRED if n not in inputs]
    if missing:
        raise UserError(f"{where} has no {', '.join(missing)}: not an SD3 transformer (was the manifest edited?); "
                        "rebuild or re-download the bundle")
    for name, rank in (("hidden_states", 4), ("encoder_hidden_states", 3), ("pooled_projections", 2)):
        shape = inputs[name]
        if not isinstance(shape, list) or len(shape) != rank or type(shape[-1 if rank < 4 else 1]) is not int:
            raise UserError(f"{where}: {name} has shape {shape!r}, not the SD3 transformer's; rebuild or re-download "
                            "the bundle")
    if "out_hidden_states" not in [o["name"] for o in manifest.components["transformer"]["outputs"]]:
        raise UserError(f"{manifest.root}/manifest.json: components.transformer.outputs has no out_hidden_states; "
                        "rebuild or re-download the bundle")
    return inputs


def sd3_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of an SD3 bundle is called with."""
    inputs = transformer_inputs(manifest)
    f, t5 = latent_factor(manifest), t5_length(manifest)
    latents = (batch, inputs["hidden_states"][1], height // f, width // f)
    out = {"transformer": {"hidden_states": latents, "timestep": (batch,),
                           "encoder_hidden_states": (batch, CLIP_TOKENS + t5, inputs["encoder_hidden_states"][-1]),
                           "pooled_projections": (batch, inputs["pooled_projections"][-1])},
           "vae_decoder": {"latent_sample": latents}}
    for comp in CLIPS:
        out[comp] = {"input_ids": (batch, CLIP_TOKENS)}
    if T5 in manifest.components:
        out[T5] = {"input_ids": (batch, t5)}
    return out


class SD3Txt2Img(FlowPipeline):
    """Text-to-image over an SD3 / SD3.5 bundle (with or without its T5)."""
    refusal = "the SD3 pipeline runs SD3 / SD3.5 bundles"
    size_why = "SD3 reads 2x2 patches of the VAE's 1/{f} scale latents"
    default_schedule = {"shift": 3.0, "spacing": "training"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inputs = transformer_inputs(self.manifest)
        self.channels = int(inputs["hidden_states"][1])
        self.context_width = int(inputs["encoder_hidden_states"][-1])

    def check_io(self, manifest: Manifest) -> None:
        transformer_inputs(manifest)

    def text_limits(self) -> dict[str, int]:
        limits = super().text_limits()
        if T5 in limits:
            limits[T5] = self.t5_tokens - 1      # T5: less `</s>`
        return limits

    # ---- conditioning ---------------------------------------------------------------------------
    def _clip(self, comp: str, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """(penultimate hidden states [1, 77, width] of the prompt's first 75 tokens, weighted as A1111 weights
        them, projected pooled [1, projection], unweighted)."""
        chunk = clip_truncated(self.tokenizers[comp], prompt)
        session = self.component(comp).session
        config = self.manifest.components[comp].get("config", {})
        out = session.run(encoder_feeds(session, comp, chunk.ids[None, :], self.embeddings[comp],
                                        int(config.get("hidden", 768))))
        states = out[text_state_name(out, config, penultimate=True)]    # by name: every layer is an output
        return emphasize(states.astype(np.float32), chunk.weights), out["text_embeds"].astype(np.float32)

    def _t5(self, prompt: str) -> np.ndarray:
        if T5 not in self.needed:
            return np.zeros((1, self.t5_tokens, self.context_width), np.float32)
        ids, _, weights = t5_input(self.tokenizers[T5], prompt, self.t5_tokens)
        out = self.component(T5).session.run({"input_ids": ids[None, :].astype(np.int32)})
        return emphasize(out["last_hidden_state"].astype(np.float32), weights)

    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The transformer's text inputs for one prompt: encoder_hidden_states and pooled_projections."""
        (l_states, l_pooled), (g_states, g_pooled) = (self._clip(c, prompt) for c in CLIPS)
        clip = np.concatenate([l_states, g_states], axis=-1)
        if clip.shape[-1] > self.context_width:
            raise UserError(f"{self.manifest.root}: the CLIP encoders give {clip.shape[-1]} values per token, more than "
                            f"the transformer's context width {self.context_width}; rebuild the bundle")
        clip = np.pad(clip, ((0, 0), (0, 0), (0, self.context_width - clip.shape[-1])))
        return {"encoder_hidden_states": np.concatenate([clip, self._t5(prompt)], axis=1),
                "pooled_projections": np.concatenate([l_pooled, g_pooled], axis=-1)}

    # ---- how the transformer is fed --------------------------------------------------------------
    def noise(self, seed: int) -> np.ndarray:
        f = latent_factor(self.manifest)
        shape = (1, self.channels, self.height // f, self.width // f)
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    def timestep(self, sampler, i: int, t) -> np.ndarray:
        return np.full((1,), np.float32(sampler.sigmas[i]) * np.float32(1000), np.float32)


# SAI SD3LatentFormat: latent = 1.5305 * (z - 0.0609). StableDiffusion3Pipeline / SAI sd3_infer.py: static shift
# 3.0 over the scheduler's own spacing (down to the training schedule's last sigma); 3-medium 28 steps / CFG
# 7.0, 3.5-large and 3.5-medium 40 / 4.5 (3.5-medium's skip-layer guidance is not run), large-turbo 4 steps
# without CFG; T5 run for 256 tokens.
SD3_FLOW = {"use_dynamic_shifting": False, "shift": 3.0, "spacing": "training"}
# previews' latent -> RGB projection of SD3's 16-channel latents (ComfyUI latent_formats.py SD3)
SD3_RGB = LatentRGB(((-0.0922, -0.0175, 0.0749), (0.0311, 0.0633, 0.0954), (0.1994, 0.0927, 0.0458),
                     (0.0856, 0.0339, 0.0902), (0.0587, 0.0272, -0.0496), (-0.0006, 0.1104, 0.0309),
                     (0.0978, 0.0306, 0.0427), (-0.0042, 0.1038, 0.1358), (-0.0194, 0.0020, 0.0669),
                     (-0.0488, 0.0130, -0.0268), (0.0922, 0.0988, 0.0951), (-0.0278, 0.0524, -0.0542),
                     (0.0332, 0.0456, 0.0895), (-0.0069, -0.0030, -0.0810), (-0.0596, -0.0465, -0.0293),
                     (-0.1448, -0.1463, -0.1189)), (0.2394, 0.2135, 0.1925))
FAMILIES = (
    Family("sd3", "SD3", NEEDED, "transformer", 1.5305, SD3Txt2Img, sd3_requests, latent_shift=0.0609, patch=2,
           optional=(T5,), steps=28, guidance=7.0, samplers=FLOW_SAMPLERS, check_mode=img2img_mode, img2img=True,
           variants={"3-medium": Flow(SD3_FLOW, 28, 7.0, 256), "3.5-medium": Flow(SD3_FLOW, 40, 4.5, 256),
                     "3.5-large": Flow(SD3_FLOW, 40, 4.5, 256), "3.5-large-turbo": Flow(SD3_FLOW, 4, 1.0, 256)},
           latent_rgb=SD3_RGB),
)
SD3Txt2Img.families = {f.name: f for f in FAMILIES}
