"""img2img and inpainting (issue 17, items 3 and 5): the runtime's pipelines match diffusers'
StableDiffusionImg2ImgPipeline and StableDiffusionInpaintPipeline (a 9-channel inpainting UNet, and a
plain UNet by latent blending) at PSNR >= 40 dB on tiny SD 1.x bundles, same noise and schedulers;
the runtime's PNG reader (every colour type, palettes, 16-bit, each row filter; damaged files one
line); the sizing rules of runtime/images.py; `precast generate --init-image/--mask/--strength` and
the Python API's img2img / inpaint."""
import json
import struct
import zlib

import numpy as np
import pytest
import torch

import reference as ref
from conftest import precast
from precast.compiler.demo_model import TINY, TINY_INPAINT, write_demo_model
from precast.runtime import images
from precast.runtime.errors import UserError
from precast.runtime.png import decode_png, png_bytes, read_png, write_png

SIZE = 64


def psnr(a, b):
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return 10 * np.log10(1.0 / mse) if mse else float("inf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny SD 1.x bundles with a VAE encoder (ONNX Runtime, 64x64), built once for this module from
    recipes naming checkpoints demo_model writes: a plain UNet and a 9-channel inpainting UNet."""
    tmp = tmp_path_factory.mktemp("img2img")
    out = {}
    for name, cfg in (("plain", TINY), ("inpaint", TINY_INPAINT)):
        ckpt = tmp / f"{name}.safetensors"
        write_demo_model(str(ckpt), cfg)
        recipe = tmp / f"{name}.yaml"
        recipe.write_text(f"model: {{source: {ckpt.name}}}\ncomponents: [text_encoder, unet, vae_decoder, vae_encoder]\n"
                          "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime]\n")
        precast("build", recipe, "--out", tmp / name, env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
        out[name] = (tmp / name, ckpt, cfg)
    return out


def picture(w=SIZE, h=SIZE, seed=3) -> np.ndarray:
    """A deterministic uint8 RGB picture: gradients, a disc, a little noise."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([xx / w, yy / h, 0.5 + 0.5 * np.sin(xx / 5 + yy / 7)], -1)
    img[(xx - w * 0.6) ** 2 + (yy - h * 0.4) ** 2 < (w / 5) ** 2] = (0.9, 0.2, 0.1)
    img += np.random.default_rng(seed).normal(0, 0.03, img.shape)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)


def same_start(monkeypatch, module, noise: np.ndarray) -> None:
    """A diffusers img2img pipeline module made to start as precast does: its randn_tensor returns `noise` (reshaped
    to what it asks for) and retrieve_latents takes the VAE distribution's mode (precast encodes deterministically)."""
    original = module.retrieve_latents
    monkeypatch.setattr(module, "randn_tensor", lambda shape, **k: torch.from_numpy(noise.copy()).reshape(shape))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        original(out, generator, "argmax"))


def mask_picture(w=SIZE, h=SIZE) -> np.ndarray:
    m = np.zeros((h, w), np.uint8)
    m[h * 3 // 16:h * 13 // 16, w * 5 // 16:w * 11 // 16 + 3] = 255   # edges off the 8-pixel grid
    return m


@pytest.fixture(scope="module")
def diffusers_parts(tiny):
    """{name: (unet, vae, text_encoder, tokenizer)} for the two checkpoints (diffusers' own converters)."""
    from transformers import CLIPTokenizer
    parts = {}
    for name, (path, ckpt, cfg) in tiny.items():
        unet, vae, te = ref.models_from_single_file(ckpt, cfg)
        tok = CLIPTokenizer(str(path / "tokenizer/vocab.json"), str(path / "tokenizer/merges.txt"), model_max_length=77)
        parts[name] = (unet, vae, te, tok)
    return parts


def diffusers_run(parts, kind, scheduler, noise, monkeypatch, **kw):
    """diffusers' pipeline with the runtime's noise (randn_tensor patched) and the VAE's mean (retrieve_latents
    in argmax mode: the runtime encodes deterministically)."""
    from diffusers import (DPMSolverMultistepScheduler, EulerDiscreteScheduler, StableDiffusionImg2ImgPipeline,
                           StableDiffusionInpaintPipeline)
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as m_i2i
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as m_inp
    for mod in (m_i2i, m_inp):
        original = mod.retrieve_latents
        monkeypatch.setattr(mod, "randn_tensor", lambda shape, **k: torch.from_numpy(noise.copy()))
        monkeypatch.setattr(mod, "retrieve_latents", lambda out, generator=None, sample_mode="sample", _o=original:
                            _o(out, generator, "argmax"))
    cfg = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
               timestep_spacing="leading", steps_offset=1)
    sched = EulerDiscreteScheduler(**cfg) if scheduler == "euler" else DPMSolverMultistepScheduler(
        **cfg, algorithm_type="dpmsolver++", solver_order=2)
    unet, vae, te, tok = parts
    cls = StableDiffusionImg2ImgPipeline if kind == "img2img" else StableDiffusionInpaintPipeline
    pipe = cls(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=sched, safety_checker=None,
               feature_extractor=None, requires_safety_checker=False)
    with torch.no_grad():
        return pipe(output_type="np", **kw).images[0]


