"""A new user's first hour, without dead ends (issue 29 items 9-11, 13), all through the real CLI:
a LoRA with unmatched keys is allowed by the flag or recipe field the error names; `plan` refuses
a damaged checkpoint as `build` would and lists every family; `plan --format github` without the
build side still prints its JSON error; ONNX Runtime's warning about the text encoder's input
default stays off stderr while the embeddings it carries still apply; a --size outside every
profile says so, and the recipe profile it suggests removes the run-time compile."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import precast

TINY_UNET = "model: {source: demo:tiny-sd15}\ncomponents: [unet]\n"
PROFILE = "profiles: {height: 64, width: 64}\ntargets: [onnxruntime]\n"
ORT_WARNING = "appears in graph inputs"


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---- item 9: a LoRA with unmatched keys --------------------------------------------------------------

@pytest.fixture(scope="module")
def stray_lora(tmp_path_factory):
    """A LoRA for the tiny SD 1.x UNet with one tensor that names no weight of it."""
    path = tmp_path_factory.mktemp("lora") / "stray.safetensors"
    rng = np.random.default_rng(0)
    q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file({f"{q}.lora_down.weight": rng.standard_normal((4, 32), dtype=np.float32),
               f"{q}.lora_up.weight": rng.standard_normal((32, 4), dtype=np.float32),
               "something_else.weight": np.zeros(3, np.float32)}, str(path))
    return path


def test_build_takes_allow_unmatched_from_the_flag_or_the_recipe(stray_lora, tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY_UNET + f"loras:\n  - path: {stray_lora}\n    strength: 0.5\n" + PROFILE)
    proc = precast("build", recipe, "--out", tmp_path / "b", env=env)
    (line,) = _lines(proc.stderr)
    assert proc.returncode == 2 and "something_else.weight" in line, proc.stderr
    # the advice names what `build` takes: the recipe field (where) and the flag
    assert (f"set `allow_unmatched: true` in loras[0] of {recipe} (line 4) "
            "or pass --allow-unmatched to `precast build`") in line
    assert not (tmp_path / "b").exists()

    proc = precast("build", recipe, "--out", tmp_path / "b", "--allow-unmatched", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    warnings = [w for w in proc.stderr.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 1 and "something_else.weight" in warnings[0], proc.stderr   # said once, not per export
    manifest = json.loads((tmp_path / "b/manifest.json").read_text())
    assert manifest["model"]["loras"][0]["unmatched"] == 1 and manifest["model"]["loras"][0]["strength"] == 0.5

    allowed = tmp_path / "allowed.yaml"   # the recipe field: the same export (the flag does not change the bytes)
    allowed.write_text(recipe.read_text().replace("strength: 0.5\n", "strength: 0.5\n    allow_unmatched: true\n"))
    proc = precast("build", allowed, "--out", tmp_path / "c", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    export = next(a for a in json.loads(proc.stdout)["artifacts"] if a["backend"] == "onnx")
    assert export["cache"] == "hit"
    data = "onnx/unet/model.onnx_data"
    files = json.loads((tmp_path / "c/manifest.json").read_text())["files"]
    assert files[data]["sha256"] == manifest["files"][data]["sha256"]

    plain = tmp_path / "plain.yaml"       # and the LoRA's matched part was merged
    plain.write_text(TINY_UNET + PROFILE)
    precast("build", plain, "--out", tmp_path / "p", env=env, check=True)
    assert json.loads((tmp_path / "p/manifest.json").read_text())["files"][data]["sha256"] != files[data]["sha256"]


def test_recipe_allow_unmatched_must_be_true_or_false(stray_lora, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY_UNET + f"loras:\n  - path: {stray_lora}\n    allow_unmatched: yes please\n" + PROFILE)
    for command in (["plan", recipe], ["build", recipe, "--out", tmp_path / "b"]):
        proc = precast(*command)
        (line,) = _lines(proc.stderr)
        assert proc.returncode == 2 and f"{recipe}:5: loras[0].allow_unmatched: expected true or false" in line, line


# ---- item 10: plan on a damaged checkpoint ---------------------------------------------------------------

@pytest.mark.parametrize("damage", ["png", "truncated"])
def test_plan_refuses_a_damaged_checkpoint_as_export_does(demo_ckpt, tmp_path, damage):
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200) if damage == "png" else demo_ckpt.read_bytes()[:100_000])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {ckpt}}}\ntargets: [onnxruntime]\n")
    export = precast("export", ckpt, "--out", tmp_path / "o")
    assert export.returncode == 2 and "not a valid .safetensors file" in export.stderr
    proc = precast("plan", recipe)
    (line,) = _lines(proc.stderr)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert line.startswith(f"error: {recipe}:1: model.source: {ckpt}: not a valid .safetensors file"), line
    assert "not there to read" not in line
    proc = precast("plan", recipe, "--format", "github")
    assert proc.returncode == 2 and json.loads(proc.stdout) == {"error": line[len("error: "):], "exit": 2}


def test_plan_of_an_absent_checkpoint_lists_every_family(tmp_path):
    from precast.compiler.families import FAMILIES
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: later.safetensors}\ntargets: [onnxruntime]\n")
    proc = precast("plan", recipe)
    (line,) = _lines(proc.stderr)
    assert proc.returncode == 0 and "unet.onnxruntime" in proc.stdout
    assert "is not there to read" in line and line.endswith(f"give model.family ({', '.join(FAMILIES)})"), line
    assert "sd3" in FAMILIES


# ---- item 11: plan --format github without the build side ------------------------------------------------

# as tests/test_pipeline.py: what `pip install precast onnxruntime` lacks
RUNTIME_ONLY = ["onnx", "onnxsim", "safetensors", "yaml", "platformdirs", "filelock", "ml_dtypes", "torch",
                "diffusers", "transformers", "tensorrt_rtx"]


@pytest.mark.parametrize("fmt", [["--format", "github"], ["--format=json"], ["--format", "table"]])
def test_plan_json_formats_print_the_error_object_without_the_compiler(tmp_path, fmt):
    code = (f"import sys\nfor m in {RUNTIME_ONLY!r}: sys.modules[m] = None\n"
            "from precast.runtime.cli import main\nmain()")
    (tmp_path / "r.yaml").write_text("model: {source: demo:tiny-sd15}\ntargets: [onnxruntime]\n")
    proc = subprocess.run([sys.executable, "-c", code, "plan", "r.yaml", *fmt], capture_output=True, text=True,
                          cwd=tmp_path, check=False)
    (line,) = _lines(proc.stderr)
    assert proc.returncode == 2 and "`precast plan` needs the build side's dependencies" in line, proc.stderr
    if fmt[-1] == "table":
        assert proc.stdout == ""
    else:
        assert json.loads(proc.stdout) == {"error": line[len("error: "):], "exit": 2}


def test_plan_usage_error_under_format_github_is_json_too():
    proc = precast("plan", "--format", "github")
    (line,) = _lines(proc.stderr)
    assert proc.returncode == 2 and "Missing argument 'RECIPE'" in line
    assert json.loads(proc.stdout) == {"error": line[len("error: "):], "exit": 2}


# ---- item 13a: ONNX Runtime's warning about the text encoder's input default --------------------------

def test_input_defaults_read_without_onnx_agree_with_onnx(tiny_bundle, demo_ckpt, tmp_path):
    import onnx
    from precast.runtime.onnx_header import input_defaults
    bundle, _ = tiny_bundle
    paths = sorted(bundle.glob("onnx/*/model.onnx")) + sorted(bundle.glob("artifacts/*/onnxruntime*/model.onnx"))
    for name in ("model.onnx", "model.onnx_data"):    # copied: onnx refuses hard-linked weights
        shutil.copyfile(bundle / "onnx/text_encoder" / name, tmp_path / name)
    small = tmp_path / "embedded.onnx"      # weights inside the file: skipped, not read as fields
    onnx.save(onnx.load(str(tmp_path / "model.onnx")), str(small))
    for path in paths + [small]:
        g = onnx.load(str(path), load_external_data=False).graph
        want = {i.name for i in g.input} & {t.name for t in g.initializer}
        assert input_defaults(path) == want, path
    assert input_defaults(bundle / "onnx/text_encoder/model.onnx") == {"token_embeddings_extra"}
    assert input_defaults(demo_ckpt) == set() and input_defaults(tmp_path / "absent.onnx") == set()


def test_universal_onnxruntime_artifact_runs_quietly_and_applies_embeddings(tmp_path):
    from precast.compiler.demo_model import TINY
    save_file({"emb_params": np.random.default_rng(3).standard_normal((2, TINY.context_dim)).astype(np.float32)},
              str(tmp_path / "mystyle.safetensors"))
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    images = {}
    for name, extra in (("plain", ""), ("ti", "embeddings: [mystyle.safetensors]\n")):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n" + extra +
                          "profiles: {height: 64, width: 64}\ntargets: [{onnxruntime: {optimize: false}}]\n")
        precast("build", recipe, "--out", tmp_path / name, env=env, check=True)
        out = tmp_path / f"{name}.png"
        proc = precast("generate", tmp_path / name, "--prompt", "a photo of mystyle", "--steps", "2", "--out", out,
                       "--json")
        assert proc.returncode == 0, proc.stderr
        assert ORT_WARNING not in proc.stderr, proc.stderr
        assert json.loads(proc.stdout)["components"]["text_encoder"]["backend"] == "onnxruntime"
        images[name] = out.read_bytes()
    assert images["plain"] != images["ti"]          # the embedding reached the text encoder


# ---- item 13b: a --size outside every profile -----------------------------------------------------------

def test_size_outside_every_profile_warns_and_the_suggested_profile_avoids_the_compile(tiny_bundle, tmp_path):
    bundle, _ = tiny_bundle
    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "1", "--size", "64x72",
                   "--out", tmp_path / "a.png")
    assert proc.returncode == 0, proc.stderr
    (line,) = [w for w in proc.stderr.splitlines() if w.startswith("warning:")]
    assert "size 64x72 is outside every shape profile of this bundle's unet engines (64x64)" in line
    assert "compiled at run time" in line
    suggested = line.split("e.g. profiles: ", 1)[1]
    assert suggested == "{height: {min: 64, opt: 64, max: 72}, width: 64}", line
    assert "unet.onnxruntime" not in next(s for s in proc.stdout.splitlines() if s.startswith("unet"))   # fallback

    proc = precast("generate", bundle, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / "b.png")
    assert proc.returncode == 0 and "warning:" not in proc.stderr, proc.stderr

    recipe = tmp_path / "wider.yaml"        # the profile it suggested: the engine serves 64x72, no warning
    recipe.write_text(f"model: {{source: demo:tiny-sd15}}\ncomponents: [text_encoder, unet, vae_decoder]\n"
                      f"profiles: {suggested}\ntargets: [onnxruntime]\n")
    precast("build", recipe, "--out", tmp_path / "wider", env={"PRECAST_CACHE": str(tmp_path / "cache")}, check=True)
    proc = precast("generate", tmp_path / "wider", "--prompt", "a cat", "--steps", "1", "--size", "64x72",
                   "--out", tmp_path / "c.png")
    assert proc.returncode == 0 and "warning:" not in proc.stderr, proc.stderr
    assert "unet.onnxruntime" in next(s for s in proc.stdout.splitlines() if s.startswith("unet"))
