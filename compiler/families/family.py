"""What a model family is to the compiler: the records its module (sd.py, flux.py, sd3.py) fills in and
the registry (compiler/families/__init__.py) assembles.

Owns: `Component` (one exported graph: where its weights live, its config, its builder, its tokenizer),
`Family` (everything the compiler knows about one family), `Detected` (what detection found in a
checkpoint's header), `Diffusers` (its diffusers / optimum pipeline folder) and `GenAI` (its OpenVINO GenAI
folder). Facts the runtime needs too (latent scale and shift, denoiser, patch size, the released models'
flow schedules and T5 lengths, the components `generate` loads) are the runtime family's
(runtime/families/), read through `Family.runtime`, not written here. Plain data: no family's code is here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...runtime.families import FAMILIES as RUNTIME
from ...runtime.families import Family as RuntimeFamily
from ...runtime.families import Flow


@dataclass(frozen=True)
class Component:
    name: str                      # optimum folder name
    prefixes: tuple[str, ...]      # where its weights may live; the first one present is used
    config_name: str               # diffusers subfolder whose config.json applies; override namespace
    make_config: Callable
    build: Callable
    scopes: tuple[str, ...] = ()   # keys that must all be consumed (default: the chosen prefix)
    config_file: str = ""          # key of its diffusers config in Checkpoint.configs (default: config_name)
    missing_hint: str = ""         # what to do when a checkpoint lacks it
    tokenizer: str = ""            # a text encoder's: "clip", "openclip" (CLIP BPE padded with id 0 '!'), "t5" or
    # "qwen2" (an LLM's byte-level BPE, tokenizer.json)
    optional: bool = False         # exported only when asked for by name (a recipe's components, --component)

    @property
    def config_key(self) -> str:
        return self.config_file or self.config_name

    def prefix_in(self, keys) -> str | None:
        for p in self.prefixes:
            if any(k.startswith(p) for k in keys):
                return p
        return None


@dataclass(frozen=True)
class Detected:
    name: str          # a family's name, or what else the file is: controlnet | vae
    variant: str       # e.g. "inpaint", "v-pred", "dev", "3.5-large", "" when plain
    evidence: str      # the keys/shapes that decided it, for messages


@dataclass(frozen=True)
class Diffusers:
    """The family's diffusers-style pipeline folder (compiler/interop.py writes it)."""
    pipeline: str                  # model_index.json _class_name
    scheduler: str                 # DPMSolverMultistepScheduler | FlowMatchEulerDiscreteScheduler
    sample_size: int               # nominal sample size, in latents
    index: dict = field(default_factory=dict)   # further model_index.json fields (parts it does not hold, flags)
    unet_plain_level: int = -1     # the UNet level without cross-attention (its nominal block types)
    vae_force_upcast: bool = False
    transformer: str = ""          # the transformer's diffusers class
    transformer_fields: Callable | None = None   # (precast config) -> that class's config fields
    variants: dict = field(default_factory=dict)   # variant -> model_index.json fields of its own (its pipeline)


@dataclass(frozen=True)
class GenAI:
    """The family's OpenVINO GenAI folder (compiler/openvino_genai.py writes it)."""
    index: dict                    # model_index.json classes GenAI dispatches on (with _class_name, scheduler)
    pooled_first: tuple[str, ...] = ()   # CLIP models whose output 0 is the pooled text_embeds (hidden states
    # read by index); empty: a CLIP model's outputs are kept as exported
    spacing: str | None = None     # flow families: the schedule spacing GenAI's pipeline samples
    static_shift_only: bool = False
    text_inputs: tuple[str, ...] = ("input_ids",)   # what GenAI feeds each text encoder (int64 all)
    adapt: Callable | None = None  # (ov, name, ov.Model, config, report) -> the model with the IO GenAI's pipeline uses
    files: Callable | None = None  # (files, configs, report) -> None: adds what GenAI reads beyond diffusers' fields
    chat_template: str = ""        # Jinja its tokenizer carries: GenAI templates the prompt with it
    variants: dict = field(default_factory=dict)   # variant -> model_index.json fields, or why it is refused (str)


@dataclass(frozen=True)
class Family:
    """One model family as the compiler builds it; its `name` is the manifest's model.family."""
    name: str
    components: dict[str, Component]           # every graph it exports, in export order
    diffusers: Diffusers
    defaults: dict[str, dict] = field(default_factory=dict)   # what the weights cannot say, per config_name
    fp32_vae: bool = False         # its VAE overflows in fp16: exported fp32 unless asked otherwise
    text_encoder_files: bool = False   # single files ship without text encoders: --text-encoder files are read
    check_parts: Callable | None = None    # (family, {component: config}, path, vae_file): the parts fit
    guess_prediction: Callable | None = None   # (checkpoint) -> "v_prediction" | None, from the weights
    controlnet_family: Callable | None = None  # (a ControlNet's encoder config) -> the family it was made for
    demos: dict[str, dict] = field(default_factory=dict)   # its embedded demo sources -> what their weights cannot say
    genai: GenAI | None = None
    no_genai: str = ""             # why export-openvino-genai refuses it, where it says more than "not written yet"
    foreign_onnx: bool = False     # `precast build` takes its optimum / diffusers ONNX folders

    @property
    def runtime(self) -> RuntimeFamily:
        return RUNTIME[self.name]

    @property
    def title(self) -> str:
        return self.runtime.title

    def flow(self, variant: str) -> Flow | None:
        """The released model's flow-matching schedule and defaults (flow families), else None."""
        return self.runtime.variants.get(variant)

    @property
    def t5(self) -> bool:
        """Whether it reads T5 (its transformer is built and run for a T5 length)."""
        return any(c.tokenizer == "t5" for c in self.components.values())

    def tokenizers(self) -> dict[str, str]:
        """{tokenizer folder: "clip" | "openclip" | "t5"} for each of its text encoders."""
        return {n.replace("text_encoder", "tokenizer"): c.tokenizer for n, c in self.components.items() if c.tokenizer}

    def overrides_for(self, component: Component, user: dict) -> dict:
        """The config overrides a component is built with: the family's defaults, then the user's (--set)."""
        return {**self.defaults.get(component.config_name, {}), **user.get(component.config_name, {})}

    def pad_zero(self, component: str) -> bool:
        """Whether the text encoder's CLIP tokenizer pads with id 0 (OpenCLIP) rather than end-of-text."""
        comp = self.components.get(component)
        return comp is not None and comp.tokenizer == "openclip"
