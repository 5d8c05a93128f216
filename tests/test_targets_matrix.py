"""Every target x export dtype x option the README offers either builds an artifact or stops in one
line (exit 2, no traceback) before any backend build starts; GPU architectures have one spelling.

The refusals run in process (click's CliRunner: cheap); the combinations that build run once each,
in one real `precast compile` per dtype, on the tiny VAE decoder (TensorRT-RTX AOT builds here
without a GPU; MIGraphX is not installed here and must say so)."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import precast
from precast.compiler.cache import Cache

DTYPES = ("fp32", "fp16", "bf16")
COMPONENT = "vae_decoder"

# (target, options) -> what happens for each dtype: "ok" or the words of the one error line
MIGRAPHX = ["target migraphx", "ROCm", "not found on this machine"]
ORT_BF16 = ["vae_decoder for onnxruntime", "the export is bf16", "fp32 or fp16"]
TURING = {"fp32": ["vae_decoder for tensorrt-rtx:sm_75", "the export is fp32", "Turing", "--dtype fp16", "sm_75"],
          "bf16": ["vae_decoder for tensorrt-rtx:sm_75", "the export is bf16", "Turing", "--dtype fp16"]}
TABLE = [
    ("onnxruntime", (), {"fp32": "ok", "fp16": "ok", "bf16": ORT_BF16}),
    ("onnxruntime", ("optimize=false", "simplify=false"), {"fp32": "ok", "fp16": "ok", "bf16": ORT_BF16}),
    ("openvino", (), {d: "ok" for d in DTYPES}),
    ("openvino", ("precision=bf16", "ir=true", "compress_to_fp16=true"), {d: "ok" for d in DTYPES}),
    ("openvino", ("precision=f16", "winograd=false", "performance_hint=THROUGHPUT", "num_streams=2", "threads=1"),
     {d: "ok" for d in DTYPES}),
    ("openvino", ("compress_to_fp16=true",), {d: "ok" for d in DTYPES}),
    ("openvino", ("compress_to_fp16=true", "weights=int8"), {d: ["compress_to_fp16 and weights=int8", "choose one"]
                                                            for d in DTYPES}),
    ("openvino:GPU", (), {d: ["device GPU", "not present on this machine"] for d in DTYPES}),
    ("tensorrt-rtx:sm_86", ("weight_streaming=true",), {d: "ok" for d in DTYPES}),
    ("tensorrt-rtx:sm_75", (), {"fp32": TURING["fp32"], "fp16": "ok", "bf16": TURING["bf16"]}),
    ("tensorrt-rtx:sm_86,sm_75", (), {"fp32": TURING["fp32"] + ["drop sm_75 (tensorrt-rtx:sm_86)"], "fp16": "ok",
                                      "bf16": TURING["bf16"]}),
    ("tensorrt-rtx:sm_86", ("refittable=true",), {d: ["GPU driver"] for d in DTYPES}),
    ("tensorrt-rtx:sm_86", ("strip_weights=true",), {d: ["GPU driver"] for d in DTYPES}),
    ("tensorrt-rtx:sm_70", (), {d: ["compute capability 'sm_70'", "sm_75"] for d in DTYPES}),
    ("migraphx:gfx1100", (), {d: MIGRAPHX for d in DTYPES}),
    ("migraphx:gfx1100", ("fp16=true", "fast_math=false"), {d: MIGRAPHX for d in DTYPES}),
    ("migraphx", (), {d: MIGRAPHX for d in DTYPES}),
]
CASES = [(t, o, d, want[d]) for t, o, want in TABLE for d in DTYPES]


def _args(target, options):
    return ["--target", target, *[a for o in options for a in ("--option", o)]]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny VAE decoder exported in each dtype: {dtype: folder}."""
    from precast.compiler.demo_model import write_demo_model
    from precast.compiler.export import export
    tmp = tmp_path_factory.mktemp("matrix")
    write_demo_model(str(tmp / "tiny.safetensors"))
    return {d: Path(export(tmp / "tiny.safetensors", tmp / d, [COMPONENT], d, progress=False)["out"]) for d in DTYPES}


def _cli(args, cache):
    from precast.compiler.cli import main
    result = CliRunner().invoke(main, [str(a) for a in args], env={"PRECAST_CACHE": str(cache)},
                                catch_exceptions=False)
    return result.exit_code, result.stderr, result.stdout


@pytest.mark.parametrize("target, options, dtype, want",
                         [c for c in CASES if c[3] != "ok"],
                         ids=[f"{c[0]}{'+' + '+'.join(c[1]) if c[1] else ''}-{c[2]}" for c in CASES if c[3] != "ok"])
def test_refused_in_one_line_before_any_build(exports, tmp_path, target, options, dtype, want):
    code, err, out = _cli(["compile", exports[dtype], *_args(target, options), "--height", "64", "--width", "64"],
                          tmp_path / "cache")
    assert code == 2 and "Traceback" not in err and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and all(w in line for w in want), line
    assert Cache(tmp_path / "cache").list() == []       # nothing was built


