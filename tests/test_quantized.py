"""Weight-only quantized engines (target option `weights`) and memory budgets (--params-backend DEVICE:SIZE).

Quantized artifacts of the tiny SD 1.5 UNet and the tiny Flux schnell transformer build, load in the
runtime and run; their output stays within a stated error of the fp32 artifact's on fixed inputs.
Metric: relative L2 error ||y_q - y_fp32|| / ||y_fp32|| of the denoiser's output (its noise / velocity
prediction) on one fixed latent, timestep and text embedding. The denoiser is where weight
quantization acts (VAEs are not quantized) and its output is what the sampler integrates each step,
so its error bounds the image's; L2 over the whole tensor rather than the max because weight rounding
errors are spread, zero-mean noise. The tiny models have random (untrained) weights, whose
outlier-free Gaussian distribution makes them easier to quantize per channel but whose narrow (32-64)
layers average rounding errors less than a real model's: thresholds are ~2x what was measured here.
TensorRT-RTX fp8 engines build ahead of time (no GPU) for sm_89/sm_120, their headers checked; not
run (not verified on hardware). Budgets: selection on recorded 8 GB / 12 GB NVIDIA and Iris Xe machines.
"""
import json
import os
import weakref

import numpy as np
import pytest

from conftest import ROOT, build_recipe, linear_weights, precast
from precast.compiler.errors import BadInput
from precast.compiler.targets import parse_target
from precast.runtime.assign import assign_modules, parse_size
from precast.runtime.devices import discover_devices
from precast.runtime.fingerprint import Fingerprint
from precast.runtime.manifest import Manifest
from precast.runtime.budgets import share_budgets as _share_budgets
from precast.runtime.select import select_component
from precast.runtime.sessions import open_artifact
from precast.runtime.trt_header import read_header

MACHINES = f"{ROOT}/tests/data/machines"
GiB = 1 << 30
# measured here (tiny random-weight models), thresholds with ~2x margin: see the module docstring
# (reference: the fp32 ONNX Runtime artifact, so OpenVINO's own f32-vs-ONNX-Runtime difference is included;
# both compress the Linears only: OpenVINO's int8 convolutions, left out on the CPU since, cost the UNet 0.036)
MEASURED = {"sd": {"onnxruntime-int8": 0.0108, "openvino-int8": 0.0121, "openvino-int4": 0.194},
            "flux": {"onnxruntime-int8": 0.017, "openvino-int8": 0.025, "openvino-int4": 0.281}}
THRESHOLD = {"onnxruntime-int8": 0.035, "openvino-int8": 0.05, "openvino-int4": 0.45}

SD_TARGETS = ("  - onnxruntime\n  - {onnxruntime: {weights: int8}}\n  - {openvino: {device: CPU, weights: int8}}\n"
              "  - {openvino: {device: CPU, weights: int4, group_size: 64}}\n"
              "  - {tensorrt-rtx: {compute_capabilities: [sm_89, sm_120], weights: fp8, weight_streaming: true}}\n")
FLUX_TARGETS = ("  - onnxruntime\n  - {onnxruntime: {weights: int8}}\n  - {openvino: {device: CPU, weights: int8}}\n"
                "  - {openvino: {device: CPU, weights: int4}}\n")