CASES = {  # id: (bundle, mask?, scheduler, strength)
    "img2img-euler": ("plain", False, "euler", 0.6),
    "img2img-dpm": ("plain", False, "dpm++2m", 0.75),
    "inpaint9-euler": ("inpaint", True, "euler", 1.0),
    "inpaint9-euler-strength": ("inpaint", True, "euler", 0.7),
    "inpaint4-blend-euler": ("plain", True, "euler", 1.0),
    "inpaint4-blend-dpm": ("plain", True, "dpm++2m", 0.8),
}


@pytest.fixture(scope="module")
def runtime_pipes(tiny):
    from precast.runtime.families.sd import Txt2Img
    return {name: Txt2Img(path, width=SIZE, height=SIZE, image_input=True) for name, (path, _, _) in tiny.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers(case, tiny, runtime_pipes, diffusers_parts, monkeypatch):
    from PIL import Image
    name, with_mask, scheduler, strength = CASES[case]
    prompt, negative, steps, guidance = "a photo of a cat", "blurry", 8, 7.5
    noise = np.random.default_rng(11).standard_normal((1, 4, 8, 8)).astype(np.float32)
    init, mask = picture(), mask_picture() if with_mask else None
    ours = runtime_pipes[name](prompt, negative, steps, 0, guidance, scheduler, latents=noise, progress=False,
                               init_image=init, mask=mask, strength=strength)
    kw = dict(prompt=prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=guidance,
              strength=strength, image=Image.fromarray(init))
    if with_mask:
        kw.update(mask_image=Image.fromarray(mask), height=SIZE, width=SIZE)
    want = diffusers_run(diffusers_parts[name], "inpaint" if with_mask else "img2img", scheduler, noise, monkeypatch, **kw)
    assert ours.shape == want.shape == (SIZE, SIZE, 3)
    assert want.std() > 0.05
    score = psnr(ours, want)
    print(f"{case}: PSNR {score:.1f} dB")
    assert score >= 40.0, score
    # the init image matters: a different one gives a different result (the image really conditions the run)
    if strength < 1.0:
        other = runtime_pipes[name](prompt, negative, steps, 0, guidance, scheduler, latents=noise, progress=False,
                                    init_image=255 - init, mask=mask, strength=strength)
        assert psnr(other, ours) < 30


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """A tiny SDXL bundle with a VAE encoder (ONNX Runtime, 64x64) and its diffusers models."""
    from precast.compiler.demo_model import TINY_SDXL
    tmp = tmp_path_factory.mktemp("img2img-xl")
    ckpt = tmp / "xl.safetensors"
    write_demo_model(str(ckpt), TINY_SDXL)
    (tmp / "xl.yaml").write_text("model: {source: xl.safetensors}\ncomponents: [text_encoder, text_encoder_2, unet, "
                                 "vae_decoder, vae_encoder]\nprofiles: {batch: 1, height: 64, width: 64}\n"
                                 "targets: [onnxruntime]\n")
    precast("build", tmp / "xl.yaml", "--out", tmp / "bundle", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    models = ref.family_models(ckpt, TINY_SDXL)
    models["vae"].register_to_config(scaling_factor=0.13025)
    return tmp / "bundle", models


@pytest.mark.parametrize("with_mask, strength", [(False, 0.6), (True, 0.7)])
def test_sdxl_matches_diffusers(sdxl, with_mask, strength, monkeypatch):
    """SDXL base (two text encoders, pooled embeds, time ids): img2img and plain-UNet inpainting as
    StableDiffusionXLImg2ImgPipeline / StableDiffusionXLInpaintPipeline."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img as m_i2i
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as m_inp
    from PIL import Image
    from transformers import CLIPTokenizer
    from precast.runtime.families.sd import Txt2Img
    bundle, models = sdxl
    noise = np.random.default_rng(3).standard_normal((1, 4, 8, 8)).astype(np.float32)
    for mod in (m_i2i, m_inp):
        original = mod.retrieve_latents
        monkeypatch.setattr(mod, "randn_tensor", lambda shape, **k: torch.from_numpy(noise.copy()))
        monkeypatch.setattr(mod, "retrieve_latents", lambda out, generator=None, sample_mode="sample", _o=original:
                            _o(out, generator, "argmax"))
    mask = mask_picture() if with_mask else None
    ours = Txt2Img(bundle, width=SIZE, height=SIZE, image_input=True)(
        "a cat", "blurry", 4, 0, 5.0, "euler", latents=noise, progress=False, init_image=picture(), mask=mask,
        strength=strength)
    toks = [CLIPTokenizer(str(bundle / f / "vocab.json"), str(bundle / f / "merges.txt"), model_max_length=77, **kw)
            for f, kw in (("tokenizer", {}), ("tokenizer_2", {"pad_token": "!"}))]
    cls = StableDiffusionXLInpaintPipeline if with_mask else StableDiffusionXLImg2ImgPipeline
    pipe = cls(vae=models["vae"], text_encoder=models["text_encoder"], text_encoder_2=models["text_encoder_2"],
               tokenizer=toks[0], tokenizer_2=toks[1], unet=models["unet"], requires_aesthetics_score=False,
               scheduler=EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                                beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1))
    kw = dict(mask_image=Image.fromarray(mask), height=SIZE, width=SIZE) if with_mask else {}
    with torch.no_grad():
        want = pipe("a cat", negative_prompt="blurry", image=Image.fromarray(picture()), strength=strength,
                    num_inference_steps=4, guidance_scale=5.0, output_type="np", **kw).images[0]
    assert want.std() > 0.05
    score = psnr(ours, want)
    print(f"sdxl {'inpaint' if with_mask else 'img2img'}: PSNR {score:.1f} dB")
    assert score >= 40.0, score


def test_latent_blending_keeps_the_unmasked_region(runtime_pipes):
    """A plain UNet inpaints by blending: outside the mask the final latents are the init image's, so the
    decoded image there is the VAE round trip of the init image whatever the prompt."""
    pipe = runtime_pipes["plain"]
    init, mask = picture(), mask_picture()
    a = pipe("a cat", steps=4, seed=1, progress=False, init_image=init, mask=mask)
    b = pipe("a dog on a sofa", steps=4, seed=2, progress=False, init_image=init, mask=mask)
    keep = images.mask_tensor(mask, SIZE, SIZE)[0, 0][::8, ::8] == 0
    keep_px = np.kron(keep, np.ones((8, 8), bool))
    keep_px[1:] &= keep_px[:-1]
    keep_px[:, 1:] &= keep_px[:, :-1]     # away from the mask's edge by a pixel; the decoder mixes neighbours
    inner = np.zeros_like(keep_px)
    inner[16:-16, 16:-16] = True
    assert np.abs(a - b)[~keep_px].mean() > 0.02
    assert np.abs(a - b)[keep_px & ~inner].mean() < np.abs(a - b)[~keep_px].mean() / 2


# ---- the PNG reader ------------------------------------------------------------------------------------
def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def filtered(rows: list[bytes], bpp: int, kinds) -> bytes:
    """Each row filtered with its type (kinds cycles), by the PNG spec's definitions."""
    out, prev = b"", bytes(len(rows[0]))
    for y, row in enumerate(rows):
        k = kinds[y % len(kinds)]
        enc = bytearray()
        for i, x in enumerate(row):
            a = row[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            pred = (0, a, b, (a + b) // 2, paeth(a, b, c))[k]
            enc.append((x - pred) & 0xFF)
        out += bytes([k]) + bytes(enc)
        prev = row
    return out


def make_png(samples: np.ndarray, depth: int, color: int, kinds=(0, 1, 2, 3, 4), extra=b"", interlace=0) -> bytes:
    """A PNG of `samples` ([H, W, C] ints at `depth`; palette indices for color 3) built by hand."""
    h, w, c = samples.shape
    if depth == 16:
        rows = [samples[y].astype(">u2").tobytes() for y in range(h)]
    elif depth == 8:
        rows = [samples[y].astype(np.uint8).tobytes() for y in range(h)]
    else:
        rows = [np.packbits(np.unpackbits(samples[y, :, 0].astype(np.uint8)[:, None], axis=1)[:, 8 - depth:]
                            .reshape(-1)).tobytes() for y in range(h)]
    bpp = max(1, depth * c // 8)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, interlace))
            + extra + chunk(b"IDAT", zlib.compress(filtered(rows, bpp, kinds))) + chunk(b"IEND", b""))


def test_png_reader_round_trips_the_writer():
    img = picture(24, 17)
    assert np.array_equal(decode_png(png_bytes(img)), img)


@pytest.mark.parametrize("color, depth", [(0, 8), (0, 16), (0, 1), (0, 4), (2, 8), (2, 16), (4, 8), (6, 8), (6, 16),
                                          (3, 8), (3, 2)])
def test_png_reader_reads_each_colour_type_and_filter(color, depth):
    rng = np.random.default_rng(color * 100 + depth)
    h, w = 7, 13
    c = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    top = (1 << depth) - 1
    extra = b""
    if color == 3:
        palette = rng.integers(0, 256, (top + 1, 3)).astype(np.uint8)
        samples = rng.integers(0, top + 1, (h, w, 1))
        alpha = rng.integers(0, 256, top + 1).astype(np.uint8)
        extra = chunk(b"PLTE", palette.tobytes()) + chunk(b"tRNS", alpha.tobytes())
        want = np.concatenate([palette[samples[..., 0]], alpha[samples[..., 0]][..., None]], -1)
    else:
        samples = rng.integers(0, top + 1, (h, w, c))
        want = (samples * 255 / top).round().astype(np.uint8)
    samples[0, :3] = top            # smooth runs and extremes too
    if color == 3:
        want[0, :3] = np.concatenate([palette[top], [alpha[top]]])
    else:
        want[0, :3] = 255
    for kinds in ((0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)):
        got = decode_png(make_png(samples, depth, color, kinds, extra))
        assert got.dtype == np.uint8 and np.array_equal(got, want), (kinds, got[0, :4], want[0, :4])


def test_png_reader_refuses_damaged_files_in_one_line(tmp_path):
    good = make_png(picture(8, 8).astype(np.int64), 8, 2)
    bad = {
        "not a PNG": b"GIF89a" + good[6:],
        "truncated PNG": good[:len(good) - 20],
        "fails its CRC check": good[:40] + bytes([good[40] ^ 0xFF]) + good[41:],
        "interlaced (Adam7)": make_png(picture(8, 8).astype(np.int64), 8, 2, interlace=1),
        "bit depth 4 is not allowed for RGB": make_png(np.zeros((2, 2, 3), np.int64), 8, 2).replace(
            chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0)),
            chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 4, 2, 0, 0, 0))),
        "looks like a JPEG": b"\xff\xd8\xff\xe0" + bytes(100),
    }
    for words, data in bad.items():
        path = tmp_path / "bad.png"
        path.write_bytes(data)
        with pytest.raises(UserError) as e:
            read_png(path, "--init-image")
        msg = str(e.value)
        assert words in msg and msg.startswith(f"--init-image {path}: ") and "\n" not in msg, msg


