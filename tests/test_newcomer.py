"""What a newcomer's tour of the CLI found beyond the first-hour issue: parts of two models
mixed in one export, a checkpoint given as a LoRA, earlier exports and bundles of another model
in the --out folder. Each one is a user mistake or a surprise: one line, exit 2, or a note."""
import json

import pytest

from conftest import precast


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    from precast.compiler.demo_dit import write_demo_dit
    path = tmp_path_factory.mktemp("flux") / "flux.safetensors"
    write_demo_dit(str(path), "tiny-flux-dev")
    return path


def _one_line(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_a_vae_of_another_latent_width_is_refused_at_export(demo_ckpt, flux_file, tmp_path):
    err = _one_line(precast("export", demo_ckpt, "--out", tmp_path / "o", "--vae", flux_file))
    assert f"--vae {flux_file}" in err and "16 latent channels" in err and "predicts 4" in err
    assert not (tmp_path / "o").exists()


def test_a_text_encoder_file_is_refused_for_sd(demo_ckpt, flux_file, tmp_path):
    err = _one_line(precast("export", demo_ckpt, "--out", tmp_path / "o", "--text-encoder", flux_file))
    assert "--text-encoder" in err and "Flux, Chroma, SD3" in err and "drop the flag" in err


def test_reexporting_one_component_keeps_the_rest_of_the_same_model(demo_ckpt, tmp_path):
    out = tmp_path / "o"
    precast("export", demo_ckpt, "--out", out, check=True)
    precast("export", demo_ckpt, "--out", out, "--component", "vae_decoder", "--dtype", "fp16", check=True)
    report = json.loads((out / "precast_export.json").read_text())
    dtypes = {c["name"]: c["dtype"] for c in report["components"]}
    assert dtypes == {"vae_decoder": "fp16", "text_encoder": "fp32", "unet": "fp32", "vae_encoder": "fp32"}
    assert sorted(p.name for p in out.iterdir() if (p / "model.onnx").is_file()) == sorted(dtypes)


def test_an_export_of_another_model_leaves_no_stale_components(demo_ckpt, tmp_path):
    from precast.compiler.demo_model import write_demo_model
    other = tmp_path / "other.safetensors"
    write_demo_model(str(other), seed=5)
    out = tmp_path / "o"
    precast("export", demo_ckpt, "--out", out, check=True)
    precast("export", other, "--out", out, "--component", "unet", check=True)
    report = json.loads((out / "precast_export.json").read_text())
    assert [c["name"] for c in report["components"]] == ["unet"]
    assert sorted(p.name for p in out.iterdir() if (p / "model.onnx").is_file()) == ["unet"]
    index = json.loads((out / "model_index.json").read_text())          # the diffusers-style files follow
    assert [k for k, v in index.items() if v == ["diffusers", "OnnxRuntimeModel"]] == ["unet"]


def test_a_checkpoint_given_as_a_lora_is_named(demo_ckpt, tmp_path):
    err = _one_line(precast("export", demo_ckpt, "--out", tmp_path / "o", "--lora", demo_ckpt))
    assert "model checkpoint, not a LoRA" in err and "--allow-unmatched" not in err


def test_a_lora_strength_that_is_not_a_number_is_named(demo_ckpt, tmp_path):
    err = _one_line(precast("export", demo_ckpt, "--out", tmp_path / "o", "--lora", f"{demo_ckpt}:abc"))
    assert "strength 'abc' is not a number" in err


def test_demo_model_into_a_folder_is_refused(tmp_path):
    err = _one_line(precast("demo-model", "--out", tmp_path))
    assert "is a folder" in err and "tmp-" not in err


def test_a_bundle_of_another_model_is_replaced_with_a_note(tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    base = "components: [unet]\nprofiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n"
    for name, source in (("a", "demo:tiny-sd15"), ("b", "demo:tiny-flux-dev")):
        comp = "components: [transformer]\n" if "flux" in source else ""
        text = f"name: {name}\nmodel: {{source: {source}}}\n" + (comp + base.split("\n", 1)[1] if comp else base)
        (tmp_path / f"{name}.yaml").write_text(text)
    precast("build", tmp_path / "a.yaml", "--out", tmp_path / "bundle", env=env, check=True)
    proc = precast("build", tmp_path / "b.yaml", "--out", tmp_path / "bundle", env=env, check=True)
    assert "held a bundle of a (sd1" in proc.stderr and "replaced by b (flux" in proc.stderr
    again = precast("build", tmp_path / "b.yaml", "--out", tmp_path / "bundle", env=env, check=True)
    assert "held a bundle" not in again.stderr


def test_generate_writes_png_names_only(tiny_bundle, tmp_path):
    bundle, _ = tiny_bundle
    victim = tmp_path / "model.safetensors"
    victim.write_bytes(b"weights")
    for out in (victim, tmp_path / "g.jpg", tmp_path / "g"):
        err = _one_line(precast("generate", bundle, "--prompt", "x", "--steps", "1", "--out", out))
        assert f"--out {out}" in err and ".png" in err
    assert victim.read_bytes() == b"weights" and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_prompt_past_clip_length_is_warned_about(tiny_bundle, tmp_path):
    bundle, _ = tiny_bundle
    proc = precast("generate", bundle, "--prompt", "cat " * 100, "--steps", "1", "--out", tmp_path / "a.png", "--json")
    assert proc.returncode == 0, proc.stderr
    (warning,) = json.loads(proc.stdout)["warnings"]
    assert "needs 154 tokens" in warning and "rebuild with profiles: {tokens: {min: 77, opt: 77, max: 154}}" in warning
    short = precast("generate", bundle, "--prompt", "cat", "--steps", "1", "--out", tmp_path / "b.png")
    assert short.returncode == 0 and "warning" not in short.stderr, short.stderr


def test_compile_refuses_profiles_a_component_cannot_take(demo_ckpt, tmp_path):
    out = tmp_path / "e"
    precast("export", demo_ckpt, "--out", out, "--component", "text_encoder", check=True)
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    err = _one_line(precast("compile", out, "--target", "onnxruntime", "--tokens", "1:77:2000", env=env))
    assert "tokens (1, 77, 2000): at most 1232 (16 prompt chunks of 77)" in err
    err = _one_line(precast("compile", out, "--target", "onnxruntime", "--t5-tokens", "64", env=env))
    assert "--t5-tokens 64" in err and "drop it" in err
    err = _one_line(precast("compile", tmp_path / "nothere", "--target", "onnxruntime", env=env))
    assert "no such folder" in err
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("entry.json"))


def test_openvino_precision_takes_the_recipe_spelling():
    from precast.compiler.targets import parse_target
    assert parse_target("openvino", {"precision": "fp16"}) == parse_target("openvino", {"precision": "f16"})


def test_doctor_says_what_generate_would_lack(tmp_path):
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    (tmp_path / "r.yaml").write_text("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
                                     "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")
    precast("build", tmp_path / "r.yaml", "--only", "unet.onnxruntime", "--out", tmp_path / "b", env=env, check=True)
    proc = precast("doctor", tmp_path / "b", env=env)
    assert proc.returncode == 0 and "needs text_encoder, vae_decoder, which this bundle lacks" in proc.stderr
    report = json.loads(precast("doctor", tmp_path / "b", "--json", env=env, check=True).stdout)
    assert report["missing_for_generate"] == ["text_encoder", "vae_decoder"]


def test_inspect_shows_the_sizes_a_bundle_serves(tiny_bundle):
    bundle, _ = tiny_bundle
    out = precast("bundle", "inspect", bundle, check=True).stdout
    assert out.count("  profile  64x64, batch 1, 77 tokens") == 3, out


def test_ctrl_c_during_a_tensorrt_rtx_build_stops_it(demo_ckpt, tmp_path):
    """TensorRT swallows a KeyboardInterrupt raised in its callbacks: SIGINT must still end the
    command (exit 130, `interrupted`) and leave no cache entry behind."""
    import os
    import signal
    import subprocess
    import sys
    out = tmp_path / "e"
    precast("export", demo_ckpt, "--out", out, "--component", "unet", check=True)
    env = {**os.environ, "PRECAST_CACHE": str(tmp_path / "cache"), "PRECAST_PROGRESS_INTERVAL": "0.2"}
    proc = subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "compile", str(out), "--target",
                             "tensorrt-rtx:sm_86"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stderr.readline()                  # a heartbeat line: the build is under way
    assert "compile unet for tensorrt-rtx" in first, first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache").rglob("entry.json")) and not list((tmp_path / "cache").rglob("*.engine"))


def test_a_second_tour_s_findings(tiny_bundle, demo_ckpt, tmp_path):
    """Second tour: an export folder given where a checkpoint or a bundle goes is named as such;
    unpack takes an empty folder; demo-model takes only seeds >= 0 and .safetensors names;
    doctor's JSON has the same keys with or without a bundle."""
    bundle, _ = tiny_bundle
    export = tmp_path / "e"
    precast("export", demo_ckpt, "--out", export, "--component", "unet", check=True)
    assert "is a precast export (ONNX), not a checkpoint" in _one_line(precast("export", export, "--out", tmp_path / "x"))
    assert "not a precast bundle but an export" in _one_line(precast("generate", export, "--prompt", "a",
                                                                     "--out", tmp_path / "a.png"))
    precast("bundle", "pack", bundle, "--out", tmp_path / "b.tar", check=True)
    (tmp_path / "empty").mkdir()
    precast("bundle", "unpack", tmp_path / "b.tar", "--out", tmp_path / "empty", check=True)
    assert (tmp_path / "empty" / "manifest.json").is_file()
    assert "is a folder" in _one_line(precast("bundle", "unpack", bundle, "--out", tmp_path / "u"))
    assert "--seed" in _one_line(precast("demo-model", "--out", tmp_path / "d.safetensors", "--seed", "-1"))
    assert ".safetensors" in _one_line(precast("demo-model", "--out", tmp_path / "d.ckpt"))
    bare = json.loads(precast("doctor", "--json", check=True).stdout)
    full = json.loads(precast("doctor", bundle, "--json", check=True).stdout)
    assert set(bare) == set(full) and bare["components"] == {} and bare["size"] is None
