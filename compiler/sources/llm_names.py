"""Decoder-only LLM text encoders (Qwen3, Qwen2.5-VL's text model, Mistral's) in the canonical layout: HF
`Qwen3Model` names (`embed_tokens.weight`, `layers.N.*`, `norm.weight`) under tensor_refs.LLM.

Owns: where an LLM's names start in any file people share -- a diffusers `text_encoder/` saved from the model
(`layers.*`) or from its ForCausalLM (`model.layers.*`; `lm_head` is left out), ComfyUI's separate
text-encoder files (`model.*`, e.g. qwen_3_4b.safetensors) and its all-in-one files
(`text_encoders.<name>.transformer.model.*`) -- and their mapping to the canonical names.
"""
from __future__ import annotations

from .tensor_refs import LLM, is_weight_key

MARKER = "layers.0.mlp.gate_proj.weight"     # SwiGLU's gate: no CLIP, T5 or DiT names it


def llm_prefix(keys) -> str | None:
    """The prefix an LLM's HF names follow in these keys, or None when they hold none."""
    hit = next((k for k in keys if k.endswith(MARKER) and (k == MARKER or k[-len(MARKER) - 1] == ".")), None)
    return None if hit is None else hit[:-len(MARKER)]


def llm_names(keys, prefix: str) -> dict[str, str]:
    """key -> canonical name, for the keys under `prefix` (a CausalLM's lm_head lies outside it)."""
    return {k: LLM + k[len(prefix):] for k in keys if k.startswith(prefix) and is_weight_key(k)
            and k[len(prefix):] != "lm_head.weight"}