def _build(tmp, name, source, components, targets, extra=""):
    recipe = tmp / f"{name}.yaml"
    recipe.write_text(f"model: {{source: {source}}}\ncomponents: [{', '.join(components)}]\n"
                      f"profiles: {{batch: 1, height: 64, width: 64{extra}}}\ntargets:\n{targets}")
    precast("build", recipe, "--out", tmp / name, env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    return tmp / name


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantized")
    return {"sd": _build(tmp, "sd", "demo:tiny-sd15", ["unet"], SD_TARGETS),
            "flux": _build(tmp, "flux", "demo:tiny-flux-schnell", ["transformer"], FLUX_TARGETS, ", t5_tokens: 32")}


def _kind(a: dict) -> str:
    w = a["target"].get("weights")
    return f"{a['backend']}-{w}" if w else f"{a['backend']}-fp32"


def _feeds(artifact: dict, inputs: list[dict]) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for i in inputs:
        shape = artifact["shapes"][i["name"]][1]          # the profile's opt shape
        if i["dtype"].startswith("int"):
            out[i["name"]] = rng.integers(0, 100, shape).astype(i["dtype"])
        elif i["name"] in ("timestep", "timesteps", "t"):
            out[i["name"]] = np.full(shape, 0.5 if "transformer" == artifact["component"] else 500.0, np.float32)
        else:
            out[i["name"]] = rng.standard_normal(shape).astype(np.float32)
    return out


@pytest.mark.parametrize("model", ["sd", "flux"])
def test_quantized_artifacts_run_within_error_of_fp32(bundles, model):
    bundle = bundles[model]
    manifest = json.loads((bundle / "manifest.json").read_text())
    comp = "unet" if model == "sd" else "transformer"
    inputs = manifest["components"][comp]["inputs"]
    arts = {_kind(a): a for a in manifest["artifacts"] if a["component"] == comp and a["backend"] != "tensorrt-rtx"}
    assert set(arts) == {"onnxruntime-fp32", "onnxruntime-int8", "openvino-int8", "openvino-int4"}
    feeds = _feeds(arts["onnxruntime-fp32"], inputs)

    def run(a):
        session = open_artifact(bundle, {"backend": a["backend"], "entry": a["entry"], **a["metadata"]})
        return next(iter(session.run(feeds).values())).astype(np.float64)

    ref = run(arts["onnxruntime-fp32"])
    errors = {}
    for kind in ("onnxruntime-int8", "openvino-int8", "openvino-int4"):
        a = arts[kind]
        w = a["metadata"]["weights"]                   # recorded in the manifest: format and how
        assert w["format"] == kind.split("-")[1]
        assert a["target"]["weights"] == w["format"]   # the option is part of the target (hence of the key)
        out = run(a)
        errors[kind] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        assert errors[kind] > 0, f"{kind}: output identical to fp32: nothing was quantized"
    print(model, {k: round(v, 4) for k, v in errors.items()})
    for kind, err in errors.items():
        assert err < THRESHOLD[kind], f"{model} {kind}: relative L2 error {err:.4f} >= {THRESHOLD[kind]}"
    ort = arts["onnxruntime-int8"]["metadata"]["weights"]
    assert ort["op"] == "MatMulNBits" and ort["bits"] == 8 and ort["matmuls"] > 0
    # every Linear (Flux: the parts of fused qkv / modulation weights too) in both quantizers, and on OpenVINO's
    # CPU nothing else: its plugin widens int8 convolution weights back to f32, so the UNet's stay float
    linears = linear_weights(bundle / manifest["components"][comp]["onnx"])
    if model == "flux":
        assert ort["matmuls"] == linears, (ort, linears)
    ov8 = arts["openvino-int8"]["metadata"]["weights"]
    assert ov8["matmuls"] == linears and ov8["constants"]["u8"] == 2 * linears, (ov8, linears)  # weight + zero point
    assert ov8["kept_float"] == (["Convolution"] if model == "sd" else []), ov8
    assert "i4" in json.dumps(arts["openvino-int4"]["metadata"]["weights"]["constants"])
    # distinct cache keys: same component and backend, different weights
    keys = {a["id"].rsplit("/", 1)[1] for a in arts.values()}
    assert len(keys) == 4


def test_tensorrt_rtx_fp8_engine_builds_for_ada_and_blackwell(bundles):
    manifest = json.loads((bundles["sd"] / "manifest.json").read_text())
    (a,) = [a for a in manifest["artifacts"] if a["backend"] == "tensorrt-rtx"]
    assert a["metadata"]["weights"]["format"] == "fp8_e4m3" and a["metadata"]["weights"]["matmuls"] > 0
    with open(bundles["sd"] / a["entry"], "rb") as f:
        header = read_header(f.read(64))
    assert header.compute_capabilities == ("sm_89", "sm_120")
    assert header.size == os.path.getsize(bundles["sd"] / a["entry"])


@pytest.mark.parametrize("target,options,words", [
    ("tensorrt-rtx:sm_86", {"weights": "fp8"}, ["FP8 tensor cores", "sm_86", "weights=int8"]),
    ("tensorrt-rtx:sm_86,sm_89", {"weights": "fp8"}, ["sm_86 has none", "tensorrt-rtx:sm_89"]),
    ("tensorrt-rtx", {"weights": "fp8"}, ["sm_80, sm_86 has none"]),     # the default set includes Ampere
    ("tensorrt-rtx:sm_89", {"weights": "int4"}, ["tensorrt-rtx takes fp8, int8"]),
    ("openvino", {"weights": "fp8"}, ["openvino takes int8, int4", "TensorRT-RTX format"]),
    ("onnxruntime", {"weights": "fp8"}, ["onnxruntime takes int8, int4"]),
    ("openvino", {"weights": "int8", "group_size": 64}, ["group_size applies to weights=int4"]),
    ("onnxruntime", {"block_size": 32}, ["block_size applies to quantized weights only"]),
    ("openvino", {"weights": "int2"}, ["weights='int2'", "expected a weight format"]),
])
def test_bad_combinations_are_refused_in_one_line(target, options, words):
    with pytest.raises(BadInput) as e:
        parse_target(target, options)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_fp8_for_ampere_is_refused_when_the_recipe_is_read(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [unet]\n"
                      "targets:\n  - {tensorrt-rtx: {compute_capabilities: [sm_86], weights: fp8}}\n")
    proc = precast("plan", recipe)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{recipe}:4: targets[0]" in proc.stderr and "FP8 tensor cores" in proc.stderr


def test_bf16_export_builds_an_onnxruntime_int8_cpu_fallback(bundles, tmp_path):
    """Flux ships bf16, which ONNX Runtime's CPU provider cannot run: with weights int8 the same bf16
    export builds (MatMulNBits, fp32 compute) and matches the fp32 artifact as closely as an fp32
    export quantized (the demo's weights are bf16 values, so both quantize the same numbers)."""
    recipe = tmp_path / "bf16.yaml"
    base = ("model: {source: demo:tiny-flux-schnell}\ncomponents: [transformer]\nprecision: {default: bf16}\n"
            "profiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\ntargets:\n")
    recipe.write_text(base + "  - onnxruntime\n")
    proc = precast("plan", recipe)
    assert proc.returncode == 2 and "bf16" in proc.stderr and "weights: int8" in proc.stderr, proc.stderr
    recipe.write_text(base + "  - {onnxruntime: {weights: int8}}\n")
    precast("build", recipe, "--out", tmp_path / "b", env={"PRECAST_CACHE": str(tmp_path / "cache")}, check=True)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    (a,) = [a for a in manifest["artifacts"] if a["component"] == "transformer"]
    assert a["metadata"]["weights"]["activations"] == "fp32 (from bf16)"
    ref_bundle = bundles["flux"]
    ref_manifest = json.loads((ref_bundle / "manifest.json").read_text())
    arts = {_kind(r): r for r in ref_manifest["artifacts"] if r["component"] == "transformer"}
    feeds = _feeds(arts["onnxruntime-fp32"], ref_manifest["components"]["transformer"]["inputs"])

    def run(bundle, art):
        session = open_artifact(bundle, {"backend": art["backend"], "entry": art["entry"], **art["metadata"]})
        return next(iter(session.run(feeds).values())).astype(np.float64)

    ref = run(ref_bundle, arts["onnxruntime-fp32"])
    out = run(tmp_path / "b", a)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    from_fp32 = float(np.linalg.norm(run(ref_bundle, arts["onnxruntime-int8"]) - ref) / np.linalg.norm(ref))
    assert 0 < err < THRESHOLD["onnxruntime-int8"] and abs(err - from_fp32) < 0.2 * from_fp32, (err, from_fp32)


def test_openvino_ir_store_runs_like_the_blob(bundles, tmp_path):
    """store: ir (what `auto` picks for exports over 4 GiB) keeps the compressed model as model.xml/.bin,
    compiled when loaded: same output as the int8 blob."""
    b = build_recipe(tmp_path, "model: {source: demo:tiny-flux-schnell}\ncomponents: [transformer]\n"
                               "profiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\n"
                               "targets:\n  - {openvino: {device: CPU, weights: int8, store: ir}}\n", "b")
    manifest = json.loads((b / "manifest.json").read_text())
    (a,) = [a for a in manifest["artifacts"] if a["component"] == "transformer"]
    assert a["entry"].endswith("model.xml") and a["metadata"]["store"] == "ir"
    assert any(f.endswith("model.bin") for f in a["files"])
    ref_manifest = json.loads((bundles["flux"] / "manifest.json").read_text())
    arts = {_kind(r): r for r in ref_manifest["artifacts"] if r["component"] == "transformer"}
    feeds = _feeds(arts["onnxruntime-fp32"], ref_manifest["components"]["transformer"]["inputs"])

    def run(bundle, art):
        session = open_artifact(bundle, {"backend": art["backend"], "entry": art["entry"], **art["metadata"]})
        return next(iter(session.run(feeds).values())).astype(np.float64)

    blob = run(bundles["flux"], arts["openvino-int8"])
    ir = run(b, a)
    assert np.linalg.norm(ir - blob) <= 1e-5 * np.linalg.norm(blob)


# --- memory budgets ---------------------------------------------------------------------------

def test_budget_grammar():
    devices = discover_devices(f"{MACHINES}/rtx4060-desktop", {})
    assert parse_size("8G") == parse_size("8GiB") == 8 * GiB and parse_size("512m") == 512 << 20
    p = assign_modules(devices, None, "te=cpu,cuda0:6G,cpu:16G")
    assert dict(p["diffusion"].budgets) == {"cuda0": 6 * GiB, "cpu": 16 * GiB}
    assert p["te"].params.id == "cpu" and not p["diffusion"].offload


def _manifest(tmp_path, sizes: dict, streaming: bool, backend="tensorrt-rtx", arch="sm_89"):
    """A bundle manifest with Flux-sized files (sizes only; verify off) for the selection to hold
    against budgets: component -> engine bytes; the ONNX fallback as large as the engine."""
    fp = (Fingerprint("tensorrt-rtx", "1.7.1.116", "nvidia", "gpu", (arch,), "525.60") if backend == "tensorrt-rtx"
          else Fingerprint("openvino", "2026.4.1-22982", "intel", "gpu", ("xe-lp",)))
    data = {"components": {}, "files": {}, "artifacts": []}
    for comp, size in sizes.items():
        data["components"][comp] = {"onnx": f"onnx/{comp}/model.onnx", "files": [f"onnx/{comp}/model.onnx"],
                                    "inputs": [], "outputs": []}
        data["files"][f"onnx/{comp}/model.onnx"] = {"size": size, "sha256": "0" * 64}
        data["files"][f"artifacts/{comp}/e"] = {"size": size, "sha256": "0" * 64}
        data["artifacts"].append({"id": f"{comp}.{backend}/k", "component": comp, "backend": backend,
                                  "fingerprint": fp.to_string(), "entry": f"artifacts/{comp}/e",
                                  "files": [f"artifacts/{comp}/e"], "shapes": {},
                                  "metadata": {"weight_streaming": streaming}})
    return Manifest(tmp_path, data)


INSTALLED = {"tensorrt-rtx": "1.7.1.116", "onnxruntime": "1.32.0", "openvino": "2026.4.1-22982"}
FLUX_FP8 = {"transformer": int(11.9e9), "text_encoder_2": int(4.9e9), "vae_decoder": int(0.16e9)}


def _select(tmp_path, machine, sizes, streaming, params=None, **kw):
    devices = discover_devices(f"{MACHINES}/{machine}", {})
    m = _manifest(tmp_path, sizes, streaming, **kw)
    placements = assign_modules(devices, None, params)
    from precast.runtime.assign import module_of
    sels = {c: select_component(m, c, placements[module_of(c)], devices, {}, INSTALLED, False) for c in sizes}
    _share_budgets(sels, placements, devices)
    return sels


def test_8gb_card_streams_the_flux_fp8_transformer(tmp_path):
    sels = _select(tmp_path, "rtx4060-desktop", FLUX_FP8, streaming=True)
    t = sels["transformer"].choice
    assert t.device.id == "cuda0" and t.memory["plan"] == "stream" and t.memory["budget"] == 8 * GiB
    assert t.memory["budget_from"] == "device memory" and t.weight_budget == 8 * GiB
    assert "streams 3.08 GiB of 11.08 GiB weights from host memory" in t.note


def test_8gb_card_without_weight_streaming_offloads_to_the_cpu(tmp_path):
    sels = _select(tmp_path, "rtx4060-desktop", FLUX_FP8, streaming=False)
    t = sels["transformer"]
    assert t.choice.device.id == "cpu" and t.choice.artifact is None          # the bundle's ONNX on the CPU
    (why,) = [r for r in t.refused if r["backend"] == "tensorrt-rtx"]
    assert "weights 11.08 GiB exceed cuda0's budget 8.00 GiB (device memory)" in why["reason"]
    assert "not built with weight_streaming" in why["reason"]
    # the T5 (4.6 GiB) and the VAE fit the 8 GB card together: resident
    assert sels["text_encoder_2"].choice.device.id == "cuda0"


def test_12gb_card_loads_components_one_at_a_time(tmp_path):
    sels = _select(tmp_path, "rtx4070-desktop", FLUX_FP8, streaming=True)
    plans = {c: s.choice.memory["plan"] for c, s in sels.items()}
    assert plans == {"transformer": "one-at-a-time", "text_encoder_2": "one-at-a-time", "vae_decoder": "one-at-a-time"}
    assert "loaded one at a time: 3 components need 15.80 GiB together, cuda0's budget is 12.00 GiB" \
        in sels["transformer"].choice.note


def test_user_budget_overrides_the_card(tmp_path):
    sels = _select(tmp_path, "rtx4070-desktop", FLUX_FP8, streaming=True, params="cuda0:6G")
    t = sels["transformer"].choice
    assert t.memory["plan"] == "stream" and t.weight_budget == 6 * GiB
    assert t.memory["budget_from"] == "--params-backend budget"


def test_igpu_shares_half_the_host_memory(tmp_path):
    """Iris Xe on a 16 GB laptop: OpenVINO has no weight streaming; an int8 Flux transformer (11.9 GB)
    exceeds the ~7.5 GiB the iGPU may take and runs on the CPU; an int4 one (6.7 GB) fits."""
    int8 = _select(tmp_path, "iris-xe-laptop", {"transformer": int(11.9e9)}, False, backend="openvino")
    t = int8["transformer"]
    assert t.choice.device.id == "cpu"
    (why,) = [r for r in t.refused if r["device"] == "xpu0"]
    assert "(half of the host memory it shares)" in why["reason"] and "openvino cannot stream weights" in why["reason"]
    int4 = _select(tmp_path, "iris-xe-laptop", {"transformer": int(6.7e9)}, False, backend="openvino")
    chosen = int4["transformer"].choice
    assert chosen.device.id == "xpu0" and chosen.memory["plan"] == "resident"
    # the budget goes to OpenVINO's GPU plugin with the session (sessions.openvino_gpu_memory)
    assert chosen.weight_budget == chosen.memory["budget"] and "OpenVINO GPU plugin given" in chosen.note
    user = _select(tmp_path, "iris-xe-laptop", {"transformer": int(6.7e9)}, False, params="xpu0:7G", backend="openvino")
    assert user["transformer"].choice.weight_budget == 7 * GiB


def test_openvino_gpu_memory_properties():
    """A budget becomes AVAILABLE_DEVICE_MEM_SIZE; past the device's largest single allocation, large
    allocations are allowed (OpenVINO GPU plugin properties; not verified on hardware: no Intel GPU)."""
    from precast.runtime.sessions import openvino_gpu_memory
    assert openvino_gpu_memory(7 * GiB, 4 * GiB) == {"AVAILABLE_DEVICE_MEM_SIZE": str(7 * GiB),
                                                      "GPU_ENABLE_LARGE_ALLOCATIONS": "YES"}
    assert openvino_gpu_memory(3 * GiB, 4 * GiB) == {"AVAILABLE_DEVICE_MEM_SIZE": str(3 * GiB)}
    assert openvino_gpu_memory(3 * GiB, None) == {"AVAILABLE_DEVICE_MEM_SIZE": str(3 * GiB)}
    import openvino._pyopenvino.properties.intel_gpu as gpu     # the names are OpenVINO's own
    assert gpu.hint.available_device_mem() == "AVAILABLE_DEVICE_MEM_SIZE"
    assert gpu.hint.enable_large_allocations() == "GPU_ENABLE_LARGE_ALLOCATIONS"
    assert gpu.device_max_alloc_mem_size() == "GPU_DEVICE_MAX_ALLOC_MEM_SIZE"


def test_doctor_json_says_what_streams(bundles):
    """The tiny SD bundle's fp8 engine (sm_89, weight streaming) on the recorded 8 GB RTX 4060, under a
    1 MiB budget: doctor --json names the plan, the budget and what streams."""
    proc = precast("doctor", bundles["sd"], "--json", "--sysroot", f"{MACHINES}/rtx4060-desktop",
                   "--params-backend", "cuda0:1M")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    unet = report["components"]["unet"]
    assert unet["device"] == "cuda0" and unet["backend"] == "tensorrt-rtx"
    assert unet["memory"]["plan"] == "stream" and unet["memory"]["budget"] == 1 << 20
    assert "from host memory" in unet["note"]
    assert report["assignment"]["diffusion"]["budgets"] == {"cuda0": 1 << 20}
    plain = json.loads(precast("doctor", bundles["sd"], "--json", "--sysroot", f"{MACHINES}/rtx4060-desktop").stdout)
    memory = plain["components"]["unet"]["memory"]
    assert (memory["plan"], memory["budget"], memory["budget_from"]) == ("resident", 8 * GiB, "device memory")


def test_components_load_one_at_a_time_under_a_budget(tmp_path):
    """A CPU budget that each component fits but not all together (--params-backend cpu:SIZE): generate
    says so per component, loads each on first use and releases the others first (the text encoders
    are gone when the transformer runs, the transformer when the VAE decodes), same image as without."""
    from precast.runtime.families.flux import FluxTxt2Img
    build_recipe(tmp_path, "model: {source: demo:tiny-flux-schnell}\ncomponents: [text_encoder, text_encoder_2, "
                           "transformer, vae_decoder]\nprofiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\n"
                           "targets:\n  - onnxruntime\n", "b")
    sizes = {c: sum(f.stat().st_size for f in (tmp_path / "b" / "artifacts" / c).rglob("*") if f.is_file())
             for c in ("text_encoder", "text_encoder_2", "transformer", "vae_decoder")}
    budget = max(sizes.values()) + (1 << 16)
    assert budget < sum(sizes.values())
    plain = FluxTxt2Img(tmp_path / "b")
    image = plain("a cat", steps=2, seed=1)
    model = FluxTxt2Img(tmp_path / "b", params_backend=f"cpu:{budget}")
    assert model.loaded == {}                                   # nothing loaded up front
    live, refs = {}, {}
    original = model.component

    def spy(comp):
        loaded = original(comp)
        live[comp] = sorted(c for c, l in model.loaded.items() if l.session is not None)
        refs.setdefault(comp, weakref.ref(loaded.session))
        if comp == "vae_decoder":     # the transformer's session is gone, not just unlisted
            live["transformer alive at decode"] = refs["transformer"]() is not None
        return loaded
    model.component = spy
    again = model("a cat", steps=2, seed=1)
    assert np.array_equal(np.asarray(image), np.asarray(again))
    assert live["transformer"] == ["transformer"] and live["vae_decoder"] == ["vae_decoder"]
    assert live["transformer alive at decode"] is False
    report = model.report()["components"]
    assert {c: r["memory"]["plan"] for c, r in report.items()} == dict.fromkeys(sizes, "one-at-a-time")
    assert "loaded one at a time: 4 components need" in report["transformer"]["note"]


# --- every Linear quantized, whichever path built the graph (onnxsim's Gemm included) -----------------

def _matmul_float_weights(onnx_path) -> list[str]:
    """Nodes of a built artifact that still multiply by a float 2-D weight of 16 or more rows and columns."""
    import onnx
    m = onnx.load(str(onnx_path), load_external_data=False)
    floats = {t.name for t in m.graph.initializer if len(t.dims) == 2 and min(t.dims) >= 16
              and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)}
    return [f"{n.op_type} {n.name}" for n in m.graph.node
            if n.op_type in ("MatMul", "Gemm", "FusedMatMul", "FusedGemm") and n.input[1] in floats]


