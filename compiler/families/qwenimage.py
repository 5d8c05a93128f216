"""Qwen-Image (Alibaba's 20 B text-to-image MMDiT): everything the compiler knows about it.

Owns: the evidence in a checkpoint's header (the transformer's txt_norm beside img_mod.1 blocks, diffusers names;
the edit / layered variants refused by their names), its components (Qwen2.5-VL's text model read at its last
hidden state, after the final norm: compiler/graphs/llm_encoder.py; the transformer: compiler/graphs/qwenimage.py;
the Qwen-Image VAE on one frame with its latents' statistics: compiler/graphs/qwenimage_vae.py, in diffusers names
or Wan's: compiler/sources/qwen_vae_names.py), how the parts must fit (the transformer packs 2x2 patches of the
VAE's latent channels and reads the text model's width; the tokenizer is there), the tiny demo's RoPE split, and its
diffusers and OpenVINO GenAI folder layouts (QwenImagePipeline).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from ..errors import BadInput
from ..graphs import llm_encoder, qwenimage, qwenimage_vae
from ..sources.llm_tokenizer_files import llm_tokenizer_files
from ..sources.tensor_refs import DIT, LLM, VAE, Checkpoint
from .family import Component, Detected, Diffusers, Family, GenAI
from .shared import FLOW_EULER, FLOW_SCHEDULER, QWEN_TOKENIZER

LOOKED_FOR = "txt_norm.* + transformer_blocks.0.img_mod.* (Qwen-Image)"
TE_HINT = ("Qwen-Image split files ship the Qwen2.5-VL text encoder on its own: pass it with --text-encoder "
           "qwen_2.5_vl_7b.safetensors (recipe: model.text_encoders)")
QWEN25_THETA = 1_000_000.0      # Qwen2.5-VL-7B's rope_theta, where its config.json is not at hand
TEXT_ENCODER = Component("text_encoder", (LLM,), "text_encoder",
                         partial(llm_encoder.llm_config, reads=(-1,), theta=QWEN25_THETA),
                         llm_encoder.build_llm_encoder,
                         config_file="llm", missing_hint=TE_HINT, tokenizer="qwen2")
TRANSFORMER = Component("transformer", (DIT,), "transformer", qwenimage.qwenimage_config, qwenimage.build_qwenimage)
VAES = {"vae_encoder": Component("vae_encoder", (VAE,), "vae", qwenimage_vae.qwen_vae_config,
                                 qwenimage_vae.build_qwen_vae_encoder, (VAE + "encoder.", VAE + "quant_conv.")),
        "vae_decoder": Component("vae_decoder", (VAE,), "vae", qwenimage_vae.qwen_vae_config,
                                 qwenimage_vae.build_qwen_vae_decoder, (VAE + "decoder.", VAE + "post_quant_conv."))}
DEMO = {"transformer": {"axes_dims_rope": [4, 6, 6]}}   # the tiny demo's 16-wide heads


def detect(ckpt: Checkpoint) -> Detected | None:
    if DIT + "txt_norm.weight" not in ckpt.refs or DIT + "transformer_blocks.0.img_mod.1.weight" not in ckpt.refs:
        return None
    return Detected("qwenimage", "base", "txt_norm + transformer_blocks.0.img_mod.1 (Qwen-Image)")


def check_parts(family: Family, configs: dict[str, dict], path: str, vae_file: str | None) -> None:
    """The transformer packs 2x2 patches of the VAE's latent channels and reads the text model's width; the
    tokenizer is there."""
    dit, te = configs.get("transformer"), configs.get("text_encoder")
    vae = configs.get("vae_decoder") or configs.get("vae_encoder")
    if dit and vae and dit["in_channels"] != 4 * vae["latent_channels"]:
        raise BadInput(f"{f'--vae {vae_file}' if vae_file else path}: the VAE has {vae['latent_channels']} latent "
                       f"channels; the Qwen-Image transformer reads {dit['in_channels']} = 4 x "
                       f"{dit['in_channels'] // 4}: give the model's own VAE (the folder's vae/, 16 channels) with "
                       "--vae")
    if dit and te and te["hidden"] != dit["context_dim"]:
        raise BadInput(f"{path}: the text encoder is {te['hidden']} wide; the Qwen-Image transformer's txt_in reads "
                       f"{dit['context_dim']} (Qwen2.5-VL-7B: 3584): give the text encoder the model was trained with")
    if te:
        llm_tokenizer_files(Path(path))


def _transformer_fields(cfg: dict) -> dict:
    """QwenImageTransformer2DModel's config fields."""
    return dict(patch_size=2, in_channels=cfg.get("in_channels"), out_channels=(cfg.get("out_channels") or 0) // 4,
                num_layers=cfg.get("depth"), attention_head_dim=cfg.get("head_dim"),
                num_attention_heads=cfg.get("heads"), joint_attention_dim=cfg.get("context_dim"),
                axes_dims_rope=cfg.get("axes_dim"))


