"""Diffusers-style pipeline folders: what other tools need beside precast's ONNX graphs.

Owns: turning what an export already records (precast_export.json, or a bundle manifest's model +
components) into `model_index.json`, `scheduler/scheduler_config.json`, each component's
`config.json` in diffusers / transformers form, and complete tokenizer folders, so that
optimum's ORT*Pipeline, diffusers' OnnxStableDiffusionPipeline and optimum-intel load a precast
export or a bundle's `onnx/` folder as written. What differs per family (pipeline and scheduler
classes, sample size, flags, the transformer's class and fields) is the family's `Diffusers` record
(compiler/families/); its tokenizers follow its text encoders. Component configs carry the fields
those tools read; fields the graphs do not record (the VAE's block widths, which UNet levels attend)
are nominal, marked `_precast_nominal`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..runtime.manifest import file_record
from ..runtime.previews import PREVIEW_DECODER
from ..runtime.vae_segments import TILED
from .bundle_writer import BundleWriter, add_llm_tokenizer, add_t5_tokenizer, add_tokenizer
from .families import FAMILIES
from .families.shared import CLIP_TOKENIZER, DPM_SOLVER, QWEN2_TOKENIZER, T5_TOKENIZER

ONNX_PART = ["diffusers", "OnnxRuntimeModel"]
DIFFUSERS_VERSION = "0.30.0"
TOKENIZER_CLASS = {"clip": CLIP_TOKENIZER, "openclip": CLIP_TOKENIZER, "t5": T5_TOKENIZER, "qwen2": QWEN2_TOKENIZER}


def model_index(model: dict, components: list[str]) -> dict:
    """model_index.json: the pipeline class and where each part comes from."""
    family = FAMILIES[model["family"]]
    spec = family.diffusers
    out = {"_class_name": spec.pipeline, "_diffusers_version": DIFFUSERS_VERSION,
           "scheduler": ["diffusers", spec.scheduler],
           **{n: list(TOKENIZER_CLASS[kind]) for n, kind in family.tokenizers().items()}}
    out.update({name: [None, None] for name, c in family.components.items() if not c.optional})  # parts not in it
    out.update({name: list(ONNX_PART) for name in components})
    out.update({k: list(v) if isinstance(v, list) else v
                for k, v in {**spec.index, **spec.variants.get(model.get("variant") or "", {})}.items()})
    return out


def scheduler_config(model: dict) -> dict:
    """`precast generate --scheduler dpm++2m`'s schedule in diffusers' form (DPM-Solver++ 2M, `leading`
    spacing; flow families: their FlowMatch schedule). Not Euler, precast's default: diffusers'
    numpy OnnxStableDiffusionPipeline cannot multiply its latents by Euler's tensor init_noise_sigma."""
    family = FAMILIES[model["family"]]
    if family.diffusers.scheduler == DPM_SOLVER:
        return {"_class_name": "DPMSolverMultistepScheduler", "_diffusers_version": DIFFUSERS_VERSION,
                "algorithm_type": "dpmsolver++", "solver_order": 2, "solver_type": "midpoint",
                "lower_order_final": True, "final_sigmas_type": "zero", "use_karras_sigmas": False,
                "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                "beta_schedule": "scaled_linear", "trained_betas": None,
                "prediction_type": model.get("prediction", "epsilon"), "timestep_spacing": "leading",
                "steps_offset": 1, "thresholding": False}
    released = family.flow(model.get("variant", ""))
    sched = dict(model.get("scheduler") or (released.scheduler if released else {}))
    out = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": DIFFUSERS_VERSION,
           "num_train_timesteps": 1000, "shift": sched.get("shift", 1.0),
           "use_dynamic_shifting": sched.get("use_dynamic_shifting", False)}
    for k in ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len", "shift_terminal"):
        if k in sched:
            out[k] = sched[k]
    return out


def clip_text_config(cfg: dict) -> dict:
    """transformers CLIPTextConfig (with projection where the graph outputs text_embeds)."""
    projected = cfg.get("pooled") == "text_embeds"
    return {"architectures": ["CLIPTextModelWithProjection" if projected else "CLIPTextModel"],
            "model_type": "clip_text_model", "vocab_size": cfg["vocab"], "hidden_size": cfg["hidden"],
            "intermediate_size": cfg["intermediate"], "num_hidden_layers": cfg["layers"],
            "num_attention_heads": cfg["heads"], "max_position_embeddings": cfg["max_positions"],
            "hidden_act": cfg["activation"], "layer_norm_eps": cfg["eps"],
            "projection_dim": cfg.get("projection") or cfg["hidden"], "bos_token_id": 49406,
            "eos_token_id": cfg["eos_token_id"], "pad_token_id": 1, "torch_dtype": "float32"}