@pytest.mark.parametrize("weights,bound", [("int8", THRESHOLD["onnxruntime-int8"]), ("int4", 0.4)])
def test_onnxruntime_quantizes_every_linear_of_a_simplified_graph(demo_ckpt, tmp_path, weights, bound):
    """`precast compile` simplifies (onnxsim) before quantizing; onnxsim fuses MatMul + Add on a 2-D input
    (the UNet's time embedding and its projections into each ResBlock) into Gemm. Those Linears are
    quantized too: the entry's count equals the graph's Linears, no float weight is left in a GEMM, and
    the output stays within the quantization bound of the fp32 export (measured: int8 0.011, int4 0.19)."""
    from pathlib import Path

    import onnx
    import onnxruntime as ort
    export = tmp_path / "export"
    precast("export", demo_ckpt, "--out", export, "--component", "unet", check=True)
    proc = precast("compile", export, "--target", "onnxruntime", "--option", f"weights={weights}", "--height", "64",
                   "--width", "64", "--json", env={"PRECAST_CACHE": str(tmp_path / "cache")}, check=True)
    (a,) = json.loads(proc.stdout)["artifacts"]
    meta = json.loads((Path(a["path"]) / "entry.json").read_text())["metadata"]
    w = meta["weights"]
    assert meta["simplified"], meta          # the path the recipes (simplify: false) never took
    artifact = Path(a["path"]) / "model.onnx"
    assert _matmul_float_weights(artifact) == []
    assert w["matmuls"] == w["linears"] > 0 and "unquantized" not in w and "note:" not in proc.stderr, (w, proc.stderr)
    nbits = sum(n.op_type == "MatMulNBits" for n in onnx.load(str(artifact), load_external_data=False).graph.node)
    assert nbits == w["matmuls"]
    rng = np.random.default_rng(0)
    feeds = {"sample": rng.standard_normal((2, 4, 8, 8)).astype(np.float32), "timestep": np.full(2, 500.0, np.float32),
             "encoder_hidden_states": rng.standard_normal((2, 77, 64)).astype(np.float32)}
    ref = ort.InferenceSession(str(export / "unet" / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    print(weights, round(err, 4))
    assert 0 < err < bound, err


def _gemm_graph(path, dtype=np.float32):
    """A real ONNX file with the Linear forms a graph may hold: Gemm transB=1 with a bias [N] (onnxsim's fusion),
    Gemm transB=0 without one, Gemm with a bias [1, N] (broadcast), MatMul through Transpose, and one Linear
    read through a Cast (no quantizer follows it) -- plus a float reference of each output."""
    import onnx
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    w = {k: (rng.standard_normal((48, 32)) * 0.1).astype(np.float32) for k in "abcdf"}
    b = (rng.standard_normal(48) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(w["a"], "wa"), numpy_helper.from_array(np.ascontiguousarray(w["b"].T), "wb"),
             numpy_helper.from_array(w["c"], "wc"), numpy_helper.from_array(w["d"], "wd"),
             numpy_helper.from_array(w["f"].astype(np.float16), "wf16"),
             numpy_helper.from_array(b, "bias"), numpy_helper.from_array(b[None], "bias2")]
    nodes = [helper.make_node("Gemm", ["x", "wa", "bias"], ["ya"], transB=1, name="gemm_bias"),
             helper.make_node("Gemm", ["x", "wb"], ["yb"], name="gemm_kn"),
             helper.make_node("Gemm", ["x", "wc", "bias2"], ["yc"], transB=1, name="gemm_bias2"),
             helper.make_node("Transpose", ["wd"], ["wdt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wdt"], ["yd"], name="matmul_t"),
             helper.make_node("Cast", ["wf16"], ["wf"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Transpose", ["wf"], ["wft"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wft"], ["yf"], name="matmul_cast")]
    outs = ["ya", "yb", "yc", "yd", "yf"]
    graph = helper.make_graph(nodes, "linears", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 32])],
                              [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [2, 48]) for o in outs], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, location=path.name + "_data", size_threshold=0)
    f = w["f"].astype(np.float16).astype(np.float32)
    return x, {"ya": x @ w["a"].T + b, "yb": x @ w["b"].T, "yc": x @ w["c"].T + b, "yd": x @ w["d"].T, "yf": x @ f.T}