def _genai_positions(ov, height, width, text):
    """precast's img_ids [rows cols, 3] and txt_ids [T, 3] computed in the graph from the packed grid's height and
    width (int64 scalars, as GenAI's QwenImagePipeline feeds them) and the text length (`text`'s dim 1), as
    runtime/families/qwenimage.py's latent_ids and text_ids make them."""
    import numpy as np
    from openvino import opset13 as ops
    i64, f32 = ov.Type.i64, ov.Type.f32
    c = lambda v: ops.constant(np.array(v, np.int64))
    half_h, half_w = ops.divide(height, c(2)), ops.divide(width, c(2))
    rows = ops.subtract(ops.range(c(0), height, c(1), i64), ops.subtract(height, half_h))
    cols = ops.subtract(ops.range(c(0), width, c(1), i64), ops.subtract(width, half_w))
    grid = ops.concat([ops.unsqueeze(height, c([0])), ops.unsqueeze(width, c([0]))], 0)
    row = ops.broadcast(ops.unsqueeze(ops.convert(rows, f32), c([1])), grid)
    col = ops.broadcast(ops.unsqueeze(ops.convert(cols, f32), c([0])), grid)
    zero = ops.broadcast(ops.constant(np.float32(0)), grid)
    img = ops.reshape(ops.concat([ops.unsqueeze(a, c([2])) for a in (zero, row, col)], 2), c([-1, 3]), False)
    length = ops.gather(ops.shape_of(text, i64), c(1), c(0))
    t = ops.convert(ops.add(ops.range(c(0), length, c(1), i64), ops.maximum(half_h, half_w)), f32)
    txt = ops.broadcast(ops.unsqueeze(t, c([1])), ops.concat([ops.unsqueeze(length, c([0])), c([3])], 0))
    return img.output(0), txt.output(0)


def _genai_adapt(ov, name: str, model, config: dict, report: dict):
    """OpenVINO GenAI's QwenImagePipeline feeds the transformer the packed grid's height and width (int64
    scalars) where precast's graph takes position ids, an int64 text mask, and a 5-D single-frame VAE."""
    from ..ov_io import computed_inputs, parameter, retype, single_frame
    if name == "text_encoder":
        model.output(0).get_tensor().add_names({"last_hidden_state"})     # optimum's name; GenAI reads output 0
    elif name == "transformer":
        model = retype(ov, model, {"encoder_hidden_states_mask": ov.Type.i64})
        height, width = (parameter(ov, n, ov.Type.i64, []) for n in ("height", "width"))
        img, txt = _genai_positions(ov, height.output(0), width.output(0), model.input("encoder_hidden_states"))
        model = computed_inputs(model, [height, width], {"img_ids": img, "txt_ids": txt})
    elif name in ("vae_decoder", "vae_encoder"):
        model = single_frame(ov, model)
    return model


def _genai_files(files: dict, configs: dict, report: dict) -> None:
    """What QwenImagePipeline reads beyond diffusers' fields: the VAE's factor as 2 ** len(temperal_downsample)
    (precast's VAE halves decoder_levels - 1 times; the released one's flags are [False, True, True]) and its
    input channels."""
    levels = int(configs["vae_decoder"]["decoder_levels"]) - 1
    for name in ("vae_decoder", "vae_encoder"):
        if f"{name}/config.json" in files:
            files[f"{name}/config.json"].update(temperal_downsample=[False] + [True] * (levels - 1), input_channels=3)
    files["transformer/config.json"].update(guidance_embeds=False, sample_size=128)


GENAI = GenAI({"_class_name": "QwenImagePipeline", "scheduler": FLOW_EULER, "tokenizer": QWEN_TOKENIZER,
               "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
               "transformer": ["diffusers", "QwenImageTransformer2DModel"],
               "vae": ["diffusers", "AutoencoderKLQwenImage"]},
              spacing="1/steps", text_inputs=("input_ids", "attention_mask"), adapt=_genai_adapt, files=_genai_files)


FAMILIES = (
    Family("qwenimage", {"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER, **VAES},
           Diffusers("QwenImagePipeline", FLOW_SCHEDULER, 128, transformer="QwenImageTransformer2DModel",
                     transformer_fields=_transformer_fields),
           fp32_vae=True, text_encoder_files=True, check_parts=check_parts, demos={"demo:tiny-qwen-image": DEMO},
           genai=GENAI),
)
