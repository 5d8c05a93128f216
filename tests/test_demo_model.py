"""`precast demo-model --family`: one tiny file per family in the real key layout, which precast detects
as that family, and a printed recipe that plans (a LoRA / ControlNet: over the tiny SD 1.x it fits);
one printed recipe built end to end. The shipped tiny recipes build for this machine only (ONNX Runtime,
OpenVINO); tiny-sd15-rtx adds the TensorRT-RTX engines."""
import json
from pathlib import Path

import pytest

from conftest import ROOT, build_recipe, precast
from precast.compiler.plan import make_plan
from precast.compiler.recipe import DEFAULT_COMPONENTS, load_recipe

# --family -> (family, variant) in the export report; the recipe's components are that family's defaults
CHECKPOINTS = {"sd15": ("sd1", ""), "sd2": ("sd2", ""), "sdxl": ("sdxl", ""), "inpaint": ("sd1", "inpaint"),
               "sd3": ("sd3", "3-medium"), "sd35-medium": ("sd3", "3.5-medium"), "sd35-large": ("sd3", "3.5-large"),
               "flux-dev": ("flux", "dev"), "flux-schnell": ("flux", "schnell"), "chroma": ("chroma", "")}


def _demo(family, folder, seed=1):
    """Run demo-model; (the file, the printed recipe written to folder/r.yaml)."""
    out = folder / f"{family}.safetensors"
    proc = precast("demo-model", "--family", family, "--out", out, "--seed", seed, check=True)
    first, *recipe = proc.stdout.splitlines()
    assert first.startswith(f"wrote {out} (") and f", seed {seed}); a recipe that builds it" in first, first
    assert sorted(p.name for p in folder.iterdir()) == [out.name]          # no temp file left beside it
    (folder / "r.yaml").write_text("\n".join(recipe) + "\n")
    return out, folder / "r.yaml"


@pytest.mark.parametrize("family", [*CHECKPOINTS, "controlnet", "lora"])
def test_each_family_s_file_is_detected_and_its_printed_recipe_plans(family, demo_ckpt, tmp_path):
    (tmp_path / "d").mkdir()
    out, recipe = _demo(family, tmp_path / "d")
    comps = {e.component for e in make_plan(load_recipe(recipe))}      # what `precast plan` lists
    if family in CHECKPOINTS:
        name, variant = CHECKPOINTS[family]
        assert comps == set(DEFAULT_COMPONENTS[name])
        report = precast("export", out, "--out", tmp_path / "e", "--component", "vae_decoder", "--json", check=True)
        assert (json.loads(report.stdout)["family"], json.loads(report.stdout)["variant"]) == (name, variant)
    elif family == "controlnet":        # a ControlNet for the tiny SD 1.x: its own component beside the UNet
        assert comps == {*DEFAULT_COMPONENTS["sd1"], "controlnet_demo"}
        report = json.loads(precast("export", demo_ckpt, "--controlnet", f"{out}:demo", "--component",
                                    "controlnet_demo", "--out", tmp_path / "e", "--json", check=True).stdout)
        assert [c["name"] for c in report["components"]] == ["controlnet_demo"]
    else:                               # a LoRA whose every module patches a weight of the tiny SD 1.x
        assert comps == set(DEFAULT_COMPONENTS["sd1"])
        report = json.loads(precast("export", demo_ckpt, "--lora", out, "--component", "text_encoder",
                                    "--out", tmp_path / "e", "--json", check=True).stdout)
        (lora,) = report["loras"]
        assert lora["unmatched"] == [] and lora["modules"] == lora["weights"] > 0


def test_a_printed_flux_recipe_builds_and_generates(tmp_path):
    """The tiny Flux file's 16-wide heads need their RoPE split from the recipe: the printed one says it."""
    _, recipe = _demo("flux-schnell", tmp_path, seed=0)
    bundle = build_recipe(tmp_path, recipe.read_text())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["family"] == "flux" and manifest["model"]["variant"] == "schnell"
    precast("generate", bundle, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / "cat.png", check=True)
    assert (tmp_path / "cat.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_family_is_one_line_naming_the_choices(tmp_path):
    proc = precast("demo-model", "--family", "sd4", "--out", tmp_path / "x.safetensors")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "'sd4' is not one of" in proc.stderr and "'flux-dev'" in proc.stderr and "'lora'" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_tiny_recipes_build_tensorrt_rtx_only_when_asked():
    """TensorRT-RTX engines, which cannot run without an NVIDIA GPU, took 6 of 10 s of the first
    `precast build tiny-sd15`: the tiny recipes build for this machine; tiny-sd15-rtx adds them."""
    names = sorted(p.stem for p in Path(ROOT, "compiler", "recipes").glob("tiny-*.yaml"))
    assert "tiny-sd15-rtx" in names and "tiny-sd15" in names
    for name in names:
        backends = {e.target.backend for e in make_plan(load_recipe(name))}
        assert backends == ({"onnxruntime", "openvino", "tensorrt-rtx"} if name.endswith("-rtx")
                            else {"onnxruntime", "openvino"}), name