def test_a_refused_target_stops_the_command_before_the_others_build(exports, tmp_path):
    """With --json the refusal is also the JSON on stdout: {"error": ..., "exit": 2}."""
    proc = precast("compile", exports["fp32"], "--target", "openvino", "--target", "onnxruntime",
                   "--target", "tensorrt-rtx:sm_75", "--height", "64", "--width", "64", "--json",
                   env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "Turing" in line and json.loads(proc.stdout) == {"error": line.removeprefix("error: "), "exit": 2}
    assert Cache(tmp_path / "cache").list() == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_buildable_combination_builds(exports, tmp_path, dtype):
    ok = [(t, o) for t, o, want in TABLE if want[dtype] == "ok"]
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    records = []
    for options in sorted({o for _, o in ok}):      # one process per option set (options apply to every --target)
        targets = [a for t, o in ok if o == options for a in ("--target", t)]
        proc = precast("compile", exports[dtype], *targets, *[a for o in options for a in ("--option", o)],
                       "--height", "64", "--width", "64", "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        records += json.loads(proc.stdout)["artifacts"]
    assert len(records) == len(ok) and all(r["cache"] == "miss" for r in records)
    for r in records:
        artifact = Path(r["artifact"])
        assert r["component"] == COMPONENT and tmp_path / "cache" in artifact.parents
        assert artifact.is_file() and r["size"] > 0
    assert len(Cache(tmp_path / "cache").list()) == len(ok)


def test_four_spellings_of_one_architecture_are_one_entry(exports, tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    spellings = ["tensorrt-rtx:sm86", "tensorrt-rtx:sm_86", "tensorrt-rtx:86", "tensorrt-rtx:8.6"]
    proc = precast("compile", exports["fp16"], *[a for t in spellings for a in ("--target", t)],
                   "--height", "64", "--width", "64", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    recs = json.loads(proc.stdout)["artifacts"]
    assert [r["cache"] for r in recs] == ["miss", "hit", "hit", "hit"]
    assert {r["target"] for r in recs} == {"tensorrt-rtx:sm_86"} and len({r["key"] for r in recs}) == 1
    again = precast("compile", exports["fp16"], "--target", "tensorrt-rtx:SM_86", "--option",
                    "compute_capabilities=[8.6, sm86]", "--height", "64", "--width", "64", "--json", env=env)
    assert again.returncode == 0, again.stderr
    assert [r["cache"] for r in json.loads(again.stdout)["artifacts"]] == ["hit"]
    ls = json.loads(precast("cache", "ls", "--json", env=env, check=True).stdout)
    assert len(ls["entries"]) == 1


def test_one_spelling_in_specs_and_recipes(tmp_path):
    from precast.compiler.recipe import load_recipe
    from precast.compiler.targets import parse_target
    want = parse_target("tensorrt-rtx:sm_86,sm_120")
    for text, options in [("tensorrt-rtx:120,8.6,sm86", None), ("trt", {"compute_capabilities": [12.0, "SM_86"]}),
                          ("tensorrt-rtx", {"compute_capabilities": "sm120,86"})]:
        assert parse_target(text, options) == want
    assert parse_target("tensorrt-rtx", {"compute_capabilities": []}) == parse_target("tensorrt-rtx")
    assert parse_target("migraphx:GFX90A:sramecc+:xnack-") == parse_target("migraphx:gfx90a:sramecc+:xnack-")
    assert parse_target("openvino:cpu") == parse_target("openvino", {"device": "CPU"})
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [unet]\nprecision: fp16\n"
                      "targets: [{tensorrt-rtx: {compute_capabilities: [8.6, sm86, '120']}}]\n")
    assert load_recipe(recipe).targets == (want,)


@pytest.mark.parametrize("precision, words", [
    ("fp32", ["targets[1]", "unet is fp32 (precision)", "tensorrt-rtx:sm_75,sm_86", "Turing", "fp16",
              "drop sm_75 (tensorrt-rtx:sm_86)"]),
    ("bf16", ["targets[0]", "unet is bf16 (precision)", "onnxruntime", "fp32 or fp16"]),
])
def test_recipe_with_an_unbuildable_precision_is_refused_at_plan_and_build(tmp_path, precision, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [unet]\n"
                      f"precision: {precision}\nprofiles: {{batch: 1, height: 64, width: 64}}\n"
                      "targets:\n  - onnxruntime\n  - tensorrt-rtx: {compute_capabilities: [sm_75, sm_86]}\n")
    for args in (["plan", recipe], ["build", recipe, "--out", tmp_path / "bundle"]):
        code, err, out = _cli(args, tmp_path / "cache")
        assert code == 2 and "Traceback" not in err and out == ""
        (line,) = err.strip().splitlines()
        assert line.startswith(f"error: {recipe}:") and all(w in line for w in words), line
    assert not (tmp_path / "bundle").exists() and not (tmp_path / "cache" / "entries").exists()


def test_recipe_for_turing_in_fp16_plans(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [unet, vae_decoder]\nprecision: fp16\n"
                      "targets: [{tensorrt-rtx: {compute_capabilities: [sm_75]}}]\n")
    code, err, out = _cli(["plan", recipe, "--format", "json"], tmp_path / "cache")
    assert code == 0, err
    assert [e["target"] for e in json.loads(out)["entries"]] == ["tensorrt-rtx:sm_75"] * 2
