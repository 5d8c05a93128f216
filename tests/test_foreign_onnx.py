"""`precast compile` of ONNX folders precast did not write (compiler/foreign_onnx.py).

One folder is written by optimum's own exporter in the side environment (tests/side_env.py: optimum-onnx
0.1.0 needs transformers<4.58, this venv has 5.x; test_compile_real_optimum_export, skipped with the way to
make it where that environment is missing). The others are made here the way optimum makes them: `torch.onnx.export` of the tiny diffusers /
transformers models (tests/reference.py models_from_single_file on compiler/demo_model's checkpoint),
with optimum's input/output names and dynamic-axis names (batch_size, sequence_length, steps,
num_channels, height, width, num_channels_latent, height_latent, width_latent), laid out as
`optimum-cli export onnx` writes a Stable Diffusion pipeline: model_index.json, scheduler/,
text_encoder/, unet/ (model.onnx + model.onnx_data), vae_encoder/ (latent_parameters), vae_decoder/,
each with its config.json. optimum's int64 input_ids and int64 timestep are used there. The second
folder is a diffusers OnnxStableDiffusionPipeline layout (diffusers' conversion script: axes
batch / channels / height / width / sequence, the UNet's weights in `weights.pb`, int32 input_ids,
float timestep). The optimum folder compiles for onnxruntime and openvino, the diffusers one for
onnxruntime (the test stays under 60 s), and each engine's outputs equal the foreign model.onnx run
directly in onnxruntime on the same inputs (1e-5). `precast build` with such a folder as model.source
(compiler/bundle_foreign.py) writes a bundle `precast generate` runs: from optimum's real export its image matches
optimum's ORTStableDiffusionPipeline on the folder, from the made folders precast's own bundle of the same
checkpoint (PSNR >= 40 dB).
"""
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import reference as ref
from conftest import precast
from precast.compiler.cache import Cache
from precast.compiler.demo_model import TINY, write_demo_model
from precast.runtime.sessions import open_artifact

OPTIMUM = {   # name -> (inputs, outputs, dynamic axes) as optimum's SD ONNX configs declare them
    "text_encoder": (["input_ids"], ["last_hidden_state", "pooler_output"],
                     {"input_ids": {0: "batch_size", 1: "sequence_length"},
                      "last_hidden_state": {0: "batch_size", 1: "sequence_length"}, "pooler_output": {0: "batch_size"}}),
    "unet": (["sample", "timestep", "encoder_hidden_states"], ["out_sample"],
             {"sample": {0: "batch_size", 2: "height", 3: "width"}, "timestep": {0: "steps"},
              "encoder_hidden_states": {0: "batch_size", 1: "sequence_length"},
              "out_sample": {0: "batch_size", 2: "height", 3: "width"}}),
    "vae_encoder": (["sample"], ["latent_parameters"],
                    {"sample": {0: "batch_size", 1: "num_channels", 2: "height", 3: "width"},
                     "latent_parameters": {0: "batch_size", 1: "num_channels_latent", 2: "height_latent",
                                           3: "width_latent"}}),
    "vae_decoder": (["latent_sample"], ["sample"],
                    {"latent_sample": {0: "batch_size", 1: "num_channels_latent", 2: "height_latent",
                                       3: "width_latent"},
                     "sample": {0: "batch_size", 1: "num_channels", 2: "height", 3: "width"}}),
}
DIFFUSERS = {  # diffusers' convert_stable_diffusion_checkpoint_to_onnx.py
    "text_encoder": (["input_ids"], ["last_hidden_state", "pooler_output"],
                     {"input_ids": {0: "batch", 1: "sequence"}}),
    "unet": (["sample", "timestep", "encoder_hidden_states"], ["out_sample"],
             {"sample": {0: "batch", 1: "channels", 2: "height", 3: "width"}, "timestep": {0: "batch"},
              "encoder_hidden_states": {0: "batch", 1: "sequence"}}),
    "vae_encoder": (["sample"], ["latent_sample"], {"sample": {0: "batch", 1: "channels", 2: "height", 3: "width"}}),
    "vae_decoder": (["latent_sample"], ["sample"],
                    {"latent_sample": {0: "batch", 1: "channels", 2: "height", 3: "width"}}),
}


class _Text(torch.nn.Module):
    def __init__(self, te):
        super().__init__()
        self.te = te

    def forward(self, input_ids):
        out = self.te(input_ids.long())
        return out.last_hidden_state, out.pooler_output


class _Unet(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states).sample