def t5_config(cfg: dict) -> dict:
    """transformers T5Config (encoder only). num_decoder_layers is the value T5Config itself defaults to
    (num_layers); optimum's ORTTextEncoder reads it as the layer count of a config without num_hidden_layers."""
    return {"architectures": ["T5EncoderModel"], "model_type": "t5", "vocab_size": cfg["vocab"],
            "d_model": cfg["d_model"], "d_kv": cfg["d_kv"], "d_ff": cfg["d_ff"], "num_layers": cfg["layers"],
            "num_decoder_layers": cfg["layers"],
            "num_heads": cfg["heads"], "relative_attention_num_buckets": cfg["buckets"],
            "relative_attention_max_distance": cfg["max_distance"], "layer_norm_epsilon": cfg["eps"],
            "feed_forward_proj": "gated-gelu" if cfg.get("gated", True) else "relu",
            "is_gated_act": bool(cfg.get("gated", True)), "dense_act_fn": "gelu_new" if cfg.get("gated", True) else "relu"}


def llm_config(cfg: dict) -> dict:
    """transformers' config of the LLM text encoder, all its layers (precast's graph runs those it reads): Qwen3's
    (QK norms), Qwen2's (q/k/v biases: Qwen2.5's text model) or Mistral's (neither)."""
    model, kind = ("Qwen3Model", "qwen3") if cfg.get("qk_norm") else ("Qwen2Model", "qwen2") if cfg.get("qkv_bias") \
        else ("MistralModel", "mistral")
    return {"architectures": [model], "model_type": kind, "vocab_size": cfg["vocab"],
            "hidden_size": cfg["hidden"], "intermediate_size": cfg["intermediate"], "num_hidden_layers": cfg["layers"],
            "num_attention_heads": cfg["heads"], "num_key_value_heads": cfg["kv_heads"], "head_dim": cfg["head_dim"],
            "rope_theta": cfg["theta"], "rms_norm_eps": cfg["eps"], "attention_bias": cfg["qkv_bias"],
            "hidden_act": "silu", "torch_dtype": "float32"}


def unet_config(cfg: dict, model: dict) -> dict:
    """diffusers UNet2DConditionModel config from the LDM layout precast records."""
    levels, channels = cfg["levels"], cfg["channels"]
    n = max(levels) + 1
    widths = [[c for c, lv in zip(channels, levels) if lv == i][-1] for i in range(n)]
    per_level = levels.count(0) - 1
    spec = FAMILIES[model["family"]].diffusers
    attends = [i != spec.unet_plain_level % n for i in range(n)]
    out = {"_class_name": "UNet2DConditionModel", "_diffusers_version": DIFFUSERS_VERSION,
           "in_channels": cfg["in_channels"], "out_channels": cfg["out_channels"],
           "sample_size": spec.sample_size, "block_out_channels": widths,
           "layers_per_block": per_level, "cross_attention_dim": cfg["context_dim"],
           "attention_head_dim": cfg["num_heads"],   # diffusers' name for the head count
           "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attends],
           "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attends)],
           "use_linear_projection": cfg["use_linear_projection"], "norm_num_groups": cfg["groups"],
           "norm_eps": cfg["norm_eps"], "flip_sin_to_cos": cfg["flip_sin_to_cos"], "freq_shift": cfg["freq_shift"],
           "downsample_padding": cfg["downsample_padding"], "center_input_sample": cfg["center_input_sample"],
           "time_cond_proj_dim": None, "_precast_nominal": ["down_block_types", "up_block_types"]}
    if cfg.get("time_ids"):
        out.update(addition_embed_type="text_time", addition_time_embed_dim=cfg["time_id_dim"],
                   projection_class_embeddings_input_dim=cfg["adm_in_channels"])
    return out


def vae_config(cfg: dict, model: dict) -> dict:
    """diffusers AutoencoderKL config; the level count (hence the latent factor) is exact, the widths nominal."""
    n = cfg["decoder_levels"]
    if "latents_mean" in cfg:       # Qwen-Image's causal 3-D VAE: its latents' statistics are what pipelines read
        return {"_class_name": "AutoencoderKLQwenImage", "_diffusers_version": DIFFUSERS_VERSION,
                "z_dim": cfg["latent_channels"], "latents_mean": cfg["latents_mean"], "latents_std": cfg["latents_std"],
                "precast": cfg}
    spec = FAMILIES[model["family"]].diffusers
    widths = ([128, 256, 512, 512] + [512] * n)[:n]
    out = {"_class_name": "AutoencoderKL", "_diffusers_version": DIFFUSERS_VERSION,
           "in_channels": cfg["image_channels"], "out_channels": cfg["image_channels"],
           "latent_channels": cfg["latent_channels"], "block_out_channels": widths,
           "down_block_types": ["DownEncoderBlock2D"] * cfg["encoder_levels"],
           "up_block_types": ["UpDecoderBlock2D"] * n, "layers_per_block": 2, "norm_num_groups": cfg["groups"],
           "act_fn": "silu", "sample_size": spec.sample_size * 2 ** (n - 1),
           "scaling_factor": model.get("latent_scale"), "force_upcast": spec.vae_force_upcast,
           "_precast_nominal": ["block_out_channels"]}
    if model.get("latent_shift") is not None:
        out["shift_factor"] = model["latent_shift"]
    return out


