"""Writes tiny kohya LoRAs with seeded random weights for the demo configs of compiler/demo_model.py
(SD 1.x, SD 2.x, SDXL), for `precast demo-model --family lora` and tests.

Owns: which weights of an LDM checkpoint a demo LoRA patches and their kohya names over LDM paths:
the UNet's attention q / v / out projections, each text encoder's first MLP layer and OpenCLIP's
fused q / k / v rows (addressed as HF q_proj / k_proj / v_proj, as kohya names them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .demo_model import SDXL_TE1, TINY, SD1Config, sd1_layout, write_safetensors
from .sources.checkpoint import TEXT, UNET

# the text encoders of each family: kohya's name -> the checkpoint prefix it patches
TE_PREFIXES = {"sd1": {"te": TEXT}, "sd2": {"te": "cond_stage_model.model."},
               "sdxl": {"te1": SDXL_TE1, "te2": "conditioner.embedders.1.model."}}


@dataclass(frozen=True)
class LoraTarget:
    name: str                           # kohya module name, e.g. lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q
    key: str                            # the checkpoint weight it patches
    rows: tuple[int, int] | None        # the rows of `key` it patches (OpenCLIP's fused q | k | v); None: all
    out_dim: int
    in_dim: int


def kohya_targets(layout: dict[str, tuple[int, ...]], te_prefixes: dict[str, str]) -> list[LoraTarget]:
    out = []
    for key, shape in layout.items():
        if key.startswith(UNET) and ".transformer_blocks." in key and key.endswith(("to_q.weight", "to_v.weight",
                                                                                    "to_out.0.weight")):
            module = key[len(UNET):-len(".weight")]
            out.append(LoraTarget("lora_unet_" + module.replace(".", "_"), key, None, *shape))
    for tag, prefix in te_prefixes.items():
        for key, shape in layout.items():
            rel = key[len(prefix):] if key.startswith(prefix) else ""
            layer = rel.split(".")[2] if rel.count(".") > 2 else ""
            if rel.endswith(("mlp.fc1.weight", "mlp.c_fc.weight")):     # HF CLIP / OpenCLIP
                out.append(LoraTarget(f"lora_{tag}_text_model_encoder_layers_{layer}_mlp_fc1", key, None, *shape))
            elif rel.endswith("attn.in_proj_weight"):                    # OpenCLIP: rows q | k | v
                d = shape[1]
                for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
                    out.append(LoraTarget(f"lora_{tag}_text_model_encoder_layers_{layer}_self_attn_{name}", key,
                                          (i * d, (i + 1) * d), d, d))
    return out


def write_demo_lora(path: str, cfg: SD1Config = TINY, seed: int = 0, rank: int = 4,
                    alpha: float = 2.0) -> list[LoraTarget]:
    """A deterministic kohya LoRA (fp32 down / up ~ 0.2 N(0, 1), `alpha` per module) for any checkpoint of
    cfg's shapes; returns what it patches (the delta of a target is alpha / rank * up @ down)."""
    targets = kohya_targets(sd1_layout(cfg), TE_PREFIXES[cfg.family])
    shapes = {}
    for t in targets:
        shapes[f"{t.name}.lora_down.weight"] = (rank, t.in_dim)
        shapes[f"{t.name}.lora_up.weight"] = (t.out_dim, rank)
        shapes[f"{t.name}.alpha"] = ()
    rng = np.random.default_rng(seed)
    write_safetensors(str(path), shapes, "fp32", lambda key, shape: np.float32(alpha) if key.endswith(".alpha")
                      else 0.2 * rng.standard_normal(shape))
    return targets
