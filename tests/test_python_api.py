"""The Python API for apps (runtime/api.py) on real tiny bundles (SD 1.x: the session's `tiny_bundle`;
Flux schnell: built here once): the plan is doctor's selection as data, `--backend` strings are honoured
and bad ones are one-line errors, components run on numpy feeds, txt2img gives `precast generate`'s PNG
byte for byte, the step callback and the cancel hook, the example in docs/runtime.md, and a thin import."""
import json
import re
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, build_recipe, precast
from precast.runtime.api import Cancelled, UserError, open_bundle


@pytest.fixture(scope="module")
def sd(tiny_bundle):
    return tiny_bundle[0]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux schnell bundle (ONNX Runtime, 64x64, 32 T5 tokens), built once for this module."""
    return build_recipe(tmp_path_factory.mktemp("api-flux"),
                        "model: {source: 'demo:tiny-flux-schnell'}\n"
                        "components: [text_encoder, text_encoder_2, transformer, vae_decoder]\nprecision: fp32\n"
                        "profiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\ntargets: [onnxruntime]\n")


@pytest.fixture(scope="module")
def bundles(sd, flux):
    return {"sd": sd, "flux": flux}


def read_png(data: bytes) -> np.ndarray:
    """[H, W, 3] uint8 from an 8-bit RGB PNG with filter 0 rows (what runtime/png.py writes)."""
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = size
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


# ---- the plan: doctor as data -------------------------------------------------------------------
@pytest.mark.parametrize("name, backend", [("sd", None), ("sd", "te=cpu:onnxruntime,unet=openvino"),
                                           ("flux", "te=cpu,dit=cpu:onnxruntime")])
def test_plan_lists_every_component_as_doctor_chooses_it(bundles, name, backend):
    bundle = open_bundle(bundles[name])
    report = bundle.plan(backend)
    assert list(report.components) == list(bundle.manifest.components) == list(bundle.components)
    for comp, part in report.components.items():
        assert part.device == "cpu" and part.backend in report.installed_backends and part.artifact, part
        assert part.why and part.module in part.why or "fell back" in part.why, part.why
    args = ["--backend", backend] if backend else []
    doctor = json.loads(precast("doctor", bundles[name], *args, "--json", check=True).stdout)
    assert report.size == tuple(map(int, doctor["size"].split("x")))
    for comp, want in doctor["components"].items():
        got = report.components[comp].as_dict()
        for key in ("module", "device", "device_name", "backend", "artifact", "how", "note", "passed_over", "then"):
            assert got[key] == want[key], (comp, key, got[key], want[key])
    assert report.as_dict()["assignment"] == doctor["assignment"]
    assert str(report).splitlines()[0].startswith(next(iter(report.components)))


def test_backend_strings_are_honoured(sd):
    bundle = open_bundle(sd)
    pinned = bundle.plan("te=cpu:onnxruntime,unet=openvino,vae=ort").components
    assert (pinned["text_encoder"].backend, pinned["unet"].backend, pinned["vae_decoder"].backend) == \
        ("onnxruntime", "openvino", "onnxruntime")
    assert "asked: 'cpu:onnxruntime'" in pinned["text_encoder"].why
    then = [(o.artifact == "onnx", o.backend) for o in pinned["unet"].then]   # the pinned backend's first
    assert then == [(True, "openvino"), (False, "onnxruntime"), (True, "onnxruntime")]
    absent = bundle.plan("vae=gpu7").components["vae_decoder"]   # a GPU this machine lacks: fall back, say why
    assert absent.device == "cpu" and "gpu7" in absent.why
    assert any("gpu7" in str(p) for p in absent.passed_over)
    with pytest.raises(UserError, match="gpu7.*--strict: no fallback"):
        bundle.plan("vae=gpu7", strict=True)


@pytest.mark.parametrize("call, words", [
    (lambda b: b.plan("unet=tpu0"), "unknown device 'tpu0'"),
    (lambda b: b.plan("bogus=cpu"), "unknown backend module 'bogus'"),
    (lambda b: b.plan("te=cpu:tensorrt-rtx"), "tensorrt-rtx does not run on cpu"),
    (lambda b: b.plan("unet="), "invalid backend assignment 'unet='"),
    (lambda b: b.load("vae_decoder", "vae=gpu²"), "unknown device 'gpu²'"),
    (lambda b: b.plan(size="63x64"), "multiples of 8"),
    (lambda b: b.plan(size=(64,)), "expected 'WIDTHxHEIGHT' or (width, height)"),
    (lambda b: b.load("controlnet"), "no component 'controlnet'"),
    (lambda b: b.txt2img("a cat", steps=0), "steps=0"),
    (lambda b: b.txt2img("a cat", seed=-1), "seed=-1"),
    (lambda b: b.txt2img("a cat", guidance=float("nan")), "guidance=nan"),
    (lambda b: b.txt2img("a cat", steps=1, scheduler="flow-euler"), "flow-euler"),
])
def test_bad_input_is_one_line(sd, call, words):
    with pytest.raises(UserError) as e:
        call(open_bundle(sd))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_open_refuses_a_bad_verify_and_a_folder_that_is_no_bundle(sd, tmp_path):
    with pytest.raises(UserError, match=r"verify='sometimes': expected 'auto' or 'full'"):
        open_bundle(sd, verify="sometimes")
    with pytest.raises(UserError, match="not a precast bundle"):
        open_bundle(tmp_path)
    assert open_bundle(sd, verify="full").plan().components["unet"].device == "cpu"


# ---- components -----------------------------------------------------------------------------------
def test_components_run_on_numpy_feeds(sd):
    bundle = open_bundle(sd)
    te = bundle.load("text_encoder", "te=cpu:onnxruntime")
    assert (te.plan.backend, te.plan.device) == ("onnxruntime", "cpu") and te.plan.then
    ids = np.zeros((1, 77), np.int64)      # any integer dtype: cast to the artifact's
    out = te.run({"input_ids": ids})       # token_embeddings_extra filled in (no embeddings)
    assert list(out) == list(te.outputs) == ["last_hidden_state", "pooler_output"]
    assert out["last_hidden_state"].shape == (1, 77, 64) and out["pooler_output"].shape == (1, 64)
    unet = bundle.load("unet", "unet=openvino")
    assert unet.plan.backend == "openvino"
    eps = unet({"sample": np.ones((2, 4, 8, 8), np.float32), "timestep": np.full((2,), 999, np.float32),
                "encoder_hidden_states": np.repeat(out["last_hidden_state"], 2, axis=0)})
    assert list(eps) == ["out_sample"] and eps["out_sample"].shape == (2, 4, 8, 8)
    vae = bundle.load("vae_decoder")
    assert vae({"latent_sample": np.zeros((1, 4, 8, 8), np.float32)})["sample"].shape == (1, 3, 64, 64)
    with pytest.raises(UserError, match=r"^vae_decoder: missing latent_sample; no input named latents "
                                        r"\(it takes latent_sample\)$"):
        vae.run({"latents": np.zeros((1, 4, 8, 8), np.float32)})


def test_flux_components_run_on_numpy_feeds(flux):
    bundle = open_bundle(flux)
    t5 = bundle.load("text_encoder_2")
    states = t5.run({"input_ids": np.ones((1, 32), np.int32)})["last_hidden_state"]
    assert states.shape[:2] == (1, 32)
    vae = bundle.load("vae_decoder", "vae=cpu")
    assert vae.run({"latent_sample": np.zeros((1, 16, 32, 32), np.float32)})["sample"].shape == (1, 3, 64, 64)


@pytest.mark.parametrize("demo, channels", [("tiny-flux2-klein", 32), ("tiny-qwen-image", 16)])
def test_a_bundle_of_the_vae_alone_plans_and_decodes(tmp_path, demo, channels):
    """A DiT family's bundle holding only its VAE (no transformer to read the latents' width from): doctor plans
    it, and its decoder loads and decodes latents of the VAE's own channels (a KeyError before)."""
    bundle = build_recipe(tmp_path, f"model: {{source: 'demo:{demo}'}}\ncomponents: [vae_decoder, vae_encoder]\n"
                                    "precision: fp32\nprofiles: {batch: 1, height: 64, width: 64}\n"
                                    "targets: [onnxruntime]\n")
    proc = precast("doctor", bundle)
    assert proc.returncode == 0 and "vae_decoder" in proc.stdout, proc.stderr
    api = open_bundle(bundle)
    assert set(api.plan().components) == {"vae_decoder", "vae_encoder"}
    f = 64 // (2 ** (api.manifest.components["vae_decoder"]["config"]["decoder_levels"] - 1))
    image = api.load("vae_decoder").run({"latent_sample": np.zeros((1, channels, f, f), np.float32)})["sample"]
    assert image.shape == (1, 3, 64, 64)


