"""A precast export as an OpenVINO GenAI model folder (`precast export-openvino-genai`).

Owns: turning a `precast export` folder into the layout `optimum-cli export openvino` writes, which
`openvino_genai.Text2ImagePipeline(folder, device)` loads: `openvino_model.xml/.bin` per component
folder (text_encoder*/, unet/ or transformer/, vae_decoder/, vae_encoder/), `tokenizer*/` with the
OpenVINO tokenizer and detokenizer models (openvino-tokenizers, made from the export's CLIP or T5
tokenizer files, which are copied beside them), `model_index.json` naming the diffusers / transformers
classes GenAI dispatches on, `scheduler/scheduler_config.json` and each component's `config.json`
(compiler/interop.py's).

The graphs are precast's ONNX converted by OpenVINO with the IO GenAI feeds: it fills `input_ids`
from its tokenizers as int64 and passes the UNet's `timestep` as int64 [1], where precast's graphs take
int32 ids and a float32 timestep, so those Parameters are retyped with a Convert inside the model (a
DiT's float32 timestep is what GenAI feeds: sigma for Flux, sigma x 1000 for SD3, as precast's graphs
take them); float inputs and outputs are float32 whatever the export's dtype (GenAI hands float32
latents and text states between the models); a CLIP encoder's `token_embeddings_extra` input (textual
inversion rows, with a one-zero-row default) becomes that constant, since GenAI feeds it one input.
Weights are stored fp16 only for an fp16 component (bf16 stays bf16), never compressed from fp32.

SD 1.x / 2.x, SDXL base: GenAI runs DDIM, Euler, Euler ancestral, PNDM and LCM, not precast's default
DPM++ 2M: the folder's scheduler is Euler discrete (`leading` spacing, steps_offset 1), which is
`precast generate --scheduler euler`'s schedule, so the same noise gives the same image. SDXL's and
SD3's CLIP models output every hidden state in optimum's order, which is how GenAI indexes them
(hidden_state_outputs).
Flux (dev, schnell) and SD3 / SD3.5 (with or without T5): GenAI's FluxPipeline /
StableDiffusion3Pipeline with the export's own flow-matching schedule, which both sample as precast
does (Flux: sigmas linspace(1, 1/steps), SD3: the scheduler's default; check_flow_schedule). GenAI pads
T5 to generate()'s max_sequence_length, precast to the bundle's T5 length; an SD3 folder without T5
gets 77 zero text tokens from GenAI whatever that length (precast: the T5 length).
FLUX.2 klein, Z-Image and Qwen-Image: GenAI's Flux2KleinPipeline / ZImagePipeline / QwenImagePipeline, which
template the prompt with the tokenizer's chat template (written for each: GenAI.chat_template) and feed the LLM
text encoder input_ids and attention_mask (int64); where GenAI feeds a model otherwise than precast's graphs take
it, the family's GenAI.adapt rewrites its IO (compiler/ov_io.py) and GenAI.files adds the config fields GenAI
reads. The SDXL refiner, Chroma and FLUX.2 dev (no GenAI pipeline) are refused with a message.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..runtime.openvino_attention import rewrite_attention
from ..runtime.staging import Staging
from .cache import staging_registry
from .engines import read_export
from .errors import BadInput
from .families import FAMILIES
from .interop import DIFFUSERS_VERSION, pipeline_files, write_json

PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "unet", "transformer", "vae_decoder", "vae_encoder")
INSTALL = "pip install 'precast[openvino-genai]' (openvino, openvino-tokenizers and transformers)"


def model_index(family: str, components: list[str], variant: str = "") -> dict:
    """model_index.json as optimum-intel writes it for the family's pipeline (the family's GenAI.index, with its
    variant's fields); an optional part the export lacks (SD3's T5) is named null with its tokenizer, as
    diffusers does."""
    fam = FAMILIES[family]
    out = {"_diffusers_version": DIFFUSERS_VERSION, **fam.genai.index, **fam.genai.variants.get(variant, {})}
    for name in fam.runtime.optional:
        if name not in components:
            out[name] = out[name.replace("text_encoder", "tokenizer")] = [None, None]
    if "vae_encoder" not in components:
        out["_precast_note"] = "no vae_encoder: Text2ImagePipeline only"
    return out


def scheduler_config(prediction: str) -> dict:
    """Euler discrete as `precast generate --scheduler euler` runs it (runtime/schedulers.py Euler)."""
    return {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": DIFFUSERS_VERSION,
            "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
            "beta_schedule": "scaled_linear", "trained_betas": None, "prediction_type": prediction,
            "timestep_spacing": "leading", "steps_offset": 1, "interpolation_type": "linear",
            "final_sigmas_type": "zero", "use_karras_sigmas": False, "timestep_type": "discrete",
            "rescale_betas_zero_snr": False}


def check_flow_schedule(export_dir: Path, report: dict) -> None:
    """A Flux / SD3 export's schedule must be one GenAI samples the way precast does."""
    fam = FAMILIES[report["family"]]
    released = fam.flow(report.get("variant", ""))
    sched = report.get("scheduler") or dict(released.scheduler if released else {})
    spacing, genai = sched.get("spacing", "1/steps"), fam.genai
    if spacing != genai.spacing:
        raise BadInput(f"{export_dir}: the export's scheduler spacing is {spacing!r}; OpenVINO GenAI's "
                       f"{genai.index['_class_name']} samples {genai.spacing!r} only")
    if genai.static_shift_only and sched.get("use_dynamic_shifting"):
        raise BadInput(f"{export_dir}: the export's scheduler shifts dynamically; OpenVINO GenAI's "
                       f"{genai.index['_class_name']} supports a static shift only")