# ---- sizing rules ----------------------------------------------------------------------------------------
def test_colour_rules_and_mask_luma():
    grey_alpha = np.array([[[100, 0], [100, 255], [100, 128]]], np.uint8)
    assert images.to_rgb(grey_alpha).tolist() == [[[255] * 3, [100] * 3, [177] * 3]]   # alpha over white: 100 x 128/255 + 127
    rgb = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255], [128, 128, 128]]], np.uint8)
    from PIL import Image
    assert images.to_luma(rgb).tolist() == np.array(Image.fromarray(rgb).convert("L")).tolist()
    m = images.mask_tensor(np.array([[0, 127, 128, 255]], np.uint8), 4, 1)
    assert m.tolist() == [[[[0, 0, 1, 1]]]]


def test_resize_is_antialiased_bilinear_like_pil_and_crops_to_the_aspect():
    from PIL import Image
    img = picture(96, 80)
    for size in ((48, 40), (24, 20), (120, 100), (37, 23)):
        ours = images.resize(img, *size)
        pil = np.array(Image.fromarray(img).resize(size, Image.BILINEAR)).astype(np.float32)
        assert np.abs(ours - pil).max() <= 1.01, size   # PIL rounds its first pass to uint8
    assert images.crop_box(96, 64, 64, 64) == (16, 0, 64, 64)
    assert images.crop_box(64, 96, 64, 64) == (0, 16, 64, 64)
    assert images.crop_box(100, 100, 64, 32) == (0, 25, 100, 50)
    wide = np.zeros((64, 128, 3), np.uint8)
    wide[:, 32:96] = 200                                  # the centre square survives the crop
    assert np.allclose(images.fit(wide, 64, 64), 200)
    t = images.image_tensor(picture(), SIZE, SIZE)
    assert t.shape == (1, 3, SIZE, SIZE) and t.min() >= -1 and t.max() <= 1


