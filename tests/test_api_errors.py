"""Every public entry point of the Python API (runtime/api.py) given wrong types and values, on the real
tiny bundle: each is one UserError line naming the keyword (and the fix) before anything loads or is
written, in `precast generate`'s words for the same mistake (runtime/checks.py holds both's checks)."""
import math
import os

import numpy as np
import pytest

from conftest import precast
from precast.runtime.api import UserError, open_bundle

PX = np.zeros((64, 64, 3), np.uint8)


@pytest.fixture(scope="module")
def api(tiny_bundle):
    """The bundle opened, one image made (for save) and the VAE decoder loaded (for run)."""
    bundle = open_bundle(tiny_bundle[0])
    return bundle, bundle.txt2img("a cat", steps=1), bundle.load("vae_decoder", "vae=cpu:onnxruntime")


def _tree(*roots) -> dict:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for root in roots for d, _, files in os.walk(root) for f in files}


# (call(bundle, image, vae, work folder), what the one line must hold: the keyword first)
CASES = {
    "steps str": (lambda b, i, v, w: b.txt2img("a", steps="10"), "steps='10'", "whole number from 1 to 1000"),
    "steps bool": (lambda b, i, v, w: b.txt2img("a", steps=True), "steps=True", "whole number"),
    "steps float": (lambda b, i, v, w: b.txt2img("a", steps=2.5), "steps=2.5", "whole number"),
    "steps 0": (lambda b, i, v, w: b.txt2img("a", steps=0), "steps=0", "1 to 1000"),
    "steps pipeline": (lambda b, i, v, w: b.pipeline()("a", steps="2"), "steps='2'", "whole number"),
    "seed str": (lambda b, i, v, w: b.txt2img("a", steps=1, seed="1"), "seed='1'", "0 or more"),
    "seed None": (lambda b, i, v, w: b.txt2img("a", steps=1, seed=None), "seed=None", "whole number"),
    "seed float": (lambda b, i, v, w: b.txt2img("a", steps=1, seed=1.5), "seed=1.5", "whole number"),
    "guidance str": (lambda b, i, v, w: b.txt2img("a", steps=1, guidance="7"), "guidance='7'", "finite number, e.g. 7.5"),
    "guidance bool": (lambda b, i, v, w: b.txt2img("a", steps=1, guidance=True), "guidance=True", "finite number"),
    "guidance inf": (lambda b, i, v, w: b.txt2img("a", steps=1, guidance=math.inf), "guidance=inf", "finite number"),
    "guidance huge": (lambda b, i, v, w: b.txt2img("a", steps=1, guidance=-1e308), "guidance=-1e+308",
                      "from -1000 to 1000"),       # was an all-NaN image (fp32 overflow), silently
    "sysroot int": (lambda b, i, v, w: open_bundle(b.path, sysroot=5), "sysroot=5", "expected a folder"),
    "negative 1 MB": (lambda b, i, v, w: b.txt2img("a", steps=1, negative=b"x" * 10 ** 6), "negative=b'xxx",
                      "(1000003 characters)"),     # the value cut, not echoed back whole
    "scheduler int": (lambda b, i, v, w: b.txt2img("a", steps=1, scheduler=3), "scheduler=3", "euler, euler-a, heun"),
    "scheduler unknown": (lambda b, i, v, w: b.txt2img("a", steps=1, scheduler="ddim9"), "scheduler='ddim9'",
                          "choose one of"),
    "scheduler of flux": (lambda b, i, v, w: b.txt2img("a", steps=1, scheduler="flow-euler"),
                          "scheduler='flow-euler'", "take euler, euler-a, heun"),
    "prompt None": (lambda b, i, v, w: b.txt2img(None, steps=1), "prompt=None", "expected text"),
    "prompt surrogate": (lambda b, i, v, w: b.txt2img("a\udc80", steps=1), "prompt=", "UTF-8"),
    "negative bytes": (lambda b, i, v, w: b.txt2img("a", negative=b"x", steps=1), "negative=b'x'", "expected text"),
    "on_step": (lambda b, i, v, w: b.txt2img("a", steps=1, on_step=3), "on_step=3", "callable"),
    "cancel": (lambda b, i, v, w: b.txt2img("a", steps=1, cancel="stop"), "cancel='stop'", "threading.Event"),
    "size text": (lambda b, i, v, w: b.txt2img("a", steps=1, size="63x64"), "size='63x64'", "multiples of 8"),
    "size float": (lambda b, i, v, w: b.plan(size=(64.5, 64)), "size=(64.5, 64)", "whole pixels"),
    "size negative": (lambda b, i, v, w: b.plan(size=(-64, 64)), "size=(-64, 64)", "8 to 4096 px"),
    "size str pair": (lambda b, i, v, w: b.plan(size=("64", "64")), "size=('64', '64')", "(width, height)"),
    "size int": (lambda b, i, v, w: b.load("unet", size=64), "size=64", "(width, height)"),
    "backend int": (lambda b, i, v, w: b.plan(5), "backend=5", "--backend grammar"),
    "params_backend list": (lambda b, i, v, w: b.txt2img("a", steps=1, params_backend=["cpu"]), "params_backend=",
                            "--backend grammar"),
    "backend unknown": (lambda b, i, v, w: b.plan("unet=cuda:foo"), "--backend unet=cuda:foo",
                        "unknown backend 'foo' in 'cuda:foo'"),
    "controls str": (lambda b, i, v, w: b.txt2img("a", steps=1, controls="canny"), "controls=", "list of"),
    "controls scale": (lambda b, i, v, w: b.txt2img("a", steps=1, controls=[("canny", PX, "x")]),
                       "controls[0] scale='x'", "finite number"),
    "controls net": (lambda b, i, v, w: b.txt2img("a", steps=1, controls=[("canny", PX)]), "controls[0] name='canny'",
                     "not in the bundle (it has no ControlNet; rebuild it with `controlnets:`"),
    "controls range": (lambda b, i, v, w: b.txt2img("a", steps=1, controls=[("canny", PX, 1.0, 0.9, 0.2)]),
                       "controls[0] start=0.9, end=0.2", "0 <= start < end <= 1"),
    "controls shape": (lambda b, i, v, w: b.txt2img("a", steps=1, controls=[("canny", PX, 1.0, 0.2)]), "controls[0]",
                       "got 4 items"),
    "controls name": (lambda b, i, v, w: b.txt2img("a", steps=1, controls=[(3, PX)]), "controls[0]", "(a str"),
    "controls image": (lambda b, i, v, w: b.txt2img("a", steps=1, controls=[("canny", w / "none.png")]),
                       "controls[0] image", "no such file"),
    "guess_mode": (lambda b, i, v, w: b.txt2img("a", steps=1, guess_mode=True), "guess_mode=True", "give controls"),
    "controlnets str": (lambda b, i, v, w: b.pipeline(controlnets="canny"), "controlnets='canny'", "['canny']"),
    "controlnets unknown": (lambda b, i, v, w: b.pipeline(controlnets=["canny"]), "controlnets='canny'",
                            "not in the bundle"),
    "init_image None": (lambda b, i, v, w: b.img2img("a", None), "init_image", "PNG path"),
    "init_image missing": (lambda b, i, v, w: b.img2img("a", w / "none.png"), "init_image", "no such file"),
    "init_image folder": (lambda b, i, v, w: b.img2img("a", w), "init_image", "not a file"),
    "init_image shape": (lambda b, i, v, w: b.img2img("a", np.zeros(64, np.uint8)), "init_image", "shape (64,)"),
    "init_image float": (lambda b, i, v, w: b.img2img("a", PX.astype(np.float32)), "init_image", "uint8"),
    "strength str": (lambda b, i, v, w: b.img2img("a", PX, strength="0.5"), "strength='0.5'", "finite number"),
    "strength nan": (lambda b, i, v, w: b.img2img("a", PX, strength=math.nan), "strength=nan", "finite number"),
    "strength 0": (lambda b, i, v, w: b.img2img("a", PX, strength=0), "strength=0", "more than 0 and at most 1"),
    "mask None": (lambda b, i, v, w: b.inpaint("a", PX, None), "mask=", "needs a mask"),
    "mask size": (lambda b, i, v, w: b.inpaint("a", PX, np.zeros((32, 32), np.uint8)), "mask", "init image's size"),
    "open None": (lambda b, i, v, w: open_bundle(None), "path=None", "bundle's folder"),
    "open verify": (lambda b, i, v, w: open_bundle(b.path, verify="x"), "verify='x'", "'auto' or 'full'"),
    "load list": (lambda b, i, v, w: b.load(["unet"]), "no component ['unet']", "it has text_encoder"),
    "run list": (lambda b, i, v, w: v.run([1]), "feeds=list", "dict of input name"),
    "run shape": (lambda b, i, v, w: v.run({"latent_sample": np.zeros((1, 3, 8, 8), np.float32)}),
                  "feeds['latent_sample'] has shape [1, 3, 8, 8]", "takes [1, 4, 8, 8]"),
    "run rank": (lambda b, i, v, w: v.run({"latent_sample": np.zeros((4, 8, 8), np.float32)}),
                 "feeds['latent_sample'] has shape [4, 8, 8]", "takes ["),
    "run None": (lambda b, i, v, w: v.run({"latent_sample": None}), "feeds['latent_sample']", "numeric"),
    "run name": (lambda b, i, v, w: v.run({"latent": np.zeros((1, 4, 8, 8), np.float32)}), "no input named latent",
                 "it takes latent_sample"),
    "save no folder": (lambda b, i, v, w: i.save(w / "missing" / "x.png"), "path=", "does not exist; create it first"),
    "save jpg": (lambda b, i, v, w: i.save(w / "x.jpg"), "path=", "precast writes PNG images; give a path ending in .png"),
    "save folder": (lambda b, i, v, w: i.save(w), "path=", "is a folder"),
    "save None": (lambda b, i, v, w: i.save(None), "path=None", "file path"),
}


