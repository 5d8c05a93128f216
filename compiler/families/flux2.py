"""FLUX.2 (Black Forest Labs' klein 4B / 9B, distilled and base, and dev): everything the compiler knows about it.

Owns: the evidence in a checkpoint's header (the transformer's shared single_stream_modulation, in diffusers names
after compiler/sources/flux2_names.py; dev told by its guidance embedder; klein base told from the distilled model
by a diffusers folder's model_index.json `is_distilled`, the weights being alike), its components (the LLM text
encoder, told by its shapes: a Qwen3 -- q_norm -- read at hidden_states 9, 18 and 27 as Flux2KleinPipeline reads
it, else Mistral-Small-3.2's text model read at 10, 20 and 30 as Flux2Pipeline reads dev's, stacked:
compiler/graphs/llm_encoder.py; the transformer: compiler/graphs/flux2.py; the FLUX.2 VAE with its latents'
batch-norm statistics: compiler/graphs/flux2_vae.py), how the parts must fit (the transformer packs 2x2 patches of
the VAE's latent channels and reads the stacked states' width; the tokenizer is there), the tiny demos' RoPE split,
its diffusers folder layout (Flux2KleinPipeline) and its OpenVINO GenAI folder (klein).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..graphs import flux2, flux2_vae, ldm_vae, llm_encoder, vae_segments
from ..sources.llm_tokenizer_files import llm_tokenizer_files
from ..sources.tensor_refs import DIT, LLM, VAE, Checkpoint
from .family import Component, Detected, Diffusers, Family, GenAI
from .shared import FLOW_EULER, FLOW_SCHEDULER, QWEN3_CHAT, QWEN_TOKENIZER

LOOKED_FOR = "single_stream_modulation.* (FLUX.2)"
TE_HINT = ("FLUX.2 split files ship the text encoder on its own: pass it with --text-encoder (klein 4B: "
           "qwen_3_4b.safetensors, 9B: qwen_3_8b, dev: mistral_3_small_flux2_bf16.safetensors; recipe: "
           "model.text_encoders)")
# (hidden_states read, RoPE theta, RMSNorm eps) where the checkpoint carries no config: Flux2KleinPipeline's
# text_encoder_out_layers over Qwen3-4B / -8B (36 layers), Flux2Pipeline's over Mistral-Small-3.2's 40
QWEN3 = ((9, 18, 27), 1_000_000.0, 1e-6)
MISTRAL = ((10, 20, 30), 1_000_000_000.0, 1e-5)
GUIDANCE_KEY = DIT + "time_guidance_embed.guidance_embedder.linear_1.weight"


def text_encoder_config(g, config_json: dict, overrides: dict) -> llm_encoder.LLMConfig:
    """klein's Qwen3 (QK norms) or dev's Mistral text model (none), told by its names."""
    reads, theta, eps = QWEN3 if g.has("layers.0.self_attn.q_norm.weight") else MISTRAL
    return llm_encoder.llm_config(g, config_json, overrides, reads=reads, theta=theta, eps=eps)


TEXT_ENCODER = Component("text_encoder", (LLM,), "text_encoder", text_encoder_config, llm_encoder.build_llm_encoder,
                         config_file="llm", missing_hint=TE_HINT, tokenizer="qwen2")
TRANSFORMER = Component("transformer", (DIT,), "transformer", flux2.flux2_config, flux2.build_flux2)
VAES = {"vae_encoder": Component("vae_encoder", (VAE,), "vae", flux2_vae.flux2_vae_config, ldm_vae.build_vae_encoder,
                                 (VAE + "encoder.", VAE + "quant_conv.")),
        "vae_decoder": Component("vae_decoder", (VAE,), "vae", flux2_vae.flux2_vae_config, ldm_vae.build_vae_decoder,
                                 (VAE + "decoder.", VAE + "post_quant_conv.")),
        "vae_encoder_tiled": Component("vae_encoder_tiled", (VAE,), "vae", flux2_vae.flux2_vae_config,
                                       vae_segments.build_vae_encoder_tiled,
                                       (VAE + "encoder.", VAE + "quant_conv."), optional=True),
        "vae_decoder_tiled": Component("vae_decoder_tiled", (VAE,), "vae", flux2_vae.flux2_vae_config,
                                       vae_segments.build_vae_decoder_tiled,
                                       (VAE + "decoder.", VAE + "post_quant_conv."), optional=True)}
DEMO = {"transformer": {"axes_dims_rope": [4, 4, 4, 4]}}   # the tiny demo's 16-wide heads


def detect(ckpt: Checkpoint) -> Detected | None:
    if DIT + "single_stream_modulation.linear.weight" not in ckpt.refs:
        return None
    if GUIDANCE_KEY in ckpt.refs:
        return Detected("flux2", "dev", "single_stream_modulation + guidance_embedder (FLUX.2 dev)")
    distilled = (ckpt.configs.get("model_index") or {}).get("is_distilled", True) is not False
    return Detected("flux2", "klein" if distilled else "klein-base", "single_stream_modulation (FLUX.2)"
                    + ("" if distilled else ", model_index.json is_distilled false"))


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The transformer packs 2x2 patches of the VAE's latent channels and reads the stacked states' width; the
    tokenizer is there."""
    dit, te = configs.get("transformer"), configs.get("text_encoder")
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if dit and vae and dit["in_channels"] != 4 * vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent "
                       f"channels; the FLUX.2 transformer reads {dit['in_channels']} = 4 x {dit['in_channels'] // 4}: "
                       "give the model's own VAE (flux2-vae.safetensors, 32 channels) with --vae")
    if dit and te and te["hidden"] * len(te["reads"]) != dit["context_dim"]:
        raise BadInput(f"{path}: the text encoder is {te['hidden']} wide ({len(te['reads'])} layers stacked: "
                       f"{te['hidden'] * len(te['reads'])}); the FLUX.2 transformer's context_embedder reads "
                       f"{dit['context_dim']} (klein 4B: Qwen3-4B, 3 x 2560; 9B: Qwen3-8B, 3 x 4096; dev: "
                       "Mistral-Small-3.2, 3 x 5120): give the text encoder the model was trained with")
    if te:
        llm_tokenizer_files(Path(path))


