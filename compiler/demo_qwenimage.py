"""Writes Qwen-Image checkpoints with seeded random weights in the real key layouts.

Owns: the key/shape layouts of a Qwen-Image transformer in diffusers names (QwenImageTransformer2DModel, as
ComfyUI's qwen_image diffusion_models files carry them), of Qwen2.5-VL's text model in HF names (q/k/v biases, no
QK norm; its 128-wide heads as released) and of the Qwen-Image VAE in diffusers names (AutoencoderKLQwenImage:
causal 3-D convs, RMS-norm gammas, temporal up/downsamplers), the all-in-one layout (`model.diffusion_model.`,
the text model under `text_encoders.qwen25_7b.transformer.model.`, `vae.`) and the embedded tiny demo
(`demo:tiny-qwen-image`), which carries demo_zimage.py's tiny Qwen2-style tokenizer in its metadata.
numpy + ml_dtypes (+ tokenizers).
"""
from __future__ import annotations

from dataclasses import dataclass

from .demo_dit import VAE_PREFIX
from .demo_model import _lin
from .demo_weights import Component, write_components
from .demo_zimage import DIT_PREFIX, tiny_tokenizer_json
from .sources.llm_tokenizer_files import DEMO_KEY

LLM_PREFIX = "text_encoders.qwen25_7b.transformer.model."     # ComfyUI's Qwen2.5-VL-7B text model, HF names after it


@dataclass(frozen=True)
class QwenImageConfig:
    """A Qwen-Image transformer's shape (QwenImageTransformer2DModel's fields)."""
    heads: int
    head_dim: int
    depth: int
    context: int                    # the text model's width
    in_channels: int = 64           # 2x2 patches of 16 latent channels
    time_dim: int = 256

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Qwen25Config:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 128


@dataclass(frozen=True)
class QwenVaeConfig:
    base: int = 16
    mult: tuple[int, ...] = (1, 2, 2, 2)
    res_blocks: int = 1
    z: int = 16


TINY_QWEN_IMAGE = QwenImageConfig(heads=4, head_dim=16, depth=2, context=256)
# heads 128 wide as released (= hidden / heads, as transformers' Qwen2.5-VL has them; no config.json says so)
TINY_QWEN25 = Qwen25Config(vocab=512, hidden=256, intermediate=256, layers=2, heads=2, kv_heads=1)
TINY_QWEN_VAE = QwenVaeConfig()
DEMO_AXES = [4, 6, 6]           # the tiny transformer's 16-wide heads' RoPE split over (frame, row, column)


def qwenimage_layout(cfg: QwenImageConfig) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {}
    h, hd = cfg.hidden, cfg.head_dim
    _lin(d, "img_in", h, cfg.in_channels)
    _lin(d, "txt_in", h, cfg.context)
    d["txt_norm.weight"] = (cfg.context,)
    _lin(d, "time_text_embed.timestep_embedder.linear_1", h, cfg.time_dim)
    _lin(d, "time_text_embed.timestep_embedder.linear_2", h, h)
    for i in range(cfg.depth):
        p = f"transformer_blocks.{i}"
        for s in ("img", "txt"):
            _lin(d, f"{p}.{s}_mod.1", 6 * h, h)
            _lin(d, f"{p}.{s}_mlp.net.0.proj", 4 * h, h)
            _lin(d, f"{p}.{s}_mlp.net.2", h, 4 * h)
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            _lin(d, f"{p}.attn.{n}", h, h)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            d[f"{p}.attn.{n}.weight"] = (hd,)
    _lin(d, "norm_out.linear", 2 * h, h)
    _lin(d, "proj_out", cfg.in_channels, h)
    return d


