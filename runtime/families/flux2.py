"""FLUX.2 (klein 4B / 9B -- distilled: 4 steps, no CFG; base: 50 steps, CFG 4 -- and dev: 50 steps, distilled
guidance 4): the family facts and text-to-image over such a bundle -- an LLM text encoder read at three hidden
states stacked (klein: Qwen3's 9, 18 and 27; dev: Mistral-Small-3.2's 10, 20 and 30), over a chat-templated prompt
padded to a fixed length; the transformer on packed 2x2 latent patches with 4-D position ids; the FLUX.2 VAE with
its latents' batch-norm statistics -- on the shared flow-matching loop (flow_matching.py).

Owns: the FLUX.2 record (FAMILIES: components, the released schedules: linspace(1, 1/steps) sigmas shifted by
exp(mu) with FLUX.2's empirical mu of the image tokens and the steps, steps and guidance per variant, the 512-token
text), its conditioning as Flux2KleinPipeline / Flux2Pipeline build it -- the prompt put in the variant's chat
template (klein: Qwen3's, one user turn, the assistant's turn opened with thinking off: an empty think block; dev:
Mistral's, BFL's system message then the user turn, `[IMG]` taken out of the prompt as the pipeline does),
tokenized (runtime/llm_tokenizer.py), cut at 512 and padded to the text length the bundle runs (512 where its
engines take it; on the tokenizer's side: Qwen2's right, Mistral's left; the transformer reads the padding too,
unmasked, so the length is part of the result), the encoder's `hidden_states` -- the text ids (0, 0, 0, i), the
image ids (0, row, col, 0), the packing (2x2 patches, channel-major: Flux's), and the latents' denormalisation
before the VAE decoder (x * sqrt(var + eps) + mean per patchified channel, the statistics the manifest's
vae_decoder config carries; done here, not in the VAE graph, so VAE tiles need not start on the patch grid).
klein's guidance is the usual CFG scale (1 = off) against the negative prompt ('' in diffusers); a distilled model's
defaults run without CFG (diffusers ignores guidance for them; precast runs what it is asked). dev's is distilled:
fed to its transformer's guidance embedder, no negative prompt.
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..image_size import latent_factor
from ..manifest import Manifest
from .family import Family, Flow, LatentRGB
from .flow_matching import FLOW_SAMPLERS, chat_cut_warnings, check_latent_stats, t5_length, txt2img_only
from .flux import PackedFlowPipeline, pack, packed_grid, unpack

# Qwen3's chat template as Flux2KleinPipeline renders it (one user message, add_generation_prompt=True,
# enable_thinking=False: an empty think block)
CHAT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# Mistral-Small's chat template as Flux2Pipeline renders it (BFL's system message, one user turn, no generation
# prompt); the BOS is the template's own
SYSTEM = ("You are an AI that reasons about image descriptions. You give structured responses focusing on object "
          "relationships, object\nattribution and actions without speculation.")
DEV_CHAT = "<s>[SYSTEM_PROMPT]" + SYSTEM + "[/SYSTEM_PROMPT][INST]{prompt}[/INST]"
MAX_TOKENS = 512            # Flux2KleinPipeline's max_sequence_length
REQUIRED = {"transformer": ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"),
            "text_encoder": ("input_ids", "attention_mask")}


def check_io(manifest: Manifest) -> None:
    """The manifest's text encoder, transformer and VAE decoder as FLUX.2's have them, else one UserError naming
    the field."""
    where = f"{manifest.root}/manifest.json: components"
    for comp, names in REQUIRED.items():
        if comp not in manifest.components:
            continue
        inputs = {i["name"]: i.get("shape") for i in manifest.components[comp]["inputs"]}
        outputs = [o["name"] for o in manifest.components[comp]["outputs"]]
        out = "out_hidden_states" if comp == "transformer" else "hidden_states"
        missing = [n for n in names if n not in inputs]
        if missing or out not in outputs:
            raise UserError(f"{where}.{comp} has no {', '.join(missing) or out}: not a FLUX.2 {comp} (was the manifest "
                            "edited?); rebuild or re-download the bundle")
    inputs = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}
    for name in ("hidden_states", "encoder_hidden_states"):
        shape = inputs[name]
        if not isinstance(shape, list) or len(shape) != 3 or type(shape[-1]) is not int or shape[-1] < 1 or \
                (name == "hidden_states" and shape[-1] % 4):
            raise UserError(f"{where}.transformer.inputs: {name} has shape {shape!r}, not the transformer's; rebuild "
                            "or re-download the bundle")
    vae = manifest.components.get("vae_decoder")
    if vae is not None:
        cfg, n = vae.get("config") or {}, inputs["hidden_states"][-1]
        check_latent_stats(cfg, ("latents_bn_mean", "latents_bn_std"), n, f"{where}.vae_decoder.config",
                           "batch-norm statistics of a FLUX.2 VAE's latents")


def flux2_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of a FLUX.2 bundle is called with (the text at the length it runs)."""
    check_io(manifest)
    inputs = {i["name"]: i["shape"] for i in manifest.components["transformer"]["inputs"]}
    rows, cols = packed_grid(manifest, height, width)
    tokens, text, f = rows * cols, t5_length(manifest), latent_factor(manifest)
    out = {"text_encoder": {"input_ids": (batch, text), "attention_mask": (batch, text)},
           "transformer": {"hidden_states": (batch, tokens, inputs["hidden_states"][-1]),
                           "encoder_hidden_states": (batch, text, inputs["encoder_hidden_states"][-1]),
                           "timestep": (batch,), "img_ids": (tokens, 4), "txt_ids": (text, 4)},
           "vae_decoder": {"latent_sample": (batch, inputs["hidden_states"][-1] // 4, height // f, width // f)}}
    if "guidance" in inputs:
        out["transformer"]["guidance"] = (batch,)
    return out


def latent_ids(rows: int, cols: int) -> np.ndarray:
    """[(rows cols), 4]: (0, row, col, 0) per packed latent, row-major."""
    ids = np.zeros((rows, cols, 4), np.float32)
    ids[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
    return ids.reshape(rows * cols, 4)


def text_ids(length: int) -> np.ndarray:
    """[length, 4]: (0, 0, 0, i) per text token."""
    ids = np.zeros((length, 4), np.float32)
    ids[:, 3] = np.arange(length, dtype=np.float32)
    return ids


class Flux2Txt2Img(PackedFlowPipeline):
    """Text-to-image over a FLUX.2 bundle."""
    refusal = "the FLUX.2 pipeline runs FLUX.2 bundles"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.manifest.components["vae_decoder"]["config"]
        self.bn_mean, self.bn_std = (np.asarray(cfg[k], np.float32) for k in ("latents_bn_mean", "latents_bn_std"))
        self.chat = DEV_CHAT if self.manifest.model.get("variant") == "dev" else CHAT

    def check_io(self, manifest: Manifest) -> None:
        check_io(manifest)

    def text_limits(self) -> dict[str, int]:
        """Tokens of the chat-templated prompt read: the pipeline's 512, or the text length the bundle runs."""
        return {"text_encoder": min(MAX_TOKENS, self.t5_tokens)}

    def prompt_warnings(self, *prompts: str | None) -> list[str]:
        """What the text encoder will cut off: one line per prompt, counted in the chat template's tokens."""
        read = prompts if self.negative else prompts[:1]        # dev reads no negative prompt
        return chat_cut_warnings(self.tokenizers["text_encoder"], self.chat, self.text_limits()["text_encoder"],
                                 [p and self.cleaned(p) for p in read], "FLUX.2's chat template")

    def cleaned(self, prompt: str) -> str:
        """dev's prompt as Flux2Pipeline reads it: `[IMG]` (an image's place in Mistral's template) taken out."""
        return prompt.replace("[IMG]", "") if self.chat is DEV_CHAT else prompt

    # ---- conditioning ---------------------------------------------------------------------------
    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The stacked hidden states of the chat-templated prompt padded to the text length, and its ids."""
        tok, length = self.tokenizers["text_encoder"], self.t5_tokens
        padded, mask = tok.padded(tok.chat(self.cleaned(prompt), self.chat, min(MAX_TOKENS, length)), length)
        session = self.component("text_encoder").session
        states = session.run({"input_ids": padded, "attention_mask": mask})["hidden_states"].astype(np.float32)
        return {"encoder_hidden_states": states, "txt_ids": text_ids(length)}

    # ---- how the transformer is fed --------------------------------------------------------------
    def fixed_feeds(self, transformer, guidance: float) -> dict[str, np.ndarray]:
        fixed = {"img_ids": latent_ids(self.rows, self.cols)}
        if "guidance" in transformer.input_names:
            fixed["guidance"] = np.full((1,), guidance, np.float32)
        return fixed

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """The VAE decoder's images of normalised latents [N, C, H, W]: denormalised per patchified channel first."""
        rows, cols = latents.shape[2] // 2, latents.shape[3] // 2
        return super().decode(unpack(pack(latents) * self.bn_std + self.bn_mean, rows, cols))


# Flux2KleinPipeline and Flux2Pipeline: sigmas linspace(1, 1/steps), mu = compute_empirical_mu(image tokens, steps);
# the scheduler config the klein and dev folders ship (dynamic shifting; the shift fields unused once mu is given);
# max_sequence_length 512. Distilled (black-forest-labs/FLUX.2-klein-4B / -9B): 4 steps, no CFG; base
# (-klein-base-4B / -9B): 50 steps, CFG 4.0; dev (FLUX.2-dev): 50 steps, guidance 4.0 fed to the transformer (the
# pipelines' defaults).
SCHEDULE = {"use_dynamic_shifting": True, "dynamic_mu": "empirical", "shift": 3.0, "base_shift": 0.5,
            "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
# previews' latent -> RGB projection of the 32-channel latents after the 2x2 unpacking, normalised by the VAE's
# batch-norm statistics (ComfyUI latent_formats.py Flux2: its 128 channels reshaped to 32 at twice the size, the
# same order as unpack's)
FLUX2_RGB = LatentRGB(((0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644),
                      (0.2144, 0.3009, 0.3652), (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160),
                      (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109), (-0.3527, -0.2712, -0.1666),
                      (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
                      (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080),
                      (-0.0939, -0.0008, 0.0186), (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127),
                      (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065), (0.0128, 0.0101, 0.0142),
                      (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
                      (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025),
                      (0.0220, 0.0169, -0.0048), (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609),
                      (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614)), (-0.0329, -0.0718, -0.0851))
FAMILIES = (
    Family("flux2", "FLUX.2", ("text_encoder", "transformer", "vae_decoder"), "transformer", 1.0, Flux2Txt2Img,
           flux2_requests, patch=2, steps=4, guidance=1.0, samplers=FLOW_SAMPLERS, check_mode=txt2img_only,
           variants={"klein": Flow(SCHEDULE, 4, 1.0, MAX_TOKENS), "klein-base": Flow(SCHEDULE, 50, 4.0, MAX_TOKENS),
                     "dev": Flow(SCHEDULE, 50, 4.0, MAX_TOKENS, negative=False)},
           latent_rgb=FLUX2_RGB),
)
Flux2Txt2Img.families = {f.name: f for f in FAMILIES}
