"""Writes FLUX.2 klein and dev checkpoints with seeded random weights in the real key layouts.

Owns: the key/shape layouts of a FLUX.2 transformer in Black Forest Labs' names (flux-2-klein-*.safetensors, as
ComfyUI's diffusion_models files carry them: fused `img_attn.qkv`, `linear1` = q | k | v | SwiGLU gate | up, shared
`*_stream_modulation.lin`, no biases) and of the FLUX.2 VAE (LDM names with 32 latent channels, quant convs and
the latents' batch-norm statistics `bn.running_mean` / `bn.running_var`; BFL's own file nests the quant convs under
encoder. / decoder.), the ComfyUI all-in-one layout (`model.diffusion_model.`, the Qwen3 text model under
`text_encoders.qwen3_4b.transformer.model.`, `vae.`), and the embedded tiny demos: `demo:tiny-flux2-klein`, which
carries demo_zimage.py's tiny Qwen2-style tokenizer in its metadata (its Qwen3 has 28 layers, so the released
hidden states 9, 18 and 27 are read as Flux2KleinPipeline reads them), and `demo:tiny-flux2-dev` (dev's guidance
embedder `guidance_in`; a Mistral-style text model -- no QK norms, 128-wide heads wider than its width / heads, as
Mistral-Small-3.2's, 30 layers for the hidden states 10, 20 and 30 -- under `text_encoders.mistral3_24b.transformer.
model.`, and a tiny byte-level BPE tokenizer with Mistral's control tokens first). numpy + ml_dtypes (+ tokenizers).
"""
from __future__ import annotations

from dataclasses import dataclass

from .demo_dit import VAE_PREFIX
from .demo_model import SD1Config, _lin, vae_layout
from ..runtime.families.flux2 import SYSTEM
from .demo_weights import Component, write_components
from .demo_zimage import CORPUS, DIT_PREFIX, LLM_PREFIX, Qwen3Config, qwen3_layout, tiny_tokenizer_json
from .sources.llm_tokenizer_files import DEMO_KEY, qwen2_tokenizer

MISTRAL_PREFIX = "text_encoders.mistral3_24b.transformer.model."
# Mistral's control tokens at the head of its vocabulary (tekken: ids 0.. ; the ones FLUX.2 dev's template spells)
MISTRAL_SPECIAL = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                   "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")


@dataclass(frozen=True)
class Flux2Config:
    """A FLUX.2 transformer's shape (diffusers Flux2Transformer2DModel's fields)."""
    hidden: int
    heads: int
    depth: int
    depth_single: int
    context: int                    # the stacked text states' width (3 x the Qwen3's)
    in_channels: int = 128          # 2x2 patches of 32 latent channels
    mlp_ratio: float = 3.0
    time_dim: int = 256
    guidance: bool = False          # dev: a guidance embedder (guidance_in)

    @property
    def mlp(self) -> int:
        return int(self.hidden * self.mlp_ratio)


TINY_FLUX2 = Flux2Config(hidden=64, heads=4, depth=2, depth_single=2, context=96)
TINY_QWEN3_28 = Qwen3Config(vocab=512, hidden=32, intermediate=64, layers=28, heads=4, kv_heads=2, head_dim=8)
TINY_FLUX2_DEV = Flux2Config(hidden=64, heads=4, depth=2, depth_single=2, context=96, guidance=True)
TINY_MISTRAL_30 = Qwen3Config(vocab=512, hidden=32, intermediate=64, layers=30, heads=2, kv_heads=1, head_dim=128)
TINY_VAE32 = SD1Config(vae_ch=32, vae_mult=(1, 2), vae_res_blocks=1, latent_channels=32)
DEMO_AXES = [4, 4, 4, 4]        # the tiny transformer's 16-wide heads' RoPE split over (t, h, w, l)


def flux2_layout(cfg: Flux2Config) -> dict[str, tuple[int, ...]]:
    """The transformer in BFL names (no prefix)."""
    d: dict[str, tuple[int, ...]] = {}
    h, hd, mlp = cfg.hidden, cfg.hidden // cfg.heads, cfg.mlp
    _lin(d, "img_in", h, cfg.in_channels, bias=False)
    _lin(d, "txt_in", h, cfg.context, bias=False)
    _lin(d, "time_in.in_layer", h, cfg.time_dim, bias=False)
    _lin(d, "time_in.out_layer", h, h, bias=False)
    if cfg.guidance:
        _lin(d, "guidance_in.in_layer", h, cfg.time_dim, bias=False)
        _lin(d, "guidance_in.out_layer", h, h, bias=False)
    _lin(d, "double_stream_modulation_img.lin", 6 * h, h, bias=False)
    _lin(d, "double_stream_modulation_txt.lin", 6 * h, h, bias=False)
    _lin(d, "single_stream_modulation.lin", 3 * h, h, bias=False)
    for i in range(cfg.depth):
        for s in ("img", "txt"):
            p = f"double_blocks.{i}.{s}"
            _lin(d, f"{p}_attn.qkv", 3 * h, h, bias=False)
            d[f"{p}_attn.norm.query_norm.scale"] = d[f"{p}_attn.norm.key_norm.scale"] = (hd,)
            _lin(d, f"{p}_attn.proj", h, h, bias=False)
            _lin(d, f"{p}_mlp.0", 2 * mlp, h, bias=False)
            _lin(d, f"{p}_mlp.2", h, mlp, bias=False)
    for i in range(cfg.depth_single):
        p = f"single_blocks.{i}"
        _lin(d, f"{p}.linear1", 3 * h + 2 * mlp, h, bias=False)
        _lin(d, f"{p}.linear2", h, h + mlp, bias=False)
        d[f"{p}.norm.query_norm.scale"] = d[f"{p}.norm.key_norm.scale"] = (hd,)
    _lin(d, "final_layer.adaLN_modulation.1", 2 * h, h, bias=False)
    _lin(d, "final_layer.linear", cfg.in_channels, h, bias=False)
    return d


