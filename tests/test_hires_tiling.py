"""VAE tiling and the hires fix (issue 33 items 5 and 6), on real tiny SD 1.x bundles built through the CLI
(ONNX Runtime): the tiles' blend is exact for a decoder that is local; the tiny VAE decodes in tiles close to
its plain decode, closer than diffusers' own AutoencoderKL.tiled_decode at the same tile size (a VAE's
GroupNorms see one tile at a time: 40 dB is out of reach on a random tiny VAE, for either); a bundle built for
64x64 decodes (and encodes) 2x and 4x that through `generate` in tiles on its engine, with the note; the hires
fix's image is the first pass then img2img by hand through the API, byte for byte; a second size outside the
denoiser's profiles is refused in one line; `--from-png` reruns hires and tiled PNGs byte for byte."""
import json
import math

import numpy as np
import pytest

from conftest import build_recipe, precast

BACKEND = "cpu:onnxruntime"
RECIPE = ("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder, vae_encoder]\n"
          "profiles: {batch: 1, height: SIZE, width: SIZE}\ntargets: [onnxruntime]\n")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """{"dyn": profiles 64..128 px, "small": 64x64 only (its VAE engines take 8x8 latents, no more)}."""
    tmp = tmp_path_factory.mktemp("hires")
    return {"dyn": build_recipe(tmp, RECIPE.replace("SIZE", "{min: 64, opt: 64, max: 128}"), "dyn"),
            "small": build_recipe(tmp, RECIPE.replace("SIZE", "64"), "small")}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """dB between two decodes in [-1, 1], as images in [0, 1]."""
    a, b = (np.clip(x.astype(np.float64) / 2 + 0.5, 0, 1) for x in (a, b))
    return 10 * math.log10(1 / float(np.mean((a - b) ** 2)))


