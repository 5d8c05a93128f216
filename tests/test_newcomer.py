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
    assert "--text-encoder" in err and "Flux and Chroma" in err and "drop the flag" in err


def test_reexporting_one_component_keeps_the_rest_of_the_same_model(demo_ckpt, tmp_path):
    out = tmp_path / "o"
    precast("export", demo_ckpt, "--out", out, check=True)
    precast("export", demo_ckpt, "--out", out, "--component", "vae_decoder", "--dtype", "fp16", check=True)
    report = json.loads((out / "precast_export.json").read_text())
    dtypes = {c["name"]: c["dtype"] for c in report["components"]}
    assert dtypes == {"vae_decoder": "fp16", "text_encoder": "fp32", "unet": "fp32", "vae_encoder": "fp32"}
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(dtypes)


def test_an_export_of_another_model_leaves_no_stale_components(demo_ckpt, tmp_path):
    from precast.compiler.demo_model import write_demo_model
    other = tmp_path / "other.safetensors"
    write_demo_model(str(other), seed=5)
    out = tmp_path / "o"
    precast("export", demo_ckpt, "--out", out, check=True)
    precast("export", other, "--out", out, "--component", "unet", check=True)
    report = json.loads((out / "precast_export.json").read_text())
    assert [c["name"] for c in report["components"]] == ["unet"]
    assert sorted(p.name for p in out.iterdir()) == ["precast_export.json", "unet"]


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
    assert "100 tokens for text_encoder, which reads the first 75" in warning
    short = precast("generate", bundle, "--prompt", "cat", "--steps", "1", "--out", tmp_path / "b.png")
    assert short.returncode == 0 and "warning" not in short.stderr, short.stderr


def test_compile_refuses_profiles_a_component_cannot_take(demo_ckpt, tmp_path):
    out = tmp_path / "e"
    precast("export", demo_ckpt, "--out", out, "--component", "text_encoder", check=True)
    env = {"PRECAST_CACHE": str(tmp_path / "cache")}
    err = _one_line(precast("compile", out, "--target", "onnxruntime", "--tokens", "1:77:200", env=env))
    assert "text_encoder: --tokens 1:77:200" in err and "77 positions" in err
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