def _transformer_fields(cfg: dict) -> dict:
    """Flux2Transformer2DModel's config fields (precast feeds packed tokens: patch_size 1)."""
    return dict(patch_size=1, in_channels=cfg.get("in_channels"), num_layers=cfg.get("depth"),
                num_single_layers=cfg.get("depth_single"), attention_head_dim=cfg.get("head_dim"),
                num_attention_heads=cfg.get("heads"), joint_attention_dim=cfg.get("context_dim"),
                axes_dims_rope=cfg.get("axes_dim"), rope_theta=cfg.get("theta"),
                guidance_embeds=bool(cfg.get("guidance")))


def _genai_text_states(ov, model, reads: list[int]):
    """The text encoder with one output per hidden state, `hidden_states.0` (the embeddings) up to the deepest
    read, in index order: OpenVINO GenAI's Flux2KleinPipeline reads `hidden_states.N` by name (and stacks those of
    config.json's hidden_states_layers, as precast's graph stacks them), optimum-intel's pipeline indexes the list
    of `hidden_states*` outputs by N. precast's graph outputs the read states concatenated; the others are on the
    residual stream it already computes: each layer's state is the second of two residual Adds whose first input
    is the previous state (compiler/graphs/llm_encoder.py), walked back from the deepest read and checked against
    the ones read."""
    from openvino import opset13 as ops
    (out,) = model.outputs
    node = out.get_node().input_value(0).get_node()
    read = list(node.input_values()) if len(reads) > 1 else [out.get_node().input_value(0)]
    states, x = {}, read[reads.index(max(reads))]
    for i in range(max(reads), 0, -1):
        states[i] = x
        for _ in range(2):
            if x.get_node().get_type_name() != "Add":
                x = None
                break
            x = x.get_node().input_value(0)
        if x is None:
            break
    first = x.get_node() if x is not None else None
    if first is not None and first.get_type_name() == "Convert":
        first = first.input_value(0).get_node()
    if first is None or first.get_type_name() != "Gather" or any(states.get(r) != p for r, p in zip(reads, read)):
        raise BadInput("the FLUX.2 text encoder's graph is not the one this precast writes (its residual stream "
                       "cannot be followed from the states it reads); export it again with this precast version")
    states[0] = x
    out.get_node().input_value(0).get_tensor().set_names(set())
    results = []
    for i in range(max(reads) + 1):
        states[i].get_tensor().set_names({f"hidden_states.{i}"})
        results.append(ops.result(states[i]))
    return ov.Model(results, model.get_parameters(), model.get_friendly_name())