# ---- txt2img --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, steps, scheduler", [("sd", 3, None), ("sd", 2, "dpm++2m"), ("flux", 2, None)])
def test_txt2img_is_precast_generate(bundles, tmp_path, name, steps, scheduler):
    """Same seed, steps and scheduler: the API's PNG is the bytes `precast generate` writes."""
    out = tmp_path / "cli.png"
    extra = ["--scheduler", scheduler] if scheduler else []
    precast("generate", bundles[name], "--prompt", "a red fox in the snow", "--steps", steps, "--seed", 7,
            "--out", out, *extra, check=True)
    image = open_bundle(bundles[name]).txt2img("a red fox in the snow", steps=steps, seed=7, scheduler=scheduler)
    assert image.pixels.dtype == np.float32 and image.pixels.shape == (64, 64, 3) and image.size == (64, 64)
    assert 0.0 <= image.pixels.min() and image.pixels.max() <= 1.0 and image.pixels.std() > 0
    assert image.png() == out.read_bytes()
    np.testing.assert_array_equal(read_png(image.png()), image.to_uint8())
    assert (image.steps, image.seed) == (steps, 7)
    assert image.scheduler == (scheduler or ("flow-euler" if name == "flux" else "euler"))
    saved = image.save(tmp_path / "api.png")
    assert saved.read_bytes() == out.read_bytes()


