"""Exact tiled VAE passes (issue 33: tiled vs plain decode >= 40 dB): the `vae_decoder_tiled` / `vae_encoder_tiled`
components (the LDM decoder / encoder cut at their GroupNorms, compiler/graphs/vae_segments.py) run tile by tile by
runtime/vae_segments.py equal the plain decoder / encoder to float rounding -- on image-like latents where tiles with
their own GroupNorms (the blended tiling) fall far short --, on ONNX Runtime and OpenVINO engines, for SD's, Flux's
and FLUX.2's VAEs, odd sizes and batches; `generate` past the VAE's profile uses them (img2img's encoder too) and
says so (blended tiles when the estimate is past the memory budget); they are built only when asked for by name and
left out of the diffusers pipeline folder."""
import json
import math
import re
import shutil

import numpy as np
import pytest

from conftest import build_recipe, precast

RECIPE = ("model: {source: demo:SOURCE}\ncomponents: [COMPONENTS, vae_encoder, vae_encoder_tiled, vae_decoder, "
          "vae_decoder_tiled]\n"
          "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime, openvino]\n")


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return build_recipe(tmp_path_factory.mktemp("segments"),
                        RECIPE.replace("SOURCE", "tiny-sd15").replace("COMPONENTS", "text_encoder, unet"), "sd")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """dB between two decodes in [-1, 1], as images in [0, 1]."""
    a, b = (np.clip(x.astype(np.float64) / 2 + 0.5, 0, 1) for x in (a, b))
    return 10 * math.log10(1 / max(float(np.mean((a - b) ** 2)), 1e-30))