@pytest.mark.parametrize("name", CASES)
def test_wrong_argument_is_one_line_naming_the_keyword_and_nothing_is_written(api, tiny_bundle, tmp_path,
                                                                            monkeypatch, name):
    call, keyword, fix = CASES[name]
    bundle, image, vae = api
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path, tiny_bundle[0])
    with pytest.raises(UserError) as e:
        call(bundle, image, vae, work)
    line = str(e.value)
    assert "\n" not in line and keyword in line and fix in line, line
    assert not line.startswith("--") or keyword.startswith("--"), line      # an API keyword, not a CLI option
    assert _tree(tmp_path, tiny_bundle[0]) == before, name                  # no temp file, no partial write


def test_the_api_and_generate_say_the_same_for_the_same_mistake(api, tiny_bundle, tmp_path):
    """The words after the setting's name are one function's (runtime/checks.py), from both sides."""
    bundle, image, _ = api
    cases = [(["--steps", "0"], lambda: bundle.txt2img("a", steps=0)),
             (["--seed", "-1"], lambda: bundle.txt2img("a", seed=-1)),
             (["--guidance", "nan"], lambda: bundle.txt2img("a", guidance=math.nan)),
             (["--scheduler", "flow-euler"], lambda: bundle.txt2img("a", scheduler="flow-euler")),
             (["--size", "64x63"], lambda: bundle.txt2img("a", size="64x63")),
             (["--out", tmp_path / "x.jpg"], lambda: image.save(tmp_path / "x.jpg")),
             (["--out", tmp_path / "no" / "x.png"], lambda: image.save(tmp_path / "no" / "x.png"))]
    for args, call in cases:
        out = [] if args[0] == "--out" else ["--out", tmp_path / "x.png"]
        proc = precast("generate", tiny_bundle[0], "--prompt", "a", *out, *args)
        (cli,) = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and cli.startswith(f"error: {args[0]} "), proc.stderr
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value).split(": ", 1)[1] == cli.split(": ", 2)[2], (cli, str(e.value))
    assert os.listdir(tmp_path) == []