def test_the_denoisers_blob_pages_are_dropped_before_decoding_and_images_stay_the_same(sd, monkeypatch):
    """OpenVINO: after the denoising loop the UNet's session gives back the blob pages it reads in place (trim),
    the VAE decoder's does not; a second image on the same pipeline (its UNet reading them again from the page
    cache) is the first one byte for byte, as is an image from a pipeline that never trims."""
    from precast.runtime.sessions import OpenVinoSession
    pipe = open_bundle(sd).pipeline("all=openvino")
    trimmed, real = [], OpenVinoSession.trim
    monkeypatch.setattr(OpenVinoSession, "trim", lambda self: trimmed.append(self) or real(self))
    first = pipe("a cat", steps=3, seed=5)
    loaded = pipe.pipe.loaded
    assert loaded["unet"].session in trimmed and loaded["vae_decoder"].session not in trimmed
    assert loaded["unet"].session.trim() and not loaded["vae_decoder"].session in trimmed[1:]
    assert pipe("a cat", steps=3, seed=5).png() == first.png()
    monkeypatch.setattr(OpenVinoSession, "trim", lambda self: False)
    assert open_bundle(sd).pipeline("all=openvino")("a cat", steps=3, seed=5).png() == first.png()


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_progress_callback_once_per_step(bundles, name):
    calls = []
    pipe = open_bundle(bundles[name]).pipeline()
    pipe("a cat", steps=4, on_step=lambda i, n: calls.append((i, n)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert "denoising" not in vars(pipe.pipe)        # the hook is gone after the call
    report = pipe.report
    assert list(report.components) == list(pipe.pipe.needed)
    assert all(p.device == "cpu" and p.why for p in report.components.values())


@pytest.mark.parametrize("name", ["sd", "flux"])
@pytest.mark.parametrize("kind", ["callable", "event"])
def test_cancel_after_step_one_stops_early(bundles, name, kind):
    pipe = open_bundle(bundles[name]).pipeline()
    calls = []
    event = threading.Event()
    if kind == "event":
        cancel, on_step = event, lambda i, n: (calls.append(i), event.set())
    else:
        cancel, on_step = (lambda: len(calls) >= 1), calls.append
    with pytest.raises(Cancelled, match=r"^cancelled after step 1 of 5") as e:
        pipe("a cat", steps=5, seed=3, on_step=on_step if kind == "event" else lambda i, n: on_step(i), cancel=cancel)
    assert (e.value.step, e.value.total) == (1, 5) and calls == [1]
    assert "decode" not in pipe.pipe.run_stages and "denoise" not in pipe.pipe.run_stages   # no more steps, no decode
    assert not isinstance(e.value, UserError)
    # the pipeline is whole afterwards: the next call is the uncancelled image
    again = pipe("a cat", steps=5, seed=3)
    assert again.png() == open_bundle(bundles[name]).txt2img("a cat", steps=5, seed=3).png()


def test_cancel_before_the_first_step_and_a_bad_hook(sd):
    pipe = open_bundle(sd).pipeline()
    with pytest.raises(Cancelled, match="after step 0 of 2"):
        pipe("a cat", steps=2, cancel=lambda: True)
    with pytest.raises(UserError, match="threading.Event"):
        pipe("a cat", steps=2, cancel="stop")


# ---- the documented example, and a thin import -----------------------------------------------------
EXAMPLE = '''
import threading

import numpy as np

from precast.runtime.api import Cancelled, UserError, open_bundle

bundle = open_bundle("build/demo/bundle", verify="auto")    # verify="full": hash every file again

# What would run where, and why (`precast doctor` as data); nothing is loaded yet.
report = bundle.plan("te=cpu,unet=gpu0")                     # no GPU here: unet falls back, with the reason
for name, part in report.components.items():
    print(f"{name}: {part.artifact} via {part.backend} on {part.device}: {part.why}")

# One component, numpy in and out.
vae = bundle.load("vae_decoder", "vae=cpu:onnxruntime")
out = vae.run({"latent_sample": np.zeros((1, 4, 8, 8), np.float32)})
print({k: v.shape for k, v in out.items()})                 # {'sample': (1, 3, 64, 64)}

# Text to image in one call, with progress; the same image as `precast generate --seed 1 --steps 4`.
image = bundle.txt2img("a photo of a cat", steps=4, seed=1, on_step=lambda i, n: print(f"step {i}/{n}"))
image.save("build/demo/api-cat.png")                         # image.png(): bytes; image.pixels: HxWx3 in [0, 1]

# Cancel from anywhere (a UI's button): set the event; the run stops before its next step.
stop = threading.Event()
try:
    bundle.txt2img("a photo of a cat", steps=4, on_step=lambda i, n: stop.set(), cancel=stop)
except Cancelled as e:
    print(e)                                                 # cancelled after step 1 of 4 (...)

try:
    bundle.plan("unet=tpu0")
except UserError as e:
    print(f"error: {e}")                                     # error: --backend unet=tpu0: unknown device 'tpu0' (...)
'''


def _run_example(code: str, bundle: Path, tmp_path: Path) -> None:
    """Runs the example as a script, in a folder where `make demo`'s bundle path is the tiny bundle."""
    (tmp_path / "build" / "demo").mkdir(parents=True)
    (tmp_path / "build" / "demo" / "bundle").symlink_to(bundle)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:3]] == ["text_encoder", "unet", "vae_decoder"]
    assert "{'sample': (1, 3, 64, 64)}" in lines and "step 4/4" in lines
    assert any(ln.startswith("cancelled after step 1 of 4") for ln in lines)
    assert lines[-1].startswith("error: --backend unet=tpu0: unknown device 'tpu0'")
    assert (tmp_path / "build" / "demo" / "api-cat.png").read_bytes()[:4] == b"\x89PNG"