def generate(bundle, out, *args, check=True):
    proc = precast("generate", bundle, "--prompt", "a red fox", "--steps", "2", "--backend", BACKEND, "--out", out,
                   *args)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_blend_is_exact_for_a_local_decoder():
    from precast.runtime.vae_tiling import Tiling, run_tiled
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 4, 30, 44)).astype(np.float32)
    shapes = []

    def decoder(t):          # each latent -> an 8x8 block of its own: tiling cannot change it
        shapes.append(t.shape)
        return np.repeat(np.repeat(np.tanh(t[:, :3] * 1.5) + t[:, 3:] ** 2, 8, axis=2), 8, axis=3)
    tiled = run_tiled(decoder, z, Tiling(12, 16, 3, "test"), 8, decode=True)
    assert len(shapes) == 3 * 4 and set(shapes) == {(2, 4, 12, 16)}       # 3 x 4 tiles, all one size, overlapping
    np.testing.assert_allclose(tiled, decoder(z), rtol=0, atol=2e-6)
    x = rng.standard_normal((1, 3, 96, 136)).astype(np.float32)           # encoding: pixels -> latents
    encoder = lambda t: t.reshape(1, 3, t.shape[2] // 8, 8, t.shape[3] // 8, 8).mean(axis=(3, 5))  # noqa: E731
    np.testing.assert_allclose(run_tiled(encoder, x, Tiling(4, 6, 1, "test"), 8, decode=False), encoder(x),
                               rtol=0, atol=2e-6)


def test_tiled_decode_is_close_and_closer_than_diffusers(bundles, demo_ckpt):
    import torch
    from precast.compiler.demo_model import SD1Config
    from precast.runtime.api import open_bundle
    from precast.runtime.vae_tiling import Tiling, run_tiled
    from reference import models_from_single_file
    decoder = open_bundle(str(bundles["dyn"])).load("vae_decoder", BACKEND, size=(256, 256))   # the ONNX: any size
    run = lambda z: decoder.run({"latent_sample": z})["sample"]     # noqa: E731
    z = np.random.default_rng(1).standard_normal((1, 4, 32, 32)).astype(np.float32)
    plain = run(z)
    vae = models_from_single_file(demo_ckpt, SD1Config())[1]
    with torch.no_grad():
        assert psnr(vae.decode(torch.from_numpy(z)).sample.numpy(), plain) > 60     # the same VAE
        for tile, floor in ((16, 26), (24, 32)):        # 3 x 3 and 2 x 2 tiles of a 256x256 image
            ours = psnr(run_tiled(run, z, Tiling(tile, tile, tile // 4, "test"), 8, decode=True), plain)
            vae.tile_latent_min_size, vae.tile_sample_min_size, vae.tile_overlap_factor = tile, tile * 8, 0.25
            theirs = psnr(vae.tiled_decode(torch.from_numpy(z)).sample.numpy(), plain)
            assert ours > floor and ours > theirs + 3, (tile, ours, theirs)


def test_generate_decodes_past_the_vae_profile_in_tiles(bundles, tmp_path):
    from precast.runtime.api import open_bundle
    small = bundles["small"]
    proc = generate(small, tmp_path / "big.png", "--size", "256x256")      # 4x the VAE engines' 64x64
    lines = proc.stderr.strip().splitlines()
    assert lines[:2] == [
        "warning: size 256x256 is outside every shape profile of this bundle's unet engines (64x64): its ONNX is "
        "compiled at run time instead, on every run (slow); to avoid that, rebuild with a recipe profile covering it, "
        "e.g. profiles: {height: {min: 64, opt: 64, max: 256}, width: {min: 64, opt: 64, max: 256}}",
        "note: VAE decoder ran in 5x5 tiles of 64x64 px, overlapping by 16 px (256x256 px is past the largest size "
        "the VAE decoder's engine takes, 64x64 px)"], proc.stderr
    report = json.loads(generate(small, tmp_path / "j.png", "--size", "256x256", "--json").stdout)
    assert report["components"]["vae_decoder"]["artifact"].startswith("vae_decoder.onnxruntime/")   # its engine
    assert report["vae_tiling"]["decoder"]["tiles"] == "5x5"
    from precast.runtime.png import read_png
    assert read_png(tmp_path / "big.png").shape == (256, 256, 3)
    plain = json.loads(generate(small, tmp_path / "p.png", "--size", "256x256", "--json", "--no-vae-tiling").stdout)
    assert plain["components"]["vae_decoder"]["artifact"] == "onnx" and plain["vae_tiling"]["forced"] is False
    bundle = open_bundle(str(small))           # 2x, and img2img's encoder too, through the API
    image = bundle.txt2img("a red fox", steps=2, size=(128, 128), backend=BACKEND)
    assert image.size == (128, 128) and image.vae_tiling["decoder"]["tiles"] == "3x3"
    again = bundle.img2img("a red fox", image.to_uint8(), strength=0.5, steps=2, backend=BACKEND)
    assert again.vae_tiling["encoder"]["tiles"] == "3x3" and again.size == (128, 128)
    assert json.loads(again.text_chunks()["precast"])["settings"]["vae_tiling"]["encoder"]["tile"] == "64x64"


def pixel_hires_is_img2img_by_hand(bundle, settings: dict):
    """The pixel-upscaled hires fix (64 -> 128 px, 4 steps at denoise 0.6 after 3) equals txt2img then img2img of
    its image at 128x128 with the same seed, byte for byte; the hires Image."""
    base = bundle.txt2img("a red fox", steps=3, **settings)
    by_hand = bundle.img2img("a red fox", base.to_uint8(), strength=0.6, steps=4, size=(128, 128), **settings)
    hires = bundle.txt2img("a red fox", steps=3, hires_scale=2, hires_steps=4, hires_denoise=0.6,
                           hires_upscaler="bilinear", **settings)
    assert base.size == (64, 64) and hires.size == (128, 128)
    assert hires.to_uint8().tobytes() == by_hand.to_uint8().tobytes()
    return hires


def test_hires_is_the_first_pass_then_img2img_by_hand(bundles):
    import torch
    from precast.runtime.api import open_bundle
    from precast.runtime.families.sd import requests
    from precast.runtime.hires import upscale_latents
    bundle = open_bundle(str(bundles["dyn"]))
    settings = {"negative": "blurry", "seed": 5, "backend": BACKEND}
    pixel_hires_is_img2img_by_hand(bundle, settings)
    # the latent upscaler: torch's bilinear interpolate of the first pass's latents, then img2img from them
    pipe = bundle.pipeline(BACKEND).pipe
    kwargs = {"negative": "blurry", "guidance": 7.5, "progress": False}
    latents = pipe("a red fox", seeds=[5], steps=3, decode=False, **kwargs)
    up = torch.nn.functional.interpolate(torch.from_numpy(latents), size=(16, 16), mode="bilinear").numpy()
    np.testing.assert_allclose(upscale_latents(latents, 16, 16, "latent"), up, rtol=0, atol=1e-6)
    near = torch.nn.functional.interpolate(torch.from_numpy(latents), size=(16, 16), mode="nearest-exact").numpy()
    assert np.array_equal(upscale_latents(latents, 16, 16, "latent-nearest-exact"), near)
    second = pipe.at_size(128, 128, requests(bundle.manifest, 1, 128, 128))    # the same engines take 128x128
    assert second is not None and second.loaded is pipe.loaded
    by_hand = second("a red fox", seeds=[5], steps=4, init_latents=upscale_latents(latents, 16, 16, "latent"),
                     strength=0.6, **kwargs)
    latent = bundle.txt2img("a red fox", steps=3, hires_scale=2, hires_steps=4, hires_denoise=0.6, **settings)
    assert latent.to_uint8().tobytes() == (np.clip(by_hand[0], 0, 1) * 255).round().astype(np.uint8).tobytes()
    assert latent.settings["hires"] == {"scale": 2.0, "size": "128x128", "steps": 4, "denoise": 0.6,
                                        "upscaler": "latent"} and latent.settings["size"] == "64x64"


def test_hires_is_refused_in_one_line_before_anything_runs(bundles, tmp_path):
    from precast.runtime.api import UserError, open_bundle
    from precast.runtime.families import FAMILIES
    from precast.runtime.hires import check_hires
    proc = generate(bundles["dyn"], tmp_path / "x.png", "--hires-scale", "3", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --hires-scale 3.0: the second pass at 192x192 is outside every shape profile of this bundle's unet "
        "engines (64x64..128x128); rebuild with a recipe profile covering it, e.g. profiles: {height: {min: 64, opt: "
        "64, max: 192}, width: {min: 64, opt: 64, max: 192}}, or ask for a smaller hires size"]
    assert not (tmp_path / "x.png").exists()
    proc = generate(bundles["dyn"], tmp_path / "x.png", "--hires-denoise", "0.5", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: --hires-denoise: applies to the hires fix; give --hires-scale or --hires-size too"
    bundle = open_bundle(str(bundles["dyn"]))
    with pytest.raises(UserError, match=r"hires_upscaler='lanczos': choose one of latent, latent-nearest-exact, "):
        bundle.txt2img("a", hires_scale=2, hires_upscaler="lanczos")
    with pytest.raises(UserError, match=r"^hires_size='128x128': the hires fix's second pass is img2img, which FLUX.2 "
                                        r"bundles do not run \(SD 1.x/2.x/XL, Flux, Chroma, SD3, Z-Image and Qwen-Image"):
        check_hires(bundle.manifest, FAMILIES["flux2"], (64, 64), size="128x128", names="api")


def test_from_png_reruns_hires_and_tiled_pngs_byte_for_byte(bundles, tmp_path):
    from precast.runtime.png import read_png_text
    generate(bundles["dyn"], tmp_path / "h.png", "--seed", "3", "--hires-scale", "2", "--hires-steps", "3")
    params = read_png_text(tmp_path / "h.png", "png")["parameters"]
    assert "Size: 64x64" in params and "Denoising strength: 0.7, Hires upscale: 2.0, Hires steps: 3, " \
        "Hires upscaler: Latent" in params
    precast("generate", "--from-png", tmp_path / "h.png", "--out", tmp_path / "h2.png", check=True)
    assert (tmp_path / "h2.png").read_bytes() == (tmp_path / "h.png").read_bytes()
    generate(bundles["dyn"], tmp_path / "t.png", "--size", "128x128", "--vae-tiling", "--vae-tile", "64")
    record = json.loads(read_png_text(tmp_path / "t.png", "png")["precast"])["settings"]["vae_tiling"]
    assert record == {"forced": True, "tile": 64, "decoder": {"tiles": "3x3", "tile": "64x64", "overlap": 32,
                                                             "why": "--vae-tiling"}}
    precast("generate", "--from-png", tmp_path / "t.png", "--out", tmp_path / "t2.png", check=True)
    assert (tmp_path / "t2.png").read_bytes() == (tmp_path / "t.png").read_bytes()
    precast("generate", "--from-png", tmp_path / "t.png", "--no-vae-tiling", "--out", tmp_path / "t3.png", check=True)
    assert (tmp_path / "t3.png").read_bytes() != (tmp_path / "t.png").read_bytes()


def test_a_memory_budget_tiles_and_shrinks_the_tile():
    from precast.runtime.vae_tiling import plan, vae_bytes
    budget = vae_bytes(256, 256)
    assert plan((32, 32), None, None, None, 8, budget) is None           # 256x256 px fits the budget
    tiling = plan((64, 64), None, None, None, 8, budget)                 # 512x512 does not: tiles of 256 px
    assert (tiling.tile_h, tiling.tile_w, tiling.overlap) == (32, 32, 8) and "GiB, past the" in tiling.why
    assert plan((64, 64), ((8, 16), (8, 16)), None, None, 8, budget).tile_h == 16     # within the engine's profile
    assert plan((64, 64), None, False, None, 8, budget) is None          # --no-vae-tiling