def _modules():
    try:
        import openvino as ov
    except ImportError:
        raise BadInput(f"export-openvino-genai: the openvino package is not installed; {INSTALL}") from None
    try:
        import openvino_tokenizers
    except ImportError:
        raise BadInput("export-openvino-genai: openvino-tokenizers is not installed (it makes GenAI's "
                       f"tokenizer models); {INSTALL}") from None
    try:
        import transformers  # noqa: F401  (openvino-tokenizers converts a transformers tokenizer)
    except ImportError:
        raise BadInput(f"export-openvino-genai: transformers is not installed (openvino-tokenizers reads the "
                       f"CLIP tokenizer through it); {INSTALL}") from None
    return ov, openvino_tokenizers


def convert_component(ov, onnx_path: Path, name: str, dtype: str, text_inputs: tuple[str, ...] = ("input_ids",)):
    """precast's ONNX graph -> an ov.Model with the IO GenAI feeds (see the module doc); `text_inputs`: what
    GenAI feeds a text encoder, int64 all."""
    model = ov.convert_model(str(onnx_path))
    if dtype in ("fp16", "bf16"):
        rewrite_attention(model)
    ppp = ov.preprocess.PrePostProcessor(model)
    changed = False
    for port in model.inputs:
        want = None
        if port.get_names() & set(text_inputs) or (name == "unet" and "timestep" in port.get_names()):
            want = ov.Type.i64
        elif port.get_element_type().is_real():
            want = ov.Type.f32
        if want is not None and port.get_element_type() != want:
            ppp.input(port.get_any_name()).tensor().set_element_type(want)
            changed = True
    for i, port in enumerate(model.outputs):
        if port.get_element_type().is_real() and port.get_element_type() != ov.Type.f32:
            ppp.output(i).tensor().set_element_type(ov.Type.f32)
            changed = True
    if changed:
        model = ppp.build()
    names = [next((n for n in text_inputs if n in p.get_names()), p.get_any_name()) for p in model.inputs]
    if name.startswith("text_encoder") and names != list(text_inputs):
        raise BadInput(f"{onnx_path}: the text encoder converts with inputs {names}; OpenVINO GenAI feeds "
                       f"{', '.join(text_inputs)} only. Export again with this precast version")
    return model