def test_output_size_and_mask_size_rules(tmp_path):
    assert images.output_size(np.zeros((48, 72, 3), np.uint8), "--init-image", "a.png", 8) == (72, 48)
    with pytest.raises(UserError, match=r"--init-image a.png is 70x48, not multiples of 8: give --size WIDTHxHEIGHT"):
        images.output_size(np.zeros((48, 70, 3), np.uint8), "--init-image", "a.png", 8)
    with pytest.raises(UserError, match=r"--mask \(array\) is 32x32 but the init image is 64x64"):
        images.mask_image(np.zeros((32, 32), np.uint8), picture())
    with pytest.raises(UserError, match="expected a uint8 array"):
        images.init_image(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(UserError, match="no such file"):
        images.init_image(tmp_path / "none.png")


# ---- the command line and the Python API ---------------------------------------------------------------
def test_generate_img2img_and_inpaint_cli(tiny, tmp_path, runtime_pipes):
    """`precast generate --init-image/--mask` writes the API's image byte for byte; --json names the mode.
    A larger init image with --size is cropped and resized; without --size the output takes its size."""
    from precast.runtime.api import open_bundle
    path = tiny["plain"][0]
    init, mask = tmp_path / "in.png", tmp_path / "mask.png"
    write_png(init, picture())
    write_png(mask, np.repeat(mask_picture()[..., None], 3, axis=2))
    out = tmp_path / "out.png"
    proc = precast("generate", path, "--prompt", "a cat", "--steps", "4", "--init-image", init, "--mask", mask,
                   "--strength", "0.75", "--scheduler", "dpm++2m", "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["mode"], report["strength"], report["size"]) == ("inpaint", 0.75, "64x64")
    assert "vae_encoder" in report["components"]
    bundle = open_bundle(path)
    steps = []
    image = bundle.inpaint("a cat", init, mask, steps=4, strength=0.75, scheduler="dpm++2m",
                           on_step=lambda i, n: steps.append((i, n)))
    assert image.png() == out.read_bytes() and image.mode == "inpaint"
    assert steps == [(1, 3), (2, 3), (3, 3)]           # int(4 x 0.75) = 3 steps run
    # an array gives the same image as the file it was written to
    again = bundle.inpaint("a cat", picture(), np.repeat(mask_picture()[..., None], 3, axis=2), steps=4,
                           strength=0.75, scheduler="dpm++2m")
    assert again.png() == image.png()
    i2i = bundle.img2img("a cat", picture(), steps=4, seed=5)
    assert i2i.mode == "img2img" and i2i.strength == 0.8 and i2i.size == (SIZE, SIZE)
    big = tmp_path / "big.png"
    write_png(big, picture(96, 80))
    out2 = tmp_path / "out2.png"
    proc = precast("generate", path, "--prompt", "a cat", "--steps", "2", "--init-image", big, "--size", "64x64",
                   "--out", out2)
    assert proc.returncode == 0 and "img2img from" in proc.stdout, proc.stderr
    assert read_png(out2).shape == (64, 64, 3)


def test_generate_bad_image_inputs_are_one_line(tiny, tmp_path):
    plain, inpaint = tiny["plain"][0], tiny["inpaint"][0]
    init, damaged, small, odd = (tmp_path / n for n in ("in.png", "damaged.png", "small.png", "odd.png"))
    write_png(init, picture())
    data = bytearray(init.read_bytes())
    data[50] ^= 0xFF
    damaged.write_bytes(bytes(data))
    write_png(small, picture(32, 32))
    write_png(odd, picture(60, 64))
    out = tmp_path / "x.png"
    cases = [
        ([plain, "--init-image", damaged], f"--init-image {damaged}: damaged PNG (chunk 'IDAT' at byte 33 fails its CRC"),
        ([plain, "--mask", init], "--mask: inpainting needs the image the mask applies to: give --init-image too"),
        ([plain, "--init-image", init, "--strength", "1.5"], "--strength 1.5: must be more than 0 and at most 1"),
        ([plain, "--init-image", init, "--strength", "0.1"], "--strength 0.1 with 4 steps runs no step"),
        ([plain, "--init-image", init, "--mask", small], f"--mask {small} is 32x32 but the init image is 64x64"),
        ([plain, "--init-image", odd], f"--init-image {odd} is 60x64, not multiples of 8: give --size"),
        ([plain, "--strength", "0.5"], "--strength: applies to img2img and inpainting; give --init-image too"),
        ([inpaint], "has an inpainting UNet (9 input channels: latents, mask, masked image): give --init-image"),
        ([inpaint, "--init-image", init], "has an inpainting UNet (9 input channels): give --mask too"),
    ]
    for args, words in cases:
        proc = precast("generate", *args, "--prompt", "x", "--steps", "4", "--out", out)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert words in lines[0], lines[0]
    assert not out.exists()


def test_bundle_without_vae_encoder_and_other_families_are_refused(tiny_bundle, tiny):
    """Checked from the manifest before anything loads (check_image_mode)."""
    from types import SimpleNamespace
    from precast.runtime.api import open_bundle
    from precast.runtime.generate import check_image_mode
    with pytest.raises(UserError, match="rebuild it with vae_encoder in the recipe's components"):
        open_bundle(tiny_bundle[0]).img2img("x", picture())
    flux2 = SimpleNamespace(root="b", model={"family": "flux2"}, components={"transformer": {}, "vae_encoder": {}})
    with pytest.raises(UserError, match=r"img2img and inpainting are for SD 1.x/2.x/XL bundles now \(img2img for "
                                        r"Flux, Chroma, SD3, Z-Image and Qwen-Image too\); this one is flux2"):
        check_image_mode(flux2, True, False, None, 20)
    zimage = SimpleNamespace(root="z", model={"family": "zimage"}, components={"transformer": {}})
    with pytest.raises(UserError, match="^z: img2img encodes the image with the VAE encoder, which this bundle lacks"):
        check_image_mode(zimage, True, False, None, 8)
    zimage.components["vae_encoder"] = {}
    assert check_image_mode(zimage, True, False, None, 8) == ("img2img", 0.6)      # diffusers' default strength
    with pytest.raises(UserError, match="strength=0: must be more than 0"):
        open_bundle(tiny["plain"][0]).img2img("x", picture(), strength=0)
