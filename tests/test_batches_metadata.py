"""Batches, seeds and PNG metadata (issue 33 items 2 and 4), on real tiny bundles built through the CLI
(ONNX Runtime, batch profiles 1..4 and 1..2): image i of `--batch 4 --seed 10` is the single image of seed
10 + i, byte for byte, through the CLI and the Python API, for SD 1.x and a flow family (Flux schnell);
--count runs one after another; a batch larger than the profile runs in chunks; the PNG's A1111
`parameters` chunk parses back as A1111 parses it; `--from-png` reruns a PNG byte for byte (img2img with
its init image given again); a PNG without precast's record is one clear error."""
import json
import re

import numpy as np
import pytest

from conftest import build_recipe, precast

SD = ("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder, vae_encoder]\n"
      "profiles: {batch: {min: 1, opt: 1, max: MAX}, height: 64, width: 64}\ntargets: [onnxruntime]\n")
BACKEND = "cpu:onnxruntime"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """{"sd": SD 1.x with batch 1..4, "sd2": the same with batch 1..2, "flux": Flux schnell with batch 1..4}."""
    from precast.compiler.demo_families import write_demo_file
    tmp = tmp_path_factory.mktemp("batches")
    out = {name: build_recipe(tmp, SD.replace("MAX", most), name) for name, most in (("sd", "4"), ("sd2", "2"))}
    recipe = write_demo_file("flux-schnell", str(tmp / "schnell.safetensors"))
    recipe = re.sub(r"targets: .*", "targets: [onnxruntime]",
                    recipe.replace("batch: 1,", "batch: {min: 1, opt: 1, max: 4},"))
    assert "max: 4" in recipe
    out["flux"] = build_recipe(tmp, recipe, "flux")
    return out


def generate(bundle, out, *args, check=True):
    """`precast generate --json` (2 steps, ONNX Runtime on the CPU): the report, or the process (check=False)."""
    proc = precast("generate", *([bundle] if bundle else []), "--steps", "2", "--backend", BACKEND, "--out", out,
                   "--json", *args)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


# A1111's parse_generation_parameters (modules/infotext_utils.py), as it reads the `parameters` chunk
A1111_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
A1111_SIZE = re.compile(r"^(\d+)x(\d+)$")


def a1111_parse(text: str) -> dict:
    res, prompt, negative, done = {}, "", "", False
    *lines, lastline = text.strip().split("\n")
    if len(A1111_PARAM.findall(lastline)) < 3:
        lines.append(lastline)
        lastline = ""
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            done, line = True, line[16:].strip()
        if done:
            negative += ("" if negative == "" else "\n") + line
        else:
            prompt += ("" if prompt == "" else "\n") + line
    for k, v in A1111_PARAM.findall(lastline):
        if v[:1] == '"' and v[-1:] == '"':
            v = json.loads(v)
        m = A1111_SIZE.match(v)
        if m:
            res[f"{k}-1"], res[f"{k}-2"] = m.group(1), m.group(2)
        else:
            res[k] = v
    res["Prompt"], res["Negative prompt"] = prompt, negative
    return res


def png_chunks(path) -> dict:
    """The PNG's text chunks as Pillow reads them (an independent reader of tEXt / iTXt)."""
    from PIL import Image as PILImage
    with PILImage.open(path) as im:
        im.load()
        return dict(im.text)


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_batch_image_i_is_the_single_image_of_seed_plus_i(bundles, tmp_path, name):
    from precast.runtime.api import open_bundle
    bundle = str(bundles[name])
    report = generate(bundle, tmp_path / "b.png", "--prompt", "a red fox", "--negative", "blurry", "--batch", "4",
                      "--seed", "10")
    files = [tmp_path / f"b-000{i}.png" for i in range(1, 5)]
    assert report["batches"] == [4]                    # one denoiser call: the profile takes batch 4
    assert [i["seed"] for i in report["images"]] == [10, 11, 12, 13]
    assert [i["out"] for i in report["images"]] == list(map(str, files)) and not (tmp_path / "b.png").exists()
    single = generate(bundle, tmp_path / "s.png", "--prompt", "a red fox", "--negative", "blurry", "--seed", "12")
    assert single["batches"] == [1] and (tmp_path / "s.png").read_bytes() == files[2].read_bytes()
    pipe = open_bundle(bundle).pipeline(BACKEND)
    ones = [pipe("a red fox", negative="blurry", steps=2, seed=10 + i) for i in range(4)]
    assert [im.png() for im in ones] == [f.read_bytes() for f in files]            # the CLI's PNGs, byte for byte
    many = pipe.images("a red fox", negative="blurry", steps=2, seed=10, batch=4)
    assert pipe.pipe.batches == [4]
    assert [im.seed for im in many] == [10, 11, 12, 13]
    assert [im.png() for im in many] == [im.png() for im in ones]
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(many, ones))
    assert not np.array_equal(many[0].pixels, many[1].pixels)        # each its own seed's noise


