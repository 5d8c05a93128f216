"""Qwen-Image (Alibaba; 50 steps, true CFG 4 against the negative prompt " "): the family facts and text-to-image
over such a bundle -- Qwen2.5-VL's text model read at its last hidden state over the prompt in Qwen-Image's
template (its first 34 tokens dropped), the double-stream transformer on packed 2x2 latent patches with its
centred 3-D positions, the Qwen-Image VAE with per-channel latent statistics -- on the shared flow-matching loop
(flow_matching.py).

Owns: the Qwen-Image record (FAMILIES: components, the released schedule -- linspace(1, 1/steps) sigmas shifted
by exp(mu), mu linear in the image tokens between (256, 0.5) and (8192, 0.9), stretched to end at 0.02 --, 50
steps, guidance 4), its conditioning as QwenImagePipeline builds it -- the prompt in the template, tokenized
(runtime/llm_tokenizer.py), cut at 1024 + 34 tokens, the encoder's hidden states after the 34 template tokens
(padding, where an engine's profile wants more rows, masked by encoder_hidden_states_mask), the text ids (m + i
on each axis, m = max(rows, cols) // 2 of the packed grid) and the image ids (0, row - ceil(rows / 2), col -
ceil(cols / 2)) --, true CFG with the norm rescale (pos's per-token norm kept: comb * |pos| / |comb|), an empty
negative prompt read as " " (the model card's), the packing (Flux's), and the latents' denormalisation before
the VAE decoder (x * latents_std + latents_mean per channel, from the manifest's vae_decoder config) and their
normalisation after the VAE encoder for img2img (QwenImageImg2ImgPipeline's).
Imports numpy and the runtime's own modules; never the compiler.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..image_size import latent_factor
from ..manifest import Manifest
from .family import Family, Flow, LatentRGB
from .flow_matching import FLOW_SAMPLERS, chat_cut_warnings, check_latent_stats, img2img_mode, t5_length
from .flux import PackedFlowPipeline, packed_grid

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
            "<|im_start|>assistant\n")
DROP = 34                   # QwenImagePipeline's prompt_template_encode_start_idx: the template's tokens (Qwen2's)
MAX_TOKENS = 1024           # its tokenizer_max_length (after the dropped tokens)
NEGATIVE = " "              # the model card's negative prompt: what an empty one is read as
REQUIRED = {"transformer": ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                            "img_ids", "txt_ids"),
            "text_encoder": ("input_ids", "attention_mask")}


def check_io(manifest: Manifest) -> None:
    """The manifest's text encoder, transformer and VAE decoder as Qwen-Image's have them, else one UserError."""
    where = f"{manifest.root}/manifest.json: components"
    for comp, names in REQUIRED.items():
        if comp not in manifest.components:
            continue
        inputs = {i["name"] for i in manifest.components[comp]["inputs"]}
        outputs = [o["name"] for o in manifest.components[comp]["outputs"]]
        out = "out_hidden_states" if comp == "transformer" else "hidden_states"
        missing = [n for n in names if n not in inputs]
        if missing or out not in outputs:
            raise UserError(f"{where}.{comp} has no {', '.join(missing) or out}: not a Qwen-Image {comp} (was the "
                            "manifest edited?); rebuild or re-download the bundle")
    shape = {i["name"]: i.get("shape") for i in manifest.components["transformer"]["inputs"]}["hidden_states"]
    if not isinstance(shape, list) or len(shape) != 3 or type(shape[-1]) is not int or shape[-1] % 4:
        raise UserError(f"{where}.transformer.inputs: hidden_states has shape {shape!r}, not the transformer's; "
                        "rebuild or re-download the bundle")
    vae = manifest.components.get("vae_decoder")
    if vae is not None:
        cfg = vae.get("config") or {}
        check_latent_stats(cfg, ("latents_mean", "latents_std"), shape[-1] // 4, f"{where}.vae_decoder.config",
                           "per-channel statistics of a Qwen-Image VAE's latents")


def qwenimage_requests(manifest: Manifest, batch: int, height: int, width: int) -> dict:
    """The input shapes each component of a Qwen-Image bundle is called with (the text at its default length)."""
    check_io(manifest)
    inputs = {i["name"]: i["shape"] for i in manifest.components["transformer"]["inputs"]}
    rows, cols = packed_grid(manifest, height, width)
    tokens, text, c, f = rows * cols, t5_length(manifest), inputs["hidden_states"][-1], latent_factor(manifest)
    return {"text_encoder": {"input_ids": (batch, text), "attention_mask": (batch, text)},
            "transformer": {"hidden_states": (batch, tokens, c), "timestep": (batch,),
                            "encoder_hidden_states": (batch, text, inputs["encoder_hidden_states"][-1]),
                            "encoder_hidden_states_mask": (batch, text), "img_ids": (tokens, 3), "txt_ids": (text, 3)},
            "vae_decoder": {"latent_sample": (batch, c // 4, height // f, width // f)}}


def latent_ids(rows: int, cols: int) -> np.ndarray:
    """[(rows cols), 3]: (0, row - ceil(rows / 2), col - ceil(cols / 2)) per packed latent, row-major."""
    ids = np.zeros((rows, cols, 3), np.float32)
    ids[..., 1] = (np.arange(rows) - (rows - rows // 2))[:, None]
    ids[..., 2] = (np.arange(cols) - (cols - cols // 2))[None, :]
    return ids.reshape(rows * cols, 3)


def text_ids(length: int, rows: int, cols: int) -> np.ndarray:
    """[length, 3]: m + i on each axis, m = max(rows // 2, cols // 2)."""
    return np.repeat((max(rows // 2, cols // 2) + np.arange(length, dtype=np.float32))[:, None], 3, axis=1)


class QwenImageTxt2Img(PackedFlowPipeline):
    """Text-to-image over a Qwen-Image bundle."""
    refusal = "the Qwen-Image pipeline runs Qwen-Image bundles"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.manifest.components["vae_decoder"]["config"]
        self.mean, self.std = (np.asarray(cfg[k], np.float32)[None, :, None, None]
                               for k in ("latents_mean", "latents_std"))

    def check_io(self, manifest: Manifest) -> None:
        check_io(manifest)

    def fit(self, comp: str, name: str, n: int) -> int:
        """The length `comp` runs `n` rows at: n, raised to its engine's minimum, cut to its maximum."""
        span = self.input_range(comp, name, 1)
        return n if span is None else min(max(n, span[0]), span[1])

    def text_limits(self) -> dict[str, int]:
        """Tokens of the prompt (after the template's) the transformer reads: 1024, or what the engines take."""
        te = self.input_range("text_encoder", "input_ids", 1)
        tr = self.input_range("transformer", "encoder_hidden_states", 1)
        return {"text_encoder": min(MAX_TOKENS, (te[1] - DROP) if te else MAX_TOKENS, tr[1] if tr else MAX_TOKENS)}

    def prompt_warnings(self, *prompts: str | None) -> list[str]:
        return chat_cut_warnings(self.tokenizers["text_encoder"], TEMPLATE, self.text_limits()["text_encoder"],
                                 prompts, "Qwen-Image's template", "the transformer", DROP)

    # ---- conditioning ---------------------------------------------------------------------------
    def encode(self, prompt: str) -> dict[str, np.ndarray]:
        """The last hidden states of the templated prompt after its first 34 tokens, padded rows masked."""
        tok = self.tokenizers["text_encoder"]
        ids = tok.chat(prompt or NEGATIVE, TEMPLATE, DROP + self.text_limits()["text_encoder"])
        if len(ids) <= DROP:
            raise UserError(f"the tokenizer turns Qwen-Image's template into {len(ids)} tokens, no more than the "
                            f"{DROP} the pipeline drops: not the model's tokenizer; rebuild the bundle with "
                            "Qwen-Image's")
        length = self.fit("text_encoder", "input_ids", len(ids))
        padded, mask = tok.padded(ids, length, left=False)
        session = self.component("text_encoder").session
        states = session.run({"input_ids": padded, "attention_mask": mask})["hidden_states"].astype(np.float32)
        n = len(ids) - DROP
        rows = self.fit("transformer", "encoder_hidden_states", n)
        out = np.zeros((1, rows, states.shape[-1]), np.float32)
        out[:, :n] = states[:, DROP:len(ids)]
        mask = (np.arange(rows) < n)[None].astype(np.int32)
        return {"encoder_hidden_states": out, "encoder_hidden_states_mask": mask,
                "txt_ids": text_ids(rows, self.rows, self.cols)}

    # ---- how the transformer is fed --------------------------------------------------------------
    def fixed_feeds(self, transformer, guidance: float) -> dict[str, np.ndarray]:
        return {"img_ids": latent_ids(self.rows, self.cols)}

    def guide(self, v: np.ndarray, v_neg: np.ndarray, guidance: float) -> np.ndarray:
        """QwenImagePipeline's true CFG: the guided velocity rescaled to the prompt's per-token norm."""
        comb = v_neg + np.float32(guidance) * (v - v_neg)
        return comb * (np.linalg.norm(v, axis=-1, keepdims=True) / np.linalg.norm(comb, axis=-1, keepdims=True))

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """The VAE decoder's images of normalised latents [N, C, H, W]: x * latents_std + latents_mean first."""
        return super().decode(latents * self.std + self.mean)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """img2img's latents, normalised as the decoder's are read: (mean - latents_mean) / latents_std
        (QwenImageImg2ImgPipeline's _encode_vae_image)."""
        return (super().encode_image(pixels) - self.mean) / self.std


# Qwen/Qwen-Image's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler): dynamic shifting between
# (256, 0.5) and (8192, 0.9), exponential, stretched to a last sigma of 0.02; QwenImagePipeline: sigmas
# linspace(1, 1/steps), 50 steps, true_cfg_scale 4 (the model card: negative prompt " ").
SCHEDULE = {"use_dynamic_shifting": True, "shift": 1.0, "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
            "max_image_seq_len": 8192, "shift_terminal": 0.02}
# previews' latent -> RGB projection of the normalised 16-channel latents (Qwen-Image's VAE is Wan 2.1's: ComfyUI
# latent_formats.py Wan21, whose model space is these latents, (z - latents_mean) / latents_std)
QWEN_RGB = LatentRGB(((-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747),
                      (0.0372, 0.2344, 0.1420), (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665),
                      (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975), (-0.0412, 0.0267, -0.1364),
                      (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
                      (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950),
                      (0.1984, 0.0913, 0.1861)), (-0.1835, -0.0868, -0.3360))
FAMILIES = (
    Family("qwenimage", "Qwen-Image", ("text_encoder", "transformer", "vae_decoder"), "transformer", 1.0,
           QwenImageTxt2Img, qwenimage_requests, patch=2, steps=50, guidance=4.0, samplers=FLOW_SAMPLERS,
           check_mode=img2img_mode, img2img=True, variants={"base": Flow(SCHEDULE, 50, 4.0, MAX_TOKENS)},
           latent_rgb=QWEN_RGB),
)
QwenImageTxt2Img.families = {f.name: f for f in FAMILIES}