def _genai_adapt(ov, name: str, model, config: dict, report: dict):
    """OpenVINO GenAI's Flux2KleinPipeline (and optimum-intel's) read the text encoder's states one output per
    layer and feed the transformer batched position ids."""
    from ..ov_io import batched_inputs
    if name == "text_encoder":
        return _genai_text_states(ov, model, list(config["reads"]))
    if name == "transformer":
        return batched_inputs(ov, model, ("img_ids", "txt_ids"))
    return model


def _genai_files(files: dict, configs: dict, report: dict) -> None:
    """What Flux2KleinPipeline reads beyond diffusers' fields: the layers it stacks, the latents' batch-norm
    statistics (precast keeps the std: written as the variance with eps 0) and the schedule's empirical mu
    (GenAI's time_shift_type "exponential")."""
    files["text_encoder/config.json"]["hidden_states_layers"] = list(configs["text_encoder"]["reads"])
    vae = configs["vae_decoder"]
    files["vae_decoder/config.json"].update(
        bn_running_mean_data=list(vae["latents_bn_mean"]), bn_running_var_data=[s * s for s in vae["latents_bn_std"]],
        batch_norm_eps=0.0, patch_size=[2, 2])
    if (report.get("scheduler") or {}).get("dynamic_mu") == "empirical":
        files["scheduler/scheduler_config.json"]["time_shift_type"] = "exponential"


GENAI = GenAI({"_class_name": "Flux2KleinPipeline", "scheduler": FLOW_EULER, "tokenizer": QWEN_TOKENIZER,
               "text_encoder": ["transformers", "Qwen3ForCausalLM"], "vae": ["diffusers", "AutoencoderKLFlux2"],
               "transformer": ["diffusers", "Flux2Transformer2DModel"]},
              spacing="1/steps", text_inputs=("input_ids", "attention_mask"), adapt=_genai_adapt, files=_genai_files,
              chat_template=QWEN3_CHAT,
              variants={"klein": {"is_distilled": True}, "klein-base": {"is_distilled": False},
                        "dev": "OpenVINO GenAI 2026.4 has no FLUX.2 dev pipeline (its Flux2KleinPipeline reads a "
                               "Qwen3 text encoder, not dev's Mistral), so export-openvino-genai cannot write one"})


FAMILIES = (
    Family("flux2", {"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER, **VAES},
           Diffusers("Flux2KleinPipeline", FLOW_SCHEDULER, 128, transformer="Flux2Transformer2DModel",
                     transformer_fields=_transformer_fields,
                     variants={"dev": {"_class_name": "Flux2Pipeline",
                                       "tokenizer": ["transformers", "LlamaTokenizerFast"]}}),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts,
           demos={"demo:tiny-flux2-klein": DEMO, "demo:tiny-flux2-dev": DEMO},
           genai=GENAI),
)