def test_count_runs_one_after_another(bundles, tmp_path):
    from precast.runtime.api import open_bundle
    report = generate(bundles["sd"], tmp_path / "c.png", "--prompt", "a cat", "--batch", "2", "--count", "2",
                      "--seed", "5")
    assert report["batches"] == [2, 2] and report["count"] == 2
    pipe = open_bundle(str(bundles["sd"])).pipeline(BACKEND)
    ims = pipe.images("a cat", steps=2, seed=5, batch=2, count=2)
    assert [im.seed for im in ims] == [5, 6, 7, 8] and pipe.pipe.batches == [2]   # the last run's
    assert [im.png() for im in ims] == [(tmp_path / f"c-000{i}.png").read_bytes() for i in range(1, 5)]


def test_a_batch_past_the_profile_runs_in_chunks(bundles, tmp_path):
    from precast.runtime.api import open_bundle
    report = generate(bundles["sd2"], tmp_path / "k.png", "--prompt", "a cat", "--batch", "3", "--seed", "10")
    assert report["batches"] == [2, 1]                  # the profile's batch max is 2
    pipe = open_bundle(str(bundles["sd2"])).pipeline(BACKEND)
    singles = [pipe("a cat", steps=2, seed=s).png() for s in (10, 11, 12)]
    assert singles == [(tmp_path / f"k-000{i}.png").read_bytes() for i in (1, 2, 3)]


def test_the_png_carries_a1111_parameters_and_precast_record(bundles, tmp_path):
    from precast.runtime.manifest import read_manifest
    prompt = "a red fox, oil: painting, café ☃"
    generate(bundles["sd"], tmp_path / "p.png", "--prompt", prompt, "--negative", "blurry, dark", "--seed", "7",
             "--guidance", "6.5", "--scheduler", "dpm++2m")
    chunks = png_chunks(tmp_path / "p.png")
    p = a1111_parse(chunks["parameters"])
    source = read_manifest(bundles["sd"]).model["source_sha256"]
    assert (p["Prompt"], p["Negative prompt"]) == (prompt, "blurry, dark")
    assert (p["Steps"], p["Sampler"], p["CFG scale"], p["Seed"]) == ("2", "DPM++ 2M", "6.5", "7")
    assert (p["Size-1"], p["Size-2"], p["Model hash"], p["Model"]) == ("64", "64", source[:10], "sd")
    record = json.loads(chunks["precast"])
    assert record["settings"]["prompt"] == prompt
    assert {k: record["settings"][k] for k in ("seed", "steps", "guidance", "scheduler", "size")} == \
        {"seed": 7, "steps": 2, "guidance": 6.5, "scheduler": "dpm++2m", "size": "64x64"}
    assert record["bundle"]["name"] == "sd" and len(record["bundle"]["manifest_sha256"]) == 64
    assert record["components"]["unet"]["backend"] == "onnxruntime" and record["components"]["unet"]["device"] == "cpu"
    assert record["precast"]
    generate(bundles["flux"], tmp_path / "f.png", "--prompt", "a fox", "--seed", "3")
    f = a1111_parse(png_chunks(tmp_path / "f.png")["parameters"])
    assert (f["Sampler"], f["CFG scale"], f["Seed"], f["Negative prompt"]) == ("Euler", "1.0", "3", "")
    assert "Distilled CFG Scale" in f


