"""What a LoRA module's name points at in a model: the FORWARD name table.

Owns: `build_name_table`, built from the model's real weight names: for every weight, every
spelling a LoRA can use for it (kohya names over LDM paths and over diffusers paths, PEFT /
diffusers dotted names) maps to that weight, a `Target` (a key, a row block of a fused q/k/v, the
rows of a fused module's delta); `NameTable`, `targets_of`, `flat`. `_` flattening is not
reversible, so names are never un-flattened; a spelling two weights would share is marked
ambiguous and refused rather than guessed. The files themselves are read by lora.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import flux2_names, flux_names, sd3_names
from .tensor_refs import CLIP_G, CLIP_L, DIT, T5, UNET
from .diffusers_names import RES_NAMES, UNET_TOP

# Text encoders: canonical prefix -> (layout, kohya prefixes, diffusers/PEFT prefixes).
TEXT_ENCODERS = {
    "cond_stage_model.transformer.text_model.": ("hf", ("lora_te",), ("text_encoder",)),          # SD1 CLIP-L
    "cond_stage_model.model.": ("openclip", ("lora_te",), ("text_encoder",)),                    # SD2 OpenCLIP-H
    "conditioner.embedders.0.transformer.text_model.": ("hf", ("lora_te1",), ("text_encoder",)),  # SDXL CLIP-L
    "conditioner.embedders.1.model.": ("openclip", ("lora_te2",), ("text_encoder_2",)),          # SDXL bigG
    "conditioner.embedders.1.transformer.text_model.": ("hf", ("lora_te2",), ("text_encoder_2",)),  # (folders)
    CLIP_L: ("hf", ("lora_te1", "lora_te"), ("text_encoder",)),                                 # Flux / SD3 CLIP-L
    CLIP_G: ("hf", ("lora_te2",), ("text_encoder_2",)),                                          # SD3 CLIP-G
}
# T5 (Flux's text_encoder_2, Chroma's text_encoder, SD3's text_encoder_3): kohya sd-scripts' lora_te2 /
# lora_te3, diffusers/PEFT names
T5_SPELLINGS = (("lora_te2", "lora_te3"), ("text_encoder_2", "text_encoder", "text_encoder_3"))
TE_ATTN_ALIASES = {"q_proj": ("to_q",), "k_proj": ("to_k",), "v_proj": ("to_v",), "out_proj": ("to_out", "to_out.0")}


def flat(name: str) -> str:
    """The lookup form of a module spelling: dots to underscores (kohya's own flattening)."""
    return name.replace(".", "_")


@dataclass(frozen=True)
class Target:
    key: str                                   # canonical checkpoint key of the weight
    rows: tuple[int, int] | None = None        # a row block of a fused q/k/v (OpenCLIP in_proj)
    part: tuple[int, int] | None = None        # the rows of the LoRA's delta that land here (a fused module's delta
    # over separate weights: a FLUX.2 LoRA's BFL img_attn.qkv over diffusers' to_q | to_k | to_v)

    def describe(self) -> str:
        return self.key + (f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else "") + \
            (f" (delta rows {self.part[0]}:{self.part[1]})" if self.part else "")


def targets_of(found: "Target | tuple[Target, ...]") -> tuple[Target, ...]:
    """A name table entry as the weights it names: one, or a fused module's several."""
    return found if isinstance(found, tuple) else (found,)


@dataclass
class NameTable:
    """Every spelling (flattened) -> the weight it names; spellings two weights share are ambiguous."""
    entries: dict[str, Target | tuple[Target, ...]] = field(default_factory=dict)
    ambiguous: dict[str, set[str]] = field(default_factory=dict)

    def add(self, spelling: str, target: Target | tuple[Target, ...]) -> None:
        s = flat(spelling)
        old = self.entries.get(s)
        said = " + ".join(t.describe() for t in targets_of(target))
        if s in self.ambiguous:
            self.ambiguous[s].add(said)
        elif old is not None and old != target:
            self.ambiguous[s] = {" + ".join(t.describe() for t in targets_of(old)), said}
            del self.entries[s]
        else:
            self.entries[s] = target

    def lookup(self, module: str) -> Target | tuple[Target, ...] | None:
        return self.entries.get(flat(_normalise_module(module)))


def _normalise_module(module: str) -> str:
    """Undo spellings that are not paths: diffusers' attention-processor names."""
    module = re.sub(r"\.processor\.(to_[qkv])$", r".\1", module)
    module = re.sub(r"\.processor\.to_out(\.0)?$", r".to_out.0", module)
    return module


def unet_diffusers_modules(keys: list[str]) -> dict[str, str]:
    """LDM UNet module path -> diffusers module path, for the modules present in `keys`
    (UNet keys without the model.diffusion_model. prefix). Levels are found from the keys:
    a down level ends at its downsampler (`input_blocks.N.0.op`), an up level at its upsampler."""
    def blocks(side: str) -> list[int]:
        return sorted({int(m.group(1)) for k in keys if (m := re.match(rf"{side}\.(\d+)\.", k))})

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    out: dict[str, str] = {ldm: diff for diff, ldm in UNET_TOP.items()}
    res_inv = {v: k for k, v in RES_NAMES.items()}
    level, j = 0, 0
    for n in blocks("input_blocks"):
        if n == 0:
            continue
        if has(f"input_blocks.{n}.0.op."):
            out[f"input_blocks.{n}.0.op"] = f"down_blocks.{level}.downsamplers.0.conv"
            level, j = level + 1, 0
            continue
        out[f"input_blocks.{n}.0"] = f"down_blocks.{level}.resnets.{j}"
        out[f"input_blocks.{n}.1"] = f"down_blocks.{level}.attentions.{j}"
        j += 1
    level, j = 0, 0
    for n in blocks("output_blocks"):
        out[f"output_blocks.{n}.0"] = f"up_blocks.{level}.resnets.{j}"
        up = next((s for s in (1, 2) if has(f"output_blocks.{n}.{s}.conv.")), None)
        if has(f"output_blocks.{n}.1.") and up != 1:
            out[f"output_blocks.{n}.1"] = f"up_blocks.{level}.attentions.{j}"
        if up is not None:
            out[f"output_blocks.{n}.{up}.conv"] = f"up_blocks.{level}.upsamplers.0.conv"
            level, j = level + 1, 0
        else:
            j += 1
    out.update({"middle_block.0": "mid_block.resnets.0", "middle_block.1": "mid_block.attentions.0",
                "middle_block.2": "mid_block.resnets.1"})
    # Block prefixes -> full module paths; resnet children renamed.
    modules: dict[str, str] = {}
    for k in keys:
        module = k.rsplit(".", 1)[0]
        for ldm_prefix in _prefixes(module):
            if ldm_prefix in out:
                diff = out[ldm_prefix]
                rest = module[len(ldm_prefix):].lstrip(".")
                if ".resnets." in diff:
                    rest = res_inv.get(rest, rest)
                modules[module] = f"{diff}.{rest}" if rest else diff
                break
    return modules


def _prefixes(module: str):
    """'a.b.c' -> 'a.b.c', 'a.b', 'a' (longest first)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        yield ".".join(parts[:i])


def _openclip_modules(rel_keys: list[str]) -> dict[str, tuple[str, tuple[int, int] | None, str]]:
    """OpenCLIP text tower -> {HF module path: (relative weight key, rows, kind)}; q/k/v are row
    blocks of the fused `attn.in_proj_weight`."""
    out = {}
    for k in rel_keys:
        m = re.match(r"transformer\.resblocks\.(\d+)\.(attn\.in_proj_weight|attn\.out_proj\.weight|"
                     r"mlp\.c_fc\.weight|mlp\.c_proj\.weight)$", k)
        if not m:
            continue
        i, what = m.group(1), m.group(2)
        layer = f"encoder.layers.{i}"
        if what == "attn.in_proj_weight":
            continue  # rows need the width: filled in by the caller, which has shapes
        hf = {"attn.out_proj.weight": "self_attn.out_proj", "mlp.c_fc.weight": "mlp.fc1",
              "mlp.c_proj.weight": "mlp.fc2"}[what]
        out[f"{layer}.{hf}"] = (k, None, "weight")
    return out


def build_name_table(shapes: dict[str, tuple[int, ...]]) -> NameTable:
    """The forward table for a model whose canonical weights (name -> shape) are `shapes`."""
    table = NameTable()
    keys = list(shapes)
    # UNet: kohya over LDM paths (SDXL style) and over diffusers paths (SD1/2 style), PEFT dotted.
    unet_rel = [k[len(UNET):] for k in keys if k.startswith(UNET)]
    to_diffusers = unet_diffusers_modules(unet_rel)
    for rel in unet_rel:
        if not rel.endswith(".weight") or len(shapes[UNET + rel]) < 2:
            continue
        module = rel[:-len(".weight")]
        t = Target(UNET + rel)
        for sp in (f"lora_unet_{module}", f"diffusion_model.{module}", f"model.diffusion_model.{module}",
                   f"unet.{module}"):
            table.add(sp, t)
        diff = to_diffusers.get(module)
        if diff is not None:
            for sp in (f"lora_unet_{diff}", f"unet.{diff}", diff):
                table.add(sp, t)
    # Flux / Chroma transformer in diffusers / PEFT names: q, k, v (and a single block's proj_mlp) are
    # row blocks of BFL's fused qkv / linear1; kohya over BFL (and SAI) paths is covered by the loop above.
    # SD3's MMDiT in diffusers / PEFT names the same way (to_q -> rows of joint_blocks.N.x_block.attn.qkv)
    dit_names = flux_names if any(k.startswith(DIT + "double_blocks.") for k in keys) else \
        sd3_names if any(k.startswith(DIT + "joint_blocks.") for k in keys) else None
    if dit_names is not None:
        for module, (key, rows) in dit_names.lora_targets(shapes, DIT).items():
            t = Target(key, rows)
            for sp in (f"transformer.{module}", module, f"lora_transformer_{module}", f"lora_unet_{module}",
                       f"base_model.model.{module}"):
                table.add(sp, t)
    else:   # transformers kept in diffusers' names (Z-Image, Qwen-Image): PEFT / diffusers, ComfyUI and kohya spellings
        for rel in (k[len(DIT):] for k in keys if k.startswith(DIT)):
            if rel.endswith(".weight") and len(shapes[DIT + rel]) == 2:
                module, t = rel[:-len(".weight")], Target(DIT + rel)
                for sp in (f"transformer.{module}", module, f"diffusion_model.{module}", f"lora_transformer_{module}",
                           f"lora_unet_{module}", f"base_model.model.{module}"):
                    table.add(sp, t)
        if DIT + "single_stream_modulation.linear.weight" in shapes:    # FLUX.2: LoRAs in BFL's names too
            for module, found in flux2_names.bfl_lora_targets(shapes, DIT).items():
                ts = tuple(Target(key, rows, part) for key, rows, part in found)
                for sp in (f"diffusion_model.{module}", f"model.diffusion_model.{module}", module,
                           f"transformer.{module}", f"lora_unet_{module}", f"lora_transformer_{module}"):
                    table.add(sp, ts if len(ts) > 1 else ts[0])
    for rel in (k[len(T5):] for k in keys if k.startswith(T5)):
        if rel.endswith(".weight") and len(shapes[T5 + rel]) == 2 and rel.startswith("encoder.block."):
            t = Target(T5 + rel)
            module = rel[:-len(".weight")]
            for p in T5_SPELLINGS[0]:
                table.add(f"{p}_{module}", t)
            for p in T5_SPELLINGS[1]:
                table.add(f"{p}.{module}", t)
    # Text encoders.
    for prefix, (layout, kohya, peft) in TEXT_ENCODERS.items():
        rel_keys = [k[len(prefix):] for k in keys if k.startswith(prefix)]
        if not rel_keys:
            continue
        found: dict[str, Target] = {}
        if layout == "hf":
            for rel in rel_keys:
                if rel.endswith(".weight") and len(shapes[prefix + rel]) == 2 and rel.startswith("encoder."):
                    found[rel[:-len(".weight")]] = Target(prefix + rel)
        else:
            for hf, (rel, rows, _) in _openclip_modules(rel_keys).items():
                found[hf] = Target(prefix + rel, rows)
            for rel in rel_keys:
                m = re.match(r"transformer\.resblocks\.(\d+)\.attn\.in_proj_weight$", rel)
                if m:
                    d = shapes[prefix + rel][0] // 3
                    for n, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                        found[f"encoder.layers.{m.group(1)}.self_attn.{proj}"] = \
                            Target(prefix + rel, (n * d, (n + 1) * d))
        for hf, t in found.items():
            names = [hf]
            last = hf.rsplit(".", 1)[-1]
            names += [hf.rsplit(".", 1)[0] + "." + a for a in TE_ATTN_ALIASES.get(last, ())]
            for name in names:
                for p in kohya:
                    table.add(f"{p}_text_model.{name}", t)
                for p in peft:
                    table.add(f"{p}.text_model.{name}", t)
                    table.add(f"{p}.{name}", t)  # transformers 5 module names have no text_model.
    return table
