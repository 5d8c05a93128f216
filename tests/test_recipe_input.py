"""Bad recipes: every mistake is exit 2 from both `plan` and `build`, one line naming file:line and
the field, and `build` writes nothing. Fields are typed (a string where a list belongs is refused,
not iterated), `model.set` is checked against the fields precast reads, YAML aliases and duplicate
keys are refused, numbers must be finite."""
import os
import subprocess
import sys

import pytest

from conftest import precast

HEAD = "name: t\nmodel:\n  source: demo:tiny-sd15\n"
TAIL = "profiles: {height: 64, width: 64}\ntargets:\n  - onnxruntime\n"


def _recipe(model="", top="", targets=None):
    return HEAD + model + top + (TAIL if targets is None else f"targets:\n  - {targets}\n")


CASES = {  # name: (recipe text, line, words the error must hold)
    "key_is_a_list": (_recipe(targets="{[a]: {}}"), 5, "targets[0]: has a key that is a list or a map"),
    "family_list": (_recipe("  family: [sd1]\n"), 4, "model.family"),
    "set_list": (_recipe("  set: [1, 2]\n"), 4, "model.set: expected {component: {field: value}}"),
    "set_str": (_recipe("  set: abc\n"), 4, "model.set: expected"),
    "set_inner_list": (_recipe("  set: {unet: [1]}\n"), 4, "model.set.unet: expected {field: value}"),
    "set_heads_str": (_recipe("  set: {unet: {num_heads: abc}}\n"), 4, "model.set.unet.num_heads: expected a positive"),
    "set_heads_inf": (_recipe("  set:\n    unet:\n      num_heads: .inf\n"), 6, "model.set.unet.num_heads"),
    "set_unknown_component": (_recipe("  set: {foo: {bar: 1}}\n"), 4, "model.set.foo: unknown component 'foo'; known:"),
    "set_unknown_field": (_recipe("  set:\n    unet: {bogus: 1}\n"), 5,
                          "model.set.unet.bogus: unknown field 'bogus'; known for unet: addition_time_embed_dim"),
    "set_prediction": (_recipe("  set: {model: {prediction: xyz}}\n"), 4, "model.set.model.prediction: expected epsilon"),
    "vae_list": (_recipe("  vae: [a]\n"), 4, "model.vae: expected"),
    "name_list": (_recipe().replace("name: t", "name: [1, 2]"), 1, "name: expected"),
    "loras_int": (_recipe(top="loras: 5\n"), 4, "loras: expected a list"),
    "loras_str": (_recipe(top="loras: abc\n"), 4, "loras: expected a list"),
    "loras_path_int": (_recipe(top="loras: [{path: 5}]\n"), 4, "loras[0].path: expected"),
    "loras_strength_nan": (_recipe(top="loras: [{path: x.safetensors, strength: .nan}]\n"), 4,
                           "loras[0].strength: expected a finite number, got nan"),
    "loras_strength_inf": (_recipe(top="loras:\n  - path: x.safetensors\n    te_strength: -.inf\n"), 6,
                           "loras[0].te_strength: expected a finite number"),
    "loras_strength_bool": (_recipe(top="loras: [{path: x.safetensors, strength: true}]\n"), 4, "loras[0].strength"),
    "emb_str": (_recipe(top="embeddings: /path/x.pt\n"), 4, "embeddings: expected a list"),
    "emb_int": (_recipe(top="embeddings: 5\n"), 4, "embeddings: expected a list"),
    "emb_list_int": (_recipe(top="embeddings: [5]\n"), 4, "embeddings[0]: expected"),
    "tokens_big": (_recipe().replace("height: 64,", "tokens: 100, height: 64,"), 4, "profiles.tokens: 100 tokens"),
    "trt_cc_int": (_recipe(targets="tensorrt-rtx: {compute_capabilities: 86}"), 5, "compute_capabilities=86"),
    "ov_device_int": (_recipe(targets="openvino: {device: 5}"), 5, "device=5"),
    "ov_device_dict": (_recipe(targets="openvino: {device: {a: 1}}"), 5, "device="),
    "ov_threads_str": (_recipe(targets="openvino: {device: CPU, threads: abc}"), 5, "threads='abc'"),
    "ov_threads_neg": (_recipe(targets="openvino: {device: CPU, threads: -3}"), 5, "threads=-3"),
    "ov_streams_str": (_recipe(targets="openvino: {device: CPU, num_streams: lots}"), 5, "num_streams='lots'"),
    "duplicate_key": (_recipe().replace("name: t\n", "name: t\nname: u\n"), 2, "name: given twice (lines 1 and 2)"),
    "recursive_alias": ("a: &x [*x]\n" + _recipe(), 1, "aliases"),
    "python_tag": (_recipe().replace("name: t", "name: !!python/object/apply:os.system [true]"), 1, "YAML tag"),
}