def test_quantizers_take_gemm_and_say_which_linears_they_pass_over(tmp_path, capsys):
    """Gemm in each form (transB 0/1, bias [N] / [1, N] / none) is quantized by ONNX Runtime's and
    TensorRT-RTX's rewrites, and runs in ONNX Runtime within int8 error; the one Linear neither follows
    (read through a Cast) is counted, recorded as `unquantized` and said on stderr -- never silent."""
    import onnxruntime as ort
    from precast.compiler.targets.quantize import quantize_onnxruntime
    from precast.compiler.targets.quantize_tensorrt import qdq_weights
    x, ref = _gemm_graph(tmp_path / "linears.onnx")
    for name, rewrite in (("ort", quantize_onnxruntime), ("trt", qdq_weights)):
        info = rewrite(tmp_path / "linears.onnx", tmp_path / f"{name}.onnx", "int8")
        s = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        outs = dict(zip([o.name for o in s.get_outputs()], s.run(None, {"x": x})))
        for k, r in ref.items():
            e = float(np.linalg.norm(outs[k] - r) / np.linalg.norm(r))
            assert (e < 1e-5) if k == "yf" else (1e-4 < e < 0.01), (name, k, e)   # yf: float, not quantized
        assert (info["matmuls"], info["linears"], info["unquantized"]) == (4, 5, 1), info
        err = capsys.readouterr().err
        assert f"{tmp_path / 'linears.onnx'}" in err and "quantized 4 of the graph's 5 Linear weights; 1 stay" in err, err