def transformer_config(cfg: dict, model: dict) -> dict:
    """FluxTransformer2DModel / SD3Transformer2DModel: the diffusers fields pipelines read (in_channels,
    joint_attention_dim; the family's own: Flux's guidance_embeds, SD3's patch_size and sample_size), then
    precast's own record."""
    spec = FAMILIES[model["family"]].diffusers
    out = {"_class_name": spec.transformer,
           "_diffusers_version": DIFFUSERS_VERSION, "in_channels": cfg.get("in_channels"),
           "out_channels": cfg.get("out_channels"), "joint_attention_dim": cfg.get("context_dim"),
           "num_attention_heads": cfg.get("heads"), "attention_head_dim": cfg.get("head_dim"), "precast": cfg}
    out.update(spec.transformer_fields(cfg))
    return out


def component_config(name: str, cfg: dict, model: dict) -> dict:
    if name.startswith("text_encoder"):
        return clip_text_config(cfg) if "layout" in cfg else llm_config(cfg) if "kv_heads" in cfg else t5_config(cfg)
    if name == "unet":
        return unet_config(cfg, model)
    if name.startswith("vae_"):
        return vae_config(cfg, model)
    return transformer_config(cfg, model)


def pipeline_files(model: dict, components: dict[str, dict]) -> dict[str, dict]:
    """relative path -> JSON data: every file of the folder except the graphs and tokenizers.
    `model`: family, prediction, latent_scale[, latent_shift, scheduler]; `components`: name -> config
    (ControlNets, the preview decoder and the tiled VAE components, which no diffusers pipeline folder of these
    classes holds, are left out)."""
    components = {n: c for n, c in components.items()
                  if not n.startswith("controlnet_") and n != PREVIEW_DECODER and n not in TILED.values()}
    files = {"model_index.json": model_index(model, sorted(components)),
             "scheduler/scheduler_config.json": scheduler_config(model)}
    for name, cfg in components.items():
        files[f"{name}/config.json"] = component_config(name, cfg, model)
    return files


def tokenizer_extras(kind: str, pad_zero: bool) -> dict[str, dict]:
    """tokenizer_config.json fields and special_tokens_map.json for a CLIP tokenizer folder."""
    if TOKENIZER_CLASS[kind] != CLIP_TOKENIZER:
        return {}
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "!" if pad_zero else "<|endoftext|>"}
    return {"tokenizer_config.json": {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77,
                                      "do_lower_case": True, "clean_up_tokenization_spaces": True, **special},
            "special_tokens_map.json": special}


def write_json(path: Path, data: dict) -> Path:
    """Written to a temporary name and renamed over `path`: a bundle's file may be a hard link into
    the cache (an export entry holds its config.json too), which must never be written in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def complete_tokenizer(folder: Path, kind: str, pad_zero: bool) -> list[Path]:
    """Add what transformers needs to a tokenizer folder (its own tokenizer_config.json fields kept)."""
    written = []
    for name, data in tokenizer_extras(kind, pad_zero).items():
        path = folder / name
        mine = json.loads(path.read_text()) if path.is_file() else {}
        written.append(write_json(path, {**data, **mine}))
    return written


def write_pipeline_folder(root: Path, model: dict, components: dict[str, dict], source: Path,
                          writer=None) -> list[Path]:
    """Write the pipeline files and tokenizers into `root` (an export, or a bundle's onnx/ with its
    BundleWriter `writer`, which records them); returns the paths written."""
    root = Path(root)
    family = FAMILIES.get(model.get("family"))
    if family is None:
        return []
    written = [write_json(root / rel, data) for rel, data in pipeline_files(model, components).items()]
    writer = writer or BundleWriter(root)
    prefix = root.relative_to(writer.root).as_posix() if root != writer.root else ""
    for folder, kind in family.tokenizers().items():
        rel = f"{prefix}/{folder}" if prefix else folder
        pad_zero = kind == "openclip"
        if kind == "t5":
            add_t5_tokenizer(writer, Path(source), rel, source_folder=folder)
        elif kind == "qwen2":       # read from beside the model: only when its text encoder is exported too
            if folder.replace("tokenizer", "text_encoder") not in components:
                continue
            add_llm_tokenizer(writer, Path(source), rel, source_folder=folder)
        else:
            add_tokenizer(writer, Path(source), rel, pad_zero=pad_zero, source_folder=folder)
            written += complete_tokenizer(root / folder, kind, pad_zero)
        written += sorted((root / folder).iterdir())
    for p in written:
        writer.files[p.relative_to(writer.root).as_posix()] = file_record(p)
    return sorted(set(written))
