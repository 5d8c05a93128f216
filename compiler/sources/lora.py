"""LoRA files and what their names point at in a model.

Owns: reading LoRA / LyCORIS files (kohya `lora_unet_*` / `lora_te*_*`, LoCon with `lora_mid`,
LoHa `hada_*`, LoKr `lokr_*`, full `diff`, diffusers / PEFT `lora_A` / `lora_B` and their older
`.processor.to_q_lora.down` / `lora_linear_layer` spellings, DoRA `dora_scale` /
`lora_magnitude_vector`, alpha from a `.alpha` tensor or from safetensors metadata) into one
`LoraModule` per adapted layer; and the FORWARD name table that resolves them. The table is
built from the model's real weight names: for every weight, every spelling a LoRA can use for
it (kohya names over LDM paths and over diffusers paths, PEFT / diffusers dotted names) maps
to that weight. `_` flattening is not reversible, so names are never un-flattened; a spelling
two weights would share is marked ambiguous and refused rather than guessed.
Reads headers only; tensor bytes are read by the merge (compiler/lora_merge.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...runtime.manifest import sha256_file
from ..errors import BadInput
from . import flux2_names, flux_names, sd3_names
from .tensor_refs import CLIP_G, CLIP_L, CONVERT_HINT, DIT, T5, UNET, open_weights_file
from .diffusers_names import RES_NAMES, UNET_TOP
from .peft_metadata import pattern_matches, peft_config
from .safetensors_file import FLOAT_DTYPES, SafetensorsFile

# Tensor-name endings -> role, longest first so `.lora_A.default.weight` wins over `.weight`.
SUFFIXES = {
    ".lora_down.weight": "down", ".lora_up.weight": "up", ".lora_mid.weight": "mid",
    ".lora_A.default.weight": "down", ".lora_B.default.weight": "up",
    ".lora_A.weight": "down", ".lora_B.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up",
    "_lora.down.weight": "down", "_lora.up.weight": "up",       # .processor.to_q_lora.down.weight
    ".lora.down.weight": "down", ".lora.up.weight": "up",
    ".lora_magnitude_vector.default.weight": "magnitude", ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector": "magnitude",
    ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b", ".hada_w2_a": "hada_w2_a", ".hada_w2_b": "hada_w2_b",
    ".hada_t1": "hada_t1", ".hada_t2": "hada_t2",
    ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b", ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b",
    ".lokr_w1": "lokr_w1", ".lokr_w2": "lokr_w2", ".lokr_t2": "lokr_t2",
    ".diff_b": "diff_b", ".diff": "diff",
    ".dora_scale": "dora_scale", ".alpha": "alpha",
}
_SUFFIX_ORDER = sorted(SUFFIXES, key=len, reverse=True)
IGNORED_KEYS = ("text_encoder.text_model.embeddings.position_ids",)
ALPHA_DTYPES = FLOAT_DTYPES + ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")  # an integer alpha is exact

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


# ---- the forward table ---------------------------------------------------------------------

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


# ---- reading LoRA files -----------------------------------------------------------------------

@dataclass
class LoraModule:
    name: str                       # the module spelling as the file has it
    tensors: dict[str, str]         # role -> tensor key in the file

    @property
    def kind(self) -> str:
        roles = set(self.tensors)
        if roles & {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}:
            return "loha"
        if any(r.startswith("lokr_") for r in roles):
            return "lokr"
        if roles & {"down", "up"}:
            return "lora"
        if roles & {"diff", "diff_b"}:
            return "full"
        return "unknown"


@dataclass
class LoraFile:
    path: str
    sha256: str
    file: SafetensorsFile
    modules: dict[str, LoraModule]
    metadata: dict[str, str]
    peft_config: dict                         # diffusers' lora_adapter_metadata (component.field -> value)
    stray: list[str] = field(default_factory=list)  # keys no known suffix explains

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def shape(self, module: LoraModule, role: str) -> tuple[int, ...]:
        return self.file.tensors[module.tensors[role]].shape

    def read(self, module: LoraModule, role: str) -> np.ndarray:
        """A tensor in fp32; NaN or infinity is refused (it would spread into every merged weight)."""
        key = module.tensors[role]
        arr = self.file.read(key).astype(np.float32)
        if not np.isfinite(arr).all():
            raise BadInput(f"--lora {self.path}: tensor {key} holds NaN or infinity; the LoRA file is damaged "
                           "(re-download or re-save it)")
        return arr

    def alpha(self, module: LoraModule, rank: int) -> float | None:
        """alpha from the `.alpha` tensor, else diffusers' metadata (lora_alpha / alpha_pattern), else None."""
        if "alpha" in module.tensors:
            n = math.prod(self.shape(module, "alpha"))
            if n != 1:
                raise BadInput(f"--lora {self.path}: tensor {module.tensors['alpha']} holds {n} values "
                               f"(shape {list(self.shape(module, 'alpha'))}); alpha is one number")
            return float(self.read(module, "alpha").reshape(-1)[0])
        if not self.peft_config:
            return None
        component = module.name.split(".", 1)[0] if "." in module.name else ""
        cfg = {k[len(component) + 1:]: v for k, v in self.peft_config.items() if k.startswith(component + ".")} \
            if component else {}
        cfg = cfg or self.peft_config
        inner = module.name[len(component) + 1:] if component else module.name
        patterns = cfg.get("alpha_pattern") or {}
        alpha = next((v for pat, v in patterns.items() if pattern_matches(pat, inner)), None)  # PEFT: first match
        if alpha is None:
            alpha = cfg.get("lora_alpha")
        if alpha is None:
            return None
        if cfg.get("use_rslora"):
            return float(alpha) * rank / float(np.sqrt(rank))  # scale alpha/sqrt(r) expressed as alpha'/r
        return float(alpha)


