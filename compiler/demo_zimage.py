"""Writes Z-Image checkpoints with seeded random weights in the real key layouts, and a tiny Qwen2-style tokenizer.

Owns: the key/shape layouts of a Z-Image transformer (the original release's names, as ComfyUI's
z_image_turbo_bf16.safetensors carries them: fused `attention.qkv`, `x_embedder`, `final_layer`; or diffusers'
names) and of a Qwen3 text model (HF `Qwen3Model` names), the ComfyUI all-in-one file layout
(`model.diffusion_model.`, `text_encoders.qwen3_4b.transformer.model.`, `vae.` with the FLUX.1 VAE of
demo_dit.py), and the tiny tokenizer the demo carries in its metadata (compiler/sources/llm_tokenizer_files.py
reads it): byte-level BPE in Qwen2's pipeline (that module's qwen2_tokenizer: its split pattern, NFC, ByteLevel
without prefix space) and special tokens, trained with the `tokenizers` library on a fixed corpus. numpy +
ml_dtypes (+ tokenizers).
"""
from __future__ import annotations

from dataclasses import dataclass

from .demo_dit import TINY_VAE16, VAE_PREFIX, vae16_layout
from .demo_model import _lin
from .demo_weights import Component, write_components
from .sources.llm_tokenizer_files import DEMO_KEY, qwen2_tokenizer

DIT_PREFIX = "model.diffusion_model."
LLM_PREFIX = "text_encoders.qwen3_4b.transformer.model."     # ComfyUI's Qwen3-4B text encoder, HF names after it
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
CORPUS = ("A photo of a cat sitting on a red sofa, soft light, 35mm film.",
          "一只猫坐在红色沙发上，柔和的光线。",
          "Young woman in red Hanfu, intricate embroidery, golden phoenix headdress.",
          "A futuristic electric motorcycle parked under neon lights at night, rain, reflections.",
          "Watercolor landscape: mountains, a lake, pine trees and a small wooden house; morning fog.",
          "Poster with the text \"Z-IMAGE\" in bold letters, 1024x1024, high detail, 8k.",
          "In 2024, 1024 x 1024 px and 12345 steps: it's what WE'LL do, I'm sure they'd like it   --  ok!!\n\n")


@dataclass(frozen=True)
class ZImageConfig:
    """A Z-Image transformer's shape (diffusers ZImageTransformer2DModel's fields)."""
    dim: int
    heads: int
    layers: int
    refiner_layers: int
    cap_dim: int
    in_channels: int = 16

    @property
    def ffn(self) -> int:
        return int(self.dim / 3 * 8)


@dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3 text model's shape."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


TINY_ZIMAGE = ZImageConfig(dim=64, heads=4, layers=2, refiner_layers=2, cap_dim=32)
TINY_QWEN3 = Qwen3Config(vocab=512, hidden=32, intermediate=64, layers=3, heads=4, kv_heads=2, head_dim=8)
ZIMAGE_TURBO = ZImageConfig(dim=3840, heads=30, layers=30, refiner_layers=2, cap_dim=2560)
QWEN3_4B = Qwen3Config(vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128)
DEMO_AXES = [4, 6, 6]           # the tiny transformer's 16-wide heads' RoPE split


def zimage_layout(cfg: ZImageConfig, original: bool = True) -> dict[str, tuple[int, ...]]:
    """The transformer's keys (no prefix): the original release's names, or diffusers' (`original` False)."""
    d: dict[str, tuple[int, ...]] = {}
    dim, hd, adaln = cfg.dim, cfg.dim // cfg.heads, min(cfg.dim, 256)
    _lin(d, "x_embedder" if original else "all_x_embedder.2-1", dim, 4 * cfg.in_channels)
    final = "final_layer" if original else "all_final_layer.2-1"
    _lin(d, f"{final}.linear", 4 * cfg.in_channels, dim)
    _lin(d, f"{final}.adaLN_modulation.1", dim, adaln)
    _lin(d, "t_embedder.mlp.0", 1024, 256)
    _lin(d, "t_embedder.mlp.2", adaln, 1024)
    d["cap_embedder.0.weight"] = (cfg.cap_dim,)
    _lin(d, "cap_embedder.1", dim, cfg.cap_dim)
    d["x_pad_token"] = d["cap_pad_token"] = (1, dim)
    blocks = [(f"noise_refiner.{i}", True) for i in range(cfg.refiner_layers)] + \
        [(f"context_refiner.{i}", False) for i in range(cfg.refiner_layers)] + \
        [(f"layers.{i}", True) for i in range(cfg.layers)]
    for p, modulated in blocks:
        a = f"{p}.attention"
        if original:
            _lin(d, f"{a}.qkv", 3 * dim, dim, bias=False)
            _lin(d, f"{a}.out", dim, dim, bias=False)
        else:
            for n in ("to_q", "to_k", "to_v", "to_out.0"):
                _lin(d, f"{a}.{n}", dim, dim, bias=False)
        for n in ("q_norm", "k_norm") if original else ("norm_q", "norm_k"):
            d[f"{a}.{n}.weight"] = (hd,)
        _lin(d, f"{p}.feed_forward.w1", cfg.ffn, dim, bias=False)
        _lin(d, f"{p}.feed_forward.w2", dim, cfg.ffn, bias=False)
        _lin(d, f"{p}.feed_forward.w3", cfg.ffn, dim, bias=False)
        for n in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            d[f"{p}.{n}.weight"] = (dim,)
        if modulated:
            _lin(d, f"{p}.adaLN_modulation.0", 4 * dim, adaln)
    return d