def image_like(shape, seed: int) -> np.ndarray:
    """Latents with image-like structure: smooth fields (noise upsampled 8x, then blurred) plus a gradient, so
    regions differ in their statistics as a picture's do (sky, subject, shadow)."""
    n, c, h, w = shape
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((n, c, -(-h // 8) + 1, -(-w // 8) + 1))
    z = np.repeat(np.repeat(coarse, 8, axis=2), 8, axis=3)[:, :, :h, :w]
    for axis in (2, 3):
        z = (z + np.roll(z, 1, axis) + np.roll(z, -1, axis)) / 3
    ramp = np.linspace(-1.5, 1.5, w)[None, None, None, :] * np.linspace(0.5, 1.5, h)[None, None, :, None]
    return (1.5 * z + ramp + 0.2 * rng.standard_normal(shape)).astype(np.float32)


def spec_of(bundle, component="vae_decoder_tiled"):
    """The component's manifest record: its program (config.segments), inputs and outputs."""
    return json.loads((bundle / "manifest.json").read_text())["components"][component]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_tiled_decode_equals_the_plain_one(sd, backend):
    from precast.runtime.api import open_bundle
    from precast.runtime.vae_segments import run_program as decode
    from precast.runtime.vae_tiling import Tiling, run_tiled
    bundle = open_bundle(str(sd))
    plain_decoder = bundle.load("vae_decoder", f"cpu:{backend}", size=(320, 256))     # at run time: any size
    tiled = bundle.load("vae_decoder_tiled", f"cpu:{backend}")
    assert tiled.plan.artifact.startswith(f"vae_decoder_tiled.{backend}/"), tiled.plan      # its own engine
    spec = spec_of(sd)
    program = spec["config"]["segments"]
    z = image_like((1, 4, 32, 40), 3)
    plain = plain_decoder.run({"latent_sample": z})["sample"]
    calls = []

    def run(feeds):
        calls.append(1)
        return tiled.run(feeds)
    segments = sum("segment" in step for step in program)
    for values, least in ((1 << 24, segments), (40000, 4 * segments)):     # whole maps: one call a segment; tiles
        calls.clear()
        exact = decode(run, spec, z, tile_values=values)
        assert len(calls) >= least and (values < 1 << 24 or len(calls) == segments)
        assert exact.shape == plain.shape and psnr(exact, plain) > 100, psnr(exact, plain)
        assert np.abs(exact - plain).max() < 1e-4
    blended = run_tiled(lambda t: plain_decoder.run({"latent_sample": t})["sample"], z, Tiling(16, 16, 4, "test"), 8,
                        decode=True)
    assert psnr(blended, plain) < 40           # the tiles' own GroupNorms: what the exact path is for
    encoder, twin = (bundle.load(c, f"cpu:{backend}", size=(320, 256)) for c in ("vae_encoder", "vae_encoder_tiled"))
    x = np.clip(plain, -1, 1)                   # an image-like picture: the decode
    want = encoder.run({"sample": x})["latent_parameters"]
    for values in (1 << 24, 40000):
        got = decode(twin.run, spec_of(sd, "vae_encoder_tiled"), x, tile_values=values)
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("source", ["tiny-flux-schnell", "tiny-flux2-klein"])
def test_other_vaes_odd_sizes_and_batches(tmp_path, source):
    import onnxruntime as ort
    from precast.runtime.vae_segments import run_program as decode
    bundle = build_recipe(tmp_path, RECIPE.replace("SOURCE", source).replace("COMPONENTS, ", ""), source)
    manifest = json.loads((bundle / "manifest.json").read_text())
    plain, tiled = (ort.InferenceSession(str(bundle / manifest["components"][c]["onnx"]))
                    for c in ("vae_decoder", "vae_decoder_tiled"))
    names = [o.name for o in tiled.get_outputs()]
    channels = spec_of(bundle)["inputs"][0]["shape"][1]
    for shape in ((2, channels, 19, 27), (1, channels, 5, 3)):
        z = image_like(shape, 5)
        ref = plain.run(None, {"latent_sample": z})[0]
        out = decode(lambda f: dict(zip(names, tiled.run(None, f))), spec_of(bundle), z, tile_values=2000)
        assert out.shape == ref.shape and np.abs(out - ref).max() < 1e-4, (shape, np.abs(out - ref).max())
        encoder, twin = (ort.InferenceSession(str(bundle / manifest["components"][c]["onnx"]))
                         for c in ("vae_encoder", "vae_encoder_tiled"))
        names_e = [o.name for o in twin.get_outputs()]
        x = np.clip(ref, -1, 1)
        want = encoder.run(None, {"sample": x})[0]
        got = decode(lambda f: dict(zip(names_e, twin.run(None, f))), spec_of(bundle, "vae_encoder_tiled"), x,
                     tile_values=2000)
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4 * np.abs(want).max(), shape


def test_generate_past_the_profile_decodes_exactly(sd, tmp_path):
    from precast.runtime.png import read_png
    args = ("generate", sd, "--prompt", "a red fox", "--steps", "2", "--size", "256x192", "--backend",
            "cpu:onnxruntime")
    proc = precast(*args, "--out", tmp_path / "tiled.png", check=True)
    assert "note: VAE decoder ran exactly, tile by tile through its 24 segments (256x192 px is past the largest " \
           "size the VAE decoder's engine takes, 64x64 px)" in proc.stderr, proc.stderr
    assert "\nunet              -> cpu" in proc.stdout and "\nvae_decoder_tiled -> cpu" in proc.stdout   # one column
    assert f"\n{'':20}passed over: unet." in proc.stdout, proc.stdout                    # under the arrow's tail
    report = json.loads(precast(*args, "--out", tmp_path / "j.png", "--json", check=True).stdout)
    assert report["vae_tiling"]["decoder"]["exact"] is True
    assert report["components"]["vae_decoder_tiled"]["artifact"].startswith("vae_decoder_tiled.onnxruntime/")
    precast(*args, "--out", tmp_path / "plain.png", "--no-vae-tiling", check=True)
    a, b = (read_png(tmp_path / f).astype(int) for f in ("tiled.png", "plain.png"))
    assert a.shape == (192, 256, 3) and np.abs(a - b).max() <= 1 and (a != b).mean() < 1e-3
    short = precast(*args, "--out", tmp_path / "short.png", "--params-backend", "cpu:100M", check=True)   # too little
    assert re.search(r"note: VAE decoder ran in 5x4 tiles of 64x64 px, overlapping by 16 px \(256x192 px is past the "
                     r"largest size the VAE decoder's engine takes, 64x64 px; an exact decode would hold \d+ MiB, past "
                     r"the \d+ MiB its device has for it\)", short.stderr), short.stderr
    assert "vae_decoder_tiled" not in short.stdout
    again = precast(*args, "--out", tmp_path / "i2i.png", "--init-image", tmp_path / "tiled.png", "--strength", "0.5",
                    check=True)                 # img2img past the encoder's profile: its exact twin
    assert "note: VAE encoder ran exactly, tile by tile through its 16 segments" in again.stderr, again.stderr
    assert "\nunet              -> cpu" in again.stdout and "\nvae_encoder_tiled -> cpu" in again.stdout


def test_a_tiled_twin_that_cannot_load_leaves_the_blended_tiles(sd, tmp_path):
    from conftest import flip_byte
    bundle = tmp_path / "damaged"
    shutil.copytree(sd, bundle)
    for path in bundle.rglob("*"):       # every file of the decoder's twin: its engines and its ONNX
        if path.is_file() and "vae_decoder_tiled" in str(path.relative_to(bundle)) and path.stat().st_size > 4096:
            flip_byte(path, path.stat().st_size // 2)
    proc = precast("generate", bundle, "--prompt", "a red fox", "--steps", "2", "--size", "256x192", "--backend",
                   "cpu:onnxruntime", "--out", tmp_path / "x.png")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"note: VAE decoder ran in 5x4 tiles of 64x64 px, overlapping by 16 px \(.*; vae_decoder_tiled did "
                     r"not load \(.+\)\)", proc.stderr), proc.stderr


def test_a_twin_takes_its_plain_components_precision_and_migraphx_refuses_it(tmp_path):
    recipe = ("model: {source: demo:tiny-sd15}\ncomponents: [vae_decoder, vae_decoder_tiled]\n"
              "precision: {default: fp16, vae_decoder: fp32}\nprofiles: {batch: 1, height: 64, width: 64}\n")
    bundle = build_recipe(tmp_path, recipe + "targets: [onnxruntime]\n", "p")
    dtypes = {c: v["dtype"] for c, v in json.loads((bundle / "manifest.json").read_text())["components"].items()}
    assert dtypes == {"vae_decoder": "fp32", "vae_decoder_tiled": "fp32"}       # exact to the plain one's rounding
    (tmp_path / "mx.yaml").write_text(recipe + "targets: [{migraphx: {gfx: gfx1100}}]\n")
    proc = precast("plan", tmp_path / "mx.yaml")
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path / 'mx.yaml'}:5: targets[0]: MIGraphX compiles " \
        "fixed shapes, and vae_decoder_tiled takes tiles of any size; drop it from the components or build it for " \
        "another target\n", proc.stderr


def test_built_only_when_asked_for_and_left_out_of_the_pipeline_folder(sd, tmp_path):
    from precast.compiler.recipe import DEFAULT_COMPONENTS
    assert all("vae_decoder_tiled" not in comps for comps in DEFAULT_COMPONENTS.values())
    index = json.loads((sd / "onnx" / "model_index.json").read_text())     # what diffusers / optimum load
    assert "vae_decoder" in index and "vae_decoder_tiled" not in index and "vae_encoder_tiled" not in index
    assert not (sd / "onnx" / "vae_decoder_tiled" / "config.json").exists()
    recipe = tmp_path / "q.yaml"          # Qwen-Image's VAE is another architecture (3D convolutions)
    recipe.write_text(RECIPE.replace("SOURCE", "tiny-qwen-image").replace("COMPONENTS, ", ""))
    proc = precast("build", recipe, "--out", tmp_path / "q")
    assert proc.returncode == 2 and proc.stderr == f"error: {recipe}: components: qwenimage has no vae_encoder_tiled, " \
        "vae_decoder_tiled (it has text_encoder, transformer, vae_encoder, vae_decoder)\n", proc.stderr