def test_from_png_reruns_byte_for_byte(bundles, tmp_path):
    made = generate(bundles["sd"], tmp_path / "m.png", "--prompt", "a cat, dog", "--negative", "blurry", "--seed", "10",
                    "--batch", "2", "--guidance", "5")
    assert made["batches"] == [2]
    proc = precast("generate", "--from-png", tmp_path / "m-0002.png", "--out", tmp_path / "r.png", "--json")
    assert proc.returncode == 0, proc.stderr        # BUNDLE, steps, backends: the record's
    again = json.loads(proc.stdout)
    assert (tmp_path / "r.png").read_bytes() == (tmp_path / "m-0002.png").read_bytes()
    assert again["warnings"] == [] and again["steps"] == 2 and again["components"]["unet"]["backend"] == "onnxruntime"
    assert again["seed"] == 11 and again["guidance"] == 5 and again["negative"] == "blurry"
    generate(bundles["sd"], tmp_path / "o.png", "--from-png", tmp_path / "m-0002.png", "--seed", "10")  # overridden
    assert (tmp_path / "o.png").read_bytes() == (tmp_path / "m-0001.png").read_bytes()
    # img2img: the record names the init image by its pixels, so it is given again
    from precast.runtime.png import write_png
    write_png(tmp_path / "in.png", np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    generate(bundles["sd"], tmp_path / "i.png", "--prompt", "a cat", "--init-image", tmp_path / "in.png")
    proc = precast("generate", "--from-png", tmp_path / "i.png", "--out", tmp_path / "j.png")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [(
        f"error: --from-png {tmp_path / 'i.png'}: was made by img2img from images its record names only by their "
        "pixels' sha256; give --init-image FILE again")]
    precast("generate", "--from-png", tmp_path / "i.png", "--init-image", tmp_path / "in.png", "--out",
            tmp_path / "j.png", check=True)
    assert (tmp_path / "j.png").read_bytes() == (tmp_path / "i.png").read_bytes()


def test_from_png_without_precast_record_is_one_error(tmp_path):
    from precast.runtime.png import write_png
    pixels = np.zeros((8, 8, 3), np.uint8)
    write_png(tmp_path / "plain.png", pixels)
    write_png(tmp_path / "a1111.png", pixels, {"parameters": "a cat\nSteps: 20, Sampler: Euler, Seed: 1"})
    write_png(tmp_path / "deep.png", pixels, {"precast": "[" * 100_000 + "]" * 100_000})   # json recurses
    for name, extra in (("plain.png", ""), ("a1111.png", "it has A1111 parameters"), ("deep.png", "")):
        proc = precast("generate", "--from-png", tmp_path / name, "--out", tmp_path / "x.png")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        says = "its precast record is not JSON" if name == "deep.png" else "has no precast record"
        assert lines[0].startswith(f"error: --from-png {tmp_path / name}: {says}") and extra in lines[0], lines[0]
        assert not (tmp_path / "x.png").exists()


def test_a_text_chunk_that_inflates_to_a_gigabyte_is_one_error(tmp_path):
    """A 1 MB zTXt chunk that inflates to 1 GiB (a PNG decompression bomb) beside a precast record: refused in one
    line without inflating it (the reader stops at runtime/png.py's MAX_TEXT); a truncated stream too."""
    import struct
    import zlib

    from precast.runtime.png import png_bytes, png_text
    data = png_bytes(np.zeros((8, 8, 3), np.uint8), {"precast": "{}"})

    def with_ztxt(stream: bytes) -> bytes:
        body = b"junk\0\0" + stream
        chunk = struct.pack(">I", len(body)) + b"zTXt" + body + struct.pack(">I", zlib.crc32(b"zTXt" + body))
        return data[:-12] + chunk + data[-12:]          # before IEND
    inflater = zlib.compressobj(9)
    bomb = b"".join(inflater.compress(bytes(1 << 24)) for _ in range(64)) + inflater.flush()
    assert len(bomb) < 2 << 20
    (tmp_path / "bomb.png").write_bytes(with_ztxt(bomb))
    proc = precast("generate", "--from-png", tmp_path / "bomb.png", "--out", tmp_path / "x.png")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "damaged PNG (zTXt chunk 'junk'): its text inflates past 32 MiB" in lines[0], lines[0]
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(Exception, match="cut short"):
        png_text(with_ztxt(zlib.compress(b"a workflow")[:-3]))


def test_batch_and_count_are_checked_first(bundles, tmp_path):
    from precast.runtime.api import UserError, open_bundle
    proc = generate(bundles["sd"], tmp_path / "x.png", "--prompt", "a", "--batch", "0", check=False)
    assert proc.returncode == 2 and "--batch 0: must be a whole number from 1 to 64" in proc.stdout
    proc = generate(bundles["sd"], tmp_path / "x.png", "--prompt", "a", "--count", "-1", check=False)
    assert proc.returncode == 2 and "--count -1: must be a whole number" in proc.stdout
    pipe = open_bundle(str(bundles["sd"])).pipeline(BACKEND)
    with pytest.raises(UserError, match=r"batch='2': must be a whole number"):
        pipe.images("a", batch="2")


@pytest.mark.parametrize("settings", [{"size": 64}, {"size": [64, 64]}, {"hires": {"size": 5}}, {"hires": [1]}])
def test_a_record_with_fields_of_the_wrong_type_is_one_error(settings):
    """A --from-png record edited by hand (a size as a number or a list, hires as a list): one UserError naming the
    PNG, not a TypeError deep in the size parser."""
    from precast.runtime.api import UserError
    from precast.runtime.rerun import rerun_options
    record = {"bundle": {"path": "b"}, "settings": {"prompt": "a cat", **settings}}
    with pytest.raises(UserError, match=r"--from-png x\.png: its precast record is damaged"):
        rerun_options(record, set(), "x.png")
