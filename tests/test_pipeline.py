"""The reference txt2img pipeline through the runtime matches diffusers' StableDiffusionPipeline
(same weights, scheduler, seed latents and token ids): PSNR >= 40 dB on the decoded image. And the
runtime's commands work with none of the build side importable."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import precast
import reference as ref
from precast.compiler.demo_model import TINY


@pytest.fixture
def bundle(tiny_bundle):
    return tiny_bundle


def psnr(a, b):
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return 10 * np.log10(1.0 / mse) if mse else float("inf")


@pytest.mark.parametrize("scheduler, backend", [("euler", None), ("dpm++2m", None), ("euler", "cpu")])
def test_txt2img_matches_diffusers(bundle, scheduler, backend):
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler, StableDiffusionPipeline
    from transformers import CLIPTokenizer
    from precast.runtime.families.sd import Txt2Img
    path, ckpt = bundle
    prompt, negative, steps, guidance = "a photo of a cat, (masterpiece:1.2)", "blurry", 8, 7.5
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    literal = prompt.replace("(", "\\(").replace(")", "\\)")    # escaped: diffusers reads no weighting syntax
    ours = Txt2Img(path, backend, width=64, height=64)(literal, negative, steps, 0, guidance, scheduler,
                                                       latents=noise, progress=False)
    unet, vae, te = ref.models_from_single_file(ckpt, TINY)
    cfg = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
               timestep_spacing="leading", steps_offset=1)
    sched = EulerDiscreteScheduler(**cfg) if scheduler == "euler" else DPMSolverMultistepScheduler(
        **cfg, algorithm_type="dpmsolver++", solver_order=2)
    tok = CLIPTokenizer(str(path / "tokenizer/vocab.json"), str(path / "tokenizer/merges.txt"), model_max_length=77)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    with torch.no_grad():
        want = pipe(prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=guidance,
                    height=64, width=64, latents=torch.from_numpy(noise), output_type="np").images[0]
    assert ours.shape == want.shape == (64, 64, 3)
    assert want.std() > 0.05  # a real image, not a constant
    assert psnr(ours, want) >= 40.0


def test_generate_cli_writes_png_and_says_what_ran_where(bundle, tmp_path):
    path, _ = bundle
    out = tmp_path / "cat.png"
    proc = precast("generate", path, "--prompt", "a cat", "--steps", "3", "--size", "64x64", "--out", out,
                   "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {c: w["backend"] for c, w in report["components"].items()} == {
        "text_encoder": "openvino", "unet": "openvino", "vae_decoder": "openvino"}
    assert all(w["device"] == "cpu" for w in report["components"].values())


def test_generate_bad_input(bundle, tmp_path):
    path, _ = bundle
    for args, words in ((["--size", "60x64"], "multiples of 8"), (["--size", "big"], "WIDTHxHEIGHT"),
                        (["--backend", "te=tpu0"], "unknown device 'tpu0'"),
                        (["--scheduler", "ddim9"], "'--scheduler': 'ddim9' is not one of 'euler', 'euler-a'"),
                        (["--scheduler", "flow-euler"], "--scheduler flow-euler: is Flux / Chroma / SD3")):
        proc = precast("generate", path, "--prompt", "x", "--steps", "1", "--out", tmp_path / "x.png", *args)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = precast("generate", tmp_path, "--prompt", "x", "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and "not a precast bundle" in proc.stderr


BLOCKED = ["onnx", "onnxsim", "torch", "diffusers", "transformers", "safetensors", "yaml", "tensorrt_rtx",
           "precast.compiler"]


def test_runtime_commands_need_no_build_side(bundle, tmp_path):
    """doctor and generate run end to end in a process where the compiler and onnx/torch cannot import."""
    path, _ = bundle
    code = (f"import sys\nfor m in {BLOCKED!r}: sys.modules[m] = None\n"
            "from precast.runtime.cli import main\nmain()")
    out = tmp_path / "thin.png"
    for args in (["doctor", str(path)],
                 ["generate", str(path), "--prompt", "a cat", "--steps", "2", "--size", "64x64", "--out", str(out)]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert out.exists()
    proc = subprocess.run([sys.executable, "-c", code, "export", "x.safetensors", "--out", "y"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "precast[compiler]" in proc.stderr


# What `pip install precast onnxruntime` lacks: the `compiler` extra's modules (and onnxsim, torch, ...).
# precast.compiler itself ships in the wheel, so it stays importable here.
RUNTIME_ONLY = ["onnx", "onnxsim", "safetensors", "yaml", "platformdirs", "filelock", "ml_dtypes", "torch",
                "diffusers", "transformers", "tensorrt_rtx"]


@pytest.mark.parametrize("args", [
    ["export", "x.safetensors", "--out", "y"], ["build", "recipe.yaml", "--out", "b"], ["plan", "recipe.yaml"],
    ["compile", "export", "--target", "onnxruntime"], ["bundle", "merge", "a", "b", "--out", "c"],
    ["cache", "ls"], ["cache", "gc"], ["cache", "show", "abc"], ["cache", "rm", "abc"],
    ["demo-model", "--out", "tiny.safetensors"]])
def test_build_commands_on_a_runtime_only_install_name_the_extra(tmp_path, args):
    """Every build command printed a traceback for a missing module (onnx, yaml, platformdirs); now one
    line naming the command and the extra to install, exit 2, nothing written."""
    code = (f"import sys\nfor m in {RUNTIME_ONLY!r}: sys.modules[m] = None\n"
            "from precast.runtime.cli import main\nmain()")
    (tmp_path / "recipe.yaml").write_text("model: {source: demo:tiny-sd15}\n")
    command = " ".join(args[:2] if args[0] in ("bundle", "cache") else args[:1])
    for extra in ([], ["--json"]):
        proc = subprocess.run([sys.executable, "-c", code, *args, *extra], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PRECAST_CACHE": str(tmp_path / "cache")})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: `precast {command.split()[0]}") and "needs the build side's dependencies" in line
        assert line.endswith("add the compiler extra to this precast: pip install 'precast[compiler]' with this "
                             "environment's pip, or pip install -e '.[compiler]' in a checkout"), line
        if extra:
            assert json.loads(proc.stdout) == {"error": line[len("error: "):], "exit": 2}
        else:
            assert proc.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_build_command_help_works_on_a_runtime_only_install(tmp_path):
    """A user without the compiler extra can still read what a build command takes."""
    code = (f"import sys\nfor m in {RUNTIME_ONLY!r}: sys.modules[m] = None\n"
            "from precast.runtime.cli import main\nmain()")
    for cmd in (["export"], ["compile"], ["cache", "gc"]):
        proc = subprocess.run([sys.executable, "-c", code, *cmd, "--help"], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith("Usage: ") and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("damage, words", [
    ("flip", "tokenizer/vocab.json: sha256 differs from the manifest"),
    ("remove", "tokenizer/merges.txt: missing"),
    ("unlisted", "tokenizer/trigger_words.json: not listed in the bundle's manifest"),
])
def test_generate_refuses_a_changed_tokenizer(bundle, tmp_path, damage, words):
    """Tokenizer files are checked against the manifest like engines: a changed vocab.json used to
    crash with a JSONDecodeError traceback, a removed merges.txt silently meant the shipped vocabulary."""
    import shutil
    from conftest import flip_byte
    copy = tmp_path / "copy"
    shutil.copytree(bundle[0], copy)
    if damage == "flip":
        flip_byte(copy / "tokenizer/vocab.json", 100, mask=1)
    elif damage == "remove":
        (copy / "tokenizer/merges.txt").unlink()
    else:
        (copy / "tokenizer/trigger_words.json").write_text('{"cat": [49408]}')
    out = tmp_path / "x.png"
    proc = precast("generate", copy, "--prompt", "a cat", "--steps", "1", "--size", "64x64", "--out", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{copy}/{words}" in lines[0], lines[0]
    assert not out.exists()


def test_a_changed_tokenizer_fails_before_any_engine_is_verified_or_loaded(bundle, tmp_path, monkeypatch):
    """The tokenizer was checked after every engine was loaded (GBs for SDXL); now first."""
    import shutil
    from conftest import flip_byte
    from precast.runtime import loading as pipeline
    from precast.runtime.errors import UserError
    from precast.runtime.families.sd import Txt2Img
    copy = tmp_path / "copy"
    shutil.copytree(bundle[0], copy)
    flip_byte(copy / "tokenizer/vocab.json", 100, mask=1)

    def no_engines(*a, **k):
        raise AssertionError("an engine was selected or loaded before the tokenizer was checked")
    monkeypatch.setattr(pipeline, "select_all", no_engines)
    monkeypatch.setattr(pipeline, "load_component", no_engines)
    with pytest.raises(UserError, match="tokenizer/vocab.json: sha256 differs"):
        Txt2Img(copy, width=64, height=64)


def test_sdxl_embedding_files_are_checked_and_read_once_for_both_encoders(monkeypatch):
    """Each embedding file was hashed and read once per text encoder (twice for SDXL); now once,
    registered with both encoders' tokenizers."""
    from pathlib import Path
    from types import SimpleNamespace
    from precast.runtime import embeddings, text_encoders as pipeline

    class Tok:
        def __init__(self):
            self.vocab_size = 10

        def add_tokens(self, name, n):
            ids = list(range(self.vocab_size, self.vocab_size + n))
            self.vocab_size += n
            return ids
    checked, read = [], []
    manifest = SimpleNamespace(
        root=Path("/bundle"), check_file=checked.append,
        model={"embeddings": [{"name": "cat", "file": "embeddings/cat.safetensors"}]},
        components={c: {"config": {"vocab": 10}} for c in ("text_encoder", "text_encoder_2")})
    monkeypatch.setattr(pipeline, "load_tokenizer", lambda m, folder: Tok())
    monkeypatch.setattr(embeddings, "read_vectors", lambda p: read.append(p) or {
        "text_encoder": np.ones((2, 4), np.float32), "text_encoder_2": np.ones((2, 6), np.float32)})
    toks, embs = pipeline.bundle_tokenizers(manifest, ("text_encoder", "text_encoder_2", "unet", "vae_decoder"))
    assert checked == ["embeddings/cat.safetensors"] and read == [Path("/bundle/embeddings/cat.safetensors")]
    assert set(toks) == set(embs) == {"text_encoder", "text_encoder_2"}
    assert all(t.vocab_size == 12 for t in toks.values())
    assert all([name for name, _ in e.items] == ["cat"] for e in embs.values())