def qwen25_layout(cfg: Qwen25Config) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-VL's text model in HF names (Qwen2Model's: q/k/v biases)."""
    d: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab, cfg.hidden), "norm.weight": (cfg.hidden,)}
    for i in range(cfg.layers):
        p = f"layers.{i}"
        _lin(d, f"{p}.self_attn.q_proj", cfg.heads * cfg.head_dim, cfg.hidden)
        _lin(d, f"{p}.self_attn.k_proj", cfg.kv_heads * cfg.head_dim, cfg.hidden)
        _lin(d, f"{p}.self_attn.v_proj", cfg.kv_heads * cfg.head_dim, cfg.hidden)
        _lin(d, f"{p}.self_attn.o_proj", cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        _lin(d, f"{p}.mlp.gate_proj", cfg.intermediate, cfg.hidden, bias=False)
        _lin(d, f"{p}.mlp.up_proj", cfg.intermediate, cfg.hidden, bias=False)
        _lin(d, f"{p}.mlp.down_proj", cfg.hidden, cfg.intermediate, bias=False)
        d[f"{p}.input_layernorm.weight"] = d[f"{p}.post_attention_layernorm.weight"] = (cfg.hidden,)
    return d


def _conv3(d: dict, name: str, cout: int, cin: int, k: int) -> None:
    d[f"{name}.weight"], d[f"{name}.bias"] = (cout, cin, k, k, k), (cout,)


def _res(d: dict, p: str, cin: int, cout: int) -> None:
    d[f"{p}.norm1.gamma"], d[f"{p}.norm2.gamma"] = (cin, 1, 1, 1), (cout, 1, 1, 1)
    _conv3(d, f"{p}.conv1", cout, cin, 3)
    _conv3(d, f"{p}.conv2", cout, cout, 3)
    if cin != cout:
        _conv3(d, f"{p}.conv_shortcut", cout, cin, 1)


def _mid(d: dict, p: str, c: int) -> None:
    _res(d, f"{p}.resnets.0", c, c)
    _res(d, f"{p}.resnets.1", c, c)
    d[f"{p}.attentions.0.norm.gamma"] = (c, 1, 1)
    d[f"{p}.attentions.0.to_qkv.weight"], d[f"{p}.attentions.0.to_qkv.bias"] = (3 * c, c, 1, 1), (3 * c,)
    d[f"{p}.attentions.0.proj.weight"], d[f"{p}.attentions.0.proj.bias"] = (c, c, 1, 1), (c,)


def qwen_vae_layout(cfg: QwenVaeConfig = TINY_QWEN_VAE) -> dict[str, tuple[int, ...]]:
    """AutoencoderKLQwenImage's names (temporal down/upsampling in every level but the first / last, as released)."""
    d: dict[str, tuple[int, ...]] = {}
    dims = [cfg.base * m for m in (1, *cfg.mult)]
    _conv3(d, "encoder.conv_in", dims[0], 3, 3)
    n, levels = 0, len(cfg.mult)
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(cfg.res_blocks):
            _res(d, f"encoder.down_blocks.{n}", cin, cout)
            cin, n = cout, n + 1
        if i != levels - 1:
            _lin(d, f"encoder.down_blocks.{n}.resample.1", cout, cout)
            d[f"encoder.down_blocks.{n}.resample.1.weight"] = (cout, cout, 3, 3)
            if i > 0:
                _conv3(d, f"encoder.down_blocks.{n}.time_conv", cout, cout, 1)
                d[f"encoder.down_blocks.{n}.time_conv.weight"] = (cout, cout, 3, 1, 1)
            n += 1
    _mid(d, "encoder.mid_block", dims[-1])
    d["encoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    _conv3(d, "encoder.conv_out", 2 * cfg.z, dims[-1], 3)
    _conv3(d, "quant_conv", 2 * cfg.z, 2 * cfg.z, 1)
    _conv3(d, "post_quant_conv", cfg.z, cfg.z, 1)
    up = [cfg.base * m for m in (cfg.mult[-1], *cfg.mult[::-1])]
    _conv3(d, "decoder.conv_in", up[0], cfg.z, 3)
    _mid(d, "decoder.mid_block", up[0])
    for i, (cin, cout) in enumerate(zip(up[:-1], up[1:])):
        cin = cin // 2 if i > 0 else cin
        for j in range(cfg.res_blocks + 1):
            _res(d, f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i != levels - 1:
            p = f"decoder.up_blocks.{i}.upsamplers.0"
            d[f"{p}.resample.1.weight"], d[f"{p}.resample.1.bias"] = (cout // 2, cout, 3, 3), (cout // 2,)
            if i < levels - 2:        # temperal_upsample = reversed([False, True, True])
                d[f"{p}.time_conv.weight"], d[f"{p}.time_conv.bias"] = (2 * cout, cout, 3, 1, 1), (2 * cout,)
    d["decoder.norm_out.gamma"] = (up[-1], 1, 1, 1)
    _conv3(d, "decoder.conv_out", 3, up[-1], 3)
    return d


def qwenimage_components(cfg: QwenImageConfig = TINY_QWEN_IMAGE, te: Qwen25Config | None = TINY_QWEN25,
                         vae: QwenVaeConfig | None = TINY_QWEN_VAE) -> list[Component]:
    comps = [Component("transformer", DIT_PREFIX, qwenimage_layout(cfg), True)]
    if te:
        comps.append(Component("qwen25", LLM_PREFIX, qwen25_layout(te), True))
    if vae:
        comps.append(Component("vae", VAE_PREFIX, qwen_vae_layout(vae), False))
    return comps


def write_demo_qwenimage(path, name: str = "tiny-qwen-image", seed: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """The embedded tiny demo (`demo:tiny-qwen-image`): one all-in-one bf16 file carrying its tokenizer."""
    return write_components(path, qwenimage_components(), seed, "bf16", rest_dtype="bf16",
                            metadata={DEMO_KEY: tiny_tokenizer_json()})