class _Enc(torch.nn.Module):
    def __init__(self, vae, moments):
        super().__init__()
        self.vae, self.moments = vae, moments

    def forward(self, sample):
        dist = self.vae.encode(sample).latent_dist
        return dist.parameters if self.moments else dist.mean


class _Dec(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return self.vae.decode(latent_sample).sample


def _export(module, args, folder: Path, names, weights_file: str | None):
    folder.mkdir(parents=True)
    inputs, outputs, axes = names
    path = folder / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    if weights_file:     # optimum: model.onnx_data; diffusers' script: weights.pb
        model = onnx.load(str(path))
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=weights_file, size_threshold=0)


def _foreign_folder(root: Path, models, layout: str) -> Path:
    unet, vae, te = models
    names = OPTIMUM if layout == "optimum" else DIFFUSERS
    ids_dtype, t_dtype = (torch.int64, torch.int64) if layout == "optimum" else (torch.int32, torch.float32)
    out = root / layout
    ctx = torch.randn(2, 77, TINY.context_dim)
    _export(_Text(te), (torch.zeros(1, 77, dtype=ids_dtype),), out / "text_encoder", names["text_encoder"], None)
    _export(_Unet(unet), (torch.randn(2, 4, 8, 8), torch.tensor([10, 10], dtype=t_dtype), ctx), out / "unet",
            names["unet"], "model.onnx_data" if layout == "optimum" else "weights.pb")
    _export(_Enc(vae, layout == "optimum"), (torch.randn(1, 3, 64, 64),), out / "vae_encoder",
            names["vae_encoder"], None)
    _export(_Dec(vae), (torch.randn(1, 4, 8, 8),), out / "vae_decoder", names["vae_decoder"], None)
    if layout == "optimum":      # optimum writes each component's config next to its graph
        (out / "unet" / "config.json").write_text(json.dumps(dict(unet.config)))
        for part in ("vae_encoder", "vae_decoder"):
            (out / part / "config.json").write_text(json.dumps(dict(vae.config)))
        te.config.to_json_file(str(out / "text_encoder" / "config.json"))
    (out / "scheduler").mkdir()
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "PNDMScheduler"}))
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline" if layout == "optimum" else "OnnxStableDiffusionPipeline",
        **{c: ["diffusers", "OnnxRuntimeModel"] for c in names}}))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("foreign")
    write_demo_model(str(tmp / "tiny.safetensors"))
    models = ref.models_from_single_file(tmp / "tiny.safetensors", TINY)
    return {layout: _foreign_folder(tmp, models, layout) for layout in ("optimum", "diffusers")}


def _feeds(folder: Path, component: str) -> dict:
    import onnxruntime as ort
    rng = np.random.default_rng(3)
    inputs = ort.InferenceSession(str(folder / component / "model.onnx")).get_inputs()
    types, ranks = {i.name: i.type for i in inputs}, {i.name: len(i.shape) for i in inputs}
    ids_dtype = np.int64 if types.get("input_ids") == "tensor(int64)" else np.int32
    t_dtype = np.int64 if types.get("timestep") == "tensor(int64)" else np.float32
    # optimum-onnx 0.1.0's own UNet export takes one scalar timestep for the whole batch
    timestep = np.array([500, 20], t_dtype) if ranks.get("timestep", 1) else np.array(500, t_dtype)
    return {
        "text_encoder": {"input_ids": np.array([[49406, 320, 1125, 49407] + [49407] * 73], ids_dtype)},
        "unet": {"sample": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
                 "timestep": timestep,
                 "encoder_hidden_states": rng.standard_normal((2, 77, TINY.context_dim)).astype(np.float32)},
        "vae_encoder": {"sample": rng.standard_normal((1, 3, 64, 64)).astype(np.float32)},
        "vae_decoder": {"latent_sample": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)},
    }[component]


def test_read_foreign_maps_axes_and_family(folders):
    from precast.compiler.foreign_onnx import read_foreign
    comps, report = read_foreign(folders["optimum"])
    assert report["family"] == "sd1" and set(comps) == {"text_encoder", "unet", "vae_encoder", "vae_decoder"}
    shapes = {c: {t["name"]: t["shape"] for t in comps[c].inputs + comps[c].outputs} for c in comps}
    assert shapes["unet"]["sample"] == ["batch", 4, "height", "width"]
    assert shapes["unet"]["timestep"] == ["steps"] and shapes["unet"]["encoder_hidden_states"] == ["batch", "sequence", 64]
    assert shapes["vae_encoder"] == {"sample": ["batch", 3, "height", "width"],
                                     "latent_parameters": ["batch", 8, "latent_height", "latent_width"]}
    assert shapes["vae_decoder"]["latent_sample"] == ["batch", 4, "latent_height", "latent_width"]
    assert shapes["text_encoder"]["input_ids"] == ["batch", "sequence"]
    assert comps["unet"].sizes.keys() == {"model.onnx", "model.onnx_data"}
    dcomps, _ = read_foreign(folders["diffusers"])
    assert [t["shape"] for t in dcomps["vae_decoder"].inputs] == [["batch", 4, "latent_height", "latent_width"]]
    assert "weights.pb" in dcomps["unet"].sizes


