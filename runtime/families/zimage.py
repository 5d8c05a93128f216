"""Z-Image (Tongyi-MAI; Turbo: 8 steps, no CFG): the family facts and text-to-image over such a bundle -- a Qwen3
text encoder read at its second-to-last hidden state over a chat-templated prompt, the single-stream transformer
on the latents themselves, the FLUX.1 VAE -- on the shared flow-matching loop (flow_matching.py).

Owns: the Z-Image record (FAMILIES: components, latent scale and shift -- the FLUX.1 VAE's --, the released Turbo
schedule: static shift 3 on linspace(1, 1/steps) sigmas, 8 steps, guidance 1 = no CFG), its conditioning as
ZImagePipeline builds it -- the prompt put in Qwen3's chat template (one user turn, the assistant's turn opened,
thinking left on), tokenized (runtime/llm_tokenizer.py), cut at 512 tokens, the encoder's `hidden_states` rows of
the real tokens -- the text length run (the real tokens rounded up to 32, within the engines' profiles; the
padding is masked, so it changes nothing), the transformer's timestep (1 - sigma, as the pipeline feeds it), and
the shapes each component is called with (for selection); img2img as ZImageImg2ImgPipeline runs it
(flow_matching.py's). guidance is the usual CFG scale (1 = off);
precast's guidance is diffusers' `guidance_scale` + 1 (ZImagePipeline: pos + g (pos - neg); precast: neg + g (pos - neg)).
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..image_size import latent_factor
from ..manifest import Manifest
from .family import Family, Flow
from .flow_matching import FLOW_SAMPLERS, FlowPipeline, chat_cut_warnings, img2img_mode, t5_length
from .flux import FLUX_RGB

# Qwen3's chat template as ZImagePipeline renders it (one user message, add_generation_prompt=True,
# enable_thinking=True: no empty think block)
CHAT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 512            # ZImagePipeline's max_sequence_length
MULTIPLE = 32               # the transformer pads the text to a multiple of this
REQUIRED = {"transformer": ("hidden_states", "encoder_hidden_states", "attention_mask", "timestep"),
            "text_encoder": ("input_ids", "attention_mask")}


def check_io(manifest: Manifest) -> None:
    """The manifest's text encoder and transformer IO as Z-Image's have them, else one UserError naming the field."""
    for comp, names in REQUIRED.items():
        if comp not in manifest.components:
            continue
        inputs = {i["name"]: i.get("shape") for i in manifest.components[comp]["inputs"]}
        missing = [n for n in names if n not in inputs]
        outputs = [o["name"] for o in manifest.components[comp]["outputs"]]
        out = "out_hidden_states" if comp == "transformer" else "hidden_states"
        if missing or out not in outputs:
            raise UserError(f"{manifest.root}/manifest.json: components.{comp} has no "
                            f"{', '.join(missing) or out}: not a Z-Image {comp} (was the manifest edited?); rebuild or "
                            "re-download the bundle")
    shape = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}["hidden_states"]
    if not isinstance(shape, list) or len(shape) != 4 or type(shape[1]) is not int or shape[1] < 1:
        raise UserError(f"{manifest.root}/manifest.json: components.transformer.inputs: hidden_states has shape "
                        f"{shape!r}, not the transformer's [batch, channels, h, w]; rebuild or re-download the bundle")


def zimage_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of a Z-Image bundle is called with (the text at its default length)."""
    check_io(manifest)
    inputs = {i["name"]: i["shape"] for i in manifest.components["transformer"]["inputs"]}
    f = latent_factor(manifest)
    text = t5_length(manifest)
    latents = (batch, inputs["hidden_states"][1], height // f, width // f)
    return {"text_encoder": {"input_ids": (batch, text), "attention_mask": (batch, text)},
            "transformer": {"hidden_states": latents, "attention_mask": (batch, text), "timestep": (batch,),
                            "encoder_hidden_states": (batch, text, inputs["encoder_hidden_states"][-1])},
            "vae_decoder": {"latent_sample": latents}}


class ZImageTxt2Img(FlowPipeline):
    """Text-to-image over a Z-Image bundle."""
    refusal = "the Z-Image pipeline runs Z-Image bundles"
    size_why = "{family} reads 2x2 patches of the VAE's 1/{f} latents"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inputs = {i["name"]: i["shape"] for i in self.manifest.components["transformer"]["inputs"]}
        self.channels = int(inputs["hidden_states"][1])
        self.f = latent_factor(self.manifest)

    def check_io(self, manifest: Manifest) -> None:
        check_io(manifest)

    def text_limits(self) -> dict[str, int]:
        """Tokens of the chat-templated prompt read: ZImagePipeline's 512, or fewer where the engines take fewer."""
        return {"text_encoder": min(MAX_TOKENS, self.text_length(1 << 30)[0])}

    def prompt_warnings(self, *prompts: str | None) -> list[str]:
        """What the text encoder will cut off: one line per prompt, counted in the chat template's tokens."""
        return chat_cut_warnings(self.tokenizers["text_encoder"], CHAT, self.text_limits()["text_encoder"], prompts,
                                 "Z-Image's chat template")

    def text_length(self, tokens: int) -> tuple[int, int]:
        """(the length to run, the tokens kept): the real tokens rounded up to 32, within what the text encoder's
        and the transformer's engines take."""
        low, high = 1, 1 << 30
        for comp in ("text_encoder", "transformer"):
            span = self.input_range(comp, "attention_mask", 1)
            if span is not None:
                low, high = max(low, span[0]), min(high, span[1])
        length = min(max(-(-tokens // MULTIPLE) * MULTIPLE, low), high)
        return length, min(tokens, length)

    # ---- conditioning ---------------------------------------------------------------------------
    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The encoder's hidden states of the chat-templated prompt (its real tokens first) and their mask."""
        tok = self.tokenizers["text_encoder"]
        ids = tok.chat(prompt, CHAT, MAX_TOKENS)
        length, kept = self.text_length(len(ids))
        padded, mask = tok.padded(ids[:kept], length, left=False)
        session = self.component("text_encoder").session
        states = session.run({"input_ids": padded, "attention_mask": mask})["hidden_states"].astype(np.float32)
        return {"encoder_hidden_states": states, "attention_mask": mask}

    # ---- how the transformer is fed --------------------------------------------------------------
    def noise(self, seed: int) -> np.ndarray:
        shape = (1, self.channels, self.height // self.f, self.width // self.f)
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    def timestep(self, sampler, i: int, t) -> np.ndarray:
        """ZImagePipeline's (1000 - t) / 1000 of the scheduler's t = sigma * 1000, in float32."""
        t1000 = np.float32(sampler.sigmas[i]) * np.float32(1000)
        return np.full((1,), (np.float32(1000) - t1000) / np.float32(1000), np.float32)


FAMILIES = (
    Family("zimage", "Z-Image", ("text_encoder", "transformer", "vae_decoder"), "transformer", 0.3611, ZImageTxt2Img,
           zimage_requests, latent_shift=0.1159, patch=2, steps=8, guidance=1.0, samplers=FLOW_SAMPLERS,
           check_mode=img2img_mode, img2img=True, latent_rgb=FLUX_RGB,
           variants={"turbo": Flow({"use_dynamic_shifting": False, "shift": 3.0}, 8, 1.0, 512)}),
)
ZImageTxt2Img.families = {f.name: f for f in FAMILIES}
