"""LoRA / LyCORIS files read into one `LoraModule` per adapted layer.

Owns: reading LoRA files (kohya `lora_unet_*` / `lora_te*_*`, LoCon with `lora_mid`,
LoHa `hada_*`, LoKr `lokr_*`, full `diff`, diffusers / PEFT `lora_A` / `lora_B` and their older
`.processor.to_q_lora.down` / `lora_linear_layer` spellings, DoRA `dora_scale` /
`lora_magnitude_vector`, alpha from a `.alpha` tensor or from safetensors metadata): `SUFFIXES`,
`split_key`, `read_lora` and `LoraFile`, its tensors' dtypes and values checked. What a module's
name points at in a model is lora_names.py's name table.
Reads headers only; tensor bytes are read by the merge (compiler/lora_merge.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...runtime.manifest import sha256_file
from ..errors import BadInput
from .tensor_refs import CONVERT_HINT, open_weights_file
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
    if p.is_dir():
        raise BadInput(f"--lora {p}: a folder; give the LoRA's .safetensors file inside it")
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