@pytest.mark.parametrize("layout", ["optimum", "diffusers"])
def test_compile_foreign_folder_matches_its_onnx(folders, tmp_path, layout):
    import onnxruntime as ort
    folder, env = folders[layout], {"PRECAST_CACHE": str(tmp_path / "cache")}
    backends = ("onnxruntime", "openvino") if layout == "optimum" else ("onnxruntime",)   # < 60 s in all
    args = ("compile", folder, *[a for b in backends for a in ("--target", b)], "--height", "64", "--width", "64",
            "--json")
    proc = precast(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)["artifacts"]
    assert sorted((r["backend"], r["component"]) for r in records) == sorted(
        (b, c) for b in backends for c in ("text_encoder", "unet", "vae_encoder", "vae_decoder"))
    assert all(r["cache"] == "miss" for r in records)
    _engines_match_folder(folder, records, env["PRECAST_CACHE"])
    if layout == "optimum":     # a second compile: every engine from the cache
        again = precast(*args, env=env)
        assert again.returncode == 0, again.stderr
        assert [r["cache"] for r in json.loads(again.stdout)["artifacts"]] == ["hit"] * 8


def _engines_match_folder(folder: Path, records: list, cache: str) -> None:
    """Each engine `precast compile` recorded gives the outputs of the folder's own model.onnx run directly in
    ONNX Runtime on the same inputs (1e-5)."""
    import onnxruntime as ort
    for rec in records:
        entry, _ = Cache(cache).get(rec["key"])
        feeds = _feeds(folder, rec["component"])
        got = open_artifact(entry.path, entry.metadata).run(feeds)
        sess = ort.InferenceSession(str(folder / rec["component"] / "model.onnx"), providers=["CPUExecutionProvider"])
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        assert set(got) == set(want), rec["component"]
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{rec['backend']} {rec['component']} {name}")


