"""What a bundle's text encoders need besides their sessions: their tokenizers and the state they hand on.

Owns: the tokenizers a bundle carries (CLIP's BPE, T5's sentencepiece model, an LLM's tokenizer.json, each
file checked against the manifest before it is read), the bundle's textual-inversion embeddings registered
with every CLIP encoder's tokenizer (runtime/embeddings.py), and which of a text encoder's outputs the
denoiser reads (`text_state_name`). Used by runtime/loading.py's BundleModel and the family pipelines.
Imports the runtime's own modules only; never the compiler.
"""
from __future__ import annotations

from .embeddings import read_bundle_embeddings, register_embeddings
from .errors import UserError
from .llm_tokenizer import FOLDER_FILES as LLM_FILES, LLMTokenizer
from .t5_tokenizer import FOLDER_FILES as T5_FILES, T5Tokenizer
from .tokenizer import FOLDER_FILES as CLIP_FILES, ClipTokenizer

TOKENIZER_FOLDER = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}


def text_state_name(outputs, config: dict, penultimate: bool) -> str:
    """Which of a text encoder's outputs the denoiser reads, chosen by name, never by position (SDXL's and
    SD3's CLIP graphs output every layer's hidden state, as optimum's export does): the one the export
    recorded (config `hidden_name`); else, for a graph without that record (an older precast export, a
    foreign optimum export), with `penultimate` (SDXL, SD3) the only hidden_states.* output or
    hidden_states.{layers - 1}, without it last_hidden_state."""
    names = list(outputs)
    recorded = config.get("hidden_name")
    if recorded in names:
        return recorded
    states = [n for n in names if n.startswith("hidden_states.")]
    if penultimate and states:
        if len(states) == 1:
            return states[0]
        layers = config.get("layers") or config.get("num_hidden_layers")
        if layers and f"hidden_states.{int(layers) - 1}" in names:
            return f"hidden_states.{int(layers) - 1}"
    if "last_hidden_state" in names:
        return "last_hidden_state"
    raise UserError(f"the text encoder's outputs {names} name no hidden state precast can read"
                    + (f" (the export recorded {recorded})" if recorded else ""))


def load_tokenizer(manifest, folder: str):
    """The bundle's tokenizer in `folder`, every file it reads checked against the manifest first
    (vocab.json and merges.txt must be listed: a missing one would silently mean other ids)."""
    for name in CLIP_FILES:
        manifest.check_file(f"{folder}/{name}", required=name in ("vocab.json", "merges.txt"))
    try:
        return ClipTokenizer.from_folder(manifest.root / folder)
    except (OSError, ValueError) as e:
        raise UserError(f"{manifest.root}/{folder}: not a readable tokenizer ({e})") from None


def is_t5(manifest, comp: str) -> bool:
    """A T5 text encoder (Flux, Chroma): its input_ids run over the T5 length."""
    return any("t5_sequence" in (i.get("shape") or []) for i in manifest.components[comp].get("inputs", []))


def load_t5_tokenizer(manifest, folder: str):
    """The bundle's T5 tokenizer (sentencepiece model), checked against the manifest first."""
    for name in T5_FILES:
        manifest.check_file(f"{folder}/{name}", required=name == "spiece.model")
    return T5Tokenizer.from_folder(manifest.root / folder)


def is_llm(manifest, comp: str) -> bool:
    """An LLM text encoder (Z-Image's Qwen3): its input_ids run over `llm_sequence`."""
    return any("llm_sequence" in (i.get("shape") or []) for i in manifest.components[comp].get("inputs", []))


def load_llm_tokenizer(manifest, folder: str):
    """The bundle's LLM tokenizer (tokenizer.json), checked against the manifest first."""
    for name in LLM_FILES:
        manifest.check_file(f"{folder}/{name}", required=name == "tokenizer.json")
    return LLMTokenizer.from_folder(manifest.root / folder)


def bundle_tokenizers(manifest, needed) -> tuple[dict, dict]:
    """({text encoder: tokenizer}, {text encoder: Embeddings}) for the text encoders in `needed`; each
    embedding file is checked and read once, then registered with every CLIP encoder's tokenizer
    (T5 encoders take no textual-inversion vectors)."""
    tokenizers, embeddings, items = {}, {}, None
    for comp in (c for c in needed if c.startswith("text_encoder")):
        if is_t5(manifest, comp):
            tokenizers[comp] = load_t5_tokenizer(manifest, TOKENIZER_FOLDER[comp])
            continue
        if is_llm(manifest, comp):
            tokenizers[comp] = load_llm_tokenizer(manifest, TOKENIZER_FOLDER[comp])
            continue
        tok = tokenizers[comp] = load_tokenizer(manifest, TOKENIZER_FOLDER[comp])
        if items is None:
            items = read_bundle_embeddings(manifest)
        vocab = manifest.components[comp].get("config", {}).get("vocab")
        embeddings[comp] = register_embeddings(items, tok, vocab)
    return tokenizers, embeddings