def hidden_state_outputs(ov, model, name: str, layers: int, pooled: bool, recorded: str | None = None):
    """SDXL, SD3: GenAI reads the text states as output `num_hidden_layers + 1` of each CLIP model
    (optimum's order: text_embeds, last_hidden_state or last_hidden_state, pooler_output, then
    hidden_states.0..N) and the pooled text_embeds as output 0 where it pools (`pooled`: SDXL's
    text_encoder_2, both of SD3's). precast's graphs output that layout (compiler/graphs/clip_text.py):
    its Results are kept in that order, and the slot GenAI reads holds the state the export recorded
    (`recorded`, the config's hidden_name: the penultimate hidden_states.N-1 unless clip_skip chose
    another). An export from before that layout (one hidden_states output, plus text_embeds) has its
    one state repeated so those indices hold it."""
    from openvino import opset13 as ops
    outs = {p.get_any_name(): p for p in model.outputs}
    every = [f"hidden_states.{i}" for i in range(layers + 1)]
    heads = ["text_embeds", "last_hidden_state"] if pooled else ["last_hidden_state", "pooler_output"]
    if all(n in outs for n in every + heads):
        order = [outs[n] for n in heads + every]
        if recorded in outs:
            order[layers + 1] = outs[recorded]
    else:
        states = [p for n, p in outs.items() if n.startswith("hidden_states") or n == "last_hidden_state"]
        if len(states) != 1 or (pooled and "text_embeds" not in outs):
            raise BadInput(f"{name}: outputs {sorted(outs)}; expected {', '.join(heads)}, hidden_states.0 .. "
                           f"hidden_states.{layers} (optimum's layout), or one hidden_states output"
                           + (" and text_embeds" if pooled else ""))
        first = outs["text_embeds"] if pooled else states[0]
        order = [first] + [states[0]] * (layers + 1)
    results = [ops.result(p.get_node().input_value(0)) for p in order]   # model.outputs are its Results' ports
    return ov.Model(results, model.get_parameters(), name)


def write_tokenizer(ov, ovt, source: Path, dest: Path, chat_template: str = "") -> list[str]:
    """Copy the export's CLIP (vocab.json), T5 (spiece.model, tokenizer.json) or LLM (tokenizer.json, its
    class in tokenizer_config.json; `chat_template`, where GenAI templates the prompt with the tokenizer's, is
    written there and carried by the OpenVINO tokenizer) tokenizer files and add openvino_tokenizer.xml /
    openvino_detokenizer.xml."""
    from transformers import AutoTokenizer, CLIPTokenizer, T5TokenizerFast
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    if chat_template:
        path = dest / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        write_json(dest / "tokenizer_config.json", {**config, "chat_template": chat_template})
    kind = CLIPTokenizer if (source / "vocab.json").is_file() else \
        T5TokenizerFast if (source / "spiece.model").is_file() else AutoTokenizer
    tokenizer, detokenizer = ovt.convert_tokenizer(kind.from_pretrained(dest), with_detokenizer=True)
    ov.save_model(tokenizer, str(dest / "openvino_tokenizer.xml"))
    ov.save_model(detokenizer, str(dest / "openvino_detokenizer.xml"))
    return sorted(f.name for f in dest.iterdir())


def check_export(export_dir: Path, report: dict, comps: dict) -> list[str]:
    """The export is one GenAI runs, else one BadInput; returns the tokenizer folders to write."""
    family = report.get("family")
    fam = FAMILIES.get(family)
    if fam is not None and fam.no_genai:
        raise BadInput(f"{export_dir}: a {fam.title} export; {fam.no_genai}")
    if fam is None or fam.genai is None:
        raise BadInput(f"{export_dir}: a {family} export; export-openvino-genai writes SD 1.x / 2.x, SDXL, SD3 / SD3.5, "
                       "Flux, FLUX.2 klein, Z-Image and Qwen-Image pipelines (the SDXL refiner is not written yet)")
    refused = fam.genai.variants.get(report.get("variant", ""))
    if isinstance(refused, str):
        raise BadInput(f"{export_dir}: a {fam.title} {report.get('variant')} export; {refused}")
    required = fam.runtime.needs
    missing = [n for n in required if n not in comps]
    if missing:
        raise BadInput(f"{export_dir}: has no {', '.join(missing)}; OpenVINO GenAI's Text2ImagePipeline needs "
                       f"{', '.join(required)}: export them (precast export --component ...)")
    if fam.genai.spacing:
        check_flow_schedule(export_dir, report)
    tokenizers = [n.replace("text_encoder", "tokenizer") for n in PARTS if n.startswith("text_encoder") and n in comps]
    for folder in tokenizers:
        if not (export_dir / folder).is_dir():
            raise BadInput(f"{export_dir}: no {folder}/ folder; export again with this precast version")
    return tokenizers