@pytest.fixture(scope="module")
def real_optimum(tiny_bundle, tmp_path_factory):
    """The folder optimum's own exporter writes (`optimum-cli export onnx --task text-to-image`, run through
    its Python API in the side environment of tests/side_env.py: optimum-onnx 0.1.0 needs transformers<4.58)
    from a tiny seeded diffusers StableDiffusionPipeline, and `precast compile` of it for ONNX Runtime and
    OpenVINO: (folder, records, cache)."""
    import side_env
    tmp = tmp_path_factory.mktemp("real-optimum")
    report = side_env.run_side({"export": {"tokenizer": str(tiny_bundle[0] / "onnx" / "tokenizer"),
                                           "model": str(tmp / "diffusers"), "out": str(tmp / "optimum")}},
                               tmp / "side")
    assert report["optimum-onnx"] == "0.1.0", report
    folder, env = tmp / "optimum", {"PRECAST_CACHE": str(tmp / "cache")}
    proc = precast("compile", folder, "--target", "onnxruntime", "--target", "openvino", "--height", "64",
                   "--width", "64", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return folder, json.loads(proc.stdout)["artifacts"], env["PRECAST_CACHE"]


def test_real_optimum_export_is_read(real_optimum):
    from precast.compiler.foreign_onnx import read_foreign
    folder, records, _ = real_optimum
    comps, found = read_foreign(folder)
    assert found["family"] == "sd1" and set(comps) == {"text_encoder", "unet", "vae_encoder", "vae_decoder"}
    shapes = {c: {t["name"]: t["shape"] for t in comps[c].inputs + comps[c].outputs} for c in comps}
    assert shapes["unet"]["sample"] == ["batch", 4, "height", "width"]
    assert shapes["unet"]["timestep"] == []            # optimum-onnx 0.1.0: one scalar timestep
    assert shapes["unet"]["encoder_hidden_states"] == ["batch", "sequence", 64]
    assert shapes["vae_encoder"]["sample"] == ["batch", 3, "height", "width"]   # its sample_height / sample_width
    assert shapes["vae_decoder"]["latent_sample"] == ["batch", 4, "latent_height", "latent_width"]
    assert sorted((r["backend"], r["component"]) for r in records) == sorted(
        (b, c) for b in ("onnxruntime", "openvino") for c in ("text_encoder", "unet", "vae_encoder", "vae_decoder"))


@pytest.mark.parametrize("component", ["text_encoder", "unet", "vae_encoder", "vae_decoder"])
def test_real_optimum_engines_match_its_onnx(real_optimum, component):
    folder, records, cache = real_optimum
    _engines_match_folder(folder, [r for r in records if r["component"] == component], cache)


def test_weights_change_changes_the_key(folders, tmp_path):
    """The UNet's weights.pb (not model.onnx_data) is in the cache key: a changed file is a new build."""
    import shutil
    from precast.compiler.engines import compile_component, read_export
    from precast.compiler.profiles import ShapeProfile
    from precast.compiler.targets import parse_target
    folder = tmp_path / "copy"
    shutil.copytree(folders["diffusers"], folder)
    cache, spec = Cache(tmp_path / "cache"), parse_target("onnxruntime", {})
    profile = ShapeProfile(height=(64, 64, 64), width=(64, 64, 64))
    first, _ = compile_component(read_export(folder)["unet"], spec, profile, cache, progress=False)
    data = folder / "unet" / "weights.pb"
    raw = bytearray(data.read_bytes())
    raw[-4:] = b"\x00\x00\x80\x3f"
    data.write_bytes(bytes(raw))
    second, _ = compile_component(read_export(folder)["unet"], spec, profile, cache, progress=False)
    assert second["cache"] == "miss" and second["key"] != first["key"]


@pytest.mark.parametrize("damage, says", [
    ("axis", "vae_decoder input latent_sample: axis 0 is named 'frames'"),
    ("elem_type", "vae_decoder/model.onnx: latent_sample has element type 999, which ONNX does not define"),
    ("location", "is not a file name beside the graph"),
])
def test_unmappable_or_hostile_graph_is_one_line(folders, tmp_path, damage, says):
    import shutil
    folder = tmp_path / "odd"
    shutil.copytree(folders["optimum"], folder)
    path = folder / "vae_decoder" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    if damage == "axis":
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "frames"
    elif damage == "elem_type":
        model.graph.input[0].type.tensor_type.elem_type = 999
    else:                                       # weights moved out to a file, then one pointed outside the folder
        onnx.save_model(onnx.load(str(path)), str(path), save_as_external_data=True, location="model.onnx_data",
                        size_threshold=0)
        model = onnx.load(str(path), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        for e in external[0].external_data:
            if e.key == "location":
                e.value = "../../../etc/passwd"
    path.write_bytes(model.SerializeToString())
    proc = precast("compile", folder, "--target", "onnxruntime", "--component", "vae_decoder")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _recipe(tmp_path: Path, folder: Path, extra: str = "") -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: foreign\nmodel:\n  source: {folder}\nprofiles: {{batch: 1, height: 64, width: 64}}\n"
                      f"targets: [onnxruntime]\n{extra}")
    return recipe


def test_build_from_real_optimum_export_matches_optimum(real_optimum, tmp_path):
    """`precast build` of optimum's own export (issue 18, item 4): a normal bundle (the folder's graphs, weights,
    configs, scheduler and tokenizer under onnx/, ONNX Runtime engines through the cache `precast compile` filled,
    the family, prediction type and latent scale from the folder); `precast generate` runs it (optimum's int64
    input_ids and 0-d timestep), and its image from given noise matches optimum's ORTStableDiffusionPipeline run
    on the same folder in the side environment (DPM-Solver++ 2M in the folder's scheduler config, 4 steps,
    guidance 7.5): PSNR >= 40 dB in fp32."""
    import shutil
    from test_interop import GUIDANCE, PROMPT, STEPS, psnr, run_side
    from precast.compiler.interop import scheduler_config
    from precast.runtime.manifest import verify_bundle
    from precast.runtime.families.sd import Txt2Img
    folder, _, cache = real_optimum
    bundle, env = tmp_path / "bundle", {"PRECAST_CACHE": cache}
    proc = precast("build", _recipe(tmp_path, folder), "--out", bundle, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    engines = [r for r in json.loads(proc.stdout)["artifacts"] if r["backend"] == "onnxruntime"]
    assert sorted(r["component"] for r in engines) == ["text_encoder", "unet", "vae_decoder", "vae_encoder"]
    assert verify_bundle(bundle) == []
    manifest = json.loads((bundle / "manifest.json").read_text())
    model = manifest["model"]
    assert (model["family"], model["prediction"], model["latent_scale"]) == ("sd1", "epsilon", 0.18215)
    assert model["onnx_source"]["layout"] == "optimum"
    unet = manifest["components"]["unet"]
    assert {t["name"]: t["shape"] for t in unet["inputs"]}["timestep"] == []
    assert set(unet["files"]) == {"onnx/unet/model.onnx", "onnx/unet/config.json"}   # weights inside (3 MB)
    for rel in ("tokenizer/vocab.json", "onnx/tokenizer/merges.txt", "onnx/model_index.json",
                "onnx/scheduler/scheduler_config.json"):
        assert (bundle / rel).is_file(), rel
    png = tmp_path / "x.png"
    gen = precast("generate", bundle, "--prompt", PROMPT, "--steps", "2", "--out", png, env=env)
    assert gen.returncode == 0, gen.stderr
    assert png.stat().st_size > 0
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ours = Txt2Img(bundle, None, width=64, height=64)(PROMPT, "", STEPS, 0, GUIDANCE, "dpm++2m", latents=noise,
                                                       progress=False)
    theirs_folder = tmp_path / "theirs"          # the same graphs, with precast's dpm++2m as the folder's scheduler
    shutil.copytree(folder, theirs_folder)
    (theirs_folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(scheduler_config({"family": "sd1", "prediction": "epsilon"})))
    index = json.loads((theirs_folder / "model_index.json").read_text())    # the class is read from here
    (theirs_folder / "model_index.json").write_text(
        json.dumps({**index, "scheduler": ["diffusers", "DPMSolverMultistepScheduler"]}))
    theirs = run_side(tmp_path / "side", "optimum.onnxruntime", "ORTStableDiffusionPipeline", theirs_folder,
                      {"prompt": PROMPT, "height": 64, "width": 64, "num_inference_steps": STEPS,
                       "guidance_scale": GUIDANCE}, noise)
    assert theirs.shape == ours.shape and theirs.std() > 0.01
    print(f"PSNR {psnr(theirs, ours):.1f} dB")
    assert psnr(theirs, ours) >= 40


def test_build_from_foreign_folder_refuses_what_its_graphs_cannot_take(folders, tmp_path):
    """A LoRA (merged into weights at export), a component the folder lacks or a precision its graphs are not
    in: one line, before any work."""
    lora = tmp_path / "l.safetensors"
    lora.write_bytes(b"")
    proc = precast("build", _recipe(tmp_path, folders["optimum"], f"loras: [{lora}]\n"), "--out", tmp_path / "b")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "loras: not with an ONNX pipeline folder" in proc.stderr
    proc = precast("build", _recipe(tmp_path, folders["optimum"], "components: [text_encoder, unet, vae_decoder, "
                                    "text_encoder_2]\n"), "--out", tmp_path / "b")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "has no text_encoder_2 (it has text_encoder, unet, vae_encoder, vae_decoder)" in proc.stderr
    proc = precast("build", _recipe(tmp_path, folders["optimum"], "precision: fp16\n"), "--out", tmp_path / "b")
    assert proc.returncode != 0 and "an ONNX folder's graphs are built at their own precision" in proc.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("layout", ["optimum", "diffusers"])
def test_build_from_foreign_folder_matches_precasts_own_bundle(folders, tiny_bundle, tmp_path, layout):
    """Both layouts (optimum's int64 [steps] timestep and int64 ids; diffusers' float [batch] timestep, int32 ids,
    weights.pb, no configs or tokenizer) exported from the demo checkpoint tiny_bundle is built from: `precast build`
    of the folder gives the image precast's own bundle gives from the same noise (PSNR >= 40 dB, fp32)."""
    from test_interop import GUIDANCE, PROMPT, STEPS, psnr
    from precast.runtime.families.sd import Txt2Img
    bundle = tmp_path / "bundle"
    proc = precast("build", _recipe(tmp_path, folders[layout], "components: [text_encoder, unet, vae_decoder]\n"),
                   "--out", bundle, env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((bundle / "manifest.json").read_text())["model"]["onnx_source"]["layout"] == layout
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    run = lambda b: Txt2Img(b, "cpu", width=64, height=64)(PROMPT, "", STEPS, 0, GUIDANCE, "dpm++2m", latents=noise,
                                                           progress=False)
    theirs, ours = run(bundle), run(tiny_bundle[0])
    assert ours.std() > 0.01
    print(f"{layout} PSNR {psnr(theirs, ours):.1f} dB")
    assert psnr(theirs, ours) >= 40