def qwen3_layout(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """A Qwen3 text model in HF `Qwen3Model` names."""
    d: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab, cfg.hidden), "norm.weight": (cfg.hidden,)}
    for i in range(cfg.layers):
        p = f"layers.{i}"
        _lin(d, f"{p}.self_attn.q_proj", cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        _lin(d, f"{p}.self_attn.k_proj", cfg.kv_heads * cfg.head_dim, cfg.hidden, bias=False)
        _lin(d, f"{p}.self_attn.v_proj", cfg.kv_heads * cfg.head_dim, cfg.hidden, bias=False)
        _lin(d, f"{p}.self_attn.o_proj", cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        d[f"{p}.self_attn.q_norm.weight"] = d[f"{p}.self_attn.k_norm.weight"] = (cfg.head_dim,)
        _lin(d, f"{p}.mlp.gate_proj", cfg.intermediate, cfg.hidden, bias=False)
        _lin(d, f"{p}.mlp.up_proj", cfg.intermediate, cfg.hidden, bias=False)
        _lin(d, f"{p}.mlp.down_proj", cfg.hidden, cfg.intermediate, bias=False)
        d[f"{p}.input_layernorm.weight"] = d[f"{p}.post_attention_layernorm.weight"] = (cfg.hidden,)
    return d


def tiny_tokenizer_json(vocab: int = TINY_QWEN3.vocab) -> str:
    """A byte-level BPE tokenizer.json built as Qwen2's is (pre-tokenizer, normalizer, decoder, special tokens),
    its merges trained on CORPUS: `vocab` ids in all, the special tokens last."""
    from tokenizers import models, pre_tokenizers, trainers
    tok = qwen2_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL))
    return tok.to_str()


def zimage_components(cfg: ZImageConfig = TINY_ZIMAGE, te: Qwen3Config | None = TINY_QWEN3, vae=TINY_VAE16,
                      layout: str = "all-in-one") -> list[Component]:
    """"all-in-one": ComfyUI prefixes (transformer in original names, Qwen3, FLUX.1 VAE); "bare": the transformer
    alone in original names, no prefix (z_image_turbo_bf16.safetensors)."""
    if layout == "bare":
        return [Component("transformer", "", zimage_layout(cfg), True)]
    comps = [Component("transformer", DIT_PREFIX, zimage_layout(cfg), True)]
    if te:
        comps.append(Component("qwen3", LLM_PREFIX, qwen3_layout(te), True))
    if vae:
        comps.append(Component("vae", VAE_PREFIX, vae16_layout(vae), False))
    return comps


def write_qwen3_file(path, cfg: Qwen3Config = TINY_QWEN3, seed: int = 0, dtype: str = "bf16"):
    """A Qwen3 text model alone (`model.*` keys), as ComfyUI's qwen_3_4b.safetensors."""
    return write_components(path, [Component("qwen3", "model.", qwen3_layout(cfg), True)], seed, dtype)


def write_demo_zimage(path, name: str = "tiny-z-image", seed: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """The embedded tiny demo (`demo:tiny-z-image`): one all-in-one bf16 file carrying its tokenizer."""
    return write_components(path, zimage_components(), seed, "bf16", rest_dtype="bf16",
                            metadata={DEMO_KEY: tiny_tokenizer_json()})