def _check(proc, recipe, line, words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {recipe}:{line}: ") and words in lines[0], proc.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_recipe_is_one_line_with_file_line_and_field(tmp_path, case):
    text, line, words = CASES[case]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    _check(precast("plan", recipe, env=env), recipe, line, words)
    _check(precast("build", recipe, "--out", tmp_path / "b", env=env), recipe, line, words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_non_utf8_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(_recipe().replace("name: t", "name: t\xff").encode("latin-1"))
    _check(precast("plan", recipe), recipe, 1, "not UTF-8")


def test_nested_aliases_are_refused_at_once(tmp_path):
    laughs = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(laughs + _recipe())
    proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", "plan", str(recipe)], capture_output=True,
                          text=True, timeout=60)  # before: expanding 10^9 nodes, for minutes
    _check(proc, recipe, 2, "aliases")


def test_a_good_recipe_still_plans(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe("  set: {unet: {num_heads: [2, 2, 2]}, text_encoder: {clip_skip: 1}}\n  prediction: epsilon\n",
                              "loras: [{path: x.safetensors, strength: 0.5, te_strength: 1}]\nembeddings: [a.pt]\n",
                              "openvino: {device: CPU, threads: 2, num_streams: AUTO}"))
    proc = precast("plan", recipe)
    assert proc.returncode == 0 and "unet.openvino-CPU" in proc.stdout, proc.stderr


def test_deeply_nested_recipe_and_a_pipe_as_recipe_are_one_line(tmp_path):
    recipe = tmp_path / "deep.yaml"
    recipe.write_text(_recipe(top="loras: " + "[" * 20000 + "]" * 20000 + "\n"))
    proc = precast("plan", recipe)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {recipe}: nested too deeply to be a recipe"
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", "plan", str(fifo)], capture_output=True,
                          text=True, timeout=60)    # before: blocked forever opening the pipe
    assert proc.returncode == 2 and "not a file" in proc.stderr and "Traceback" not in proc.stderr


def test_build_keeps_a_folder_that_is_not_a_bundle(tmp_path):
    """Before: any folder holding a file named manifest.json was replaced, its other files deleted."""
    out = tmp_path / "project"
    (out / "src").mkdir(parents=True)
    (out / "manifest.json").write_text('{"name": "web app"}')
    (out / "src" / "main.js").write_text("important")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe())
    proc = precast("build", recipe, "--out", out, env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "is not a precast bundle" in proc.stderr, proc.stderr
    assert (out / "src" / "main.js").read_text() == "important"
    assert not (tmp_path / "cache").exists()    # refused before any work


@pytest.mark.parametrize("profiles, words", [("{height: 8000000, width: 64}", "at most 16384"),
                                             ("{batch: 1000000000, height: 64, width: 64}", "at most 64")])
def test_profiles_past_the_limits_are_refused(tmp_path, profiles, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(HEAD + f"profiles: {profiles}\ntargets:\n  - onnxruntime\n")
    proc = precast("plan", recipe)
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