def split_key(key: str) -> tuple[str, str] | None:
    for suffix in _SUFFIX_ORDER:
        if key.endswith(suffix):
            return key[:-len(suffix)], SUFFIXES[suffix]
    return None


def _check_dtype(p: Path, f: SafetensorsFile, key: str, role: str) -> None:
    """LoRA factors are floats (an integer alpha is exact and allowed); BOOL or integer factors mean
    a damaged or mislabelled file."""
    dtype = f.tensors[key].dtype
    if dtype not in (ALPHA_DTYPES if role == "alpha" else FLOAT_DTYPES):
        want = "a float or an integer" if role == "alpha" else f"a float ({', '.join(FLOAT_DTYPES)})"
        raise BadInput(f"--lora {p}: tensor {key} has dtype {dtype}; a LoRA's {role} tensor must be {want}; "
                       "the LoRA file is damaged (re-download or re-save it)")


def read_lora(path: str | Path, sha256: str | None = None) -> LoraFile:
    """Open a LoRA file (headers only) and group its tensors by module."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"--lora {p}: no such file")
    f = open_weights_file(p, lambda path: BadInput(f"--lora {path}: pickled LoRA refused. {CONVERT_HINT}"))
    modules: dict[str, LoraModule] = {}
    stray = []
    for key in f.keys():
        if key in IGNORED_KEYS:
            continue
        parts = split_key(key)
        if parts is None:
            stray.append(key)
            continue
        module, role = parts
        m = modules.setdefault(module, LoraModule(module, {}))
        if role in m.tensors:
            raise BadInput(f"--lora {p}: module {module} has two {role} tensors "
                           f"({m.tensors[role]}, {key}); the file mixes two formats")
        _check_dtype(p, f, key, role)
        m.tensors[role] = key
    peft_cfg = peft_config(p, f.metadata.get("lora_adapter_metadata"))
    if not modules and not stray:
        raise BadInput(f"--lora {p}: holds no tensors")
    if not modules:
        raise BadInput(f"--lora {p}: none of its {len(stray)} tensors is a LoRA factor (lora_down/lora_up, lora_A/lora_B, "
                       f"hada_*, lokr_*, diff; e.g. it has {stray[0]}): this looks like a model checkpoint, not a "
                       "LoRA; export it as the model instead")
    if sha256 is None:
        sha256 = sha256_file(p)
    return LoraFile(str(p), sha256, f, modules, dict(f.metadata), peft_cfg, stray)