def export_openvino_genai(export_dir: str | Path, out: str | Path, progress=None) -> dict:
    """Write the OpenVINO GenAI folder `out` from the precast export `export_dir`; returns a report.
    `progress(message)` is called as each part is written."""
    t0 = time.perf_counter()
    export_dir, out = Path(export_dir), Path(out)
    comps = read_export(export_dir)
    report = json.loads((export_dir / "precast_export.json").read_text())
    family = report.get("family")
    tokenizers = check_export(export_dir, report, comps)
    genai = FAMILIES[family].genai
    if out.resolve() == export_dir.resolve():
        raise BadInput(f"--out {out}: is the export folder; give a new folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / "precast_openvino_genai.json").is_file():
        raise BadInput(f"--out {out}: exists and is not an earlier export-openvino-genai folder; give a new or "
                       "empty folder")
    ov, ovt = _modules()
    say = progress or (lambda msg: None)
    parts = [n for n in PARTS if n in comps]
    configs = {c["name"]: c["config"] for c in report["components"] if c["name"] in parts}
    with Staging(out, "genai", staging_registry()) as stage:
        staging = stage.path
        written = []
        for name in parts:
            comp = comps[name]
            model = convert_component(ov, comp.onnx_path, name, comp.export_dtype, genai.text_inputs)
            if genai.pooled_first and name in ("text_encoder", "text_encoder_2"):
                model = hidden_state_outputs(ov, model, name, configs[name]["layers"], name in genai.pooled_first,
                                             configs[name].get("hidden_name"))
            if genai.adapt:
                model = genai.adapt(ov, name, model, configs[name], report)
            (staging / name).mkdir()
            ov.save_model(model, str(staging / name / "openvino_model.xml"), compress_to_fp16=comp.export_dtype == "fp16")
            written.append({"name": name, "dtype": comp.export_dtype,
                            "inputs": [{"name": p.get_any_name(), "dtype": p.get_element_type().get_type_name()}
                                       for p in model.inputs],
                            "outputs": [{"name": p.get_any_name(), "dtype": p.get_element_type().get_type_name()}
                                        for p in model.outputs]})
            say(f"{name}: openvino_model.xml")
        for folder in tokenizers:
            write_tokenizer(ov, ovt, export_dir / folder, staging / folder, genai.chat_template)
            say(f"{folder}: openvino_tokenizer.xml, openvino_detokenizer.xml")
        files = pipeline_files(report, configs)
        files["model_index.json"] = model_index(family, parts, report.get("variant", ""))
        if not genai.spacing:      # flow families keep interop's FlowMatch schedule (the export's)
            files["scheduler/scheduler_config.json"] = scheduler_config(report.get("prediction", "epsilon"))
        if genai.files:
            genai.files(files, configs, report)
        for rel, data in files.items():
            write_json(staging / rel, data)
        write_json(staging / "precast_openvino_genai.json",
                   {"source": str(export_dir), "family": family, "source_identity": report.get("source_identity"),
                    "openvino": ov.get_version(), "components": written})
        stage.commit()
    return {"out": str(out), "family": family, "components": written,
            "scheduler": files["scheduler/scheduler_config.json"]["_class_name"],
            "seconds": round(time.perf_counter() - t0, 3)}