def flux2_vae_layout(cfg: SD1Config = TINY_VAE32, nested: bool = False) -> dict[str, tuple[int, ...]]:
    """The FLUX.2 VAE in LDM names (no prefix) with its latents' batch-norm statistics; `nested`: BFL's own file,
    whose quant convs sit under encoder. / decoder."""
    cut = len("first_stage_model.")
    d = {k[cut:]: v for k, v in vae_layout(cfg).items()}
    if nested:
        side = {"quant_conv": "encoder.", "post_quant_conv": "decoder."}
        d = {side.get(k.split(".")[0], "") + k: v for k, v in d.items()}
    d["bn.running_mean"] = d["bn.running_var"] = (4 * cfg.latent_channels,)
    return d


def mistral_layout(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """A Mistral text model in HF `MistralModel` names (a Qwen3's without the QK norms)."""
    return {k: v for k, v in qwen3_layout(cfg).items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}


def mistral_tokenizer_json(vocab: int = TINY_MISTRAL_30.vocab) -> str:
    """A byte-level BPE tokenizer.json with Mistral's control tokens first (ids 0..19), its merges trained on
    demo_zimage.py's CORPUS and FLUX.2 dev's system message (so a prompt fits the tiny text lengths): `vocab` ids."""
    from tokenizers import models, pre_tokenizers, trainers
    tok = qwen2_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False, special_tokens=list(MISTRAL_SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(CORPUS + (SYSTEM,)) * 4, trainer=trainer)
    return tok.to_str()


def flux2_components(cfg: Flux2Config = TINY_FLUX2, te: Qwen3Config | None = TINY_QWEN3_28,
                     vae: SD1Config | None = TINY_VAE32, layout: str = "all-in-one") -> list[Component]:
    """"all-in-one": ComfyUI prefixes (transformer in BFL names, the text model -- Qwen3, or a Mistral for a dev
    transformer --, the VAE); "bare": the transformer alone in BFL names, no prefix (flux-2-klein-4b.safetensors)."""
    if layout == "bare":
        return [Component("transformer", "", flux2_layout(cfg), True)]
    comps = [Component("transformer", DIT_PREFIX, flux2_layout(cfg), True)]
    if te and cfg.guidance:
        comps.append(Component("mistral", MISTRAL_PREFIX, mistral_layout(te), True))
    elif te:
        comps.append(Component("qwen3", LLM_PREFIX, qwen3_layout(te), True))
    if vae:
        comps.append(Component("vae", VAE_PREFIX, flux2_vae_layout(vae), False))
    return comps


def write_flux2_vae_file(path, cfg: SD1Config = TINY_VAE32, seed: int = 0, dtype: str = "fp32"):
    """The FLUX.2 VAE alone in BFL's names (nested quant convs), as flux2-vae.safetensors."""
    return write_components(path, [Component("vae", "", flux2_vae_layout(cfg, nested=True), False)], seed, dtype)


def write_mistral_file(path, cfg: Qwen3Config = TINY_MISTRAL_30, seed: int = 0, dtype: str = "bf16"):
    """A Mistral text model alone (`model.*` keys), as ComfyUI's mistral_3_small_flux2_bf16.safetensors."""
    return write_components(path, [Component("mistral", "model.", mistral_layout(cfg), True)], seed, dtype)


def write_demo_flux2(path, name: str = "tiny-flux2-klein", seed: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """The embedded tiny demos (`demo:tiny-flux2-klein`, `demo:tiny-flux2-dev`): one all-in-one bf16 file each,
    carrying its tokenizer."""
    if name == "tiny-flux2-dev":
        return write_components(path, flux2_components(TINY_FLUX2_DEV, TINY_MISTRAL_30), seed, "bf16",
                                rest_dtype="bf16", metadata={DEMO_KEY: mistral_tokenizer_json()})
    return write_components(path, flux2_components(), seed, "bf16", rest_dtype="bf16",
                            metadata={DEMO_KEY: tiny_tokenizer_json()})