def test_the_example_runs(sd, tmp_path):
    _run_example(EXAMPLE, sd, tmp_path)


def test_the_documented_example_runs(sd, tmp_path):
    """The example of docs/runtime.md's Python API section (where the README sends apps) runs as written."""
    doc = Path(ROOT, "docs", "runtime.md").read_text()
    section = doc.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "docs/runtime.md's Python API section holds one python block"
    _run_example(blocks[0], sd, tmp_path)


THIN = ("precast.compiler", "onnx", "torch", "diffusers", "transformers")


def test_the_api_imports_only_the_runtime(sd):
    """Importing the API and generating through it loads none of the compiler, onnx, torch, diffusers or
    transformers; `precast.runtime` re-exports the API lazily (the CLI does not load it)."""
    code = ("import sys\nimport precast.runtime.api\n"
            f"loaded = [m for m in {THIN!r} if m in sys.modules]\n"
            "from precast.runtime import open_bundle\n"
            f"open_bundle({str(sd)!r}).txt2img('a cat', steps=1)\n"
            f"print(loaded, [m for m in {THIN!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[] []", proc.stdout
    cli = subprocess.run([sys.executable, "-c", "import sys, precast.runtime.cli\n"
                          "print('precast.runtime.api' in sys.modules)"], capture_output=True, text=True)
    assert cli.stdout.strip() == "False", cli.stderr
